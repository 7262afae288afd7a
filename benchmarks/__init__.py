"""GPU benchmarks of the compressor ops (``dsv4-compressor bench``, or ``python -m benchmarks`` from the repository
root; see :mod:`.cli`). They live next to the package in a checkout of the repository and are not installed.

Modules:

- :mod:`.cases`: the :class:`~.cases.Case` dataclass (phases ``decode``, ``prefill``, ``plan``, ``dispatch``,
  ``cache-step``, ``model``, ``projection``, ``layer``, ``model-hidden``), the presets (``quick``, ``c128``,
  ``online``, ``host``, ``model``, ``projection``, ``full``), the positions each step supplies, and the byte and
  memory counts of the whole-model steps. Pure Python.
- :mod:`.floors`: bytes each step must move (the formulas), the floors, the memory table. Pure Python.
- :mod:`.layers`: layers driven as an engine drives them: the step's metadata and plan, each layer's op.
- :mod:`.timing`: the timing functions (CUDA events around graph replays or eager calls; host wall time per
  call), graph capture, the copy-bandwidth and launch floors.
- :mod:`.runner`: runs one case of any phase (:mod:`.hidden_runs`: the whole-step phases and those from hidden
  states).
- :mod:`.results`: the results JSON (schema, writing, reading), number formats and the stdout summary.
- :mod:`.env`: the environment a run is recorded with (date, GPU, versions, git commit).
- :mod:`.report`: ``docs/PERF.md`` and its plot from the results JSON (``scripts/write_perf.py``).
- :mod:`.probes`: diagnostics (launch-setting sweeps, the host-time split, the projection's blocks).
- :mod:`.multi_gpu`: the engine-shaped multi-GPU harness of the LightLLM adapter (``scripts/multi_gpu_run.py``,
  under ``torchrun``; ``scripts/multi_gpu_check.sh``).
- :mod:`.engine_checks`: the GPU check of the indexer packs and the C128 ring decode against SGLang's and
  LightLLM's own kernels (``scripts/engine_pack_check.py``).
"""
