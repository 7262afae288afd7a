"""The op contract (``ops`` module docstring): a call that does not match the plan it is given is refused before
anything is written, and one that matches writes exactly the reference entries (CPU, Triton interpreter).

Each case of the table below was accepted before the contract and lost or corrupted entries without an error:

=========================================================  ======================================================
call                                                       now
=========================================================  ======================================================
``kv_score`` with rows past the plan's ``T`` (a padded      accepted; the padding rows are ignored, the result is
engine buffer)                                              the call on the first ``T``
``kv_score`` with fewer rows than ``T``                     refused
a plan built for another ratio                              refused
``out_keys`` and ``out_pages`` of different capacities      refused
a ring smaller than the plan's ``mtp_step`` needs           refused (a decode step needs one row more)
=========================================================  ======================================================

and the property test drives the ops with random valid and invalid combinations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.inputs import CSA_SMALL, make_params, random_rows
from helpers.session import count_launches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ops import EngineLayer

from dsv4_compressor import ops
from dsv4_compressor.errors import OpError


def _buffers(layer: EngineLayer, *extra) -> list[torch.Tensor]:
    """Everything a call may write: the state, the page memory (padding columns included), the keys, the
    scratch, and whatever else is given (plans, tables)."""
    return [t for t in (layer.state, layer.page_memory, layer.keys, layer.scratch, *extra) if t is not None]


def _snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def _assert_unchanged(tensors, before, what: str) -> None:
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)), f"{what}: a refused call wrote a buffer"


def _plain_step(layer: EngineLayer, rows: torch.Tensor, *, slot: int = 0, start: int = 0):
    """The engine metadata of one request's rows, a built plan and the compress arguments (not yet called)."""
    r = layer.cfg.ratio
    n = rows.shape[0]
    positions = torch.arange(start, start + n)
    out_slot = torch.tensor(
        [layer.out_slot_of(slot, p // r) if p % r == r - 1 else -1 for p in positions.tolist()], dtype=torch.int64
    )
    plan = ops.empty_plan(n, 2, r, "cpu")
    ops.build_plan(plan, positions, torch.full((n,), slot), out_slot, ratio=r, num_slots=layer.num_slots,
                   mtp_step=layer.mtp)  # fmt: skip
    p = layer.params
    if layer.variant.startswith("online"):
        args = (rows, plan, layer.ape, p.norm_weight, layer.cos, layer.sin, layer.state, layer.pages)
        return plan, ops.compress_online_hca, args, dict(page_size=layer.page_size, scratch=layer.scratch)
    args = (rows, plan, layer.ape, p.norm_weight, layer.cos, layer.sin, layer.state, layer.pages)
    kwargs = dict(kind=layer.kind, page_size=layer.page_size, scratch=layer.scratch, out_keys=layer.keys)
    return plan, ops.compress, args, kwargs


# ---------------------------------------------------------------------------------------------------------------
# The table's cases
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["csa", "indexer", "hca_tiled", "online"])
def test_kv_score_rows_past_the_plan_are_ignored(variant):
    """An engine's padded ``[>= T, 2W]`` buffer (SGLang's is): a 64-row CSA prefill given 72 rows wrote only 8
    of its 16 entries before (the kernels addressed the plan by the buffer's rows). Now the bytes equal those
    of the call with exactly ``T`` rows, and every entry is the reference's."""
    items = lambda gen, cfg: [(0, 0, random_rows(64, cfg, gen)), (2, 0, random_rows(11, cfg, gen))]  # noqa: E731
    padded, exact = EngineLayer(variant, "sglang", seed=1), EngineLayer(variant, "sglang", seed=1)
    padded.step(items(torch.Generator().manual_seed(1), padded.cfg), kv_extra=8, pad_back=0)
    exact.step(items(torch.Generator().manual_seed(1), exact.cfg), pad_back=0)
    padded.check(f"{variant} with 8 padding rows")
    for got, want in zip(_buffers(padded), _buffers(exact)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{variant}: padding rows changed a byte"
    assert len(padded.written) == 64 // padded.cfg.ratio + 11 // padded.cfg.ratio


@pytest.mark.parametrize("variant", ["csa", "indexer", "hca_tiled", "hca_single", "online", "online_split"])
def test_kv_score_shorter_than_the_plan_is_refused(variant):
    """8 rows fewer than the plan's ``T``: the last entries were silently not written before."""
    layer = EngineLayer(variant, "vllm", seed=2)
    rows = random_rows(3 * layer.cfg.ratio + 8, layer.cfg, torch.Generator().manual_seed(2))
    plan, fn, args, kwargs = _plain_step(layer, rows)
    tensors = _buffers(layer, plan)
    before = _snapshot(tensors)
    with pytest.raises(
        OpError, match=rf"kv_score has {rows.shape[0] - 8} rows; the plan was built for .* {rows.shape[0]}"
    ):
        fn(rows[:-8], *args[1:], **kwargs)
    _assert_unchanged(tensors, before, variant)


def test_plan_of_another_ratio_is_refused():
    """A plan built at ratio 128 given to a CSA compress (ratio 4, taken from the APE) was accepted before."""
    layer = EngineLayer("csa", "lightllm", seed=3)
    rows = random_rows(12, layer.cfg, torch.Generator().manual_seed(3))
    positions = torch.arange(12)
    plan = ops.empty_plan(12, 2, 4, "cpu")  # room for a ratio-4 step
    ops.build_plan(plan, positions, torch.zeros(12, dtype=torch.int64), positions, ratio=128, num_slots=4)
    p = layer.params
    tensors = _buffers(layer, plan)
    before = _snapshot(tensors)
    with pytest.raises(OpError, match="ape has 4 rows .*built for ratio 128"):
        ops.compress(rows, plan, layer.ape, p.norm_weight, layer.cos, layer.sin, layer.state.view(-1, 512),
                     layer.pages, kind="csa", page_size=64, ring=layer.ring)  # fmt: skip
    _assert_unchanged(tensors, before, "ratio")


@pytest.mark.parametrize("delta", [-64, -1, 1])
def test_out_keys_and_pages_of_different_capacities_are_refused(delta):
    """An entry's slot addresses both outputs: indexer keys with fewer rows than the pages' slots left the
    packs of the later pages unwritten before, with no error."""
    layer = EngineLayer("indexer", "vllm", seed=4)
    rows = random_rows(40, layer.cfg, torch.Generator().manual_seed(4))
    plan, fn, args, kwargs = _plain_step(layer, rows)
    slots = layer.pages.shape[0] * layer.page_size
    keys = torch.full((slots + delta, layer.cfg.head_dim), 1.5, dtype=torch.bfloat16)
    tensors = _buffers(layer, plan, keys)
    before = _snapshot(tensors)
    with pytest.raises(OpError, match=f"out_keys holds {slots + delta} slots and out_pages .* {slots}"):
        fn(*args, **dict(kwargs, out_keys=keys))
    _assert_unchanged(tensors, before, f"keys {delta}")


@pytest.mark.parametrize("layout", ["3-D", "2-D", "tables"])
def test_ring_smaller_than_the_plans_mtp_step_needs_is_refused(layout):
    """A CSA ring of 8 rows (its window) with ``mtp_step`` 2: only ``ring >= window`` was checked before, and
    a rewind read rows a later save had overwritten. ``window - 1 + mtp_step`` rows serve steps that save after
    every window's reads; a decode step, whose rows are saved while windows read, needs one more."""
    layer = EngineLayer("csa", "sglang", seed=5, mtp=2)
    cfg = layer.cfg
    rows = random_rows(10, cfg, torch.Generator().manual_seed(5))
    plan, fn, args, kwargs = _plain_step(layer, rows)
    state = layer.state  # [slots, 10, 2W]
    for ring, decode, refused in ((8, False, True), (9, False, False), (9, True, True), (10, True, False)):
        small = state[:, :ring]
        if layout == "2-D":
            small = small.reshape(-1, cfg.row_width)
        call = dict(kwargs, decode=decode)
        if layout == "tables":
            read_rows = torch.full((plan.shape[0], cfg.window - 1), -1, dtype=torch.int64)
            save_rows = torch.full((10,), -1, dtype=torch.int64)
            small = small.reshape(-1, cfg.row_width)
            if ring < 9:
                with pytest.raises(OpError, match=f"ring={ring} rows cannot hold a window of 8 with mtp_step=2"):
                    ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=ring)
                continue
            ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=ring)
            call.update(read_rows=read_rows, save_rows=save_rows)
        elif layout == "2-D":
            call["ring"] = ring
        tensors = _buffers(layer, plan)
        before = _snapshot(tensors)
        if refused:
            with pytest.raises(OpError, match=f"(ring={ring}|ring of {ring}) rows"):
                fn(rows, plan, *args[2:6], small, *args[7:], **call)
            _assert_unchanged(tensors, before, f"ring {ring}")
        else:
            fn(rows, plan, *args[2:6], small, *args[7:], **call)


