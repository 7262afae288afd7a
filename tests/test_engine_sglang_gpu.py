"""The SGLang adapter on a GPU through the real ``sglang==0.5.23`` classes, against SGLang's own CUDA kernels.

The GPU machine has no SGLang: ``scripts/build_engine_kit.sh`` builds ``engine_kit/`` (carried there), which
``helpers.engine_kit.activate`` puts on ``sys.path`` before anything imports SGLang. Skipped without the kit or
SGLang, and (the ``gpu`` tests) without CUDA.

``test_ours_against_sglangs_own_kernels`` (gpu): SGLang's real ``DeepSeekV4TokenToKVPool`` (C128 layer 0, C4 layer
1 with its indexer, 256-token pages), ``ReqToTokenPool``, ``DeepseekV4AttnBackend`` (constructor included: under
``install()`` it allocates our scratch and workspaces and, with ``projection="auto"``, joins the C4 layer's two
``wkv_gate`` weights) and ``Compressor`` modules at V4-Flash's hidden size on CUDA run one program twice on
identical inputs: a prefill of two requests (one across a C128 group end), a chunked prefill beside a new
request, then padded decode batches (E = 1) or padded E = 3 verify batches with random acceptance (EAGLE in the
published ``ServerArgs``: rings 16 / 256), each decode / verify shape captured as a CUDA graph holding
``init_forward_metadata_in_graph`` (the raw metadata upgraded to the full one, SGLang's planner or ours) and
every layer's compressor, then replayed per step; then an idle batch. Once through SGLang's own path (no
``install()``: ``create_paged_compressor_data``'s ``c_plan`` planner, ``compress_forward``'s ``c4_v2`` /
``c128_v2`` kernels and ``compress_norm_rope_store``'s ``fused_norm_rope_v2``, JIT-built by SGLang's
``load_jit`` with the machine's nvcc), once through ours (``install(projection=..., hca=...)``, ``engine`` and
``auto``: our projection on the steps its measured gate admits, the paired C4 launch on decode / verify steps;
``hca="online"``: the C128 layer's banks in SGLang's C128 pool, sized for them, checked apart: no pool row of a
slot no step ran written, each live request's bank of its length finite). After
every step our run's entries pass the float64 checks (``EngineWorld.check``: the compression of SGLang's GEMM
rows, or under ``auto`` of ``x @ W.T`` with the float32 projection's floor), its state rows bit for bit
(``engine``) and no stray byte or row; SGLang's records that fail those checks are counted and printed, not
asserted (on an H100 at 03c1c9d about one byte per CSA and HCA record); then every written record is compared
byte for byte between the runs (records that differ: both valid, so at rounding boundaries; counted and
printed), every state row a later step may read (bit for bit with SGLang's GEMM on both sides, else within
float32 rounding of the projection), and what SGLang writes for its padding request 0 (its state rows and slot
0, which ours leaves poisoned) is counted apart. With ``$OUT`` set the counts go to
``$OUT/engine_sglang_gpu.json``. Then each run's captured step graph is timed (warm replays), SGLang's own
against ours through the adapter.

``test_cpu_smoke_of_the_harness``: the same harness on CPU under the interpreter (eager, no graph: SGLang's
compressor path is its JIT CUDA kernels only, so both runs are ours, ``engine`` against ``auto`` with our
projection admitted on small steps), so the GPU call is not the harness's first run.
"""

from __future__ import annotations

import importlib.util
import os
import types

import pytest
import torch
from helpers import engine_kit

# the kit where this Python has no SGLang of its own (the GPU machine); the engines' CPU environment keeps its own
KIT = engine_kit.activate() if importlib.util.find_spec("sglang") is None else None
pytest.importorskip("sglang", reason="SGLang is not importable (no engine_kit/: scripts/build_engine_kit.sh)")
import test_engine_sglang as tes  # noqa: E402  (the torchvision stand-in on CPU, SGLang's modules)
import test_integration_sglang as tis  # noqa: E402
from helpers import sglang_engine_world as sew  # noqa: E402
from helpers.session import interpreting, record_out  # noqa: E402

from dsv4_compressor.integrations import sglang as sg  # noqa: E402

CUDA = torch.cuda.is_available() and not interpreting()
PROGRAM_DRAFTS = [1, 3]


