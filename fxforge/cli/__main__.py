"""``python -m fxforge.cli``: the same as the ``fxforge`` command."""

import sys

from fxforge.cli import main

sys.exit(main())
