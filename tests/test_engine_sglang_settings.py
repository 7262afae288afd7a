"""The SGLang adapter deployed as SGLang 0.5.23 deploys it, against the REAL package (``make test-sglang``).

Every value the adapter sizes from is the one SGLang runs with: its resolution pipeline (``ServerArgs.resolve_once``
on a DeepSeek-V4 ``config.json``: the arg-group hooks declare their decisions beside raw fields that stay ``None``)
or the config bags a process publishes (``RuntimeContext.override_server_args``, SGLang's own way to publish a
config in tests). The backends are SGLang's ``DeepseekV4AttnBackend`` / ``DeepseekV4MultiStepBackend`` built on
its real ``DeepSeekV4TokenToKVPool`` (V4, V4.1, HiSparse and draft pools) on CPU; the ``ModelRunner`` is a
namespace of what the constructor reads (as in ``tests/test_engine_sglang.py``), and two CUDA-only pieces of the
constructor's world are stubbed there too (``dsa_utils.get_parallel``: no process group; FlashMLA's metadata).

Resolution of one record takes a few seconds on 2 cores: each test resolves at most two.
"""

from __future__ import annotations

import json
import re
import types

import pytest
import test_engine_sglang as tes  # the torchvision stand-in and SGLang's modules, imported once
import torch

from dsv4_compressor.integrations import sglang as sg

ServerArgs = tes.server_args_mod.ServerArgs
runtime_mod, pool_mod, backend_mod = tes.runtime_mod, tes.pool_mod, tes.backend_mod
overrides_mod = pytest.importorskip("sglang.srt.arg_groups.overrides")
spec_hook = pytest.importorskip("sglang.srt.arg_groups.speculative_hook")
ns = types.SimpleNamespace

#: A DeepSeek-V4-Flash-shaped ``config.json`` (what SGLang's resolution reads from the model path): layers of
#: ratios 128 and 4, one MTP layer.
DSV4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
    "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4, 0], "torch_dtype": "bfloat16", "vocab_size": 129280,
    "max_position_embeddings": 65536, "num_nextn_predict_layers": 1, "sliding_window": 128, "head_dim": 512,
    "index_head_dim": 128, "window_size": 128,
}  # fmt: skip
PAGE, PAGES, SLOTS = 256, 5, 4


@pytest.fixture(scope="module")
def dsv4_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4")
    (path / "config.json").write_text(json.dumps(DSV4_CONFIG))
    return str(path)


@pytest.fixture
def clean():
    sg.uninstall()
    yield
    sg.uninstall()


@pytest.fixture
def published():
    """``publish(**fields)``: SGLang's ``override_server_args`` (a resolved record whose declarations are
    ``fields``, raw fields ``None``), restored after the test."""
    ctx = runtime_mod.get_context()
    held = []

    def publish(**fields):
        o = ctx.override_server_args(device="cpu", **fields)
        held.append(o)
        return o.install()

    yield publish
    for o in reversed(held):
        o.restore()


def _resolve(model, declare=None, **fields):
    """SGLang's resolution of ``ServerArgs(model_path=model, device="cpu", **fields)``, with launcher-stage
    declarations ``declare`` first (SGLang keeps those: pipeline.py)."""
    args = ServerArgs(model_path=model, device="cpu", **fields)
    if declare:
        overrides_mod.declare_resolution(args, "launcher", **declare)
    args.resolve_once()
    return args


def test_default_server_args_size_from_what_sglang_resolves(dsv4_model):
    """A default ``ServerArgs`` has ``chunked_prefill_size`` and ``max_running_requests`` ``None``: SGLang's
    hooks decide them (CPU here: a 4,096-token chunk; DeepSeek-V4's 256 requests). The adapter reads those, on the
    raw record (resolving a copy with SGLang's own pipeline) as on the resolved one; before, it took the raw
    ``max_prefill_tokens`` (16,384) and no request count."""
    raw = ServerArgs(model_path=dsv4_model, device="cpu")
    assert raw.chunked_prefill_size is None and raw.max_running_requests is None
    settings = sg.settings_of(raw)
    assert settings.source == "a resolved copy" and raw.chunked_prefill_size is None  # the record is kept
    assert (settings.chunked_prefill_size, settings.max_running_requests, settings.draft_tokens) == (4096, 256, 1)
    resolved = _resolve(dsv4_model)
    assert sg.settings_of(resolved).source == "resolved ServerArgs"
    want = max(4096, 256 * 1, settings.decode_graph_bs)
    assert sg.scratch_rows_for(raw) == sg.scratch_rows_for(resolved) == want == 4096
    assert sg.backends_for(resolved) == sg.compressor_backends_for(resolved) == 1
    assert sg.scratch_bytes_for(resolved) == 4096 * 512 * 4
    assert sg.refusals_from_server_args(resolved) == []


