"""The vLLM adapter (``dsv4_compressor.integrations.vllm``) on vLLM-shaped buffers, against the float64 reference.

The classes ``install()`` patches are stand-ins written from vLLM 0.33's code (tests/test_engine_vllm.py runs the
real package)
(``vllm/models/deepseek_v4/compressor.py``; docs/INTEGRATION.md, vLLM): ``CompressorMetadataBuilder`` (its
``__init__`` / ``build`` as vLLM's, ``_cudagraph_support = ALWAYS``) and ``DeepseekCompressor`` (its attributes;
the original ``forward`` only counts calls). A :class:`VllmWorld` is the compressor layers of one kind and
state group as the vLLM model runner and KV-cache manager hold them, scaled down: a state group (sliding window
``coff * r``, blocks of 4 rows for C4 / 8 for C128, block 0 the null block, every block padded to 576-byte
alignment, blocks outside the window freed to the null block and handed out again at once), a compressed-KV
group (uint8 ``[blocks, P, record]``, padded block stride, null block 0), the persistent runner buffers
(int64 ``positions`` and slot mappings, int32 ``token_to_req_indices`` and block table, ``-1`` state slots on
padding rows, the compressed slot mapping ``-1``-filled except on group-ends) and padding to CUDA-graph capture
sizes whose padded tail looks like a real request (stale ``token_to_req_indices`` and block-table row of a live
request).

Each step goes through the patched builder and forward. After every step: every stored entry of every live
request against the float64 reference (``verify.check_latent_records``; the indexer's ``"pow2"`` pack with
``verify.check_indexer_pack``), every state row vLLM would read next, bit for bit, at ``block_table[req, q //
bs] * bs + q % bs``, and every byte outside the written records and saved state rows (padding bytes, null
blocks, free blocks) still holding its poison. The indexer runs with two layers in its group (the second one
reuses the plan the first one built); on a GPU (marker ``gpu``) every kind's verify steps replay one CUDA graph
captured on a dummy padded batch, as vLLM captures its graphs.

``install()`` / ``register()`` are tested in ``tests/test_integration_vllm_patching.py``, the planner and the layer
call outside the world (and at vLLM's default sizes) in ``tests/test_integration_vllm_layer.py``; both import
the stand-ins and the world from here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_params, random_rows
from helpers.model import StreamModel

from dsv4_compressor import reference
from dsv4_compressor.integrations import vllm as dsv4_vllm
from dsv4_compressor.layout import PageLayout
from dsv4_compressor.verify import check_indexer_pack, check_latent_records

POISON = 0xA5
POISON_F32 = 0x7FC0A5A5  # a NaN: a state row read by mistake turns its entry into NaN
PAD_F32 = 0x3F5A5A5A  # kv_score rows of padding: finite, so a padding row that is not ignored leaves a trace
PAGE_ALIGN = 576  # vLLM pads state and KV pages to 576-byte alignment (fp8_ds_mla)

MTP = 3  # num_speculative_tokens
S = MTP + 1  # rows of a request in a verify step
MAX_T = 32  # max_num_batched_tokens
MAX_REQS = 5  # max_num_seqs
CAPTURE_SIZES = (8, 20, 32)  # every step is padded to the next one, as under vLLM's CUDA graphs
MAX_BLOCKS = 16
STATE_BLOCKS = 24
KV_BLOCKS = 16
HIT = 16  # prefix-cache hit length: a multiple of the KV block's tokens (P * r = 16) and of the state block

#: kind -> (config, KV page size P, norm weight dtype). P * r = 16 tokens per KV block: vLLM's 256, scaled down.
KINDS = {
    "csa": (CSA_SMALL, 4, torch.bfloat16),
    "indexer": (INDEXER_CFG, 4, torch.float32),
    "hca": (HCA_SMALL, 2, torch.bfloat16),
    "hca_online": (HCA_SMALL, 2, torch.bfloat16),
}


# ---------------------------------------------------------------------------------------------------------------
# Stand-ins for vLLM's classes (vllm/models/deepseek_v4/compressor.py, vLLM 0.33)
# ---------------------------------------------------------------------------------------------------------------
class AttentionCGSupport(enum.Enum):
    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass
class CompressorMetadata:
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    token_to_req_indices: torch.Tensor | None = None


@dataclass
class CommonAttentionMetadata:
    """The fields of vLLM's ``CommonAttentionMetadata`` the compressor builder reads."""

    query_start_loc_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    slot_mapping: torch.Tensor  # this group's, [num_tokens] (padding included)
    block_table_tensor: torch.Tensor
    stale_tail: torch.Tensor  # what the persistent buffer holds past the actual tokens (vLLM leaves it)

    def token_to_req_indices(self, out: torch.Tensor) -> torch.Tensor:
        lens = self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]
        n = self.num_actual_tokens
        out[:n] = torch.repeat_interleave(torch.arange(self.num_reqs, dtype=torch.int32), lens)
        num_tokens = self.slot_mapping.shape[0]
        out[n:num_tokens] = self.stale_tail[: num_tokens - n]
        return out[:num_tokens]


