"""FP8 encodings and page layouts (SPEC section 4), checked byte for byte against an independent packer.

The packer here uses numpy bit manipulation and an explicit table of the 127 finite non-negative e4m3fn
values (round to nearest by comparing against exact midpoints, ties to the even code), so it shares no code
with ``layout``'s torch casts or the kernels' integer encoder.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.buffers import pack_args
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG

from dsv4_compressor import layout
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.pool import EntryPool
from dsv4_compressor.verify import check_indexer_fp8, check_latent_records

CSA = CompressorConfig.csa()
HCA = CompressorConfig.hca()


# ----------------------------------------------------------------------------------------------
# The independent packer
# ----------------------------------------------------------------------------------------------
def _e4m3_table() -> np.ndarray:
    """Values of the e4m3fn codes 0x00..0x7E (0x7F is NaN), exactly, as float64."""
    vals = []
    for b in range(0x7F):
        exp, man = b >> 3, b & 7
        vals.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    out = np.array(vals)
    assert out[-1] == 448.0 and np.all(np.diff(out) > 0)
    return out


E4M3 = _e4m3_table()
E4M3_MID = (E4M3[:-1] + E4M3[1:]) / 2  # exact in float64 (5 significant bits)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 values -> e4m3fn bytes: saturate at 448, round to nearest, ties to the even code."""
    x = np.asarray(x, dtype=np.float32)
    a = np.minimum(np.abs(x).astype(np.float64), 448.0)
    lo = np.searchsorted(E4M3, a, side="right") - 1  # E4M3[lo] <= a
    lo = np.minimum(lo, 0x7E)
    mid = E4M3_MID[np.minimum(lo, 0x7D)]
    up = (lo < 0x7E) & ((a > mid) | ((a == mid) & (lo % 2 == 1)))
    code = lo + up
    sign = np.signbit(x).astype(np.int64) << 7
    return (code | sign).astype(np.uint8)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 holding the nearest-even bfloat16 (integer arithmetic on the bits)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
    return (rounded & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def bf16_bytes(x: np.ndarray) -> np.ndarray:
    """Little-endian bytes of the nearest-even bf16 of float32 values, ``[..., 2 * n]``."""
    hi = (bf16_round(x).view(np.uint32) >> 16).astype("<u2")
    return hi.view(np.uint8).reshape(*hi.shape[:-1], -1)


def ceil_log2_f32(y: np.ndarray) -> np.ndarray:
    """Exact ``ceil(log2(y))`` of positive normal float32 values, from their bits."""
    bits = np.asarray(y, dtype=np.float32).view(np.uint32).astype(np.int64)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0)


def pack_latent_oracle(values: np.ndarray, cfg: CompressorConfig) -> np.ndarray:
    """The 584-byte record (SPEC section 4) of float32 ``[N, H]`` values."""
    values = np.asarray(values, dtype=np.float32)
    n, nope = values.shape[0], cfg.nope_dim
    out = np.zeros((n, cfg.entry_bytes), dtype=np.uint8)
    blocks = bf16_round(values[:, :nope]).reshape(n, -1, 64)
    amax = np.abs(blocks).max(axis=-1)
    quotient = np.maximum(amax, np.float32(1e-4)) / np.float32(448.0)  # float32 / float32 -> float32 (IEEE)
    assert quotient.dtype == np.float32
    e = ceil_log2_f32(quotient)
    scaled = blocks.astype(np.float64) * np.exp2(-e.astype(np.float64))[..., None]  # exact
    scaled = np.clip(scaled, -448.0, 448.0).astype(np.float32)
    out[:, :nope] = e4m3_encode(scaled).reshape(n, nope)
    out[:, nope : cfg.record_data_bytes] = bf16_bytes(values[:, nope:])
    out[:, cfg.record_data_bytes : cfg.record_data_bytes + cfg.fp8_blocks] = (e + 127).astype(np.uint8)
    return out


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def pack_indexer_oracle(keys: np.ndarray) -> np.ndarray:
    """The 132-byte indexer pack of float32 keys ``[N, 128]`` (bf16-rounded first)."""
    k = bf16_round(np.asarray(keys, dtype=np.float32)).astype(np.float64)
    h = k.shape[1]
    x = (k @ sylvester(h).T).astype(np.float32) * np.float32(h**-0.5)
    assert x.dtype == np.float32
    amax = np.abs(x).max(axis=1, keepdims=True)
    scale = np.maximum(amax, np.float32(1e-4)) / np.float32(448.0)
    q = np.clip(x / scale, np.float32(-448.0), np.float32(448.0))
    assert scale.dtype == q.dtype == np.float32
    return np.concatenate([e4m3_encode(q), scale.astype("<f4").view(np.uint8)], axis=1)


