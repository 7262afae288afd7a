"""Stand-in for ``flash_mla`` (sgl-flash-mla, FlashMLA's CUDA kernels): see ``_placeholder``.

``get_mla_metadata()`` is the one call SGLang's metadata builders make without attention running
(``_create_flashmla_metadata``): it returns an empty schedule, as the real one does before the first decode call
fills it. Everything else raises when called."""

import _placeholder

from .flash_mla_interface import FlashMLASchedMeta


def get_mla_metadata(*args, **kwargs):
    if args or kwargs:
        raise _placeholder.StandInCalled("flash_mla.get_mla_metadata(...): a stand-in (only the empty form runs)")
    return FlashMLASchedMeta(), None


_placeholder.make_package("flash_mla", __import__("sys").modules[__name__])