def test_the_narrowest_ring_serves_rewinding_prefill_steps():
    """SGLang's C4 ring of 16 rows with 10 draft tokens (``mtp_step`` 9, ``window - 1 + mtp_step = 16``): steps
    run with ``decode=False`` (saves after every window's reads) rewind correctly on it."""
    layer = EngineLayer("csa", "sglang", seed=6, mtp=9, ring=16, has_ape=False)
    gen, rng = torch.Generator().manual_seed(6), np.random.default_rng(6)
    cfg, s = layer.cfg, 10
    layer.step([(0, 0, random_rows(13, cfg, gen)), (1, 0, random_rows(5, cfg, gen))], decode=False)
    lengths = {0: 13, 1: 5}
    for k in range(5):
        items = []
        for slot in (0, 1):
            start = lengths[slot] if k == 0 else lengths[slot] - int(rng.integers(0, s))
            items.append((slot, start, random_rows(s, cfg, gen)))
            lengths[slot] = start + s
        layer.step(items, decode=False)
        layer.check(f"verify step {k}")


def test_state_and_banks_with_fewer_slots_than_the_plan_are_refused():
    layer = EngineLayer("hca_single", "sglang", seed=7)
    rows = random_rows(20, layer.cfg, torch.Generator().manual_seed(7))
    plan, fn, args, kwargs = _plain_step(layer, rows)  # num_slots 4
    tensors = _buffers(layer, plan)
    before = _snapshot(tensors)
    with pytest.raises(OpError, match="state holds 3 request slots .* addresses 4"):
        fn(rows, plan, *args[2:6], layer.state[:3], *args[7:], **kwargs)
    with pytest.raises(OpError, match="state holds 3 request slots .* addresses 4"):
        flat = layer.state.reshape(-1, layer.cfg.row_width)[: 4 * layer.ring - 1]
        fn(rows, plan, *args[2:6], flat, *args[7:], **dict(kwargs, ring=layer.ring))
    _assert_unchanged(tensors, before, "ring slots")
    online = EngineLayer("online", "sglang", seed=7)
    plan, fn, args, kwargs = _plain_step(online, rows)
    tensors = _buffers(online, plan)
    before = _snapshot(tensors)
    with pytest.raises(OpError, match="state_banks holds 3 request slots; the plan addresses 4"):
        fn(rows, plan, *args[2:6], online.state[:3], *args[7:], **kwargs)
    with pytest.raises(OpError, match="state_banks holds 2 banks per slot; mtp_step=2 .* needs 3"):
        fn(rows, plan, *args[2:6], online.state[:, :2].contiguous(), *args[7:], **kwargs)
    _assert_unchanged(tensors, before, "banks")


