"""The benchmark's cases: what one measurement is, the presets, and the positions each step supplies.

A :class:`Case` is one measurement. Its ``phase`` says what is timed:

- ``decode``: one layer kind and backend. A CUDA graph holds ``instances`` layer instances (distinct states,
  pages and input rows; DeepSeek-V4-Flash has 20 HCA layers) and the figure is replay time / instances, timed
  two ways: *cold* (input copy sets rotate until the bytes they touch exceed twice the L2) and *warm* (one
  input set replayed back to back, so whatever of the instances' bytes fits stays in L2). The reference
  backend is eager PyTorch, timed eagerly on one instance.
- ``prefill``: one instance, one request, one chunk of ``chunk`` rows (cold).
- ``plan``: ``ops.build_plan`` for a step of ``chunk`` rows and ``batch`` requests: a CUDA graph of
  ``instances`` launches, time per launch.
- ``dispatch``: host time per eager call of the Python launchers (``ops.compress``, ``ops.build_plan``)
  against the same ops called through ``torch.ops.dsv4c`` (the dispatcher's overhead).
- ``cache-step``: host time of one ``CompressedKVCache.step`` of a decode batch (validation, the metadata
  upload, the launches; the device is idle when each call starts).
- ``model``: a whole model's decode step, every compressor layer of DeepSeek-V4-Flash or -Pro and the two
  plans in one CUDA graph, per HCA backend (CSA and the indexer always run the ring kernels); warm, and cold
  with the L2 flushed before each replay.
- ``projection``: the compressor's projection ``x @ wkv_gate.T`` alone (bf16 ``[T, D]`` in, float32 out), by
  ``backend`` ``torch`` (``torch.mm(..., out_dtype=float32)``: cuBLAS, the engines' GEMM) or ``triton``
  (:mod:`~dsv4_compressor.kernels.projection`), for ``kind`` csa (CSA main, 2W = 2048), indexer (512) or hca
  (1024) at the model's hidden size (``model``: flash D = 4096, pro 7168), ``chunk`` = T rows. A CUDA graph of
  ``instances`` projections with distinct weights and inputs: *warm* (replayed back to back) and *cold* (the
  L2 flushed before each replay).
- ``layer``: a whole compressor layer from hidden states, decode step of ``batch`` requests x ``rows``:
  ``kind`` csa (main + indexer projections and compressions) or hca (projection + online compression);
  ``backend`` ``triton`` (``ops.compress_from_hidden`` with the Triton projection) or ``torch`` (``torch.mm``,
  then the same compress: the engines' GEMM before our kernels). Warm and cold as ``projection``.
- ``model-hidden``: ``model`` from hidden states: both plans, 62 (Flash) projections and compressions in one
  graph, HCA online, ``backend`` the projection path (``triton`` / ``torch``).

Boundary cases of a decode step (``S`` rows per request, ratio ``r``, group index ``g``):

- ``none``: no request closes a group: ``start = g*r + 1`` (``g*r`` when ``S = r - 1``); impossible when
  ``S >= r`` (CSA and the indexer at ``S = 4``), reported as n/a.
- ``every``: every request's last row closes group ``g``: ``start = g*r + r - S``.
- ``quarter``: every 4th request (index ``0, 4, 8, ...``) closes a group as in ``every``, the others as in
  ``none``. With ``S = 1`` and ``4B`` requests that is the same ``4B`` rows and ``B`` closing rows as ``S = 4``
  with ``B`` requests that all close one.
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

from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.pool import pool_bytes
from dsv4_compressor.workspace import plan_c128_scratch

from .floors import MODELS, Traffic, kind_config, online_bank_bytes, state_model, step_traffic

__all__ = [
    "Case",
    "PHASES",
    "KINDS",
    "BACKENDS",
    "BATCHES",
    "ROWS_PER_REQUEST",
    "BOUNDARIES",
    "CHUNKS",
    "PLAN_ROWS",
    "MODEL_NAMES",
    "MODEL_BATCHES",
    "PRESETS",
    "PREFILL_MTP_STEP",
    "SPAN_GROUPS",
    "MODEL_SPAN_GROUPS",
    "preset_cases",
    "full_cases",
    "extra_cases",
    "filter_cases",
    "decode_starts",
    "prefill_start",
    "plan_step",
    "case_traffic",
    "choose_copies",
    "pages_needed",
    "model_layers",
    "model_footprint",
    "op_launches",
    "online_splits",
    "model_launches",
    "HIDDEN",
    "PROJECTION_BACKENDS",
    "LAYER_PROJECTIONS",
    "projection_cases",
    "projection_bytes",
    "layer_kinds",
    "projection_width",
    "pairs_projections",
    "BESIDE_GEMM_WIDTH",
]

PHASES = ("decode", "prefill", "plan", "dispatch", "cache-step", "model", "projection", "layer", "model-hidden")
KINDS = ("hca", "csa", "indexer")
BACKENDS = ("reference", "triton-single", "triton-tiled", "online")
BATCHES = (1, 16, 64, 256)
ROWS_PER_REQUEST = (1, 4)
BOUNDARIES = ("none", "every", "quarter", "realistic")
CHUNKS = (512, 8192, 65536)
CARRIES = (False, True)
PLAN_ROWS = (64, 256, 1024, 8192)
#: Short model names (case ids, ``--models``) -> the rows of :data:`.floors.MODELS`.
MODEL_NAMES = {"flash": "DeepSeek-V4-Flash", "pro": "DeepSeek-V4-Pro"}
MODEL_BATCHES = (16, 64, 256)
PRESETS = ("full", "quick", "c128", "online", "host", "model", "projection")
#: Hidden size ``D`` of each model (the projections' inputs).
HIDDEN = {"flash": 4096, "pro": 7168}
#: Projection paths: cuBLAS through torch (the engines' GEMM) and ours; the layer and step cases also run
#: ``"auto"`` (the ops' default: per weight shape and step, the path measured faster) and, where a CSA layer is
#: in the case, ``"joint"``: ``auto`` with the CSA layer's two weights held as one tensor's halves
#: (``ops.join_pair_weights``, as an engine that joins them once at load time holds them), so the pair is one
#: cuBLAS GEMM of the joint weight (our one launch on its halves up to ``ops.joint_pair_triton_rows``).
PROJECTION_BACKENDS = ("torch", "triton")
LAYER_PROJECTIONS = (*PROJECTION_BACKENDS, "auto", "joint")
#: ``pair``: a CSA layer's main and indexer projections of one ``x`` (torch: cuBLAS on the concatenated weight, as
#: an engine holding them as one tensor would run it; triton: ``ops.project`` of both weights, one launch).
PROJECTION_KINDS = ("csa", "indexer", "hca", "pair")
PROJECTION_ROWS = (64, 256, 1024)
#: Whole-layer cases: CSA (main + indexer) and HCA (online), at these decode batches (S = 4).
LAYER_KINDS = ("csa", "hca")
LAYER_BATCHES = (16, 64)
#: The outputs of the GEMM an engine runs beside a layer's compressor (``layer`` cases with ``beside="gemm"``):
#: the attention's fused ``wq_a`` / ``wkv`` input projection, ``q_lora_rank + head_dim`` wide (SGLang 0.5.23's
#: ``DeepSeekV4Config`` defaults, V4-Flash: 1024 + 512; measured for V4-Flash only).
BESIDE_GEMM_WIDTH = {"flash": 1024 + 512}

#: Prefill steps run with the DeepSeek-V4 MTP setting (ring of 132 rows for HCA).
PREFILL_MTP_STEP = 3
#: Realistic decode lengths are drawn from ``[r, r * SPAN_GROUPS)``.
SPAN_GROUPS = 64
#: Whole-model steps draw lengths from ``[128, 128 * MODEL_SPAN_GROUPS)``: every phase of an HCA group occurs,
#: and the output pages reserved for the entries so far (as an engine holds them) stay a few per request.
MODEL_SPAN_GROUPS = 2
#: Decode rows per request of the plan, dispatch, cache-step and model cases (mtp_step 3).
MTP_ROWS = 4
#: The most requests a plan case has (a rank's usual request limit).
PLAN_MAX_REQUESTS = 256
#: The reference backend is eager PyTorch request by request: timed at small batches only.
REFERENCE_MAX_BATCH = 16
REFERENCE_MAX_CHUNK = 8192
#: Eager timings (next to the graph ones) for graph cases up to this batch.
EAGER_MAX_BATCH = 64
#: Backends that exist for non-overlapping kinds only (CSA and the indexer always run single-stage ring
#: kernels; the online backend falls back to them).
HCA_ONLY_BACKENDS = ("triton-tiled", "online")
#: Phases whose cases have a request count and rows per request.
BATCHED_PHASES = ("decode", "dispatch", "cache-step", "model", "layer", "model-hidden")


@dataclass(frozen=True)
class Case:
    """One measurement.

    Args:
        phase: one of :data:`PHASES`.
        kind: ``"hca"``, ``"csa"`` or ``"indexer"`` (``plan``: the ratio's kind, ``hca`` = 128, ``csa`` = 4;
            ``model``: empty, every kind runs).
        backend: one of :data:`BACKENDS` (``model``: the HCA layers' backend; ``plan``: empty).
        batch: requests in the step (prefill cases have one request).
        rows: decode rows per request ``S`` (``mtp_step = S - 1``).
        boundary: decode boundary case (``none``, ``every``, ``quarter``, ``realistic``).
        chunk: prefill rows; the plan case's rows ``T``.
        carry: prefill starts after a carried partial group of ``r // 2`` rows.
        instances: layer instances per CUDA graph (``plan``: launches per graph); the figure is per instance.
        timing: ``"graph"`` (CUDA graph replay), ``"eager"`` (only eager launches, the reference backend) or
            ``"host"`` (host wall time of Python calls).
        eager: also time eager launches of the same instances.
        group: the preset group it belongs to (for the report: ``c128``, ``s1``, ``model``, ...).
        model: ``model`` cases: a key of :data:`MODEL_NAMES`.
        beside: ``layer`` cases: ``"gemm"`` runs each layer instance beside the engine's own attention input GEMM
            (``x @ fused_wqa_wkv.T``, :data:`BESIDE_GEMM_WIDTH`) on another stream, forked and joined per
            instance as vLLM's ``_run_parallel_input_projections`` and SGLang's multi-stream prepare run them;
            ``""``: alone.
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
    model: str = ""
    beside: str = ""

    @property
    def id(self) -> str:
        if self.phase == "decode":
            return f"decode/{self.kind}/{self.backend}/B{self.batch}/S{self.rows}/{self.boundary}"
        if self.phase == "prefill":
            return f"prefill/{self.kind}/{self.backend}/{self.chunk}/{'carry' if self.carry else 'no-carry'}"
        if self.phase == "plan":
            return f"plan/r{kind_config(self.kind).ratio}/T{self.chunk}"
        if self.phase == "dispatch":
            return f"dispatch/{self.kind}/{self.backend}/B{self.batch}/S{self.rows}/{self.boundary}"
        if self.phase == "cache-step":
            return f"cache-step/{self.kind}/{self.backend}/B{self.batch}/S{self.rows}"
        if self.phase == "model":
            return f"model/{self.model}/{self.backend}/B{self.batch}/S{self.rows}"
        if self.phase == "projection":
            return f"projection/{self.model}/{self.kind}/{self.backend}/T{self.chunk}"
        if self.phase == "layer":
            tail = f"/beside-{self.beside}" if self.beside else ""
            return f"layer/{self.model}/{self.kind}/{self.backend}/B{self.batch}/S{self.rows}{tail}"
        if self.phase == "model-hidden":
            return f"model-hidden/{self.model}/{self.backend}/B{self.batch}/S{self.rows}"
        raise ValueError(f"unknown phase {self.phase!r}; choose one of {', '.join(PHASES)}")

    @property
    def mtp_step(self) -> int:
        return PREFILL_MTP_STEP if self.phase == "prefill" else self.rows - 1

    def not_applicable(self) -> str | None:
        """Why this case cannot exist (reported as n/a), or ``None``."""
        if self.phase in ("decode", "dispatch") and self.boundary in ("none", "quarter"):
            cfg = kind_config(self.kind)
            if self.rows >= cfg.ratio:
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
    """The decode and prefill matrix over the given axes. Tiled and online run on HCA only; the reference
    backend at ``B <= 16`` and chunks ``<= 8K`` only (eager, one instance)."""
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


def _s1_cases(instances: int) -> list[Case]:
    """HCA decode with ``S = 1`` row for each of ``4B`` requests, ``B`` of which close a group (every 4th),
    for B = 16, 64, 256: the rows and closing rows of the S = 4, every-closes cases of :func:`_c128_cases`."""
    return [
        _decode("hca", backend, 4 * batch, 1, "quarter", instances=instances, group="s1")
        for batch in (16, 64, 256)
        for backend in ("triton-tiled", "online")
    ]


def plan_requests(rows: int) -> int:
    """Requests of a plan case of ``rows`` rows: ``S = 4`` rows each, at most :data:`PLAN_MAX_REQUESTS`."""
    return max(1, min(rows // MTP_ROWS, PLAN_MAX_REQUESTS))


def _plan_cases(instances: int) -> list[Case]:
    """``build_plan`` at ratio 4 (CSA and the indexer) and 128 (HCA) for steps of :data:`PLAN_ROWS` rows (256: a
    B = 64 decode step of 4 rows per request)."""
    return [
        Case("plan", kind, "", batch=plan_requests(t), rows=MTP_ROWS, chunk=t, instances=instances, group="plan")
        for kind in ("csa", "hca")
        for t in PLAN_ROWS
    ]


def _host_cases() -> list[Case]:
    """The dispatcher's overhead on one HCA decode step (B = 64, S = 4, every request closes a group), for the
    ring op (tiled) and the online op; the host time of ``cache.step`` at B = 256, S = 4."""
    dispatch = [
        Case("dispatch", "hca", backend, 64, MTP_ROWS, "every", timing="host", group="dispatch")
        for backend in ("triton-tiled", "online")
    ]
    steps = [
        Case("cache-step", kind, backend, 256, MTP_ROWS, timing="host", group="cache-step")
        for kind, backend in (("hca", "online"), ("csa", "triton-single"))
    ]
    return dispatch + steps


def _model_cases() -> list[Case]:
    return [
        Case("model", "", backend, batch, MTP_ROWS, "realistic", model=model, group="model")
        for model in MODEL_NAMES
        for backend in ("online", "triton-tiled")
        for batch in MODEL_BATCHES
    ]


def projection_cases(instances: int = 20) -> list[Case]:
    """The ``projection`` preset: each projection alone (both paths, both models, three widths, T = 64 / 256 /
    1024), whole layers from hidden states (CSA and HCA, B = 16 / 64, S = 4; V4-Flash's also beside the
    engine's attention GEMM on another stream, on cuBLAS, ``auto`` and ``joint``) and the whole decode step from
    hidden states (both models, B = 16 / 64), these on each path and on ``auto``."""
    cases = [
        Case("projection", kind, backend, chunk=t, instances=instances, model=model, group="projection")
        for model in MODEL_NAMES
        for kind in PROJECTION_KINDS
        for t in PROJECTION_ROWS
        for backend in PROJECTION_BACKENDS
    ]
    cases += [
        Case("layer", kind, backend, batch, MTP_ROWS, "realistic", instances=instances, model=model, group="layer")
        for model in MODEL_NAMES
        for kind in LAYER_KINDS
        for batch in LAYER_BATCHES
        for backend in LAYER_PROJECTIONS
        if backend != "joint" or kind == "csa"
    ]
    cases += [
        Case("layer", kind, backend, batch, MTP_ROWS, "realistic", instances=instances, model=model,
             group="layer-beside", beside="gemm")
        for model in BESIDE_GEMM_WIDTH
        for kind in LAYER_KINDS
        for batch in LAYER_BATCHES
        for backend in ("torch", "auto", "joint")
        if backend != "joint" or kind == "csa"
    ]  # fmt: skip
    cases += [
        Case("model-hidden", "", backend, batch, MTP_ROWS, "realistic", model=model, group="model-hidden")
        for model in MODEL_NAMES
        for batch in LAYER_BATCHES
        for backend in LAYER_PROJECTIONS
    ]
    return cases


def projection_bytes(width: int, dim: int, rows: int) -> dict:
    """Bytes a projection of ``rows`` rows must move: the bf16 weight and ``x`` read, the float32 ``kv_score``
    written (``read``, ``written``, ``total``)."""
    read = width * dim * 2 + rows * dim * 2
    written = rows * width * 4
    return {"read": read, "written": written, "total": read + written}


def projection_width(kind: str) -> int:
    """Outputs (``2W``) of a ``projection`` case's weight: a kind's ``row_width``, both CSA widths for ``pair``."""
    if kind == "pair":
        return sum(kind_config(k).row_width for k in layer_kinds("csa"))
    return kind_config(kind).row_width


def pairs_projections(backend: str, rows: int, dim: int) -> bool:
    """Whether a CSA layer's two projections run as one ``ops.project`` call on this projection path (``triton``:
    always, our one launch; ``joint``: always, on ``auto``'s rule for a joint weight (our one launch on the halves up
    to ``ops.joint_pair_triton_rows``, else one cuBLAS GEMM of the joint weight); ``auto``: up to
    ``ops.pair_projection_rows``, where our one launch measured faster; ``torch``: never)."""
    if backend in ("triton", "joint"):
        return True
    if backend != "auto":
        return False
    from dsv4_compressor import ops  # imported here: ops decorates kernels, which a dry run never needs

    widths = [kind_config(k).row_width for k in layer_kinds("csa")]
    return rows <= ops.pair_projection_rows(*widths, dim)


def layer_kinds(kind: str) -> tuple[str, ...]:
    """The compressors of a ``layer`` case's layer: a CSA layer has the main one and the indexer."""
    return ("csa", "indexer") if kind == "csa" else ("hca",)


def extra_cases(instances: int = 20) -> list[Case]:
    """Every measurement outside the decode / prefill matrix: the S = 1 workload, build_plan, the host-side
    figures and the whole-model steps."""
    return _s1_cases(instances) + _plan_cases(instances) + _host_cases() + _model_cases()


def preset_cases(preset: str, *, instances: int = 20) -> list[Case]:
    """Cases of a named preset (``full`` is :func:`full_cases` with its defaults plus :func:`extra_cases` and
    :func:`projection_cases`; ``projection`` the latter alone).

    ``quick`` (one device call of a few minutes): the ``c128`` and ``online`` presets, realistic HCA decode at
    B = 64 (tiled, online), CSA and indexer decode at B = 16, 64 and 256 (S = 4, every request closes) and their
    8K and 64K prefill chunks, the reference backend eagerly at B = 16, :func:`extra_cases` and
    :func:`projection_cases`. ``host``: the plan, dispatch and cache-step cases.
    ``model``: the whole-model steps.
    """
    if preset == "full":
        return full_cases(instances=instances) + extra_cases(instances) + projection_cases(instances)
    if preset == "c128":
        return _c128_cases(instances)
    if preset == "online":
        online_decode = [c for c in _c128_cases(instances) if c.backend == "online"]
        return _online_prefill_cases() + online_decode
    if preset == "host":
        return _plan_cases(instances) + _host_cases()
    if preset == "model":
        return _model_cases()
    if preset == "projection":
        return projection_cases(instances)
    if preset == "quick":
        cases = _c128_cases(instances) + _online_prefill_cases()
        cases += [
            _decode("hca", backend, 64, 4, "realistic", instances=instances, group="realistic")
            for backend in ("triton-tiled", "online")
        ]
        cases += [
            _decode(kind, "triton-single", batch, 4, "every", instances=instances, group="csa-indexer")
            for kind in ("csa", "indexer")
            for batch in (16, 64, 256)
        ]
        cases += [
            _prefill(kind, "triton-single", chunk, False, group="csa-indexer")
            for kind in ("csa", "indexer")
            for chunk in (8192, 65536)
        ]
        cases += [
            _decode("hca", "reference", 16, 4, boundary, instances=1, group="reference")
            for boundary in ("none", "every")
        ]
        cases += [
            _decode(kind, "reference", 16, 4, "every", instances=1, group="reference") for kind in ("csa", "indexer")
        ]
        return cases + extra_cases(instances) + projection_cases(instances)
    raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def filter_cases(
    cases: list[Case],
    *,
    phases=None,
    kinds=None,
    backends=None,
    batches=None,
    rows=None,
    boundaries=None,
    chunks=None,
    carries=None,
    plan_rows=None,
    models=None,
    instances: int | None = None,
) -> list[Case]:
    """Keep the cases matching every given axis (``None`` keeps all; an axis a phase does not have keeps its
    cases: ``kinds`` does not filter whole-model steps); ``instances`` overrides graph cases' instances."""
    out = []
    for c in cases:
        batched = c.phase in BATCHED_PHASES
        if phases is not None and c.phase not in phases:
            continue
        if kinds is not None and c.kind and c.phase != "plan" and c.kind not in kinds:
            continue
        if backends is not None and c.backend and c.backend not in backends:
            continue
        if batched and batches is not None and c.batch not in batches:
            continue
        if batched and rows is not None and c.rows not in rows:
            continue
        if c.phase in ("decode", "dispatch") and boundaries is not None and c.boundary not in boundaries:
            continue
        if c.phase == "prefill" and chunks is not None and c.chunk not in chunks:
            continue
        if c.phase == "prefill" and carries is not None and c.carry not in carries:
            continue
        if c.phase == "plan" and plan_rows is not None and c.chunk not in plan_rows:
            continue
        if c.phase in ("model", "projection", "layer", "model-hidden") and models is not None and c.model not in models:
            continue
        if c.phase == "projection" and chunks is not None and c.chunk not in chunks:
            continue
        if instances is not None and c.timing == "graph" and c.phase in ("decode", "plan", "projection", "layer"):
            c = replace(c, instances=instances)
        out.append(c)
    return list(dict.fromkeys(out))


# -------------------------------------------------------------------------------------------------
# Positions
# -------------------------------------------------------------------------------------------------
def _starts(boundary: str, r: int, s: int, b: int, copy: int, key: str, span: int) -> list[int]:
    g = 1 + copy
    none = g * r + (1 if s <= r - 2 else 0)
    every = g * r + r - s
    if boundary == "none":
        return [none] * b
    if boundary == "every":
        return [every] * b
    if boundary == "quarter":
        return [every if i % 4 == 0 else none for i in range(b)]
    if boundary == "realistic":
        rng = np.random.default_rng(zlib.crc32(key.encode()))
        return [int(x) for x in rng.integers(r, r * span, size=b)]
    raise ValueError(f"unknown boundary case {boundary!r}; choose one of {', '.join(BOUNDARIES)}")


def decode_starts(case: Case, copy: int = 0, *, seed: int = 0) -> list[int] | None:
    """Start position of each request of a decode (or dispatch, or model) case's step, for rotated input copy
    ``copy`` (``None`` when the boundary case is impossible). Whole-model steps use HCA's ratio and lengths
    below ``128 * MODEL_SPAN_GROUPS``."""
    if case.not_applicable():
        return None
    if case.phase in ("model", "model-hidden"):
        key = f"model/{case.batch}/{case.rows}/{copy}/{seed}"
        return _starts(case.boundary, kind_config("hca").ratio, case.rows, case.batch, copy, key, MODEL_SPAN_GROUPS)
    key = f"{case.kind}/{case.batch}/{case.rows}/{copy}/{seed}"
    r = kind_config(case.kind).ratio
    return _starts(case.boundary, r, case.rows, case.batch, copy, key, SPAN_GROUPS)


def prefill_start(case: Case) -> int:
    """A prefill chunk starts at 0, or after a carried partial group of ``r // 2`` rows."""
    return kind_config(case.kind).ratio // 2 if case.carry else 0


def plan_step(case: Case, *, seed: int = 0) -> tuple[list[int], list[int]]:
    """``(starts, counts)`` of a plan case's step: ``batch - 1`` decode requests of ``S`` rows at random lengths,
    and one request with the remaining rows (a prompt chunk from position 0 when there are more than ``S``)."""
    r, b, s, t = kind_config(case.kind).ratio, case.batch, case.rows, case.chunk
    rng = np.random.default_rng(zlib.crc32(f"plan/{r}/{t}/{seed}".encode()))
    starts = [int(x) for x in rng.integers(r, r * SPAN_GROUPS, size=b)]
    counts = [s] * (b - 1) + [t - s * (b - 1)]
    if counts[-1] > s:
        starts[-1] = 0
    return starts, counts


# -------------------------------------------------------------------------------------------------
# Bytes
# -------------------------------------------------------------------------------------------------
def model_layers(model: str) -> dict[str, int]:
    """Compressor layers of a model (``flash`` / ``pro``): ``{"hca": n, "csa": n, "indexer": n}`` (the indexer
    runs on every CSA layer)."""
    if model not in MODEL_NAMES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODEL_NAMES)}")
    layers = MODELS[MODEL_NAMES[model]]
    return {"hca": layers["hca"], "csa": layers["csa"], "indexer": layers["csa"]}


def _model_backend(kind: str, hca_backend: str) -> str:
    return hca_backend if kind == "hca" else "triton-single"


def case_traffic(case: Case, copy: int = 0, *, seed: int = 0) -> Traffic | None:
    """Bytes this case must move in the step of input copy ``copy``: per layer (decode, prefill), or the whole
    model's step (``model``); ``None`` for an impossible case and for the plan and host phases."""
    if case.phase == "model-hidden":
        return case_traffic(replace(case, phase="model", backend="online"), copy, seed=seed)
    if case.phase == "layer":
        starts = decode_starts(case, copy, seed=seed)
        total = Traffic()
        for kind in layer_kinds(case.kind):
            cfg = kind_config(kind)
            state = state_model("online" if kind == "hca" else "triton-single", cfg)
            total = total + step_traffic(cfg, starts, [case.rows] * case.batch, state=state, mtp_step=case.mtp_step)
        return total
    if case.phase == "model":
        starts = decode_starts(case, copy, seed=seed)
        total = Traffic()
        for kind, count in model_layers(case.model).items():
            cfg = kind_config(kind)
            state = state_model(_model_backend(kind, case.backend), cfg)
            one = step_traffic(cfg, starts, [case.rows] * case.batch, state=state, mtp_step=case.mtp_step)
            total = total + one.scaled(count)
        return total
    if case.phase not in ("decode", "prefill"):
        return None
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


def pages_needed(cfg: CompressorConfig, ends, page_size: int) -> int:
    """Output pages that requests of lengths ``ends`` hold (pages for every entry so far, as an engine's page
    table has them); at least 1, the pool's minimum."""
    entries = np.asarray(ends, dtype=np.int64) // cfg.ratio
    return max(1, int((-(-entries // page_size)).sum()))


def online_splits(case: Case, device) -> bool:
    """Whether the case is an online HCA prefill step that splits its groups through the scratch on
    ``device`` (:func:`~dsv4_compressor.kernels.online_hca.splits`; the bench gives the online backend one)."""
    from dsv4_compressor.kernels.online_hca import splits

    cfg = kind_config(case.kind)
    online = state_model(case.backend, cfg) == "online"
    return online and case.phase == "prefill" and splits(case.chunk, cfg.ratio, device)


def op_launches(kind: str, backend: str, *, decode: bool, requests: int, split: bool = False) -> int | None:
    """Kernel launches of one layer's op (the plan not included) on a step of ``requests`` requests, by
    :func:`dsv4_compressor.ops.launches`, as the bench calls it: ring states without state-row tables, a
    scratch for the tiled HCA kernel and for the online backend's prefill steps, which ``split`` says whether
    they split (:func:`online_splits`); ``None`` for the reference backend, which is eager PyTorch."""
    from dsv4_compressor import ops  # imported here: it decorates kernels, which a dry run never launches

    if backend == "reference":
        return None
    cfg = kind_config(kind)
    if state_model(backend, cfg) == "online":
        # the split rule is online_splits'; with it given, the op's own count follows from decode and scratch
        return ops.launches("compress_online_hca", rows=1, requests=requests, ratio=cfg.ratio, decode=decode,
                            scratch=split, device="cpu")  # fmt: skip
    return ops.launches(
        "compress", rows=1, requests=requests, ratio=cfg.ratio, kind=cfg.op_kind, decode=decode,
        scratch=backend == "triton-tiled" and not cfg.overlap,
    )  # fmt: skip


def model_launches(case: Case) -> int:
    """Kernel launches of a whole-model decode step: the two plans, then every layer's op (``model-hidden``:
    and every layer's projection; HCA online)."""
    if case.phase == "model-hidden":
        layers = model_layers(case.model)
        projections = sum(layers.values())
        paired = 0
        if pairs_projections(case.backend, case.batch * case.rows, HIDDEN[case.model]):
            projections -= layers["csa"]  # a CSA layer's two in one launch
            # and its two compressions (ops.compress_pair on a decode step)
            from dsv4_compressor import ops  # imported here: it decorates kernels, which a dry run never launches

            paired = layers["csa"] * (2 - ops.launches("compress_pair", rows=1, requests=1, decode=True))
        return model_launches(replace(case, phase="model", backend="online")) + projections - paired
    return 2 + sum(
        count * op_launches(kind, _model_backend(kind, case.backend), decode=True, requests=case.batch)
        for kind, count in model_layers(case.model).items()
    )


def _plan_bytes(rows: int, requests: int, ratio: int) -> int:
    """Bytes of ``ops.empty_plan(rows, requests, ratio)``: int32 ``[requests, ceil(numel / requests)]``."""
    from dsv4_compressor.kernels.plan import (
        plan_numel,  # imported here: it decorates kernels, which a dry run never launches
    )

    return requests * -(-plan_numel(rows, requests, ratio) // requests) * 4


def model_footprint(case: Case, *, seed: int = 0) -> dict[str, int]:
    """Device bytes a whole-model step owns, by part: ``state`` (ring rows or online banks of every layer),
    ``pools`` (output pages of the entries so far), ``kv_score`` (each layer's input rows), ``scratch`` (the tiled
    HCA kernel's, one region shared by the HCA layers), ``plans`` and ``metadata`` (the step's per-row int64
    tensors), and ``total``. The parameters (APE, norm weight, rope tables) are shared and not counted."""
    b, s = case.batch, case.rows
    rows = b * s
    ends = np.asarray(decode_starts(case, seed=seed)) + s
    parts = dict.fromkeys(("state", "pools", "kv_score", "scratch", "plans", "metadata"), 0)
    for kind, count in model_layers(case.model).items():
        cfg = kind_config(kind)
        if state_model(_model_backend(kind, case.backend), cfg) == "online":
            state = (case.mtp_step + 1) * online_bank_bytes(cfg)
        else:
            state = cfg.ring_bytes(case.mtp_step)
        page = cfg.default_page_size
        parts["state"] += count * b * state
        parts["pools"] += count * pool_bytes(cfg, page, pages_needed(cfg, ends, page))
        parts["kv_score"] += count * rows * cfg.row_width * 4
    if case.backend == "triton-tiled":
        hca = kind_config("hca")
        plan = plan_c128_scratch(batch_max_tokens=rows, max_req_num=b, mtp_step=case.mtp_step, head_dim=hca.head_dim)
        parts["scratch"] = plan.bytes
    parts["plans"] = _plan_bytes(rows, b, kind_config("csa").ratio) + _plan_bytes(rows, b, kind_config("hca").ratio)
    parts["metadata"] = 4 * rows * 8  # positions, row_req, and an out_slot per ratio
    parts["total"] = sum(parts.values())
    return parts
