"""The vLLM adapter on a GPU through the real ``vllm==0.33.0`` classes, against vLLM's own compressor forward.

The GPU machine has no vLLM: ``scripts/build_engine_kit.sh`` builds ``engine_kit/`` (carried there), which
``helpers.engine_kit.activate`` puts on ``sys.path`` before anything imports vLLM. Skipped without the kit or
vLLM, and (the ``gpu`` tests) without CUDA.

The layer is test_engine_vllm.py's :class:`ForwardRun` (vLLM's ``DeepseekCompressor``, ``CompressorStateCache``,
``CompressorMetadataBuilder``, ``BlockTable``, ``get_compressed_slot_mapping``, ``create_kv_cache_views``), here on
CUDA. vLLM's side is its forward as it runs
where its CuTe DSL kernels do not (AMD, XPU; the package's CUDA platform needs the ``vllm._C_stable_libtorch``
extension, which the kit does not carry): ``_SAVE_PARTIAL_STATES_KERNEL`` then ``compress_norm_rope_store_triton``,
its Triton kernels compiled for this GPU. So vLLM's platform is pinned to its ``UnspecifiedPlatform`` with device
type ``cuda`` before the compressor module is imported; nothing else of vLLM is replaced. On NVIDIA GPUs vLLM
writes the head-512 records with its CuTe DSL kernels, which this does not compare against.

* ``test_eager_program_on_cuda``: test_engine_vllm.py's programs (chunked prefill, decode, MTP verify with rejected
  drafts, the runners' paddings), every step's state and k cache allocations compared byte for byte.
* ``test_piecewise_graph_on_cuda``: a real CUDA graph of our layer captured on vLLM's PIECEWISE dummy batch (a decode
  batch by its metadata) and replayed on a 7-row prefill chunk padded to 8, against vLLM's eager forward.
* ``test_full_graph_on_cuda``: a FULL graph captured on a padded MTP verify step and replayed on the next ones, with
  rejected drafts, against vLLM's eager forward.
* ``test_online_hca_on_cuda``: online HCA (``install(hca="online")``: the banks in vLLM's own
  ``CircularBufferSpec`` group, a block-strided view, no slot mapping) through test_engine_vllm_online.py's program
  (chunked prefill, MTP verify after rejected drafts, decode, a request joining, the runners' paddings) against
  vLLM's own forward with its C128 ring: the same slots written, records that differ only at the online kernel's
  rounding boundaries (it sums a group in another order: counted, at most 2% of the bytes), ours against float64
  after every step and every mid-group bank against the float64 partial group.

Differing bytes and records are counted and printed (a line starting ``vLLM GPU``; with ``$OUT`` set, into
``$OUT/engine_vllm_gpu.json``) before they are asserted to be none.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import engine_kit
from helpers.session import interpreting, record_out

KIT = engine_kit.activate() if importlib.util.find_spec("vllm") is None else None
CUDA = torch.cuda.is_available() and not interpreting()
pytest.importorskip("vllm", reason="vLLM is not importable (no engine_kit/: scripts/build_engine_kit.sh)")
if CUDA:
    import vllm.platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    if vllm.platforms._current_platform is None:  # before any vLLM module reads current_platform
        _platform = UnspecifiedPlatform()
        _platform.device_type = "cuda"
        vllm.platforms._current_platform = _platform
import test_engine_vllm as tev  # noqa: E402

from dsv4_compressor.integrations import vllm as dsv4_vllm  # noqa: E402

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA and compiled kernels (no TRITON_INTERPRET)")


@pytest.fixture(scope="module")
def vllm_on_device():
    """vLLM's parallel groups (one rank, gloo) and its platform's device type, as test_engine_vllm.py's
    ``vllm_on_cpu`` sets them, for this machine's device."""
    import tempfile

    import vllm.v1.utils
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    device = "cuda" if CUDA else "cpu"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(current_platform, "device_type", device)
        mp.setattr(vllm.v1.utils, "PIN_MEMORY", False)
        with tev.set_current_vllm_config(tev._fwd_config(device=device)), tempfile.TemporaryDirectory() as tmp:
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{tmp}/init", backend="gloo"
            )
            parallel_state.initialize_model_parallel(1, 1)
            try:
                yield device
            finally:
                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()


