"""Launching LightLLM with the adapter: the launcher module and every process LightLLM spawns from it, on
the stand-ins of ``helpers.lightllm_engine`` / ``helpers.lightllm_sim``."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from helpers import lightllm_sim as sim

from dsv4_compressor.integrations import lightllm as adapter
from dsv4_compressor.integrations.lightllm import patching as adapter_patching


# ---------------------------------------------------------------------------------------------------------------
# Launching LightLLM with the adapter
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def spawn_stand_ins(tmp_path, monkeypatch):
    """``sim.write_spawn_stand_ins``'s LightLLM-shaped package on ``sys.path`` (a spawned process inherits it),
    with ``spawn`` as the start method as LightLLM sets it; LightLLM modules imported meanwhile are dropped."""
    sim.write_spawn_stand_ins(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "lightllm" or n.startswith("lightllm.")]:
        monkeypatch.delitem(sys.modules, name)
    method = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)
    yield tmp_path
    multiprocessing.set_start_method(method, force=True)
    adapter.uninstall()
    for name in [n for n in sys.modules if n == "lightllm" or n.startswith("lightllm.")]:
        del sys.modules[name]


def _spawn_router(monkeypatch, root, main_module: str) -> list[dict]:
    """Start LightLLM's router stand-in in a spawned process, this process's ``__main__`` being
    ``main_module`` as ``python -m main_module`` makes it; the router spawns the model worker. Their reports."""
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.util.find_spec(main_module)
    monkeypatch.setitem(sys.modules, "__main__", main)
    from lightllm.server.router.manager import start_router_process

    report = root / f"{main_module}.jsonl"
    router = multiprocessing.Process(target=start_router_process, args=(str(report),))
    router.start()
    router.join(300)
    assert router.exitcode == 0, f"the router exited with {router.exitcode}"
    return [json.loads(line) for line in report.read_text().splitlines()]


def test_every_process_lightllm_spawns_from_the_launcher_has_the_adapter(spawn_stand_ins, monkeypatch):
    """LightLLM starts its router with ``spawn`` and the router its model workers (``api_server.py`` L14,
    ``model_rpc.py`` L217). A spawned process first re-imports the launch process's main module by name: with the
    launcher as main (``python -m dsv4_compressor.integrations.lightllm``) the router and the worker it spawns
    both run ``install_from_environment`` (``$DSV4C_LIGHTLLM=online``) and see every patch, without the hook
    having imported LightLLM's modules; with ``python -m lightllm.server.api_server`` as main they run
    LightLLM's own code."""
    monkeypatch.setenv(adapter.ENV_VAR, "online")
    patched = _spawn_router(monkeypatch, spawn_stand_ins, "dsv4_compressor.integrations.lightllm.launch")
    plain = _spawn_router(monkeypatch, spawn_stand_ins, "lightllm.server.api_server")
    flags = ("init_some_extra_state", "compress", "write_indexer_k", "get_fixed_memory_size", "pd_banks",
             "init_mem_manager")  # fmt: skip
    for lines, main, want in ((patched, "dsv4_compressor.integrations.lightllm.launch", True),
                              (plain, "lightllm.server.api_server", False)):  # fmt: skip
        assert [line["where"] for line in lines] == ["router", "model worker"], lines
        assert len({line["pid"] for line in lines} | {os.getpid()}) == 3, "router and worker are processes of their own"
        for line in lines:
            assert line["main"] == main and line["imported_before"] == [], line
            assert all(line[f] is want for f in flags), line


def test_the_launcher_command_patches_every_process_it_spawns(spawn_stand_ins):
    """``python -m dsv4_compressor.integrations.lightllm --dsv4c online <LightLLM's arguments>`` as a user types it
    (a child Python, LightLLM's launch stand-ins on its path): the package's ``__main__`` hands over to
    :mod:`.launch`, whose name the spawned router and model worker re-run, so both run patched. (Run as
    ``<package>.__main__`` itself, ``spawn`` would re-run nothing in them.)"""
    report = spawn_stand_ins / "launched.jsonl"
    src = Path(adapter.__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(spawn_stand_ins), str(src)]))
    env.pop(adapter.ENV_VAR, None)
    done = subprocess.run([sys.executable, "-m", "dsv4_compressor.integrations.lightllm", "--dsv4c", "online",
                           "--report", str(report)], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert [line["where"] for line in lines] == ["router", "model worker"], lines
    for line in lines:
        assert line["main"] == "dsv4_compressor.integrations.lightllm.launch", line
        assert line["compress"] is True and line["pd_banks"] is True and line["imported_before"] == [], line


def test_launcher_parses_lightllm_s_arguments_refuses_before_it_starts_and_hands_over(spawn_stand_ins, monkeypatch,
                                                                                        capsys):  # fmt: skip
    """``main`` parses LightLLM's arguments with LightLLM's parser, refuses a mode it cannot serve before
    anything starts, sets ``$DSV4C_LIGHTLLM`` for the processes to come, installs the import hook and calls
    ``launch_server`` with LightLLM's ``StartArgs``; ``--dsv4c off`` leaves LightLLM alone."""
    import lightllm.server.api_server as api_server
    from lightllm.server.core.objs.start_args_type import StartArgs

    started = []
    monkeypatch.setattr(api_server, "launch_server", started.append)
    monkeypatch.delenv(adapter.ENV_VAR, raising=False)
    with pytest.raises(SystemExit) as refused:
        adapter.main(["--report", "r", "--dsv4c", "online", "--diverse_mode"])
    assert refused.value.code == 2 and "--diverse_mode is not supported" in capsys.readouterr().err
    assert started == [] and not any(isinstance(f, adapter_patching._PatchOnImport) for f in sys.meta_path)
    adapter.main(["--report", "r", "--dsv4c", "online", "--mtp_step", "3"])
    (args,) = started
    assert isinstance(args, StartArgs) and (args.mtp_step, args.report, args.run_mode) == (3, "r", "normal")
    assert os.environ[adapter.ENV_VAR] == "online"
    from lightllm.common.kv_cache_mem_manager import deepseek4_mem_manager as mem  # imported after the hook

    assert hasattr(mem.DeepseekV4MemoryManager.write_mem_to_page_kv_move_buffer, "__wrapped__")
    adapter.uninstall()
    adapter.main(["--dsv4c", "off", "--report", "r"])
    assert len(started) == 2 and os.environ[adapter.ENV_VAR] == "off"
    assert not any(isinstance(f, adapter_patching._PatchOnImport) for f in sys.meta_path)
