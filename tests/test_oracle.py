"""An independent token-by-token oracle of SPEC section 3 (plain Python floats), against ``reference``.

The oracle below is written from the SPEC text alone: for every group, every channel, a softmax over the
window positions of ``score + ape[p % r]``, the weighted sum of ``kv``, RMSNorm, then interleaved rope at the
group start. It does not use ``dsv4_compressor.reference`` or torch math.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_params, random_rows

from dsv4_compressor import reference
from dsv4_compressor.config import CompressorConfig, CompressorParams
from dsv4_compressor.rope import YarnScaling, rope_tables


def oracle_entries(rows: torch.Tensor, params: CompressorParams, cfg: CompressorConfig) -> list[list[float]]:
    """Entries of groups ``0..L//r - 1`` of the rows ``[L, 2W]`` of positions ``0..L-1``, in float64."""
    r, h, rd = cfg.ratio, cfg.head_dim, cfg.rope_dim
    w = h * (2 if cfg.overlap else 1)
    x = rows.double().tolist()
    ape = params.ape.double().tolist()
    nw = params.norm_weight.double().tolist()
    cos = params.cos.double().tolist()
    sin = params.sin.double().tolist()
    eps = float(params.eps)
    out = []
    for g in range(len(x) // r):
        s = g * r
        # (position, column of its kv half, column of its gate half within [0, W))
        window = []
        if cfg.overlap:
            window += [(p, 0, 0) for p in range(s - r, s) if p >= 0]  # previous-group halves [0, H)
            window += [(p, h, h) for p in range(s, s + r)]  # current-group halves [H, 2H)
        else:
            window += [(p, 0, 0) for p in range(s, s + r)]
        c = []
        for d in range(h):
            logits = [x[p][w + sc + d] + ape[p % r][sc + d] for p, _, sc in window]
            m = max(logits)
            e = [math.exp(v - m) for v in logits]
            z = math.fsum(e)
            c.append(math.fsum(ej * x[p][kc + d] for ej, (p, kc, _) in zip(e, window)) / z)
        inv = 1.0 / math.sqrt(math.fsum(v * v for v in c) / h + eps)
        n = [c[d] * inv * nw[d] for d in range(h)]
        for k in range(rd // 2):
            i = h - rd + 2 * k
            cs, sn = cos[s][k], sin[s][k]
            xv, yv = n[i], n[i + 1]
            n[i], n[i + 1] = xv * cs - yv * sn, yv * cs + xv * sn
        out.append(n)
    return out


def _oracle(rows, params, cfg) -> torch.Tensor:
    return torch.tensor(oracle_entries(rows, params, cfg), dtype=torch.float64).reshape(-1, cfg.head_dim)


def _assert_f32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 math vs the float64 oracle: within 1e-4 relative, plus 1e-5 of the entry's RMS."""
    rms = want.pow(2).mean(dim=-1, keepdim=True).sqrt()
    err = (got.double() - want).abs()
    bound = 1e-4 * want.abs() + 1e-5 * rms
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}, worst ratio {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("cfg", [HCA_SMALL, CSA_SMALL, INDEXER_CFG], ids=lambda c: c.name)
@pytest.mark.parametrize("length_groups,extra", [(1, 0), (3, 0), (4, 3)])
def test_reference_matches_oracle(cfg, length_groups, extra):
    gen = torch.Generator().manual_seed(1000 + 10 * length_groups + extra + cfg.ratio)
    params = make_params(cfg, seed=7 + length_groups, max_positions=64)
    length = length_groups * cfg.ratio + extra
    rows = random_rows(length, cfg, gen)
    want = _oracle(rows, params, cfg)
    assert want.shape == (length_groups, cfg.head_dim)
    got64 = reference.compress_sequence(rows, params, cfg, dtype=torch.float64)
    assert got64.dtype == torch.float64 and got64.shape == want.shape
    assert float((got64 - want).abs().max()) < 1e-10
    got32 = reference.compress_sequence(rows, params, cfg, dtype=torch.float32)
    assert got32.dtype == torch.float32
    _assert_f32_close(got32, want)


def test_reference_matches_oracle_real_hca_shape():
    cfg = CompressorConfig.hca()
    gen = torch.Generator().manual_seed(4242)
    params = make_params(cfg, seed=3, max_positions=512)
    rows = random_rows(2 * cfg.ratio + 5, cfg, gen)
    want = _oracle(rows, params, cfg)
    assert want.shape == (2, 512)
    got64 = reference.compress_sequence(rows, params, cfg, dtype=torch.float64)
    assert float((got64 - want).abs().max()) < 1e-10
    _assert_f32_close(reference.compress_sequence(rows, params, cfg), want)


@pytest.mark.parametrize("cfg", [CSA_SMALL, INDEXER_CFG], ids=lambda c: c.name)
def test_first_overlap_group_has_no_previous_group(cfg):
    """Entry 0 pools only positions 0..r-1 (current halves); the previous-group halves of those rows feed
    entry 1 only."""
    gen = torch.Generator().manual_seed(77)
    params = make_params(cfg, seed=1, max_positions=64)
    r, h, w = cfg.ratio, cfg.head_dim, cfg.width
    rows = random_rows(2 * r, cfg, gen)
    base = reference.compress_sequence(rows, params, cfg, dtype=torch.float64)
    # Entry 0 from the SPEC's g = 0 rule, written out directly: softmax over 4 positions of the [H, 2H) halves.
    logits = rows[:r, w + h :].double() + params.ape[:r, h:].double()
    kv = rows[:r, h:w].double()
    c = (torch.softmax(logits, dim=0) * kv).sum(dim=0)
    want0 = _oracle(rows, params, cfg)[0]
    n = c / math.sqrt(float((c * c).mean()) + params.eps) * params.norm_weight.double()
    assert float((n[: h - cfg.rope_dim] - want0[: h - cfg.rope_dim]).abs().max()) < 1e-12
    # Changing the previous-group halves of group 0's rows changes entry 1 but not entry 0.
    changed = rows.clone()
    changed[:r, :h] = random_rows(r, cfg, gen)[:, :h]
    changed[:r, w : w + h] = random_rows(r, cfg, gen)[:, w : w + h]
    after = reference.compress_sequence(changed, params, cfg, dtype=torch.float64)
    assert torch.equal(after[0], base[0])
    assert float((after[1] - base[1]).abs().max()) > 1e-3
    # And the oracle agrees on both.
    assert float((_oracle(changed, params, cfg) - after).abs().max()) < 1e-10


@pytest.mark.parametrize("cfg", [HCA_SMALL, CSA_SMALL], ids=lambda c: c.name)
def test_ape_row_is_chosen_by_position(cfg):
    """Perturbing ape[k, col] changes pooled channel col % H only, and only in entries whose window holds,
    in that half, a position p with p % r == k."""
    gen = torch.Generator().manual_seed(31)
    params = make_params(cfg, seed=5, max_positions=64)
    r, h = cfg.ratio, cfg.head_dim
    groups = 4
    rows = random_rows(groups * r, cfg, gen)
    _, pooled = reference.compress_sequence(rows, params, cfg, dtype=torch.float64, return_pooled=True)
    cols = [3, h + 9] if cfg.overlap else [3, h - 2]
    for k in (0, r - 1, r // 2):
        for col in cols:
            bumped = CompressorParams(params.ape.clone(), params.norm_weight, params.cos, params.sin, params.eps)
            bumped.ape[k, col] += 2.0
            values, pooled2 = reference.compress_sequence(rows, bumped, cfg, dtype=torch.float64, return_pooled=True)
            assert float((values - _oracle(rows, bumped, cfg)).abs().max()) < 1e-10
            diff = (pooled2 - pooled).abs()
            ch = col % h
            others = torch.ones(h, dtype=torch.bool)
            others[ch] = False
            assert float(diff[:, others].max()) == 0.0
            # previous-group half (overlap, col < H) is absent from entry 0; every other window holds each residue
            expect_changed = [not (cfg.overlap and col < h and g == 0) for g in range(groups)]
            assert [bool(diff[g, ch] > 1e-9) for g in range(groups)] == expect_changed, (k, col)


def test_rope_rotates_at_group_start():
    """Rope uses the table row of the group start s = g*r: changing any other row changes nothing."""
    cfg = HCA_SMALL
    gen = torch.Generator().manual_seed(12)
    params = make_params(cfg, seed=2, max_positions=64)
    rows = random_rows(3 * cfg.ratio, cfg, gen)
    base = reference.compress_sequence(rows, params, cfg, dtype=torch.float64)
    cos, sin = params.cos.clone(), params.sin.clone()
    starts = {0, 8, 16}
    for p in range(24):
        if p not in starts:
            cos[p] = torch.rand(cos.shape[1], generator=gen)
            sin[p] = torch.rand(sin.shape[1], generator=gen)
    other = CompressorParams(params.ape, params.norm_weight, cos, sin, params.eps)
    assert torch.equal(reference.compress_sequence(rows, other, cfg, dtype=torch.float64), base)
    cos[8] = torch.rand(cos.shape[1], generator=gen)
    moved = reference.compress_sequence(rows, other, cfg, dtype=torch.float64)
    nope = cfg.nope_dim
    assert torch.equal(moved[[0, 2]], base[[0, 2]])
    assert torch.equal(moved[1, :nope], base[1, :nope])
    assert float((moved[1, nope:] - base[1, nope:]).abs().max()) > 1e-3


# ----------------------------------------------------------------------------------------------
# Rope tables (SPEC section 1)
# ----------------------------------------------------------------------------------------------
def _yarn_inv_freq_oracle(d, base, factor, l0, beta_fast, beta_slow) -> list[float]:
    inv = [base ** (-2.0 * i / d) for i in range(d // 2)]

    def corr(n):
        return d * math.log(l0 / (2 * math.pi * n)) / (2 * math.log(base))

    low = min(max(math.floor(corr(beta_fast)), 0), d - 1)
    high = min(max(math.ceil(corr(beta_slow)), 0), d - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(d // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(inv[i] / factor * ramp + inv[i] * (1 - ramp))
    return out


def test_deepseek_yarn_correction_range():
    d, base = 64, 160000.0

    def corr(n):
        return d * math.log(65536 / (2 * math.pi * n)) / (2 * math.log(base))

    assert (math.floor(corr(32)), math.ceil(corr(1))) == (15, 25)


POSITIONS = [0, 1, 2, 3, 127, 4096, 65535, 65536, 65537, 300_001, 1_000_000, 1_048_575]


@pytest.mark.parametrize("yarn", [None, YarnScaling()], ids=["plain", "yarn"])
def test_rope_tables_against_formula(yarn):
    d, base = 64, 160000.0
    cos, sin = rope_tables(d, 1_048_576, base=base, yarn=yarn)
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == sin.shape == (1_048_576, 32)
    if yarn is None:
        inv = [base ** (-2.0 * i / d) for i in range(d // 2)]
    else:
        inv = _yarn_inv_freq_oracle(d, base, 16.0, 65536, 32.0, 1.0)
    for p in POSITIONS:
        want_c = torch.tensor([math.cos(p * f) for f in inv], dtype=torch.float64)
        want_s = torch.tensor([math.sin(p * f) for f in inv], dtype=torch.float64)
        # float32 storage of a float64 value in [-1, 1]: at most half an ulp (2^-25) off
        assert float((cos[p].double() - want_c).abs().max()) <= 2.0**-25, p
        assert float((sin[p].double() - want_s).abs().max()) <= 2.0**-25, p


def test_yarn_differs_from_plain_only_in_low_frequencies():
    inv_y = _yarn_inv_freq_oracle(64, 160000.0, 16.0, 65536, 32.0, 1.0)
    inv_p = [160000.0 ** (-2.0 * i / 64) for i in range(32)]
    # dims below the beta_fast correction dim (15) keep the plain frequency; from beta_slow's (25) on, / 16
    assert all(inv_y[i] == inv_p[i] for i in range(16))
    assert all(abs(inv_y[i] - inv_p[i] / 16) <= 1e-15 * inv_p[i] for i in range(25, 32))
    assert all(inv_p[i] / 16 < inv_y[i] < inv_p[i] for i in range(16, 25))
    _, cy = rope_tables(64, 2, yarn=YarnScaling())  # sin(p * inv) ~ p * inv: tells frequencies apart
    _, cp = rope_tables(64, 2, yarn=None)
    assert torch.equal(cy[1, :16], cp[1, :16])
    assert bool((cy[1, 16:] != cp[1, 16:]).all())


@pytest.mark.parametrize("cfg", [HCA_SMALL, CSA_SMALL, INDEXER_CFG], ids=lambda c: c.name)
def test_sequences_shorter_than_a_group(cfg):
    """No complete group yet: no entries (and no error), in both precisions; a trailing partial group is
    ignored."""
    gen = torch.Generator().manual_seed(3)
    params = make_params(cfg, seed=4, max_positions=64)
    for length in (0, 1, cfg.ratio - 1):
        rows = random_rows(length, cfg, gen)
        for dtype in (torch.float32, torch.float64):
            out = reference.compress_sequence(rows, params, cfg, dtype=dtype)
            assert out.shape == (0, cfg.head_dim) and out.dtype == dtype
    rows = random_rows(2 * cfg.ratio - 1, cfg, gen)
    full = reference.compress_sequence(rows, params, cfg, dtype=torch.float64)
    assert full.shape == (1, cfg.head_dim)
    assert torch.equal(full, reference.compress_sequence(rows[: cfg.ratio], params, cfg, dtype=torch.float64))


@pytest.mark.parametrize(
    "scaling",
    [
        YarnScaling(),
        YarnScaling(factor=4.0, original_max_positions=4096, beta_fast=32.0, beta_slow=1.0),
        YarnScaling(factor=8.0, original_max_positions=65536, beta_fast=1e6, beta_slow=1e-6),  # both clamps bind
        YarnScaling(factor=2.0, original_max_positions=65536, beta_fast=4.0, beta_slow=4.0),  # low == high
    ],
)
def test_yarn_inv_freq_against_formula(scaling):
    from dsv4_compressor.rope import yarn_inv_freq

    for d in (64, 16):
        got = yarn_inv_freq(d, 160000.0, scaling)
        want = _yarn_inv_freq_oracle(
            d, 160000.0, scaling.factor, scaling.original_max_positions, scaling.beta_fast, scaling.beta_slow
        )
        assert got.dtype == torch.float64
        assert float((got - torch.tensor(want, dtype=torch.float64)).abs().max()) <= 1e-15 * max(want)
