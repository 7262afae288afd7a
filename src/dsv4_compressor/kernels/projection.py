"""The compressor's projection ``kv_score = x @ weight.T`` (bf16 in, float32 out), sized for decode steps.

A decode step's projection reads far more weight than anything else (CSA main at D = 4096: 16 MiB of weight
against 0.5 MiB of ``x`` at T = 64), so the kernel is built around reading every weight element once, with
enough programs in flight to keep HBM busy:

- one program per (row block of ``BLOCK_T`` rows, column block of ``BLOCK_N`` outputs, K split): it streams
  its ``BLOCK_N x K / SPLIT_K`` weight slice once, multiplies it with the matching ``x`` columns (``tl.dot``,
  bf16 inputs, float32 accumulation) and keeps the ``BLOCK_T x BLOCK_N`` sums in registers;
- with ``SPLIT_K > 1`` each program stores its partial sums into the workspace, counts its arrival on its
  tile's integer counter (``atomic_add``, acquire-release) and the program that counts the last arrival adds
  the ``SPLIT_K`` partials **in split order** (0, 1, ...), writes the tile and sets the counter back to 0.
  Whoever arrives last, the sum is the same sequence of float32 additions: results are deterministic, and
  tensor-parallel replicas stay byte-identical. No float atomics.

Wide column blocks keep ``x``'s re-reads (one per column block, from L2) small; the K split restores the
parallelism that wide blocks take away. :func:`projection_config` picks the blocks from the shapes alone, so
a CUDA graph's grid depends only on ``T``.

Where :func:`prefetches` says so, each program of the first row block first asks L2 for the first
:data:`PREFETCH_STEPS` ``BLOCK_K`` steps of its weight rows (``cp.async.bulk.prefetch.L2``, Hopper and newer: a
few instructions per program, no registers or shared memory held) and only then waits for the kernel before it
(PDL): the weight does not depend on that kernel, only ``x`` does, so those bytes are on their way while the
predecessor finishes. Measured (docs/DESIGN.md, "The projection's weight prefetched before the wait"): the whole
slice is slower nearly everywhere; the first two steps win only on the V4-Flash HCA weight, which is where it is
on by default (:data:`PREFETCH_ROWS`).

The workspace (float32, flat, :func:`workspace_numel`) holds ``kv_score`` (``T x N``), the partials
(``SPLIT_K x T x N``) and, in its last :data:`COUNTERS` elements (as int32), the tile counters. The counters
sit at a fixed place whatever ``T``, so a prefill step that filled the workspace with rows never leaves a
later decode step's counters non-zero; they are zero when the workspace is allocated and every launch sets
them back to zero.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import interpreting, sm_count
from .pdl import launch_options, wait_then_release

__all__ = [
    "COUNTERS",
    "ProjectionConfig",
    "OVERRIDES",
    "FASTER_THAN_CUBLAS",
    "projection_config",
    "PAIR_FASTER",
    "JOINT_PAIR_TRITON",
    "pair_config",
    "PARTIALS",
    "partials_config",
    "workspace_numel",
    "launch_projection",
]

#: int32 tile counters at the end of every projection workspace (16 KiB): enough for any step the Triton path
#: takes (:func:`projection_config` keeps ``tiles <= COUNTERS``).
COUNTERS = 4096
#: Programs a launch aims at: one wave, a program per multiprocessor (``None``: the current device's count,
#: :func:`~dsv4_compressor.kernels.sm_count`, 132 on the H200, 148 on a B200).
TARGET_PROGRAMS: int | None = None
#: A K split keeps at least this many ``BLOCK_K`` steps per program (the loads of one step overlap the next's).
MIN_K_STEPS = 2
#: ``(width, dim, reduce) -> rows``: the launches that prefetch by default, up to that many rows: measured faster
#: warm and cold with the first 2 steps prefetched (H100, 46f84bc): the V4-Flash HCA weight, reducing at T = 64
#: (7.80 against 7.27 us cold) and left as partials for the online op (its layer from hidden states, B = 16 / 64:
#: 8.34 / 12.9 against 7.70 / 12.6 us cold; the V4-Flash step at B = 16 549 against 532). Every other measured
#: shape was level or slower (the reducing HCA projection at T = 256 by 7%, CSA main at T = 64 by 4%).
PREFETCH_ROWS: dict[tuple[int, int, bool], int] = {(1024, 4096, True): 64, (1024, 4096, False): 256}
#: ``DSV4_PROJECTION_PREFETCH`` at import: ``auto`` (default) :data:`PREFETCH_ROWS`; ``1`` every launch; ``0`` none
#: (A/B runs). Taken only where the device has the instruction (compute capability 9.0 and newer, compiled
#: kernels) and the weight rows start 16-byte aligned.
PREFETCH: str = os.environ.get("DSV4_PROJECTION_PREFETCH", "auto").strip().lower() or "auto"
if PREFETCH not in ("auto", "0", "1"):
    raise ValueError(f"DSV4_PROJECTION_PREFETCH must be auto, 0 or 1, got {PREFETCH!r}")
#: How much of its slice a program prefetches: the first ``PREFETCH_STEPS`` ``BLOCK_K`` steps of each weight row
#: (0: all of it). Only the programs of the first row block prefetch (the others read the same weight).
PREFETCH_STEPS: int = int(os.environ.get("DSV4_PROJECTION_PREFETCH_STEPS", "2"))


def prefetches(rows: int, width: int, dim: int, *, reduce: bool = True) -> bool:
    """Whether a launch of ``rows`` rows of a ``[width, dim]`` weight prefetches by default (:data:`PREFETCH`,
    :data:`PREFETCH_ROWS`); the device and alignment are the launcher's to check."""
    if PREFETCH != "auto":
        return PREFETCH == "1"
    return rows <= PREFETCH_ROWS.get((width, dim, reduce), 0)


