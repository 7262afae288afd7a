"""Buffers as an engine holds them: poison, raw bytes, and the engine path of a step (pages, per-row
metadata with padding rows, ``backend.launch``), what CUDA graphs capture.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4_compressor.config import LATENT

#: Byte the output areas (pool pages, indexer keys and FP8 pages) are filled with before a test.
POISON_BYTE = 0xA5
#: Byte of guard bands around output areas.
GUARD_BYTE = 0x5A
#: float32 poison of the ring, the online banks and the scratch: a quiet NaN with a payload; a kernel that reads
#: a row it should not turns its result into NaN, which no check explains.
POISON_F32 = 0x7FC0A5A5
#: float32 guard bands and padding rows of ``kv_score``: finite values near 1 (~1.29, ~0.85), so that a stray
#: read-modify-write (e.g. adding the APE bias) changes their bits; NaN would carry its payload through it.
GUARD_F32 = 0x3FA5A5A5
PAD_F32 = 0x3F5A5A5A


# ----------------------------------------------------------------------------------------------
# Raw bytes, poison
# ----------------------------------------------------------------------------------------------
def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor as a flat uint8 tensor (NaN-safe equality)."""
    return t.contiguous().view(-1).view(torch.uint8)


def fill_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """Fill a float32 tensor with a bit pattern (in place)."""
    assert t.dtype == torch.float32
    t.view(torch.int32).fill_(bits if bits < 2**31 else bits - 2**32)
    return t


def output_tensors(cache) -> dict[str, torch.Tensor]:
    """The pool's output areas by name (latent pages, or indexer keys and FP8 pages)."""
    return cache.pool.tensors()


def backend_state(cache) -> dict[str, torch.Tensor]:
    """The backend's per-request state (ring or online banks), by name."""
    pool = set(cache.pool.tensors())
    return {k: v for k, v in cache.state_tensors().items() if k not in pool}


def poison_cache(cache) -> None:
    """Poison every tensor the cache owns (never test on zeros): pool bytes ``0xA5``; the float32 state (ring,
    online banks) and the C128 scratch with NaN, so that a row read by mistake shows up."""
    for t in cache.state_tensors().values():
        if t.dtype == torch.float32:
            fill_bits(t, POISON_F32)
        else:
            t.view(torch.uint8).fill_(POISON_BYTE)
    ws = getattr(cache.backend, "workspace", None)
    if ws is not None:
        fill_bits(ws.buffer, POISON_F32)


