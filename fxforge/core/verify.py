"""Numerical checks shared by capture and the rewrite pipeline.

Every claim fxforge makes about "the same results" goes through :func:`compare_outputs`, and every
extra run fxforge makes of a user's model goes through :func:`isolated`, so that checking never
changes the model (BatchNorm running statistics, RNG state) behind the user's back.

Example:
    >>> import torch
    >>> compare_outputs(torch.ones(2), torch.ones(2) + 1e-9).ok
    True
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxforge.core.snapshots import CONSTANT_BUFFER_PREFIX, Snapshots  # noqa: F401 - (the prefix: imported from here)
from fxforge.core.tensor_cache import version as tensor_version

# (rtol, atol) per dtype; atol is scaled by the magnitude of the reference output.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    # float32: rewrites reassociate sums (a folded BatchNorm, a fused kernel); through tens of layers
    # rounding alone reaches ~2e-5 of the output's scale, while a wrong rewrite is off by O(1).
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Outcome of comparing two outputs.

    Attributes:
        ok: True when structure, shapes, dtypes and values agree within tolerance.
        max_abs_err: the largest absolute difference over all floating-point leaves.
        reason: why ``ok`` is False ("" when it is True).

    Example:
        >>> compare_outputs((torch.zeros(1),), (torch.ones(1),)).reason
        'output[0]: max abs error 1 exceeds tolerance 0.0001'
    """

    ok: bool
    max_abs_err: float
    reason: str = ""
    note: str = ""


def _leaf_name(path: tuple) -> str:
    return "output" + pytree.keystr(path) if path else "output"


# TensorFloat-32 keeps 10 mantissa bits where float32 keeps 23: float32 work on a GPU that allows it rounds
# about this many times more than the float32 tolerances assume (seen: 2e-4 of ResNet-50's output on an H200).
TF32_SCALE = 10.0


def tf32_scale(device: torch.device) -> float:
    """How much more float32 work on ``device`` may round than the float32 tolerances of
    :func:`compare_outputs` allow: :data:`TF32_SCALE` on a CUDA device where torch lets cuDNN's convolutions
    or cuBLAS's matrix products use TensorFloat-32 (cuDNN's default), else 1.

    Example:
        >>> tf32_scale(torch.device("cpu"))
        1.0
    """
    if device.type != "cuda":
        return 1.0
    allowed = torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
    return TF32_SCALE if allowed else 1.0


def compare_outputs(reference: Any, actual: Any, *, rtol_scale: float = 1.0) -> Comparison:
    """Compare two (nested) outputs leaf by leaf.

    Containers must have the same structure (a transformers ``ModelOutput`` is a pytree). Floating-point
    tensors agree when ``|a - r| <= atol * max(1, max|r|) + rtol * |r|`` with tolerances chosen by dtype,
    NaNs in the same places; integer and boolean tensors and non-tensor leaves must be equal.

    Example:
        >>> compare_outputs({"a": torch.ones(3)}, {"a": torch.ones(3)}).ok
        True
    """
    ref_leaves, ref_spec = pytree.tree_flatten_with_path(reference)
    act_leaves, act_spec = pytree.tree_flatten_with_path(actual)
    if ref_spec != act_spec:
        return Comparison(False, float("inf"), f"output structure differs: {ref_spec} vs {act_spec}")
    worst = 0.0
    for (path, r), (_, a) in zip(ref_leaves, act_leaves):
        name = _leaf_name(path)
        if isinstance(r, torch.Tensor) != isinstance(a, torch.Tensor):
            return Comparison(False, float("inf"), f"{name}: tensor vs {type(a).__name__}")
        if not isinstance(r, torch.Tensor):
            if r != a:
                return Comparison(False, float("inf"), f"{name}: {r!r} != {a!r}")
            continue
        if r.shape != a.shape or r.dtype != a.dtype:
            return Comparison(
                False, float("inf"), f"{name}: {tuple(r.shape)}/{r.dtype} vs {tuple(a.shape)}/{a.dtype}"
            )
        if r.numel() == 0:
            continue
        r_cpu, a_cpu = r.detach().cpu(), a.detach().cpu()
        if not (r.is_floating_point() or r.is_complex()):
            if not torch.equal(r_cpu, a_cpu):
                return Comparison(False, float("inf"), f"{name}: integer values differ")
            continue
        r64, a64 = r_cpu.double(), a_cpu.double()
        nan_r, nan_a = torch.isnan(r64), torch.isnan(a64)
        if not torch.equal(nan_r, nan_a):
            return Comparison(False, float("inf"), f"{name}: NaNs in different places")
        finite = ~nan_r
        diff = (r64 - a64).abs()[finite]
        if diff.numel() == 0:
            continue
        inf_mismatch = torch.isinf(r64[finite]) | torch.isinf(a64[finite])
        if inf_mismatch.any() and not torch.equal(r64[finite][inf_mismatch], a64[finite][inf_mismatch]):
            return Comparison(False, float("inf"), f"{name}: infinities differ")
        diff = torch.where(inf_mismatch, torch.zeros_like(diff), diff)
        rtol, atol = _TOLERANCES.get(r.dtype, (1e-4, 1e-4))
        rtol, atol = rtol * rtol_scale, atol * rtol_scale
        ref_abs = r64[finite].abs().masked_fill(inf_mismatch, 0)
        scale = max(1.0, float(ref_abs.max()))
        allowed = atol * scale + rtol * ref_abs
        err = float(diff.max())
        worst = max(worst, err)
        if bool((diff > allowed).any()):
            return Comparison(False, worst, f"{name}: max abs error {err:.3g} exceeds tolerance {atol * scale:.3g}")
    return Comparison(True, worst)


