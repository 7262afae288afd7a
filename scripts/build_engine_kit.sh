#!/usr/bin/env bash
# Build engine_kit/ (git-ignored through .git/info/exclude): what brings SGLang 0.5.23 and vLLM 0.33.0 onto the
# offline GPU machine (Python 3.12, torch, triton, nvcc, ninja), for the GPU tests through the real engine
# classes (tests/test_engine_sglang_gpu.py); carry it there with `carry: ["engine_kit"]`. Runs on a CPU machine
# that has the engines' CPU environments (make test-sglang / test-vllm build them) and reaches PyPI.
#
#   VENV_SGLANG=/path/.venv-sglang VENV_VLLM=/path/.venv-vllm bash scripts/build_engine_kit.sh [--check]
#
# What goes in (tests/helpers/engine_kit.py unpacks it on the machine and arranges sys.path):
#   front/sglang.zip     the sglang package's directories that the DeepSeek-V4 compressor / attention backend
#                        path imports (a census: importing what the tests import, on CPU and with torch.cuda
#                        reporting an H100 so the `if is_cuda():` imports run; plus every directory an imported
#                        module names in a function-level import), pure Python though the wheel is cp311; its JIT
#                        headers (kernels/jit/include) and DeepSeek-V4 CUDA sources (kernels/jit/csrc/deepseek_v4),
#                        from which SGLang's load_jit builds c4_v2, c128_v2, fused_norm_rope_v2 and c_plan with
#                        the machine's nvcc
#   front/vllm.zip       the vllm package's directories of the same census (no vllm._C: the CUDA extensions)
#   front/apache_tvm_ffi-0.1.11-cp312-*.whl   SGLang's pin, the cp312 build load_jit links against
#   front/stand_ins.zip  import-only stand-ins (tests/helpers/kit_stand_ins) for two CUDA kernel packages too
#                        large to carry that SGLang imports on a CUDA machine off the compressor path: flash_mla
#                        (the backend's constructor imports it; its builders call only the empty
#                        get_mla_metadata(); no compressor calls it) and sgl_kernel (module-level imports of
#                        SGLang's quantization, GGUF and HiSparse modules); every other name raises when called
#   back/*.whl           the dependencies those imports load (cp312 manylinux wheels where compiled), at the
#                        versions of the engines' CPU environments (tests/engines/*.txt), put after the
#                        machine's own site-packages so what the image has (torch, triton, numpy, transformers,
#                        huggingface_hub, tokenizers, safetensors, pillow, ...) is the image's
# Not carried: deep_gemm (SGLang falls back without it: ENABLE_JIT_DEEPGEMM off), flashinfer, vLLM's CuTe-DSL
# kernels (nvidia-cutlass-dsl) and FlashMLA; the GPU tests compare against the engines' own compressor kernels
# (SGLang: its JIT CUDA kernels; vLLM: its Triton compress_norm_rope_store kernels).
#
# --check: on this CPU machine, in a Python without either engine ($PYTHON_CHECK, default the project's .venv),
# activate the kit (python -S semantics are not needed: the engines are not installed there) and import every
# module the GPU tests import; the cp312 compiled wheels cannot load on another Python, so the check puts the
# same versions' wheels for the local Python last on the path (downloaded into the cache, never into the kit).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-engine_kit}
CACHE=${KIT_CACHE:-$HOME/.cache/dsv4c-engine-kit}
VENV_SGLANG=${VENV_SGLANG:-.venv-sglang}
VENV_VLLM=${VENV_VLLM:-.venv-vllm}
PYTHON_CHECK=${PYTHON_CHECK:-.venv/bin/python}
LIMIT_MIB=${LIMIT_MIB:-60}
# the GPU image is Python 3.12.3 on a glibc of 2.39 (Ubuntu 24.04's)
PLATFORMS=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform manylinux_2_5_x86_64 --platform linux_x86_64)
PIP="$VENV_SGLANG/bin/python -m pip"
KIT_PLATFORMS=$(printf '%s\n' "${PLATFORMS[@]}" | python3 -c 'import json, sys; print(json.dumps(sys.stdin.read().split()))')
export KIT_PLATFORMS

