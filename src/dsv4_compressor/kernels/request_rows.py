"""A step's per-row request and position from its per-request tensors, in one launch (``ops.rows_from_requests``).

Engines that hand over a step per request (SGLang: ``req_pool_indices``, ``seq_lens``, ``extend_lens``) leave the
per-row tensors a plan is built from to the compressor: row ``t`` of a packed prefill / verify step belongs to
request ``b``, the first whose rows end after ``t``, at position ``seq_lens[b] - extend_lens[b] + (t - first row
of b)``; rows past the last request's are padding. In torch that is a cumsum, an arange, a searchsorted, clamps,
three gathers and wheres: about a dozen launches per plan, more than the plan's own build in a decode step's
graph. Here each program takes ``BLOCK_T`` rows, scans the (at most ``BLOCK_B``) requests' row counts in
registers and writes both outputs.
"""

import triton
import triton.language as tl


@triton.jit
def _rows_from_requests_kernel(
    req, seq, ext, positions, row_req, batch, rows, pad_req,
    DECODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_rows = t < rows
    if DECODE:
        # one row per request: row t is request t, at position seq_lens[t] - 1
        b = t
        valid = in_rows & (t < batch)
        pos = tl.load(seq + b, mask=valid, other=1).to(tl.int64) - 1
    else:
        bb = tl.arange(0, BLOCK_B)
        counts = tl.load(ext + bb, mask=bb < batch, other=0).to(tl.int64)
        ends = tl.cumsum(counts, axis=0)
        before = ends[None, :] <= t[:, None]  # [BLOCK_T, BLOCK_B]: request j's rows end at or before row t
        b = tl.sum(before.to(tl.int32), axis=1)  # the request row t belongs to (batch: padding)
        first = tl.sum(tl.where(before, counts[None, :], 0), axis=1)  # its first row
        valid = in_rows & (b < batch)
        s = tl.load(seq + b, mask=valid, other=0).to(tl.int64)
        n = tl.load(ext + b, mask=valid, other=0).to(tl.int64)
        pos = s - n + (t - first)
    r = tl.load(req + b, mask=valid, other=-1).to(tl.int64)
    keep = valid & (r != pad_req)
    tl.store(positions + t, tl.where(valid, pos, 0), mask=in_rows)
    tl.store(row_req + t, tl.where(keep, r, -1), mask=in_rows)


def launch_rows_from_requests(req, seq, ext, positions, row_req, *, batch: int, rows: int, pad_req: int,
                              decode: bool) -> None:  # fmt: skip
    """Launch over ``rows`` rows (``ext`` unused with ``decode``)."""
    block_b = triton.next_power_of_2(max(batch, 1))
    block_t = max(16, min(128, 4096 // block_b))
    _rows_from_requests_kernel[(triton.cdiv(rows, block_t),)](
        req, seq, ext, positions, row_req, batch, rows, pad_req, DECODE=decode, BLOCK_T=block_t, BLOCK_B=block_b
    )
