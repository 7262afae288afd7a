"""The latent record layouts (``layout=``): SGLang's V4.1 records, block-split (``"v41"``) and interleaved
(``"v41_new"``), and the uniform FP8 values, written by the kernels byte for byte as the plain-PyTorch
reference (:mod:`dsv4_compressor.layout`) packs them, at the reference's page offsets and nowhere else.

``tests/test_engine_sglang_v41.py`` holds the reference itself to SGLang's ``quantize_k_cache_v41``."""

from __future__ import annotations

import pytest
import torch
from helpers.buffers import POISON_BYTE
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_params, random_rows

from dsv4_compressor import layout, ops, reference
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.errors import OpError
from dsv4_compressor.kernels.entry_pack import LAYOUTS, entry_args, finish_values, pack_values
from dsv4_compressor.verify import check_latent_records

V4_HCA = CompressorConfig.hca()
OTHER_LAYOUTS = ("v41", "v41_new", "uniform_fp8")


def test_every_layout_has_a_kernel_encoding():
    assert set(LAYOUTS) == set(layout.LATENT_LAYOUTS)
    assert LAYOUTS == {"v4": 0, "v41": 1, "uniform_fp8": 3, "v41_new": 4}  # SGLang's KVLayout numbers


@pytest.mark.parametrize(
    "name, record, p64, p2",
    [
        ("v4", (576, 8), 37440, 1728),
        ("v41", (512, 16), 33792, 1536),  # [P x 512][P x 16], padded to 512
        ("v41_new", (512, 16), 33792, 1056),  # 528 bytes a record, unpadded
        ("uniform_fp8", (512, 0), 32768, 1024),
    ],
)
def test_page_bytes(name, record, p64, p2):
    """DeepSeek-V4's pages per layout, as SGLang's ``kv_page_bytes`` sizes them."""
    assert layout.latent_record_bytes(512, 64, name) == record
    assert layout.latent_page_layout(V4_HCA, 64, name).bytes_per_page == p64
    assert layout.latent_page_layout(V4_HCA, 2, name).bytes_per_page == p2


def test_v41_new_offsets_interleave():
    pl = layout.latent_page_layout(V4_HCA, 4, "v41_new")
    assert [pl.data_offset(t) for t in range(4)] == [0, 528, 1056, 1584]
    assert [pl.scale_offset(t) for t in range(4)] == [512, 1040, 1568, 2096]
    split = layout.latent_page_layout(V4_HCA, 4, "v41")
    assert [split.scale_offset(t) for t in range(4)] == [2048, 2064, 2080, 2096]


def test_v41_exponent_floor_after_the_quotient():
    """``ceil(log2(max(amax / 448, 1e-4)))``: 448 * 2^k maps to k, the next float above to k + 1, and the floor
    is 2^-13 (V4's ``max(amax, 1e-4) / 448`` would reach 2^-22)."""
    amax = torch.tensor([448.0, 448.0 * (1 + 2**-23), 896.0, 1.0, 0.0, 1e-30, 448 * 2.0**-13, 448 * 2.0**-14])
    assert layout.v41_exponent(amax).tolist() == [0, 1, 1, -8, -13, -13, -13, -13]


