"""Adapters that put the ops inside serving engines and models, one engine per module.

* :mod:`.lightllm`: LightLLM (``support_ds4``): ``CompressorInfer.compress`` and ``write_indexer_k``.
* :mod:`.vllm`: vLLM (``DeepseekCompressor.forward``).
* :mod:`.sglang`: SGLang (``CompressorBackendMixin.forward_unified``).
* :mod:`.transformers`: Hugging Face DeepSeek-V4 generation with our compressor in place of the eager one.

Each builds the plan (and the state-row tables its engine's addressing needs) once per step from the
engine's own per-step metadata and calls one op per layer and compressor on the engine's own buffers. None
of them imports its engine at import time; ``install()`` patches an engine only when it is importable.
"""
