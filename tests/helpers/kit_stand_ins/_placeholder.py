"""Import-only stand-ins for CUDA kernel packages the engine kit does not carry (tests/helpers/engine_kit.py).

SGLang 0.5.23 imports ``flash_mla`` (its backend's constructor, ``flash_mla_interface``), ``sgl_kernel`` (module
level, under ``is_cuda()``: quantization, GGUF, HiSparse) and ``deep_gemm`` (the DeepSeek-V4 model and the
indexer's top-k metadata) on a CUDA machine; none of them is on the compressor path. Every name these modules are
asked for is a placeholder class that raises when it is called or instantiated, so a compressor path that
reached one would fail loudly instead of computing something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class StandInCalled(RuntimeError):
    """A stand-in's placeholder was called: the path reached kernel code the kit does not carry."""


def placeholder(qualname: str):
    def absent(*args, **kwargs):
        raise StandInCalled(f"{qualname}: a stand-in of the engine kit (the real CUDA package is not carried)")

    return type(qualname.rsplit(".", 1)[-1], (), {"__new__": lambda cls, *a, **k: absent(), "__call__": absent,
                                                   "__qualname__": qualname})  # fmt: skip


class StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The named submodules of a stand-in package (``sgl_kernel.quantization``: SGLang imports them at module
    level, unguarded) are stand-in modules too; any other submodule is absent (an ImportError), so SGLang's own
    ``try: from sgl_kernel.x import ... except ImportError`` fallbacks still take their fallback."""

    def __init__(self):
        self.submodules: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname in self.submodules:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def make_package(name: str, module: types.ModuleType, submodules=()) -> None:
    """Turn the stand-in package's own module into a :class:`StandInModule` (its defined names stay) and
    register its stand-in ``submodules``."""
    module.__class__ = StandInModule
    finder = next((f for f in sys.meta_path if isinstance(f, _Finder)), None)
    if finder is None:
        finder = _Finder()
        sys.meta_path.append(finder)
    finder.submodules.update(f"{name}.{s}" for s in submodules)