def _values(n: int, head: int, seed: int) -> torch.Tensor:
    """Random entry values over several magnitudes, with a zero 32-block, a tiny one and exact powers of two."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, head, generator=gen) * torch.exp2(torch.randint(-12, 8, (n, 1), generator=gen).float())
    x[0, :32] = 0.0
    x[min(1, n - 1), 32:64] = 1e-7
    x[min(2, n - 1), 64:96] = torch.exp2(torch.randint(-10, 9, (32,), generator=gen).float())
    x[min(3, n - 1), 100] = 448.0 * 3  # beyond the FP8 range
    return x


@pytest.mark.parametrize("name", OTHER_LAYOUTS)
@pytest.mark.parametrize("cfg, page_size", [(V4_HCA, 64), (V4_HCA, 2), (HCA_SMALL, 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_pack_values_kernel_byte_exact(name, cfg, page_size, seed):
    """The kernels' encoder (``store_entry`` through ``pack_values``) on random values into poisoned pages: the
    reference's records at the reference's offsets, every other byte untouched."""
    pl = layout.latent_page_layout(cfg, page_size, name)
    pages = torch.full((5, pl.bytes_per_page + 7), POISON_BYTE, dtype=torch.uint8)  # rows wider than a page
    num_slots = 5 * page_size
    gen = torch.Generator().manual_seed(seed + 10)
    slots = torch.randperm(num_slots, generator=gen)[: max(1, num_slots // 2)]
    x = _values(slots.shape[0], cfg.head_dim, seed)
    p = make_params(cfg)
    _, out, meta = entry_args(
        head=cfg.head_dim, rope=cfg.rope_dim, latent=True, page_size=page_size, scale_bytes=8,
        norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, eps=1e-6, out_pages=pages, out_keys=None,
        exact_fp8=True, layout=name,
    )  # fmt: skip
    pack_values(x, slots.to(torch.int32), out, meta)
    want = torch.full_like(pages, POISON_BYTE)
    body = want[:, : pl.bytes_per_page]
    records = layout.encode_latent(x, cfg, name)
    assert records.shape[1] == pl.record_bytes
    flat = torch.empty(5, pl.bytes_per_page, dtype=torch.uint8).copy_(body)
    pl.write(flat, slots, records)
    want[:, : pl.bytes_per_page] = flat
    differing = (pages != want).nonzero()
    assert differing.numel() == 0, f"{differing.shape[0]} bytes differ, first at {differing[:4].tolist()}"
    got = pl.read(pages[:, : pl.bytes_per_page].contiguous(), slots)
    assert torch.equal(got, records)


@pytest.mark.parametrize("name", ["v41", "v41_new"])
def test_v41_round_trip_bound(name):
    """Decoded V4.1 records are within half the 32-block's top FP8 step (``2^e * 32``, ``2^e < 2 amax / 448``)
    of the values (no bf16 rounding first)."""
    x = torch.randn(64, 512)
    back = layout.decode_latent(layout.encode_latent(x, V4_HCA, name), V4_HCA, name)
    blocks = x.view(64, 16, 32).abs().amax(-1, keepdim=True)
    assert ((back.view(64, 16, 32) - x.view(64, 16, 32)).abs() <= 2 * blocks / 448 * 16).all()


def test_uniform_record_is_torchs_saturating_cast():
    """``"uniform_fp8"``: e4m3 of each float32 value, round to nearest even, as torch's ``.to(float8_e4m3fn)``
    (SGLang's trtllm pool) up to 464; beyond, 448 (torch since pytorch/pytorch#178817 saturates too; before it,
    NaN)."""
    x = _values(16, 512, 3) * 64  # up to 448 * 3 * 64
    x[0, :8] = torch.tensor([447.9, 448.0, 455.9, 464.0, 464.1, 480.0, 1e6, -1e6])
    got = layout.encode_latent(x, V4_HCA, "uniform_fp8")
    small = x.abs() <= 464
    assert torch.equal(got[small], x[small].to(torch.float8_e4m3fn).view(torch.uint8))
    assert set(got[~small].tolist()) <= {0x7E, 0xFE}
    assert got[0, :8].tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE]


@pytest.mark.parametrize("name", OTHER_LAYOUTS)
def test_float64_check_of_each_layout(name):
    """``verify.check_latent_records(layout=)``: the reference's records of values a few ulps off pass; a byte
    one code off, a scale one off, or another layout's record fail."""
    x = _values(32, 512, 4)
    x[3, 100] = 1.0  # within the FP8 range: every value's bounds are finite
    wobble = x * (1 + 1e-7 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1)))
    records = layout.encode_latent(wobble, V4_HCA, name)
    assert check_latent_records(records, x.double(), V4_HCA, layout=name).ok
    bad = records.clone()
    bad[5, 40] ^= 1  # one FP8 code off
    rep = check_latent_records(bad, x.double(), V4_HCA, layout=name)
    assert not rep.ok and "fp8 value" in str(rep)
    if name != "uniform_fp8":
        bad = records.clone()
        bad[6, 512 + 2] += 1  # one scale exponent off
        assert not check_latent_records(bad, x.double(), V4_HCA, layout=name).ok
    other = "v41" if name == "uniform_fp8" else "uniform_fp8"
    assert not check_latent_records(layout.encode_latent(x, V4_HCA, other), x.double(), V4_HCA, layout=name).ok


