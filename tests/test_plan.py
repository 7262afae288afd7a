"""``ops.build_plan`` against an independent numpy model of the plan, and ``ops.check_plan``'s error codes.

The model below is written from the layout table in ``kernels/plan.py``'s docstring, row by row in plain
Python; the kernel builds the same records with scans. Inputs are engine-shaped: int32 and int64 metadata,
padding rows (``-1``, ``num_slots``, huge int64 values) before, between and after requests, and ``0`` or ``-1``
in ``out_slot`` off group boundaries.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.session import interpreting, kernel_device

from dsv4_compressor import ops
from dsv4_compressor.errors import OpError
from dsv4_compressor.kernels import plan as P

REC = int(P.REC)


@pytest.fixture(autouse=True, params=["blocks", "one_block"])
def plan_kernel(request, monkeypatch):
    """Every test runs with both builds: one program per block of rows, and the single-program build."""
    monkeypatch.setattr(P, "PLAN_KERNEL", request.param)
    return request.param


def pin_128_row_blocks(monkeypatch):
    """The blocks build in 128-row blocks whatever the step (its prefix chunk as shipped), for tests whose point
    does not depend on the block size: fewer programs for the interpreter, whose time grows with them."""
    shipped = P.blocks_config
    monkeypatch.setattr(P, "blocks_config", lambda rows: (128, 4, shipped(rows)[2]))


def model_plan(positions, row_req, out_slot, *, requests: int, ratio: int, num_slots: int):
    """``(header, request records, row records, closing records)`` as int64 arrays."""
    rows = len(positions)
    runs = []  # [first row, slot, last row]
    for t in range(rows):
        if not 0 <= row_req[t] < num_slots:
            continue
        if runs and runs[-1][2] == t - 1 and row_req[t - 1] == row_req[t] and positions[t - 1] + 1 == positions[t]:
            runs[-1][2] = t
        else:
            runs.append([t, int(row_req[t]), t])
    row_rec = np.array([[positions[t], -1, 0, 0, 0, -1, -1, 0] for t in range(rows)], dtype=np.int64).reshape(-1, 8)
    req_rec = np.full((requests, 8), -1, dtype=np.int64)
    closing = np.full((rows // ratio + requests, 8), -1, dtype=np.int64)
    n_close, valid, flags = 0, 0, 0
    for k, (t0, slot, t1) in enumerate(runs[:requests]):
        start, end = positions[t0], positions[t1] + 1
        first_out = None
        for t in range(t0, t1 + 1):
            closes = positions[t] % ratio == ratio - 1
            out = int(out_slot[t]) if closes else -1
            if not -1 <= out < 2**31 - 1:  # beyond int32: the row writes nothing, and the step is flagged
                out = -1
                flags |= int(P.FLAG_SLOT_OVERFLOW)
            row_rec[t] = [positions[t], slot, start, t0, end, out, k, 0]
            valid += 1
            if closes:
                first_out = out if first_out is None else first_out
                closing[n_close] = [t, positions[t], slot, start, t0, end, out, k]
                n_close += 1
        req_rec[k] = [t0, slot, start, t0, end, -1 if first_out is None else first_out, k, 0]
    flags |= int(P.FLAG_REQUEST_OVERFLOW) if len(runs) > requests else 0
    header = np.array([rows, requests, ratio, num_slots, len(runs), n_close, valid, flags], dtype=np.int64)
    return header, req_rec, row_rec, closing


def read_plan(plan: torch.Tensor, rows: int, requests: int, ratio: int):
    flat = plan.reshape(-1).cpu().numpy().astype(np.int64)
    n_close = rows // ratio + requests
    header = flat[:REC]
    req = flat[REC : REC * (1 + requests)].reshape(-1, 8)
    row = flat[REC * (1 + requests) : REC * (1 + requests + rows)].reshape(-1, 8)
    closing = flat[REC * (1 + requests + rows) : REC * (1 + requests + rows + n_close)].reshape(-1, 8)
    return header, req, row, closing


def engine_rows(rng, *, ratio: int, num_slots: int, requests: int, pad_value: int, off_boundary: int):
    """A step as an engine hands it over: requests of random lengths and starts (rewinds look the same as
    continuations here), padding rows sprinkled in, ``out_slot`` meaningful only on group-closing rows."""
    positions, row_req = [], []
    for slot in rng.permutation(num_slots)[:requests]:
        if rng.random() < 0.3:
            positions.append(int(rng.integers(0, 50)))
            row_req.append(pad_value)
        n, start = int(rng.integers(1, 3 * ratio + 2)), int(rng.integers(0, 5 * ratio))
        positions += range(start, start + n)
        row_req += [int(slot)] * n
        if rng.random() < 0.2:  # the same slot again after a jump: a second run (check_plan flags it)
            positions += range(start + n + 3, start + n + 5)
            row_req += [int(slot)] * 2
    for _ in range(int(rng.integers(0, 4))):
        positions.append(0)
        row_req.append(pad_value)
    positions = np.array(positions, dtype=np.int64)
    out = rng.integers(0, 1 << 20, size=len(positions))
    out[positions % ratio != ratio - 1] = off_boundary
    return positions, np.array(row_req, dtype=np.int64), out


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ratio", [4, 8, 128])
def test_build_plan_matches_model(dtype, ratio, monkeypatch):
    """Random engine-like steps against the numpy model. At ratio 128 (steps of up to 1,500 rows) the blocks
    build runs 128-row blocks, whatever ``blocks_config`` gives those steps: the interpreter's time grows with
    the programs, and the smaller ratios' steps already run several of the shipped small blocks."""
    if ratio == 128:
        pin_128_row_blocks(monkeypatch)
    rng = np.random.default_rng(ratio + (dtype == torch.int64))
    num_slots = 7
    for trial in range(12):
        requests_in_step = int(rng.integers(0, 5))
        pad_value = int(rng.choice([-1, num_slots, 1 << 40 if dtype == torch.int64 else 1 << 30]))
        positions, row_req, out = engine_rows(
            rng, ratio=ratio, num_slots=num_slots, requests=requests_in_step, pad_value=pad_value,
            off_boundary=int(rng.choice([0, -1])),
        )  # fmt: skip
        rows = len(positions)
        capacity = requests_in_step + int(rng.integers(0, 3))
        plan = ops.empty_plan(rows + 5, max(capacity, 1), ratio, "cpu")
        plan.fill_(0x5A5A5A5A)  # whatever a previous step left must not leak into this one
        ops.build_plan(
            plan, torch.tensor(positions, dtype=dtype), torch.tensor(row_req, dtype=dtype),
            torch.tensor(out, dtype=dtype), ratio=ratio, num_slots=num_slots,
        )  # fmt: skip
        want = model_plan(positions, row_req, out, requests=max(capacity, 1), ratio=ratio, num_slots=num_slots)
        got = read_plan(plan, rows, max(capacity, 1), ratio)
        for name, w, g in zip(("header", "requests", "rows", "closing"), want, got):
            assert np.array_equal(w, g), f"trial {trial}: {name}\nwant {w}\ngot  {g}"


