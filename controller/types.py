"""Identifier and label rules of the controller, spelled once.

Identifiers (device ids, camera ids, registry names) are the wire contract's (``fleet_protocol.ids``);
labels are the controller's own (Kubernetes-style keys and values, fed to selectors).
"""

from __future__ import annotations

import re

from fleet_protocol.ids import ID_MAX, ID_PATTERN, CameraId, DeviceId, Name, valid_id

__all__ = [
    "CAMERA_OR_ANY_PATTERN",
    "ID_MAX",
    "ID_PATTERN",
    "NO_NUL_PATTERN",
    "CameraId",
    "DeviceId",
    "Name",
    "check_labels",
    "valid_id",
]

# Query strings and names reach the database; PostgreSQL refuses NUL in text, which must be a 422.
NO_NUL_PATTERN = r"^[^\x00]*$"
# A deployment's camera: one camera id, or "*" for every camera of a device.
CAMERA_OR_ANY_PATTERN = r"^(\*|[A-Za-z0-9][A-Za-z0-9_.-]{0,63})$"

_LABEL_KEY = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.\-/]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9_.\-]{0,61}[A-Za-z0-9])?)?")


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """``labels`` unchanged when every key and value is plain; else ValueError naming the first bad one."""
    for k, v in labels.items():
        if not _LABEL_KEY.fullmatch(k):
            raise ValueError(f"label key {k!r}: letters, digits and -_./ inside, at most 63 characters")
        if not _LABEL_VALUE.fullmatch(v):
            raise ValueError(f"label {k}: value {v!r}: letters, digits and -_. inside, at most 63 characters")
    return labels
