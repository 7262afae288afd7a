"""Online HCA banks in SGLang's own C128 ``CompressStatePool`` (``install(hca="online")``).

SGLang 0.5.23 keeps a C128 ring per request slot and HCA layer: ``resolve_compress_state_ring_size(128)`` rows
(128; 256 with speculation) of ``[kv | score]``, ``2H`` float32, in a flat ``CompressStatePool.kv_score_buffer``
``[rows, 2H]``. Its pool configurator prices that ring as fixed bytes (``_get_c128_state_fixed_bytes``) before
it turns the budget into KV tokens, and ``finalize_with_max_running_requests`` sizes the pool from the same ring.
Under ``install(hca="online")`` the C128 "ring" is :func:`bank_rows` rows per slot instead: ``B`` banks of
``(max, sum, weighted sum)``, ``3H`` float32 each (:func:`bank_count`: ``E`` draft tokens rounded up to even, so
that ``B * 3H == rows * 2H`` and slot ``s``'s banks are exactly its pool rows ``[s * rows, (s + 1) * rows)``).
The same pool tensor, read as ``[slots, B, 3, H]`` (:func:`banks_view`), is what ``ops.compress_online_hca``
takes: no second buffer, so SGLang's memory saver, two-batch overlap's backends (one shared pool) and its KV
sizing see the banks where they saw the ring, and the bytes the ring took become KV tokens in SGLang's own
accounting (its ``ring_sizes[128]`` is the bank rows).

What else reads the C128 pool, and what :func:`online_patches` does there:

* ``resolve_compress_state_ring_size`` (the pool's ``get_ring_size`` and, imported by name, the pool
  configurator): ratio 128 gives :func:`bank_rows` of the largest draft count SGLang may run
  (``max_speculative_num_draft_tokens``); the other ratios are SGLang's.
* ``DSV4PoolConfigurator._assert_ring_serves_draft_tokens``: the C128 check is for a ring; banks serve any
  draft count they were sized for, so the check runs with SGLang's own C128 ring (the C4 check unchanged).
* ``DeepSeekV4TokenToKVPool._make_compress_state_pool``: the C128 pool it builds is marked as holding banks
  (:data:`BANK_ATTR`, the bank count); the adapter's backends refuse a pool that is not.
* PD: ``get_request_state_buf_infos`` gives a bank pool's item length as one bank (``3H`` float32, 6 KiB), and
  ``request_state_transfer_indices`` the one bank a resume at ``seq_len`` reads, ``slot * B + seq_len % B``
  (none at a group boundary), computed on each side with its own ``B``: a prefill node without speculation
  (``B = 2``) pairs with a decode node with EAGLE (``B = 4``), the item lengths agree.
* ``clear_request_scoped_state`` (the decode node, before the transfer) fills the slot's banks with NaN: a
  bank no step or transfer wrote shows up in the entries; a request starts at a group boundary, which reads
  none.
* ``clear_unaccepted_c128_draft_states`` (after EAGLE verify) would run SGLang's ring kernel over the banks:
  skipped for bank pools (a rewind reads an older bank; there is nothing to clear).

Not touched: HiCache (it moves C4 state and compressed pages, no C128 state: a prefix hit lands on a 256-token
page, a group boundary), retraction (the request is prefilled again from a boundary).
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import torch

#: On a ``CompressStatePool``: its bank count ``B`` when it holds online HCA banks (install(hca="online")).
BANK_ATTR = "_dsv4c_banks"
#: SGLang's C128 ratio.
HCA_RATIO = 128


def bank_count(draft_tokens: int) -> int:
    """Banks per request slot for ``draft_tokens`` (``E``; 1 without speculation): ``E`` rounded up to even
    (the kernel banks length ``L`` in bank ``L % B``; any ``B >= E`` serves a rewind of ``E - 1``)."""
    e = max(1, int(draft_tokens))
    return e + (e % 2)


def bank_rows(draft_tokens: int) -> int:
    """Pool rows (``2H`` float32 each) per request slot holding :func:`bank_count` banks of ``3H``: ``3B / 2``
    (3 without speculation, 6 at E = 4)."""
    return 3 * bank_count(draft_tokens) // 2


def pool_banks(pool) -> int | None:
    """The bank count of a ``CompressStatePool`` holding online banks, else ``None``."""
    b = getattr(pool, BANK_ATTR, None) if pool is not None else None
    return int(b) if b else None


def banks_view(state: torch.Tensor, banks: int, head: int) -> torch.Tensor:
    """The online banks ``[slots, B, 3, head]`` (contiguous) over a C128 pool's flat ``[rows, 2 * head]``
    ``kv_score`` (no copy). Slot ``s`` is rows ``[s * 3B/2, (s + 1) * 3B/2)``; the pool's last row (SGLang's
    sentinel, which its constructor clears) is left out."""
    if state.dim() != 2 or state.shape[1] != 2 * head or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"sglang online HCA: a C128 pool of float32 [rows, {2 * head}] rows, got "
                         f"{state.dtype} {list(state.shape)}")  # fmt: skip
    rows = 3 * banks // 2
    slots = (state.shape[0] - 1) // rows
    return state[: slots * rows].view(slots, banks, 3, head)


def _draft_tokens_published() -> int:
    """The largest draft count SGLang may run in this process (what its ring resolution reads): 1 without
    speculation, else ``max(speculative_num_draft_tokens, max_speculative_num_draft_tokens())``."""
    runtime = importlib.import_module("sglang.srt.runtime_context")
    spec = runtime.get_spec()
    if spec.speculative_algorithm is None:
        return 1
    widest = getattr(runtime, "max_speculative_num_draft_tokens", lambda: None)()
    return max(1, int(spec.speculative_num_draft_tokens or 0), int(widest or 0))


def _ring_size(resolve):
    @functools.wraps(resolve)
    def resolve_compress_state_ring_size(compress_ratio: int) -> int:
        if int(compress_ratio) == HCA_RATIO:
            return bank_rows(_draft_tokens_published())
        return resolve(compress_ratio)

    return resolve_compress_state_ring_size


def _assert_ring(check, resolve):
    @functools.wraps(check)
    def _assert_ring_serves_draft_tokens(self, num_draft_tokens):
        rings = self.ring_sizes
        if HCA_RATIO not in rings:
            return check(self, num_draft_tokens)
        self.ring_sizes = {**rings, HCA_RATIO: resolve(HCA_RATIO)}  # SGLang's own ring: the C4 check unchanged
        try:
            return check(self, num_draft_tokens)
        finally:
            self.ring_sizes = rings

    return _assert_ring_serves_draft_tokens


def _marking(make):
    @functools.wraps(make)
    def _make_compress_state_pool(self, ratio, *args, **kwargs):
        pool = make(self, ratio, *args, **kwargs)
        if int(ratio) == HCA_RATIO and getattr(pool, "request_scoped", False) and not getattr(pool, "online", False):
            rows = int(pool.ring_size)
            if rows % 3 or pool.last_dim % 2:
                raise RuntimeError(
                    f"sglang online HCA: the C128 pool has {rows} rows per slot of {pool.last_dim}; online banks "
                    "need 3B/2 rows of 2H (was resolve_compress_state_ring_size patched?)"
                )
            setattr(pool, BANK_ATTR, 2 * rows // 3)
        return pool

    return _make_compress_state_pool


def _request_scoped(kvpool) -> list:
    return [p for p in kvpool.compress_state_pools if p is not None and p.request_scoped]


def _buf_infos(infos):
    @functools.wraps(infos)
    def get_request_state_buf_infos(self):
        ptrs, lens, items = infos(self)
        pools = _request_scoped(self)
        if len(pools) != len(items):
            raise RuntimeError("sglang online HCA: get_request_state_buf_infos lists other buffers than the pools")
        out = []
        for pool, item in zip(pools, items):
            b = pool_banks(pool)
            out.append(item if b is None else pool.kv_score_buffer.kv_score[0].nbytes * 3 // 2)  # one bank: 3H
        return ptrs, lens, out

    return get_request_state_buf_infos


def _transfer_indices(indices):
    @functools.wraps(indices)
    def request_state_transfer_indices(self, req_pool_idx: int, seq_len: int):
        pools = _request_scoped(self)
        counts = {pool_banks(p) for p in pools}
        if counts == {None}:
            return indices(self, req_pool_idx, seq_len)
        if None in counts or len(counts) != 1:
            raise RuntimeError("sglang online HCA: the request-scoped pools must all hold banks of one count")
        (b,) = counts
        seq_len = int(seq_len)
        if seq_len <= 0 or seq_len % HCA_RATIO == 0:  # nothing pends at a group boundary
            return np.empty((0,), dtype=np.int32)
        return np.array([int(req_pool_idx) * b + seq_len % b], dtype=np.int32)

    return request_state_transfer_indices


def _clear_scoped(clear):
    @functools.wraps(clear)
    def clear_request_scoped_state(self, req_pool_idx: int) -> None:
        pools = _request_scoped(self)
        if all(pool_banks(p) is None for p in pools):
            return clear(self, req_pool_idx)
        for pool in pools:
            b = pool_banks(pool)
            if b is None:  # SGLang's ring reset (the ratio-2 pending pairs of V4.1 layouts)
                start = int(req_pool_idx) * pool.ring_size
                pool.kv_score_buffer[start : start + pool.ring_size].clear()
                continue
            state = pool.kv_score_buffer.kv_score
            banks_view(state, b, state.shape[1] // 2)[int(req_pool_idx)].fill_(float("nan"))

    return clear_request_scoped_state


def _clear_unaccepted(clear):
    @functools.wraps(clear)
    def clear_unaccepted_c128_draft_states(self, *args, **kwargs) -> None:
        c128 = [p for p in self.compress_state_pools if p is not None and p.ratio == HCA_RATIO]
        if c128 and all(pool_banks(p) is not None for p in c128):
            return None  # banks: a rewind reads an older bank, nothing to clear (SGLang's kernel would write rows)
        return clear(self, *args, **kwargs)

    return clear_unaccepted_c128_draft_states


def online_patches(pool_mod, configurator_mod) -> tuple[list[tuple], dict]:
    """What ``install(hca="online")`` patches: ``([(owner class, name, wrapper)], {function name: (wrapper,
    original)})``, the second replaced in every module that imported the function by name."""
    patches, wrappers = [], {}
    resolve = pool_mod.resolve_compress_state_ring_size
    wrappers["resolve_compress_state_ring_size"] = (_ring_size(resolve), resolve)
    kvpool = pool_mod.DeepSeekV4TokenToKVPool
    for name, wrap in (
        ("_make_compress_state_pool", _marking),
        ("get_request_state_buf_infos", _buf_infos),
        ("request_state_transfer_indices", _transfer_indices),
        ("clear_request_scoped_state", _clear_scoped),
        ("clear_unaccepted_c128_draft_states", _clear_unaccepted),
    ):
        patches.append((kvpool, name, wrap(kvpool.__dict__[name])))
    dsv4 = getattr(configurator_mod, "DSV4PoolConfigurator", None) if configurator_mod is not None else None
    check = dsv4.__dict__.get("_assert_ring_serves_draft_tokens") if dsv4 is not None else None
    if check is not None:
        patches.append((dsv4, "_assert_ring_serves_draft_tokens", _assert_ring(check, resolve)))
    return patches, wrappers


#: Why a backend's pool is refused under install(hca="online") when its C128 pools hold no banks.
NO_BANKS = (
    "install(hca='online'): layer {layer}'s C128 state pool holds SGLang's ring, not online banks (a pool built "
    "before install(), or a pool class whose _make_compress_state_pool is not DeepSeekV4TokenToKVPool's); "
    "install the adapter before SGLang builds its KV pool"
)
