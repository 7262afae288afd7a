"""Sweep the single-stage kernel's launch settings on the GPU: where the CSA and indexer layers spend their time.

Runs the bench's decode cases (``--kinds csa,indexer``, S = 4, every request closing a group) in-process once per
variant and prints one table of warm and cold us per layer. A variant sets the warps of the single-stage kernel
per kind, or drops one of the indexer's outputs (the FP8 pack or the bf16 keys) to show what each costs::

    python scripts/tune_single.py OUT_DIR [--batch 16,64,256]

Writes ``OUT_DIR/tune_single.json`` and ``OUT_DIR/tune_single.md``. Not a test: it measures, it does not check
bytes (the bench cases and the GPU tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from dsv4_compressor import ops  # noqa: E402
from dsv4_compressor.bench import cli as bench_cli  # noqa: E402
from dsv4_compressor.bench import layers as bench_layers  # noqa: E402
from dsv4_compressor.kernels import fused_compress  # noqa: E402

_launch = fused_compress.launch_compress_single
_call = bench_layers.LayerOp.call

#: name -> (warps by head dim (512: CSA main, 128: indexer; None: the default), indexer outputs kept)
VARIANTS = {
    "default": ({}, "both"),
    "csa w2": ({512: 2}, "both"),
    "csa w8": ({512: 8}, "both"),
    "idx w1": ({128: 1}, "both"),
    "idx w2": ({128: 2}, "both"),
    "idx w8": ({128: 8}, "both"),
    "idx pack only": ({}, "pack"),
    "idx keys only": ({}, "keys"),
    "idx w1 pack only": ({128: 1}, "pack"),
}


def _install(warps: dict[int, int], outputs: str) -> None:
    def launch(kv, state, ape, plan, prm, out, meta, sm, **kwargs):
        nw = warps.get(meta.HEAD)
        if nw is not None:
            kwargs["num_warps"] = nw
        return _launch(kv, state, ape, plan, prm, out, meta, sm, **kwargs)

    def call(self, kv_score, plan, *, decode):
        name, args, kwargs = _call(self, kv_score, plan, decode=decode)
        if kwargs.get("kind") == "indexer":
            if outputs == "pack":
                kwargs = dict(kwargs, out_keys=None)
            elif outputs == "keys":
                args = (*args[:-1], None)
        return name, args, kwargs

    ops.launch_compress_single = launch
    bench_layers.LayerOp.call = call


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--batch", default="16,64,256")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, dict[str, dict]] = {}
    for name in args.variants.split(","):
        warps, outputs = VARIANTS[name]
        _install(warps, outputs)
        kinds = "csa" if name.startswith("csa") else ("indexer" if name.startswith("idx") else "csa,indexer")
        path = os.path.join(args.out, f"tune_{name.replace(' ', '_')}.json")
        argv = ["--kinds", kinds, "--phases", "decode", "--batch", args.batch, "--rows-per-request", "4",
                "--boundary", "every", "--backends", "triton-single", "--json", path]  # fmt: skip
        rc = bench_cli.main(argv)
        if rc:
            print(f"variant {name}: bench exit {rc}")
            continue
        with open(path) as f:
            for res in json.load(f)["cases"]:
                if res.get("status") != "ok":
                    continue
                cold = (res.get("graph") or {}).get("median_us")
                warm = (res.get("warm") or {}).get("median_us")
                results.setdefault(res["id"], {})[name] = {"cold": cold, "warm": warm}
        os.remove(path)
    names = args.variants.split(",")
    lines = ["| case | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for case, by in results.items():
        cells = []
        for n in names:
            v = by.get(n)
            cells.append("" if v is None else f"{v['warm']:.2f} / {v['cold']:.2f}")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    text = "us per layer, warm / cold (CUDA graph of 20 layer instances)\n\n" + "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "tune_single.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "tune_single.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
