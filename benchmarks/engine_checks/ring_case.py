"""One ``--ring-decode`` case on both sides (:class:`RingCase`, of :class:`RingInstance` layer instances): our
caches, SGLang's rings and pages with the same history and input rows, both plans, the float64 reference and the
rings after a step; and the comparison of two sides' 584-byte records (:func:`compare_latent`)."""

from __future__ import annotations

import torch

from .common import POISON
from .sglang_ring import RING_DATA, RING_HEAD, RING_RATIO, RING_ROPE, RING_SCALES


class RingInstance:
    """One layer instance: our cache (ring rows ``[kv | score + ape]``, pages, op), SGLang's ring (``[kv |
    score]``, the same history) and pages, and the step's input rows (shared by both); ``history``: SGLang's ring
    before the step (instance 0 only: the reference reads it)."""

    def __init__(self, layer, sg_ring: torch.Tensor, sg_pages, kv_in: torch.Tensor, history):
        self.layer, self.sg_ring, self.sg_pages, self.kv_in, self.history = layer, sg_ring, sg_pages, kv_in, history


class RingCase:
    """One case: ``requests`` requests of one row each, ``boundary`` ``every`` or ``quarter`` (the bench's
    positions, :func:`benchmarks.cases.decode_starts` of copy 0), ``instances`` layer instances, our
    step metadata and plan (``step_meta``), SGLang's plan inputs, plan and ``out_loc``."""

    def __init__(self, requests: int, boundary: str, *, instances: int, params, seed: int, device):
        import numpy as np

        from benchmarks.cases import Case, decode_starts, pages_needed
        from benchmarks.floors import kind_config
        from benchmarks.layers import LayerOp, make_cache, reserve_pages, step_meta
        from dsv4_compressor.workspace import Workspace, plan_c128_scratch

        self.requests, self.boundary, self.device = requests, boundary, torch.device(device)
        self.cfg = cfg = kind_config("hca")
        self.params = params
        case = Case("decode", "hca", "triton-tiled", requests, 1, boundary, instances=instances)
        self.id = case.id
        starts = np.asarray(decode_starts(case, 0), dtype=np.int64)
        ends = starts + 1
        slots = np.arange(requests)
        self.workspace = Workspace(
            plan_c128_scratch(batch_max_tokens=requests, max_req_num=requests, mtp_step=0, head_dim=cfg.head_dim),
            device=self.device,
        )
        max_seq_len = -(-(int(ends.max()) + 1) // cfg.ratio) * cfg.ratio
        pages = pages_needed(cfg, ends, cfg.default_page_size)
        g = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + requests * 10 + len(boundary))
        ape = params.ape
        self.instances: list[RingInstance] = []
        for i in range(instances):
            cache = make_cache(cfg, params, "triton-tiled", max_requests=requests, max_seq_len=max_seq_len,
                               mtp_step=0, device=self.device, workspace=self.workspace, max_pages=pages)  # fmt: skip
            ring = cache.backend.ring
            if tuple(ring.shape) != (requests, RING_RATIO, 2 * RING_HEAD):
                raise RuntimeError(f"our ring is {list(ring.shape)}, not [{requests}, 128, 1024]")
            sg_ring = torch.randn(ring.shape, generator=g, device=self.device)
            ring.copy_(sg_ring)
            ring[..., RING_HEAD:] += ape[None]  # ring row j holds a position with p % 128 == j
            layer = LayerOp(cache, scratch=self.workspace.c128_scratch(0, requests))
            kv_in = torch.randn(requests, 2 * RING_HEAD, generator=g, device=self.device)
            self.instances.append(RingInstance(layer, sg_ring, None, kv_in, sg_ring.clone() if i == 0 else None))
        reserve_pages([inst.layer.cache.pool for inst in self.instances], slots, ends)
        for inst in self.instances:
            inst.sg_pages = torch.empty_like(inst.layer.cache.pool.out_pages)
        self.page_layout = self.instances[0].layer.cache.pool.layout
        self.meta = step_meta(slots, starts, [1] * requests, ratio=cfg.ratio, num_slots=requests, mtp_step=0,
                              device=self.device, pool=self.instances[0].layer.cache.pool)  # fmt: skip
        self.positions = torch.from_numpy(starts.copy()).to(self.device)
        out_slot = torch.from_numpy(self.meta.host[2].copy()).to(self.device)
        self.closing = torch.nonzero(out_slot >= 0).reshape(-1)
        self.slots = out_slot[self.closing]
        # SGLang's step metadata: c128_out_loc (the entry's slot on closing rows, else 0), its plan's inputs
        self.out_loc = torch.where(out_slot >= 0, out_slot, torch.zeros_like(out_slot)).contiguous()
        self.req_pool_indices = torch.from_numpy(slots.copy()).to(self.device)
        self.seq_lens = (self.positions + 1).contiguous()
        self.req_to_token = torch.zeros(1, 1, dtype=torch.int32, device=self.device)  # not read at ratio 128
        self.full_to_state = torch.zeros(1, dtype=torch.int64, device=self.device)  # not read at ratio 128
        self.plan_d = torch.zeros(requests, 16, dtype=torch.uint8, device=self.device)
        table = torch.stack([params.cos, params.sin], dim=-1)  # [P, 32, 2] = view_as_real(freqs_cis)
        self.freqs = table.reshape(table.shape[0], RING_ROPE).contiguous()
        self.weight = params.norm_weight.float().contiguous()  # compress_norm_rope_store casts it to kv's dtype
        self.ape = ape.float().contiguous()
        self.sg_out = torch.empty(requests, RING_HEAD, device=self.device)  # compress_forward's out (reused)

    # -- the two sides -----------------------------------------------------------------------------------------
    def poison(self) -> None:
        for inst in self.instances:
            inst.layer.cache.pool.out_pages.fill_(POISON)
            inst.sg_pages.fill_(POISON)
        self.sg_out.fill_(float("nan"))

    def sglang_plan(self, sg) -> None:
        sg.plan(self.plan_d, self.req_pool_indices, self.seq_lens, self.req_to_token, self.full_to_state)

    def sglang_layers(self, sg) -> None:
        for inst in self.instances:
            sg.decode(inst.sg_ring, inst.kv_in, self.sg_out, self.ape, self.plan_d)
            sg.store(self.sg_out, self.plan_d, self.weight, self.freqs, self.out_loc, inst.sg_pages, self.params.eps)

    def our_plan(self) -> None:
        self.meta.build_plan()

    def our_layers(self) -> None:
        for inst in self.instances:
            inst.layer(inst.kv_in, self.meta)

    # -- checks ------------------------------------------------------------------------------------------------
    def reference_values(self) -> torch.Tensor:
        """Float64 entry values of instance 0's closing rows (docs/SPEC.md section 3: softmax over score + ape,
        RMSNorm, rope at the group start), from SGLang's ring before the step and the step's rows."""
        from dsv4_compressor.reference import finish_entries, params_as

        inst = self.instances[0]
        win = inst.history[self.closing].double().clone()  # [N, 128, 2H]; row 127 is the step's row
        win[:, RING_RATIO - 1] = inst.kv_in[self.closing].double()
        kv, score = win[..., :RING_HEAD], win[..., RING_HEAD:] + self.ape.double()[None]
        pooled = (torch.softmax(score, dim=1) * kv).sum(1)
        starts = self.positions[self.closing] - (RING_RATIO - 1)
        return finish_entries(pooled, starts, params_as(self.params, torch.float64), self.cfg)

    def ring_mismatch(self) -> dict:
        """After a step: our ring rows against SGLang's (kv equal; our score = SGLang's score + ape, float32)."""
        rows = bad_kv = bad_score = 0
        ape = self.ape[None]
        for inst in self.instances:
            ours, theirs = inst.layer.cache.backend.ring, inst.sg_ring
            rows += ours.shape[0] * ours.shape[1]
            bad_kv += int((ours[..., :RING_HEAD] != theirs[..., :RING_HEAD]).any(-1).sum())
            bad_score += int((ours[..., RING_HEAD:] != theirs[..., RING_HEAD:] + ape).any(-1).sum())
        return dict(rows=rows, kv_rows_differ=bad_kv, score_rows_differ=bad_score)


