"""Generate the Python gRPC stubs of every .proto here: `python -m services.common.kv.proto.gen [--out DIR]`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

# grpc_tools.protoc with its bundled well-known-type protos on the include path; argv[1:] are protoc's.
_PROTOC = (
    "import sys, pathlib, grpc_tools; from grpc_tools import protoc; "
    "inc = pathlib.Path(grpc_tools.__file__).parent / '_proto'; "
    "sys.exit(protoc.main(['protoc', f'-I{inc}', *sys.argv[1:]]))"
)
PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parents[3]


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Run protoc (grpcio-tools) so the stubs land at ``out_dir/services/common/kv/proto/*_pb2*.py``.

    The protos are compiled relative to the repository root, so the generated ``*_pb2_grpc.py``
    imports ``services.common.kv.proto.*_pb2`` (a package import, not a top-level one). protoc runs in
    a child process: its bundled libprotobuf/abseil must not meet others loaded here (nixl's).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in sorted(PROTO_DIR.glob("*.proto")):
        rel = proto.relative_to(REPO_ROOT)
        cmd = [
            sys.executable,
            "-c",
            _PROTOC,
            f"-I{REPO_ROOT}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(rel),
        ]
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed on {rel}: {done.stderr.strip()}")
    target = out_dir / PROTO_DIR.relative_to(REPO_ROOT)
    return sorted(target.glob("*_pb2*.py"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT, help="root to write services/common/kv/proto/ under"
    )
    for path in generate(parser.parse_args().out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