_SNAPSHOTS = Snapshots()
# The RNG is one per process: a thread inside isolated() owns it until it leaves (reentrant, so isolated
# blocks nest), so two threads verifying at once each draw the numbers of their own seed. Calls through
# TorchDynamo take the same lock (fxforge.runtime.dynamo): a graph's first call builds a plan, which verifies
# inside isolated(), and isolated() blocks run models with breaks, so two locks would be taken in both orders.
RNG_LOCK = threading.RLock()


@contextlib.contextmanager
def isolated(*modules: torch.nn.Module, seed: int = 0, inputs: Any = None) -> Iterator[None]:
    """Run a block with a fixed RNG seed and restore the modules' buffers, the tensors in ``inputs`` and the
    RNG afterwards.

    Inside, dropout and other random ops draw the same numbers on every run, so two graphs can be
    compared in training mode; BatchNorm running statistics updated inside are put back on exit, and so are
    inputs a model changes in place (each run sees the inputs as the caller gave them, and the caller's
    tensors are left as they were). The RNG is the process's: other threads entering ``isolated`` wait
    until this block is done.

    Example:
        >>> bn = torch.nn.BatchNorm1d(3).train()
        >>> with isolated(bn):
        ...     _ = bn(torch.randn(4, 3))
        >>> float(bn.running_mean.abs().sum())
        0.0
    """
    saved = _SNAPSHOTS.take(modules) + (_SNAPSHOTS.take_inputs(inputs) if inputs is not None else [])
    devices = [t.device for t, _, _ in saved if t.device.type == "cuda"]
    with RNG_LOCK, torch.random.fork_rng(devices=sorted({d.index or 0 for d in devices}) or None):
        torch.manual_seed(seed)
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, version, copy in saved:
                    if version is None or tensor_version(buf) != version:
                        if buf.is_inference():
                            with torch.inference_mode():  # (where an inference tensor may change)
                                buf.copy_(copy)
                        else:  # (inference_mode(False) would turn grad mode back on: a buffer may require grad)
                            buf.copy_(copy)


# A float value at or below this in a mask hides a key (transformers use -1e4, -1e9 and finfo.min).
MASKED = -1e4


def _is_additive_mask(values: torch.Tensor, all_finite: bool) -> bool:
    """Whether a float tensor's finite ``values`` (``all_finite``: it has no others) make it a mask."""
    if len(torch.unique(values[:64])) > 2:  # most inputs show it in their first values: no full sort
        return False
    distinct = torch.unique(values)
    if len(distinct) > 2:
        return False
    return not all_finite or bool((distinct <= MASKED).any())


