"""``ops.compress_pair`` (a CSA layer's main compressor and its indexer on one plan, ``ops/compression.py``) and
the adapters' ``compress_pair_of`` (``integrations/_pairing.py``), on engine-shaped buffers against the float64
reference (CPU, Triton interpreter).

A :class:`PairedLayers` is two :class:`test_ops.EngineLayer` on one schedule (``test_ops._schedule``), stepped
through ``compress_pair`` or through two ``compress`` calls on one plan: through prefill chunks, mixed batches
and MTP verify steps every entry of both against the reference and every byte of both states, pages and keys
equal to the two calls'; decode steps one launch of the pair kernel. A call that is not a pair, or a pair whose
indexer half is wrong, is refused before anything is written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.inputs import CSA_SMALL, INDEXER_CFG, random_rows
from helpers.session import count_launches
from test_ops import EngineLayer, _schedule

from dsv4_compressor import ops
from dsv4_compressor.errors import OpError
from dsv4_compressor.integrations._pairing import compress_pair_of


class PairedLayers:
    """A CSA layer's main compressor and its indexer as an engine holds them (two :class:`EngineLayer` on one
    schedule, the same output slots), stepped through ``ops.compress_pair`` (``pair=True``) or through two
    ``ops.compress`` calls on one plan."""

    def __init__(self, style: str, *, seed: int, mode: str = "ring", has_ape: bool = True,
                 pack: str = "hadamard", keys: bool = True):  # fmt: skip
        options = dict(seed=seed, mode=mode, has_ape=has_ape)
        self.main = EngineLayer("csa", style, **options)
        self.indexer = EngineLayer("indexer", style, pack=pack, keys=keys, **options)

    def step(self, items, *, pair: bool | str, names: list | None = None, edit_pair=None, **kwargs):
        """``items`` as :meth:`EngineLayer.step` takes them, with each item's rows a ``(main, indexer)`` pair.
        ``pair="of"``: the two ``compress`` calls made as one by the adapters' ``compress_pair_of``. ``names``
        (from ``count_launches``): the kernels the pair's own call launched, in order. ``edit_pair`` changes the
        pair call's keyword arguments."""
        held = {}

        def hold(fn, args, kw):  # the indexer's call, made below with the main's plan
            held.update(args=args, kwargs=kw)
            return (lambda *a, **k: None), args, kw

        self.indexer.step([(s, p, rows[1]) for s, p, rows in items], edit_call=hold, **kwargs)
        ia, ik = held["args"], held["kwargs"]

        def joined(fn, args, kw):
            plan = args[1]
            tables = {}
            if self.indexer.mode != "ring":  # the indexer's tables, built on the plan the pair runs
                tables = self.indexer._state_rows(plan, ops.plan_info(plan).rows)
            indexer_call = ((ia[0], plan, *ia[2:]), dict(ik, **tables))
            if not pair:

                def two(*a, **k):
                    ops.compress(*a, **k)
                    ops.compress(*indexer_call[0], **indexer_call[1])

                return two, args, kw
            if pair == "of":
                return (lambda *a, **k: compress_pair_of((a, k), indexer_call)), args, kw
            call = dict(
                page_size=kw["page_size"], indexer_page_size=ik["page_size"], eps=kw["eps"], indexer_eps=ik["eps"],
                decode=kw["decode"], out_keys=kw["out_keys"], indexer_out_keys=ik["out_keys"], ring=kw["ring"],
                indexer_ring=ik["ring"], read_rows=kw.get("read_rows"), save_rows=kw.get("save_rows"),
                indexer_read_rows=tables.get("read_rows"), indexer_save_rows=tables.get("save_rows"),
                state_has_ape=kw["state_has_ape"], indexer_pack=ik["indexer_pack"],
            )  # fmt: skip
            if edit_pair is not None:
                call = edit_pair(call)

            def run(*a, **k):
                if names is not None:
                    names.clear()
                ops.compress_pair(*args[:8], ia[0], *ia[2:8], **call)

            return run, args, kw

        self.main.step([(s, p, rows[0]) for s, p, rows in items], edit_call=joined, **kwargs)

    def buffers(self) -> list[torch.Tensor]:
        out = [self.main.state, self.main.page_memory, self.indexer.state, self.indexer.page_memory]
        return out + ([self.indexer.keys] if self.indexer.keys is not None else [])


def _paired_schedule(pair: PairedLayers, seed: int):
    """:func:`_schedule` with a ``(main, indexer)`` pair of rows per item."""
    gen = torch.Generator().manual_seed(seed + 100)
    for items, kwargs in _schedule(pair.main, torch.Generator().manual_seed(seed), np.random.default_rng(seed)):
        yield [(s, p, (rows, random_rows(rows.shape[0], INDEXER_CFG, gen))) for s, p, rows in items], kwargs


