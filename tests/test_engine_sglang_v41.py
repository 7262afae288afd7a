"""SGLang 0.5.23's V4.1 page layouts against its own pure-torch reference (``make test-sglang``; skipped without
SGLang): our records (the kernels' finish: norm, rope and pack, then the plain-PyTorch reference packer) against
``sglang.test.kernels.deepseek_v4.dsv41_kv_quant_reference.quantize_k_cache_v41`` (block-split ``V41`` pages)
and its ``interleave_pages`` (``V41_NEW``) on the same normed and rotated values, at page sizes 64 (C4) and
2 (C128, SGLang's HCA pages), every record compared; the page sizes SGLang's ``KVLayout.page_bytes`` gives.

The GPU counterpart (SGLang's own CUDA store ``compress_norm_rope_store(layout=...)`` against ours) is
``tests/test_engine_sglang_v41_gpu.py``.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from helpers.buffers import POISON_BYTE
from helpers.inputs import make_params

from dsv4_compressor import layout
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.kernels.entry_pack import entry_args, finish_values

try:
    importlib.import_module("sglang")
except ImportError:
    pytest.skip("sglang is not installed (make test-sglang builds .venv-sglang with it)", allow_module_level=True)
ref = importlib.import_module("sglang.test.kernels.deepseek_v4.dsv41_kv_quant_reference")
from test_engine_sglang_settings import published  # noqa: E402, F401  (the fixture: SGLang's published settings)

HCA = CompressorConfig.hca()
CSA = CompressorConfig.csa()
#: Pages per case; the records compared are every slot of them.
PAGES = {64: 3, 2: 40}


def _pooled(n: int, seed: int) -> torch.Tensor:
    """Pooled vectors before the norm, over several magnitudes per row (the norm takes the scale out, the
    weights bring spread back), with a few rows of tiny or uneven values."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(n, 512, generator=gen) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=gen).float())
    c[1, :256] *= 1e-4  # blocks far below the row's RMS: the 2^-13 floor of the scale
    c[2, 448:] *= 50.0  # a large rope tail
    return c


def _ours(cfg, page_size: int, name: str, seed: int):
    """``(values, pages)``: the kernels' finished values of every slot (float32, from ``out_keys``) and the pages
    the same launch wrote in layout ``name``."""
    pages_n = PAGES[page_size]
    slots = pages_n * page_size
    p = make_params(cfg, seed=seed, max_positions=4096)
    pl = layout.latent_page_layout(cfg, page_size, name)
    pages = torch.full((pages_n, pl.bytes_per_page), POISON_BYTE, dtype=torch.uint8)
    keys = torch.zeros(slots, cfg.head_dim)
    prm, out, meta = entry_args(
        head=cfg.head_dim, rope=cfg.rope_dim, latent=True, page_size=page_size, scale_bytes=8,
        norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, eps=1e-6, out_pages=pages, out_keys=keys,
        exact_fp8=True, layout=name,
    )  # fmt: skip
    start = (torch.arange(slots, dtype=torch.int32) * cfg.ratio) % 4096
    finish_values(_pooled(slots, seed), start, torch.arange(slots, dtype=torch.int32), prm, out, meta)
    return keys, pages


def _differing_records(ours: torch.Tensor, theirs: torch.Tensor, pl: layout.PageLayout) -> int:
    slots = torch.arange(ours.shape[0] * pl.page_size)
    a = pl.read(ours.contiguous(), slots)
    b = pl.read(theirs.contiguous(), slots)
    return int((a != b).any(dim=1).sum())


COUNTS: dict = {}


