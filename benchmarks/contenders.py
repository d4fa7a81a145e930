"""The contenders the harness compares: a small registry of named ``prepare`` functions.

A contender turns ``(model, example_inputs)`` into something callable like the model: ``fn(*args)``
returns the model's outputs (any pytree of tensors; ONNX Runtime's list of arrays is turned back into
tensors). ``prepare`` may return the callable itself or a :class:`Prepared` that also carries a short
``note`` for the results table and an ``info`` dict that lands in ``results.json``.

The runner hands every contender but ``eager`` its own ``copy.deepcopy`` of the model, in eval mode, and
calls ``prepare`` and the first call under ``torch.no_grad()``; the time of both together is the row's
"prepare s" (export / compile / optimize time).

Adding a contender (e.g. fxforge -> ONNX Runtime)::

    from benchmarks.contenders import Prepared, register

    @register("fxforge-ort", "fxforge.optimize(model, target='onnxruntime')")
    def _fxforge_ort(model, args):
        import fxforge
        opt = fxforge.optimize(model, example_inputs=args, target="onnxruntime")
        return Prepared(opt, note=_report_note(opt.report), info={"counts": dict(opt.report.counts)})

and it is then selectable with ``--contenders eager,fxforge-ort``. The order of :data:`CONTENDERS` is the
default order of the run and of the tables.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Prepared:
    """What ``prepare`` may return instead of a bare callable.

    Attributes:
        fn: called as ``fn(*example_inputs)``; returns the outputs (a pytree of tensors).
        note: a short text for the table's "note" column (e.g. which rewrites fired).
        info: anything JSON-serialisable; stored under the row's ``info`` in ``results.json``.
        describe: called once after the prepare time was taken (so not counted in it); returns more
            ``info`` (e.g. a digest of the graph ONNX Runtime optimized the model into).
    """

    fn: Callable[..., Any]
    note: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    describe: Callable[[], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Contender:
    """A named way to run a model.

    Attributes:
        name: the name used by ``--contenders`` and in the tables.
        prepare: ``prepare(model, example_inputs) -> callable | Prepared``.
        description: one line for ``--list`` and the results header.
        copy_model: give ``prepare`` its own deep copy of the model (all but ``eager`` do, so that no
            contender can change the weights or modules another one runs).
    """

    name: str
    prepare: Callable[[nn.Module, tuple], Any]
    description: str = ""
    copy_model: bool = True


CONTENDERS: dict[str, Contender] = {}


def register(name: str, description: str = "", *, copy_model: bool = True):
    """Decorator: register ``prepare`` as the contender ``name`` (replacing one of the same name)."""

    def deco(prepare: Callable[[nn.Module, tuple], Any]) -> Callable[[nn.Module, tuple], Any]:
        CONTENDERS[name] = Contender(name, prepare, description, copy_model)
        return prepare

    return deco


def as_prepared(obj: Any) -> Prepared:
    """Normalise what a ``prepare`` returned into a :class:`Prepared`."""
    if isinstance(obj, Prepared):
        return obj
    if not callable(obj):
        raise TypeError(f"prepare returned {type(obj).__name__}, which is not callable")
    return Prepared(obj)


def _device_of(args: tuple) -> torch.device:
    for leaf in torch.utils._pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# eager


@register("eager", "the model as is (eval mode, torch.no_grad)", copy_model=False)
def _eager(model: nn.Module, args: tuple) -> Callable[..., Any]:
    return model


# --------------------------------------------------------------------------------------------------
# torch.compile


@register("torch.compile", "torch.compile(model), default backend (Inductor)")
def _torch_compile(model: nn.Module, args: tuple) -> Prepared:
    compiled = torch.compile(model)
    return Prepared(compiled, note="inductor")


@register("torch.compile-inference",
          "torch.compile(model, options={'freezing': True}): Inductor's recommended CPU-inference setting")
def _torch_compile_inference(model: nn.Module, args: tuple) -> Prepared:
    compiled = torch.compile(model, options={"freezing": True})
    return Prepared(compiled, note="inductor, freezing")


# --------------------------------------------------------------------------------------------------
# torch.fx.experimental.optimization.optimize_for_inference


def raised_in_symbolic_trace(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while ``torch.fx`` symbolically traced a model (inside ``Tracer.trace``)."""
    suffix = os.path.join("fx", "_symbolic_trace.py")
    return any(
        frame.f_code.co_name == "trace" and frame.f_code.co_filename.endswith(suffix)
        for frame, _ in traceback.walk_tb(exc.__traceback__)
    )