@pytest.mark.parametrize(
    "style, options",
    [
        ("vllm", dict()),
        ("lightllm", dict(mode="token_map", pack="hadamard_bf16", keys=False)),
        ("sglang", dict(has_ape=False, pack="hadamard_f32", keys=False)),
        ("vllm", dict(mode="block_table", pack="pow2")),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v),
)
def test_compress_pair_writes_what_two_compresses_write(monkeypatch, style, options):
    """``compress_pair`` through prefill chunks, mixed batches and MTP verify steps: every entry of both
    compressors against the float64 reference, the state rows a next step reads and the untouched bytes
    checked after each step, and every byte of both states, pages and keys equal to two ``compress`` calls
    on the same plan. Decode steps are one launch of the pair kernel, other steps the two compresses' own."""
    seed = 61 + len(str(options))
    paired, apart, of = (PairedLayers(style, seed=seed, **options) for _ in range(3))
    names = count_launches(monkeypatch)
    pair_steps = 0
    for k, (items, kwargs) in enumerate(_paired_schedule(paired, seed)):
        paired.step(items, pair=True, names=names, **kwargs)
        decode = all(rows[0].shape[0] <= paired.main.mtp + 1 for _, _, rows in items)
        want = ops.launches("compress_pair", rows=1, requests=1, decode=decode, tables=paired.main.mode != "ring")
        assert len(names) == want, (names, want)
        if decode:
            assert names == ["_compress_pair_kernel"], names
            pair_steps += 1
        else:
            assert "_compress_pair_kernel" not in names, names
        for layer in (paired.main, paired.indexer):
            layer.check(f"{style}/{options} step {k} ({layer.kind})")
        apart.step(items, pair=False, **kwargs)
        of.step(items, pair="of", **kwargs)  # the adapters' mapping of two compress calls onto one pair
        for i, (got, want, mapped) in enumerate(zip(paired.buffers(), apart.buffers(), of.buffers())):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"step {k}: buffer {i} differs"
            assert torch.equal(mapped.view(torch.uint8), got.view(torch.uint8)), f"step {k}: buffer {i} (pair_of)"
    assert pair_steps >= 6


def test_compress_pair_of_refuses_calls_that_are_not_a_pair():
    """The adapters' ``compress_pair_of`` makes one ``compress_pair`` only of a CSA call and an indexer call on
    one plan that agree on ``decode``; anything else is refused before anything is written."""
    pair = PairedLayers("vllm", seed=6)
    gen = torch.Generator().manual_seed(6)
    calls = {}

    def keep(fn, args, kw):
        calls["main"] = (args, kw)
        return (lambda *a, **k: None), args, kw

    step = [(0, 0, (random_rows(9, CSA_SMALL, gen), random_rows(9, INDEXER_CFG, gen)))]
    pair.main.step([(s, p, rows[0]) for s, p, rows in step], edit_call=keep)
    (args, kw) = calls["main"]
    other_plan = args[1].clone()
    before = [b.clone() for b in pair.buffers()]
    for what, indexer, needle in (
        ("a CSA call twice", (args, kw), "CSA main"),
        ("another plan", ((args[0], other_plan, *args[2:]), kw), "one plan"),
        ("decode differs", (args, dict(kw, kind="indexer", decode=not kw["decode"])), "decode"),
    ):
        with pytest.raises(OpError, match=needle):
            compress_pair_of((args, kw), indexer)
        for got, want in zip(pair.buffers(), before):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{what}: a buffer was written"


def test_compress_pair_refuses_a_bad_indexer_argument_and_writes_nothing():
    """A pair whose indexer half is wrong is refused before the main compressor runs: nothing of either is
    written, and the error names the indexer."""
    pair = PairedLayers("vllm", seed=5)
    gen = torch.Generator().manual_seed(5)
    first = [(0, 0, (random_rows(9, CSA_SMALL, gen), random_rows(9, INDEXER_CFG, gen)))]
    pair.step(first, pair=True)
    before = [b.clone() for b in pair.buffers()]
    bad = {
        "indexer_ring": (dict(indexer_ring=2), ["indexer", "ring"]),
        "indexer_pack": (dict(indexer_pack="fp4"), ["indexer", "indexer_pack", "fp4"]),
        "indexer_page_size": (dict(indexer_page_size=0), ["indexer", "page_size"]),
    }
    decode = [(0, 9, (random_rows(1, CSA_SMALL, gen), random_rows(1, INDEXER_CFG, gen)))]
    for name, (change, needles) in bad.items():
        with pytest.raises(OpError) as info:
            pair.step(decode, pair=True, edit_pair=lambda call, change=change: dict(call, **change))
        for needle in needles:
            assert needle in str(info.value), f"{name}: {needle!r} not in {info.value}"
        for got, want in zip(pair.buffers(), before):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{name}: a buffer was written"
