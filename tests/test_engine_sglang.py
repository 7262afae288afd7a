"""The SGLang adapter against the REAL ``sglang==0.5.23`` package (``make test-sglang``; skipped without it).

What runs here: the signatures of every SGLang symbol the adapter patches or calls (``inspect.signature`` on the
real functions), ``install()`` / ``uninstall()`` on the real modules (a module imported after ``install()``
included), the refusals (environment, server arguments through SGLang's own ``ServerArgs``, the layout SGLang's
``select_dsv4_kv_layout`` returns), the HCA scratch sized from SGLang's limits and never replaced, the E <= 10
bound, ``c{r}_out_loc`` read from SGLang's core metadata, the scratch subtracted from the KV budget SGLang's
``KVCacheConfigurator._profile_available_bytes`` returns (the real function on stand-ins for CUDA's memory query
and the runtime context), and the ``sglang.srt.plugins`` entry point through
``importlib.metadata`` on the installed package.

SGLang's own pools, builders and reader (``test_real_pools_builders_and_sglangs_reader``): a
``DeepSeekV4TokenToKVPool`` (its ``DeepSeekV4SingleKVPool`` pages, indexer pool and ``CompressStatePool``s, from
the published ``ServerArgs``), a ``ReqToTokenPool``, the real ``DeepseekV4AttnBackend`` (constructor included, on
a stand-in ``ModelRunner`` namespace) whose own builders build every step (``init_forward_metadata_prefill``,
``make_forward_metadata_from_raw_decode`` / ``_verify``: ``make_core_attn_metadata``,
``init_compression_metadata``), real ``Compressor`` modules, a prefill / chunked prefill / padded decode (or
E = 3 MTP verify, SGLang's rings 16 / 256) / idle program at DeepSeek-V4's shapes (C4 and C128 groups closing)
against float64, the latent pages read back by SGLang's ``dequantize_k_cache_paged_dsv4``.
Stand-ins there:
FlashMLA's scheduler metadata (``_create_flashmla_metadata``: the ``flash_mla`` module is CUDA only; None, as on
SM120) and the attention indexer's top-k metadata (``init_forward_metadata_indexer``: deep_gemm and a CUDA JIT
planner; no compressor reads it), the SWA allocator's ``full_to_swa_index_mapping`` and the scheduler.

Not here: radix hits on the real pools and SGLang's scheduler-side C128 draft cleanup
(``clear_unaccepted_c128_draft_states``) after verify (``tests/test_engine_sglang_online.py`` runs both, with
the ring and with online HCA), the ragged verify layout, CUDA-graph capture
and replay of the real metadata (``init_forward_metadata_in_graph``, padded prefill graphs), the projection from
hidden states (``install(projection=...)``) on the real pools (``tests/test_engine_sglang_projection.py`` stubs
the backend constructor inside the adapter's wrapper and runs on ``World``'s pools), the FP8 indexer pages
through an SGLang reader (its only one is deep_gemm's CUDA ``fp8_paged_mqa_logits``; the pool's
``get_index_k_dequant`` reads the FP4 layout only: those pages are checked against float64 only), and SGLang's
attention kernels (FlashMLA) reading the pages.

torchvision is not installable on CPU torch here (PyPI's builds are CUDA builds); SGLang's multimodal configs
import it at module level, so an inert stand-in module (every attribute a placeholder that raises if used) is
put on the import path before SGLang is imported, after transformers has decided it is absent. The other SGLang
modules import this one first for it, and for SGLang's modules, the shared shapes and :class:`RealPoolWorld`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import sys
import types

import numpy as np
import pytest
import test_integration_sglang as tis
import torch
from helpers.inputs import INDEXER_CFG, make_params, projection_weight
from helpers.model import StreamModel
from helpers.session import engine_casts_round_to_nearest_even
from test_integration_sglang import World

from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.errors import OpError
from dsv4_compressor.integrations import entry_points
from dsv4_compressor.integrations import sglang as sg
from dsv4_compressor.layout import decode_latent


def _absent_torchvision() -> None:
    try:
        import transformers.utils.import_utils as iu
    except ImportError:
        return
    iu.is_torchvision_available()  # cached False before the stand-in exists
    if any(isinstance(f, _AbsentFinder) for f in sys.meta_path):
        return
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.append(_AbsentFinder())


class _Absent(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name}: torchvision is absent in this test environment")

        value = type(name, (), {"__init__": absent, "__new__": lambda cls, *a, **k: absent()})
        setattr(self, name, value)
        return value


class _AbsentFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Absent(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


try:
    importlib.import_module("sglang")
except ImportError:
    pytest.skip("sglang is not installed (make test-sglang builds .venv-sglang with it)", allow_module_level=True)
_absent_torchvision()
cv2 = pytest.importorskip("sglang.srt.layers.attention.dsv4.compressor_v2")
backend_mod = importlib.import_module("sglang.srt.layers.attention.deepseek_v4_backend")
pool_mod = importlib.import_module("sglang.srt.mem_cache.deepseek_v4_memory_pool")
server_args_mod = importlib.import_module("sglang.srt.server_args")
HIP_RADIX = "sglang.srt.layers.attention.deepseek_v4_backend_hip_radix"


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _record(**fields):
    """A resolved ``ServerArgs`` whose settings are ``fields`` as given: SGLang's resolution of its ``dummy``
    model path (no model config to read) leaves them as they are."""
    args = server_args_mod.ServerArgs(model_path="dummy", **fields)
    args.resolve_once()
    return args


def test_signatures_of_what_the_adapter_patches_and_calls():
    mixin = cv2.CompressorBackendMixin
    for name in ("forward_unified", "forward_core_compressor", "forward_indexer_compressor"):
        assert _params(mixin.__dict__[name]) == ["self", "x", "forward_batch", "layer_id", "compressor"], name
    planner = _params(cv2.create_paged_compressor_data)
    assert planner[0] == "compress_ratio"
    for arg in ("is_prefill", "token_to_kv_pool", "req_to_token", "req_pool_indices", "seq_lens", "extend_lens",
                "seq_lens_cpu", "extend_lens_cpu", "use_prefill_cuda_graph", "num_q_tokens"):  # fmt: skip
        assert arg in planner, arg
    assert "out_loc" not in planner  # the adapter's own keyword: it must never collide with SGLang's
    assert backend_mod.create_paged_compressor_data is cv2.create_paged_compressor_data  # imported by name
    cls = backend_mod.DeepseekV4AttnBackend
    assert _params(cls.__init__)[:2] == ["self", "model_runner"]
    core = _params(cls.make_core_attn_metadata)
    assert core[:6] == ["self", "req_to_token", "req_pool_indices_repeated", "seq_lens_casual", "max_seq_len",
                        "out_loc"]  # fmt: skip
    for name in ("make_forward_metadata_from_raw_verify", "make_forward_metadata_from_raw_decode",
                 "init_forward_metadata_target_verify", "init_forward_metadata_prefill"):  # fmt: skip
        assert name in cls.__dict__, name
        assert sg._refers_to(cls.__dict__[name].__code__, "create_paged_compressor_data") or "verify" in name, name
    fields = {f for f in backend_mod.DSV4AttnMetadata.__dataclass_fields__}
    assert {"c4_out_loc", "c128_out_loc"} <= fields
    assert _params(pool_mod.select_dsv4_kv_layout) == []
    assert pool_mod.DeepSeekV4SingleKVPool.kv_layout.name == "V4"
    for arg in ("chunked_prefill_size", "max_prefill_tokens", "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill",
                "speculative_num_draft_tokens", "dsv4_attn_backend"):  # fmt: skip
        assert arg in server_args_mod.ServerArgs.__struct_fields__, arg


@pytest.fixture
def clean():
    sg.uninstall()
    yield
    sg.uninstall()


def test_install_uninstall_on_the_real_modules_and_later_imports(clean):
    mixin = cv2.CompressorBackendMixin
    cls = backend_mod.DeepseekV4AttnBackend
    before = {
        n: mixin.__dict__[n] for n in ("forward_unified", "forward_core_compressor", "forward_indexer_compressor")
    }
    methods = dict(cls.__dict__)
    planner, select = cv2.create_paged_compressor_data, pool_mod.select_dsv4_kv_layout
    sys.modules.pop(HIP_RADIX, None)
    sg.install()
    assert sg.installed()
    assert mixin.forward_core_compressor is mixin.forward_indexer_compressor is mixin.forward_unified
    assert mixin.forward_unified is not before["forward_unified"]
    assert backend_mod.create_paged_compressor_data is cv2.create_paged_compressor_data is not planner
    assert pool_mod.select_dsv4_kv_layout is not select
    for name in ("make_forward_metadata_from_raw_verify", "make_forward_metadata_from_raw_decode",
                 "init_forward_metadata_prefill", "make_core_attn_metadata", "__init__"):  # fmt: skip
        assert cls.__dict__[name] is not methods[name], name
    later = importlib.import_module(HIP_RADIX)  # imported after install(): takes the wrapper by name
    assert later.create_paged_compressor_data is cv2.create_paged_compressor_data
    sg.uninstall()
    assert not sg.installed()
    assert {n: mixin.__dict__[n] for n in before} == before
    assert all(cls.__dict__[n] is v for n, v in methods.items())
    assert backend_mod.create_paged_compressor_data is planner is cv2.create_paged_compressor_data
    assert later.create_paged_compressor_data is planner  # the defect: it kept the wrapper
    assert pool_mod.select_dsv4_kv_layout is select


def test_refusals_at_install_and_construction(clean, monkeypatch):
    # the V4.1 layouts are written; their FP4 compressed records are refused
    monkeypatch.delenv("SGLANG_DSV4_COMPRESSED_KV_LAYOUT", raising=False)
    for layout in ("v41", "v41_new"):
        monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", layout)
        assert sg.refusals_from_environment(hip=False, sm100=True) == []
        monkeypatch.setenv("SGLANG_DSV4_COMPRESSED_KV_LAYOUT", "fp4")
        with pytest.raises(sg.SGLangModeNotSupported, match=f"SGLANG_DSV4_KV_LAYOUT={layout} with .*FP4"):
            sg.install()
        assert not sg.installed()
        monkeypatch.delenv("SGLANG_DSV4_COMPRESSED_KV_LAYOUT")
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "auto")
    assert sg.refusals_from_environment(hip=False, sm100=True) == []
    monkeypatch.setenv("SGLANG_DSV4_COMPRESSED_KV_LAYOUT", "fp4")
    assert any("FP4" in r for r in sg.refusals_from_environment(hip=False, sm100=True))
    assert sg.refusals_from_environment(hip=False, sm100=False) == []  # auto off SM100: V4, the option unused
    monkeypatch.delenv("SGLANG_DSV4_COMPRESSED_KV_LAYOUT")
    assert any("unified_kv_triton" in r for r in sg.refusals_from_environment(hip=True, sm100=False))
    args = _record
    assert any("flashmla_mega" in r for r in sg.refusals_from_server_args(args(dsv4_attn_backend="flashmla_mega")))
    trtllm = args(dsv4_attn_backend="trtllm", chunked_prefill_size=8192)
    assert sg.refusals_from_server_args(trtllm) == []  # its uniform FP8 pool is written
    assert sg.refusals_from_server_args(args(chunked_prefill_size=8192)) == []
    assert sg.refusals_from_server_args(args(chunked_prefill_size=-1))
    # the backend's constructor refuses before SGLang's own constructor runs (no pool, no graph yet)
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    sg.install()
    runner = types.SimpleNamespace(server_args=args(dsv4_attn_backend="flashmla_mega"))
    with pytest.raises(sg.SGLangModeNotSupported, match="flashmla_mega"):
        backend_mod.DeepseekV4AttnBackend(runner)
    # the pool's layout choice is wrapped (it needs SGLang's published runtime config to run): V4, V41 and
    # V41_NEW pass; V4.1 with FP4 compressed records is refused when the pool is built
    assert pool_mod.select_dsv4_kv_layout.__wrapped__ is sg._installed["wrappers"]["select_dsv4_kv_layout"][1]
    for name in ("V4", "V41", "V41_NEW"):
        for option in (None, "auto", "fp8"):
            chosen = getattr(pool_mod.KVLayout, name)
            assert sg._checked_layout(lambda chosen=chosen, option=option: (chosen, option))()[0] is chosen
    for name in ("V41", "V41_NEW"):
        fp4 = sg._checked_layout(lambda name=name: (getattr(pool_mod.KVLayout, name), "fp4"))
        with pytest.raises(sg.SGLangModeNotSupported, match=f"{name} KV layout with V4.1 FP4"):
            fp4()
    with pytest.raises(sg.SGLangModeNotSupported, match="V41_FP4 KV layout"):
        sg._checked_layout(lambda: (pool_mod.KVLayout.V41_FP4, None))()


def test_scratch_from_sglang_limits_is_never_replaced():
    # a prefill step is bounded by the chunk (SGLang's PrefillAdder charges every extend to it), not by
    # max_prefill_tokens
    assert sg.scratch_rows_for(_record(chunked_prefill_size=8192, max_prefill_tokens=16384), 1) == 8192
    args = _record(chunked_prefill_size=256, max_prefill_tokens=128, max_running_requests=128)
    assert sg.scratch_rows_for(args, 4) == 512  # a verify step of 128 requests x 4 drafts
    adapter = sg.SGLangCompressor(scratch_rows=64)
    buf = adapter.allocate_scratch("cpu")
    assert tuple(buf.shape) == (64, 512)
    assert adapter._scratch_for(40, 512, torch.device("cpu")) is buf
    with pytest.raises(OpError, match="never replaced"):  # before: a larger buffer replaced it
        adapter._scratch_for(65, 512, torch.device("cpu"))
    assert adapter._scratch_for(64, 512, torch.device("cpu")).data_ptr() == buf.data_ptr()


def test_buffers_are_keyed_by_the_device_step_tensors_report(monkeypatch):
    """SGLang's backend holds ``torch.device(model_runner.device)``, ``cuda`` without an index, which is not equal
    to the ``cuda:0`` its step tensors report: the scratch allocated in the constructor under the first would be
    looked up under the second and allocated again (uncounted, or refused under capture). allocate_scratch /
    allocate_projection resolve the index first."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert torch.device("cuda") != torch.device("cuda:0")
    assert sg._resolved("cuda") == torch.device("cuda:0") and sg._resolved("cuda:1") == torch.device("cuda:1")
    assert sg._resolved("cpu") == torch.device("cpu")


