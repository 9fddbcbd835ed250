"""Maintenance scripts of the repository (not part of the kvferry distribution)."""
