"""The operator image runs kopf against the emulated API server and reconciles a pool to Ready; the
engine image it renders is the one `make images` built for a CPU pool."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pool_operator.images import ImageSet
from tests.images.containers import Mount, pod_run, started
from tests.operator.cluster import Cluster, wait_for
from tests.operator.test_operator import deployment, phase, pool_body, pool_path

pytestmark = pytest.mark.images


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    emulated = Cluster().start()
    yield emulated
    emulated.stop()


def test_operator_image_reconciles_a_pool(
    image: Callable[[str], str], cluster: Cluster, tmp_path: Path
) -> None:
    kube = tmp_path / "kube"
    kube.mkdir()
    cluster.kubeconfig(kube)
    container = pod_run(
        image("operator"),
        ["kvferry", "operator", "--status-interval", "0.3", "--metrics-port", "0"],
        tmp_path / "operator.log",
        [Mount(kube, "/kube")],
        env={"KUBECONFIG": "/kube/kubeconfig", "KVFERRY_OPERATOR_RETRY_DELAY": "1"},
    )
    with started(container):
        cluster.call("POST", pool_path("alpha"), pool_body("emb", "alpha", "embedding-pool.yaml"))
        try:
            engine = wait_for(
                lambda: deployment(cluster, "alpha", "emb-engine"), 60, what="engine Deployment"
            )
            wait_for(lambda: deployment(cluster, "alpha", "emb-router"), 30, what="router Deployment")
            cluster.settle("alpha")
            wait_for(lambda: phase(cluster, "alpha", "emb") == "Ready", 60, what="phase Ready")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{container.log_text()[-4000:]}") from None
    pod = engine["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == ImageSet().image("engine-cpu")
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert "Traceback" not in container.log_text()
