"""CPU smoke test of the multi-GPU demonstration (``scripts/multi_gpu_run.py``, the harness in
``benchmarks/multi_gpu/``; docs/INTEGRATION.md, "Distributed engines").

The script runs as two ranks, launched as torchrun would launch them, on the gloo backend with the Triton
interpreter and scaled-down shapes (H = 128, HCA ratio 8, SWA page 16). Each run has one CSA layer (C4 main +
indexer) and one HCA layer. On the CPU the decode "graph" runs eagerly and the NCCL collectives are gloo's: the
code path is otherwise the GPU's.

- ``--mode dp`` with LightLLM's C128 ring, the ops called through ``torch.ops.dsv4c``: the ranks have their own
  requests, chunked prefill, MTP decode with rewinds, a radix prefix hit, HOLD-only forwards on an idle rank;
- ``--mode tp`` with the online HCA banks: both ranks get the same rows from a bf16 GEMM, the replicas are
  compared every 2 iterations and at the end, and the timing code runs once (wall clock);
- a corrupted pool byte makes the run fail (non-zero exit, ``ok: false``).

Each run's JSON must say that every entry of every request on every rank was verified against the float64
reference, with no stray pool byte and no HOLD state row touched.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "multi_gpu_run.py"
SMALL = [
    "--backend", "gloo", "--device", "cpu", "--small", "--requests", "2", "--max-prompt", "48", "--decode-steps", "3",
    "--chunk", "48", "--csa-layers", "1", "--hca-layers", "1", "--hidden", "64", "--prefix-reuse", "1",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, *args: str, ranks: int = 2) -> tuple[int, dict, str]:
    """Run the script as ``ranks`` processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT);
    returns the worst exit status, rank 0's JSON report and the output."""
    out = tmp_path / "run.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks))  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, str(SCRIPT), *SMALL, *args, "--json", str(out)]
    logs = [tmp_path / f"rank{r}.log" for r in range(ranks)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as f:  # files, not pipes: a full pipe would block a rank inside a collective
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=f,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    deadline = time.monotonic() + 240
    try:  # as torchrun: when one rank fails, the others (blocked in a collective) are stopped
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.wait() for p in procs]
    text = "\n".join(
        f"--- rank {r} (exit {c})\n{log.read_text()[-6000:]}" for r, (c, log) in enumerate(zip(codes, logs))
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return max(codes), report, text


def _check_verified(report: dict, log: str) -> None:
    assert report.get("ok") is True, log
    v = report["verification"]
    assert v["all_verified"] and v["unexplained_bytes"] == 0, v
    assert v["entries_verified"] == v["entries_expected"] > 0, v
    assert v["stray_pool_bytes"] == 0 and v["hold_rows_untouched"] and v["plan_errors"] == 0, v
    assert report["lockstep"]
    assert len(report["ranks"]) == 2
    for rank in report["ranks"]:
        total = rank["verification"]["total"]
        assert total["all_verified"] and total["entries_verified"] == total["entries_expected"] > 0, total
        for kind in ("c4", "indexer", "c128"):
            assert rank["verification"]["by_kind"][kind]["entries_verified"] > 0, (rank["rank"], kind)
        assert rank["scheduler"]["rewinds"] > 0, "MTP decode never rewound"
    mem = report["memory"]["models"]["DeepSeek-V4-Flash"]
    assert mem["ring_bytes_per_request"] == 20 * 132 * 1024 * 4 and mem["online_bytes_per_request"] == 20 * 24 * 1024
    assert mem["admissible_requests_online"] > mem["admissible_requests_ring"] > 0
    env = report["environment"]
    assert env["torch"] and env["triton"] and env["date"] and env["world_size"] == 2


def test_dp_ranks_with_the_c128_ring(tmp_path):
    args = ["--mode", "dp", "--hca", "ring", "--dispatch", "torch-ops", "--timing-samples", "0"]
    code, report, log = _launch(tmp_path, *args)
    assert code == 0, log
    _check_verified(report, log)
    engines = [r["engine"] for r in report["ranks"]]
    assert sum(e["idle_prefill_forwards"] for e in engines) > 0, "no rank ran a HOLD-only prefill"
    assert sum(e["idle_decode_forwards"] for e in engines) > 0, "no rank ran a HOLD-only decode step"
    assert all(e["decode_forwards"] > 0 and e["hold_rows"] > 0 for e in engines)
    assert sum(r["scheduler"]["prefix_hits"] for r in report["ranks"]) > 0, "no radix prefix hit"
    assert report["tp"] is None and report["config"]["kv_source"] == "random"
    assert all(r["dispatcher_calls"] > 0 for r in report["ranks"]), "the ops did not go through torch.ops.dsv4c"


def test_tp_replicas_with_online_hca_are_byte_equal(tmp_path):
    args = ["--mode", "tp", "--hca", "online", "--check-every", "2", "--timing-samples", "1", "--timing-inner", "1",
            "--timing-variants", "layers_nccl_concurrent,hca_layers"]  # fmt: skip
    code, report, log = _launch(tmp_path, *args)
    assert code == 0, log
    _check_verified(report, log)
    tp = report["tp"]
    assert tp["equal"] and tp["ranks"] == 2 and tp["buffers"] == 9 and not tp["differing"], tp
    assert report["config"]["kv_source"] == "gemm"
    checks = report["ranks"][0]["periodic_checks"]
    assert checks and all(c["all_verified"] and c["tp_equal"] for c in checks), checks
    requests = [[(q["prompt"], q["length"]) for q in r["requests"]] for r in report["ranks"]]
    assert requests[0] == requests[1], "TP ranks must serve the same requests"
    timing = report["timing"]["rank0"]
    assert set(timing["raw"]) == {"build", "layers_nccl_concurrent", "hca_layers"}
    assert timing["layers"] == 2 and all(v["median_us"] > 0 for v in timing["raw"].values())
    per_layer = timing["per_layer_us"]
    assert per_layer["layers_with_nccl_concurrent"] is not None and per_layer["hca_layer_alone"] is not None
    assert report["timing_summary"]["build_us_per_step"] > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="in process: needs TRITON_INTERPRET=1")
