"""One compressor layer's step through SGLang 0.5.23's own store and through the adapter, on SGLang's real pools
and identical inputs, compared record by record.

Shared by ``tests/test_engine_sglang_uniform_fp8.py`` (CPU, Triton interpreter) and
``tests/test_engine_sglang_v41_gpu.py`` (CUDA), so that the GPU test runs the SGLang-calling code the CPU tests run:

* SGLang's side is always ``CompressorBackendMixin.forward_unified`` (what SGLang's model calls as
  ``forward_core_compressor``) on a :class:`StoreBackend` over a real ``DeepSeekV4TokenToKVPool``: a V4.1 pool
  (``kv_layout`` ``V41`` / ``V41_NEW``) goes through ``_forward_compress_all_in_one`` (``compress_forward``, then
  ``compress_norm_rope_store(layout=...)``), the trtllm backend's pool (``uniform_fp8``, built while the published
  settings say ``--dsv4-attn-backend trtllm``) through ``compressor_trtllm.forward_compress_uniform_fp8``
  (``compress_forward``, its masking of rows that close no group, ``fused_norm_rope_inplace_triton``, the pool's
  ``set_key_buffer_fused``: torch's cast to e4m3);
* ours is the adapter's ``SGLangCompressor.forward_unified`` (its metadata from its ``create_paged_compressor_data``
  on the same per-request tensors) on a twin pool, or, for the finish alone, the kernels' ``finish_values``.

On CUDA SGLang's plan comes from its own ``create_paged_compressor_data`` (the ``c_plan`` JIT planner). On CPU
SGLang's CUDA-only pieces are stood in: the planner by :func:`cpu_plan` (the plan fields SGLang's Python reads:
``seq_len``, ``ragged_id``, invalid rows) and ``compress_forward`` by :func:`pooled_stand_in` (given pooled
vectors); SGLang's uniform FP8 store (Triton under the interpreter, then torch) runs as it is. Its Triton kernel
there stores float32 into float32: no interpreter cast is involved (SPEC section 9).

The world: layer 0 C128 (page 2), layer 1 C4 (page 64), 256-token pages, request slots ``1..slots`` of 512
positions each (request 0 is SGLang's padding request), an SWA page permutation, random state rows (SGLang's: raw
score, no APE) copied into both pools, every page poisoned before a step.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from dataclasses import dataclass, field

import test_engine_sglang as tes  # the torchvision stand-in and SGLang's modules, imported once
import torch

from dsv4_compressor import layout, reference
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.integrations import sglang as sg
from dsv4_compressor.kernels import exact_fp8_default
from dsv4_compressor.kernels.entry_pack import entry_args, finish_values
from dsv4_compressor.verify import check_latent_records
from helpers.buffers import POISON_BYTE
from helpers.inputs import make_params

cv2 = importlib.import_module("sglang.srt.layers.attention.dsv4.compressor_v2")
trt = importlib.import_module("sglang.srt.layers.attention.dsv4.compressor_trtllm")
compress_mod = importlib.import_module("sglang.kernels.ops.attention.dsv4.compress")
pool_mod, runtime_mod = tes.pool_mod, tes.runtime_mod
ForwardMode = tes.ForwardMode
ns = types.SimpleNamespace

HCA, CSA = CompressorConfig.hca(), CompressorConfig.csa()
PAGE, CONTEXT = 256, 512
#: ratio -> (config, layer id)
LAYERS = {128: (HCA, 0), 4: (CSA, 1)}
#: SGLang's ``KVLayout`` member -> the ops' ``layout=``
LAYOUT_OF = {"V41": "v41", "V41_NEW": "v41_new", "UNIFORM_FP8": "uniform_fp8"}
#: invalid rows appended to a CPU prefill plan (a CUDA-graph-padded plan has them; SGLang's uniform store zeroes
#: them into slot 0)
INVALID_PLAN_ROWS = 2


@contextlib.contextmanager
def published(device, **fields):
    """SGLang's ``override_server_args`` (its own way to publish a config in tests), restored after; yields the
    published record."""
    over = runtime_mod.get_context().override_server_args(device=str(device), **fields)
    try:
        yield over.install()
    finally:
        over.restore()


@dataclass
class Step:
    """One step's per-request tensors (SGLang's) and per-token rows: ``items`` ``(slot, start, n)``."""

    prefill: bool
    items: list
    bs: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor  # [T] int64, CPU
    row_req: torch.Tensor  # [T] int64, CPU (0: padding)
    extend_lens: torch.Tensor | None = None
    kv: dict = field(default_factory=dict)  # ratio -> [T, 2W] float32 on the device
    out_loc: dict = field(default_factory=dict)  # ratio -> [T] int64 on the device (SGLang's c{r}_out_loc)

    @property
    def tokens(self) -> int:
        return int(self.positions.shape[0])

    def closing(self, ratio: int) -> torch.Tensor:
        """Rows of real requests that close a group of ``ratio`` (CPU int64)."""
        return (((self.positions + 1) % ratio == 0) & (self.row_req > 0)).nonzero().flatten()


class StoreWorld:
    """Two real pools (``theirs``, ``ours``) built alike, their state rows equal; see the module docstring."""

    def __init__(self, *, slots: int, device, kv_layout: str = "V4", seed: int = 0):
        self.device, self.slots = torch.device(device), slots
        self.pages = (slots + 1) * CONTEXT // PAGE
        size = self.pages * PAGE
        self.theirs, self.ours = (
            pool_mod.DeepSeekV4TokenToKVPool(
                max_num_reqs=slots,
                swa_size=size,
                c4_size=size // 4,
                c128_size=size // 128,
                c4_state_pool_size=self.pages * 16,
                c128_state_pool_size=0,
                page_size=PAGE,
                swa_page_size=PAGE,
                dtype=torch.float8_e4m3fn,
                c4_state_dtype=torch.float32,
                c128_state_dtype=torch.float32,
                qk_nope_head_dim=448,
                qk_rope_head_dim=64,
                indexer_head_dim=128,
                layer_num=2,
                device=self.device,
                enable_memory_saver=False,
                compression_ratios=[128, 4],
                kv_layout=getattr(pool_mod.KVLayout, kv_layout),
            )  # fmt: skip
            for _ in range(2)
        )
        self.gen = torch.Generator().manual_seed(seed)
        moved = 1 + torch.randperm(self.pages - 1, generator=self.gen)  # page 0 (request 0's) stays
        swa_page = torch.cat([torch.zeros(1, dtype=torch.int64), moved])
        full = torch.arange(size)
        self.full_to_swa = (swa_page[full // PAGE] * PAGE + full % PAGE).to(self.device)
        for pool in (self.theirs, self.ours):
            pool.register_mapping(self.full_to_swa)
        r2t = torch.arange(slots + 1)[:, None] * CONTEXT + torch.arange(CONTEXT)[None, :]
        self.req_to_token = r2t.to(torch.int32).to(self.device)
        self.ring = {r: int(self.ours.get_ring_size(r)) for r in LAYERS}
        self.params, self.ape = {}, {}
        for ratio, (cfg, _) in LAYERS.items():
            p = make_params(cfg, seed=seed + ratio, max_positions=CONTEXT)
            self.params[ratio] = p
            ape = p.ape.float()  # checkpoint layout [r, coff * H]; SGLang's load-time hotfix for C4: [coff * r, H]
            if cfg.overlap:
                ape = torch.cat(torch.chunk(ape, 2, dim=-1), dim=0).view(cfg.ratio, -1)
            self.ape[ratio] = ape.contiguous().to(self.device)
            state = self.state(self.theirs, ratio)
            w = cfg.width
            rows = torch.cat([torch.randn(state.shape[0], w, generator=self.gen),
                              1.5 * torch.randn(state.shape[0], w, generator=self.gen)], dim=1)  # fmt: skip
            state.copy_(rows)
            self.state(self.ours, ratio).copy_(rows)
        self.adapter = sg.SGLangCompressor(hca_kernel="tiled", projection="engine")
        self.calls = {"compress_forward": 0}

    # -- buffers ------------------------------------------------------------------------------------------------
    @staticmethod
    def state(pool, ratio: int) -> torch.Tensor:
        return pool.get_attention_compress_states(LAYERS[ratio][1]).kv_score_buffer.kv_score

    @staticmethod
    def pages_of(pool, ratio: int) -> torch.Tensor:
        return pool.get_extra_key_buffer(LAYERS[ratio][1]).view(torch.uint8)

    def poison(self) -> None:
        for pool in (self.theirs, self.ours):
            for ratio in LAYERS:
                self.pages_of(pool, ratio).fill_(POISON_BYTE)

    def compressor(self, ratio: int, kv: torch.Tensor):
        """SGLang's ``Compressor`` as ``forward_unified`` reads it (its ``compute_kv_score`` gives ``kv``)."""
        cfg, layer = LAYERS[ratio]
        p = self.params[ratio]
        return ns(
            ratio=ratio, head_dim=cfg.head_dim, is_in_indexer=False, rotate=False, ape=self.ape[ratio],
            freqs_cis=torch.complex(p.cos, p.sin).to(self.device),
            norm=ns(weight=p.norm_weight.float().to(self.device), variance_epsilon=p.eps),
            compute_kv_score=lambda x, fb: kv,
            get_state_pool=lambda backend: backend.token_to_kv_pool.get_attention_compress_states(layer),
        )  # fmt: skip

    # -- steps --------------------------------------------------------------------------------------------------
    def _rows(self, step: Step) -> Step:
        r2t = self.req_to_token.cpu().long()
        raw = torch.where(step.row_req > 0, r2t[step.row_req, step.positions], 0)
        for ratio, (cfg, _) in LAYERS.items():
            closes = ((step.positions + 1) % ratio == 0) & (step.row_req > 0)
            step.out_loc[ratio] = torch.where(closes, raw // ratio, 0).to(self.device)
            kv = torch.randn(step.tokens, cfg.width, generator=self.gen)
            step.kv[ratio] = torch.cat([kv, 1.5 * torch.randn(step.tokens, cfg.width, generator=self.gen)], 1).to(
                self.device
            )
        return step

    def decode(self, lengths: list[tuple[int, int]], bs: int) -> Step:
        """A decode batch of ``bs`` rows: ``(slot, L)`` brings position ``L - 1`` (SGLang's ``seq_lens``: ``L``);
        padding rows are request 0 with ``seq_lens`` 1."""
        slots = [s for s, _ in lengths] + [0] * (bs - len(lengths))
        seq = [n for _, n in lengths] + [1] * (bs - len(lengths))
        step = Step(
            prefill=False, items=[(s, n - 1, 1) for s, n in lengths], bs=bs,
            req_pool_indices=torch.tensor(slots, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=self.device),
            positions=torch.tensor([n - 1 for n in seq], dtype=torch.int64),
            row_req=torch.tensor([s for s in slots], dtype=torch.int64),
        )  # fmt: skip
        step.positions[len(lengths) :] = 0
        return self._rows(step)

    def prefill(self, items: list[tuple[int, int, int]]) -> Step:
        """A prefill (extend) step: request ``slot`` supplies positions ``start .. start + n - 1``."""
        positions = torch.cat([torch.arange(s, s + n) for _, s, n in items])
        row_req = torch.cat([torch.full((n,), slot) for slot, _, n in items]).to(torch.int64)
        step = Step(
            prefill=True, items=list(items), bs=len(items),
            req_pool_indices=torch.tensor([s for s, _, _ in items], dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor([s + n for _, s, n in items], dtype=torch.int64, device=self.device),
            positions=positions.to(torch.int64), row_req=row_req,
            extend_lens=torch.tensor([n for _, _, n in items], dtype=torch.int32, device=self.device),
        )  # fmt: skip
        return self._rows(step)

    # -- SGLang's side ------------------------------------------------------------------------------------------
    def sglang_plan(self, step: Step, ratio: int):
        """SGLang's plan of the step: its own planner on CUDA, :func:`cpu_plan` on CPU."""
        if self.device.type != "cuda":
            return cpu_plan(step, ratio)
        kwargs = {}
        if step.prefill:
            kwargs = dict(extend_lens=step.extend_lens, seq_lens_cpu=[s + n for _, s, n in step.items],
                          extend_lens_cpu=[n for _, _, n in step.items])  # fmt: skip
        return cv2.create_paged_compressor_data(
            ratio, is_prefill=step.prefill, token_to_kv_pool=self.theirs, req_to_token=self.req_to_token,
            req_pool_indices=step.req_pool_indices, seq_lens=step.seq_lens, **kwargs,
        )  # fmt: skip

    def theirs_step(self, step: Step, ratio: int, pooled: torch.Tensor | None = None) -> None:
        """SGLang's ``forward_unified`` of layer ``ratio`` on ``theirs``; ``pooled`` (``[T, H]`` float32 by
        ``kv_score`` row): ``compress_forward`` stood in by :func:`pooled_stand_in` (CPU; on CUDA for the finish
        alone)."""
        plan = self.sglang_plan(step, ratio)
        backend = StoreBackend(self.theirs, ratio, plan, step.out_loc[ratio])
        fb = ns(forward_mode=ForwardMode.EXTEND if step.prefill else ForwardMode.DECODE)
        x = torch.zeros(step.tokens, 1, device=self.device)
        with pooled_stand_in(pooled, self.calls):
            backend.forward_unified(x, fb, LAYERS[ratio][1], self.compressor(ratio, step.kv[ratio]))

    # -- ours ---------------------------------------------------------------------------------------------------
    def ours_step(self, step: Step, ratio: int) -> None:
        """The adapter's ``forward_unified`` of layer ``ratio`` on ``ours`` (SGLang's per-request tensors)."""
        kwargs = dict(extend_lens=step.extend_lens, num_q_tokens=step.tokens) if step.prefill else {}
        meta = self.adapter.create_paged_compressor_data(
            ratio, is_prefill=step.prefill, token_to_kv_pool=self.ours, req_to_token=self.req_to_token,
            req_pool_indices=step.req_pool_indices, seq_lens=step.seq_lens, out_loc=step.out_loc[ratio], **kwargs,
        )  # fmt: skip
        backend = ns(token_to_kv_pool=self.ours, enable_deepseek_v4_fp4_indexer=False,
                     forward_metadata=ns(**{f"c{ratio}_compress_metadata": meta}))  # fmt: skip
        fb = ns(forward_mode=ForwardMode.EXTEND if step.prefill else ForwardMode.DECODE)
        x = torch.zeros(step.tokens, 1, device=self.device)
        self.adapter.forward_unified(backend, x, fb, LAYERS[ratio][1], self.compressor(ratio, step.kv[ratio]))

    def scratch_rows(self, step: Step) -> torch.Tensor:
        """The HCA scratch after our C128 step: the pooled float32 vector of each closing ``kv_score`` row."""
        (scratch,) = self.adapter._scratch.values()
        return scratch[: step.tokens].clone()

    def ours_finish(self, step: Step, ratio: int, pooled: torch.Tensor, name: str) -> None:
        """The kernels' finish (norm, rope, record; ``finish_values``) of the step's closing rows from ``pooled``
        into ``ours`` at SGLang's slots."""
        cfg, _ = LAYERS[ratio]
        rows = step.closing(ratio)
        p = self.params[ratio]
        prm, out, meta = entry_args(
            head=cfg.head_dim, rope=cfg.rope_dim, latent=True, page_size=self.page_size(ratio), scale_bytes=8,
            norm_weight=p.norm_weight.float().to(self.device), cos=p.cos.to(self.device), sin=p.sin.to(self.device),
            eps=p.eps, out_pages=self.pages_of(self.ours, ratio), out_keys=None,
            exact_fp8=exact_fp8_default(self.device), layout=name,
        )  # fmt: skip
        starts = (step.positions[rows] + 1 - ratio).to(torch.int32).to(self.device)
        slots = step.out_loc[ratio][rows.to(self.device)].to(torch.int32)
        finish_values(pooled[rows.to(self.device)], starts, slots, prm, out, meta)

    def page_size(self, ratio: int) -> int:
        return int(self.ours.get_extra_key_page_size(LAYERS[ratio][1]))

    # -- the float64 reference ----------------------------------------------------------------------------------
    def entries(self, step: Step, ratio: int, state: torch.Tensor, dtype=torch.float64):
        """``(pooled, values)`` of the step's closing rows (:meth:`Step.closing` order): the window of each from
        the step's rows and ``state`` (the rows before the step, SGLang's ring addressing), pooled and finished by
        :mod:`dsv4_compressor.reference` in ``dtype``."""
        cfg, _ = LAYERS[ratio]
        p = reference.params_as(self.params[ratio], dtype)
        kv = step.kv[ratio].cpu().to(dtype)
        state = state.cpu().to(dtype)
        ring, r2t, f2s = self.ring[ratio], self.req_to_token.cpu().long(), self.full_to_swa.cpu()
        first = dict(self._starts(step))

        def row(req: int, pos: int) -> torch.Tensor:
            start, t0 = first[req]
            if pos >= start:
                return kv[t0 + pos - start]
            if cfg.overlap:
                m = int(f2s[r2t[req, pos]])
                return state[(m // PAGE) * ring + m % ring]
            return state[req * ring + pos % ring]

        closing = step.closing(ratio)
        cur, prev = [], []
        for t in closing.tolist():
            req, e = int(step.row_req[t]), int(step.positions[t])
            s = e + 1 - ratio
            cur.append(torch.stack([row(req, q) for q in range(s, e + 1)]))
            if cfg.overlap:
                if s == 0:
                    absent = torch.zeros(ratio, 2 * cfg.width, dtype=dtype)
                    absent[:, cfg.width :] = float("-inf")
                    prev.append(absent)
                else:
                    prev.append(torch.stack([row(req, q) for q in range(s - ratio, s)]))
        if not cur:
            return torch.zeros(0, cfg.head_dim, dtype=dtype), torch.zeros(0, cfg.head_dim, dtype=dtype)
        ends = step.positions[closing]
        starts = ends + 1 - ratio
        window = torch.arange(ratio)
        cur_rows = reference.gated_rows(torch.stack(cur).view(-1, 2 * cfg.width),
                                        (starts[:, None] + window).flatten(), p.ape, cfg.width)  # fmt: skip
        prev_rows = None
        if cfg.overlap:
            pr = torch.stack(prev)
            gated = reference.gated_rows(pr.view(-1, 2 * cfg.width), (starts[:, None] - ratio + window).flatten()
                                         .clamp(min=0), p.ape, cfg.width)  # fmt: skip
            prev_rows = gated.view(-1, ratio, 2 * cfg.width)
        k, sc = reference.window_halves(prev_rows, cur_rows.view(-1, ratio, 2 * cfg.width), cfg)
        pooled = reference.pool_windows(k, sc)
        return pooled, reference.finish_entries(pooled, starts, p, cfg)

    @staticmethod
    def _starts(step: Step):
        t = 0
        for slot, start, n in step.items:
            yield slot, (start, t)
            t += n

    # -- comparison ---------------------------------------------------------------------------------------------
    def compare(self, step: Step, ratio: int, name: str, values64: torch.Tensor | None = None) -> dict:
        """Counts of one layer's step: records written (closing rows of real requests), those that differ between
        the pools, bytes either side wrote outside them (slot 0 apart), and, with ``values64`` (float64 entry
        values of the closing rows), whether each side's records pass the float64 check."""
        cfg, _ = LAYERS[ratio]
        pl = layout.latent_page_layout(cfg, self.page_size(ratio), name)
        ours, theirs = self.pages_of(self.ours, ratio).cpu(), self.pages_of(self.theirs, ratio).cpu()
        slots = step.out_loc[ratio].cpu()[step.closing(ratio)]
        touched = torch.zeros_like(ours)
        pl.write(touched, slots, torch.ones(slots.shape[0], pl.record_bytes, dtype=torch.uint8))
        slot0 = torch.zeros_like(ours)
        pl.write(slot0, torch.zeros(1, dtype=torch.int64), torch.ones(1, pl.record_bytes, dtype=torch.uint8))
        other, at0 = (touched == 0) & (slot0 == 0), slot0 == 1
        a, b = pl.read(ours, slots), pl.read(theirs, slots)
        counts = dict(
            records=int(slots.shape[0]), differing_records=int((a != b).any(dim=1).sum()),
            differing_bytes=int((a != b).sum()), record_bytes=int(a.numel()),
            stray_ours=int((ours[other] != POISON_BYTE).sum()), stray_theirs=int((theirs[other] != POISON_BYTE).sum()),
            slot0_ours=int((ours[at0] != POISON_BYTE).sum()), slot0_theirs=int((theirs[at0] != POISON_BYTE).sum()),
            slot0_theirs_values=sorted(set(theirs[at0][theirs[at0] != POISON_BYTE].tolist())),
        )  # fmt: skip
        if values64 is not None:
            mine = check_latent_records(a, values64, cfg, layout=name)
            engine = check_latent_records(b, values64, cfg, layout=name)
            counts.update(ours_float64=mine.ok, ours_report=str(mine), theirs_float64=engine.ok,
                          theirs_report=str(engine))  # fmt: skip
        return counts


class StoreBackend(cv2.CompressorBackendMixin):
    """What ``CompressorBackendMixin.forward_unified`` reads of SGLang's ``DeepseekV4AttnBackend``: the pool, the
    step's plan and ``core_metadata.c{r}_out_loc`` (``forward_metadata``), the FP4 indexer switch (off)."""

    def __init__(self, pool, ratio: int, plan, out_loc: torch.Tensor):  # noqa: D107 (no super(): no backend state)
        self.token_to_kv_pool = pool
        self.enable_deepseek_v4_fp4_indexer = False
        self.forward_metadata = ns(**{f"c{ratio}_compress_metadata": plan},
                                   core_metadata=ns(**{f"c{ratio}_out_loc": out_loc}))  # fmt: skip


def cpu_plan(step: Step, ratio: int):
    """SGLang's plan of ``step`` as its Python reads it (``compress.cuh``'s ``DecodePlan`` / ``CompressPlan``):
    decode, one 16-byte record per request whose first ``uint32`` is ``seq_len``; prefill, a ``CompressPlan`` per
    closing row (``seq_len = position + 1``, ``ragged_id`` its ``kv_score`` row) then :data:`INVALID_PLAN_ROWS`
    invalid ones (``seq_len = -1``). The ring fields (read by ``compress_forward`` only) stay zero."""
    device = step.seq_lens.device
    if not step.prefill:
        words = torch.zeros(step.bs, 4, dtype=torch.int32)
        words[:, 0] = step.seq_lens.cpu().to(torch.int32)
        return compress_mod.CompressorDecodePlan(ratio, words.view(torch.uint8).to(device))
    rows = step.closing(ratio)
    words = torch.zeros(rows.shape[0] + INVALID_PLAN_ROWS, 4, dtype=torch.int32)
    words[: rows.shape[0], 0] = (step.positions[rows] + 1).to(torch.int32)
    words[: rows.shape[0], 1] = rows.to(torch.int32)  # ragged_id (low 16 bits), buffer_len 0
    words[rows.shape[0] :, 0] = -1
    plan_w = torch.zeros(words.shape[0], 8, dtype=torch.uint8)
    return compress_mod.CompressorPrefillPlan(ratio, words.view(torch.uint8).to(device), plan_w.to(device))


@contextlib.contextmanager
def pooled_stand_in(pooled: torch.Tensor | None, calls: dict):
    """``compress_forward`` (in ``compressor_v2`` and ``compressor_trtllm``) returning ``pooled`` (float32
    ``[T, H]`` by ``kv_score`` row) for each plan row: a decode plan's row ``b`` is row ``b``, a prefill plan's its
    ``ragged_id``. ``None``: SGLang's own."""
    if pooled is None:
        yield
        return
    saved = (cv2.compress_forward, trt.compress_forward)

    def compress_forward(*, kv_score_buffer, kv_score_input, ape, plan, compress_ratio, head_dim, out=None,
                         is_online=False):  # fmt: skip
        calls["compress_forward"] += 1
        words = plan[1].view(torch.int32)
        if plan.is_decode:
            rows = torch.arange(words.shape[0], device=words.device)
        else:
            rows = torch.where(words[:, 0] == -1, 0, words[:, 1] & 0xFFFF).long()
        return pooled[rows].clone()

    cv2.compress_forward = trt.compress_forward = compress_forward
    try:
        yield
    finally:
        cv2.compress_forward, trt.compress_forward = saved


def decode_lengths(slots: int, seed: int) -> list[tuple[int, int]]:
    """``(slot, L)`` for every request slot: by ``slot % 4``, a C128 group end (``L`` a multiple of 128, also a C4
    one), a C4 group end only, no group end, a C128 group end again; slot 1 at ``L = 4`` (C4's first group)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for slot in range(1, slots + 1):
        kind = slot % 4
        if slot == 1:
            length = 4
        elif kind in (0, 3):
            length = 128 * int(torch.randint(1, CONTEXT // 128 + 1, (1,), generator=gen))
        elif kind == 1:
            length = 4 * int(torch.randint(2, CONTEXT // 4, (1,), generator=gen))
            length += 4 if length % 128 == 0 else 0
        else:
            length = 4 * int(torch.randint(2, CONTEXT // 4, (1,), generator=gen)) + 1 + slot % 3
        out.append((slot, min(length, CONTEXT)))
    return out
