"""``kvferry serve``'s composition root: the engine's CLI with the role packages plugged in per ``--role``.

Above the engine and the role packages (like ``up_cli``): the engine never imports ``services.prefill``
or ``services.decode``; this module hands it one factory per role.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import MappingProxyType

from services.common.kv.kv_transfer import DEFAULT_LEASE_S
from services.engine.entrypoints import cli as engine_cli
from services.engine.entrypoints.role import AggregatedRole, EngineRole
from services.engine.kv_transfer.lease_connector import LeaseSettings


def _prefill(args: argparse.Namespace) -> EngineRole:
    from services.prefill.role import PrefillRole, PrefillSettings

    _generative(args)
    return PrefillRole(PrefillSettings(**_lease(args).model_dump()))


def _lease(args: argparse.Namespace) -> LeaseSettings:
    """Where peers reach this engine's leased blocks (prefill's prompts, a draining engine's streams)."""
    url = engine_cli.advertised_url(args.host, args.port, args.advertise_url)
    host = url.removeprefix("http://").rsplit(":", 1)[0]
    lease = DEFAULT_LEASE_S if args.kv_lease is None else args.kv_lease
    return LeaseSettings(host=host, port=args.port, lease_s=lease)


def _generative(args: argparse.Namespace) -> None:
    if args.task == "embed":
        raise ValueError(f"--task embed: embedding engines run as --role both (not --role {args.role})")


def _decode(args: argparse.Namespace) -> EngineRole:
    from services.decode.role import DecodeRole

    _generative(args)
    return DecodeRole(_lease(args))


def _aggregated(args: argparse.Namespace) -> EngineRole:
    if args.task == "embed":  # nothing streams: no KV to move, no NIXL agent to register
        if args.kv_lease is not None:
            raise ValueError("--kv-lease: an embedding engine (--task embed) leases no KV")
        return AggregatedRole()
    return AggregatedRole(_lease(args))  # a NIXL agent (unless --no-nixl): drained streams move with their KV


ROLE_FACTORIES: Mapping[str, engine_cli.RoleFactory] = MappingProxyType(
    {"both": _aggregated, "prefill": _prefill, "decode": _decode}
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``kvferry`` parser."""
    return engine_cli.add_parser(subparsers, ROLE_FACTORIES)