class ProjectionConfig(NamedTuple):
    """Block sizes of one launch: ``BLOCK_T`` rows, ``BLOCK_N`` output columns, ``BLOCK_K`` of the reduction per
    step, ``SPLIT_K`` programs per tile along K, and the compiler's ``num_warps`` / ``num_stages``."""

    block_t: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3

    def tiles(self, rows: int, width: int) -> int:
        return triton.cdiv(rows, self.block_t) * triton.cdiv(width, self.block_n)

    def grid(self, rows: int, width: int) -> tuple[int, int, int]:
        return triton.cdiv(rows, self.block_t), triton.cdiv(width, self.block_n), self.split_k


#: ``(width, dim) -> {rows: ProjectionConfig}``: measured choices that replace the heuristic for steps of at
#: most ``rows`` rows (the smallest key that holds the step). The winners of the H200 sweep
#: (``python -m benchmarks.probes.tune_projection``, 40 sampled blocks per case, docs/PERF.md) at
#: DeepSeek-V4-Flash (D = 4096) and -Pro (7168) widths: narrow column blocks with a K split fill one wave.
OVERRIDES: dict[tuple[int, int], dict[int, ProjectionConfig]] = {
    (2048, 4096): {64: ProjectionConfig(64, 32, 128, 2, 4, 4), 256: ProjectionConfig(64, 64, 128, 2, 4, 3)},
    (512, 4096): {64: ProjectionConfig(64, 32, 128, 8, 4, 4), 256: ProjectionConfig(64, 64, 128, 4, 8, 4)},
    (1024, 4096): {64: ProjectionConfig(64, 64, 128, 8, 8, 4), 256: ProjectionConfig(64, 32, 128, 2, 4, 4)},
    (2048, 7168): {64: ProjectionConfig(64, 32, 128, 4, 4, 4), 256: ProjectionConfig(64, 64, 128, 2, 8, 3)},
    (512, 7168): {64: ProjectionConfig(64, 32, 128, 8, 4, 3), 256: ProjectionConfig(64, 32, 128, 4, 4, 4)},
    (1024, 7168): {64: ProjectionConfig(64, 32, 128, 4, 4, 4), 256: ProjectionConfig(64, 64, 128, 4, 4, 3)},
    # a CSA layer's main and indexer weights in one launch (pair_config; tune_projection --pairs, 61 blocks each)
    (2560, 4096): {64: ProjectionConfig(64, 64, 128, 2, 4, 5)},
    (2560, 7168): {64: ProjectionConfig(64, 32, 128, 4, 4, 3)},
}
#: ``(width, dim) -> rows``: the largest step at which the bench of record (``dsv4-compressor bench --quick``,
#: docs/PERF.md, H200) measured this kernel, with :data:`OVERRIDES`, faster than cuBLAS
#: (``torch.mm(x, w.T, out_dtype=float32)``) both warm and cold, by at least 5% cold; ``projection="auto"`` takes
#: the Triton path up to it and cuBLAS above it and for every other shape. At T = 64 (B = 16 decode, S = 4) every
#: V4 projection but the V4-Pro indexer (level warm), and the V4-Flash indexer up to T = 256; cuBLAS is faster on
#: every other measured step (T = 256 and 1,024).
FASTER_THAN_CUBLAS: dict[tuple[int, int], int] = {
    (2048, 4096): 64,  # cold 8.84 against 10.3 us, warm 8.77 against 9.58
    (512, 4096): 256,  # T = 64: 5.66 / 7.82 cold; T = 256: 7.64 / 8.46 cold, 7.58 / 7.73 warm
    (1024, 4096): 64,  # 7.33 / 8.35 cold, 7.25 / 7.58 warm
    (2048, 7168): 64,  # 12.2 / 13.6 cold, 11.7 / 12.8 warm
    (1024, 7168): 64,  # 8.50 / 10.0 cold, 8.45 / 9.30 warm
}


