#!/usr/bin/env bash
# Gather what scripts/engine_pack_check.py needs on the (offline) GPU machine into engine_src/ (git-ignored through
# .git/info/exclude), from the cached wheels and the fetched LightLLM kernels; then carry "engine_src":
#   engine_src/sglang/kernels/jit/{include,csrc/deepseek_v4}   SGLang 0.5.23's JIT headers and kernel sources
#   engine_src/tvm_ffi/{include,lib}                          apache-tvm-ffi 0.1.11 (SGLang's pin): headers, lib
#   engine_src/lightllm/*.py                                  LightLLM's hadamard_transform and indexer pack
# WHEELS (default /work/cache/wheels) and LIGHTLLM (default /work/cache/lightllm_ds4) say where they are.
set -euo pipefail
WHEELS=${WHEELS:-/work/cache/wheels}
LIGHTLLM=${LIGHTLLM:-/work/cache/lightllm_ds4}
DEST=${DEST:-engine_src}
rm -rf "$DEST" && mkdir -p "$DEST/lightllm"
grep -qx '/engine_src/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
  || echo '/engine_src/' >> "$(git rev-parse --git-common-dir)/info/exclude"
unzip -q -o "$WHEELS"/sglang-0.5.23-*.whl 'sglang/kernels/jit/include/*' 'sglang/kernels/jit/csrc/deepseek_v4/*' -d "$DEST"
unzip -q -o "$WHEELS"/apache_tvm_ffi-0.1.11-*.whl 'tvm_ffi/include/*' 'tvm_ffi/lib/libtvm_ffi.so' -d "$DEST"
cp "$LIGHTLLM"/hadamard_transform.py "$LIGHTLLM"/destindex_copy_indexer_k_dsv4.py "$LIGHTLLM"/SOURCE.txt "$DEST/lightllm/"
du -sh "$DEST"