def _setup(monkeypatch, draft_tokens: int, device: str):
    """SGLang's runtime context as the CPU test publishes it, and the stand-ins named in the world's docstring."""
    monkeypatch.setattr(tes.dsa_utils, "get_parallel", lambda: types.SimpleNamespace(attn_cp_size=1))
    monkeypatch.setattr(tes.backend_mod.DeepseekV4AttnBackend, "init_forward_metadata_indexer",
                        lambda self, *a, **k: None)  # fmt: skip
    if device == "cpu":  # flash_mla: CUDA only (on the GPU the kit's stand-in returns its empty schedule)
        monkeypatch.setattr(tes.backend_mod, "_create_flashmla_metadata", lambda: None)
    monkeypatch.setattr(tis, "PAGE", sew.PAGE)
    ctx = tes.runtime_mod.get_context()
    saved = {name: getattr(ctx, name) for name in ("_server_args", "_config_bags")}
    saved_parallel = ctx.parallel._config
    spec = {}
    if draft_tokens > 1:
        spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=draft_tokens - 1, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=draft_tokens)  # fmt: skip
    args = tes.server_args_mod.ServerArgs(model_path="x", chunked_prefill_size=256, max_prefill_tokens=256,
                                          device=device, **spec)  # fmt: skip
    ctx.set_server_args(args)

    def restore():
        for name, value in saved.items():
            setattr(ctx, name, value)
        ctx.parallel._config = saved_parallel

    return args, restore


def _program(w: sew.EngineWorld, *, decode_steps: int = 4, verify_steps: int = 3) -> None:
    w.step([(1, 0, 130), (2, 0, 9)], "prefill")
    w.check("prefill")
    w.step([(2, 9, 6), (3, 0, 7)], "prefill")
    w.check("chunked prefill")
    if w.draft_tokens > 1:
        assert (w.ring4, w.ring128) == (16, 256 if not w.ours or w.adapter.hca == "ring" else sg.bank_rows(3))
        w.verify_steps([1, 2, 3], verify_steps, bs=4)  # checks after each step
    else:
        for k in range(decode_steps):
            w.step([(s, w.lengths[s], 1) for s in (1, 2, 3)], "decode", bs=4)
            w.check(f"decode {k}")
    idle = types.SimpleNamespace(forward_mode=tes.ForwardMode.IDLE, positions=torch.zeros(0, dtype=torch.int64))
    before = [layer.memory.clone() for layer in w.layers]
    w._layers(torch.zeros(0, w.hidden, dtype=torch.bfloat16, device=w.device), idle)
    assert all(torch.equal(b, layer.memory) for b, layer in zip(before, w.layers)), "the idle batch wrote"


def _run(monkeypatch, draft_tokens: int, device: str, hidden: int, projection: str | None,
         hca: str = "ring") -> sew.EngineWorld:  # fmt: skip
    """One run of the program: SGLang's own path (``projection=None``) or ours under ``install(projection=,
    hca=)``."""
    args, restore = _setup(monkeypatch, draft_tokens, device)
    try:
        if projection is not None:
            sg.install(projection=projection, hca=hca, check_environment=False)
        w = sew.EngineWorld(args, device=device, hidden=hidden, ours=projection is not None)
        if projection is not None:
            assert w.adapter.draft_tokens == draft_tokens and w.adapter.hca == hca
            workspaces = dict(w.adapter._projection)
            assert (projection == "auto") == bool(workspaces) and (projection == "auto") == (
                w.adapter.joined_layers == 1
            )
        _program(w)
        if projection is not None:
            assert w.adapter._projection.keys() == workspaces.keys()
            assert all(w.adapter._projection[g] is t for g, t in workspaces.items()), "a workspace was replaced"
            assert w.adapter.projection_fallbacks == {}, w.adapter.projection_fallbacks
        return w
    finally:
        sg.uninstall()
        restore()


def _report(name: str, counts: dict) -> None:
    line = ", ".join(
        f"{layer}: {c['differing_records']} of {c['records']} records ({c['differing_bytes']} of {c['record_bytes']}"
        f" bytes) differ, state {c['differing_state_rows']} of {c['state_rows']} rows; SGLang's padding request: "
        f"{c['padding_rows_theirs']} state rows, slot 0 {'written' if c['padding_slot_theirs'] else 'untouched'}; "
        f"steps where SGLang's own records fail the float64 checks: {c.get('engine_deviations', 0)}"
        for layer, c in counts.items()
    )  # fmt: skip
    print(f"{name}: {line}")
    record_out("engine_sglang_gpu.json", name, counts)


