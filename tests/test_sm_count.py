"""``kernels.sm_count``: the multiprocessor count the launch sizes aim at, read from the device and cached per
device; :data:`~dsv4_compressor.kernels.DEFAULT_SM_COUNT` only where no CUDA device can be asked. No launch
size assumes 132 multiprocessors (a B200 has 148)."""

from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

import torch

from dsv4_compressor import kernels
from dsv4_compressor.kernels import pdl
from dsv4_compressor.kernels import projection as proj

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "dsv4_compressor"


def test_default_without_cuda():
    assert kernels.sm_count(torch.device("cpu")) == kernels.DEFAULT_SM_COUNT == 132
    assert kernels.sm_count("cpu") == kernels.DEFAULT_SM_COUNT
    if not torch.cuda.is_available() or kernels.interpreting():
        assert kernels.sm_count() == kernels.DEFAULT_SM_COUNT
        assert kernels.sm_count(0) == kernels.DEFAULT_SM_COUNT


def test_read_from_the_device_and_cached_per_device(monkeypatch):
    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(multi_processor_count={0: 148, 1: 132}[index])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    kernels._device_sm_count.cache_clear()
    try:
        assert kernels.sm_count(torch.device("cuda", 0)) == 148
        assert kernels.sm_count(0) == 148
        assert kernels.sm_count() == 132  # the current device
        assert kernels.sm_count("cuda:1") == 132
        assert kernels.sm_count(torch.device("cuda")) == 132
        assert asked == [0, 1]  # once per device
    finally:
        kernels._device_sm_count.cache_clear()


def test_launch_sizes_follow_the_count(monkeypatch):
    for sms in (132, 148):
        monkeypatch.setattr(pdl, "sm_count", lambda sms=sms: sms)
        assert pdl.launch_options(True, sms)["PDL"] == 2
        assert pdl.launch_options(True, sms + 1)["PDL"] == 1
    monkeypatch.setattr(proj, "OVERRIDES", {})
    grids = {}
    for sms in (66, 132, 148):
        monkeypatch.setattr(proj, "sm_count", lambda sms=sms: sms)
        cfg = proj.projection_config(16, 512, 4096)
        t, n, s = cfg.grid(16, 512)
        assert t * n * s <= sms
        grids[sms] = t * n * s
    assert grids[66] < grids[132]


def test_no_hard_coded_132_multiprocessors():
    """Any ``= 132`` in the package is the indexer pack's bytes, not a multiprocessor count."""
    for path in SRC.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b132\b", line) and "byte" not in line.lower() and "DEFAULT_SM_COUNT" not in line:
                assert not re.search(r"=\s*132\b|\(\s*132\s*[,)]", line), f"{path}:{number}: {line.strip()}"
