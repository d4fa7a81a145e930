"""How a model's inputs and outputs map to an exported ONNX graph's: :class:`IOSpec` feeds a call's tensors
to the graph's inputs (checking the structure and the values export fixed) and puts the graph's outputs back
into the model's own output structure; :class:`InputShapeError` is what a call the export does not take
raises.

Example:
    >>> spec = IOSpec.for_tensors(["x", "y"], 1)
    >>> [name for name, _ in spec.feeds((torch.ones(1), torch.ones(2)), {})]
    ['x', 'y']
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree


class InputShapeError(ValueError):
    """Inputs that the exported ONNX model does not accept (structure, count, shape or dtype).

    Example:
        >>> str(InputShapeError("input 'x' has shape (3, 4); the ONNX model takes (2, 4)"))
        "input 'x' has shape (3, 4); the ONNX model takes (2, 4)"
    """


@dataclasses.dataclass(frozen=True)
class IOSpec:
    """How the model's inputs and outputs map to the ONNX graph's.

    Attributes:
        in_spec: the pytree structure of ``(args, kwargs)`` the model was exported with.
        inputs: per input leaf, ``("tensor", onnx_input_name)``, or ``("constant", value)`` for a Python value
            that export fixed (calls must pass the same value).
        out_spec: the pytree structure of the model's outputs.
        outputs: per output leaf, ``("tensor", index of the ONNX output)`` or ``("constant", value)``.

    Example:
        >>> spec = IOSpec.for_tensors(["x"], 1)
        >>> spec.feeds((torch.ones(1),), {})[0][0]
        'x'
        >>> spec.outputs_from([torch.zeros(1)]).tolist()
        [0.0]
    """

    in_spec: pytree.TreeSpec
    inputs: tuple[tuple[str, Any], ...]
    out_spec: pytree.TreeSpec
    outputs: tuple[tuple[str, Any], ...]

    @classmethod
    def for_tensors(cls, input_names: Sequence[str], num_outputs: int) -> IOSpec:
        """The spec of a model called with positional tensors, returning one tensor (or a tuple of them)."""
        _, in_spec = pytree.tree_flatten((tuple(torch.empty(0) for _ in input_names), {}))
        out = torch.empty(0) if num_outputs == 1 else tuple(torch.empty(0) for _ in range(num_outputs))
        _, out_spec = pytree.tree_flatten(out)
        return cls(in_spec, tuple(("tensor", n) for n in input_names), out_spec,
                   tuple(("tensor", i) for i in range(num_outputs)))

    @classmethod
    def from_exported_program(cls, program: torch.export.ExportedProgram, onnx_inputs: Sequence[str],
                              num_onnx_outputs: int, out_structure: tuple | None = None) -> IOSpec:
        """The mapping for an ONNX model that ``torch.onnx.export`` made from ``program``.

        The exporter keeps the program's tensor user inputs as graph inputs and its tensor user outputs
        as graph outputs, in order; Python values are baked into the graph. ``out_structure`` rebuilds the
        outputs of a program that returns its tensors flat: ``(spec, per leaf ("tensor", index) or
        ("constant", value))``.

        Raises:
            ValueError: the ONNX graph's inputs or outputs do not line up with the program's.
        """
        from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind, TensorArgument

        inputs, tensor_inputs = [], 0
        for spec in program.graph_signature.input_specs:
            if spec.kind != InputKind.USER_INPUT:
                continue
            if isinstance(spec.arg, TensorArgument):
                if tensor_inputs >= len(onnx_inputs):
                    raise ValueError("the ONNX model has fewer inputs than the exported program")
                inputs.append(("tensor", onnx_inputs[tensor_inputs]))
                tensor_inputs += 1
            elif isinstance(spec.arg, ConstantArgument):
                inputs.append(("constant", spec.arg.value))
            else:
                raise ValueError(f"an input of kind {type(spec.arg).__name__} cannot be fed to ONNX Runtime")  # noqa: TRY004
        if tensor_inputs != len(onnx_inputs):
            raise ValueError(f"the ONNX model has {len(onnx_inputs)} inputs, the exported program {tensor_inputs}")
        outputs, index = [], 0
        for spec in program.graph_signature.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:
                continue
            if isinstance(spec.arg, TensorArgument):
                outputs.append(("tensor", index))
                index += 1
            else:
                outputs.append(("constant", getattr(spec.arg, "value", None)))
        if index != num_onnx_outputs:
            raise ValueError(f"the ONNX model has {num_onnx_outputs} outputs, the exported program {index}")
        if out_structure is not None:
            out_spec, kinds = out_structure
            if any(kind != "tensor" for kind, _ in outputs) or sum(k == "tensor" for k, _ in kinds) != index:
                raise ValueError(f"the program returns {len(outputs)} values, the model's outputs have "
                                 f"{sum(k == 'tensor' for k, _ in kinds)} tensors")
            return cls(program.call_spec.in_spec, tuple(inputs), thawed(out_spec), tuple(kinds))
        return cls(program.call_spec.in_spec, tuple(inputs), thawed(program.call_spec.out_spec), tuple(outputs))

    def feeds(self, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
        """``(onnx input name, tensor)`` for a call, in the ONNX graph's input order.

        Raises:
            InputShapeError: the call's structure differs from the exported one, or a fixed value changed.
        """
        names = self._positional_names
        if names is not None and not kwargs and len(args) == len(names) and all(
                type(value) is torch.Tensor for value in args):  # the common call: the example's tensors, in order
            return list(zip(names, args))
        from torch.export._tree_utils import reorder_kwargs

        try:
            kwargs = reorder_kwargs(dict(kwargs), self.in_spec)
        except Exception as error:  # noqa: BLE001 - a missing or extra keyword
            raise InputShapeError(f"the keyword inputs {sorted(kwargs)} differ from the exported ones: {error}") from None
        leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self.in_spec:
            raise InputShapeError(f"the inputs' structure {spec} differs from the one exported, {self.in_spec}: "
                                  "call the module the way the example inputs were given")
        feeds = []
        for (kind, what), value in zip(self.inputs, leaves):
            if kind == "tensor":
                if not isinstance(value, torch.Tensor):
                    raise InputShapeError(f"input {what!r} must be a tensor, got {type(value).__name__}")
                feeds.append((what, value))
            elif not _same_constant(value, what):
                raise InputShapeError(f"an input was fixed to {what!r} at export; this call passes {value!r}")
        return feeds

    @functools.cached_property
    def _positional_names(self) -> tuple[str, ...] | None:
        """The ONNX input names when the model takes its tensors positionally and nothing else, else None."""
        if any(kind != "tensor" for kind, _ in self.inputs):
            return None
        _, flat = pytree.tree_flatten((tuple(torch.empty(0) for _ in self.inputs), {}))
        return tuple(name for _, name in self.inputs) if flat == self.in_spec else None

    def outputs_from(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The model's output structure, from the ONNX outputs in order."""
        leaves = [tensors[what] if kind == "tensor" else what for kind, what in self.outputs]
        return pytree.tree_unflatten(leaves, self.out_spec)


def thawed(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """``spec`` with torch.fx's ``immutable_dict`` / ``immutable_list`` (what a traced graph returns for the
    model's dicts and lists) made the plain ``dict`` / ``list`` the model returned.

    Example:
        >>> from torch.fx.immutable_collections import immutable_dict
        >>> thawed(pytree.tree_flatten(immutable_dict(a=torch.ones(1)))[1]) == pytree.tree_flatten({"a": 0})[1]
        True
    """
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    if spec.is_leaf():
        return spec
    # The spec's own nodes are rebuilt: unflattening would run custom containers' code (a transformers cache).
    kind = {immutable_dict: dict, immutable_list: list}.get(spec.type, spec.type)
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs  # older torch
    return pytree.TreeSpec(kind, spec.context, [thawed(child) for child in children])


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (a is None and b is None)
    except Exception:  # noqa: BLE001 - values that do not compare
        return a is b
