"""The benchmark's cases: what one measurement is, the presets, and the positions each step supplies.

A :class:`Case` is one (phase, kind, backend, shape) point. Decode cases time a CUDA graph holding
``instances`` layer instances (distinct caches, inputs, states and pages; DeepSeek-V4-Flash has 20 HCA layers)
and report the replay time divided by ``instances``. Prefill cases time one instance on one request. The
reference backend is eager PyTorch and is timed eagerly on one instance.

Boundary cases of a decode step (``S`` rows per request, ratio ``r``, group index ``g``):

- ``none``: no request closes a group: ``start = g*r + 1`` (``g*r`` when ``S = r - 1``); impossible when
  ``S >= r`` (CSA and the indexer at ``S = 4``), reported as n/a.
- ``every``: every request's last row closes group ``g``: ``start = g*r + r - S``.
- ``realistic``: requests at random lengths (``start`` uniform in ``[r, r * SPAN_GROUPS)``), so about ``S/r``
  of them close a group per step.

Rotated input copies use group ``g = 1 + copy`` (so each copy writes other ring rows) or, for ``realistic``,
fresh random lengths; the random lengths depend on the kind, ``B``, ``S`` and the copy, not on the backend,
so every backend times the same steps.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, replace

import numpy as np

from .floors import Traffic, kind_config, state_model, step_traffic

__all__ = [
    "Case",
    "KINDS",
    "BACKENDS",
    "BATCHES",
    "ROWS_PER_REQUEST",
    "BOUNDARIES",
    "CHUNKS",
    "PRESETS",
    "PREFILL_MTP_STEP",
    "SPAN_GROUPS",
    "preset_cases",
    "full_cases",
    "filter_cases",
    "decode_starts",
    "prefill_start",
    "case_traffic",
    "choose_copies",
]

KINDS = ("hca", "csa", "indexer")
BACKENDS = ("reference", "triton-single", "triton-tiled", "online")
BATCHES = (1, 16, 64, 256)
ROWS_PER_REQUEST = (1, 4)
BOUNDARIES = ("none", "every", "realistic")
CHUNKS = (512, 8192, 65536)
CARRIES = (False, True)
PRESETS = ("full", "quick", "c128", "online")

#: Prefill steps run with the DeepSeek-V4 MTP setting (ring of 132 rows for HCA).
PREFILL_MTP_STEP = 3
#: Realistic decode lengths are drawn from ``[r, r * SPAN_GROUPS)``.
SPAN_GROUPS = 64
#: The reference backend is eager PyTorch request by request: timed at small batches only.
REFERENCE_MAX_BATCH = 16
REFERENCE_MAX_CHUNK = 8192
#: Eager timings (next to the graph ones) for graph cases up to this batch.
EAGER_MAX_BATCH = 64
#: Backends that exist for non-overlapping kinds only (CSA and the indexer always run single-stage ring
#: kernels; the online backend falls back to them).
HCA_ONLY_BACKENDS = ("triton-tiled", "online")


@dataclass(frozen=True)
class Case:
    """One measurement.

    Args:
        phase: ``"decode"`` or ``"prefill"``.
        kind: ``"hca"``, ``"csa"`` or ``"indexer"``.
        backend: one of :data:`BACKENDS`.
        batch: requests in the step (decode); prefill cases have one request.
        rows: decode rows per request ``S`` (``mtp_step = S - 1``).
        boundary: decode boundary case (``none``, ``every``, ``realistic``).
        chunk: prefill rows.
        carry: prefill starts after a carried partial group of ``r // 2`` rows.
        instances: layer instances per CUDA graph (the figure is the replay time / instances).
        timing: ``"graph"`` (CUDA graph replay) or ``"eager"`` (only eager launches, the reference backend).
        eager: also time eager launches of the same instances.
        group: the preset group it belongs to (for the report: ``c128``, ``online-prefill``, ...).
    """

    phase: str
    kind: str
    backend: str
    batch: int = 1
    rows: int = 0
    boundary: str = ""
    chunk: int = 0
    carry: bool = False
    instances: int = 1
    timing: str = "graph"
    eager: bool = False
    group: str = ""

    @property
    def id(self) -> str:
        if self.phase == "decode":
            return f"decode/{self.kind}/{self.backend}/B{self.batch}/S{self.rows}/{self.boundary}"
        return f"prefill/{self.kind}/{self.backend}/{self.chunk}/{'carry' if self.carry else 'no-carry'}"

    @property
    def mtp_step(self) -> int:
        return self.rows - 1 if self.phase == "decode" else PREFILL_MTP_STEP

    def not_applicable(self) -> str | None:
        """Why this case cannot exist (reported as n/a), or ``None``."""
        cfg = kind_config(self.kind)
        if self.phase == "decode" and self.boundary == "none" and self.rows >= cfg.ratio:
            return f"no step of {self.rows} rows avoids a boundary at r={cfg.ratio}"
        return None

    def as_dict(self) -> dict:
        out = asdict(self)
        out["id"] = self.id
        out["mtp_step"] = self.mtp_step
        return out


# -------------------------------------------------------------------------------------------------
# Matrices
# -------------------------------------------------------------------------------------------------
def _decode(kind, backend, batch, rows, boundary, *, instances, group="") -> Case:
    if backend == "reference":
        return Case("decode", kind, backend, batch, rows, boundary, instances=1, timing="eager", group=group)
    return Case(
        "decode",
        kind,
        backend,
        batch,
        rows,
        boundary,
        instances=instances,
        eager=batch <= EAGER_MAX_BATCH,
        group=group,
    )


def _prefill(kind, backend, chunk, carry, *, group="") -> Case:
    timing = "eager" if backend == "reference" else "graph"
    return Case("prefill", kind, backend, chunk=chunk, carry=carry, timing=timing, eager=True, group=group)


def full_cases(
    *,
    kinds=KINDS,
    backends=BACKENDS,
    batches=BATCHES,
    rows=ROWS_PER_REQUEST,
    boundaries=BOUNDARIES,
    chunks=CHUNKS,
    carries=CARRIES,
    instances: int = 20,
    decode: bool = True,
    prefill: bool = True,
) -> list[Case]:
    """The whole matrix over the given axes. Tiled and online run on HCA only; the reference backend at
    ``B <= 16`` and chunks ``<= 8K`` only (eager, one instance)."""
    cases = []
    for kind in kinds:
        overlap = kind_config(kind).overlap
        usable = [b for b in backends if not (overlap and b in HCA_ONLY_BACKENDS)]
        if decode:
            for s in rows:
                for boundary in boundaries:
                    for batch in batches:
                        for backend in usable:
                            if backend == "reference" and batch > REFERENCE_MAX_BATCH:
                                continue
                            cases.append(_decode(kind, backend, batch, s, boundary, instances=instances))
        if prefill:
            for chunk in chunks:
                for carry in carries:
                    for backend in usable:
                        if backend == "reference" and chunk > REFERENCE_MAX_CHUNK:
                            continue
                        cases.append(_prefill(kind, backend, chunk, carry))
    return cases


def _c128_cases(instances: int) -> list[Case]:
    """HCA decode, head 512, S = 4 (mtp_step 3), B = 16, 64, 256, boundaries none and every: single-stage vs
    tiled (and online), a CUDA graph of ``instances`` layers, replay / instances."""
    return [
        _decode("hca", backend, batch, 4, boundary, instances=instances, group="c128")
        for boundary in ("none", "every")
        for batch in (16, 64, 256)
        for backend in ("triton-single", "triton-tiled", "online")
    ]


def _online_prefill_cases() -> list[Case]:
    """HCA prefill of a 64K-token chunk (and 8K), one request, with and without a carried partial group:
    online against tiled (the online target: >= 60% of the copy bandwidth on the bytes it must read)."""
    return [
        _prefill("hca", backend, chunk, carry, group="online-prefill")
        for chunk in (65536, 8192)
        for carry in (False, True)
        for backend in ("online", "triton-tiled")
    ]


def preset_cases(preset: str, *, instances: int = 20) -> list[Case]:
    """Cases of a named preset (``full`` is :func:`full_cases` with its defaults).

    ``quick`` (one device call, under 3 minutes of GPU time): the ``c128`` and ``online`` presets, realistic
    HCA decode at B = 64 (tiled, online), CSA and indexer decode at B = 16 and 256 (S = 4, every request
    closes), and the reference backend eagerly at B = 16.
    """
    if preset == "full":
        return full_cases(instances=instances)
    if preset == "c128":
        return _c128_cases(instances)
    if preset == "online":
        online_decode = [c for c in _c128_cases(instances) if c.backend == "online"]
        return _online_prefill_cases() + online_decode
    if preset == "quick":
        cases = _c128_cases(instances) + _online_prefill_cases()
        cases += [
            _decode("hca", backend, 64, 4, "realistic", instances=instances, group="realistic")
            for backend in ("triton-tiled", "online")
        ]
        cases += [
            _decode(kind, "triton-single", batch, 4, "every", instances=instances, group="csa-indexer")
            for kind in ("csa", "indexer")
            for batch in (16, 256)
        ]
        cases += [
            _decode("hca", "reference", 16, 4, boundary, instances=1, group="reference")
            for boundary in ("none", "every")
        ]
        cases += [
            _decode(kind, "reference", 16, 4, "every", instances=1, group="reference") for kind in ("csa", "indexer")
        ]
        return cases
    raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def filter_cases(
    cases: list[Case],
    *,
    kinds=None,
    backends=None,
    batches=None,
    rows=None,
    boundaries=None,
    chunks=None,
    carries=None,
    decode: bool = True,
    prefill: bool = True,
    instances: int | None = None,
) -> list[Case]:
    """Keep the cases matching every given axis (``None`` keeps all); ``instances`` overrides graph cases'."""
    out = []
    for c in cases:
        if kinds is not None and c.kind not in kinds:
            continue
        if backends is not None and c.backend not in backends:
            continue
        if c.phase == "decode":
            if not decode:
                continue
            if batches is not None and c.batch not in batches:
                continue
            if rows is not None and c.rows not in rows:
                continue
            if boundaries is not None and c.boundary not in boundaries:
                continue
        else:
            if not prefill:
                continue
            if chunks is not None and c.chunk not in chunks:
                continue
            if carries is not None and c.carry not in carries:
                continue
        if instances is not None and c.phase == "decode" and c.timing == "graph":
            c = replace(c, instances=instances)
        out.append(c)
    return list(dict.fromkeys(out))


