"""Per-step compress metadata (what ``DSV4Metadata.c4_compress_metadata`` / ``c128_compress_metadata`` hold
under the adapter), SGLang's constants and the ring bounds."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

from ... import ops

#: SGLang's ``ReqToTokenPool`` keeps row 0 for CUDA-graph padding: padded requests have ``req_pool_indices``
#: 0 (and ``req_to_token[0] == 0``). The adapter turns those rows into plan padding, so they write nothing.
PAD_REQ_INDEX = 0

#: C4 state rows SGLang keeps at the end of each SWA page (what a radix prefix hit on the page boundary reads:
#: the previous group's 4 rows of the overlapping window).
C4_PAGE_TAIL = 4

#: The C4 indexer page of SGLang 0.5.23 (64 slots: ``[64 x 128 fp8][64 x 4 B scale]`` = 8,448 bytes), used when
#: the pool has no ``get_index_k_page_size``.
INDEX_PAGE_SIZE = 64


def _is_overlap(ratio: int) -> bool:
    # SGLang's is_overlap_compress: only the ratio-4 compressors (CSA main and indexer) have overlapping windows.
    return ratio == 4


def _ring_rows(ratio: int, mtp_step: int, *, decode: bool = False) -> int:
    """Smallest ring per request slot (or per SWA page) that holds a window and ``mtp_step`` rejected drafts:
    ``window - 1 + mtp_step`` rows when the state is saved after every window's reads (two launches), one more
    when a decode step compresses and saves in one launch (``ops._ring_need``)."""
    window = 2 * ratio if _is_overlap(ratio) else ratio
    need = max(window, window - 1 + mtp_step + (1 if decode else 0))
    return need if _is_overlap(ratio) else -(-need // 4) * 4


#: SGLang's largest draft depth: its C4 ring (16 with speculation) keeps ``mtp_pad`` rows resident for up to
#: 10 draft tokens (``c_plan.cuh``). At E = 10 a verify step needs 17 rows to compress and save in one launch,
#: so the adapter plans it as a prefill step (save after the reads: 16 rows suffice).
MAX_DRAFT_TOKENS = 10

#: How :meth:`SGLangCompressor.forward_unified` projects ``x``: ``"auto"`` (our Triton projection fused before the
#: compression, ``ops.compress_from_hidden``, on steps of at most ``ops.projection_triton_rows(2W, D)`` rows, where
#: it measured faster than cuBLAS; SGLang's ``compute_kv_score`` elsewhere) or ``"engine"`` (SGLang's, always).
PROJECTIONS = ("auto", "engine")


# ---------------------------------------------------------------------------------------------------------------
# Per-step metadata
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SGLangCompressMetadata:
    """One step's metadata of one ratio, shared by every layer of that ratio (and by both C4 compressors):
    what ``DSV4Metadata.c4_compress_metadata`` / ``c128_compress_metadata`` hold once the adapter is in.

    ``plan`` (int32, from ``ops.empty_plan``), and for ``addressing == "token_map_ring"`` the state-row tables
    ``read_rows`` / ``save_rows`` (int32); ``num_tokens`` is the step's (padded) token count the plan was built
    for and ``num_slots`` the request slots (``req_to_token.shape[0]``).
    """

    ratio: int
    decode: bool
    addressing: str  # "req_ring" (the kernel computes slot * ring + pos % ring) or "token_map_ring" (tables)
    ring: int
    num_tokens: int
    num_slots: int
    plan: torch.Tensor
    read_rows: torch.Tensor | None = None
    save_rows: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        # SGLang code reads ``plan.is_decode`` on its compress metadata.
        return self.decode

    def copy_(self, other: SGLangCompressMetadata) -> None:
        """Refresh in place from ``other`` (``DSV4Metadata.copy_`` → ``maybe_copy_inplace``): what CUDA-graph
        replay does when the metadata was built outside the graph. Shapes are static per graph, so they must
        agree; only the tensors' contents change (the captured kernels read them by address)."""
        if type(other) is not type(self):
            raise TypeError(f"copy_: expected {type(self).__name__}, got {type(other).__name__}")
        static = ("ratio", "decode", "addressing", "ring", "num_tokens", "num_slots")
        mine, theirs = (tuple(getattr(m, f) for f in static) for m in (self, other))
        if mine != theirs:
            raise ValueError(f"copy_: metadata differ in {static}: {mine} vs {theirs} (a graph replays one shape)")
        for name in ("plan", "read_rows", "save_rows"):
            dst, src = getattr(self, name), getattr(other, name)
            if (dst is None) != (src is None) or dst is not None and dst.shape != src.shape:
                raise ValueError(f"copy_: {name} differs in shape")
            if dst is not None:
                ops.copy_plan(dst, src)  # with the build record compress checks its calls against


# A target-verify step brings at most E rows per request (E = draft tokens): SGLang plans it with its prefill
# planner, but our kernels can then compress and save in one launch (``decode=True``). ``install`` wraps the
# backend's verify metadata builders to set this while they run.
_VERIFY = contextvars.ContextVar("dsv4c_sglang_verify", default=False)


@contextlib.contextmanager
def verify_step():
    """Metadata built inside this block is for a target-verify step (``decode=True``)."""
    token = _VERIFY.set(True)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def _resolved(device) -> torch.device:
    """``device`` as a tensor on it reports it: ``torch.device("cuda")`` (what SGLang's backend holds) is not
    equal to the ``cuda:0`` of the step's tensors, so a buffer keyed or checked by it would be looked up anew."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
