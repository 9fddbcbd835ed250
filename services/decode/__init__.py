"""The decode role: what a decode engine does differently from an aggregated one.

- ``services.engine.entrypoints.pull_admission.PullAdmission`` (shared with aggregated engines): a
  request's ``kv_transfer_params`` (``do_remote_prefill``, from the prefill engine's answer) are validated, and prefill's NIXL agent is loaded with one handshake over
  HTTP before the request is queued; an unreachable or restarted prefill is counted and the request is
  served as a local one. Engines that disagree on KV layout refuse it (409).
- ``services.engine.kv_transfer.pull_connector.PullConnector`` (shared too): after the local prefix
  hit, the request's blocks past it are allocated and READ from prefill with NIXL (WAITING_FOR_REMOTE_KV meanwhile); a hash mismatch, an
  expired lease or a failed read is counted by reason, and the prompt comes from the kvstore or is
  recomputed; leases decode will not read are released at once.
- ``role.DecodeRole``: composes them with the kvstore fetch (no offload) for ``kvferry serve --role decode``.
"""