#: ``(N1, N2, dim) -> rows``: the largest step at which one launch of a CSA layer's two projections (main and
#: indexer, :func:`pair_config`) measured faster than the two apart (``launch_projection`` per weight at its own
#: blocks) and than cuBLAS's two GEMMs, cold (H200, ``python -m benchmarks.probes.tune_projection
#: OUT --pairs 2048+512x4096,2048+512x7168``, docs/runs/probe_770d9c3). At T = 256 the pair was slower than
#: cuBLAS. cuBLAS on the two weights concatenated into one tensor is faster still (9.3 / 14.5 us at T = 64):
#: ``ops.project`` runs that where the two are one tensor's halves (``ops.join_pair_weights``).
PAIR_FASTER: dict[tuple[int, int, int], int] = {
    (2048, 512, 4096): 64,  # 11.2 against 15.3 (ours apart) and 16.3 us (cuBLAS apart)
    (2048, 512, 7168): 64,  # 15.6 against 20.3 and 20.3 us
}
#: ``(N1, N2, dim) -> rows``: the largest step at which a CSA layer's pair whose weights are one tensor's halves
#: (``ops.join_pair_weights``, as the LightLLM and SGLang adapters hold them) takes this kernel's one launch on the
#: halves instead of one cuBLAS GEMM of the joint weight. Measured beside the engine's attention input GEMM on
#: another stream, as the engines run the compressor (``bench --preset projection``'s ``beside-gemm`` layers,
#: H100, 46f84bc, cold, us per layer and GEMM together): V4-Flash B = 16 (T = 64) 20.8 against 24.1, the layer
#: alone level (17.4 / 17.5) and the decode step level (532.2 / 534.3); at T = 256 cuBLAS wins alone and beside
#: (32.6 against 41.9). V4-Pro was not measured beside its GEMM: cuBLAS. At most :data:`PAIR_FASTER`'s rows (the
#: adapters' pair workspaces are sized by it).
JOINT_PAIR_TRITON: dict[tuple[int, int, int], int] = {
    (2048, 512, 4096): 64,
}


#: ``(width, dim) -> {rows: ProjectionConfig}``: blocks for a projection whose consumer adds the K split's partials
#: itself (``launch_projection(reduce=False)``; :func:`partials_config`), so the kernel skips the last-arriving
#: program's reduction, its counter and ``kv_score``'s store. Measured (H200, ``python -m
#: benchmarks.probes.tune_projection OUT --partials``, docs/runs/probe_03536d9), us per launch cold
#: against the reducing kernel's best and cuBLAS. The V4-Flash HCA weight, which ``ops.compress_online_hca_from_hidden``
#: projects this way; the other shapes were not measured (V4-Pro) or feed kernels that read ``kv_score`` whole.
PARTIALS: dict[tuple[int, int], dict[int, ProjectionConfig]] = {
    # T = 64: 4.95 against 7.45 (reducing) and 7.47 (cuBLAS); T = 256: 8.48 against 10.46 and 9.52
    (1024, 4096): {64: ProjectionConfig(64, 64, 128, 8, 8, 4), 256: ProjectionConfig(64, 128, 64, 8, 4, 4)},
}