def test_state_rows_tables_of_another_build_are_refused():
    """Tables resolved for an earlier build of the plan (a stale step) are refused; copies made with
    ``ops.copy_plan`` keep the record, plain ``copy_`` does not."""
    layer = EngineLayer("csa", "lightllm", seed=8, mode="ring_tables")
    rows = random_rows(12, layer.cfg, torch.Generator().manual_seed(8))
    plan, fn, args, kwargs = _plain_step(layer, rows)
    read_rows = torch.full((plan.shape[0], layer.cfg.window - 1), -1, dtype=torch.int64)
    save_rows = torch.full((12,), -1, dtype=torch.int64)
    state = layer.state.reshape(-1, layer.cfg.row_width)
    ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=layer.ring)
    stale_read, stale_save = torch.empty_like(read_rows), torch.empty_like(save_rows)
    ops.copy_plan(stale_read, read_rows)
    ops.copy_plan(stale_save, save_rows)
    plain_read = read_rows.clone()
    _plain_step(layer, rows)  # another plan
    info = ops.plan_info(plan)
    positions = torch.arange(12)
    ops.build_plan(plan, positions, torch.zeros(12, dtype=torch.int64), positions, ratio=4, num_slots=4, mtp_step=2)
    assert ops.plan_info(plan).build != info.build
    tensors = _buffers(layer, plan)
    before = _snapshot(tensors)
    with pytest.raises(OpError, match="read_rows was resolved for build .* call ops.build_state_rows after"):
        fn(rows, plan, *args[2:6], state, *args[7:], **dict(kwargs, read_rows=stale_read, save_rows=stale_save))
    with pytest.raises(OpError, match="read_rows was not filled by ops.build_state_rows"):
        fn(rows, plan, *args[2:6], state, *args[7:], **dict(kwargs, read_rows=plain_read, save_rows=stale_save))
    _assert_unchanged(tensors, before, "stale tables")
    ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=layer.ring)
    fn(rows, plan, *args[2:6], state, *args[7:], **dict(kwargs, read_rows=read_rows, save_rows=save_rows))


