"""GPU check: the engine-named indexer packs against each engine's own kernel, byte for byte, on one GPU.

On the same random inputs at each batch size it runs

* ``hadamard_f32`` (SGLang): SGLang 0.5.23's ``fused_norm_rope_indexer`` (``fused_norm_rope_v2.cuh``, built here
  with nvcc from the wheel's JIT headers and the flags SGLang's JIT uses: ``-DSGL_CUDA_ARCH -std=c++20 -O3
  --expt-relaxed-constexpr``, the GPU's arch, no fast math; launched through a small C wrapper as SGLang's
  ``forward`` does: decode plans, 256-thread blocks of 8 keys, page 64, fp32 input) against our finish
  (``entry_pack.finish_values``: the kernels' RMSNorm, rope and pack) from the same pooled vectors;
* ``hadamard_bf16`` (LightLLM): LightLLM's Triton ``hadamard_transform`` then ``destindex_copy_indexer_k_dsv4``
  (the fetched source files) against our pack (``entry_pack.pack_values``) of the same bf16 keys;

and reports the records that differ (0 expected), with the scale and FP8 bytes of the first few. An engine whose
kernel cannot be built or run here is reported as ``not run: <reason>``; the others still run. Writes
``engine_pack_check.json`` and ``engine_pack_check.log`` under ``--out`` (default ``$OUT``, else ``out``).

    bash scripts/engine_pack_sources.sh           # on the machine with the wheels: fills engine_src/
    PYTHONPATH=src python3 scripts/engine_pack_check.py --src engine_src   # on the GPU machine (carry engine_src)

``--ring-decode`` runs another check instead: SGLang 0.5.23's C128 ring decode (its
``flash_c128_decode`` from ``c128_v2.cuh``, built with ``-use_fast_math`` as ``compress.py`` does, then its
``fused_norm_rope_flashmla`` store, V4 584-byte records at page 2, and its ``plan_compress_decode``; fp32 state, input
and output, PDL on sm90) against our tiled C128 kernel (``ops.compress(kind="hca", scratch=...)`` as the bench's
``decode/hca/triton-tiled/B*/S1/*`` cases call it) on 4B = 64, 256, 1024 requests of one row, every request or every
4th closing a group. Both sides get the same ring history (SGLang's rows ``[kv | score]``, ours ``[kv | score +
ape]``), input rows and poisoned pages; the records are compared byte by byte, decoded, and against a float64
reference; each side is timed as a CUDA graph of ``--instances`` layers (warm; cold after an L2 flush), SGLang's
plan apart. ``--variants`` times ours with other ``launch_c128_tiled`` settings. Writes ``ring_decode.json``,
``ring_decode.md`` and ``ring_decode.log``; ``--device cpu`` runs it host-side (SGLang emulated in PyTorch, ours
under ``TRITON_INTERPRET=1``); ``--ring-compile-only`` only builds the CUDA wrappers (no device needed).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import traceback


def _cpu_run() -> bool:
    """``--device cpu`` (the ring harness's host-side check under the Triton interpreter) or an import (tests)."""
    argv = sys.argv[1:]
    cpu = "--device=cpu" in argv or any(a == "--device" and b == "cpu" for a, b in zip(argv, argv[1:]))
    return cpu or __name__ != "__main__"


if not _cpu_run():
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dsv4_compressor.kernels.engine_float import rsqrt_approx  # noqa: E402

# the ring decode harness reuses the checkout's benchmarks/ (cases, layers, timing; not installed with the package)
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

POISON = 0xAB
PAGE = 64
HEAD, ROPE = 128, 64
LOG: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# Ours
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# LightLLM
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# --ring-decode: SGLang's C128 ring decode against our tiled C128 kernel
# ---------------------------------------------------------------------------------------------------------------
RING_HEAD, RING_RATIO, RING_ROPE, RING_PAGE = 512, 128, 64, 2
RING_RECORD, RING_DATA, RING_SCALES = 584, 576, 7  # V4 record: 576 data, 7 UE8M0 scales, 1 pad byte
RING_POSITIONS = 4096

RING_C128_WRAPPER = r"""
#include "deepseek_v4/c128_v2.cuh"

#include <cstring>
#include <exception>

static char g_error[2048];

extern "C" const char* dsv4c_sgl_c128_error() { return g_error; }

// SGLang's HCA decode: FlashCompress128Kernel<512, float, float, float, pdl>::run_decode without the tvm-ffi
// tensor checks: the same params, grid (batch * kNumSplit), block and launch (PDL attribute when `pdl`).
extern "C" int dsv4c_sgl_c128_decode(void* kv_buffer, const void* kv_input, void* kv_output, const void* ape,
                                     const void* plan_d, uint32_t batch_size, int pdl, void* stream) {
  using Kernel = sglang::FlashCompress128Kernel<512, float, float, float, true>;
  using Trait = Kernel::Trait;
  try {
    if (batch_size == 0) return 0;
    const auto params = sglang::Compress128DecodeParams{
        .kv_buffer = kv_buffer,
        .kv_input = kv_input,
        .kv_output = kv_output,
        .score_bias = ape,
        .plan_d = static_cast<const sglang::PlanD*>(plan_d),
        .batch_size = batch_size,
    };
    const uint32_t num_blocks = batch_size * Trait::kNumSplit;
    sglang::host::LaunchKernel(num_blocks, Trait::kBlockSize, static_cast<cudaStream_t>(stream))
        .enable_pdl(pdl != 0)(Kernel::decode_kernel, params);
  } catch (const std::exception& e) {
    std::strncpy(g_error, e.what(), sizeof(g_error) - 1);
    return -1;
  }
  return static_cast<int>(cudaGetLastError());
}
"""

RING_STORE_WRAPPER = r"""
#include "deepseek_v4/fused_norm_rope_v2.cuh"

#include <cstring>
#include <exception>

static char g_error[2048];

extern "C" const char* dsv4c_sgl_store_error() { return g_error; }

// SGLang's latent store: FusedNormRopeKernel<float, 512, 64, page 2, 0, bf16_store false, V4, pdl>::forward in
// decode mode without the tvm-ffi tensor checks: one 256-thread block per token.
extern "C" int dsv4c_sgl_store_decode(void* input, const void* plan_d, const void* weight, const float* freqs_cis,
                                      const int64_t* out_loc, uint8_t* kvcache, float eps, uint32_t compress_ratio,
                                      uint32_t num_tokens, int pdl, void* stream) {
  using Kernel = sglang::FusedNormRopeKernel<float, 512, 64, 2, 0, false, sglang::deepseek_v4::KVLayout::V4, true>;
  static_assert(Kernel::kPageBytes == 1728);
  try {
    if (num_tokens == 0) return 0;
    const auto params = sglang::FusedNormRopeStoreParams{
        .input = input,
        .handle = plan_d,
        .weight = weight,
        .freqs_cis = freqs_cis,
        .out_loc = out_loc,
        .kvcache = kvcache,
        .eps = eps,
        .compress_ratio = compress_ratio,
        .num_tokens = num_tokens,
    };
    const auto kernel = Kernel::select_kernel<sglang::ForwardMode::CompressDecode>();
    sglang::host::LaunchKernel(num_tokens, sglang::kBlockSize, static_cast<cudaStream_t>(stream))
        .enable_pdl(pdl != 0)(kernel, params);
  } catch (const std::exception& e) {
    std::strncpy(g_error, e.what(), sizeof(g_error) - 1);
    return -1;
  }
  return static_cast<int>(cudaGetLastError());
}
"""

RING_PLAN_WRAPPER = r"""
#include "deepseek_v4/c_plan.cuh"

#include <cstring>
#include <exception>

static char g_error[2048];

extern "C" const char* dsv4c_sgl_plan_error() { return g_error; }

// SGLang's decode plan: plan_compress_decode without the tvm-ffi tensor checks and allocation (the caller owns
// plan_d, uint8 [batch, 16]): the same params, 256-thread blocks, no PDL.
extern "C" int dsv4c_sgl_plan_decode(void* plan_d, const int64_t* req_pool_indices, const int32_t* req_to_token,
                                     int64_t stride_r2t, const int64_t* full_to_state, const int64_t* seq_lens,
                                     uint32_t batch_size, int32_t compress_ratio, int32_t swa_page_size,
                                     int32_t ring_size, int use_req_ring, void* stream) {
  using namespace sglang::host::compress;
  try {
    if (batch_size == 0) return 0;
    const auto params = DecodeParams{
        .plan_d = static_cast<PlanD*>(plan_d),
        .rid_ptr = req_pool_indices,
        .r2t_ptr = req_to_token,
        .f2s_ptr = full_to_state,
        .seq_ptr = seq_lens,
        .stride_r2t = stride_r2t,
        .batch_size = batch_size,
        .swa_page_size = swa_page_size,
        .ring_size = ring_size,
        .compress_ratio = compress_ratio,
        .use_req_ring = use_req_ring != 0,
    };
    const uint32_t block_size = 256;
    const uint32_t num_blocks = (batch_size + block_size - 1) / block_size;
    sglang::host::LaunchKernel(num_blocks, block_size, static_cast<cudaStream_t>(stream))(
        plan_compress_decode_kernel, params);
  } catch (const std::exception& e) {
    std::strncpy(g_error, e.what(), sizeof(g_error) - 1);
    return -1;
  }
  return static_cast<int>(cudaGetLastError());
}
"""

#: name -> (wrapper source, the kernel file it includes, extra nvcc flags as SGLang's load_jit passes them:
#: ``compress.py`` builds c128_v2 with ``-use_fast_math``, the store and the plan without)
RING_UNITS = {
    "c128": (RING_C128_WRAPPER, "c128_v2.cuh", ["-use_fast_math"]),
    "store": (RING_STORE_WRAPPER, "fused_norm_rope_v2.cuh", []),
    "plan": (RING_PLAN_WRAPPER, "c_plan.cuh", []),
}


def ring_arch() -> tuple[int, int]:
    """The device's compute capability, or (9, 0) (the H200's) when there is no device (compile checks)."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)


def sglang_nvcc_command(src: str, work: str, stem: str, code: str, header: str, extra: list[str],
                        arch: tuple[int, int]) -> tuple[list[str], str, str]:  # fmt: skip
    """Write ``code`` (an extern "C" wrapper around SGLang's ``deepseek_v4/<header>``) to ``<work>/<stem>.cu``;
    the nvcc command that builds it with SGLang's JIT flags (plus ``extra``) into ``<stem>.so``, the .cu, the .so."""
    jit = os.path.join(src, "sglang", "kernels", "jit")
    tvm = os.path.join(src, "tvm_ffi")
    for need in (os.path.join(jit, "csrc", "deepseek_v4", header), os.path.join(tvm, "include")):
        if not os.path.exists(need):
            raise FileNotFoundError(f"{need} is missing (run scripts/engine_pack_sources.sh and carry engine_src)")
    major, minor = arch
    sm = f"{major}{minor}" + ("a" if major >= 9 else "")
    cu = os.path.join(work, f"{stem}.cu")
    lib = os.path.join(work, f"{stem}.so")
    with open(cu, "w") as f:
        f.write(code)
    cmd = [
        "nvcc", f"-gencode=arch=compute_{sm},code=sm_{sm}", f"-DSGL_CUDA_ARCH={major * 100 + minor * 10}",
        "-std=c++20", "-O3", "--expt-relaxed-constexpr", *extra,
        "-shared", "-Xcompiler", "-fPIC", "-I", os.path.join(jit, "include"), "-I", os.path.join(jit, "csrc"),
        "-I", os.path.join(tvm, "include"), cu, "-o", lib, "-L", os.path.join(tvm, "lib"), "-ltvm_ffi",
        f"-Xlinker=-rpath={os.path.abspath(os.path.join(tvm, 'lib'))}",
    ]  # fmt: skip
    return cmd, cu, lib


def ring_nvcc_command(src: str, work: str, name: str, arch: tuple[int, int]) -> tuple[list[str], str, str]:
    """:func:`sglang_nvcc_command` of one ring wrapper (:data:`RING_UNITS`)."""
    code, header, extra = RING_UNITS[name]
    return sglang_nvcc_command(src, work, f"sglang_ring_{name}", code, header, extra, arch)


def build_sglang_ring(src: str, work: str, arch: tuple[int, int] | None = None) -> dict:
    """Compile SGLang's C128 decode, latent store and decode plan (three .so: their flags differ); returns the
    loaded libraries by name, their argument types set."""
    arch = arch or ring_arch()
    libs, procs = {}, {}
    for name in RING_UNITS:  # the three in parallel
        cmd, _, lib = ring_nvcc_command(src, work, name, arch)
        log(f"  nvcc: {' '.join(cmd)}")
        procs[name] = (lib, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for name, (_lib, proc) in procs.items():
        text, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {name}:\n" + text[-4000:])
    for name, (lib, _) in procs.items():
        libs[name] = ctypes.CDLL(lib)
    p, u32, i32, i64, f32 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    libs["c128"].dsv4c_sgl_c128_decode.argtypes = [p, p, p, p, p, u32, ctypes.c_int, p]
    libs["store"].dsv4c_sgl_store_decode.argtypes = [p, p, p, p, p, p, f32, u32, u32, ctypes.c_int, p]
    libs["plan"].dsv4c_sgl_plan_decode.argtypes = [p, p, p, i64, p, p, u32, i32, i32, i32, ctypes.c_int, p]
    for name in RING_UNITS:
        fn = getattr(libs[name], f"dsv4c_sgl_{name}_error")
        fn.restype = ctypes.c_char_p
        getattr(libs[name], {"c128": "dsv4c_sgl_c128_decode", "store": "dsv4c_sgl_store_decode",
                             "plan": "dsv4c_sgl_plan_decode"}[name]).restype = ctypes.c_int  # fmt: skip
    try:
        for name in RING_UNITS:
            lib = os.path.join(work, f"sglang_ring_{name}.so")
            sass = subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True).stdout
            with open(os.path.join(work, f"sglang_ring_{name}.sass"), "w") as f:
                f.write(sass)
            log(f"  {name} SASS: {sass.count('FFMA')} FFMA, {sass.count('MUFU.EX2')} MUFU.EX2, "
                f"{sass.count('MUFU.RSQ')} MUFU.RSQ, {sass.count('MUFU.RCP')} MUFU.RCP")  # fmt: skip
    except Exception as e:  # noqa: BLE001
        log(f"  (no SASS dump: {e})")
    return libs


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


class SglangRing:
    """SGLang's three launches on the current torch stream (so a CUDA graph captures them)."""

    def __init__(self, libs: dict, *, pdl: bool = True):
        self.libs, self.pdl = libs, int(bool(pdl))

    def _check(self, name: str, rc: int) -> None:
        if rc != 0:
            msg = getattr(self.libs[name], f"dsv4c_sgl_{name}_error")().decode(errors="replace")
            raise RuntimeError(f"SGLang {name} launch failed: rc {rc} {msg}")

    @staticmethod
    def _stream():
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def plan(self, plan_d, req_pool_indices, seq_lens, req_to_token, full_to_state) -> None:
        rc = self.libs["plan"].dsv4c_sgl_plan_decode(
            _ptr(plan_d), _ptr(req_pool_indices), _ptr(req_to_token), req_to_token.stride(0), _ptr(full_to_state),
            _ptr(seq_lens), seq_lens.numel(), RING_RATIO, 256, RING_RATIO, 0, self._stream(),
        )  # fmt: skip
        self._check("plan", rc)

    def decode(self, kv_buffer, kv_input, kv_output, ape, plan_d) -> None:
        rc = self.libs["c128"].dsv4c_sgl_c128_decode(
            _ptr(kv_buffer), _ptr(kv_input), _ptr(kv_output), _ptr(ape), _ptr(plan_d), kv_input.shape[0], self.pdl,
            self._stream(),
        )  # fmt: skip
        self._check("c128", rc)

    def store(self, kv, plan_d, weight, freqs, out_loc, pages, eps: float) -> None:
        rc = self.libs["store"].dsv4c_sgl_store_decode(
            _ptr(kv), _ptr(plan_d), _ptr(weight), _ptr(freqs), _ptr(out_loc), _ptr(pages), eps, RING_RATIO,
            kv.shape[0], self.pdl, self._stream(),
        )  # fmt: skip
        self._check("store", rc)


class SglangRingEmulated:
    """The same three steps in PyTorch, mirroring the CUDA code line by line (float32; exact softmax order aside),
    for the CPU checks of this harness's buffers, addressing and comparisons; on the GPU its plan is checked
    against SGLang's. Not a timing subject."""

    def plan(self, plan_d, req_pool_indices, seq_lens, req_to_token, full_to_state) -> None:
        # plan_compress_decode_kernel, compress_ratio 128: write_loc = rid*ring + p%ring, read pages = loc/128
        rid, seq = req_pool_indices.long(), seq_lens.long()
        p1 = seq - 1
        p0 = (p1 - RING_RATIO).clamp(min=0)
        write_loc = rid * RING_RATIO + p1 % RING_RATIO
        read0 = (rid * RING_RATIO + p0 % RING_RATIO) // RING_RATIO
        plan = torch.stack([seq, write_loc, read0, write_loc // RING_RATIO], dim=1).to(torch.int32)
        plan_d.copy_(plan.contiguous().view(torch.uint8).view(-1, 16))

    def decode(self, kv_buffer, kv_input, kv_output, ape, plan_d) -> None:
        plan = plan_d.view(torch.int32).view(-1, 4).long()
        buf = kv_buffer.view(-1, RING_RATIO, 2 * RING_HEAD)
        flat = buf.view(-1, 2 * RING_HEAD)
        flat[plan[:, 1]] = kv_input.float()  # c128_write_decode: the row at write_loc
        closing = torch.nonzero(plan[:, 1] % RING_RATIO == RING_RATIO - 1).reshape(-1)
        if closing.numel():
            win = buf[plan[closing, 3]]  # [N, 128, 2H]: the page read_page_1, all 128 rows (buffer_len 128)
            kv, score = win[..., :RING_HEAD], win[..., RING_HEAD:] + ape[None]
            kv_output[closing] = (torch.softmax(score, dim=1) * kv).sum(1).to(kv_output.dtype)

    def store(self, kv, plan_d, weight, freqs, out_loc, pages, eps: float) -> None:
        from dsv4_compressor.layout import ue8m0_exponent

        plan = plan_d.view(torch.int32).view(-1, 4).long()
        closing = torch.nonzero(plan[:, 0] % RING_RATIO == 0).reshape(-1)
        if not closing.numel():
            return
        x = kv[closing].float()
        position = plan[closing, 0] - RING_RATIO
        n = x * torch.rsqrt((x * x).sum(-1, keepdim=True) / RING_HEAD + eps) * weight.float()
        f = freqs[position].view(-1, RING_ROPE // 2, 2)
        pair = n[:, RING_HEAD - RING_ROPE :].reshape(-1, RING_ROPE // 2, 2)
        xr, xi = pair[..., 0], pair[..., 1]
        rope = torch.stack([xr * f[..., 0] - xi * f[..., 1], xr * f[..., 1] + xi * f[..., 0]], -1).reshape(-1, 64)
        nope = n[:, : RING_HEAD - RING_ROPE].to(torch.bfloat16).float().view(-1, RING_SCALES, 64)
        e = ue8m0_exponent(nope.abs().amax(-1))  # cast_to_ue8m0(max(amax, 1e-4) / 448): the exponent rounded up
        q = torch.ldexp(nope, (-e)[..., None].float()).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        loc = out_loc[closing].long()
        page, slot = loc // RING_PAGE, loc % RING_PAGE
        bpp = pages.stride(0)
        flat = pages.view(-1)
        data = (page * bpp + slot * RING_DATA)[:, None]
        flat[(data + torch.arange(448)).reshape(-1)] = q.reshape(-1)
        flat[(data + 448 + torch.arange(128)).reshape(-1)] = rope.to(torch.bfloat16).view(torch.uint8).reshape(-1)
        scale = (page * bpp + RING_PAGE * RING_DATA + slot * 8)[:, None] + torch.arange(RING_SCALES)
        flat[scale.reshape(-1)] = (e + 127).to(torch.uint8).reshape(-1)  # byte 7 of the scales: not written


class RingInstance:
    """One layer instance: our cache (ring rows ``[kv | score + ape]``, pages, op), SGLang's ring (``[kv |
    score]``, the same history) and pages, and the step's input rows (shared by both); ``history``: SGLang's ring
    before the step (instance 0 only: the reference reads it)."""

    def __init__(self, layer, sg_ring: torch.Tensor, sg_pages, kv_in: torch.Tensor, history):
        self.layer, self.sg_ring, self.sg_pages, self.kv_in, self.history = layer, sg_ring, sg_pages, kv_in, history


class RingCase:
    """One case: ``requests`` requests of one row each, ``boundary`` ``every`` or ``quarter`` (the bench's
    positions, :func:`benchmarks.cases.decode_starts` of copy 0), ``instances`` layer instances, our
    step metadata and plan (``step_meta``), SGLang's plan inputs, plan and ``out_loc``."""

    def __init__(self, requests: int, boundary: str, *, instances: int, params, seed: int, device):
        import numpy as np

        from benchmarks.cases import Case, decode_starts, pages_needed
        from benchmarks.floors import kind_config
        from benchmarks.layers import LayerOp, make_cache, reserve_pages, step_meta
        from dsv4_compressor.workspace import Workspace, plan_c128_scratch

        self.requests, self.boundary, self.device = requests, boundary, torch.device(device)
        self.cfg = cfg = kind_config("hca")
        self.params = params
        case = Case("decode", "hca", "triton-tiled", requests, 1, boundary, instances=instances)
        self.id = case.id
        starts = np.asarray(decode_starts(case, 0), dtype=np.int64)
        ends = starts + 1
        slots = np.arange(requests)
        self.workspace = Workspace(
            plan_c128_scratch(batch_max_tokens=requests, max_req_num=requests, mtp_step=0, head_dim=cfg.head_dim),
            device=self.device,
        )
        max_seq_len = -(-(int(ends.max()) + 1) // cfg.ratio) * cfg.ratio
        pages = pages_needed(cfg, ends, cfg.default_page_size)
        g = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + requests * 10 + len(boundary))
        ape = params.ape
        self.instances: list[RingInstance] = []
        for i in range(instances):
            cache = make_cache(cfg, params, "triton-tiled", max_requests=requests, max_seq_len=max_seq_len,
                               mtp_step=0, device=self.device, workspace=self.workspace, max_pages=pages)  # fmt: skip
            ring = cache.backend.ring
            if tuple(ring.shape) != (requests, RING_RATIO, 2 * RING_HEAD):
                raise RuntimeError(f"our ring is {list(ring.shape)}, not [{requests}, 128, 1024]")
            sg_ring = torch.randn(ring.shape, generator=g, device=self.device)
            ring.copy_(sg_ring)
            ring[..., RING_HEAD:] += ape[None]  # ring row j holds a position with p % 128 == j
            layer = LayerOp(cache, scratch=self.workspace.c128_scratch(0, requests))
            kv_in = torch.randn(requests, 2 * RING_HEAD, generator=g, device=self.device)
            self.instances.append(RingInstance(layer, sg_ring, None, kv_in, sg_ring.clone() if i == 0 else None))
        reserve_pages([inst.layer.cache.pool for inst in self.instances], slots, ends)
        for inst in self.instances:
            inst.sg_pages = torch.empty_like(inst.layer.cache.pool.out_pages)
        self.page_layout = self.instances[0].layer.cache.pool.layout
        self.meta = step_meta(slots, starts, [1] * requests, ratio=cfg.ratio, num_slots=requests, mtp_step=0,
                              device=self.device, pool=self.instances[0].layer.cache.pool)  # fmt: skip
        self.positions = torch.from_numpy(starts.copy()).to(self.device)
        out_slot = torch.from_numpy(self.meta.host[2].copy()).to(self.device)
        self.closing = torch.nonzero(out_slot >= 0).reshape(-1)
        self.slots = out_slot[self.closing]
        # SGLang's step metadata: c128_out_loc (the entry's slot on closing rows, else 0), its plan's inputs
        self.out_loc = torch.where(out_slot >= 0, out_slot, torch.zeros_like(out_slot)).contiguous()
        self.req_pool_indices = torch.from_numpy(slots.copy()).to(self.device)
        self.seq_lens = (self.positions + 1).contiguous()
        self.req_to_token = torch.zeros(1, 1, dtype=torch.int32, device=self.device)  # not read at ratio 128
        self.full_to_state = torch.zeros(1, dtype=torch.int64, device=self.device)  # not read at ratio 128
        self.plan_d = torch.zeros(requests, 16, dtype=torch.uint8, device=self.device)
        table = torch.stack([params.cos, params.sin], dim=-1)  # [P, 32, 2] = view_as_real(freqs_cis)
        self.freqs = table.reshape(table.shape[0], RING_ROPE).contiguous()
        self.weight = params.norm_weight.float().contiguous()  # compress_norm_rope_store casts it to kv's dtype
        self.ape = ape.float().contiguous()
        self.sg_out = torch.empty(requests, RING_HEAD, device=self.device)  # compress_forward's out (reused)

    # -- the two sides -----------------------------------------------------------------------------------------
    def poison(self) -> None:
        for inst in self.instances:
            inst.layer.cache.pool.out_pages.fill_(POISON)
            inst.sg_pages.fill_(POISON)
        self.sg_out.fill_(float("nan"))

    def sglang_plan(self, sg) -> None:
        sg.plan(self.plan_d, self.req_pool_indices, self.seq_lens, self.req_to_token, self.full_to_state)

    def sglang_layers(self, sg) -> None:
        for inst in self.instances:
            sg.decode(inst.sg_ring, inst.kv_in, self.sg_out, self.ape, self.plan_d)
            sg.store(self.sg_out, self.plan_d, self.weight, self.freqs, self.out_loc, inst.sg_pages, self.params.eps)

    def our_plan(self) -> None:
        self.meta.build_plan()

    def our_layers(self) -> None:
        for inst in self.instances:
            inst.layer(inst.kv_in, self.meta)

    # -- checks ------------------------------------------------------------------------------------------------
    def reference_values(self) -> torch.Tensor:
        """Float64 entry values of instance 0's closing rows (docs/SPEC.md section 3: softmax over score + ape,
        RMSNorm, rope at the group start), from SGLang's ring before the step and the step's rows."""
        from dsv4_compressor.reference import finish_entries, params_as

        inst = self.instances[0]
        win = inst.history[self.closing].double().clone()  # [N, 128, 2H]; row 127 is the step's row
        win[:, RING_RATIO - 1] = inst.kv_in[self.closing].double()
        kv, score = win[..., :RING_HEAD], win[..., RING_HEAD:] + self.ape.double()[None]
        pooled = (torch.softmax(score, dim=1) * kv).sum(1)
        starts = self.positions[self.closing] - (RING_RATIO - 1)
        return finish_entries(pooled, starts, params_as(self.params, torch.float64), self.cfg)

    def ring_mismatch(self) -> dict:
        """After a step: our ring rows against SGLang's (kv equal; our score = SGLang's score + ape, float32)."""
        rows = bad_kv = bad_score = 0
        ape = self.ape[None]
        for inst in self.instances:
            ours, theirs = inst.layer.cache.backend.ring, inst.sg_ring
            rows += ours.shape[0] * ours.shape[1]
            bad_kv += int((ours[..., :RING_HEAD] != theirs[..., :RING_HEAD]).any(-1).sum())
            bad_score += int((ours[..., RING_HEAD:] != theirs[..., RING_HEAD:] + ape).any(-1).sum())
        return dict(rows=rows, kv_rows_differ=bad_kv, score_rows_differ=bad_score)


def _ordered(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Sign-magnitude codes (e4m3 bytes, bf16 halves) as integers ordered like their values."""
    c = codes.long() & ((1 << bits) - 1)
    mag = c & ((1 << (bits - 1)) - 1)
    return torch.where(c >> (bits - 1) == 1, -mag, mag)


def compare_latent(ours: torch.Tensor, theirs: torch.Tensor, slots: torch.Tensor, layout, ref=None) -> dict:
    """Our 584-byte records of ``slots`` against SGLang's (and both against float64 ``ref`` values, when given):
    records and bytes that differ (data 576, the 7 scales; the pad byte apart: SGLang does not write it), the
    largest FP8 / bf16 code steps where the scales agree, the largest decoded difference (absolute, and relative
    to the record's largest magnitude), and every byte outside the records (poison expected on both)."""
    from benchmarks.floors import kind_config
    from dsv4_compressor.layout import decode_latent

    cfg = kind_config("hca")
    n = int(slots.numel())
    o, t = layout.read(ours, slots), layout.read(theirs, slots)
    real = RING_DATA + RING_SCALES
    differ = o[:, :real] != t[:, :real]
    rec_diff = differ.any(1)
    scale_eq = (o[:, RING_DATA:real] == t[:, RING_DATA:real]).all(1)
    nope_steps = (_ordered(o[:, :448], 8) - _ordered(t[:, :448], 8)).abs()
    rope_o = o[:, 448:RING_DATA].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    rope_t = t[:, 448:RING_DATA].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    rope_steps = (_ordered(rope_o, 16) - _ordered(rope_t, 16)).abs()
    fixed = o.clone()
    fixed[:, real:] = 0
    tfixed = t.clone()
    tfixed[:, real:] = 0
    do, dt = decode_latent(fixed, cfg).double(), decode_latent(tfixed, cfg).double()
    amax = torch.maximum(do.abs().amax(1), dt.abs().amax(1)).clamp(min=1e-30)
    diff = (do - dt).abs()
    idx = layout._byte_index(slots).reshape(-1)
    touched = torch.zeros(ours.numel(), dtype=torch.bool, device=ours.device)
    touched[idx] = True
    of, tf = ours.reshape(-1), theirs.reshape(-1)
    out = dict(
        records=n, differing_records=int(rec_diff.sum()), differing_data_bytes=int(differ[:, :RING_DATA].sum()),
        differing_scale_bytes=int(differ[:, RING_DATA:].sum()), records_with_scale_diff=int((~scale_eq).sum()),
        max_nope_step=int(nope_steps[scale_eq].max()) if bool(scale_eq.any()) else 0,
        max_rope_step=int(rope_steps.max()) if n else 0,
        max_abs_diff=float(diff.max()) if n else 0.0,
        max_rel_diff=float((diff.amax(1) / amax).max()) if n else 0.0,
        pad_byte_ours=sorted({int(x) for x in o[:, real].tolist()}),
        pad_byte_sglang=sorted({int(x) for x in t[:, real].tolist()}),
        other_bytes_differ=int(((of != tf) & ~touched).sum()),
        untouched_poisoned=bool((of[~touched] == POISON).all()) and bool((tf[~touched] == POISON).all()),
        records_poisoned_ours=int((o[:, :real] == POISON).all(1).sum()),
        records_poisoned_sglang=int((t[:, :real] == POISON).all(1).sum()),
    )  # fmt: skip
    if ref is not None and n:
        # against the float64 values (the FP8 / bf16 rounding included), and against their own encoding (the
        # records layout.encode_latent, docs/SPEC.md section 4, makes of them: what an exact implementation stores)
        from dsv4_compressor.layout import encode_latent

        r = ref.double()
        ramax = r.abs().amax(1).clamp(min=1e-30)
        enc = encode_latent(ref.float(), cfg)
        denc = decode_latent(enc, cfg).double()
        for side, d, rec in (("ours", do, o), ("sglang", dt, t)):
            err = (d - r).abs()
            out[f"{side}_vs_ref_max_abs"] = float(err.max())
            out[f"{side}_vs_ref_max_rel"] = float((err.amax(1) / ramax).max())
            out[f"{side}_vs_ref_records_differ"] = int((rec[:, :real] != enc[:, :real]).any(1).sum())
            out[f"{side}_vs_ref_bytes_differ"] = int((rec[:, :real] != enc[:, :real]).sum())
            out[f"{side}_vs_ref_encoded_max_abs"] = float((d - denc).abs().max())
    examples = []
    for i in torch.nonzero(rec_diff).reshape(-1)[:4].tolist():
        examples.append(dict(
            slot=int(slots[i]), data_bytes_differ=int(differ[i, :RING_DATA].sum()),
            scales_ours=o[i, RING_DATA:real].tolist(), scales_sglang=t[i, RING_DATA:real].tolist(),
            max_abs_diff=float(diff[i].max()),
        ))  # fmt: skip
    out["examples"] = examples
    return out


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """``"default;tile=32;block_t=16,num_warps=8"`` -> ``[(name, launch_c128_tiled overrides), ...]``; ``pdl=0``
    turns programmatic dependent launch off for our launches."""
    out = []
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        if part == "default":
            out.append(("default", {}))
            continue
        kw = {}
        for item in part.split(","):
            key, _, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if key not in ("tile", "block_t", "num_warps", "one_launch", "tile_major", "pdl"):
                raise ValueError(f"unknown variant key {key!r} in {part!r}")
            if key in ("one_launch", "tile_major", "pdl"):
                kw[key] = value.lower() in ("1", "true", "yes")
            else:
                kw[key] = int(value)
        out.append((" ".join(f"{k}={v}" for k, v in kw.items()), kw))
    return out


_ORIGINAL_TILED = None
_ORIGINAL_PDL = None


def install_variant(kw: dict) -> None:
    """Override ``launch_c128_tiled``'s settings as ``ops`` calls it (the bench's tune probe does the same)."""
    global _ORIGINAL_TILED, _ORIGINAL_PDL
    from dsv4_compressor import ops

    if _ORIGINAL_TILED is None:
        _ORIGINAL_TILED, _ORIGINAL_PDL = ops.launch_c128_tiled, ops.pdl_enabled
    kw = dict(kw)
    pdl_on = kw.pop("pdl", None)
    ops.pdl_enabled = _ORIGINAL_PDL if pdl_on is None else (lambda device, on=pdl_on: on and _ORIGINAL_PDL(device))
    if not kw:
        ops.launch_c128_tiled = _ORIGINAL_TILED
        return

    def launch(*args, **kwargs):
        return _ORIGINAL_TILED(*args, **{**kwargs, **kw})

    ops.launch_c128_tiled = launch


def time_graph(timer, fn, *, per: int, replays: int, warm_replays: int, warmup: int, flush) -> dict:
    """Capture ``fn`` (already run once) in one CUDA graph; warm (replayed back to back) and cold (``flush``, a
    read of twice the L2, before each replay, outside the timed events), per ``per`` instances (us)."""
    from benchmarks.timing import summarize

    fn()
    timer.sync()
    graph = timer.capture(fn)
    warm = timer.time([graph], replays=warm_replays, warmup=warmup, queue_ahead=True)
    cold = timer.time([graph], replays=replays, warmup=warmup, queue_ahead=True, before=flush)
    keep = ("median_us", "p10_us", "p90_us", "min_us", "n")
    return dict(
        warm={k: v for k, v in summarize(warm, per=per).items() if k in keep},
        cold={k: v for k, v in summarize(cold, per=per).items() if k in keep},
    )


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _reset_ours(case: RingCase) -> None:
    """Our rings back to the history before the step, our pages poisoned (before another variant runs)."""
    for inst in case.instances:
        ring = inst.layer.cache.backend.ring
        ring.copy_(inst.history if inst.history is not None else inst.sg_ring)
        ring[..., RING_HEAD:] += case.ape[None]
        inst.layer.cache.pool.out_pages.fill_(POISON)


def run_variant(args, case: RingCase, ref, timing: dict | None) -> dict:
    """Our layers once on the case (its state fresh), compared with SGLang's pages; then timed (``timing``: the
    timer and flush, or ``None``)."""
    v: dict = {}
    case.our_layers()
    if case.device.type == "cuda":
        torch.cuda.synchronize()
    cmp = [
        compare_latent(inst.layer.cache.pool.out_pages, inst.sg_pages, case.slots, case.page_layout,
                       ref if i == 0 else None)
        for i, inst in enumerate(case.instances)
    ]  # fmt: skip
    v["compare_instance0"] = cmp[0]
    v["records"] = sum(c["records"] for c in cmp)
    v["differing_records"] = sum(c["differing_records"] for c in cmp)
    v["differing_data_bytes"] = sum(c["differing_data_bytes"] for c in cmp)
    v["differing_scale_bytes"] = sum(c["differing_scale_bytes"] for c in cmp)
    v["max_abs_diff"] = max(c["max_abs_diff"] for c in cmp)
    v["max_rel_diff"] = max(c["max_rel_diff"] for c in cmp)
    v["other_bytes_differ"] = sum(c["other_bytes_differ"] for c in cmp)
    v["untouched_poisoned"] = all(c["untouched_poisoned"] for c in cmp)
    v["ok"] = (not v["other_bytes_differ"] and v["untouched_poisoned"] and v["max_rel_diff"] <= args.max_rel_diff
               and not any(c["records_poisoned_ours"] or c["records_poisoned_sglang"] for c in cmp))  # fmt: skip
    if timing is not None:
        v["ours"] = time_graph(timing["timer"], case.our_layers, per=args.instances, replays=args.replays,
                               warm_replays=args.warm_replays, warmup=args.warmup, flush=timing["flush"])  # fmt: skip
    return v


def run_ring_case(args, sg, params, n: int, boundary: str, variants, timing: dict | None) -> dict:
    """One case: SGLang's plan and layers once on fresh poisoned pages, ours per variant, compared; then timed."""
    case = RingCase(n, boundary, instances=args.instances, params=params, seed=args.seed, device=args.device)
    entry: dict = dict(id=case.id, closing=int(case.closing.numel()), instances=args.instances, variants={})
    case.poison()
    case.sglang_plan(sg)
    want = torch.zeros_like(case.plan_d)
    SglangRingEmulated().plan(want, case.req_pool_indices, case.seq_lens, case.req_to_token, case.full_to_state)
    entry["plan_matches_emulation"] = bool(torch.equal(want, case.plan_d))
    case.sglang_layers(sg)
    ref = case.reference_values()
    for i, (name, kw) in enumerate(variants):
        install_variant(kw)
        try:
            if i:
                _reset_ours(case)
            entry["variants"][name] = v = run_variant(args, case, ref, timing)
            if i == 0:
                entry["ring"] = case.ring_mismatch()
            log(f"  [{name}] records {v['records']}, differing {v['differing_records']} ({v['differing_data_bytes']} "
                f"data / {v['differing_scale_bytes']} scale bytes), max abs diff {v['max_abs_diff']:.3g} (rel "
                f"{v['max_rel_diff']:.3g}), other bytes differ {v['other_bytes_differ']}, untouched poisoned "
                f"{v['untouched_poisoned']}" + (f"; ours warm {v['ours']['warm']['median_us']:.2f} cold "
                f"{v['ours']['cold']['median_us']:.2f} us/layer" if "ours" in v else ""))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            entry["variants"][name] = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            log(f"  [{name}] failed: {entry['variants'][name]['error']}\n{entry['variants'][name]['traceback']}")
        finally:
            install_variant({})
    first = entry["variants"][variants[0][0]].get("compare_instance0", {})
    log("  instance 0: " + json.dumps({k: x for k, x in first.items() if k != "examples"}))
    for ex in first.get("examples", []):
        log(f"    {ex}")
    log(f"  rings after the step: {entry.get('ring')}; SGLang plan = emulation: {entry['plan_matches_emulation']}")
    ring = entry.get("ring") or {}
    entry["ok"] = (entry["plan_matches_emulation"] and ring.get("rows", 0) > 0 and not ring.get("kv_rows_differ")
                   and not ring.get("score_rows_differ")
                   and all(v.get("ok") for v in entry["variants"].values()))  # fmt: skip
    # SGLang's emulation is timed only on the CPU (to run the code path; its nonzero() cannot be captured)
    if timing is not None and (isinstance(sg, SglangRing) or case.device.type == "cpu"):
        t = dict(per=args.instances, replays=args.replays, warm_replays=args.warm_replays, warmup=args.warmup,
                 flush=timing["flush"])  # fmt: skip
        entry["sglang_timing"] = time_graph(timing["timer"], lambda: case.sglang_layers(sg), **t)
        # the plans: one per step, shared by the layers; a graph of `instances` launches, per launch
        entry["sglang_plan_timing"] = time_graph(
            timing["timer"], lambda: [case.sglang_plan(sg) for _ in range(args.instances)], **t
        )
        entry["our_plan_timing"] = time_graph(
            timing["timer"], lambda: [case.our_plan() for _ in range(args.instances)], **t
        )
        s, sp, op = entry["sglang_timing"], entry["sglang_plan_timing"], entry["our_plan_timing"]
        log(f"  SGLang warm {s['warm']['median_us']:.2f} cold {s['cold']['median_us']:.2f} us/layer; plan per step "
            f"(warm / cold): SGLang {sp['warm']['median_us']:.2f} / {sp['cold']['median_us']:.2f} us, ours "
            f"{op['warm']['median_us']:.2f} / {op['cold']['median_us']:.2f} us")  # fmt: skip
    if args.bench_cross_check and timing is not None and case.device.type == "cuda":
        try:  # our default as the project's bench measures it (cold: rotated input copies, not a flush)
            from benchmarks.cases import Case
            from benchmarks.runner import Runner

            res = Runner(timing["timer"], replays=args.replays, warmup=args.warmup, warm_replays=args.warm_replays,
                         l2_bytes=args.l2_mib * 2**20, seed=args.seed).run(
                Case("decode", "hca", "triton-tiled", n, 1, boundary, instances=args.instances))  # fmt: skip
            warm = (res.get("warm") or {}).get("median_us")
            entry["bench"] = dict(status=res["status"], error=res.get("error"), cold_us=res.get("us_per_layer"),
                                  warm_us=warm, copies=res.get("copies"))  # fmt: skip
            log(f"  bench {res['id']}: {entry['bench']}")
        except Exception as e:  # noqa: BLE001
            entry["bench"] = dict(status="error", error=f"{type(e).__name__}: {e}")
            log(f"  bench cross-check failed: {entry['bench']['error']}")
    return entry


def table_rows(key: str, entry: dict) -> list[str]:
    """The markdown rows of one case: one per variant of ours against SGLang's figure."""

    def med(t, which):
        return t[which]["median_us"] if t else None

    sgt = entry.get("sglang_timing")
    rows = []
    for name, v in entry.get("variants", {}).items():
        ours = v.get("ours")
        ow, oc, sw, sc = med(ours, "warm"), med(ours, "cold"), med(sgt, "warm"), med(sgt, "cold")
        rw = ow / sw if ow and sw else None
        rcold = oc / sc if oc and sc else None
        diff = f"{v['differing_records']} / {v['records']}" if "records" in v else "error"
        mad = f"{v['max_abs_diff']:.3g}" if "max_abs_diff" in v else "-"
        rows.append(f"| {key} | {name} | {_fmt(ow)} | {_fmt(oc)} | {_fmt(sw)} | {_fmt(sc)} | {_fmt(rw)} | "
                    f"{_fmt(rcold)} | {diff} | {mad} |")  # fmt: skip
    return rows


def ring_main(args) -> int:
    from benchmarks.floors import kind_config
    from benchmarks.timing import CudaTimer, HostTimer
    from dsv4_compressor.config import CompressorParams

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    work = os.path.join(args.out, "build")
    os.makedirs(work, exist_ok=True)
    report: dict = dict(mode="ring-decode", args=vars(args), cases={})
    if gpu and not torch.cuda.is_available():
        log("not run: no CUDA device")
        report["error"] = "no CUDA device"
        return _ring_write(args, report, 1)
    report["environment"] = dict(
        device=torch.cuda.get_device_name() if gpu else "cpu", torch=torch.__version__, triton=triton.__version__,
        python=sys.version.split()[0], interpret=os.environ.get("TRITON_INTERPRET"),
    )  # fmt: skip
    log(f"environment: {report['environment']}")
    if args.sglang == "emulated" or not gpu:
        sg, report["sglang"] = SglangRingEmulated(), "emulated in PyTorch (not SGLang's kernels; timed only on the CPU)"
    else:
        try:
            sg, report["sglang"] = SglangRing(build_sglang_ring(args.src, work), pdl=args.sglang_pdl), "kernels"
        except Exception as e:  # noqa: BLE001
            report["sglang"] = f"not built: {type(e).__name__}: {e}"
            log(report["sglang"])
            return _ring_write(args, report, 1)
    timing = None
    if gpu and not args.no_timing:
        flush_buf = torch.empty(max(1, 2 * args.l2_mib * 2**20 // 4), device=device)
        timing = dict(timer=CudaTimer(device), flush=flush_buf.sum)
    elif not args.no_timing:  # the CPU check of the timing path: host clock, no capture, no flush
        timing = dict(timer=HostTimer(), flush=None)
    params = CompressorParams.random(kind_config("hca"), max_positions=RING_POSITIONS, seed=args.seed, device=device)
    variants = parse_variants(args.variants)
    ok, rows_md = True, []
    for n in [int(s) for s in args.ring_sizes.split(",")]:
        for boundary in args.ring_cases.split(","):
            key = f"4B={n} {boundary}"
            closes = "every request closes a group" if boundary == "every" else "every 4th request closes a group"
            log(f"== {key}: {n} requests x S = 1, {closes}")
            try:
                entry = run_ring_case(args, sg, params, n, boundary, variants, timing)
            except Exception as e:  # noqa: BLE001
                entry = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                log(f"  failed: {entry['error']}\n{entry['traceback']}")
            report["cases"][key] = entry
            ok = ok and entry["ok"]
            rows_md += table_rows(key, entry)
            if gpu:
                torch.cuda.empty_cache()
    table = [
        f"us per layer: median over replays of a CUDA graph of {args.instances} layer instances; warm: replayed back "
        f"to back; cold: {2 * args.l2_mib} MiB read before each replay; ratio = ours / SGLang; SGLang: "
        f"{report['sglang']} (its c128 decode + its norm-rope-store per layer; plans not included)",
        "",
        "| case | our variant | ours warm | ours cold | SGLang warm | SGLang cold | ratio warm | ratio cold | "
        "differing records | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows_md,
    ]
    log("")
    for line in table:
        log(line)
    with open(os.path.join(args.out, "ring_decode.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    report["table"] = table
    return _ring_write(args, report, 0 if ok else 1)


def _ring_write(args, report: dict, rc: int) -> int:
    report["ok"] = rc == 0
    with open(os.path.join(args.out, "ring_decode.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "ring_decode.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    log(f"ring decode: {'ok' if rc == 0 else 'FAILED'} ({os.path.join(args.out, 'ring_decode.json')})")
    return rc


def ring_compile_check(args) -> int:
    """Build the three ring wrappers for the given arch without a device (``--ring-compile-only``)."""
    work = os.path.join(args.out, "build")
    os.makedirs(work, exist_ok=True)
    major, minor = (int(x) for x in args.arch.split("."))
    rc = 0
    for name in RING_UNITS:
        cmd, _, lib = ring_nvcc_command(args.src, work, name, (major, minor))
        log(f"  nvcc: {' '.join(cmd)}")
        r = subprocess.run(cmd, capture_output=True, text=True)
        log(f"  {name}: {'built ' + lib if r.returncode == 0 else 'FAILED'}")
        if r.returncode != 0:
            log((r.stdout + r.stderr)[-4000:])
            rc = 1
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default="engine_src", help="folder made by scripts/engine_pack_sources.sh")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--sizes", default="16,256")
    ap.add_argument("--seed", type=int, default=0)
    ring = ap.add_argument_group("--ring-decode: SGLang's C128 ring decode against our tiled kernel")
    ring.add_argument("--ring-decode", action="store_true", help="run the ring decode harness instead")
    ring.add_argument("--ring-compile-only", action="store_true", help="only build its CUDA wrappers (--arch)")
    ring.add_argument("--arch", default="9.0", help="compute capability for --ring-compile-only")
    ring.add_argument("--device", default="cuda", help="cpu: our side under TRITON_INTERPRET=1, SGLang emulated")
    ring.add_argument("--sglang", choices=("kernels", "emulated"), default="kernels")
    ring.add_argument("--sglang-pdl", type=int, default=1, help="launch SGLang's kernels with PDL (as on sm90)")
    ring.add_argument("--ring-sizes", default="64,256,1024", help="requests 4B of S = 1 row each")
    ring.add_argument("--ring-cases", default="every,quarter", help="every: all close a group; quarter: every 4th")
    ring.add_argument("--instances", type=int, default=20, help="layer instances per CUDA graph")
    ring.add_argument("--replays", type=int, default=200, help="timed cold replays")
    ring.add_argument("--warm-replays", type=int, default=100, help="timed warm replays")
    ring.add_argument("--warmup", type=int, default=20)
    ring.add_argument("--l2-mib", type=int, default=60, help="cold replays read 2x this many MiB first")
    ring.add_argument("--no-timing", action="store_true", help="only the byte comparisons")
    ring.add_argument(
        "--bench-cross-check",
        action="store_true",
        help="also run the bench's own decode case for ours (cold there: rotated input copies)",
    )
    ring.add_argument(
        "--max-rel-diff",
        type=float,
        default=0.15,
        help="largest decoded difference, relative to a record's largest value, that passes",
    )
    ring.add_argument(
        "--variants",
        default="default",
        help="our launch variants, ';'-separated, each 'default' or k=v,... over tile, block_t, "
        "num_warps, one_launch, tile_major (launch_c128_tiled) and pdl, e.g. "
        "'default;tile=32;block_t=16,num_warps=8'",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.ring_compile_only:
        return ring_compile_check(args)
    if args.ring_decode:
        return ring_main(args)
    work = os.path.join(args.out, "build")
    os.makedirs(work, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    report: dict = dict(sizes=sizes, engines={})
    if not torch.cuda.is_available():
        log("not run: no CUDA device")
        report["error"] = "no CUDA device"
    else:
        report["environment"] = dict(
            gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
            torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0],
        )  # fmt: skip
        try:
            report["environment"]["nvcc"] = subprocess.run(
                ["nvcc", "--version"], capture_output=True, text=True
            ).stdout.strip().splitlines()[-1]  # fmt: skip
        except Exception as e:  # noqa: BLE001
            report["environment"]["nvcc"] = f"none: {e}"
        log(f"environment: {report['environment']}")
        try:
            report["probes"] = probes()
        except Exception as e:  # noqa: BLE001
            report["probes"] = f"failed: {e!r}"
        log(f"probes: {report['probes']}")
        engines = {
            "sglang": ("hadamard_f32", lambda: build_sglang(args.src, work), run_sglang, ours_finish),
            "lightllm": ("hadamard_bf16", lambda: load_lightllm(args.src), run_lightllm, ours_pack),
        }
        for name, (pack, setup, theirs, ours) in engines.items():
            log(f"== {name}: our {pack!r} pack against the engine's kernel")
            entry: dict = dict(pack=pack)
            report["engines"][name] = entry
            try:
                handle = setup()
            except Exception as e:  # noqa: BLE001
                entry["status"] = f"not run: {type(e).__name__}: {e}"
                log(f"  {entry['status']}")
                continue
            entry["status"] = "run"
            for batch in sizes:
                try:
                    inp = make_inputs(batch, args.seed, "cuda")
                    result = compare(ours(inp, pack), theirs(handle, inp), inp["slots"])
                    result["verdict"] = "identical" if result["differing_records"] == 0 and not result[
                        "other_bytes_differ"] else "DIFFERENT"  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    result = dict(verdict=f"failed: {type(e).__name__}: {e}", traceback=traceback.format_exc())
                entry[f"B={batch}"] = result
                log(f"  B={batch}: {result.get('verdict')}: " + json.dumps(
                    {k: v for k, v in result.items() if k not in ("examples", "traceback", "verdict")}))  # fmt: skip
                for ex in result.get("examples", []):
                    log(f"    {ex}")
                if "traceback" in result:
                    log(result["traceback"])
    with open(os.path.join(args.out, "engine_pack_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "engine_pack_check.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    ok = all(
        isinstance(v, dict) and v.get("verdict") == "identical"
        for e in report["engines"].values() if e.get("status") == "run"
        for k, v in e.items() if k.startswith("B=")
    )  # fmt: skip
    parts = []
    for name, e in report["engines"].items():
        runs = " ".join(f"{k} {v['verdict']}" for k, v in e.items() if k.startswith("B="))
        parts.append(f"{name}: {runs if e['status'] == 'run' else e['status']}")
    log("summary: " + ", ".join(parts))
    return 0 if ok and report["engines"] else 1


if __name__ == "__main__":
    sys.exit(main())
