"""Torch-free engine bookkeeping: requests, sampling params, config, block pool, KV cache manager, scheduler, the KV-connector port."""
