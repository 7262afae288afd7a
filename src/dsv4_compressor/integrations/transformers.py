"""Hugging Face transformers' DeepSeek-V4 (``transformers >= 5.24``) generating with our compressor.

::

    from dsv4_compressor.integrations import transformers as dc_hf

    dc_hf.enable(model)        # every HCA / CSA compressor and CSA indexer of the model now runs our ops
    model.generate(input_ids, max_new_tokens=64)
    dc_hf.disable(model)       # the eager compressor again (between generations)

What changes, and what does not. In ``modeling_deepseek_v4.py`` each compressor (``DeepseekV4HCACompressor``,
``DeepseekV4CSACompressor`` and the ``DeepseekV4Indexer`` the CSA one calls) projects ``kv`` and ``gate`` with
its own ``kv_proj`` / ``gate_proj``, hands them to its cache layer (``store_compression_weights``: buffer the rows
of the open window, return the closed windows), pools the closed windows, normalizes and rotates them, and
appends the entries to the cache layer's running list (``update_compressor_states``); everything after that
(the HCA causal block bias, the indexer's query scoring and top-k, the CSA block bias) reads that list.
:func:`enable` replaces each compressor module's ``forward`` with one that runs the module's own forward
against a stand-in for its cache layer: the stand-in receives the projected ``kv`` / ``gate`` (so the
projection is the module's own, in the module's dtype), runs :func:`dsv4_compressor.ops.compress` (or
:func:`~dsv4_compressor.ops.compress_online_hca` for HCA) on them with ``out_keys`` float32, keeps our state
(the ring of SPEC section 6, or the online HCA banks) for the batch's sequences, and returns no rows to pool, so
the eager pooling never runs and the running list it hands back is ours. The model therefore gets a tensor of
the same shape and dtype, with the same entries, and the masking, indexer scoring and attention are the eager
code, unchanged.

Positions follow the eager compressor: group ``g`` of a sequence covers its cache positions ``g*r .. g*r+r-1``
(tokens as the cache received them, left padding included, the same for every row of the batch; the eager
code counts ``entry_count * r``, not ``position_ids``), rope at the group start, with the module's own rotary
frequencies (``rotary_emb.compress_inv_freq``, YaRN included) in the module's dtype, exactly as the eager
``apply_rotary_pos_emb`` reads them. The state lives on the model's cache layer (``cache.layers[i]``), so it
begins and ends with the generation; the eager fields ``compressed_kv[name]`` and ``entry_count[name]`` mirror
ours, and ``reorder_cache`` (beam search) reorders ours too. Not supported: cropping the cache (assisted
generation; the eager compressor does not support it either), ``batch_select_indices``, training (the op has no
backward: a forward with gradients enabled is refused), and switching compressors in the middle of a
generation.

Numerics: every entry is computed in float32 (SPEC section 3) and cast once to the module's dtype. In a float32
model that is the eager math up to float32 summation order. In a bfloat16 model the eager compressor rounds the
softmax weights, the weighted sum and the normalized entry to bfloat16 before rope; ours rounds only the
result. The rope tables are the model's, not :func:`dsv4_compressor.rope_tables`: the eager code forms the
angles ``p * inv_freq`` in float32 (the SPEC's tables in float64), which moves cos / sin by up to 1e-3 at
position 65,536 and 2e-2 at 1,048,576; the model's queries are rotated the same way, so its tables are kept.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch

__all__ = ["enable", "disable", "install", "is_enabled", "HCA_BACKENDS"]

#: How HCA layers run: ``"online"`` (:func:`ops.compress_online_hca`, the running-softmax banks), ``"tiled"``
#: (:func:`ops.compress` with a scratch: the tiled C128 kernel; needs a head_dim multiple of 64) or
#: ``"single"`` (:func:`ops.compress`, the single-stage ring kernel). CSA and the indexer always run the
#: single-stage ring kernel.
HCA_BACKENDS = ("online", "tiled", "single")

_ATTR = "_dsv4c_adapter"  # on a patched compressor module
_STATES = "_dsv4c_states"  # on a model cache layer: {stream name: _State}


def _modeling():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    return modeling_deepseek_v4


def enable(model: torch.nn.Module, *, hca_backend: str = "online") -> int:
    """Run every DeepSeek-V4 compressor of ``model`` (any module tree holding them) with our ops.

    Returns the number of compressor modules patched. Calling it again replaces the previous settings.
    On CPU the kernels need the Triton interpreter (``TRITON_INTERPRET=1`` before triton is imported).
    """
    if hca_backend not in HCA_BACKENDS:
        raise ValueError(f"hca_backend must be one of {HCA_BACKENDS}, got {hca_backend!r}")
    mdl = _modeling()
    runtime = _Runtime(hca_backend)
    count = 0
    for module in model.modules():
        if isinstance(module, mdl.DeepseekV4HCACompressor):
            streams = {"compressor": _Stream("hca", module)}
        elif isinstance(module, mdl.DeepseekV4CSACompressor):
            streams = {"compressor": _Stream("csa", module), "indexer": _Stream("indexer", module.indexer)}
        else:
            continue
        for stream in streams.values():
            stream.check(hca_backend)
        setattr(module, _ATTR, _Adapter(runtime, streams))
        module.forward = types.MethodType(_patched_forward, module)
        count += 1
    return count


#: The name the other adapters of this package use (``install()``); here it patches one model instance.
install = enable


def disable(model: torch.nn.Module) -> int:
    """Restore the eager compressors; returns how many were patched. Do it between generations."""
    count = 0
    for module in model.modules():
        if getattr(module, _ATTR, None) is not None:
            delattr(module, _ATTR)
            if "forward" in module.__dict__:
                del module.forward
            count += 1
    return count


def is_enabled(model: torch.nn.Module) -> bool:
    return any(getattr(m, _ATTR, None) is not None for m in model.modules())


def _patched_forward(self, hidden_states, q_residual, position_ids, cache=None, layer_idx=None, **kwargs):
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    if kwargs:
        raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    return getattr(self, _ATTR).forward(self, hidden_states, q_residual, position_ids, cache, layer_idx)


# ---------------------------------------------------------------------------------------------------------------
# Per compressor stream: its parameters, in the form the ops read them
# ---------------------------------------------------------------------------------------------------------------
class _Stream:
    """One compressor stream (``kind`` hca / csa / indexer) of one module: its ops-facing parameters."""

    def __init__(self, kind: str, module: torch.nn.Module):
        self.kind = kind
        self.module = module
        self.overlap = kind != "hca"
        self._rope_key = None
        self._cos = self._sin = None

    @property
    def ratio(self) -> int:
        return int(self.module.compress_rate)

    @property
    def head(self) -> int:
        return int(self.module.head_dim)

    @property
    def width(self) -> int:
        return self.head * (2 if self.overlap else 1)

    @property
    def ring(self) -> int:
        """Ring rows per sequence without MTP (SPEC section 6): ``2r`` with overlap, else ``r`` rounded up to 4."""
        return 2 * self.ratio if self.overlap else -(-self.ratio // 4) * 4

    def check(self, hca_backend: str) -> None:
        if self.kind == "hca" and hca_backend == "tiled" and self.head % 64:
            raise ValueError(f"hca_backend='tiled' needs a head_dim multiple of 64, got {self.head}")
        rot = self.module.rotary_emb
        rope_type = rot.rope_type.get(self.module.rope_layer_type)
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope_type {rope_type!r} changes its frequencies with the length: not supported")
        bias = self.module.position_bias
        if tuple(bias.shape) != (self.ratio, self.width):
            raise ValueError(f"{self.kind}: position_bias is {list(bias.shape)}, expected [{self.ratio}, {self.width}]")

    def params(self):
        """``(ape, norm_weight, eps)`` as the ops read them (the module's tensors, no copies when float32)."""
        ape = self.module.position_bias.detach()
        if ape.dtype != torch.float32:
            ape = ape.float()
        norm = self.module.kv_norm
        weight = norm.weight.detach()
        if weight.dtype not in (torch.float32, torch.bfloat16):
            weight = weight.float()
        return ape, weight, float(norm.variance_epsilon)

    def rope(self, positions: int, dtype: torch.dtype, device: torch.device):
        """float32 ``(cos, sin)`` covering ``positions``: the module's rotary embedding as its forward computes it
        (float32 angles ``p * inv_freq``, times the attention scaling, rounded to the compressor's ``dtype``)."""
        rot = self.module.rotary_emb
        layer_type = self.module.rope_layer_type
        inv_freq = getattr(rot, f"{layer_type}_inv_freq")
        scaling = getattr(rot, f"{layer_type}_attention_scaling")
        key = (inv_freq.data_ptr(), inv_freq._version, dtype, device, scaling)
        if self._rope_key != key or self._cos.shape[0] < positions:
            size = 256
            while size < positions:
                size *= 2
            pos = torch.arange(size, device=device, dtype=torch.float32)
            freqs = pos[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
            self._cos = (freqs.cos() * scaling).to(dtype).float()
            self._sin = (freqs.sin() * scaling).to(dtype).float()
            self._rope_key = key
        return self._cos, self._sin


@dataclass
class _State:
    """One stream of one layer, for the batch's sequences: length, our state and the entries so far."""

    length: int
    state: torch.Tensor  # ring [B, ring, 2W] or online banks [B, 1, 3, H], float32
    entries: torch.Tensor  # [B, groups, H] in the compressor's dtype

    def select(self, index: torch.Tensor) -> None:
        self.state = self.state.index_select(0, index.to(self.state.device))
        self.entries = self.entries.index_select(0, index.to(self.entries.device))


@dataclass
class _Runtime:
    """Settings shared by the model's compressors, and the step's plans (one per ratio, reused by every layer)."""

    hca_backend: str
    plans: dict = field(default_factory=dict)

    def plan(self, ratio: int, length: int, rows: int, batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """The plan of a step that brings ``rows`` rows for each of ``batch`` sequences at positions
        ``length..length+rows-1``, and the number of groups each sequence closes; entries go to out_keys rows
        ``b * closed + (g - length // ratio)``."""
        from .. import ops

        key = (ratio, length, rows, batch, device)
        hit = self.plans.get(ratio)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        first = length // ratio
        closed = (length + rows) // ratio - first
        positions = (length + torch.arange(rows, device=device)).repeat(batch)
        row_req = torch.arange(batch, device=device).repeat_interleave(rows)
        out_slot = torch.where(
            positions % ratio == ratio - 1,
            row_req * closed + positions // ratio - first,
            torch.full_like(positions, -1),
        )
        plan = ops.empty_plan(batch * rows, batch, ratio, device)
        ops.build_plan(plan, positions, row_req, out_slot, ratio=ratio, num_slots=batch)
        self.plans[ratio] = (key, plan, closed)
        return plan, closed


# ---------------------------------------------------------------------------------------------------------------
# The patched forward: the module's own forward against a stand-in cache layer
# ---------------------------------------------------------------------------------------------------------------
class _Adapter:
    def __init__(self, runtime: _Runtime, streams: dict[str, _Stream]):
        self.runtime = runtime
        self.streams = streams

    def forward(self, module, hidden_states, q_residual, position_ids, cache, layer_idx):
        if torch.is_grad_enabled() and (
            hidden_states.requires_grad or any(p.requires_grad for p in module.parameters())
        ):
            raise RuntimeError(
                "dsv4_compressor's transformers adapter is for inference: run under torch.no_grad() / "
                "torch.inference_mode() (model.generate does), or disable() it for training"
            )
        cache_layer = cache.layers[layer_idx] if cache is not None else None
        stand_in = _StepLayer(self, cache_layer, hidden_states.shape[0], hidden_states.shape[1])
        original = type(module).forward
        return original(module, hidden_states, q_residual, position_ids, _StandInCache(layer_idx, stand_in), layer_idx)


class _StandInCache:
    """What the eager forward sees as ``cache``: only ``cache.layers[layer_idx]`` is read."""

    def __init__(self, layer_idx, layer):
        self.layers = {layer_idx: layer}


class _StepLayer:
    """The stand-in cache layer of one forward call of one compressor module."""

    def __init__(self, adapter: _Adapter, cache_layer, batch: int, rows: int):
        self.adapter, self.cache_layer, self.batch, self.rows = adapter, cache_layer, batch, rows
        self.entries: dict[str, torch.Tensor] = {}

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        stream = self.adapter.streams[name]
        state = self._state(name, stream, kv)
        self.entries[name] = _compress(self.adapter.runtime, stream, state, kv, gate)
        if self.cache_layer is not None:
            self.cache_layer.compressed_kv[name] = state.entries
            self.cache_layer.entry_count[name] = state.entries.shape[1]
        # no rows for the eager pooling: it emits nothing and takes our entries from update_compressor_states
        return kv[:, :0], gate[:, :0], state.length // stream.ratio * stream.ratio

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        if compressed.shape[1]:
            raise RuntimeError(f"the eager {name} pooled rows behind the adapter's back")
        return self.entries[name]

    def update_overlap_state(self, *args, **kwargs):
        raise RuntimeError("the eager overlap state is not used with the adapter")

    def _state(self, name: str, stream: _Stream, kv: torch.Tensor) -> _State:
        """This stream's state before the step (checked against the cache layer's length), fresh on a new
        sequence; ``None`` cache: a throwaway state (the eager stateless mode: one call, positions from 0)."""
        batch, rows = self.batch, self.rows
        states = None
        start = 0
        if self.cache_layer is not None:
            states = self.cache_layer.__dict__.get(_STATES)
            if states is None:
                states = {}
                setattr(self.cache_layer, _STATES, states)
                _follow_reorder(self.cache_layer)
            # the attention updated the sliding-window cache (cumulative_length) before calling the compressor
            start = int(self.cache_layer.cumulative_length) - rows
        st = states.get(name) if states is not None else None
        if st is not None and st.length == start and st.state.shape[0] == batch:
            return st
        if start != 0:
            raise RuntimeError(
                f"layer {stream.kind} {name}: the cache holds {start} positions but the adapter's state "
                f"{'none' if st is None else st.length} (enable() before a generation starts; cropping or "
                f"batch-selecting the cache is not supported)"
            )
        device = kv.device
        if stream.kind == "hca" and self.adapter.runtime.hca_backend == "online":
            buf = torch.zeros(batch, 1, 3, stream.head, device=device)
        else:
            buf = torch.zeros(batch, stream.ring, 2 * stream.width, device=device)
        st = _State(0, buf, kv.new_zeros((batch, 0, stream.head)))
        if states is not None:
            states[name] = st
        return st


def _follow_reorder(cache_layer) -> None:
    """Beam search reorders the cache's batch (``reorder_cache``): reorder our states with it."""
    original = cache_layer.reorder_cache

    def reorder_cache(beam_idx):
        original(beam_idx)
        for name, st in cache_layer.__dict__.get(_STATES, {}).items():
            st.select(beam_idx)
            cache_layer.compressed_kv[name] = st.entries

    cache_layer.reorder_cache = reorder_cache


def _compress(runtime: _Runtime, stream: _Stream, st: _State, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """One step of one stream: ``kv`` / ``gate`` ``[B, S, W]`` -> the running entries ``[B, groups, H]``."""
    from .. import ops

    batch, rows, width = kv.shape
    if rows == 0:
        return st.entries
    device = kv.device
    kv_score = torch.cat([kv, gate], dim=-1).reshape(batch * rows, 2 * width).float().contiguous()
    plan, closed = runtime.plan(stream.ratio, st.length, rows, batch, device)
    ape, norm_weight, eps = stream.params()
    cos, sin = stream.rope(max(st.length + rows, stream.ratio), kv.dtype, device)
    out = torch.empty(max(batch * closed, 1), stream.head, device=device)
    decode = rows == 1
    if stream.kind == "hca" and runtime.hca_backend == "online":
        ops.compress_online_hca(kv_score, plan, ape, norm_weight, cos, sin, st.state, None, page_size=1, eps=eps,
                                decode=decode, out_keys=out)  # fmt: skip
    else:
        scratch = None
        if stream.kind == "hca" and runtime.hca_backend == "tiled":
            scratch = torch.empty(batch * rows, stream.head, device=device)
        ops.compress(kv_score, plan, ape, norm_weight, cos, sin, st.state, None, kind=stream.kind, page_size=1,
                     eps=eps, decode=decode, scratch=scratch, out_keys=out)  # fmt: skip
    st.length += rows
    if closed:
        new = out[: batch * closed].view(batch, closed, stream.head).to(kv.dtype)
        st.entries = torch.cat([st.entries, new], dim=1)
    return st.entries
