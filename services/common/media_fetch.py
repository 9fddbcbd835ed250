"""Remote media: http(s) image and video URLs fetched with a byte and a time limit where a server allows it
(off by default), answered as data: URLs, so decoding, hashing and the router's hand-off to an engine treat
them as inline media. Router and engine both use it, with the same flags."""

from __future__ import annotations

import argparse
import asyncio
import base64
import mimetypes
from collections.abc import Callable, Sequence
from typing import Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from services.common.image_inputs import MAX_IMAGE_BYTES
from services.common.video_inputs import MAX_VIDEO_BYTES

Kind = Literal["image", "video"]
_CAPS = {"image": MAX_IMAGE_BYTES, "video": MAX_VIDEO_BYTES}  # what a data: URL of the kind may hold too


class RemoteMedia(BaseModel):
    """--allow-remote-media, --media-fetch-timeout, --media-fetch-max-bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: bool = False
    timeout_s: float = Field(10.0, gt=0, le=600)  # the whole fetch: connect, headers and body
    max_bytes: int = Field(MAX_VIDEO_BYTES, ge=1, le=MAX_VIDEO_BYTES)  # images are capped at 20 MiB anyway

    def limit(self, kind: Kind) -> int:
        return min(self.max_bytes, _CAPS[kind])


def is_remote(url: str) -> bool:
    return urlsplit(url).scheme.lower() in ("http", "https")


async def inline_remote(
    urls: Sequence[str], kind: Kind, settings: RemoteMedia
) -> list[tuple[int, str | ValueError]]:
    """Each http(s) URL of ``urls`` (by index) fetched as a data: URL, or the ValueError saying why not;
    fetches run concurrently on the event loop. Other URLs are not in the answer."""
    remote = [(i, url) for i, url in enumerate(urls) if is_remote(url)]
    if not remote:
        return []
    if not settings.allow:
        refused = ValueError(
            f"{kind}_url: fetching http(s) URLs is disabled on this server; send a data: URL "
            "(or start the server with --allow-remote-media)"
        )
        return [(i, refused) for i, _ in remote]
    async with httpx.AsyncClient(
        follow_redirects=True, max_redirects=3, timeout=settings.timeout_s
    ) as client:
        fetched = await asyncio.gather(*(_data_url(client, url, kind, settings) for _, url in remote))
    return [(i, got) for (i, _), got in zip(remote, fetched, strict=True)]


async def _data_url(
    client: httpx.AsyncClient, url: str, kind: Kind, settings: RemoteMedia
) -> str | ValueError:
    limit = settings.limit(kind)
    try:
        async with asyncio.timeout(settings.timeout_s):
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    return ValueError(f"{kind}_url: fetching it failed (HTTP {response.status_code})")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    return ValueError(f"{kind}_url: the {kind} is over this server's limit of {limit} bytes")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        return ValueError(
                            f"{kind}_url: the {kind} is over this server's limit of {limit} bytes"
                        )
                mime = _mime(response.headers.get("content-type", ""), str(response.url), kind)
    except TimeoutError:
        return ValueError(f"{kind}_url: fetching it took longer than {settings.timeout_s:g} s")
    except httpx.HTTPError as exc:
        return ValueError(f"{kind}_url: fetching it failed ({type(exc).__name__})")
    return f"data:{mime};base64,{base64.b64encode(bytes(body)).decode()}"


def _mime(header: str, url: str, kind: Kind) -> str:
    """The response's media type; a generic one (octet-stream) is guessed from the URL's path."""
    declared = header.split(";", 1)[0].strip().lower()
    if declared.startswith(f"{kind}/"):
        return declared
    guessed = mimetypes.guess_type(urlsplit(url).path)[0] or ""
    return guessed if guessed.startswith(f"{kind}/") else f"{kind}/unknown"


def add_remote_media_flags(add: Callable[..., object]) -> None:
    """The flags, for ``kvferry serve`` and ``kvferry router`` alike."""
    add(
        "--allow-remote-media",
        action="store_true",
        help="vision models: fetch http(s) image_url / video_url parts (default: refused with a 400)",
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


def remote_media_from_args(args: argparse.Namespace) -> RemoteMedia:
    return RemoteMedia(
        allow=args.allow_remote_media,
        timeout_s=args.media_fetch_timeout,
        max_bytes=args.media_fetch_max_bytes,
    )
