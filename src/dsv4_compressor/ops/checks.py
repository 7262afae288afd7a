"""The host checks every op runs before it launches anything, and the build records they check against.

Nothing here reads device memory or launches a kernel: a refused call raises :class:`~dsv4_compressor.errors.OpError`
naming the argument and both numbers, and leaves every buffer unchanged. A plan's build record
(:class:`PlanInfo`) is kept on the host, as an attribute of the plan tensor; state-row tables carry theirs
(:class:`_TablesInfo`).
"""

from __future__ import annotations

import contextvars
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..config import FP8_BLOCK
from ..errors import OpError
from ..kernels import interpreting
from ..kernels import plan as _plan
from ..kernels.c128_tiled import CHANNEL_TILE
from ..kernels.ring import StateRef
from ..layout import LATENT_LAYOUTS, V41_TILE, latent_record_bytes

#: The record of a latent entry: 576 data bytes (448 FP8 + 64 bf16) and 8 scale bytes, at DeepSeek-V4 shapes.
_LATENT_SCALE_BYTES = 8


def _fail(op: str, msg: str):
    raise OpError(f"{op}: {msg}")


def _int(op: str, name: str, value, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(op, f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _tensor(op: str, name: str, t, *, dtypes, ndim=None, device=None, inner_contiguous=True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(op, f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    dim = t.dim()
    if ndim is not None and (dim != ndim if type(ndim) is int else dim not in ndim):
        _fail(op, f"{name} must have {ndim} dimensions, got shape {list(t.shape)}")
    if device is not None and t.device != device:
        _fail(op, f"{name} is on {t.device}, expected {device} (where kv_score / plan live)")
    if inner_contiguous and dim and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must have a contiguous last dimension, got strides {list(t.stride())}")
    return t


def _storage_key(t: torch.Tensor) -> int:
    """What tells two tensors' storages apart: the data address, or for a fake (``torch.compile``'s tracing, which
    has none) its storage's identity."""
    if isinstance(t, FakeTensor):
        return t.untyped_storage()._cdata
    return t.untyped_storage().data_ptr()


def _runnable(op: str, device: torch.device) -> None:
    """Kernels run on CUDA, or on CPU tensors under the Triton interpreter."""
    if device.type == "cpu" and not interpreting():
        _fail(op, "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before triton is imported")
    if device.type not in ("cpu", "cuda"):
        _fail(op, f"tensors on {device} are not supported (CUDA, or CPU under TRITON_INTERPRET=1)")


def _plan_capacity(op: str, plan, rows: int, ratio: int, device) -> int:
    """The plan's request capacity (its first dimension), after checking it holds a step of ``rows`` rows."""
    _tensor(op, "plan", plan, dtypes=(torch.int32,), ndim=2, device=device)
    if not plan.is_contiguous():
        _fail(op, "plan must be contiguous (a buffer from ops.empty_plan)")
    requests = plan.shape[0]
    need = _plan.plan_numel(rows, requests, ratio)
    if plan.numel() < need:
        _fail(
            op,
            f"plan holds {plan.numel()} ints; a step of {rows} rows and {requests} requests at ratio {ratio} needs "
            f"{need} (ops.empty_plan(max_rows >= {rows}, ...))",
        )
    return requests


class PlanInfo(NamedTuple):
    """What a plan was built for, kept on the host with the plan tensor by :func:`build_plan` (read it with
    :func:`plan_info`); every compress on the plan is checked against it before anything is launched.

    Attributes:
        rows: ``T``, the step's rows (the length of ``positions``; padding rows included).
        requests: ``R``, the plan's request capacity (its first dimension).
        ratio: ``r``.
        num_slots: request state slots; every slot a row addresses is below it.
        mtp_step: the MTP depth the step may rewind over (rings and banks must be sized for it).
        build: a serial number of the build (state-row tables and copies carry it; 0: no build seen).
    """

    rows: int
    requests: int
    ratio: int
    num_slots: int
    mtp_step: int
    build: int


class _TablesInfo(NamedTuple):
    """What :func:`build_state_rows` resolved, kept with its ``read_rows`` / ``save_rows``."""

    build: int  # the PlanInfo.build they were resolved for
    mode: str
    ring: int | None


_PLAN_ATTR = "_dsv4c_plan_info"
_TABLES_ATTR = "_dsv4c_state_rows"


def plan_info(plan: torch.Tensor) -> PlanInfo | None:
    """What ``plan`` was last built for (:class:`PlanInfo`), or ``None`` if no :func:`build_plan` (or
    :func:`copy_plan`) has filled this tensor. A view or a clone of a plan carries none."""
    return getattr(plan, _PLAN_ATTR, None) if isinstance(plan, torch.Tensor) else None


#: Set while a fake (``torch.compile``'s tracing) runs an op: the op runs its checks, then returns before it
#: launches or writes anything but the host records of what it would build (:func:`_checks_only`).
_CHECKING = contextvars.ContextVar("dsv4c_checking", default=False)


def _checks_only() -> bool:
    """Whether the running op is a fake: every check, then no launch (see :mod:`.library`)."""
    return _CHECKING.get()


#: Set while an op runs through the dispatcher (``torch.ops.dsv4c.*``); see :func:`_built`.
_DISPATCHED = contextvars.ContextVar("dsv4c_dispatched", default=False)


def _built(op: str, plan, *, rows: int = 0, ratio: int = 0) -> PlanInfo:
    """The plan's build record. Called directly, an op refuses a plan without one. Through the dispatcher
    (compiled graphs: functionalization hands an op a clone of a mutated plan when the backend does not
    re-inplace it, and clones carry no record) such a plan is taken at its shape: ``rows`` and ``ratio`` are
    the call's own, no slot or ``mtp_step`` check, and its kernels wait before reading the plan."""
    info = plan_info(plan)
    if info is None:
        if _DISPATCHED.get():
            return PlanInfo(rows, plan.shape[0], ratio, 0, 0, build=0)
        _fail(op, "plan carries no build: fill it with ops.build_plan (or ops.copy_plan from a built plan) first; "
                  "a view or clone of a plan is not one")  # fmt: skip
    return info


def _layout(op: str, layout, *, latent: bool) -> None:
    """``layout`` names a latent record layout (:data:`~dsv4_compressor.layout.LATENT_LAYOUTS`); the indexer's
    pages have one layout, ``"v4"``."""
    if layout not in LATENT_LAYOUTS:
        _fail(op, f"layout must be one of {list(LATENT_LAYOUTS)}, got {layout!r}")
    if not latent and layout != "v4":
        _fail(op, f"layout={layout!r} is a latent record layout; the indexer's pages take layout='v4'")


def _common(op, kv_score, plan, ape, norm_weight, cos, sin, *, overlap: bool, latent: bool, page_size: int,
            layout: str = "v4"):  # fmt: skip
    """Validate what every compress op reads against the plan's build; returns ``(info, head, rope, device)``
    (``info.rows`` is the step's ``T``: rows of ``kv_score`` past it are padding)."""
    _layout(op, layout, latent=latent)
    _tensor(op, "kv_score", kv_score, dtypes=(torch.float32,), ndim=2)
    device = kv_score.device
    _runnable(op, device)
    _tensor(op, "plan", plan, dtypes=(torch.int32,), ndim=2, device=device)
    _tensor(op, "ape", ape, dtypes=(torch.float32,), ndim=(2, 3), device=device, inner_contiguous=False)
    info = _built(op, plan, rows=kv_score.shape[0], ratio=ape.shape[0])
    _tensor(op, "norm_weight", norm_weight, dtypes=(torch.float32, torch.bfloat16), ndim=1, device=device,
            inner_contiguous=False)  # fmt: skip
    head = norm_weight.shape[0]
    width = head * (2 if overlap else 1)
    if kv_score.shape[1] != 2 * width:
        _fail(op, f"kv_score must be [T, {2 * width}] (2W for H = {head}), got {list(kv_score.shape)}")
    if kv_score.shape[0] < info.rows:
        _fail(op, f"kv_score has {kv_score.shape[0]} rows; the plan was built for a step of {info.rows} rows (T)")
    coff = 2 if overlap else 1
    if ape.dim() == 2 and ape.shape[1] != width or ape.dim() == 3 and tuple(ape.shape[1:]) != (coff, head):
        _fail(op, f"ape must be [r, {width}] or [r, {coff}, {head}], got {list(ape.shape)}")
    if ape.shape[0] != info.ratio:
        _fail(op, f"ape has {ape.shape[0]} rows (ratio {ape.shape[0]}); the plan was built for ratio {info.ratio}")
    ratio = info.ratio
    _tensor(op, "cos", cos, dtypes=(torch.float32,), ndim=2, device=device, inner_contiguous=False)
    _tensor(op, "sin", sin, dtypes=(torch.float32,), ndim=2, device=device, inner_contiguous=False)
    if cos.shape != sin.shape:
        _fail(op, f"cos and sin differ in shape ({list(cos.shape)}, {list(sin.shape)})")
    rope = 2 * cos.shape[1]
    if rope > head or cos.shape[0] < ratio:
        _fail(op, f"cos/sin must be [positions >= {ratio}, R/2] with R <= {head}, got {list(cos.shape)}")
    if latent and layout == "v4" and (head - rope) % FP8_BLOCK:
        _fail(op, f"latent output packs H - R = {head - rope} nope dims in blocks of {FP8_BLOCK}")
    if latent and layout in ("v41", "v41_new") and head % V41_TILE:
        _fail(op, f"layout={layout!r} packs H = {head} dims in blocks of {V41_TILE}")
    if not latent and head & (head - 1):
        _fail(op, f"the indexer's Hadamard pack needs a power-of-two head_dim, got {head}")
    _int(op, "page_size", page_size, 1)
    _plan_capacity(op, plan, info.rows, ratio, device)
    return info, head, rope, device


def _pages(op, name, pages, *, device, record_bytes: int, page_size: int):
    _tensor(op, name, pages, dtypes=(torch.uint8,), ndim=2, device=device)
    if pages.shape[1] < page_size * record_bytes:
        _fail(op, f"{name} pages hold {pages.shape[1]} bytes; {page_size} slots of {record_bytes} need "
                  f"{page_size * record_bytes}")  # fmt: skip


def _scratch(op: str, scratch: torch.Tensor, *, rows: int, head: int, device) -> None:
    """A float32 ``[>= rows, head]`` scratch, rows ``head`` apart, for kernels that split a group's channels."""
    if head % CHANNEL_TILE:
        _fail(op, f"scratch is for head_dim a multiple of {CHANNEL_TILE}, got {head}")
    _tensor(op, "scratch", scratch, dtypes=(torch.float32,), ndim=2, device=device)
    if scratch.shape[0] < rows or scratch.shape[1] != head or (rows > 1 and scratch.stride(0) != head):
        _fail(op, f"scratch must be contiguous [>= {rows}, {head}], got {list(scratch.shape)} "
                  f"strides {list(scratch.stride())}")  # fmt: skip


def _outputs(op, kind, out_pages, out_keys, *, latent, head, rope, page_size, device, layout="v4") -> None:
    """Latent kinds write records (``out_pages``, in ``layout``), the indexer FP8 packs; either may also or
    instead write the values to ``out_keys`` (bf16, or float32 for a model that reads entries unquantized). An
    entry's slot addresses both, so given together they hold the same slots. A page holds ``page_size`` records
    of the layout (``"v4"`` 584 bytes, ``"v41"`` / ``"v41_new"`` 528, ``"uniform_fp8"`` 512 at ``H = 512``)."""
    if out_pages is None and out_keys is None:
        _fail(op, f"kind={kind!r} needs out_pages or out_keys (or both)")
    if out_pages is not None:
        record = sum(latent_record_bytes(head, rope, layout)) if latent else head + 4
        _pages(op, "out_pages", out_pages, device=device, record_bytes=record, page_size=page_size)
    if out_keys is not None:
        _tensor(op, "out_keys", out_keys, dtypes=(torch.bfloat16, torch.float32), ndim=2, device=device)
        if out_keys.shape[1] != head:
            _fail(op, f"out_keys must be [slots, {head}], got {list(out_keys.shape)}")
    if out_pages is not None and out_keys is not None and out_keys.shape[0] != out_pages.shape[0] * page_size:
        slots = out_pages.shape[0] * page_size
        _fail(op, f"out_keys holds {out_keys.shape[0]} slots and out_pages {out_pages.shape[0]} pages x {page_size} = "
                  f"{slots}: an entry's slot addresses both, so they must hold the same")  # fmt: skip


def _ring_need(window: int, mtp_step: int, decode: bool) -> int:
    """Ring rows a window of ``window`` positions needs per request (or state page) when a step may rewind
    ``mtp_step`` positions: its oldest row is ``start - (window - 1)`` with ``start >= L - mtp_step``, and the
    ring keeps the last ``ring`` positions, so ``window - 1 + mtp_step``. A decode step saves its rows in the
    launch whose windows read the ring (each row's program saves it), so its up to ``mtp_step + 1`` new rows must
    not land on a row a window of the same step reads: one more. Never less than the window."""
    return max(window, window - 1 + mtp_step + (1 if decode else 0))


def _state(op, state, read_rows, save_rows, ring, info: PlanInfo, *, width, window, decode, device):
    """Validate the state (and its tables) against the plan's build; returns its ``StateRef``, the ring rows
    (ring mode) and the rows per block (table mode)."""
    _tensor(op, "state", state, dtypes=(torch.float32,), ndim=(2, 3), device=device)
    if state.shape[-1] != 2 * width:
        _fail(op, f"state rows must be {2 * width} wide (2W), got {list(state.shape)}")
    if (read_rows is None) != (save_rows is None):
        _fail(op, "read_rows and save_rows come together (ops.build_state_rows)")
    if state.dim() == 3:
        blocks, per_block, block_stride, row_stride = state.shape[0], state.shape[1], state.stride(0), state.stride(1)
    else:
        blocks, per_block, block_stride, row_stride = state.shape[0], 1, state.stride(0), state.stride(0)
    state_rows = blocks * per_block
    if read_rows is not None:
        _tensor(op, "read_rows", read_rows, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
        _tensor(op, "save_rows", save_rows, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
        if read_rows.shape[0] < info.requests or read_rows.shape[1] != window - 1 or not read_rows.is_contiguous():
            _fail(op, f"read_rows must be contiguous [>= {info.requests}, {window - 1}] (requests, window - 1), got "
                      f"{list(read_rows.shape)}")  # fmt: skip
        if save_rows.shape[0] < info.rows:
            _fail(op, f"save_rows must hold >= {info.rows} rows (T), got {save_rows.shape[0]}")
        if ring is not None:
            _fail(op, "ring= is for the req_ring state; with read_rows / save_rows the tables address the state")
        tables = None
        for name, t in (("read_rows", read_rows), ("save_rows", save_rows)):
            tables = getattr(t, _TABLES_ATTR, None)
            if tables is None and _DISPATCHED.get():
                break  # as for a plan without a record (_built)
            if tables is None:
                _fail(op, f"{name} was not filled by ops.build_state_rows (or ops.copy_plan from tables that were)")
            if info.build and tables.build != info.build:
                _fail(op, f"{name} was resolved for build {tables.build} of a plan; this plan holds build "
                          f"{info.build}: call ops.build_state_rows after each build_plan")  # fmt: skip
        if decode and tables is not None and tables.ring is not None:
            need = _ring_need(window, info.mtp_step, decode)
            if tables.ring < need:
                _fail(op, f"a decode step on a ring of {tables.ring} rows (build_state_rows ring=): windows of "
                          f"{window} with mtp_step={info.mtp_step} need >= {need}; run it with decode=False (the "
                          "save then follows every window's reads) or widen the ring")  # fmt: skip
        return StateRef(state, state_rows, 0, block_stride, row_stride, read_rows, save_rows), 1, per_block
    if state.dim() == 3:
        if ring is not None and ring != per_block:
            _fail(op, f"ring={ring} but state is [slots, {per_block}, 2W]")
        ring_rows = per_block
        slots = blocks
    else:
        if ring is None:
            _fail(op, "a 2-D state [rows, 2W] needs ring= (rows per request slot), or read_rows / save_rows")
        _int(op, "ring", ring, 1)
        ring_rows = ring
        slots = blocks // ring
    need = _ring_need(window, info.mtp_step, decode)
    if ring_rows < need:
        _fail(op, f"ring={ring_rows} rows cannot hold a window of {window} with mtp_step={info.mtp_step} "
                  f"(needs >= {need}{' in a decode step' if decode else ''}; config.ring_rows(mtp_step))")  # fmt: skip
    if slots < info.num_slots:
        _fail(op, f"state holds {slots} request slots of {ring_rows} rows; the plan addresses {info.num_slots} "
                  "(build_plan num_slots=)")  # fmt: skip
    slot_stride = block_stride if state.dim() == 3 else ring_rows * row_stride
    return StateRef(state, state_rows, slot_stride, block_stride, row_stride, state, state), ring_rows, 1


def _float(op: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        _fail(op, f"{name} must be a float in (0, 1), got {value!r}")
    return float(value)


def _banks(op: str, state_banks, info: PlanInfo, *, head: int, device) -> None:
    """:func:`compress_online_hca`'s checks of its banks."""
    _tensor(op, "state_banks", state_banks, dtypes=(torch.float32,), ndim=4, device=device, inner_contiguous=False)
    if state_banks.shape[2:] != (3, head):
        _fail(op, f"state_banks must be [slots, mtp_step + 1, 3, {head}], got {list(state_banks.shape)}")
    # each slot's banks contiguous; slots stride(0) apart, never overlapping (a view into padded engine blocks)
    slots, banks = state_banks.shape[:2]
    want = (banks * 3 * head, 3 * head, head, 1)
    strides = state_banks.stride()
    inner_ok = all(n == 1 or st == w for n, st, w in zip(state_banks.shape[1:], strides[1:], want[1:]))
    if not inner_ok or (slots > 1 and strides[0] < want[0]):
        _fail(op, f"state_banks [slots, {banks}, 3, {head}] must have each slot's banks contiguous (strides "
                  f"[>= {want[0]}, {want[1]}, {want[2]}, 1]: slots may be padded, not overlap), got strides "
                  f"{list(strides)}")  # fmt: skip
    if state_banks.shape[0] < info.num_slots:
        _fail(op, f"state_banks holds {state_banks.shape[0]} request slots; the plan addresses {info.num_slots} "
                  "(build_plan num_slots=)")  # fmt: skip
    if state_banks.shape[1] < info.mtp_step + 1:
        _fail(op, f"state_banks holds {state_banks.shape[1]} banks per slot; mtp_step={info.mtp_step} (the plan's) "
                  f"needs {info.mtp_step + 1}")  # fmt: skip
