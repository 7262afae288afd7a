"""Diagnostics that still answer a live question; each prints or writes tables, none checks bytes.

* :mod:`.tune_kernels`: which launch settings (warps, tiles, one launch or two, programmatic dependent launch)
  are fastest on this GPU for the bench's cases and the whole model step? ``scripts/tune_check.sh`` runs it on
  the GPU with ``bench --quick`` and Nsight Compute profiles
  (``python -m benchmarks.probes.tune_kernels OUT_DIR --families single,tiled,online``).
* :mod:`.host_profile`: where does the host time of ``CompressedKVCache.step`` go (validation, backend, ops,
  launchers, triton's run)? On a CPU through the compile check's stand-in driver, or ``--device cuda``
  (``python -m benchmarks.probes.host_profile``).
* :mod:`.tune_projection`: which blocks make the projection kernel fastest per weight shape and step size, and
  where does it stand against cuBLAS? (``python -m benchmarks.probes.tune_projection OUT_DIR``, GPU).
"""