@pytest.mark.parametrize("kernel", ["one_block", "blocks16"])
@pytest.mark.parametrize("read", ["gather", "lookup"])
@pytest.mark.parametrize(("row_dtype", "map_dtype"), [(torch.int32, torch.int64), (torch.int64, torch.int32)])
def test_build_plan_with_a_request_to_slot_table(row_dtype, map_dtype, read, kernel, monkeypatch):
    """``req_state_slot``: rows carry request indices, the table (a strided column, as vLLM's
    ``block_table[:, 0]``) their slots. The plan equals the model's for the slots looked up on the host; padding
    comes from the row (``-1``, an index past the table) or from the table (``-1``, ``>= num_slots``). The
    table is gathered from (read whole with the rows) or, past ``SLOT_GATHER_MAX`` entries, looked up row by row;
    by the one-block build, or by the blocks build in blocks of 16 rows (prefix chunks of 16: several blocks
    and chunks on these small steps)."""
    if read == "lookup":
        monkeypatch.setattr(P, "SLOT_GATHER_MAX", 1)
    if kernel == "blocks16":
        monkeypatch.setattr(P, "PLAN_KERNEL", "blocks")
        monkeypatch.setattr(P, "blocks_config", lambda rows: (16, 4, 16))
    rng = np.random.default_rng(5 + (row_dtype == torch.int64))
    num_slots, ratio = 7, 4
    for trial in range(8):
        requests_in_step = int(rng.integers(1, 5))
        positions, slots, out = engine_rows(
            rng, ratio=ratio, num_slots=num_slots, requests=requests_in_step, pad_value=-1, off_boundary=-1
        )  # fmt: skip
        # request index i holds slot order[i]; two more indices hold a padding slot (-1, num_slots)
        order = rng.permutation(num_slots)
        table_values = np.concatenate([order, [-1, num_slots]])
        index_of = {int(s): i for i, s in enumerate(order)}
        pad_index = rng.choice([-1, len(table_values), num_slots, num_slots + 1], size=len(slots))
        row_req = np.array([index_of[int(s)] if s >= 0 else int(p) for s, p in zip(slots, pad_index)])
        table = torch.full((len(table_values), 3), -7, dtype=map_dtype)
        table[:, 1] = torch.tensor(table_values, dtype=map_dtype)
        capacity = requests_in_step + 2
        plan = ops.empty_plan(len(positions), capacity, ratio, "cpu")
        plan.fill_(0x5A5A5A5A)
        ops.build_plan(
            plan, torch.tensor(positions, dtype=row_dtype), torch.tensor(row_req, dtype=row_dtype),
            torch.tensor(out, dtype=row_dtype), ratio=ratio, num_slots=num_slots, req_state_slot=table[:, 1],
        )  # fmt: skip
        want = model_plan(positions, slots, out, requests=capacity, ratio=ratio, num_slots=num_slots)
        got = read_plan(plan, len(positions), capacity, ratio)
        for name, w, g in zip(("header", "requests", "rows", "closing"), want, got):
            assert np.array_equal(w, g), f"trial {trial}: {name}\nwant {w}\ngot  {g}"
    # two request indices of one slot, back to back with consecutive positions: two requests, not one
    plan = ops.empty_plan(4, 2, ratio, "cpu")
    ops.build_plan(
        plan, torch.arange(4), torch.tensor([0, 0, 1, 1]), torch.full((4,), -1), ratio=ratio, num_slots=num_slots,
        req_state_slot=torch.tensor([3, 3]),
    )  # fmt: skip
    header, req, _rows, _closing = read_plan(plan, 4, 2, ratio)
    assert header[int(P.H_REQUESTS)] == 2 and req[:, 1].tolist() == [3, 3]


