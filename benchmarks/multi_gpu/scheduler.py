"""The scheduler of one rank (:class:`Scheduler`): its requests (:class:`Request`), their arrival, radix prefix
hits, chunked prefill and MTP decode steps with rewinds."""

from __future__ import annotations

import dataclasses

import numpy as np

from .engine import Engine


@dataclasses.dataclass
class Request:
    rid: int
    arrive: int
    prompt: int
    decode_steps: int
    phase: str = "waiting"  # waiting -> prefill -> decode -> done (finished requests stay resident)
    filled: int = 0
    decoded: int = 0
    ready_at: int = 0
    prefix: int = 0


class Scheduler:
    """Requests arrive in two waves, at iterations 0 and 2 (the second wave may take radix hits on the first).
    Prefill is chunked FIFO within ``--chunk`` rows per forward. A request decodes from the iteration after its
    prefill: ``decode_steps`` MTP steps of S rows, each starting after a random number of accepted drafts (a
    rewind unless all were accepted). In DP mode rank ``k``'s requests arrive ``k`` iterations later and stop
    sooner, so ranks are idle at both ends and run HOLD forwards."""

    def __init__(self, args, engine: Engine, rank: int, rng: np.random.Generator):
        self.args, self.eng, self.rng = args, engine, rng
        self.S = args.mtp_step + 1
        self.align = 2 * engine.shapes.swa_page  # 256 at full size: whole SWA pages and whole HCA groups
        assert self.align % engine.shapes.hca.ratio == 0
        first_wave = max(1, -(-args.requests // 2))
        offset = rank if args.mode == "dp" else 0
        shorter = max(1, args.decode_steps // 6) * rank if args.mode == "dp" else 0
        self.requests = []
        for j in range(args.requests):
            prompt = int(rng.integers(1, args.max_prompt + 1))
            steps = int(rng.integers(max(1, args.decode_steps // 2), args.decode_steps + 1))
            arrive = (0 if j < first_wave else 2) + offset
            self.requests.append(Request(j, arrive, prompt, max(1, steps - shorter)))
        self.stats = dict(decode_request_steps=0, rewinds=0, rewound_rows=0, accepted_drafts=0, prefix_hits=0,
                          prefix_tokens=0)  # fmt: skip

    def admit(self, it: int) -> None:
        for r in self.requests:
            if r.phase != "waiting" or r.arrive > it:
                continue
            r.phase = "prefill"
            if self.rng.random() < self.args.prefix_reuse:
                best, src = 0, None
                for q in self.requests:
                    if q.phase in ("prefill", "decode", "done") and q is not r:
                        b = self.eng.alloc.reusable_prefix(q.rid, self.align)
                        if self.align <= b < self.args.max_prompt and b > best:
                            best, src = b, q
                if src is not None:
                    r.prompt = best + int(self.rng.integers(1, min(self.args.max_prompt - best, 64) + 1))
                    r.filled = r.prefix = best
                    self.eng.share_prefix(src.rid, r.rid, best)
                    self.stats["prefix_hits"] += 1
                    self.stats["prefix_tokens"] += best

    def plan(self, it: int):
        budget, prefill, decode = self.args.chunk, [], []
        for r in self.requests:
            if r.phase == "prefill" and budget > 0:
                n = min(r.prompt - r.filled, budget)
                prefill.append((r.rid, r.filled, n))
                budget -= n
        for r in self.requests:
            if r.phase != "decode" or r.ready_at > it:
                continue
            length = self.eng.alloc.length[r.rid]
            start = length
            if r.decoded:  # the previous step's 1 + accepted rows stay; the rejected drafts are rewritten
                accepted = int(self.rng.integers(0, self.S))
                start = length - (self.S - 1 - accepted)
                self.stats["accepted_drafts"] += accepted
                self.stats["rewinds"] += start < length
                self.stats["rewound_rows"] += length - start
            decode.append((r.rid, start, self.S))
        return prefill, decode

    def commit(self, it: int, prefill, decode) -> None:
        by_id = {r.rid: r for r in self.requests}
        for rid, _, n in prefill:
            r = by_id[rid]
            r.filled += n
            if r.filled == r.prompt:
                r.phase, r.ready_at = "decode", it + 1
        for rid, _, _ in decode:
            r = by_id[rid]
            r.decoded += 1
            self.stats["decode_request_steps"] += 1
            if r.decoded == r.decode_steps:
                r.phase = "done"

    def unfinished(self) -> bool:
        return any(r.phase != "done" for r in self.requests)