def mkldnn_info(gm: nn.Module) -> dict[str, int]:
    """How much of an ``optimize_for_inference`` result runs in MKLDNN layout.

    ``modules``: MKLDNN modules (prepacked convolutions, linears, batch norms); ``conversions``: the
    ``to_mkldnn`` / ``to_dense`` calls left in the graph (each is a layout copy at run time).
    """
    graph = getattr(gm, "graph", None)
    nodes = list(graph.nodes) if graph is not None else []
    conversions = sum(n.op == "call_method" and n.target in ("to_mkldnn", "to_dense") for n in nodes)
    modules = sum(type(m).__module__ == "torch.utils.mkldnn" for m in gm.modules())
    return {"mkldnn_modules": modules, "mkldnn_conversions": conversions}


@register(
    "optimize_for_inference",
    "torch.fx.experimental.optimization.optimize_for_inference(model): conv/BN fusion, dropout "
    "removal, MKLDNN layouts (symbolic_trace; float32 CPU only)",
)
def _optimize_for_inference(model: nn.Module, args: tuple) -> Prepared:
    """``optimize_for_inference`` on the runner's copy of the model.

    It symbolically traces the model (models with data-dependent control flow, such as the transformers
    vision models, fail here: the error says so). Inputs and outputs stay dense tensors: the pass wraps
    every MKLDNN subgraph in ``to_mkldnn`` / ``to_dense`` calls, so the result is called like the model.
    """
    from torch.fx.experimental.optimization import optimize_for_inference

    try:
        gm = optimize_for_inference(model)
    except Exception as exc:
        if raised_in_symbolic_trace(exc):
            raise RuntimeError(f"torch.fx.symbolic_trace failed: {type(exc).__name__}: {exc}") from exc
        raise
    info = mkldnn_info(gm)
    if info["mkldnn_modules"] or info["mkldnn_conversions"]:
        note = f"mkldnn: {info['mkldnn_modules']} modules, {info['mkldnn_conversions']} layout conversions"
    else:
        note = "no MKLDNN subgraph kept"
    return Prepared(gm, note=note, info=info)


# --------------------------------------------------------------------------------------------------
# ONNX Runtime on a plain torch.onnx export


def ort_session_options(threads: int | None = None):
    """SessionOptions the harness uses for every ONNX Runtime contender (no spinning, torch's threads)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads if threads is not None else torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def ort_providers(device: torch.device) -> list[str]:
    """CUDA only when the model runs on a CUDA device (so both sides run on the same hardware)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OrtCallable:
    """Runs an ``onnxruntime.InferenceSession`` like the model: tensors in, list of tensors out.

    Only the tensor leaves of the arguments are fed, in pytree order, to the session inputs in order
    (what ``torch.onnx.export(dynamo=True)`` produces for a flat signature).
    """

    def __init__(self, session, device: torch.device):
        self.session = session
        self.device = device
        self.input_names = [i.name for i in session.get_inputs()]

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        leaves = [x for x in torch.utils._pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        if len(leaves) != len(self.input_names):
            raise ValueError(
                f"the ONNX model takes {len(self.input_names)} inputs {self.input_names}, "
                f"got {len(leaves)} tensors"
            )
        feeds = {name: t.detach().cpu().numpy() for name, t in zip(self.input_names, leaves)}
        outs = self.session.run(None, feeds)
        return [torch.from_numpy(o).to(self.device) for o in outs]


def plain_onnx_export(model: nn.Module, args: tuple, path: str) -> None:
    """``torch.onnx.export(model, args, path, dynamo=True)`` with its progress lines kept off the console;
    a failure keeps the exporter's last lines (which say which step failed) in its message."""
    from fxforge.exporters.program import quiet

    log = io.StringIO()
    try:
        with quiet(log):
            torch.onnx.export(model, args, path, dynamo=True, verbose=False)
    except Exception as exc:
        tail = "\n".join(log.getvalue().strip().splitlines()[-5:])
        raise RuntimeError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}\n{tail}") from exc