def _profiling_stand_ins(monkeypatch, kvc_mod, free_gb: float) -> None:
    """Stand-ins for what ``_profile_available_bytes`` reads besides its object: SGLang's CUDA memory query
    (``get_available_gpu_memory``: no GPU here) and its per-process runtime context (``get_parallel`` /
    ``get_schedule`` / ``get_exec`` / ``get_disagg`` / ``get_mm``, published by SGLang's launcher from the resolved
    server arguments and a process group), with the values of a plain single-GPU decode/prefill server."""
    ns = types.SimpleNamespace
    prefill_graph = ns(full_prefill_max_req=None, backend=None)
    monkeypatch.setattr(kvc_mod, "get_available_gpu_memory", lambda *a, **k: free_gb)
    monkeypatch.setattr(kvc_mod, "get_parallel", lambda: ns(launch_world_size=1, world_group=ns(cpu_group=None)))
    monkeypatch.setattr(kvc_mod, "get_schedule", lambda: ns(mem_fraction_static=0.9, prefill_max_requests=None))
    monkeypatch.setattr(kvc_mod, "get_exec", lambda: ns(graph=ns(cuda_graph_config=ns(prefill=prefill_graph))))
    monkeypatch.setattr(kvc_mod, "get_disagg", lambda: ns(disaggregation_mode="null"))
    monkeypatch.setattr(kvc_mod, "get_mm", lambda: ns(mm_feature_transport=None))


