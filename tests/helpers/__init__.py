"""The test suite's helpers (CPU modules under the Triton interpreter, and the GPU modules), by what they build.

- :mod:`.session`: where kernels run in this process, the session summary's note on the GPU modules, and
  :func:`~.session.engine_casts_round_to_nearest_even` (an engine's Triton kernel as a reference under the
  interpreter);
- :mod:`.inputs`: small configurations (``HCA_SMALL``, ``CSA_SMALL``, ``INDEXER_CFG``), parameters, rows, caches;
- :mod:`.buffers`: poison and raw bytes of engine buffers, and the engine path of a step (:func:`launch_step`);
- :mod:`.model`: :class:`StreamModel`, the reference every cache is checked against;
- :mod:`.checks`: the assertions (:func:`check_all`, :func:`check_outputs`, :func:`check_ring`,
  :func:`assert_unchanged`);
- :mod:`.guards`: guard bands around every buffer a kernel writes (:class:`GuardedRun`);
- :mod:`.schedules`: step schedules that cover every path of the streaming contract;
- :mod:`.lightllm_sim`: stand-ins of LightLLM's DeepSeek-V4 serving objects (LightLLM does not install on a CPU
  machine), for the LightLLM adapter's tests and the multi-GPU harness (``benchmarks/multi_gpu/``,
  ``scripts/multi_gpu_run.py``).

Nothing here imports Triton at module level: ``tests/conftest.py`` decides whether kernels run under the
interpreter (``TRITON_INTERPRET``) before the first kernel module is imported; helpers that launch kernels
import them when called. Test modules import the helper modules directly (``from helpers.inputs import ...``).
"""
