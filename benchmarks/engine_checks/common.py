"""What both checks share: the poison byte of every page buffer, the run's log (:func:`log` prints a line and keeps
it in :data:`LOG`, which the checks write to their ``.log`` files) and :func:`sglang_nvcc_command`, the nvcc command
that builds an extern "C" wrapper around an SGLang kernel with SGLang's JIT flags."""

from __future__ import annotations

import os

POISON = 0xAB
LOG: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


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