# -------------------------------------------------------------------------------------------------
# Positions and bytes
# -------------------------------------------------------------------------------------------------
def decode_starts(case: Case, copy: int = 0, *, seed: int = 0) -> list[int] | None:
    """Start position of each request of a decode case's step, for rotated input copy ``copy``
    (``None`` when the boundary case is impossible)."""
    if case.not_applicable():
        return None
    r, s, b = kind_config(case.kind).ratio, case.rows, case.batch
    g = 1 + copy
    if case.boundary == "none":
        return [g * r + (1 if s <= r - 2 else 0)] * b
    if case.boundary == "every":
        return [g * r + r - s] * b
    if case.boundary == "realistic":
        key = zlib.crc32(f"{case.kind}/{b}/{s}/{copy}/{seed}".encode())
        rng = np.random.default_rng(key)
        return [int(x) for x in rng.integers(r, r * SPAN_GROUPS, size=b)]
    raise ValueError(f"unknown boundary case {case.boundary!r}; choose one of {', '.join(BOUNDARIES)}")


def prefill_start(case: Case) -> int:
    """A prefill chunk starts at 0, or after a carried partial group of ``r // 2`` rows."""
    return kind_config(case.kind).ratio // 2 if case.carry else 0


def case_traffic(case: Case, copy: int = 0, *, seed: int = 0) -> Traffic | None:
    """Bytes one layer of this case must move in the step of input copy ``copy``."""
    cfg = kind_config(case.kind)
    state = state_model(case.backend, cfg)
    if case.phase == "decode":
        starts = decode_starts(case, copy, seed=seed)
        if starts is None:
            return None
        return step_traffic(cfg, starts, [case.rows] * case.batch, state=state, mtp_step=case.mtp_step)
    return step_traffic(cfg, [prefill_start(case)], [case.chunk], state=state, mtp_step=case.mtp_step)


def choose_copies(
    *, bytes_per_replay: float, bytes_per_copy: float, l2_bytes: int, max_copies: int, max_copy_bytes: int
) -> int:
    """Input copy sets to rotate so that ``copies * bytes_per_replay >= 2 * l2_bytes``, within
    ``max_copies`` and ``copies * bytes_per_copy <= max_copy_bytes`` (at least one)."""
    need = 1 if bytes_per_replay <= 0 else -(-int(2 * l2_bytes) // max(1, int(bytes_per_replay)))
    by_memory = max(1, int(max_copy_bytes // max(1, int(bytes_per_copy))))
    return max(1, min(need, max_copies, by_memory))
