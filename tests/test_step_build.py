"""``ops.build_plans`` (kernels/step_build.py): a step's plans of several ratios from the same rows, in one launch
where every plan fits one program, optionally with plan 0's state-row tables, against ``build_plan`` per plan
and ``build_state_rows`` after it (the plan model and helpers are ``test_plan.py``'s)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.session import count_launches
from test_plan import _engine_step, pin_128_row_blocks, read_plan

from dsv4_compressor import ops
from dsv4_compressor.errors import OpError
from dsv4_compressor.kernels import plan as P


@pytest.fixture(autouse=True, params=["blocks", "one_block"])
def plan_kernel(request, monkeypatch):
    """Every test runs with both plan builds (as in ``test_plan.py``)."""
    monkeypatch.setattr(P, "PLAN_KERNEL", request.param)
    return request.param


def two_ratio_step(rng, *, num_slots: int, requests: int, decode: bool, mtp_step: int = 3, chunk: int = 20):
    """A step whose rows close groups at ratio 4 and at 128 (:func:`_engine_step`): prefill chunks of up to
    ``chunk`` rows and decode rows (``1 .. mtp_step + 1`` per request, starts that rewind up to ``mtp_step``)
    from starts near a multiple of 128."""

    def request_rows():
        if decode:
            n = int(rng.integers(1, mtp_step + 2))
            return n, max(0, int(rng.integers(1, 4)) * 128 - int(rng.integers(0, mtp_step + 2)))
        n = int(rng.integers(1, chunk + 1))  # mostly a chunk across a multiple of 128
        off = int(rng.integers(1, n + 1)) if rng.random() < 0.7 else int(rng.integers(0, chunk + 1))
        return n, max(0, int(rng.integers(1, 4)) * 128 - off)

    return _engine_step(rng, num_slots=num_slots, requests=requests, tokens=4096, request_rows=request_rows)


def _build_plans_case(rng, *, dtype, mapped: bool, table: bool, decode: bool, requests: int, chunk: int = 20):
    """A random step and ``build_plans``' arguments for plans at ratios 4 and 128 (capacities 6 and 5): with
    ``mapped`` both plans' out slots go through their own map from the same ``mem_index`` (LightLLM's), the C4
    plan's map strided (``"first"`` / ``"second"``: only that plan's; the other reads its own out slots); with
    ``table`` ``row_req`` holds request indices into a strided request-to-slot table.
    Returns ``(positions, row_req, out_slots, kwargs)``."""
    num_slots, tokens = 7, 4096
    positions, slots, mem = two_ratio_step(rng, num_slots=num_slots, requests=requests, decode=decode, chunk=chunk)
    kwargs = dict(num_slots=num_slots, ratios=[4, 128], mtp_step=3)
    if table:
        order = rng.permutation(num_slots + 2) - 1  # entries -1 .. num_slots: two of them padding
        column = torch.full((num_slots + 2, 2), -5, dtype=dtype)
        column[:, 1] = torch.tensor(order, dtype=dtype)
        index_of = {int(s): i for i, s in enumerate(order) if 0 <= s < num_slots}
        slots = np.array([index_of.get(int(s), int(rng.choice([-1, num_slots + 2]))) for s in slots])
        kwargs["req_state_slot"] = column[:, 1]
    if mapped:
        values = [rng.integers(0, 1 << 20, size=tokens) for _ in range(2)]
        for v in values:
            v[rng.random(tokens) < 0.1] = -1
        c4_map = torch.full((tokens, 2), -9, dtype=torch.int64)
        c4_map[:, 0] = torch.tensor(values[0])
        kwargs["out_slot_maps"] = [c4_map[:, 0], torch.tensor(values[1], dtype=torch.int32)]
        out_slots = [torch.tensor(mem, dtype=dtype)] * 2
        if mapped in ("first", "second"):  # one plan through its map, the other from its own out slots
            k = 1 if mapped == "first" else 0
            kwargs["out_slot_maps"][k] = None
            out_slots[k] = torch.tensor(rng.integers(-1, 1 << 20, size=len(positions)), dtype=dtype)
    else:
        out_slots = [torch.tensor(rng.integers(-1, 1 << 20, size=len(positions)), dtype=dtype) for _ in range(2)]
    return torch.tensor(positions, dtype=dtype), torch.tensor(slots, dtype=dtype), out_slots, kwargs


def _reference(plans, positions, row_req, out_slots, *, ratios, out_slot_maps=None, **kwargs):
    """What ``build_plan`` per plan writes into copies of ``plans``, and the records it keeps."""
    want = [p.clone() for p in plans]
    maps = out_slot_maps or [None] * len(plans)
    for plan, out, ratio, omap in zip(want, out_slots, ratios, maps):
        ops.build_plan(plan, positions, row_req, out, ratio=ratio, out_slot_map=omap, **kwargs)
    return want, [ops.plan_info(p) for p in want]


def _same_record(got, want) -> bool:
    return got is not None and got._replace(build=0) == want._replace(build=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("mapped", "table"),
    [(False, False), (True, False), ("first", False), ("second", True), (False, True), (True, True)],
)
def test_build_plans_equals_build_plan_per_plan(dtype, mapped, table, plan_kernel, monkeypatch):
    """``build_plans`` of a ratio-4 and a ratio-128 plan is byte for byte two ``build_plan`` calls, with the same
    host records, on random prefill chunks and decode steps with MTP rewinds, padding rows, int32 and int64
    inputs, with and without out-slot maps and a request-to-slot table. With ``one_block`` every step (up to
    ~130 rows) runs in one launch of the two-plan kernel; with ``blocks`` it falls back to a launch per plan."""
    rng = np.random.default_rng(3 + (dtype == torch.int64) + 2 * bool(mapped) + 4 * table + 8 * (mapped == "first"))
    names = count_launches(monkeypatch)
    closed = [0, 0]
    for trial in range(4):
        decode = trial % 2 == 1
        positions, row_req, out_slots, kwargs = _build_plans_case(
            rng, dtype=dtype, mapped=mapped, table=table, decode=decode, requests=int(rng.integers(1, 7)),
        )  # fmt: skip
        rows = positions.shape[0]
        plans = [ops.empty_plan(rows, 6, 4, "cpu").fill_(0x5A5A5A5A), ops.empty_plan(rows, 5, 128, "cpu").fill_(-7)]
        want, records = _reference(plans, positions, row_req, out_slots, **kwargs)
        names.clear()
        ops.build_plans(plans, positions, row_req, out_slots, **kwargs)
        if plan_kernel == "one_block":
            assert names == ["_build_plans_one_block_kernel"], names
        else:
            assert names == ["_build_plan_blocks_kernel"] * 2, names
        for k in range(2):
            assert torch.equal(plans[k], want[k]), f"trial {trial} (decode={decode}), plan {k}"
            assert _same_record(ops.plan_info(plans[k]), records[k]), (ops.plan_info(plans[k]), records[k])
            closed[k] += int(read_plan(plans[k], rows, plans[k].shape[0], kwargs["ratios"][k])[0][int(P.H_CLOSING)])
    assert min(closed) >= 2, closed  # both ratios' steps close groups: their out slots are read


def test_build_plans_auto_takes_one_launch_only_where_every_plan_fits_one_program(plan_kernel, monkeypatch):
    """``PLAN_KERNEL = "auto"``: steps of up to ``PLAN_ONE_BLOCK_MAX_ROWS`` rows and requests in every plan take
    one launch; a step of more rows, or a plan of more requests, one ``build_plan`` launch per plan (as
    ``ops.launches`` says); the plans are the two ``build_plan`` calls' either way. One plan alone works too."""
    if plan_kernel == "blocks":
        pytest.skip("auto picks the build itself: once is enough")
    monkeypatch.setattr(P, "PLAN_KERNEL", "auto")
    pin_128_row_blocks(monkeypatch)
    rng = np.random.default_rng(21)
    names = count_launches(monkeypatch)
    one, blocks, alone = "_build_plans_one_block_kernel", "_build_plan_blocks_kernel", "_build_plan_one_block_kernel"
    cases = [(6, 20, (6, 5), [one]), (7, 40, (6, 5), [blocks] * 2), (3, 6, (6, 65), [alone, blocks]),
             (3, 10, (64, 64), [one])]  # fmt: skip
    for requests, chunk, capacities, kernels in cases:
        launches = len(kernels)
        positions, row_req, out_slots, kwargs = _build_plans_case(
            rng, dtype=torch.int64, mapped=True, table=False, decode=False, requests=requests, chunk=chunk
        )  # fmt: skip
        rows = positions.shape[0]
        if launches == 2 and capacities == (6, 5):
            assert rows > int(P.PLAN_ONE_BLOCK_MAX_ROWS), rows  # the step itself is too long
        elif launches == 1:
            assert rows <= int(P.PLAN_ONE_BLOCK_MAX_ROWS), rows
        plans = [ops.empty_plan(rows, capacities[0], 4, "cpu").fill_(3), ops.empty_plan(rows, capacities[1], 128,
                                                                                        "cpu").fill_(-3)]  # fmt: skip
        want, records = _reference(plans, positions, row_req, out_slots, **kwargs)
        names.clear()
        ops.build_plans(plans, positions, row_req, out_slots, **kwargs)
        assert len(names) == launches == ops.launches("build_plans", rows=rows, requests=max(capacities), plans=2)
        assert names == kernels, (names, kernels)
        for k in range(2):
            assert torch.equal(plans[k], want[k]), (requests, chunk, capacities, k)
            assert _same_record(ops.plan_info(plans[k]), records[k])
    single = ops.empty_plan(rows, 5, 128, "cpu").fill_(11)
    want, records = _reference([single], positions, row_req, out_slots[1:], ratios=[128], num_slots=7,
                               out_slot_maps=kwargs["out_slot_maps"][1:], mtp_step=3)  # fmt: skip
    names.clear()
    ops.build_plans([single], positions, row_req, out_slots[1:], ratios=[128], num_slots=7,
                    out_slot_maps=kwargs["out_slot_maps"][1:], mtp_step=3)  # fmt: skip
    assert names == ["_build_plans_one_block_kernel"] and torch.equal(single, want[0])
    assert _same_record(ops.plan_info(single), records[0])


