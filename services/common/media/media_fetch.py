"""Remote media: http(s) image and video URLs fetched with a byte and a time limit where a server allows it
(off by default; services.common.media.media_settings), answered as data: URLs, so decoding, hashing and the router's
hand-off to an engine treat them as inline media. Router and engine both use it.

Every hop (the URL, then each redirect) is resolved first; a host with a loopback, private, link-local or
otherwise non-public address is refused unless its ``host:port`` is one of the server's allowed private hosts,
and the connection goes to the very address that was checked (no second lookup a DNS answer could change)."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import mimetypes
import socket
from collections.abc import Sequence
from urllib.parse import urljoin, urlsplit

import httpx

from services.common.media.media_settings import Kind, RemoteMedia

MAX_REDIRECTS = 3
_REDIRECTS = (301, 302, 303, 307, 308)


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
        follow_redirects=False, timeout=settings.timeout_s, trust_env=False
    ) as client:
        fetched = await asyncio.gather(*(_data_url(client, url, kind, settings) for _, url in remote))
    return [(i, got) for (i, _), got in zip(remote, fetched, strict=True)]


class _Refused(Exception):
    """A hop the server will not fetch (its message is the client's)."""


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def _pinned(url: str, kind: Kind, settings: RemoteMedia) -> tuple[str, dict[str, str], dict[str, str]]:
    """The URL to connect to (the checked address), its Host header and TLS name; _Refused when not public."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise _Refused(f"{kind}_url: only http(s) URLs with a host can be fetched")
    host = parts.hostname
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    if f"{host}:{port}" in settings.allowed_private_hosts:
        return url, {}, {}
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise _Refused(f"{kind}_url: its host name does not resolve") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses or not all(_public(a) for a in addresses):
        raise _Refused(
            f"{kind}_url: its host resolves to a loopback, private or link-local address; this server fetches "
            "public addresses only"
        )
    target = httpx.URL(url).copy_with(host=addresses[0])
    return str(target), {"Host": parts.netloc.rpartition("@")[2]}, {"sni_hostname": host}


async def _open(client: httpx.AsyncClient, url: str, kind: Kind, settings: RemoteMedia) -> httpx.Response:
    """The final response after at most MAX_REDIRECTS redirects, each hop checked (streamed, still open)."""
    for _ in range(MAX_REDIRECTS + 1):
        target, headers, extensions = await _pinned(url, kind, settings)
        request = client.build_request("GET", target, headers=headers, extensions=extensions)
        response = await client.send(request, stream=True)
        location = response.headers.get("location")
        if response.status_code not in _REDIRECTS or not location:
            return response
        await response.aclose()
        url = urljoin(url, location)
    raise _Refused(f"{kind}_url: more than {MAX_REDIRECTS} redirects")


async def _data_url(
    client: httpx.AsyncClient, url: str, kind: Kind, settings: RemoteMedia
) -> str | ValueError:
    limit = settings.limit(kind)
    too_big = ValueError(f"{kind}_url: the {kind} is over this server's limit of {limit} bytes")
    try:
        async with asyncio.timeout(settings.timeout_s):
            response = await _open(client, url, kind, settings)
            try:
                if response.status_code != 200:  # the upstream's status is its business, not the client's
                    return ValueError(f"{kind}_url: fetching it failed (no {kind} at that URL)")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    return too_big
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        return too_big
                mime = _mime(response.headers.get("content-type", ""), url, kind)
            finally:
                await response.aclose()
    except _Refused as exc:
        return ValueError(str(exc))
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