def ort_session(path: str, device: torch.device, optimized_model_filepath: str | None = None) -> Any:
    """An onnxruntime session for ``path`` with :func:`ort_session_options` and warnings-only logging; with
    ``optimized_model_filepath``, ORT also writes the graph it optimized ``path`` into there."""
    import onnxruntime as ort

    options = ort_session_options()
    options.log_severity_level = 3
    if optimized_model_filepath is not None:
        options.optimized_model_filepath = optimized_model_filepath
    return ort.InferenceSession(path, sess_options=options, providers=ort_providers(device))


@register("ort", "torch.onnx.export(model, args, dynamo=True) in an onnxruntime InferenceSession")
def _ort(model: nn.Module, args: tuple) -> Prepared:
    device = _device_of(args)
    tmp = tempfile.mkdtemp(prefix="fxforge-bench-")
    try:
        path = os.path.join(tmp, "model.onnx")
        plain_onnx_export(model, args, path)
        session = ort_session(path, device)
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fn = OrtCallable(session, device)
    # The export stays until describe() has read it, or until the callable is dropped if describe never runs.
    remove_export = weakref.finalize(fn, shutil.rmtree, tmp, True)

    def describe() -> dict[str, Any]:
        try:
            return {"optimized_graph": optimized_graph_digest(path, device)}
        finally:
            remove_export()

    return Prepared(
        fn,
        note=f"{session.get_providers()[0].replace('ExecutionProvider', '')}",
        info={"onnx_bytes": size, "providers": session.get_providers()},
        describe=describe,
    )


def optimized_graph_digest(path: str, device: torch.device) -> str:
    """A digest of the graph ONNX Runtime optimizes ``path`` into (the harness's session options), by structure:
    ops, their attributes and wiring, initializer shapes and dtypes; not names, not initializer values.

    Two exports with the same digest run the same kernels on the same shapes in ORT, so any difference in
    their timings is noise. Each call builds a throwaway session that writes its optimized model.

    Example:
        >>> optimized_graph_digest("model.onnx", torch.device("cpu"))  # doctest: +SKIP
        '3f1c...'
    """
    import onnx

    with tempfile.TemporaryDirectory(prefix="fxforge-bench-opt-") as tmp:
        optimized_path = os.path.join(tmp, "optimized.onnx")
        ort_session(path, device, optimized_model_filepath=optimized_path)
        optimized = onnx.load(optimized_path, load_external_data=False)
    return hashlib.sha256(repr(_graph_structure(optimized.graph)).encode()).hexdigest()[:16]


def _graph_structure(graph: Any, outer: dict[str, str] | None = None) -> list:
    """``graph`` by structure: each value named by a hash of how it is computed (its node's op, attributes
    and inputs, recursively; graph inputs by position, initializers by shape and dtype), so names and the
    order of independent nodes do not matter. Returns the sorted node hashes and the outputs' hashes."""
    from onnx import helper

    names: dict[str, str] = dict(outer or {})
    names[""] = ""
    for i, value in enumerate(graph.input):
        names[value.name] = f"in{i}"
    for init in graph.initializer:
        names[init.name] = f"w{list(init.dims)}:{init.data_type}"
    nodes = []
    for node in graph.node:  # ONNX keeps nodes in topological order: inputs are named before their users
        attrs = []
        for attr in sorted(node.attribute, key=lambda a: a.name):
            value = helper.get_attribute_value(attr)
            if attr.type == attr.GRAPH:
                value = _graph_structure(value, names)
            elif isinstance(value, bytes):
                value = value.decode(errors="replace")
            elif hasattr(value, "dims"):  # a tensor attribute: its shape and dtype
                value = (list(value.dims), value.data_type)
            attrs.append((attr.name, repr(value)))
        inputs = [names.get(n, f"outer:{n}") for n in node.input]
        key = hashlib.sha256(repr((node.domain, node.op_type, attrs, inputs)).encode()).hexdigest()[:16]
        nodes.append(key)
        for i, output in enumerate(node.output):
            names[output] = f"{key}:{i}"
    return [sorted(nodes), [names.get(o.name, o.name) for o in graph.output]]


