"""Each image started as the operator's pods start it: UID 10001, a read-only root, and no writable path
but the rendered empty volumes (/tmp, /dev/shm)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pool_operator.images import COMPONENTS
from tests.images.containers import UID, pod_run, run_to_end

pytestmark = pytest.mark.images

# Walks the whole filesystem as the image's user; prints every writable folder outside the volumes.
PROBE = """import os
ALLOWED = ("/tmp", "/dev/shm", "/proc", "/sys", "/dev")
print("uid", os.getuid(), os.getgid())
for top, dirs, _ in os.walk("/"):
    if top.startswith(ALLOWED):
        dirs[:] = []
        continue
    if os.access(top, os.W_OK):
        print("writable", top)
try:
    open("/opt/kvferry/probe", "w")
    print("wrote /opt/kvferry")
except OSError as e:
    print("refused", e.errno)
open("/tmp/probe", "w").write("ok")
print("tmp ok")
"""


@pytest.mark.parametrize("component", COMPONENTS)
def test_image_runs_as_10001_with_only_the_volumes_writable(
    component: str, image: Callable[[str], str], tmp_path: Path
) -> None:
    code, out = run_to_end(pod_run(image(component), ["python", "-c", PROBE], tmp_path / "probe.log"))
    assert code == 0, out
    assert f"uid {UID} {UID}" in out
    assert "writable" not in out and "wrote" not in out, out
    assert "refused 30" in out  # EROFS: the root is mounted read-only
    assert "tmp ok" in out
