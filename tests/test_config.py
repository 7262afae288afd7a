"""CompressorConfig derived sizes and validation (SPEC sections 1, 4, 6)."""

from __future__ import annotations

import pytest
import torch
from helpers.inputs import CSA_SMALL, HCA_SMALL, SMALL_KINDS, bad_params, make_params

from dsv4_compressor.config import INDEXER, LATENT, CompressorConfig, CompressorParams
from dsv4_compressor.rope import rope_tables

HCA = CompressorConfig.hca()
CSA = CompressorConfig.csa()
IDX = CompressorConfig.indexer()


def test_deepseek_kinds():
    assert (HCA.ratio, HCA.head_dim, HCA.rope_dim, HCA.overlap, HCA.output) == (128, 512, 64, False, LATENT)
    assert (CSA.ratio, CSA.head_dim, CSA.rope_dim, CSA.overlap, CSA.output) == (4, 512, 64, True, LATENT)
    assert (IDX.ratio, IDX.head_dim, IDX.rope_dim, IDX.overlap, IDX.output) == (4, 128, 64, True, INDEXER)
    assert IDX.indexer_fp8 and not CompressorConfig.indexer(fp8=False).indexer_fp8


def test_widths_and_windows():
    assert (HCA.width, HCA.row_width, HCA.window) == (512, 1024, 128)
    assert (CSA.width, CSA.row_width, CSA.window) == (1024, 2048, 8)
    assert (IDX.width, IDX.row_width, IDX.window) == (256, 512, 8)
    assert (HCA_SMALL.width, HCA_SMALL.row_width, HCA_SMALL.window) == (128, 256, 8)
    assert (CSA_SMALL.width, CSA_SMALL.row_width, CSA_SMALL.window) == (256, 512, 8)


def test_entry_bytes():
    for cfg in (HCA, CSA):
        assert cfg.nope_dim == 448 and cfg.fp8_blocks == 7
        assert cfg.record_data_bytes == 576 and cfg.record_scale_bytes == 8
        assert cfg.entry_bytes == 584
    assert IDX.entry_bytes == 256 and IDX.indexer_fp8_bytes == 132
    assert HCA_SMALL.entry_bytes == 64 + 128 + 8
    # a wide latent needs more than 8 scale bytes: next power of two
    wide = CompressorConfig(ratio=4, head_dim=64 * 9 + 64, rope_dim=64, overlap=False)
    assert wide.fp8_blocks == 9 and wide.record_scale_bytes == 16


def test_ring_rows():
    assert HCA.ring_rows(3) == 132 and HCA.ring_bytes(3) == 132 * 1024 * 4 == 528 * 1024
    assert [HCA.ring_rows(m) for m in range(6)] == [128, 132, 132, 132, 132, 136]
    assert [CSA.ring_rows(m) for m in range(4)] == [8, 9, 10, 11]
    assert [IDX.ring_rows(m) for m in range(4)] == [8, 9, 10, 11]
    assert CSA.ring_bytes(3) == 11 * 2048 * 4
    assert [HCA_SMALL.ring_rows(m) for m in (0, 1, 3, 4, 5)] == [8, 12, 12, 12, 16]
    # 256 requests at mtp 3: about 139 MB per HCA layer (SPEC section 8)
    assert 256 * HCA.ring_bytes(3) == 138_412_032
    with pytest.raises(ValueError, match="-1"):
        HCA.ring_rows(-1)


def test_default_page_sizes():
    assert CSA.default_page_size == 64 and IDX.default_page_size == 64 and HCA.default_page_size == 2
    assert HCA_SMALL.default_page_size == 32 and CSA_SMALL.default_page_size == 64


def test_group_start_and_describe():
    assert [HCA.group_start(g) for g in range(3)] == [0, 128, 256]
    assert "r=4" in CSA.describe() and "overlap" in CSA.describe()


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(ratio=0, head_dim=128, rope_dim=64, overlap=False), "ratio"),
        (dict(ratio=4, head_dim=128, rope_dim=63, overlap=False), "rope_dim=63"),
        (dict(ratio=4, head_dim=128, rope_dim=-2, overlap=False), "rope_dim=-2"),
        (dict(ratio=4, head_dim=128, rope_dim=130, overlap=False), "rope_dim=130"),
        (dict(ratio=4, head_dim=100, rope_dim=64, overlap=False), "36"),  # nope 36: not a multiple of 64
        (dict(ratio=4, head_dim=128, rope_dim=64, overlap=False, output="dense"), "dense"),
        (dict(ratio=4, head_dim=96, rope_dim=32, overlap=True, output=INDEXER, indexer_fp8=True), "96"),
        (dict(ratio=4, head_dim=128, rope_dim=64, overlap=False, indexer_fp8=True), "indexer_fp8"),
    ],
)
def test_config_validation(kwargs, needle):
    with pytest.raises(ValueError) as info:
        CompressorConfig(**kwargs, name="bad_kind")
    assert needle in str(info.value) and "bad_kind" in str(info.value)


def test_config_accepts_edge_shapes():
    CompressorConfig(ratio=1, head_dim=64, rope_dim=0, overlap=False)
    CompressorConfig(ratio=4, head_dim=96, rope_dim=32, overlap=True, output=INDEXER, indexer_fp8=False)


@pytest.mark.parametrize("kind", ["hca_small", "csa_small", "indexer"])
def test_params_validate(kind):
    cfg = SMALL_KINDS[kind]
    params = make_params(cfg, seed=8, max_positions=32)
    assert params.validate(cfg) is params
    bf16 = make_params(cfg, seed=8, max_positions=32, norm_dtype=torch.bfloat16)
    assert bf16.norm_weight.dtype == torch.bfloat16 and bf16.validate(cfg) is bf16
    for name, bad, needles in bad_params(cfg, params):
        with pytest.raises(ValueError) as info:
            bad.validate(cfg)
        message = str(info.value)
        assert cfg.name in message, f"{name}: {message}"
        for needle in needles:
            assert needle in message, f"{name}: {needle!r} not in {message!r}"


def test_params_random():
    for cfg in (HCA, CSA, IDX):
        p = CompressorParams.random(cfg, max_positions=300, seed=4)
        assert p.ape.shape == (cfg.ratio, cfg.width) and p.ape.dtype == torch.float32
        assert p.norm_weight.shape == (cfg.head_dim,) and p.norm_weight.dtype == torch.float32
        assert p.cos.shape == p.sin.shape == (300, 32) and p.max_positions == 300
        assert p.eps == 1e-6
        cos, sin = rope_tables(64, 300)  # DeepSeek YaRN by default
        assert torch.equal(p.cos, cos) and torch.equal(p.sin, sin)
        assert float(p.ape.std()) == pytest.approx(0.5, rel=0.2)
    a = CompressorParams.random(CSA, max_positions=8, seed=1)
    b = CompressorParams.random(CSA, max_positions=8, seed=1)
    c = CompressorParams.random(CSA, max_positions=8, seed=2)
    assert torch.equal(a.ape, b.ape) and not torch.equal(a.ape, c.ape)
    plain = CompressorParams.random(CSA, max_positions=8, yarn=None)
    assert torch.equal(plain.cos, rope_tables(64, 8, yarn=None)[0])
    moved = a.to("cpu")
    assert moved.eps == a.eps and torch.equal(moved.norm_weight, a.norm_weight)
