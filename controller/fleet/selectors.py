"""Kubernetes-style label selectors for targeting devices.

Grammar (requirements joined by commas, all must hold):
  key=value | key==value | key!=value | key in (v1,v2) | key notin (v1,v2) | key | !key
Keys and values: letters, digits, '-', '_', '.', '/' (keys) — as on devices' labels.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from controller.errors import InvalidError

_KEY = r"[A-Za-z0-9]([A-Za-z0-9_.\-/]{0,61}[A-Za-z0-9])?"
_VALUE = r"[A-Za-z0-9]([A-Za-z0-9_.\-]{0,61}[A-Za-z0-9])?"
_KEY_RE = re.compile(rf"^{_KEY}$")
_VALUE_RE = re.compile(rf"^({_VALUE})?$")


class SelectorError(InvalidError):
    """A selector that cannot be parsed; the message points at the offending part."""


class Op(StrEnum):
    EQ = "="
    NE = "!="
    IN = "in"
    NOTIN = "notin"
    EXISTS = "exists"
    NOT_EXISTS = "!exists"


@dataclass(frozen=True)
class Requirement:
    key: str
    op: Op
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        match self.op:
            case Op.EQ | Op.IN:
                return present and value in self.values
            case Op.NE | Op.NOTIN:
                # As in Kubernetes: a device without the key satisfies "!=" and "notin".
                return not present or value not in self.values
            case Op.EXISTS:
                return present
            case Op.NOT_EXISTS:
                return not present
        return False  # pragma: no cover - exhaustive above


@dataclass(frozen=True)
class Selector:
    requirements: tuple[Requirement, ...]
    text: str

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)

    def __str__(self) -> str:
        return self.text


def _split(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError("unbalanced ')'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise SelectorError("unbalanced '('")
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _key(key: str, part: str) -> str:
    if not _KEY_RE.match(key):
        raise SelectorError(f"invalid label key {key!r} in {part!r}")
    return key


def _value(value: str, part: str) -> str:
    if not _VALUE_RE.match(value):
        raise SelectorError(f"invalid label value {value!r} in {part!r}")
    return value


_SET_RE = re.compile(r"^(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")


@functools.lru_cache(maxsize=1024)
def parse_selector(text: str) -> Selector:
    """Parse ``text``; an empty selector matches every device. Cached: a Selector is immutable, and
    every device's desired state parses every pool's selector."""
    if len(text) > 1024:
        raise SelectorError("selector longer than 1024 characters")
    stripped = text.strip()
    if not stripped:
        return Selector((), "")
    reqs: list[Requirement] = []
    for part in _split(stripped):
        if not part:
            raise SelectorError(f"empty requirement in {text!r}")
        if m := _SET_RE.match(part):
            values = [v.strip() for v in m["values"].split(",")]
            if not values or any(v == "" for v in values):
                raise SelectorError(f"empty value list in {part!r}")
            op = Op.IN if m["op"] == "in" else Op.NOTIN
            reqs.append(Requirement(_key(m["key"], part), op, frozenset(_value(v, part) for v in values)))
        elif "!=" in part:
            k, v = (s.strip() for s in part.split("!=", 1))
            reqs.append(Requirement(_key(k, part), Op.NE, frozenset({_value(v, part)})))
        elif "=" in part:
            k, v = (
                (s.strip() for s in part.split("==", 1))
                if "==" in part
                else (s.strip() for s in part.split("=", 1))
            )
            if "=" in v:
                raise SelectorError(f"unexpected '=' in {part!r}")
            reqs.append(Requirement(_key(k, part), Op.EQ, frozenset({_value(v, part)})))
        elif part.startswith("!"):
            reqs.append(Requirement(_key(part[1:].strip(), part), Op.NOT_EXISTS))
        else:
            if " " in part or "(" in part:
                raise SelectorError(f"cannot parse {part!r}: expected key=value, key in (a,b), key or !key")
            reqs.append(Requirement(_key(part, part), Op.EXISTS))
    return Selector(tuple(reqs), stripped)
