"""`kvferry render` and `kvferry operator`: the sub-commands of the pool operator."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from pool_operator.images import ImageSet
from pool_operator.pool_secret import new_token
from pool_operator.poolfile import PoolFileError, load_pools
from pool_operator.render import PoolRenderer


def render_command(args: argparse.Namespace) -> int:
    """Print every manifest of the pools in args.file as one multi-document YAML stream."""
    try:
        pools = load_pools(Path(args.file))
    except PoolFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    images = ImageSet(args.registry, args.version or "")
    documents = []
    for pool in pools:
        if args.namespace:
            pool = pool.model_copy(
                update={"metadata": pool.metadata.model_copy(update={"namespace": args.namespace})}
            )
        renderer = PoolRenderer(pool, images)
        documents += [renderer.pool_secret(new_token()), *renderer.render()]
    sys.stdout.write(yaml.safe_dump_all(documents, sort_keys=False, width=120))
    print(
        "kvferry render: each pool's Secret holds a NEW random side-channel token on every run: create it "
        "once (kubectl create), and drop it from later renders, or the pods started before and after a "
        "re-apply disagree (their KV hand-offs fail and are recomputed) until they restart",
        file=sys.stderr,
    )
    return 0


def add_render_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `kvferry render POOL.yaml`."""
    parser = subparsers.add_parser(
        "render",
        help="print the manifests of an InferencePool",
        description="Print the Kubernetes manifests an InferencePool owns "
        "(for GitOps review, or to deploy without the operator).",
    )
    parser.add_argument("file", help="YAML file with one or more InferencePool documents")
    parser.add_argument("--namespace", "-n", help="override metadata.namespace")
    parser.add_argument(
        "--registry", default=ImageSet().registry, help="image registry (default: %(default)s)"
    )
    parser.add_argument("--version", help="image tag (default: this kvferry's version)")
    parser.set_defaults(func=render_command)
    return parser


def operator_command(args: argparse.Namespace) -> int:
    """Run the kopf operator until interrupted."""
    from pool_operator.config import OperatorConfig
    from pool_operator.handlers import run_operator

    try:
        config = OperatorConfig.from_env(
            namespaces=tuple(args.namespace) if args.namespace else None,
            status_interval=args.status_interval,
            autoscale_interval=args.autoscale_interval,
            metrics_port=args.metrics_port,
            liveness_port=args.liveness_port,
            standalone=False if args.peering else None,
            allow_host_path_models=args.allow_host_path_models,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    run_operator(config, verbose=args.verbose)
    return 0


def add_operator_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `kvferry operator`."""
    parser = subparsers.add_parser(
        "operator",
        help="run the InferencePool operator",
        description="Run the kopf operator that turns InferencePools into pods. "
        "Credentials: in-cluster service account, else $KUBECONFIG.",
    )
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    parser.add_argument("--status-interval", type=float, help="seconds between status refreshes")
    parser.add_argument("--autoscale-interval", type=float, help="seconds between autoscaling decisions")
    parser.add_argument("--metrics-port", type=int, help="port of the operator's /metrics (0: off)")
    parser.add_argument("--liveness-port", type=int, help="port of /healthz (0: off)")
    parser.add_argument(
        "--allow-host-path-models",
        action="store_true",
        default=None,
        help="serve pools with spec.model.source.hostPath (off by default: it mounts a node folder)",
    )
    parser.add_argument("--peering", action="store_true", help="use kopf peering (several replicas)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.set_defaults(func=operator_command)
    return parser