def test_build_plan_refuses_a_bad_request_to_slot_table():
    plan = ops.empty_plan(4, 2, 4, "cpu")
    rows = torch.arange(4)
    for table, needle in ((torch.tensor([[1, 2]]), "dimensions"), (torch.tensor([1.0]), "int32 or torch.int64")):
        before = plan.clone()
        with pytest.raises(OpError, match=needle):
            ops.build_plan(plan, rows, rows, rows, ratio=4, num_slots=4, req_state_slot=table)
        assert torch.equal(plan, before)


# The interpreter runs a program as one thread whatever num_warps says: there only the first case is new.
_SAME_UNDER_INTERPRETER = pytest.mark.skipif(interpreting(), reason="the interpreter ignores num_warps")


@pytest.mark.parametrize("num_warps", [4, pytest.param(8, marks=_SAME_UNDER_INTERPRETER),
                                       pytest.param(16, marks=_SAME_UNDER_INTERPRETER)])  # fmt: skip
def test_build_plan_one_block_with_other_warp_counts(num_warps):
    """The one-block build of a step of about 900 rows (block 1,024) launched with 4, 8 or 16 warps, on the
    device kernels run on (the GPU where there is one: ``pytest tests/test_plan.py -k warp``): the same plan."""
    rng = np.random.default_rng(100 + num_warps)
    positions, row_req, out = engine_rows(rng, ratio=4, num_slots=300, requests=110, pad_value=-1, off_boundary=0)
    rows, requests = len(positions), 128
    assert 512 < rows <= 1024, rows
    dev = kernel_device()
    plan = ops.empty_plan(rows, requests, 4, dev)
    plan.fill_(0x5A5A5A5A)
    P.launch_build_plan(
        plan, torch.tensor(positions, device=dev), torch.tensor(row_req, device=dev), torch.tensor(out, device=dev),
        rows=rows, requests=requests, ratio=4, num_slots=300, num_warps=num_warps,
    )  # fmt: skip
    want = model_plan(positions, row_req, out, requests=requests, ratio=4, num_slots=300)
    for name, w, g in zip(("header", "requests", "rows", "closing"), want, read_plan(plan, rows, requests, 4)):
        assert np.array_equal(w, g), f"{num_warps} warps: {name}"


