"""The ops from hidden states on a CUDA GPU at DeepSeek-V4 shapes (V4-Flash D = 4096, V4-Pro 7168; CSA main
2W = 2048, the indexer 512, HCA 1024): the projection against float64 and against cuBLAS
(``torch.mm(..., out_dtype=float32)``, the engines' GEMM), determinism of the K split under real concurrency,
and whole layers (decode step in a CUDA graph, replayed on new hidden states) against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from helpers.checks import projected_rows

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


@pytest.mark.parametrize("dim", [4096, 7168])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_pair_projection_against_float64_and_apart(dim, rows):
    """A CSA layer's two projections in one ``ops.project`` launch (main 2048, indexer 512; the main weight a
    strided row slice of a larger tensor): each compressor's columns within the float32 bound of float64, the
    same launch twice the same bits, and the floats that differ from each weight's own launch and from cuBLAS
    counted (float32 sums in other orders)."""
    x = _hidden(rows, dim, 5)
    w1 = _weight(2048 + 64, dim, 6)[32 : 32 + 2048]
    w2 = _weight(512, dim, 7)
    width = 2048 + 512
    ws = torch.full((ops.projection_workspace_numel(rows, width, dim),), float("nan"), device=DEV)
    ws[-proj.COUNTERS :].zero_()
    ops.project(x, w1, ws, rows=rows, weight2=w2)
    kv = ws[: rows * width].view(rows, width).clone()
    for cols, w in ((slice(0, 2048), w1), (slice(2048, width), w2)):
        ref = x.double() @ w.double().t()
        bound = dim * U32 * (x.double().abs() @ w.double().abs().t())
        err = (kv[:, cols].double() - ref).abs()
        assert (err <= bound).all(), f"max error / bound {(err / bound).max().item():.3g}"
        alone = torch.full((ops.projection_workspace_numel(rows, w.shape[0], dim),), float("nan"), device=DEV)
        alone[-proj.COUNTERS :].zero_()
        ops.project(x, w, alone, rows=rows, projection="triton")
        apart = alone[: rows * w.shape[0]].view(rows, w.shape[0])
        cublas = torch.mm(x, w.t(), out_dtype=torch.float32)
        print(f"D={dim} T={rows} 2W={w.shape[0]} {tuple(proj.pair_config(rows, 2048, 512, dim))}: "
              f"{(kv[:, cols] != apart).float().mean().item():.2%} of floats differ from its own launch, "
              f"{(kv[:, cols] != cublas).float().mean().item():.2%} from cuBLAS")  # fmt: skip
    ops.project(x, w1, ws, rows=rows, weight2=w2)
    assert torch.equal(ws[: rows * width].view(rows, width).view(torch.int32), kv.view(torch.int32))
    assert (ws.view(torch.int32)[-proj.COUNTERS :] == 0).all()


@pytest.mark.parametrize("dim", [4096, 7168])
@pytest.mark.parametrize("rows", [64, 256])
def test_pair_on_joint_weights_is_cublas_above_the_joint_pair_rows(dim, rows):
    """Where the two weights are one tensor's halves (``ops.join_pair_weights``), ``ops.project`` of the pair on
    ``auto`` is cuBLAS on the joint weight: the bits of ``torch.mm(x, joint.T, out_dtype=float32)``, within the
    float32 bound of float64, the same bits twice; except up to ``ops.joint_pair_triton_rows`` (V4-Flash, 64
    rows), where it is our one launch on the halves: the bits of that launch on separate copies of the weights.
    ``triton`` runs our one launch on the same tensors."""
    x = _hidden(rows, dim, 8)
    joint = ops.join_pair_weights(_weight(2048, dim, 9), _weight(512, dim, 10))
    width = joint.shape[0]
    ws = torch.full((ops.projection_workspace_numel(rows, width, dim),), float("nan"), device=DEV)
    ws[-proj.COUNTERS :].zero_()
    cublas = torch.mm(x, joint.t(), out_dtype=torch.float32)
    ours_on_auto = rows <= ops.joint_pair_triton_rows(2048, 512, dim)
    assert ours_on_auto == (dim == 4096 and rows == 64)
    want = cublas
    if ours_on_auto:
        ops.project(x, joint[:2048].clone(), ws, rows=rows, weight2=joint[2048:].clone(), projection="triton")
        want = ws[: rows * width].view(rows, width).clone()
        ws[: rows * width].fill_(float("nan"))
    for _ in range(2):
        ops.project(x, joint[:2048], ws, rows=rows, weight2=joint[2048:])
        assert torch.equal(ws[: rows * width].view(rows, width).view(torch.int32), want.view(torch.int32))
    err = (cublas.double() - x.double() @ joint.double().t()).abs()
    assert (err <= dim * U32 * (x.double().abs() @ joint.double().abs().t())).all()
    ws[: rows * width].fill_(float("nan"))
    ops.project(x, joint[:2048], ws, rows=rows, weight2=joint[2048:], projection="triton")
    ours = ws[: rows * width].view(rows, width)
    assert torch.isfinite(ours).all() and (ours - cublas).abs().max() <= 1e-3 * cublas.abs().max()
    assert (ws.view(torch.int32)[-proj.COUNTERS :] == 0).all()
    print(f"D={dim} T={rows}: {(ours != cublas).float().mean().item():.2%} of our floats differ from cuBLAS's")


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
        self.projection = projection
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
        kv = self.projected(x.shape[0]).double().cpu()
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

    def projected(self, rows: int) -> torch.Tensor:
        """The step's ``kv_score`` as the compression read it (``helpers.checks.projected_rows``: the workspace's,
        or the partials' sum where the online op left them)."""
        return projected_rows(self.workspace, rows, self.cfg.row_width, self.dim, online=self.online,
                              projection=self.projection)  # fmt: skip


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


