"""An engine-shaped multi-GPU run of the LightLLM adapter: DeepSeek-V4 compressors on LightLLM's buffers, one
process per rank, between NCCL collectives and inside CUDA graphs (docs/INTEGRATION.md, "Distributed
engines")::

    torchrun --nproc-per-node 2 scripts/multi_gpu_run.py --mode dp --hca ring      # or --hca online
    torchrun --nproc-per-node 2 scripts/multi_gpu_run.py --mode tp --dispatch torch-ops
    # CPU smoke test (Triton interpreter, gloo, scaled-down shapes):
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 scripts/multi_gpu_run.py --mode dp --backend gloo --device cpu \\
        --small --requests 3 --max-prompt 48 --decode-steps 3 --chunk 48 --csa-layers 1 --hca-layers 1 --hidden 64

``scripts/multi_gpu_check.sh`` runs the GPU runs; ``tests/test_multi_gpu_cpu.py`` the CPU smoke test.

Each rank is a LightLLM instance of DeepSeek-V4-Flash's compressor layers. By default there are 21 CSA layers, each
with a C4 main compressor and an indexer compressor, and 20 HCA (C128) layers: 62 compressors at full size
(H = 512 / 128, ratio 4 / 128). The LightLLM stand-ins are in ``tests/helpers/lightllm_sim``. The LightLLM adapter
(``dsv4_compressor.integrations.lightllm``) runs on them: ``StepBuilder.build`` once per step, then one op per
compressor and layer (``compress_layer``, or ``compressor_compress`` / ``write_indexer_k`` after LightLLM's bf16
GEMM). The adapter calls the ops as Python functions, or with ``--dispatch torch-ops`` through
``torch.ops.dsv4c``.

``--mode dp`` is data-parallel attention, the production shape:

- every rank has its own requests and scheduler;
- chunked prefill runs eagerly, mixed with MTP decode. A decode step has S = mtp_step + 1 rows per request, and a
  random number of drafts is accepted, so most steps rewind;
- 256-aligned radix prefix reuse is taken where the source's SWA page is still held;
- the ranks stay in lockstep. Every iteration all-reduces the ranks' work; a rank with nothing to prefill or
  decode runs a HOLD dummy request;
- an NCCL all_reduce per layer stands in for the EP MoE;
- decode steps replay a CUDA graph. The graph holds the per-step build (plan and state rows), every compressor
  layer and the collectives; LightLLM's ``copy_for_cuda_graph`` refreshes its inputs.

``--mode tp`` runs tensor-parallel replicas:

- both ranks get the same requests and rows (same seeds). ``kv_score`` comes from a real bf16 GEMM of identical
  hidden states;
- at the end, per-layer checksums of every pool, state and input buffer are all-gathered and must be equal on
  every rank.

Checks, on every rank:

- every entry of every request is checked against the float64 reference (``reference.compress_sequence``):
  ``verify.check_latent_records``, and ``verify.check_indexer_pack(..., "hadamard_bf16")`` for the indexer;
- pool bytes outside the slots the run wrote must still hold their poison;
- the HOLD request's state rows, the HOLD SWA page's state rows and the sentinel rows must be untouched;
- ``check_plan`` must report nothing, step after step.

Any unexplained byte makes the exit status non-zero. The checks' results are written before the timing runs.

The report: rank 0 writes a JSON file (``--json``, default ``$OUT/multi_gpu_<mode>_<hca>.json``) and prints a
summary. It holds:

- the checks: entries verified and expected per rank and kind, unexplained and exact bytes, stray pool bytes,
  HOLD rows, ``check_plan`` findings, TP equality; and what ran: forwards, HOLD-only forwards, graph replays,
  rewinds, radix hits, SWA evictions, per request its prompt, decode steps and final length;
- microseconds per layer under graph replay, for the first decode step in which every rank decoded a full batch.
  That step is snapshot and replayed after the checks. The same graph of layers is timed alone, with a
  per-layer all_reduce after each layer (engine order), with the all_reduces running concurrently on a side
  stream, and with the all_reduces alone; HCA and CSA layers are also timed on their own. Timing uses CUDA
  events, median over replays, and the summary takes the slowest rank;
- HCA state bytes per request, ring against online banks, for DeepSeek-V4-Flash and -Pro, and the requests per
  rank that a memory budget admits (from ``CompressorConfig.hca()``);
- the environment.

On the CPU (gloo, Triton interpreter) the same code runs eagerly: no CUDA graphs, no NCCL, wall-clock timing.

Modules, each a part of the run above:

- :mod:`.options`: the compressors' kinds, the timing's graph variants, the full and scaled-down shapes, and the
  command line (:func:`~.options.parse_args`).
- :mod:`.runtime`: this rank and its process group (:class:`~.runtime.Dist`), CUDA graph capture and replay
  (:class:`~.runtime.Replay`), the ops routed through ``torch.ops.dsv4c`` (:class:`~.runtime.TorchOps`).
- :mod:`.model`: every compressor of every layer on LightLLM's buffers (:class:`~.model.Model`).
- :mod:`.engine`: one rank's engine: LightLLM's buffers, the step builder, the forwards and the decode graph
  (:class:`~.engine.Engine`).
- :mod:`.scheduler`: one rank's requests and scheduler (:class:`~.scheduler.Scheduler`).
- :mod:`.checks`: every entry against the float64 reference, and the TP replicas' checksums.
- :mod:`.timing`: the decode step's graph variants, timed.
- :mod:`.report`: the memory table, rank 0's JSON report and the printed summary.
- :mod:`.run`: the run from start to end (:func:`~.run.main`: what ``scripts/multi_gpu_run.py`` calls).

The LightLLM stand-ins are the checkout's ``tests/helpers/lightllm_sim``: importing this package puts ``tests/``
on ``sys.path`` (like ``benchmarks/`` itself, it is not installed with the package). ``--device cpu`` needs
``TRITON_INTERPRET=1`` before triton is imported: ``scripts/multi_gpu_run.py`` sets it from its command line.
"""

import os
import sys

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
