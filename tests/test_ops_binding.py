"""``ops.bind_layer``: a layer's fixed tensors checked once at bind time, then per step the same flat op.

Each case steps two copies of one layer's poisoned buffers through a prefill, a decode step, an MTP verify step
and a rewound step on fresh random rows: one copy with the flat op, one with the bound layer; after every step
the state, pages and keys must be equal byte for byte (and the pages written). A bind with a bad tensor is
refused at bind time, naming ``bind_layer`` and the flat op's reason (CPU, Triton interpreter).
"""

from __future__ import annotations

import pytest
import torch
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_params, projection_weight

from dsv4_compressor import ops
from dsv4_compressor.errors import OpError

POISON = 0xA5
POISON_F32 = 0x7FC0A5A5  # a NaN: an entry that reads state it should not is NaN
SLOTS, MTP, HIDDEN = 3, 1, 64
#: (request, positions) per step, and whether it is a decode step (every request brings <= mtp_step + 1 rows).
STEPS = [
    ({0: range(0, 13), 1: range(0, 6)}, False),
    ({0: range(13, 14), 1: range(6, 7)}, True),
    ({0: range(14, 16), 1: range(7, 9)}, True),
    ({0: range(15, 17), 1: range(8, 10)}, True),  # request 0 rewinds one position (an MTP rejection)
]
#: case -> (config, kind, how the state is held, the indexer's pack, from hidden states)
CASES = {
    "csa ring": (CSA_SMALL, "csa", "ring3d", "hadamard", False),
    "csa tables": (CSA_SMALL, "csa", "tables", "hadamard", False),
    "indexer 2-D ring": (INDEXER_CFG, "indexer", "ring2d", "pow2", False),
    "hca tiled": (HCA_SMALL, "hca", "ring3d", "hadamard", False),
    "hca online": (HCA_SMALL, "hca", "online", "hadamard", False),
    "csa from hidden": (CSA_SMALL, "csa", "ring3d", "hadamard", True),
    "hca online from hidden": (HCA_SMALL, "hca", "online", "hadamard", True),
}


def _poisoned_f32(*shape) -> torch.Tensor:
    return torch.full(shape, POISON_F32, dtype=torch.int32).view(torch.float32)


class Layer:
    """One layer's buffers (poisoned) and fixed tensors, as an engine holds them."""

    def __init__(self, case: str):
        cfg, self.kind, self.how, self.pack, self.hidden = CASES[case]
        self.cfg, self.p = cfg, make_params(cfg, seed=11, max_positions=64)
        self.page_size = 2 if cfg.ratio == 8 else 64
        self.ring = cfg.ring_rows(MTP)
        if self.how == "online":
            self.state = _poisoned_f32(SLOTS, MTP + 1, 3, cfg.head_dim)
        elif self.how == "ring3d":
            self.state = _poisoned_f32(SLOTS, self.ring, cfg.row_width)
        else:
            self.state = _poisoned_f32(SLOTS * self.ring, cfg.row_width)
        record = cfg.head_dim + 4 if self.kind == "indexer" else cfg.head_dim + cfg.rope_dim + 8
        self.pages = torch.full((16 // self.page_size + 8, self.page_size * record), POISON, dtype=torch.uint8)
        slots = self.pages.shape[0] * self.page_size
        self.keys = torch.full((slots, cfg.head_dim), POISON, dtype=torch.int16).view(torch.bfloat16)
        if self.kind != "indexer":
            self.keys = None
        self.scratch = _poisoned_f32(32, cfg.head_dim) if self.kind == "hca" else None
        self.workspace = ops.projection_workspace(32, cfg.row_width, HIDDEN, "cpu") if self.hidden else None

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.state, self.pages, self.keys) if t is not None]

    def bind(self) -> ops.BoundLayer:
        p = self.p
        return ops.bind_layer(kind=self.kind, ape=p.ape, norm_weight=p.norm_weight, cos=p.cos, sin=p.sin,
                              state=self.state, out_pages=self.pages, page_size=self.page_size, out_keys=self.keys,
                              ring=self.ring if self.how == "ring2d" else None, tables=self.how == "tables",
                              online=self.how == "online", indexer_pack=self.pack, num_slots=SLOTS,
                              mtp_step=MTP)  # fmt: skip

    def flat(self, data, plan, decode, tables) -> None:
        """The step through the flat op."""
        p = self.p
        kw = dict(page_size=self.page_size, decode=decode, out_keys=self.keys, scratch=self.scratch)
        if self.how != "online":
            kw.update(kind=self.kind, indexer_pack=self.pack, ring=self.ring if self.how == "ring2d" else None)
            kw.update(zip(("read_rows", "save_rows"), tables or (None, None)))
        fixed = (p.ape, p.norm_weight, p.cos, p.sin, self.state, self.pages)
        if self.hidden:
            x, w = data
            fn = ops.compress_online_hca_from_hidden if self.how == "online" else ops.compress_from_hidden
            fn(x, w, self.workspace, plan, *fixed, projection="triton" if self.how != "online" else "torch", **kw)
            return
        (ops.compress_online_hca if self.how == "online" else ops.compress)(data, plan, *fixed, **kw)

    def bound(self, layer: ops.BoundLayer, data, plan, decode, tables) -> None:
        """The step through the bound layer."""
        kw = dict(decode=decode, scratch=self.scratch)
        kw.update(zip(("read_rows", "save_rows"), tables or (None, None)))
        if self.hidden:
            x, w = data
            projection = "triton" if self.how != "online" else "torch"
            layer.compress_from_hidden(x, w, self.workspace, plan, projection=projection, **kw)
            return
        layer.compress(data, plan, **kw)