# ----------------------------------------------------------------------------------------------
# Test data
# ----------------------------------------------------------------------------------------------
def wide_values(n: int, h: int, seed: int) -> torch.Tensor:
    """Random values whose magnitudes vary across 64-blocks (2^-30 .. 2^30) and within them (20% of the
    elements another 2^-10 .. 2^10)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen)
    block = torch.randint(-30, 31, (n, -(-h // 64)), generator=gen).float()
    x *= torch.exp2(block).repeat_interleave(64, dim=1)[:, :h]
    spread = torch.randint(-10, 11, (n, h), generator=gen).float() * (torch.rand(n, h, generator=gen) < 0.2)
    return x * torch.exp2(spread)


#: Values whose fp8 encoding (at scale 2^0) lands just below a power of two: the interpreter's cast rounds
#: some of these down a whole binade (SPEC section 9: -31.46 -> -16 instead of -32).
NEAR_POW2 = [
    -31.46,
    31.9,
    -15.9,
    7.95,
    -3.99,
    1.999,
    -0.999,
    63.7,
    -127.9,
    255.5,
    0.0155,
    -0.01562,
    0.4999,
    0.0078,
    -0.00293,
]


def edge_records(cfg: CompressorConfig) -> torch.Tensor:
    """Hand-made entries: each nope block exercises one edge of the encoding."""
    nb, nope = cfg.fp8_blocks, cfg.nope_dim
    gen = torch.Generator().manual_seed(99)
    rows = []
    for k in (0, 3, -7, 12, -20):  # block scale 2^k set by a 448 * 2^k element
        v = torch.randn(cfg.head_dim, generator=gen)
        blocks = v[:nope].view(nb, 64)
        s = 2.0**k
        blocks[0, :] = torch.tensor((NEAR_POW2 * 5)[:64]) * s
        blocks[0, 0] = 448.0 * s
        if nb > 1:  # exact powers of two, and values around the e4m3 subnormal range
            blocks[1, :32] = (
                torch.exp2(torch.arange(-16, 16).float()) * s * torch.where(torch.arange(32) % 2 == 0, 1, -1)
            )
            blocks[1, 32:] = (
                torch.tensor([2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-7, 0.0, -(2.0**-9), 5 * 2.0**-11] * 5)[:32] * s
            )
            blocks[1, 40] = 448.0 * s
        if nb > 2:  # zeros in a block
            blocks[2, ::3] = 0.0
            blocks[2, 1] = -0.0
        if nb > 3:  # all tiny: amax below the 1e-4 floor
            blocks[3] = torch.randn(64, generator=gen) * 1e-6
            blocks[3, 5] = 9.99e-5
        if nb > 4:  # all zero block
            blocks[4] = 0.0
        if nb > 5:  # amax just above / below a power of two times 448
            blocks[5] = torch.randn(64, generator=gen)
            blocks[5, 0] = 448.0 * 2.0**k * 1.01
        if nb > 6:
            blocks[6] = torch.randn(64, generator=gen)
            blocks[6, 0] = -448.0 * 2.0**k * 0.99
        rows.append(v)
    return torch.stack(rows)


# ----------------------------------------------------------------------------------------------
# The oracle packer itself
# ----------------------------------------------------------------------------------------------
def test_oracle_e4m3_against_known_codes():
    cases = [
        (0.0, 0x00),
        (448.0, 0x7E),
        (500.0, 0x7E),
        (-448.0, 0xFE),
        (1.0, 0x38),
        (-2.0, 0xC0),
        (2.0**-9, 0x01),
        (2.0**-10, 0x00),  # tie between 0 and 2^-9 -> even code 0
        (3 * 2.0**-10, 0x02),  # tie between codes 1 and 2 -> 2
        (17.0, 0x58),  # tie between 16 (0x58) and 18 (0x59) -> 16
        (19.0, 0x5A),  # tie between 18 (0x59) and 20 (0x5A) -> 20
        (-31.46, 0xE0),  # -32
        (240.0, 0x77),
        (-0.0, 0x80),
    ]
    for x, code in cases:
        assert int(e4m3_encode(np.array([x]))[0]) == code, x


def test_oracle_e4m3_agrees_with_torch_cast_on_all_codes_and_midpoints():
    """A second opinion on the table encoder: torch's own cast, over every code and every midpoint +- 1 ulp."""
    pts = np.concatenate([E4M3, E4M3_MID, np.nextafter(E4M3_MID, 0), np.nextafter(E4M3_MID, 1000)]).astype(np.float32)
    pts = np.concatenate([pts, -pts])
    want = torch.from_numpy(pts).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(e4m3_encode(pts), want)


