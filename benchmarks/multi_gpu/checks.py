"""The checks after a run: every entry of every request against the float64 reference (:func:`verify_entries`),
and for TP replicas the all-gathered checksums of every pool, state and input buffer (:func:`tp_compare`)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from dsv4_compressor import reference, verify
from dsv4_compressor.integrations import lightllm as adapter

from .engine import Engine
from .options import KINDS_OF_RATE
from .runtime import Dist


def verify_entries(eng: Engine) -> dict:
    """Every entry of every request (every group within its current length) against the float64 reference of its
    current rows: the stored bytes, read through LightLLM's tables (``req_to_token``, ``full_to_c4`` /
    ``full_to_c128``) from the layer's pool."""
    alloc = eng.alloc
    kinds = KINDS_OF_RATE[4] + KINDS_OF_RATE[128]
    per_kind = {k: dict(entries_expected=0, entries_verified=0, missing_slots=0, report=None) for k in kinds}
    lengths = {rid: n for rid, n in alloc.length.items() if n > 0}
    for c in eng.model.comps.values():
        r = c.cfg.ratio
        table = alloc.full_to_c128 if c.kind == "c128" else alloc.full_to_c4
        slots, values, agg = [], [], per_kind[c.kind]
        for rid, length in sorted(lengths.items()):
            groups = length // r
            if groups == 0:
                continue
            agg["entries_expected"] += groups
            ends = np.arange(groups) * r + r - 1
            got = table[alloc.req_to_token[rid, ends]]
            ok = got >= 0
            agg["missing_slots"] += int((~ok).sum())
            want = reference.compress_sequence(c.hist[rid, :length], c.params, c.cfg, dtype=torch.float64)
            keep = torch.from_numpy(ok).to(want.device)
            slots.append(got[ok])
            values.append(want[keep])
        if not slots:
            continue
        slot_t = torch.from_numpy(np.concatenate(slots).astype(np.int64)).to(c.pages.device)
        records = c.layout.read(c.pages, slot_t)
        want = torch.cat(values)
        if c.kind == "indexer":
            rep = verify.check_indexer_pack(records, want, adapter.INDEXER_PACK)
        else:
            rep = verify.check_latent_records(records, want, c.cfg)
        if not rep.ok:
            rep.failures = [f"layer {c.layer} {c.kind}: {f}" for f in rep.failures]
        agg["entries_verified"] += int(slot_t.numel()) if rep.ok else 0
        agg["report"] = rep if agg["report"] is None else agg["report"].merge(rep)
    out = {}
    for kind, agg in per_kind.items():
        rep = agg.pop("report") or verify.Report(kind)
        out[kind] = dict(agg, total_bytes=rep.total_bytes, exact_bytes=rep.exact_bytes,
                         unexplained_bytes=rep.unexplained, max_abs_err=rep.max_abs_err,
                         failures=rep.failures[:5])  # fmt: skip
    keys = ("entries_expected", "entries_verified", "missing_slots", "total_bytes", "exact_bytes", "unexplained_bytes")
    total = {k: sum(v[k] for v in out.values()) for k in keys}
    total["requests"] = len(lengths)
    total["all_verified"] = (
        total["unexplained_bytes"] == 0 and total["missing_slots"] == 0
        and total["entries_verified"] == total["entries_expected"]
    )  # fmt: skip
    return {"by_kind": out, "total": total}


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of a tensor's bytes (a word sum and a position-weighted word sum, both mod 2^64)."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    if b.numel() % 4 or b.storage_offset() % 4:
        b = torch.cat([b, b.new_zeros((-b.numel()) % 4)])
    w = b.view(torch.int32).to(torch.int64)
    weights = torch.arange(w.numel(), dtype=torch.int64, device=w.device) * 2654435761 + 1
    return torch.stack([w.sum(), (w * weights).sum()])


def tp_compare(eng: Engine, ctx: Dist) -> dict:
    """All-gather per-layer checksums of every pool, state and input buffer; every rank must hold the same bytes."""
    names, digests, nbytes = [], [], 0
    for c in eng.model.comps.values():
        for part, t in (("pool", c.pages), ("state", c.state), ("kv_score", c.hist)):
            names.append(f"layer {c.layer} {c.kind} {part}")
            digests.append(_digest(t))
            nbytes += t.numel() * t.element_size()
    mine = torch.stack(digests).to(ctx.comm_device)
    every = [torch.empty_like(mine) for _ in range(ctx.world)]
    dist.all_gather(every, mine)
    differ = set()
    for other in every[1:]:
        bad = (other != every[0]).any(dim=1).cpu()
        differ.update(int(i) for i in bad.nonzero().flatten())
    return {"ranks": ctx.world, "buffers": len(names), "bytes_per_rank": nbytes, "equal": not differ,
            "differing": [names[i] for i in sorted(differ)][:20]}  # fmt: skip