def test_build_plans_refusals_leave_every_plan_and_record_unchanged(plan_kernel):
    """Every plan's arguments and plan 0's state-row tables (``build_state_rows``' checks) are checked before
    anything launches: a call refused for its second plan, the lists or the tables leaves both plans, both
    tables and every record as the last build left them."""
    rng = np.random.default_rng(5)
    positions, row_req, out_slots, kwargs = _build_plans_case(
        rng, dtype=torch.int64, mapped=True, table=False, decode=True, requests=4
    )  # fmt: skip
    rows = positions.shape[0]
    plans = [ops.empty_plan(rows, 6, 4, "cpu"), ops.empty_plan(rows, 5, 128, "cpu")]
    read_rows, save_rows = torch.zeros(6, 7, dtype=torch.int64), torch.zeros(rows + 2, dtype=torch.int32)
    kwargs.update(read_rows=read_rows, save_rows=save_rows, state_mode="req_ring", ring=11)
    ops.build_plans(plans, positions, row_req, out_slots, **kwargs)
    every = [*plans, read_rows, save_rows]
    for t in every:
        t.view(-1)[::3] = 0x77  # poison: a refused call must not rebuild
    before = [t.clone() for t in every]

    def records():
        return [ops.plan_info(p) for p in plans] + [getattr(t, ops._TABLES_ATTR) for t in (read_rows, save_rows)]

    kept = records()
    maps = kwargs["out_slot_maps"]
    small = ops.empty_plan(rows - 1, 5, 128, "cpu")
    bad = [
        (dict(ratios=[4, 0]), "ratio"),
        (dict(ratios=[4]), "one entry per plan"),
        (dict(out_slot_maps=[maps[0], maps[1].reshape(-1, 2)]), r"out_slot_maps\[1\]"),
        (dict(out_slots=[out_slots[0], out_slots[1][:-1]]), r"out_slots\[1\]"),
        (dict(out_slots=[out_slots[0], out_slots[1].float()]), r"out_slots\[1\]"),
        (dict(plans=[plans[0], small]), "plan holds"),
        (dict(plans=[plans[0], plans[0]]), "distinct"),
        (dict(plans=[]), "at least one"),
        (dict(mtp_step=-1), "mtp_step"),
        (dict(state_mode="rings"), "mode must be one of"),
        (dict(ring=None), "needs ring="),
        (dict(ring=7), "cannot hold a window"),
        (dict(read_rows=read_rows[:5]), "read_rows must be contiguous"),
        (dict(save_rows=save_rows[: rows - 1]), "save_rows holds"),
        (dict(save_rows=None), "come together"),
        (
            dict(state_mode="block_table", block_table=torch.zeros(3, 8, dtype=torch.int32), block_size=4),
            "block_table has 3 rows",
        ),  # fmt: skip
    ]
    for change, match in bad:
        call = dict(kwargs, plans=plans, out_slots=out_slots)
        call.update(change)
        args = (call.pop("plans"), positions, row_req, call.pop("out_slots"))
        with pytest.raises(OpError, match=match):
            ops.build_plans(*args, **call)
        for t, b in zip(every, before):
            assert torch.equal(t, b), change
        assert all(a is b for a, b in zip(records(), kept)), change


