"""spec.model.source.hostPath mounts a folder of the node: the operator refuses such pools unless it was
started with --allow-host-path-models (KVFERRY_OPERATOR_ALLOW_HOST_PATH_MODELS, chart allowHostPathModels)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from pool_operator.config import OperatorConfig
from pool_operator.poolfile import parse_pool
from pool_operator.reconciler import Reconciler, SpecConflictError
from tests.operator.test_operator import pool_body


class _Reached(Exception):
    """The reconciler got past its checks and asked the API server for something."""


class _Client:
    def __getattr__(self, name: str) -> Any:
        async def call(*_: Any, **__: Any) -> None:
            raise _Reached(name)

        return call


def _reconcile(config: OperatorConfig, source: dict[str, Any]) -> None:
    body = pool_body("p", "ns")
    body["spec"]["model"]["source"] = source
    asyncio.run(Reconciler(_Client(), config).reconcile(parse_pool(body), logging.getLogger("t")))  # type: ignore[arg-type]


def test_host_path_pools_are_refused_by_default() -> None:
    with pytest.raises(SpecConflictError, match="--allow-host-path-models"):
        _reconcile(OperatorConfig(), {"hostPath": "/etc"})
    with pytest.raises(_Reached):  # a PVC source passes the gate
        _reconcile(OperatorConfig(), {"pvc": {"claimName": "models"}})


def test_the_operator_flag_and_variable_allow_them() -> None:
    with pytest.raises(_Reached):
        _reconcile(OperatorConfig(allow_host_path_models=True), {"hostPath": "/models"})
    config = OperatorConfig.from_env({"KVFERRY_OPERATOR_ALLOW_HOST_PATH_MODELS": "true"})
    assert config.allow_host_path_models
    assert not OperatorConfig.from_env({}).allow_host_path_models