def _time_step_graphs(name: str, theirs: sew.EngineWorld, ours: sew.EngineWorld) -> None:
    """Warm: the median replay of each run's captured decode / verify step (metadata build, the C4 layer's two
    compressors and the C128 layer, each from hidden states) over 200 replays, SGLang's own path against ours
    through the adapter, printed (after the comparison: a replay repeats the step's writes)."""
    import numpy as np

    from benchmarks.timing import CudaTimer

    timer = CudaTimer()
    (key,) = theirs.graphs
    medians = {}
    for side, world in (("SGLang", theirs), ("ours", ours)):
        samples = timer.time([world.graphs[key].graph.replay], replays=200, warmup=20, queue_ahead=True)
        medians[side] = float(np.median(samples))
    print(f"{name}: step graph {key}: SGLang's own {medians['SGLang']:.2f} us, ours through the adapter "
          f"{medians['ours']:.2f} us ({torch.cuda.get_device_name()})")  # fmt: skip
    if os.environ.get("DSV4_PROFILE_STEP") == "1":
        for side, world in (("SGLang", theirs), ("ours", ours)):
            _profile_step(f"{name}: {side}", world.graphs[key].graph)


def _profile_step(name: str, graph, replays: int = 20) -> None:
    """torch's profiler over ``replays`` replays of a captured step: kernels per replay, their summed device time
    and the costliest kernels, printed (``DSV4_PROFILE_STEP=1``: where a step graph's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.count]
    kernels = sum(e.count for e in events) / replays
    total = sum(e.device_time_total for e in events) / replays
    print(f"{name}: {kernels:.0f} kernels per replay, {total:.1f} us summed")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:14]:
        print(f"  {e.device_time_total / replays:7.2f} us  x{e.count / replays:.0f}  {e.key[:100]}")


_THEIRS: dict[int, sew.EngineWorld] = {}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and compiled kernels (no TRITON_INTERPRET)")
@pytest.mark.parametrize("hca", ["ring", "online"])
@pytest.mark.parametrize("projection", ["engine", "auto"])
@pytest.mark.parametrize("draft_tokens", PROGRAM_DRAFTS, ids=["decode", "mtp"])
def test_ours_against_sglangs_own_kernels(monkeypatch, draft_tokens, projection, hca):
    """See the module docstring."""
    if draft_tokens not in _THEIRS:
        _THEIRS[draft_tokens] = _run(monkeypatch, draft_tokens, "cuda", sew.HIDDEN_GPU, None)
    theirs = _THEIRS[draft_tokens]
    ours = _run(monkeypatch, draft_tokens, "cuda", sew.HIDDEN_GPU, projection, hca)
    assert ours.replays == theirs.replays > 0 and len(ours.graphs) == len(theirs.graphs) == 1
    counts = sew.compare(theirs, ours)
    name = f"E={draft_tokens} projection={projection}" + (" hca=online" if hca == "online" else "")
    _report(name, counts)
    for layer, what, line in theirs.engine_deviations:
        print(f"SGLang's own {layer} records, {what}: {line}")
    assert counts["hca"]["records"] >= 1 and counts["csa"]["records"] >= 38 and counts["indexer"]["records"] >= 38
    _time_step_graphs(name, theirs, ours)
    total = sum(c["record_bytes"] for c in counts.values())
    differing = sum(c["differing_bytes"] for c in counts.values())
    assert differing <= total // 50, f"{differing} of {total} record bytes differ: more than rounding"


@pytest.mark.parametrize("draft_tokens", PROGRAM_DRAFTS, ids=["decode", "mtp"])
def test_cpu_smoke_of_the_harness(monkeypatch, draft_tokens):
    """The harness on CPU (see the module docstring): ours with SGLang's GEMM against ours with our projection
    on the steps of at most 16 rows (the measured gate admits V4 shapes only) and online HCA, every check and
    the comparison."""
    if CUDA:
        pytest.skip("the GPU test runs the harness on CUDA")
    monkeypatch.setattr(sg.ops, "projection_triton_rows", lambda width, dim, **_: tes.SMALL)
    engine = _run(monkeypatch, draft_tokens, "cpu", tes.HIDDEN, "engine")
    auto = _run(monkeypatch, draft_tokens, "cpu", tes.HIDDEN, "auto", "online")
    counts = sew.compare(engine, auto)
    _report(f"CPU smoke E={draft_tokens}: engine against auto, online HCA", counts)
    assert counts["csa"]["records"] >= 38 and counts["hca"]["records"] >= 1
    assert all(c["padding_rows_theirs"] == 0 and not c["padding_slot_theirs"] for c in counts.values())
