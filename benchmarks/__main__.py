"""``python -m benchmarks``: the full benchmark (``--quick`` for a smoke run)."""

import sys

from benchmarks.bench import main

sys.exit(main())