def _pair(kind: str, device: str, debug: bool = False, max_tokens: int = tev.FWD_T):
    theirs = tev.ForwardRun(kind, ours=False, device=device, max_tokens=max_tokens)
    with dsv4_vllm.install(debug=debug):
        ours = tev.ForwardRun(kind, ours=True, device=device, max_tokens=max_tokens)
    return theirs, ours


class Counts:
    """Differing bytes and records of the k cache and differing state words, per test case, over all steps."""

    def __init__(self, name: str, record: int):
        self.name, self.record = name, record
        self.c = dict(steps=0, k_bytes=0, differing_k_bytes=0, differing_records=0, state_words=0,
                      differing_state_words=0)  # fmt: skip
        self.first: list[str] = []

    def add(self, what: str, theirs: tev.ForwardRun, ours: tev.ForwardRun) -> None:
        torch.cuda.synchronize() if CUDA else None
        k = theirs.k_raw.view(torch.uint8) != ours.k_raw.view(torch.uint8)
        usable = k.numel() // self.record * self.record  # records in page order (page padding after them)
        records = int(k[:usable].view(-1, self.record).any(dim=1).sum())
        state = theirs.state_raw.view(torch.int32) != ours.state_raw.view(torch.int32)
        self.c["steps"] += 1
        self.c["k_bytes"] += k.numel()
        self.c["differing_k_bytes"] += int(k.sum())
        self.c["differing_records"] += records
        self.c["state_words"] += state.numel()
        self.c["differing_state_words"] += int(state.sum())
        if (k.any() or state.any()) and len(self.first) < 4:
            self.first.append(f"{what}: {int(k.sum())} k bytes ({records} records), {int(state.sum())} state words")

    def report_and_assert(self) -> None:
        print(f"vLLM GPU {self.name}: {self.c}" + (f"; first: {self.first}" if self.first else ""))
        record_out("engine_vllm_gpu.json", self.name, dict(self.c, first=self.first))
        assert self.c["differing_k_bytes"] == 0 and self.c["differing_state_words"] == 0, self.first


def _eager_step(theirs, ours, counts: Counts, what: str, padding, items, gen, *, debug: bool = False) -> None:
    """One step of ``items`` through vLLM's forward and ours (under ``install(debug=)``), then counted."""
    rows = tev._fwd_rows(theirs.kind, padding, items, gen)
    theirs.step(padding, items, rows)
    with dsv4_vllm.install(debug=debug):
        ours.step(padding, items, rows)
    counts.add(what, theirs, ours)


def _written(theirs: tev.ForwardRun) -> None:
    """Not two untouched caches: vLLM's forward wrote entries (a record's worth of bytes per closed slot)."""
    torch.cuda.synchronize() if CUDA else None
    written = int((theirs.k_raw.view(torch.uint8) != tev.POISON_BYTE).sum())
    assert theirs.closed and written >= 0.9 * len(theirs.closed) * theirs.record


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(tev.FWD_PROGRAMS))
def test_eager_program_on_cuda(kind, vllm_on_device):
    """See the module docstring."""
    theirs, ours = _pair(kind, vllm_on_device)
    counts = Counts(f"eager {kind}", theirs.record)
    gen = torch.Generator().manual_seed(11)
    for k, (padding, items) in enumerate(tev.FWD_PROGRAMS[kind]):
        _eager_step(theirs, ours, counts, f"step {k}", padding, items, gen)
    _written(theirs)
    counts.report_and_assert()


