"""The projection: where ours computes what SGLang's ``Compressor.compute_kv_score`` does, the C4 weights
joined for one GEMM, and the workspaces' sizes."""

from __future__ import annotations

import sys
import weakref
from types import ModuleType
from typing import Any

import torch

from ... import ops
from .._pairing import tensor_key


# ---------------------------------------------------------------------------------------------------------------
# The projection: where ours computes what SGLang's compute_kv_score does
# ---------------------------------------------------------------------------------------------------------------
def _sglang_compressor_module(compressor) -> ModuleType | None:
    """The module of SGLang's ``Compressor`` class when ``compressor`` runs that class's own
    ``compute_kv_score`` and ``_compute_wkv_gate`` (the code this adapter was read against); else ``None``: a
    subclass or stand-in that computes ``kv_score`` some other way keeps it."""
    cls = next((c for c in type(compressor).__mro__ if c.__name__ == "Compressor"
                and "compute_kv_score" in c.__dict__ and "_compute_wkv_gate" in c.__dict__), None)  # fmt: skip
    if cls is None:
        return None
    for name in ("compute_kv_score", "_compute_wkv_gate"):
        if getattr(type(compressor), name) is not cls.__dict__[name]:
            return None
    return sys.modules.get(cls.__module__)


def _x_key(x: torch.Tensor, forward_batch, layer: int) -> tuple:
    return (layer, id(forward_batch), *tensor_key(x))


#: The most (layer, step size) pairing verdicts an adapter keeps (SGLang's prefill chunks come in many sizes).
_PAIRABLE_KEYS = 1 << 16
#: What :meth:`SGLangCompressor.paired_kv_score` returns where the compressor's work is done (its entries
#: and state written by the layer's ``ops.compress_pair``).
PAIR_DONE = object()
#: A joined C4 layer's compressors, each to the other (:func:`join_c4_weights`); weak: a model freed is forgotten.
_PARTNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def join_c4_weights(model) -> int:
    """Make each C4 layer's two ``wkv_gate`` weights (the attention's ``compressor`` and ``indexer.compressor``:
    bf16 ``[2W, D]`` row-major, what :func:`projection_weight` reads) the halves of one tensor
    (``ops.join_pair_weights``; the parameters keep their objects and loaders, their ``.data`` become views), so
    :meth:`SGLangCompressor.paired_kv_score` projects both in one GEMM; returns the number of layers joined.
    Memory-neutral: a layer's two old tensors are freed once its joint copy is made (on CUDA the cache is
    emptied after each layer, so at most one layer's weights are held twice: 20 MiB for V4-Flash, 35 for V4-Pro).
    Done once per model, when the first backend is built (after SGLang has loaded the weights and before any
    graph is captured; an in-place weight update later writes into the views); a second call only counts.
    Layers whose weights the op does not read (quantized, GGUF, another layout) are left as they are."""
    joined = 0
    first = not getattr(model, "_dsv4c_joined", False)
    for module in model.modules():
        main_c = getattr(module, "compressor", None)
        index_c = getattr(getattr(module, "indexer", None), "compressor", None)
        if main_c is None or index_c is None or int(getattr(main_c, "ratio", 0)) != 4:
            continue
        weights = [getattr(getattr(c, "wkv_gate", None), "weight", None) for c in (main_c, index_c)]
        if not all(isinstance(w, torch.Tensor) for w in weights):
            continue
        dim = int(weights[0].shape[-1])
        if any(projection_weight(c, int(w.shape[0]), dim)[1] is not None for c, w in zip((main_c, index_c), weights)):
            continue
        if ops.joint_pair_weight(*weights) is None:
            if not first or any(w.stride() != (dim, 1) for w in weights):
                continue
            with torch.no_grad():
                joint = ops.join_pair_weights(weights[0].data, weights[1].data)
                n1 = weights[0].shape[0]
                weights[0].data, weights[1].data = joint[:n1], joint[n1:]
            del joint
            if weights[0].is_cuda:
                torch.cuda.empty_cache()  # the two old tensors' blocks back before the next layer's copy
        _PARTNERS[main_c], _PARTNERS[index_c] = index_c, main_c
        joined += 1
    if first:
        model._dsv4c_joined = True
    return joined


