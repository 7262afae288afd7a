"""Online HCA in SGLang (``install(hca="online")``, ``DSV4C_SGLANG=online``) on the REAL ``sglang==0.5.23``
package (``make test-sglang``; skipped without it), CPU, Triton interpreted.

What runs here, on SGLang's own ``DeepSeekV4TokenToKVPool`` (its C128 ``CompressStatePool`` holding the banks,
sized by its own ``resolve_compress_state_ring_size``), ``ReqToTokenPool``, the real ``DeepseekV4AttnBackend``
(constructor and metadata builders) and real ``Compressor`` modules (``test_engine_sglang.RealPoolWorld``):

* a program of chunked prefill (a C128 group carried across chunks), decode or EAGLE verify with random
  rejections (then SGLang's own ``clear_unaccepted_c128_draft_states``, as its EAGLE worker runs it), a radix
  hit on a 256-token page, a new request in a freed slot, run once with SGLang's ring and once with online HCA:
  every entry of both against float64, C4 and indexer pages identical byte for byte, the HCA pages identical but
  at the online kernel's rounding boundaries (counted), pool rows of slots never used still poison;
* PD: a request moved mid-group from one pool to another (another slot) through SGLang's own
  ``get_request_state_buf_infos`` / ``request_state_transfer_indices`` (the bytes copied as SGLang's generic
  state transfer copies them), then continued there to its group's end; and the banks between a prefill node
  without speculation (2 banks) and a decode node with EAGLE (4 banks);
* the switch: ``DSV4C_SGLANG=online`` through the entry point, the refusals that remain.
"""

from __future__ import annotations

import ctypes
import importlib
import types

import numpy as np
import pytest
import test_engine_sglang as tes
import test_integration_sglang as tis
import torch

from dsv4_compressor.integrations import sglang as sg

pool_mod, backend_mod, server_args_mod = tes.pool_mod, tes.backend_mod, tes.server_args_mod
runtime_mod, dsa_utils = tes.runtime_mod, tes.dsa_utils
clean = tes.clean  # the fixture: uninstall before and after
common_utils = importlib.import_module("sglang.srt.disaggregation.common.utils")
PAGES = 7  # full-token pages of 256 (page 0 the padding token's): a 2-page request, a shared page, a freed one


class _BankLayer(tis.Layer):
    """The HCA layer of :class:`OnlineWorld`: its ``state`` is SGLang's C128 pool, the banks. Entries checked as
    every layer's; the pool rows of request slots no step used must still hold their poison."""

    def _check_untouched(self, what: str, used_slots=None) -> None:
        super()._check_untouched(what, self.world.used_slots)


class OnlineWorld(tes.RealPoolWorld):
    """:class:`test_engine_sglang.RealPoolWorld` with the scheduler's other moves: a request freed (its pages
    back to the allocator), SGLang's EAGLE cleanup after each verify; its HCA layer a :class:`_BankLayer` when
    the adapter runs online HCA."""

    def __init__(self, monkeypatch, server_args, *, seed: int = 31):
        super().__init__(monkeypatch, server_args, seed=seed)
        self.server_args = server_args
        self.used_slots: set[int] = set()
        if self.adapter.hca == "online":
            hca = self.layers[0]
            assert hca.name == "hca"
            hca.__class__, hca.hca = _BankLayer, "online"

    def inputs(self, items, mode, bs, tokens=None):
        self.used_slots.update(s for s, _, _ in items)
        return super().inputs(items, mode, bs, tokens)

    def free(self, slot: int) -> None:
        """The request in ``slot`` finished: its pages go back to the allocator (reused next), its rows leave."""
        for layer in self.layers:
            layer.model.release(slot)
        self.free_pages.extend(self.pages.pop(slot))
        self.lengths.pop(slot)

    def verify_and_clean(self, slots, count: int, *, bs: int) -> None:
        """EAGLE verify steps with random acceptance, each followed by SGLang's own
        ``clear_unaccepted_c128_draft_states`` (as ``eagle_worker_common`` calls it): on the ring it clears the
        rejected drafts' rows; on the banks it must do nothing."""
        e = self.draft_tokens
        committed = {s: self.lengths[s] for s in slots}
        for k in range(count):
            items = [(s, committed[s], e) for s in slots]
            self.step(items, "verify", bs=bs)
            self.check(f"verify {k} {items}")
            accept = [int(self.rng.integers(1, e + 1)) for _ in slots]
            hca = self.layers[0].state
            before = hca.clone()
            self.pool.clear_unaccepted_c128_draft_states(
                torch.tensor(slots, dtype=torch.int64), torch.tensor([committed[s] for s in slots]),
                torch.tensor(accept, dtype=torch.int32), e,
            )  # fmt: skip
            if self.adapter.hca == "online":  # the banks untouched (SGLang's kernel would clear ring rows in them)
                assert torch.equal(hca.view(torch.int32), before.view(torch.int32)), f"verify {k}: banks cleared"
            elif any(a < e for a in accept):
                assert not torch.equal(hca.view(torch.int32), before.view(torch.int32))  # SGLang's cleanup ran
            for s, a in zip(slots, accept):
                committed[s] += a
        for s in slots:  # the scheduler's lengths: the rejected drafts' rows are gone (SGLang cleared them)
            self.lengths[s] = committed[s]
            for layer in self.layers:
                layer.model.apply(s, committed[s], layer.model.rows[s][:0])