# ----------------------------------------------------------------------------------------------
# The engine path: pages, per-row metadata with padding, backend.launch
# ----------------------------------------------------------------------------------------------
def step_meta(cache, items, *, pad_rows: int = 0, off_slot: int = -1, pad_slot: int = -1) -> np.ndarray:
    """Reserve the pages of ``items = [(rid, start, n)]`` and return int64 ``[3, T + pad_rows]``:
    ``positions, row_req, out_slot`` as an engine passes them to ``build_plan``. ``off_slot`` is written on rows
    that close no group (engines use 0 or -1); padding rows get ``row_req = pad_slot`` (-1, or the engines'
    ``num_slots``) and, adversarially, a closing position and output slot 0: they must still do nothing."""
    cfg, pool = cache.config, cache.pool
    r = cfg.ratio
    ids = np.array([i[0] for i in items], dtype=np.int64)
    starts = np.array([i[1] for i in items], dtype=np.int64)
    counts = np.array([i[2] for i in items], dtype=np.int64)
    pool.reserve(ids, (starts + counts) // r)
    total = int(counts.sum())
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)] + [np.zeros(0, np.int64)])
    row_req = np.repeat(ids, counts)
    closes = positions % r == r - 1
    out_slot = np.full(total, off_slot, dtype=np.int64)
    out_slot[closes] = pool.out_slots(row_req[closes], positions[closes] // r)
    pad = np.stack([np.full(pad_rows, r - 1), np.full(pad_rows, pad_slot), np.zeros(pad_rows)]).astype(np.int64)
    return np.concatenate([np.stack([positions, row_req, out_slot]), pad], axis=1)


def launch_step(cache, items, rows: torch.Tensor, *, pad_rows=0, pad_requests=0, decode=None, launch=None, **meta):
    """One step through the engine path: :func:`step_meta`, ``kv_score`` with ``pad_rows`` sentinel rows
    (``PAD_F32``), a plan for ``len(items) + pad_requests`` requests, then ``launch(kv, positions, row_req,
    out_slot, plan, decode=...)`` (default ``cache.backend.launch``). The cache's request table is not updated
    (as in an engine, which keeps its own). Returns ``(kv_score, host metadata)``."""
    cfg, dev = cache.config, cache.device
    host = step_meta(cache, items, pad_rows=pad_rows, **meta)
    total = rows.shape[0]
    assert total == sum(n for _, _, n in items)
    kv = fill_bits(torch.empty(total + pad_rows, cfg.row_width, device=dev), PAD_F32)
    kv[:total] = rows.to(dev)
    if decode is None:
        decode = all(n <= cache.mtp_step + 1 for _, _, n in items)
    positions, row_req, out_slot = torch.from_numpy(host).to(dev)
    plan = cache.backend.plan_buffer(total + pad_rows, len(items) + pad_requests)
    (launch or cache.backend.launch)(kv, positions, row_req, out_slot, plan, decode=decode)
    return kv, host


def online_launcher(cache, *, block_t=None, num_warps=None, channel_major=False, exact_fp8=None, split_tile=None):
    """A ``launch`` for :func:`launch_step` that runs the online HCA kernel with an explicit launch shape
    (``ops.compress_online_hca`` picks one itself): ``build_plan``, then ``launch_online_hca`` on the cache's
    banks and pages; in one launch, or with ``split_tile`` channels per program through the cache's scratch."""
    from dsv4_compressor import ops
    from dsv4_compressor.kernels import exact_fp8_default
    from dsv4_compressor.kernels.entry_pack import entry_args
    from dsv4_compressor.kernels.online_hca import launch_online_hca
    from dsv4_compressor.kernels.plan import PlanRef, closing_capacity
    from dsv4_compressor.kernels.ring import ApeRef, KvRef

    cfg, params, pool, banks = cache.config, cache.params, cache.pool, cache.backend.state
    assert not cfg.overlap

    def launch(kv, positions, row_req, out_slot, plan, *, decode):
        ops.build_plan(plan, positions, row_req, out_slot, ratio=cfg.ratio, num_slots=cache.max_requests)
        exact = exact_fp8_default(kv.device) if exact_fp8 is None else exact_fp8
        prm, out, meta = entry_args(
            head=cfg.head_dim, rope=cfg.rope_dim, latent=True, page_size=pool.page_size,
            scale_bytes=cfg.record_scale_bytes, norm_weight=params.norm_weight, cos=params.cos, sin=params.sin,
            eps=params.eps, out_pages=pool.pages, out_keys=None, exact_fp8=exact,
        )  # fmt: skip
        ape = ApeRef(params.ape, params.ape.stride(0), cfg.head_dim * params.ape.stride(1), params.ape.stride(1))
        rows, requests = kv.shape[0], plan.shape[0]
        split = {}
        if split_tile is not None:
            split = dict(scratch=cache.backend.workspace.c128_scratch(0, rows), split_tile=split_tile)
        launch_online_hca(
            KvRef(kv, kv.stride(0)), ape, PlanRef(plan, rows, requests), banks, prm, out, meta, ratio=cfg.ratio,
            closing=closing_capacity(rows, requests, cfg.ratio), decode=decode, block_t=block_t,
            num_warps=num_warps, channel_major=channel_major, **split,
        )  # fmt: skip

    return launch


def pack_args(pool, *, exact_fp8: bool = True):
    """``(EntryOut, EntryMeta)`` of a pool for ``kernels.entry_pack.pack_values`` (which reads no parameters)."""
    from dsv4_compressor.kernels.entry_pack import entry_args

    cfg = pool.config
    one = torch.ones(cfg.head_dim, dtype=torch.float32, device=pool.device)
    table = torch.ones(1, max(1, cfg.rope_dim // 2), dtype=torch.float32, device=pool.device)
    _, out, meta = entry_args(
        head=cfg.head_dim, rope=cfg.rope_dim, latent=cfg.output == LATENT, page_size=pool.page_size,
        scale_bytes=cfg.record_scale_bytes, norm_weight=one, cos=table, sin=table, eps=1e-6,
        out_pages=pool.out_pages, out_keys=pool.out_keys, exact_fp8=exact_fp8,
    )  # fmt: skip
    return out, meta