if [ "${1:-}" = "--check" ]; then
  [ -f "$KIT/manifest.json" ] || { echo "no kit at $KIT (build it first)"; exit 1; }
  local_py=$("$PYTHON_CHECK" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  shadow="$CACHE/check-cp$local_py"
  mkdir -p "$shadow"
  # the compiled back wheels again, for this Python (same versions): only for the check, never carried
  "$PYTHON_CHECK" - "$KIT" "$shadow" <<'EOF'
import json, sys, pathlib
kit, shadow = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
m = json.loads((kit / "manifest.json").read_text())
import importlib.util
for part in ("front", "back"):
    names = [w for w in m[part] if w.endswith(".whl") and "-none-any" not in w]
    want = [f"{w.split('-')[0]}=={w.split('-')[1]}" for w in names]
    if part == "back":  # what the GPU image has and this Python lacks, at the engines' versions
        want += [f"{d}=={v}" for top, (d, v) in m.get("image", {}).items() if importlib.util.find_spec(top) is None]
    (shadow / f"{part}.txt").write_text("".join(w + "\n" for w in want))
EOF
  for part in front back; do
    rm -rf "$shadow/$part" && mkdir -p "$shadow/$part"
    if [ -s "$shadow/$part.txt" ]; then
      $PIP download -q --no-deps --only-binary=:all: -d "$shadow/wheels-$part" -r "$shadow/$part.txt"
      for w in "$shadow/wheels-$part"/*.whl; do unzip -q -o "$w" -d "$shadow/$part"; done
    fi
  done
  # the kit as on the GPU machine, with this Python's builds of the same versions just before the kit's cp312
  # ones (front: tvm-ffi; back: after the site-packages), the engines nowhere
  PYTHONPATH="$PWD/tests:$PWD/src" DSV4C_ENGINE_SITE="$CACHE/check-site" DSV4C_KIT_SHADOW_FRONT="$shadow/front" \
    DSV4C_KIT_SHADOW="$shadow/back" "$PYTHON_CHECK" tests/helpers/engine_kit.py check "$KIT"
  exit $?
fi

grep -qx '/engine_kit/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
  || echo '/engine_kit/' >> "$(git rev-parse --git-common-dir)/info/exclude"
rm -rf "$KIT" && mkdir -p "$KIT/front" "$KIT/back" "$KIT/census" "$CACHE/wheels"

echo "== census (the engines' CPU environments; with torch.cuda reporting an H100 for the CUDA imports)"
for mode in cpu cuda; do
  TRITON_INTERPRET=1 "$VENV_SGLANG/bin/python" tests/helpers/engine_kit.py census sglang "$KIT/census/sglang_$mode.json" $mode \
    2> "$KIT/census/sglang_$mode.log"
  TRITON_INTERPRET=1 "$VENV_VLLM/bin/python" tests/helpers/engine_kit.py census vllm "$KIT/census/vllm_$mode.json" $mode \
    2> "$KIT/census/vllm_$mode.log"
done
grep -h '^census' "$KIT"/census/*.log || true

echo "== front: the engine subsets and the stand-ins; back: the dependencies' wheels"
"$VENV_SGLANG/bin/python" - "$KIT" "$VENV_SGLANG" "$VENV_VLLM" "$CACHE/wheels" <<'EOF'
import json, pathlib, subprocess, sys, zipfile, importlib.metadata as md

kit, venv_sg, venv_vl, wheels = (pathlib.Path(a) for a in sys.argv[1:5])

def site(venv):
    return next(pathlib.Path(venv).glob("lib/python3*/site-packages"))

def census(name):
    dirs, tops = set(), set()
    for mode in ("cpu", "cuda"):
        d = json.loads((kit / "census" / f"{name}_{mode}.json").read_text())
        dirs.update(d["dirs"]); tops.update(d["tops"])
    return sorted(dirs), sorted(tops)

def zip_dirs(out, base, dirs, trees=(), files=()):
    n = 0
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for d in dirs:
            for f in sorted((base / d).glob("*.py")):
                z.write(f, f.relative_to(base)); n += 1
        for t in trees:
            for f in sorted((base / t).rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts:
                    z.write(f, f.relative_to(base)); n += 1
        for f in files:
            z.write(base / f, f); n += 1
    return n

manifest = dict(front=[], back=[], sizes={})
# the engines' own packages, subset
for name, venv, trees in (
    ("sglang", venv_sg, ("sglang/kernels/jit/include", "sglang/kernels/jit/csrc/deepseek_v4")),
    ("vllm", venv_vl, ()),
):
    base = site(venv)
    dirs, _ = census(name)
    dist = next(base.glob(f"{name}-*.dist-info"))
    meta = [str(p.relative_to(base)) for p in dist.iterdir() if p.name in ("METADATA", "entry_points.txt", "top_level.txt")]
    n = zip_dirs(kit / "front" / f"{name}.zip", base, dirs, trees, meta)
    manifest["front"].append(f"{name}.zip")
    print(f"  {name}: {len(dirs)} directories, {n} files")
# the stand-ins
stand = pathlib.Path("tests/helpers/kit_stand_ins")
with zipfile.ZipFile(kit / "front" / "stand_ins.zip", "w", zipfile.ZIP_DEFLATED) as z:
    for f in sorted(stand.rglob("*.py")):
        z.write(f, f.relative_to(stand))
manifest["front"].append("stand_ins.zip")

# dependencies: what the census loaded from site-packages, less what the GPU image has or must keep its own of
IMAGE = {"torch", "triton", "numpy", "functorch", "torchgen", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
         "filelock", "fsspec", "typing_extensions", "_distutils_hack", "setuptools", "pkg_resources", "packaging",
         "_pytest", "pytest", "pluggy", "iniconfig", "py", "transformers", "huggingface_hub", "tokenizers",
         "safetensors", "sentencepiece", "PIL", "sglang", "vllm", "dsv4_compressor", "tests", "helpers"}
want = {}
for name, venv in (("sglang", venv_sg), ("vllm", venv_vl)):
    _, tops = census(name)
    py = str(pathlib.Path(venv) / "bin" / "python")
    code = ("import json, sys, importlib.metadata as md; pd = md.packages_distributions(); "
            "out = {t: [(d, md.version(d)) for d in pd.get(t, [])] for t in sys.argv[1:]}; print(json.dumps(out))")
    found = json.loads(subprocess.check_output([py, "-c", code, *sorted(tops)]))
    for top, dists in found.items():
        if top in IMAGE:  # the GPU image's own; recorded for --check, which stands them in on a bare Python
            if dists and top not in ("sglang", "vllm", "dsv4_compressor"):
                manifest.setdefault("image", {})[top] = list(dists[0])
            continue
        if not dists:
            print(f"  (no distribution for {top}: skipped)")
        for d, v in dists:
            want.setdefault(d.lower().replace("_", "-"), v)
tvm = "apache-tvm-ffi"
reqs = sorted(f"{d}=={v}" for d, v in want.items())
(kit / "census" / "requirements.txt").write_text("\n".join(reqs) + "\n")
cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
       "--implementation", "cp", "-d", str(wheels), *json.loads(__import__("os").environ["KIT_PLATFORMS"]), *reqs]
subprocess.check_call(cmd)
for d, v in sorted(want.items()):
    norm = d.replace("-", "_").lower()
    hits = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(f"{norm}-{v}-")]
    hits = [w for w in hits if "cp312" in w.name or "abi3" in w.name or "-none-any" in w.name or "py3" in w.name]
    if not hits:
        sys.exit(f"no cp312 wheel of {d}=={v} in {wheels}")
    w = sorted(hits)[0]
    part = "front" if d == tvm else "back"
    (kit / part / w.name).write_bytes(w.read_bytes())
    manifest[part].append(w.name)
for part in ("front", "back"):
    for f in (kit / part).iterdir():
        manifest["sizes"][f"{part}/{f.name}"] = f.stat().st_size
(kit / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
EOF
total=$(du -sb "$KIT" | cut -f1)
echo "== kit: $KIT, $((total / 1024 / 1024)) MiB ($total bytes)"
du -sh "$KIT"/front/* | sort -h | tail -n 6
echo "   back: $(ls "$KIT"/back | wc -l) wheels, $(du -sh "$KIT"/back | cut -f1)"
[ "$total" -le $((LIMIT_MIB * 1024 * 1024)) ] || { echo "the kit is over $LIMIT_MIB MiB: trim it"; exit 1; }
