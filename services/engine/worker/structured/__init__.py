"""Structured outputs: grammar compilation (xgrammar), per-request matchers, the per-step token bitmask."""
