"""The `kvferry` console script: one sub-command per deployable, each registered lazily."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# (name, "module:function that adds the sub-parser", help). Modules import only when chosen, so
# `kvferry router` never imports torch.
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("serve", "services.serve_cli:add_parser", "run an engine server (OpenAI API)"),
    ("router", "services.router.cli:add_parser", "run the cache-aware router"),
    ("kvstore", "services.kvstore.cli:add_parser", "run the host-memory KV block store"),
    ("operator", "pool_operator.cli:add_operator_parser", "run the InferencePool operator"),
    ("up", "services.up_cli:add_parser", "start a local stack (Redis, kvstore, engines, router)"),
    ("render", "pool_operator.cli:add_render_parser", "print the manifests of an InferencePool"),
    ("bench", "services.bench.cli:add_parser", "benchmarks and load generation"),
    ("sim", "services.sim.cli:add_parser", "simulate a pool (real router and autoscaler, simulated engines)"),
)


def _available(target: str) -> bool:
    module = target.split(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Build the top-level parser; only the chosen sub-command's module is imported."""
    parser = argparse.ArgumentParser(prog="kvferry", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, target, help_text in SUBCOMMANDS:
        if name == chosen and _available(target):
            module, func = target.split(":")
            getattr(importlib.import_module(module), func)(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["router", "calibrate"]:  # a tool beside the router, with flags of its own
        from services.router.sessions.calibrate_cli import main as calibrate

        return calibrate(argv[2:])
    if argv[:2] == ["sim", "calibrate"]:  # fits a timing model from a real engine, flags of its own
        from services.sim.calibrate_cli import main as sim_calibrate

        return sim_calibrate(argv[2:])
    if next((a for a in argv if not a.startswith("-")), None) == "serve":
        from services.engine.cpu_runtime import exec_with_runtime

        exec_with_runtime(argv)  # once, before torch loads: Intel OpenMP + tcmalloc where installed
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        if args.command:
            parser.error(f"sub-command {args.command!r} is not available in this installation")
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