def _ordered(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Sign-magnitude codes (e4m3 bytes, bf16 halves) as integers ordered like their values."""
    c = codes.long() & ((1 << bits) - 1)
    mag = c & ((1 << (bits - 1)) - 1)
    return torch.where(c >> (bits - 1) == 1, -mag, mag)


def compare_latent(ours: torch.Tensor, theirs: torch.Tensor, slots: torch.Tensor, layout, ref=None) -> dict:
    """Our 584-byte records of ``slots`` against SGLang's (and both against float64 ``ref`` values, when given):
    records and bytes that differ (data 576, the 7 scales; the pad byte apart: SGLang does not write it), the
    largest FP8 / bf16 code steps where the scales agree, the largest decoded difference (absolute, and relative
    to the record's largest magnitude), and every byte outside the records (poison expected on both)."""
    from benchmarks.floors import kind_config
    from dsv4_compressor.layout import decode_latent

    cfg = kind_config("hca")
    n = int(slots.numel())
    o, t = layout.read(ours, slots), layout.read(theirs, slots)
    real = RING_DATA + RING_SCALES
    differ = o[:, :real] != t[:, :real]
    rec_diff = differ.any(1)
    scale_eq = (o[:, RING_DATA:real] == t[:, RING_DATA:real]).all(1)
    nope_steps = (_ordered(o[:, :448], 8) - _ordered(t[:, :448], 8)).abs()
    rope_o = o[:, 448:RING_DATA].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    rope_t = t[:, 448:RING_DATA].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    rope_steps = (_ordered(rope_o, 16) - _ordered(rope_t, 16)).abs()
    fixed = o.clone()
    fixed[:, real:] = 0
    tfixed = t.clone()
    tfixed[:, real:] = 0
    do, dt = decode_latent(fixed, cfg).double(), decode_latent(tfixed, cfg).double()
    amax = torch.maximum(do.abs().amax(1), dt.abs().amax(1)).clamp(min=1e-30)
    diff = (do - dt).abs()
    idx = layout._byte_index(slots).reshape(-1)
    touched = torch.zeros(ours.numel(), dtype=torch.bool, device=ours.device)
    touched[idx] = True
    of, tf = ours.reshape(-1), theirs.reshape(-1)
    out = dict(
        records=n, differing_records=int(rec_diff.sum()), differing_data_bytes=int(differ[:, :RING_DATA].sum()),
        differing_scale_bytes=int(differ[:, RING_DATA:].sum()), records_with_scale_diff=int((~scale_eq).sum()),
        max_nope_step=int(nope_steps[scale_eq].max()) if bool(scale_eq.any()) else 0,
        max_rope_step=int(rope_steps.max()) if n else 0,
        max_abs_diff=float(diff.max()) if n else 0.0,
        max_rel_diff=float((diff.amax(1) / amax).max()) if n else 0.0,
        pad_byte_ours=sorted({int(x) for x in o[:, real].tolist()}),
        pad_byte_sglang=sorted({int(x) for x in t[:, real].tolist()}),
        other_bytes_differ=int(((of != tf) & ~touched).sum()),
        untouched_poisoned=bool((of[~touched] == POISON).all()) and bool((tf[~touched] == POISON).all()),
        records_poisoned_ours=int((o[:, :real] == POISON).all(1).sum()),
        records_poisoned_sglang=int((t[:, :real] == POISON).all(1).sum()),
    )  # fmt: skip
    if ref is not None and n:
        # against the float64 values (the FP8 / bf16 rounding included), and against their own encoding (the
        # records layout.encode_latent, docs/SPEC.md section 4, makes of them: what an exact implementation stores)
        from dsv4_compressor.layout import encode_latent

        r = ref.double()
        ramax = r.abs().amax(1).clamp(min=1e-30)
        enc = encode_latent(ref.float(), cfg)
        denc = decode_latent(enc, cfg).double()
        for side, d, rec in (("ours", do, o), ("sglang", dt, t)):
            err = (d - r).abs()
            out[f"{side}_vs_ref_max_abs"] = float(err.max())
            out[f"{side}_vs_ref_max_rel"] = float((err.amax(1) / ramax).max())
            out[f"{side}_vs_ref_records_differ"] = int((rec[:, :real] != enc[:, :real]).any(1).sum())
            out[f"{side}_vs_ref_bytes_differ"] = int((rec[:, :real] != enc[:, :real]).sum())
            out[f"{side}_vs_ref_encoded_max_abs"] = float((d - denc).abs().max())
    examples = []
    for i in torch.nonzero(rec_diff).reshape(-1)[:4].tolist():
        examples.append(dict(
            slot=int(slots[i]), data_bytes_differ=int(differ[i, :RING_DATA].sum()),
            scales_ours=o[i, RING_DATA:real].tolist(), scales_sglang=t[i, RING_DATA:real].tolist(),
            max_abs_diff=float(diff[i].max()),
        ))  # fmt: skip
    out["examples"] = examples
    return out
