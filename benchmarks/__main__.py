"""``python -m benchmarks``: see :func:`benchmarks.run.main`."""

import sys

from benchmarks.run import main

if __name__ == "__main__":
    sys.exit(main())
