"""The SGLang adapter against the REAL ``sglang==0.5.23`` package (``make test-sglang``; skipped without it).

What runs here: the signatures of every SGLang symbol the adapter patches or calls (``inspect.signature`` on the
real functions), ``install()`` / ``uninstall()`` on the real modules (a module imported after ``install()``
included), the refusals (environment, server arguments through SGLang's own ``ServerArgs``, the layout SGLang's
``select_dsv4_kv_layout`` returns), the HCA scratch sized from SGLang's limits and never replaced, the E <= 10
bound, ``c{r}_out_loc`` read from SGLang's core metadata, the scratch subtracted from the KV budget SGLang's
``KVCacheConfigurator._profile_available_bytes`` returns (the real function on stand-ins for CUDA's memory query
and the runtime context), and the ``sglang.srt.plugins`` entry point through
``importlib.metadata`` on the installed package.

Not here yet (see the adapter's stand-in tests, ``tests/test_integration_sglang.py``, for the step program
against float64): the real ``DeepseekV4AttnBackend`` needs a ``ModelRunner`` (a model config, CUDA pools), so
its builders and ``forward_unified`` are not driven end to end on CPU in this module.

torchvision is not installable on CPU torch here (PyPI's builds are CUDA builds); SGLang's multimodal configs
import it at module level, so an inert stand-in module (every attribute a placeholder that raises if used) is
put on the import path before SGLang is imported, after transformers has decided it is absent.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import sys
import types

import pytest
import torch

from dsv4_compressor.errors import OpError
from dsv4_compressor.integrations import sglang as sg


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
    with pytest.raises(sg.SGLangModeNotSupported, match="hca='online' is refused"):
        sg.install(hca="online")
    for layout in ("v41", "v41_new"):
        monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", layout)
        with pytest.raises(sg.SGLangModeNotSupported, match=f"SGLANG_DSV4_KV_LAYOUT={layout}"):
            sg.install()
        assert not sg.installed()
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "auto")
    assert any("SM100" in r for r in sg.refusals_from_environment(hip=False, sm100=True))
    assert sg.refusals_from_environment(hip=False, sm100=False) == []
    assert any("unified_kv_triton" in r for r in sg.refusals_from_environment(hip=True, sm100=False))
    args = server_args_mod.ServerArgs
    assert any(
        "flashmla_mega" in r
        for r in sg.refusals_from_server_args(args(model_path="x", dsv4_attn_backend="flashmla_mega"))
    )  # noqa: E501
    assert any("trtllm" in r for r in sg.refusals_from_server_args(args(model_path="x", dsv4_attn_backend="trtllm")))
    assert sg.refusals_from_server_args(args(model_path="x", chunked_prefill_size=8192)) == []
    assert sg.refusals_from_server_args(args(model_path="x", chunked_prefill_size=-1))
    # the backend's constructor refuses before SGLang's own constructor runs (no pool, no graph yet)
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    sg.install()
    runner = types.SimpleNamespace(server_args=args(model_path="x", dsv4_attn_backend="flashmla_mega"))
    with pytest.raises(sg.SGLangModeNotSupported, match="flashmla_mega"):
        backend_mod.DeepseekV4AttnBackend(runner)
    # the pool's layout choice is wrapped (it needs SGLang's published runtime config to run): a V4 choice
    # passes, a V4.1 one is refused when the pool is built
    assert pool_mod.select_dsv4_kv_layout.__wrapped__ is sg._installed["wrappers"]["select_dsv4_kv_layout"][1]
    assert sg._checked_layout(lambda: (pool_mod.KVLayout.V4, None))()[0].name == "V4"
    v41 = sg._checked_layout(lambda: (pool_mod.KVLayout.V41, None))
    with pytest.raises(sg.SGLangModeNotSupported, match="V41 KV layout"):
        v41()


def test_scratch_from_sglang_limits_is_never_replaced():
    args = server_args_mod.ServerArgs(model_path="x", chunked_prefill_size=8192, max_prefill_tokens=16384)
    assert sg.scratch_rows_for(args, 1) == 16384
    args = server_args_mod.ServerArgs(
        model_path="x", chunked_prefill_size=256, max_prefill_tokens=128, cuda_graph_max_bs_decode=128
    )
    assert sg.scratch_rows_for(args, 4) == 512  # a verify graph of 128 requests x 4 drafts
    adapter = sg.SGLangCompressor(scratch_rows=64)
    buf = adapter.allocate_scratch("cpu")
    assert tuple(buf.shape) == (64, 512)
    assert adapter._scratch_for(40, 512, torch.device("cpu")) is buf
    with pytest.raises(OpError, match="never replaced"):  # before: a larger buffer replaced it
        adapter._scratch_for(65, 512, torch.device("cpu"))
    assert adapter._scratch_for(64, 512, torch.device("cpu")).data_ptr() == buf.data_ptr()


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
    ns, args = types.SimpleNamespace, server_args_mod.ServerArgs
    server = args(model_path="x", chunked_prefill_size=8192, max_prefill_tokens=16384, enable_two_batch_overlap=True,
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

    # 3 TBO target backends, the draft runner's, the draft-extend one, the multi-step one and its 3 steps
    assert sg.scratch_backends_for(server) == 9
    per_backend = sg.SGLangCompressor(draft_tokens=4, scratch_rows=sg.scratch_rows_for(server, 4))
    buf = per_backend.allocate_scratch("cpu")  # what _checked_init allocates in each backend
    scratch = sg.scratch_bytes_for(server)
    assert scratch == 9 * buf.numel() * buf.element_size() == 9 * 16384 * 512 * 4
    sg.install(check_environment=False)
    assert cls.__dict__["_profile_available_bytes"] is not real
    assert cls._profile_available_bytes(kvc, 80.0) == before_bytes - scratch
    assert scratch % (sizer._cell_size * page) == 0  # so the page-aligned count drops by exactly this
    assert before - tokens() == scratch // sizer._cell_size == 196608
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
    plain = args(model_path="x", chunked_prefill_size=8192, max_prefill_tokens=16384)
    assert sg.scratch_backends_for(plain) == 1
    assert sg.scratch_bytes_for(plain, scratch_rows=32768) == 32768 * 512 * 4  # install(scratch_rows=) wins
    assert sg.scratch_backends_for(args(model_path="x", enable_pdmux=True, sm_group_num=4)) == 5
    assert sg.scratch_backends_for(args(model_path="x", speculative_algorithm="EAGLE", speculative_num_steps=1)) == 3
    assert sg.scratch_backends_for(args(model_path="x", speculative_algorithm="NGRAM")) == 1


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
    assert len(eps) == 1 and eps[0].value == "dsv4_compressor.integrations.sglang:register"
    register = eps[0].load()
    assert register is sg.register
    monkeypatch.delenv(sg.PLUGIN_ENV, raising=False)
    register()
    assert not sg.installed()  # inert without DSV4C_SGLANG
    monkeypatch.setenv(sg.PLUGIN_ENV, "online")
    with pytest.raises(SystemExit, match="online"):
        register()  # SGLang logs and swallows an Exception from a plugin; SystemExit stops the process
    monkeypatch.setenv(sg.PLUGIN_ENV, "bogus")
    with pytest.raises(SystemExit, match="expected one of"):
        register()
    monkeypatch.setenv(sg.PLUGIN_ENV, "ring")
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    plugins = importlib.import_module("sglang.srt.plugins")
    loaded = plugins.load_plugins_by_group("sglang.srt.plugins")  # SGLang's own loader finds and loads it
    assert loaded["dsv4_compressor"][0] is sg.register
    loaded["dsv4_compressor"][0]()
    assert sg.installed() and sg._installed["options"]["hca_kernel"] == "tiled"
