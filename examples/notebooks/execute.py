"""`make notebooks`: run every notebook in this folder top to bottom and save it in place with its outputs.

Each notebook runs in a fresh ``python3`` kernel (this interpreter) with ``examples/notebooks`` as its working
directory; a cell that raises stops that notebook, leaves its file as it was, and makes the command exit 1.

Run: python examples/notebooks/execute.py [NAME.ipynb ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 600


def execute(path: Path) -> float:
    """Execute the notebook at ``path`` in place; return the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(HERE)}})
    start = time.perf_counter()
    client.execute()
    for cell in nb.cells:  # wall-clock timestamps only make every run a diff
        cell.metadata.pop("execution", None)
    tmp = path.with_name(path.name + ".tmp")
    nbformat.write(nb, tmp)
    tmp.replace(path)
    return time.perf_counter() - start


def main(names: list[str]) -> int:
    paths = [HERE / n for n in names] if names else sorted(HERE.glob("*.ipynb"))
    failed = 0
    for path in paths:
        try:
            print(f"{path.name}: executed in {execute(path):.1f} s", flush=True)
        except nbclient.exceptions.CellExecutionError as err:
            failed += 1
            print(f"{path.name}: FAILED, left unchanged\n{str(err)[-2000:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
