"""Online HCA banks and vLLM 0.33.0's KV transfer (disaggregated prefill / decode, ``kv_transfer_config``).

Skips without vLLM; runs on CPU (Triton under the interpreter), in ``.venv-vllm``. What vLLM's NIXL pull connector
does with the ``CircularBufferSpec`` group that holds the banks, read from its code and run here:

* the prefill node's ``request_finished`` names the group's one block among the request's blocks
  (``NixlBaseConnectorScheduler.get_exchange_clipped_blocks``: a group that is neither a sliding window nor
  Mamba state keeps its blocks); the decode node's ``KVCacheManager`` claims one block for it
  (``CircularBufferManager.allocate_external_computed_blocks``) and its connector asks for it;
* the worker registers the packed cache (every group's page at the start of a block: the groups overlay) as one
  region of whole blocks, the bank group's region among its "scratch" regions, and reads the remote block into
  the local one whole: every bank, at any block id on either side;
* the decode node's scheduler then recomputes the prompt's last token (``Scheduler._update_waiting_for_remote_kv``:
  ``num_computed_tokens = num_tokens - 1``), a restart one position back, which the banks serve only with at
  least 2 of them (the adapter keeps 2 under KV transfer also without speculation).

NIXL itself cannot run here: :class:`FakeNixl` stands in for its agent (``NixlWrapper``), takes the descriptor
lists the connector prepares (NIXL's strided ``Nx5`` rows) and, for each READ the connector posts, copies the bytes
the two descriptors name (``ctypes.memmove`` between the two pools of this process). Everything that decides
which blocks and bytes move is vLLM's: its connector (scheduler and worker roles), ``KVCacheManager``, planner and
allocator (:class:`test_engine_vllm_online.PooledRun`). The handshake's socket is skipped: the decode worker gets
the prefill worker's payload directly and checks it as ``_nixl_handshake`` does.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

compressor = pytest.importorskip("vllm.models.deepseek_v4.compressor", reason="vLLM 0.33 is not installed")

from test_engine_vllm import PAD_TO, vllm_on_cpu  # noqa: E402,F401  (fixture)
from test_engine_vllm_online import HEAD, PooledRun, _check_banks, pool_config  # noqa: E402

from dsv4_compressor.integrations import vllm as dsv4_vllm  # noqa: E402

N = 250  # the prompt: group 1 open (122 rows in the bank) when it moves


class FakeNixl:
    """NIXL's agent (``NixlWrapper``) for agents in one process: a descriptor list is kept as its owner and
    ``(address, bytes)`` per descriptor; a READ copies the ``i``-th remote descriptor it names into the ``i``-th
    local one (same length, as NIXL requires), then hands its notification to the remote agent. ``moved``: every
    copy, ``(local address, remote address, bytes)``."""

    agents: dict[str, FakeNixl] = {}

    def __init__(self, name: str, config=None):
        self.name, self.dlists, self.xfers, self.notifs, self.moved = name, {}, {}, [], []
        self.ids = itertools.count(1)
        FakeNixl.agents[name] = self

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        return metadata.decode()

    def get_reg_descs(self, ranges, mem_type=None):
        return list(ranges)

    def register_memory(self, descs, backends=None) -> None:
        pass

    def deregister_memory(self, descs) -> None:
        pass

    def prep_xfer_dlist(self, agent: str, descs, mem_type=None) -> int:
        """``descs``: rows ``(address, bytes, device, stride, count)``, each ``count`` descriptors."""
        flat = [(int(a) + k * int(st), int(n)) for a, n, _, st, c in descs.tolist() for k in range(int(c))]
        handle = next(self.ids)
        self.dlists[handle] = (self.name if agent == "NIXL_INIT_AGENT" else agent, flat)
        return handle

    def make_prepped_xfer(self, op, local, local_ids, remote, remote_ids, notif_msg=b"", **kwargs) -> int:
        handle = next(self.ids)
        self.xfers[handle] = (op, local, list(local_ids), remote, list(remote_ids), notif_msg)
        return handle

    def transfer(self, handle: int) -> str:
        op, local, local_ids, remote, remote_ids, notif = self.xfers[handle]
        assert op == "READ" and len(local_ids) == len(remote_ids)
        (_, here), (owner, there) = self.dlists[local], self.dlists[remote]
        for i, j in zip(local_ids, remote_ids):
            (dst, n), (src, m) = here[i], there[j]
            assert n == m, f"descriptor lengths differ: {n} local, {m} remote"
            ctypes.memmove(dst, src, n)
            self.moved.append((dst, src, n))
        if notif:
            FakeNixl.agents[owner].notifs.append((self.name, notif))
        return "DONE"

    def check_xfer_state(self, handle: int) -> str:
        return "DONE"

    def get_xfer_telemetry(self, handle: int):
        return types.SimpleNamespace(xferDuration=1, postDuration=1, totalBytes=1, descCount=1)

    def send_notif(self, agent: str, notif_msg: bytes) -> None:
        FakeNixl.agents[agent].notifs.append((self.name, notif_msg))

    def get_new_notifs(self) -> dict:
        out: dict = {}
        for agent, msg in self.notifs:
            out.setdefault(agent, []).append(msg)
        self.notifs = []
        return out

    def release_xfer_handle(self, handle: int) -> None:
        pass

    def release_dlist_handle(self, handle: int) -> None:
        pass

    def remove_remote_agent(self, name: str) -> None:
        pass


@pytest.fixture
def nixl(monkeypatch, vllm_on_cpu):  # noqa: F811
    """vLLM's NIXL connector with :class:`FakeNixl` as its agent. On a CPU platform its worker pins the process to
    the last core of each NUMA node (``discover_numa_topology``): none here."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.platforms import current_platform

    monkeypatch.setattr(base_worker, "NixlWrapper", FakeNixl)
    monkeypatch.setattr(base_worker, "check_nixl_version", lambda version: None)
    monkeypatch.setattr(current_platform, "discover_numa_topology", lambda: [], raising=False)
    FakeNixl.agents.clear()
    yield
    FakeNixl.agents.clear()


