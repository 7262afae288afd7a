"""The engine-named indexer packs against each engine's own operation sequence, byte for byte (CPU, interpreter).

* ``hadamard_f32`` (SGLang): SGLang's ``fused_norm_rope_indexer`` is CUDA C++ and does not run here; the reference
  is its operation sequence written out in PyTorch float32 (read from ``fused_norm_rope_v2.cuh`` and the SASS
  nvcc 13.0 makes of it for sm_90a: per-lane ``fma`` sum of squares, the ``shfl_xor`` tree, ``rsqrt``, rope as
  ``fma(x, cos, -(y * sin))`` / ``fma(x, sin, y * cos)``, ``q = h * (1 / scale)``). The GPU check
  (``scripts/engine_pack_check.py``, ``benchmarks/engine_checks/indexer_packs.py``) runs SGLang's compiled kernel
  itself.
* ``hadamard_bf16`` (LightLLM): LightLLM's own Triton kernels (``hadamard_transform``,
  ``destindex_copy_indexer_k_dsv4``) under the interpreter when their source files are here (``engine_src/lightllm``
  from ``scripts/engine_pack_sources.sh``, or ``DSV4C_LIGHTLLM_SRC``; LightLLM is not on PyPI), and always
  against their sequence in PyTorch.
* ``pow2`` / ``pow2_ue8m0`` (vLLM, compute capability < 10 / 10.x): vLLM's own Triton kernel
  ``_fused_kv_compress_norm_rope_insert_indexer_attn`` (``MX_SCALE`` off / on) under the interpreter, where the
  real vLLM is installed (``.venv-vllm``), and the adapter's choice of the pack.

Where an engine's Triton kernel is the reference, the interpreter's float32 -> bfloat16 casts (it truncates) and
float32 -> e4m3 casts (it rounds half away from zero on one bit) are corrected to round to nearest even, as the
GPU's ``cvt.rn`` does, for the duration of the engine's launch only (:func:`engine_casts_round_to_nearest_even`).
Under the interpreter our ``rsqrt.approx`` / ``div.full`` helpers are the correctly rounded operations, which is
also what the engines' Triton code computes there (numpy); the hardware approximations are the GPU check's.
"""

from __future__ import annotations

import importlib.util
import math
import os
import types
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from helpers.session import engine_casts_round_to_nearest_even

from dsv4_compressor import ops
from dsv4_compressor.kernels.entry_pack import entry_args, finish_values, pack_values
from dsv4_compressor.layout import decode_indexer_fp8, encode_indexer_fp8
from dsv4_compressor.verify import check_indexer_pack

