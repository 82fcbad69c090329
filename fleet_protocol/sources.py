"""Camera source URLs as the controller stores and sends them: credentials only as references.

A pool camera's source travels in the signed desired state, so it must never hold a password: where a
camera needs one, the URL names a secret (``rtsp://{secret:NAME}@host/path``, or a query value
``token={secret:NAME}``) and the device puts the secret's text in its place from its own store. The
controller checks the form (``controller/fleet/pools.py``); the device resolves it (``expand``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

# A reference to a secret that the device resolves from its own store: the only credential form kept.
SECRET_REF = re.compile(r"\{secret:([A-Za-z0-9][A-Za-z0-9_.-]{0,63})\}")
SOURCE_SCHEMES = ("rtsp", "rtsps", "http", "https", "file")
MAX_SOURCE_LEN = 2048


class SecretMissing(LookupError):
    """A source names a secret the device does not have (or cannot read)."""


def secret_names(url: str) -> list[str]:
    return [m.group(1) for m in SECRET_REF.finditer(url)]


def expand(url: str, read_secret: Callable[[str], str]) -> str:
    """``url`` with every ``{secret:NAME}`` replaced by ``read_secret(NAME)``, the text exactly as it
    goes in the URL (``user:password``, percent-encoded where the URL needs it). ``read_secret`` raises
    SecretMissing for a name it does not hold; the message names the secret, never its value."""
    return SECRET_REF.sub(lambda m: read_secret(m.group(1)), url)