def test_build_state_rows_checks_its_tables_against_the_plan():
    cfg = CSA_SMALL
    positions = torch.arange(12)
    plan = ops.empty_plan(12, 2, 4, "cpu")
    read_rows = torch.full((2, cfg.window - 1), -1, dtype=torch.int64)
    save_rows = torch.full((12,), -1, dtype=torch.int64)
    with pytest.raises(OpError, match="plan carries no build"):
        ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=12)
    ops.build_plan(plan, positions, torch.zeros(12, dtype=torch.int64), positions, ratio=4, num_slots=3, mtp_step=1)
    before = _snapshot([read_rows, save_rows])
    with pytest.raises(OpError, match="save_rows holds 11 rows; the plan was built for a step of 12"):
        ops.build_state_rows(plan, read_rows, save_rows[:11], mode="req_ring", ring=12)
    with pytest.raises(OpError, match="ring=7 rows cannot hold a window of 8 with mtp_step=1"):
        ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=7)
    with pytest.raises(OpError, match="req_to_token has 2 rows; the plan addresses 3 slots"):
        ops.build_state_rows(
            plan, read_rows, save_rows, mode="token_map_ring", ring=9,
            req_to_token=torch.zeros(2, 16, dtype=torch.int32), token_to_state=torch.zeros(32, dtype=torch.int64),
            state_page=16, page_tail=9,
        )  # fmt: skip
    with pytest.raises(OpError, match="block_table has 2 rows; the plan addresses 3 slots"):
        ops.build_state_rows(plan, read_rows, save_rows, mode="block_table",
                             block_table=torch.zeros(2, 4, dtype=torch.int32), block_size=4)  # fmt: skip
    _assert_unchanged([read_rows, save_rows], before, "build_state_rows")


