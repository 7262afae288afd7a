"""``python -m benchmarks``: the benchmark's command line (also for ``--dry-run`` without a GPU)."""

import sys

from .cli import main

sys.exit(main())
