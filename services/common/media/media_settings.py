"""Media settings of a vision-language server, the same flags on engines and router: images and videos per
request (--limit-mm-per-prompt) and http(s) media fetching (--allow-remote-media and its limits)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.media.image_inputs import MAX_IMAGE_BYTES
from services.common.media.video_inputs import MAX_VIDEO_BYTES

Kind = Literal["image", "video"]
_CAPS = {"image": MAX_IMAGE_BYTES, "video": MAX_VIDEO_BYTES}  # what a data: URL of the kind may hold too


class MediaLimits(BaseModel):
    """--limit-mm-per-prompt: the most images and videos one request may carry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: int = Field(4, ge=0, le=64)
    video: int = Field(1, ge=0, le=16)


class RemoteMedia(BaseModel):
    """--allow-remote-media, --media-fetch-timeout, --media-fetch-max-bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: bool = False
    timeout_s: float = Field(10.0, gt=0, le=600)  # the whole fetch: connect, headers and body
    max_bytes: int = Field(MAX_VIDEO_BYTES, ge=1, le=MAX_VIDEO_BYTES)  # images are capped at 20 MiB anyway
    # host:port pairs fetched although they resolve to a private address (an in-cluster media mirror)
    allowed_private_hosts: tuple[str, ...] = ()

    def limit(self, kind: Kind) -> int:
        return min(self.max_bytes, _CAPS[kind])


def add_media_flags(add: Callable[..., object]) -> None:
    """The flags, for ``kvferry serve`` and ``kvferry router`` alike."""
    add(
        "--limit-mm-per-prompt",
        default=None,
        metavar="JSON",
        help='vision models: most images and videos per request, e.g. \'{"image": 4, "video": 1}\' '
        "(the defaults)",
    )
    add(
        "--allow-remote-media",
        action="store_true",
        help="vision models: fetch http(s) image_url / video_url parts (default: refused with a 400)",
    )
    add(
        "--media-allow-private-host",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="vision models: fetch from this host:port although it resolves to a loopback, private or "
        "link-local address (refused by default; repeat for several)",
    )
    add(
        "--media-fetch-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="vision models: the most seconds one http(s) media fetch may take (default: 10)",
    )
    add(
        "--media-fetch-max-bytes",
        type=int,
        default=MAX_VIDEO_BYTES,
        metavar="N",
        help="vision models: the most bytes one fetched image or video may have; images are also capped at "
        f"{MAX_IMAGE_BYTES} (default: {MAX_VIDEO_BYTES})",
    )


def media_limits(text: str | None) -> MediaLimits:
    """--limit-mm-per-prompt '{"image": N, "video": M}' (either may be left out: 4 images, 1 video)."""
    if text is None:
        return MediaLimits()
    try:
        return MediaLimits.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "value"
        raise ValueError(
            f'--limit-mm-per-prompt: expected {{"image": N, "video": M}} ({where}: {first["msg"]})'
        ) from exc


def remote_media_from_args(args: argparse.Namespace) -> RemoteMedia:
    return RemoteMedia(
        allow=args.allow_remote_media,
        timeout_s=args.media_fetch_timeout,
        max_bytes=args.media_fetch_max_bytes,
        allowed_private_hosts=tuple(args.media_allow_private_host),
    )