def _step_plan(cfg, rows: dict, gen) -> tuple[torch.Tensor, int]:
    positions = torch.tensor([q for req in rows for q in rows[req]], dtype=torch.int64)
    row_req = torch.tensor([req for req in rows for _ in rows[req]], dtype=torch.int32)
    r = cfg.ratio
    out_slot = torch.tensor([req * 8 + q // r for req in rows for q in rows[req]], dtype=torch.int64)
    plan = ops.empty_plan(32, 4, r, "cpu")
    ops.build_plan(plan, positions, row_req, out_slot, ratio=r, num_slots=SLOTS, mtp_step=MTP)
    return plan, positions.shape[0]


@pytest.mark.parametrize("case", list(CASES))
def test_a_bound_layer_writes_what_the_flat_op_writes(case):
    flat, bound = Layer(case), Layer(case)
    layer = bound.bind()
    cfg = flat.cfg
    gen = torch.Generator().manual_seed(sum(case.encode()))
    weight = projection_weight(cfg.row_width, HIDDEN, seed=3) if flat.hidden else None
    for i, (rows, decode) in enumerate(STEPS):
        plan, n = _step_plan(cfg, rows, gen)
        if flat.hidden:
            data = ((torch.randn(n, HIDDEN, generator=gen)).to(torch.bfloat16), weight)
        else:
            data = torch.cat([torch.randn(n, cfg.width, generator=gen), 1.5 * torch.randn(n, cfg.width, generator=gen)],
                             1)  # fmt: skip
        tables = None
        if flat.how == "tables":
            tables = (torch.full((4, cfg.window - 1), -1, dtype=torch.int64), torch.full((32,), -1, dtype=torch.int64))
            ops.build_state_rows(plan, *tables, mode="req_ring", ring=flat.ring)
        flat.flat(data, plan, decode, tables)
        bound.bound(layer, data, plan, decode, tables)
        for a, b in zip(flat.buffers(), bound.buffers()):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"step {i}: the bound layer wrote otherwise"
    assert (flat.pages != POISON).any(), "no entry was written"


def _bad(layer: Layer, what: str) -> dict:
    p = layer.p
    kwargs = dict(kind=layer.kind, ape=p.ape, norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, state=layer.state,
                  out_pages=layer.pages, page_size=layer.page_size, out_keys=layer.keys, num_slots=SLOTS,
                  mtp_step=MTP)  # fmt: skip
    if what == "ape dtype":
        kwargs["ape"] = p.ape.to(torch.bfloat16)
    elif what == "ape of another width":
        kwargs["ape"] = p.ape[:, :-16]
    elif what == "cos and sin differ":
        kwargs["sin"] = p.sin[:, :-2]
    elif what == "state width":
        kwargs["state"] = layer.state[..., :-4]
    elif what == "state slots":
        kwargs["state"] = layer.state[: SLOTS - 1]
    elif what == "ring too small":
        kwargs["state"] = layer.state[:, : layer.ring - 3]
    elif what == "keys capacity":
        kwargs["out_keys"] = torch.zeros(7, layer.cfg.head_dim, dtype=torch.bfloat16)
    elif what == "no outputs":
        kwargs["out_pages"] = kwargs["out_keys"] = None
    elif what == "page size":
        kwargs["page_size"] = 0
    elif what == "kind":
        kwargs["kind"] = "mla"
    elif what == "online csa":
        kwargs["online"] = True
    return kwargs


BAD = {
    "ape dtype": "ape must be torch.float32",
    "ape of another width": "ape must be",
    "cos and sin differ": "cos and sin differ",
    "state width": "state rows must be",
    "state slots": "request slots",
    "ring too small": "cannot hold a window",
    "keys capacity": "the same",
    "no outputs": "needs out_pages or out_keys",
    "page size": "page_size must be",
    "kind": "kind must be one of",
    "online csa": "online=True is for kind='hca'",
}


@pytest.mark.parametrize("what", list(BAD))
def test_a_bind_with_a_bad_tensor_is_refused_at_bind_time(what):
    layer = Layer("csa ring")
    layer.keys = torch.full((layer.pages.shape[0] * layer.page_size, layer.cfg.head_dim), 1.0, dtype=torch.bfloat16)
    before = [t.clone() for t in layer.buffers()]
    with pytest.raises(OpError, match="^bind_layer: .*" + BAD[what].replace("(", r"\(")):
        ops.bind_layer(**_bad(layer, what))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(layer.buffers(), before))


def test_a_bound_layer_refuses_a_step_that_does_not_match_it():
    """A bound ring layer refuses tables (and a table-bound one their absence); its tensors cannot be
    replaced; a step's own mismatch (a plan of another ratio) is the flat op's refusal."""
    ring, tables = Layer("csa ring"), Layer("csa tables")
    bound_ring, bound_tables = ring.bind(), tables.bind()
    plan, n = _step_plan(ring.cfg, STEPS[0][0], None)
    kv = torch.randn(n, ring.cfg.row_width)
    rr, sr = torch.full((4, 7), -1, dtype=torch.int64), torch.full((32,), -1, dtype=torch.int64)
    ops.build_state_rows(plan, rr, sr, mode="req_ring", ring=ring.ring)
    with pytest.raises(OpError, match="ring state"):
        bound_ring.compress(kv, plan, read_rows=rr, save_rows=sr)
    with pytest.raises(OpError, match="tables=True"):
        bound_tables.compress(kv, plan)
    with pytest.raises(AttributeError, match="fixed"):
        bound_ring.state = tables.state
    other, _ = _step_plan(HCA_SMALL, STEPS[0][0], None)
    with pytest.raises(OpError, match="^compress: ape has 4 rows"):
        bound_ring.compress(kv, other)
    assert (ring.pages == POISON).all() and (tables.pages == POISON).all()
