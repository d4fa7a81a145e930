"""Starting local worker processes on ``torch.distributed`` and collecting what each wrote back.

Every multi-process run of fxforge (a pipeline, a data/tensor/fully-sharded plan, the link measurement)
does the same: write one payload file, start ``world`` Python processes running a worker module with
``MASTER_ADDR``/``MASTER_PORT`` set and this process's ``sys.path``, wait with a deadline, and read
``rank{R}.pt`` from each, or the first rank's own error (``rank{R}.error``) when one failed; the others
then only report that a peer hung up.

A worker module has ``main(argv) -> int`` taking ``PAYLOAD RANK WORLD OUT_DIR [SETUP_MODULE:FUNCTION]``;
:func:`worker_main` does the common part of that (setup call, payload, process group, error file).

Example (slow: starts processes)::

    results = run_workers("fxforge.parallel.mesh_worker", payload, world=2, threads=1)
    results[0]["seconds"]
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fxforge.runtime.link_measure import free_port

PEER_HUNG_UP = ("Connection closed by peer", "Connection reset by peer")
"""What gloo says on a rank whose peer failed (it depends on when the peer went): the peer's own error is the
one to report."""


def setup_name(worker_setup: Callable[[], Any] | None) -> list[str]:
    """``["module:function"]`` for a module-level setup function the workers call first, or ``[]``.

    Example:
        >>> setup_name(error_line)
        ['fxforge.parallel.processes:error_line']
    """
    return [f"{worker_setup.__module__}:{worker_setup.__qualname__}"] if worker_setup else []


def run_workers(module: str, payload: dict[str, Any], world: int, *, threads: int, timeout: float = 600.0,
                worker_setup: Callable[[], Any] | None = None, what: str = "worker") -> list[dict[str, Any]]:
    """Run ``python -m module PAYLOAD RANK WORLD OUT_DIR`` for every rank and return what each saved.

    Args:
        module: the worker module (its ``main`` writes ``OUT_DIR/rank{R}.pt``).
        payload: saved with ``torch.save`` for the workers (a model in it must be importable by class).
        world: the number of processes.
        threads: torch/OpenMP threads per process.
        timeout: seconds to wait for all of them.
        worker_setup: a module-level function each worker calls before it loads the payload.
        what: how an error names a rank (``"pipeline stage"``, ``"rank"``...).

    Raises:
        RuntimeError: a worker failed (its own last error line is given) or did not finish in time.
    """
    with tempfile.TemporaryDirectory(prefix="fxforge-workers-") as tmp:
        folder = Path(tmp)
        path = folder / "payload.pt"
        torch.save(payload, path)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS=str(threads))
        # Each rank's stderr goes to a file: a pipe read rank by rank blocks a later rank once it has written
        # 64 KiB of warnings, and the earlier ranks then wait for it in a collective until the deadline.
        logs = [open(folder / f"rank{rank}.stderr", "w+", encoding="utf-8") for rank in range(world)]  # noqa: SIM115
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(world):
                procs.append(subprocess.Popen([sys.executable, "-m", module, str(path), str(rank), str(world),
                                               str(folder), *setup_name(worker_setup)], env=env,
                                              stdout=subprocess.DEVNULL, stderr=logs[rank]))
            failed = _wait(procs, timeout, what)
            errors = {}
            for rank in failed:
                logs[rank].seek(0)
                lines = [line for line in logs[rank].read().strip().splitlines() if line.strip()]
                errors[rank] = lines[-1] if lines else f"exit code {procs[rank].returncode}"
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log in logs:
                log.close()
        if errors:
            own = {rank: (folder / f"rank{rank}.error").read_text() for rank in errors
                   if (folder / f"rank{rank}.error").is_file()}
            first = [(r, line) for r, line in sorted(own.items()) if not any(words in line for words in PEER_HUNG_UP)]
            rank, line = (first or sorted(own.items()) or sorted(errors.items()))[0]
            raise RuntimeError(f"{what} {rank} failed: {line}")
        return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _wait(procs: list[subprocess.Popen], timeout: float, what: str) -> list[int]:
    """Wait for every process; once one has failed, the others get a few seconds to write their own error
    (a peer's failure ends their collectives) and are then ended. Returns the ranks that exited non-zero."""
    deadline = time.monotonic() + timeout
    grace_end = None
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if all(code is not None for code in codes):
            return failed
        now = time.monotonic()
        if failed and grace_end is None:
            grace_end = now + 10.0
        if grace_end is not None and now > grace_end:
            return [rank for rank, proc in enumerate(procs) if proc.poll() not in (None, 0)]
        if now > deadline:
            raise RuntimeError(f"the {what}s did not finish in {timeout:.0f} s")
        time.sleep(0.01)


def error_line(error: BaseException) -> str:
    """The exception and its cause on one line, for the launcher.

    Example:
        >>> error_line(ValueError("bad  size\\n here"))
        'ValueError: bad size here'
    """
    cause = error.__cause__ or error.__context__
    text = f"{type(error).__name__}: " + " ".join(str(error).split())[:400]
    if cause is not None:
        text += f" (from {type(cause).__name__}: {' '.join(str(cause).split())[:300]})"
    return text


def worker_main(argv: list[str], run_rank: Callable[[dict[str, Any], int, int, torch.device], dict[str, Any]]
                ) -> int:
    """A worker's ``main``: setup, payload, process group, ``run_rank``, and the result or error file.

    ``run_rank(payload, rank, world, device)`` runs with the default process group initialised (the
    payload's ``backend``; on CUDA one device per rank) and returns what to save.
    """
    payload_path, rank, world, out_dir = argv[0], int(argv[1]), int(argv[2]), argv[3]
    if len(argv) > 4:  # module:function to call before the payload is loaded
        module, _, name = argv[4].partition(":")
        getattr(importlib.import_module(module), name)()
    payload = torch.load(payload_path, weights_only=False)
    if payload.get("cuda"):
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.distributed.init_process_group(payload["backend"], rank=rank, world_size=world)
    try:
        result = run_rank(payload, rank, world, device)
    except Exception as error:
        Path(out_dir, f"rank{rank}.error").write_text(error_line(error))
        raise
    finally:
        torch.distributed.destroy_process_group()
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    return 0
