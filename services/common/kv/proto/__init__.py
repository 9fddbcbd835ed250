"""gRPC contracts (.proto) and their generated, committed stubs (regenerate with `python -m services.common.kv.proto.gen`)."""
