"""Tests of services.prefill: the lease connector and the handshake route."""
