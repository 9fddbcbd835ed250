"""KV wire contracts: block hashes, KV events, the prefix index, KV transfer, the kvstore client and its proto."""