HEAD, ROPE, PAGE = 128, 64, 64
POISON = 0xAB
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------
def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``a * b + c`` with one rounding (the product is exact in float64; the sum's double rounding has
    probability ~2^-29 per operation)."""
    return (a.double() * b.double() + c.double()).float()


def hadamard32(x: torch.Tensor) -> torch.Tensor:
    """The transform's butterflies in float32, stage by stage (lanes ``i`` and ``i + span``, span 1, 2, ..., 64),
    as SGLang, LightLLM and our kernels add them (``layout.hadamard`` sums in float64)."""
    n = x.shape[-1]
    y, span = x.float(), 1
    while span < n:
        y = y.reshape(*x.shape[:-1], n // (2 * span), 2, span)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*x.shape[:-1], n)
        span *= 2
    return y


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """float32 square root, correctly rounded (the float64 root rounded once more is). PyTorch 2.13's own float32
    ``sqrt`` on CPU is within an ulp but not correctly rounded (208,142 of 2^20 random roots off by one on this
    project's AMD CPU, contiguous or strided; numpy's are all exact), so the reference does not use it."""
    return torch.sqrt(x.double()).float()


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    pooled = torch.randn(n, HEAD, generator=g) * torch.exp2(torch.randint(-3, 4, (n, 1), generator=g).float())
    pooled = pooled * (1 + 0.5 * torch.rand(n, HEAD, generator=g))
    weight = (1 + 0.2 * torch.randn(HEAD, generator=g)).to(torch.bfloat16).float()
    ang = torch.arange(512, dtype=torch.float64)[:, None] / (160000.0 ** (torch.arange(0, ROPE, 2) / ROPE))[None]
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    start = 4 * torch.randint(0, 128, (n,), generator=g)
    slots = torch.randperm(max(2 * PAGE, n), generator=g)[:n].int()
    return pooled, weight, cos, sin, start.int(), slots


def new_pages(num: int = 2) -> torch.Tensor:
    return torch.full((num, PAGE * (HEAD + 4)), POISON, dtype=torch.uint8)


def records(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 132]``: the FP8 values and the 4 scale bytes of each slot."""
    flat = pages.view(pages.shape[0], PAGE * (HEAD + 4))
    page, tok = (slots.long() // PAGE), (slots.long() % PAGE)
    data = flat[page[:, None], tok[:, None] * HEAD + torch.arange(HEAD)]
    scale = flat[page[:, None], PAGE * HEAD + tok[:, None] * 4 + torch.arange(4)]
    return torch.cat([data, scale], dim=1)


def untouched_are_poison(pages: torch.Tensor, slots: torch.Tensor) -> bool:
    mask = torch.ones_like(pages, dtype=torch.bool)
    flat = mask.view(pages.shape[0], -1)
    page, tok = (slots.long() // PAGE), (slots.long() % PAGE)
    flat[page[:, None], tok[:, None] * HEAD + torch.arange(HEAD)] = False
    flat[page[:, None], PAGE * HEAD + tok[:, None] * 4 + torch.arange(4)] = False
    return bool((pages[mask] == POISON).all())


def our_finish(pooled, weight, cos, sin, start, slots, pack, pages=None):
    pages = new_pages() if pages is None else pages
    prm, out, meta = entry_args(
        head=HEAD, rope=ROPE, latent=False, page_size=PAGE, scale_bytes=8, norm_weight=weight, cos=cos, sin=sin,
        eps=1e-6, out_pages=pages, out_keys=None, exact_fp8=True, indexer_pack=pack,
    )  # fmt: skip
    finish_values(pooled, start, slots, prm, out, meta)
    return pages


def our_pack(values, slots, pack):
    pages = new_pages()
    z = torch.zeros(8, ROPE // 2)
    prm, out, meta = entry_args(
        head=HEAD, rope=ROPE, latent=False, page_size=PAGE, scale_bytes=8, norm_weight=torch.ones(HEAD), cos=z,
        sin=z, eps=1e-6, out_pages=pages, out_keys=None, exact_fp8=True, indexer_pack=pack,
    )  # fmt: skip
    pack_values(values, slots, out, meta)
    return pages


# ---------------------------------------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------------------------------------
def sglang_sequence(pooled, weight, cos, sin, start, eps=1e-6, divide=False) -> torch.Tensor:
    """SGLang 0.5.23 ``fused_norm_rope_indexer`` (fp32 input, page 64) in PyTorch float32: records ``[n, 132]``."""
    n = pooled.shape[0]
    lanes = pooled.view(n, 32, 4)
    s = lanes[..., 0] * lanes[..., 0]
    for i in (1, 2, 3):
        s = fma32(lanes[..., i], lanes[..., i], s)
    lane = torch.arange(32)
    for mask in (16, 8, 4, 2, 1):
        s = s + s[:, lane ^ mask]
    total = s[:, :1]
    # rsqrtf: under the interpreter the correctly rounded root, then the quotient (float64 rounded once more is
    # the float32 quotient)
    inv_rms = (1.0 / sqrt32(total * (1.0 / 128) + torch.tensor(eps, dtype=torch.float32)).double()).float()
    x = pooled * inv_rms * weight
    xr, xi = x[:, 0::2].clone(), x[:, 1::2].clone()
    c, sn = cos[start.long()], sin[start.long()]  # [n, 32]: pairs 32..63 are the rope dims
    rr = fma32(xr[:, 32:], c, -(xi[:, 32:] * sn))
    ri = fma32(xr[:, 32:], sn, xi[:, 32:] * c)
    xr[:, 32:], xi[:, 32:] = rr, ri
    x = torch.stack([xr, xi], dim=-1).reshape(n, HEAD)
    h = hadamard32(x) * torch.tensor(1 / math.sqrt(HEAD), dtype=torch.float32)
    scale = torch.clamp(h.abs().amax(-1, keepdim=True), min=1e-4) / 448.0
    q = e4m3(h / scale if divide else h * (1.0 / scale))
    return torch.cat([q, scale.contiguous().view(torch.uint8).view(n, 4)], dim=1)


@pytest.mark.parametrize("n", [16, 96])
def test_sglang_pack_is_sglangs_operation_sequence(n):
    pooled, weight, cos, sin, start, slots = inputs(n, seed=n)
    pages = our_finish(pooled, weight, cos, sin, start, slots, "hadamard_f32")
    got, want = records(pages, slots), sglang_sequence(pooled, weight, cos, sin, start)
    bad = (got != want).any(1)
    assert not bad.any(), f"{int(bad.sum())} of {n} records differ from SGLang's sequence, first at {bad.nonzero()[0]}"
    assert untouched_are_poison(pages, slots)


def test_sglang_pack_multiplies_by_the_reciprocal():
    """Keys where ``h * (1 / scale)`` and ``h / scale`` round to different FP8 bytes (rare: about 2 in 65,536,
    found in PyTorch first, over several seeds) are packed as SGLang does, by the reciprocal."""
    found = 0
    for seed in range(3, 11):
        pooled, weight, cos, sin, start, _ = inputs(65536, seed=seed)
        times = sglang_sequence(pooled, weight, cos, sin, start)
        differ = (times != sglang_sequence(pooled, weight, cos, sin, start, divide=True)).any(1).nonzero()[:, 0]
        if differ.numel() == 0:
            continue
        slots = torch.arange(differ.numel(), dtype=torch.int32)
        pages = our_finish(pooled[differ], weight, cos, sin, start[differ], slots, "hadamard_f32")
        assert torch.equal(records(pages, slots), times[differ]), f"seed {seed}"
        found += differ.numel()
    assert found >= 4, f"only {found} keys tell the two apart"


def test_sglang_sequence_is_not_the_plain_pack():
    """The SGLang variant's own norm, rope and reciprocal change bytes: the plain ``hadamard`` pack of the same
    pooled vectors (our RMSNorm, rope, bf16 key, IEEE quotient) differs from SGLang's sequence on some records."""
    pooled, weight, cos, sin, start, slots = inputs(128, seed=7)
    want = sglang_sequence(pooled, weight, cos, sin, start)
    other = records(our_finish(pooled, weight, cos, sin, start, slots, "hadamard"), slots)
    assert (other != want).any(1).sum() > 5


# ---------------------------------------------------------------------------------------------------------------
# LightLLM
# ---------------------------------------------------------------------------------------------------------------
def lightllm_sequence(keys: torch.Tensor) -> torch.Tensor:
    """LightLLM's ``hadamard_transform(k, 128**-0.5)`` (float32 butterflies, product by the float32 constant, bf16
    store) then ``destindex_copy_indexer_k_dsv4`` (``scale = max(amax, 1e-4) / 448``, ``q = k / scale``), with
    IEEE division (what the interpreter computes for Triton's ``/``)."""
    n = keys.shape[0]
    h = (hadamard32(keys.float()) * torch.tensor(HEAD**-0.5, dtype=torch.float32)).to(torch.bfloat16).float()
    scale = torch.clamp(h.abs().amax(-1, keepdim=True), min=1e-4) / 448.0
    return torch.cat([e4m3(h / scale), scale.contiguous().view(torch.uint8).view(n, 4)], dim=1)


def lightllm_kernels():
    src = Path(os.environ.get("DSV4C_LIGHTLLM_SRC", REPO / "engine_src" / "lightllm"))
    mods = []
    for name in ("hadamard_transform", "destindex_copy_indexer_k_dsv4"):
        path = src / f"{name}.py"
        if not path.exists():
            pytest.skip(f"LightLLM's {name}.py is not here ({path}; scripts/engine_pack_sources.sh puts it there)")
        spec = importlib.util.spec_from_file_location(f"lightllm_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


def bf16_keys(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, HEAD, generator=g) * (1 + torch.rand(n, 1, generator=g) * 3)
    return k.to(torch.bfloat16)


@pytest.mark.parametrize("n", [16, 96])
def test_lightllm_pack_is_lightllms_operation_sequence(n):
    keys, slots = bf16_keys(n, n), torch.randperm(2 * PAGE, generator=torch.Generator().manual_seed(n))[:n].int()
    pages = our_pack(keys.float(), slots, "hadamard_bf16")
    got, want = records(pages, slots), lightllm_sequence(keys)
    assert torch.equal(got, want), f"{int((got != want).any(1).sum())} of {n} records differ"
    assert untouched_are_poison(pages, slots)


@pytest.mark.parametrize("n", [16, 96])
def test_lightllm_pack_matches_lightllms_kernels(n):
    had, dest = lightllm_kernels()
    keys, slots = bf16_keys(n, n), torch.randperm(2 * PAGE, generator=torch.Generator().manual_seed(n))[:n].int()
    theirs = new_pages()
    with engine_casts_round_to_nearest_even():
        rotated = torch.empty_like(keys)
        # _hadamard_transform_triton's launch (its block of rows comes from the GPU's SM count: 8 here)
        block_r = 8
        had._hadamard_transform_kernel[(triton.cdiv(n, block_r),)](
            keys, rotated, n, HEAD**-0.5, BLOCK_R=block_r, BLOCK_N=HEAD, num_warps=4
        )  # fmt: skip
        dest.destindex_copy_indexer_k_dsv4(
            rotated, torch.arange(n), torch.full((n,), 3), slots.long(), theirs, PAGE
        )  # fmt: skip
    ours = our_pack(keys.float(), slots, "hadamard_bf16")
    assert torch.equal(records(ours, slots), records(theirs, slots))
    assert torch.equal(ours, theirs), "bytes outside the records differ"
    assert torch.equal(records(ours, slots), lightllm_sequence(keys))


# ---------------------------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------------------------
def vllm_indexer_kernel():
    """vLLM's ``_fused_kv_compress_norm_rope_insert_indexer_attn``. Without an active GPU driver vLLM replaces
    triton by placeholders (``vllm/triton_utils/importing.py``: its ``@triton.jit`` returns the plain function);
    then the test binds the kernel's own source (and its ``pack_ue8m0_x4``) to the real triton."""
    try:
        import vllm.v1.attention.ops.common as common
        from vllm.models.deepseek_v4.common.ops import fused_compress_quant_cache as m
    except Exception as e:  # noqa: BLE001 - not installed here, or its imports need what this env lacks
        pytest.skip(f"vLLM's indexer kernel is not importable here: {type(e).__name__}: {e}")
    kernel = m._fused_kv_compress_norm_rope_insert_indexer_attn
    if isinstance(kernel, triton.runtime.JITFunction):
        return kernel

    def rebind(fn, module_globals, **extra):
        g = dict(module_globals, tl=tl, triton=triton, **extra)
        return triton.jit(types.FunctionType(fn.__code__, g, fn.__name__))

    pack = rebind(common.pack_ue8m0_x4, common.__dict__)
    return rebind(kernel, m.__dict__, pack_ue8m0_x4=pack)


def run_vllm_indexer(kernel, pooled, weight, cos, sin, start, slots, mx_scale: bool) -> torch.Tensor:
    """vLLM's indexer kernel, one token per closing group (position ``start + 3``), its 8-row window pooled by a
    one-hot score so the pooled vector is exactly ``pooled`` (the window's last row, weight 1; the others 0)."""
    n = pooled.shape[0]
    state = torch.zeros(2 * n, 4, 2 * 2 * HEAD)  # state blocks of 4 rows: [kv (256) | score (256)]
    state[..., 2 * HEAD :] = float("-inf")
    block_table = torch.zeros(n, int(start.max()) // 4 + 2, dtype=torch.int32)
    for i in range(n):
        b = int(start[i]) // 4  # the closing row start + 3 ends state block b; the window is blocks b - 1, b
        block_table[i, b], block_table[i, b - 1] = 2 * i, 2 * i + 1
        state[2 * i, 3, HEAD : 2 * HEAD] = pooled[i]  # the current group's half of the closing row
        state[2 * i, 3, 3 * HEAD :] = 0.0  # its score: 0; every other row's -inf
    cos_sin = torch.cat([cos, sin], dim=1).contiguous()
    pages = new_pages()
    positions = (start + 3).long()
    with engine_casts_round_to_nearest_even():
        kernel[(n,)](
            state, state.stride(0), state.stride(1), torch.arange(n, dtype=torch.int32), positions,
            torch.zeros(n, dtype=torch.int64), block_table, block_table.stride(0), 4, weight, 1e-6, cos_sin,
            cos_sin.stride(0), pages, slots.long(), PAGE,
            HEAD_SIZE=HEAD, TRITON_BLOCK_SIZE=HEAD, STATE_WIDTH=2 * HEAD, COMPRESS_RATIO=4, OVERLAP=1,
            ROPE_HEAD_DIM=ROPE, FP8_MAX=448.0, QUANT_BLOCK=HEAD, TOKEN_STRIDE=HEAD, SCALE_DIM=4,
            KV_BLOCK_STRIDE=pages.stride(0), MX_SCALE=mx_scale, num_warps=1,
        )  # fmt: skip
    return pages


@pytest.mark.parametrize("pack", ["pow2", "pow2_ue8m0"])
def test_vllm_packs_match_vllms_kernel(pack):
    kernel = vllm_indexer_kernel()
    pooled, weight, cos, sin, start, slots = inputs(24, seed=11)
    start = start % 496 + 8  # every window lies in the request, every group start in the rope table
    theirs = run_vllm_indexer(kernel, pooled, weight, cos, sin, start, slots, mx_scale=pack == "pow2_ue8m0")
    ours = our_finish(pooled, weight, cos, sin, start, slots, pack)
    assert torch.equal(records(ours, slots), records(theirs, slots))
    assert torch.equal(ours, theirs)


def test_pow2_ue8m0_is_pow2_with_the_exponent_byte_four_times():
    """Same FP8 bytes as ``pow2``; the scale's 4 bytes are its float32 exponent field (vLLM's ``pack_ue8m0_x4``),
    and the layout reference and its decoder agree with the kernel."""
    pooled, weight, cos, sin, start, slots = inputs(64, seed=5)
    a = records(our_finish(pooled, weight, cos, sin, start, slots, "pow2"), slots)
    b = records(our_finish(pooled, weight, cos, sin, start, slots, "pow2_ue8m0"), slots)
    assert torch.equal(a[:, :HEAD], b[:, :HEAD])
    exponent = (a[:, HEAD:].contiguous().view(torch.int32) >> 23) & 0xFF
    assert torch.equal(b[:, HEAD:].long(), exponent.long().expand(-1, 4))
    values = torch.randn(64, HEAD) * 3
    got = records(our_pack(values, slots, "pow2_ue8m0"), slots)
    assert torch.equal(got, encode_indexer_fp8(values, "pow2_ue8m0"))
    assert torch.equal(decode_indexer_fp8(got, "pow2_ue8m0"), decode_indexer_fp8(encode_indexer_fp8(values, "pow2")))


def test_vllm_adapter_picks_the_packed_scale_on_compute_capability_10(monkeypatch):
    from dsv4_compressor.integrations import vllm as adapter

    try:
        import vllm.utils.deep_gemm as deep_gemm
    except Exception:  # noqa: BLE001 - no vLLM: the adapter reads the device's capability
        deep_gemm = None
    for mx, want in ((True, "pow2_ue8m0"), (False, "pow2")):
        adapter.indexer_pack.cache_clear()
        if deep_gemm is not None:
            monkeypatch.setattr(deep_gemm, "mqa_logits_use_mx_scales", lambda mx=mx: mx)
        else:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, mx=mx: (10, 0) if mx else (9, 0))
        assert adapter.indexer_pack() == want
    adapter.indexer_pack.cache_clear()


def test_unknown_pack_is_refused_before_any_write():
    positions = torch.arange(4)
    plan = ops.empty_plan(4, 1, 4, "cpu")
    ops.build_plan(plan, positions, torch.zeros(4, dtype=torch.int64), positions // 4, ratio=4, num_slots=1)
    pages, state = new_pages(), torch.full((16, 512), 7.0)
    with pytest.raises(Exception, match="indexer_pack.*pow2_e8m0"):
        ops.compress(
            torch.zeros(4, 512), plan, torch.zeros(4, 2, HEAD), torch.ones(HEAD), torch.zeros(8, 32),
            torch.zeros(8, 32), state, pages, kind="indexer", page_size=PAGE, ring=16, indexer_pack="pow2_e8m0",
        )  # fmt: skip
    assert (pages == POISON).all() and (state == 7.0).all()


def test_check_indexer_pack_reads_ue8m0_scales_and_allows_the_approximate_division():
    """The checker reads ``pow2_ue8m0``'s four exponent bytes (a wrong or unequal byte is unexplained) and gives
    ``hadamard_bf16``'s scale the 2 ulps of the GPU's ``div.full.f32``, no more."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(8, 128, generator=gen, dtype=torch.float64)
    packed = encode_indexer_fp8(values.float(), "pow2_ue8m0")
    assert check_indexer_pack(packed, values, "pow2_ue8m0").ok
    bad = packed.clone()
    bad[2, 129] += 1
    assert check_indexer_pack(bad, values, "pow2_ue8m0").unexplained > 0
    packed = encode_indexer_fp8(values.float(), "hadamard_bf16")
    for ulps, ok in ((2, True), (16, False)):
        moved = packed.clone()
        moved[:, 128:].view(torch.int32).add_(ulps)
        assert check_indexer_pack(moved, values, "hadamard_bf16").ok is ok, ulps
