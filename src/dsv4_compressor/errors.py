"""The library's exceptions. All are ``ValueError``s: bad input, refused before anything changes."""

from __future__ import annotations

__all__ = ["StepError", "CapacityError", "OpError"]


class StepError(ValueError):
    """A refused cache step or read. The cache is unchanged when this is raised."""


class CapacityError(StepError):
    """A step needs more than a buffer was sized for (scratch rows of the C128 workspace, output pages of the
    pool); raised before anything is launched or allocated."""


class OpError(ValueError):
    """An op refused its arguments (raised before anything is launched)."""