@pytest.mark.parametrize("cfg", [HCA, CSA], ids=["hca", "csa"])
@pytest.mark.parametrize("page_size", [64, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_v41_records_match_sglangs_reference(cfg, page_size, seed):
    """Block-split ``V41`` pages: 0 differing records, and the whole page (its padding included) as SGLang's
    ``quantize_k_cache_v41`` lays it out at SGLang's page size."""
    values, pages = _ours(cfg, page_size, "v41", seed)
    pl = layout.latent_page_layout(cfg, page_size, "v41")
    theirs = ref.quantize_k_cache_v41(values.view(-1, page_size, 512), page_bytes=pl.bytes_per_page)
    assert theirs.shape == pages.shape
    differing = _differing_records(pages, theirs, pl)
    COUNTS[("v41", cfg.name, page_size, seed)] = (differing, values.shape[0])
    assert differing == 0, f"{differing} of {values.shape[0]} records differ"
    # our reference packer gives the same records from the same values
    assert torch.equal(layout.encode_latent(values, cfg, "v41"), pl.read(pages, torch.arange(values.shape[0])))
    raw = page_size * 528
    assert (pages[:, raw:] == POISON_BYTE).all()  # the page padding is not ours to write


@pytest.mark.parametrize("cfg", [HCA, CSA], ids=["hca", "csa"])
@pytest.mark.parametrize("page_size", [64, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_v41_new_records_match_sglangs_interleaved_reference(cfg, page_size, seed):
    """``V41_NEW`` pages: SGLang's V41 bytes through its ``interleave_pages``; 0 differing records, every byte of
    the (unpadded) pages equal."""
    values, pages = _ours(cfg, page_size, "v41_new", seed)
    pl = layout.latent_page_layout(cfg, page_size, "v41_new")
    split = ref.quantize_k_cache_v41(values.view(-1, page_size, 512))
    theirs = ref.interleave_pages(split, page_size, 512, 16)
    assert theirs.shape == pages.shape == (PAGES[page_size], page_size * 528)
    differing = _differing_records(pages, theirs, pl)
    COUNTS[("v41_new", cfg.name, page_size, seed)] = (differing, values.shape[0])
    assert differing == 0, f"{differing} of {values.shape[0]} records differ"
    assert torch.equal(pages, theirs)


def test_v41_reference_values_round_trip():
    """SGLang's ``dequantize_k_cache_v41`` reads our pages as our reference decodes them."""
    values, pages = _ours(HCA, 64, "v41", 3)
    theirs = ref.dequantize_k_cache_v41(pages, 64).float().view(-1, 512)
    ours = layout.decode_latent(layout.encode_latent(values, HCA, "v41"), HCA, "v41")
    assert torch.equal(theirs, ours.to(torch.bfloat16).float())


def test_page_bytes_are_sglangs():
    """Our page sizes per layout are SGLang's (``KVLayout.page_bytes``, ``bytes_per_token``)."""
    kv_layout = importlib.import_module("sglang.kernels.ops.attention.dsv4.kv_layout")
    names = {"v4": "V4", "v41": "V41", "v41_new": "V41_NEW", "uniform_fp8": "UNIFORM_FP8"}
    for ours, theirs in names.items():
        member = kv_layout.KVLayout[theirs]
        for page_size in (64, 2, 1, 256):
            pl = layout.latent_page_layout(HCA, page_size, ours)
            if ours != "uniform_fp8":  # the uniform pool sizes its pages itself (P x 512, DeepSeekV4UniformFP8KVPool)
                assert member.page_bytes(page_size) == pl.bytes_per_page, (ours, page_size)
            assert member.bytes_per_token == pl.record_bytes, ours


# ---------------------------------------------------------------------------------------------------------------
# The adapter on SGLang's real pools, built with each layout
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["V4", "V41", "V41_NEW"])
@pytest.mark.parametrize("online", [False, True], ids=["ring", "online"])
def test_adapter_writes_each_pools_layout(name, online, published):  # noqa: F811
    """A ``DeepSeekV4TokenToKVPool`` built with ``kv_layout=name``: the adapter reads its C128 layer's layout
    (:func:`layer_layout`) and its prefill step writes the pool's own page buffer exactly as ``ops.compress`` /
    ``ops.compress_online_hca`` with that ``layout=`` writes a copy of it (every byte), and SGLang's reader of the
    layout reads the written V4.1 records as our reference decodes them."""
    import test_engine_sglang_settings as tess

    from dsv4_compressor import ops
    from dsv4_compressor.integrations import sglang as sg

    published(chunked_prefill_size=256, max_running_requests=8)  # SGLang's pools read the published settings
    kv_layout = importlib.import_module("sglang.kernels.ops.attention.dsv4.kv_layout").KVLayout
    pool = tess._pool([128, 4], kv_layout=getattr(kv_layout, name))
    ours = name.lower()
    assert sg.layer_layout(pool, 0) == ours
    cfg, rows, ring = HCA, 260, 128
    p = make_params(cfg, seed=5, max_positions=512)
    state = torch.zeros(tess.SLOTS * ring, cfg.row_width)
    compressor = types.SimpleNamespace(
        ratio=128, head_dim=512, is_in_indexer=False, ape=p.ape.clone(), freqs_cis=torch.complex(p.cos, p.sin),
        norm=types.SimpleNamespace(weight=p.norm_weight.float(), variance_epsilon=p.eps),
        get_state_pool=lambda backend: types.SimpleNamespace(kv_score_buffer=types.SimpleNamespace(kv_score=state)),
    )  # fmt: skip
    adapter = sg.SGLangCompressor(hca="online" if online else "ring", hca_kernel="single")
    buffers = adapter._buffers(types.SimpleNamespace(), pool, compressor, 0)
    assert buffers["layout"] == ours and buffers["page_size"] == 2
    positions = torch.arange(rows, dtype=torch.int64)
    req = torch.ones(rows, dtype=torch.int64)
    out_loc = 3 + positions // 128  # c128_out_loc of the closing rows (127, 255): slots 3, 4
    req_to_token = torch.zeros(tess.SLOTS, 512, dtype=torch.int32)
    metadata = adapter.metadata(128, positions=positions, req_pool_indices=req, out_loc=out_loc,
                                req_to_token=req_to_token, full_to_swa_index_mapping=None, swa_page_size=None,
                                ring=ring, decode=False)  # fmt: skip
    kv = torch.randn(rows, cfg.row_width, generator=torch.Generator().manual_seed(7))
    pages = pool.get_extra_key_buffer(0).view(torch.uint8)
    pages.fill_(POISON_BYTE)
    want = pages.clone()
    name_, args, kwargs = adapter._layer_call(metadata, compressor, "kv_score", rows, kv.device, **buffers)
    assert kwargs["layout"] == ours
    want_args = list(args)
    want_args[-1] = want
    if online:
        want_args[-2] = want_args[-2].clone()
    else:
        want_args[-2] = state.clone()
    adapter.forward_compress(kv, metadata, compressor, **buffers)
    getattr(ops, name_)(kv, *want_args, **kwargs)
    assert torch.equal(pages, want), f"{int((pages != want).sum())} bytes differ"
    assert (pages != POISON_BYTE).any()
    if ours != "v4":
        pl = layout.latent_page_layout(cfg, 2, ours)
        records = pl.read(pages[:, : pl.bytes_per_page].contiguous(), torch.tensor([3, 4]))
        split = pages if ours == "v41" else None
        if split is None:  # SGLang's reader takes the block-split arrangement
            split = torch.zeros(pages.shape[0], 1536, dtype=torch.uint8)
            split[:, : 2 * 528] = ref.deinterleave_pages(pages, 2, 512, 16)
        theirs = ref.dequantize_k_cache_v41(split, 2).float().view(-1, 512)[[3, 4]]
        assert torch.equal(theirs, layout.decode_latent(records, cfg, ours).to(torch.bfloat16).float())
