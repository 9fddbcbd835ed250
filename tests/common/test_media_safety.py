"""Media a hostile client may send: a small PNG that claims billions of pixels, and http(s) URLs (or their
redirects) that lead to loopback, private or link-local addresses. Each is refused with a clear message."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib
from collections.abc import Iterator

import pytest
from PIL import Image

from services.common.media.image_inputs import MAX_IMAGE_PIXELS, load_image
from services.common.media.media_fetch import inline_remote
from services.common.media.media_settings import RemoteMedia
from tests.media_server import MediaServer


def _png(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header then claims ``width`` x ``height`` (a decompression bomb's header)."""
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    return bytes(data)


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_a_decompression_bomb_is_refused_before_it_is_decoded() -> None:
    bomb = _png(9_000, 8_000)  # 72 MP: under Pillow's own bomb check, 288 MB as RGBA, in 70 bytes
    assert len(bomb) < 200
    with pytest.raises(ValueError, match=f"9000x8000 pixels, over this server's limit of {MAX_IMAGE_PIXELS}"):
        load_image(_data_url(bomb))
    assert load_image(_data_url(_png(1, 1))).size == (1, 1)


@pytest.fixture
def servers() -> Iterator[tuple[MediaServer, MediaServer]]:
    inner = MediaServer({"/secret.png": ("image/png", _png(1, 1))})  # e.g. a metadata endpoint
    mirror = MediaServer({"/cat.png": ("image/png", _png(1, 1))})
    yield mirror, inner
    mirror.close()
    inner.close()


def _fetch(url: str, *allowed: str) -> str | ValueError:
    settings = RemoteMedia(allow=True, timeout_s=5, allowed_private_hosts=allowed)
    return asyncio.run(inline_remote([url], "image", settings))[0][1]


def _host(server: MediaServer) -> str:
    return server.url.removeprefix("http://")


def test_loopback_and_private_hosts_are_refused_on_every_hop(
    servers: tuple[MediaServer, MediaServer],
) -> None:
    mirror, inner = servers
    for url in (f"{inner.url}/secret.png", "http://localhost:9/x.png", "http://169.254.169.254/latest/x.png"):
        refused = _fetch(url)
        assert isinstance(refused, ValueError) and "loopback, private or link-local" in str(refused), url
    assert inner.requests == []  # nothing was even asked
    assert _fetch(f"{mirror.url}/cat.png", _host(mirror)).startswith("data:image/png;base64,")
    # an allowed mirror redirecting to 127.0.0.1 elsewhere: the redirect's hop is checked too
    mirror.redirects = {"/hop.png": f"{inner.url}/secret.png"}
    refused = _fetch(f"{mirror.url}/hop.png", _host(mirror))
    assert isinstance(refused, ValueError) and "loopback, private or link-local" in str(refused)
    assert inner.requests == []


def test_upstream_status_is_not_echoed(servers: tuple[MediaServer, MediaServer]) -> None:
    mirror, _ = servers
    refused = _fetch(f"{mirror.url}/gone.png", _host(mirror))
    assert isinstance(refused, ValueError) and "404" not in str(refused)
    assert str(refused) == "image_url: fetching it failed (no image at that URL)"