def test_scratch_is_counted_where_sglang_sizes_the_kv_cache(clean, monkeypatch):
    """SGLang sizes its KV pool (``ModelRunner.alloc_memory_pool`` -> ``KVCacheConfigurator.configure``) before
    it builds the attention backends, whose constructors allocate the HCA scratch under install(): the scratch
    must come out of the KV budget ``_profile_available_bytes`` returns, or it eats SGLang's headroom."""
    kvc_mod = importlib.import_module("sglang.srt.mem_cache.kv_cache_configurator")
    pc_mod = importlib.import_module("sglang.srt.model_executor.pool_configurator")
    cls = kvc_mod.KVCacheConfigurator
    real = cls.__dict__["_profile_available_bytes"]
    assert _params(real) == ["self", "pre_model_load_memory"]
    assert "server_args" in cls.__dataclass_fields__ and "is_draft_worker" in cls.__dataclass_fields__
    _profiling_stand_ins(monkeypatch, kvc_mod, free_gb=60.0)
    ns, args = types.SimpleNamespace, _record
    server = args(chunked_prefill_size=8192, max_prefill_tokens=16384, enable_two_batch_overlap=True,
                  speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_num_draft_tokens=4)  # fmt: skip
    # the attributes the real function (and the wrapper) read; the rest of a KVCacheConfigurator needs a model
    kvc = ns(device="cuda", gpu_id=0, mambaish_config=None, post_capture_kv_active=False, is_draft_worker=False,
             model_config=ns(is_multimodal=False, hf_config=ns(architectures=["DeepseekV4ForCausalLM"])),
             server_args=server)  # fmt: skip
    # the token count from a budget: SGLang's default configurator (available // cell_size, page-aligned) on a
    # stand-in cell size (DeepSeek-V4's own comes from a model config; its configurator divides the same way)
    sizer = object.__new__(pc_mod.DefaultPoolConfigurator)
    sizer._cell_size, sizer._fixed_overhead_bytes, page = 1536, 0, 256

    def tokens() -> int:
        return sizer.calculate_pool_sizes(cls._profile_available_bytes(kvc, 80.0), page).max_total_num_tokens

    before_bytes, before = cls._profile_available_bytes(kvc, 80.0), tokens()
    assert before_bytes == int((60.0 - 80.0 * 0.1) * (1 << 30))  # the real function ran on the stand-ins

    # 3 TBO target backends, the draft runner's, the draft-extend one, the multi-step one and its 3 steps; only
    # the 3 target ones have compressor layers (the draft's MTP layer has ratio 0) and get a scratch
    assert sg.backends_for(server) == 9 and sg.scratch_backends_for(server) == 3
    per_backend = sg.SGLangCompressor(draft_tokens=4, scratch_rows=sg.scratch_rows_for(server, 4))
    buf = per_backend.allocate_scratch("cpu")  # what _checked_init allocates in each target backend
    scratch = sg.scratch_bytes_for(server)
    assert scratch == 3 * buf.numel() * buf.element_size() == 3 * 8192 * 512 * 4
    sg.install(check_environment=False)
    assert cls.__dict__["_profile_available_bytes"] is not real
    assert cls._profile_available_bytes(kvc, 80.0) == before_bytes - scratch
    assert scratch % (sizer._cell_size * page) == 0  # so the page-aligned count drops by exactly this
    assert before - tokens() == scratch // sizer._cell_size == 32768
    # not counted: a draft runner's sizing (SGLang gives it the target's pool config), a model the adapter does
    # not serve
    assert cls._profile_available_bytes(ns(**{**vars(kvc), "is_draft_worker": True}), 80.0) == before_bytes
    llama = ns(is_multimodal=False, hf_config=ns(architectures=["LlamaForCausalLM"]))
    other = ns(**{**vars(kvc), "model_config": llama})
    assert cls._profile_available_bytes(other, 80.0) == before_bytes
    sg.uninstall()
    assert cls.__dict__["_profile_available_bytes"] is real
    assert cls._profile_available_bytes(kvc, 80.0) == before_bytes and tokens() == before
    sg.install(hca_kernel="single", check_environment=False)  # the single-stage kernel allocates no scratch
    assert cls._profile_available_bytes(kvc, 80.0) == before_bytes
    sg.uninstall()
    plain = args(chunked_prefill_size=8192, max_prefill_tokens=16384)
    assert sg.scratch_backends_for(plain) == 1
    assert sg.scratch_bytes_for(plain, scratch_rows=32768) == 32768 * 512 * 4  # install(scratch_rows=) wins
    assert sg.scratch_backends_for(args(enable_pdmux=True, sm_group_num=4)) == 5
    eagle = args(speculative_algorithm="EAGLE", speculative_num_steps=1)
    assert sg.backends_for(eagle) == 3 and sg.scratch_backends_for(eagle) == 1
    assert sg.scratch_backends_for(args(speculative_algorithm="NGRAM")) == 1


