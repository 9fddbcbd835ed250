"""Remote media: http(s) image and video URLs fetched with a byte and a time limit where a server allows it
(off by default; services.common.media_settings), answered as data: URLs, so decoding, hashing and the router's hand-off to an engine treat
them as inline media. Router and engine both use it."""

from __future__ import annotations

import asyncio
import base64
import mimetypes
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from services.common.media_settings import Kind, RemoteMedia


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
