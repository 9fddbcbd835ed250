"""Tests of services.engine.kv_transfer: NIXL transfers between real agents, the kvstore arena over NIXL."""