def test_build_plan_record_and_refusals():
    """``plan_info`` holds what the last build saw; a refused build changes neither the plan nor its record."""
    plan = ops.empty_plan(16, 3, 4, "cpu")
    assert ops.plan_info(plan) is None
    positions = torch.arange(10)
    ops.build_plan(plan, positions, torch.zeros(10, dtype=torch.int32), positions, ratio=4, num_slots=5, mtp_step=3)
    info = ops.plan_info(plan)
    assert (info.rows, info.requests, info.ratio, info.num_slots, info.mtp_step) == (10, 3, 4, 5, 3)
    before = plan.clone()
    with pytest.raises(OpError, match="mtp_step"):
        ops.build_plan(plan, positions, positions, positions, ratio=4, num_slots=5, mtp_step=-1)
    with pytest.raises(OpError, match="plan holds"):
        long = torch.arange(17)
        ops.build_plan(plan, long, long, long, ratio=4, num_slots=5)
    assert ops.plan_info(plan) is info and torch.equal(plan, before)
    assert ops.plan_info(plan.clone()) is None and ops.plan_info(plan[:2]) is None


def test_check_plan_finds_entries_beyond_the_outputs():
    """``out_slots=``: an entry whose ``out_slot`` the outputs do not hold would be written nowhere."""
    positions = torch.arange(12)
    out = torch.where(positions % 4 == 3, positions // 4 * 10, -1)  # slots 0, 10, 20
    plan = ops.empty_plan(12, 2, 4, "cpu")
    ops.build_plan(plan, positions, torch.ones(12, dtype=torch.int64), out, ratio=4, num_slots=4, mtp_step=1)
    err = torch.full((4,), 9, dtype=torch.int32)
    ops.check_plan(plan, None, err, out_slots=21)
    assert ops.plan_error(err) is None
    ops.check_plan(plan, None, err, out_slots=20)
    assert err.tolist() == [8, 0, 1, 20], err
    assert "out_slot 20, beyond the outputs' slots" in ops.plan_error(err)
    ops.check_plan(plan, None, err, out_slots=5, decode=True)  # a decode check fails first (12 rows, mtp 1)
    assert err[0] == 6
    with pytest.raises(OpError, match="state_info holds 3 slots; the plan addresses 4"):
        ops.check_plan(plan, torch.zeros(3, dtype=torch.int32), err)


# ---------------------------------------------------------------------------------------------------------------
# The schema, the dispatcher and the launch count
# ---------------------------------------------------------------------------------------------------------------
def test_schema_lists_what_each_op_writes():
    """``compress`` writes the plan (the tiled one-launch decode's arrival counters): the schema says so."""
    writes = {
        name: {a.name for a in getattr(torch.ops.dsv4c, name).default._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
        for name in ("build_plan", "build_plans", "build_state_rows", "compress", "compress_online_hca", "check_plan",
                     "copy_plan")
    }  # fmt: skip
    assert writes["compress"] == {"state", "out_pages", "scratch", "out_keys", "plan"}
    assert writes["compress_online_hca"] == {"state_banks", "out_pages", "out_keys", "scratch"}
    assert writes["build_plan"] == {"plan"} and writes["copy_plan"] == {"dst"}
    assert writes["build_plans"] == {"plans", "read_rows", "save_rows"}
    assert writes["build_state_rows"] == {"read_rows", "save_rows"} and writes["check_plan"] == {"err"}


def test_a_plan_without_a_record_is_refused_directly_and_taken_at_its_shape_when_dispatched():
    """A clone of a built plan carries no record: ``ops.compress`` refuses it; ``torch.ops.dsv4c.compress``
    (what compiled graphs call, whose functionalization may pass such clones) runs it and writes the same."""
    cfg = CSA_SMALL
    p = make_params(cfg, seed=9)
    rows = random_rows(13, cfg, torch.Generator().manual_seed(9))
    positions = torch.arange(13)
    out = torch.where(positions % 4 == 3, positions // 4, -1)
    plan = ops.empty_plan(13, 1, 4, "cpu")
    ops.build_plan(plan, positions, torch.zeros(13, dtype=torch.int64), out, ratio=4, num_slots=1, mtp_step=1)
    outputs = []
    for call in (ops.compress, torch.ops.dsv4c.compress):
        state = torch.zeros(1, cfg.ring_rows(1), cfg.row_width)
        pages = torch.full((1, 64 * 200), 0xA5, dtype=torch.uint8)
        clone = plan.clone()
        if call is ops.compress:
            with pytest.raises(OpError, match="plan carries no build"):
                call(rows, clone, p.ape, p.norm_weight, p.cos, p.sin, state, pages, kind="csa", page_size=64)
            clone = plan
        call(rows, clone, p.ape, p.norm_weight, p.cos, p.sin, state, pages, kind="csa", page_size=64)
        outputs.append((state, pages))
    assert torch.equal(outputs[0][1], outputs[1][1]) and torch.equal(outputs[0][0], outputs[1][0])
    assert not torch.equal(outputs[0][1], torch.full_like(outputs[0][1], 0xA5))


@pytest.mark.parametrize(
    "variant, mode, decode",
    [
        ("hca_tiled", "ring", True), ("hca_tiled", "ring", False), ("hca_single", "ring", False),
        ("csa", "ring", True), ("csa", "ring", False), ("csa", "ring_tables", False), ("csa", "ring_tables", True),
        ("online", "ring", True), ("online", "ring", False), ("online_split", "ring", False),
    ],
)  # fmt: skip
def test_launches_counts_what_the_ops_launch(monkeypatch, variant, mode, decode):
    layer = EngineLayer(variant, "vllm", seed=10, mode=mode)
    cfg = layer.cfg
    n = 3 if decode else 2 * cfg.ratio + 3
    rows = random_rows(n, cfg, torch.Generator().manual_seed(10))
    plan, fn, args, kwargs = _plain_step(layer, rows, start=cfg.ratio - 1 if decode else 0)
    kwargs = dict(kwargs, decode=decode)
    if mode == "ring_tables":
        read_rows = torch.full((plan.shape[0], cfg.window - 1), -1, dtype=torch.int64)
        save_rows = torch.full((n,), -1, dtype=torch.int64)
        ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=layer.ring)
        kwargs.update(read_rows=read_rows, save_rows=save_rows)
        args = (*args[:6], layer.state.reshape(-1, cfg.row_width), *args[7:])
    names = count_launches(monkeypatch)
    fn(*args, **kwargs)
    op = fn.__name__
    want = ops.launches(op, rows=n, requests=plan.shape[0], ratio=cfg.ratio, kind=layer.kind, decode=decode,
                        scratch=layer.scratch is not None, tables=mode != "ring")  # fmt: skip
    assert len(names) == want, (names, want)
    assert want == (2 if (variant, decode) in {("hca_tiled", False), ("online_split", False)} or
                    (mode, decode) == ("ring_tables", False) else 1)  # fmt: skip
    names.clear()
    ops.build_plan(plan, torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.arange(n), ratio=cfg.ratio,
                   num_slots=4)  # fmt: skip
    assert len(names) == ops.launches("build_plan", rows=n, requests=plan.shape[0]) == 1
    names.clear()
    other = ops.empty_plan(n, plan.shape[0], 4 if cfg.ratio == 128 else 128, "cpu")
    idx = torch.arange(n)
    ops.build_plans([plan, other], idx, torch.zeros(n, dtype=torch.int64), [idx, idx],
                    ratios=[cfg.ratio, 4 if cfg.ratio == 128 else 128], num_slots=4)  # fmt: skip
    assert len(names) == ops.launches("build_plans", rows=n, requests=plan.shape[0], plans=2) == 1, names


# ---------------------------------------------------------------------------------------------------------------
# Property: random valid and invalid calls
# ---------------------------------------------------------------------------------------------------------------
#: Changes to a valid call: name -> whether the op refuses the changed call.
MUTATIONS = {
    "none": False,
    "kv padding rows": False,
    "kv short": True,
    "ape of another ratio": True,
    "ring too small": True,
    "state slots": True,
    "keys capacity": True,
    "stale tables": True,
    "no build": True,
}


def _mutations_for(variant: str, mode: str) -> list[str]:
    names = ["none", "kv padding rows", "kv short", "ape of another ratio", "no build"]
    if mode == "ring":
        names.append("state slots")
    if not variant.startswith("online"):
        names.append("ring too small" if mode == "ring" else "stale tables")
    if variant == "indexer":
        names.append("keys capacity")
    return names


@st.composite
def _calls(draw):
    variant = draw(st.sampled_from(["csa", "indexer", "hca_tiled", "hca_single", "online"]))
    mode = "ring" if variant.startswith(("online", "hca")) else draw(st.sampled_from(["ring", "ring_tables"]))
    style = draw(st.sampled_from(["lightllm", "sglang", "vllm"]))
    first = draw(st.integers(1, 20))  # the first prefill chunk of request 0
    decode = draw(st.booleans())
    mutation = draw(st.sampled_from(_mutations_for(variant, mode)))
    return variant, mode, style, first, decode, mutation, draw(st.integers(0, 2**16))


def _mutate(layer: EngineLayer, mutation: str, gen: torch.Generator, seen: dict):
    """An ``EngineLayer.step`` call editor: the step's op call changed by ``mutation`` (and what it wrote
    before the call, the plan and the tables, kept in ``seen``)."""

    def edit(fn, args, kwargs):
        kv, plan, ape, norm, cos, sin, state, pages = args
        kwargs = dict(kwargs)
        seen.update(plan=plan, tables=[kwargs[k] for k in ("read_rows", "save_rows") if k in kwargs])
        cfg = layer.cfg
        if mutation == "kv padding rows":
            kv = torch.cat([kv, random_rows(5, cfg, gen)])
        elif mutation == "kv short":
            kv = kv[:-1]
        elif mutation == "ape of another ratio":
            ape = torch.cat([ape, ape[:1]])
        elif mutation == "ring too small":
            if state.dim() == 3:
                state = state[:, : cfg.window]
            else:
                kwargs["ring"] = cfg.window  # the flat state read as rings of one window
        elif mutation == "state slots":
            state = state[: layer.num_slots - 1] if state.dim() == 4 or state.dim() == 3 else state[: layer.ring]
        elif mutation == "keys capacity":
            kwargs["out_keys"] = kwargs["out_keys"][:-1]
        elif mutation == "stale tables":
            kwargs["read_rows"] = kwargs["read_rows"].clone()  # the tables' record does not travel with a clone
        elif mutation == "no build":
            plan = plan.clone()
        seen["before"] = _snapshot(_buffers(layer, *seen["tables"], seen["plan"]))
        return fn, (kv, plan, ape, norm, cos, sin, state, pages), kwargs

    return edit


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(_calls())
def test_random_calls_either_refuse_before_writing_or_write_the_reference(call):
    """A prefill step, then a second step (decode or a continuation chunk, most rewinding) whose compress is
    valid or changed by one mutation: a refused call leaves every buffer as it was (state, pages, keys,
    scratch, plan, tables); an accepted one leaves every entry equal to the float64 reference, the state rows a
    next step reads exact, and every other byte poisoned."""
    variant, mode, style, first, decode, mutation, seed = call
    layer = EngineLayer(variant, style, seed=seed % 97, mode=mode)
    cfg, r = layer.cfg, layer.cfg.ratio
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    layer.step([(0, 0, random_rows(first, cfg, gen)), (3, 0, random_rows(r + 1, cfg, gen))])
    layer.check("first step")
    items, lengths = [], {0: first, 3: r + 1}
    for slot in (0, 3):
        n = int(rng.integers(1, layer.mtp + 2)) if decode else int(rng.integers(1, 2 * r + 2))
        start = lengths[slot] - int(rng.integers(0, min(layer.mtp, lengths[slot]) + 1))
        items.append((slot, start, random_rows(n, cfg, gen)))
    seen = {}
    edit = _mutate(layer, mutation, gen, seen)
    what = f"{variant}/{mode}/{style}/decode={decode}: {mutation}"
    if MUTATIONS[mutation]:
        with pytest.raises(OpError):
            layer.step(items, decode=decode, edit_call=edit)
        _assert_unchanged(_buffers(layer, *seen["tables"], seen["plan"]), seen["before"], what)
        return
    layer.step(items, decode=decode, edit_call=edit)
    layer.check(what)
