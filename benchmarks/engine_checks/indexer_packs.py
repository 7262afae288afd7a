"""The default check's parts (the engine-named indexer packs against each engine's own kernel): the inputs
(:func:`make_inputs`) and the record comparison (:func:`compare`); our side (:func:`ours_finish`, ``hadamard_f32``;
:func:`ours_pack`, ``hadamard_bf16``); SGLang's ``fused_norm_rope_indexer`` behind a C wrapper
(:func:`build_sglang`, :func:`run_sglang`); LightLLM's Triton kernels from the fetched sources
(:func:`load_lightllm`, :func:`run_lightllm`); and the MUFU rsqrt probe (:func:`probes`). Records are 132 bytes
(128 FP8, 4 scale) on pages of 64."""

from __future__ import annotations

import ctypes
import importlib.util
import inspect
import math
import os
import subprocess

import torch
import triton
import triton.language as tl

from dsv4_compressor.kernels.engine_float import rsqrt_approx

from .common import POISON, log, sglang_nvcc_command

PAGE = 64
HEAD, ROPE = 128, 64


def make_inputs(batch: int, seed: int, device: str):
    """Pooled vectors (float32, before the norm; magnitudes spread over a few octaves), a bf16-valued norm weight,
    a rope table at DeepSeek-V4's compressed-rope frequencies, group start positions, and scattered slots."""
    g = torch.Generator().manual_seed(seed * 1000 + batch)
    pooled = torch.randn(batch, HEAD, generator=g) * torch.exp2(torch.randint(-3, 4, (batch, 1), generator=g).float())
    pooled = pooled * (1 + 0.5 * torch.rand(batch, HEAD, generator=g))
    weight = (1 + 0.2 * torch.randn(HEAD, generator=g)).to(torch.bfloat16).float()
    positions = 4096
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE))
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    freqs = torch.polar(torch.ones_like(ang), ang).to(torch.complex64)  # [P, 32], SGLang's freqs_cis
    start = 4 * torch.randint(0, positions // 4, (batch,), generator=g)
    pages = max(2, -(-batch * 3 // PAGE))
    slots = torch.randperm(pages * PAGE, generator=g)[:batch]
    keys = (pooled / pooled.pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)  # LightLLM's bf16 keys
    to = dict(device=device)
    return dict(
        pooled=pooled.to(**to), weight=weight.to(**to), freqs=freqs.to(**to), start=start.to(**to),
        slots=slots.to(**to), pages=pages, keys=keys.to(**to),
    )  # fmt: skip


def compare(ours: torch.Tensor, theirs: torch.Tensor, slots: torch.Tensor) -> dict:
    """Records (132 bytes each: 128 FP8, 4 scale) of ``slots`` in two page buffers, and every other byte."""
    o, t = ours.view(-1, PAGE * (HEAD + 4)), theirs.view(-1, PAGE * (HEAD + 4))
    s = slots.long()
    page, tok = s // PAGE, s % PAGE
    data_idx = (page * o.shape[1] + tok * HEAD)[:, None] + torch.arange(HEAD, device=s.device)
    scale_idx = (page * o.shape[1] + PAGE * HEAD + tok * 4)[:, None] + torch.arange(4, device=s.device)
    of, tf = o.reshape(-1), t.reshape(-1)
    od, td, osc, tsc = of[data_idx], tf[data_idx], of[scale_idx], tf[scale_idx]
    rec_diff = (od != td).any(1) | (osc != tsc).any(1)
    scale_diff = (osc != tsc).any(1)
    touched = torch.zeros_like(of, dtype=torch.bool)
    touched[data_idx.reshape(-1)] = True
    touched[scale_idx.reshape(-1)] = True
    other_diff = int(((of != tf) & ~touched).sum())
    o_scale = osc.contiguous().view(torch.float32).reshape(-1)
    t_scale = tsc.contiguous().view(torch.float32).reshape(-1)
    ulps = (osc.contiguous().view(torch.int32) - tsc.contiguous().view(torch.int32)).reshape(-1)
    steps = (od.view(torch.int8).int() - td.view(torch.int8).int()).abs()
    examples = []
    for i in torch.nonzero(rec_diff).reshape(-1)[:5].tolist():
        examples.append(dict(
            slot=int(s[i]), scale_ours=float(o_scale[i]), scale_theirs=float(t_scale[i]), scale_ulps=int(ulps[i]),
            fp8_bytes_differ=int((od[i] != td[i]).sum()), max_fp8_step=int(steps[i].max()),
        ))  # fmt: skip
    return dict(
        records=int(s.numel()), differing_records=int(rec_diff.sum()), differing_scales=int(scale_diff.sum()),
        differing_fp8_bytes=int((od != td).sum()), max_scale_ulps=int(ulps.abs().max()) if s.numel() else 0,
        other_bytes_differ=other_diff, untouched_poisoned=bool((of[~touched] == POISON).all()),
        examples=examples,
    )  # fmt: skip


def ours_finish(inp, pack: str) -> torch.Tensor:
    from dsv4_compressor.kernels.entry_pack import entry_args, finish_values

    pages = torch.full((inp["pages"], PAGE * (HEAD + 4)), POISON, dtype=torch.uint8, device=inp["pooled"].device)
    table = torch.view_as_real(inp["freqs"])  # [P, 32, 2]
    prm, out, meta = entry_args(
        head=HEAD, rope=ROPE, latent=False, page_size=PAGE, scale_bytes=8, norm_weight=inp["weight"],
        cos=table[..., 0], sin=table[..., 1], eps=1e-6, out_pages=pages, out_keys=None, exact_fp8=False,
        indexer_pack=pack,
    )  # fmt: skip
    finish_values(inp["pooled"], inp["start"], inp["slots"], prm, out, meta)
    return pages


def ours_pack(inp, pack: str) -> torch.Tensor:
    from dsv4_compressor.kernels.entry_pack import entry_args, pack_values

    pages = torch.full((inp["pages"], PAGE * (HEAD + 4)), POISON, dtype=torch.uint8, device=inp["keys"].device)
    table = torch.view_as_real(inp["freqs"])
    prm, out, meta = entry_args(
        head=HEAD, rope=ROPE, latent=False, page_size=PAGE, scale_bytes=8, norm_weight=inp["weight"],
        cos=table[..., 0], sin=table[..., 1], eps=1e-6, out_pages=pages, out_keys=None, exact_fp8=False,
        indexer_pack=pack,
    )  # fmt: skip
    pack_values(inp["keys"].float(), inp["slots"], out, meta)
    return pages


WRAPPER = r"""
#include "deepseek_v4/fused_norm_rope_v2.cuh"

extern "C" int dsv4c_sglang_indexer(void* input, const void* plan, const void* weight, const float* freqs,
                                    const int64_t* out_loc, uint8_t* kvcache, float eps, uint32_t ratio,
                                    uint32_t num_tokens, void* stream) {
  sglang::FusedNormRopeStoreParams p{};
  p.input = input;
  p.handle = plan;
  p.weight = weight;
  p.freqs_cis = freqs;
  p.out_loc = out_loc;
  p.kvcache = kvcache;
  p.eps = eps;
  p.compress_ratio = ratio;
  p.num_tokens = num_tokens;
  const uint32_t blocks = (num_tokens + sglang::kNumWarps - 1) / sglang::kNumWarps;
  sglang::fused_norm_rope_indexer<float, sglang::ForwardMode::CompressDecode, 6, false>
      <<<blocks, sglang::kBlockSize, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}
"""


def build_sglang(src: str, work: str):
    cmd, _, lib = sglang_nvcc_command(src, work, "sglang_indexer", WRAPPER, "fused_norm_rope_v2.cuh", [],
                                      torch.cuda.get_device_capability())  # fmt: skip
    log("  nvcc: " + " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("nvcc failed:\n" + (r.stdout + r.stderr)[-4000:])
    try:
        sass = subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True).stdout
        with open(os.path.join(work, "sglang_indexer.sass"), "w") as f:
            f.write(sass)
        log(f"  SASS: {sass.count('FFMA')} FFMA, {sass.count('FMUL')} FMUL, {sass.count('MUFU.RSQ')} MUFU.RSQ, "
            f"{sass.count('MUFU.RCP')} MUFU.RCP")  # fmt: skip
    except Exception as e:  # noqa: BLE001
        log(f"  (no SASS dump: {e})")
    return ctypes.CDLL(lib)


def run_sglang(lib, inp) -> torch.Tensor:
    dev = inp["pooled"].device
    batch = inp["pooled"].shape[0]
    plan = torch.zeros(batch, 4, dtype=torch.int32, device=dev)  # DecodePlan {seq_len, write_loc, page0, page1}
    plan[:, 0] = (inp["start"] + 4).int()  # seq_len: a group closes; position = seq_len - ratio
    freqs = torch.view_as_real(inp["freqs"]).flatten(-2).contiguous()  # [P, 64], as compress_norm_rope_store
    out_loc = inp["slots"].long().contiguous()
    pages = torch.full((inp["pages"], PAGE * (HEAD + 4)), POISON, dtype=torch.uint8, device=dev)
    pooled, weight = inp["pooled"].contiguous(), inp["weight"].contiguous()
    p = ctypes.c_void_p
    rc = lib.dsv4c_sglang_indexer(
        p(pooled.data_ptr()), p(plan.data_ptr()), p(weight.data_ptr()), p(freqs.data_ptr()), p(out_loc.data_ptr()),
        p(pages.data_ptr()), ctypes.c_float(1e-6), ctypes.c_uint32(4), ctypes.c_uint32(batch),
        p(torch.cuda.current_stream().cuda_stream),
    )  # fmt: skip
    torch.cuda.synchronize()
    if rc != 0:
        raise RuntimeError(f"SGLang kernel launch failed: cudaError {rc}")
    return pages


def _load(path: str, name: str):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing (run scripts/engine_pack_sources.sh and carry engine_src)")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_lightllm(src: str):
    d = os.path.join(src, "lightllm")
    had = _load(os.path.join(d, "hadamard_transform.py"), "lightllm_hadamard_transform")
    pack = _load(os.path.join(d, "destindex_copy_indexer_k_dsv4.py"), "lightllm_destindex_copy_indexer_k_dsv4")
    return had.hadamard_transform, pack.destindex_copy_indexer_k_dsv4


def run_lightllm(fns, inp) -> torch.Tensor:
    hadamard_transform, destindex = fns
    dev = inp["keys"].device
    batch = inp["keys"].shape[0]
    pages = torch.full((inp["pages"], PAGE * (HEAD + 4)), POISON, dtype=torch.uint8, device=dev)
    rotated = hadamard_transform(inp["keys"].contiguous(), scale=HEAD**-0.5)
    params = list(inspect.signature(destindex).parameters)
    if len(params) >= 6:  # (K, MemIndex, Positions, FullToC4, O_buffer, page_size)
        mem_index = torch.arange(batch, device=dev, dtype=torch.int64)
        positions = (inp["start"] + 3).long()
        destindex(rotated, mem_index, positions, inp["slots"].long(), pages, PAGE)
    else:  # (K, DestLoc, O_buffer, page_size)
        destindex(rotated, inp["slots"].long(), pages, PAGE)
    torch.cuda.synchronize()
    return pages


@triton.jit
def _rsqrt_probe(x_ptr, y_ptr):
    tl.store(y_ptr, rsqrt_approx(tl.load(x_ptr)))


def probes() -> dict:
    """The hardware result the packs depend on: MUFU rsqrt of 128 against float32(128**-0.5) (SGLang's
    ``rsqrtf(128.0f)`` is folded by nvcc to the latter; ours multiplies by the latter)."""
    x = torch.tensor([128.0], device="cuda")
    y = torch.empty_like(x)
    _rsqrt_probe[(1,)](x, y)
    got = int(y.cpu().view(torch.int32))
    want = int(torch.tensor([1 / math.sqrt(128)], dtype=torch.float32).view(torch.int32))
    return dict(rsqrt_approx_128=hex(got), float32_inv_sqrt_128=hex(want), equal=got == want)
