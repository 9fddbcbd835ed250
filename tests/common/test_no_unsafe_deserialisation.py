"""No wire or file format is read with pickle or another arbitrary-object deserialiser (grep-enforced).

NIXL metadata, gRPC, HTTP side channels, checkpoints: peers and files are data, never code. A new use
of one of these readers fails here; a justified one must be added to ALLOWED with the reason."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNSAFE = re.compile(
    r"\bimport (c?pickle|dill|cloudpickle|jsonpickle|shelve|marshal)\b"
    r"|\bfrom (c?pickle|dill|cloudpickle|jsonpickle|shelve|marshal) import\b"
    r"|\b(pickle|marshal)\.loads?\("
    r"|\byaml\.(unsafe_)?load\((?![^)]*SafeLoader)"
    r"|\btorch\.load\((?![^)]*weights_only=True)"
    r"|\bnp\.load\([^)]*allow_pickle=True"
)
ALLOWED: dict[str, str] = {}  # "path:line text" -> why it is safe


def test_no_unsafe_deserialisation_in_the_tree() -> None:
    found = []
    for folder in ("services", "operator", "kvkernels", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name.endswith("_pb2.py") or "_pb2_grpc" in path.name:
                continue
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if UNSAFE.search(line) and not line.lstrip().startswith("#"):
                    key = f"{path.relative_to(REPO)}:{line.strip()}"
                    if key not in ALLOWED:
                        found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "unsafe deserialisation:\n" + "\n".join(found)


def test_the_pattern_catches_what_it_must() -> None:
    for bad in ("import pickle", "x = pickle.loads(data)", "yaml.load(f)", "torch.load(path)", "import dill"):
        assert UNSAFE.search(bad), bad
    for fine in ("yaml.safe_load(f)", "torch.load(p, weights_only=True)", "json.loads(s)", "# import pickle"):
        assert not UNSAFE.search(fine) or fine.startswith("#"), fine
