"""The ops from hidden states on a CUDA GPU at DeepSeek-V4 shapes (V4-Flash D = 4096, V4-Pro 7168; CSA main
2W = 2048, the indexer 512, HCA 1024): the projection against float64 and against cuBLAS
(``torch.mm(..., out_dtype=float32)``, the engines' GEMM), determinism of the K split under real concurrency,
and whole layers (decode step in a CUDA graph, replayed on new hidden states) against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_compressor import ops, reference
from dsv4_compressor.config import CompressorConfig, CompressorParams
from dsv4_compressor.kernels import projection as proj
from dsv4_compressor.layout import indexer_fp8_page_layout, latent_page_layout
from dsv4_compressor.verify import check_indexer_keys, check_latent_records

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEV = torch.device("cuda")
U32 = 2.0**-24
KINDS = {"csa": CompressorConfig.csa(), "indexer": CompressorConfig.indexer(), "hca": CompressorConfig.hca()}


def _weight(width: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(width, dim, device=DEV, generator=gen) / dim**0.5
    w[width // 2 :] *= 1.5
    return w.to(torch.bfloat16)


def _hidden(rows: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(rows, dim, device=DEV, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("dim", [4096, 7168])
@pytest.mark.parametrize("width", [2048, 512, 1024])
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
def test_projection_against_float64_and_cublas(dim, width, rows):
    """Within the float32 bound of float64; against cuBLAS: the same bound, and the share of differing floats
    printed (both are float32 sums in different orders)."""
    x, w = _hidden(rows, dim, 1), _weight(width, dim, 2)
    cfg = proj.projection_config(rows, width, dim)
    ws = torch.full((proj.workspace_numel(rows, width, cfg),), float("nan"), device=DEV)
    ws[-proj.COUNTERS :].zero_()
    proj.launch_projection(x, w, ws, rows=rows, cfg=cfg, pdl=ops.pdl_enabled(DEV))
    kv = ws[: rows * width].view(rows, width)
    ref = x.double() @ w.double().t()
    bound = dim * U32 * (x.double().abs() @ w.double().abs().t())
    err = (kv.double() - ref).abs()
    assert (err <= bound).all(), f"{cfg}: max error / bound {(err / bound).max().item():.3g}"
    cublas = torch.mm(x, w.t(), out_dtype=torch.float32)
    assert ((cublas.double() - ref).abs() <= bound).all()
    share = (kv != cublas).float().mean().item()
    print(f"D={dim} 2W={width} T={rows} {tuple(cfg)}: {share:.2%} of floats differ from cuBLAS")
    assert (ws.view(torch.int32)[-proj.COUNTERS :] == 0).all()


@pytest.mark.parametrize("width, dim", [(2048, 4096), (512, 7168)])
def test_split_k_is_deterministic_under_concurrency(width, dim):
    rows = 64
    x, w = _hidden(rows, dim, 3), _weight(width, dim, 4)
    cfg = proj.projection_config(rows, width, dim)
    assert cfg.split_k > 1
    ws = torch.zeros(proj.workspace_numel(rows, width, cfg), device=DEV)
    first = None
    for _ in range(50):
        proj.launch_projection(x, w, ws, rows=rows, cfg=cfg, pdl=ops.pdl_enabled(DEV))
        kv = ws[: rows * width].clone()
        if first is None:
            first = kv
        assert torch.equal(kv.view(torch.int32), first.view(torch.int32))


@pytest.mark.parametrize("width, dim", [(2048, 4096), (512, 4096), (1024, 7168)])
@pytest.mark.parametrize("rows", [16, 64, 256])
def test_weight_prefetch_changes_no_byte(width, dim, rows, monkeypatch):
    """The weight's L2 prefetch before the PDL wait (``proj.PREFETCH``) against none: the same bytes, in a CUDA
    graph where the kernel before the projection writes ``x`` (read after the wait), replayed on new ``x``."""
    w = _weight(width, dim, 5)
    cfg = proj.projection_config(rows, width, dim)
    x = torch.empty(rows, dim, device=DEV, dtype=torch.bfloat16)
    source = _hidden(rows, dim, 6)
    outputs = {}
    for prefetch in (False, True):
        monkeypatch.setattr(proj, "PREFETCH", prefetch)
        ws = torch.zeros(proj.workspace_numel(rows, width, cfg), device=DEV)

        def step(ws=ws):
            x.copy_(source)
            proj.launch_projection(x, w, ws, rows=rows, cfg=cfg, pdl=ops.pdl_enabled(DEV))

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        got = []
        for seed in (7, 8):
            source.copy_(_hidden(rows, dim, seed))
            ws[: rows * width].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            got.append(ws[: rows * width].clone())
        kv = got[-1].view(rows, width).double()
        ref = source.double() @ w.double().t()
        assert ((kv - ref).abs() <= dim * U32 * (source.double().abs() @ w.double().abs().t())).all()
        outputs[prefetch] = got
    for off, on in zip(outputs[False], outputs[True]):
        assert torch.equal(off.view(torch.int32), on.view(torch.int32))


class HiddenLayer:
    """One layer at real shapes: weight, params, pages (poisoned), ring state or online banks, workspace."""

    def __init__(self, kind: str, dim: int, *, slots: int, max_rows: int, online: bool = False, seed: int = 0):
        self.kind, self.online, self.dim = kind, online, dim
        self.cfg = cfg = KINDS[kind]
        self.params = CompressorParams.random(cfg, max_positions=4096, seed=seed, device=DEV, norm_dtype=torch.bfloat16)
        self.weight = _weight(cfg.row_width, dim, seed + 1)
        self.page = cfg.default_page_size
        self.num_pages = slots * 4
        self.layout = (latent_page_layout if cfg.output == "latent" else indexer_fp8_page_layout)(cfg, self.page)
        self.pages = torch.full((self.num_pages, self.layout.bytes_per_page), 0xA5, dtype=torch.uint8, device=DEV)
        self.keys = None
        if kind == "indexer":
            keys = torch.full((self.num_pages * self.page, cfg.head_dim), 0x7FA5, dtype=torch.int16, device=DEV)
            self.keys = keys.view(torch.bfloat16)  # a NaN: an unwritten key fails the check
        if online:
            self.state = torch.zeros(slots, 4, 3, cfg.head_dim, device=DEV)
        else:
            self.state = torch.zeros(slots, cfg.ring_rows(3), cfg.row_width, device=DEV)
        self.workspace = ops.projection_workspace(max_rows, cfg.row_width, dim, DEV)

    def out_slot(self, slot: int, group: int) -> int:
        return slot * 4 * self.page + group

    def call(self, x, plan, *, decode: bool, projection: str = "auto"):
        p = self.params
        common = (x, self.weight, self.workspace, plan, p.ape, p.norm_weight, p.cos, p.sin, self.state, self.pages)
        if self.online:
            ops.compress_online_hca_from_hidden(*common, page_size=self.page, decode=decode, projection=projection)
        else:
            ops.compress_from_hidden(*common, kind=self.cfg.op_kind, page_size=self.page, decode=decode,
                                     out_keys=self.keys, projection=projection)  # fmt: skip

    def check(self, x: torch.Tensor, rows_of: dict[int, slice]):
        """The step's ``kv_score`` (the workspace's) within the float32 bound of float64 ``x @ weight.T``, then
        every request's entries against the float64 compression of the rows it was given: the projection's
        rounding is bounded where it happens, and the entries carry no error the compression's tolerance
        model does not explain."""
        width = self.cfg.row_width
        kv = self.workspace[: x.shape[0] * width].view(-1, width).double().cpu()
        xd, wd = x.double().cpu(), self.weight.double().cpu()
        err = (kv - xd @ wd.t()).abs()
        bound = self.dim * U32 * (xd.abs() @ wd.abs().t())
        assert (err <= bound).all(), f"{self.kind}: kv_score max error / bound {(err / bound).max().item():.3g}"
        for slot, rows in rows_of.items():
            values = reference.compress_sequence(kv[rows], self.params.to("cpu"), self.cfg, dtype=torch.float64)
            slots = torch.tensor([self.out_slot(slot, g) for g in range(values.shape[0])])
            if self.cfg.output == "latent":
                rep = check_latent_records(self.layout.read(self.pages.cpu(), slots), values, self.cfg)
            else:
                rep = check_indexer_keys(self.keys.cpu()[slots].float(), values)
            assert rep.ok, f"{self.kind} slot {slot}: {rep}"


def _plan(layer: HiddenLayer, starts, counts, *, mtp_step: int = 3):
    r = layer.cfg.ratio
    positions, row_req, out_slot = [], [], []
    for slot, (start, n) in enumerate(zip(starts, counts)):
        for p in range(start, start + n):
            positions.append(p)
            row_req.append(slot)
            out_slot.append(layer.out_slot(slot, p // r) if p % r == r - 1 else -1)
    t = len(positions)
    plan = ops.empty_plan(t, len(starts), r, DEV)
    ops.build_plan(plan, torch.tensor(positions, device=DEV), torch.tensor(row_req, device=DEV),
                   torch.tensor(out_slot, device=DEV), ratio=r, num_slots=len(starts), mtp_step=mtp_step)  # fmt: skip
    return plan, t


@pytest.mark.parametrize("dim", [4096, 7168])
@pytest.mark.parametrize("kind", ["csa", "indexer"])
@pytest.mark.parametrize("batch", [16, 64])
def test_decode_step_in_a_cuda_graph(dim, kind, batch):
    """B requests of 4 rows from position 0 (each closes group 0): captured, replayed on new hidden states,
    entries against float64 after each; the torch path's bytes beside the Triton path's (differences
    printed)."""
    layer = HiddenLayer(kind, dim, slots=batch, max_rows=4 * batch)
    plan, t = _plan(layer, [0] * batch, [4] * batch)
    x = _hidden(t, dim, 5)
    layer.call(x, plan, decode=True)
    torch.cuda.synchronize()
    layer.check(x, {s: slice(4 * s, 4 * s + 4) for s in range(batch)})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.call(x, plan, decode=True)
    for seed in (6, 7):
        x.copy_(_hidden(t, dim, seed))
        layer.pages.fill_(0xA5)
        if layer.keys is not None:
            layer.keys.view(torch.int16).fill_(0x7FA5)
        graph.replay()
        torch.cuda.synchronize()
        layer.check(x, {s: slice(4 * s, 4 * s + 4) for s in range(batch)})
    triton_pages = layer.pages.clone()
    layer.call(x, plan, decode=True, projection="torch")
    torch.cuda.synchronize()
    differ = int((triton_pages != layer.pages).sum())
    print(f"{kind} D={dim} B={batch}: {differ} of {layer.pages.numel()} page bytes differ from the cuBLAS path")
    layer.check(x, {s: slice(4 * s, 4 * s + 4) for s in range(batch)})


@pytest.mark.parametrize("dim", [4096, 7168])
@pytest.mark.parametrize("rows", [256, 1024])
def test_online_hca_prefill_from_hidden(dim, rows):
    """One request's prefill chunk (Triton path at 256 rows, cuBLAS above the switch), entries against
    float64."""
    layer = HiddenLayer("hca", dim, slots=2, max_rows=rows, online=True)
    plan, t = _plan(layer, [0], [rows])
    x = _hidden(t, dim, 8)
    layer.call(x, plan, decode=False)
    torch.cuda.synchronize()
    layer.check(x, {0: slice(0, rows)})


def test_layers_started_ahead_write_what_layers_in_order_write(monkeypatch):
    """``projection.AHEAD`` (each compression releases the next layer's projection before its wait) against the
    plain order: a CUDA graph of a decode step (both plans built in the graph, then a CSA layer, its indexer,
    another CSA layer and an online HCA layer from hidden states, all on one shared workspace: a projection that
    wrote its ``kv_score`` before the compression before it had read its own would change bytes), replayed on
    new hidden states with every output poisoned: the same bytes in pages, keys and states."""
    dim, batch = 4096, 16
    rows = 4 * batch
    layers = [
        HiddenLayer("csa", dim, slots=batch, max_rows=rows, seed=1),
        HiddenLayer("indexer", dim, slots=batch, max_rows=rows, seed=2),
        HiddenLayer("csa", dim, slots=batch, max_rows=rows, seed=3),
        HiddenLayer("hca", dim, slots=batch, max_rows=rows, online=True, seed=4),
    ]
    numel = max(ops.projection_workspace_numel(rows, layer.cfg.row_width, dim) for layer in layers)
    shared = torch.zeros(numel, device=DEV)
    for layer in layers:
        layer.workspace = shared
    positions = torch.arange(124, 128, device=DEV).repeat(batch)  # every request closes a group of 4 and of 128
    row_req = torch.arange(batch, device=DEV).repeat_interleave(4)
    plans = {}
    for r, layer in ((4, layers[0]), (128, layers[3])):  # the indexer's pages are the CSA layer's size
        out_slot = torch.where((positions + 1) % r == 0, layer.out_slot(row_req, positions // r), -1)
        plans[r] = (ops.empty_plan(rows, batch, r, DEV), out_slot)
    assert layers[1].page == layers[0].page

    def step(x):
        for r, (plan, out_slot) in plans.items():
            ops.build_plan(plan, positions, row_req, out_slot, ratio=r, num_slots=batch, mtp_step=3)
        for layer in layers:
            layer.call(x, plans[layer.cfg.ratio][0], decode=True, projection="triton")

    outputs = {}
    for ahead in (False, True):
        monkeypatch.setattr(proj, "PREFETCH", ahead)
        monkeypatch.setattr(proj, "AHEAD", ahead)
        x = _hidden(rows, dim, 5)
        for layer in layers:
            layer.state.zero_()
        step(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(x)
        got = []
        for seed in (6, 7):
            x.copy_(_hidden(rows, dim, seed))
            for layer in layers:
                layer.pages.fill_(0xA5)
                if layer.keys is not None:
                    layer.keys.view(torch.int16).fill_(0x7FA5)
            graph.replay()
            torch.cuda.synchronize()
            for layer in layers:
                got.append(layer.pages.clone())
                got.append(layer.state.clone().view(torch.int32))
                if layer.keys is not None:
                    got.append(layer.keys.clone().view(torch.int16))
        outputs[ahead] = got
        assert (layers[0].pages != 0xA5).any()  # the step wrote entries
    for plain, ahead in zip(outputs[False], outputs[True]):
        assert torch.equal(plain, ahead)
