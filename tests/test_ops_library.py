"""The registered ops (``torch.ops.dsv4c``) check a call as the eager op does: a bad call is refused with the same
:class:`OpError` called directly, through the dispatcher, and while ``torch.compile`` traces it (the fake runs
the op's checks), before anything is written (CPU, Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
from helpers.inputs import CSA_SMALL, make_params, random_rows

from dsv4_compressor import ops
from dsv4_compressor.errors import OpError

N, SLOTS = 9, 3


def _inputs(bad: str):
    cfg = CSA_SMALL
    p = make_params(cfg, seed=5, max_positions=64)
    positions = torch.arange(N)
    out_slot = torch.where(positions % 4 == 3, positions // 4, -1)
    rows = random_rows(N, cfg, torch.Generator().manual_seed(5))
    slots = SLOTS - 1 if bad == "state slots" else SLOTS  # the plan addresses SLOTS request slots
    state = torch.full((slots, cfg.ring_rows(0), cfg.row_width), 0.5)
    pages = torch.full((2, 64 * 200), 0xA5, dtype=torch.uint8)
    ape = p.ape.to(torch.bfloat16) if bad == "ape dtype" else p.ape
    return dict(positions=positions, out_slot=out_slot, rows=rows, state=state, pages=pages, ape=ape, p=p)


def _step(build, compress, plan, x):
    """A layer step as an engine's graph holds it: the plan's build, then the compress on it."""
    build(plan, x["positions"], torch.zeros(N, dtype=torch.int64), x["out_slot"], ratio=4, num_slots=SLOTS)
    p = x["p"]
    compress(x["rows"], plan, x["ape"], p.norm_weight, p.cos, p.sin, x["state"], x["pages"], kind="csa",
             page_size=64)  # fmt: skip


def _op_error(e: BaseException) -> OpError | None:
    """The :class:`OpError` an exception is or wraps (``torch.compile`` wraps what a fake raises)."""
    while e is not None and not isinstance(e, OpError):
        e = e.__cause__ or e.__context__
    return e


@pytest.mark.parametrize("bad", ["state slots", "ape dtype"])
def test_a_bad_call_is_refused_alike_eager_dispatched_and_compiled(bad):
    """``state slots``: a state with fewer request slots than the plan it is given addresses (a check against the
    plan's build record: the traced build keeps it on the traced plan); ``ape dtype``: a bf16 APE (a check of
    the call alone). Each path refuses with the same message, and no buffer (plan, state, pages) changes."""
    if bad == "state slots":
        pytest.importorskip("torch._inductor")
    messages = {}

    def eager(plan, x):
        _step(ops.build_plan, ops.compress, plan, x)

    def dispatched(plan, x):
        _step(torch.ops.dsv4c.build_plan, torch.ops.dsv4c.compress, plan, x)

    paths = {"eager": eager, "dispatcher": dispatched}
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        paths[backend] = torch.compile(dispatched, backend=backend, fullgraph=True)
    for name, fn in paths.items():
        x = _inputs(bad)
        plan = ops.empty_plan(N, 2, 4, "cpu")
        before = [t.clone() for t in (plan, x["state"], x["pages"])]
        with pytest.raises(Exception) as info:
            fn(plan, x)
        error = _op_error(info.value)
        assert error is not None, f"{name}: {info.value!r} is no OpError"
        messages[name] = str(error)
        if name in ("aot_eager", "inductor"):  # eager calls build the plan before compress refuses; a trace, nothing
            assert torch.equal(plan, before[0]), f"{name}: the plan was written"
        assert torch.equal(x["state"], before[1]) and torch.equal(x["pages"], before[2]), f"{name} wrote a buffer"
    assert len(set(messages.values())) == 1, messages
    assert ("request slots" if bad == "state slots" else "ape must be") in messages["eager"]


def test_a_valid_call_traces_and_runs_compiled():
    """The fake's checks accept a valid call: the compiled step writes what the eager one writes."""
    x, y = _inputs("none"), _inputs("none")
    eager_plan, compiled_plan = ops.empty_plan(N, 2, 4, "cpu"), ops.empty_plan(N, 2, 4, "cpu")
    _step(ops.build_plan, ops.compress, eager_plan, x)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda plan, x: _step(torch.ops.dsv4c.build_plan, torch.ops.dsv4c.compress, plan, x),
        backend="aot_eager",
        fullgraph=True,
    )
    compiled(compiled_plan, y)
    assert torch.equal(x["pages"], y["pages"]) and torch.equal(x["state"], y["state"])
    assert not torch.equal(y["pages"], torch.full_like(y["pages"], 0xA5))