def test_sglang_s_automatic_eagle_settings_count_the_backends_it_builds(dsv4_model):
    """SGLang's automatic EAGLE parameters (its ``_auto_choose_speculative_params``: 3 steps, top-k 1, 4 draft
    tokens), declared as its launcher would: the raw fields stay ``None``. SGLang builds 7 backends (the
    target's, the draft runner's, the draft-extend one, the multi-step one and its 3 steps); before, the raw
    ``speculative_num_steps`` (None) counted 3 and the raw draft tokens 1."""
    auto = spec_hook._auto_choose_speculative_params(ServerArgs(model_path=dsv4_model), "DeepseekV4ForCausalLM")
    assert auto == (3, 1, 4)
    steps, topk, draft = auto
    args = _resolve(dsv4_model, speculative_algorithm="EAGLE", declare=dict(
        speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=draft))  # fmt: skip
    assert args.speculative_num_steps is None and args.speculative_num_draft_tokens is None
    settings = sg.settings_of(args)
    assert (settings.speculative_num_steps, settings.speculative_eagle_topk, settings.draft_tokens) == (3, 1, 4)
    assert sg.backends_for(args) == 7
    assert sg.compressor_backends_for(args) == 1  # the draft runner's MTP layer has no compressor
    # a verify step of every request with its 4 draft tokens is the largest step here (256 x 4 < the chunk)
    assert sg.scratch_rows_for(args) == max(4096, settings.max_running_requests * 4)
    # the topk=1 path of SGLang's own resolution (steps given, draft tokens derived as steps + 1)
    derived = _resolve(dsv4_model, speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=3)
    assert derived.speculative_num_draft_tokens is None and sg.settings_of(derived).draft_tokens == 4


