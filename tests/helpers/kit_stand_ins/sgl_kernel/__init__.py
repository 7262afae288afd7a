"""Stand-in for ``sgl_kernel`` (CUDA kernels SGLang imports on a CUDA machine off the compressor path): see
``_placeholder``. Every name is a placeholder that raises when called."""

import _placeholder

# the submodules SGLang 0.5.23 imports at module level without a fallback (GGUF, HiSparse)
_placeholder.make_package("sgl_kernel", __import__("sys").modules[__name__], ("quantization", "kvcacheio"))