def _connectors(run: PooledRun):
    """The node's ``NixlConnector`` in its scheduler role (the scheduler's KV-cache config) and its worker role
    (the worker's, its caches registered as the runner registers them)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

    with set_current_vllm_config(run.config):
        scheduler = NixlConnector(run.config, KVConnectorRole.SCHEDULER, run.scheduler_kv_config)
        worker = NixlConnector(run.config, KVConnectorRole.WORKER, run.kv_config)
        worker.register_kv_caches(run.caches)
    return scheduler, worker


def _handshake(decode, prefill) -> None:
    """What ``_nixl_handshake`` does with the prefill worker's payload, less the socket: decode it, compare the
    compatibility hashes, add the remote agent (its descriptors)."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, NixlHandshakePayload

    d, p = decode.connector_worker, prefill.connector_worker
    payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(msgspec.msgpack.encode(p.xfer_handshake_metadata))
    assert payload.compatibility_hash == d.compat_hash
    agent = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    d._remote_agents[agent.engine_id] = {(0, 0): d.add_remote_agent(agent, 0, 1, agent.dcp_size)}


def _resume(run: PooledRun, connector, rid: str) -> None:
    """vLLM's ``Scheduler._update_waiting_for_remote_kv`` on the decode node once the load finished (a scheduler
    of this node's manager and connector, no replay window, the load not failed)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = types.SimpleNamespace(
        connector=connector, kv_cache_manager=run.manager, failed_recving_kv_req_ids=set(),
        finished_recving_kv_req_ids={rid}, prefix_replay_tokens=0, prefix_replay_group_ids=(),
        needs_kv_cache_zeroing=False,
    )  # fmt: skip
    for name in ("_mark_prefix_replay", "_load_restores_replay_window"):
        setattr(sched, name, types.MethodType(getattr(Scheduler, name), sched))
    Scheduler._update_waiting_for_remote_kv(sched, run.requests[rid])


#: mtp -> the decode node's steps after the load (R: the moved request, X: one the node already runs). The first
#: is vLLM's recompute of the prompt's last token; R's group 1 closes at position 255.
DECODE_PROGRAMS = {
    3: [
        (None, [("R", N - 1, 1), ("X", 40, 1)]),
        ("full", [("R", N, 4), ("X", 41, 4)]),
        ("piecewise", [("R", N + 2, 4), ("X", 43, 4)]),  # R rejected 2 drafts: closes group 1
        (None, [("R", N + 5, 4), ("X", 46, 4)]),  # R rejected 1: closes group 1 again
    ],
    0: [(None, [("R", p, 1)] + [("X", 40 + p - N + 1, 1)]) for p in range(N - 1, N + 7)],
}
PREFILL = [(None, [("R", 0, 150)]), ("piecewise", [("R", 150, N - 150)])]


def _rows(padding, items, table: dict, gen) -> torch.Tensor:
    """A step's ``kv_score``: each item's rows from ``table[rid]`` (a request's rows by position), padded with
    random rows to the capture size of ``padding``."""
    rows = torch.cat([table[rid][start : start + n] for rid, start, n in items])
    padded = rows.shape[0] if padding is None else min(s for s in PAD_TO if s >= rows.shape[0])
    return torch.cat([rows, torch.randn(padded - rows.shape[0], rows.shape[1], generator=gen)])


@pytest.mark.parametrize("mtp", [3, 0], ids=["mtp3", "no_speculation"])
def test_the_banks_move_mid_group_through_vllms_nixl_connector(nixl, mtp):
    """A request prefilled to 250 positions on a prefill node (group 1 open) moves through vLLM's NIXL connector
    to a decode node, where another request already holds blocks (so every block id differs), and continues
    there, vLLM's recompute of its last prompt token first, then decode or MTP verify steps with rejected drafts
    across its group 1's end. The bank block arrives byte for byte (all banks), in the block the decode node's
    manager claimed for it; the decode node's records and R's banks equal an uninterrupted run's (the same steps
    on one node, without the move and the recompute) byte for byte and the float64 entries; the resident
    request's too. Without speculation the group keeps 2 banks under KV transfer (1 would double-count the
    recomputed position)."""
    from vllm.v1.request import RequestStatus

    prefill, decode, alone = (PooledRun(mtp=mtp, num_blocks=b, engine=e) for e, b in (("P", 16), ("D", 24), ("U", 16)))
    (p_sched, p_worker), (d_sched, d_worker) = _connectors(prefill), _connectors(decode)
    gen = torch.Generator().manual_seed(3)
    table = {rid: torch.randn(N + 16, 2 * HEAD, generator=gen) * torch.cat([torch.ones(HEAD), 2 * torch.ones(HEAD)])
             for rid in "RX"}  # fmt: skip
    tokens = torch.randint(0, 1000, (N,), generator=gen).tolist()
    try:
        # the prefill node, and the same prefill on the node that runs R alone
        prefill.admit("R", tokens, kv_transfer_params={"do_remote_decode": True})
        alone.admit("R", tokens)
        for k, (padding, items) in enumerate(PREFILL):
            rows = _rows(padding, items, table, gen)
            with dsv4_vllm.install(hca="online"):
                prefill.step(padding, items, rows)
                alone.step(padding, items, rows)
            if not k:  # the scheduler tells the connector of every allocation
                p_sched.update_state_after_alloc(prefill.requests["R"], prefill.manager.get_blocks("R"), 0)
        req = prefill.requests["R"]
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = p_sched.request_finished_all_groups(req, prefill.manager.get_block_ids("R"))
        p_bank, p_kv = prefill.block_ids("R")
        bank_group = prefill.group_of[prefill.module.state_cache.prefix]
        assert delay and list(params["remote_block_ids"][bank_group]) == p_bank  # the bank block is sent
        p_worker.bind_connector_metadata(p_sched.build_connector_meta(None))
        p_worker.start_load_kv(None)  # the prefill worker holds R's blocks until the decode node read them

        # the decode node: X runs, then R arrives
        decode.admit("X", [t + 1 for t in tokens[:40]])
        with dsv4_vllm.install(hca="online"):
            decode.step(None, [("X", 0, 40)], _rows(None, [("X", 0, 40)], table, gen))
        hit, hit_tokens = decode.admit("R", tokens, kv_transfer_params=dict(params))
        decode.hits.pop("R")
        req = decode.requests["R"]
        count, is_async = d_sched.get_num_new_matched_tokens(req, hit_tokens)
        assert (hit_tokens, count, is_async) == (0, N, True)
        assert decode.manager.allocate_slots(req, 0, hit_tokens, hit, num_external_computed_tokens=count,
                                             delay_cache_blocks=True) is not None  # fmt: skip
        req.num_computed_tokens = count
        d_sched.update_state_after_alloc(req, decode.manager.get_blocks("R"), count)
        d_bank, d_kv = decode.block_ids("R")
        assert d_bank != p_bank and d_kv != p_kv
        decode.claimed["R"] = d_bank[0]
        decode.poison_banks(d_bank[0])  # what the load must overwrite
        meta = d_sched.build_connector_meta(None)
        assert meta.reqs_to_recv["R"].remote.block_ids[bank_group] == p_bank
        _handshake(d_worker, p_worker)
        d_worker.bind_connector_metadata(meta)
        d_worker.start_load_kv(None)
        assert d_worker.get_finished(set()) == (set(), {"R"}) and p_worker.get_finished(set()) == ({"R"}, set())
        moved = FakeNixl.agents[d_worker.connector_worker.nixl_wrapper.name].moved
        assert {n for _, _, n in moved} == {prefill.row}  # whole packed blocks
        got, want = decode.banks()[d_bank[0]], prefill.banks()[p_bank[0]]
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), "the banks did not arrive as sent"
        decode.rows["R"] = prefill.rows["R"]  # the same tokens: the same rows
        assert torch.equal(decode.records("R", d_kv), prefill.records("R", p_kv))  # group 0, in the k cache blocks
        _resume(decode, d_sched, "R")
        assert req.num_computed_tokens == N - 1  # vLLM recomputes the prompt's last token

        for k, (padding, items) in enumerate(DECODE_PROGRAMS[mtp]):
            rows = _rows(padding, items, table, gen)
            with dsv4_vllm.install(hca="online"):
                decode.step(padding, items, rows)
                if k:  # the uninterrupted run: no move, no recompute
                    mine = [item for item in items if item[0] == "R"]
                    alone.step(padding, mine, _rows(padding, mine, table, gen))
    finally:
        for connector in (p_sched, p_worker, d_sched, d_worker):
            connector.shutdown()
    length = decode.rows["R"].shape[0]
    assert length == alone.rows["R"].shape[0] > 256
    assert decode.check_entries("R", "decode node") == 2 and decode.check_entries("X", "decode node") == 0
    assert torch.equal(decode.records("R"), alone.records("R")), "the decode node's records differ from one node's"
    b = length % decode.nbanks
    assert torch.equal(decode.banks()[d_bank[0], b].view(torch.int32),
                       alone.banks()[alone.claimed["R"], b].view(torch.int32))  # fmt: skip
    assert _check_banks(decode) == 2
    assert prefill.nbanks == decode.nbanks == max(mtp + 1, 2)  # 2 banks under KV transfer without speculation


# ---------------------------------------------------------------------------------------------------------------
# What is refused
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "connector, device, match",
    [
        ("OffloadingConnector", "cuda", "only NIXL's pull connector"),
        ("MultiConnector", "cuda", "only NIXL's pull connector"),
        ("MooncakeConnector", "cuda", "only NIXL's pull connector"),
        ("NixlPushConnector", "cuda", "only NIXL's pull connector"),
        ("NixlConnector", "cpu-buffer", "kv_buffer_device='cpu'"),
        ("NixlConnector", "cuda", None),
        ("NixlPullConnector", "cuda", None),
    ],
)
def test_kv_transfer_other_than_nixl_pull_is_refused_at_install(connector, device, match, monkeypatch):
    """``install(hca="online")`` with a ``kv_transfer_config`` takes NIXL's pull connector (device buffers) and
    refuses, with the reason and nothing patched, every other connector and NIXL's host staging on a GPU
    platform; the same config is refused where vLLM asks the state for its spec. Under KV transfer the bank
    group holds ``max(mtp_step + 1, 2)`` banks."""
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cuda")
    config = pool_config(mtp=0)
    buffer = "cpu" if device == "cpu-buffer" else "cuda"
    config.kv_transfer_config = KVTransferConfig(kv_connector=connector, kv_role="kv_producer", kv_buffer_device=buffer,
                                                 engine_id="P")  # fmt: skip
    before = compressor.DeepseekCompressor.forward
    if match is None:
        with dsv4_vllm.install(hca="online", vllm_config=config):
            assert compressor.DeepseekCompressor.forward is not before
        assert dsv4_vllm.online.bank_count(config) == 2 and dsv4_vllm.online.bank_count(pool_config(mtp=0)) == 1
        assert dsv4_vllm.online.bank_count(pool_config(mtp=3, engine="P")) == 4
        return
    with pytest.raises(dsv4_vllm.VllmModeNotSupported, match=match):
        dsv4_vllm.install(hca="online", vllm_config=config)
    assert compressor.DeepseekCompressor.forward is before
    state = types.SimpleNamespace(sliding_window=128, state_dim=2 * HEAD)
    with dsv4_vllm.install(hca="online"):
        with pytest.raises(dsv4_vllm.VllmModeNotSupported, match=match):
            compressor.CompressorStateCache.get_kv_cache_spec(state, config)


def test_nixl_host_staging_copies_the_bank_block_only_when_it_is_allocated(monkeypatch):
    """Why host staging is refused, on vLLM's own scheduler side: with ``kv_buffer_device='cpu'`` on a GPU, NIXL
    saves a request's blocks to host memory as ``build_connector_meta`` lists them, the blocks each step newly
    allocates (``_build_save_meta``). The bank block comes with a prompt's first chunk and is rewritten by every
    later chunk, but no later chunk lists it again: the host copy keeps the banks of the first chunk."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import CircularBufferSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    monkeypatch.setattr(current_platform, "device_type", "cuda")
    config = pool_config(mtp=0, engine="P")
    config.kv_transfer_config.kv_buffer_device = "cpu"
    k = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=HEAD, dtype=torch.uint8)
    banks = CircularBufferSpec(block_size=2, num_kv_heads=1, head_size=3 * HEAD, head_size_v=0, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["k"], k), KVCacheGroupSpec(["banks"], banks)])  # fmt: skip
    sched = NixlPullConnectorScheduler(config, "P", kv_config)
    assert sched.use_host_buffer
    req = types.SimpleNamespace(request_id="R", kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=300,
                                num_computed_tokens=0)  # fmt: skip
    sched._reqs_need_save["R"] = req
    chunk = types.SimpleNamespace(scheduled_new_reqs=[types.SimpleNamespace(req_id="R", block_ids=([3], [7]))],
                                  scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                              resumed_req_ids=set()),
                                  num_scheduled_tokens={"R": 200})  # fmt: skip
    assert sched.build_connector_meta(chunk).reqs_to_save["R"].local_block_ids == ([3], [7])
    req.num_computed_tokens = 200
    chunk = types.SimpleNamespace(scheduled_new_reqs=[],
                                  scheduled_cached_reqs=types.SimpleNamespace(req_ids=["R"], new_block_ids=[([4], [])],
                                                                              resumed_req_ids=set()),
                                  num_scheduled_tokens={"R": 100})  # fmt: skip
    assert sched.build_connector_meta(chunk).reqs_to_save["R"].local_block_ids == ([4], [])  # no bank block
