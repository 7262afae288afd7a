"""Sweep the kernels' launch settings on the GPU and print warm / cold us per layer per variant.

Each family runs a set of the bench's cases in-process once per variant; a variant overrides launch settings
of one launcher (``ops`` calls the launchers through module globals, so they are wrapped here) or drops one of
the indexer's outputs to show what each costs::

    python -m benchmarks.probes.tune_kernels OUT_DIR [--families single,tiled,online]

Families: ``single`` (the single-stage kernel: CSA and indexer decode at B = 16/64/256, S = 4, and their 8K
prefill; warps per kind), ``tiled`` (the tiled HCA kernel's channel tile, row tile, warps and one launch or two on
the quick preset's HCA cases), ``online`` (the online HCA decode program's warps), ``plan`` (build_plan's kernel, rows
per program and warps),
``prefill`` (the quick preset's HCA prefill chunks), ``online_prefill`` (the online kernel's prefill: split
shapes against one launch) and ``model`` (the whole V4-Flash decode steps); the
``single`` family also launches prefill over every row, not the plan's closing list (``prefill row grid``), and every
family has ``no pdl`` (all kernels launched without programmatic dependent launch) and ``pdl release at
start`` (every program releases the next kernel right after its wait, not at its exit), ``start if <=N``
(only launches of up to N programs do; the default is 132) and ``start never``. Writes
``OUT_DIR/tune.md`` and ``OUT_DIR/tune.json``. It measures; the bench cases and GPU tests check bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from benchmarks import cases as bench_cases
from benchmarks import cli as bench_cli
from benchmarks import layers as bench_layers
from dsv4_compressor import ops
from dsv4_compressor.kernels import c128_tiled, pdl

LAUNCHERS = {
    "single": "launch_compress_single",
    "tiled": "launch_c128_tiled",
    "tiled_s1": "launch_c128_tiled",
    "online": "launch_online_hca",
    "online_prefill": "launch_online_hca",
    "plan": "_plan.launch_build_plan",
}


def _owner(path: str):
    """The module holding launcher ``path`` (``ops`` calls ``_plan.launch_build_plan`` through ``ops._plan``)."""
    return (ops._plan, path.split(".")[1]) if "." in path else (ops, path)


ORIGINAL = {path: getattr(*_owner(path)) for path in LAUNCHERS.values()}
PLAN_ROWS = bench_cases.PLAN_ROWS
PDL_ENABLED = ops.pdl_enabled
PDL_RELEASE = pdl.RELEASE
PDL_START_MAX = pdl.START_RELEASE_MAX_PROGRAMS
TILED_START_MAX = c128_tiled.RELEASE_AT_START_MAX_REQUESTS
#: Variants launching every kernel without programmatic dependent launch (on by default on compute capability
#: 9.0+), or with every program releasing the next kernel at its start instead of its exit.
NO_PDL = ({"pdl": False}, "both")
PDL_VARIANTS = {
    "pdl release at start": ({"pdl_release": "start"}, "both"),
    "start never": ({"pdl_start_max": 0}, "both"),
    "start if <=132": ({"pdl_start_max": 132}, "both"),
    "start if <=288": ({"pdl_start_max": 288}, "both"),
}
#: Variants releasing the next kernel at the start of the one-launch tiled decode kernel's programs, for plans
#: of up to N requests (``c128_tiled.RELEASE_AT_START_MAX_REQUESTS``); every other launch as by default.
TILED_START = {f"tiled start <={n}": ({"tiled_start_max": n}, "both") for n in (0, 64, 256)}
#: What every family sweeps: the defaults, and the launch-mode variants every launcher shares.
COMMON = {"default": ({}, "both"), "no pdl": NO_PDL, **PDL_VARIANTS}
CALL = bench_layers.LayerOp.call


def _blocks(block: int, warps: int, **extra) -> tuple:
    """A ``plan`` variant: the blocks build with ``block`` rows per program and ``warps`` warps."""
    return ({"*": {"kernel": "blocks", "block": block, "num_warps": warps, **extra}}, "both")


_S1 = "--kinds hca --backends triton-tiled --phases decode --batch 64,256,1024 --rows-per-request 1".split()
_S1 += ["--boundary", "every,quarter"]
_DECODE = ["--phases", "decode", "--batch", "16,64,256", "--rows-per-request", "4", "--boundary", "every"]
FAMILIES = {
    "single": {
        "cases": [
            ["--kinds", "csa,indexer", "--backends", "triton-single", *_DECODE],
            [
                "--kinds",
                "csa,indexer",
                "--backends",
                "triton-single",
                "--phases",
                "prefill",
                "--prefill",
                "8192",
                "--carry",
                "no",
            ],
        ],  # fmt: skip
        # variant -> (launch overrides by head dim (512: CSA main, 128: indexer), indexer outputs kept)
        "variants": {
            **COMMON,
            "csa w8": ({512: {"num_warps": 8}}, "both"),
            # registers per thread: 105 (triton 3.6, 4 warps) allow 4 programs per SM, 96 / 80 / 64 allow 5 / 6 / 8
            "csa reg96": ({512: {"maxnreg": 96}}, "both"),
            "idx reg80": ({128: {"maxnreg": 80}}, "both"),
            "csa reg80": ({512: {"maxnreg": 80}}, "both"),
            "csa reg64": ({512: {"maxnreg": 64}}, "both"),
            "idx w2": ({128: {"num_warps": 2}}, "both"),
            "idx w4": ({128: {"num_warps": 4}}, "both"),
            "idx keys only": ({}, "keys"),
            "idx pack only": ({}, "pack"),
            "prefill row grid": ({512: {"closing_grid": False}, 128: {"closing_grid": False}}, "both"),
            # the finish's norm weight and rope row requested before the window behind a barrier, or once the
            # window has arrived (default: first for steps that do not save rows, prefill)
            "finish first": ({512: {"finish_first": True}, 128: {"finish_first": True}}, "both"),
            "finish after window": ({512: {"finish_first": False}, 128: {"finish_first": False}}, "both"),
        },
    },
    "plan": {
        "cases": [["--quick", "--phases", "plan"]],
        # step rows of the cases (the bench's own are 64, 256, 1,024 and 8,192)
        "plan_rows": (64, 128, 256, 512, 1024, 2048, 4096, 8192),
        "variants": {
            **COMMON,
            "w1": ({"*": {"num_warps": 1}}, "both"),
            "w2": ({"*": {"num_warps": 2}}, "both"),
            "w4": ({"*": {"num_warps": 4}}, "both"),
            "c1024": ({"*": {"chunk": 1024}}, "both"),
            "slot table": ({"*": {"slot_table": True}}, "both"),
            # the blocks build's shape with a table (its default is the table-less optimum)
            "slot table w8": ({"*": {"slot_table": True, "num_warps": 8}}, "both"),
            "slot table 64 w8": _blocks(64, 8, slot_table=True),
            "slot table 64 w4": _blocks(64, 4, slot_table=True),
            "slot table 256 w16": _blocks(256, 16, slot_table=True),
            "slot table c512": ({"*": {"slot_table": True, "chunk": 512}}, "both"),
            "slot table 64 w16": _blocks(64, 16, slot_table=True),
            "slot table 32 w4": _blocks(32, 4, slot_table=True),
            "slot table 32 w8": _blocks(32, 8, slot_table=True),
            "slot table 128 w8": _blocks(128, 8, slot_table=True),
            "blocks 64 w8": ({"*": {"kernel": "blocks", "block": 64, "num_warps": 8}}, "both"),
            "blocks 64 w16": ({"*": {"kernel": "blocks", "block": 64, "num_warps": 16}}, "both"),
            "blocks 32 w4": ({"*": {"kernel": "blocks", "block": 32, "num_warps": 4}}, "both"),
            "blocks 32 w8": ({"*": {"kernel": "blocks", "block": 32, "num_warps": 8}}, "both"),
            "c512": ({"*": {"chunk": 512}}, "both"),
            "c256": ({"*": {"chunk": 256}}, "both"),
            "w16": ({"*": {"num_warps": 16}}, "both"),
            "blocks": ({"*": {"kernel": "blocks"}}, "both"),
            "blocks 64": ({"*": {"kernel": "blocks", "block": 64}}, "both"),
            "blocks 256": ({"*": {"kernel": "blocks", "block": 256}}, "both"),
            "blocks 256 w8": ({"*": {"kernel": "blocks", "block": 256, "num_warps": 8}}, "both"),
            "blocks 128 w8": ({"*": {"kernel": "blocks", "block": 128, "num_warps": 8}}, "both"),
            "blocks 128 w16": ({"*": {"kernel": "blocks", "block": 128, "num_warps": 16}}, "both"),
            "blocks 256 w16": ({"*": {"kernel": "blocks", "block": 256, "num_warps": 16}}, "both"),
            "blocks 256 w8 c2048": ({"*": {"kernel": "blocks", "block": 256, "num_warps": 8, "chunk": 2048}}, "both"),
            "blocks 512 w8": ({"*": {"kernel": "blocks", "block": 512, "num_warps": 8}}, "both"),
            "blocks 64 w2": ({"*": {"kernel": "blocks", "block": 64, "num_warps": 2}}, "both"),
            "blocks 64 w4": ({"*": {"kernel": "blocks", "block": 64, "num_warps": 4}}, "both"),
            "blocks 128 w4": ({"*": {"kernel": "blocks", "block": 128, "num_warps": 4}}, "both"),
        },
    },
    "tiled": {
        "cases": [["--quick", "--kinds", "hca", "--backends", "triton-tiled", "--phases", "decode"]],
        "variants": {
            **COMMON,
            "tile32": ({"*": {"tile": 32}}, "both"),
            "tile32 bt128": ({"*": {"tile": 32, "block_t": 128}}, "both"),
            "bt128": ({"*": {"block_t": 128}}, "both"),
            "bt128 w8": ({"*": {"block_t": 128, "num_warps": 8}}, "both"),
            "bt32": ({"*": {"block_t": 32}}, "both"),
            "tile32 bt32 w2": ({"*": {"tile": 32, "block_t": 32, "num_warps": 2}}, "both"),
            "tile major": ({"*": {"tile_major": True}}, "both"),
            "record major": ({"*": {"tile_major": False}}, "both"),
            # decode steps in one launch (the last tile program of a closing row to arrive finishes its entry): the
            # default up to ONE_LAUNCH_MAX_REQUESTS requests; here always, or never
            "one launch": ({"*": {"one_launch": True}}, "both"),
            "two stage": ({"*": {"one_launch": False}}, "both"),
            "one launch tile16": ({"*": {"one_launch": True, "tile": 16}}, "both"),
            "one launch w2": ({"*": {"one_launch": True, "num_warps": 2}}, "both"),
            **TILED_START,
            # 64-channel tile programs (8 per closing row) with more warps: SGLang's decode block shape
            "tile64 w8": ({"*": {"tile": 64, "num_warps": 8}}, "both"),
            "tile64 w16": ({"*": {"tile": 64, "num_warps": 16}}, "both"),
            "tile64 w4": ({"*": {"tile": 64}}, "both"),
            # whole-row tile programs: one program pools all of a closing row's channels, streaming the window
            # a few rows at a time (contiguous 2 KiB rows of values and of gate logits)
            "rows bt8": ({"*": {"tile": 512, "block_t": 8}}, "both"),
            "rows bt16": ({"*": {"tile": 512, "block_t": 16}}, "both"),
            "rows bt8 w8": ({"*": {"tile": 512, "block_t": 8, "num_warps": 8}}, "both"),
            "half rows bt16": ({"*": {"tile": 256, "block_t": 16}}, "both"),
        },
    },
    # SGLang's decode workload: 4B requests of one row each, every request closing a group or every 4th
    "tiled_s1": {
        "cases": [_S1],
        "variants": {
            "default": ({}, "both"),
            "bt32": ({"*": {"block_t": 32}}, "both"),
            "bt64": ({"*": {"block_t": 64}}, "both"),
            "bt128": ({"*": {"block_t": 128}}, "both"),
            "w8": ({"*": {"num_warps": 8}}, "both"),
            "bt32 w8": ({"*": {"block_t": 32, "num_warps": 8}}, "both"),
            "tile64 w8": ({"*": {"tile": 64, "num_warps": 8}}, "both"),
            "tile64 bt32 w8": ({"*": {"tile": 64, "block_t": 32, "num_warps": 8}}, "both"),
            "two stage": ({"*": {"one_launch": False}}, "both"),
            "one launch": ({"*": {"one_launch": True}}, "both"),
            # whole-row tile programs: one program pools all of a closing row's channels, streaming the window
            # a few rows at a time (contiguous 2 KiB rows of values and of gate logits)
            "rows bt8": ({"*": {"tile": 512, "block_t": 8}}, "both"),
            "rows bt16": ({"*": {"tile": 512, "block_t": 16}}, "both"),
            "rows bt8 w8": ({"*": {"tile": 512, "block_t": 8, "num_warps": 8}}, "both"),
            "half rows bt16": ({"*": {"tile": 256, "block_t": 16}}, "both"),
        },
    },
    "prefill": {
        "cases": [["--quick", "--phases", "prefill"]],
        "variants": COMMON,
    },
    "online_prefill": {
        "cases": [
            ["--quick", "--phases", "prefill", "--backends", "online"],
            [
                "--kinds",
                "hca",
                "--phases",
                "prefill",
                "--prefill",
                "16384,32768",
                "--carry",
                "no",
                "--backends",
                "online",
            ],
        ],
        "variants": {
            **COMMON,
            # without the scratch: one launch of whole-channel programs (its own default shape)
            "one launch": ({"*": {"scratch": None}}, "both"),
            "one launch w4 bt16": ({"*": {"scratch": None, "num_warps": 4, "block_t": 16}}, "both"),
            "split 64": ({"*": {"split_tile": 64}}, "both"),
            "split 64 bt64": ({"*": {"split_tile": 64, "block_t": 64}}, "both"),
            "split bt64": ({"*": {"block_t": 64}}, "both"),
            "split bt32": ({"*": {"block_t": 32}}, "both"),
            "split w8": ({"*": {"num_warps": 8}}, "both"),
            # a diagnostic, not a setting: the kernel sees one bank (mtp_step 0: no banked tail), so the request
            # program has nothing to walk after its span and the interior programs set the time
            "one bank": ({"*": {"banks_seen": 1}}, "both"),
        },
    },
    "model": {
        "cases": [["--quick", "--phases", "model", "--models", "flash"]],
        "variants": {**COMMON, **TILED_START},
    },
    "online": {
        "cases": [["--quick", "--kinds", "hca", "--backends", "online", "--phases", "decode"]],
        "variants": {
            **COMMON,
            "w1": ({"*": {"decode_warps": 1}}, "both"),
            "w2": ({"*": {"decode_warps": 2}}, "both"),
            "w8": ({"*": {"decode_warps": 8}}, "both"),
        },
    },
}


#: The identity request-to-slot tables of the ``slot table`` variant, per (slots, device).
SLOT_TABLES: dict = {}


def _install(family: str, overrides: dict, outputs: str) -> None:
    for path, fn in ORIGINAL.items():
        setattr(*_owner(path), fn)
    ops.pdl_enabled = PDL_ENABLED
    pdl.RELEASE = overrides.get("pdl_release", PDL_RELEASE)
    pdl.START_RELEASE_MAX_PROGRAMS = overrides.get("pdl_start_max", PDL_START_MAX)
    c128_tiled.RELEASE_AT_START_MAX_REQUESTS = overrides.get("tiled_start_max", TILED_START_MAX)
    if "pdl" in overrides:  # every launcher, not only the family's
        ops.pdl_enabled = lambda device, on=overrides["pdl"]: on and PDL_ENABLED(device)
    launcher = LAUNCHERS.get(family)  # families without one vary only what every launch shares
    original = ORIGINAL.get(launcher)

    def launch(*args, **kwargs):
        meta = next((a for a in args if hasattr(a, "HEAD")), None)
        extra = dict(overrides.get("*") or overrides.get(getattr(meta, "HEAD", None)) or {})
        if kwargs.get("save_rows"):
            extra.pop("closing_grid", None)  # decode steps save rows in-kernel: every row needs its program
        if "banks_seen" in extra:  # the state banks' first n, as a view (times only; the states are not checked)
            args = (*args[:3], args[3][:, : extra.pop("banks_seen")], *args[4:])
        if extra.pop("slot_table", False):
            # build_plan through a request-to-slot table: the identity, so row_req (slots) are also the
            # request indices and the plan is the same; made on the first (untimed) call, outside any capture
            key = (kwargs["num_slots"], args[1].device)
            if key not in SLOT_TABLES:
                SLOT_TABLES[key] = torch.arange(key[0], dtype=torch.int32, device=key[1])
            extra["req_state_slot"] = SLOT_TABLES[key]
        return original(*args, **{**kwargs, **extra})

    def call(self, kv_score, plan, *, decode):
        name, args, kwargs = CALL(self, kv_score, plan, decode=decode)
        if kwargs.get("kind") == "indexer":
            if outputs == "pack":
                kwargs = dict(kwargs, out_keys=None)
            elif outputs == "keys":
                args = (*args[:-1], None)
        return name, args, kwargs

    if launcher is not None:
        setattr(*_owner(launcher), launch)
    bench_layers.LayerOp.call = call


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--variants", default=None, help="only these variants (comma-separated) besides each default")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    text, everything = [], {}
    for family in args.families.split(","):
        spec = FAMILIES[family]
        bench_cases.PLAN_ROWS = spec.get("plan_rows", PLAN_ROWS)
        results: dict[str, dict[str, dict]] = {}
        chosen = None if args.variants is None else {"default", *args.variants.split(",")}
        names = [n for n in spec["variants"] if chosen is None or n in chosen]
        for name in names:
            overrides, outputs = spec["variants"][name]
            _install(family, overrides, outputs)
            for i, case_args in enumerate(spec["cases"]):
                path = os.path.join(args.out, f"tune_{family}_{i}.json")
                if bench_cli.main([*case_args, "--json", path]):
                    print(f"{family} / {name}: bench failed")
                    continue
                with open(path) as f:
                    cases = json.load(f)["cases"]
                os.remove(path)
                for res in cases:
                    if res.get("status") == "ok":
                        cold = (res.get("graph") or {}).get("median_us")
                        warm = (res.get("warm") or {}).get("median_us")
                        results.setdefault(res["id"], {})[name] = {"cold": cold, "warm": warm}
        lines = [f"### {family}", "", "| case | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for case, by in results.items():
            cells = []
            for n in names:
                v = by.get(n)
                warm = "-" if v is None or v["warm"] is None else f"{v['warm']:.2f}"
                cells.append("" if v is None else f"{warm} / {v['cold']:.2f}")
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
        text.append("\n".join(lines))
        everything[family] = results
        print(text[-1], flush=True)
    head = "us per layer, warm / cold (CUDA graph of 20 layer instances; prefill: cold only)\n\n"
    with open(os.path.join(args.out, "tune.md"), "w") as f:
        f.write(head + "\n\n".join(text) + "\n")
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
