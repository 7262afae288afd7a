"""The targets docs/PERF.md checks a run's figures against: each table that shows one says whether the run met
it; none is used as a figure. Cold figures (the L2 flushed or inputs rotated past it), us unless named otherwise;
set for DeepSeek-V4 decode on one H200-class GPU.
"""

from __future__ import annotations

__all__ = [
    "FROM_HIDDEN_TARGETS_US",
    "ONLINE_READ_TARGET_PCT",
    "ONLINE_DECODE_TARGETS",
    "ONLINE_STATE_FACTOR_TARGET",
    "CACHE_STEP_TARGET_US",
]

#: The steps from hidden states, keyed ``(phase, model, kind, B)``: the whole CSA layer (both projections and
#: compressions) and the HCA layer (projection and online compression) at B = 16 / 64 (T = 64 / 256 rows), and
#: the whole V4-Flash decode step (``model-hidden``, kind ``""``) at B = 16 / 64.
FROM_HIDDEN_TARGETS_US = {
    ("layer", "flash", "csa", 16): 8.0,
    ("layer", "flash", "csa", 64): 10.0,
    ("layer", "flash", "hca", 16): 4.0,
    ("layer", "flash", "hca", 64): 5.0,
    ("model-hidden", "flash", "", 16): 300.0,
    ("model-hidden", "flash", "", 64): 400.0,
}
#: The online backend on a 64K prefill chunk: read bandwidth over the measured copy bandwidth, percent.
ONLINE_READ_TARGET_PCT = 60.0
#: The online backend's HCA decode (S = 4 rows per request, CUDA graph figures): every-closes time over
#: none-closes time, online over tiled on each, and the slowest boundary case per batch size (us per layer).
ONLINE_DECODE_TARGETS = {
    "every_over_none": 1.1,
    "vs_tiled_every": 0.5,
    "vs_tiled_none": 1.0,
    "us_per_layer": {16: 2.0, 64: 3.5, 256: 7.0},
}
#: HCA state per request and layer: the ring backends' over the online backend's (at least this factor).
ONLINE_STATE_FACTOR_TARGET = 20.0
#: Host time of one ``cache.step`` per layer at B = 256 decode (below this).
CACHE_STEP_TARGET_US = 50.0
