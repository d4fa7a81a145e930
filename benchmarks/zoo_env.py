"""A section's zoo models in the zoo environment (``.venv-zoo``: torchvision and timm, ``make zoo``).

The main environment has no torchvision or timm (see :mod:`benchmarks.zoo`); a section with zoo models
(``--suite training``, ``--suite pipeline``) runs them with :func:`run_in_zoo`: the same section, in a new
``python -m benchmarks`` process of the zoo environment, writing its JSON to a temporary folder, which
the section merges into its own results.

Example:
    >>> zoo_passthrough(["--suite", "training", "--models", "a,b", "--quick", "--out=x", "--no-markdown",
    ...                  "--rounds", "2"])
    ['--quick', '--rounds', '2']
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile

from benchmarks.log import log
from benchmarks.report import REPO_ROOT

ZOO_PYTHON = os.path.join(REPO_ROOT, ".venv-zoo", "bin", "python")
"""The zoo environment's interpreter (``make zoo`` builds it)."""

ZOO_RUNNER_OPTIONS = ("--suite", "--models", "--out", "--markdown", "--zoo-python")
"""Options :func:`run_in_zoo` sets itself for the zoo process (the rest of the command line passes through)."""


def zoo_passthrough(argv: list[str]) -> list[str]:
    """The arguments the zoo process gets from ours: all but :data:`ZOO_RUNNER_OPTIONS` (with their values)
    and ``--no-markdown``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ZOO_RUNNER_OPTIONS:
            skip = True
        elif arg.split("=")[0] not in ZOO_RUNNER_OPTIONS and arg != "--no-markdown":
            out.append(arg)
    return out


def run_in_zoo(section: str, models: list[str], argv: list[str], python: str = ZOO_PYTHON) -> tuple[dict | None, str | None]:
    """``python -m benchmarks --suite SECTION --models ... --out TMP --no-markdown`` plus
    :func:`zoo_passthrough` of ``argv`` (our arguments) in the zoo environment's ``python`` (its log on our
    stderr): ``(its results-SECTION.json, None)``, or ``(None, why)`` when it cannot run."""
    if not os.path.exists(python):
        return None, f"the zoo environment is missing ({python}; `make zoo` builds it)"
    with tempfile.TemporaryDirectory(prefix=f"fxforge-bench-{section}-") as out:
        cmd = [python, "-m", "benchmarks", "--suite", section, "--models", ",".join(models), "--out", out,
               "--no-markdown", *zoo_passthrough(argv)]
        log(f"zoo models in {os.path.dirname(os.path.dirname(python))}: {shlex.join(cmd[1:])}")
        proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, check=False)
        path = os.path.join(out, f"results-{section}.json")
        if not os.path.exists(path):
            return None, f"the zoo run exited with status {proc.returncode} and wrote no results"
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    if proc.returncode != 0:
        result.setdefault("meta", {})["zoo_returncode"] = proc.returncode
    return result, None
