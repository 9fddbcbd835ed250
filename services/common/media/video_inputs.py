"""VideoClip: a request's video decoded with PyAV and sampled at the model's frame rate / frame cap (SmolVLM's
rule: uniform indices over the clip, one second skipped at each end of a long clip), from a data: or
file:// URL. Router and engine both use it, so the frames they hash are the same."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

MAX_VIDEO_BYTES = 64 * 2**20  # an encoded video larger than this is refused
MAX_VIDEO_FRAMES = 18_000  # frames in the whole clip (10 minutes at 30 fps)
MAX_FRAME_PIXELS = 3840 * 2160  # one decoded frame (4K UHD)
MIME_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/mpeg", "video/avi")


class VideoSampling(BaseModel):
    """The model's video settings (SmolVLM's ``video_sampling``): frames per second, the frame cap, the size
    frames are resized to before the square tile."""

    model_config = ConfigDict(frozen=True)

    fps: float = Field(1.0, gt=0)
    max_frames: int = Field(64, ge=1)
    longest_edge: int = Field(512, ge=1)
    skip_secs: float = 1.0

    def indices(self, total_frames: int, fps: float) -> list[int]:
        """Which frames of a clip of ``total_frames`` at ``fps`` are sampled (ascending, distinct)."""
        duration = total_frames / fps if fps else 0.0
        wanted = max(1, min(int(round(self.fps * duration)), self.max_frames))
        start, end = 0, total_frames - 1
        if self.skip_secs > 0 and duration - 2 * self.skip_secs > self.max_frames * self.fps:
            start, end = int(self.skip_secs * fps), int(total_frames - self.skip_secs * fps)
        start, end = max(0, start), min(end, total_frames - 1)
        if start >= end:
            start, end = 0, total_frames - 1
        return sorted({int(i) for i in np.linspace(start, end, wanted, dtype=int)})


@dataclass(frozen=True)
class VideoClip:
    """The sampled frames (uint8 [F, H, W, 3]), each one's time in seconds, and the clip's duration."""

    frames: np.ndarray
    timestamps: tuple[float, ...]
    duration: float


def load_video(
    url: str, sampling: VideoSampling, local_root: Path | None = None, max_frames: int = MAX_VIDEO_FRAMES
) -> VideoClip:
    """A ``data:video/...;base64,`` URL or ``file://`` under ``local_root``, decoded and sampled; ValueError
    saying why not."""
    return decode_video(_video_bytes(url, local_root), sampling, max_frames)


def decode_video(data: bytes, sampling: VideoSampling, max_frames: int = MAX_VIDEO_FRAMES) -> VideoClip:
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError("video_url: the file has no video stream")
            stream = container.streams.video[0]
            total, fps = int(stream.frames), float(stream.average_rate or 0)
            if stream.width * stream.height > MAX_FRAME_PIXELS:
                raise ValueError(
                    f"video_url: {stream.width}x{stream.height} frames are over {MAX_FRAME_PIXELS} pixels"
                )
            if total <= 0:  # webm and others do not say: count the packets (no decoding), then rewind
                total = _count_packets(container, stream, max_frames)
                container.seek(0)
            if total > max_frames:
                raise ValueError(f"video_url: {total} frames is over this server's limit of {max_frames}")
            if total <= 0 or fps <= 0:
                raise ValueError("video_url: the video has no frames, or does not say its frame rate")
            wanted = sampling.indices(total, fps)
            frames = _frames(container, set(wanted), wanted[-1])
    except av.FFmpegError as exc:
        raise ValueError(f"video_url: the video cannot be decoded ({type(exc).__name__})") from exc
    if len(frames) != len(wanted):
        raise ValueError(
            f"video_url: the video has fewer frames than it says ({len(frames)} of {len(wanted)})"
        )
    return VideoClip(np.stack(frames), tuple(i / fps for i in wanted), total / fps)


def _count_packets(container: Any, stream: Any, limit: int) -> int:
    """The stream's frame count from its packets, counting stops past ``limit``."""
    count = 0
    for packet in container.demux(stream):
        count += 1 if packet.size else 0
        if count > limit:
            break
    return count


def _frames(container: object, wanted: set[int], last: int) -> list[np.ndarray]:
    out = []
    for i, frame in enumerate(container.decode(video=0)):  # type: ignore[attr-defined]
        if i > last:
            break
        if i in wanted:
            out.append(frame.to_ndarray(format="rgb24"))
    return out


def _video_bytes(url: str, root: Path | None) -> bytes:
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        mime = header.removeprefix("data:").removesuffix(";base64")
        if not header.endswith(";base64") or not mime.startswith("video/"):
            raise ValueError("video_url: a data URL must be data:video/<type>;base64,<data>")
        if mime not in MIME_TYPES:
            raise ValueError(f"video_url: {mime} is not supported ({', '.join(MIME_TYPES)})")
        if len(payload) > MAX_VIDEO_BYTES * 4 // 3 + 4:
            raise ValueError(f"video_url: the video is over {MAX_VIDEO_BYTES // 2**20} MiB")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("video_url: the data URL is not valid base64") from exc
    if url.startswith("file://"):
        return _local_file(url.removeprefix("file://"), root)
    if url.startswith(("http://", "https://")):
        raise ValueError("video_url: fetching http(s) URLs is disabled on this server; send a data: URL")
    raise ValueError("video_url: the URL must be a data: URL (or file:// where allowed)")


def _local_file(path: str, root: Path | None) -> bytes:
    if root is None:
        raise ValueError("video_url: file:// URLs need --allowed-local-media-path on this server")
    target = Path(path).resolve()
    if not target.is_relative_to(root.resolve()):
        raise ValueError("video_url: the file is outside --allowed-local-media-path")
    if not target.is_file() or target.stat().st_size > MAX_VIDEO_BYTES:
        raise ValueError("video_url: no such file, or it is too large")
    return target.read_bytes()