def _state_tables(rng, mode: str, *, num_slots: int, dtype):
    """``build_state_rows``' addressing of ``mode`` for a step of :func:`_build_plans_case` (slots < num_slots,
    positions < 1,024): LightLLM's C4 state by 16-position SWA pages, or vLLM's block table, with holes."""
    if mode == "req_ring":
        return dict(ring=11)
    if mode == "token_map_ring":
        max_seq, tokens = 1024, num_slots * 1024
        req_to_token = torch.tensor(rng.permutation(tokens).reshape(num_slots, max_seq), dtype=torch.int32)
        to_state = rng.permutation(tokens + 64)[:tokens]
        to_state[rng.random(tokens) < 0.05] = -1  # a token the engine holds no state row for
        return dict(ring=11, req_to_token=req_to_token, token_to_state=torch.tensor(to_state, dtype=dtype),
                    state_page=16, page_tail=5)  # fmt: skip
    table = torch.tensor(rng.permutation(num_slots * 256).reshape(num_slots, 256), dtype=dtype)
    table[torch.tensor(rng.random(table.shape) < 0.05)] = -1
    return dict(block_table=table, block_size=4)


@pytest.mark.parametrize("mode", ["req_ring", "token_map_ring", "block_table"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("in_plan_launch", [True, False])
def test_build_plans_with_state_rows_equals_build_state_rows_after(mode, dtype, plan_kernel, in_plan_launch,
                                                                   monkeypatch):  # fmt: skip
    """``build_plans(..., read_rows=, save_rows=, state_mode=...)`` writes the plans and plan 0's tables byte for
    byte as ``build_plans`` then ``build_state_rows(plans[0], ...)``, into poisoned tables (rows past the step's
    left alone), with records a compress accepts: in one launch (the tables from the C4 program's registers)
    with ``one_block``, or with ``step_build.TABLES_IN_PLAN_LAUNCH`` off the plans' one launch and the tables'
    own; else the plans' launches and the tables' own. Random prefill chunks and MTP decode steps with padding
    rows, a request overflow (7 requests, a C4 plan of 6), out-slot maps, a request table."""
    monkeypatch.setattr(ops._step_build, "TABLES_IN_PLAN_LAUNCH", in_plan_launch)
    rng = np.random.default_rng(11 + 3 * (dtype == torch.int64) + 7 * len(mode))
    names = count_launches(monkeypatch)
    for trial in range(4):
        decode = trial % 2 == 1
        positions, row_req, out_slots, kwargs = _build_plans_case(
            rng, dtype=dtype, mapped=trial < 2, table=trial % 3 == 0, decode=decode, requests=int(rng.integers(1, 8))
        )  # fmt: skip
        rows = positions.shape[0]
        state = dict(state_mode=mode, **_state_tables(rng, mode, num_slots=kwargs["num_slots"], dtype=dtype))
        window = 8
        plans = [ops.empty_plan(rows, 6, 4, "cpu").fill_(0x5A5A5A5A), ops.empty_plan(rows, 5, 128, "cpu").fill_(-7)]
        read_rows = torch.full((6, window - 1), -9, dtype=dtype)
        save_rows = torch.full((rows + 5,), -9, dtype=torch.int64 if dtype == torch.int32 else torch.int32)
        want_plans = [p.clone() for p in plans]
        want_read, want_save = read_rows.clone(), save_rows.clone()
        ops.build_plans(want_plans, positions, row_req, out_slots, **kwargs)
        mode_kwargs = {k: v for k, v in state.items() if k != "state_mode"}
        ops.build_state_rows(want_plans[0], want_read, want_save, mode=mode, **mode_kwargs)
        names.clear()
        ops.build_plans(plans, positions, row_req, out_slots, read_rows=read_rows, save_rows=save_rows, **state,
                        **kwargs)  # fmt: skip
        if plan_kernel == "one_block":
            tail = [] if in_plan_launch else ["_state_rows_kernel"]
            assert names == ["_build_plans_one_block_kernel", *tail], names
        else:
            assert names == ["_build_plan_blocks_kernel"] * 2 + ["_state_rows_kernel"], names
        assert len(names) == ops.launches("build_plans", rows=rows, requests=6, plans=2, tables=True)
        for k in range(2):
            assert torch.equal(plans[k], want_plans[k]), (trial, k)
        assert torch.equal(read_rows, want_read), (trial, read_rows, want_read)
        assert torch.equal(save_rows, want_save), (trial, save_rows, want_save)
        assert (save_rows[rows:] == -9).all()
        assert (read_rows >= 0).any() and (save_rows[:rows] >= 0).any()  # not a table of -1 alone
        record = getattr(read_rows, ops._TABLES_ATTR)
        assert record.build == ops.plan_info(plans[0]).build and record == getattr(save_rows, ops._TABLES_ATTR)


def test_tables_in_plan_launch_switch(monkeypatch):
    from dsv4_compressor.kernels import step_build

    for value, want in (("1", True), ("", False), ("0", False), ("off", False)):
        monkeypatch.setenv("DSV4_STEP_TABLES_IN_PLAN_LAUNCH", value)
        assert step_build._tables_in_plan_launch_from_env() is want
    monkeypatch.setenv("DSV4_STEP_TABLES_IN_PLAN_LAUNCH", "2")
    with pytest.raises(ValueError, match="DSV4_STEP_TABLES_IN_PLAN_LAUNCH"):
        step_build._tables_in_plan_launch_from_env()
