"""Bytes a step must move, the floors a measured time is compared with, and the memory table.

Everything here is pure Python (no GPU), so the formulas are unit-tested on CPU.

Bytes that must move, per layer and per request supplying rows ``[start, start + n)`` (docs/SPEC.md sections 2, 4
and 6; ``H`` = head_dim, ``W`` = row half width (``H``, or ``2H`` with overlap), ``r`` = ratio, float32 = 4 B):

- ``rows_read = n * 2W * 4``: every new row is read whole (its kv and gate halves feed windows, the saved
  state, or both).
- ``state_read``, ring backends: for each group ``g`` the step closes (its last position ``g*r + r - 1`` lies
  in ``[start, start + n)``), the window positions ``0 <= q < start`` come from the ring. Each needs one
  half pair, ``kv[0:H]`` and ``score[0:H]`` of the right half: the whole row without overlap (``W = H``);
  with overlap the previous-group half for ``q < g*r`` and the current-group half otherwise. That is
  ``2 * H * 4`` bytes per (position, half), counted once even when two windows need it. HCA: a group closed
  by the last of 4 decode rows reads 124 ring rows of 4 KiB plus the 4 new rows: ``128 * 1024 * 4`` bytes.
- ``state_read``, online backend (HCA): one bank of ``3 * H * 4`` bytes (running max, sum of exponentials,
  weighted sum) when the step starts inside a group (``start % r != 0``), nothing otherwise.
- ``state_written``, ring backends: the saved tail rows, ``min(n, ring_rows) * 2W * 4``.
- ``state_written``, online backend: ``min(n, mtp_step + 1)`` banks of ``3 * H * 4`` (the state as of each
  of the last ``mtp_step + 1`` positions, which MTP rewinds need).
- ``entries_written``: closed groups times the entry bytes: 584 (latent), or 256 (bf16 indexer key) + 132
  (its FP8 pack, when on).

Not counted: the step's plan (32 B per row, shared by every layer), the parameters (APE, norm weight, rope
rows; shared by all requests and cached), and scratch traffic: the tiled kernel's float32 scratch round trip
is an implementation choice, which is what the floor should expose.

Floors, per layer: ``bytes_floor_us = total_bytes / copy_bandwidth`` (the device-to-device copy bandwidth
measured in the same run, read + write bytes counted) and ``launch_floor_us`` (an empty kernel replayed in a
CUDA graph, per kernel: one launch is the least any step needs; a whole-model step counts every launch it
makes); ``floor_us`` is the larger. A result reports ``x_floor = time / floor_us`` and the achieved bandwidth
``total_bytes / time``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsv4_compressor.config import INDEXER, MODELS, CompressorConfig
from dsv4_compressor.workspace import plan_c128_scratch

__all__ = [
    "Traffic",
    "kind_config",
    "state_model",
    "request_traffic",
    "step_traffic",
    "mean_traffic",
    "derive_metrics",
    "online_bank_bytes",
    "memory_table",
    "MODELS",
    "MEMORY_REQUESTS",
    "MEMORY_MTP_STEP",
    "MEMORY_BATCH_MAX_TOKENS",
]

KINDS = ("hca", "csa", "indexer")


def kind_config(kind: str) -> CompressorConfig:
    """The DeepSeek-V4 config of a layer kind: ``hca``, ``csa`` or ``indexer`` (with its FP8 pack)."""
    if kind == "hca":
        return CompressorConfig.hca()
    if kind == "csa":
        return CompressorConfig.csa()
    if kind == "indexer":
        return CompressorConfig.indexer(fp8=True)
    raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")


def state_model(backend: str, cfg: CompressorConfig) -> str:
    """``"online"`` for the online backend on non-overlapping kinds (HCA), else ``"ring"`` (the online
    backend falls back to the ring kernels for CSA and the indexer)."""
    return "online" if backend == "online" and not cfg.overlap else "ring"


def online_bank_bytes(cfg: CompressorConfig) -> int:
    """One online state bank: running max, sum and weighted sum per channel, float32."""
    return 3 * cfg.head_dim * 4


@dataclass(frozen=True)
class Traffic:
    """Bytes one layer must move for a step (see the module docstring); ``closing_rows`` = entries written."""

    rows_read: int = 0
    state_read: int = 0
    state_written: int = 0
    entries_written: int = 0
    closing_rows: int = 0

    @property
    def read(self) -> int:
        return self.rows_read + self.state_read

    @property
    def written(self) -> int:
        return self.state_written + self.entries_written

    @property
    def total(self) -> int:
        return self.read + self.written

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def scaled(self, k: int) -> Traffic:
        """The traffic of ``k`` layers that each move these bytes."""
        return Traffic(*(k * a for a in self.astuple()))

    def astuple(self) -> tuple[int, ...]:
        return (self.rows_read, self.state_read, self.state_written, self.entries_written, self.closing_rows)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(read=self.read, written=self.written, total=self.total)
        return out


def _entry_bytes(cfg: CompressorConfig) -> int:
    if cfg.output == INDEXER:
        return cfg.entry_bytes + (cfg.indexer_fp8_bytes if cfg.indexer_fp8 else 0)
    return cfg.entry_bytes


def _closed_groups(cfg: CompressorConfig, start: int, n: int) -> range:
    r = cfg.ratio
    first = max(0, -(-(start - (r - 1)) // r))  # first g with g*r + r - 1 >= start
    return range(first, (start + n) // r)


def request_traffic(cfg: CompressorConfig, start: int, n: int, *, state: str, mtp_step: int) -> Traffic:
    """Bytes one request supplying ``n`` rows from position ``start`` must move in one layer."""
    if state not in ("ring", "online"):
        raise ValueError(f"state must be 'ring' or 'online', got {state!r}")
    r, h = cfg.ratio, cfg.head_dim
    groups = _closed_groups(cfg, start, n)
    half_pair = 2 * h * 4
    if state == "ring":
        needed: set[tuple[int, int]] = set()  # (position, half): half 0 = previous-group / whole row, 1 = current
        for g in groups:
            lo = (g - 1) * r if cfg.overlap else g * r
            for q in range(max(lo, 0), min(start, g * r + r)):
                needed.add((q, 1 if (cfg.overlap and q >= g * r) else 0))
        state_read = len(needed) * half_pair
        state_written = min(n, cfg.ring_rows(mtp_step)) * cfg.row_width * 4
    else:
        if cfg.overlap:
            raise ValueError(f"{cfg.name}: the online state applies to non-overlapping kinds only")
        bank = online_bank_bytes(cfg)
        state_read = bank if start % r else 0
        state_written = min(n, mtp_step + 1) * bank
    return Traffic(
        rows_read=n * cfg.row_width * 4,
        state_read=state_read,
        state_written=state_written,
        entries_written=len(groups) * _entry_bytes(cfg),
        closing_rows=len(groups),
    )


def step_traffic(cfg: CompressorConfig, starts, num_rows, *, state: str, mtp_step: int) -> Traffic:
    """Bytes a whole step (all its requests) must move in one layer."""
    total = Traffic()
    for start, n in zip(starts, num_rows):
        total = total + request_traffic(cfg, int(start), int(n), state=state, mtp_step=mtp_step)
    return total


def mean_traffic(traffics: list[Traffic]) -> dict:
    """Field-wise mean of several steps' traffic (rotated input copies differ in which rows close groups)."""
    if not traffics:
        raise ValueError("mean_traffic needs at least one step")
    k = len(traffics)
    sums = traffics[0]
    for t in traffics[1:]:
        sums = sums + t
    out = {name: value / k for name, value in sums.as_dict().items()}
    return out


