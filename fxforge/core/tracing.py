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

from fxforge.core.module_snapshot import ModuleSnapshot, left_as_found

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
        self._traced: ModuleSnapshot | None = None  # the modules as the last trace left them

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> torch.fx.Graph:
        """Trace ``root``, with tensors built from traced sizes or dtypes recorded (see :func:`shape_built`),
        leaving ``root`` as it was, whether the trace succeeds or fails
        (:func:`~fxforge.core.module_snapshot.left_as_found`): what the forward wrote on its modules meanwhile (a
        cache entry holding a proxy, a tensor constant torch.fx stowed on the root) is taken off again;
        :meth:`graph_module` puts it back only while it builds the GraphModule.

        Example:
            >>> class Caching(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.cache = {}
            ...     def forward(self, x):
            ...         self.cache["y"] = x + 1
            ...         return self.cache["y"]
            >>> model = Caching()
            >>> with tracing():
            ...     _ = ThreadBoundTracer().trace(model)
            >>> model.cache
            {}
        """
        self._traced = None
        with left_as_found(root), shape_built():
            graph = super().trace(root, concrete_args)
            self._traced = ModuleSnapshot(list(root.modules())) if isinstance(root, torch.nn.Module) else None
        return graph

    def graph_module(self, graph: torch.fx.Graph, name: str) -> torch.fx.GraphModule:
        """The GraphModule of a traced ``graph``, leaving the traced model as it was.

        torch.fx stows tensors the forward creates (``torch.tensor([...])`` constants) as attributes of the
        traced root (``_tensor_constant0``) so a ``get_attr`` can reach them (and a forward may register a
        submodule it calls). The GraphModule takes its own reference while the modules are as the trace left
        them; then they are put back as they were, which would otherwise look as if the model's forward set new
        state on every traced call.

        Example:
            >>> class Net(torch.nn.Module):
            ...     def forward(self, x):
            ...         return x + torch.tensor([1.0, 2.0])
            >>> net, tracer = Net(), ThreadBoundTracer()
            >>> with tracing():
            ...     gm = tracer.graph_module(tracer.trace(net), "Net")
            >>> gm(torch.zeros(2)).tolist(), hasattr(net, "_tensor_constant0")
            ([1.0, 2.0], False)
        """
        if self._traced is None or not isinstance(self.root, torch.nn.Module):
            return torch.fx.GraphModule(self.root, graph, name)
        with left_as_found(self.root):
            self._traced.restore()
            return torch.fx.GraphModule(self.root, graph, name)

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if threading.get_ident() != self.thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


# torch functions that take sizes or a dtype as plain Python values, so torch.fx cannot see a traced size in
# them (``torch.zeros(q.size(0), 4)`` raises a TypeError inside the call): while a trace runs, a call of one
# with a traced value among its arguments is recorded as a node instead.
SHAPE_BUILT = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "eye", "finfo", "iinfo",
               "tensor", "as_tensor")


@contextlib.contextmanager
def shape_built() -> Iterator[None]:
    """For the block, the torch functions of :data:`SHAPE_BUILT` record a graph node when an argument is a
    traced value (``torch.ones(q.size(0), 4)``, ``torch.finfo(q.dtype).min``); called with plain values, from
    any thread, they run as they are. Callers hold the trace lock (:func:`tracing`).

    Example:
        >>> gm = symbolic_trace(lambda q: q + torch.zeros(q.size(0), 1) + torch.finfo(q.dtype).eps)
        >>> {torch.zeros, torch.finfo} <= {n.target for n in gm.graph.nodes}, gm(torch.zeros(3, 2)).shape
        (True, torch.Size([3, 2]))
    """
    # Modules imported for the first time inside the block would take the stand-ins for torch's own names:
    # torch.fx imports torch._dynamo lazily while it traces, and dynamo keeps torch.finfo and torch.iinfo in
    # its set of constant *types*, where a stand-in function breaks every later torch.compile guard. So it is
    # imported before anything is replaced.
    import torch._dynamo.utils
    originals = {name: getattr(torch, name) for name in SHAPE_BUILT}
    for name, fn in originals.items():
        setattr(torch, name, _recording(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


def _recording(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        proxy = next((v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.fx.Proxy)),
                     None)
        if proxy is None:
            return fn(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", fn, args, kwargs)

    call.__name__ = getattr(fn, "__name__", "shape_built")
    call.__doc__ = fn.__doc__
    return call


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
        return tracer.graph_module(graph, name)
