"""The kvstore service: host-memory KV block store behind gRPC (`kvferry kvstore`)."""