if os.environ.get("DSV4_PROJECTION_PARTIALS") == "0":  # A/B runs: every projection adds its partials itself
    PARTIALS.clear()


def partials_config(rows: int, width: int, dim: int) -> ProjectionConfig | None:
    """The blocks of a projection left as its partials (:data:`PARTIALS`, the smallest row key that holds the
    step), or ``None`` where none was measured: the projection then sums its partials itself."""
    for limit, cfg in sorted(PARTIALS.get((width, dim), {}).items()):
        if rows <= limit:
            return cfg
    return None


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def projection_config(rows: int, width: int, dim: int, *, programs: int | None = None) -> ProjectionConfig:
    """The blocks of a projection of ``rows`` rows, ``width`` (``2W``) outputs and ``dim`` (``D``) inputs.

    ``BLOCK_T`` = ``rows`` rounded up to a power of two in [16, 64]; ``BLOCK_N`` 128 for ``width >= 1024`` (CSA
    main 2048, HCA 1024), else 64 (the indexer's 512); ``BLOCK_K`` 128 (64, 32, 16 when ``dim`` needs);
    ``SPLIT_K`` the largest power of two that divides ``dim / BLOCK_K``, keeps :data:`MIN_K_STEPS` steps per
    program and keeps the grid within ``programs`` (``None``: :data:`TARGET_PROGRAMS`, by default the device's
    multiprocessors; at T = 64 on 132: CSA main 16 tiles x 8 splits, the indexer and HCA 8 x 16).
    :data:`OVERRIDES` takes precedence."""
    if programs is None:
        programs = sm_count() if TARGET_PROGRAMS is None else TARGET_PROGRAMS
    tuned = OVERRIDES.get((width, dim))
    if tuned:
        for limit in sorted(tuned):
            if rows <= limit:
                return tuned[limit]
    block_t = min(64, max(16, _pow2_at_least(rows)))
    block_n = 128 if width >= 1024 else 64
    block_k = next(b for b in (128, 64, 32, 16) if dim % b == 0)
    steps = dim // block_k
    tiles = triton.cdiv(rows, block_t) * triton.cdiv(width, block_n)
    split = 1
    while steps % (2 * split) == 0 and steps // (2 * split) >= MIN_K_STEPS and tiles * 2 * split <= programs:
        split *= 2
    return ProjectionConfig(block_t, block_n, block_k, split)


def pair_config(rows: int, first: int, second: int, dim: int) -> ProjectionConfig | None:
    """The blocks of one launch projecting two weights (``first`` and ``second`` outputs): those of a
    ``first + second`` wide weight, the column block halved until it divides ``first`` (a block reads one
    weight); ``None`` where ``first`` is not a multiple of 16."""
    if first % 16:
        return None
    cfg = projection_config(rows, first + second, dim)
    block_n = cfg.block_n
    while first % block_n:
        block_n //= 2
    return cfg._replace(block_n=block_n)


def workspace_numel(rows: int, width: int, cfg: ProjectionConfig | None) -> int:
    """float32 elements a launch of ``rows`` rows needs: ``kv_score``, the partials (``cfg.split_k > 1``) and the
    counters (``cfg``: the Triton path; ``None``: ``kv_score`` only, e.g. a cuBLAS projection)."""
    if cfg is None:
        return rows * width + COUNTERS
    parts = cfg.split_k if cfg.split_k > 1 else 0
    return rows * width * (1 + parts) + COUNTERS


