"""The controller's domain errors: one base, a few meanings, no transport codes.

Services raise these (or their own subclasses of them); the HTTP layer maps each meaning to a status
in one place (``controller.api.errors``), and the CLI and workers read the message.

::

    ControllerError
     ├─ NotFoundError        a device, model, deployment or camera the request names does not exist
     ├─ ConflictError        cannot be done in the current state (a name in use, a model still deployed)
     ├─ InvalidError         the request itself is wrong (a bad selector, bad waves, a missing field)
     │   ├─ MalformedError   what was sent cannot be read or used at all (not multipart, not a model)
     │   └─ TooLargeError    what was sent is over a size limit
     ├─ UnavailableError     a part the request needs is not there right now (broker, device, admin)
     │   └─ TimedOutError    a device did not answer in time
     └─ DeviceError          a device answered, with an error of its own or something unusable
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


class MalformedError(InvalidError):
    """What was sent cannot be read or used at all (a body that does not parse, a file that is not a
    usable model); the message says why."""


class TooLargeError(InvalidError):
    """What was sent is over a size limit; the message names the limit."""


class UnavailableError(ControllerError):
    """A part the request needs is not there right now (broker, device, broker admin); try again later."""


class TimedOutError(UnavailableError):
    """A device (or another part the request waited on) did not answer in time."""


class DeviceError(ControllerError):
    """A device answered, but with an error of its own or with something that cannot be used."""
