"""Tracing a model without disturbing other threads.

While torch.fx traces (``symbolic_trace``, and ``torch.export``, which traces with an fx tracer too), it
patches ``nn.Module.__call__`` and ``nn.Module.__getattr__`` for the whole process and puts them back when
it is done. Two traces in two threads can interleave those patches and leave a finished tracer's wrapper
installed; and a module called from another thread meanwhile reaches the tracer instead of its forward.
So fxforge:

- traces one model at a time per process (:func:`tracing`, a reentrant lock every capture, pattern and
  export trace holds), so concurrent optimizations queue for the trace only, not for the rest;
- traces with :class:`ThreadBoundTracer`, which hands module calls and attribute reads made by other
  threads straight to the module, so optimized modules keep running while another model is captured.

Example:
    >>> with tracing():
    ...     graph = ThreadBoundTracer().trace(torch.nn.Sequential(torch.nn.ReLU()))
    >>> [n.op for n in graph.nodes]
    ['placeholder', 'call_module', 'output']
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

# One trace at a time in this process (a lock: synchronisation, not state that carries results).
_TRACE_LOCK = threading.RLock()


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Hold the process's trace lock for the block (reentrant: a trace may start another).

    Example:
        >>> with tracing(), tracing():
        ...     pass
    """
    with _TRACE_LOCK:
        yield


class ThreadBoundTracer(torch.fx.Tracer):
    """An fx tracer that records only the thread that created it; other threads' module calls and
    attribute reads, which reach it through torch.fx's process-wide patches, run as if nothing traced.

    Example:
        >>> ThreadBoundTracer().trace(torch.nn.Sequential(torch.nn.Linear(2, 2))).find_nodes(op="call_module")[0].target
        '0'
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.thread = threading.get_ident()

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if threading.get_ident() != self.thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


def symbolic_trace(fn: Callable[..., Any] | torch.nn.Module) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace`` with a :class:`ThreadBoundTracer`, holding the trace lock.

    Example:
        >>> symbolic_trace(lambda x: x + 1)(torch.ones(1)).tolist()
        [2.0]
    """
    with tracing():
        tracer = ThreadBoundTracer()
        graph = tracer.trace(fn)
    name = fn.__class__.__name__ if isinstance(fn, torch.nn.Module) else fn.__name__
    return torch.fx.GraphModule(tracer.root, graph, name)