# --------------------------------------------------------------------------------------------------
# fxforge


def report_note(report: Any) -> str:
    """A short note from an fxforge Report: the rewrites that fired and how often."""
    counts = dict(getattr(report, "counts", None) or {})
    fired = {k: v for k, v in counts.items() if v}
    parts = [f"{k}×{v}" for k, v in sorted(fired.items())] or ["no rewrite applied"]
    parts += [f"{r.rule} rolled back" for r in getattr(report, "rolled_back", None) or []]
    return ", ".join(parts)


def report_info(report: Any) -> dict[str, Any]:
    """The JSON part of an fxforge Report: its counts and its readable summary."""
    if report is None:
        return {}
    counts = {str(k): int(v) for k, v in dict(getattr(report, "counts", None) or {}).items()}
    try:
        text = str(report)
    except Exception as exc:  # noqa: BLE001 - a broken __str__ must not lose the row
        text = f"<str(report) failed: {type(exc).__name__}: {exc}>"
    return {"rewrite_counts": counts, "report": text}


@register("fxforge", "fxforge.optimize(model, example_inputs=args, target='native')")
def _fxforge(model: nn.Module, args: tuple) -> Prepared:
    import fxforge

    opt = fxforge.optimize(model, example_inputs=args, target="native")
    report = getattr(opt, "report", None)
    return Prepared(opt, note=report_note(report), info=report_info(report))


@register("fxforge-attention", "fxforge.optimize(model, example_inputs=args, rewrites=['cleanup', 'attention'])")
def _fxforge_attention(model: nn.Module, args: tuple) -> Prepared:
    """fxforge with the attention rewrite alone: what the attention section's memory criterion reads, so
    the fit over S is not moved by autotune's other choices (e.g. linear+GELU fused at one S, not another)."""
    import fxforge

    opt = fxforge.optimize(model, example_inputs=args, target="native", rewrites=["cleanup", "attention"])
    report = getattr(opt, "report", None)
    return Prepared(opt, note=report_note(report), info=report_info(report))


@register("fxforge-inductor", "fxforge.optimize(model, example_inputs=args, target='inductor'): fxforge's rewrites, "
                              "then torch.compile of the rewritten graph")
def _fxforge_inductor(model: nn.Module, args: tuple) -> Prepared:
    import fxforge

    opt = fxforge.optimize(model, example_inputs=args, target="inductor")
    report = getattr(opt, "report", None)
    return Prepared(opt, note=report_note(report), info=report_info(report))


@register("fxforge-auto", "fxforge.optimize(model, example_inputs=args, target='auto'): the race, then a second "
                          "optimize of a copy (the remembered choice)")
def _fxforge_auto(model: nn.Module, args: tuple) -> Prepared:
    """The race's prepare time is the first optimize's (the harness's autotune and target caches start empty);
    the info also holds a second optimize of a deep copy, which reads the remembered choice."""
    import copy
    import time

    import fxforge

    twin = copy.deepcopy(model)
    opt = fxforge.optimize(model, example_inputs=args, target="auto")
    race = opt.race

    def describe() -> dict[str, Any]:
        start = time.perf_counter()
        again = fxforge.optimize(twin, example_inputs=args, target="auto")
        return {"second_prepare_s": round(time.perf_counter() - start, 2), "second_remembered": again.race.remembered,
                "second_winner": again.race.winner}

    contenders = {c.target: {"latency_ms": c.latency_ms, "prepare_s": c.prepare_s, "max_abs_err": c.max_abs_err,
                             "refused": c.refused} for c in race.contenders}
    return Prepared(opt, note=f"chose {race.winner}", describe=describe,
                    info={"target": race.winner, "why": race.why, "race": contenders, "race_eager_ms": race.eager_ms,
                          "race_notes": race.notes})
