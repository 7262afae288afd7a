"""Stand-in for ``flash_mla.flash_mla_interface``: the empty schedule object SGLang's builders hold."""

import _placeholder


class FlashMLASchedMeta:
    """An empty FlashMLA schedule (what the real class holds before the first decode call fills it)."""

    def __init__(self):
        self.tile_scheduler_metadata = None
        self.num_splits = None


_placeholder.make_package("flash_mla", __import__("sys").modules[__name__])
