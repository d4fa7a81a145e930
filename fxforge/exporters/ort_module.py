"""Run an exported ONNX model in ONNX Runtime as an ``nn.Module``, called like the original model.

:class:`OnnxRuntimeModule` is what ``fxforge.optimize(model, inputs, target="onnxruntime")`` returns. It
takes the model's own inputs (positional, keyword, nested), feeds their tensors to the ONNX session, and
returns the model's own output structure (a tensor, a tuple, a dict, a transformers ``ModelOutput``) as
torch tensors on the inputs' device. :class:`~fxforge.exporters.io_spec.IOSpec` records that mapping at
export time; :mod:`fxforge.exporters.ort_session` opens the session.

Example:
    >>> import torch, fxforge
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    >>> ort_model = fxforge.optimize(model, (torch.ones(2, 4),), target="onnxruntime")
    >>> torch.allclose(ort_model(torch.ones(2, 4)), model(torch.ones(2, 4)), atol=1e-6)
    True
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.core.follows import FollowsTraining
from fxforge.exporters.io_spec import InputShapeError, IOSpec, thawed  # noqa: F401 - importable from here as before
from fxforge.exporters.ort_binding import _ORT_DTYPES, run_bound
from fxforge.exporters.ort_calls import as_exported, other_structure, varied_inputs
from fxforge.exporters.ort_session import (  # noqa: F401 - importable from here as before
    _provider_options,
    default_providers,
    ort_refusal,
    session_options,
)

# How many times ``dynamic=None`` exports again for calls the file does not take; each export adds the dims that
# changed to those already dynamic, so a model whose image height, then width, then batch change exports four
# times at most (an image's H and W become dynamic together, with the batch).
MAX_GROWTH = 3

# (args, kwargs, path, the session's options[, before=]) -> (the OnnxExport, the OnnxRuntimeModule that validated
# it); ``before``: the inputs of the export this one replaces (the dims that changed since become dynamic).
Exporter = Callable[..., tuple[Any, "OnnxRuntimeModule"]]


def _dims_text(shape: Sequence[Any]) -> str:
    return "(" + ", ".join(str(d) if d is not None else "?" for d in shape) + ("," if len(shape) == 1 else "") + ")"


class OnnxRuntimeModule(nn.Module):
    """An ``nn.Module`` running an ONNX model in an ONNX Runtime session, called like the original model.

    The ONNX model holds the weights as they were at export; the module has no parameters of its own
    (re-optimize after changing the model's weights). The session is created with
    :func:`session_options` unless ``session_options`` is given; setting :attr:`intra_op_num_threads`,
    :attr:`session_options` or :attr:`providers` creates a new session. With ``follow_threads`` set (as
    ``objective="throughput"`` does, for its streams) and the default options, a CPU call runs on a session of
    as many intra-op threads as torch has in the calling thread: one per count, made from the same file on first
    use, dropped with the session they copy.

    Inputs on the session's device are bound in place (IO binding); on CUDA, outputs are written
    straight into torch tensors on the device when their shapes follow from the inputs'. Outputs come back
    on the device of the inputs, in the model's own structure.

    A module that exports the model itself (:meth:`deferred`) counts its exports in :attr:`exports`; with
    ``dynamic=None`` it exports once more when a call differs from the exported sizes (see :meth:`deferred`).
    Its ``training`` flag is then the model's (``model.eval()`` is seen here, ``.train()`` here sets the model's
    modes); the session runs the graph of the mode it was exported in.

    Args:
        path: the ``.onnx`` file.
        io: how the model's inputs and outputs map to the ONNX graph's (see :class:`IOSpec`); by default
            the ONNX inputs in order, positionally, and one output or a tuple.
        providers: ONNX Runtime execution providers (default :func:`default_providers`).
        session_options: an ``onnxruntime.SessionOptions`` (default :func:`session_options`).
        intra_op_num_threads: threads of the default session options (default torch's thread count).
        report: what fxforge did to the model before export (``.report``).
        owned_dir: a directory removed when this module is garbage collected (a temporary export).

    Raises:
        InputShapeError: (on call) inputs whose structure, shapes or dtypes the ONNX model does not take.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "relu.onnx")
        >>> _ = fxforge.export_onnx(torch.nn.ReLU(), path, (torch.ones(2, 3),))
        >>> module = OnnxRuntimeModule(path)
        >>> module(-torch.ones(2, 3)).sum().item(), module.intra_op_num_threads == torch.get_num_threads()
        (0.0, True)
        >>> module(torch.ones(4, 3))
        Traceback (most recent call last):
        ...
        fxforge.exporters.io_spec.InputShapeError: input 'input' has shape (4, 3); the ONNX model takes (2, 3) (export with dynamic=True, dynamic_batch=True or dynamic_shapes= for other sizes)
    """

    training = FollowsTraining(lambda self: self.__dict__.get("original"))

    def __init__(self, path: str | os.PathLike | None, io: IOSpec | None = None, *,
                 providers: Sequence[Any] | None = None, session_options: Any = None,
                 intra_op_num_threads: int | None = None, report: Any = None, owned_dir: str | None = None):
        super().__init__()
        self.path = os.fspath(path) if path is not None else None
        self.report = report
        self.onnx_export = None  # the OnnxExport, when this module exported the model itself
        self._providers = list(providers) if providers is not None else default_providers()
        self._threads = intra_op_num_threads
        self._options = session_options
        self._session = None
        self._export: Exporter | None = None
        self._export_path: str | None = None
        self._dynamic: bool | None = False  # None: export again once when only sizes change
        self._exports = 0
        self._exported_for: Any = None  # the last export's inputs, as meta tensors (shapes and dtypes only)
        self._owned_dir: str | None = None
        self._grown = 0  # how many times dynamic=None exported again (at most MAX_GROWTH)
        self._serve: Any = None  # inputs (as meta tensors) the first export must take too
        self.follow_threads = False  # CPU calls on a session of the calling thread's torch thread count
        self._by_threads: dict[int, Any] = {}  # thread count -> its session (follow_threads)
        self._lock = threading.Lock()
        if owned_dir is not None:
            self._cleanup = weakref.finalize(self, shutil.rmtree, owned_dir, True)
        self.io = io
        if self.path is not None:
            self._create_session()
            if io is None:
                self.io = IOSpec.for_tensors([i.name for i in self._session.get_inputs()],
                                             len(self._session.get_outputs()))

    @classmethod
    def deferred(cls, model: nn.Module, export: Exporter, *, path: str | os.PathLike | None = None,
                 providers: Sequence[Any] | None = None, session_options: Any = None,
                 intra_op_num_threads: int | None = None, dynamic: bool | None = False,
                 serve: Any = None) -> OnnxRuntimeModule:
        """A module that exports ``model`` on its first call (or :meth:`prepare`), with that call's inputs.

        ``export(args, kwargs, path, module_options)`` writes the checked, validated ONNX file at ``path``
        and returns ``(OnnxExport, the OnnxRuntimeModule that validated it)``
        (:func:`fxforge.targets.onnxruntime.onnxruntime_module` hands in fxforge's export). The file goes to ``path`` if
        given, else to a temporary folder removed with the module.

        ``dynamic=None`` (``torch.compile``'s automatic dynamic): when a later call differs from the exported
        inputs only in sizes (same structure, dtypes, ranks) and the file does not take it, the model is
        exported once more, ``export(args, kwargs, path, module_options, before=exported inputs)``, which
        makes the dims that changed dynamic; its session replaces the old one (freed) and serves every
        later call; a call that file does not take either exports again with the dims that varied so far
        and the new ones dynamic, up to :data:`MAX_GROWTH` times, after which it raises
        :class:`InputShapeError`. A call of another structure (an optional keyword input left out or added, a
        Python value other than the exported one, inputs of other dtypes: int32 token ids where the file takes
        int64) gets a file and session of its own, exported on its first call, as a native plan is made per
        call structure and dtypes. True or False: the file of the first export serves every call (the
        exporter decides which dims are dynamic). :attr:`exports` counts the exports.

        ``serve``: other inputs ``(args, kwargs)`` the first export must take too: it is made as that export
        for other sizes is, ``before=`` their shapes, so the dims where they differ from the first call's are
        dynamic from the start.

        Example:
            >>> from fxforge.targets.onnxruntime import onnxruntime_module
            >>> m = onnxruntime_module(torch.nn.Tanh().eval(), intra_op_num_threads=1)
            >>> m(torch.zeros(2)).tolist(), m.intra_op_num_threads
            ([0.0, 0.0], 1)
        """
        module = cls(None, providers=providers, session_options=session_options,
                     intra_op_num_threads=intra_op_num_threads)
        module.__dict__["original"] = model  # not a submodule: the ONNX file holds the weights
        module._export = export
        module._export_path = os.fspath(path) if path is not None else None
        module._dynamic = dynamic
        module._serve = pytree.tree_map(
            lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t,
            (tuple(serve[0]), dict(serve[1]))) if serve is not None else None
        return module

    def train(self, mode: bool = True) -> OnnxRuntimeModule:
        original = self.__dict__.get("original")
        if original is None:
            return super().train(mode)
        original.train(mode)  # (this module's flag is the model's)
        return self

    @property
    def exports(self) -> int:
        """How many times this module exported the model (each export made a new ONNX file and session): 0
        for a module made from a file or not exported yet, 1 after the first call, 2 once ``dynamic=None``
        exported again for other sizes. Read-only.

        Example:
            >>> from fxforge.targets.onnxruntime import onnxruntime_module
            >>> m = onnxruntime_module(torch.nn.ReLU().eval(), (torch.ones(2, 3),), dynamic=True)
            >>> _ = m(torch.ones(5, 3)); m.exports
            1
        """
        return self._exports + sum(v.exports for v in self.__dict__.get("_variants", {}).values())

    def prepare(self, *args: Any, **kwargs: Any) -> OnnxRuntimeModule:
        """Export the model for these inputs now, if it was not exported yet (see :meth:`deferred`)."""
        if self._session is not None:
            return self
        if self._export is None:
            raise RuntimeError("this OnnxRuntimeModule has no ONNX file and no model to export")
        self._export_now(tuple(args), dict(kwargs), before=self._serve)
        return self

    def _export_now(self, args: tuple, kwargs: dict, before: Any = None) -> None:
        """Export for these inputs (``before``: the inputs of the export this one replaces) and take over the
        validating module's session; the old session, if any, is dropped only once the new one works."""
        target, owned = self._export_path, None
        if target is not None and not os.path.isdir(os.path.dirname(os.path.abspath(target))):
            raise FileNotFoundError(f"cannot write {target!r}: no folder {os.path.dirname(os.path.abspath(target))!r}")
        if target is None:
            if self._owned_dir is None:
                owned = tempfile.mkdtemp(prefix="fxforge-ort-")
            target = os.path.join(owned or self._owned_dir, f"{type(self.original).__name__}.onnx")
        options = {"providers": self._providers, "session_options": self._options,
                   "intra_op_num_threads": self._threads}
        # An ONNX file takes its inputs dense: a call's strided view (ids[:, :4] of a longer batch) exported as it
        # is would tie a dynamic dim to its stride (torch.export's guard "size != 7" on the slice's source).
        args, kwargs = pytree.tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, (args, kwargs))
        try:
            with _runs_its_own_forward(self.original):
                if before is None:
                    result, validated = self._export(args, kwargs, target, options)
                else:
                    result, validated = self._export(args, kwargs, target, options, before=before)
        except BaseException:
            if owned is not None:
                shutil.rmtree(owned, ignore_errors=True)
            raise
        if owned is not None:
            self._owned_dir = owned
            self._cleanup = weakref.finalize(self, shutil.rmtree, owned, True)
        self._session, self._by_threads = None, {}  # the old sessions go now (the new one is open)
        for name in ("path", "io", "report", "_session", "_input_meta", "_output_meta", "_on_cuda"):
            setattr(self, name, getattr(validated, name))
        validated._session = None
        self.onnx_export = result
        self._exports += 1
        self._exported_for = pytree.tree_map(
            lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t,
            (args, kwargs))

    def _other_structure(self, args: tuple, kwargs: dict) -> bool:
        return other_structure(self.io, args, kwargs)

    def _variant(self, args: tuple, kwargs: dict) -> OnnxRuntimeModule:
        """The module for calls that pass other inputs than the exported ones (an optional keyword left out or
        added, or inputs of other dtypes): with ``dynamic=None`` each set of inputs gets an export of its own,
        made on its first call, as a native plan is made per call structure and dtypes."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        key = (spec, tuple(("tensor", v.dtype, v.dim()) if isinstance(v, torch.Tensor) else ("value", repr(v))
                           for v in leaves))
        variants = self.__dict__.setdefault("_variants", {})
        if key not in variants:
            variant = OnnxRuntimeModule.deferred(self.original, self._export, providers=self._providers,
                                                 session_options=self._options, intra_op_num_threads=self._threads,
                                                 dynamic=None)
            variant.prepare(*args, **kwargs)
            variants[key] = variant
        variants[key].follow_threads = self.follow_threads
        return variants[key]

    def _as_exported(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return as_exported(self.io, self.__dict__.get("original"), args, kwargs)

    def _varied(self, feeds: Sequence[tuple[str, torch.Tensor]], args: tuple, kwargs: dict) -> Any:
        return varied_inputs(self._input_meta, feeds, args, kwargs)


    def _differs_in(self, feeds: Sequence[tuple[str, torch.Tensor]]) -> str:
        """How these inputs differ from what the ONNX model takes: ``"ranks"`` (some input has another number
        of dims), else ``"dtypes"`` (another dtype: token ids as int32 where it was exported with int64), else
        ``"sizes"`` (at most their sizes)."""
        dtypes = False
        for name, tensor in feeds:
            meta = self._input_meta[name]
            if len(meta.shape) != tensor.dim():
                return "ranks"
            want = _ORT_DTYPES.get(meta.type)
            dtypes = dtypes or (want is not None and tensor.dtype != want)
        return "dtypes" if dtypes else "sizes"

    # ------------------------------------------------------------------------------------------ session

    def _create_session(self) -> None:
        import onnxruntime as ort

        options = self._options if self._options is not None else session_options(self._threads)
        self._session = ort.InferenceSession(self.path, sess_options=options,
                                             providers=_provider_options(self._providers))
        self._input_meta = {i.name: i for i in self._session.get_inputs()}
        self._output_meta = list(self._session.get_outputs())
        self._on_cuda = self._session.get_providers()[0] == "CUDAExecutionProvider"
        self._by_threads = {}

    def _require_session(self) -> Any:
        if self._session is None:
            raise RuntimeError("the model is exported on the first call (or prepare()); no session yet")
        return self._session

    def _cpu_session(self) -> Any:
        """The session a CPU call runs on: the module's own, or with :attr:`follow_threads` (a throughput module's
        streams set it) one of as many intra-op threads as torch has in the calling thread, made on first use."""
        threads = torch.get_num_threads()
        if not self.follow_threads or self._options is not None or threads == self.intra_op_num_threads:
            return self._session
        with self._lock:
            if threads not in self._by_threads:
                import onnxruntime as ort

                self._by_threads[threads] = ort.InferenceSession(
                    self.path, sess_options=session_options(threads), providers=_provider_options(self._providers))
            return self._by_threads[threads]

    @property
    def session(self) -> Any:
        """The ``onnxruntime.InferenceSession``."""
        return self._require_session()

    @property
    def providers(self) -> list[str]:
        """The providers the session runs on, first choice first."""
        return self._session.get_providers() if self._session is not None else list(self._providers)

    @providers.setter
    def providers(self, providers: Sequence[Any]) -> None:
        self._providers = list(providers)
        self._refresh()

    @property
    def session_options(self) -> Any:
        """The session's ``onnxruntime.SessionOptions`` (assign new ones to recreate the session)."""
        if self._session is None:
            return self._options if self._options is not None else session_options(self._threads)
        return self._session.get_session_options()

    @session_options.setter
    def session_options(self, options: Any) -> None:
        self._options = options
        self._refresh()

    @property
    def intra_op_num_threads(self) -> int:
        """The session's intra-op thread count (assign to recreate the session with another)."""
        return self.session_options.intra_op_num_threads

    @intra_op_num_threads.setter
    def intra_op_num_threads(self, threads: int) -> None:
        self._threads = int(threads)
        if self._options is not None:
            self._options.intra_op_num_threads = int(threads)
        self._refresh()

    def _refresh(self) -> None:
        if self.path is not None:
            self._create_session()

    @property
    def device(self) -> torch.device:
        """Where the session computes: ``cuda:N`` with the CUDA provider, else ``cpu``."""
        if self._session is None:
            on_cuda = bool(self._providers) and self._providers[0] == "CUDAExecutionProvider"
            return torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        if self._on_cuda:
            options = self._session.get_provider_options().get("CUDAExecutionProvider", {})
            return torch.device("cuda", int(options.get("device_id", 0)))
        return torch.device("cpu")

    # ------------------------------------------------------------------------------------------ calls

    def check_inputs(self, feeds: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
        """Check each tensor against the ONNX input's dtype and shape; returns the symbolic dims' values.

        Raises:
            InputShapeError: naming the input, what it got and what the model takes.
        """
        symbols: dict[str, int] = {}
        for name, tensor in feeds:
            meta = self._input_meta[name]
            want = _ORT_DTYPES.get(meta.type)
            if want is not None and tensor.dtype != want:
                raise InputShapeError(f"input {name!r} has dtype {tensor.dtype}; the ONNX model takes {want}")
            shape = list(meta.shape)
            if len(shape) != tensor.dim():
                raise InputShapeError(f"input {name!r} has {tensor.dim()} dims {_dims_text(tensor.shape)}; the ONNX "
                                      f"model takes {len(shape)} {_dims_text(shape)}")
            for axis, (dim, size) in enumerate(zip(shape, tensor.shape)):
                if isinstance(dim, int) and dim != size:
                    raise InputShapeError(
                        f"input {name!r} has shape {_dims_text(tensor.shape)}; the ONNX model takes "
                        f"{_dims_text(shape)} (export with dynamic=True, dynamic_batch=True or dynamic_shapes= for "
                        "other sizes)")
                if isinstance(dim, str) and symbols.setdefault(dim, size) != size:
                    raise InputShapeError(
                        f"input {name!r} has size {size} in dim {axis} ({dim!r}); another input has "
                        f"{symbols[dim]} there, and the ONNX model needs them equal")
        return symbols

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._session is None:
            self.prepare(*args, **kwargs)
        args, kwargs = self._as_exported(args, kwargs)
        try:
            feeds = self.io.feeds(args, kwargs)
        except InputShapeError:
            if not (self._dynamic is None and self._export is not None and self._other_structure(args, kwargs)):
                raise
            return self._variant(args, kwargs)(*args, **kwargs)
        try:
            symbols = self.check_inputs(feeds)
        except InputShapeError as error:
            differs = self._differs_in(feeds)
            if self._dynamic is None and self._export is not None and differs == "dtypes":
                return self._variant(args, kwargs)(*args, **kwargs)  # an export of its own for those dtypes
            if not (self._dynamic is None and self._export is not None and self._grown < MAX_GROWTH
                    and differs == "sizes"):
                raise
            self._grown += 1  # a file that still does not take a call after MAX_GROWTH exports says so
            try:
                self._export_now(tuple(args), dict(kwargs), before=self._varied(feeds, args, kwargs))
            except Exception as failure:
                raise InputShapeError(f"{error}; exporting again with the dims that changed dynamic failed: "
                                      f"{str(failure).splitlines()[0] if str(failure) else type(failure).__name__}"
                                      ) from failure
            feeds = self.io.feeds(args, kwargs)
            symbols = self.check_inputs(feeds)
        devices = [t.device for _, t in feeds]
        out_device = devices[0] if devices else (self.device if self._on_cuda else torch.device("cpu"))
        if self._on_cuda:
            outputs = run_bound(self._session, self._output_meta, self.device, feeds, symbols, out_device)
        else:
            numpy_feeds = {name: _as_numpy(t) for name, t in feeds}
            outputs = [torch.from_numpy(np.asarray(o)).to(out_device) for o in self._cpu_session().run(None, numpy_feeds)]
        return self.io.outputs_from(outputs)

    def extra_repr(self) -> str:
        if self._session is None:
            return "not exported yet"
        return f"path={self.path!r}, providers={self.providers}, intra_op_num_threads={self.intra_op_num_threads}"


@contextlib.contextmanager
def _runs_its_own_forward(model: Any) -> Any:
    """While the block runs, an instance of a class decorated for this target
    (:mod:`fxforge.exporters.ort_decorator`) runs its own forward: exporting it calls it, and its decorated
    forward would call this module again (an export for other sizes starts from a call of that module)."""
    state = getattr(model, "__dict__", {}).get("_fxforge_ort")
    if not isinstance(state, dict):
        yield
        return
    before, state["exporting"] = state.get("exporting", False), True
    try:
        yield
    finally:
        state["exporting"] = before


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        raise InputShapeError("bfloat16 inputs need the CUDA provider (numpy has no bfloat16)")
    return tensor.numpy()
