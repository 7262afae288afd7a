"""Test configuration: without a GPU, kernels run under the Triton interpreter on CPU (SPEC section 9)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
from _helpers import STREAMING_BACKENDS, backend_missing  # noqa: E402


@pytest.fixture(scope="session", params=STREAMING_BACKENDS)
def backend(request) -> str:
    """Each streaming backend by name; those whose module does not exist yet are skipped."""
    reason = backend_missing(request.param)
    if reason is not None:
        pytest.skip(reason)
    return request.param