def test_ten_draft_tokens_as_sglang_allows():
    adapter = sg.SGLangCompressor(draft_tokens=10)  # before: refused (ring 16 < 18)
    n = 10
    positions = torch.arange(20, 20 + n)
    req = torch.ones(n, dtype=torch.int64)
    req_to_token = torch.arange(2 * 64, dtype=torch.int32).view(2, 64)
    meta = adapter.metadata(
        4, positions=positions, req_pool_indices=req, out_loc=positions, req_to_token=req_to_token,
        full_to_swa_index_mapping=torch.arange(128), swa_page_size=32, ring=16, decode=True,
    )  # fmt: skip
    assert not meta.decode  # planned as a prefill step: save after the reads, 16 rows suffice
    hca = adapter.metadata(
        128, positions=positions, req_pool_indices=req, out_loc=positions, req_to_token=req_to_token,
        full_to_swa_index_mapping=None, swa_page_size=None, ring=256, decode=True,
    )  # fmt: skip
    assert hca.decode
    with pytest.raises(ValueError, match="at most 10"):
        sg.SGLangCompressor(draft_tokens=11)


def test_out_loc_is_read_from_sglangs_core_metadata(clean):
    """Encoder-SWA bounded replay routes folded rows to slot 0 in ``c{r}_out_loc`` on purpose: under
    install() the planner plans with SGLang's out locations, not with ones recomputed from req_to_token."""
    sg.install()
    req_to_token = torch.zeros(3, 64, dtype=torch.int32)
    req_to_token[1] = torch.arange(64, 128)
    pool = types.SimpleNamespace(
        _unified_kv=False, full_to_swa_index_mapping=torch.arange(256), swa_page_size=32,
        get_ring_size=lambda compress_ratio: 8 if compress_ratio == 4 else 128,
    )  # fmt: skip
    kwargs = dict(is_prefill=True, token_to_kv_pool=pool, req_to_token=req_to_token,
                  req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([16]),
                  extend_lens=torch.tensor([16], dtype=torch.int32), extend_lens_cpu=[16])  # fmt: skip
    routed = torch.zeros(16, dtype=torch.int64)  # every folded row routed to slot 0
    core = types.SimpleNamespace(c4_out_loc=routed, c128_out_loc=routed)
    builder = sg._as_builder(lambda: (_publish(core), cv2.create_paged_compressor_data(4, **kwargs))[1], verify=False)
    got = builder()
    recomputed = cv2.create_paged_compressor_data(4, **kwargs)  # outside a builder: no core metadata
    want = sg.SGLangCompressor().create_paged_compressor_data(4, out_loc=routed, **kwargs)
    assert torch.equal(got.plan, want.plan)
    assert not torch.equal(got.plan, recomputed.plan)  # before: recomputed, the routed rows overwritten


