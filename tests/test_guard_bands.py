"""Guard bands: the kernels write exactly the bytes they should, and nothing around them.

The cache's output pool (latent pages, or indexer keys and FP8 pages), its state (ring, or the online banks) and
the C128 scratch workspace are moved into larger buffers (``helpers.guards.guard_cache``): the areas themselves are
poisoned (``0xA5`` bytes, NaN floats), the bands around them hold another pattern. Each step's ``kv_score`` lives
inside a guarded buffer too. Full schedules run (prefill chunks, decode with MTP rewinds across group boundaries,
slot reuse, a padded graph-style launch at the end: ``backend.launch`` with padding rows of ``row_req =
num_slots`` and a spare plan request record); after every step:

- every guard band is intact;
- every output record the schedule wrote is explained byte by byte, every other pool byte is still poison;
- every ring row a step saved holds ``[kv | score + ape]`` (online: the bank of the current length holds the
  partial group's running state), every ring row / bank never saved is still poison (an unused request slot
  included);
- the scratch rows of group-closing rows are fully written, all other scratch rows (and the other
  micro-batch's region) still hold poison;
- ``kv_score`` is untouched, padding rows included.
"""

import pytest
import torch
from helpers.guards import GuardedRun
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG

# (id, config, backend, backend options, scratch region, mtp_step, parameter options)
VARIANTS = [
    ("hca_small-tiled", HCA_SMALL, "triton", dict(c128_kernel="tiled"), None, 2, {}),
    ("hca_small-single-bf16_norm", HCA_SMALL, "triton", dict(c128_kernel="single"), None, 2,
     dict(norm_dtype=torch.bfloat16)),
    ("hca_small-online", HCA_SMALL, "online", {}, None, 2, {}),
    ("hca_small-online-mtp0", HCA_SMALL, "online", {}, None, 0, {}),
    ("csa_small", CSA_SMALL, "triton", {}, None, 2, {}),
    ("indexer-mtp0", INDEXER_CFG, "triton", {}, None, 0, {}),
]  # fmt: skip


@pytest.mark.parametrize("vid,cfg,backend,opts,region,mtp,popts", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_guard_bands_full_schedule(vid, cfg, backend, opts, region, mtp, popts):
    GuardedRun(cfg, opts, region, backend=backend, mtp=mtp, params_opts=popts).run_standard(decode_steps=2, what=vid)


def test_guard_bands_second_scratch_region():
    """The tiled HCA kernel of a cache on region 1 of a two-region workspace writes region 1 only."""
    GuardedRun(HCA_SMALL, dict(c128_kernel="tiled"), 1).run_standard(decode_steps=2, what="hca_small-tiled-region1")
