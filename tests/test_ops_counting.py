"""``ops.launches`` follows the dispatch the ops run: change an input of that dispatch and both the kernels a call
really launches (counted under the interpreter) and ``launches()`` change, together (CPU, Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
from helpers.inputs import random_rows
from helpers.session import count_launches
from test_op_contract import _plain_step
from test_ops import EngineLayer

from dsv4_compressor import ops
from dsv4_compressor.kernels import c128_tiled


def _tiled_decode(monkeypatch) -> tuple[int, int]:
    """A decode step of the tiled HCA kernel: (kernels launched, ``launches()``)."""
    layer = EngineLayer("hca_tiled", "vllm", seed=3)
    rows = random_rows(3, layer.cfg, torch.Generator().manual_seed(3))
    plan, fn, args, kwargs = _plain_step(layer, rows, start=layer.cfg.ratio - 1)
    names = count_launches(monkeypatch)
    fn(*args, **dict(kwargs, decode=True))
    want = ops.launches("compress", rows=3, requests=plan.shape[0], ratio=layer.cfg.ratio, kind="hca", decode=True,
                        scratch=True)  # fmt: skip
    return len(names), want


def _pair_decode(monkeypatch) -> tuple[int, int]:
    """A decode step of ``compress_pair`` (a CSA layer's main compressor and its indexer on one plan)."""
    main, idx = (EngineLayer(v, "vllm", seed=4) for v in ("csa", "indexer"))
    gen = torch.Generator().manual_seed(4)
    rows, idx_rows = random_rows(1, main.cfg, gen), random_rows(1, idx.cfg, gen)
    plan, _, args, _ = _plain_step(main, rows, start=3)
    p, q = main.params, idx.params
    names = count_launches(monkeypatch)
    ops.compress_pair(*args, idx_rows, idx.ape, q.norm_weight, idx.cos, idx.sin, idx.state, idx.pages,
                      page_size=main.page_size, indexer_page_size=idx.page_size, decode=True,
                      indexer_out_keys=idx.keys, out_keys=main.keys)  # fmt: skip
    want = ops.launches("compress_pair", rows=1, requests=plan.shape[0], decode=True, head=p.norm_weight.shape[0],
                        indexer_head=q.norm_weight.shape[0])  # fmt: skip
    return len(names), want


def _plans_with_tables(monkeypatch) -> tuple[int, int]:
    """``build_plans`` of a step's ratio-4 and ratio-128 plans with plan 0's state-row tables."""
    n, ring = 9, 8
    idx = torch.arange(n)
    plans = [ops.empty_plan(n, 2, r, "cpu") for r in (4, 128)]
    read_rows = torch.full((2, 7), -1, dtype=torch.int64)
    save_rows = torch.full((n,), -1, dtype=torch.int64)
    names = count_launches(monkeypatch)
    ops.build_plans(plans, idx, torch.zeros(n, dtype=torch.int64), [idx, idx], ratios=[4, 128], num_slots=2,
                    read_rows=read_rows, save_rows=save_rows, state_mode="req_ring", ring=ring)  # fmt: skip
    return len(names), ops.launches("build_plans", rows=n, requests=2, plans=2, tables=True)


#: A dispatch input of an op: (the call, the attribute's owner, its name, the changed value, launches before and
#: after the change).
CHANGES = {
    "tiled one-launch cap": (_tiled_decode, c128_tiled, "ONE_LAUNCH_MAX_REQUESTS", 0, 1, 2),
    "pair launch switch": (_pair_decode, ops, "PAIR_LAUNCH", False, 1, 2),
    "tables in the plans' launch": (_plans_with_tables, ops._step_build, "TABLES_IN_PLAN_LAUNCH", True, 2, 1),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_launches_follows_a_change_of_the_dispatch(monkeypatch, change):
    """Before and after the change ``launches()`` is what the call launches, and the change changes it."""
    call, owner, name, value, before, after = CHANGES[change]
    with monkeypatch.context() as m:
        launched, counted = call(m)
    assert launched == counted == before, (launched, counted)
    monkeypatch.setattr(owner, name, value)
    with monkeypatch.context() as m:
        launched, counted = call(m)
    assert launched == counted == after, (launched, counted)


def test_launches_of_a_pair_follows_the_fused_kernel_s_head_limit():
    """``compress_pair``'s one launch needs head dims the fused kernel takes (``pairs_in_one_launch``): at
    DeepSeek-V4's (512, 128) one launch, with a head too wide for one save block two per compressor's
    compress."""
    assert ops.launches("compress_pair", rows=1, requests=1, decode=True) == 1
    assert ops.launches("compress_pair", rows=1, requests=1, decode=True, head=1024) == 2
    assert ops.launches("compress_pair", rows=4, requests=1, decode=False) == 2


def test_patching_the_package_reaches_the_op():
    """A name set on ``ops`` (as the adapter tests set ``ops.projection_triton_rows``) is what the op that calls it
    sees: ``projection_choice`` takes the Triton path up to the patched rows."""
    assert ops.projection_choice(16, 256, 64).path == "torch"  # no measured entry for this shape: cuBLAS
    original = ops.projection_triton_rows
    try:
        ops.projection_triton_rows = lambda width, dim, **_: 32
        assert ops.projection_choice(16, 256, 64).path == "triton"
        assert ops.projection_choice(33, 256, 64).path == "torch"
    finally:
        ops.projection_triton_rows = original
    assert ops.projection.projection_triton_rows is original
    assert ops.projection_choice(16, 256, 64).path == "torch"