def projection_weight(compressor, width: int, dim: int) -> tuple[torch.Tensor | None, str | None]:
    """``(compressor.wkv_gate.weight, None)`` where SGLang 0.5.23's ``Compressor._compute_wkv_gate`` is the plain
    ``linear_bf16_fp32(x, weight)`` our projection computes: a bf16 ``[2W, D]`` row-major weight (SGLang's
    ``torch.mm(x, w.t(), out_dtype=float32)`` or ``deep_gemm``'s bf16 x bf16 -> float32, the same product; its
    split-K "hpc" kernel takes a float32 weight only), no aiter. Else ``(None, reason)``, and SGLang's GEMM runs:
    aiter's ``tgemm`` (ROCm) rounds ``kv_score`` to bf16; a GGUF ``qweight`` (no ``weight``) goes through
    ``fused_mul_mat_gguf``; a weight of another dtype (quantized, float32) or layout is read SGLang's way."""
    module = _sglang_compressor_module(compressor)
    if module is None:
        return None, "the compressor's compute_kv_score is not SGLang's Compressor's: kept"
    if getattr(module, "_use_aiter", False):
        return None, "aiter's tgemm (ROCm) rounds kv_score to bf16"
    weight = getattr(getattr(compressor, "wkv_gate", None), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None, "wkv_gate has no weight tensor (GGUF qweight)"
    if weight.dtype != torch.bfloat16:
        return None, f"wkv_gate.weight is {weight.dtype}, not bf16 (quantized or float32)"
    if tuple(weight.shape) != (width, dim):
        return None, f"wkv_gate.weight is {list(weight.shape)}, not [2W, D] = [{width}, {dim}]"
    if dim > 1 and weight.stride(1) != 1:
        return None, "wkv_gate.weight is not row-major [2W, D]"
    return weight, None


def kv_score_differs(compressor, x: torch.Tensor, forward_batch) -> str | None:
    """Why SGLang's ``compute_kv_score(x, forward_batch)`` would not be ``x @ W.T`` of this step's rows, or
    ``None``: under prefill context parallelism (SGLang's own ``dsa_use_prefill_cp(forward_batch)``, a host
    check) it gathers ``kv_score`` across the ranks (``cp_materialize_global_token_order``); an ``x`` that is not
    bf16 with unit column stride goes through SGLang's float32 fallback or is not what our kernel reads."""
    module = _sglang_compressor_module(compressor)
    use_cp = getattr(module, "dsa_use_prefill_cp", None)
    if use_cp is None:
        return "SGLang's compressor module has no dsa_use_prefill_cp: prefill context parallelism unknown"
    if use_cp(forward_batch):
        return "prefill context parallel: SGLang gathers kv_score across the ranks"
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}, not bf16"
    if x.shape[1] > 1 and x.stride(1) != 1:
        return "x has no unit column stride"
    return None


def projection_workspaces(
    hidden_size: int, max_rows: int, *, head_dim: int = 512, index_head_dim: int = 128, ratios=(4, 128)
) -> dict[str, tuple[int, dict[int, int]]]:
    """``group -> (float32 elements, {2W: rows})`` of the projection workspaces one adapter allocates
    (:meth:`SGLangCompressor.allocate_projection`) for a model of ``hidden_size`` (``D``), compressor heads
    ``head_dim`` / ``index_head_dim`` and the layers' ``ratios`` (``compress_ratios``): group ``"main"`` holds
    the C4 main (``2W = 4 * head_dim``) and HCA (``2 * head_dim``) projections, ``"indexer"`` the indexer's
    (``4 * index_head_dim``), each for steps of ``min(ops.projection_triton_rows(2W, D), max_rows)`` rows, and
    ``"pair"`` a C4 layer's two projections in one launch on its joined weights (``2W = 4 * head_dim + 4 *
    index_head_dim``, up to ``ops.joint_pair_triton_rows`` rows); a width our kernel never serves (0 rows)
    needs nothing, a group without any is left out. DeepSeek-V4-Flash (D = 4096) at ``max_rows >= 256``: main
    2.27 MiB (64 rows), indexer 2.52 MiB (256 rows), pair 1.89 MiB (64 rows); V4-Pro (7168): main 2.52 MiB, no
    indexer or pair workspace (cuBLAS is as fast there)."""
    widths = {"main": [], "indexer": []}
    ratios = {int(r) for r in ratios}
    if 4 in ratios:
        widths["main"].append(4 * int(head_dim))
        widths["indexer"].append(4 * int(index_head_dim))
    if any(r > 4 for r in ratios):
        widths["main"].append(2 * int(head_dim))
    out = {}
    for group, sizes in widths.items():
        rows = {w: min(ops.projection_triton_rows(w, hidden_size), int(max_rows)) for w in sizes}
        rows = {w: n for w, n in rows.items() if n > 0}
        if rows:
            out[group] = (max(ops.projection_workspace_numel(n, w, hidden_size) for w, n in rows.items()), rows)
    if 4 in ratios:
        pair = (4 * int(head_dim), 4 * int(index_head_dim))
        n = min(ops.joint_pair_triton_rows(*pair, hidden_size), int(max_rows))
        if n > 0:
            out["pair"] = (ops.projection_workspace_numel(n, sum(pair), hidden_size), {sum(pair): n})
    return out


def model_dims(model_config) -> dict[str, Any] | None:
    """The projection's shapes from SGLang's ``ModelConfig`` (``hf_text_config``, else ``hf_config``):
    ``hidden_size``, ``head_dim`` (``qk_nope_head_dim + qk_rope_head_dim`` without one), ``index_head_dim``,
    ``ratios`` (``compress_ratios``; both kinds when absent); ``None`` without a hidden size (no workspace)."""
    cfg = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    hidden = getattr(cfg, "hidden_size", None)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0:
        return None
    head = getattr(cfg, "head_dim", None)
    if not isinstance(head, int) or head <= 0:
        head = int(getattr(cfg, "qk_nope_head_dim", 448)) + int(getattr(cfg, "qk_rope_head_dim", 64))
    index = getattr(cfg, "index_head_dim", None)
    ratios = tuple(int(r) for r in (getattr(cfg, "compress_ratios", None) or ())) or (4, 128)
    return dict(hidden_size=hidden, head_dim=head, index_head_dim=int(index) if index else 128, ratios=ratios)