def test_dp_attention_sizes_per_rank(published):
    """Under attention DP SGLang divides the chunk per rank (``_handle_data_parallelism``) and the request count
    (``resolve_max_num_reqs``): the scratch follows the rank's, not the global operator values."""
    # what SGLang's resolution declares for --chunked-prefill-size 8192 --max-running-requests 512 --attn-dp-size 4
    args = published(chunked_prefill_size=8192 // 4, max_running_requests=512, attn_dp_size=4, tp_size=4)
    settings = sg.settings_of(args)
    assert settings.source == "runtime context"
    assert (settings.chunked_prefill_size, settings.max_running_requests) == (2048, 128)
    assert sg.scratch_rows_for(args) == 2048


def test_chunked_prefill_resolved_off_is_refused_at_install_and_at_backend_build(clean, published, monkeypatch):
    """Chunked prefill switched off by SGLang's resolution (raw ``chunked_prefill_size`` ``None``, resolved
    ``-1``): refused at install() where SGLang has published its settings, in the KV sizing and when a backend
    is built, with the reason; before, the raw ``None`` passed and a long prompt failed inside the op."""
    args = published(chunked_prefill_size=-1, max_running_requests=8)
    assert args.chunked_prefill_size is None
    off = r"chunked prefill is off \(chunked_prefill_size -1 as SGLang resolved it\)"
    assert any(re.search(off, r) for r in sg.refusals_from_server_args(args))
    with pytest.raises(sg.SGLangModeNotSupported, match=off):
        sg.install(check_environment=False)
    assert not sg.installed()
    with pytest.raises(sg.SGLangModeNotSupported, match="chunked prefill is off"):
        sg.scratch_rows_for(args)
    sg.install(check_environment=False, modules=sg._import_sglang())  # a late install: the backend refuses
    with pytest.raises(sg.SGLangModeNotSupported, match="chunked prefill is off"):
        backend_mod.DeepseekV4AttnBackend(ns(server_args=args))


def test_blackwell_with_the_layout_unset_is_sglang_s_v4(monkeypatch):
    """SGLang's default of ``SGLANG_DSV4_KV_LAYOUT`` is ``v4`` (srt/environ.py): unset on an SM100 / SM103 GPU
    is the V4 pages and supported; only an explicit ``auto`` (there), ``v41`` or ``v41_new`` selects V4.1."""
    monkeypatch.delenv("SGLANG_DSV4_KV_LAYOUT", raising=False)
    assert sg.kv_layout_env() == ("v4", False)
    assert sg.refusals_from_environment(hip=False, sm100=True) == []  # before: "auto on an SM100" refused
    # SGLang's own choice agrees: V4 pages with the variable unset
    with runtime_mod.get_context().override_server_args(device="cpu"):
        assert pool_mod.select_dsv4_kv_layout()[0] is pool_mod.KVLayout.V4
    # the V4.1 layouts SGLang selects there (auto on SM100, v41, v41_new) are written too
    monkeypatch.delenv("SGLANG_DSV4_COMPRESSED_KV_LAYOUT", raising=False)
    for layout in ("auto", "v41", "v41_new"):
        monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", layout)
        assert sg.refusals_from_environment(hip=False, sm100=True) == []


# ---------------------------------------------------------------------------------------------------------------
# SGLang's backends on its real pools
# ---------------------------------------------------------------------------------------------------------------
def _pool(ratios, **kwargs):
    size = PAGES * PAGE
    return pool_mod.DeepSeekV4TokenToKVPool(
        max_num_reqs=SLOTS, swa_size=size, c4_size=size // 4, c128_size=size // 128, c4_state_pool_size=PAGES * 16,
        c128_state_pool_size=0, page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
        indexer_head_dim=128, layer_num=len(ratios), device="cpu", enable_memory_saver=False,
        compression_ratios=ratios, **kwargs,
    )  # fmt: skip


def _runner(pool, server_args, **extra):
    """What ``DeepseekV4AttnBackend.__init__`` reads of a ``ModelRunner``, on SGLang's real pools."""
    hf = ns(hidden_size=DSV4_CONFIG["hidden_size"], head_dim=512, index_head_dim=128, compress_ratios=[128, 4])
    model_config = ns(head_dim=512, v_head_dim=512, context_len=512, hf_text_config=hf, hf_config=hf)
    req_pool = tes.memory_pool_mod.ReqToTokenPool(size=SLOTS, max_context_len=512, device="cpu",
                                                  enable_memory_saver=False)  # fmt: skip
    fields = dict(device="cpu", model_config=model_config, page_size=PAGE, req_to_token_pool=req_pool,
                  token_to_kv_pool=pool, hisparse_coordinator=None, is_draft_worker=False,
                  spec_algorithm=tes.spec_mod.SpeculativeAlgorithm.NONE, server_args=server_args)  # fmt: skip
    return ns(**{**fields, **extra})


@pytest.fixture
def backends(monkeypatch):
    """Stand-ins for the constructor's CUDA-only pieces, and every adapter the backends' constructors attach."""
    monkeypatch.setattr(tes.dsa_utils, "get_parallel", lambda: ns(attn_cp_size=1))  # no process group
    monkeypatch.setattr(backend_mod, "_create_flashmla_metadata", lambda: None)  # flash_mla: CUDA only


def _adapter(backend) -> sg.SGLangCompressor:
    return backend.__dict__[sg._ADAPTER_ATTR]


def test_draft_backends_whose_model_has_no_compressor_allocate_nothing(clean, published, backends):
    """With EAGLE (3 steps) SGLang builds the draft side's backends on the draft runner's pool, whose MTP layers
    all have ratio 0 (no compressor): each gets no HCA scratch and no projection workspace (before: 32 MiB and
    ~4.8 MiB each, 221 MiB at 3 steps); the target's backend gets both, sized for its verify steps."""
    args = published(chunked_prefill_size=256, max_running_requests=8, speculative_algorithm="EAGLE",
                     speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)  # fmt: skip
    sg.install(check_environment=False)
    target = backend_mod.DeepseekV4AttnBackend(_runner(_pool([128, 4]), args))
    a = _adapter(target)
    assert a.compressor_ratios == (4, 128) and a.draft_tokens == 4
    assert [tuple(t.shape) for t in a._scratch.values()] == [(max(256, 8 * 4), 512)]
    assert set(a._projection) == {"main", "indexer", "pair"}  # V4-Flash: its C4 layers' joined pair too
    draft_runner = _runner(_pool([0], is_draft_worker=True), args, is_draft_worker=True)
    built = [backend_mod.DeepseekV4AttnBackend(draft_runner)]  # the draft runner's own backend
    built.append(backend_mod.DeepseekV4AttnBackend(draft_runner, skip_prefill=False))  # draft extend
    multi = backend_mod.DeepseekV4MultiStepBackend(draft_runner, topk=1, speculative_num_steps=3)
    built += [multi, *multi.attn_backends]
    assert 1 + len(built) == sg.backends_for(args) == 7  # the backends SGLang builds, every one adapted
    for b in built:
        d = _adapter(b)
        assert d.compressor_ratios == () and d._scratch == {} and d._projection == {} and d.projection_bytes == 0


def test_layouts_are_read_per_layer_where_the_backend_is_built(clean, published, backends):
    """SGLang's real pools built with each main layout: the backend's construction reads each compressor layer's
    layout from the pool (V4, V41: C128 pages of 1,536 bytes, C4 of 64 x 528; V41_NEW: 2 x 528 and 64 x 528) and
    keeps it for the layer's calls; V4.1 FP4 compressed records (``compressed_kv_layout="fp4"``) refuse the
    backend with the layer and the reason. A backend built before install() reads the layout at the layer's first
    call, before any write."""
    args = published(chunked_prefill_size=256, max_running_requests=8)
    sg.install(check_environment=False)
    widths = {"V4": (1728, 64 * 584 // 576 * 576 + 576), "V41": (1536, 64 * 528), "V41_NEW": (2 * 528, 64 * 528)}
    for name, (c128, c4) in widths.items():
        pool = _pool([128, 4], kv_layout=getattr(pool_mod.KVLayout, name))
        assert pool.get_extra_key_buffer(0).shape[-1] == c128 and pool.get_extra_key_buffer(1).shape[-1] >= c4
        assert [sg.layer_layout(pool, layer) for layer in (0, 1)] == [name.lower()] * 2
        backend = backend_mod.DeepseekV4AttnBackend(_runner(pool, args))
        adapter = _adapter(backend)
        assert adapter.check_layouts(pool) == []
        compressor = ns(is_in_indexer=False, get_state_pool=lambda backend: ns(kv_score_buffer=ns(kv_score=None)))
        for layer in (0, 1):
            assert adapter._buffers(backend, pool, compressor, layer)["layout"] == name.lower()
    fp4 = _pool([128, 4], kv_layout=pool_mod.KVLayout.V41, compressed_kv_layout="fp4")
    reasons = [sg.layer_layout_refusal(fp4, layer) for layer in (0, 1)]
    assert all(f"layer {i}: the pool's compressed pages are v41_fp4" in r and "FP4" in r for i, r in enumerate(reasons))
    with pytest.raises(sg.SGLangModeNotSupported, match=r"layer 0: .*v41_fp4.*layer 1: .*v41_fp4"):
        backend_mod.DeepseekV4AttnBackend(_runner(fp4, args))
    # late install: an adapter that never saw the constructor reads the layer's layout at its first call
    adapter = sg.SGLangCompressor()
    compressor = ns(is_in_indexer=False, get_state_pool=lambda backend: ns(kv_score_buffer=ns(kv_score=None)))
    with pytest.raises(sg.SGLangUnsupported, match="layer 0: the pool's compressed pages are v41_fp4"):
        adapter._buffers(ns(), fp4, compressor, 0)
    assert adapter.check_layouts(fp4) == reasons
    # the trtllm backend's pool (its layout getter says V4): uniform FP8 records, P x 512-byte pages
    uniform = ns(uniform_fp8=True, get_extra_key_page_size=lambda layer: 2,
                 get_extra_key_buffer=lambda layer: torch.zeros(4, 1024, dtype=torch.float8_e4m3fn))  # fmt: skip
    assert sg.layer_layout(uniform, 3) == "uniform_fp8"
    narrow = ns(uniform_fp8=True, get_extra_key_page_size=lambda layer: 2,
                get_extra_key_buffer=lambda layer: torch.zeros(4, 1023, dtype=torch.uint8))  # fmt: skip
    with pytest.raises(sg.SGLangUnsupported, match="layer 3: the pool's 1023-byte pages cannot hold 2 uniform_fp8"):
        sg.layer_layout(narrow, 3)


def test_hisparse_is_refused_where_the_backend_is_built(clean, published, backends):
    """HiSparse (its ``HiSparseC4DevicePool``, its coordinator on the runner): refused in the backend's
    constructor, before any warm-up forward or capture (before: at the first forward, inside the capture's
    warm-up); ``--enable-hisparse`` as SGLang resolved it is refused from the settings too."""
    args = published(chunked_prefill_size=256, max_running_requests=8)
    sg.install(check_environment=False)
    hisparse = _pool([128, 4], enable_hisparse=True)
    assert type(hisparse.layer_mapping[1][2]).__name__ == "HiSparseC4DevicePool"
    with pytest.raises(sg.SGLangModeNotSupported, match="HiSparse"):
        backend_mod.DeepseekV4AttnBackend(_runner(hisparse, args))
    with pytest.raises(sg.SGLangModeNotSupported, match="HiSparse"):
        backend_mod.DeepseekV4AttnBackend(_runner(_pool([128, 4]), args, hisparse_coordinator=object()))
    on = published(chunked_prefill_size=256, enable_hisparse=True)
    assert any("HiSparse" in r for r in sg.refusals_from_server_args(on))
