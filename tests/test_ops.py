"""The ops on engine-shaped buffers, against the float64 reference (CPU, Triton interpreter).

An :class:`EngineLayer` is one compressor layer as an engine holds it: its own state and pages, per-step
metadata built the engine's way (int32 or int64, padding rows with the engine's padding value, ``0`` or ``-1``
in ``out_slot`` off group boundaries), cos / sin as strided views of a complex table or of a ``cos_sin``
cache, a bf16 norm weight, a 2-D (LightLLM) or 3-D state, pages wider than a page. It drives ``build_plan``
then ``compress`` / ``compress_online_hca`` through prefill chunks, mixed batches and MTP verify steps with
rewinds, and after every step checks every stored entry against the one-shot float64 reference, every state
row the next step may read, and that no byte outside the written slots changed. ``ops.compress_pair`` on two of
them (a CSA layer's main compressor and its indexer) is tested in ``tests/test_ops_pair.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_params, random_rows
from helpers.model import StreamModel

from dsv4_compressor import ops, reference
from dsv4_compressor.errors import OpError
from dsv4_compressor.layout import indexer_fp8_page_layout, latent_page_layout
from dsv4_compressor.verify import check_indexer_keys, check_indexer_pack, check_latent_records

POISON = 0xA5
POISON_F32 = 0x7FC0A5A5  # a NaN: a kernel that reads state it should not turns its entry into NaN

#: Engine conventions, from docs/INTEGRATION.md ("What the engines call and hold").
STYLES = {
    # LightLLM: int64 positions, int32 request slots, HOLD padding = num_slots, out_slot gathered (0 elsewhere),
    # cos / sin = .real / .imag of a complex64 table, bf16 norm weight, 2-D HCA state [(slots + 1) * ring + 1, 2W]
    "lightllm": dict(pos=torch.int64, req=torch.int32, out=torch.int64, pad="num_slots", off=0, rope="complex",
                     norm=torch.bfloat16, state2d=True, page_pad=0, ape="flat"),
    # SGLang: int64 everywhere, 0 off boundary, view_as_real(freqs)[..., 0/1], reordered CSA APE (strided view)
    "sglang": dict(pos=torch.int64, req=torch.int64, out=torch.int64, pad=-1, off=0, rope="complex",
                   norm=torch.float32, state2d=False, page_pad=0, ape="permuted"),
    # vLLM: int32 token_to_req_indices, -1 off boundary, cos_sin_cache[:, :32] / [:, 32:], padded page stride
    "vllm": dict(pos=torch.int64, req=torch.int32, out=torch.int64, pad=-1, off=-1, rope="cos_sin",
                 norm=torch.float32, state2d=False, page_pad=64, ape="view"),
}  # fmt: skip

#: (op variant, config): ``hca_tiled`` passes a scratch, ``hca_single`` none, ``online`` the online op
#: (``online_split`` with a scratch: steps that are not decode split each group's channels).
VARIANTS = {
    "hca_tiled": HCA_SMALL,
    "hca_single": HCA_SMALL,
    "online": HCA_SMALL,
    "online_split": HCA_SMALL,
    "csa": CSA_SMALL,
    "indexer": INDEXER_CFG,
}


def _rope_views(cos: torch.Tensor, sin: torch.Tensor, how: str):
    """cos / sin as the engines hold them: strided views into one table."""
    if how == "complex":
        table = torch.complex(cos, sin)  # complex64 [P, R/2]
        return table.real, table.imag
    cache = torch.cat([cos, sin], dim=1)  # vLLM's cos_sin_cache [P, R]
    half = cos.shape[1]
    return cache[:, :half], cache[:, half:]


def _ape_view(ape: torch.Tensor, cfg, how: str):
    coff = 2 if cfg.overlap else 1
    if how == "flat":
        return ape
    if how == "view":
        return ape.view(cfg.ratio, coff, cfg.head_dim)
    # SGLang reorders the CSA APE's memory to [coff, r, H] at load time and passes a permuted view
    memory = ape.view(cfg.ratio, coff, cfg.head_dim).permute(1, 0, 2).contiguous()
    return memory.permute(1, 0, 2)


class EngineLayer:
    """One compressor layer's engine-owned buffers and its step metadata (see the module docstring)."""

    def __init__(
        self,
        variant: str,
        style: str,
        *,
        num_slots: int = 4,
        mtp: int = 2,
        seed: int = 0,
        mode: str = "ring",
        has_ape: bool = True,
        pack: str = "hadamard",
        keys: bool = True,
        ring: int | None = None,
    ):
        """``mode``: ``ring`` (in-kernel ``req_ring``), or per-step tables from ``build_state_rows``:
        ``ring_tables`` (``req_ring``), ``token_map`` (state by SWA page, LightLLM / SGLang C4), ``block_table``
        (vLLM, a padded 3-D state). ``has_ape``: state rows hold ``score + ape`` (else SGLang's bare score).
        ``pack`` / ``keys``: the indexer's FP8 pack variant and whether bf16 keys are stored too. ``ring``: ring
        rows per slot (default ``config.ring_rows(mtp)``)."""
        self.variant, self.style = variant, STYLES[style]
        self.mode, self.has_ape, self.pack = mode, has_ape, pack
        self.cfg = cfg = VARIANTS[variant]
        st = self.style
        self.params = make_params(cfg, seed=seed, max_positions=256, norm_dtype=st["norm"])
        self.cos, self.sin = _rope_views(self.params.cos, self.params.sin, st["rope"])
        self.ape = _ape_view(self.params.ape, cfg, st["ape"])
        self.num_slots, self.mtp = num_slots, mtp
        self.kind = "indexer" if cfg.output == "indexer" else ("csa" if cfg.overlap else "hca")
        self.ring = cfg.ring_rows(mtp) if ring is None else ring
        self.page_size = cfg.default_page_size
        self.num_pages = 3 * num_slots
        self.max_seq = 256
        if variant.startswith("online"):
            self.state = torch.zeros(num_slots, mtp + 1, 3, cfg.head_dim).view(torch.int32).fill_(POISON_F32)
            self.state = self.state.view(torch.float32)
        elif mode == "token_map":
            # the engine's SWA pages: PAGE positions each, a ring of ring rows per page
            self.swa_page = 16
            pages = num_slots * self.max_seq // self.swa_page
            self.state = self._poisoned_f32(pages * self.ring, cfg.row_width)
            rng = np.random.default_rng(seed + 1)
            swa_pages = rng.permutation(pages).reshape(num_slots, -1)
            positions = np.arange(self.max_seq)
            self.req_to_token = torch.tensor(
                np.arange(num_slots)[:, None] * self.max_seq + positions[None, :], dtype=torch.int32
            )  # a token id per (slot, position)
            swa = swa_pages[:, positions // self.swa_page] * self.swa_page + positions % self.swa_page
            self.token_to_state = torch.tensor(swa.reshape(-1), dtype=torch.int64)
        elif mode == "block_table":
            self.block = 4 if cfg.overlap else 8
            blocks = num_slots * self.max_seq // self.block
            padded = self._poisoned_f32(blocks, self.block * cfg.row_width + 48)  # vLLM pads blocks
            self.state = padded[:, : self.block * cfg.row_width].view(blocks, self.block, cfg.row_width)
            rng = np.random.default_rng(seed + 2)
            self.block_table = torch.tensor(rng.permutation(blocks).reshape(num_slots, -1), dtype=torch.int32)
        elif st["state2d"]:
            self.state = self._poisoned_f32((num_slots + 1) * self.ring + 1, cfg.row_width)
        else:
            self.state = self._poisoned_f32(num_slots, self.ring, cfg.row_width)
        if cfg.output == "latent":
            self.layout = latent_page_layout(cfg, self.page_size)
        else:
            self.layout = indexer_fp8_page_layout(cfg, self.page_size)
        bpp = self.layout.bytes_per_page
        self.page_memory = torch.full((self.num_pages, bpp + st["page_pad"]), POISON, dtype=torch.uint8)
        self.pages = self.page_memory[:, :bpp]
        self.keys = None
        if cfg.output == "indexer":
            self.keys = torch.full((self.num_pages * self.page_size, 2 * cfg.head_dim), POISON, dtype=torch.uint8)
            self.keys = self.keys.view(torch.bfloat16) if keys else None
        # poisoned: a kernel reads back only what it wrote
        self.scratch = self._poisoned_f32(128, cfg.head_dim) if variant in ("hca_tiled", "online_split") else None
        self.model = StreamModel(cfg, self.params)
        rng = np.random.default_rng(seed)
        self.page_of = rng.permutation(self.num_pages).reshape(num_slots, -1)  # request slot, page index -> page
        self.written: set[int] = set()
        self.first_group: dict[int, int] = {}  # a slot's entries before this group belong to another request

    @staticmethod
    def _poisoned_f32(*shape):
        return torch.full(shape, POISON_F32, dtype=torch.int32).view(torch.float32)

    def out_slot_of(self, slot: int, group: int) -> int:
        return int(self.page_of[slot, group // self.page_size]) * self.page_size + group % self.page_size

    def step(self, items, *, pad_front: int = 0, pad_back: int = 1, decode: bool | None = None, kv_extra: int = 0,
             edit_call=None):  # fmt: skip
        """``items = [(slot, start, rows), ...]``: build the engine metadata, plan, compress, update the model.
        ``kv_extra``: random rows after the step's in the ``kv_score`` buffer (an engine's padded buffer);
        ``edit_call(fn, args, kwargs) -> (fn, args, kwargs)`` changes the op call before it is made (the model
        is updated only if the call returns)."""
        st, cfg, r = self.style, self.cfg, self.cfg.ratio
        pad = self.num_slots if st["pad"] == "num_slots" else -1
        positions, row_req, out_slot, chunks = [], [], [], []
        filler = random_rows(pad_front + pad_back, cfg, torch.Generator().manual_seed(99))

        def padding(n, i0):
            positions.extend([7] * n)
            row_req.extend([pad] * n)
            out_slot.extend([3] * n)  # an engine's garbage: padding rows must not write it
            chunks.append(filler[i0 : i0 + n])

        padding(pad_front, 0)
        for slot, start, rows in items:
            for p in range(start, start + rows.shape[0]):
                positions.append(p)
                row_req.append(slot)
                out_slot.append(self.out_slot_of(slot, p // r) if p % r == r - 1 else st["off"])
                if p % r == r - 1:
                    self.written.add(self.out_slot_of(slot, p // r))
            chunks.append(rows)
        padding(pad_back, pad_front)
        chunks.append(random_rows(kv_extra, cfg, torch.Generator().manual_seed(98)))
        kv_score = torch.cat(chunks).contiguous()
        before = kv_score.clone()
        t = len(positions)
        plan = ops.empty_plan(t, len(items) + 1, r, "cpu")
        ops.build_plan(
            plan, torch.tensor(positions, dtype=st["pos"]), torch.tensor(row_req, dtype=st["req"]),
            torch.tensor(out_slot, dtype=st["out"]), ratio=r, num_slots=self.num_slots, mtp_step=self.mtp,
        )  # fmt: skip
        if decode is None:
            decode = all(rows.shape[0] <= self.mtp + 1 for _, _, rows in items)
        online = self.variant.startswith("online")
        tables = self._state_rows(plan, t) if self.mode != "ring" and not online else {}
        p = self.params
        args = (kv_score, plan, self.ape, p.norm_weight, self.cos, self.sin, self.state, self.pages)
        kwargs = dict(page_size=self.page_size, eps=p.eps, decode=decode, scratch=self.scratch)
        if online:
            fn = ops.compress_online_hca
        else:
            fn = ops.compress
            kwargs.update(
                kind=self.kind, out_keys=self.keys, ring=self.ring if st["state2d"] and self.mode == "ring" else None,
                state_has_ape=self.has_ape, indexer_pack=self.pack, **tables,
            )  # fmt: skip
        if edit_call is not None:
            fn, args, kwargs = edit_call(fn, args, kwargs)
        fn(*args, **kwargs)
        assert torch.equal(kv_score.view(torch.int32), before.view(torch.int32)), "kv_score was written"
        for slot, start, rows in items:
            self.model.apply(slot, start, rows)

    def _state_rows(self, plan, rows: int) -> dict:
        """The step's read / save tables, built by ``build_state_rows`` the engine's way (poisoned first)."""
        window = self.cfg.window
        read_rows = torch.full((plan.shape[0], window - 1), -7, dtype=torch.int64)
        save_rows = torch.full((rows + 3,), -7, dtype=torch.int32)  # a capacity: more than the step's rows
        if self.mode == "ring_tables":
            ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=self.ring)
        elif self.mode == "token_map":
            ops.build_state_rows(
                plan, read_rows, save_rows, mode="token_map_ring", ring=self.ring, req_to_token=self.req_to_token,
                token_to_state=self.token_to_state, state_page=self.swa_page, page_tail=self.ring,
            )  # fmt: skip
        else:
            ops.build_state_rows(
                plan, read_rows, save_rows, mode="block_table", block_table=self.block_table, block_size=self.block
            )
        assert (save_rows[rows:] == -7).all(), "save_rows written past the step's rows"
        return dict(read_rows=read_rows, save_rows=save_rows)

    def state_row(self, slot: int, q: torch.Tensor) -> torch.Tensor:
        """The state rows of positions ``q`` of ``slot``, ``[len(q), 2W]``, wherever the mode keeps them."""
        cfg = self.cfg
        if self.mode in ("ring", "ring_tables"):
            return self.state.reshape(-1, cfg.row_width)[slot * self.ring + q % self.ring]
        if self.mode == "token_map":
            m = self.token_to_state[self.req_to_token[slot, q].long()]
            return self.state[(m // self.swa_page) * self.ring + m % self.ring]
        return self.state[self.block_table[slot, q // self.block].long(), q % self.block]

    # -- checks ---------------------------------------------------------------------------------------
    def check(self, what: str) -> None:
        cfg = self.cfg
        for slot in self.model.live():
            groups = self.model.length(slot) // cfg.ratio
            if groups == 0:
                continue
            g0 = self.first_group.get(slot, 0)
            want = self.model.expected(slot)[g0:]
            slots = torch.tensor([self.out_slot_of(slot, g) for g in range(g0, groups)])
            if cfg.output == "latent":
                rep = check_latent_records(self.layout.read(self.pages, slots), want, cfg)
            else:
                keys = None
                if self.keys is not None:
                    keys = self.keys[slots]
                    rep = check_indexer_keys(keys.float(), want)
                    assert rep.ok, f"{what}: slot {slot}: {rep}"
                rep = check_indexer_pack(self.layout.read(self.pages, slots), want, self.pack, keys=keys)
            assert rep.ok, f"{what}: slot {slot}: {rep}"
        self._check_untouched(what)
        if not self.variant.startswith("online"):
            self._check_state(what)

    def _check_untouched(self, what: str) -> None:
        """Every byte outside the written slots' records (padding columns of the pages included) still holds
        the poison."""
        keep = torch.zeros_like(self.page_memory, dtype=torch.bool)
        flat = keep.view(-1)
        stride = self.page_memory.shape[1]
        written = torch.tensor(sorted(self.written), dtype=torch.int64)
        if len(written):
            idx = self.layout._byte_index(written)
            page, off = idx // self.layout.bytes_per_page, idx % self.layout.bytes_per_page
            flat[(page * stride + off).reshape(-1)] = True
        stray = (self.page_memory != POISON) & ~keep
        assert not stray.any(), f"{what}: {int(stray.sum())} page bytes written outside the closed entries' slots"
        if self.keys is not None:
            rows = torch.ones(self.keys.shape[0], dtype=torch.bool)
            rows[written] = False
            assert (self.keys[rows].view(torch.uint8) == POISON).all(), f"{what}: indexer keys written elsewhere"

    def _check_state(self, what: str) -> None:
        """The state rows of every position a next step may read (continuing at L, or rewinding by up to
        mtp_step) hold ``[kv | score + ape]`` bit for bit."""
        cfg, r = self.cfg, self.cfg.ratio
        for slot in self.model.live():
            length = self.model.length(slot)
            low = max(0, length - self.mtp)
            lo = max(0, (low // r - (1 if cfg.overlap else 0)) * r)
            if lo >= length:
                continue
            rows = self.model.rows[slot][lo:length]
            positions = torch.arange(lo, length)
            want = reference.gated_rows(rows, positions, self.params.ape, cfg.width) if self.has_ape else rows
            got = self.state_row(slot, positions)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{what}: slot {slot} state rows"


def _schedule(layer: EngineLayer, gen: torch.Generator, rng: np.random.Generator):
    """Prefill chunks (a chunk spanning several groups, a chunk ending mid-group), a mixed batch, then MTP
    verify steps of ``mtp + 1`` rows with random acceptance (most steps rewind), one slot re-begun."""
    cfg, r, s = layer.cfg, layer.cfg.ratio, layer.mtp + 1

    def rows(n):
        return random_rows(n, cfg, gen)

    yield [(0, 0, rows(2 * r + 3)), (2, 0, rows(r - 1))], {}
    yield [(2, r - 1, rows(r + 2)), (1, 0, rows(3)), (0, 2 * r + 3, rows(1))], dict(pad_front=2)
    lengths = {0: 2 * r + 4, 1: 3, 2: 2 * r + 1}
    for i in range(6):
        items = []
        for slot in (0, 1, 2):
            accepted = int(rng.integers(0, s))  # of the previous step's drafts
            start = lengths[slot] if i == 0 else max(0, lengths[slot] - (s - 1 - accepted))
            items.append((slot, start, rows(s)))
            lengths[slot] = start + s
        yield items, dict(pad_back=int(rng.integers(0, 3)))
    yield [(1, 0, rows(r + 1)), (0, lengths[0] - 1, rows(2))], {}  # slot 1 begins again


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_ops_engine_shaped_streaming(variant, style):
    seed = sorted(VARIANTS).index(variant) * 10 + sorted(STYLES).index(style)
    layer = EngineLayer(variant, style, seed=seed)
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    for k, (items, kwargs) in enumerate(_schedule(layer, gen, rng)):
        layer.step(items, **kwargs)
        layer.check(f"{variant}/{style} step {k}")


@pytest.mark.parametrize(
    "variant, style, options",
    [
        ("csa", "lightllm", dict(mode="ring_tables")),
        ("hca_tiled", "lightllm", dict(mode="ring_tables")),
        ("csa", "lightllm", dict(mode="token_map")),
        ("indexer", "sglang", dict(mode="token_map", has_ape=False, pack="hadamard_f32", keys=False)),
        ("csa", "sglang", dict(has_ape=False)),
        ("hca_single", "sglang", dict(has_ape=False)),
        ("csa", "vllm", dict(mode="block_table")),
        ("hca_tiled", "vllm", dict(mode="block_table")),
        ("indexer", "vllm", dict(mode="block_table", pack="pow2", keys=False)),
        ("indexer", "lightllm", dict(pack="hadamard_bf16", keys=False)),
        ("indexer", "vllm", dict(pack="pow2")),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v),
)
def test_engine_state_modes_and_packs(variant, style, options):
    """Every state addressing mode, APE-less state rows and every indexer pack, through the same streaming
    schedule: entries, the state rows a next step reads, and the untouched bytes all checked."""
    seed = 31 + len(str(options))
    layer = EngineLayer(variant, style, seed=seed, **options)
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    for k, (items, kwargs) in enumerate(_schedule(layer, gen, rng)):
        layer.step(items, **kwargs)
        layer.check(f"{variant}/{style}/{options} step {k}")


@pytest.mark.parametrize("variant", ["csa", "indexer"])
def test_decode_row_the_tables_do_not_save_is_not_written(variant):
    """A decode row whose ``save_rows`` entry is ``-1`` (LightLLM: its token has no SWA slot) is saved nowhere,
    though the kernel requests its values with the other rows' (table mode, ``ring.load_saved_row``); every other
    row is saved where its entry says, and no other state byte changes."""
    cfg = VARIANTS[variant]
    p = make_params(cfg, seed=5)
    gen = torch.Generator().manual_seed(5)
    ring, rows = 11, 4  # two requests of two decode rows each
    state = torch.full((6 * ring, cfg.row_width), 0.0).view(torch.int32).fill_(POISON_F32).view(torch.float32)
    positions = torch.tensor([9, 10, 21, 22])
    row_req = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    plan = ops.empty_plan(rows, 2, cfg.ratio, "cpu")
    ops.build_plan(plan, positions, row_req, torch.arange(rows), ratio=cfg.ratio, num_slots=2, mtp_step=1)
    read_rows = torch.full((2, cfg.window - 1), -7, dtype=torch.int64)
    save_rows = torch.full((rows,), -7, dtype=torch.int64)
    ops.build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=ring)
    want_rows = save_rows.clone()
    save_rows[2] = -1  # request 1's first row: not held by the engine
    kv = random_rows(rows, cfg, gen)
    before = state.clone()
    pages = torch.full((8, cfg.default_page_size * 600), POISON, dtype=torch.uint8)
    kwargs = dict(kind=variant, page_size=cfg.default_page_size, decode=True, read_rows=read_rows,
                  save_rows=save_rows)  # fmt: skip
    ops.compress(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages, **kwargs)
    gated = reference.gated_rows(kv, positions, p.ape, cfg.width)
    changed = (state.view(torch.int32) != before.view(torch.int32)).any(dim=1).nonzero().flatten().tolist()
    saved = [int(want_rows[t]) for t in (0, 1, 3)]
    assert sorted(changed) == sorted(saved), (changed, saved)
    for t in (0, 1, 3):
        assert torch.equal(state[want_rows[t]].view(torch.int32), gated[t].view(torch.int32)), f"row {t}"


def test_token_map_prefix_reuse_at_a_state_page_boundary():
    """Request 1 shares request 0's first two SWA pages (LightLLM / SGLang radix reuse) and starts at the page
    boundary: its first windows read request 0's saved page-tail rows through the token map."""
    layer = EngineLayer("csa", "lightllm", mode="token_map", seed=5)
    gen = torch.Generator().manual_seed(5)
    boundary = 2 * layer.swa_page
    layer.step([(0, 0, random_rows(boundary + 9, layer.cfg, gen))])
    layer.req_to_token[1, :boundary] = layer.req_to_token[0, :boundary]  # the shared prefix
    shared = layer.model.rows[0][:boundary]
    rows = random_rows(11, layer.cfg, gen)
    layer.model.apply(1, 0, shared)  # the model holds the shared prefix; the step supplies the rest
    layer.first_group[1] = boundary // layer.cfg.ratio  # the prefix's entries are request 0's
    layer.step([(1, boundary, rows)])
    layer.check("after reuse")
    groups = layer.model.length(1) // layer.cfg.ratio
    assert groups > boundary // layer.cfg.ratio  # entries past the boundary were computed and checked


def test_decode_flag_on_a_prefill_plan_is_caught_by_check_plan():
    """Engines promise ``decode`` statically; ``check_plan(decode=True)`` catches a step that breaks it."""
    layer = EngineLayer("csa", "vllm")
    positions = torch.arange(0, 9)
    plan = ops.empty_plan(9, 1, 4, "cpu")
    ops.build_plan(plan, positions, torch.zeros(9, dtype=torch.int64), positions, ratio=4, num_slots=4)
    err = torch.zeros(4, dtype=torch.int32)
    ops.check_plan(plan, None, err, mtp_step=layer.mtp, decode=True)
    assert "9 rows" in ops.plan_error(err)


# ---------------------------------------------------------------------------------------------------------------
# Validation: bad arguments are refused before anything is written
# ---------------------------------------------------------------------------------------------------------------
def _bad_compress_args(layer: EngineLayer, kv, plan):
    p, cfg = layer.params, layer.cfg
    base = dict(
        kv_score=kv, plan=plan, ape=layer.ape, norm_weight=p.norm_weight, cos=layer.cos, sin=layer.sin,
        state=layer.state, out_pages=layer.pages, kind=layer.kind, page_size=layer.page_size, out_keys=layer.keys,
    )  # fmt: skip
    yield "kind", dict(base, kind="mla"), ["kind", "'mla'"]
    yield "kv dtype", dict(base, kv_score=kv.double()), ["kv_score", "float64"]
    yield "kv width", dict(base, kv_score=kv[:, :-2]), ["kv_score", f"{cfg.row_width}"]
    yield "ape shape", dict(base, ape=p.ape[:, :-1]), ["ape"]
    yield "norm dtype", dict(base, norm_weight=p.norm_weight.half()), ["norm_weight", "float16"]
    yield "cos vs sin", dict(base, sin=layer.sin[:-1]), ["cos and sin"]
    yield "state width", dict(base, state=layer.state[..., :-4]), ["state rows"]
    yield "state dtype", dict(base, state=layer.state.double()), ["state", "float64"]
    yield "2-D state without ring", dict(base, state=layer.state.reshape(-1, cfg.row_width)), ["ring="]
    yield "ring too small", dict(base, state=layer.state.reshape(-1, cfg.row_width), ring=2), ["ring=2"]
    yield "page too small", dict(base, out_pages=layer.pages[:, :100]), ["out_pages", "100"]
    yield "pages dtype", dict(base, out_pages=layer.pages.view(torch.int8)), ["out_pages", "int8"]
    yield "page_size", dict(base, page_size=0), ["page_size"]
    yield "eps", dict(base, eps=2.0), ["eps"]
    yield "a slice of a plan", dict(base, plan=plan[:, :3]), ["plan carries no build"]
    yield "plan dtype", dict(base, plan=plan.long()), ["plan"]
    yield "scratch for csa", dict(base, scratch=torch.zeros(64, cfg.head_dim)), ["scratch"]
    yield "device", dict(base, state=layer.state.to("meta")), ["state", "meta"]


def test_compress_refuses_bad_arguments_and_writes_nothing():
    layer = EngineLayer("csa", "vllm")
    gen = torch.Generator().manual_seed(3)
    kv = random_rows(9, layer.cfg, gen)
    plan = ops.empty_plan(9, 1, 4, "cpu")
    positions = torch.arange(9)
    ops.build_plan(plan, positions, torch.zeros(9, dtype=torch.int64), positions, ratio=4, num_slots=4)
    state0, pages0 = layer.state.clone(), layer.page_memory.clone()
    for name, kwargs, needles in _bad_compress_args(layer, kv, plan):
        with pytest.raises(OpError) as info:
            ops.compress(**kwargs)
        for needle in needles:
            assert needle in str(info.value), f"{name}: {needle!r} not in {info.value}"
        assert torch.equal(layer.state.view(torch.int32), state0.view(torch.int32)), name
        assert torch.equal(layer.page_memory, pages0), name


def test_online_refuses_bad_banks():
    layer = EngineLayer("online", "sglang")
    kv = random_rows(4, layer.cfg, torch.Generator().manual_seed(1))
    plan = ops.empty_plan(4, 1, layer.cfg.ratio, "cpu")
    positions = torch.arange(4)
    ops.build_plan(plan, positions, torch.zeros(4, dtype=torch.int64), positions, ratio=layer.cfg.ratio, num_slots=4)
    p = layer.params
    args = (kv, plan, layer.ape, p.norm_weight, layer.cos, layer.sin)
    with pytest.raises(OpError, match="state_banks"):
        ops.compress_online_hca(*args, layer.state[..., :-1], layer.pages, page_size=2)
    with pytest.raises(OpError, match="state_banks"):
        ops.compress_online_hca(*args, layer.state.transpose(0, 1), layer.pages, page_size=2)


def test_online_refuses_bad_scratch_and_writes_nothing():
    layer = EngineLayer("online_split", "vllm")
    cfg, p = layer.cfg, layer.params
    rows = random_rows(3 * cfg.ratio, cfg, torch.Generator().manual_seed(2))
    n, h = rows.shape[0], cfg.head_dim
    positions = torch.arange(n)
    plan = ops.empty_plan(n, 1, cfg.ratio, "cpu")
    out_slot = torch.where(positions % cfg.ratio == cfg.ratio - 1, positions // cfg.ratio, -1)
    ops.build_plan(plan, positions, torch.zeros(n, dtype=torch.int64), out_slot, ratio=cfg.ratio, num_slots=4)
    args = (rows, plan, layer.ape, p.norm_weight, layer.cos, layer.sin, layer.state, layer.pages)
    bad = {
        "too few rows": torch.zeros(n - 1, h),
        "width": torch.zeros(n, h + 32),
        "dtype": torch.zeros(n, h, dtype=torch.bfloat16),
        "row stride": torch.zeros(n, 2 * h)[:, :h],
        "1-D": torch.zeros(n * h),
    }
    banks0, pages0 = layer.state.clone(), layer.page_memory.clone()
    for name, scratch in bad.items():
        with pytest.raises(OpError, match="scratch"):
            ops.compress_online_hca(*args, page_size=2, scratch=scratch)
        assert torch.equal(layer.state.view(torch.int32), banks0.view(torch.int32)), name
        assert torch.equal(layer.page_memory, pages0), name


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plan = ops.empty_plan(4, 1, 4, "cpu")
    with pytest.raises(OpError, match="TRITON_INTERPRET=1"):
        idx = torch.zeros(4, dtype=torch.int64)
        ops.build_plan(plan, idx, idx, idx, ratio=4, num_slots=4)


# ---------------------------------------------------------------------------------------------------------------
# torch.library: schemas, fakes, torch.compile
# ---------------------------------------------------------------------------------------------------------------
def _op_inputs(variant: str, style: str = "vllm"):
    layer = EngineLayer(variant, style, seed=7)
    r = layer.cfg.ratio
    rows = random_rows(2 * r + 1, layer.cfg, torch.Generator().manual_seed(8))
    positions = torch.arange(rows.shape[0])
    row_req = torch.ones(rows.shape[0], dtype=torch.int64)
    out_slot = torch.where(positions % r == r - 1, positions // r + 4, -1)
    plan = ops.empty_plan(rows.shape[0], 2, r, "cpu")
    return layer, rows, positions, row_req, out_slot, plan


def test_opcheck_every_op():
    """Schemas, fakes and dispatch of every op. opcheck runs them through ``torch.ops.dsv4c`` on clones of
    their inputs; clones of a plan carry no build record, which the dispatched ops accept (``ops._built``)."""
    from torch.library import opcheck

    layer, rows, positions, row_req, out_slot, plan = _op_inputs("csa")
    p = layer.params
    opcheck(torch.ops.dsv4c.build_plan.default, (plan, positions, row_req, out_slot), dict(ratio=4, num_slots=4))
    slots = torch.arange(8, dtype=torch.int32).flip(0)[::2]  # a strided request-to-slot table: 6, 4, 2, 0
    opcheck(
        torch.ops.dsv4c.build_plan.default, (plan, positions, row_req.clamp(-1, 3), out_slot),
        dict(ratio=4, num_slots=8, req_state_slot=slots),
    )  # fmt: skip
    out_map = torch.arange(40, dtype=torch.int32).flip(0)[::2]  # a strided output-slot table: 39, 37, ..., 1
    opcheck(
        torch.ops.dsv4c.build_plan.default, (plan, positions, row_req, positions),
        dict(ratio=4, num_slots=4, out_slot_map=out_map),
    )  # fmt: skip
    # build_plans: two plans in one launch, with and without maps, and one plan alone
    c128 = ops.empty_plan(positions.shape[0], plan.shape[0], 128, "cpu")
    opcheck(
        torch.ops.dsv4c.build_plans.default, ([plan, c128], positions, row_req, [out_slot, positions]),
        dict(ratios=[4, 128], num_slots=4, out_slot_maps=[None, out_map]),
    )  # fmt: skip
    opcheck(
        torch.ops.dsv4c.build_plans.default, ([plan, c128], positions, row_req.clamp(-1, 3), [out_slot, out_slot]),
        dict(ratios=[4, 128], num_slots=8, req_state_slot=slots, mtp_step=2),
    )  # fmt: skip
    opcheck(torch.ops.dsv4c.build_plans.default, ([c128], positions, row_req, [out_slot]),
            dict(ratios=[128], num_slots=4))  # fmt: skip
    # ... and with the C4 plan's state-row tables (LightLLM's step build)
    opcheck(
        torch.ops.dsv4c.build_plans.default, ([plan, c128], positions, row_req, [out_slot, out_slot]),
        dict(ratios=[4, 128], num_slots=4, read_rows=torch.zeros(plan.shape[0], 7, dtype=torch.int64),
             save_rows=torch.zeros(positions.shape[0], dtype=torch.int32), state_mode="req_ring", ring=layer.ring),
    )  # fmt: skip
    ops.build_plan(plan, positions, row_req, out_slot, ratio=4, num_slots=4)
    state = layer.state.nan_to_num(0.0)  # opcheck compares outputs of repeated runs: no NaN poison here
    common = (rows, plan, layer.ape, p.norm_weight, layer.cos, layer.sin)
    opcheck(torch.ops.dsv4c.compress.default, (*common, state, layer.pages), dict(kind="csa", page_size=64))
    idx = EngineLayer("indexer", "vllm", seed=7)
    idx_rows = random_rows(rows.shape[0], idx.cfg, torch.Generator().manual_seed(9))
    pair_args = (*common, state, layer.pages, idx_rows, idx.ape, idx.params.norm_weight, idx.cos, idx.sin,
                 idx.state.nan_to_num(0.0), idx.pages)  # fmt: skip
    for decode in (False, True):
        opcheck(torch.ops.dsv4c.compress_pair.default, pair_args,
                dict(page_size=64, indexer_page_size=64, indexer_out_keys=idx.keys, decode=decode))  # fmt: skip
    err = torch.zeros(4, dtype=torch.int32)
    opcheck(torch.ops.dsv4c.check_plan.default, (plan, None, err), dict(mtp_step=2))
    hca, rows, positions, row_req, out_slot, plan = _op_inputs("online")
    ops.build_plan(plan, positions, row_req, out_slot, ratio=hca.cfg.ratio, num_slots=4)
    banks = torch.zeros(4, 3, 3, hca.cfg.head_dim)
    p = hca.params
    args = (rows, plan, hca.ape, p.norm_weight, hca.cos, hca.sin, banks, hca.pages)
    opcheck(torch.ops.dsv4c.compress_online_hca.default, args, dict(page_size=2))
    scratch = torch.zeros(rows.shape[0], hca.cfg.head_dim)
    opcheck(torch.ops.dsv4c.compress_online_hca.default, args, dict(page_size=2, scratch=scratch))
    args = (rows, plan, hca.ape, p.norm_weight, hca.cos, hca.sin, hca.state.new_zeros(4, hca.ring, 256), hca.pages)
    opcheck(torch.ops.dsv4c.compress.default, args, dict(kind="hca", page_size=2, scratch=scratch))


@pytest.mark.parametrize("pair", [False, True], ids=["two", "pair"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_plan_then_compress_matches_eager(backend, pair):
    """A layer stub (plan, then the main and the indexer compressor of a CSA layer: two ``compress`` calls, or
    one ``compress_pair``) under ``torch.compile(fullgraph=True)``: bytes equal eager, state and pages updated
    in place."""
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
    main, rows, positions, row_req, out_slot, plan = _op_inputs("csa")
    idx = EngineLayer("indexer", "vllm", seed=7)
    idx_rows = random_rows(rows.shape[0], idx.cfg, torch.Generator().manual_seed(9))
    for layer in (main, idx):
        layer.state.zero_()

    def layer_step(plan, positions, row_req, out_slot, rows, idx_rows, main_state, main_pages, idx_state, idx_pages,
                   idx_keys):  # fmt: skip
        torch.ops.dsv4c.build_plan(plan, positions, row_req, out_slot, ratio=4, num_slots=4)
        p, q = main.params, idx.params
        if pair:
            torch.ops.dsv4c.compress_pair(
                rows, plan, main.ape, p.norm_weight, main.cos, main.sin, main_state, main_pages, idx_rows, idx.ape,
                q.norm_weight, idx.cos, idx.sin, idx_state, idx_pages, page_size=64, indexer_page_size=64,
                indexer_out_keys=idx_keys,
            )  # fmt: skip
            return
        torch.ops.dsv4c.compress(
            rows, plan, main.ape, p.norm_weight, main.cos, main.sin, main_state, main_pages, kind="csa", page_size=64
        )
        torch.ops.dsv4c.compress(
            idx_rows, plan, idx.ape, q.norm_weight, idx.cos, idx.sin, idx_state, idx_pages, kind="indexer",
            page_size=64, out_keys=idx_keys,
        )  # fmt: skip

    buffers = [main.state, main.pages, idx.state, idx.pages, idx.keys]
    eager = [b.clone() for b in buffers]
    layer_step(plan.clone(), positions, row_req, out_slot, rows, idx_rows, *eager)
    compiled = torch.compile(layer_step, fullgraph=True, backend=backend)
    pointers = [b.data_ptr() for b in buffers]
    args = (plan, positions, row_req, out_slot, rows, idx_rows, *buffers)
    if backend == "inductor":
        from torch._inductor.utils import run_and_get_code

        _, code = run_and_get_code(compiled, *args)
        code = "\n".join(code)
        # re-inplaced: the ops run on the caller's buffers, nothing is cloned and copied back
        calls = ("torch.ops.dsv4c.compress_pair.default(", 1) if pair else ("torch.ops.dsv4c.compress.default(", 2)
        assert code.count(calls[0]) == calls[1] and "dsv4c.build_plan.default(" in code
        assert "clone" not in code and "copy_" not in code, code
    else:
        compiled(*args)
    assert [b.data_ptr() for b in buffers] == pointers
    for name, got, want in zip(("main state", "main pages", "indexer state", "indexer pages", "keys"), buffers, eager):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{backend}: {name} differs from eager"
    assert not torch.equal(main.pages, torch.full_like(main.pages, POISON)), "nothing was written"


@pytest.mark.parametrize("variant", ["hadamard", "hadamard_bf16", "hadamard_f32", "pow2"])
def test_indexer_pack_variants_match_their_engine_sequence(variant):
    """The kernel's pack of given float32 keys equals the PyTorch emulation of the engine's rounding sequence
    (``layout.encode_indexer_fp8``), and the variants really differ on the same keys. The kernel sums the
    Hadamard transform in float32, the emulation exactly, so a few bytes at rounding boundaries may differ."""
    from dsv4_compressor.kernels.entry_pack import entry_args, pack_values
    from dsv4_compressor.layout import encode_indexer_fp8

    cfg = INDEXER_CFG
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(96, cfg.head_dim, generator=gen) * torch.rand(96, 1, generator=gen) * 4
    pages = torch.full((2, 64 * 132), POISON, dtype=torch.uint8)
    p = make_params(cfg)
    prm, out, meta = entry_args(
        head=cfg.head_dim, rope=cfg.rope_dim, latent=False, page_size=64, scale_bytes=8, norm_weight=p.norm_weight,
        cos=p.cos, sin=p.sin, eps=1e-6, out_pages=pages, out_keys=None, exact_fp8=True, indexer_pack=variant,
    )  # fmt: skip
    slots = torch.arange(96, dtype=torch.int32)
    pack_values(keys, slots, out, meta)
    got = indexer_fp8_page_layout(cfg, 64).read(pages, slots)
    want = encode_indexer_fp8(keys, variant)
    equal = (got == want).float().mean().item()
    assert equal == 1.0 if variant == "pow2" else equal > 0.995, f"{variant}: {equal:.4f} of bytes equal"
    for other in ("hadamard", "hadamard_bf16", "hadamard_f32", "pow2"):
        if other != variant:
            assert (encode_indexer_fp8(keys, other) != want).any(), f"{variant} and {other} pack these keys alike"


@pytest.mark.parametrize("variant", ["hca_tiled", "online", "online_split", "csa"])
def test_unquantized_values_output(variant):
    """``out_keys`` float32 for a latent kind (a model that reads entries unquantized): the normalized, rotated
    float32 values, within float32 accuracy of the float64 reference; no record is written without pages."""
    cfg = VARIANTS[variant]
    p = make_params(cfg, seed=4)
    rows = random_rows(3 * cfg.ratio + 2, cfg, torch.Generator().manual_seed(4))
    n = rows.shape[0]
    positions, row_req = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    out_slot = torch.where(positions % cfg.ratio == cfg.ratio - 1, positions // cfg.ratio, -1)
    plan = ops.empty_plan(n, 1, cfg.ratio, "cpu")
    ops.build_plan(plan, positions, row_req, out_slot, ratio=cfg.ratio, num_slots=1)
    values = torch.full((8, cfg.head_dim), float("nan"))
    if variant.startswith("online"):
        banks = torch.zeros(1, 2, 3, cfg.head_dim)
        scratch = torch.full((n, cfg.head_dim), float("nan")) if variant == "online_split" else None
        ops.compress_online_hca(rows, plan, p.ape, p.norm_weight, p.cos, p.sin, banks, None, page_size=2,
                                out_keys=values, scratch=scratch)  # fmt: skip
    else:
        state = torch.zeros(1, cfg.ring_rows(1), cfg.row_width)
        scratch = torch.zeros(n, cfg.head_dim) if variant == "hca_tiled" else None
        kind = "hca" if variant.startswith("hca") else "csa"
        ops.compress(rows, plan, p.ape, p.norm_weight, p.cos, p.sin, state, None, kind=kind, page_size=2,
                     out_keys=values, scratch=scratch)  # fmt: skip
    want = reference.compress_sequence(rows, p, cfg, dtype=torch.float64)
    got = values[:3].double()
    tol = 1e-5 * want.abs() + 1e-6 * want.pow(2).mean(-1, keepdim=True).sqrt()
    assert ((got - want).abs() <= tol).all(), (got - want).abs().max()
    assert values[3:].isnan().all()
