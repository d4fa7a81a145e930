"""Running one benchmark row per model in a new process with cold caches, for the sections that compare compilers.

Each child gets its own empty fxforge cache (autotune and targets) and Inductor cache, Inductor's caches off, so no
contender reuses another's compile of the same graphs, and prints its row as JSON on its last line.

Example::

    rows = rows_in_processes("benchmarks.fusions", ["convnext"], 3, 5)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def rows_in_processes(module: str, models: list[str], *args: object) -> list[dict]:
    """``python -m module name *args`` for each model, cold; its row, or ``{"model", "error"}`` where it failed."""
    rows = []
    for name in models:
        with tempfile.TemporaryDirectory(prefix="fxforge-cold-") as cache:
            env = dict(os.environ, FXFORGE_CACHE_DIR=cache, FXFORGE_TARGET_CACHE="0",
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
            done = subprocess.run([sys.executable, "-m", module, name, *map(str, args)], check=False, cwd=HERE,
                                  env=env, capture_output=True, text=True)
        try:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        except (IndexError, json.JSONDecodeError):
            rows.append({"model": name, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]})
        print(f"{name}: {'failed' if 'error' in rows[-1] else 'done'}", file=sys.stderr)
    return rows
