"""Routing accuracy: the index's predicted cached tokens against what the engines report."""
