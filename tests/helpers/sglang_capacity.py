"""``python -m dsv4_compressor.integrations.sglang.capacity`` where SGLang's multimodal configs cannot import
torchvision (CPU machines: PyPI's torchvision builds are CUDA builds): the test suite's inert stand-in for it
first (``test_engine_sglang``), then the table. Run: ``PYTHONPATH=src:tests python -m helpers.sglang_capacity``."""

from __future__ import annotations

import test_engine_sglang  # noqa: F401  (puts the torchvision stand-in on the import path)

from dsv4_compressor.integrations.sglang import capacity

if __name__ == "__main__":
    capacity.main()