@functools.cache
def _bulk_prefetch_device(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or interpreting() or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefetch_row_bytes(cfg: ProjectionConfig, dim: int, steps: int | None = None) -> int:
    """Bytes of each weight row a program prefetches: its slice (``dim / split_k`` bf16), or its first ``steps``
    ``BLOCK_K`` steps (``None``: :data:`PREFETCH_STEPS`; 0: the whole slice)."""
    steps = PREFETCH_STEPS if steps is None else steps
    row = dim // cfg.split_k
    return 2 * (min(row, steps * cfg.block_k) if steps > 0 else row)


def prefetch_chunks(cfg: ProjectionConfig, dim: int, steps: int | None = None) -> int:
    """Pieces each row's prefetch (:func:`prefetch_row_bytes`) is issued in: enough that every thread of a
    program issues about one prefetch (``num_warps * 32 / block_n``), each piece a multiple of 16 bytes."""
    row_bytes = prefetch_row_bytes(cfg, dim, steps)
    chunks = max(1, cfg.num_warps * 32 // cfg.block_n)
    while chunks > 1 and (row_bytes % chunks or (row_bytes // chunks) % 16):
        chunks //= 2
    return chunks


@triton.jit
def _prefetch_rows_l2(row_ptr, row_bytes: tl.constexpr, CHUNKS: tl.constexpr):
    """Ask L2 for ``row_bytes`` bytes at each of ``row_ptr`` (a ``[R]`` block of bf16 pointers), in ``CHUNKS``
    pieces per row: ``cp.async.bulk.prefetch.L2.global`` (sm_90+), one per element of an ``[R, CHUNKS]`` block.
    Nothing waits on it; a later load of those bytes finds them in L2 (or in flight to it)."""
    CHUNK: tl.constexpr = row_bytes // CHUNKS
    piece = tl.arange(0, CHUNKS) * (CHUNK // 2)  # bf16 elements
    ptrs = row_ptr[:, None] + piece[None, :]
    size = tl.full(ptrs.shape, CHUNK, tl.int32)
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0;\n\tcp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r", [ptrs, size],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


# T is not specialised: a one-row step would make it a constexpr 1 (no ``.to``), and one compiled kernel serves
# every step size a captured graph replays.
@triton.jit(do_not_specialize=["T"])
def _projection_kernel(x_ptr, x_stride, w_ptr, w_stride, w2_ptr, w2_stride, out_ptr, part_ptr, count_ptr, T,
                       N: tl.constexpr, N1: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       COUNTERS: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
                       REDUCE: tl.constexpr = True, PREFETCH_CHUNKS: tl.constexpr = 0,
                       PREFETCH_BYTES: tl.constexpr = 0):  # fmt: skip
    """``out[t, n] = sum_k x[t, k] * w[n, k]`` for this program's tile and K split (see the module docstring);
    ``out`` is ``[T, N]`` contiguous, partial ``s`` the ``[T, N]`` block at ``part_ptr + s * T * N``, tile
    ``i``'s counter ``count_ptr[COUNTERS - 1 - i]`` (from the end: the same place whatever ``T``). With
    ``N1 < N`` the weight is two: columns ``[0, N1)`` are ``w``'s rows, ``[N1, N)`` ``w2``'s (``BLOCK_N``
    divides ``N1``, so a column block reads one of them). ``PREFETCH_CHUNKS > 0``: the first row block's
    programs request ``PREFETCH_BYTES`` of each weight row of their slice into L2 first, before the PDL wait
    (:func:`_prefetch_rows_l2`)."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    K_SPLIT: tl.constexpr = K // SPLIT_K
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < T
    cmask = cols < N
    kk = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    xp = x_ptr + rows[:, None].to(tl.int64) * x_stride + kk[None, :]
    w_base = w_ptr
    w_rows = cols
    w_row_stride = w_stride
    w_last = pid_n * 0 + (N1 - 1)  # the last row of the weight this block reads
    if N1 < N:
        if pid_n * BLOCK_N >= N1:
            w_base = w2_ptr
            w_rows = cols - N1
            w_row_stride = w2_stride
            w_last = pid_n * 0 + (N - N1 - 1)
    if PREFETCH_CHUNKS > 0:  # the weight does not depend on the kernel before: request it before the wait
        if pid_t == 0:
            slice_rows = tl.minimum(w_rows, w_last).to(tl.int64) * w_row_stride + pid_k * K_SPLIT
            _prefetch_rows_l2(w_base + slice_rows, PREFETCH_BYTES, PREFETCH_CHUNKS)
    wait_then_release(PDL)
    wp = w_base + w_rows[None, :].to(tl.int64) * w_row_stride + kk[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        a = tl.load(xp, mask=rmask[:, None], other=0.0)
        b = tl.load(wp, mask=cmask[None, :], other=0.0)
        if UPCAST:  # the interpreter's dot misreads bf16 operands; float32 products of bf16 values are exact
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        xp += BLOCK_K
        wp += BLOCK_K
    cell = rows[:, None].to(tl.int64) * N + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + cell, acc, mask=omask)
    elif not REDUCE:  # the partials are the result: whoever reads them adds them in split order
        tl.store(part_ptr + pid_k * (T.to(tl.int64) * N) + cell, acc, mask=omask)
    else:
        block = T.to(tl.int64) * N
        tl.store(part_ptr + pid_k * block + cell, acc, mask=omask)
        # Every thread's stores precede the release below (the barrier orders them before the one thread that
        # performs the atomic), so the program that counts the last arrival sees every partial.
        tl.debug_barrier()
        counter = count_ptr + (COUNTERS - 1) - (pid_t * tl.num_programs(1) + pid_n)
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.store(counter, 0)
            total = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other programs' partials are (this multiprocessor's L1 may be stale)
                total += tl.load(part_ptr + s * block + cell, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + cell, total, mask=omask)


def launch_projection(
    x, weight, workspace, *, rows: int, cfg: ProjectionConfig, pdl: bool, weight2=None, reduce: bool = True,
    prefetch: bool | None = None,
) -> None:  # fmt: skip
    """``workspace[: rows * N]`` (as ``[rows, N]``) = ``x[:rows] @ weight.T`` in float32; with ``weight2``
    (``[N2, D]``), ``x[:rows] @ cat(weight, weight2).T`` (``N = N1 + N2``) in the same launch, ``cfg.block_n``
    dividing ``N1``.

    ``x``: bf16 ``[>= rows, D]`` (unit column stride), ``weight``: bf16 ``[N1, D]`` (unit column stride),
    ``workspace``: float32, flat, at least :func:`workspace_numel` elements, counters zero. Validated by the
    caller (``ops.compress_from_hidden``, ``ops.project``). ``reduce=False`` (with ``cfg.split_k > 1``) leaves
    the ``split_k`` partials (``[split_k, rows, N]`` at ``workspace[rows * N:]``) as the result, unsummed.
    ``prefetch``: the L2 prefetch of the weight before the wait (``None``: :func:`prefetches`, where the device
    has it); taken only where every prefetched row starts 16-byte aligned, never under the interpreter."""
    first, dim = weight.shape
    width = first + (0 if weight2 is None else weight2.shape[0])
    second = weight if weight2 is None else weight2
    counters = workspace.view(torch.int32)[-COUNTERS:]
    grid = cfg.grid(rows, width)
    options = launch_options(pdl, grid[0] * grid[1] * grid[2])
    if prefetch is None:
        split = reduce or cfg.split_k == 1
        prefetch = prefetches(rows, width, dim, reduce=split) and _bulk_prefetch_device(x.device.type, x.device.index)
    aligned = all(w.data_ptr() % 16 == 0 and w.stride(0) * 2 % 16 == 0 for w in (weight, second))
    prefetch = prefetch and aligned and not interpreting() and dim // cfg.split_k % 8 == 0
    chunks = prefetch_chunks(cfg, dim) if prefetch else 0
    row_bytes = prefetch_row_bytes(cfg, dim) if prefetch else 0
    _projection_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), second, second.stride(0), workspace, workspace[rows * width :],
        counters, rows, N=width, N1=first, K=dim, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, COUNTERS=COUNTERS, UPCAST=interpreting(), REDUCE=reduce, PREFETCH_CHUNKS=chunks,
        PREFETCH_BYTES=row_bytes,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **options,
    )  # fmt: skip
