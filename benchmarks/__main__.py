"""``python -m benchmarks``: see :mod:`benchmarks.harness`."""

import sys

from benchmarks.harness import main

if __name__ == "__main__":
    sys.exit(main())
