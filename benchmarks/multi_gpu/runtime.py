"""What one rank runs on: its process group and device (:class:`Dist`, with the few collectives the harness
itself needs), a function captured in a CUDA graph and replayed (:class:`Replay`, eager on the CPU), and
``dsv4_compressor.ops`` with its launching ops routed through ``torch.ops.dsv4c`` (:class:`TorchOps`,
``--dispatch torch-ops``)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


class Dist:
    """This rank, its device, and the few collectives the harness itself needs."""

    def __init__(self, args):
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        if args.device == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("multi_gpu_run: --device cuda but no CUDA device (use --device cpu --backend gloo)")
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        if args.backend == "nccl" and not self.cuda:
            raise SystemExit("multi_gpu_run: the nccl backend needs --device cuda")
        timeout = datetime.timedelta(seconds=args.timeout_s)
        kwargs = dict(device_id=self.device) if args.backend == "nccl" else {}
        dist.init_process_group(args.backend, timeout=timeout, **kwargs)
        self.backend = args.backend
        # where the harness's own collectives live (NCCL: the GPU)
        self.comm_device = self.device if args.backend == "nccl" else torch.device("cpu")

    def all_max(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        t = torch.zeros(1, device=self.comm_device)
        dist.all_reduce(t)
        if self.cuda:
            torch.cuda.synchronize()


class Replay:
    """``fn()`` captured in a CUDA graph, after a warm-up on a side stream that compiles every kernel at the graph's
    shapes and runs each collective once. Keeps ``fn``'s return value: the graph's output tensors. On the CPU,
    ``replay()`` runs ``fn()`` eagerly."""

    def __init__(self, fn, device: torch.device, capture_error_mode: str):
        self.fn, self.graph, self.out = fn, None, None
        if device.type != "cuda":
            return
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            fn()
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode=capture_error_mode):
            self.out = fn()
        torch.cuda.synchronize()

    def replay(self):
        if self.graph is None:
            self.out = self.fn()
        else:
            self.graph.replay()
        return self.out


class TorchOps:
    """``dsv4_compressor.ops`` as the adapter sees it, with the launching ops routed through the dispatcher
    (``torch.ops.dsv4c.<name>``, docs/INTEGRATION.md, "torch.library registration"); everything else is the module's."""

    ROUTED = ("build_plan", "build_state_rows", "check_plan", "compress", "compress_online_hca")

    def __init__(self, module):
        self._module = module
        self.calls = 0

    def __getattr__(self, name):
        if name not in self.ROUTED:
            return getattr(self._module, name)
        op = getattr(torch.ops.dsv4c, name)

        def call(*args, **kwargs):
            self.calls += 1
            return op(*args, **kwargs)

        return call