def _warm_then_capture(ours: tev.ForwardRun, metadata: dict, rows: int, mode) -> torch.cuda.CUDAGraph:
    """What vLLM's runner does before it captures: a warm-up run of the captured shape (here with the capture
    path's host decisions, so every kernel the graph records is compiled), its writes undone, then the capture
    (which runs nothing)."""
    saved = ours.state_raw.clone(), ours.k_raw.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), pytest.MonkeyPatch.context() as mp:
        mp.setattr(dsv4_vllm.planner, "_capturing", lambda device: True)
        ours.forward(metadata, rows, mode)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    ours.state_raw.copy_(saved[0])
    ours.k_raw.copy_(saved[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours.forward(metadata, rows, mode)
    return graph


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(tev.GRAPH_PROGRAMS))
def test_piecewise_graph_on_cuda(kind, vllm_on_device):
    """See the module docstring (the CPU twin: test_engine_vllm.py's
    ``test_a_piecewise_graph_captured_on_a_decode_batch_replays_a_prefill_chunk``)."""
    from vllm.config import CUDAGraphMode

    first, chunk, after = tev.GRAPH_PROGRAMS[kind]
    theirs, ours = _pair(kind, vllm_on_device, debug=True)
    counts = Counts(f"piecewise {kind}", theirs.record)
    gen = torch.Generator().manual_seed(3)
    _eager_step(theirs, ours, counts, "first chunk", None, first, gen, debug=True)
    with dsv4_vllm.install(debug=True):
        capture = ours.capture_batch(8)
        step = getattr(capture[ours.module.state_cache.prefix], dsv4_vllm.STEP_ATTR)
        assert step.decode  # the capture batch is a decode batch by its metadata
        graph = _warm_then_capture(ours, capture, 8, CUDAGraphMode.PIECEWISE)
        rows = tev._fwd_rows(kind, "piecewise", chunk, gen)
        theirs.step("piecewise", chunk, rows)
        ours.prepare("piecewise", chunk, rows)
        graph.replay()
        assert step.rows == 8 and not step.decode_path
    counts.add("chunk replayed on the decode capture", theirs, ours)
    # debug: raises what the replay's check found
    _eager_step(theirs, ours, counts, "decode step after the replay", None, after, gen, debug=True)
    assert int(ours.builder._dsv4c_planner.captured_err[0]) == 0
    _written(theirs)
    counts.report_and_assert()


#: kind -> (first chunks, the positions where requests A and B start their verify steps of MTP + 1 rows)
FULL_PROGRAMS = {
    "csa": ([("A", 0, 9), ("B", 0, 6)], 5),
    "indexer": ([("A", 0, 7), ("B", 0, 10)], 5),
    "hca": ([("A", 0, 118), ("B", 0, 120)], 5),  # both cross position 127 during the verify steps
}


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(FULL_PROGRAMS))
def test_full_graph_on_cuda(kind, vllm_on_device):
    """See the module docstring. vLLM's V2 runner captures a FULL graph under runtime mode NONE on metadata built
    for the shape it replays (here the first verify step's), and replays it on every uniform verify batch of
    that padded size; each request verifies ``MTP + 1`` rows and rejects a random number of drafts."""
    from vllm.config import CUDAGraphMode

    first, verify_steps = FULL_PROGRAMS[kind]
    # the first chunks in one step: a batch of up to 256 tokens (HCA's two requests start near position 127)
    theirs, ours = _pair(kind, vllm_on_device, debug=True, max_tokens=max(tev.FWD_T, 256))
    counts = Counts(f"full {kind}", theirs.record)
    gen = torch.Generator().manual_seed(5)
    _eager_step(theirs, ours, counts, "first chunks", None, first, gen, debug=True)
    lengths = {rid: n for rid, _, n in first}
    rejected = torch.Generator().manual_seed(9)
    graph = None
    for k in range(verify_steps):
        items = []
        for rid in sorted(lengths):
            back = int(torch.randint(0, tev.MTP + 1, (1,), generator=rejected)) if k else 0
            start = lengths[rid] - back
            items.append((rid, start, tev.MTP + 1))
            lengths[rid] = start + tev.MTP + 1
        rows = tev._fwd_rows(kind, "full", items, gen)
        theirs.step("full", items, rows)
        with dsv4_vllm.install(debug=True):
            metadata, padded, _ = ours.prepare("full", items, rows)
            if graph is None:
                graph = _warm_then_capture(ours, metadata, padded, CUDAGraphMode.NONE)
                step = getattr(metadata[ours.module.state_cache.prefix], dsv4_vllm.STEP_ATTR)
            graph.replay()
            assert step.decode_path
        counts.add(f"verify step {k}", theirs, ours)
    assert int(ours.builder._dsv4c_planner.captured_err[0]) == 0
    _written(theirs)
    counts.report_and_assert()


