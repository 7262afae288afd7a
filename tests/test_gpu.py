"""GPU tests of the Triton ring backend at DeepSeek-V4's real shapes (run on the H200; skipped without CUDA).

These tests need compiled kernels, which a process that imported them under the interpreter cannot have: with
``TRITON_INTERPRET`` set (the first pass of ``make test``) they skip, and the session summary says so loudly
when a GPU is there; ``make test`` then runs them in its second pass (``pytest -m gpu``), or alone::

    PYTHONPATH=src python -m pytest -q tests/test_gpu.py        # add -s to see the verify reports

What is checked (SPEC sections 4-7, 9):

- FP8 encoding: the integer (exact) encoder and the hardware cast agree byte for byte with each other and
  with PyTorch on every rounding case;
- HCA (r=128, H=512, tiled), CSA (r=4, H=512) and the indexer (H=128, FP8 pack, bf16 norm weight) on a
  schedule with prefill chunks straddling cached and new rows, chunks longer than the ring, MTP rewinds across
  group boundaries, mixed steps and slot reuse: every stored byte is explained against float64 values
  (:mod:`dsv4_compressor.verify`), the exact-equal fraction is reported and must be >= 99.5%; caches with
  ``exact_fp8=True`` and ``exact_fp8=False`` hold identical bytes after every step; rings equal the reference
  backend's bit for bit;
- the single-stage HCA kernel (the 128 x 512 window) on the same kind of schedule (one test: slow compile);
- CUDA graphs: ``backend.launch(kv_score, positions, row_req, out_slot, plan, decode=True)`` over static
  metadata tensors and a plan, captured once (on a step where no row closes a group) and replayed with new
  positions and rows (steps where some or all rows close groups, MTP rewinds, fewer requests), and the cache's
  own ``cache.graph(...)``: bytes equal an eager cache after every replay;
- two micro-batches on two CUDA streams sharing one two-region workspace, each cache on its own region:
  results equal running them one after another;
- guard bands around the pool, the ring, the scratch and ``kv_score`` at real shapes;
- capacity refusal: ``dc.CapacityError`` before any launch, nothing changed.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from helpers.buffers import PAD_F32, fill_bits, poison_cache, raw, step_meta
from helpers.checks import (
    assert_unchanged,
    check_all,
    check_outputs,
    check_ring,
    compare_with_reference_backend,
    first_difference,
    snapshot,
)
from helpers.guards import GuardedRun
from helpers.inputs import e4m3_probe_inputs, make_cache, make_params, random_rows
from helpers.model import StreamModel, run_step, split_rows
from helpers.schedules import max_positions_needed, random_schedule, schedule_coverage, standard_schedule
from helpers.session import gpu_plan, gpu_session_note, interpreting

import dsv4_compressor as dc
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.kernels.numerics import e4m3_byte

CUDA = torch.cuda.is_available()
PLAN = gpu_plan(CUDA, interpreting())
_REASON = {
    "none": "needs a CUDA GPU",
    "interpreted": "this process runs Triton under the interpreter (TRITON_INTERPRET): run the GPU tests without it, "
    "as the second pass of make test does (python -m pytest -m gpu tests)",
}


def gpu(test):
    """A GPU test: marker ``gpu``, skipped unless this process has CUDA and compiled kernels."""
    return pytest.mark.gpu(pytest.mark.skipif(PLAN != "here", reason=_REASON.get(PLAN, ""))(test))


# With its index: a Workspace made for "cuda" is refused by a cache on "cuda" (it resolves to "cuda:0"), see
# test_workspace_on_cuda_without_an_index.
DEV = torch.device("cuda", 0) if CUDA else torch.device("cpu")
HCA = CompressorConfig.hca()
CSA = CompressorConfig.csa()
IDXC = CompressorConfig.indexer()
MTP = 3  # S = 4 rows per request in decode, as the engines run
MIN_EXACT_FRACTION = 0.995
ROOT = Path(__file__).resolve().parents[1]
GPU_MODULES = ["tests/test_gpu.py", "tests/test_online_gpu.py"]

# kind -> (config, backend options, parameter options)
KINDS = {
    "hca-tiled": (HCA, dict(c128_kernel="tiled"), {}),
    "csa": (CSA, {}, {}),
    "indexer-bf16_norm": (IDXC, {}, dict(norm_dtype=torch.bfloat16)),
}


class GpuReport(UserWarning):
    """Byte-check results, shown in pytest's warnings summary (visible with -q)."""


