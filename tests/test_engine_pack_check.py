"""Host-side checks of ``scripts/engine_pack_check.py --ring-decode`` (SGLang's C128 ring decode against ours; the
checks are ``benchmarks/engine_checks/``).

The GPU run builds SGLang's kernels with nvcc and times both sides; here (CPU, Triton interpreter) the parts that
must work the first time there are checked: the variant parser, the record comparison on synthetic pages, the
emulated SGLang plan, and one tiny end-to-end run (our tiled kernel interpreted, SGLang emulated in PyTorch).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.engine_checks import common, ring_case, ring_decode, sglang_ring

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def epc():
    """The entry point, loaded as the command line runs it (its ``main`` is the package's)."""
    path = REPO / "scripts" / "engine_pack_check.py"
    spec = importlib.util.spec_from_file_location("engine_pack_check_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_variants():
    got = ring_decode.parse_variants("default; tile=32 ;block_t=16,num_warps=8;one_launch=0,pdl=1")
    assert got == [
        ("default", {}),
        ("tile=32", {"tile": 32}),
        ("block_t=16 num_warps=8", {"block_t": 16, "num_warps": 8}),
        ("one_launch=False pdl=True", {"one_launch": False, "pdl": True}),
    ]
    with pytest.raises(ValueError, match="unknown variant key"):
        ring_decode.parse_variants("tiles=32")


def _pages(slots, values):
    from benchmarks.floors import kind_config
    from dsv4_compressor.layout import encode_latent, latent_page_layout

    cfg = kind_config("hca")
    layout = latent_page_layout(cfg, sglang_ring.RING_PAGE)
    pages = torch.full((4, layout.bytes_per_page), common.POISON, dtype=torch.uint8)
    layout.write(pages, slots, encode_latent(values, cfg))
    return pages, layout


def test_compare_latent():
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([1, 2, 7])
    values = torch.randn(3, sglang_ring.RING_HEAD, generator=g)
    ours, layout = _pages(slots, values)
    theirs = ours.clone()
    same = ring_case.compare_latent(ours, theirs, slots, layout, ref=values.double())
    assert same["records"] == 3 and same["differing_records"] == 0 and same["other_bytes_differ"] == 0
    assert same["untouched_poisoned"] and same["max_abs_diff"] == 0.0
    assert same["ours_vs_ref_records_differ"] == 0 and same["sglang_vs_ref_encoded_max_abs"] == 0.0

    # SGLang leaves the record's 8th scale byte unwritten: reported apart, not a differing record
    base = 0 * layout.bytes_per_page + sglang_ring.RING_PAGE * sglang_ring.RING_DATA + 1 * 8
    theirs[0, base + 7] = common.POISON
    out = ring_case.compare_latent(ours, theirs, slots, layout)
    assert out["differing_records"] == 0 and out["pad_byte_sglang"] == [0, common.POISON]

    # one FP8 code one step up in slot 2 (page 1, slot 0), one byte outside every record
    b = int(theirs[1, 5])
    theirs[1, 5] = b ^ (2 if b & 0x7F == 0x7E else 1)  # never the NaN code 0x7F
    theirs[3, 0] = 0
    out = ring_case.compare_latent(ours, theirs, slots, layout)
    assert out["differing_records"] == 1 and out["differing_data_bytes"] == 1 and out["differing_scale_bytes"] == 0
    assert out["other_bytes_differ"] == 1 and not out["untouched_poisoned"]
    assert out["examples"][0]["slot"] == 2 and out["max_abs_diff"] > 0


def test_ordered_codes():
    codes = torch.tensor([0x00, 0x01, 0x7E, 0x80, 0x81, 0xFE])
    assert ring_case._ordered(codes, 8).tolist() == [0, 1, 126, 0, -1, -126]


def test_emulated_plan():
    rid = torch.tensor([0, 1, 5], dtype=torch.int64)
    seq = torch.tensor([256, 130, 128], dtype=torch.int64)
    plan = torch.zeros(3, 16, dtype=torch.uint8)
    sglang_ring.SglangRingEmulated().plan(plan, rid, seq, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1))
    got = plan.view(torch.int32).view(3, 4).tolist()
    # DecodePlan {seq_len, write_loc = rid*128 + (seq-1)%128, read_page_0, read_page_1 = rid}
    assert got == [[256, 127, 0, 0], [130, 129, 1, 1], [128, 767, 5, 5]]


def test_ring_decode_cpu(epc, tmp_path, monkeypatch):
    """A tiny end to end run: 4 requests, both boundary cases, one instance, our default and one variant."""
    out = tmp_path / "out"
    argv = ["engine_pack_check.py", "--ring-decode", "--device", "cpu", "--ring-sizes", "4", "--instances", "1",
            "--no-timing", "--out", str(out), "--variants", "default;tile=32"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert epc.main() == 0
    report = json.loads((out / "ring_decode.json").read_text())
    assert report["ok"] and set(report["cases"]) == {"4B=4 every", "4B=4 quarter"}
    every, quarter = report["cases"]["4B=4 every"], report["cases"]["4B=4 quarter"]
    assert every["closing"] == 4 and quarter["closing"] == 1
    for case in (every, quarter):
        assert case["plan_matches_emulation"]
        assert case["ring"]["kv_rows_differ"] == 0 and case["ring"]["score_rows_differ"] == 0
        for v in case["variants"].values():
            assert v["ok"] and v["other_bytes_differ"] == 0 and v["untouched_poisoned"]
            assert v["max_rel_diff"] < 0.02  # a few one-step FP8 differences at most
    assert (out / "ring_decode.md").read_text().count("| 4B=4 ") == 4