def derive_metrics(traffic: dict, us_per_layer: float | None, floors: dict | None, *, launches: int = 1) -> dict:
    """Achieved bandwidth and position against the floors for one measured time (microseconds per layer, or
    per whole-model step).

    ``floors`` holds ``copy_bw_GBps`` and ``launch_floor_us`` (measured in the same run); missing values
    give ``None`` entries, never invented ones. The launch floor is ``launches`` empty kernels: one for a
    layer (the least any step needs), every launch of a whole-model step.
    """
    out = {
        "gbps": None,
        "read_gbps": None,
        "bytes_floor_us": None,
        "launch_floor_us": None,
        "floor_us": None,
        "x_floor": None,
        "read_pct_of_copy": None,
        "floor_bound": None,
    }
    if us_per_layer is None or us_per_layer <= 0:
        return out
    total, read = traffic["total"], traffic["read"]
    out["gbps"] = total / us_per_layer / 1e3  # bytes/us = MB/s; / 1e3 -> GB/s
    out["read_gbps"] = read / us_per_layer / 1e3
    floors = floors or {}
    bw = floors.get("copy_bw_GBps")
    launch = floors.get("launch_floor_us")
    if bw:
        out["bytes_floor_us"] = total / (bw * 1e3)
        out["read_pct_of_copy"] = 100.0 * out["read_gbps"] / bw
    if launch:
        out["launch_floor_us"] = launch * launches
    candidates = [v for v in (out["bytes_floor_us"], out["launch_floor_us"]) if v is not None]
    if candidates:
        out["floor_us"] = max(candidates)
        out["x_floor"] = us_per_layer / out["floor_us"]
        out["floor_bound"] = "bytes" if out["floor_us"] == out["bytes_floor_us"] else "launch"
    return out