def _publish(core):
    scope = sg._CORE.get()
    assert scope is not None, "not inside a builder scope"
    scope[0] = core


def test_entry_point_on_the_installed_package(clean, monkeypatch):
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "dsv4_compressor"]
    assert len(eps) == 1 and eps[0].value == "dsv4_compressor.integrations.entry_points:sglang"
    register = eps[0].load()
    assert register is entry_points.sglang  # reads the switch, then delegates to sg.register
    monkeypatch.delenv(sg.PLUGIN_ENV, raising=False)
    register()
    assert not sg.installed()  # inert without DSV4C_SGLANG
    monkeypatch.setenv(sg.PLUGIN_ENV, "bogus")
    with pytest.raises(SystemExit, match="expected one of"):
        register()  # SGLang logs and swallows an Exception from a plugin; SystemExit stops the process
    monkeypatch.setenv(sg.PLUGIN_ENV, "ring")
    monkeypatch.setenv(sg.PROJECTION_ENV, "cublas")
    with pytest.raises(SystemExit, match="expected one of auto, engine"):
        register()
    assert not sg.installed()
    monkeypatch.setenv(sg.PROJECTION_ENV, "engine")
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    register()
    assert sg.installed() and sg._installed["options"]["projection"] == "engine"
    sg.uninstall()
    monkeypatch.delenv(sg.PROJECTION_ENV)
    plugins = importlib.import_module("sglang.srt.plugins")
    loaded = plugins.load_plugins_by_group("sglang.srt.plugins")  # SGLang's own loader finds and loads it
    assert loaded["dsv4_compressor"][0] is entry_points.sglang
    loaded["dsv4_compressor"][0]()
    assert sg.installed() and sg._installed["options"]["hca_kernel"] == "tiled"
    assert sg._installed["options"]["projection"] == "auto"  # the default


# ---------------------------------------------------------------------------------------------------------------
# SGLang's modules and the small shapes the compressor tests share (the projection's tests import them:
# tests/test_engine_sglang_projection.py)
# ---------------------------------------------------------------------------------------------------------------
compressor_mod = importlib.import_module("sglang.srt.layers.attention.dsv4.compressor")
dsa_utils = importlib.import_module("sglang.srt.layers.attention.dsa.utils")
ForwardMode = importlib.import_module("sglang.srt.model_executor.forward_batch_info").ForwardMode
MODES = {"prefill": ForwardMode.EXTEND, "verify": ForwardMode.TARGET_VERIFY, "decode": ForwardMode.DECODE}
HIDDEN = 512  # D of the small layers (V4: 4096 / 7168): the heuristic blocks split it in 2 along K
SMALL = 16  # rows our projection serves in the tests (the measured table has V4 shapes only)
memory_pool_mod = importlib.import_module("sglang.srt.mem_cache.memory_pool")
runtime_mod = importlib.import_module("sglang.srt.runtime_context")
spec_mod = importlib.import_module("sglang.srt.speculative.spec_info")
dequant_mod = importlib.import_module("sglang.kernels.ops.attention.dsv4.dequant_k_cache")


def _real_compressor(layer):
    """SGLang's own ``Compressor`` of a test layer (``tests/test_integration_sglang.py``'s ``Layer``): its APE
    through SGLang's loader (the C4 hotfix reorders the memory), the layer's norm weight and bf16 ``layer.weight``
    as ``wkv_gate``."""
    p, cfg = layer.params, layer.cfg
    indexer = cfg.output == "indexer"
    c = compressor_mod.Compressor(
        types.SimpleNamespace(hidden_size=HIDDEN, rms_norm_eps=p.eps), layer_id=layer.layer_id,
        is_in_indexer=indexer, freqs_cis=torch.complex(p.cos, p.sin), compress_ratio=cfg.ratio,
        head_dim=cfg.head_dim, rotate=indexer,
    )  # fmt: skip
    with torch.no_grad():
        c.load_ape_weight(c.ape, p.ape)
        c.norm.weight.copy_(p.norm_weight.float())
        c.wkv_gate.weight.copy_(layer.weight)
    assert c.norm.variance_epsilon == p.eps
    return c