def test_uniform_values_are_sglangs_triton_norm():
    """The kernels finish uniform FP8 records with SGLang's Triton norm and rope (``tl.rsqrt(sum / H + eps)``):
    their float32 values are within a few ulps of ``reference.finish_entries_sglang_triton`` (the sums of
    squares are added in another order) and their records are those values' encoding."""
    p = make_params(V4_HCA, seed=3, max_positions=512)
    gen = torch.Generator().manual_seed(8)
    c = torch.randn(24, 512, generator=gen) * torch.exp2(torch.randint(-8, 8, (24, 1), generator=gen).float())
    starts = torch.randint(0, 4, (24,), generator=gen, dtype=torch.int32) * 128
    pages, keys = _poisoned((12, 1024)), torch.zeros(24, 512)
    prm, out, meta = entry_args(
        head=512, rope=64, latent=True, page_size=2, scale_bytes=8, norm_weight=p.norm_weight, cos=p.cos, sin=p.sin,
        eps=p.eps, out_pages=pages, out_keys=keys, exact_fp8=True, layout="uniform_fp8",
    )  # fmt: skip
    finish_values(c, starts, torch.arange(24, dtype=torch.int32), prm, out, meta)
    ref = reference.finish_entries_sglang_triton(c, starts, p, V4_HCA)
    rms = ref.pow(2).mean(dim=1, keepdim=True).sqrt()
    assert float(((keys - ref).abs() / (ref.abs() + rms)).max()) < 2**-21
    assert torch.equal(pages.view(24, 512), layout.encode_latent(keys, V4_HCA, "uniform_fp8"))
    exact = reference.finish_entries(c.double(), starts, reference.params_as(p, torch.float64), V4_HCA)
    assert check_latent_records(pages.view(24, 512), exact, V4_HCA, layout="uniform_fp8").ok


def _step(cfg, rows=32, slots=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per = rows // slots
    positions = torch.arange(per, dtype=torch.int64).repeat(slots)
    row_req = torch.arange(slots, dtype=torch.int32).repeat_interleave(per)
    out_slot = torch.arange(rows, dtype=torch.int64)
    plan = ops.empty_plan(rows, slots, cfg.ratio, "cpu")
    ops.build_plan(plan, positions, row_req, out_slot, ratio=cfg.ratio, num_slots=slots)
    closing = ((positions + 1) % cfg.ratio == 0).nonzero().flatten()
    return plan, random_rows(rows, cfg, gen), closing


def _poisoned(shape, dtype=torch.uint8):
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).fill_(POISON_BYTE)
    return t