def test_build_plan_request_overflow_is_flagged_and_extra_rows_do_nothing():
    positions = np.concatenate([np.arange(0, 8), np.arange(3, 11), np.arange(20, 24)])
    row_req = np.array([0] * 8 + [1] * 8 + [2] * 4)
    out = np.arange(len(positions))
    plan = ops.empty_plan(len(positions), 2, 4, "cpu")
    ops.build_plan(plan, torch.tensor(positions), torch.tensor(row_req), torch.tensor(out), ratio=4, num_slots=3)
    header, req, rows, closing = read_plan(plan, len(positions), 2, 4)
    assert header[int(P.H_REQUESTS)] == 3 and header[int(P.H_FLAGS)] & int(P.FLAG_REQUEST_OVERFLOW)
    assert (rows[16:, 1] == -1).all() and (rows[16:, 5] == -1).all()  # request 2's rows became padding
    assert set(closing[:, 0][closing[:, 0] >= 0]) <= set(range(16))
    err = torch.zeros(4, dtype=torch.int32)
    ops.check_plan(plan, None, err)
    assert err[0] == int(P.ERR_REQUEST_OVERFLOW)
    assert "3 requests" in ops.plan_error(err)


def test_build_plan_is_deterministic_and_overwrites_everything_it_owns():
    rng = np.random.default_rng(5)
    positions, row_req, out = engine_rows(rng, ratio=4, num_slots=9, requests=6, pad_value=-1, off_boundary=0)
    args = [torch.tensor(a) for a in (positions, row_req, out)]
    rows = len(positions)
    a = ops.empty_plan(rows, 8, 4, "cpu")
    b = ops.empty_plan(rows, 8, 4, "cpu")
    b.fill_(-123456)
    ops.build_plan(a, *args, ratio=4, num_slots=9)
    ops.build_plan(b, *args, ratio=4, num_slots=9)
    used = ops.plan_numel(rows, 8, 4)
    assert torch.equal(a.reshape(-1)[:used], b.reshape(-1)[:used])


def test_empty_plan_shape_and_capacity_check():
    plan = ops.empty_plan(100, 16, 4, "cpu")
    assert plan.dtype == torch.int32 and plan.shape[0] == 16 and plan.numel() >= ops.plan_numel(100, 16, 4)
    idx = torch.zeros(101, dtype=torch.int64)
    with pytest.raises(OpError, match="101 rows and 16 requests"):
        ops.build_plan(plan, idx, idx, idx, ratio=4, num_slots=16)
    with pytest.raises(OpError, match="differ in length"):
        ops.build_plan(plan, idx[:5], idx[:4], idx[:5], ratio=4, num_slots=16)
    with pytest.raises(OpError, match="int32 or torch.int64"):
        ops.build_plan(plan, idx[:5].float(), idx[:5], idx[:5], ratio=4, num_slots=16)
    with pytest.raises(OpError, match="contiguous"):
        ops.build_plan(plan, torch.zeros(10, dtype=torch.int64)[::2], idx[:5], idx[:5], ratio=4, num_slots=16)
    with pytest.raises(OpError, match="ratio"):
        ops.build_plan(plan, idx[:5], idx[:5], idx[:5], ratio=0, num_slots=16)
    with pytest.raises(OpError, match="plan must be"):
        ops.build_plan(plan.long(), idx[:5], idx[:5], idx[:5], ratio=4, num_slots=16)
    with pytest.raises(OpError, match="max_requests"):
        ops.empty_plan(10, 0, 4, "cpu")


def _plan_for(requests, *, ratio=4, capacity=None):
    """A built plan for ``requests = [(slot, start, n), ...]`` in row order."""
    positions = np.concatenate([np.arange(s, s + n) for _, s, n in requests])
    row_req = np.concatenate([[slot] * n for slot, _, n in requests])
    out = np.arange(len(positions))
    plan = ops.empty_plan(len(positions), capacity or len(requests), ratio, "cpu")
    ops.build_plan(plan, torch.tensor(positions), torch.tensor(row_req), torch.tensor(out), ratio=ratio, num_slots=8)
    return plan


@pytest.mark.parametrize(
    "requests, lengths, kwargs, code, needles",
    [
        ([(0, 10, 4), (1, 0, 9)], [10, 0, 0, 0, 0, 0, 0, 0], dict(mtp_step=3), 0, []),
        ([(0, 10, 4), (1, 0, 9), (0, 14, 2)], None, {}, P.ERR_REQUEST_TWICE, ["request 0", "slot 0"]),
        ([(0, 10, 4), (0, 20, 2)], None, {}, P.ERR_REQUEST_TWICE, ["second run"]),
        ([(0, 10, 4), (1, 0, 9)], None, dict(max_positions=12), P.ERR_BEYOND_ROPE, ["position 13"]),
        ([(1, 0, 3), (0, 6, 4)], [10, 0, 0, 0, 0, 0, 0, 0], dict(mtp_step=3), P.ERR_START, ["slot 0", "at 6"]),
        ([(0, 11, 4)], [10, 0, 0, 0, 0, 0, 0, 0], dict(mtp_step=3), P.ERR_START, ["at 11"]),
        (
            [(0, 10, 4), (1, 3, 5)],
            [10, 3, 0, 0, 0, 0, 0, 0],
            dict(mtp_step=3, decode=True),
            P.ERR_DECODE_ROWS,
            ["request 1", "5 rows"],
        ),  # fmt: skip
        ([(0, 10, 4), (1, 3, 5)], [10, 3, 0, 0, 0, 0, 0, 0], dict(mtp_step=3), 0, []),
    ],
)
def test_check_plan_codes(requests, lengths, kwargs, code, needles):
    plan = _plan_for(requests)
    err = torch.full((4,), 99, dtype=torch.int32)
    state_info = None if lengths is None else torch.tensor(lengths, dtype=torch.int64)
    ops.check_plan(plan, state_info, err, **kwargs)
    assert int(err[0]) == int(code), ops.plan_error(err)
    message = ops.plan_error(err)
    if code == 0:
        assert message is None and err.tolist() == [0, -1, -1, 0]
    for needle in needles:
        assert needle in message, (needle, message)


