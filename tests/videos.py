"""Short test clips: frames drawn with numpy, encoded with PyAV (MPEG-4 part 2 in an mp4 container)."""

from __future__ import annotations

import base64
import io

import numpy as np


def clip_bytes(
    frames: int,
    fps: int = 10,
    size: tuple[int, int] = (48, 32),
    seed: int = 0,
    flat: bool = False,
    container_format: str = "mp4",
) -> bytes:
    """An mp4 (or ``container_format``: webm gets VP8) of ``frames`` frames of ``size`` (w, h): a moving bar
    over per-seed noise (``flat``: one colour, which compresses to almost nothing)."""
    import av

    w, h = size
    rng = np.random.default_rng(seed)
    base = np.full((h, w, 3), 90, np.uint8) if flat else rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container_format) as container:
        stream = container.add_stream("libvpx" if container_format == "webm" else "mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            frame = base.copy()
            frame[:, (i * 3) % w] = 255
            frame[..., 0] = (frame[..., 0].astype(int) + i * 5) % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()