def make_vllm() -> SimpleNamespace:
    """Fresh stand-in classes (``install()`` patches classes: each test gets its own)."""

    class CompressorMetadataBuilder:
        _cudagraph_support = AttentionCGSupport.ALWAYS

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (
                kv_cache_spec, layer_names, vllm_config, device
            )  # fmt: skip
            self.block_size = kv_cache_spec.block_size
            self.token_to_req_indices = torch.zeros(
                vllm_config.scheduler_config.max_num_batched_tokens, dtype=torch.int32, device=device
            )

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            token_to_req_indices = common_attn_metadata.token_to_req_indices(self.token_to_req_indices)
            return CompressorMetadata(
                block_table=common_attn_metadata.block_table_tensor.clamp_(min=0),
                slot_mapping=common_attn_metadata.slot_mapping,
                block_size=self.block_size,
                token_to_req_indices=token_to_req_indices,
            )

    class DeepseekCompressor:
        def __init__(self, **attributes):
            self.__dict__.update(attributes)
            self.original_calls = 0

        def forward(self, kv_score, positions, rotary_emb):
            self.original_calls += 1  # vLLM's own kernels would run here

    return SimpleNamespace(CompressorMetadataBuilder=CompressorMetadataBuilder, DeepseekCompressor=DeepseekCompressor)


def vllm_config() -> SimpleNamespace:
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=MAX_T, max_num_seqs=MAX_REQS),
        speculative_config=SimpleNamespace(num_speculative_tokens=MTP),
    )


# ---------------------------------------------------------------------------------------------------------------
# Compressor layers of one state group as vLLM's runner and KV-cache manager hold them
# ---------------------------------------------------------------------------------------------------------------
def _poisoned_f32(*shape, device=None) -> torch.Tensor:
    return torch.full(shape, POISON_F32, dtype=torch.int32, device=device).view(torch.float32)


class Pool:
    """A KV-cache group's block pool: block 0 is the null block; freed blocks are handed out again first."""

    def __init__(self, blocks: int):
        self.free = list(range(blocks - 1, 0, -1))
        self.refs = [0] * blocks
        self.ever = {0}  # blocks ever handed out (and the null block)

    def take(self) -> int:
        block = self.free.pop()
        self.refs[block] = 1
        self.ever.add(block)
        return block

    def share(self, block: int) -> int:
        self.refs[block] += 1
        return block

    def drop(self, block: int) -> None:
        if block:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)


@dataclass
class Req:
    state_blocks: list  # logical block -> physical (0: null), sliding window
    kv_blocks: list
    bank: int = 0  # online: the request-scoped block
    next_min_start: int = 0  # the lowest start the next step may have (an MTP rollback reaches back to it)