# ---------------------------------------------------------------------------------------------------------------
# SGLang's own pools, metadata builders and reader
# ---------------------------------------------------------------------------------------------------------------
CSA, HCA = CompressorConfig.csa(), CompressorConfig.hca()  # the pool's shapes: 584-byte records, ratios 4 / 128
REAL_PAGE = 256  # SGLang's page (the backend asserts 256): C4 and indexer pages of 64 slots, C128 of 2
REAL_PAGES = 5  # full-token pages, page 0 the padding token's
REAL_SLOTS = 4  # request slots (ReqToTokenPool adds row 0, CUDA-graph padding)


class _PoolLayer(tis.Layer):
    """:class:`test_integration_sglang.Layer` (its checks, unchanged) on one layer's buffers of SGLang's real
    pool: ``kv_score_buffer.kv_score`` of the layer's ``CompressStatePool`` and the page buffer, poisoned."""

    def __init__(self, world, name, cfg, layer_id, compressor, state, memory, page_size):
        self.world, self.name, self.cfg, self.layer_id, self.hca = world, name, cfg, layer_id, "ring"
        self.params = make_params(cfg, seed=layer_id + 11 + (cfg.output == "indexer"), max_positions=512)
        self.compressor, self.state, self.page_size = compressor, state, page_size
        self.ring = world.ring4 if cfg.overlap else world.ring128
        self.memory = memory.view(torch.uint8)  # the pool's own storage (the C4 / C128 buffers are fp8 views)
        make = tis.indexer_fp8_page_layout if cfg.output == "indexer" else tis.latent_page_layout
        self.layout = make(cfg, page_size)
        assert self.layout.bytes_per_page == self.memory.shape[1], (name, self.memory.shape)  # SGLang's padding
        self.memory.fill_(tis.POISON)
        self.state.view(torch.int32).fill_(tis.POISON_F32)
        self.model = StreamModel(cfg, self.params)
        self.written, self.addressed = set(), set()


