"""The engine kit (``scripts/build_engine_kit.sh``): SGLang's and vLLM's Python on the offline GPU machine.

The GPU machine has Python 3.12, torch, triton, nvcc and ninja but neither engine and no network; the kit is a
git-ignored ``engine_kit/`` folder carried there (``carry: ["engine_kit"]``) holding zip archives:

* ``front/*.zip``: what must win over anything the machine has, put first on ``sys.path``: the subset of the
  ``sglang`` 0.5.23 package its DeepSeek-V4 compressor path imports (pure Python; with its JIT headers and
  ``deepseek_v4`` CUDA sources), the cp312 ``apache-tvm-ffi`` 0.1.11 wheel SGLang's ``load_jit`` builds
  with, the subset of the ``vllm`` 0.33.0 package (without ``vllm._C``), and the stand-ins (``stand_ins.zip``:
  import-only modules for ``flash_mla``, ``sgl_kernel``, CUDA kernel packages too large
  to carry, every attribute a placeholder that raises if called);
* ``back/*.whl``: the pure-Python and cp312 manylinux dependencies of those imports at the versions of
  ``tests/engines/*.txt``, appended after the machine's own site-packages, so a package the image already has
  is the image's.

:func:`activate` unpacks them once (into ``$DSV4C_ENGINE_SITE``, default ``/tmp/dsv4c_engine_site``, keyed by
the manifest's hash) and arranges ``sys.path``; it returns ``None`` when there is no kit. ``python
tests/helpers/engine_kit.py census ...`` is the builder's module census (run by the build script in the
engines' CPU environments), ``... check KIT`` the build script's ``--check``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "manifest.json"

# what the GPU tests import from each engine: the census imports these (and the CPU tests' modules)
SGLANG_MODULES = (
    "sglang.srt.layers.attention.deepseek_v4_backend",
    "sglang.srt.layers.attention.dsv4.compressor",
    "sglang.srt.layers.attention.dsv4.compressor_v2",
    "sglang.srt.layers.attention.dsv4.compressor_trtllm",
    "sglang.srt.layers.attention.dsv4.unified_kv_gate",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool",
    "sglang.srt.mem_cache.deepseek_v4_compress_state",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.kv_cache_configurator",
    "sglang.srt.model_executor.pool_configurator",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.model_executor.runner_utils.capture_mode",
    "sglang.srt.runtime_context",
    "sglang.srt.server_args",
    "sglang.srt.speculative.spec_info",
    "sglang.srt.layers.attention.dsa.utils",
    "sglang.srt.plugins",
    "sglang.kernels.ops.attention.dsv4",
    "sglang.kernels.ops.attention.dsv4.compress",
    "sglang.kernels.ops.attention.dsv4.rope",
    "sglang.kernels.ops.attention.dsv4.metadata_kernel",
    "sglang.kernels.ops.attention.dsv4.dequant_k_cache",
    "sglang.kernels.ops.attention.flash_mla_interface",
    "sglang.kernels.jit.utils.compile.loader",
)
VLLM_MODULES = (
    "vllm.models.deepseek_v4.compressor",
    "vllm.models.deepseek_v4.attention",
    "vllm.models.deepseek_v4.common.rope",
    "vllm.v1.attention.backends.mla.indexer",
    "vllm.v1.attention.backends.mla.compressor_utils",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.block_table",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.kv_cache_layout",
    "vllm.distributed.parallel_state",
    "vllm.forward_context",
    "vllm.platforms.interface",
)
STAND_INS = ("flash_mla", "sgl_kernel")
KIT_PYTHON = (3, 12)  # the GPU image's Python, which the compiled wheels are built for


def kit_dir() -> Path:
    return Path(os.environ.get("DSV4C_ENGINE_KIT", ROOT / "engine_kit"))


def _manifest(kit: Path) -> dict | None:
    path = kit / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def activate(kit: Path | str | None = None) -> dict | None:
    """Unpack the kit (once) and put its front archives first and its back wheels last on ``sys.path``.

    Returns the manifest (``{"front": [...], "back": [...], "sizes": {...}}``) or ``None`` without a kit or on a
    Python other than 3.12 (the compiled wheels' ABI). Idempotent. Call before anything imports an engine."""
    kit = Path(kit) if kit is not None else kit_dir()
    manifest = _manifest(kit)
    if manifest is None:
        return None
    shadowed = "DSV4C_KIT_SHADOW" in os.environ  # --check: another Python's builds stand in for the cp312 ones
    if sys.version_info[:2] != KIT_PYTHON and not shadowed:
        return None  # the compiled wheels are cp312: on another Python the kit cannot load
    key = hashlib.sha256((kit / MANIFEST).read_bytes()).hexdigest()[:16]
    site = Path(os.environ.get("DSV4C_ENGINE_SITE", "/tmp/dsv4c_engine_site")) / key
    front, back = site / "front", site / "back"
    done = site / ".unpacked"
    if not done.is_file():
        for name in manifest["front"]:
            with zipfile.ZipFile(kit / "front" / name) as z:
                z.extractall(front)
        for name in manifest["back"]:
            with zipfile.ZipFile(kit / "back" / name) as z:
                z.extractall(back)
        done.write_text(key)
    if str(front) not in sys.path:
        sys.path.insert(0, str(front))
    # --check on another Python: its builds of the kit's compiled wheels, each before the kit's own
    shadow_front, shadow = os.environ.get("DSV4C_KIT_SHADOW_FRONT"), os.environ.get("DSV4C_KIT_SHADOW")
    if shadow_front and shadow_front not in sys.path:
        sys.path.insert(0, shadow_front)
    if shadow and shadow not in sys.path:
        sys.path.append(shadow)
    if str(back) not in sys.path:
        sys.path.append(str(back))
    os.environ.setdefault("SGLANG_JIT_CACHE_DIR", str(site / "sglang_jit"))
    importlib.invalidate_caches()
    return dict(manifest, site=str(site))


# ---------------------------------------------------------------------------------------------------------------
# The builder's side (CPU, in the engines' own environments)
# ---------------------------------------------------------------------------------------------------------------
def _simulate_cuda() -> None:
    """Make ``torch.cuda.is_available()`` true (an H100's properties) so SGLang's and vLLM's module-level
    ``if is_cuda():`` imports run as on the GPU machine; nothing is launched."""
    import torch

    class Props:
        multi_processor_count, total_memory, name, major, minor = 132, 80 << 30, "NVIDIA H100 80GB HBM3", 9, 0
        L2_cache_size, warp_size, uuid, gcnArchName = 50 << 20, 32, "0", ""

    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: Props.name
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda *a, **k: Props()


def _absent_torchvision() -> None:
    """The CPU census only (PyPI's torchvision needs CUDA torch; the GPU image has a real one): transformers
    decides it is absent, then ``torchvision.*`` imports give empty placeholder modules."""
    import importlib.abc
    import importlib.machinery
    import types

    import transformers.utils.import_utils as iu

    iu.is_torchvision_available()

    class Absent(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            value = type(name, (), {})
            setattr(self, name, value)
            return value

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] == "torchvision":
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = Absent(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.append(Finder())


def _install_stand_ins(names) -> None:
    """Import-only modules for the CUDA kernel packages the kit does not carry (see :mod:`stand_ins`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "kit_stand_ins"))
    for name in names:
        importlib.import_module(name)


def _lazy_refs(path: Path, package: str) -> set[str]:
    """Every ``package.*`` module a source file names in an import statement, at any depth (function-level
    imports included: they run on the GPU path only)."""
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError):
        return set()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == package)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == package:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def census(package: str, modules, *, cuda: bool, extra_paths=()) -> dict:
    """Import ``modules`` (with the CUDA simulation and the stand-ins if ``cuda``) and return the directories of
    ``package`` to carry (every directory holding an imported module or a module one of them names in any
    import statement) and the top-level distributions the imports loaded from site-packages."""
    sys.path[:0] = [str(p) for p in extra_paths]
    if cuda:
        _simulate_cuda()
        _install_stand_ins(STAND_INS)
        if importlib.util.find_spec("torchvision") is None:  # the GPU image has it; the CPU census stands it in
            _absent_torchvision()
    failed = {}
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - reported: the build script prints them
            failed[m] = f"{type(e).__name__}: {e}"
    pkg = importlib.import_module(package)
    base = Path(pkg.__file__).resolve().parents[1]
    dirs, tops = set(), set()
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not f:
            continue
        p = Path(f).resolve()
        if "site-packages" in p.parts:
            i = p.parts.index("site-packages")
            if len(p.parts) > i + 1:
                tops.add(p.parts[i + 1].removesuffix(".py"))
        if name.split(".")[0] != package:
            continue
        rel = p.parent.relative_to(base)
        dirs.add(str(rel))
        for ref in _lazy_refs(p, package):
            target = base / Path(*ref.split("."))
            if target.is_dir():
                dirs.add(str(target.relative_to(base)))
            elif target.with_suffix(".py").is_file():
                dirs.add(str(target.parent.relative_to(base)))
    # every package directory on the way down needs its __init__.py
    for d in list(dirs):
        parts = Path(d).parts
        dirs.update(str(Path(*parts[:k])) for k in range(1, len(parts)))
    return dict(dirs=sorted(dirs), tops=sorted(tops), failed=failed)


def check(kit: Path) -> int:
    """The build script's ``--check``: in a Python without the engines, activate the kit and import what the GPU
    tests import. Compiled back wheels are cp312: on another Python they cannot load, so the check reports which
    imports fail only for that reason (``.so`` of another ABI) apart from real failures."""
    manifest = activate(kit)
    if manifest is None:
        print(f"no kit at {kit}")
        return 1
    for name in ("sglang", "vllm"):
        assert name not in sys.modules
    if importlib.util.find_spec("torchvision") is None:  # CPU only: the GPU image has a real torchvision
        _absent_torchvision()
    bad = 0
    for m in SGLANG_MODULES + VLLM_MODULES:
        try:
            importlib.import_module(m)
            f = sys.modules[m].__file__
            ok = f.startswith(manifest["site"])
            print(f"ok   {m}" + ("" if ok else f"  (NOT from the kit: {f})"))
            bad += not ok
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {m}: {type(e).__name__}: {e}")
            bad += 1
    print(f"check: {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "census":
        package, out, mode = sys.argv[2], sys.argv[3], sys.argv[4]
        mods = SGLANG_MODULES if package == "sglang" else VLLM_MODULES
        extra = [ROOT / "tests", ROOT / "src"]
        if package == "sglang" and mode == "cpu":
            sys.path[:0] = [str(p) for p in extra]
            import test_engine_sglang  # noqa: F401  (the CPU tests' imports, torchvision stand-in included)
        if package == "vllm" and mode == "cpu":
            sys.path[:0] = [str(p) for p in extra]
            import test_engine_vllm  # noqa: F401
        result = census(package, mods, cuda=mode == "cuda", extra_paths=extra)
        Path(out).write_text(json.dumps(result, indent=1))
        for m, err in result["failed"].items():
            print(f"census ({package}, {mode}): {m} did not import: {err}", file=sys.stderr)
    elif cmd == "check":
        sys.exit(check(Path(sys.argv[2])))
    else:
        sys.exit(f"unknown command {cmd!r}")