def _stand_ins(monkeypatch) -> None:
    monkeypatch.setattr(dsa_utils, "get_parallel", lambda: types.SimpleNamespace(attn_cp_size=1))
    monkeypatch.setattr(backend_mod, "_create_flashmla_metadata", lambda: None)  # flash_mla: CUDA only
    monkeypatch.setattr(backend_mod.DeepseekV4AttnBackend, "init_forward_metadata_indexer", lambda self, *a, **k: None)
    monkeypatch.setattr(tis, "PAGE", tes.REAL_PAGE)
    monkeypatch.setattr(tes, "REAL_PAGES", PAGES)


def _args(draft_tokens: int):
    spec = {}
    if draft_tokens > 1:
        spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=draft_tokens - 1, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=draft_tokens)  # fmt: skip
    return server_args_mod.ServerArgs(model_path="x", chunked_prefill_size=256, max_prefill_tokens=256, device="cpu",
                                      **spec)  # fmt: skip


class _Published:
    """SGLang's runtime context with ``args`` published (its pools read their options there), restored after."""

    def __init__(self, args):
        self.ctx = runtime_mod.get_context()
        self.saved = {name: getattr(self.ctx, name) for name in ("_server_args", "_config_bags")}
        self.saved_parallel = self.ctx.parallel._config
        self.ctx.set_server_args(args)

    def restore(self) -> None:
        for name, value in self.saved.items():
            setattr(self.ctx, name, value)
        self.ctx.parallel._config = self.saved_parallel


