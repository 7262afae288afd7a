"""The engines' plugin entry points, inert and cheap unless their switch is set.

vLLM calls every ``vllm.general_plugins`` entry point in its engine core and in every worker, and SGLang loads
``sglang.srt.plugins`` in each of its processes (scheduler, detokenizer, DP controller), for every model. These
two functions are what this package declares there (``pyproject.toml``): each reads its engine's switch and,
unset or off, returns at once. Importing this module imports the standard library's ``os`` and
``importlib`` and this package's (lazy) ``__init__`` only: not torch, not Triton, not the kernels, not the
adapters. Only a set switch imports the adapter, whose ``register()`` then validates the value and installs.

* :func:`vllm`: ``$VLLM_DSV4C`` (``VLLM_``-prefixed, so vLLM forwards it to Ray workers), or ``$DSV4C_VLLM``
  when that is unset; off: unset, empty, ``off`` or ``0``. Delegates to
  :func:`dsv4_compressor.integrations.vllm.register`.
* :func:`sglang`: ``$DSV4C_SGLANG``; off: unset, empty, ``0``, ``off``, ``false`` or ``no``. Delegates to
  :func:`dsv4_compressor.integrations.sglang.register`.

Calling the adapters' ``register()`` directly works as before (the same switch, the same errors).
"""

from __future__ import annotations

import importlib
import os

__all__ = ["VLLM_ENV", "VLLM_ENV_ALIAS", "VLLM_OFF", "SGLANG_ENV", "SGLANG_OFF", "vllm_switch", "vllm", "sglang"]

#: The variable the vLLM entry point reads, and the earlier name read when it is unset (not forwarded to Ray).
VLLM_ENV, VLLM_ENV_ALIAS = "VLLM_DSV4C", "DSV4C_VLLM"
#: Values (stripped, lower-cased) that leave vLLM alone.
VLLM_OFF = ("", "off", "0")
#: The variable the SGLang entry point reads (``integrations.sglang.PLUGIN_ENV``).
SGLANG_ENV = "DSV4C_SGLANG"
#: Values (stripped, lower-cased) that leave SGLang alone (as ``integrations.sglang.register`` reads them).
SGLANG_OFF = ("", "0", "off", "false", "no")


def vllm_switch() -> tuple[str, str | None]:
    """``(name, raw value)`` of the vLLM switch in effect: ``$VLLM_DSV4C`` if set (even empty), else
    ``$DSV4C_VLLM``; the value is ``None`` when neither is set."""
    raw = os.environ.get(VLLM_ENV)
    if raw is not None:
        return VLLM_ENV, raw
    return VLLM_ENV_ALIAS, os.environ.get(VLLM_ENV_ALIAS)


def vllm():
    """The ``vllm.general_plugins`` entry point: ``None`` (nothing imported, nothing patched) unless the switch
    is on; then :func:`dsv4_compressor.integrations.vllm.register`'s result (an ``Installation``) or error."""
    if (vllm_switch()[1] or "").strip().lower() in VLLM_OFF:
        return None
    return importlib.import_module(".vllm", __package__).register()


def sglang():
    """The ``sglang.srt.plugins`` entry point: ``None`` (nothing imported) unless ``$DSV4C_SGLANG`` is on; then
    :func:`dsv4_compressor.integrations.sglang.register` (which exits the process on a value it refuses)."""
    if os.environ.get(SGLANG_ENV, "").strip().lower() in SGLANG_OFF:
        return None
    return importlib.import_module(".sglang", __package__).register()