def test_a_corrupted_pool_byte_fails_the_run(tmp_path, monkeypatch):
    """In process, one rank: the entries are corrupted just before the final check, which must fail loudly."""
    import multi_gpu_run as mg  # scripts/ is on the tests' path (pyproject.toml)

    from benchmarks.multi_gpu import run as mg_run  # where the run looks verify_entries up

    original = mg_run.verify_entries

    def corrupt_then_verify(eng):
        c = eng.model.comps[(0, "c4")]  # request 0's first C4 entry (group end at position 3)
        slot = int(eng.alloc.full_to_c4[eng.alloc.req_to_token[0, 3]])
        assert slot >= 0
        byte = c.layout._byte_index(torch.tensor([slot]))[0, 0]
        c.pages.view(-1)[byte] ^= 0x40  # flip a bit of its first FP8 value
        return original(eng)

    monkeypatch.setattr(mg_run, "verify_entries", corrupt_then_verify)
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(_free_port())).items():  # fmt: skip
        monkeypatch.setenv(name, value)
    out = tmp_path / "bad.json"
    args = [*SMALL, "--mode", "dp", "--requests", "1", "--max-prompt", "8", "--decode-steps", "1", "--chunk", "16",
            "--prefix-reuse", "0", "--timing-samples", "0", "--json", str(out)]  # fmt: skip
    try:
        assert mg.main(args) == 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    report = json.loads(out.read_text())
    assert report["ok"] is False and not report["verification"]["all_verified"]
    assert report["verification"]["unexplained_bytes"] > 0
    assert any("verification" in f for f in report["failures"]), report["failures"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
