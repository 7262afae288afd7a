"""GPU benchmark of the compressor ops (``dsv4-compressor bench``; see :mod:`.cli`).

Modules:

- :mod:`.cases`: the :class:`~.cases.Case` dataclass (phases ``decode``, ``prefill``, ``plan``, ``dispatch``,
  ``cache-step``, ``model``), the presets (``quick``, ``c128``, ``online``, ``host``, ``model``, ``full``), the
  positions each step supplies, and the byte and memory counts of the whole-model steps. Pure Python.
- :mod:`.floors`: bytes each step must move (the formulas), the floors, the memory table. Pure Python.
- :mod:`.layers`: layers driven as an engine drives them: the step's metadata and plan, each layer's op.
- :mod:`.timing`: the timing functions (CUDA events around graph replays or eager calls; host wall time per
  call), graph capture, the copy-bandwidth and launch floors.
- :mod:`.runner`: runs one case of any phase.
- :mod:`.results`: the results JSON (schema, writing, reading), number formats and the stdout summary.
- :mod:`.env`: the environment a run is recorded with (date, GPU, versions, git commit).

``docs/PERF.md`` and its plot are made from the results JSON by ``scripts/write_perf.py``
(``dsv4_compressor.bench.report``).
"""
