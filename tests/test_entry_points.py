"""The engines' plugin entry points (``integrations/entry_points.py``, declared in pyproject.toml): inert and
cheap with their switch unset, the adapters' ``register()`` once it is set.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes and SGLang loads
``sglang.srt.plugins`` in each of its own, for every model: loaded with the switch unset, ours must import
neither torch nor Triton nor a kernel module nor an adapter. The loading runs in a fresh interpreter (the test
session has imported all of them already), from the declarations in this tree's pyproject.toml, as
``importlib.metadata`` loads an installed one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_compressor.integrations import entry_points

ROOT = Path(__file__).resolve().parents[1]
#: Modules a switched-off entry point must not import.
HEAVY = ("torch", "triton", "dsv4_compressor.kernels", "dsv4_compressor.ops", "dsv4_compressor.integrations.vllm",
         "dsv4_compressor.integrations.sglang")  # fmt: skip
GROUPS = {"vllm.general_plugins": "vllm", "sglang.srt.plugins": "sglang"}


def _declared() -> dict[str, str]:
    """group -> the value of this package's entry point in pyproject.toml."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {group: project["entry-points"][group]["dsv4_compressor"] for group in GROUPS}


def test_pyproject_declares_the_light_entry_points():
    assert _declared() == {group: f"dsv4_compressor.integrations.entry_points:{fn}" for group, fn in GROUPS.items()}


def _load_in_a_fresh_process(group: str, value: str, env: dict) -> dict:
    code = f"""
import json, sys, time
from importlib.metadata import EntryPoint
t = time.perf_counter()
result = EntryPoint("dsv4_compressor", {value!r}, {group!r}).load()()
ms = (time.perf_counter() - t) * 1e3
print(json.dumps(dict(result=repr(result), ms=ms, modules=sorted(sys.modules))))
"""
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("switch", [None, "", "off", "0"])
def test_a_switched_off_entry_point_imports_nothing_heavy(group, switch):
    """Loaded and called as the engine does, with the switch unset (or off), the entry point returns ``None`` and
    leaves torch, Triton, the kernels, the ops and both adapters out of ``sys.modules``."""
    env = {k: v for k, v in os.environ.items()
           if k not in (entry_points.VLLM_ENV, entry_points.VLLM_ENV_ALIAS, entry_points.SGLANG_ENV)}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if switch is not None:
        env[entry_points.VLLM_ENV if group.startswith("vllm") else entry_points.SGLANG_ENV] = switch
    got = _load_in_a_fresh_process(group, _declared()[group], env)
    assert got["result"] == "None"
    heavy = [m for m in got["modules"] if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == [], f"{group}: the switched-off entry point imported {heavy[:8]}"
    assert "dsv4_compressor.integrations.entry_points" in got["modules"]  # it did load ours
    print(f"{group} (switch {switch!r}): loaded and called in {got['ms']:.2f} ms")


def test_the_vllm_entry_point_delegates_once_switched_on(monkeypatch):
    """On, the vLLM entry point is the adapter's ``register()``: its install, its errors; the alias counts only
    while ``VLLM_DSV4C`` is unset, and an empty ``VLLM_DSV4C`` is off whatever the alias says."""
    from dsv4_compressor.integrations import vllm as dsv4_vllm

    calls = []
    monkeypatch.setattr(dsv4_vllm.patching, "install", lambda **kwargs: calls.append(kwargs) or "installed")
    for name in (entry_points.VLLM_ENV, entry_points.VLLM_ENV_ALIAS, entry_points.SGLANG_ENV):
        monkeypatch.delenv(name, raising=False)
    assert entry_points.vllm() is None and calls == []
    monkeypatch.setenv(entry_points.VLLM_ENV_ALIAS, "tiled")
    assert entry_points.vllm() == "installed" and calls == [dict(hca="tiled")]
    monkeypatch.setenv(entry_points.VLLM_ENV, "")
    assert entry_points.vllm() is None and len(calls) == 1
    monkeypatch.setenv(entry_points.VLLM_ENV, "fast")
    with pytest.raises(ValueError, match="VLLM_DSV4C"):
        entry_points.vllm()
    monkeypatch.setenv(entry_points.VLLM_ENV, "online")
    assert entry_points.vllm() == "installed" and calls[-1] == dict(hca="online")
    assert (dsv4_vllm.ENV_VAR, dsv4_vllm.ENV_VAR_ALIAS) == (entry_points.VLLM_ENV, entry_points.VLLM_ENV_ALIAS)


def test_the_sglang_entry_point_is_off_exactly_where_the_adapter_is(monkeypatch):
    """Every value the light entry point treats as off, the SGLang adapter's ``register()`` treats as off too
    (it would install nothing), and an on value goes through to the adapter's install."""
    from dsv4_compressor.integrations import sglang as dsv4_sglang

    assert dsv4_sglang.PLUGIN_ENV == entry_points.SGLANG_ENV
    calls = []
    monkeypatch.setattr(dsv4_sglang.patching, "install", lambda **kwargs: calls.append(kwargs))  # register's
    for value in entry_points.SGLANG_OFF + (" OFF ",):
        monkeypatch.setenv(entry_points.SGLANG_ENV, value)
        assert entry_points.sglang() is None
        assert dsv4_sglang.register() is None and calls == [], f"{value!r}: the adapter would install"
    monkeypatch.setenv(entry_points.SGLANG_ENV, "ring")
    entry_points.sglang()
    assert len(calls) == 1 and calls[0]["hca_kernel"] == "tiled"
    monkeypatch.setenv(entry_points.SGLANG_ENV, "nonsense")
    with pytest.raises(SystemExit, match="DSV4C_SGLANG"):
        entry_points.sglang()


def test_the_package_imports_lazily_and_keeps_its_public_names():
    """``import dsv4_compressor`` imports neither torch nor Triton; every name of ``__all__`` still resolves
    (``from dsv4_compressor import X``, ``dc.X``), to the object its submodule defines."""
    code = """
import json, sys, types
import dsv4_compressor as dc
before = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton"))
from dsv4_compressor import CompressedKVCache, CompressorConfig, OpError
from dsv4_compressor.cache import CompressedKVCache as cache_cls
from dsv4_compressor.errors import OpError as op_error
ok = CompressedKVCache is cache_cls and OpError is op_error and dc.CompressorConfig is CompressorConfig
names = {name: "module" if isinstance(getattr(dc, name), types.ModuleType) else type(getattr(dc, name)).__name__
         for name in dc.__all__}
print(json.dumps(dict(before=before, ok=ok, names=names, dir=sorted(set(dc.__all__) - set(dir(dc))))))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["before"] == [] and got["ok"] and got["dir"] == []
    assert got["names"]["ops"] == "module" and got["names"]["CompressedKVCache"] == "type"
    import dsv4_compressor

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        dsv4_compressor.nothing  # noqa: B018