def test_check_plan_reports_the_first_error_in_code_then_request_order():
    # request 2 has a start beyond its state's length, and request 1 reaches past the rope table: rope first
    plan = _plan_for([(0, 0, 4), (1, 60, 8), (2, 9, 2)])
    err = torch.zeros(4, dtype=torch.int32)
    ops.check_plan(plan, torch.tensor([0, 60, 4, 0, 0, 0, 0, 0]), err, mtp_step=1, max_positions=64)
    assert err.tolist()[:3] == [int(P.ERR_BEYOND_ROPE), 1, 1]
    ops.check_plan(plan, torch.tensor([0, 60, 4, 0, 0, 0, 0, 0]), err, mtp_step=1, max_positions=100)
    assert err.tolist() == [int(P.ERR_START), 2, 2, 9]


@pytest.mark.parametrize(
    ("counts", "dtype"),
    [([700, 3, 900, 1, 450], torch.int64), ([2600, 2, 1], torch.int32), ([1, 1100, 1200], torch.int64),
     ([900, 2, 700], torch.int32)],
    ids=["counts0", "counts1", "counts2", "counts3"],
)  # fmt: skip
def test_build_plan_of_steps_longer_than_one_block(counts, dtype, plan_kernel, monkeypatch):
    """Steps of more than 1,024 rows (the blocks build; one program refuses them): runs and groups crossing
    block edges, prefixes of more than one chunk and runs whose end lies more than a chunk past a block. The
    metadata dtype alternates between cases (it only changes how the inputs are read; every test above runs
    both). Blocks of 128 rows whatever the step (the interpreter's time grows with the programs; the shipped
    shapes of each step size are the other tests')."""
    pin_128_row_blocks(monkeypatch)
    if plan_kernel == "one_block":
        with pytest.raises(ValueError, match="up to 1,024 rows"):
            P.launch_build_plan(
                ops.empty_plan(2048, 6, 4, "cpu"), *[torch.zeros(2048, dtype=dtype)] * 3, rows=2048, requests=6,
                ratio=4, num_slots=5,
            )  # fmt: skip
        return
    rng = np.random.default_rng(7)
    positions, row_req = [], []
    for slot, n in enumerate(counts):
        start = int(rng.integers(0, 300))
        positions += range(start, start + n)
        row_req += [slot] * n
        positions.append(0)
        row_req.append(-1)
    positions, row_req = np.array(positions), np.array(row_req)
    out = rng.integers(0, 1 << 20, size=len(positions))
    out[positions % 4 != 3] = -1
    plan = ops.empty_plan(len(positions), 6, 4, "cpu")
    ops.build_plan(plan, *(torch.tensor(a, dtype=dtype) for a in (positions, row_req, out)), ratio=4, num_slots=5)
    want = model_plan(positions, row_req, out, requests=6, ratio=4, num_slots=5)
    got = read_plan(plan, len(positions), 6, 4)
    for name, w, g in zip(("header", "requests", "rows", "closing"), want, got):
        assert np.array_equal(w, g), name


