"""Small configurations, parameters, rows and caches the tests run on."""

from __future__ import annotations

import dataclasses

import torch

from dsv4_compressor.cache import CompressedKVCache
from dsv4_compressor.config import CompressorConfig, CompressorParams
from helpers.session import kernel_device

# ----------------------------------------------------------------------------------------------
# Configurations and inputs
# ----------------------------------------------------------------------------------------------
HCA_SMALL = CompressorConfig(ratio=8, head_dim=128, rope_dim=64, overlap=False, name="hca_small")
CSA_SMALL = CompressorConfig(ratio=4, head_dim=128, rope_dim=64, overlap=True, name="csa_small")
INDEXER_CFG = CompressorConfig.indexer()  # the real one: r=4, H=128, FP8 pack on

#: The three small kinds every streaming test runs on.
SMALL_KINDS = {"hca_small": HCA_SMALL, "csa_small": CSA_SMALL, "indexer": INDEXER_CFG}

#: Every backend of the cache. A name whose module is missing or renamed makes its tests FAIL (no skipping).
STREAMING_BACKENDS = ["reference", "triton", "online"]


def make_params(cfg: CompressorConfig, seed: int = 0, max_positions: int = 256, **kwargs) -> CompressorParams:
    """Random realistic parameters (ape ~ N(0, 0.5), norm weight ~ 1 + N(0, 0.1), DeepSeek YaRN tables);
    ``norm_dtype=torch.bfloat16`` for a bf16 norm weight, ``device=`` as ``CompressorParams.random``."""
    return CompressorParams.random(cfg, max_positions=max_positions, seed=seed, **kwargs)


def random_rows(n: int, cfg: CompressorConfig, gen: torch.Generator, device=None) -> torch.Tensor:
    """Fresh float32 ``[n, 2W]`` rows: values ~ N(0, 1), gate logits ~ N(0, 1.5^2) (peaked softmaxes)."""
    kv = torch.randn(n, cfg.width, generator=gen)
    score = 1.5 * torch.randn(n, cfg.width, generator=gen)
    rows = torch.cat([kv, score], dim=1).contiguous()
    return rows if device is None else rows.to(device)


def projection_weight(width: int, dim: int, seed: int = 0) -> torch.Tensor:
    """A compressor's bf16 ``wkv_gate`` weight ``[2W, D]`` (row-major, as the engines hold it) whose outputs have
    about unit variance for unit-variance ``x``; the score half scaled by 1.5, like :func:`random_rows`."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(width, dim, generator=gen) / dim**0.5
    w[width // 2 :] *= 1.5
    return w.to(torch.bfloat16)


def params_with(params: CompressorParams, **changes) -> CompressorParams:
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    fields.update(changes)
    return CompressorParams(**fields)


def make_cache(
    cfg: CompressorConfig,
    params: CompressorParams,
    backend: str,
    *,
    max_requests: int = 4,
    max_seq_len: int = 64,
    mtp_step: int = 0,
    device=None,
    **kwargs,
) -> CompressedKVCache:
    """A cache on :func:`kernel_device` (unless ``device`` is given); ``kwargs`` go to the cache (``page_size``,
    ``max_pages``, ``check_finite``) and its backend (``c128_kernel``, ``workspace``, ``exact_fp8``, ...)."""
    return CompressedKVCache(
        cfg,
        params,
        max_requests=max_requests,
        max_seq_len=max_seq_len,
        mtp_step=mtp_step,
        backend=backend,
        device=kernel_device() if device is None else device,
        **kwargs,
    )


def e4m3_probe_inputs() -> torch.Tensor:
    """float32 values in [-448, 448] that exercise every rounding case of float32 -> e4m3fn."""
    # every bfloat16 value in range (what the latent pack feeds the encoder)
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)
    bf = bits.view(torch.bfloat16).float()
    bf = bf[bf <= 448.0]
    # every e4m3fn value, the midpoints between neighbours (ties) and one float32 ulp either side
    q = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (q[1:] + q[:-1]) / 2
    up = torch.nextafter(mid, torch.full_like(mid, 1e9))
    down = torch.nextafter(mid, torch.zeros_like(mid))
    # just below and at powers of two (SPEC section 9: -31.46 came out as -16 in the interpreter)
    p2 = torch.tensor([2.0**k for k in range(-12, 9)])
    below = torch.nextafter(p2, torch.zeros_like(p2))
    special = torch.tensor([31.46, 31.999, 0.0, 1e-40, 2.0**-10, 3 * 2.0**-10, 448.0, 447.99, 464.0 - 1e-3])
    gen = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(40000, generator=gen) * 21 - 12).clamp(max=448.0)
    pos = torch.cat([bf, q, mid, up, down, p2, below, special, rand]).clamp(max=448.0)
    return torch.cat([pos, -pos]).float().contiguous()


# ----------------------------------------------------------------------------------------------
# CompressorParams.validate
# ----------------------------------------------------------------------------------------------
def bad_params(cfg: CompressorConfig, p: CompressorParams):
    """``(name, invalid params, substrings the error must hold)`` for ``CompressorParams.validate``."""
    r, w, h = cfg.ratio, cfg.width, cfg.head_dim
    half = cfg.rope_dim // 2
    nan_ape = p.ape.clone()
    nan_ape[1, 5] = float("nan")
    inf_w = p.norm_weight.clone()
    inf_w[3] = float("inf")
    nan_cos = p.cos.clone()
    nan_cos[7, 1] = float("nan")
    yield "ape shape", params_with(p, ape=torch.randn(r, w + 1)), ["ape", f"[{r}, {w}]", f"[{r}, {w + 1}]"]
    yield "ape rows", params_with(p, ape=torch.randn(r + 1, w)), ["ape", f"[{r}, {w}]", f"[{r + 1}, {w}]"]
    yield "ape dtype", params_with(p, ape=p.ape.double()), ["ape", "float64"]
    yield "ape nan", params_with(p, ape=nan_ape), ["ape", "non-finite"]
    yield "norm shape", params_with(p, norm_weight=torch.ones(h - 2)), ["norm_weight", f"[{h}]", f"[{h - 2}]"]
    yield "norm dtype", params_with(p, norm_weight=p.norm_weight.half()), ["norm_weight", "float16"]
    yield "norm inf", params_with(p, norm_weight=inf_w), ["norm_weight", "non-finite"]
    yield "cos width", params_with(p, cos=p.cos[:, :-1].contiguous()), ["cos", str(half), str(half - 1)]
    yield "sin rows", params_with(p, sin=p.sin[:-3].contiguous()), ["sin", str(p.cos.shape[0] - 3)]
    yield "cos dtype", params_with(p, cos=p.cos.double()), ["cos", "float64"]
    yield "cos nan", params_with(p, cos=nan_cos), ["cos", "non-finite"]
    yield "ape not a tensor", params_with(p, ape=p.ape.numpy()), ["ape", "ndarray"]
    yield "norm on meta", params_with(p, norm_weight=torch.empty(h, device="meta")), ["norm_weight", "meta"]
    yield "eps zero", params_with(p, eps=0.0), ["eps", "0.0"]
    yield "eps too big", params_with(p, eps=1.5), ["eps", "1.5"]
    yield "tables shorter than a group", params_with(p, cos=p.cos[: r - 1], sin=p.sin[: r - 1]), [str(r - 1)]