def _report(msg: str) -> None:
    print(msg)
    warnings.warn(GpuReport(msg.strip()), stacklevel=2)


def _sync(device=DEV):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# Where the GPU tests run (CPU-side checks of the decision; no GPU needed)
# ----------------------------------------------------------------------------------------------
def test_gpu_plan_runs_the_modules_wherever_kernels_compile():
    """With CUDA and no interpreter the GPU tests run; with the interpreter (or without CUDA) they skip."""
    assert gpu_plan(cuda=True, interpret=False) == "here"
    assert gpu_plan(cuda=True, interpret=True) == "interpreted"
    assert gpu_plan(cuda=False, interpret=True) == "none"
    assert gpu_plan(cuda=False, interpret=False) == "none"
    assert PLAN == gpu_plan(torch.cuda.is_available(), interpreting())


def test_gpu_session_note_is_loud_when_a_gpu_is_idle():
    """The session summary: a note without CUDA, an alarm with CUDA when no GPU test ran (the interpreter, or
    everything skipped), the counts when they ran."""
    skipped = dict(passed=0, failed=0, skipped=30, error=0)
    ran = dict(passed=29, failed=0, skipped=1, error=0)
    assert gpu_session_note(dict(passed=0, failed=0, skipped=0, error=0), "here") is None
    assert gpu_session_note(skipped, "none")[0] == "note"
    level, title, line = gpu_session_note(skipped, "interpreted")
    assert level == "alarm" and "CUDA IS AVAILABLE" in title and "TRITON_INTERPRET" in line and "-m gpu" in line
    assert gpu_session_note(skipped, "here")[0] == "alarm"
    assert gpu_session_note(ran, "here")[0] == "ok"
    assert gpu_session_note(dict(ran, failed=1), "here")[0] == "alarm"


_CHILD = """
import sys, torch
torch.cuda.is_available = lambda: True  # a GPU machine, as far as conftest and the test modules can tell
import pytest
from _pytest.skipping import evaluate_skip_marks

class Report:
    def pytest_collection_finish(self, session):
        for item in session.items:
            skip = evaluate_skip_marks(item)
            print("WOULD", "SKIP" if skip else "RUN", item.nodeid, skip.reason if skip else "")

sys.exit(pytest.main(sys.argv[1:], plugins=[Report()]))
"""


