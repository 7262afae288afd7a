"""Once per step: the plans and state-row tables every compressor layer of the step reads."""

from __future__ import annotations

import torch

from ... import ops
from ...errors import CapacityError
from ...workspace import C128ScratchPlan, Workspace
from .._pairing import HeldScore
from .layout import (
    _BUILDER,
    _C4_PLAN,
    _C4_READ,
    _C4_SAVE,
    _C128_PLAN,
    _C128_SCRATCH,
    C4_RATIO,
    INDEXER_HEAD_DIM,
    PROJECTIONS,
    LightLLMLayout,
    _hidden_size,
)


class _StepBuffers:
    """One micro-batch's persistent per-step buffers (the addresses a captured graph reads)."""

    def __init__(self, layout: LightLLMLayout, max_rows: int, max_requests: int, device, check: bool):
        window = 2 * C4_RATIO  # CSA and indexer windows: 8 rows, 7 of them before the first new row
        self.c4_plan = self.c4_read = self.c4_save = None
        self.c128_plan = None
        if layout.has_c4:
            self.c4_plan = ops.empty_plan(max_rows, max_requests, C4_RATIO, device)
            self.c4_read = torch.full((max_requests, window - 1), -1, dtype=torch.int32, device=device)
            self.c4_save = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        if layout.has_c128:
            self.c128_plan = ops.empty_plan(max_rows, max_requests, layout.c128_ratio, device)
        self.err = torch.zeros(2, 4, dtype=torch.int32, device=device) if check else None


