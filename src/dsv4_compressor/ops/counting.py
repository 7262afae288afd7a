"""How many kernels a call of an op launches, from the same dispatch functions the ops follow."""

from __future__ import annotations

import torch

from .compression import compress_route, pair_in_one_launch
from .online import online_splits
from .planning import plans_route


def launches(
    op: str,
    *,
    rows: int,
    requests: int,
    ratio: int = 4,
    kind: str = "csa",
    decode: bool = False,
    scratch: bool = False,
    tables: bool = False,
    device: torch.device | str = "cpu",
    plans: int = 1,
    head: int = 512,
    indexer_head: int = 128,
) -> int:
    """Kernel launches of one call of ``ops.<op>`` on a step of ``rows`` rows with a plan of ``requests``
    requests. The count comes from the functions the ops dispatch on (:func:`~.compression.compress_route`,
    :func:`~.compression.pair_in_one_launch`, :func:`~.online.online_splits`, :func:`~.planning.plans_route`), so
    it follows any change of theirs; ``tests/test_op_contract.py`` counts real launches against it.

    ``build_plan``, ``build_state_rows``, ``check_plan``: 1. ``build_plans`` of ``plans`` plans (``requests``:
    the largest capacity), with plan 0's state-row ``tables`` or not. ``compress``: ``kind="hca"`` with a
    ``scratch`` runs the tiled kernel, other calls the single-stage kernels; ``tables``: a state addressed by
    state-row tables. ``compress_online_hca``: ``scratch`` given or not (a split depends on ``device``'s
    multiprocessors). ``compress_pair``: ``head`` and ``indexer_head`` are the two compressors' head dims
    (DeepSeek-V4's by default); where they do not run in one launch, those of their two compresses.
    ``project``: 1 (Triton or ``torch.mm``). ``compress_from_hidden`` / ``compress_online_hca_from_hidden``: one
    more (the projection) than the op they end with. An op on a step of 0 rows launches nothing but the plan
    builds. Engine-side work around the ops (a gather, a mask) is not counted.
    """
    if op in ("build_plan", "build_state_rows", "check_plan"):
        return 1
    if op == "build_plans":
        return plans_route(rows=rows, requests=[requests] * plans, tables=tables).launches
    if op not in ("compress", "compress_pair", "compress_online_hca", "project", "compress_from_hidden",
                  "compress_online_hca_from_hidden"):  # fmt: skip
        raise ValueError(f"op must be an op of this module that launches kernels, got {op!r}")
    if rows == 0:
        return 0
    if op == "project":
        return 1
    if op in ("compress_from_hidden", "compress_online_hca_from_hidden"):
        inner = op.replace("_from_hidden", "")
        return 1 + launches(inner, rows=rows, requests=requests, ratio=ratio, kind=kind, decode=decode,
                            scratch=scratch, tables=tables, device=device)  # fmt: skip
    if op == "compress_pair":
        if pair_in_one_launch(decode=decode, head=head, indexer_head=indexer_head):
            return 1
        return 2 * launches("compress", rows=rows, requests=requests, ratio=ratio, kind="csa", decode=decode,
                            tables=tables, device=device)  # fmt: skip
    if op == "compress_online_hca":
        return 2 if online_splits(rows=rows, ratio=ratio, decode=decode, scratch=scratch, device=device) else 1
    return compress_route(tiled=kind == "hca" and scratch, decode=decode, tables=tables, requests=requests).launches
