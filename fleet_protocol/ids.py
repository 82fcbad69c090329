"""Identifier rules, spelled once: device ids, camera ids and registry names.

An identifier is an MQTT topic level, a folder name and a database key, so it is kept to letters,
digits and ``_.-`` (not first), at most 64 characters. Python's ``re`` lets ``$`` match before a
trailing newline, so the Python-side check uses ``fullmatch``; ``ID_PATTERN`` is for pydantic and
FastAPI, whose (Rust) regex engine reads ``$`` strictly.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

ID_MAX = 64
# For pydantic fields and FastAPI path/query parameters (length checked separately by max_length).
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# How the rule reads in an error message.
ID_RULE = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def valid_id(value: str) -> bool:
    """True when ``value`` is a valid device id, camera id or registry name."""
    return _ID_RE.fullmatch(value) is not None


Name = Annotated[str, Field(min_length=1, max_length=ID_MAX, pattern=ID_PATTERN)]
CameraId = Annotated[str, Field(min_length=1, max_length=ID_MAX, pattern=ID_PATTERN)]
DeviceId = Annotated[str, Field(min_length=1, max_length=ID_MAX, pattern=ID_PATTERN)]
