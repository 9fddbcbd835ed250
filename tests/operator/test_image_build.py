"""`make images` without building: names, build commands, the rebuild check, the debootstrapped base's trim."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pool_operator.container_tool import ContainerTool
from pool_operator.debian_base import DebianBase
from pool_operator.image_build import REPO, dockerfile_arg, main, source_hash
from pool_operator.images import COMPONENTS, ImageSet


def test_every_component_is_a_dockerfile_target_named_like_the_operator_renders_it() -> None:
    text = (REPO / "Dockerfile").read_text()
    for component in COMPONENTS:
        assert f" AS {component}\n" in text
    assert ImageSet().image("engine-cpu") == f"ghcr.io/kvferry/kvferry-engine-cpu:{ImageSet().tag()}"
    assert dockerfile_arg("BASE_IMAGE") == "docker.io/library/debian:bookworm-slim"
    assert dockerfile_arg("TORCH_VERSION") == "2.13.0"
    assert "shared/" not in text and "NOTES" not in text


def test_buildah_builds_daemonless_with_vfs_chroot_and_no_layer_copies() -> None:
    argv = ContainerTool("buildah").build_argv(
        REPO, "router", "r:1", {"BASE_IMAGE": "b"}, {"k": "v"}, {"pip-ca": Path("/ca.pem")}
    )
    assert argv[:6] == ["buildah", "--storage-driver", "vfs", "bud", "--isolation", "chroot"]
    assert "--layers" not in argv and argv[-1] == str(REPO)
    assert {"--target", "router", "--build-arg", "BASE_IMAGE=b", "--secret", "id=pip-ca,src=/ca.pem"} <= set(
        argv
    )
    docker = ContainerTool("docker").build_argv(REPO, "router", "r:1", {}, {}, {})
    assert docker[:2] == ["docker", "build"] and "--isolation" not in docker


def test_source_hash_changes_with_the_sources_and_the_build_args(tmp_path: Path) -> None:
    for name in ("Dockerfile", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "a.py").write_text("x = 1\n")
    (tmp_path / "services" / "__pycache__").mkdir()
    first = source_hash(tmp_path, ["router"])
    (tmp_path / "services" / "__pycache__" / "a.pyc").write_bytes(b"junk")
    assert source_hash(tmp_path, ["router"]) == first  # bytecode is not a source
    assert source_hash(tmp_path, ["kvstore"]) != first
    (tmp_path / "services" / "a.py").write_text("x = 2\n")
    assert source_hash(tmp_path, ["router"]) != first


def test_unknown_component_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "gpu-engine"])
    assert exit_info.value.code == 2
    assert "unknown component(s) gpu-engine; choose from engine, engine-cpu" in capsys.readouterr().err


def test_debootstrapped_root_is_trimmed_like_the_slim_image(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for folder in (
        "var/cache/apt/archives/partial",
        "var/lib/apt/lists",
        "usr/share/doc/bash",
        "etc/dpkg/dpkg.cfg.d",
        "etc/apt",
    ):
        (root / folder).mkdir(parents=True)
    (root / "var/cache/apt/archives/bash.deb").write_bytes(b"deb")
    (root / "var/cache/apt/archives/lock").write_bytes(b"")
    (root / "var/lib/apt/lists/deb.debian.org_Packages").write_text("Package: bash")
    DebianBase(tmp_path)._trim(root)
    assert sorted(p.name for p in (root / "var/cache/apt/archives").iterdir()) == ["lock"]
    assert not any((root / "var/lib/apt/lists").iterdir()) and not any((root / "usr/share/doc").iterdir())
    assert "path-exclude /usr/share/doc/*" in (root / "etc/dpkg/dpkg.cfg.d/excludes").read_text()
    sources = (root / "etc/apt/sources.list").read_text()
    assert (
        "bookworm-updates" in sources and "http://deb.debian.org/debian-security bookworm-security" in sources
    )
