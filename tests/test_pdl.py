"""Programmatic dependent launch: when it is on, and that every op forwards the choice to every launch.

What PDL launches write is checked on the GPU (``tests/test_ops_gpu.py::test_pdl_launches_write_what_plain_
launches_write``); ``scripts/compile_check.py --pdl`` checks offline that every kernel compiled with it waits on
its predecessor (``griddepcontrol.wait``) and releases its successor.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_params

from dsv4_compressor import ops
from dsv4_compressor.kernels import c128_tiled, pdl


def test_launch_options(monkeypatch):
    assert pdl.RELEASE == "exit"  # the measured choice (module docstring)
    assert pdl.START_RELEASE_MAX_PROGRAMS is None  # launches of up to one program per multiprocessor
    monkeypatch.setattr(pdl, "sm_count", lambda: 148)  # a B200
    assert pdl.launch_options(True, 148) == {"PDL": 2, "launch_pdl": True}
    assert pdl.launch_options(True, 149) == {"PDL": 1, "launch_pdl": True}
    monkeypatch.setattr(pdl, "sm_count", lambda: 132)  # an H200
    assert pdl.launch_options(True, 132) == {"PDL": 2, "launch_pdl": True}
    assert pdl.launch_options(True, 133) == {"PDL": 1, "launch_pdl": True}
    monkeypatch.setattr(pdl, "START_RELEASE_MAX_PROGRAMS", 0)
    assert pdl.launch_options(True, 1) == {"PDL": 1, "launch_pdl": True}
    assert pdl.launch_options(False, 1) == {"PDL": 0}  # the interpreter takes no launch options
    monkeypatch.setattr(pdl, "START_RELEASE_MAX_PROGRAMS", 64)
    assert pdl.launch_options(True, 64) == {"PDL": 2, "launch_pdl": True}
    assert pdl.launch_options(True, 65) == {"PDL": 1, "launch_pdl": True}
    # a launcher's own policy releases at the start whatever the size, and never turns PDL on
    assert pdl.launch_options(True, 10_000, start=True) == {"PDL": 2, "launch_pdl": True}
    assert pdl.launch_options(False, 10_000, start=True) == {"PDL": 0}
    monkeypatch.setattr(pdl, "RELEASE", "start")
    assert pdl.launch_options(True, 65) == {"PDL": 2, "launch_pdl": True}


def test_off_on_the_cpu_and_when_disabled(monkeypatch):
    for enabled in (None, True, False):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        assert pdl.pdl_enabled(torch.device("cpu")) is False
    monkeypatch.setattr(pdl, "_supported", lambda device_type, index: True)
    monkeypatch.setattr(pdl, "ENABLED", None)
    assert pdl.pdl_enabled(torch.device("cuda", 0)) is True
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_enabled(torch.device("cuda", 0)) is False


@pytest.mark.parametrize(
    "value, want", [("", None), ("auto", None), ("0", False), ("off", False), ("1", True), ("ON", True)]
)
def test_environment_switch(monkeypatch, value, want):
    monkeypatch.setenv("DSV4_PDL", value)
    assert pdl._from_env() is want


def test_environment_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv("DSV4_PDL", "sometimes")
    with pytest.raises(ValueError, match="DSV4_PDL"):
        pdl._from_env()


LAUNCHERS = (
    "launch_compress_single",
    "launch_ring_save",
    "launch_c128_tiled",
    "launch_online_hca",
    "launch_state_rows",
)


@pytest.mark.parametrize("on", [True, False])
def test_every_op_forwards_the_choice_to_every_launch(monkeypatch, on):
    """With ``pdl_enabled`` answering ``on``, every launcher of every op (plan, state rows, each compress path)
    receives ``pdl=on``; the launches are recorded, not run."""
    calls = []

    def recorder(name):
        return lambda *args, **kwargs: calls.append((name, kwargs.get("pdl")))

    monkeypatch.setattr(ops, "pdl_enabled", lambda device: on)
    for name in LAUNCHERS:
        monkeypatch.setattr(ops, name, recorder(name))
    monkeypatch.setattr(ops._plan, "launch_build_plan", recorder("launch_build_plan"))
    monkeypatch.setattr(ops._plan, "launch_check_plan", recorder("launch_check_plan"))

    rows, slots = 8, 2
    positions = torch.arange(rows, dtype=torch.int64)
    row_req = torch.zeros(rows, dtype=torch.int32)
    out_slot = torch.arange(rows, dtype=torch.int64)
    for cfg, kinds in (
        (HCA_SMALL, ("tiled", "single", "online")),
        (CSA_SMALL, ("single",)),
        (INDEXER_CFG, ("single",)),
    ):
        p = make_params(cfg)
        plan = ops.empty_plan(rows, slots, cfg.ratio, "cpu")
        ops.build_plan(plan, positions, row_req, out_slot, ratio=cfg.ratio, num_slots=slots)
        ops.check_plan(plan, None, torch.zeros(4, dtype=torch.int32))
        kv = torch.randn(rows, cfg.row_width)
        pages = torch.zeros(4, 64 * 600, dtype=torch.uint8)
        keys = torch.zeros(256, cfg.head_dim, dtype=torch.bfloat16) if cfg.output == "indexer" else None
        page = cfg.default_page_size
        for kernel in kinds:
            if kernel == "online":
                banks = torch.zeros(slots, 2, 3, cfg.head_dim)
                ops.compress_online_hca(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, banks, pages, page_size=page)
                continue
            state = torch.zeros(slots, cfg.ring_rows(1), cfg.row_width)
            scratch = torch.zeros(rows, cfg.head_dim) if kernel == "tiled" else None
            kind = "indexer" if cfg.output == "indexer" else ("csa" if cfg.overlap else "hca")
            for decode in (True, False):
                ops.compress(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages, kind=kind, page_size=page,
                             decode=decode, scratch=scratch, out_keys=keys)  # fmt: skip
        read_rows = torch.zeros(slots, cfg.window - 1, dtype=torch.int64)
        save_rows = torch.zeros(rows, dtype=torch.int64)
        ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=cfg.ring_rows(1))
        if cfg.overlap:  # a table-addressed state saves in a launch of its own in steps that are not decode
            state = torch.zeros(slots * cfg.ring_rows(1), cfg.row_width)
            ops.compress(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages, kind=kind, page_size=page,
                         out_keys=keys, read_rows=read_rows, save_rows=save_rows)  # fmt: skip
    names = {name for name, _ in calls}
    assert names == {*LAUNCHERS, "launch_build_plan", "launch_check_plan"}, names
    assert all(value is on for _, value in calls), calls


def test_tiled_one_launch_release_policy(monkeypatch):
    """``c128_tiled.RELEASE_AT_START_MAX_REQUESTS``: one-launch decode kernels of plans of up to that many
    requests release at their start (``PDL == 2``) whatever their program count; larger plans, and 0, keep the
    size rule (4,004 programs here: release at exit)."""
    assert c128_tiled.RELEASE_AT_START_MAX_REQUESTS == 64  # the measured choice (its comment)
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs["PDL"])

    monkeypatch.setattr(c128_tiled, "_window_finish_kernel", Kernel())
    plan, meta = SimpleNamespace(T=4, R=2), SimpleNamespace(HEAD=64)
    for knob in (0, 2, 1):
        monkeypatch.setattr(c128_tiled, "RELEASE_AT_START_MAX_REQUESTS", knob)
        c128_tiled.launch_c128_tiled(None, None, None, plan, None, None, meta, None, None, ratio=128, closing=2000,
                                     decode=True, pdl=True)  # fmt: skip
    assert seen == [1, 2, 1]


def test_compress_right_after_its_plans_build_waits_before_reading_its_records(monkeypatch):
    """``record_first`` (``ops.records_first``): a compress launched right after its own plan's build on the
    same stream gets ``False`` (its programs wait for the build before reading their plan records); after any
    other launch of ours on that stream (a compress, ``build_state_rows``, another plan's build, all of which
    wait for their predecessor before releasing the next kernel) it gets ``True``; a copy (``copy_plan``)
    counts as a build, and ``build_plans`` as a build of each plan it fills; a launch on another stream changes
    nothing here. Launches are recorded, not run; streams are simulated."""
    calls = []

    def recorder(name):
        return lambda *args, **kwargs: calls.append((name, kwargs["record_first"]))

    for name in ("launch_compress_single", "launch_c128_tiled", "launch_online_hca"):
        monkeypatch.setattr(ops, name, recorder(name))
    monkeypatch.setattr(ops._plan, "launch_build_plan", lambda *args, **kwargs: None)
    monkeypatch.setattr(ops._step_build, "launch_build_plans", lambda *args, **kwargs: 1)
    monkeypatch.setattr(ops, "launch_state_rows", lambda *args, **kwargs: None)
    stream = ["s1"]
    monkeypatch.setattr(ops, "_stream", lambda device: stream[0])
    monkeypatch.setattr(ops, "_LAST_LAUNCH", {})
    rows, slots, cfg = 8, 2, HCA_SMALL
    p = make_params(cfg)
    positions = torch.arange(rows, dtype=torch.int64)
    row_req = torch.zeros(rows, dtype=torch.int32)
    out_slot = torch.arange(rows, dtype=torch.int64)
    plans = [ops.empty_plan(rows, slots, cfg.ratio, "cpu") for _ in range(3)]
    kv = torch.randn(rows, cfg.row_width)
    pages = torch.zeros(4, 64 * 600, dtype=torch.uint8)
    state = torch.zeros(slots, cfg.ring_rows(1), cfg.row_width)
    banks = torch.zeros(slots, 2, 3, cfg.head_dim)
    scratch = torch.zeros(rows, cfg.head_dim)
    read_rows = torch.zeros(slots, cfg.window - 1, dtype=torch.int64)
    save_rows = torch.zeros(rows, dtype=torch.int64)

    def build(plan):
        ops.build_plan(plan, positions, row_req, out_slot, ratio=cfg.ratio, num_slots=slots)

    def tiled(plan):
        ops.compress(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages, kind="hca", page_size=2,
                     decode=True, scratch=scratch)  # fmt: skip

    def single(plan):
        ops.compress(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages, kind="hca", page_size=2,
                     decode=True)  # fmt: skip

    def online(plan):
        ops.compress_online_hca(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, banks, pages, page_size=2)

    a, b, c = plans
    assert not ops.records_first(a) or ops.plan_info(a) is None
    build(a)
    assert not ops.records_first(a)
    tiled(a)
    assert ops.records_first(a)
    tiled(a)
    online(a)
    build(a)  # the next step's plan: the compress right after it waits again
    online(a)
    single(a)
    build(a)
    build(b)  # waits for a's build before it releases anything
    single(b)
    single(a)
    tiled(b)
    build(a)
    ops.build_state_rows(a, read_rows, save_rows, mode="req_ring", ring=cfg.ring_rows(1))  # waits, like a compress
    single(a)
    ops.copy_plan(c, a)  # a copy is not our kernel: the next compress on it (or on a) waits
    single(c)
    single(a)
    build(a)
    stream[0] = "s2"  # a second stream, synchronised with the first by an event: a full dependency
    single(a)
    stream[0] = "s1"
    single(a)
    single(a)
    # build_plans: a build of every plan it fills, whichever path it takes (one launch or one per plan)
    ops.build_plans([a, b], positions, row_req, [out_slot, out_slot], ratios=[cfg.ratio] * 2, num_slots=slots)
    single(b)  # right after its build: waits
    single(a)  # after b's compress: reads its record first
    ops.build_plans([a, b], positions, row_req, [out_slot, out_slot], ratios=[cfg.ratio] * 2, num_slots=slots)
    assert not ops.records_first(a) and not ops.records_first(b)
    tiled(a)  # the first plan too waits right after the build
    assert ops.records_first(a) and ops.records_first(b)
    ops.build_plans([c], positions, row_req, [out_slot], ratios=[cfg.ratio], num_slots=slots)
    assert ops.records_first(a) and not ops.records_first(c)
    online(c)
    build(a)
    ops.build_plans([b, c], positions, row_req, [out_slot, out_slot], ratios=[cfg.ratio] * 2, num_slots=slots)
    single(a)  # a was built two launches ago: the plans' build waited for it before releasing anything
    # with plan 0's state rows: resolved in the plans' own launch, a build of both plans as without them; in a
    # launch of their own after the plans (steps too large for one program), which waited for them as
    # build_state_rows does, not
    both = dict(ratios=[cfg.ratio] * 2, num_slots=slots, read_rows=read_rows, save_rows=save_rows,
                state_mode="req_ring", ring=cfg.ring_rows(1))  # fmt: skip
    monkeypatch.setattr(ops._step_build, "TABLES_IN_PLAN_LAUNCH", True)  # the tables in the plans' launch
    ops.build_plans([a, b], positions, row_req, [out_slot, out_slot], **both)
    assert not ops.records_first(a) and not ops.records_first(b)
    monkeypatch.setattr(ops._step_build, "TABLES_IN_PLAN_LAUNCH", False)  # the tables then take a launch of their own
    ops.build_plans([a, b], positions, row_req, [out_slot, out_slot], **both)
    assert ops.records_first(a) and ops.records_first(b)
    assert calls == [
        ("launch_c128_tiled", False),
        ("launch_c128_tiled", True),
        ("launch_online_hca", True),
        ("launch_online_hca", False),
        ("launch_compress_single", True),
        ("launch_compress_single", False),
        ("launch_compress_single", True),
        ("launch_c128_tiled", True),
        ("launch_compress_single", True),
        ("launch_compress_single", False),
        ("launch_compress_single", True),
        ("launch_compress_single", True),
        ("launch_compress_single", False),
        ("launch_compress_single", True),
        ("launch_compress_single", False),
        ("launch_compress_single", True),
        ("launch_c128_tiled", False),
        ("launch_online_hca", False),
        ("launch_compress_single", True),
    ], calls


def test_launchers_read_records_first_only_where_asked(monkeypatch):
    """The launchers turn ``record_first`` into the kernels' ``RECORD_FIRST``: the tiled one-launch and online
    kernels whenever PDL is on, the single-stage kernel only in launches that release at their start
    (``PDL == 2``: there it was measured faster, elsewhere slower)."""
    from dsv4_compressor.kernels import fused_compress, online_hca

    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((kwargs["PDL"], kwargs["RECORD_FIRST"]))

    for module, name in ((c128_tiled, "_window_finish_kernel"), (fused_compress, "_compress_single_kernel"),
                         (online_hca, "_online_hca_kernel")):  # fmt: skip
        monkeypatch.setattr(module, name, Kernel())
    meta = SimpleNamespace(HEAD=64, BLOCK_HEAD=64)
    sm = SimpleNamespace(RING=8, TABLE=False)
    kv = SimpleNamespace(SPLIT=1)  # a summed kv_score: the online decode's warps depend on its SPLIT
    for programs in (4, 4000):
        plan = SimpleNamespace(T=programs, R=2)
        for pdl_on in (True, False):
            for first in (True, False):
                seen.clear()
                c128_tiled.launch_c128_tiled(None, None, None, plan, None, None, meta, None, None, ratio=128,
                                             closing=2, decode=True, pdl=pdl_on, record_first=first)  # fmt: skip
                fused_compress.launch_compress_single(None, None, None, plan, None, None, meta, sm, ratio=4,
                                                      overlap=False, save_rows=True, pdl=pdl_on,
                                                      record_first=first)  # fmt: skip
                banks = torch.zeros(2, 2, 3, 64)
                online_hca.launch_online_hca(kv, None, plan, banks, None, None, meta, ratio=128, closing=2,
                                             decode=True, pdl=pdl_on, record_first=first)  # fmt: skip
                tiled, single, online = seen
                assert tiled[1] == (first and pdl_on), (programs, pdl_on, first, seen)
                assert online[1] == (first and pdl_on), (programs, pdl_on, first, seen)
                assert single[1] == (first and single[0] == 2), (programs, pdl_on, first, seen)
                assert single[0] == (0 if not pdl_on else (2 if programs <= 132 else 1))
