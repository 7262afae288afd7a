"""Per layer: LightLLM's compressor calls as one op on its own buffers (and the paired C4 decode step)."""

from __future__ import annotations

import weakref

import torch

from ... import ops
from .._pairing import HeldScore, compress_pair_of, pair_kv_score, tensor_key
from .banks import c128_state_banks
from .layout import _BUILDER, _C4_PLAN, _C4_READ, _C4_SAVE, _C128_PLAN, _C128_SCRATCH, C4_RATIO, INDEXER_PACK
from .step import StepBuilder


def _step_tensor(infer_state, name: str) -> torch.Tensor:
    t = getattr(infer_state, name, None)
    if t is None:
        raise RuntimeError(
            f"lightllm adapter: infer_state has no {name}: the step builder did not run (dsv4c_lightllm.install() "
            f"patches DeepseekV4InferStateInfo.init_some_extra_state; or call StepBuilder.build(infer_state))"
        )
    return t


def _layer_op(kind: str, infer_state, layer_idx: int, *, ape, norm_weight, cos, sin, eps):
    """The op of one compressor of one layer on LightLLM's buffers: ``(builder, op name, positional arguments
    after kv_score, keyword arguments)`` (views and attribute reads only, no device work)."""
    builder: StepBuilder = _step_tensor(infer_state, _BUILDER)
    lay = builder.layout
    mm = infer_state.mem_manager
    decode = not infer_state.is_prefill
    head = norm_weight.shape[0]
    args = dict(norm_weight=norm_weight, cos=cos, sin=sin, eps=eps, decode=decode)
    if kind in ("c4", "indexer"):
        plan = _step_tensor(infer_state, _C4_PLAN)
        args.update(read_rows=_step_tensor(infer_state, _C4_READ), save_rows=_step_tensor(infer_state, _C4_SAVE))
        ape = ape.view(C4_RATIO, 2, head)
        if kind == "c4":
            args.update(state=mm.get_c4_state_buffer(layer_idx), out_pages=mm.get_compressed_kv_buffer(layer_idx),
                        kind="csa", page_size=lay.c4_page_size)  # fmt: skip
        else:
            pages = mm.c4_indexer_pool.get_layer_buffer(mm.layer_to_c4_idx[layer_idx])
            args.update(state=mm.get_c4_indexer_state_buffer(layer_idx), out_pages=pages, kind="indexer",
                        page_size=lay.indexer_page_size, indexer_pack=INDEXER_PACK)  # fmt: skip
        return builder, "compress", (plan, ape), args
    if kind != "c128":
        raise ValueError(f"compress_layer: kind must be 'c4', 'indexer' or 'c128', got {kind!r}")
    plan = _step_tensor(infer_state, _C128_PLAN)
    ape = ape.view(lay.c128_ratio, 1, head)
    args.update(out_pages=mm.get_compressed_kv_buffer(layer_idx), page_size=lay.c128_page_size)
    if builder.online_hca:
        scratch = None if decode else _step_tensor(infer_state, _C128_SCRATCH)  # prefill steps split
        args.update(state_banks=c128_state_banks(mm, layer_idx), scratch=scratch)
        return builder, "compress_online_hca", (plan, ape), args
    scratch = _step_tensor(infer_state, _C128_SCRATCH) if builder.c128_kernel == "tiled" else None
    args.update(state=mm.get_c128_state_buffer(layer_idx), kind="hca", ring=lay.c128_state_ring, scratch=scratch)
    return builder, "compress", (plan, ape), args


