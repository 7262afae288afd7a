"""The per-step metadata of the vLLM adapter: each compressor-state group's persistent buffers
(:class:`VllmCompressorPlanner`) and one step's plan (:class:`VllmStepPlan`); package docstring: the mapping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ... import ops
from ...errors import OpError

#: vLLM's compressor-state block sizes (``CompressorStateCache.__init__``): C4 blocks of 4 rows, C128 of 8.
VLLM_STATE_BLOCK_SIZE = {4: 4, 128: 8}

#: Attribute of vLLM's ``CompressorMetadata`` that carries our per-step handle.
STEP_ATTR = "dsv4c_step"
#: Attribute of the patched builder that holds its persistent buffers.
PLANNER_ATTR = "_dsv4c_planner"


# ---------------------------------------------------------------------------------------------------------------
# Per-step metadata
# ---------------------------------------------------------------------------------------------------------------
class VllmCompressorPlanner:
    """The persistent buffers of one compressor-state KV-cache group, allocated once (vLLM: in
    ``CompressorMetadataBuilder.__init__``), and the per-step build into them.

    Args:
        block_size: the state group's block size (rows per block: 4 for C4, 8 for C128).
        window: positions one entry pools (vLLM's ``sliding_window`` of the state spec: 8 for C4, 128 for
            C128); ``None`` for a group that only runs the online HCA op (no state-row tables).
        max_num_tokens: rows of the largest step (``max_num_batched_tokens``, padding included).
        max_num_reqs: requests of the largest step (``max_num_seqs``): the plan's request capacity.
        mtp_step: ``num_speculative_tokens`` (0 without MTP): a step with at most ``mtp_step + 1`` rows per
            request is a decode step.
        debug: run ``ops.check_plan`` after every build and raise on a bad plan (synchronises: debug only).
    """

    def __init__(
        self,
        *,
        block_size: int,
        window: int | None,
        max_num_tokens: int,
        max_num_reqs: int,
        device,
        mtp_step: int = 0,
        debug: bool = False,
    ):
        self.block_size, self.window = int(block_size), window
        self.max_num_tokens, self.max_num_reqs = int(max_num_tokens), int(max_num_reqs)
        self.mtp_step, self.debug = int(mtp_step), bool(debug)
        self.device = torch.device(device)
        # Sized for the smallest ratio this window can have (overlapping windows are 2r wide), so the one buffer
        # fits whichever ratio the group's layers turn out to have: a smaller ratio needs a larger plan.
        self.min_ratio = max(1, (window or 2) // 2)
        # One allocation, viewed per request capacity (plan_for): a step's grids follow its own request count,
        # not max_num_seqs, and every view starts at the same address (CUDA graphs replay fixed addresses).
        numel = ops.plan_numel(self.max_num_tokens, self.max_num_reqs, self.min_ratio) + self.max_num_reqs
        self._plan_memory = torch.full((numel,), -1, dtype=torch.int32, device=self.device)
        self._plans: dict[int, torch.Tensor] = {}
        self.row_req = torch.full((self.max_num_tokens,), -1, dtype=torch.int32, device=self.device)
        self.row_index = torch.arange(self.max_num_tokens, dtype=torch.int32, device=self.device)
        # A compressed-KV slot mapping shorter than the step is copied here and padded with -1; one buffer, so a
        # CUDA graph captured on a padded step reads the same address on every replay.
        self.out_slot = torch.full((self.max_num_tokens,), -1, dtype=torch.int64, device=self.device)
        self.save_rows = torch.full((self.max_num_tokens,), -1, dtype=torch.int64, device=self.device)
        self._save_views: dict[int, torch.Tensor] = {}
        self.read_rows = None
        if window is not None:
            self.read_rows = torch.full((self.max_num_reqs, window - 1), -1, dtype=torch.int64, device=self.device)
        self.err = torch.zeros(4, dtype=torch.int32, device=self.device) if debug else None
        # the first error a check inside a captured graph found (replays cannot sync): read at the next eager build
        self.captured_err = torch.zeros(4, dtype=torch.int32, device=self.device) if debug else None

    @property
    def plan(self) -> torch.Tensor:
        """The plan view of the full request capacity (``max_num_reqs``)."""
        return self.plan_for(self.max_num_reqs)

    def plan_for(self, requests: int) -> torch.Tensor:
        """The plan view of capacity ``requests`` (``[requests, k]`` at the start of the one allocation). The
        views are kept: a plan's build record lives on the tensor object, and a captured graph's view stays
        alive with the planner."""
        plan = self._plans.get(requests)
        if plan is None:
            if not 1 <= requests <= self.max_num_reqs:
                raise OpError(f"vllm: a plan of {requests} requests; the planner holds {self.max_num_reqs}")
            numel = ops.plan_numel(self.max_num_tokens, requests, self.min_ratio)
            k = -(-numel // requests)
            plan = self._plans[requests] = self._plan_memory[: requests * k].view(requests, k)
        return plan

    def save_rows_for(self, rows: int) -> torch.Tensor:
        """``save_rows[:rows]``, one view object per length (the tables' build record lives on it): the state-row
        launch of a larger step has one program per 256 entries of it, so its length is the step's."""
        view = self._save_views.get(rows)
        if view is None:
            view = self._save_views[rows] = self.save_rows[:rows]
        return view

    def requests_for(self, rows: int, block_table_rows: int) -> int:
        """The request capacity of a step of ``rows`` rows whose block table has ``block_table_rows`` rows: the
        plan's requests are runs of rows with one request index, and every index a row carries is below the
        block table's rows (vLLM slices it to the step's requests, padded ones included) and is one of ``rows``.
        Both are shapes, so a captured graph keeps a capacity that holds every batch it replays: vLLM captures
        a piecewise graph of ``T`` tokens on ``min(T, max_num_seqs)`` requests, a FULL one on its replays'."""
        return max(1, min(self.max_num_reqs, int(rows), int(block_table_rows)))

    def begin_step(self, *, decode: bool, query_start_loc: torch.Tensor | None = None) -> VllmStepPlan:
        """The handle of a new step (host only: vLLM's ``build`` attaches it to ``CompressorMetadata``), with the
        step's device ``query_start_loc`` (an online step's rows past its last entry are padding)."""
        return VllmStepPlan(self, bool(decode), query_start_loc=query_start_loc)

    def is_decode(self, max_query_len: int) -> bool:
        """vLLM's uniform-decode batch: no request brings more than ``1 + num_speculative_tokens`` rows."""
        return int(max_query_len) <= self.mtp_step + 1


@dataclass(eq=False)
class VllmStepPlan:
    """One step's plan of one state group: built once (:meth:`build`), read by every layer of the group."""

    planner: VllmCompressorPlanner
    decode: bool  # the metadata's claim: a uniform-decode batch (VllmCompressorPlanner.is_decode)
    rows: int = -1  # T, the step's rows (padding included); -1 until built
    ratio: int = 0
    online: bool = False
    requests: int = 0  # the plan's request capacity (VllmCompressorPlanner.requests_for)
    decode_path: bool = False  # what the launches take: decode, unless recorded for any batch (build)
    owner: Any = None  # the layer that built it first: it rebuilds in every forward pass, the others reuse
    source: Any = field(default=None, repr=False)  # (state metadata, out_slot) it was last built from
    query_start_loc: torch.Tensor | None = field(default=None, repr=False)  # the step's, on the device
    _plan: torch.Tensor | None = field(default=None, repr=False)

    @property
    def plan(self) -> torch.Tensor:
        return self._plan if self._plan is not None else self.planner.plan

    @property
    def read_rows(self) -> torch.Tensor | None:
        return None if self.online else self.planner.read_rows

    @property
    def save_rows(self) -> torch.Tensor | None:
        return None if self.online or not self.built else self.planner.save_rows_for(self.rows)

    @property
    def built(self) -> bool:
        return self.rows >= 0

    def build(
        self,
        positions: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        out_slot: torch.Tensor,
        *,
        ratio: int,
        online: bool = False,
        num_bank_slots: int | None = None,
        replays_any_batch: bool = False,
    ) -> VllmStepPlan:
        """Build the plan (and, for the ring state, the ``block_table`` state-row tables) from vLLM's tensors.

        ``T = slot_mapping.shape[0]`` (vLLM's ``num_actual``, padding included); ``positions`` is read on its
        first ``T`` rows. ``token_to_req_indices`` and ``out_slot`` may be shorter: vLLM sizes both by
        ``num_actual_tokens``, the unpadded count outside FULL CUDA graphs, while the slot mappings keep the
        padded one; the rows past them are padding (a shorter ``out_slot`` goes through the planner's
        persistent buffer, ``-1`` on the missing rows). A longer ``out_slot`` is refused. Rows whose state
        ``slot_mapping`` is ``-1`` are padding. With ``online=True`` a request's bank slot is its block in the
        request-scoped group, ``block_table[req, 0]``, which ``build_plan`` looks up itself (``req_state_slot``),
        and ``num_bank_slots`` is the banks tensor's first dimension; such a group's ``slot_mapping`` is all
        ``-1`` (vLLM maps no slots for a ``CircularBufferSpec``), so a row is padding where its request holds the
        null block 0 (a padded request, a dummy batch; a scheduled request always has its block), its index
        is out of the block table, or it lies past the step's last request's rows (``query_start_loc[-1]``,
        from the metadata: vLLM's ``token_to_req_indices`` maps those to request 0).

        The plan's request capacity is :meth:`VllmCompressorPlanner.requests_for` (a shape: ``T`` and the block
        table's rows), so the grids follow the step, not ``max_num_seqs``. ``replays_any_batch``: these launches
        are being captured into a graph that replays other batches of ``T`` rows than this one (vLLM's
        piecewise graphs: :func:`recorded_decode`), so the step records the general path even where its own
        metadata is a decode batch (:attr:`decode_path`; ``debug`` checks the plan against that path).
        """
        pl = self.planner
        rows = int(slot_mapping.shape[0])
        if rows > pl.max_num_tokens:
            raise OpError(f"vllm: a step of {rows} rows; the planner holds {pl.max_num_tokens} (max_num_tokens)")
        if positions.shape[0] < rows:
            raise OpError(f"vllm: positions has {positions.shape[0]} rows, slot_mapping {rows}")
        device = pl.plan.device  # a tensor's device carries its index; the planner's may not
        if out_slot.dim() != 1 or out_slot.dtype not in (torch.int32, torch.int64) or out_slot.device != device:
            raise OpError(
                f"vllm: out_slot must be a 1-D int32/int64 tensor on {device}, got {out_slot.dtype} "
                f"{list(out_slot.shape)} on {out_slot.device}"
            )
        # The compressed-KV slot mapping covers vLLM's num_actual_tokens, which outside FULL CUDA graphs is the
        # unpadded count while the state slot mapping has the padded one: shorter is padding, longer is not a
        # step's (vLLM's num_actual_tokens never exceeds the rows of its slot mappings).
        if out_slot.shape[0] > rows:
            raise OpError(f"vllm: out_slot has {out_slot.shape[0]} rows, slot_mapping {rows}")
        if online and num_bank_slots is None:
            raise OpError("vllm: online=True needs num_bank_slots (the banks tensor's first dimension)")
        if not online and pl.read_rows is None:
            raise OpError("vllm: this planner has no window (window=None): it only plans online HCA steps")
        # vLLM pads the slot mappings, not token_to_req_indices, to the padded token count (the V2 runner
        # always; the V1 runner when a backend updates the KV cache outside forward): the rows past
        # token_to_req_indices are padding (their slots are -1), as vLLM's own kernels treat them.
        mapped = min(rows, int(token_to_req_indices.shape[0]))
        row_req = pl.row_req[:rows]
        row_req[:mapped].copy_(token_to_req_indices[:mapped])
        if mapped < rows:
            row_req[mapped:].fill_(-1)
        if online:  # a request-scoped group has no slot mapping (all -1): a padded request holds the null block 0
            tables = block_table.shape[0]
            rows_req = row_req.long().clamp(0, max(tables - 1, 0))
            padded_row = (row_req < 0) | (row_req >= tables) | (block_table[:, 0][rows_req] <= 0)
            if self.query_start_loc is not None:  # vLLM maps the rows past the last request's to request 0
                padded_row |= pl.row_index[:rows] >= self.query_start_loc[-1]
            row_req.masked_fill_(padded_row, -1)
        else:
            row_req.masked_fill_(slot_mapping < 0, -1)  # a padded row's request index is stale
        if out_slot.shape[0] < rows:
            padded = pl.out_slot[:rows]
            padded[: out_slot.shape[0]].copy_(out_slot)
            padded[out_slot.shape[0] :].fill_(-1)
            out_slot = padded
        requests = pl.requests_for(rows, block_table.shape[0])
        plan = pl.plan_for(requests)
        if online:  # the request's bank slot: its block in the request-scoped group, looked up by build_plan
            ops.build_plan(
                plan, positions[:rows], row_req, out_slot, ratio=ratio, num_slots=int(num_bank_slots),
                req_state_slot=block_table[:, 0], mtp_step=pl.mtp_step,
            )  # fmt: skip
        else:  # the plan and its block-table state rows in one build (one launch on decode-sized steps)
            ops.build_plans(
                [plan], positions[:rows], row_req, [out_slot], ratios=[ratio],
                num_slots=int(block_table.shape[0]), mtp_step=pl.mtp_step, read_rows=pl.read_rows,
                save_rows=pl.save_rows_for(rows), state_mode="block_table", block_table=block_table,
                block_size=pl.block_size,
            )  # fmt: skip
        self.rows, self.ratio, self.online, self.requests, self._plan = rows, int(ratio), bool(online), requests, plan
        self.decode_path = self.decode and not replays_any_batch
        if pl.debug:
            ops.check_plan(plan, None, pl.err, mtp_step=pl.mtp_step, decode=self.decode_path)
            if _capturing(pl.device):
                # no host read inside a capture: the graph keeps the first error it finds on replay
                pl.captured_err.copy_(torch.where(pl.captured_err[0] != 0, pl.captured_err, pl.err))
            else:
                for err, where in ((pl.captured_err, " (in a CUDA graph replay)"), (pl.err, "")):
                    message = ops.plan_error(err)  # reads err: a sync, which is why this is debug only
                    if message is not None:
                        err.zero_()
                        raise OpError(f"vllm: {message}{where}")
        return self


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (no host synchronisation allowed)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def recorded_decode(decode: bool, *, graph_mode: str | None, capturing: bool) -> bool:
    """Whether a layer's launches may take the decode path (``decode=True``) on a step whose metadata says
    ``decode``, given the forward context's ``cudagraph_runtime_mode`` name and whether the stream captures.

    A launch run now (not captured) serves this step only: its metadata decides. A captured one serves every
    batch its graph replays. vLLM builds a FULL graph's capture metadata from what it replays (a uniform-decode
    graph on ``1 + num_speculative_tokens`` rows per request, a mixed one with ``max_query_len = T``:
    ``v1/worker/gpu/cudagraph_utils.py`` ``prepare_inputs_to_capture``; the V2 runner captures it with runtime
    mode NONE), so there the metadata decides too. A PIECEWISE graph of ``T`` tokens is captured on a dummy
    batch of ``min(T, max_num_seqs)`` requests of about one token each, which is a decode batch, and replays
    every batch of up to ``T`` tokens (chunked prefill, mixed): it must record the general path."""
    return bool(decode) and not (capturing and graph_mode == "PIECEWISE")