def _online_hca_program(device: str) -> dict:
    """test_engine_vllm_online.py's program through vLLM's forward (its ring) and ours online on ``device``;
    returns the counts (asserting what the module docstring says)."""
    import test_engine_vllm_online as tvo

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tev.FWD_KINDS, "hca", (128, 512, 584, 64, 4))  # the ring's blocks for request C
        theirs = tev.ForwardRun("hca", ours=False, device=device)
        with dsv4_vllm.install(hca="online"):
            ours = tvo.OnlineRun(device=device)
    c = dict(steps=0, records=0, record_bytes=0, differing_records=0, differing_bytes=0, entries_checked=0,
             banks_checked=0)  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    for k, (padding, items) in enumerate(tvo.PROGRAM):
        rows = tev._fwd_rows("hca", padding, items, gen)
        theirs.step(padding, items, rows)
        with dsv4_vllm.install(hca="online"):
            ours.step(padding, items, rows)
        torch.cuda.synchronize() if CUDA else None
        assert ours.closed == theirs.closed, f"step {k}: other slots written"
        c["steps"] += 1
        written = int((ours.k_raw.view(torch.uint8) != tev.POISON_BYTE).sum())
        if ours.closed:
            slots = torch.tensor(sorted(ours.closed), dtype=torch.int64)
            layout = tvo.latent_page_layout(tvo.HCA, ours.entries)
            got_o, got_t = (layout.read(run.k_raw.view(torch.uint8).cpu().view(-1, run.k_page), slots)
                            .reshape(len(slots), -1) for run in (ours, theirs))  # fmt: skip
            diff = got_o != got_t
            c["records"], c["record_bytes"] = len(slots), diff.numel()
            c["differing_records"], c["differing_bytes"] = int(diff.any(1).sum()), int(diff.sum())
            assert c["differing_bytes"] <= c["record_bytes"] // 50, f"step {k}: {c}"
        assert written <= c["record_bytes"], f"step {k}: {written - c['record_bytes']} k bytes off the records"
        for rid in ours.rows:
            if ours.rows[rid].shape[0] >= 128:
                c["entries_checked"] += tvo.check_entries(ours, ours.rows[rid], ours.records(rid), f"step {k}: {rid}")
        c["banks_checked"] += tvo._check_banks(ours)
    assert c["records"] == 3 and c["banks_checked"] >= 10 and c["entries_checked"] >= 3
    return c


@needs_cuda
@pytest.mark.gpu
def test_online_hca_on_cuda(vllm_on_device):
    """See the module docstring."""
    c = _online_hca_program(vllm_on_device)
    print(f"vLLM GPU online hca against vLLM's own ring: {c}")
    record_out("engine_vllm_gpu.json", "online hca", c)


@pytest.mark.parametrize("kind", ["indexer"])
def test_cpu_smoke_of_the_harness(kind, vllm_on_device):
    """The GPU tests' harness on CPU (under the interpreter), two steps of the eager program, so the GPU call is not
    its first run; the counting sees a one-byte change."""
    if CUDA:
        pytest.skip("the GPU tests run the harness on CUDA")
    theirs, ours = _pair(kind, vllm_on_device)
    counts = Counts(f"CPU smoke {kind}", theirs.record)
    gen = torch.Generator().manual_seed(11)
    for k, (padding, items) in enumerate(tev.FWD_PROGRAMS[kind][:2]):
        _eager_step(theirs, ours, counts, f"step {k}", padding, items, gen)
    counts.report_and_assert()
    ours.k_raw.view(torch.uint8)[3] ^= 1  # one byte of a record: the counting must see it
    counts.add("flipped", theirs, ours)
    assert counts.c["differing_k_bytes"] == 1 and counts.c["differing_records"] == 1


def test_cpu_smoke_of_the_online_harness(vllm_on_device):
    """The online GPU test's harness on CPU (under the interpreter): the whole program, every check."""
    if CUDA:
        pytest.skip("the GPU test runs the harness on CUDA")
    c = _online_hca_program(vllm_on_device)
    print(f"CPU smoke online hca: {c}")
