"""ScrapeTargets: the /metrics endpoints of a local stack as a Prometheus file_sd file (``kvferry up``).

Each target carries the labels the operator's PodMonitor relabelings give pods in a cluster
(``namespace``, ``pool``, ``role``, ``pod``), so the chart's dashboards and the pool's rules work
unchanged against a local Prometheus (``file_sd_configs``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

LOCAL_NAMESPACE: Final = "local"
LOCAL_POOL: Final = "local"


@dataclass
class ScrapeTargets:
    """Targets added as the stack starts; ``write`` replaces the file atomically (Prometheus re-reads it)."""

    namespace: str = LOCAL_NAMESPACE
    pool: str = LOCAL_POOL
    targets: list[dict[str, object]] = field(default_factory=list)

    def add(self, address: str, role: str, pod: str) -> None:
        """One ``host:port`` serving ``/metrics``; ``role`` is the pod role label (engine, prefill, ...)."""
        labels = {"namespace": self.namespace, "pool": self.pool, "role": role, "pod": pod}
        self.targets.append({"targets": [address], "labels": labels})

    def write(self, path: Path | None) -> None:
        """Write the file (nothing when ``path`` is None); RuntimeError, naming the flag, when it cannot."""
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_name(path.name + ".tmp")
            scratch.write_text(json.dumps(self.targets, indent=2) + "\n")
            os.replace(scratch, path)
        except OSError as exc:
            raise RuntimeError(f"cannot write --prometheus-targets {path}: {exc.strerror or exc}") from None
        if self.targets:
            print(f"  Prometheus file_sd targets ({len(self.targets)}): {path}", flush=True)
