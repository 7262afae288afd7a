"""The ops from hidden states (``ops.compress_from_hidden``, ``ops.compress_online_hca_from_hidden``) and their
projection kernel (CPU, Triton interpreter).

- the projection against float64 (the float32-accumulation error bound), its fixed-order K-split reduction
  (the tile equals its partials added in split order), and every workspace byte it must not touch;
- the ops through engine-shaped streaming (:class:`test_ops.EngineLayer`: prefill chunks, decode and MTP
  rewinds, three engines' buffer styles): every entry against the float64 reference of the rows the op
  projected, every state row bit for bit, no stray byte;
- the whole layer against float64 from the hidden states, and against the engines' path (a float32 GEMM, then
  ``compress``): equal bytes except at rounding boundaries (counted and bounded);
- refusals before any write, schema / fake (opcheck), launch counts.

The interpreter's ``tl.dot`` misreads bf16 operands, so under it the kernel multiplies float32 copies of the
bf16 values (exact products, float32 sums: the same arithmetic class as the GPU's bf16 MMA with float32
accumulation); the GPU runs the bf16 dot (``tests/test_projection_gpu.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.checks import projected_rows
from helpers.inputs import CSA_SMALL, projection_weight
from helpers.session import count_launches
from test_ops import POISON_F32, EngineLayer

from dsv4_compressor import ops, reference
from dsv4_compressor.errors import OpError
from dsv4_compressor.kernels import projection as proj
from dsv4_compressor.verify import check_latent_records

#: Hidden size of the small layers (DeepSeek-V4: 4096 / 7168).
DIM = 256
U32 = 2.0**-24  # float32 unit roundoff


def _weights(width: int, dim: int = DIM, seed: int = 0) -> torch.Tensor:
    return projection_weight(width, dim, seed)


def _hidden(n: int, dim: int = DIM, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _poisoned_workspace(numel: int) -> torch.Tensor:
    """A workspace whose data part is NaN poison and whose counters are zero (as allocated)."""
    ws = torch.full((numel,), POISON_F32, dtype=torch.int32)
    ws[-proj.COUNTERS :] = 0
    return ws.view(torch.float32)


def _float64_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float32-accumulation error bound of every output: ``D * u * sum_k |x_k w_k|`` (products are exact)."""
    return x.shape[1] * U32 * (x.double().abs() @ w.double().abs().t())


# ---------------------------------------------------------------------------------------------------------------
# The projection kernel
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rows, width, split, block_t",
    [(1, 512, 1, 16), (17, 512, 2, 16), (70, 256, 4, 64), (33, 512, 8, 16), (64, 1024, 2, 64)],
)
def test_projection_against_float64_and_fixed_order_split(monkeypatch, rows, width, split, block_t):
    """Each output within the float32 bound of the float64 product; a K-split tile equals its partials added in
    split order (0, 1, ...: deterministic whatever program arrives last); the counters are back at zero;
    nothing past the partials is written; rows past T in ``x`` are not read into the result."""
    cfg = proj.ProjectionConfig(block_t, 128 if width >= 1024 else 64, 32, split)
    monkeypatch.setitem(proj.OVERRIDES, (width, DIM), {rows: cfg})
    assert proj.projection_config(rows, width, DIM) == cfg
    x = _hidden(rows + 5)
    x[rows:] = float("nan")  # padding rows: never part of a result
    w = _weights(width)
    numel = proj.workspace_numel(rows, width, cfg) + 37
    ws = _poisoned_workspace(numel)
    proj.launch_projection(x, w, ws, rows=rows, cfg=cfg, pdl=False)
    kv = ws[: rows * width].view(rows, width)
    ref = x[:rows].double() @ w.double().t()
    err = (kv.double() - ref).abs()
    bound = _float64_bound(x[:rows], w)
    assert torch.isfinite(kv).all()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max().item():.3g}"
    assert err.max() > 0  # float32 sums: not an exact (float64) path by accident
    if split > 1:
        parts = ws[rows * width : rows * width * (1 + split)].view(split, rows, width)
        total = torch.zeros(rows, width)
        for s in range(split):
            total = total + parts[s]
        assert torch.equal(kv.view(torch.int32), total.view(torch.int32)), "not the split-order sum"
    used = proj.workspace_numel(rows, width, cfg) - proj.COUNTERS
    assert (ws.view(torch.int32)[used : -proj.COUNTERS] == POISON_F32).all(), "wrote past its partials"
    assert (ws.view(torch.int32)[-proj.COUNTERS :] == 0).all(), "a tile counter was left non-zero"
    # deterministic: a second launch gives the same bits
    again = _poisoned_workspace(numel)
    proj.launch_projection(x, w, again, rows=rows, cfg=cfg, pdl=False)
    assert torch.equal(again[: rows * width].view(rows, width).view(torch.int32), kv.view(torch.int32))


@pytest.mark.parametrize("sms", [132, 148])  # H200, B200
def test_projection_config_fits_the_device_and_the_counters(monkeypatch, sms):
    """The heuristic's choices at DeepSeek-V4's shapes (the measured ``OVERRIDES`` set aside): one wave of
    programs at most on the device's multiprocessors, the K split dividing ``D``, tiles within the counters."""
    monkeypatch.setattr(proj, "OVERRIDES", {})
    monkeypatch.setattr(proj, "sm_count", lambda: sms)
    for dim in (4096, 7168):
        for width in (2048, 512, 1024):
            for rows in (1, 16, 64, 256, 512):
                cfg = proj.projection_config(rows, width, dim)
                t, n, s = cfg.grid(rows, width)
                assert dim % (cfg.block_k * cfg.split_k) == 0
                assert s == 1 or t * n * s <= sms
                assert cfg.tiles(rows, width) <= proj.COUNTERS or s == 1
    assert proj.projection_config(64, 2048, 4096).split_k == 8  # CSA main: 16 tiles x 8 splits
    assert proj.projection_config(64, 2048, 4096, programs=64).split_k == 4  # an explicit budget wins


