"""The library's exceptions: bad input (``ValueError``s, refused before anything changes) and the engine
adapters' two kinds of refusal, which each adapter names for its engine (``SGLangModeNotSupported`` is an
:class:`EngineModeNotSupported`, ``LightLLMNotInstalled`` an :class:`EngineNotInstalled`, ...)."""

from __future__ import annotations

__all__ = ["StepError", "CapacityError", "OpError", "EngineNotInstalled", "EngineModeNotSupported"]


class StepError(ValueError):
    """A refused cache step or read. The cache is unchanged when this is raised."""


class CapacityError(StepError):
    """A step needs more than a buffer was sized for (scratch rows of the C128 workspace, output pages of the
    pool); raised before anything is launched or allocated."""


class OpError(ValueError):
    """An op refused its arguments (raised before anything is launched)."""


class EngineNotInstalled(ImportError):
    """An adapter's ``install()`` found no importable engine (or not the release the adapter follows)."""


class EngineModeNotSupported(OpError):
    """An engine mode or setting an adapter does not serve, refused at install or where the engine builds the
    layer's buffers (before any forward or graph capture); the message names the mode and what to do."""
