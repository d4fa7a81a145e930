"""A step timed beside its twins: what one rank's step takes while the other ranks on the same machine run
theirs.

Ranks of a CPU mesh share this machine's cores, memory bandwidth and caches. A step timed alone here runs
faster than the same step on a rank whose neighbours compute at the same time (1-28 % on the two-core
machine of ``benchmarks/RESULTS.md``, every prediction low). :class:`Twins` starts processes that run the
same model's forward and backward in a loop on the same threads each and waits until each has run one step;
the planner times its steps inside the block (:func:`~fxforge.parallel.step_costs.time_step`), and the
twins end when it leaves.

A twin loads the model with ``torch.load``: its class must be importable (as for any multi-process run).
Where it is not, entering the block says so (:class:`TwinsUnavailable`) and the planner times the step
alone and writes that in the plan's notes.

Example (slow: starts processes)::

    with Twins(model, (x,), {}, threads=1, count=1):
        fb, opt = time_step(model, (x,), {}, loss_fn, None, threads=1)
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

READY_TIMEOUT_S = 120.0
"""Seconds a twin may take to load the model and run its first step."""

LIFETIME_S = 600.0
"""A twin ends by itself after this long, should the process that started it die without ending it."""


class TwinsUnavailable(RuntimeError):
    """The twins could not run the model (its class does not load in another process, or a twin failed)."""


class Twins:
    """``count`` processes running ``model``'s forward and backward on ``args``/``kwargs`` in a loop, on
    ``threads`` threads each, from entering the block (once each has run one step) to leaving it.

    Raises:
        TwinsUnavailable: on entering, the model could not be sent to or run in another process.
    """

    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict, *, threads: int, count: int):
        self.model, self.args, self.kwargs, self.threads, self.count = model, args, kwargs, threads, count
        self._procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> Twins:  # noqa: PYI034
        if self.count <= 0:
            return self
        self._tmp = tempfile.TemporaryDirectory(prefix="fxforge-twins-")
        folder = Path(self._tmp.name)
        try:
            try:
                torch.save({"model": self.model, "args": self.args, "kwargs": self.kwargs, "threads": self.threads},
                           folder / "twin.pt")
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                raise TwinsUnavailable(f"the model cannot be saved for another process ({error})") from None
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                       OMP_NUM_THREADS=str(self.threads))
            for i in range(self.count):
                self._logs.append(open(folder / f"twin{i}.log", "w+", encoding="utf-8"))
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fxforge.parallel.twins", str(folder / "twin.pt"),
                     str(folder / f"twin{i}.ready")], env=env, stdout=subprocess.DEVNULL, stderr=self._logs[-1]))
            _wait_ready(self._procs, self._logs, folder)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()
        for log in self._logs:
            log.close()
        self._procs, self._logs = [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _wait_ready(procs: list[subprocess.Popen], logs: list[Any], folder: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all((folder / f"twin{i}.ready").exists() for i in range(len(procs))):
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                log.seek(0)
                lines = [line for line in log.read().splitlines() if line.strip()]
                raise TwinsUnavailable(f"a twin process failed: {lines[-1] if lines else proc.returncode}")
        if time.monotonic() > deadline:
            raise TwinsUnavailable(f"the twins did not run a step in {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.01)


def _twin(payload_path: str, ready_path: str) -> None:
    """A twin: the model's forward and backward in a loop, on the payload's threads, until ended."""
    payload = torch.load(payload_path, weights_only=False)
    torch.set_num_threads(payload["threads"])
    model, args, kwargs = payload["model"], payload["args"], payload["kwargs"]
    from fxforge.parallel.launch import square_mean_loss

    end = time.monotonic() + LIFETIME_S
    ready = False
    while time.monotonic() < end:
        for p in model.parameters():
            p.grad = None
        square_mean_loss(model(*args, **kwargs)).backward()
        if not ready:
            Path(ready_path).touch()
            ready = True


if __name__ == "__main__":
    _twin(sys.argv[1], sys.argv[2])