class RealPoolWorld(World):
    """:class:`test_integration_sglang.World`'s bookkeeping and checks on SGLang's real objects: a
    ``DeepSeekV4TokenToKVPool`` (layer 0 C128, layer 1 C4 with its indexer), a ``ReqToTokenPool``, a
    ``DeepseekV4AttnBackend`` and one ``Compressor`` per compressor, each step's metadata from the backend's own
    builders and each layer run through ``forward_core_compressor`` / ``forward_indexer_compressor`` from bf16
    hidden states (SGLang's GEMM: ``projection="engine"``)."""

    def __init__(self, monkeypatch, server_args, *, seed: int = 31):
        ns = types.SimpleNamespace
        draft = runtime_mod.get_spec().speculative_num_draft_tokens  # what the backend reads
        self.draft_tokens, self.unified_kv, self.device = draft or 1, False, torch.device("cpu")
        self.rng = np.random.default_rng(seed)
        self.gen, self.xgen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
        self.read_back = 0  # latent records SGLang's reader read
        self.lengths, self.pages, self.captured = {}, {}, {}
        self.free_pages = [int(p) for p in self.rng.permutation(np.arange(1, REAL_PAGES))]
        ratios = [HCA.ratio, CSA.ratio]
        size = REAL_PAGES * REAL_PAGE
        self.pool = pool_mod.DeepSeekV4TokenToKVPool(
            max_num_reqs=REAL_SLOTS, swa_size=size, c4_size=size // 4, c128_size=size // 128,
            c4_state_pool_size=REAL_PAGES * 16, c128_state_pool_size=0, page_size=REAL_PAGE, swa_page_size=REAL_PAGE,
            dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
            qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=INDEXER_CFG.head_dim, layer_num=2,
            device="cpu", enable_memory_saver=False, compression_ratios=ratios,
        )  # fmt: skip
        self.ring4, self.ring128 = self.pool.get_ring_size(4), self.pool.get_ring_size(128)
        swa_of_page = np.concatenate([[0], 1 + self.rng.permutation(REAL_PAGES - 1)])
        full = np.arange(size)
        swa = swa_of_page[full // REAL_PAGE] * REAL_PAGE + full % REAL_PAGE
        self.full_to_swa = torch.tensor(swa, dtype=torch.int64)
        self.pool.register_mapping(self.full_to_swa)  # what SGLang's SWA allocator registers: a permutation here
        self.req_pool = memory_pool_mod.ReqToTokenPool(size=REAL_SLOTS, max_context_len=512, device="cpu",
                                                       enable_memory_saver=False)  # fmt: skip
        self.req_to_token = self.req_pool.req_to_token
        hf = ns(hidden_size=HIDDEN, head_dim=512, index_head_dim=INDEXER_CFG.head_dim, compress_ratios=ratios)
        model_config = ns(head_dim=512, v_head_dim=512, context_len=512, hf_text_config=hf, hf_config=hf)
        runner = ns(device="cpu", model_config=model_config, page_size=REAL_PAGE, req_to_token_pool=self.req_pool,
                    token_to_kv_pool=self.pool, hisparse_coordinator=None, is_draft_worker=False,
                    spec_algorithm=spec_mod.SpeculativeAlgorithm.NONE, server_args=server_args)  # fmt: skip
        self.runner = runner
        self.backend = backend_mod.DeepseekV4AttnBackend(runner)
        self.adapter = self.backend.__dict__[sg._ADAPTER_ATTR]
        self.layers = []
        for name, cfg, layer_id in (("hca", HCA, 0), ("csa", CSA, 1), ("indexer", INDEXER_CFG, 1)):
            indexer = cfg.output == "indexer"
            if indexer:
                state = self.pool.get_indexer_compress_states(layer_id)
                memory, page = self.pool.get_index_k_with_scale_buffer(layer_id), self.pool.get_index_k_page_size()
            else:
                state = self.pool.get_attention_compress_states(layer_id)
                memory, page = self.pool.get_extra_key_buffer(layer_id), self.pool.get_extra_key_page_size(layer_id)
            layer = _PoolLayer(self, name, cfg, layer_id, None, state.kv_score_buffer.kv_score, memory, page)
            layer.weight = projection_weight(cfg.row_width, HIDDEN, seed=40 + len(self.layers))
            layer.compressor = self._compressor(layer)
            self.layers.append(layer)
        self.rows: dict[int, torch.Tensor] = {}
        real = compressor_mod.Compressor.compute_kv_score

        def compute_kv_score(compressor, x, forward_batch):  # SGLang's GEMM, its output kept for the reference
            out = real(compressor, x, forward_batch)
            self.rows[id(compressor)] = out.clone()
            return out

        monkeypatch.setattr(compressor_mod.Compressor, "compute_kv_score", compute_kv_score)

    def _compressor(self, layer):
        return _real_compressor(layer)  # its own get_state_pool: the real pool's CompressStatePool of the layer

    def step(self, items, mode: str, *, bs: int | None = None, tokens: int | None = None, path: str = "real"):
        """One forward: SGLang's builder for the step (``init_forward_metadata_prefill``, eager, or
        ``make_forward_metadata_from_raw_decode`` / ``_verify`` for a padded decode / verify batch), then every
        compressor layer."""
        bs = len(items) if bs is None else bs
        positions, req, raw_out_loc, _ = self.inputs(items, mode, bs, tokens)
        backend = self.backend
        req_pool_indices = torch.tensor([s for s, _, _ in items] + [0] * (bs - len(items)), dtype=torch.int64)
        if mode == "prefill":
            seq = [s + n for _, s, n in items]
            extend = [n for _, _, n in items]
            ext = torch.tensor(extend, dtype=torch.int32)
            backend.forward_metadata = backend.init_forward_metadata_prefill(
                max_seq_len=max(seq), req_pool_indices=req_pool_indices, seq_lens=torch.tensor(seq), seq_lens_cpu=seq,
                out_cache_loc=raw_out_loc, num_tokens=sum(extend), extend_seq_lens=ext, extend_seq_lens_cpu=extend,
                extend_start_loc=torch.cumsum(ext, 0, dtype=torch.int32) - ext,
            )  # fmt: skip
        elif mode == "verify":  # the committed lengths; padded requests: request 0, seq_lens 1
            seq = torch.tensor([s for _, s, _ in items] + [1] * (bs - len(items)), dtype=torch.int64)
            e = torch.full((bs,), self.draft_tokens, dtype=torch.int32)
            raw = backend_mod.DSV4RawVerifyMetadata(req_pool_indices, seq, raw_out_loc, extend_seq_lens=e)
            backend.forward_metadata = backend.make_forward_metadata_from_raw_verify(raw)
        else:  # decode seq_lens include the new token; padded requests: request 0, seq_lens 1
            seq = torch.tensor([s + 1 for _, s, _ in items] + [1] * (bs - len(items)), dtype=torch.int64)
            raw = backend_mod.DSV4RawDecodeMetadata(req_pool_indices, seq, raw_out_loc)
            backend.forward_metadata = backend.make_forward_metadata_from_raw_decode(raw)
        meta = backend.forward_metadata
        assert all(isinstance(getattr(meta, f"c{r}_compress_metadata"), sg.SGLangCompressMetadata) for r in (4, 128))
        x = torch.randn(positions.shape[0], HIDDEN, generator=self.xgen).to(torch.bfloat16)
        fb = types.SimpleNamespace(forward_mode=MODES[mode], positions=positions, attn_cp_metadata=None)
        rows = {}
        for layer in self.layers:
            call = backend.forward_indexer_compressor if layer.kind == "indexer" else backend.forward_core_compressor
            self.rows.pop(id(layer.compressor), None)
            call(x, fb, layer.layer_id, layer.compressor)
            rows[layer.name] = self.rows[id(layer.compressor)]
        self._record(items, rows)

    def check(self, what: str) -> None:
        """The world's checks (float64 entries, state rows, poison), then SGLang's own reader of the latent
        pages, ``dequantize_k_cache_paged_dsv4``, against our layout decoder of the same bytes."""
        super().check(what)
        for layer in self.layers:
            if layer.kind == "indexer" or not layer.written:
                continue
            slots = torch.tensor(sorted(layer.written))
            ours = decode_latent(layer.layout.read(layer.memory, slots), layer.cfg)
            with engine_casts_round_to_nearest_even():
                theirs = dequant_mod.dequantize_k_cache_paged_dsv4(layer.memory, slots, layer.page_size)
            theirs = theirs.view(len(slots), layer.cfg.head_dim).float()
            assert torch.isfinite(ours).all(), f"{what}: {layer.name}"
            bad = (theirs.view(torch.int32) != ours.view(torch.int32)).any(dim=1)
            assert not bad.any(), f"{what}: {layer.name}: SGLang reads slots {slots[bad].tolist()} otherwise"
            self.read_back += len(slots)


@pytest.mark.parametrize("draft_tokens", [1, 3], ids=["decode", "mtp"])
def test_real_pools_builders_and_sglangs_reader(clean, monkeypatch, draft_tokens):
    """SGLang's own objects end to end on CPU, under ``install(projection="engine")``: its
    ``DeepSeekV4TokenToKVPool`` (its ``DeepSeekV4SingleKVPool``s for C4 / C128, its indexer pool, its
    ``CompressStatePool``s; built from the published ``ServerArgs``), its ``ReqToTokenPool``, the real
    ``DeepseekV4AttnBackend`` (constructor included) building each step's metadata with its own
    ``init_forward_metadata_prefill`` / ``make_forward_metadata_from_raw_decode`` / ``_verify``
    (``make_core_attn_metadata``, ``init_compression_metadata``'s Triton ``c{r}_out_loc``, then the adapter's
    planner), and real ``Compressor`` modules (the APE through SGLang's loader, their ``get_state_pool``,
    ``compute_kv_score``). Stand-ins: the
    ``ModelRunner`` (a namespace of what the constructor reads: a model config, the pools), the SWA allocator's
    ``full_to_swa_index_mapping`` (a page permutation, registered through the pool's own ``register_mapping``),
    the scheduler (World's page bookkeeping) and ``dsa_utils.get_parallel`` (no process group: CP size 1); two
    CUDA-only pieces of the builders that no compressor reads: ``_create_flashmla_metadata`` (``flash_mla``;
    None, what SGLang itself keeps on SM120) and ``init_forward_metadata_indexer`` (the attention indexer's
    top-k plan: deep_gemm and a CUDA JIT kernel).

    The program: a prefill of two requests (one across a C128 group end: ratio 128 closes at position 127),
    a chunked prefill continuing one of them beside a new one, padded decode batches (C4 groups closing) or,
    with ``draft_tokens=3`` (EAGLE in the published ``ServerArgs``: SGLang's pool sizes its rings 16 / 256 and
    the backend reads E from it), padded verify batches of E rows per request with random acceptance, then an
    idle batch. After every step: every entry against float64 (``reference.compress_sequence`` of SGLang's
    kv_score rows), the state rows SGLang reads next bit for bit, every unaddressed state row and every page
    byte outside the written records still poison (``test_integration_sglang.Layer``'s checks); then SGLang's
    ``dequantize_k_cache_paged_dsv4`` (Triton, interpreted, casts rounding to nearest even) reads every written
    latent record bit for bit as our ``layout.decode_latent`` does."""
    monkeypatch.setattr(dsa_utils, "get_parallel", lambda: types.SimpleNamespace(attn_cp_size=1))  # runtime context
    monkeypatch.setattr(backend_mod, "_create_flashmla_metadata", lambda: None)  # flash_mla: CUDA only
    # the attention indexer's top-k metadata (deep_gemm, a CUDA JIT top-k planner), which no compressor reads
    monkeypatch.setattr(backend_mod.DeepseekV4AttnBackend, "init_forward_metadata_indexer", lambda self, *a, **k: None)
    monkeypatch.setattr(tis, "PAGE", REAL_PAGE)  # the world's SWA page (state rows by SWA page, page tails)
    ctx = runtime_mod.get_context()
    saved = {name: getattr(ctx, name) for name in ("_server_args", "_config_bags")}
    saved_parallel = ctx.parallel._config
    spec = {}
    if draft_tokens > 1:
        spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=draft_tokens - 1, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=draft_tokens)  # fmt: skip
    args = server_args_mod.ServerArgs(model_path="x", chunked_prefill_size=256, max_prefill_tokens=256, device="cpu",
                                      **spec)  # fmt: skip
    ctx.set_server_args(args)  # SGLang's pools read their options from the published arguments
    try:
        sg.install(projection="engine", check_environment=False)
        w = RealPoolWorld(monkeypatch, args)
        assert type(w.pool.get_attention_compress_states(0)).__name__ == "CompressStatePool"
        w.step([(1, 0, 130), (2, 0, 9)], "prefill")
        w.check("prefill")
        w.step([(2, 9, 6), (3, 0, 7)], "prefill")
        w.check("chunked prefill")
        spec_rings = (16, 256) if draft_tokens > 1 else (8, 128)  # SGLang's rings for the draft depth
        assert w.adapter.draft_tokens == draft_tokens and (w.ring4, w.ring128) == spec_rings
        if draft_tokens > 1:
            w.verify_steps([1, 2, 3], 2, bs=4)  # E rows per request, random acceptance
        else:
            for k in range(3):
                w.step([(s, w.lengths[s], 1) for s in (1, 2, 3)], "decode", bs=4)
                w.check(f"decode {k}")
        idle = types.SimpleNamespace(forward_mode=ForwardMode.IDLE, positions=torch.zeros(0, dtype=torch.int64))
        before = [layer.memory.clone() for layer in w.layers]
        b = w.backend
        for layer in w.layers:
            call = b.forward_indexer_compressor if layer.kind == "indexer" else b.forward_core_compressor
            call(torch.zeros(0, HIDDEN, dtype=torch.bfloat16), idle, layer.layer_id, layer.compressor)
        assert all(torch.equal(b, layer.memory) for b, layer in zip(before, w.layers))
        w.check("idle")
        written = {layer.name: len(layer.written) for layer in w.layers}
        print(f"real pools: entries written {written}, {w.read_back} latent records read by SGLang's reader")
        assert written["hca"] == 1 and written["csa"] >= 38 and w.read_back > 0
    finally:
        sg.uninstall()
        for name, value in saved.items():
            setattr(ctx, name, value)
        ctx.parallel._config = saved_parallel
