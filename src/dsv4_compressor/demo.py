"""The demo: simulated serving of one HCA, one CSA and one indexer layer, checked entry by entry.

What it does, in the order a serving engine would:

1. :class:`Schedule` plays a scheduler. Requests arrive a few steps apart with random prompt lengths (up to
   ``max_prompt``). Each step batches the decode rows of every decoding request with prefill chunks of random
   sizes (first chunks of new requests and continuation chunks of older ones), in shuffled request order.
   Decode uses MTP (``mtp_step = 3``): a step supplies 4 rows per request at ``start`` = its accepted length;
   a random number of the 3 drafts (0..3) is accepted, and the rejected ones are supplied again, with fresh
   rows, in the next step, whose ``start`` is therefore ``L - (3 - accepted)`` (a rewind).
2. Every layer kind has its own :class:`~dsv4_compressor.CompressedKVCache` with DeepSeek-V4-Flash shapes and
   random parameters, and all of them follow the same schedule (:class:`LayerRun`). The rows (``kv_score``)
   are random and fresh for every supplied row; each run keeps the current rows of each request so that
   it can recompute everything from scratch at the end.
3. :func:`check_cache` recomputes every entry of every request in one shot, in float64
   (:func:`~dsv4_compressor.reference.compress_sequence`), and checks the stored bytes against it
   (:mod:`dsv4_compressor.verify`).

``python -m dsv4_compressor demo`` (or ``make demo``) runs it and prints one line per layer kind.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import reference, verify
from .cache import CompressedKVCache
from .config import INDEXER, CompressorConfig, CompressorParams

__all__ = [
    "KINDS",
    "MTP_STEP",
    "Step",
    "Schedule",
    "LayerRun",
    "LayerCheck",
    "DemoResult",
    "check_cache",
    "run_demo",
    "format_result",
]

#: The layer kinds the demo can run, with DeepSeek-V4-Flash shapes.
KINDS: dict[str, Callable[[], CompressorConfig]] = {
    "hca": CompressorConfig.hca,
    "csa": CompressorConfig.csa,
    "indexer": CompressorConfig.indexer,
}
MTP_STEP = 3


# ----------------------------------------------------------------------------------------------
# The schedule: which rows each step supplies (the same for every layer kind)
# ----------------------------------------------------------------------------------------------
@dataclass
class Step:
    """One forward step: per request in ``kv_score`` order, its id, ``start`` and row count, plus what the
    rows are (``"first"`` / ``"chunk"`` prefill chunks, ``"decode"`` MTP rows) for the summary line."""

    request_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_rows: list[int] = field(default_factory=list)
    what: list[str] = field(default_factory=list)

    def add(self, rid: int, start: int, n: int, what: str) -> None:
        self.request_ids.append(rid)
        self.starts.append(start)
        self.num_rows.append(n)
        self.what.append(what)

    def shuffled(self, rng: random.Random) -> Step:
        """The same requests in a random order (any order is allowed within a batch)."""
        entries = list(zip(self.request_ids, self.starts, self.num_rows, self.what))
        rng.shuffle(entries)
        out = Step()
        for entry in entries:
            out.add(*entry)
        return out

    @property
    def rows(self) -> int:
        return sum(self.num_rows)


@dataclass
class _Request:
    prompt: int
    arrival: int  # the step at which it arrives
    prefilled: int = 0  # prompt positions supplied so far
    next_start: int = 0  # start of its next decode step: the accepted length
    decoded: int = 0  # decode steps done


class Schedule:
    """A simulated serving schedule with chunked prefill and MTP decode.

    Args:
        requests: number of requests; request ``i`` uses id ``i``.
        max_prompt: prompt lengths are uniform in ``[max(1, max_prompt // 8), max_prompt]``.
        decode_steps: MTP decode steps per request after its prompt.
        seed: everything random here (prompts, arrivals, chunk sizes, acceptance, batch order) follows it.
        chunk: ``(min, max)`` prefill chunk size; default ``(max_prompt // 8, max_prompt // 2)``, i.e. 256..1024
            for 2K prompts.
        step_tokens: most rows per step (decode rows first, then prefill chunks); default ``2 * chunk max``.
        mtp_step: drafts per decode step.
    """

    def __init__(
        self,
        requests: int,
        max_prompt: int,
        decode_steps: int,
        *,
        seed: int = 0,
        chunk: tuple[int, int] | None = None,
        step_tokens: int | None = None,
        mtp_step: int = MTP_STEP,
    ):
        if requests < 1 or max_prompt < 1 or decode_steps < 0:
            raise ValueError("need requests >= 1, max_prompt >= 1 and decode_steps >= 0")
        self.rng = random.Random(seed)
        self.mtp_step = mtp_step
        self.decode_steps = decode_steps
        self.chunk = chunk if chunk is not None else (max(1, max_prompt // 8), max(1, max_prompt // 2))
        self.step_tokens = step_tokens if step_tokens is not None else 2 * self.chunk[1]
        arrival, self.requests = 0, []
        for _ in range(requests):
            self.requests.append(
                _Request(prompt=self.rng.randint(max(1, max_prompt // 8), max_prompt), arrival=arrival)
            )
            arrival += self.rng.randint(1, 2)
        self.rewinds = 0  # decode steps that start below L (rejected drafts supplied again)
        self.steps: list[Step] = []
        while not all(self._done(req) for req in self.requests):
            step = self._batch(len(self.steps))
            self._advance(step)
            self.steps.append(step.shuffled(self.rng))

    @property
    def prompts(self) -> list[int]:
        return [req.prompt for req in self.requests]

    def _done(self, req: _Request) -> bool:
        return req.prefilled == req.prompt and req.decoded == self.decode_steps

    def _batch(self, t: int) -> Step:
        """Step ``t``: the decode rows of every decoding request, then prefill chunks, oldest request first,
        while the step's token budget lasts (the last chunk is cut to fit)."""
        step = Step()
        for rid, req in enumerate(self.requests):
            if req.prefilled == req.prompt and req.decoded < self.decode_steps:
                step.add(rid, req.next_start, self.mtp_step + 1, "decode")
        for rid, req in enumerate(self.requests):
            left, budget = req.prompt - req.prefilled, self.step_tokens - step.rows
            if req.arrival <= t and left > 0 and budget > 0:
                n = min(left, self.rng.randint(*self.chunk), budget)
                step.add(rid, req.prefilled, n, "first" if req.prefilled == 0 else "chunk")
        return step

    def _advance(self, step: Step) -> None:
        """The step's effects: prompts advance; decode requests accept 0..mtp_step of their drafts, and the
        rejected ones are supplied again next step (its start is ``L - rejected``)."""
        for rid, start, n, what in zip(step.request_ids, step.starts, step.num_rows, step.what):
            req = self.requests[rid]
            if what == "decode":
                rejected = self.mtp_step - self.rng.randint(0, self.mtp_step)
                req.next_start = start + n - rejected
                req.decoded += 1
                self.rewinds += rejected > 0
            else:
                req.prefilled += n
                req.next_start = req.prefilled

    def __iter__(self):
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def tokens(self) -> int:
        """Rows supplied over the whole run, recomputed drafts included."""
        return sum(s.rows for s in self.steps)

    @property
    def max_length(self) -> int:
        """The longest any request gets (``max(start + n)`` over the run)."""
        return max(start + n for s in self.steps for start, n in zip(s.starts, s.num_rows))

    def summary(self) -> str:
        mixed = sum(1 for s in self.steps if "decode" in s.what and ("first" in s.what or "chunk" in s.what))
        multi = sum(1 for s in self.steps if sum(w in ("first", "chunk") for w in s.what) >= 2)
        return (
            f"schedule: {len(self.steps)} steps, {self.tokens} rows; {multi} steps batch several prefill chunks, "
            f"{mixed} mix prefill chunks with MTP decode rows; {self.rewinds} decode steps rewind over rejected drafts"
        )


# ----------------------------------------------------------------------------------------------
# One layer kind driven through the schedule
# ----------------------------------------------------------------------------------------------
class LayerRun:
    """One compressor layer: its cache, and the current rows of every request (for the final check)."""

    def __init__(
        self,
        kind: str,
        *,
        requests: int,
        max_seq_len: int,
        backend: str,
        device,
        seed: int,
    ):
        self.kind = kind
        self.config = KINDS[kind]()
        self.device = torch.device(device)
        self.params = CompressorParams.random(
            self.config, max_positions=max(max_seq_len, 256), seed=seed, device=self.device
        )
        self.cache = CompressedKVCache(
            self.config,
            self.params,
            max_requests=requests,
            max_seq_len=max_seq_len,
            mtp_step=MTP_STEP,
            backend=backend,
            device=self.device,
        )
        self.rows = torch.zeros(requests, max_seq_len, self.config.row_width, device=self.device)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.step_seconds = 0.0

    def step(self, step: Step) -> None:
        """Make fresh random rows for the step, remember them as the requests' current rows, run the cache."""
        kv_score = torch.randn(step.rows, self.config.row_width, generator=self.gen).to(self.device)
        row = 0
        for rid, start, n in zip(step.request_ids, step.starts, step.num_rows):
            # A copy: the backend may use kv_score itself as scratch (the triton backend with fuse_ape=False
            # adds the APE bias to the gate logits in place), so it is not the record of the current rows.
            self.rows[rid, start : start + n] = kv_score[row : row + n]
            row += n
        self._sync()
        t0 = time.perf_counter()
        self.cache.step(step.request_ids, step.starts, step.num_rows, kv_score)
        self._sync()
        self.step_seconds += time.perf_counter() - t0

    def current_rows(self) -> dict[int, torch.Tensor]:
        """Each live request's current rows of positions ``0..L-1`` (what the invariant is stated over)."""
        return {
            rid: self.rows[rid, : self.cache.length(rid)]
            for rid in range(self.rows.shape[0])
            if self.cache.is_live(rid)
        }

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# ----------------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------------
@dataclass
class LayerCheck:
    """Outcome of :func:`check_cache` over all requests of one cache."""

    kind: str
    requests: int = 0
    entries: int = 0
    total_bytes: int = 0
    exact_bytes: int = 0
    unexplained: int = 0
    #: max |stored value - float64 reference| (quantization included).
    max_err: float = 0.0
    #: max |stored value - dequantized encoding of the float64 reference| (0 unless a byte is a neighbour).
    max_deq_diff: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.unexplained == 0 and not self.failures

    @property
    def exact_fraction(self) -> float:
        return self.exact_bytes / max(1, self.total_bytes)

    def _add(self, report: verify.Report, rid: int) -> None:
        self.total_bytes += report.total_bytes
        self.exact_bytes += report.exact_bytes
        self.unexplained += report.unexplained
        if not report.ok:
            self.failures.append(f"request {rid}: {report}")


def check_cache(cache: CompressedKVCache, rows: dict[int, torch.Tensor]) -> LayerCheck:
    """Check every entry of every request against a one-shot float64 recomputation from its current rows.

    Args:
        cache: the cache to check.
        rows: per request id, its current rows ``[L, 2W]`` (positions ``0..L-1``).

    Latent kinds: the 584-byte records (``packed_entries``) against the float64 values. Indexer: the bf16 keys
    against the float64 values, and the FP8 packs (when kept) against the stored keys.
    """
    cfg, params = cache.config, cache.params
    out = LayerCheck(cfg.name)
    for rid, current in rows.items():
        out.requests += 1
        if cache.length(rid) != current.shape[0]:
            out.failures.append(f"request {rid}: cache length {cache.length(rid)} != {current.shape[0]} rows supplied")
            continue
        values64 = reference.compress_sequence(current, params, cfg, dtype=torch.float64)
        entries = cache.entries(rid)
        out.entries += values64.shape[0]
        if entries.shape != values64.shape:
            out.failures.append(f"request {rid}: entries {list(entries.shape)} != expected {list(values64.shape)}")
            continue
        if cfg.output == INDEXER:
            out._add(verify.check_indexer_keys(entries, values64), rid)
            if cfg.indexer_fp8:
                out._add(verify.check_indexer_fp8(cache.packed_entries(rid), entries.to(torch.bfloat16)), rid)
        else:
            out._add(verify.check_latent_records(cache.packed_entries(rid), values64, cfg), rid)
        if values64.shape[0]:
            err = (entries.double() - values64).abs().max().item()
            deq = (entries - reference.dequantized_entries(values64, cfg)).abs().max().item()
            out.max_err = max(out.max_err, err)
            out.max_deq_diff = max(out.max_deq_diff, deq)
    return out


# ----------------------------------------------------------------------------------------------
# The demo
# ----------------------------------------------------------------------------------------------
@dataclass
class LayerResult:
    kind: str
    backend: str
    tokens: int
    state_bytes_per_request: int
    step_seconds: float
    check: LayerCheck


@dataclass
class DemoResult:
    device: str
    backend: str
    schedule: Schedule
    layers: list[LayerResult]

    @property
    def ok(self) -> bool:
        """Every checked entry is explained, and at least one entry was checked (nothing checked is no proof)."""
        return self.entries > 0 and all(layer.check.ok for layer in self.layers)

    @property
    def entries(self) -> int:
        return sum(layer.check.entries for layer in self.layers)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_demo(
    *,
    requests: int = 4,
    max_prompt: int = 2048,
    decode_steps: int = 128,
    seed: int = 0,
    kinds: Sequence[str] = ("hca", "csa", "indexer"),
    backend: str = "reference",
    device=None,
    progress: bool = True,
    before_check: Callable[[dict[str, LayerRun]], None] | None = None,
) -> DemoResult:
    """Run the schedule through one cache per layer kind, then check every entry.

    ``before_check`` (for tests) gets the layer runs by kind after the last step, before the check.
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {list(KINDS)}, got {list(kinds)}")
    device = torch.device(device if device is not None else default_device())
    schedule = Schedule(requests, max_prompt, decode_steps, seed=seed)
    max_seq_len = schedule.max_length
    runs = {
        kind: LayerRun(
            kind,
            requests=requests,
            max_seq_len=max_seq_len,
            backend=backend,
            device=device,
            seed=seed * 1000 + 10 * i,
        )
        for i, kind in enumerate(kinds)
    }

    steps = schedule.steps
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="serving steps", unit="step", mininterval=0.5)
    for step in steps:
        for run in runs.values():
            run.step(step)

    if before_check is not None:
        before_check(runs)
    layers = []
    for kind, run in runs.items():
        check = check_cache(run.cache, run.current_rows())
        layers.append(
            LayerResult(kind, backend, schedule.tokens, run.cache.state_bytes_per_request(), run.step_seconds, check)
        )
        for rid in list(run.current_rows()):
            run.cache.release(rid)
    return DemoResult(str(device), backend, schedule, layers)


def format_result(result: DemoResult) -> str:
    """The demo's report: the schedule, a table with one line per layer kind, and the verdict."""
    sched = result.schedule
    lines = [
        f"dsv4-compressor demo: {len(sched.prompts)} requests (prompts {'/'.join(map(str, sched.prompts))} tokens), "
        f"MTP decode with mtp_step {sched.mtp_step}, backend {result.backend} on {result.device}",
        sched.summary(),
        "",
    ]
    header = (
        "kind",
        "backend",
        "requests",
        "tokens",
        "entries",
        "max err",
        "max deq diff",
        "bytes = ref",
        "state B/req",
        "step time (s)",
    )
    table = [header]
    for layer in result.layers:
        c = layer.check
        table.append(
            (
                layer.kind,
                layer.backend,
                str(c.requests),
                str(layer.tokens),
                str(c.entries),
                f"{c.max_err:.3g}",
                f"{c.max_deq_diff:.3g}",
                f"{100 * c.exact_fraction:.3f}%",
                f"{layer.state_bytes_per_request:,}",
                f"{layer.step_seconds:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for j, row in enumerate(table):
        cells = [cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        "max err: max |stored - float64 reference| (FP8/bf16 quantization included); max deq diff: max |stored - "
        "encoded float64 reference|; bytes = ref: stored bytes equal to the encoding of the float64 reference",
    ]
    if result.ok:
        lines.append(f"all {result.entries} entries verified")
    elif result.entries == 0:
        lines.append("FAILED: no entry was checked (no request reached a full group); nothing is verified")
    else:
        bad = [layer for layer in result.layers if not layer.check.ok]
        lines.append(
            f"FAILED: {sum(layer.check.unexplained for layer in bad)} unexplained bytes in "
            f"{', '.join(layer.kind for layer in bad)} (of {result.entries} entries)"
        )
        for layer in bad:
            lines += [f"  {layer.kind}: {f}" for f in layer.check.failures[:5]]
    return "\n".join(lines)
