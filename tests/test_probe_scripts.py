"""The GPU probe scripts (``scripts/*_probe.py``) run their kernels here under the interpreter, at small shapes.

The probes time stripped-down kernels on the H200 and write docs/*_LATENCY.md, PLAN_FLOOR.md, CSA_PREFILL.md;
nothing else calls them, so a change to the helpers they are built from can leave them broken until a device
call finds out (``plan_floor_probe`` did, at c3863d2). Each test launches a probe's kernels through the
script's own launch code, with a timer that runs every captured call once, and checks what the kernels
computed where the probe does the shipped work (the plan records, the pooled and finished entries).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from _helpers import interpreting

import dsv4_compressor as dc
from dsv4_compressor import ops
from dsv4_compressor import reference as ref
from dsv4_compressor.kernels import plan as _plan
from dsv4_compressor.layout import latent_page_layout
from dsv4_compressor.verify import check_latent_records

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import csa_prefill_probe  # noqa: E402
import online_latency_probe as olp  # noqa: E402
import plan_floor_probe  # noqa: E402
import tiled_latency_probe  # noqa: E402
import tiled_timeline_probe  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="the probes' kernels run here under TRITON_INTERPRET=1")

CPU = torch.device("cpu")


class OnceTimer:
    """The probes' timer interface on the CPU: every captured call runs once; the figures are placeholders."""

    device = CPU

    def __init__(self):
        self.runs = 0

    def sync(self) -> None:
        pass

    def capture(self, fn):
        return fn

    def time(self, calls, *, replays, warmup, queue_ahead, before=None):
        for call in calls:
            call()
            self.runs += 1
        return [1.0] * len(calls)


def _pooled_after_rows(b: dict, batch: int, ape: torch.Tensor | None = None) -> torch.Tensor:
    """What the online probe's chain pools per request: the bank at ``start % BANKS``, then the 4 rows (their
    gate logits plus ``ape[position % r]`` when given)."""
    start = olp.RATIO + 1  # the probe's plan: every request starts there
    out = []
    for k in range(batch):
        m, s, a = (b["state"][k, start % olp.BANKS, i].double() for i in range(3))
        for j in range(olp.S):
            row = b["kv"][k * olp.S + j].double()
            kv, x = row[: olp.H], row[olp.H :]
            if ape is not None:
                x = x + ape[(start + j) % olp.RATIO].double()
            m_new = torch.maximum(m, x)
            s = s * torch.exp(m - m_new) + torch.exp(x - m_new)
            a = a * torch.exp(m - m_new) + torch.exp(x - m_new) * kv
            m = m_new
        out.append(a / s)
    return torch.stack(out)


