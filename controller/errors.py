"""The controller's domain errors: one base, four meanings, no transport codes.

Services raise these; the HTTP layer maps each meaning to a status in one place
(``controller.api.errors``), and the CLI and workers read the message.
"""

from __future__ import annotations


class ControllerError(Exception):
    """Something the caller asked for cannot be done; the message says what and why."""


class NotFoundError(ControllerError, LookupError):
    """A device, model, deployment or camera the request names does not exist; the message says which."""


class ConflictError(ControllerError, ValueError):
    """The request cannot be met in the current state (an unfit pinned variant, a name in use)."""


class InvalidError(ControllerError, ValueError):
    """The request itself is wrong (a bad selector, a model that fails its checks); the message says where."""


class UnavailableError(ControllerError):
    """A part the request needs is not there right now (broker, device, broker admin); try again later."""
