"""The pool's side-channel Secret: one random token per pool, created once, mounted into engines and kvstore.

The renderer stays a pure function: it mounts the Secret by name and points ``--pool-secret-file`` at it,
but never holds the token. The reconciler creates the Secret (POST) with a fresh token when it does not
exist yet; an existing one answers 409 and is kept as it is, so a reconcile never rotates the token. The
operator needs only ``create`` on Secrets (it never reads one), and the pool owns the Secret, so Kubernetes'
garbage collector deletes it with the pool.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from pool_operator.naming import PoolNames

SECRET_KEY = "token"
MOUNT_DIR = "/etc/kvferry/pool-secret"
SECRET_FILE = f"{MOUNT_DIR}/{SECRET_KEY}"
VOLUME = "pool-secret"
_FILE_MODE = 0o440  # owner and group (the pod's fsGroup) read; nobody writes


def secret_name(names: PoolNames) -> str:
    return names.child("pool-secret")


def volume(names: PoolNames) -> dict[str, Any]:
    """The pod volume of the Secret (only its token key)."""
    return {
        "name": VOLUME,
        "secret": {
            "secretName": secret_name(names),
            "items": [{"key": SECRET_KEY, "path": SECRET_KEY}],
            "defaultMode": _FILE_MODE,
        },
    }


def volume_mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MOUNT_DIR, "readOnly": True}


def flag() -> list[str]:
    """The command-line flag of every engine and kvstore of a pool."""
    return ["--pool-secret-file", SECRET_FILE]


def new_token() -> str:
    """256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def secret_manifest(names: PoolNames, token: str) -> dict[str, Any]:
    """The Secret holding ``token``, labelled as the pool's (the renderer adds the owner reference)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret_name(names), "namespace": names.namespace, "labels": names.labels(None)},
        "type": "Opaque",
        "immutable": True,  # to replace the token, delete the Secret: the next reconcile creates a new one
        "data": {SECRET_KEY: base64.b64encode(token.encode()).decode()},
    }
