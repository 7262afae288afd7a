"""LightLLM's module paths with the stand-ins in them: in this process (:func:`as_lightllm`, what the adapter's
``install`` finds) and, for tests of the launcher in real processes, as a LightLLM-shaped package written to a
directory (:func:`write_spawn_stand_ins`).
"""

from __future__ import annotations

import contextlib
import sys
import types

from .objects import (
    CompressorInfer,
    DeepseekV4IndexInfer,
    DeepseekV4InferStateInfo,
    DeepseekV4MemoryManager,
    DeepseekV4TpPartModel,
)

LAYER_MODULE = "lightllm.models.deepseek_v4.layer_infer.transformer_layer_infer"
STATE_MODULE = "lightllm.models.deepseek_v4.infer_struct"
MEM_MODULE = "lightllm.common.kv_cache_mem_manager.deepseek4_mem_manager"
MODEL_MODULE = "lightllm.models.deepseek_v4.model"


@contextlib.contextmanager
def as_lightllm(memory_manager=None, **constants):
    """Register the stand-in classes under LightLLM's module paths (docs/INTEGRATION.md, "LightLLM") for the
    duration, so that ``adapter.install()`` finds them: ``memory_manager`` (default: the stand-in class of
    :mod:`.objects`; a scaled-down subclass brings its own module's constants, or gives them here as ``DSV4_*``
    keywords). Restores ``sys.modules``."""
    attrs = {
        LAYER_MODULE: dict(CompressorInfer=CompressorInfer, DeepseekV4IndexInfer=DeepseekV4IndexInfer),
        STATE_MODULE: dict(DeepseekV4InferStateInfo=DeepseekV4InferStateInfo),
        MEM_MODULE: dict(DeepseekV4MemoryManager=memory_manager or DeepseekV4MemoryManager, **constants),
        MODEL_MODULE: dict(DeepseekV4TpPartModel=DeepseekV4TpPartModel),
    }
    saved = {}
    for path, members in attrs.items():
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            name = ".".join(parts[:k])
            if name not in saved and (name not in sys.modules or k == len(parts)):
                saved[name] = sys.modules.get(name)
                sys.modules[name] = types.ModuleType(name)
        for attr, value in members.items():
            setattr(sys.modules[path], attr, value)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