class StepBuilder:
    """LightLLM's per-step compressor metadata, built once per step for every compressor layer.

    Holds persistent buffers for steps of up to ``max_rows`` rows and ``max_requests`` requests (default: the
    layout's ``max_request_num``, the most a step can hold), one set per micro-batch (LightLLM's decode / prefill
    overlap runs two ``infer_state`` at once), and the per-layer options: ``online_hca`` (HCA on the online
    banks of :func:`allot_online_hca_banks`, not the C128 ring; its prefill steps split through the scratch
    below) and ``c128_kernel`` (``"tiled"``: the tiled kernel with a float32 scratch of ``max_rows x
    head_dim`` per micro-batch; ``"single"``: no scratch, the single-stage kernel). ``check=True`` also runs
    ``ops.check_plan`` on every plan (no synchronisation; read the result with :meth:`plan_errors`).
    """

    def __init__(
        self,
        layout: LightLLMLayout,
        *,
        max_rows: int,
        device,
        max_requests: int | None = None,
        microbatches: int = 2,
        online_hca: bool = False,
        c128_kernel: str = "tiled",
        check: bool = False,
        projection: str = "auto",
        hidden_size: int | None = None,
        indexer_head_dim: int = INDEXER_HEAD_DIM,
    ):
        if c128_kernel not in ("tiled", "single"):
            raise ValueError(f"StepBuilder: c128_kernel must be 'tiled' or 'single', got {c128_kernel!r}")
        if max_rows < 1 or microbatches < 1:
            raise ValueError(f"StepBuilder: max_rows and microbatches must be >= 1, got {max_rows}, {microbatches}")
        if projection not in PROJECTIONS:
            raise ValueError(f"StepBuilder: projection must be one of {PROJECTIONS}, got {projection!r}")
        if hidden_size is not None and (isinstance(hidden_size, bool) or not isinstance(hidden_size, int)
                                        or hidden_size < 16 or hidden_size % 16):  # fmt: skip
            raise ValueError(f"StepBuilder: hidden_size must be None or a multiple of 16, got {hidden_size!r}")
        self.layout = layout
        self.max_rows = max_rows
        self.max_requests = layout.max_request_num if max_requests is None else max_requests
        self.online_hca = bool(online_hca)
        self.c128_kernel = c128_kernel
        self.device = torch.device(device)
        self._sets = [
            _StepBuffers(layout, max_rows, self.max_requests, self.device, check) for _ in range(microbatches)
        ]
        self.workspace = None
        if layout.has_c128 and (self.online_hca or c128_kernel == "tiled"):  # online: prefill steps split
            self.workspace = Workspace(C128ScratchPlan(microbatches, max_rows, layout.head_dim), self.device)
        # The projection from hidden states (ops.*_from_hidden) runs on steps of at most triton_rows(2W, D) rows
        # (projection_rows caps it); one workspace per micro-batch and stream group ("main": C4 main and C128
        # layers, one after another on LightLLM's main stream; "indexer": the indexer, on its aux stream in
        # prefill), for the groups whose widths take that path at all.
        self.projection = projection
        self.hidden_size = hidden_size
        self.projection_rows = max_rows if projection == "auto" else 0
        self._projection_ws: list[dict[str, torch.Tensor]] = [{} for _ in range(microbatches)]
        self._projection_need: dict[tuple[int, int], int] = {}
        #: why a compressor fell back to LightLLM's GEMM (reason -> calls): a weight the op cannot read
        self.projection_fallbacks: dict[str, int] = {}
        #: a C4 layer's two projections (main, indexer) of one x in one launch on decode steps of at most
        #: pair_rows(D) rows: the kv_score the layer's second compressor reads, per micro-batch (HeldScore)
        self.c4_widths = (4 * layout.head_dim, 4 * indexer_head_dim)
        self.c128_width = 2 * layout.head_dim if layout.has_c128 else 0
        self._paired: list[HeldScore | None] = [None] * microbatches
        if self.projection_rows and hidden_size is not None:
            widths = {"main": [4 * layout.head_dim] * layout.has_c4 + [2 * layout.head_dim] * layout.has_c128,
                      "indexer": [4 * indexer_head_dim] * layout.has_c4}  # fmt: skip
            for group, sizes in widths.items():
                sizes = [w for w in sizes if self.triton_rows(w, hidden_size)]
                if sizes:
                    need = max(self._workspace_need(w, hidden_size) for w in sizes)
                    for sets in self._projection_ws:
                        sets[group] = torch.zeros(need, dtype=torch.float32, device=self.device)
            if layout.has_c4 and self.pair_rows(hidden_size):
                need = self._workspace_need(sum(self.c4_widths), hidden_size, self.pair_rows(hidden_size))
                for sets in self._projection_ws:
                    sets["pair"] = torch.zeros(need, dtype=torch.float32, device=self.device)
        self.steps = 0  # steps built (tests count them: once per step, whatever the layer count)

    @property
    def nbytes(self) -> int:
        """Device bytes the builder holds: its plans, tables, scratch and projection workspaces (what LightLLM's
        fixed-memory sizing counts for it, :func:`install`)."""
        tensors = [t for bufs in self._sets for t in vars(bufs).values() if isinstance(t, torch.Tensor)]
        tensors += [t for sets in self._projection_ws for t in sets.values()]
        if self.workspace is not None:
            tensors.append(self.workspace.buffer)
        return sum(t.numel() * t.element_size() for t in tensors)

    def triton_rows(self, width: int, dim: int) -> int:
        """The most rows of a step whose ``width`` (``2W``) x ``dim`` (``D``) projection runs as ours
        (:func:`compress_layer_from_hidden`): ``ops.projection_triton_rows`` (where our kernel is faster than
        cuBLAS; for the C128 layers on online banks, where ``ops.compress_online_hca_from_hidden``'s partials path
        is) within :attr:`projection_rows` (the builder's rows with ``projection="auto"``, else 0)."""
        online = self.online_hca and width == self.c128_width
        return min(self.projection_rows, ops.projection_triton_rows(width, dim, online=online))

    def pair_rows(self, dim: int) -> int:
        """The most rows of a decode step whose C4 layers project main and indexer in one launch
        (``ops.pair_projection_rows`` of the C4 widths, where that measured faster than two projections, within
        :attr:`projection_rows`)."""
        return min(self.projection_rows, ops.pair_projection_rows(*self.c4_widths, dim))

    def _workspace_need(self, width: int, dim: int, rows: int | None = None) -> int:
        rows = self.triton_rows(width, dim) if rows is None else rows
        key = (width, dim, rows)
        if key not in self._projection_need:
            self._projection_need[key] = ops.projection_workspace_numel(max(1, rows), width, dim)
        return self._projection_need[key]

    def projection_workspace(self, microbatch: int, group: str, width: int, dim: int) -> torch.Tensor:
        """The projection workspace of ``group`` (``"main"`` / ``"indexer"``, or ``"pair"``: a C4 layer's two
        projections) for micro-batch ``microbatch``, holding a ``width`` (``2W``) x ``dim`` (``D``) projection of
        up to :meth:`triton_rows` rows (``"pair"``: :meth:`pair_rows`). Allotted with the builder when it knows
        ``hidden_size``; else at the first call, which must not be under CUDA graph capture (LightLLM's warm-up
        forward runs eagerly before it captures)."""
        sets = self._projection_ws[microbatch]
        ws = sets.get(group)
        need = self._workspace_need(width, dim, self.pair_rows(dim) if group == "pair" else None)
        if ws is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise CapacityError(
                    "lightllm StepBuilder: the projection workspace would be allotted during CUDA graph capture; "
                    "give the builder hidden_size= (install() reads it from LightLLM's model config)"
                )
            ws = sets[group] = torch.zeros(need, dtype=torch.float32, device=self.device)
        elif ws.numel() < need:
            raise CapacityError(
                f"lightllm StepBuilder: the {group} projection workspace holds {ws.numel()} floats; a {width} x "
                f"{dim} projection of {self.pair_rows(dim) if group == 'pair' else self.triton_rows(width, dim)} "
                f"rows needs {need} (hidden_size or the "
                f"indexer's head size differ from the model's)"
            )
        return ws

    @staticmethod
    def rows_for_model(model, mtp_step: int) -> int:
        """The most rows one forward of a LightLLM model hands the compressors: the largest of
        ``batch_max_tokens`` (a prefill forward), ``max_req_num * (mtp_step + 1)`` (a decode forward) and
        ``graph_max_batch_size`` (a captured decode graph, padding included: LightLLM keeps it in rows,
        ``basemodel.py`` L83-87), rounded up to 64 (token padding for TP / SP mixing)."""
        need = max(
            int(getattr(model, "batch_max_tokens", None) or 0),
            int(model.max_req_num) * (mtp_step + 1),
            int(getattr(model, "graph_max_batch_size", 0) or 0),
        )
        return -(-need // 64) * 64

    @staticmethod
    def microbatches_for_model(model) -> int | None:
        """Micro-batches a LightLLM model runs at once: its ``dsv4_workspace.microbatch_count`` (2 with decode or
        prefill micro-batch overlap, ``models/deepseek_v4/workspace.py`` L110-111), ``None`` if it has none."""
        workspace = getattr(model, "dsv4_workspace", None)
        count = getattr(workspace, "microbatch_count", None)
        return None if count is None else int(count)

    @classmethod
    def for_model(cls, model, **options) -> StepBuilder:
        """A builder sized from a LightLLM model: its memory manager's layout, :meth:`rows_for_model` rows and
        :meth:`microbatches_for_model` micro-batches (2 when the model does not say). ``options`` go to the
        constructor (``max_rows`` and ``microbatches`` override)."""
        layout = LightLLMLayout.from_mem_manager(model.mem_manager)
        if options.get("max_rows") is None:
            options["max_rows"] = cls.rows_for_model(model, layout.mtp_step)
        if options.get("microbatches") is None:
            options["microbatches"] = cls.microbatches_for_model(model) or 2
        if options.get("hidden_size") is None:
            options["hidden_size"] = _hidden_size(getattr(model, "config", None))
        device = options.pop("device", None)
        if device is None:
            device = (
                model.mem_manager.full_to_c4_indexs if layout.has_c4 else model.mem_manager.full_to_c128_indexs
            ).device
        return cls(layout, device=device, **options)

    #: The launches of a build, in order (``build(parts=...)`` runs a subset: timing probes).
    PARTS = ("plans", "state_rows")

    def build(self, infer_state, *, parts=PARTS) -> None:
        """Build the step's plans and C4 state-row tables from LightLLM's ``infer_state`` (after its own
        ``init_some_extra_state`` set ``position_ids`` and ``dsv4_sparse_req_idx``) and set them as
        ``infer_state`` attributes. Device work only; host reads are of shapes and Python attributes: one
        ``build_plans`` of every ratio's plan, each reading its out slots through LightLLM's table itself
        (``out_slot=mem_index``, ``out_slot_map=full_to_c4_indexs`` / ``full_to_c128_indexs``) and, in the same
        call, the C4 plan's state-row tables (``mode="token_map_ring"``): one launch on steps of up to
        ``kernels.plan.PLAN_ONE_BLOCK_MAX_ROWS`` rows and requests, else one per plan and one for the tables
        (``check=True`` adds a ``check_plan`` per plan, which also reports a group end whose ``mem_index`` lies
        outside the table). ``parts`` (a subset of :data:`PARTS`) is for timing probes only: ``("plans",)`` the
        plans alone (a plan rebuilt without its tables is refused by the next compress), ``("state_rows",)`` the
        tables alone by ``build_state_rows``."""
        lay = self.layout
        positions = infer_state.position_ids
        rows = positions.shape[0]
        if rows > self.max_rows:
            raise CapacityError(
                f"lightllm StepBuilder: a step of {rows} rows, but the buffers hold {self.max_rows} (build the "
                f"builder with a larger max_rows: batch_max_tokens, or the decode rows of max_req_num requests)"
            )
        mb = int(getattr(infer_state, "microbatch_index", 0) or 0)
        if mb >= len(self._sets):
            raise CapacityError(f"lightllm StepBuilder: micro-batch {mb}, but the builder has {len(self._sets)}")
        buf = self._sets[mb]
        row_req = _row_requests(infer_state, rows)
        mem_index = infer_state.mem_index.reshape(-1)
        mm = infer_state.mem_manager
        # LightLLM's C4 state rows: (swa // 128) * ring + swa % ring of the SWA slot of each (request, position)
        c4_tables = dict(
            read_rows=buf.c4_read, save_rows=buf.c4_save, ring=lay.c4_state_ring,
            req_to_token=infer_state.req_manager.req_to_token_indexs, token_to_state=mm.full_to_swa_indexs,
            state_page=lay.swa_page_size, page_tail=lay.c4_state_ring,
        ) if lay.has_c4 else {}  # fmt: skip
        if "plans" in parts:  # every ratio's plan and the C4 tables in one build_plans (one launch when it fits)
            built = [(buf.c4_plan, C4_RATIO, mm.full_to_c4_indexs)] if lay.has_c4 else []
            if lay.has_c128:
                built.append((buf.c128_plan, lay.c128_ratio, mm.full_to_c128_indexs))
            with_tables = dict(state_mode="token_map_ring", **c4_tables) if c4_tables and "state_rows" in parts else {}
            if built:
                plans, ratios, maps = (list(column) for column in zip(*built))
                ops.build_plans(
                    plans, positions, row_req, [mem_index] * len(plans), ratios=ratios,
                    num_slots=lay.max_request_num, out_slot_maps=maps, mtp_step=lay.mtp_step, **with_tables,
                )  # fmt: skip
        elif c4_tables and "state_rows" in parts:  # the tables alone (a timing probe's part)
            read, save = c4_tables.pop("read_rows"), c4_tables.pop("save_rows")
            ops.build_state_rows(buf.c4_plan, read, save, mode="token_map_ring", **c4_tables)
        if lay.has_c4:
            setattr(infer_state, _C4_PLAN, buf.c4_plan)
            setattr(infer_state, _C4_READ, buf.c4_read)
            setattr(infer_state, _C4_SAVE, buf.c4_save)
        if lay.has_c128:
            setattr(infer_state, _C128_PLAN, buf.c128_plan)
            if self.workspace is not None:
                setattr(infer_state, _C128_SCRATCH, self.workspace.buffer[mb])
        if buf.err is not None:
            decode = not infer_state.is_prefill
            for k, plan in enumerate((buf.c4_plan, buf.c128_plan)):
                if plan is not None:
                    ops.check_plan(plan, None, buf.err[k], mtp_step=lay.mtp_step, decode=decode)
        setattr(infer_state, _BUILDER, self)
        self.steps += 1

    def plan_errors(self, microbatch: int = 0) -> list[str]:
        """Messages of ``check_plan`` findings of the micro-batch's last step (reads the device: a sync)."""
        err = self._sets[microbatch].err
        if err is None:
            raise ValueError("StepBuilder: plan_errors needs check=True")
        return [m for m in (ops.plan_error(err[0]), ops.plan_error(err[1])) if m is not None]


def _row_requests(infer_state, rows: int) -> torch.Tensor:
    """Each row's request slot: LightLLM's ``dsv4_sparse_req_idx`` (``b_req_idx`` repeated in prefill, ``b_req_idx``
    itself in decode), else derived the same way (``output_size`` keeps ``repeat_interleave`` sync-free)."""
    row_req = getattr(infer_state, "dsv4_sparse_req_idx", None)
    if row_req is None:
        if infer_state.is_prefill:
            row_req = torch.repeat_interleave(infer_state.b_req_idx, infer_state.b_q_seq_len, output_size=rows)
        else:
            row_req = infer_state.b_req_idx
    return row_req
