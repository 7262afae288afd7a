"""``--ring-decode``'s SGLang side: the ring's shapes (V4 584-byte records at page 2), the C wrappers of SGLang
0.5.23's C128 decode, latent store and decode plan (:data:`RING_UNITS`), their build (:func:`build_sglang_ring`,
:func:`ring_nvcc_command`), their launches on the current torch stream (:class:`SglangRing`) and the same three
steps in PyTorch (:class:`SglangRingEmulated`, for the CPU and to check SGLang's plan)."""

from __future__ import annotations

import ctypes
import os
import subprocess

import torch

from .common import log, sglang_nvcc_command

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
