"""Executors: how the engine core runs its model, in process (one device) or over tensor-parallel ranks."""
