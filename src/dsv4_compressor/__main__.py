"""``python -m dsv4_compressor``: the command line (see :mod:`dsv4_compressor.cli`)."""

import sys

from .cli import main

sys.exit(main())
