"""Speculative decoding in the runner: proposers (n-gram, draft model), the acceptance rule, the gate."""