def compress_layer(
    kind: str,
    kv_score: torch.Tensor,
    infer_state,
    layer_idx: int,
    *,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> None:
    """One compressor of one layer for the step: a single op on LightLLM's buffers.

    ``kind``: ``"c4"`` (the CSA latent), ``"indexer"`` (the C4 layer's indexer keys, FP8 packs only) or
    ``"c128"`` (the HCA latent; ring or online banks as the step's builder says). ``kv_score``: fp32 ``[T, 2W]``
    from LightLLM's GEMM (not written). ``ape``: the checkpoint's ``[r, coff * H]`` weight (viewed here as
    ``[r, coff, H]``); ``norm_weight``: bf16 ``[H]``; ``cos`` / ``sin``: the layer's compress rope tables.
    """
    _, name, args, kwargs = _layer_op(kind, infer_state, layer_idx, ape=ape, norm_weight=norm_weight, cos=cos,
                                      sin=sin, eps=eps)  # fmt: skip
    getattr(ops, name)(kv_score, *args, **kwargs)


def compress_layer_from_hidden(
    kind: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    infer_state,
    layer_idx: int,
    *,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> None:
    """:func:`compress_layer` from the layer's hidden states: ``ops.compress_from_hidden`` (or
    ``ops.compress_online_hca_from_hidden``) projects ``x`` (bf16 ``[>= T, D]``) with ``weight`` (bf16 ``[2W, D]``,
    unit stride along ``D``: ``.t()`` of LightLLM's ``[D, 2W]`` weight view) through the step builder's
    projection workspace, then compresses as :func:`compress_layer` does. For steps of at most
    ``builder.triton_rows(2W, D)`` rows (where the Triton projection is the faster path)."""
    builder, name, args, kwargs = _layer_op(kind, infer_state, layer_idx, ape=ape, norm_weight=norm_weight, cos=cos,
                                            sin=sin, eps=eps)  # fmt: skip
    mb = int(getattr(infer_state, "microbatch_index", 0) or 0)
    ws = builder.projection_workspace(mb, "indexer" if kind == "indexer" else "main", weight.shape[0], x.shape[1])
    getattr(ops, name + "_from_hidden")(x, weight, ws, *args, projection="auto", **kwargs)


def _gemm(linear, x: torch.Tensor, use_custom_tensor_manager: bool) -> torch.Tensor:
    """LightLLM's replicated bf16 GEMM to fp32 ``kv_score``. The allocator flag (spelled as LightLLM spells it)
    is passed only when off: the prefill aux stream must not use the main stream's tensor manager."""
    if use_custom_tensor_manager:
        return linear.mm(x, out_dtype=torch.float32)
    return linear.mm(x, use_custom_tensor_mananger=False, out_dtype=torch.float32)


#: LightLLM weight object -> (the tensor it was read from, the ``[2W, D]`` weight or the reason there is none).
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def projection_weight(linear, width: int, dim: int) -> tuple[torch.Tensor | None, str | None]:
    """The ``[2W, D]`` weight ``ops.compress_from_hidden`` takes, from LightLLM's weight object, as
    ``(weight, None)``; or ``(None, reason)`` where the op cannot read it, and LightLLM's GEMM runs. LightLLM's
    ``ROWMMWeight`` (``support_ds4``: ``mm_weight.py`` ``MMWeightTpl``) keeps the checkpoint's row-major ``[2W, D]``
    in ``mm_param.weight`` and, unquantized, a ``NoQuantization`` (``method_name`` ``"none"``) as its
    ``quant_method``; its ``mm`` is ``torch.mm(x, weight.t(), out_dtype=float32)``. An older layout kept a
    ``weight`` attribute, the ``[D, 2W]`` transposed view (``_process_weight``): read as ``weight.t()``. Refused:
    a quantization method, a bias, another dtype or shape, a weight without unit stride along ``D``. Cached per
    weight object and tensor."""
    pack = getattr(linear, "mm_param", None)
    tensor = getattr(pack, "weight", None) if pack is not None else getattr(linear, "weight", None)
    try:
        cached = _WEIGHTS.get(linear)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is not None and cached[0] is tensor:
        return cached[1]
    quant = getattr(linear, "quant_method", None)
    method = getattr(quant, "method_name", None)
    if quant is not None and method != "none":
        found = None, f"the weight is quantized (quant_method {method or type(quant).__name__})"
    elif getattr(linear, "bias", None) is not None:
        found = None, "the GEMM has a bias"
    elif not isinstance(tensor, torch.Tensor):
        found = None, f"{type(linear).__name__} has no weight tensor (mm_param.weight)"
    elif tensor.dtype != torch.bfloat16:
        found = None, f"the weight is {tensor.dtype}, not bf16"
    elif pack is not None:  # [2W, D] row-major
        if tuple(tensor.shape) != (width, dim):
            found = None, f"mm_param.weight is {list(tensor.shape)}, not [2W, D] = [{width}, {dim}]"
        elif dim > 1 and tensor.stride(1) != 1:
            found = None, "mm_param.weight [2W, D] has no unit stride along D"
        else:
            found = tensor, None
    elif tuple(tensor.shape) != (dim, width):
        found = None, f"the weight is {list(tensor.shape)}, not the [D, 2W] = [{dim}, {width}] view"
    elif dim > 1 and tensor.stride(0) != 1:
        found = None, "the weight [D, 2W] is not the transposed view of a row-major [2W, D] tensor"
    else:
        found = tensor.t(), None
    try:
        _WEIGHTS[linear] = (tensor, found)
    except TypeError:
        pass
    return found


def _x_key(x: torch.Tensor, builder: StepBuilder, layer_idx: int) -> tuple:
    return (layer_idx, builder.steps, *tensor_key(x))


#: The layer weights of each C4 compressor's parameters (LightLLM's ``DeepseekV4TransformerLayerWeight``):
#: ``wkv_gate`` linear, APE, norm.
_C4_WEIGHTS = {
    "c4": ("compressor_wkv_gate_", "compressor_ape_", "compressor_norm_"),
    "indexer": ("idx_cmp_wkv_gate_", "idx_cmp_ape_", "idx_cmp_norm_"),
}


def _compressed_with(kind: str, layer_weight, cos, sin, eps) -> tuple:
    """What a C4 compressor's compression reads besides its ``kv_score`` and LightLLM's buffers (compared by
    identity; ``eps`` by value)."""
    _, ape, norm = _C4_WEIGHTS[kind]
    return (id(getattr(layer_weight, ape).weight), id(getattr(layer_weight, norm).weight), id(cos), id(sin), eps)


def _compress_c4_pair(kv: dict, infer_state, layer_weight, layer_idx: int, cos, sin, eps) -> None:
    """Both compressors of a C4 layer (``kv``: each kind's ``kv_score`` columns) in one ``ops.compress_pair`` on
    LightLLM's buffers, each with its own APE and norm weight and this call's rope tables and ``eps``."""
    calls = {}
    for kind, (_, ape, norm) in _C4_WEIGHTS.items():
        weights = dict(ape=getattr(layer_weight, ape).weight, norm_weight=getattr(layer_weight, norm).weight)
        _, _, args, kwargs = _layer_op(kind, infer_state, layer_idx, cos=cos, sin=sin, eps=eps, **weights)
        calls[kind] = ((kv[kind], *args), kwargs)
    compress_pair_of(calls["c4"], calls["indexer"])


def _paired_step(builder: StepBuilder, kind: str, x, infer_state, layer_weight, layer_idx: int, cos, sin,
                 eps) -> bool:  # fmt: skip
    """On a decode step, a C4 layer's compressor ``kind`` (``"c4"`` / ``"indexer"``) through its pair; ``True``
    where it is done (its entries and state written), ``False`` where the pair does not apply (a prefill step,
    a larger step, a weight the op cannot read) and the caller's own path runs.

    LightLLM's decode calls ``compressor.compress(x)`` then ``write_indexer_k(x)`` (``transformer_layer_infer.py``).
    The first of the two projects both weights in one call and compresses both in one ``ops.compress_pair``
    (each compressor's APE and norm weight from the layer's weights; the rope tables and ``eps`` of this call),
    and holds what it did; the second is then done if its ``x`` is the same tensor, unchanged, on the same
    stream, in the same step, and it reads the same APE, norm weight, rope tables and ``eps``; if only the ``x``
    matches, it compresses the held columns with its own arguments (a decode step's windows read no row the
    step saves, so compressing again rewrites the same state and the right entries); else it projects afresh.
    The projection is :func:`~.._pairing.pair_kv_score` with the builder's ``"pair"`` workspace on steps of at
    most ``builder.pair_rows(D)`` rows: where :func:`join_c4_weights` made the two weights one tensor's halves,
    our one Triton launch over the halves up to ``ops.joint_pair_triton_rows`` rows (faster than cuBLAS beside
    the attention's own GEMM), on larger decode steps the builder serves one cuBLAS GEMM of the joint weight into
    a float32 ``[T, 2W_main + 2W_indexer]`` allocated as LightLLM's GEMM allocates its output; apart, our one
    launch up to ``builder.pair_rows(D)`` rows."""
    rows, dim = infer_state.position_ids.shape[0], x.shape[1]
    if infer_state.is_prefill or not 0 < rows <= builder.projection_rows:
        return False
    mb = int(getattr(infer_state, "microbatch_index", 0) or 0)
    key = _x_key(x, builder, layer_idx)
    held, builder._paired[mb] = builder._paired[mb], None
    mine = _compressed_with(kind, layer_weight, cos, sin, eps)
    if held is not None and held.key == key and held.kind == kind:
        if held.compressed != mine:
            ape, norm = (getattr(layer_weight, name).weight for name in _C4_WEIGHTS[kind][1:])
            compress_layer(kind, held.kv_score, infer_state, layer_idx, ape=ape, norm_weight=norm, cos=cos, sin=sin,
                           eps=eps)  # fmt: skip
        return True
    first, second = builder.c4_widths
    w_main, why_main = projection_weight(layer_weight.compressor_wkv_gate_, first, dim)
    w_idx, why_idx = projection_weight(layer_weight.idx_cmp_wkv_gate_, second, dim)
    if w_main is None or w_idx is None:
        return False  # the compressor's own path counts the fallback
    ws = builder.projection_workspace(mb, "pair", first + second, dim) if rows <= builder.pair_rows(dim) else None
    kv = pair_kv_score(x, w_main, w_idx, rows, ws)
    if kv is None:
        return False
    columns = {"c4": kv[:, :first], "indexer": kv[:, first:]}
    _compress_c4_pair(columns, infer_state, layer_weight, layer_idx, cos, sin, eps)
    other = "indexer" if kind == "c4" else "c4"
    done = _compressed_with(other, layer_weight, cos, sin, eps)
    builder._paired[mb] = HeldScore(key, other, columns[other], compressed=done)
    return True


def join_c4_weights(layer_weights) -> int:
    """Make each C4 layer's two compressor weights (``compressor_wkv_gate_`` and ``idx_cmp_wkv_gate_``: LightLLM's
    ``ROWMMWeight``, unquantized bf16 ``[2W, D]`` in ``mm_param.weight``) the halves of one tensor
    (``ops.join_pair_weights``), so a decode step projects both in one GEMM (:func:`_paired_step`); returns
    the number of layers whose weights are joined. Every ``WeightPack`` of the weight object
    (``mm_param`` and the ``mm_param_list`` views LightLLM's loader writes into, ``weight_pack.weight[:].copy_``)
    is re-pointed at the same offsets of the joint tensor, so a load after the join (LightLLM loads after it
    sizes its KV cache: ``basemodel.py`` ``_init_weights``, ``_init_mem_manager``, ``load_weights``) fills it.
    Called by the patched ``DeepseekV4TpPartModel._init_mem_manager`` before LightLLM's own, so the two old
    tensors are freed (and on CUDA the cache emptied) before the KV cache is sized. A layer whose weight objects
    the op cannot read, or whose packs do not all view the one weight, is left as it is."""
    joined = 0
    for layer_weight in layer_weights:
        linears = [getattr(layer_weight, name, None) for name in ("compressor_wkv_gate_", "idx_cmp_wkv_gate_")]
        if any(getattr(linear, "mm_param", None) is None for linear in linears):
            continue
        weights = [linear.mm_param.weight for linear in linears]
        if not all(isinstance(w, torch.Tensor) and w.ndim == 2 for w in weights):
            continue
        dim = int(weights[0].shape[1])
        if any(projection_weight(linear, int(w.shape[0]), dim)[1] is not None for linear, w in zip(linears, weights)):
            continue
        if ops.joint_pair_weight(*weights) is not None:
            joined += 1
            continue
        packs = [_packs_viewing(linear, w) for linear, w in zip(linears, weights)]
        if any(p is None for p in packs) or any(w.stride() != (dim, 1) for w in weights):
            continue
        with torch.no_grad():
            joint = ops.join_pair_weights(*weights)
        lo = 0
        for linear_packs, w in zip(packs, weights):
            base = w.storage_offset()
            for pack in linear_packs:
                t = pack.weight
                pack.weight = joint.as_strided(t.shape, t.stride(), lo * dim + t.storage_offset() - base)
            lo += int(w.shape[0])
        del joint, weights, packs
        if linears[0].mm_param.weight.is_cuda:
            torch.cuda.empty_cache()  # the two old tensors' blocks back before the next layer's copy
        joined += 1
    return joined


def _packs_viewing(linear, weight: torch.Tensor):
    """``linear``'s weight packs (``mm_param`` and ``mm_param_list``), if each holds a view of ``weight``'s rows
    (its storage, within its span); else ``None``."""
    packs = [linear.mm_param, *(getattr(linear, "mm_param_list", None) or [])]
    storage = weight.untyped_storage().data_ptr()
    lo, hi = weight.storage_offset(), weight.storage_offset() + weight.numel()
    for pack in packs:
        t = getattr(pack, "weight", None)
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() != storage:
            return None
        if t.stride() != weight.stride() or not lo <= t.storage_offset() <= t.storage_offset() + t.numel() <= hi:
            return None
    return packs


def compressor_compress(self, x, infer_state, layer_weight, cos_table, sin_table, use_custom_tensor_manager=True):
    """Replacement of ``CompressorInfer.compress`` (C4 main, C128, or the indexer when ``is_in_indexer``): with
    the builder's ``projection="auto"``: on a decode step of at most ``builder.pair_rows(D)`` rows (every decode
    step the builder serves where the weights are joined), a C4 layer's two compressors share one projection and
    one compression (:func:`_paired_step`); on a
    step of at most ``builder.triton_rows(2W, D)`` rows, :func:`compress_layer_from_hidden` (our projection and
    compression, ``kv_score`` in the builder's workspace); otherwise, or where :func:`projection_weight` finds no
    weight the op reads, LightLLM's GEMM then :func:`compress_layer`. Returns ``None``: the entries are in
    LightLLM's pools."""
    ratio = self.compress_ratio
    if ratio == 0:
        return None
    if self.is_in_indexer:
        kind, linear, norm, ape = "indexer", "idx_cmp_wkv_gate_", "idx_cmp_norm_", "idx_cmp_ape_"
    else:
        kind = "c4" if ratio == C4_RATIO else "c128"
        linear, norm, ape = "compressor_wkv_gate_", "compressor_norm_", "compressor_ape_"
    linear = getattr(layer_weight, linear)
    norm_weight = getattr(layer_weight, norm).weight
    layer = dict(ape=getattr(layer_weight, ape).weight, norm_weight=norm_weight, cos=cos_table, sin=sin_table,
                 eps=self.eps)  # fmt: skip
    builder = getattr(infer_state, _BUILDER, None)
    width = 2 * norm_weight.shape[0] * (1 if kind == "c128" else 2)
    if builder is not None and kind != "c128":
        if _paired_step(builder, kind, x, infer_state, layer_weight, self.layer_idx_, cos_table, sin_table, self.eps):
            return None
    if builder is not None and 0 < infer_state.position_ids.shape[0] <= builder.triton_rows(width, x.shape[1]):
        weight, reason = projection_weight(linear, width, x.shape[1])
        if weight is not None:
            compress_layer_from_hidden(kind, x, weight, infer_state, self.layer_idx_, **layer)
            return None
        builder.projection_fallbacks[reason] = builder.projection_fallbacks.get(reason, 0) + 1
    kv_score = _gemm(linear, x, use_custom_tensor_manager)
    compress_layer(kind, kv_score, infer_state, self.layer_idx_, **layer)
    return None


def write_indexer_k(self, x, infer_state, layer_weight, cos_table, sin_table, use_custom_tensor_manager=True):
    """Replacement of ``DeepseekV4IndexInfer.write_indexer_k`` (indexer compress, ``hadamard_transform`` and
    ``pack_indexer_k_to_cache``): the GEMM, then one op writing the 132-byte packs into ``c4_indexer_pool``."""
    if self.compress_ratio != C4_RATIO:
        return
    compressor_compress(self.indexer_compressor, x, infer_state, layer_weight, cos_table, sin_table,
                        use_custom_tensor_manager)  # fmt: skip