def _child_session(interpret: bool) -> list[str]:
    """Collect both GPU modules in a child process that believes CUDA is available (no test body runs) and
    report, per GPU test, whether it would run or skip."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TRITON_INTERPRET"))}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "tests"), str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])]
    )
    cmd = [sys.executable, "-c", _CHILD, "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--collect-only", "-m",
           "gpu", *GPU_MODULES]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("WOULD ")]
    assert len(lines) >= 25, out[-4000:]
    return lines


def test_gpu_modules_run_on_a_cuda_machine_without_the_interpreter():
    """On a CUDA machine without TRITON_INTERPRET (``make test``'s second pass) every GPU test runs; with the
    interpreter every one skips, saying why. The defect this guards against: the GPU module skipped itself
    whenever kernels had been imported under the interpreter, which ``make test`` forced."""
    lines = _child_session(interpret=False)
    assert all(ln.startswith("WOULD RUN") for ln in lines), "\n".join(ln for ln in lines if "SKIP" in ln)
    assert {ln.split()[2].split("::")[0] for ln in lines} == set(GPU_MODULES)
    lines = _child_session(interpret=True)
    assert all(ln.startswith("WOULD SKIP") and "TRITON_INTERPRET" in ln for ln in lines), "\n".join(lines)
    # ... and make test, whose first pass interprets, runs them in a pass of its own with compiled kernels
    recipe = (ROOT / "Makefile").read_text()
    passes = [ln for ln in recipe.splitlines() if "pytest" in ln and "-m gpu" in ln]
    assert passes and all("TRITON_INTERPRET" not in ln for ln in passes), (
        "make test must run the GPU tests (pytest -m gpu) without TRITON_INTERPRET on a CUDA machine"
    )


# ----------------------------------------------------------------------------------------------
# FP8 encoders: exact integer rounding vs the hardware cast
# ----------------------------------------------------------------------------------------------
@triton.jit
def _e4m3_probe(x_ptr, out_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, e4m3_byte(x, EXACT), mask=m)


@gpu
def test_fp8_exact_and_hardware_encoders_agree_byte_for_byte():
    x = e4m3_probe_inputs()
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    torch_gpu = x.to(DEV).to(torch.float8_e4m3fn).view(torch.uint8).cpu()
    assert torch.equal(torch_gpu, want), "torch's CUDA and CPU float8 casts disagree"
    got = {}
    for exact in (True, False):
        out = torch.full(x.shape, 0xEE, dtype=torch.uint8, device=DEV)
        block = 1024
        _e4m3_probe[(triton.cdiv(x.numel(), block),)](x.to(DEV), out, x.numel(), EXACT=exact, BLOCK=block)
        got[exact] = out.cpu()
        bad = (got[exact] != want).nonzero()[:, 0]
        assert len(bad) == 0, (
            f"EXACT={exact}: {len(bad)}/{x.numel()} bytes differ from torch's cast, e.g. "
            + ", ".join(f"{x[i].item()!r}: {got[exact][i].item():#04x} != {want[i].item():#04x}" for i in bad[:8])
        )
    assert torch.equal(got[True], got[False])


# ----------------------------------------------------------------------------------------------
# Real shapes: one schedule per kind, three caches (hardware FP8, exact FP8, reference backend)
# ----------------------------------------------------------------------------------------------
def run_recording(caches: dict, model: StreamModel, steps, gen, *, device=DEV) -> dict:
    """Run ``steps`` on all caches; after every step record (instead of raising) the first unexplained output
    of each cache and the first hardware-vs-exact difference, so one run answers every question."""
    log = {"explained": dict.fromkeys(caches), "hw_vs_exact": None, "steps": 0}
    for i, step in enumerate(steps):
        if isinstance(step, tuple):
            for c in caches.values():
                c.release(step[1])
            model.release(step[1])
            continue
        run_step(list(caches.values()), model, step, gen)
        _sync(device)
        log["steps"] += 1
        for name, cache in caches.items():
            if log["explained"][name] is None:
                try:
                    check_outputs(cache, model, f"{name} step {i} {step}")
                    check_ring(cache, model, f"{name} step {i} {step}")
                except AssertionError as e:
                    log["explained"][name] = str(e)
        if log["hw_vs_exact"] is None and "hw" in caches and "exact" in caches:
            diff = first_difference(caches["hw"], caches["exact"])
            if diff is not None:
                log["hw_vs_exact"] = f"step {i} {step}: {diff}"
    return log


def real_shapes_run(kind: str, *, device=DEV, decode_steps=4, configs=KINDS, mtp=MTP, max_requests=4):
    cfg, opts, popts = configs[kind]
    r, ring = cfg.ratio, cfg.ring_rows(mtp)
    steps = standard_schedule(r, mtp, ring, decode_steps=decode_steps)
    cov = schedule_coverage(steps, r, mtp, ring)
    assert cov.straddle and cov.longer_than_ring and cov.rewind_discards_entry and cov.all_close_decode, cov
    seq = max_positions_needed(steps) + r
    params = make_params(cfg, seed=17, max_positions=seq, **popts)
    common = dict(max_requests=max_requests, max_seq_len=seq, mtp_step=mtp, device=device)
    caches = {
        "hw": make_cache(cfg, params, "triton", exact_fp8=False, **common, **opts),
        "exact": make_cache(cfg, params, "triton", exact_fp8=True, **common, **opts),
        "reference": make_cache(cfg, params, "reference", **common),
    }
    for c in caches.values():
        poison_cache(c)
    model = StreamModel(cfg, params, mtp)
    log = run_recording(caches, model, steps, torch.Generator().manual_seed(23), device=device)
    return SimpleNamespace(kind=kind, cfg=cfg, caches=caches, model=model, log=log, steps=steps)


@pytest.fixture(scope="module", params=list(KINDS))
def real_run(request):
    return real_shapes_run(request.param)


@gpu
def test_real_shapes_every_byte_explained(real_run):
    log, model = real_run.log, real_run.model
    assert log["explained"]["hw"] is None, f"{real_run.kind} (hardware FP8): {log['explained']['hw']}"
    cache = real_run.caches["hw"]
    rep = check_outputs(cache, model, real_run.kind)
    inv = check_all(cache, model, real_run.kind)
    _report(f"\n[{real_run.kind}] {len(model.written)} records after {log['steps']} steps\n  {rep}\n  {inv}")
    assert rep.total_bytes > 0
    assert rep.exact_fraction >= MIN_EXACT_FRACTION, f"{real_run.kind}: {rep}"
    assert inv.exact_fraction >= MIN_EXACT_FRACTION, f"{real_run.kind}: {inv}"


@gpu
def test_real_shapes_exact_and_hardware_fp8_identical(real_run):
    log = real_run.log
    assert log["explained"]["exact"] is None, f"{real_run.kind} (exact FP8): {log['explained']['exact']}"
    assert log["hw_vs_exact"] is None, f"{real_run.kind}: exact_fp8=True vs False: {log['hw_vs_exact']}"
    hw, exact = real_run.caches["hw"], real_run.caches["exact"]
    assert hw.backend.exact_fp8 is False and exact.backend.exact_fp8 is True
    assert first_difference(hw, exact) is None


@gpu
def test_real_shapes_match_reference_backend(real_run):
    log = real_run.log
    assert log["explained"]["reference"] is None, f"{real_run.kind} (reference): {log['explained']['reference']}"
    same = compare_with_reference_backend(real_run.caches["hw"], real_run.caches["reference"], real_run.kind)
    _report(f"\n[{real_run.kind}] pool bytes equal to the reference backend's: {same:.4%}")
    assert same >= 0.99, f"{real_run.kind}: only {same:.4%} of pool bytes equal the reference backend's"


@gpu
def test_hca_single_stage_real_shapes():
    """The single-stage C128 kernel (whole 128 x 512 window per program): the only test that compiles it."""
    cfg, mtp = HCA, MTP
    steps = standard_schedule(cfg.ratio, mtp, cfg.ring_rows(mtp), decode_steps=2)
    seq = max_positions_needed(steps) + cfg.ratio
    params = make_params(cfg, seed=29, max_positions=seq)
    cache = make_cache(
        cfg, params, "triton", max_requests=4, max_seq_len=seq, mtp_step=mtp, device=DEV, c128_kernel="single"
    )
    assert not cache.backend.tiled
    poison_cache(cache)
    model = StreamModel(cfg, params, mtp)
    log = run_recording({"single": cache}, model, steps, torch.Generator().manual_seed(29))
    assert log["explained"]["single"] is None, log["explained"]["single"]
    rep = check_outputs(cache, model, "hca single")
    _report(f"\n[hca-single] {rep}")
    assert rep.exact_fraction >= MIN_EXACT_FRACTION, str(rep)
    check_all(cache, model, "hca single")


# ----------------------------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------------------------
def decode_plan(cfg, batch: int, mtp: int, replays: int = 6):
    """Prefill lengths and decode steps of ``batch`` requests x ``S = mtp + 1`` rows.

    Step 0 (the capture step) closes no group; later steps rewind by up to ``mtp`` (MTP verification) and
    include steps where every request closes a group and one with a request fewer."""
    r, s = cfg.ratio, mtp + 1
    assert r >= s + 1, "the capture step must be able to avoid group boundaries"
    lengths = {b: r * (b + 2) + max(0, r - s - 1 - b) for b in range(batch)}
    prefill = [(b, 0, n) for b, n in lengths.items()]
    modes = ["none", "some", "all", "fewer", "some", "all"][:replays]

    def closes(start):
        return any(p % r == r - 1 for p in range(start, start + s))

    steps = []
    for k, mode in enumerate(modes):
        items = []
        for b in range(batch):
            if mode == "fewer" and b == batch - 1:
                continue
            length = lengths[b]
            rewinds = list(range(min(mtp, length) + 1))
            if mode == "none":
                a = 0
            elif mode == "all":
                a = next((a for a in rewinds if closes(length - a)), 0)
            else:
                a = rewinds[(b + k) % len(rewinds)]
            items.append((b, length - a, s))
        steps.append(items)
        for b, start, n in items:
            lengths[b] = start + n
    flags = [[closes(start) for _, start, _ in items] for items in steps]
    assert not any(flags[0]), "the capture step must close no group"
    assert any(all(f) for f in flags[1:]), f"no step closes a group in every request: {flags}"
    return prefill, steps, flags


def graph_decode_run(cfg, opts, *, batch=4, mtp=MTP, device=DEV, use_graph=True, pad=2, params_opts=None):
    """Capture ``backend.launch(static_kv, positions, row_req, out_slot, plan, decode=True)`` over static
    metadata tensors once and replay it for every decode step (padding rows: ``row_req = num_slots``, the
    engines' HOLD value); an eager cache runs the same steps through ``cache.step``. Returns per-step failures.
    With ``use_graph=False`` (or on the CPU) the static launch runs eagerly: the same logic, testable anywhere."""
    r, s = cfg.ratio, mtp + 1
    prefill, steps, flags = decode_plan(cfg, batch, mtp)
    seq = max(n for _, _, n in prefill) + len(steps) * s + r
    params = make_params(cfg, seed=31, max_positions=seq, **(params_opts or {}))
    common = dict(max_requests=batch, max_seq_len=seq, mtp_step=mtp, device=device, check_finite=False)
    graph_cache = make_cache(cfg, params, "triton", **common, **opts)
    eager = make_cache(cfg, params, "triton", **common, **opts)
    for c in (graph_cache, eager):
        poison_cache(c)
    model = StreamModel(cfg, params, mtp)
    gen = torch.Generator().manual_seed(37)
    run_step([graph_cache, eager], model, prefill, gen)

    T = batch * s + pad
    static_kv = fill_bits(torch.empty(T, cfg.row_width, device=device), PAD_F32)
    static_meta = torch.from_numpy(step_meta(graph_cache, [], pad_rows=T, pad_slot=batch)).to(device)
    plan = graph_cache.backend.plan_buffer(T, batch)
    # All padding: a launch does nothing, which makes it the warm-up (compiles every kernel of the step).
    before = snapshot(graph_cache)
    graph_cache.backend.launch(static_kv, *static_meta, plan, decode=True)
    _sync(device)
    assert_unchanged(graph_cache, before, "an all-padding launch")

    graph = None
    failures = []
    for k, items in enumerate(steps):
        ids, starts, counts = [i[0] for i in items], [i[1] for i in items], [i[2] for i in items]
        rows = random_rows(sum(counts), cfg, gen)
        host = step_meta(graph_cache, items, pad_rows=T - rows.shape[0], pad_slot=batch)
        static_meta.copy_(torch.from_numpy(host))
        fill_bits(static_kv, PAD_F32)
        static_kv[: rows.shape[0]].copy_(rows.to(device))
        if use_graph and device.type == "cuda" and graph is None:
            # captured once, on the first decode step (no row closes a group); capturing runs nothing
            assert not any(flags[k])
            _sync(device)
            before = snapshot(graph_cache)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_cache.backend.launch(static_kv, *static_meta, plan, decode=True)
            _sync(device)
            try:
                assert_unchanged(graph_cache, before, "capturing the graph")
            except AssertionError as e:
                failures.append(str(e))
                break
        if graph is not None:
            graph.replay()
        else:
            graph_cache.backend.launch(static_kv, *static_meta, plan, decode=True)
        eager.step(ids, starts, counts, rows.to(device).clone())
        _sync(device)
        for rid, start, part in split_rows(items, rows):
            model.apply(rid, start, part, graph_cache.pool)
        label = f"replay {k} {items} (closing: {flags[k]})"
        if not np.array_equal(graph_cache.pool.page_table, eager.pool.page_table):
            failures.append(f"{label}: the graph cache and the eager cache hold different pages")
        diff = first_difference(graph_cache, eager)
        if diff is not None:
            failures.append(f"{label}: graph != eager: {diff}")
        pad_rows = static_kv[rows.shape[0] :].cpu().view(torch.int32)
        if not bool((pad_rows == PAD_F32).all()):
            failures.append(f"{label}: a padding row of kv_score was written")
        try:
            check_outputs(graph_cache, model, label)
            check_ring(graph_cache, model, label)
            check_all(eager, model, label)
        except AssertionError as e:
            failures.append(str(e))
        if failures:
            break
    return failures, model


@gpu
@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_graph_decode_replay(kind):
    cfg, opts, popts = KINDS[kind]
    mtp = MTP if cfg.ratio > MTP + 1 else 2  # r = 4: S = 3 rows, so the capture step can avoid a boundary
    failures, model = graph_decode_run(cfg, opts, mtp=mtp, params_opts=popts)
    assert not failures, f"{kind}: " + "\n".join(failures)
    assert len(model.closed_log) > 0


def cache_graph_run(cfg, opts, *, batch=4, mtp=MTP, device=DEV, params_opts=None):
    """``cache.graph(max_requests=batch, rows_per_request=mtp + 1)`` replayed for the decode steps of
    :func:`decode_plan`, against an eager cache; the graph refuses a step it cannot replay, changing nothing."""
    r, s = cfg.ratio, mtp + 1
    prefill, steps, flags = decode_plan(cfg, batch, mtp)
    seq = max(n for _, _, n in prefill) + len(steps) * s + r
    params = make_params(cfg, seed=59, max_positions=seq, **(params_opts or {}))
    common = dict(max_requests=batch + 1, max_seq_len=seq, mtp_step=mtp, device=device)
    graphed = make_cache(cfg, params, "triton", **common, **opts)
    eager = make_cache(cfg, params, "triton", **common, **opts)
    for c in (graphed, eager):
        poison_cache(c)
    model = StreamModel(cfg, params, mtp)
    gen = torch.Generator().manual_seed(61)
    run_step([graphed, eager], model, prefill, gen)
    before = snapshot(graphed)
    graph = graphed.graph(max_requests=batch, rows_per_request=s)  # captures (on CUDA) with padding only
    _sync(device)
    assert_unchanged(graphed, before, "capturing cache.graph")
    for items in steps:
        rows = random_rows(sum(n for _, _, n in items), cfg, gen)
        graph.step([i[0] for i in items], [i[1] for i in items], [i[2] for i in items], rows.to(device))
        run_step(eager, model, split_rows(items, rows))
        _sync(device)
        assert np.array_equal(graphed.pool.page_table, eager.pool.page_table)
        assert first_difference(graphed, eager) is None, f"{items}: {first_difference(graphed, eager)}"
        check_all(graphed, model, f"cache.graph {items}")
        check_outputs(graphed, model, f"cache.graph {items}")
    # a step the graph cannot replay is refused before anything changes
    before = snapshot(graphed)
    live = sorted(model.rows)
    with pytest.raises(dc.StepError, match=f"captured for {s} per request"):
        graph.step([live[0]], [model.length(live[0])], [s + 1], random_rows(s + 1, cfg, gen, device))
    with pytest.raises(dc.StepError, match=f"but the graph was captured for {batch}"):
        ids = list(range(batch + 1))
        graph.step(ids, [model.length(i) for i in ids], [1] * len(ids), random_rows(len(ids), cfg, gen, device))
    assert_unchanged(graphed, before, "refused graph steps")
    return model


@gpu
@pytest.mark.parametrize("kind", ["hca-tiled", "csa"])
def test_cache_graph_decode_replay(kind):
    cfg, opts, popts = KINDS[kind]
    mtp = MTP if cfg.ratio > MTP + 1 else 2
    model = cache_graph_run(cfg, opts, mtp=mtp, params_opts=popts)
    assert len(model.closed_log) > 0


# ----------------------------------------------------------------------------------------------
# Two micro-batches, two streams, one two-region workspace
# ----------------------------------------------------------------------------------------------
def two_region_run(cfg, *, device=DEV, streams=True, mtp=MTP, decode_steps=4):
    r, ring = cfg.ratio, cfg.ring_rows(mtp)
    schedules = [
        standard_schedule(r, mtp, ring, decode_steps=decode_steps),
        random_schedule(r, mtp, ring, seed=7, num_steps=12, max_requests=4),
    ]
    n = max(len(s) for s in schedules)
    schedules = [s + [[]] * (n - len(s)) for s in schedules]
    seq = max(max_positions_needed(s) for s in schedules) + r
    biggest = max(sum(i[2] for i in step) for s in schedules for step in s if isinstance(step, list))
    plan = dc.plan_c128_scratch(
        batch_max_tokens=biggest, max_req_num=8, mtp_step=mtp, decode_overlap=True, dp=2, head_dim=cfg.head_dim
    )
    assert plan.regions == 2
    params = make_params(cfg, seed=41, max_positions=seq)
    gen = torch.Generator().manual_seed(43)
    rows = [[random_rows(sum(i[2] for i in step), cfg, gen, device) if isinstance(step, list) else None
             for step in s] for s in schedules]  # fmt: skip

    def build():
        ws = dc.Workspace(plan, device=device)
        pair = [
            make_cache(cfg, params, "triton", max_requests=4, max_seq_len=seq, mtp_step=mtp, device=device,
                       workspace=ws, scratch_region=region, check_finite=False)
            for region in (0, 1)
        ]  # fmt: skip
        for c in pair:
            poison_cache(c)
        return pair

    def play(cache, step, kv, model=None):
        if isinstance(step, tuple):
            cache.release(step[1])
            if model is not None:
                model.release(step[1])
        elif step:
            cache.step([i[0] for i in step], [i[1] for i in step], [i[2] for i in step], kv.clone())
            if model is not None:
                row, host = 0, kv.cpu()
                for rid, start, cnt in step:
                    model.apply(rid, start, host[row : row + cnt], cache.pool)
                    row += cnt

    # one after another, on the current stream
    serial = build()
    models = [StreamModel(cfg, params, mtp) for _ in range(2)]
    for k in range(n):
        for j in range(2):
            play(serial[j], schedules[j][k], rows[j][k], models[j])
    _sync(device)

    # concurrently: micro-batch j on stream j
    concurrent = build()
    if streams:
        side = [torch.cuda.Stream(device=device) for _ in range(2)]
        for s in side:
            s.wait_stream(torch.cuda.current_stream(device))
        for k in range(n):
            for j in range(2):
                with torch.cuda.stream(side[j]):
                    play(concurrent[j], schedules[j][k], rows[j][k])
        for s in side:
            torch.cuda.current_stream(device).wait_stream(s)
    else:
        for k in range(n):
            for j in range(2):
                play(concurrent[j], schedules[j][k], rows[j][k])
    _sync(device)
    return serial, concurrent, models


@gpu
def test_two_micro_batches_on_two_streams():
    serial, concurrent, models = two_region_run(HCA)
    for j in range(2):
        assert concurrent[j].backend.scratch_region == j
        diff = first_difference(serial[j], concurrent[j])
        assert diff is None, f"micro-batch {j} (scratch region {j}): concurrent != serial: {diff}"
        check_outputs(concurrent[j], models[j], f"micro-batch {j}")
        check_ring(concurrent[j], models[j], f"micro-batch {j}")
        check_all(concurrent[j], models[j], f"micro-batch {j}")


# ----------------------------------------------------------------------------------------------
# Guard bands and capacity at real shapes
# ----------------------------------------------------------------------------------------------
GUARD_KINDS = [
    ("hca-tiled-region1", HCA, dict(c128_kernel="tiled"), 1, {}),
    ("hca-tiled", HCA, dict(c128_kernel="tiled"), None, {}),
    ("csa-bf16_norm", CSA, {}, None, dict(norm_dtype=torch.bfloat16)),
]


@gpu
@pytest.mark.parametrize(
    "vid,cfg,opts,region,popts", GUARD_KINDS, ids=["hca-tiled-region1", "hca-tiled", "csa-bf16_norm"]
)
def test_guard_bands_real_shapes(vid, cfg, opts, region, popts):
    steps = standard_schedule(cfg.ratio, MTP, cfg.ring_rows(MTP), decode_steps=2)
    seq = max_positions_needed(steps) + 2 * cfg.ratio
    # the largest step, or the closing launch run_standard ends with (up to r rows per request, 3 padding rows)
    biggest = max(max(sum(i[2] for i in s) for s in steps if isinstance(s, list)), 4 * cfg.ratio) + 8
    run = GuardedRun(cfg, opts, region, mtp=MTP, batch_max_tokens=biggest, max_positions=seq, device=DEV,
                     params_opts=popts)  # fmt: skip
    run.run_standard(decode_steps=2, what=vid)


def capacity_run(cfg, *, device=DEV, rows_per_region=16):
    mtp = MTP
    params = make_params(cfg, seed=47, max_positions=4 * cfg.ratio)
    ws = dc.Workspace(dc.C128ScratchPlan(regions=1, rows_per_region=rows_per_region, head_dim=cfg.head_dim), device)
    cache = make_cache(
        cfg, params, "triton", max_requests=3, max_seq_len=4 * cfg.ratio, mtp_step=mtp, device=device, workspace=ws
    )
    poison_cache(cache)
    model = StreamModel(cfg, params, mtp)
    gen = torch.Generator().manual_seed(53)
    run_step(cache, model, [(0, 0, rows_per_region - 4), (1, 0, 4)], gen)  # exactly at capacity
    _sync(device)
    before = snapshot(cache)
    scratch = raw(ws.buffer).clone()
    # one row too many, and no row closes a group (the case a CUDA graph is captured on)
    items = [(0, rows_per_region - 4, 2), (1, 4, 3), (2, 0, rows_per_region - 4)]
    total = sum(n for _, _, n in items)
    assert total == rows_per_region + 1
    assert not any(p % cfg.ratio == cfg.ratio - 1 for _, s0, n in items for p in range(s0, s0 + n))
    kv = random_rows(total, cfg, gen, device)
    kv_before = kv.clone()
    errors = []
    with pytest.raises(dc.CapacityError) as err:
        cache.step([i[0] for i in items], [i[1] for i in items], [i[2] for i in items], kv)
    errors.append(str(err.value))
    meta = torch.tensor([list(range(rows_per_region - 4, rows_per_region - 4 + total)), [0] * total, [-1] * total],
                        device=device)  # fmt: skip
    with pytest.raises(dc.CapacityError) as err:
        cache.backend.launch(kv, *meta, cache.backend.plan_buffer(total, 1), decode=False)
    errors.append(str(err.value))
    _sync(device)
    assert_unchanged(cache, before, "refused step")
    assert torch.equal(raw(ws.buffer), scratch), "the scratch was written by a refused step"
    assert torch.equal(raw(kv), raw(kv_before)), "kv_score was written by a refused step"
    # the cache still works
    run_step(cache, model, items[:2], gen)
    run_step(cache, model, items[2:], gen)
    _sync(device)
    check_outputs(cache, model, "after refusal")
    check_all(cache, model, "after refusal")
    return errors


@gpu
def test_workspace_on_cuda_without_an_index():
    """``Workspace``'s default device is ``"cuda"``; a cache on ``"cuda"`` must accept it."""
    plan = dc.C128ScratchPlan(regions=1, rows_per_region=16, head_dim=HCA.head_dim)
    ws = dc.Workspace(plan)
    params = make_params(HCA, max_positions=256)
    cache = make_cache(HCA, params, "triton", max_requests=1, max_seq_len=256, device="cuda", workspace=ws)
    assert cache.backend.workspace is ws


@gpu
def test_capacity_refused_before_any_launch():
    errors = capacity_run(HCA)
    for msg in errors:
        assert "region 0" in msg and "17 rows" in msg and "holds 16" in msg, msg
