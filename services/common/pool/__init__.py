"""Pool contracts: pod labels, roles, the pool secret and the engine load report."""