# ----------------------------------------------------------------------------------------------
# Latent records
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [CSA, HCA_SMALL], ids=lambda c: c.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_encode_latent_byte_exact_random(cfg, seed):
    x = wide_values(48, cfg.head_dim, seed)
    got = layout.encode_latent(x, cfg)
    assert got.dtype == torch.uint8 and got.shape == (48, cfg.entry_bytes)
    assert np.array_equal(got.numpy(), pack_latent_oracle(x.numpy(), cfg))


@pytest.mark.parametrize("cfg", [CSA, HCA_SMALL], ids=lambda c: c.name)
def test_encode_latent_byte_exact_edges(cfg):
    x = edge_records(cfg)
    want = pack_latent_oracle(x.numpy(), cfg)
    got = layout.encode_latent(x, cfg).numpy()
    assert np.array_equal(got, want)
    # the edges really are there: saturated 448 codes, subnormal codes, the 1e-4 floor, zero pad byte
    nope = cfg.nope_dim
    assert (got[:, :nope] & 0x7F == 0x7E).any()
    assert ((got[:, :nope] & 0x7F > 0) & (got[:, :nope] & 0x7F < 8)).any()
    if cfg.fp8_blocks > 3:
        floor_e = int(ceil_log2_f32(np.float32(1e-4) / np.float32(448.0)))
        assert floor_e == -22
        assert (got[:, cfg.record_data_bytes + 3] == 127 + floor_e).all()
    assert (got[:, cfg.record_data_bytes + cfg.fp8_blocks :] == 0).all()


def test_encode_latent_scale_exponent_is_exact_near_powers_of_two():
    """amax / 448 a few ulps above 2^k must give e = k + 1 (a rounded float log2 would say k)."""
    cfg = CSA
    x = torch.zeros(4, cfg.head_dim)
    gen = torch.Generator().manual_seed(5)
    x[:, : cfg.nope_dim] = torch.randn(4, cfg.nope_dim, generator=gen) * 0.1
    # bf16 values right above 448 * 2^k: 1.0078125 * 448 * 2^k = 451.5 * 2^k
    for i, k in enumerate((-3, 0, 2, 5)):
        x[i, 0] = 451.5 * 2.0**k
        x[i, 64] = 448.0 * 2.0**k
    got = layout.encode_latent(x, cfg)
    data = cfg.record_data_bytes
    for i, k in enumerate((-3, 0, 2, 5)):
        assert int(got[i, data]) == 127 + k + 1
        assert int(got[i, data + 1]) == 127 + k
    assert np.array_equal(got.numpy(), pack_latent_oracle(x.numpy(), cfg))


@pytest.mark.parametrize("cfg", [CSA, HCA_SMALL], ids=lambda c: c.name)
def test_decode_latent_round_trip_bound(cfg):
    x = torch.cat([wide_values(32, cfg.head_dim, 11), edge_records(cfg)])
    rec = layout.encode_latent(x, cfg)
    dec = layout.decode_latent(rec, cfg)
    assert dec.dtype == torch.float32 and dec.shape == x.shape
    nope = cfg.nope_dim
    # rope dims: exactly the bf16 values
    assert torch.equal(dec[:, nope:], x[:, nope:].to(torch.bfloat16).float())
    # nope: within half an fp8 ulp (at that block's scale) of the bf16 value
    xb = x[:, :nope].to(torch.bfloat16).double().view(x.shape[0], -1, 64)
    e = rec[:, cfg.record_data_bytes : cfg.record_data_bytes + cfg.fp8_blocks].long() - 127
    scale = torch.exp2(e.double())[..., None]
    a = (xb / scale).abs()
    assert float(a.max()) <= 448.0
    binade = torch.floor(torch.log2(a.clamp(min=2.0**-6))).clamp(min=-6)
    half_ulp = torch.exp2(binade - 3) / 2 * scale
    err = (dec[:, :nope].double().view_as(xb) - xb).abs()
    assert bool((err <= half_ulp).all()), float((err / half_ulp).max())
    # and the scale is the smallest power of two that fits amax into [-448, 448]
    amax = xb.abs().amax(-1).clamp(min=1e-4)
    assert bool((amax / torch.exp2(e.double()) <= 448.0 * (1 + 2**-20)).all())
    assert bool((amax / torch.exp2(e.double() - 1) > 448.0 * (1 - 2**-20)).all())