def test_prefetch_pieces_cover_each_row_slice_in_16_byte_multiples():
    """``prefetch_chunks`` at every measured and heuristic config of DeepSeek-V4's shapes: the pieces of a row's
    slice (``D / split_k`` bf16) are 16-byte multiples that tile it exactly, about one per thread of a program."""
    assert proj.PREFETCH == "auto" and proj.PREFETCH_STEPS == 2  # the measured default (PREFETCH_ROWS)
    # on where measured faster: the V4-Flash HCA weight, reducing up to 64 rows, as partials up to 256
    assert proj.prefetches(64, 1024, 4096) and not proj.prefetches(65, 1024, 4096)
    assert proj.prefetches(256, 1024, 4096, reduce=False) and not proj.prefetches(257, 1024, 4096, reduce=False)
    assert not any(proj.prefetches(64, w, d) for w, d in ((2048, 4096), (512, 4096), (2560, 4096), (1024, 7168)))
    seen = 0
    for dim in (4096, 7168):
        for width in (2048, 512, 1024, 2560):
            for rows in (1, 16, 64, 256):
                cfg = proj.projection_config(rows, width, dim)
                chunks = proj.prefetch_chunks(cfg, dim)
                row_bytes = dim // cfg.split_k * 2
                assert chunks >= 1 and row_bytes % chunks == 0 and (row_bytes // chunks) % 16 == 0, (cfg, chunks)
                assert chunks * cfg.block_n <= max(cfg.num_warps * 32, cfg.block_n), (cfg, chunks)
                seen += chunks > 1
    assert seen  # the pieces split some rows (a 32-column block over 128 threads: 4 per row)
    assert proj.prefetch_chunks(proj.ProjectionConfig(64, 32, 128, 2, 4, 4), 4096) == 4


def test_prefetch_is_never_taken_where_the_instruction_cannot_run(monkeypatch):
    """Under the interpreter (and on CPU tensors) a launch asked to prefetch runs the plain kernel: the same
    result bit for bit, ``PREFETCH_CHUNKS`` 0 in the launch."""
    launched = []
    kernel = proj._projection_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append(kwargs["PREFETCH_CHUNKS"])
                return kernel[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(proj, "_projection_kernel", Spy())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, 256, generator=gen).to(torch.bfloat16)
    w = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    cfg = proj.ProjectionConfig(16, 32, 64, 2, 4, 2)
    out = []
    for prefetch in (None, True, False):
        ws = torch.zeros(proj.workspace_numel(16, 64, cfg))
        proj.launch_projection(x, w, ws, rows=16, cfg=cfg, pdl=False, prefetch=prefetch)
        out.append(ws[: 16 * 64].clone())
    assert launched == [0, 0, 0]
    assert all(torch.equal(o.view(torch.int32), out[0].view(torch.int32)) for o in out)
    want = x.double() @ w.double().t()
    assert torch.allclose(out[0].view(16, 64).double(), want, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# The ops, engine-shaped
# ---------------------------------------------------------------------------------------------------------------
class HiddenLayer:
    """An :class:`EngineLayer` driven from hidden states: each step's rows are the projection the op computed
    (read back from its workspace after the call), so the layer's checks (entries against float64 of those
    rows, state rows bit for bit, no stray byte) hold the op to exactly what it projected."""

    def __init__(self, variant: str, style: str, *, projection: str = "triton", seed: int = 0, **kwargs):
        self.layer = EngineLayer(variant, style, seed=seed, **kwargs)
        cfg = self.layer.cfg
        self.weight = _weights(cfg.row_width, seed=seed + 3)
        self.workspace = ops.projection_workspace(64, cfg.row_width, DIM, "cpu")
        self.projection = projection
        self.gen = torch.Generator().manual_seed(seed + 4)
        self.x: dict[int, torch.Tensor] = {}  # slot -> hidden states of its current rows

    def step(self, items, *, pad_back: int = 1, **kwargs):
        """``items = [(slot, start, rows), ...]``: fresh hidden states for those rows (and the padding)."""
        width = self.layer.cfg.row_width
        hidden = [torch.randn(n, DIM, generator=self.gen).to(torch.bfloat16) for _, _, n in items]
        pad = torch.randn(pad_back, DIM, generator=self.gen).to(torch.bfloat16)
        x = torch.cat([*hidden, pad])
        placeholders = [torch.zeros(n, width) for _, _, n in items]
        ws = self.workspace

        def edit(fn, args, kw):
            name = "compress_online_hca_from_hidden" if fn is ops.compress_online_hca else "compress_from_hidden"

            def call(kv_score, *rest, **kw2):
                getattr(ops, name)(x, self.weight, ws, *rest, projection=self.projection, **kw2)
                kv = projected_rows(ws, kv_score.shape[0], width, DIM, online=name.startswith("compress_online"),
                                    projection=self.projection)  # fmt: skip
                row = 0
                for ph in placeholders:  # the model's rows: what the op projected
                    ph.copy_(kv[row : row + ph.shape[0]])
                    row += ph.shape[0]

            return call, args, kw

        self.layer.step([(s, st, ph) for (s, st, _), ph in zip(items, placeholders)], pad_back=pad_back,
                        edit_call=edit, **kwargs)  # fmt: skip
        for (slot, start, _), h in zip(items, hidden):
            old = self.x.get(slot, torch.empty(0, DIM, dtype=torch.bfloat16))[:start]
            self.x[slot] = torch.cat([old, h])


@pytest.mark.parametrize("variant", ["csa", "indexer", "hca_tiled", "online", "online_partials"])
@pytest.mark.parametrize("style", ["lightllm", "vllm"])
def test_from_hidden_streaming(monkeypatch, variant, style):
    """Prefill chunks, a mixed step, decode with an MTP rewind: the layer's checks after every step.
    ``online_partials``: the online op on a projection that leaves its K split's partials (the path
    ``kernels.projection.PARTIALS`` picks at V4-Flash's HCA shape), at every step size of the test."""
    reduced = None
    if variant == "online_partials":
        variant = "online"
        partials = proj.ProjectionConfig(16, 32, 32, 4)
        monkeypatch.setitem(proj.PARTIALS, (EngineLayer(variant, style).cfg.row_width, DIM), {64: partials})
        reduced = []
        real = proj.launch_projection
        monkeypatch.setattr(proj, "launch_projection", lambda *a, **k: reduced.append(k["reduce"]) or real(*a, **k))
    hl = HiddenLayer(variant, style, mtp=2, seed=5)
    r = hl.layer.cfg.ratio
    hl.step([(0, 0, 2 * r + 1), (1, 0, r - 1)])
    hl.layer.check("prefill")
    hl.step([(0, 2 * r + 1, 3), (1, r - 1, r + 2)])
    hl.layer.check("mixed")
    hl.step([(0, 2 * r + 3, 3)], decode=True)  # rewinds one position (start < L), MTP verify
    hl.layer.check("decode rewind")
    if reduced is not None:
        assert reduced == [False] * 3, reduced


def test_from_hidden_matches_float64_and_the_engines_gemm_path():
    """One CSA request, prefill then decode: the entries against the float64 computation from the hidden states;
    the bytes against the engines' path (float32 GEMM, then ``ops.compress``) equal except at rounding boundaries
    (few, and each within the tolerance model); ``projection="torch"`` is that path byte for byte."""
    runs = {}
    for path in ("triton", "torch", "engine"):
        hl = HiddenLayer("csa", "sglang", projection="triton" if path == "engine" else path, seed=9, mtp=0)
        hl.gen = torch.Generator().manual_seed(13)
        if path == "engine":  # the engines' GEMM in float32, then the bare op
            engine_step(hl, [(0, 0, 37)])
            engine_step(hl, [(0, 37, 3)])
        else:
            hl.step([(0, 0, 37)])
            hl.step([(0, 37, 3)])
        hl.layer.check(path)
        runs[path] = hl
    layer = runs["triton"].layer
    x = runs["triton"].x[0]
    assert torch.equal(x, runs["engine"].x[0])
    cfg = layer.cfg
    kv64 = x.double() @ runs["triton"].weight.double().t()
    values = reference.compress_sequence(kv64, layer.params, cfg, dtype=torch.float64)
    slots = torch.tensor([layer.out_slot_of(0, g) for g in range(values.shape[0])])
    ours = layer.layout.read(layer.pages, slots)
    rep = check_latent_records(ours, values, cfg)
    assert rep.ok, rep
    engine = runs["engine"].layer.layout.read(runs["engine"].layer.pages, slots)
    differ = int((ours != engine).sum())
    assert differ <= 0.02 * ours.numel(), f"{differ} of {ours.numel()} bytes differ from the engines' path"
    torch_path = runs["torch"].layer.layout.read(runs["torch"].layer.pages, slots)
    assert torch.equal(torch_path, engine)
    assert torch.equal(runs["torch"].layer.state.view(torch.int32), runs["engine"].layer.state.view(torch.int32))


def engine_step(hl: HiddenLayer, items):
    """The engines' path on ``hl``'s layer: ``kv_score = float32(x) @ float32(weight).T`` (the CPU stand-in of
    ``torch.mm(x, w.T, out_dtype=float32)``) over the step's rows, padding included, in one GEMM as the engines
    run it (a GEMM per request could sum in another order: CPU BLAS picks its kernels by shape), then the bare
    ``ops.compress`` on it."""
    width = hl.layer.cfg.row_width
    hidden = [torch.randn(n, DIM, generator=hl.gen).to(torch.bfloat16) for _, _, n in items]
    pad = torch.randn(1, DIM, generator=hl.gen).to(torch.bfloat16)  # the padding row, as HiddenLayer.step
    kv = torch.cat([*hidden, pad]).float() @ hl.weight.float().t()
    rows = list(kv[: sum(h.shape[0] for h in hidden)].split([h.shape[0] for h in hidden]))
    hl.layer.step([(s, st, r) for (s, st, _), r in zip(items, rows)])
    for (slot, start, _), h in zip(items, hidden):
        old = hl.x.get(slot, torch.empty(0, DIM, dtype=torch.bfloat16))[:start]
        hl.x[slot] = torch.cat([old, h])
    assert width == rows[0].shape[1]


# ---------------------------------------------------------------------------------------------------------------
# Refusals, registration, launches
# ---------------------------------------------------------------------------------------------------------------
def _one_step(variant: str = "csa"):
    """A built plan and valid from-hidden arguments of one request's 9 rows (not yet called)."""
    layer = EngineLayer(variant, "vllm", seed=3)
    cfg = layer.cfg
    r, n = cfg.ratio, 2 * cfg.ratio + 1
    positions = torch.arange(n)
    out_slot = torch.tensor([layer.out_slot_of(0, p // r) if p % r == r - 1 else -1 for p in range(n)])
    plan = ops.empty_plan(n, 2, r, "cpu")
    ops.build_plan(plan, positions, torch.zeros(n, dtype=torch.int64), out_slot, ratio=r, num_slots=layer.num_slots,
                   mtp_step=layer.mtp)  # fmt: skip
    p = layer.params
    x, w = _hidden(n), _weights(cfg.row_width)
    ws = _poisoned_workspace(ops.projection_workspace_numel(n, cfg.row_width, DIM))
    if variant == "online":
        args = [x, w, ws, plan, layer.ape, p.norm_weight, layer.cos, layer.sin, layer.state, layer.pages]
        return layer, ops.compress_online_hca_from_hidden, args, dict(page_size=layer.page_size)
    args = [x, w, ws, plan, layer.ape, p.norm_weight, layer.cos, layer.sin, layer.state, layer.pages]
    return layer, ops.compress_from_hidden, args, dict(kind=layer.kind, page_size=layer.page_size, out_keys=layer.keys)


def _bad_calls(layer, args, kwargs):
    x, w, ws = args[0], args[1], args[2]
    width = w.shape[0]
    yield "x float32", {0: x.float()}, {}
    yield "x of another D", {0: _hidden(x.shape[0], DIM + 16)}, {}
    yield "x with fewer rows than T", {0: x[:-1]}, {}
    yield "x column-major", {0: x.t().contiguous().t()}, {}
    yield "weight transposed", {1: w.t()}, {}
    if width != x.shape[1]:  # a square weight's transpose has the same shape and strides: nothing tells them apart
        yield "weight transposed, contiguous", {1: w.t().contiguous()}, {}
    yield "weight column-major", {1: w.t().contiguous().t()}, {}
    yield "weight float32", {1: w.float()}, {}
    yield "weight fp8", {1: w.to(torch.float8_e4m3fn)}, {}
    yield "weight of another width", {1: _weights(width + 64)}, {}
    yield "workspace too small", {2: ws[: x.shape[0] * width]}, {}
    yield "workspace float64", {2: ws.double()}, {}
    yield "workspace 2-D", {2: ws[: ws.numel() // width * width].view(-1, width)}, {}
    yield "unknown projection", {}, {"projection": "cublas"}
    yield "torch path, workspace too small", {2: ws[: x.shape[0] * width - 1]}, {"projection": "torch"}
    # the compress stage's own refusals come before the projection too
    yield "ape of another ratio", {4: layer.ape[:-1]}, {}
    yield "state with too few slots", {8: args[8][:1]}, {}
    yield "page size too large", {}, {"page_size": 4096}
    yield "eps out of range", {}, {"eps": 2.0}
    if kwargs.get("kind"):
        yield "unknown kind", {}, {"kind": "mla"}
        yield "scratch on csa", {}, {"scratch": torch.zeros(16, layer.cfg.head_dim)}
        yield "unknown indexer pack", {}, {"indexer_pack": "fp4"}


@pytest.mark.parametrize("variant", ["csa", "online"])
def test_refusals_write_nothing(variant):
    layer, fn, args, kwargs = _one_step(variant)
    for what, arg_changes, kw_changes in _bad_calls(layer, args, kwargs):
        a = list(args)
        for i, v in arg_changes.items():
            a[i] = v
        buffers = [t for t in (a[2], args[2], layer.state, layer.page_memory, layer.keys, args[3]) if t is not None]
        before = [t.clone() for t in buffers]
        with pytest.raises(OpError, match=fn.__name__):
            fn(*a, **{**kwargs, **kw_changes})
            pytest.fail(f"{what}: accepted")
        for t, b in zip(buffers, before):
            assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)), f"{what}: a refused call wrote a buffer"
    fn(*args, **kwargs)  # the unchanged call is accepted and writes
    assert not torch.equal(layer.page_memory, torch.full_like(layer.page_memory, 0xA5))


def test_opcheck_from_hidden_ops():
    """Schemas, fakes and dispatch (``torch.ops.dsv4c``), on clones of the inputs (no NaN poison: opcheck
    compares repeated runs)."""
    from torch.library import opcheck

    for variant in ("csa", "online"):
        layer, fn, args, kwargs = _one_step(variant)
        args[2] = torch.zeros_like(args[2])
        args[8] = torch.zeros_like(args[8])
        opcheck(getattr(torch.ops.dsv4c, fn.__name__).default, tuple(args), kwargs)


@pytest.mark.parametrize("projection", ["triton", "torch"])
def test_launches_counts_the_projection(monkeypatch, projection):
    layer, fn, args, kwargs = _one_step("csa")
    names = count_launches(monkeypatch)
    fn(*args, **kwargs, projection=projection)
    n = args[0].shape[0]
    want = ops.launches("compress_from_hidden", rows=n, requests=2, ratio=4, kind="csa")
    assert want == 1 + ops.launches("compress", rows=n, requests=2, ratio=4, kind="csa")
    triton_launches = want if projection == "triton" else want - 1  # torch.mm is not a Triton kernel
    assert len(names) == triton_launches, names
    assert ("_projection_kernel" in names) == (projection == "triton")


def test_auto_takes_the_path_measured_faster_per_shape(monkeypatch):
    """``projection="auto"`` projects with the Triton kernel only where the H200 bench measured it faster than
    cuBLAS (``kernels.projection.FASTER_THAN_CUBLAS``: decode steps of 64 rows, the V4-Flash indexer up to 256,
    not the V4-Pro indexer), and with torch.mm for every other shape and step."""
    for width, dim in ((2048, 4096), (1024, 4096), (2048, 7168), (1024, 7168)):
        assert ops.projection_triton_rows(width, dim) == 64
        assert ops.projection_choice(64, width, dim, projection="auto").path == "triton"
        assert ops.projection_choice(65, width, dim, projection="auto").path == "torch"
    assert ops.projection_triton_rows(512, 4096) == 256
    assert ops.projection_choice(257, 512, 4096, projection="auto").path == "torch"
    for width, dim in ((512, 7168), (512, DIM)):
        assert ops.projection_triton_rows(width, dim) == 0
        assert ops.projection_choice(1, width, dim, projection="auto").path == "torch"
    assert ops.projection_choice(4096, 2048, 4096, projection="triton").path == "triton"

    layer, fn, args, kwargs = _one_step("csa")  # 9 rows of a [2W, 256] weight: not in the table, torch.mm
    calls = []
    monkeypatch.setattr(proj, "launch_projection", lambda *a, **k: calls.append(1))
    fn(*args, **kwargs)
    assert calls == []
    monkeypatch.setitem(proj.FASTER_THAN_CUBLAS, (layer.cfg.row_width, DIM), 8)  # 9 rows: above it
    fn(*args, **kwargs)
    assert calls == []
    monkeypatch.setitem(proj.FASTER_THAN_CUBLAS, (layer.cfg.row_width, DIM), 9)
    fn(*args, **kwargs)
    assert calls == [1]


def test_auto_online_takes_the_partials_path_where_it_has_blocks(monkeypatch):
    """The online op's ``auto`` projects with the Triton kernel wherever ``kernels.projection.PARTIALS`` has
    blocks (the V4-Flash HCA weight up to 256 rows, measured faster than cuBLAS in the layer), the other ops only
    up to ``FASTER_THAN_CUBLAS``; the online decode then reads the partials with more warps."""
    from dsv4_compressor.kernels import online_hca
    from dsv4_compressor.kernels.ring import kv_ref

    assert ops.projection_triton_rows(1024, 4096) == 64
    assert ops.projection_triton_rows(1024, 4096, online=True) == 256
    flash_hca = ops.projection_choice(256, 1024, 4096, online=True)
    assert flash_hca.path == "triton" and not flash_hca.reduce  # the workspace holds partials, not kv_score
    assert ops.projection_choice(256, 1024, 4096) == ("torch", None, True)
    assert ops.projection_choice(257, 1024, 4096, projection="auto", online=True).path == "torch"
    assert ops.projection_triton_rows(1024, 7168, online=True) == 64  # V4-Pro: no partials blocks measured
    layer, fn, args, kwargs = _one_step("online")
    width, rows = layer.cfg.row_width, args[0].shape[0]
    calls = []
    monkeypatch.setattr(proj, "launch_projection", lambda *a, **k: calls.append(k["reduce"]))
    monkeypatch.setattr(online_hca, "_online_hca_kernel", _Recorder(calls))
    fn(*args, **kwargs, projection="auto")
    assert calls == ["kernel"]  # no partials blocks for this shape: cuBLAS (torch.mm), then the online kernel
    calls.clear()
    monkeypatch.setitem(proj.PARTIALS, (width, DIM), {rows: proj.ProjectionConfig(16, 32, 32, 4)})
    with pytest.raises(OpError, match="workspace holds"):  # sized before: the partials need more room
        fn(*args, **kwargs, projection="auto")
    args[2] = _poisoned_workspace(ops.projection_workspace_numel(rows, width, DIM))
    fn(*args, **kwargs, projection="auto")
    assert calls == [False, "kernel"]  # the partials path: the projection leaves them, the kernel reads them
    assert ops.projection_choice(rows, width, DIM, online=True).reduce is False  # the same answer as the op's
    assert online_hca._decode_warps(kv_ref(torch.zeros(4, 2, 8))) == online_hca.PARTIALS_DECODE_WARPS
    assert online_hca._decode_warps(kv_ref(torch.zeros(2, 8))) == online_hca.DECODE_WARPS


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kw)`` records ``"kernel"``."""

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *a, **k: self.calls.append("kernel")


def test_measured_blocks_are_valid_for_their_shapes():
    """Every ``OVERRIDES`` entry divides its ``D`` into K splits of at least two steps, keeps its tiles within
    the counters at the rows it serves, and is what ``projection_config`` returns there; ``auto``'s Triton
    range has a measured entry."""
    for (width, dim), by_rows in proj.OVERRIDES.items():
        for rows, cfg in by_rows.items():
            assert dim % (cfg.block_k * cfg.split_k) == 0 and dim // (cfg.block_k * cfg.split_k) >= 2, cfg
            assert cfg.tiles(rows, width) <= proj.COUNTERS and cfg.block_n <= width
            assert proj.projection_config(rows, width, dim) == cfg
            assert proj.projection_config(1, width, dim) == by_rows[min(by_rows)]
    for (width, dim), rows in proj.FASTER_THAN_CUBLAS.items():
        assert any(rows <= limit for limit in proj.OVERRIDES[(width, dim)])


@pytest.mark.parametrize("rows", [3, 64])
def test_the_measured_indexer_blocks_at_the_model_shape(rows):
    """Blocks ``auto`` runs on the GPU (the V4-Flash indexer, 512 x 4096: 16 column blocks x 8 K splits),
    under the interpreter, against float64, the workspace poisoned beforehand and its counters left at zero."""
    width, dim = 512, 4096
    cfg = proj.projection_config(rows, width, dim)
    assert cfg == proj.OVERRIDES[(width, dim)][64] and cfg.split_k == 8
    x, w = _hidden(rows, dim), _weights(width, dim)
    ws = _poisoned_workspace(ops.projection_workspace_numel(rows, width, dim))
    proj.launch_projection(x, w, ws, rows=rows, cfg=cfg, pdl=False)
    kv = ws[: rows * width].view(rows, width).double()
    assert ((kv - x.double() @ w.double().t()).abs() <= _float64_bound(x, w)).all()
    assert np.all(ws.view(torch.int32)[-proj.COUNTERS :].numpy() == 0)


def test_workspace_serves_a_prefill_then_a_decode_step(monkeypatch):
    """A torch-path step that fills the workspace with rows leaves the Triton path's counters at zero (they sit
    at its end), so a later split-K step is still right."""
    monkeypatch.setitem(proj.OVERRIDES, (512, DIM), {8: proj.ProjectionConfig(16, 64, 32, 4)})
    n = 48
    ws = ops.projection_workspace(n, 512, DIM, "cpu")
    assert (ws == 0).all()
    x, w = _hidden(n), _weights(512)
    ws.view(torch.int32)[: -proj.COUNTERS] = POISON_F32  # what a big step leaves behind
    cfg = proj.projection_config(8, 512, DIM)
    assert cfg.split_k > 1
    proj.launch_projection(x, w, ws, rows=8, cfg=cfg, pdl=False)
    kv = ws[: 8 * 512].view(8, 512)
    assert ((kv.double() - x[:8].double() @ w.double().t()).abs() <= _float64_bound(x[:8], w)).all()
    assert np.all(ws.view(torch.int32)[-proj.COUNTERS :].numpy() == 0)


def test_csa_small_uses_an_overlapping_width():
    """The small CSA layer's 2W = 4H (overlap), the weight shape the op asks for."""
    assert CSA_SMALL.row_width == 4 * CSA_SMALL.head_dim


def test_schema_lists_what_the_from_hidden_ops_write():
    writes = {
        name: {a.name for a in getattr(torch.ops.dsv4c, name).default._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
        for name in ("compress_from_hidden", "compress_online_hca_from_hidden")
    }  # fmt: skip
    assert writes["compress_from_hidden"] == {"workspace", "state", "out_pages", "scratch", "out_keys", "plan"}
    assert writes["compress_online_hca_from_hidden"] == {"workspace", "state_banks", "out_pages", "out_keys", "scratch"}


# ---------------------------------------------------------------------------------------------------------------
# ops.project: one weight, or a CSA layer's two (main and indexer) in one launch
# ---------------------------------------------------------------------------------------------------------------
def _pair(first: int, second: int, rows: int, seed: int = 0):
    """``x`` (NaN padding rows past ``rows``), ``weight`` a strided row slice of a fused tensor (as an engine's
    merged linear holds it), ``weight2`` its own tensor."""
    x = _hidden(rows + 3, seed=seed + 1)
    x[rows:] = float("nan")
    fused = _weights(first + 40, DIM + 32, seed=seed)[7 : 7 + first, 16 : 16 + DIM]
    assert fused.stride(0) == DIM + 32
    return x, fused, _weights(second, seed=seed + 2)


@pytest.mark.parametrize(
    "rows, first, second, cfg",
    [
        (9, 256, 64, proj.ProjectionConfig(16, 64, 32, 2)),
        (20, 512, 128, proj.ProjectionConfig(16, 32, 64, 4)),
        (64, 256, 64, proj.ProjectionConfig(64, 128, 32, 1)),  # no K split
        (5, 272, 48, proj.ProjectionConfig(16, 64, 32, 2)),  # N1 = 272: the column block halves to 16
    ],
)
def test_pair_projection_against_float64(monkeypatch, rows, first, second, cfg):
    """One launch over two weights: columns ``[0, N1)`` are ``x @ weight.T``, ``[N1, N1 + N2)`` ``x @ weight2.T``,
    each within the float32 bound of float64; a column block never straddles the two (``pair_config``); the
    split's partials added in split order; counters back at zero; nothing written past the partials; the same
    bits on a second call."""
    width = first + second
    monkeypatch.setitem(proj.OVERRIDES, (width, DIM), {rows: cfg})
    got = proj.pair_config(rows, first, second, DIM)
    assert first % got.block_n == 0 and got._replace(block_n=cfg.block_n) == cfg
    x, w1, w2 = _pair(first, second, rows)
    numel = ops.projection_workspace_numel(rows, width, DIM) + 29
    ws = _poisoned_workspace(numel)
    ops.project(x, w1, ws, rows=rows, weight2=w2)
    kv = ws[: rows * width].view(rows, width)
    assert torch.isfinite(kv).all()
    for cols, w in ((slice(0, first), w1), (slice(first, width), w2)):
        err = (kv[:, cols].double() - x[:rows].double() @ w.double().t()).abs()
        assert (err <= _float64_bound(x[:rows], w)).all()
        assert err.max() > 0
    if got.split_k > 1:
        parts = ws[rows * width : rows * width * (1 + got.split_k)].view(got.split_k, rows, width)
        total = torch.zeros(rows, width)
        for s in range(got.split_k):
            total = total + parts[s]
        assert torch.equal(kv.view(torch.int32), total.view(torch.int32)), "not the split-order sum"
    used = proj.workspace_numel(rows, width, got) - proj.COUNTERS
    assert (ws.view(torch.int32)[used : -proj.COUNTERS] == POISON_F32).all(), "wrote past its partials"
    assert (ws.view(torch.int32)[-proj.COUNTERS :] == 0).all(), "a tile counter was left non-zero"
    again = _poisoned_workspace(numel)
    ops.project(x, w1, again, rows=rows, weight2=w2)
    assert torch.equal(again[: rows * width].view(torch.int32), ws[: rows * width].view(torch.int32))


@pytest.mark.parametrize("projection", ["triton", "torch"])
def test_project_one_weight_is_compress_from_hidden_s_projection(projection):
    """``ops.project`` of one weight writes what ``compress_from_hidden``'s projection writes (the same path and
    blocks: the same bits)."""
    layer, fn, args, kwargs = _one_step("csa")
    x, w, ws = args[0], args[1], args[2]
    rows = x.shape[0]
    fn(*args, **kwargs, projection=projection)
    want = ws[: rows * w.shape[0]].clone()
    mine = _poisoned_workspace(ws.numel())
    ops.project(x, w, mine, rows=rows, projection=projection)
    assert torch.equal(mine[: rows * w.shape[0]].view(torch.int32), want.view(torch.int32))


def _project_bad_calls(x, w1, w2, ws, rows):
    yield "rows negative", dict(rows=-1)
    yield "rows past x", dict(rows=x.shape[0] + 1)
    yield "x float32", dict(x=x.float())
    yield "x of another D", dict(x=_hidden(x.shape[0], DIM + 16))
    yield "weight2 of another D", dict(weight2=_weights(w2.shape[0], DIM + 16))
    yield "weight2 transposed", dict(weight2=w2.t())
    yield "weight2 column-major", dict(weight2=w2.t().contiguous().t())
    yield "weight2 float32", dict(weight2=w2.float())
    yield "weight column-major", dict(weight=w1.contiguous().t().contiguous().t())
    yield "N1 not a multiple of 16", dict(weight=w1[:-8])
    yield "a pair on torch.mm", dict(projection="torch")
    yield "unknown projection", dict(projection="cublas")
    yield "workspace too small", dict(workspace=ws[: rows * (w1.shape[0] + w2.shape[0])])
    yield "workspace float64", dict(workspace=ws.double())


def test_project_refusals_write_nothing():
    rows, first, second = 9, 256, 64
    x, w1, w2 = _pair(first, second, rows)
    ws = _poisoned_workspace(ops.projection_workspace_numel(rows, first + second, DIM))
    good = dict(x=x, weight=w1, workspace=ws, rows=rows, weight2=w2)
    for what, change in _project_bad_calls(x, w1, w2, ws, rows):
        call = {**good, **change}
        before = ws.clone()
        with pytest.raises(OpError, match="project"):
            ops.project(call.pop("x"), call.pop("weight"), call.pop("workspace"), **call)
            pytest.fail(f"{what}: accepted")
        assert torch.equal(ws.view(torch.int32), before.view(torch.int32)), f"{what}: a refused call wrote"
    ops.project(x, w1, ws, rows=rows, weight2=w2)
    assert torch.isfinite(ws[: rows * (first + second)]).all()


def test_opcheck_and_launches_of_project(monkeypatch):
    from torch.library import opcheck

    rows, first, second = 9, 256, 64
    x, w1, w2 = _pair(first, second, rows)
    x = x[:rows].clone()  # opcheck compares runs: no NaN rows
    ws = torch.zeros(ops.projection_workspace_numel(rows, first + second, DIM))
    opcheck(torch.ops.dsv4c.project.default, (x, w1, ws), dict(rows=rows, weight2=w2))
    writes = {a.name for a in torch.ops.dsv4c.project.default._schema.arguments
              if a.alias_info is not None and a.alias_info.is_write}  # fmt: skip
    assert writes == {"workspace"}
    names = count_launches(monkeypatch)
    ops.project(x, w1, ws, rows=rows, weight2=w2)
    assert names == ["_projection_kernel"]
    ops.project(x, w1, ws, rows=0, weight2=w2)
    assert names == ["_projection_kernel"]  # an empty step launches nothing


def test_joint_pair_weight_only_for_one_tensor_s_halves_in_order():
    """``joint_pair_weight`` is the ``[N1 + N2, D]`` view of ``join_pair_weights``' halves, and ``None`` for
    every other layout: two tensors, the halves swapped, a gap, a row stride past ``D``, another dtype."""
    first, second = 64, 32
    w1, w2 = _weights(first, seed=3), _weights(second, seed=4)
    joint = ops.join_pair_weights(w1, w2)
    assert joint.shape == (first + second, DIM) and joint.is_contiguous()
    assert torch.equal(joint, torch.cat([w1, w2]))
    view = ops.joint_pair_weight(joint[:first], joint[first:])
    assert view is not None and view.data_ptr() == joint.data_ptr() and torch.equal(view, joint)
    wide = _weights(first + second, DIM + 16, seed=5)[:, :DIM]
    gap = _weights(first + second + 16, seed=6)
    for what, a, b in [
        ("two tensors", w1, w2),
        ("swapped", joint[first:], joint[:first]),
        ("a gap", gap[:first], gap[first + 16 :]),
        ("row stride past D", wide[:first], wide[first:]),
        ("another dtype", joint[:first], joint[first:].float()),
        ("transposed", joint[:first].t(), joint[first:].t()),
    ]:
        assert ops.joint_pair_weight(a, b) is None, what
    with pytest.raises(OpError, match="join_pair_weights"):
        ops.join_pair_weights(w1, w2.float())
    with pytest.raises(OpError, match="join_pair_weights"):
        ops.join_pair_weights(w1, _weights(second, DIM + 16))


@pytest.mark.parametrize("joint_rows", [0, 9], ids=["cublas", "ours-up-to-9"])
def test_pair_on_joint_weights_is_one_gemm_of_the_joint_weight(monkeypatch, joint_rows):
    """With the two weights one tensor's halves, ``auto`` (and ``torch``) run one GEMM of the joint weight: the
    bits of ``project`` of that weight alone on ``torch``, no Triton launch; ``triton`` still streams both in
    our one launch, the bits of the pair on separate copies. Where ``JOINT_PAIR_TRITON`` admits the step
    (``joint_rows``, as for V4-Flash's CSA shape at 64 rows), ``auto`` on the joint weight is that one launch,
    bit for bit, and cuBLAS again one row above it."""
    rows, first, second = 9, 256, 64
    if joint_rows:
        monkeypatch.setitem(proj.PAIR_FASTER, (first, second, DIM), 64)
        monkeypatch.setitem(proj.JOINT_PAIR_TRITON, (first, second, DIM), joint_rows)
    assert ops.joint_pair_triton_rows(first, second, DIM) == joint_rows
    x, w1, w2 = _pair(first, second, rows + 1)
    joint = ops.join_pair_weights(w1, w2)
    numel = ops.projection_workspace_numel(rows + 1, first + second, DIM)
    names = count_launches(monkeypatch)
    want = _poisoned_workspace(numel)
    ops.project(x, joint, want, rows=rows, projection="torch")
    for projection in ("auto", "torch") if not joint_rows else ("torch",):
        ws = _poisoned_workspace(numel)
        ops.project(x, joint[:first], ws, rows=rows, weight2=joint[first:], projection=projection)
        assert torch.equal(ws.view(torch.int32), want.view(torch.int32)), projection
    assert names == []
    apart, ws = _poisoned_workspace(numel), _poisoned_workspace(numel)
    ops.project(x, w1, apart, rows=rows, weight2=w2, projection="triton")
    ops.project(x, joint[:first], ws, rows=rows, weight2=joint[first:], projection="auto" if joint_rows else "triton")
    assert names == ["_projection_kernel"] * 2
    cols = rows * (first + second)
    assert torch.equal(ws[:cols].view(torch.int32), apart[:cols].view(torch.int32))
    names.clear()
    above, want_above = _poisoned_workspace(numel), _poisoned_workspace(numel)
    ops.project(x, joint, want_above, rows=rows + 1, projection="torch")
    ops.project(x, joint[:first], above, rows=rows + 1, weight2=joint[first:])
    assert names == [] and torch.equal(above.view(torch.int32), want_above.view(torch.int32))
    err = (want[:cols].view(rows, -1).double() - x[:rows].double() @ joint.double().t()).abs()
    assert (err <= _float64_bound(x[:rows], joint)).all()


def test_pair_rows_are_measured_shapes_with_valid_blocks():
    """Every ``PAIR_FASTER`` entry's pair blocks divide its ``D``, keep a column block within one weight and
    fit the counters; only the V4 CSA shapes pair (an unmeasured shape: 0, each projection apart)."""
    for (first, second, dim), rows in proj.PAIR_FASTER.items():
        cfg = proj.pair_config(rows, first, second, dim)
        assert first % cfg.block_n == 0 and dim % (cfg.block_k * cfg.split_k) == 0
        assert cfg.tiles(rows, first + second) <= proj.COUNTERS
        assert ops.pair_projection_rows(first, second, dim) == rows
    assert ops.pair_projection_rows(2048, 512, 4096) == 64 and ops.pair_projection_rows(2048, 512, 7168) == 64
    assert ops.pair_projection_rows(256, 64, DIM) == 0
    for key, rows in proj.JOINT_PAIR_TRITON.items():  # within the pair's rows: the pair workspaces hold it
        assert 0 < rows <= proj.PAIR_FASTER[key] and ops.joint_pair_triton_rows(*key) == rows
    assert ops.joint_pair_triton_rows(2048, 512, 4096) == 64 and ops.joint_pair_triton_rows(2048, 512, 7168) == 0


class PairedLayers:
    """A CSA layer and its indexer fed by one ``x``: ``ops.project`` of both weights in one launch, then each
    layer's ``ops.compress`` on its columns of the result (a ``kv_score`` whose row stride is both widths); the
    layers' own checks (entries against float64 of the rows the op projected, state rows bit for bit, no stray
    byte) hold each compress to exactly its columns."""

    def __init__(self, style: str, seed: int = 0, **kwargs):
        self.main = EngineLayer("csa", style, seed=seed, **kwargs)
        self.indexer = EngineLayer("indexer", style, seed=seed + 1, **kwargs)
        self.first, self.second = self.main.cfg.row_width, self.indexer.cfg.row_width
        self.w1, self.w2 = _weights(self.first, seed=seed + 3), _weights(self.second, seed=seed + 5)
        self.ws = ops.projection_workspace(64, self.first + self.second, DIM, "cpu")
        self.gen = torch.Generator().manual_seed(seed + 4)

    def step(self, items, **kwargs):
        hidden = [torch.randn(n, DIM, generator=self.gen).to(torch.bfloat16) for _, _, n in items]
        x = torch.cat([*hidden, torch.randn(1, DIM, generator=self.gen).to(torch.bfloat16)])
        rows, width = x.shape[0], self.first + self.second
        kv = self.ws[: rows * width].view(rows, width)
        for layer, cols, project in ((self.main, slice(0, self.first), True),
                                     (self.indexer, slice(self.first, width), False)):  # fmt: skip
            placeholders = [torch.zeros(n, cols.stop - cols.start) for _, _, n in items]

            def edit(fn, args, kw, cols=cols, project=project, placeholders=placeholders):
                def call(kv_score, *rest, **kw2):
                    if project:  # the layer's first compressor projects both
                        ops.project(x, self.w1, self.ws, rows=rows, weight2=self.w2)
                    fn(kv[:, cols], *rest, **kw2)
                    row = 0
                    for ph in placeholders:
                        ph.copy_(kv[row : row + ph.shape[0], cols])
                        row += ph.shape[0]

                return call, args, kw

            layer.step([(s, st, ph) for (s, st, _), ph in zip(items, placeholders)], edit_call=edit, **kwargs)
        for cols, w in ((slice(0, self.first), self.w1), (slice(self.first, width), self.w2)):
            err = (kv[:, cols].double() - x.double() @ w.double().t()).abs()
            assert (err <= _float64_bound(x, w)).all(), "a compressor's columns are not x @ its weight.T"


@pytest.mark.parametrize("style", ["lightllm", "sglang"])
def test_pair_projection_feeds_both_compressors(style):
    """Prefill, a mixed step and MTP decode with a rewind: a CSA layer and its indexer from one pair projection
    per step, each layer's checks after every step."""
    pl = PairedLayers(style, seed=7, mtp=2)
    r = pl.main.cfg.ratio
    pl.step([(0, 0, 2 * r + 1), (1, 0, r - 1)])
    pl.main.check("prefill")
    pl.indexer.check("prefill")
    pl.step([(0, 2 * r + 1, 3), (1, r - 1, r + 2)])
    pl.main.check("mixed")
    pl.indexer.check("mixed")
    pl.step([(0, 2 * r + 3, 3)], decode=True)
    pl.main.check("decode rewind")
    pl.indexer.check("decode rewind")