def _finite_values(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``(t in float64, where it is finite, its finite values, whether it is an additive mask)`` of a
    floating-point tensor."""
    data = t.detach().double()
    finite = torch.isfinite(data)
    values = data[finite]
    return data, finite, values, _is_additive_mask(values, bool(finite.all()))


def random_like(example: Any, seed: int) -> Any:
    """Random inputs with the shapes, dtypes and devices of ``example`` (a pytree of tensors).

    Floating-point tensors are drawn from a normal distribution with the mean and spread of the example's
    finite values for odd seeds, and centred on zero (scale: the larger of spread and mean) for even seeds,
    so that signs the example never shows are tried too; the example's NaN and infinities stay where they
    are. Integer tensors are drawn uniformly from the example's range (so token ids stay valid ids).
    Masks are kept as given, since they encode structure (padding, causality) rather than data: boolean
    tensors, and float tensors of at most two finite values that hide keys (``-inf``, or a value at or below
    :data:`MASKED`, beside one other value); so are 0-d tensors (numbers passed as tensors).

    Example:
        >>> x = random_like((torch.zeros(2, 3),), seed=1)[0]
        >>> x.shape
        torch.Size([2, 3])
        >>> mask = torch.tensor([0.0, 0.0, float("-inf")])
        >>> torch.equal(random_like(mask, seed=1), mask)
        True
    """
    gen = torch.Generator().manual_seed(seed)

    def draw(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return t
        if t.dim() == 0:  # a number passed as a tensor (dynamo passes Python floats so): drawn, it could leave its
            return t.clone()  # domain (a dropout probability read off the model), which no call of the model does
        if t.is_floating_point():
            data, finite, values, is_mask = _finite_values(t)
            if is_mask:
                return t.clone()
            std = float(values.std()) if values.numel() > 1 else 1.0
            std = std if std > 0 else 1.0
            mean = float(values.mean()) if values.numel() else 0.0
            if seed % 2 == 0:
                std, mean = max(std, abs(mean)), 0.0
            out = torch.randn(t.shape, generator=gen, dtype=torch.float64) * std + mean  # drawn on the CPU
            out = torch.where(finite, out.to(data.device), data)  # NaN and infinities stay where the example has them
            return _strided_like(out.to(dtype=t.dtype, device=t.device), t).requires_grad_(t.requires_grad)
        if t.dtype == torch.bool or t.is_complex():
            return t.clone()
        lo, hi = int(t.min()), int(t.max())
        drawn = torch.randint(lo, hi + 1, t.shape, generator=gen, dtype=torch.int64).to(t.dtype).to(t.device)
        return _strided_like(drawn, t)

    return pytree.tree_map(draw, example)


def _strided_like(values: torch.Tensor, example: torch.Tensor) -> torch.Tensor:
    """``values`` laid out in memory as ``example`` is (channels-last, transposed...), so that random inputs try
    the strides the example brings; an example whose strides overlap (expanded) or skip memory (a slice) gets
    dense strides in the same dim order (``torch.preserve_format``)."""
    if values.stride() == example.stride():
        return values
    out = torch.empty_like(example, dtype=values.dtype, device=values.device, memory_format=torch.preserve_format)
    return out.copy_(values)


def with_special_values(example: Any) -> Any:
    """``example`` (a pytree of tensors) with special values in its first batch element (index 0 of each
    tensor's first dim): a NaN in the first element of the first floating-point input that is not a mask,
    and every mask hiding everything (float masks filled with their masking value, boolean ones False, 0/1
    integer masks 0). What eager does with NaN and with rows in which every key is hidden is then part of
    what a rewrite is checked against. One NaN, in the leading input, is what a user's NaN looks like by the
    time it reaches the graph's inner tensors; a NaN planted in every input at once (a key hidden by the mask
    but not its value) is a case rewrites may treat differently (see ``fxforge.rewrites.attention``).

    Example:
        >>> x, mask = with_special_values((torch.ones(2, 2), torch.tensor([[0.0, -1e9], [0.0, 0.0]])))
        >>> x.tolist(), mask.tolist()
        ([[nan, 1.0], [1.0, 1.0]], [[-1000000000.0, -1000000000.0], [0.0, 0.0]])
    """

    planted = []  # the NaN goes into one input only

    def special(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.dim() == 0:
            return t
        t = t.detach().clone()
        if t.is_floating_point():
            data, _, values, is_mask = _finite_values(t)
            if is_mask:
                t[0] = float("-inf") if bool(torch.isneginf(data).any()) else float(values.min())
            elif not planted:
                t[(0,) * t.dim()] = float("nan")  # (any strides: channels-last, transposed, expanded copies)
                planted.append(t)
        elif t.dtype == torch.bool:
            t[0] = False
        elif not t.is_complex() and bool(((t == 0) | (t == 1)).all()):
            t[0] = 0
        return t

    return pytree.tree_map(special, example)


def check_same(
    reference: Callable[..., Any],
    candidate: Callable[..., Any],
    inputs: Sequence[tuple[tuple, dict]],
    modules: Sequence[torch.nn.Module],
    *,
    reference_outputs: list | None = None,
    candidate_outputs: dict[int, Any] | None = None,
    exact: Callable[[int], Any] | None = None,
) -> Comparison:
    """Run ``reference`` and ``candidate`` on each ``(args, kwargs)`` in ``inputs`` and compare.

    Both run under :func:`isolated` with the same seed, so random ops agree and no buffer changes.
    ``reference_outputs`` (one per input) skips re-running the reference; ``candidate_outputs`` (by
    index, e.g. from :meth:`fxforge.core.captured.LoweredRun.outputs_for`) skips running the candidate on
    those inputs. Where the values differ beyond the float32 tolerance, ``exact`` (``i -> the float64
    result``, a :class:`Float64Reference`) decides whether the difference is rounding (:func:`within_rounding`:
    the comparison is ok, with a note saying so) or error.

    Example:
        >>> f = lambda x: x * 2
        >>> check_same(f, lambda x: x + x, [((torch.ones(2),), {})], []).ok
        True
    """
    worst, notes = 0.0, []
    for i, (args, kwargs) in enumerate(inputs):
        if reference_outputs is not None:
            ref = reference_outputs[i]
        else:
            with isolated(*modules, seed=i, inputs=(args, kwargs)), torch.no_grad():
                ref = reference(*args, **kwargs)
        if candidate_outputs is not None and i in candidate_outputs:
            out = candidate_outputs[i]
        else:
            with isolated(*modules, seed=i, inputs=(args, kwargs)), torch.no_grad():
                out = candidate(*args, **kwargs)
        result = compare_outputs(ref, out)
        if not result.ok and exact is not None and math.isfinite(result.max_abs_err):
            judged = within_rounding(ref, out, exact(i))
            if judged.ok:
                notes.append(judged.note)
                result = Comparison(True, result.max_abs_err)
        worst = max(worst, result.max_abs_err)
        if not result.ok:
            kind = "example inputs" if i == 0 else f"random inputs #{i}"
            return Comparison(False, result.max_abs_err, f"on {kind}: {result.reason}")
    return Comparison(True, worst, note="; ".join(dict.fromkeys(notes)))


# How much farther from the exact result than the float32 reference a candidate may be and still be called
# rounding: both are float32 computations of one function in another order; a wrong rewrite is off by
# orders of magnitude more (a 0.1 % error against float32 rounding's ~1e-6 relative).
ROUNDING_FACTOR = 8.0


def within_rounding(reference: Any, candidate: Any, exact: Any) -> Comparison:
    """Whether ``candidate`` is as close to the ``exact`` (float64) result as the float32 ``reference`` is, up
    to :data:`ROUNDING_FACTOR`: the difference between ``reference`` and ``candidate`` is rounding, not error.

    ``exact`` None (no float64 result) decides nothing: not ok.

    Example:
        >>> exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> ref, close, wrong = exact.float() + 1e-6, exact.float() - 3e-6, exact.float() * 1.001
        >>> within_rounding(ref, close, exact).ok, within_rounding(ref, wrong, exact).ok
        (True, False)
    """
    if exact is None:
        return Comparison(False, float("inf"), "no float64 reference")
    leaves = [pytree.tree_leaves(x) for x in (reference, candidate, exact)]
    if len({len(x) for x in leaves}) != 1:
        return Comparison(False, float("inf"), "output structures differ")
    err_ref = err_cand = scale = 0.0
    for r, c, e in zip(*leaves):
        if not (isinstance(r, torch.Tensor) and r.is_floating_point()):
            continue
        r64, c64, e64 = (x.detach().double().cpu() for x in (r, c, e))
        finite = torch.isfinite(e64) & torch.isfinite(r64) & torch.isfinite(c64)
        if finite.any():
            err_ref = max(err_ref, float((r64 - e64)[finite].abs().max()))
            err_cand = max(err_cand, float((c64 - e64)[finite].abs().max()))
            scale = max(scale, float(e64[finite].abs().max()))
    allowed = ROUNDING_FACTOR * err_ref + 1e-7 * max(1.0, scale)
    if err_cand > allowed:
        return Comparison(False, err_cand, f"{err_cand:.3g} from the float64 result, the float32 reference {err_ref:.3g}")
    return Comparison(True, err_cand, note=f"beyond the float32 tolerance by rounding only: {err_cand:.3g} from the "
                                          f"float64 result, the float32 reference {err_ref:.3g}")


class Float64Reference:
    """The outputs of a graph run in float64 (a copy of it, its floating-point parameters, buffers and inputs
    in float64), computed on demand per input and kept: the exact result :func:`within_rounding` judges by.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> exact = Float64Reference(gm, [((torch.ones(1, 2),), {})])
        >>> exact(0).dtype
        torch.float64
    """

    def __init__(self, graph_module: torch.nn.Module, inputs: Sequence[tuple[tuple, dict]]):
        self.graph_module, self.inputs = graph_module, inputs
        self._copy: torch.nn.Module | None = None
        self._outputs: dict[int, Any] = {}

    def __call__(self, i: int) -> Any:
        if i not in self._outputs:
            self._outputs[i] = self._run(i)
        return self._outputs[i]

    def _run(self, i: int) -> Any:
        def to64(x: Any) -> Any:
            return x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        try:
            if self._copy is None:
                self._copy = copy.deepcopy(self.graph_module).double()
            args, kwargs = pytree.tree_map(to64, tuple(self.inputs[i]))
            with isolated(self._copy, seed=i, inputs=(args, kwargs)), torch.no_grad():
                return self._copy(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a graph that cannot run in float64 (a dtype assert) decides nothing
            return None


def graph_fingerprint(graph_module: torch.nn.Module) -> tuple:
    """What a GraphModule computes, as far as it can change: its code and the identity (and version) of
    every submodule, parameter and buffer it reaches. Two equal fingerprints mean the same function.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> graph_fingerprint(gm) == graph_fingerprint(gm)
        True
    """
    code = getattr(graph_module, "code", None)
    modules = tuple((name, id(m)) for name, m in graph_module.named_modules(remove_duplicate=False))
    tensors = tuple((name, id(t), tensor_version(t)) for name, t in
                    (*graph_module.named_parameters(remove_duplicate=False),
                     *graph_module.named_buffers(remove_duplicate=False)))
    return code, modules, tensors


def inputs_key(args: tuple, kwargs: dict) -> tuple:
    """What identifies a call's inputs as unchanged: their structure, and each tensor's identity and version
    (an in-place change bumps it); other values by their ``repr``.

    Example:
        >>> x = torch.ones(1); key = inputs_key((x,), {})
        >>> key == inputs_key((x,), {}), key == inputs_key((x.clone(),), {})
        (True, False)
    """
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return spec, tuple((id(x), tensor_version(x)) if isinstance(x, torch.Tensor) else ("value", repr(x)) for x in leaves)