# ----------------------------------------------------------------------------------------------
# Pages
# ----------------------------------------------------------------------------------------------
def test_page_sizes():
    assert layout.latent_page_layout(CSA, 64).bytes_per_page == 37440
    assert layout.latent_page_layout(HCA, 2).bytes_per_page == 1728
    assert layout.indexer_fp8_page_layout(INDEXER_CFG, 64).bytes_per_page == 8448
    assert CSA.entry_bytes == HCA.entry_bytes == 584
    with pytest.raises(ValueError, match=r"^indexer: latent pages need latent output$"):
        layout.latent_page_layout(INDEXER_CFG, 64)
    with pytest.raises(ValueError, match=r"^csa: indexer pages need indexer output$"):
        layout.indexer_fp8_page_layout(CSA, 64)


@pytest.mark.parametrize("cfg,page_size", [(CSA, 64), (HCA, 2), (CSA, 3)], ids=["csa64", "hca2", "csa3"])
def test_latent_slot_offsets(cfg, page_size):
    lay = layout.latent_page_layout(cfg, page_size)
    bpp = lay.bytes_per_page
    assert bpp == -(-page_size * 584 // 576) * 576
    num_pages = 3
    pages = torch.full((num_pages, bpp), 0xA5, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(page_size)
    slots = torch.randperm(num_pages * page_size, generator=gen)[: max(1, num_pages * page_size // 2)]
    recs = torch.randint(0, 256, (len(slots), 584), generator=gen, dtype=torch.uint8)
    recs[recs == 0xA5] = 0x5A  # so a written byte never looks like poison
    lay.write(pages, slots, recs)
    flat = pages.view(-1).numpy()
    touched = np.zeros(flat.shape, dtype=bool)
    for slot, rec in zip(slots.tolist(), recs.numpy()):
        k, t = divmod(slot, page_size)
        d0 = k * bpp + t * 576
        s0 = k * bpp + page_size * 576 + t * 8
        assert np.array_equal(flat[d0 : d0 + 576], rec[:576])
        assert np.array_equal(flat[s0 : s0 + 8], rec[576:])
        touched[d0 : d0 + 576] = True
        touched[s0 : s0 + 8] = True
    assert (flat[~touched] == 0xA5).all()
    assert touched.sum() == 584 * len(slots)
    assert torch.equal(lay.read(pages, slots), recs)


def test_indexer_fp8_slot_offsets():
    lay = layout.indexer_fp8_page_layout(INDEXER_CFG, 64)
    pages = torch.full((2, 8448), 0xA5, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([0, 63, 64, 100, 127, 5])
    recs = torch.randint(0, 256, (6, 132), generator=gen, dtype=torch.uint8)
    recs[recs == 0xA5] = 0x5A
    lay.write(pages, slots, recs)
    flat = pages.view(-1).numpy()
    touched = np.zeros(flat.shape, dtype=bool)
    for slot, rec in zip(slots.tolist(), recs.numpy()):
        k, t = divmod(slot, 64)
        d0, s0 = k * 8448 + t * 128, k * 8448 + 64 * 128 + t * 4
        assert np.array_equal(flat[d0 : d0 + 128], rec[:128])
        assert np.array_equal(flat[s0 : s0 + 4], rec[128:])
        touched[d0 : d0 + 128] = touched[s0 : s0 + 4] = True
    assert (flat[~touched] == 0xA5).all()


# ----------------------------------------------------------------------------------------------
# Indexer FP8 pack
# ----------------------------------------------------------------------------------------------
def test_sylvester_matches_layout_hadamard():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16).double()  # bf16 values: both sums are exact
    assert torch.equal(layout.hadamard(x), x @ torch.from_numpy(sylvester(128)).T)
    assert sylvester(4).tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]


@pytest.mark.parametrize("seed", [0, 1])
def test_encode_indexer_fp8_byte_exact(seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(64, 128, generator=gen) * torch.exp2(torch.randint(-12, 8, (64, 1), generator=gen).float())
    keys[0] = 0.0  # amax floor
    keys[1] = torch.randn(128, generator=gen) * 1e-7
    keys[2, :] = 0.0
    keys[2, 0] = 3.0  # a one-hot key: every Hadamard output is +-3/sqrt(128)
    got = layout.encode_indexer_fp8(keys)
    assert got.dtype == torch.uint8 and got.shape == (64, 132)
    assert np.array_equal(got.numpy(), pack_indexer_oracle(keys.numpy()))
    # bf16 keys give the same bytes as their float32 values
    assert torch.equal(layout.encode_indexer_fp8(keys.to(torch.bfloat16)), got)
    # scale bytes are a little-endian float32
    s = got[3, 128:].numpy().view("<f4")[0]
    dec = layout.decode_indexer_fp8(got)
    assert dec[3].abs().max().item() == pytest.approx(448.0 * s, rel=0.07)


# ----------------------------------------------------------------------------------------------
# The kernels' encoder under the Triton interpreter (SPEC section 9)
# ----------------------------------------------------------------------------------------------
def _two_hot_keys() -> torch.Tensor:
    """Indexer keys ``a e_0 + b e_1`` (integers, exact in bf16): their Hadamard outputs are ``+-(a + b)`` and
    ``+-(a - b)``, so the FP8 value of the smaller one is ``448 (a - b) / (a + b)``; ``a, b`` are picked so that
    it lies just below a power of two (2 .. 256) and rounds up to it."""
    rows = []
    for k in range(1, 9):
        target, best = 2.0**k, None
        for a in range(2, 257):
            for b in range(1, a):
                q = 448.0 * (a - b) / (a + b)
                lower = target - 2.0 ** (k - 1 - 3) / 2  # the midpoint below 2^k: above it rounds up
                if lower < q < target and (best is None or q > best[0]):
                    best = (q, a, b)
        _, a, b = best
        key = torch.zeros(128)
        key[0], key[1] = a, b
        rows.append(-key if k % 2 else key)
    return torch.stack(rows)


def _interp_values(cfg: CompressorConfig) -> torch.Tensor:
    if cfg.output == "latent":
        x = torch.cat([wide_values(24, cfg.head_dim, 21), edge_records(cfg)])
    else:
        gen = torch.Generator().manual_seed(21)
        x = torch.randn(24, cfg.head_dim, generator=gen) * torch.exp2(
            torch.randint(-8, 6, (24, 1), generator=gen).float()
        )
        x = torch.cat([x, _two_hot_keys(), 2.0**-5 * _two_hot_keys()])
    # rows whose scaled values sit just below powers of two at several scales (the interpreter's cast trap)
    extra = []
    for k in (0, -4, 3):
        v = torch.tensor((NEAR_POW2 * 40)[: cfg.head_dim]) * 2.0**k
        v[0] = 448.0 * 2.0**k
        extra.append(v)
    return torch.cat([x, torch.stack(extra)]).float().contiguous()


@pytest.mark.parametrize("cfg", [CSA, HCA_SMALL], ids=lambda c: c.name)
def test_pack_values_kernel_byte_exact_latent(cfg):
    from dsv4_compressor.kernels.entry_pack import pack_values

    x = _interp_values(cfg)
    n = x.shape[0]
    pool = EntryPool(cfg, max_requests=1, max_entries=n + 5, page_size=cfg.default_page_size, device="cpu")
    pool.pages.fill_(0xA5)
    gen = torch.Generator().manual_seed(4)
    slots = torch.randperm(pool.num_pages * pool.page_size, generator=gen)[:n]
    pack_values(x, slots, *pack_args(pool, exact_fp8=True))
    got = pool.layout.read(pool.pages, slots)
    want = layout.encode_latent(x, cfg)
    assert np.array_equal(want.numpy(), pack_latent_oracle(x.numpy(), cfg))
    bad = (got != want).nonzero()
    assert len(bad) == 0, f"{len(bad)} bytes differ, first at {bad[:5].tolist()}"
    # nothing outside the records was written
    touched = torch.zeros_like(pool.pages.view(-1), dtype=torch.bool)
    touched[pool.layout._byte_index(slots).reshape(-1)] = True
    assert bool((pool.pages.view(-1)[~touched] == 0xA5).all())


def test_pack_values_kernel_byte_exact_indexer():
    """The kernels' indexer encoder: bf16 keys equal a torch cast; FP8 packs equal ``layout.encode_indexer_fp8``
    (and the independent packer) byte for byte wherever the Hadamard sums are exact in float32 (integer keys:
    the two-hot keys whose FP8 values sit just below powers of two, and dyadic keys), so the summation order
    cannot matter; on the other keys every byte is explained by ``verify`` (the float32 sums may differ from
    the reference's in their last bit, moving a value across a rounding boundary) and nearly all are equal."""
    from dsv4_compressor.kernels.entry_pack import pack_values

    cfg = INDEXER_CFG
    gen = torch.Generator().manual_seed(22)
    dyadic = (torch.randint(-64, 65, (8, cfg.head_dim), generator=gen).float() / 8) * torch.exp2(
        torch.randint(-6, 6, (8, 1), generator=gen).float()
    )
    exact_rows = torch.cat([_two_hot_keys(), 2.0**-5 * _two_hot_keys(), dyadic])
    x = torch.cat([exact_rows, _interp_values(cfg)]).contiguous()
    n, n_exact = x.shape[0], exact_rows.shape[0]
    pool = EntryPool(cfg, max_requests=1, max_entries=2 * n + 2, page_size=64, device="cpu")
    pool.fp8_pages.fill_(0xA5)
    pool.keys.view(torch.uint8).fill_(0xA5)
    slots = torch.arange(n) * 2 + 1
    pack_values(x, slots, *pack_args(pool, exact_fp8=True))
    assert torch.equal(pool.keys[slots], x.to(torch.bfloat16))
    others = torch.ones(pool.keys.shape[0], dtype=torch.bool)
    others[slots] = False
    assert bool((pool.keys[others].view(torch.uint8) == 0xA5).all()), "key rows outside the slots were written"
    got = pool.fp8_layout.read(pool.fp8_pages, slots)
    want = layout.encode_indexer_fp8(x)
    assert np.array_equal(want.numpy(), pack_indexer_oracle(x.numpy()))
    bad = (got[:n_exact] != want[:n_exact]).nonzero()
    assert len(bad) == 0, f"exact-sum keys: {len(bad)} bytes differ, first at {bad[:5].tolist()}"
    rep = check_indexer_fp8(got, x.to(torch.bfloat16))
    assert rep.ok and rep.exact_fraction >= 0.99, str(rep)
    touched = torch.zeros_like(pool.fp8_pages.view(-1), dtype=torch.bool)
    touched[pool.fp8_layout._byte_index(slots).reshape(-1)] = True
    assert bool((pool.fp8_pages.view(-1)[~touched] == 0xA5).all()), "FP8 bytes outside the slots were written"


# ----------------------------------------------------------------------------------------------
# verify.check_latent_records
# ----------------------------------------------------------------------------------------------
def _verify_case():
    cfg = CSA_SMALL
    gen = torch.Generator().manual_seed(17)
    values = torch.randn(6, cfg.head_dim, generator=gen, dtype=torch.float64) * 1.3
    return cfg, values, layout.encode_latent(values.float(), cfg)


def test_verify_accepts_exact_encoding():
    cfg, values, rec = _verify_case()
    rep = check_latent_records(rec, values, cfg)
    assert rep.ok and rep.exact_bytes == rep.total_bytes == rec.numel(), str(rep)


@pytest.mark.parametrize(
    "where,mask",
    [
        ("fp8", 0x01),
        ("fp8", 0x08),
        ("fp8", 0x40),
        ("fp8-nan", None),
        ("rope-lo", 0x01),
        ("rope-hi", 0x80),
        ("scale", 0x01),
        ("scale", 0x04),
        ("pad", 0x01),
        ("pad", 0x80),
    ],
)
def test_verify_rejects_single_corruptions(where, mask):
    cfg, values, rec = _verify_case()
    nope, data = cfg.nope_dim, cfg.record_data_bytes
    for row in range(rec.shape[0]):
        bad = rec.clone()
        if where == "fp8":
            col = 7 + row
            assert bad[row, col] & 0x7F != 0  # flipping the sign of a zero would be a legal -0
        elif where == "fp8-nan":
            col = 3 * row + 1
            bad[row, col] = 0x7F
            mask = 0
        elif where == "rope-lo":
            col = nope + 2 * row
        elif where == "rope-hi":
            col = nope + 2 * row + 1
        elif where == "scale":
            col = data + row % cfg.fp8_blocks
        else:
            col = data + cfg.fp8_blocks + row % (cfg.record_scale_bytes - cfg.fp8_blocks)
        bad[row, col] ^= mask
        assert not torch.equal(bad, rec)
        rep = check_latent_records(bad, values, cfg)
        assert not rep.ok, f"{where} byte {col} of record {row} flipped by {mask:#x} was accepted: {rep}"


def test_verify_abs_tol_widens_the_floor_by_what_it_says():
    """An FP8 byte one code past the reference's: accepted exactly when the boundary between the two codes lies
    within ``abs_tol`` RMS of the float64 value (here 1e-2 RMS away, beyond the bf16 rounding the V4 record applies
    first: rejected at the default floor and at 2e-3, accepted at 2e-2)."""
    cfg, values, rec = _verify_case()
    e = int(rec[0, cfg.record_data_bytes]) - 127  # block 0's UE8M0 exponent
    block = values[0, : layout.FP8_BLOCK].abs()
    col = int(torch.nonzero((block < block.max() / 2) & (block > block.max() / 8))[0])
    code = int(rec[0, col])
    mag = lambda c: float(torch.tensor([c & 0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn).float()) * 2.0**e
    boundary = (mag(code) + mag(code + 1)) / 2  # between the value's code and the next one up in magnitude
    rms = float(values[0].pow(2).mean().sqrt())
    ref = values.clone()
    ref[0, col] = torch.sign(values[0, col]) * (boundary - 1e-2 * rms)
    assert torch.equal(layout.encode_latent(ref.float(), cfg), rec)  # still the same record
    bad = rec.clone()
    bad[0, col] = code + 1
    assert not check_latent_records(bad, ref, cfg).ok
    assert not check_latent_records(bad, ref, cfg, abs_tol=2e-3).ok
    assert check_latent_records(bad, ref, cfg, abs_tol=2e-2).ok


@pytest.mark.parametrize("where", ["fp8-step", "fp8-sign", "scale-bit"])
def test_verify_indexer_fp8_rejects_single_corruptions(where):
    """check_indexer_fp8 allows the transform's float32 summation error, and nothing more: the next FP8 value,
    a flipped sign or a scale off by a mantissa bit in any one pack is reported."""
    gen = torch.Generator().manual_seed(23)
    keys = (torch.randn(6, 128, generator=gen) * 1.7).to(torch.bfloat16)
    packs = layout.encode_indexer_fp8(keys.float())
    assert check_indexer_fp8(packs, keys).ok
    for row in range(packs.shape[0]):
        bad = packs.clone()
        col = 5 + 11 * row
        if where == "fp8-step":
            bad[row, col] = bad[row, col] + (1 if bad[row, col] & 0x7F < 0x7E else -1)
        elif where == "fp8-sign":
            if bad[row, col] & 0x7F == 0:
                col += 1
            bad[row, col] ^= 0x80
        else:
            bad[row, 128 + 2] ^= 0x01  # the scale (float32): its mantissa bit 16, a change of 2**-7
        rep = check_indexer_fp8(bad, keys)
        assert not rep.ok, f"{where} in pack {row} (byte {col}) was accepted: {rep}"


def test_empty_inputs():
    empty = torch.zeros(0, CSA.head_dim)
    rec = layout.encode_latent(empty, CSA)
    assert rec.shape == (0, 584) and rec.dtype == torch.uint8
    assert layout.decode_latent(rec, CSA).shape == (0, 512)
    pack = layout.encode_indexer_fp8(torch.zeros(0, 128))
    assert pack.shape == (0, 132) and pack.dtype == torch.uint8
    assert layout.encode_indexer_fp8(torch.zeros(0, 128, dtype=torch.bfloat16)).shape == (0, 132)
    assert layout.decode_indexer_fp8(pack).shape == (0, 128)