@pytest.mark.parametrize("name", ["v4", *OTHER_LAYOUTS])
@pytest.mark.parametrize("path", ["single", "tiled", "online", "csa"])
def test_ops_write_the_layout(name, path):
    """``compress`` (single-stage and tiled HCA, CSA) and ``compress_online_hca`` with ``layout=``: the pages
    hold the reference's records of the entries the op wrote to its float32 ``out_keys`` (the same values),
    at their slots, and nothing else."""
    cfg = CSA_SMALL if path == "csa" else HCA_SMALL
    page_size, rows = 4, 32
    plan, kv, closing = _step(cfg, rows)
    p = make_params(cfg)
    pl = layout.latent_page_layout(cfg, page_size, name)
    pages = _poisoned((rows // page_size, pl.bytes_per_page))
    keys = _poisoned((rows, cfg.head_dim), torch.float32)
    common = dict(page_size=page_size, out_keys=keys, exact_fp8=True, layout=name)
    if path == "online":
        banks = torch.zeros(2, 1, 3, cfg.head_dim)
        ops.compress_online_hca(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, banks, pages, **common)
    else:
        state = torch.zeros(2, cfg.ring_rows(0), cfg.row_width)
        scratch = torch.zeros(rows, cfg.head_dim) if path == "tiled" else None
        kind = "csa" if path == "csa" else "hca"
        ops.compress(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages, kind=kind, scratch=scratch, **common)
    assert closing.numel() and not torch.isnan(keys[closing]).any()
    want = _poisoned(pages.shape)
    pl.write(want, closing, layout.encode_latent(keys[closing], cfg, name))
    assert torch.equal(pages, want), f"{int((pages != want).sum())} bytes differ"


def test_bind_layer_carries_the_layout():
    cfg, page_size, rows = HCA_SMALL, 4, 32
    plan, kv, closing = _step(cfg, rows)
    p = make_params(cfg)
    pl = layout.latent_page_layout(cfg, page_size, "v41_new")
    pages, keys = _poisoned((8, pl.bytes_per_page)), _poisoned((rows, cfg.head_dim), torch.float32)
    state = torch.zeros(2, cfg.ring_rows(0), cfg.row_width)
    bound = ops.bind_layer(kind="hca", ape=p.ape, norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, state=state,
                           out_pages=pages, page_size=page_size, out_keys=keys, exact_fp8=True, layout="v41_new",
                           num_slots=2)  # fmt: skip
    assert bound.layout == "v41_new"
    bound.compress(kv, plan)
    want = _poisoned(pages.shape)
    pl.write(want, closing, layout.encode_latent(keys[closing], cfg, "v41_new"))
    assert torch.equal(pages, want)
    small = _poisoned((8, page_size * 528 // 4 - 1))  # a v4 page of H = 128 is larger than this
    with pytest.raises(OpError, match="bind_layer: out_pages pages hold"):
        ops.bind_layer(kind="hca", ape=p.ape, norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, state=state,
                       out_pages=small, page_size=page_size, layout="v41", num_slots=2)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(layout="v41_fp4"), "layout must be one of"),
        (dict(layout="v41", page_bytes=4 * 132 - 1), r"4 slots of 132 need 528"),
        (dict(layout="v41_new", page_bytes=4 * 132 - 1), r"4 slots of 132 need 528"),
        (dict(layout="uniform_fp8", page_bytes=4 * 128 - 1), r"4 slots of 128 need 512"),
        (dict(layout="v41", kind="indexer"), "the indexer's pages take layout='v4'"),
    ],
)
def test_refusals_change_nothing(kwargs, match):
    """A bad layout, pages too small for the layout's records, a layout for the indexer: an OpError before any
    launch, every buffer as it was."""
    kind = kwargs.pop("kind", "hca")
    cfg = INDEXER_CFG if kind == "indexer" else HCA_SMALL
    plan, kv, _ = _step(cfg, 32)
    p = make_params(cfg)
    pages = _poisoned((8, kwargs.pop("page_bytes", 4096)))
    state = torch.zeros(2, cfg.ring_rows(0), cfg.row_width)
    before = (pages.clone(), state.clone(), plan.clone())
    with pytest.raises(OpError, match=match):
        ops.compress(kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages, kind=kind, page_size=4, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, (pages, state, plan)))


def test_torch_library_takes_the_layout():
    """``torch.ops.dsv4c.compress`` (and the fake ``torch.compile`` traces with) take ``layout``."""
    schema = str(torch.ops.dsv4c.compress.default._schema)
    assert 'str layout="v4"' in schema
    for name in ("compress_pair", "compress_online_hca", "compress_from_hidden", "compress_online_hca_from_hidden"):
        assert 'str layout="v4"' in str(getattr(torch.ops.dsv4c, name).default._schema), name
