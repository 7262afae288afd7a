"""GPU benchmark of the compressor backends (``dsv4-compressor bench``; see :mod:`.cli`).

Modules:

- :mod:`.cases`: the :class:`~.cases.Case` dataclass, the presets (``quick``, ``c128``, ``online``, ``full``)
  and the positions each step supplies (boundary cases ``none``, ``every``, ``realistic``).
- :mod:`.floors`: bytes each step must move (the formulas), the floors, the memory table. Pure Python.
- :mod:`.timing`: the one timing function (CUDA events around graph replays or eager calls), graph capture,
  the copy-bandwidth and launch floors.
- :mod:`.runner`: builds layer instances and runs one case (decode or prefill).
- :mod:`.report`, :mod:`.plot`: the markdown table, the JSON file, ``docs/PERF.md``, the PNG plot.
"""
