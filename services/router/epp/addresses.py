"""Engine addresses as a gateway names them: ``ip:port`` (what ORIGINAL_DST and GIE's header carry)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def endpoint_address(url: str) -> str | None:
    """``ip:port`` (``[v6]:port``) of an engine URL ``http://IP:PORT``; None when it names no IP and port."""
    parts = urlsplit(url)
    try:
        ip = ipaddress.ip_address(parts.hostname or "")
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "http" or port is None or parts.path.strip("/"):
        return None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