# -------------------------------------------------------------------------------------------------
# Memory: state per request per layer and scratch per backend, at serving scale
# -------------------------------------------------------------------------------------------------
# MODELS (the layer counts, docs/SPEC.md section 1; the indexer runs on every CSA layer) is the library's table.
MEMORY_REQUESTS = 256
MEMORY_MTP_STEP = 3
#: The largest prefill forward the scratch plan covers (the engines' usual default; docs/SPEC.md section 7).
MEMORY_BATCH_MAX_TOKENS = 8192


def ring_state_bytes() -> dict[str, int]:
    """Ring state per request per layer at ``MEMORY_MTP_STEP``, per kind."""
    return {kind: kind_config(kind).ring_bytes(MEMORY_MTP_STEP) for kind in KINDS}


def tiled_scratch_bytes() -> int:
    """One C128 scratch region planned for ``MEMORY_REQUESTS`` requests, ``MEMORY_MTP_STEP`` and
    ``MEMORY_BATCH_MAX_TOKENS`` (shared by all layers, which run one after another)."""
    return plan_c128_scratch(
        batch_max_tokens=MEMORY_BATCH_MAX_TOKENS,
        max_req_num=MEMORY_REQUESTS,
        mtp_step=MEMORY_MTP_STEP,
        head_dim=kind_config("hca").head_dim,
    ).bytes


def memory_table(backends: list[str], probes: dict[str, dict] | None = None) -> list[dict]:
    """Rows ``{model, backend, state_per_request {kind: bytes}, layers, state_total, scratch, note}``.

    Ring backends (``reference``, ``triton-single``, ``triton-tiled``) keep the ring of docs/SPEC.md; their numbers come
    from the configs. Other backends need ``probes[backend] = {"state": {kind: bytes or None},
    "scratch": bytes or None, "note": str}`` measured from a constructed instance; without a probe their
    row says so and holds no numbers.
    """
    probes = probes or {}
    ring = ring_state_bytes()
    rows = []
    for model, layers in MODELS.items():
        for backend in backends:
            note = ""
            if backend in ("reference", "triton-single", "triton-tiled"):
                state = dict(ring)
                scratch = tiled_scratch_bytes() if backend == "triton-tiled" else 0
            elif backend in probes:
                state = dict(probes[backend].get("state", {}))
                scratch = probes[backend].get("scratch")
                note = probes[backend].get("note", "")
            else:
                state = {kind: None for kind in KINDS}
                scratch = None
                note = "not measured (backend not available in this run)"
            per_layer = {
                "hca": state.get("hca"),
                "csa": state.get("csa"),
                "indexer": state.get("indexer"),
            }
            if all(v is not None for v in per_layer.values()):
                per_request = layers["hca"] * per_layer["hca"] + layers["csa"] * (
                    per_layer["csa"] + per_layer["indexer"]
                )
                total = MEMORY_REQUESTS * per_request
            else:
                per_request = total = None
            rows.append(
                {
                    "model": model,
                    "backend": backend,
                    "layers": dict(layers),
                    "requests": MEMORY_REQUESTS,
                    "mtp_step": MEMORY_MTP_STEP,
                    "state_per_request_per_layer": per_layer,
                    "state_per_request_all_layers": per_request,
                    "state_total": total,
                    "scratch": scratch,
                    "scratch_plan": (
                        f"batch_max_tokens={MEMORY_BATCH_MAX_TOKENS}, max_req_num={MEMORY_REQUESTS}, "
                        f"mtp_step={MEMORY_MTP_STEP}, one region shared by all layers"
                        if backend == "triton-tiled"
                        else ""
                    ),
                    "note": note,
                }
            )
    return rows
