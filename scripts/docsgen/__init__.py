"""Generators of the documentation's reference pages (CLI, CRD, metrics, benchmark tables)."""
