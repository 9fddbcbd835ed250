"""OperatorRegistry wiring: the kopf handlers of InferencePool (reconcile, status, autoscale, teardown)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import kopf
from prometheus_client import CollectorRegistry, start_http_server

from pool_operator.autoscaler import Autoscaler, AutoscalerMetrics, AutoscaleState
from pool_operator.config import OperatorConfig
from pool_operator.kubeclient import KubeApiError, KubeClient
from pool_operator.models import GROUP, PLURAL, VERSION, InferencePool
from pool_operator.naming import PoolNames
from pool_operator.poolfile import PoolFileError, parse_pool
from pool_operator.reconciler import MissingKindError, Reconciler, SpecConflictError
from pool_operator.status import StatusBuilder, set_condition, utc_now

RESOURCE = (GROUP, VERSION, PLURAL)
ANNOTATION_PREFIX = "kvferry.dev"
TRANSIENT = (aiohttp.ClientError, KubeApiError, TimeoutError)


def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _degrade(body: kopf.Body, patch: kopf.Patch, reason: str, message: str, logger: Any) -> None:
    """Record a problem in status instead of crashing: Degraded=True, phase Degraded."""
    status = dict(body.get("status") or {})
    generation = body.get("metadata", {}).get("generation")
    conditions = set_condition(
        list(status.get("conditions", [])), "Degraded", True, reason, message, generation, utc_now()
    )
    patch.status["conditions"] = conditions
    patch.status["phase"] = "Degraded"
    patch.status["observedGeneration"] = generation
    logger.error(f"pool degraded ({reason}): {message}")


def _parse(body: kopf.Body, patch: kopf.Patch, logger: Any) -> InferencePool | None:
    try:
        return parse_pool(
            dict(body), f"{body.get('metadata', {}).get('namespace')}/{body.get('metadata', {}).get('name')}"
        )
    except PoolFileError as error:
        _degrade(body, patch, "InvalidSpec", "; ".join(error.problems), logger)
        return None


async def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """create/update/resume: apply what changed, prune the rest, report Progressing."""
    pool = _parse(body, patch, logger)
    if pool is None:
        return
    try:
        result = await memo.reconciler.reconcile(pool, logger)
    except SpecConflictError as error:
        _degrade(body, patch, "SpecConflict", str(error), logger)
        return
    except MissingKindError as error:  # retried: the CRDs may be installed later
        _degrade(body, patch, error.reason, str(error), logger)
        raise kopf.TemporaryError(str(error), delay=memo.reconciler.config.retry_delay) from error
    except TRANSIENT as error:
        _degrade(body, patch, "ApplyFailed", str(error), logger)
        raise kopf.TemporaryError(str(error), delay=memo.reconciler.config.retry_delay) from error
    now, generation = utc_now(), pool.metadata.generation
    conditions = list((body.get("status") or {}).get("conditions", []))
    conditions = set_condition(conditions, "Degraded", False, "Reconciled", result.summary(), generation, now)
    if result.applied or result.pruned:
        conditions = set_condition(
            conditions, "Progressing", True, "Applied", result.summary(), generation, now
        )
    patch.status["conditions"] = conditions
    patch.status["observedGeneration"] = generation
    patch.status["phase"] = StatusBuilder.phase(conditions, True)


async def refresh_status(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Timer: recompute roles, Ready/Progressing/ConfigConsistent and phase from the Deployments."""
    try:
        pool = parse_pool(dict(body))
    except PoolFileError:
        return  # reconcile already reported it as Degraded
    names = PoolNames(pool.metadata.name, pool.metadata.namespace)
    try:
        deployments = await memo.client.list("Deployment", names.namespace, names.pool_selector_string())
    except TRANSIENT as error:
        logger.warning(f"status refresh skipped, will retry: {error}")
        return
    previous = dict(body.get("status") or {})
    status = StatusBuilder(pool, previous).build({d["metadata"]["name"]: d for d in deployments})
    changed = {k: v for k, v in status.items() if previous.get(k) != v}
    if changed:
        patch.status.update(changed)


async def autoscale(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Timer: one autoscaling tick for pools that declare spec.autoscaling."""
    try:
        pool = parse_pool(dict(body))
    except PoolFileError:
        return
    if pool.spec.autoscaling is None:
        return
    state = memo.setdefault("autoscale_state", AutoscaleState())

    def post(reason: str, message: str) -> None:
        kopf.info(body, reason=reason, message=message)

    try:
        changed = await memo.autoscaler.tick(pool, state, post, logger)
    except TRANSIENT as error:
        logger.warning(f"autoscaling tick skipped, will retry: {error}")
        return
    for role in changed:
        key = "decode" if role == "engine" else role
        patch.status[key] = {"lastScaleTime": utc_now()}


async def teardown(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """delete: remove every child now, then let the finalizer go."""
    meta = body.get("metadata", {})
    deleted = await memo.reconciler.teardown(PoolNames(meta.get("name"), meta.get("namespace")))
    logger.info(f"deleted {len(deleted)} children: {', '.join(deleted) or '-'}")


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    """A fresh kopf registry with every handler (explicit ids) bound to this config."""
    registry = kopf.OperatorRegistry()

    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        settings.posting.level = logging.INFO
        info = _login(settings=settings, logger=logger)
        if info is None:
            raise kopf.PermanentError("no Kubernetes credentials: no service account and no kubeconfig")
        memo.client = KubeClient.from_connection(info)
        memo.reconciler = Reconciler(memo.client, config)
        metrics_registry = CollectorRegistry()
        memo.autoscaler = Autoscaler(memo.client, config, AutoscalerMetrics(metrics_registry))
        if config.metrics_port:
            start_http_server(config.metrics_port, registry=metrics_registry)

    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        if "client" in memo:
            await memo.client.close()

    kopf.on.login(registry=registry, id="login")(_login)
    kopf.on.startup(registry=registry, id="startup")(startup)
    kopf.on.cleanup(registry=registry, id="cleanup")(cleanup)
    kopf.on.create(*RESOURCE, registry=registry, id="reconcile-create")(reconcile)
    kopf.on.update(*RESOURCE, registry=registry, id="reconcile-update", field="spec")(reconcile)
    kopf.on.resume(*RESOURCE, registry=registry, id="reconcile-resume")(reconcile)
    kopf.on.delete(*RESOURCE, registry=registry, id="teardown")(teardown)
    kopf.timer(
        *RESOURCE,
        registry=registry,
        id="refresh-status",
        interval=config.status_interval,
        initial_delay=min(1.0, config.status_interval),
    )(refresh_status)
    kopf.timer(
        *RESOURCE,
        registry=registry,
        id="autoscale",
        interval=config.autoscale_interval,
        initial_delay=config.autoscale_interval,
    )(autoscale)
    return registry


def run_operator(config: OperatorConfig, verbose: bool = False) -> None:
    """Run until SIGINT/SIGTERM."""
    kopf.configure(verbose=verbose, log_prefix=True)
    liveness = f"http://0.0.0.0:{config.liveness_port}/healthz" if config.liveness_port else None
    asyncio.run(
        kopf.operator(
            registry=build_registry(config),
            clusterwide=not config.namespaces,
            namespaces=list(config.namespaces),
            standalone=config.standalone,
            liveness_endpoint=liveness,
            memo=kopf.Memo(),
        )
    )