#: A LightLLM-shaped package for process tests (:func:`write_spawn_stand_ins`): module path -> source. Torch-free,
#: so a process that does not load the adapter starts in a fraction of a second.
_SPAWN_STAND_INS = {
    "lightllm/__init__.py": "",
    "lightllm/server/__init__.py": "",
    "lightllm/server/api_cli.py": """
def add_cli_args(parser):  # LightLLM's names and defaults (api_cli.py), a few of them; --report is the stand-in's
    parser.add_argument("--run_mode", default="normal")
    parser.add_argument("--diverse_mode", action="store_true")
    parser.add_argument("--enable_cpu_cache", action="store_true")
    parser.add_argument("--mtp_step", type=int, default=0)
    parser.add_argument("--report", required=True)
    return parser
""",
    "lightllm/server/core/__init__.py": "",
    "lightllm/server/core/objs/__init__.py": "",
    "lightllm/server/core/objs/start_args_type.py": """
class StartArgs:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
""",
    "lightllm/server/api_server.py": """
import json
import multiprocessing as mp
import os
import sys

from .api_cli import add_cli_args
from lightllm.server.core.objs.start_args_type import StartArgs


def launch_server(args):
    mp.set_start_method("spawn")  # api_server.py L14 (torch.multiprocessing, the same call), api_start.py L34-35
    os.environ["LIGHTLLM_START_ARGS"] = json.dumps(vars(args))  # envs_utils.set_env_start_args, api_start.py L357
    from lightllm.server.router.manager import start_router_process

    router = mp.Process(target=start_router_process, args=(args.report,))  # start_utils.py L25-29
    router.start()
    router.join()
    sys.exit(router.exitcode)


if __name__ == "__main__":  # api_server.py L31-38
    from argparse import ArgumentParser

    parser = ArgumentParser()
    add_cli_args(parser)
    launch_server(StartArgs(**vars(parser.parse_args())))
""",
    "lightllm/server/router/__init__.py": "",
    "lightllm/server/router/manager.py": """
import multiprocessing as mp
import sys

from lightllm.server.router.model_infer.model_rpc import _init_env, report


def start_router_process(path):
    report("router", path)
    worker = mp.Process(target=_init_env, args=(path,))  # the model worker: model_rpc.py L217-237
    worker.start()
    worker.join()
    sys.exit(worker.exitcode)
""",
    "lightllm/server/router/model_infer/__init__.py": "",
    "lightllm/server/router/model_infer/model_rpc.py": """
import importlib
import json
import os
import sys

MODULES = (
    "lightllm.models.deepseek_v4.infer_struct",
    "lightllm.models.deepseek_v4.layer_infer.transformer_layer_infer",
    "lightllm.common.kv_cache_mem_manager.deepseek4_mem_manager",
    "lightllm.models.deepseek_v4.model",
)


def _ours(fn):
    folder = fn.__code__.co_filename.replace(os.sep, "/").rsplit("/", 1)[0]
    return folder.endswith("dsv4_compressor/integrations/lightllm")


def report(where, path):
    imported_before = [name for name in MODULES if name in sys.modules]
    state, layer, mem, model = (importlib.import_module(name) for name in MODULES)
    main = sys.modules["__main__"]
    line = dict(
        where=where, pid=os.getpid(), main=getattr(getattr(main, "__spec__", None), "name", None),
        imported_before=imported_before,
        init_some_extra_state=hasattr(state.DeepseekV4InferStateInfo.init_some_extra_state, "__wrapped__"),
        compress=_ours(layer.CompressorInfer.compress),
        write_indexer_k=_ours(layer.DeepseekV4IndexInfer.write_indexer_k),
        get_fixed_memory_size=hasattr(mem.DeepseekV4MemoryManager.get_fixed_memory_size, "__wrapped__"),
        pd_banks=hasattr(mem.DeepseekV4MemoryManager.write_mem_to_page_kv_move_buffer, "__wrapped__"),
        init_mem_manager=hasattr(model.DeepseekV4TpPartModel._init_mem_manager, "__wrapped__"),
    )
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\\n")


def _init_env(path):  # the model worker builds the model here (model_rpc.py L217)
    report("model worker", path)
""",
    "lightllm/models/__init__.py": "",
    "lightllm/models/deepseek_v4/__init__.py": "",
    "lightllm/models/deepseek_v4/infer_struct.py": """
class DeepseekV4InferStateInfo:
    def init_some_extra_state(self, model):
        pass
""",
    "lightllm/models/deepseek_v4/layer_infer/__init__.py": "",
    "lightllm/models/deepseek_v4/layer_infer/transformer_layer_infer.py": """
class CompressorInfer:
    def compress(self, x, infer_state, layer_weight, cos_table, sin_table, use_custom_tensor_manager=True):
        raise AssertionError("LightLLM's own compressor ran")


class DeepseekV4IndexInfer:
    def write_indexer_k(self, x, infer_state, layer_weight, cos_table, sin_table, use_custom_tensor_manager=True):
        raise AssertionError("LightLLM's own indexer ran")
""",
    "lightllm/models/deepseek_v4/model.py": """
class DeepseekV4TpPartModel:
    def _init_mem_manager(self):
        pass
""",
    "lightllm/common/__init__.py": "",
    "lightllm/common/kv_cache_mem_manager/__init__.py": "",
    "lightllm/common/kv_cache_mem_manager/deepseek4_mem_manager.py": """
class DeepseekV4MemoryManager:
    def get_fixed_memory_size(self):
        return 0

    def _init_buffers(self, size, dtype, head_num, head_dim, layer_num):
        pass

    def write_mem_to_page_kv_move_buffer(self, *args, **kwargs):
        pass

    def read_page_kv_move_buffer_to_mem(self, *args, **kwargs):
        pass
""",
}


def write_spawn_stand_ins(root) -> None:
    """Write a LightLLM-shaped package under ``root`` for tests of the launcher in real processes: LightLLM's
    launch path (``lightllm.server.api_server``: ``spawn``, the start arguments in ``$LIGHTLLM_START_ARGS``, a
    router process that spawns the model worker, ``python -m lightllm.server.api_server``) and its four
    patched modules as empty classes with LightLLM's names. The router and the worker append one JSON line each
    to ``--report``: which of the adapter's patches they see, and which LightLLM modules were imported before
    they imported them."""
    import pathlib

    for rel, text in _SPAWN_STAND_INS.items():
        path = pathlib.Path(root, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.lstrip("\n"))
