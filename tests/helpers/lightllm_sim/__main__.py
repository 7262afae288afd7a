"""``python -m helpers.lightllm_sim capacity`` (run from ``tests/``, or with ``PYTHONPATH=tests``): the table of
docs/INTEGRATION.md, the tokens a LightLLM GPU admits more with online HCA than with the C128 ring."""

import sys

from dsv4_compressor.integrations import lightllm as adapter

from .capacity import capacity_report, capacity_table

if sys.argv[1:] != ["capacity"]:
    sys.exit("usage: python -m helpers.lightllm_sim capacity  (from tests/, or with PYTHONPATH=tests)")
print(capacity_table(capacity_report(adapter)))
