"""Tests of services.engine.core: block pool, KV cache manager, scheduler, the connector port."""
