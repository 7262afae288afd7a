"""Stand-ins of serving engines that do not install on a CPU machine, for the tests and the multi-GPU harness.

* :mod:`.lightllm_sim`: LightLLM's DeepSeek-V4 memory manager, request manager, ``infer_state`` and compressor
  objects (``python -m dsv4_compressor.testing.lightllm_sim capacity`` prints the admitted-tokens table of
  docs/INTEGRATION.md).
"""