class Layer:
    """One ``DeepseekCompressor`` (stand-in) with its own parameters, state and k cache tensors; the block ids
    are its group's."""

    def __init__(self, world: VllmWorld, index: int, seed: int):
        cfg, dev, width = world.cfg, world.device, world.width
        self.cfg = cfg
        self.params = make_params(cfg, seed=seed, max_positions=256, norm_dtype=world.norm_dtype).to(dev)
        if world.online:
            # request-scoped blocks of S banks (PR #58074 style): S * 3 * H floats = bs rows of 2W, unpadded
            self.state_memory = _poisoned_f32(STATE_BLOCKS, world.bs * width, device=dev)
        else:
            padded = -(-world.bs * width * 4 // PAGE_ALIGN) * PAGE_ALIGN // 4  # vLLM pads the page to 576 bytes
            self.state_memory = _poisoned_f32(STATE_BLOCKS, padded, device=dev)
        self.state_cache = self.state_memory[:, : world.bs * width].view(STATE_BLOCKS, world.bs, width)
        record = world.layout.record_bytes
        padded = -(-world.page * record // PAGE_ALIGN) * PAGE_ALIGN
        self.kv_memory = torch.full((KV_BLOCKS, padded), POISON, dtype=torch.uint8, device=dev)
        self.kv_cache = self.kv_memory[:, : world.page * record].view(KV_BLOCKS, world.page, record)
        p, prefix = self.params, f"model.layers.{index}.attn"
        self.module = world.vllm.DeepseekCompressor(
            prefix=f"{prefix}.compressor", compress_ratio=cfg.ratio, head_dim=cfg.head_dim, rope_head_dim=cfg.rope_dim,
            rms_norm_eps=p.eps, overlap=cfg.overlap, coff=2 if cfg.overlap else 1, ape=p.ape.clone(),
            norm=SimpleNamespace(weight=p.norm_weight), use_fp4_cache=False,
            state_cache=SimpleNamespace(prefix=world.state_prefix, kv_cache=self.state_cache),
            k_cache_prefix=world.k_cache_prefix, max_num_batched_tokens=MAX_T, device=dev, _compress_scratch=None,
            _static_forward_context={world.k_cache_prefix: SimpleNamespace(kv_cache=self.kv_cache)},
        )  # fmt: skip
        self.rotary_emb = SimpleNamespace(cos_sin_cache=torch.cat([p.cos, p.sin], dim=1))
        self.kv_score = torch.zeros(MAX_T, width, device=dev)  # the GEMM's output: a static buffer under graphs
        self.model = StreamModel(cfg, self.params)


class VllmWorld:
    """``layers`` compressor layers of one kind: one state group and one compressed-KV group (all layers of a
    group share its block tables and slot mappings, vLLM's metadata for the group and our plan)."""

    def __init__(self, kind: str, seed: int, *, layers: int = 1, device: str = "cpu"):
        cfg, self.page, self.norm_dtype = KINDS[kind]
        self.kind, self.cfg, self.online, self.device = kind, cfg, kind == "hca_online", torch.device(device)
        self.r, self.window, self.width = cfg.ratio, cfg.window, cfg.row_width
        self.vllm = make_vllm()
        self.context = SimpleNamespace(attn_metadata=None)
        self.installation = dsv4_vllm.install(
            hca="online" if self.online else "tiled", compressor_cls=self.vllm.DeepseekCompressor,
            builder_cls=self.vllm.CompressorMetadataBuilder, get_forward_context=lambda: self.context,
        )  # fmt: skip
        self.gen, self.rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
        # vLLM names the state group's metadata after the state caches and the KV group's after the k caches; one
        # prefix each stands for the group here (all layers look their group's metadata up under it)
        self.state_prefix, self.k_cache_prefix = "state_group", "k_cache_group"
        if self.online:
            self.bs = S * 3 * cfg.head_dim // self.width
            assert self.bs * self.width == S * 3 * cfg.head_dim
            spec = SimpleNamespace(block_size=self.bs)  # a request-scoped spec, not a sliding window
        else:
            self.bs = dsv4_vllm.VLLM_STATE_BLOCK_SIZE[4 if cfg.overlap else 128]
            spec = SimpleNamespace(block_size=self.bs, sliding_window=self.window)
        if cfg.output == "latent":
            self.layout = PageLayout(self.page, cfg.record_data_bytes, cfg.record_scale_bytes)
        else:
            self.layout = PageLayout(self.page, cfg.head_dim, 4)
        self.state_pool, self.kv_pool = Pool(STATE_BLOCKS), Pool(KV_BLOCKS)
        self.layers = [Layer(self, i, seed + 100 * i) for i in range(layers)]
        self.builder = self.vllm.CompressorMetadataBuilder(spec, [self.state_prefix], vllm_config(), self.device)

        # the model runner's persistent buffers
        dev = self.device
        self.positions = torch.zeros(MAX_T, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((MAX_T,), -1, dtype=torch.int64, device=dev)
        self.out_slot = torch.full((MAX_T,), -1, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.int32, device=dev)

        self.reqs: dict[str, Req] = {}
        self.written: set[int] = set()  # compressed slots ever written
        self.saved: set[tuple[int, int]] = set()  # (block, row) of state rows ever saved
        self.pointers = None

    @property
    def model(self) -> StreamModel:
        return self.layers[0].model

    # -- the KV-cache manager ----------------------------------------------------------------------------------
    def begin(self, rid: str, *, prefix_of: str | None = None) -> None:
        """A new request; with ``prefix_of`` a prefix-cache hit of ``HIT`` tokens on that request's blocks (the
        state group's hit keeps only the blocks of the last ``window - 1`` positions; older ones are null)."""
        req = Req([], [])
        if self.online:
            req.bank = self.state_pool.take()
        if prefix_of is not None:
            src = self.reqs[prefix_of]
            if not self.online:
                first = max(0, HIT - self.window + 1) // self.bs
                shared = [self.state_pool.share(b) for b in src.state_blocks[first : HIT // self.bs]]
                assert all(shared), "the shared blocks are no longer held"
                req.state_blocks = [0] * first + shared
            req.kv_blocks = [self.kv_pool.share(b) for b in src.kv_blocks[: HIT // (self.page * self.r)]]
            for layer in self.layers:
                layer.model.apply(rid, 0, layer.model.rows[prefix_of][:HIT])
            req.next_min_start = HIT
        self.reqs[rid] = req

    def release(self, rid: str) -> None:
        req = self.reqs.pop(rid)
        for b in req.state_blocks + [req.bank]:
            self.state_pool.drop(b)
        for b in req.kv_blocks:
            self.kv_pool.drop(b)
        for layer in self.layers:
            layer.model.release(rid)

    def _schedule(self, req: Req, start: int, end: int) -> None:
        if not self.online:
            # vLLM's sliding-window manager: blocks wholly before start - (window - 1) go back to the pool
            for i in range(min(len(req.state_blocks), max(0, start - self.window + 1) // self.bs)):
                self.state_pool.drop(req.state_blocks[i])
                req.state_blocks[i] = 0
            while len(req.state_blocks) * self.bs < end:
                req.state_blocks.append(self.state_pool.take())
        while len(req.kv_blocks) * self.page < end // self.r:
            req.kv_blocks.append(self.kv_pool.take())

    def state_slot(self, req: Req, q: int) -> int:
        if self.online:
            return -1  # vLLM maps no slots for a request-scoped group (uses_slot_mapping False)
        return req.state_blocks[q // self.bs] * self.bs + q % self.bs

    def kv_slot(self, req: Req, g: int) -> int:
        return req.kv_blocks[g // self.page] * self.page + g % self.page

    # -- one step ------------------------------------------------------------------------------------------------
    def fill(self, items: list[tuple[str, int, int]], *, pad_to: int | None = None) -> tuple:
        """Schedule ``items = [(rid, start, rows)]`` (batch order) and fill the runner's buffers the way vLLM
        does; returns ``(metadata inputs, padded rows)``."""
        actual = sum(n for _, _, n in items)
        padded = pad_to or min(size for size in CAPTURE_SIZES if size >= actual)
        positions, slots = torch.zeros(padded, dtype=torch.int64), torch.full((padded,), -1, dtype=torch.int64)
        out_slot = torch.full((MAX_T,), -1, dtype=torch.int64)  # vLLM fills the whole buffer with -1 first
        table = self.block_table.cpu()
        qsl, row = [0], 0
        for i, (rid, start, n) in enumerate(items):
            req = self.reqs[rid]
            self._schedule(req, start, start + n)
            pos = list(range(start, start + n))
            positions[row : row + n] = torch.tensor(pos)
            slots[row : row + n] = torch.tensor([self.state_slot(req, q) for q in pos])
            for t, q in enumerate(pos):
                if q % self.r == self.r - 1:
                    out_slot[row + t] = self.kv_slot(req, q // self.r)
                    self.written.add(self.kv_slot(req, q // self.r))
            table[i].fill_(-1)
            blocks = [req.bank] if self.online else req.state_blocks
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            row += n
            qsl.append(row)
        # The padded tail looks like one more request: the positions of the first request's rows again, its
        # request index pointing at a block-table row that holds the first request's blocks. Only the -1 state
        # slots say it is padding.
        tail = padded - actual
        num_reqs = len(items) + (tail > 0)
        if tail:
            positions[actual:] = positions[:tail] if 0 < tail <= actual else 3
            # a request-scoped group (vLLM's CircularBufferSpec) has no slot mapping: its padded request holds the
            # null block 0, which is what says its rows are padding
            table[len(items)] = 0 if self.online else table[0]
        if self.online:
            slots.fill_(-1)
        self.positions[:padded] = positions.to(self.device)
        self.slot_mapping[:padded] = slots.to(self.device)
        self.out_slot.copy_(out_slot.to(self.device))
        self.block_table.copy_(table.to(self.device))
        cam = CommonAttentionMetadata(
            query_start_loc_cpu=torch.tensor(qsl), num_reqs=len(items), num_actual_tokens=actual,
            max_query_len=max((n for _, _, n in items), default=S), slot_mapping=self.slot_mapping[:padded],
            block_table_tensor=self.block_table[:num_reqs],
            stale_tail=torch.full((MAX_T,), len(items), dtype=torch.int32, device=self.device),
        )  # fmt: skip
        return cam, padded

    def step(self, items: list[tuple[str, int, int]], *, vllm_forward: bool = False, graph=None) -> None:
        """One step: :meth:`fill`, build the metadata with the (patched) builder, run the (patched) forward of
        every layer (or replay ``graph``, captured on these buffers), update the models. ``vllm_forward``: the
        layers are ones the adapter leaves to vLLM's own forward."""
        steps = [(rid, start, random_rows(n, self.cfg, self.gen)) for rid, start, n in items]
        cam, padded = self.fill(items, pad_to=20 if graph is not None else None)
        metadata = self.builder.build(0, cam)
        self.context.attn_metadata = {
            self.state_prefix: metadata,
            self.k_cache_prefix: SimpleNamespace(slot_mapping=self.out_slot[:padded]),
        }
        tail = padded - cam.num_actual_tokens
        befores = []
        for layer in self.layers:
            pad_rows = torch.full((tail, self.width), PAD_F32, dtype=torch.int32).view(torch.float32)
            rows = [random_rows(n, self.cfg, self.gen) for _, _, n in items] if layer is not self.layers[0] else None
            layer.step_rows = rows or [r for _, _, r in steps]
            layer.kv_score[:padded] = torch.cat(layer.step_rows + [pad_rows]).to(self.device)
            befores.append(layer.kv_score.clone())
        if graph is not None:
            graph.replay()
        else:
            for layer in self.layers:
                layer.module.forward(layer.kv_score[:padded], self.positions[:padded], layer.rotary_emb)
        for layer, before in zip(self.layers, befores):
            assert torch.equal(layer.kv_score.view(torch.int32), before.view(torch.int32)), "kv_score was written"
            assert layer.module.original_calls == int(vllm_forward), "vLLM's own forward ran, or did not"
        if vllm_forward:
            return

        step = getattr(metadata, dsv4_vllm.STEP_ATTR)
        assert step.decode == (cam.max_query_len <= S)
        if graph is None:
            assert step.rows == padded and step.owner is self.layers[0].module  # built once, by the first layer
        planner = self.builder._dsv4c_planner
        pointers = [t.data_ptr() for t in (planner.plan, planner.row_req, planner.save_rows)]
        assert self.pointers in (None, pointers), "the planner's buffers moved (CUDA graphs replay fixed addresses)"
        self.pointers = pointers

        for k, (rid, start, _) in enumerate(steps):
            req, n = self.reqs[rid], items[k][2]
            if not self.online:
                self.saved.update(divmod(self.state_slot(req, q), self.bs) for q in range(start, start + n))
            for layer in self.layers:
                layer.model.apply(rid, start, layer.step_rows[k])
            req.next_min_start = start + 1 if n == S else start + n

    def verify_step(self, rids: list[str]) -> list[tuple[str, int, int]]:
        """A verify step of every request in ``rids`` (in shuffled batch order): each rolls back its rejected
        drafts of the previous step (random acceptance) and brings ``S`` rows."""
        items = []
        for rid in rids:
            length, low = self.model.length(rid), self.reqs[rid].next_min_start
            items.append((rid, int(self.rng.integers(low, length + 1)), S))
        return [items[i] for i in self.rng.permutation(len(items))]

    # -- checks --------------------------------------------------------------------------------------------------
    def check(self, what: str) -> None:
        for i, layer in enumerate(self.layers):
            self._check_layer(f"{what} layer {i}", layer)

    def _check_layer(self, what: str, layer: Layer) -> None:
        cfg, r = self.cfg, self.r
        pages = layer.kv_cache.view(KV_BLOCKS, -1).cpu()
        for rid in layer.model.live():
            groups = layer.model.length(rid) // r
            if groups:
                slots = torch.tensor([self.kv_slot(self.reqs[rid], g) for g in range(groups)])
                got, want = self.layout.read(pages, slots), layer.model.expected(rid)
                if cfg.output == "latent":
                    rep = check_latent_records(got, want, cfg)
                else:
                    rep = check_indexer_pack(got, want, "pow2")
                assert rep.ok, f"{what}: request {rid}: {rep}"
            if not self.online:
                self._check_state_rows(what, layer, rid)
        self._check_untouched(what, layer)

    def _check_state_rows(self, what: str, layer: Layer, rid: str) -> None:
        """The rows of every position a next step's windows read (it starts in ``[next_min_start, L]``) hold
        ``[kv | score + ape]`` bit for bit where vLLM's block table puts them."""
        req, r, length = self.reqs[rid], self.r, layer.model.length(rid)
        lo = max(0, (req.next_min_start // r - (1 if self.cfg.overlap else 0)) * r)
        if lo >= length:
            return
        q = torch.arange(lo, length)
        blocks = torch.tensor(req.state_blocks)[q // self.bs]
        assert (blocks > 0).all(), f"{what}: request {rid}: a position the next step reads is in a freed block"
        got = layer.state_cache.cpu()[blocks, q % self.bs]
        want = reference.gated_rows(layer.model.rows[rid][lo:length], q, layer.model.params.ape, self.cfg.width)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{what}: request {rid}: state rows"

    def _check_untouched(self, what: str, layer: Layer) -> None:
        memory = layer.kv_memory.cpu()
        keep = torch.zeros(memory.shape, dtype=torch.bool)
        if self.written:
            idx = self.layout._byte_index(torch.tensor(sorted(self.written)))
            page, off = idx // self.layout.bytes_per_page, idx % self.layout.bytes_per_page
            keep.view(-1)[(page * memory.shape[1] + off).reshape(-1)] = True
        stray = (memory != POISON) & ~keep
        assert not stray.any(), f"{what}: {int(stray.sum())} KV bytes written outside the closed entries' records"
        bits = layer.state_memory.cpu().view(torch.int32)
        if self.online:
            # banks: only blocks handed out to a request may change; the null block and never-used ones may not
            untouched = torch.tensor([b not in self.state_pool.ever or b == 0 for b in range(STATE_BLOCKS)])
            assert (bits[untouched] == POISON_F32).all(), f"{what}: bank blocks of no request were written"
            return
        keep = torch.zeros(bits.shape, dtype=torch.bool)
        for block, row in self.saved:
            keep[block, row * self.width : (row + 1) * self.width] = True
        stray = (bits != POISON_F32) & ~keep
        assert not stray.any(), f"{what}: {int(stray.sum())} state floats written outside the saved rows"


# ---------------------------------------------------------------------------------------------------------------
# Streaming through the patched builder and forward
# ---------------------------------------------------------------------------------------------------------------
def _prefill(world: VllmWorld):
    """Chunked prefill (a chunk over several groups ending mid-group, a chunk shorter than a group), then a mixed
    step with a prefix-cache hit (D starts at ``HIT``, a block boundary, on A's blocks)."""
    r = world.r
    world.begin("A")
    world.begin("B")
    yield [("A", 0, 19), ("B", 0, r - 1)]
    world.begin("C")
    world.begin("D", prefix_of="A")
    yield [("C", 0, 3), ("A", 19, S), ("D", HIT, 5), ("B", r - 1, r + 2)]


def _schedule(world: VllmWorld):
    """:func:`_prefill`, verify steps with random acceptance (padded uniform-decode graph batches), a release
    whose blocks a new request gets at once, then verify steps again."""
    yield from _prefill(world)
    for _ in range(3):
        yield world.verify_step(["A", "B", "C", "D"])
    world.release("C")
    world.begin("E")
    yield [("E", 0, 6)] + world.verify_step(["A", "B", "D"])
    yield world.verify_step(["A", "B", "D", "E"])


#: kind -> layers of the group (two for one kind: the second layer reuses the plan the first one built)
STREAMING = {"csa": 1, "hca": 1, "hca_online": 1, "indexer": 2}


@pytest.mark.parametrize("kind", sorted(STREAMING))
def test_vllm_streaming(kind):
    world = VllmWorld(kind, seed=sorted(KINDS).index(kind), layers=STREAMING[kind])
    try:
        for k, items in enumerate(_schedule(world)):
            world.step(items)
            world.check(f"{kind} step {k} {items}")
        assert world.model.length("D") > HIT + world.r  # D's own entries past the shared prefix were checked
    finally:
        world.installation.uninstall()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_vllm_decode_steps_replay_one_cuda_graph(kind):
    """vLLM's way with CUDA graphs: a warm-up and then a capture of the layers' forward on a dummy padded decode
    batch (the same metadata object both times: the capture must still contain the plan's build), then real
    verify steps that only refill the runner's buffers, run the builder (host only) and replay the graph."""
    world = VllmWorld(kind, seed=5, layers=2, device="cuda")
    try:
        for k, items in enumerate(_prefill(world)):
            world.step(items)
            world.check(f"{kind} eager step {k}")
        cam, padded = world.fill([], pad_to=20)  # all padding: every state slot -1
        cam.block_table_tensor = world.block_table[:MAX_REQS]
        world.context.attn_metadata = {
            world.state_prefix: world.builder.build(0, cam),
            world.k_cache_prefix: SimpleNamespace(slot_mapping=world.out_slot[:padded]),
        }

        def forward():
            for layer in world.layers:
                layer.module.forward(layer.kv_score[:padded], world.positions[:padded], layer.rotary_emb)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()  # warm-up: compiles the decode kernels
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        world.check("after capture")  # the dummy batch wrote nothing
        for k in range(4):
            world.step(world.verify_step(["A", "B", "C", "D"]), graph=graph)
            world.check(f"{kind} replay {k}")
    finally:
        world.installation.uninstall()
