"""The pool secret: one shared token per pool that guards the side channels between its pods.

Engines' ``/kv/`` HTTP routes (decode -> prefill handshake) and the kvstore's gRPC service require it
when a process is started with ``--pool-secret-file``; callers send it in ``X-Kvferry-Pool-Secret``
(HTTP) or ``x-kvferry-pool-secret`` (gRPC metadata). Comparisons are constant time; the token is a
``SecretStr`` (``**********`` in every repr and dump) and is never logged.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from pydantic import SecretStr

POOL_SECRET_HEADER = "X-Kvferry-Pool-Secret"
POOL_SECRET_METADATA = "x-kvferry-pool-secret"  # gRPC metadata keys are lower case
SIDE_CHANNEL_PREFIX = "/kv/"  # every engine route under it is a side channel
MIN_SECRET_CHARS = 16


def read_pool_secret(path: str | Path | None, flag: str = "--pool-secret-file") -> SecretStr | None:
    """The token in ``path`` (surrounding whitespace stripped); None without a path.

    Raises ValueError naming the flag and the file (never the content) when it cannot be used."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.__class__.__name__}") from None
    if len(text) < MIN_SECRET_CHARS:
        raise ValueError(f"{flag}: {path} must hold a token of at least {MIN_SECRET_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError(f"{flag}: {path} must hold one token (printable, no spaces or line breaks)")
    return SecretStr(text)


def write_pool_secret(path: Path) -> Path:
    """A fresh random token in a new file only its owner can read (``kvferry up``'s per-stack secret)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as sink:
        sink.write(secrets.token_urlsafe(32) + "\n")
    return path


def secret_matches(presented: str | bytes | None, secret: SecretStr) -> bool:
    """Whether ``presented`` is the pool secret (constant time; a missing one never matches)."""
    if presented is None:
        return False
    given = presented.encode() if isinstance(presented, str) else presented
    return hmac.compare_digest(given, secret.get_secret_value().encode())


def describe(secret: SecretStr | None, what: str) -> str:
    """The start-up log line saying whether ``what`` (e.g. "side channels (/kv/*)") needs the secret."""
    if secret is None:
        return f"{what}: open (no --pool-secret-file): any caller that can reach them is served"
    return f"{what}: callers must present the pool secret (--pool-secret-file)"


def auth_headers(secret: SecretStr | None) -> dict[str, str]:
    """The HTTP headers a side-channel client sends (none without a secret)."""
    return {POOL_SECRET_HEADER: secret.get_secret_value()} if secret is not None else {}


def auth_metadata(secret: SecretStr | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata a kvstore client sends (none without a secret)."""
    return ((POOL_SECRET_METADATA, secret.get_secret_value()),) if secret is not None else ()
