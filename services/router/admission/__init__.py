"""Admission in the router: tenants, priority bands, the fair flow-control queue, the saturation gate, quotas."""
