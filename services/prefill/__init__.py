"""The prefill role: what a prefill engine does differently from an aggregated one.

- ``services.engine.kv_transfer.lease_connector.LeaseConnector`` (shared with a draining decode): a finished ``do_remote_decode`` request keeps its prompt's full
  blocks under a lease and answers ``kv_transfer_params`` naming them (engine id, host/port, block ids,
  hashes); the blocks are freed when decode's NIXL READ notifies us, when decode says it will not
  read them, or when the lease expires (counted as ``lease_unread``).
- ``services.engine.entrypoints.handshake.handshake_router`` (every engine with a NIXL agent): ``GET /kv/handshake`` serves this engine's NIXL agent metadata.
- ``role.PrefillRole``: composes them with the kvstore offload for ``kvferry serve --role prefill``;
  a request asking this engine for ``do_remote_prefill`` is refused (400).
"""
