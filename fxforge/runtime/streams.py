"""Streams: persistent worker threads, each with its own intra-op thread count, running calls side by side.

``torch.set_num_threads(k)`` called inside a thread sets that thread's OpenMP team only (the caller's count
is left as it was), and PyTorch's operators release the GIL: ``streams`` threads of ``threads`` intra-op
threads each serve ``streams`` independent requests at once on ``streams x threads`` cores, where one call
with every core would leave most of them waiting in a small model's many small operators.

A call handed to a stream runs with the caller's grad mode (grad mode is per thread in PyTorch).

Example:
    >>> with Streams(2, 1) as streams:
    ...     futures = [streams.submit(torch.get_num_threads) for _ in range(4)]
    ...     [f.result() for f in futures]
    [1, 1, 1, 1]
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

import torch


def cores() -> int:
    """The cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count()``).

    Example:
        >>> cores() >= 1
        True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Streams:
    """``streams`` worker threads, each running ``threads`` intra-op threads, fed from one queue.

    One stream is no worker thread: a call runs in the caller's thread, one at a time (a lock), with the caller's
    intra-op thread count set to ``threads`` for the call and put back after, so that the latency configuration
    pays no hand-off between threads (tens of microseconds, which a model of a few microseconds would feel).

    Args:
        streams: worker threads (calls that run at once).
        threads: ``torch.set_num_threads`` of each worker.

    Use it as a context manager, or call :meth:`close`; the caller's own thread count is left as it was.

    Example:
        >>> with Streams(1, 1) as one:
        ...     one.submit(lambda a, b: a + b, 2, 3).result()
        5
    """

    def __init__(self, streams: int, threads: int):
        if streams < 1 or threads < 1:
            raise ValueError(f"streams and threads must be 1 or more, got {streams} x {threads}")
        self.streams, self.threads = streams, threads
        self._lock = threading.Lock()
        self._pool = None if streams == 1 else concurrent.futures.ThreadPoolExecutor(
            max_workers=streams, initializer=torch.set_num_threads, initargs=(threads,),
            thread_name_prefix="fxforge-stream")

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on a free stream (under the caller's grad mode); returns its future."""
        if self._pool is None:
            return self._inline(fn, args)
        grad = torch.is_grad_enabled()

        def run() -> Any:
            with torch.set_grad_enabled(grad):
                return fn(*args)

        return self._pool.submit(run)

    def _inline(self, fn: Callable[..., Any], args: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            before = torch.get_num_threads()
            if before != self.threads:
                torch.set_num_threads(self.threads)
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 - handed to the caller through the future, as a pool does
                future.set_exception(error)
            finally:
                if before != self.threads:
                    torch.set_num_threads(before)
        return future

    def close(self) -> None:
        """Wait for the calls submitted, then end the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> Streams:  # noqa: PYI034 - returns itself, as a context manager does
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Streams({self.streams} x {self.threads} threads)"