@pytest.mark.parametrize(
    ("bad_run", "bad_value", "requests"),
    [(1, 1 << 33, 3), (1, -5, 8), (5, 1 << 33, 8), (3, 1 << 33, 3), (4, -(1 << 40), 3)],
)
def test_out_slot_beyond_int32_is_flagged_only_where_the_row_counts(bad_run, bad_value, requests, monkeypatch):
    """An int64 ``out_slot`` int32 cannot hold, on a group-closing row: the row writes nothing (``-1`` in its
    records) and the header gets ``FLAG_SLOT_OVERFLOW``; past the R-th request (R = 3: runs 3 to 5 are padding)
    the row counts for nothing, so only the request overflow is flagged. About 840 rows in blocks of 128 (not
    the shipped 32: fewer programs for the interpreter; the block size does not enter the flags): the header's
    program counts them all in one chunk (with R = 8 through the one-reduction path, with R = 3 through the
    recount past the R-th run), while the bad row's own block writes its records."""
    pin_128_row_blocks(monkeypatch)
    rng = np.random.default_rng(bad_run)
    positions, row_req = [], []
    for slot, n in enumerate([100, 150, 120, 200, 180, 90]):
        start = int(rng.integers(0, 300))
        positions += range(start, start + n)
        row_req += [slot] * n
    positions, row_req = np.array(positions), np.array(row_req)
    out = rng.integers(0, 1 << 20, size=len(positions))
    out[positions % 4 != 3] = -1
    in_run = np.flatnonzero((row_req == bad_run) & (positions % 4 == 3))
    out[in_run[len(in_run) // 2]] = bad_value
    plan = ops.empty_plan(len(positions), requests, 4, "cpu")
    ops.build_plan(plan, *(torch.tensor(a, dtype=torch.int64) for a in (positions, row_req, out)), ratio=4,
                   num_slots=8)  # fmt: skip
    want = model_plan(positions, row_req, out, requests=requests, ratio=4, num_slots=8)
    assert bool(want[0][7] & int(P.FLAG_SLOT_OVERFLOW)) == (bad_run < requests)  # the model agrees with the docstring
    got = read_plan(plan, len(positions), requests, 4)
    for name, w, g in zip(("header", "requests", "rows", "closing"), want, got):
        assert np.array_equal(w, g), name


def _engine_step(rng, *, num_slots: int, requests: int, tokens: int, request_rows):
    """``(positions, row_req, mem_index)``: ``requests`` requests in random slots, each ``(n, start) =
    request_rows()`` rows with distinct token indices from ``[0, tokens)``; padding rows (``HOLD = num_slots``)
    before, between and after them, with token indices anywhere, inside a map or not."""
    positions, row_req, mem = [], [], []
    token_ids = rng.permutation(tokens)
    for slot in rng.permutation(num_slots)[:requests]:
        if rng.random() < 0.3:
            positions.append(int(rng.integers(0, 50)))
            row_req.append(num_slots)
            mem.append(int(rng.choice([0, -1, 1 << 30])))
        n, start = request_rows()
        positions += range(start, start + n)
        row_req += [int(slot)] * n
        mem += token_ids[len(mem) : len(mem) + n].tolist()
    for _ in range(int(rng.integers(0, 4))):  # CUDA graph padding
        positions.append(0)
        row_req.append(num_slots)
        mem.append(int(rng.choice([0, -1, 1 << 30])))
    return np.array(positions, dtype=np.int64), np.array(row_req, dtype=np.int64), np.array(mem, dtype=np.int64)


def lightllm_step(rng, *, ratio: int, num_slots: int, requests: int, decode: bool, mtp_step: int = 3):
    """A LightLLM-shaped step (:func:`_engine_step`). Prefill: requests of up to ``3 r + 1`` rows from random
    starts; decode: ``1 .. mtp_step + 1`` rows per request, from a start that may rewind up to ``mtp_step``
    positions, near a group end so that rows close groups."""

    def request_rows():
        if decode:
            n = int(rng.integers(1, mtp_step + 2))
            return n, max(0, int(rng.integers(1, 6)) * ratio - int(rng.integers(0, mtp_step + 2)))
        return int(rng.integers(1, 3 * ratio + 2)), int(rng.integers(0, 5 * ratio))

    return _engine_step(rng, num_slots=num_slots, requests=requests, tokens=4 * 4096, request_rows=request_rows)


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize(("index_dtype", "map_dtype"), [(torch.int32, torch.int64), (torch.int64, torch.int32)])
@pytest.mark.parametrize("strided", [False, True])
def test_build_plan_with_an_out_slot_map_equals_the_gathered_build(ratio, index_dtype, map_dtype, strided,
                                                                   plan_kernel, monkeypatch):  # fmt: skip
    """``out_slot_map``: ``out_slot`` holds token indices (LightLLM's ``mem_index``) and the map their output
    slots (``full_to_c4_indexs``). The plan is byte for byte the one built from the gathered out slots, on
    prefill and decode (MTP rewind) steps with padding rows whose indices lie anywhere (inside the map or not:
    not read), map entries of ``-1`` (the row writes nothing) and a contiguous or a strided map. The blocks build
    runs blocks of 16 rows at ratio 4 (several blocks and prefix chunks), of 128 at ratio 128 (fewer programs
    for the interpreter)."""
    if ratio == 128:
        pin_128_row_blocks(monkeypatch)
    elif plan_kernel == "blocks":
        monkeypatch.setattr(P, "blocks_config", lambda rows: (16, 4, 16))
    rng = np.random.default_rng(ratio + 2 * (index_dtype == torch.int64) + 4 * strided)
    num_slots, tokens = 6, 4 * 4096
    trials, closed = (3 if ratio == 128 else 6), 0
    for trial in range(trials):
        decode = trial % 2 == 1
        positions, row_req, mem = lightllm_step(rng, ratio=ratio, num_slots=num_slots,
                                                requests=int(rng.integers(1, 6)), decode=decode)  # fmt: skip
        values = rng.integers(0, 1 << 20, size=tokens)
        values[rng.random(tokens) < 0.1] = -1
        if strided:
            table = torch.full((tokens, 3), -7, dtype=map_dtype)
            table[:, 2] = torch.tensor(values, dtype=map_dtype)
            out_map = table[:, 2]
        else:
            out_map = torch.tensor(values, dtype=map_dtype)
        inside = (mem >= 0) & (mem < tokens)
        gathered = np.where(inside, values[np.where(inside, mem, 0)], 12345)  # not read outside: any value
        rows, capacity = len(positions), num_slots
        args = [torch.tensor(a, dtype=index_dtype) for a in (positions, row_req)]
        want = ops.empty_plan(rows, capacity, ratio, "cpu").fill_(0x5A5A5A5A)
        got = want.clone()
        ops.build_plan(want, *args, torch.tensor(gathered, dtype=index_dtype), ratio=ratio, num_slots=num_slots)
        ops.build_plan(got, *args, torch.tensor(mem, dtype=index_dtype), ratio=ratio, num_slots=num_slots,
                       out_slot_map=out_map)  # fmt: skip
        assert torch.equal(got, want), f"trial {trial} (decode={decode})"
        header = read_plan(got, rows, capacity, ratio)[0]
        assert header[int(P.H_FLAGS)] == 0, header
        closed += int(header[int(P.H_CLOSING)])
    assert closed >= trials, closed  # the steps close groups: the map is read


def test_build_plan_out_slot_map_with_a_request_to_slot_table(plan_kernel):
    """Both tables at once (``req_state_slot`` and ``out_slot_map``): the gathered build's plan."""
    rng = np.random.default_rng(11)
    positions, slots, mem = lightllm_step(rng, ratio=4, num_slots=5, requests=4, decode=False)
    order = rng.permutation(5)
    index_of = {int(s): i for i, s in enumerate(order)}
    row_req = torch.tensor([index_of.get(int(s), -1) for s in slots])
    values = torch.tensor(rng.integers(0, 1 << 20, size=4 * 4096))
    mem_t = torch.tensor(mem)
    gathered = torch.where((mem_t >= 0) & (mem_t < values.shape[0]), values[mem_t.clamp(0, values.shape[0] - 1)], -1)
    want = ops.empty_plan(len(positions), 5, 4, "cpu")
    got = want.clone()
    common = dict(ratio=4, num_slots=5, req_state_slot=torch.tensor(order))
    ops.build_plan(want, torch.tensor(positions), row_req, gathered, **common)
    ops.build_plan(got, torch.tensor(positions), row_req, mem_t, out_slot_map=values, **common)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad_index", [-1, 4096, 1 << 40])
def test_out_slot_map_index_outside_the_map_writes_nothing_and_is_flagged(bad_index, plan_kernel, monkeypatch):
    """An index outside the map on a group-closing row: the row writes nothing (the plan of an ``out_slot`` of
    ``-1`` there) and the header gets ``FLAG_OUT_INDEX``, which ``check_plan`` reports (code 9). On a row that
    closes nothing, a padding row, or a row past the plan's R-th request the index is not read: no flag. About
    300 rows, in blocks of 32 (the header's program counts them in one chunk)."""
    if plan_kernel == "blocks":
        monkeypatch.setattr(P, "blocks_config", lambda rows: (32, 4, 512))
    n_map = 4096
    positions = np.concatenate([np.arange(5, 105), np.arange(0, 3), np.arange(40, 140), np.arange(0, 2),
                                np.arange(7, 97)])  # fmt: skip
    row_req = np.array([0] * 100 + [9] * 3 + [1] * 100 + [9] * 2 + [2] * 90)
    rng = np.random.default_rng(3)
    mem = rng.permutation(n_map)[: len(positions)]
    values = torch.tensor(rng.integers(0, 1 << 20, size=n_map))
    gathered = values[torch.tensor(mem)]
    closing = np.flatnonzero((positions % 4 == 3) & (row_req < 9))

    def build(mem_rows, out_rows, capacity):
        want = ops.empty_plan(len(positions), capacity, 4, "cpu")
        got = want.clone()
        ops.build_plan(want, torch.tensor(positions), torch.tensor(row_req), out_rows, ratio=4, num_slots=3)
        ops.build_plan(got, torch.tensor(positions), torch.tensor(row_req), torch.tensor(mem_rows), ratio=4,
                       num_slots=3, out_slot_map=values)  # fmt: skip
        return want, got

    # not read: a row that closes nothing, padding rows, a closing row of request 2 past a capacity of 2
    quiet = mem.copy()
    quiet[[0, 1, 100, 101, 102, 203]] = bad_index
    quiet[closing[row_req[closing] == 2][3]] = bad_index
    assert positions[0] % 4 != 3 and positions[1] % 4 != 3
    for capacity in (2, 3):
        want, got = build(quiet, gathered, capacity)
        if capacity == 3:  # request 2 counts: its closing row reads the bad index
            flags = read_plan(got, len(positions), capacity, 4)[0][int(P.H_FLAGS)]
            assert flags == int(P.FLAG_OUT_INDEX), flags
            continue
        assert torch.equal(got, want)
    # read: a closing row of request 1 (the middle of the step, in a block of its own)
    loud = mem.copy()
    t = closing[row_req[closing] == 1][10]
    loud[t] = bad_index
    cut = gathered.clone()
    cut[t] = -1
    want, got = build(loud, cut, 3)
    gh, gr, grows, gc = read_plan(got, len(positions), 3, 4)
    wh, wr, wrows, wc = read_plan(want, len(positions), 3, 4)
    assert grows[t][5] == -1 and gh[int(P.H_FLAGS)] == int(P.FLAG_OUT_INDEX)
    wh[int(P.H_FLAGS)] |= int(P.FLAG_OUT_INDEX)
    for name, w, g in zip(("header", "requests", "rows", "closing"), (wh, wr, wrows, wc), (gh, gr, grows, gc)):
        assert np.array_equal(w, g), name
    err = torch.zeros(4, dtype=torch.int32)
    ops.check_plan(got, None, err)
    assert err.tolist() == [int(P.ERR_OUT_INDEX), -1, -1, 0], err
    assert "outside build_plan's out_slot_map" in ops.plan_error(err)
    ops.check_plan(want, None, err)
    assert ops.plan_error(err) is None
    # with an out_slot beyond int32 in the map too (request 0), at capacities 3 and 2 (the header's program
    # recounts the chunk past the R-th request): every flag is kept
    t0 = closing[row_req[closing] == 0][5]
    values[mem[t0]] = 1 << 33
    for capacity, overflow in ((3, 0), (2, int(P.FLAG_REQUEST_OVERFLOW))):
        _want, got = build(loud, cut, capacity)
        flags = read_plan(got, len(positions), capacity, 4)[0][int(P.H_FLAGS)]
        assert flags == int(P.FLAG_OUT_INDEX) | int(P.FLAG_SLOT_OVERFLOW) | overflow, (capacity, flags)


def test_build_plan_refuses_a_bad_out_slot_map():
    """Host-side refusals of ``out_slot_map``; a refused call leaves the plan and its build record unchanged."""
    plan = ops.empty_plan(4, 2, 4, "cpu")
    rows = torch.arange(4)
    ops.build_plan(plan, rows, torch.zeros(4, dtype=torch.int64), rows, ratio=4, num_slots=4)
    info, before = ops.plan_info(plan), plan.clone()
    cases = (
        (torch.tensor([[1, 2]]), "dimensions"),
        (torch.tensor([1.0, 2.0]), "int32 or torch.int64"),
        (torch.zeros(1, dtype=torch.int64).expand(8), "positive stride"),
        (torch.zeros(8, dtype=torch.int64, device="meta"), "is on meta"),
        ([0, 1, 2, 3], "must be a torch.Tensor"),
    )
    for table, needle in cases:
        with pytest.raises(OpError, match=needle):
            ops.build_plan(plan, rows, rows, rows, ratio=4, num_slots=4, out_slot_map=table)
        assert torch.equal(plan, before) and ops.plan_info(plan) is info
