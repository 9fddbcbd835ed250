"""KV transfer: the NIXL agent over the KV cache, the kvstore tier and its connector, the context connectors are built from."""
