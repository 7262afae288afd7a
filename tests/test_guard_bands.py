"""Guard bands: the kernels write exactly the bytes they should, and nothing around them.

The cache's output pool (latent pages, or indexer keys and FP8 pages), its ring and the C128 scratch
workspace are moved into larger buffers (``_kernel_helpers.guard_cache``): the areas themselves are poisoned
(``0xA5`` bytes, NaN floats), the bands around them hold another pattern. Each step's ``kv_score`` lives inside
a guarded buffer too. Full schedules run (prefill chunks, decode with MTP rewinds across group boundaries,
slot reuse, a padded graph-style launch at the end); after every step:

- every guard band is intact;
- every output record the schedule wrote is explained byte by byte, every other pool byte is still poison;
- every ring row a step saved holds ``[kv | score + ape]``, every ring row never saved is still poison
  (an unused request slot included);
- the scratch rows of group-closing rows are fully written, all other scratch rows (and the other
  micro-batch's region) still hold poison;
- ``kv_score`` is untouched (or, with ``fuse_ape=False``, only its gate logits gained the APE bias).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
from _kernel_helpers import CSA_SMALL, HCA_SMALL, IDX, GuardedRun  # noqa: E402

VARIANTS = [
    ("hca_small-tiled-region1", HCA_SMALL, dict(c128_kernel="tiled"), 1),
    ("hca_small-single-ape_add", HCA_SMALL, dict(c128_kernel="single", fuse_ape=False), None),
    ("csa_small", CSA_SMALL, {}, None),
    ("indexer-ape_add", IDX, dict(fuse_ape=False), None),
]


@pytest.mark.parametrize("vid,cfg,opts,region", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_guard_bands_full_schedule(vid, cfg, opts, region):
    GuardedRun(cfg, opts, region).run_standard(decode_steps=2, what=vid)
