"""Camera source URLs as the controller stores and sends them: credentials only as references.

A pool camera's source travels in the signed desired state, so it must never hold a password: where a
camera needs one, the URL names a secret (``rtsp://{secret:NAME}@host/path``, or a query value
``token={secret:NAME}``) and the device puts the secret's text in its place from its own store. The
controller checks the form (``controller/fleet/pools.py``); the device resolves it (``expand``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit, urlunsplit

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


def redact_url(url: str) -> str:
    """``url`` without its secrets: the password of URL credentials (``rtsp://user:pass@host`` ->
    ``rtsp://user:***@host``; credentials without a password may be a token: ``rtsp://***@host``) and
    query values (``?token=abc`` -> ``?token=***``, where a camera may take its credential). Text that
    is not a URL comes back as it is."""
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        parts = parts._replace(netloc=f"{user}:***@{host}" if colon and user else f"***@{host}")
    if parts.query:
        hidden = (p.split("=", 1)[0] + "=***" if "=" in p else p for p in parts.query.split("&"))
        parts = parts._replace(query="&".join(hidden))
    return urlunsplit(parts)


# A URL inside free text (a log line, an exception): up to the first space or quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{1,15}://[^\s'\"<>]+")
# ``password=…``, ``token: …`` and the like outside URLs (a config dump, a command line, a header).
_KEYED_SECRET = re.compile(
    r"(?i)\b(password|passwd|pass|pwd|token|secret|api[_-]?key|authorization|credentials?)(\s*[=:]\s*)"
    r"(\"[^\"]*\"|'[^']*'|(?:bearer\s+)?[^\s,;&'\"]+)"
)
# Known secrets shorter than this are not searched for: "***" everywhere a 2-letter password occurs
# would hide the log itself.
MIN_SECRET_LEN = 4


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Free text (a log line, an error) made safe to send off the device: every known secret's text
    replaced by ``***``, then URLs through :func:`redact_url` and ``key=value`` secrets masked."""
    for secret in sorted({s for s in secrets if len(s) >= MIN_SECRET_LEN}, key=len, reverse=True):
        text = text.replace(secret, "***")
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    return _KEYED_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}***", text)