def test_online_latency_probe_kernels(monkeypatch):
    batch = 2
    sets = olp._instances(batch, 1, CPU, instances=1)
    b = sets[0][0]
    cfg = dc.CompressorConfig.hca()
    params = dc.CompressorParams.random(cfg, max_positions=olp.RATIO * 4)  # the probe's parameters (seed 0)
    pooled = _pooled_after_rows(b, batch)  # before any probe kernel writes a bank
    pooled_ape = _pooled_after_rows(b, batch, params.ape.view(olp.RATIO, olp.H))
    state0 = b["state"].clone()
    # the RMS-only finish: c * rsqrt(mean(c^2) + 1e-6) per request
    b["out"].fill_(float("nan"))
    olp._launch("finish-single", b, batch, 1, 4)
    want = pooled * torch.rsqrt((pooled * pooled).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(b["out"].view(batch, olp.H).double(), want, rtol=1e-5, atol=1e-6)
    # the finish as shipped, without and with the APE bias: entry k's FP8 record at slot k, against the float64
    # reference entry
    for probe, want_pooled in (("finish-entry", pooled), ("finish-entry-ape", pooled_ape)):
        b["state"].copy_(state0)
        b["pages"].fill_(0xA5)
        olp._launch(probe, b, batch, 1, 4)
        entries = ref.finish_entries(want_pooled, torch.zeros(batch, dtype=torch.long),
                                     ref.params_as(params, torch.float64), cfg)  # fmt: skip
        records = latent_page_layout(cfg, 2).read(b["pages"], torch.arange(batch))
        rep = check_latent_records(records, entries, cfg)
        assert rep.ok and rep.exact_fraction > 0.99, f"{probe}: {rep}"
    # the other stages run, and each writes what it stands for
    for probe, nt, warps, written in (("empty", 1, 4, "out"), ("record", 1, 4, "out"), ("bank", 1, 4, "state"),
                                      ("bank", 8, 1, "state"), ("finish-last", 8, 1, "out")):  # fmt: skip
        b["state"].copy_(state0)
        b["out"].fill_(float("nan"))
        before = b[written].clone()
        olp._launch(probe, b, batch, nt, warps)
        changed = not torch.equal(b[written].view(torch.int32), before.view(torch.int32))
        assert changed == (probe != "empty"), f"{probe} x{nt}: {written} {'changed' if changed else 'unchanged'}"
    # the measurement and the page around them
    monkeypatch.setattr(olp, "INSTANCES", 1)
    monkeypatch.setattr(olp, "L2_BYTES", 0)
    timer = OnceTimer()
    res = {"stages": {}, "finishes": {}, "pdl": False, "environment": {"date": "-", "gpu": "cpu", "commit": "-"}}
    for label, probe, nt, warps, hot in olp.STAGES:
        res["stages"][label] = {batch: olp.measure(timer, probe, batch, nt=nt, warps=warps, hot=hot)}
    assert timer.runs == len(olp.STAGES)
    page = olp.render_markdown(res, (batch,))
    assert all(label in page for label, *_ in olp.STAGES)


def test_plan_floor_probe_kernels(monkeypatch):
    """The probe's stage kernels, built from the build's own functions, on a 256-row step: the last stage
    writes the row records ``build_plan`` writes (no run crosses a block here), the header's program alone
    the header."""
    rows, requests = 256, 64
    monkeypatch.setattr(plan_floor_probe, "ROWS", rows)
    monkeypatch.setattr(plan_floor_probe, "REQUESTS", requests)
    positions, row_req, out_slot = plan_floor_probe.step_metadata(CPU)
    ratio = plan_floor_probe.RATIO
    want = ops.empty_plan(rows, requests, ratio, CPU)
    ops.build_plan(want, positions, row_req, out_slot, ratio=ratio, num_slots=requests)
    row0, row1 = _plan.REC * (1 + requests), _plan.REC * (1 + requests + rows)
    block, warps, chunk = _plan.blocks_config(rows)
    grid = (rows // block,)
    for name, stage in plan_floor_probe.STAGES.items():
        got = torch.full_like(want, -7)
        plan_floor_probe._plan_stage_probe[grid](
            _plan.PlanRef(got, rows, requests), positions, row_req, out_slot, requests,
            _plan.SlotMap(row_req, 0, 0), STAGE=stage, RATIO=ratio, BLOCK=block, CHUNK=chunk, num_warps=warps,
        )  # fmt: skip
        written = got.view(-1)[row0:row1]
        assert (written != -7).all(), f"{name}: row records not all written"
        if name == "+ list records":
            assert torch.equal(written, want.view(-1)[row0:row1]), "the probe's records differ from build_plan's"
    records = torch.full((rows * 8,), -7, dtype=torch.int32)
    for name, mode in plan_floor_probe.MODES.items():
        records.fill_(-7)
        plan_floor_probe._plan_probe[grid](positions, row_req, out_slot, records, rows, MODE=mode, BLOCK=block,
                                           CHUNK=chunk, num_warps=warps)  # fmt: skip
        assert (records != -7).all() if mode else (records == -7).all(), name
    got = torch.full_like(want, -7)
    shape = dict(rows=rows, requests=requests, ratio=ratio, num_slots=requests)
    plan_floor_probe._launch_grid_of_one(got, positions, row_req, out_slot, **shape)
    assert torch.equal(got.view(-1)[: _plan.REC], want.view(-1)[: _plan.REC]), "the header's program alone"


def test_tiled_latency_probe_kernels(monkeypatch):
    monkeypatch.setattr(tiled_latency_probe, "B", 2)
    monkeypatch.setattr(tiled_latency_probe, "INSTANCES", 1)
    monkeypatch.setattr(tiled_latency_probe, "L2_BYTES", 0)
    timer = OnceTimer()
    kernels = (*tiled_latency_probe.WORK, *tiled_latency_probe.READ_DIAGNOSTICS)
    for kernel in kernels:
        for closing in (0, 1, 2):
            assert tiled_latency_probe.measure(timer, kernel, closing, hot=False) == 1.0
    assert timer.runs == len(kernels) * 3


def test_tiled_timeline_summary():
    """``tiled_timeline_probe``'s kernel reads ``%globaltimer`` (inline PTX: GPU only); its summary and page are
    checked here on made-up stamps: every stamp of program ``p`` of instance ``i`` at ``1000 * (10 i + j) + p``
    ns for point ``j``, except that padding programs have no ``pooled`` / ``counted`` stamps (0)."""
    ttp = tiled_timeline_probe
    tiles, closing, tile_programs, programs = 3, 3, 16, 21
    i = torch.arange(ttp.INSTANCES)[:, None, None]
    p = torch.arange(programs)[None, :, None]
    j = torch.arange(6)[None, None, :]
    stamps = 1000 * (10 * i + j) + p
    stamps[:, closing * tiles :, 3:5] = 0
    res = ttp.summarise(stamps, tile_programs, closing, tiles)
    closing_programs = res["groups"]["closing tile programs"]
    # zero: the instance's first ``waited`` (program 0: 1000 * (10 i + 1)); the closing programs are 0..8
    assert closing_programs["start"] == [-1.0, -0.996, -0.992]
    assert closing_programs["waited"] == [0.0, 0.004, 0.008]
    assert closing_programs["end"] == [4.0, 4.004, 4.008]
    assert res["groups"]["padding tile programs"]["pooled"] == []
    assert res["groups"]["row programs"]["record"] == [1.016, 1.018, 1.02]
    first = res["instances"][0]
    assert first["first start"] == -1.0 and first["last end"] == 4.02 and first["last entry finished"] == 4.008
    # the next instance's first wait (11,000 ns) after this one's last end (5,020 ns)
    assert first["next waited - last end"] == 5.98
    assert "next waited - last end" not in res["instances"][-1]
    summary = dict(environment={}, pdl=True, release="as shipped", requests=5, closing=closing, programs=programs,
                   tile_programs=tile_programs, replays=[res])  # fmt: skip
    page = ttp.render_markdown(summary)
    assert "| closing tile programs | -1.00 / -1.00 / -0.99 | 0.00 / 0.00 / 0.01 |" in page, page
    assert "| 0 | -1.00 | 4.01 | 4.02 | 5.98 |" in page, page


def test_tiled_latency_probe_real_kernels(monkeypatch):
    """The probe's shipped-design stages on a decode step of 3 one-row requests, 2 of them closing: ``shipped``
    leaves each closing row's pooled values in its scratch row, ``real merge`` the same values normalized by
    their RMS, both against a float64 pooling of the window (ring rows of 132, the closing row's gate logits
    plus the APE bias); the arrival counts are back at 0 after each."""
    tlp = tiled_latency_probe
    monkeypatch.setattr(tlp, "B", 3)
    monkeypatch.setattr(tlp, "S", 1)
    b = tlp.real_step(2, CPU)
    ring0 = b["ring"].clone()
    ape = tlp._hca(CPU)[1].ape.double()
    want = []
    for k in range(2):
        pos = 2 * tlp.RATIO - 1
        q = torch.arange(pos - tlp.RATIO + 1, pos)
        rows = torch.cat([ring0[k, q % ring0.shape[1]].double(), b["kv"][k : k + 1].double()])
        score = rows[:, tlp.H :].clone()
        score[-1] += ape[pos % tlp.RATIO]
        w = torch.softmax(score, dim=0)
        want.append((w * rows[:, : tlp.H]).sum(0))
    want = torch.stack(want)
    rec = int(_plan.REC)

    def arrivals():
        return b["plan"].flatten()[rec * (1 + tlp.B) :][: rec * tlp.B].view(tlp.B, rec)[:, 7]

    b["scratch"].fill_(float("nan"))
    tlp.launch_real("shipped", b)
    torch.testing.assert_close(b["scratch"][:2].double(), want, rtol=1e-5, atol=1e-6)
    assert not bool(arrivals().any())
    b["out"].fill_(float("nan"))
    tlp.launch_real("real merge", b)
    got = b["out"].view(tlp.B, tlp.H)[:2].double()
    normed = want * torch.rsqrt((want * want).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(got, normed, rtol=1e-5, atol=1e-6)
    assert bool(b["out"].view(tlp.B, tlp.H)[2].isnan().all()), "a row that closes nothing was finished"
    assert not bool(arrivals().any())
    monkeypatch.setattr(tlp, "INSTANCES", 1)
    monkeypatch.setattr(tlp, "L2_BYTES", 0)
    timer = OnceTimer()
    for kernel in tlp.REAL:
        for closing in (0, 2):
            assert tlp.measure(timer, kernel, closing, hot=False) == 1.0
    assert timer.runs == len(tlp.REAL) * 2


def test_csa_prefill_probe_kernels(monkeypatch):
    """The probe's window kernel in each of its variants on a 32-row chunk, and the figures around it."""
    monkeypatch.setattr(csa_prefill_probe, "L2_BYTES", 0)
    timer = OnceTimer()
    for kernel in csa_prefill_probe.KERNELS:
        r = csa_prefill_probe.measure(timer, kernel, 32)
        assert r["copies"] == 1 and np.isfinite(r["gbps"])
    assert timer.runs == len(csa_prefill_probe.KERNELS)
