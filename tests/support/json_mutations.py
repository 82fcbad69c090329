"""Hostile JSON: bad values, deep nesting, and documents with one field changed or dropped (the fuzz tests
of the controller and the agent)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import strategies as st

NASTY: list[Any] = [
    None,
    True,
    "",
    "x",
    "\x00",
    "\ud800",  # a lone surrogate: not encodable as UTF-8
    "\u202e\u200b\ufeffé\U0001f600",  # right-to-left override, zero width, BOM, emoji
    "../../etc/passwd",
    "a/+/#",
    "y" * 70_000,  # over every max_length, under the payload limit
    0,
    -1,
    2**31,
    2**63,
    2**70,
    -(2**70),
    10**400,  # an integer no float can hold
    0.5,
    -0.0,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
    [],
    [None],
    {},
    {"type": "x"},
]


DEEP = "\u2063deep\u2063"  # a marker replaced, after dumping, by nesting too deep for json.dumps


def with_deep(payload: bytes, depth: int = 5000) -> bytes:
    """Replace the marker by ``depth`` nested lists: deeper than any parser's recursion limit."""
    return payload.replace(json.dumps(DEEP).encode(), b"[" * depth + b"0" + b"]" * depth)


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (dict keys and list indices)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*prefix, k)
            yield from paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield (*prefix, i)
            yield from paths(v, (*prefix, i))


def _with(obj: Any, path: tuple[Any, ...], op: Callable[[Any, Any], None]) -> Any:
    doc = json.loads(json.dumps(obj))
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    op(parent, path[-1])
    return doc


def set_at(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    def put(parent: Any, key: Any) -> None:
        parent[key] = value

    return _with(obj, path, put)


def drop_at(obj: Any, path: tuple[Any, ...]) -> Any:
    def drop(parent: Any, key: Any) -> None:
        del parent[key]

    return _with(obj, path, drop)


def dump(doc: Any) -> bytes:
    """JSON as a careless or hostile sender writes it: NaN/Infinity allowed, surrogates escaped."""
    try:
        return json.dumps(doc, allow_nan=True).encode()
    except ValueError:  # an integer too long to print (10**400 is fine; guard anyway)
        return b"{}"


LONG = "y" * 70_000  # over any one-line field, far under the payload limit


Verdicts = list[tuple[str, bytes]]


# The value of a (path, value) change that drops the field instead (field_verdicts).
DROP = object()


def field_verdicts(doc: Any, changes: list[tuple[tuple[Any, ...], Any]]) -> Verdicts:
    """``doc`` with each (path, value) change applied, or the field dropped for DROP, named."""
    out: Verdicts = []
    for path, value in changes:
        name = ".".join(map(str, path))
        if value is DROP:
            out.append((f"{name} missing", dump(drop_at(doc, path))))
        else:
            shown = "70 kB string" if value is LONG else repr(value)[:40]
            out.append((f"{name} = {shown}", dump(set_at(doc, path, value))))
    return out


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A named function, not a lambda: hypothesis describes a lambda by parsing its source.
    return st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=50),
    _containers,
    max_leaves=30,
)