@pytest.mark.parametrize("batch", [16, 64])
def test_online_decode_from_partials_in_a_cuda_graph(monkeypatch, batch):
    """V4-Flash HCA: B requests prefilled to 124 positions (cuBLAS path), then a decode step of 4 rows each
    that closes group 0, on the Triton path, whose projection leaves its K split's partials to the online
    kernel (``kernels.projection.PARTIALS``): captured, replayed on new hidden states, every entry against the
    float64 compression of its 128 rows; pages and banks byte for byte those of a projection at the same blocks
    that adds its partials itself."""
    dim, r, head = 4096, 128, 124
    layer = HiddenLayer("hca", dim, slots=batch, max_rows=head * batch, online=True)
    width = layer.cfg.row_width
    plan, t = _plan(layer, [0] * batch, [head] * batch)
    layer.call(_hidden(t, dim, 4), plan, decode=False, projection="torch")
    prefill = layer.projected(t).double().cpu().view(batch, head, width)
    plan, t = _plan(layer, [head] * batch, [r - head] * batch)
    assert proj.partials_config(t, width, dim) is not None
    slots = torch.tensor([layer.out_slot(s, 0) for s in range(batch)])

    def check():
        kv = layer.projected(t)  # the step's rows as the kernel read them: the partials' sum
        kv = kv.double().cpu().view(batch, r - head, width)
        for s in range(batch):
            values = reference.compress_sequence(torch.cat([prefill[s], kv[s]]), layer.params.to("cpu"), layer.cfg,
                                                 dtype=torch.float64)  # fmt: skip
            rep = check_latent_records(layer.layout.read(layer.pages.cpu(), slots[s : s + 1]), values, layer.cfg)
            assert rep.ok, f"slot {s}: {rep}"

    x = _hidden(t, dim, 5)
    layer.call(x, plan, decode=True, projection="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.call(x, plan, decode=True, projection="triton")
    for seed in (6, 7):
        x.copy_(_hidden(t, dim, seed))
        layer.pages.fill_(0xA5)
        graph.replay()
        torch.cuda.synchronize()
        check()
    pages, banks = layer.pages.clone(), layer.state.clone()
    # the projection that adds its partials itself, at the same blocks (the same partials, the same order)
    monkeypatch.setitem(proj.OVERRIDES, (width, dim), {t: proj.partials_config(t, width, dim)})
    monkeypatch.setattr(proj, "PARTIALS", {})
    layer.pages.fill_(0xA5)
    layer.call(x, plan, decode=True, projection="triton")
    torch.cuda.synchronize()
    assert torch.equal(layer.pages, pages)
    assert torch.equal(layer.state.view(torch.int32), banks.view(torch.int32))


@pytest.mark.parametrize("dim", [4096, 7168])
@pytest.mark.parametrize("rows", [256, 1024])
def test_online_hca_prefill_from_hidden(monkeypatch, dim, rows):
    """One request's prefill chunk (the Triton path at 256 rows, on V4-Flash its unsummed partials; cuBLAS above
    the switch), entries against float64; where the partials path ran, pages and banks byte for byte those of a
    projection at the same blocks that adds its partials itself."""
    layer = HiddenLayer("hca", dim, slots=2, max_rows=rows, online=True)
    width = layer.cfg.row_width
    plan, t = _plan(layer, [0], [rows])
    x = _hidden(t, dim, 8)
    layer.call(x, plan, decode=False)
    torch.cuda.synchronize()
    layer.check(x, {0: slice(0, rows)})
    choice = ops.projection_choice(t, width, dim, online=True)
    print(f"hca D={dim} T={t}: {choice.path} path, reduce={choice.reduce}")
    if choice.reduce:
        return
    pages, banks = layer.pages.clone(), layer.state.clone()
    monkeypatch.setitem(proj.OVERRIDES, (width, dim), {t: choice.cfg})
    monkeypatch.setattr(proj, "PARTIALS", {})
    assert ops.projection_choice(t, width, dim, projection="triton", online=True) == (choice.path, choice.cfg, True)
    layer.pages.fill_(0xA5)
    layer.call(x, plan, decode=False, projection="triton")
    torch.cuda.synchronize()
    assert torch.equal(layer.pages, pages)
    assert torch.equal(layer.state.view(torch.int32), banks.view(torch.int32))