def _program(monkeypatch, hca: str, draft_tokens: int) -> OnlineWorld:
    """The program, under ``install(hca=hca, projection="engine")``; returns the world after its last check."""
    args = _args(draft_tokens)
    published = _Published(args)
    try:
        sg.install(hca=hca, projection="engine", check_environment=False)
        w = OnlineWorld(monkeypatch, args)
        c128 = w.pool.get_attention_compress_states(0)
        if hca == "online":
            b = sg.bank_count(draft_tokens)
            assert sg.pool_banks(c128) == b and w.ring128 == sg.bank_rows(draft_tokens) == 3 * b // 2
        else:
            assert sg.pool_banks(c128) is None and w.ring128 == (256 if draft_tokens > 1 else 128)
        per = w.ring128  # SGLang's CompressStatePool: slots x ring + ring + 1 rows, padded to the ratio
        assert c128.kv_score_buffer.kv_score.shape[0] == -(-(w.pool.num_req_slots * per + per + 1) // 128) * 128
        w.step([(1, 0, 130), (2, 0, 9)], "prefill")
        w.check("prefill")
        w.step([(1, 130, 126), (3, 0, 130)], "prefill")  # slot 1's group 1 closes at 255: carried across chunks
        w.check("chunked prefill")
        slots = [1, 2, 3]
        if draft_tokens > 1:
            w.verify_and_clean(slots, 2, bs=4)
        else:
            for k in range(2):
                w.step([(s, w.lengths[s], 1) for s in slots], "decode", bs=4)
                w.check(f"decode {k}")
        w.share_prefix(1, 4, tes.REAL_PAGE)  # a radix hit on slot 1's first page: a group boundary
        w.step([(4, tes.REAL_PAGE, 5)], "prefill")
        w.check("radix hit")
        w.free(2)
        w.step([(2, 0, 12)], "prefill")  # a new request in the freed slot (its old banks / ring rows left as they were)
        w.check("new request in a freed slot")
        slots = [1, 2, 3, 4]
        if draft_tokens > 1:
            w.verify_and_clean(slots, 1, bs=4)
        else:
            w.step([(s, w.lengths[s], 1) for s in slots], "decode", bs=4)
            w.check("decode, all four")
        if hca == "online":  # the state of every open group is in SGLang's pool rows, not elsewhere
            b = sg.bank_count(draft_tokens)
            banks = sg.banks_view(w.layers[0].state, b, 512)
            for s, length in w.lengths.items():
                assert length % 128 and torch.isfinite(banks[s, length % b]).all(), (s, length)
        return w
    finally:
        sg.uninstall()
        published.restore()


@pytest.mark.parametrize("draft_tokens", [1, 3], ids=["decode", "eagle"])
def test_online_hca_in_sglang_s_pool_matches_the_ring(clean, monkeypatch, draft_tokens):
    """The same program with SGLang's C128 ring and with online HCA banks in SGLang's C128 pool (sized for the
    banks: 3 rows per request slot, 6 with EAGLE's 3 drafts rounded up to 4 banks): every entry of both runs
    against float64 after every step (``test_integration_sglang.Layer``: ``verify.check_latent_records`` /
    ``check_indexer_pack``), SGLang's reader on every written record, the C4 / indexer pages and states
    identical between the runs byte for byte, the HCA pages identical but at the online kernel's rounding
    boundaries (it sums a group in another order than the ring kernel: counted, bounded), and the bank pool's
    rows of slots no request used still poison."""
    _stand_ins(monkeypatch)
    ring = _program(monkeypatch, "ring", draft_tokens)
    online = _program(monkeypatch, "online", draft_tokens)
    for a, b in zip(ring.layers[1:], online.layers[1:]):
        assert torch.equal(a.memory, b.memory), f"{a.name}: pages differ between the ring and the online run"
        assert torch.equal(a.state.view(torch.int32), b.state.view(torch.int32)), a.name
    hca_r, hca_o = ring.layers[0], online.layers[0]
    assert hca_r.written == hca_o.written and len(hca_r.written) == 3  # slot 1's groups 0 and 1, slot 3's 0
    slots = torch.tensor(sorted(hca_r.written))
    got_r, got_o = hca_r.layout.read(hca_r.memory, slots), hca_o.layout.read(hca_o.memory, slots)
    differ = int((got_r != got_o).sum())
    print(f"online vs ring HCA: {len(slots)} records, {differ} of {got_r.numel()} bytes differ (rounding boundaries)")
    assert differ <= got_r.numel() // 50
    assert online.read_back == ring.read_back > 0


def _pd_world(monkeypatch, draft_tokens: int):
    args = _args(draft_tokens)
    published = _Published(args)
    try:
        w = OnlineWorld(monkeypatch, args)
    finally:
        published.restore()
    return w


def _transfer(src_pool, dst_pool, src_slot: int, dst_slot: int, seq_len: int) -> int:
    """One request's C128 state from ``src_pool`` to ``dst_pool`` as SGLang's PD moves its
    ``DSV4_REQUEST_STATE`` component: the buffers and item lengths of each pool's
    ``get_request_state_buf_infos`` (equal item lengths on both sides: mooncake's stride check), each side's
    ``request_state_transfer_indices`` for its own slot, grouped by ``group_concurrent_contiguous`` and copied
    item by item (``_send_kvcache_generic``'s flat layout). The decode side first runs
    ``clear_request_scoped_state`` (``decode.py``). Returns the bytes copied."""
    dst_pool.clear_request_scoped_state(dst_slot)
    src_ptrs, src_lens, src_items = src_pool.get_request_state_buf_infos()
    dst_ptrs, dst_lens, dst_items = dst_pool.get_request_state_buf_infos()
    assert src_items == dst_items and len(src_ptrs) == len(dst_ptrs)
    src_idx = np.asarray(src_pool.request_state_transfer_indices(src_slot, seq_len), dtype=np.int32)
    dst_idx = np.asarray(dst_pool.request_state_transfer_indices(dst_slot, seq_len), dtype=np.int32)
    assert len(src_idx) == len(dst_idx)
    moved = 0
    for sp, dp, sl, dl, item in zip(src_ptrs, dst_ptrs, src_lens, dst_lens, src_items):
        for sg_, dg in zip(*common_utils.group_concurrent_contiguous(src_idx, dst_idx)):
            n = item * len(sg_)
            assert (sg_[0] * item + n <= sl) and (dg[0] * item + n <= dl)
            ctypes.memmove(dp + dg[0] * item, sp + sg_[0] * item, n)
            moved += n
    return moved


@pytest.mark.parametrize("draft_tokens", [1, 3], ids=["decode", "eagle"])
def test_pd_moves_the_banks_mid_group_and_the_request_continues(clean, monkeypatch, draft_tokens):
    """PD disaggregation: a request prefilled in one SGLang pool (slot 1) to 254 positions (group 1 open, 126
    rows in the bank) moves to another pool (slot 3): its pages, C4 state (by SWA page) and token table copied as
    SGLang's page transfers would, its banks only through SGLang's own request-state transfer (one bank, 6 KiB
    per layer, ``request_state_transfer_indices`` of each side; the decode pool's slot NaN-cleared first). The
    decode pool then continues it (decode steps, or an EAGLE verify of 3 rows) across position 255: the entry
    of group 1, pooled from the moved bank, against float64; a missing or misplaced bank turns it into NaN."""
    _stand_ins(monkeypatch)
    sg.install(hca="online", projection="engine", check_environment=False)
    try:
        p = _pd_world(monkeypatch, draft_tokens)
        d = _pd_world(monkeypatch, draft_tokens)
        # the prefill node
        published = _Published(p.server_args)
        try:
            p.step([(1, 0, 254)], "prefill")
            p.check("prefill node")
        finally:
            published.restore()
        # the page transfers (KV pages and page-scoped C4 state; the same pages on both nodes), the token table
        src, dst, length = 1, 3, 254
        for a, b in zip(p.layers, d.layers):
            if a.name != "hca":
                b.state.copy_(a.state)
            b.memory.copy_(a.memory)
            b.model.apply(dst, 0, a.model.rows[src])
            b.written |= a.written
            if a.name != "hca":  # C4 state rows by SWA page: the same rows on both nodes
                b.addressed |= a.addressed
        d.pages[dst] = list(p.pages[src])
        d.free_pages = [q for q in d.free_pages if q not in d.pages[dst]]
        d.req_to_token[dst] = p.req_to_token[src]
        d.lengths[dst] = length
        d.used_slots.add(dst)
        hca = d.layers[0]
        b = sg.bank_count(draft_tokens)
        moved = _transfer(p.pool, d.pool, src, dst, length)
        assert moved == 3 * 512 * 4  # one bank of one HCA layer
        banks_p = sg.banks_view(p.layers[0].state, b, 512)
        banks_d = sg.banks_view(hca.state, b, 512)
        assert torch.equal(banks_d[dst, length % b].view(torch.int32), banks_p[src, length % b].view(torch.int32))
        others = [k for k in range(b) if k != length % b]
        assert torch.isnan(banks_d[dst, others]).all()  # cleared by clear_request_scoped_state, not moved
        # the decode node continues it across the group's end (position 255)
        published = _Published(d.server_args)
        try:
            if draft_tokens > 1:
                d.verify_and_clean([dst], 2, bs=2)  # from 254: at least 256 after two
            else:
                for k in range(2):
                    d.step([(dst, d.lengths[dst], 1)], "decode", bs=2)
                    d.check(f"decode node {k}")
        finally:
            published.restore()
        groups = hca.model.length(dst) // 128
        assert groups == 2, groups  # group 1 closed on the decode node, from the moved bank
    finally:
        sg.uninstall()


def test_banks_between_nodes_with_other_bank_counts(clean, monkeypatch):
    """A prefill node without speculation keeps 2 banks per request, a decode node with EAGLE (E = 3) 4: SGLang's
    transfer pairs the item each side names for the same length (bank ``L % 2`` there, ``L % 4`` here), of the
    same length on both sides (one bank, 6 KiB), and nothing at a group boundary."""
    _stand_ins(monkeypatch)
    sg.install(hca="online", projection="engine", check_environment=False)
    try:
        p, d = _pd_world(monkeypatch, 1), _pd_world(monkeypatch, 3)
        bp, bd = (
            sg.pool_banks(p.pool.get_attention_compress_states(0)),
            sg.pool_banks(d.pool.get_attention_compress_states(0)),
        )
        assert (bp, bd) == (2, 4)
        src = sg.banks_view(p.layers[0].state, bp, 512)
        src.copy_(torch.randn(src.shape, generator=torch.Generator().manual_seed(5)))
        for length in (129, 130, 131, 254, 383):
            assert _transfer(p.pool, d.pool, 2, 1, length) == 6144
            dst = sg.banks_view(d.layers[0].state, bd, 512)
            assert torch.equal(dst[1, length % bd], src[2, length % bp]), length
        assert _transfer(p.pool, d.pool, 2, 1, 256) == 0  # a group boundary: nothing pends
        assert list(p.pool.request_state_transfer_indices(2, 256)) == []
    finally:
        sg.uninstall()


# ---------------------------------------------------------------------------------------------------------------
# The switch, the refusals that remain, the gain in SGLang's own accounting
# ---------------------------------------------------------------------------------------------------------------
pc_mod = importlib.import_module("sglang.srt.model_executor.pool_configurator")


def test_switch_patches_the_pool_and_its_sizing_and_uninstall_restores(clean, monkeypatch):
    """``DSV4C_SGLANG=online`` (the ``sglang.srt.plugins`` entry point) installs ``hca="online"``: SGLang's ring
    resolution, in the pool module and where the configurator imported it by name, gives the bank rows for C128
    only; the pool's factory, PD buffers and indices, clears and the configurator's ring check are wrapped;
    ``uninstall()`` puts SGLang's own back everywhere."""
    kvpool, dsv4 = pool_mod.DeepSeekV4TokenToKVPool, pc_mod.DSV4PoolConfigurator
    names = ("_make_compress_state_pool", "get_request_state_buf_infos", "request_state_transfer_indices",
             "clear_request_scoped_state", "clear_unaccepted_c128_draft_states")  # fmt: skip
    before = {n: kvpool.__dict__[n] for n in names}
    check, resolve = dsv4.__dict__["_assert_ring_serves_draft_tokens"], pool_mod.resolve_compress_state_ring_size
    assert pc_mod.resolve_compress_state_ring_size is resolve
    monkeypatch.setenv(sg.PLUGIN_ENV, "online")
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    sg.register()
    assert sg.installed() and sg._installed["options"]["hca"] == "online"
    assert pool_mod.resolve_compress_state_ring_size is pc_mod.resolve_compress_state_ring_size is not resolve
    assert all(kvpool.__dict__[n] is not before[n] for n in names)
    assert dsv4.__dict__["_assert_ring_serves_draft_tokens"] is not check
    published = _Published(_args(3))
    try:
        assert (
            pool_mod.resolve_compress_state_ring_size(128) == 6 and pool_mod.resolve_compress_state_ring_size(4) == 16
        )
        assert resolve(128) == 256
    finally:
        published.restore()
    sg.uninstall()
    assert pool_mod.resolve_compress_state_ring_size is pc_mod.resolve_compress_state_ring_size is resolve
    assert all(kvpool.__dict__[n] is before[n] for n in names)
    assert dsv4.__dict__["_assert_ring_serves_draft_tokens"] is check
    sg.install(check_environment=False)  # the ring: none of it
    assert pool_mod.resolve_compress_state_ring_size is resolve and kvpool.__dict__[names[0]] is before[names[0]]


def test_refusals_that_remain_are_stated_at_install_and_backend_build(clean, monkeypatch):
    """SGLang's own online C128 (``SGLANG_OPT_USE_ONLINE_COMPRESS``: its commit step and bank-0-only transfer) is
    refused at install; a backend whose pool was built without banks (before ``install(hca="online")``) is
    refused when the backend is built, with the layer and the reason, not at its first forward."""
    _stand_ins(monkeypatch)
    monkeypatch.setattr(tes.cv2, "_use_online_compress", lambda ratio: ratio == 128)
    with pytest.raises(sg.SGLangModeNotSupported, match="SGLANG_OPT_USE_ONLINE_COMPRESS"):
        sg.install(hca="online", check_environment=False)
    assert not sg.installed()
    monkeypatch.undo()
    _stand_ins(monkeypatch)
    args = _args(1)
    published = _Published(args)
    try:
        sg.install(projection="engine", check_environment=False)  # the ring: the pool gets SGLang's ring
        w = OnlineWorld(monkeypatch, args)
        sg.uninstall()
        sg.install(hca="online", projection="engine", check_environment=False)
        with pytest.raises(sg.SGLangModeNotSupported, match="layer 0's C128 state pool holds SGLang's ring"):
            backend_mod.DeepseekV4AttnBackend(w.runner)  # the same runner, its pool built under the ring
        backend = backend_mod.DeepseekV4AttnBackend(OnlineWorld(monkeypatch, args).runner)  # a pool built now
        assert backend.__dict__[sg._ADAPTER_ATTR].require_pool_banks
    finally:
        sg.uninstall()
        published.restore()


def test_the_gain_in_sglang_s_own_pool_configurator(clean):
    """SGLang's ``DSV4PoolConfigurator`` (real code) for V4-Flash at its defaults and with EAGLE, ring against
    online (:mod:`dsv4_compressor.integrations.sglang.capacity`): the C128 fixed bytes are SGLang's formula over
    the bank rows (3 per slot, 6 with EAGLE; its ring check passes), every byte freed becomes KV tokens at
    SGLang's bytes per token, and the C128 pool SGLang finalizes is the bank rows of every request slot."""
    from dsv4_compressor.integrations.sglang import capacity

    budget = 80 << 30
    for speculative, rows in ((False, 3), (True, 6)):
        ring = capacity.pool_capacity("DeepSeek-V4-Flash", hca="ring", speculative=speculative, available_bytes=budget)
        online = capacity.pool_capacity("DeepSeek-V4-Flash", hca="online", speculative=speculative,
                                        available_bytes=budget)  # fmt: skip
        assert ring["ring_rows"] == (256 if speculative else 128) and online["ring_rows"] == rows
        slots = 257  # 256 running requests + 1
        for r in (ring, online):
            state_rows = -(-(slots * r["ring_rows"] + r["ring_rows"] + 1) // 128) * 128
            assert r["c128_state_bytes"] == state_rows * 1024 * 4 * 20  # 20 HCA layers, 2H float32 rows
            assert r["c128_state_pool_rows"] == slots * r["ring_rows"]
        assert ring["adapter_bytes"] == online["adapter_bytes"] and ring["bytes_per_token"] == online["bytes_per_token"]
        freed = ring["c128_state_bytes"] - online["c128_state_bytes"]
        gained = online["tokens"] - ring["tokens"]
        assert abs(gained - freed / ring["bytes_per_token"]) <= 256, (gained, freed)
        print(f"V4-Flash speculative={speculative}: {freed / (1 << 30):.3f} GiB freed, {gained:,} more KV tokens")
