"""``--dynamic``: which dims of the file ``-o`` writes take any size, as the export functions' options.

``auto`` (the default) is what ``fxforge.export_onnx(dynamic=True)`` does for an ``.onnx`` file (the batch,
and the sequence length of token inputs) and the batch for a ``.pt2``; ``none`` a static file; ``batch``,
``batch,length``, or dim numbers (``0,1``: those dims of every input that has them).

Example:
    >>> dynamic_options("none", ".onnx", ())
    {'dynamic': False}
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from fxforge.cli.inputs import dynamic_shapes_for

# The stages of an ExportError where dims asked to be dynamic could not be (the default --dynamic then writes a
# static file, with a note): torch.export refused the dims, or the inputs have no batch dim.
DIMS_STAGES = ("torch.export", "input")


def dynamic_options(dynamic: str | tuple, artifact: str | None, inputs: tuple | dict) -> dict[str, Any]:
    """What ``--dynamic`` asks of the target that writes ``artifact``: the build options of an ``.onnx``
    file's export (``dynamic``, ``dynamic_batch``, ``dynamic_shapes`` of :func:`fxforge.export_onnx`), or
    ``{"dynamic_batch": ...}`` for a ``.pt2`` file's write; none without a file (plans for the given shapes).

    Example:
        >>> dynamic_options("auto", ".onnx", ()), dynamic_options(("batch",), ".onnx", ())
        ({'dynamic': True}, {'dynamic': False, 'dynamic_batch': True})
        >>> dynamic_options("auto", ".pt2", ()), dynamic_options("none", ".pt2", ())
        ({'dynamic_batch': True}, {'dynamic_batch': False})
    """
    if artifact == ".pt2":
        return {"dynamic_batch": dynamic in ("auto", ("batch",))}
    if artifact != ".onnx":
        return {}
    if dynamic in ("auto", ("batch", "length")):
        return {"dynamic": True}
    if dynamic == "none":
        return {"dynamic": False}
    if dynamic == ("batch",):
        return {"dynamic": False, "dynamic_batch": True}
    return {"dynamic": False, "dynamic_shapes": dynamic_shapes_for(inputs, dynamic)}


def check_dynamic(args: argparse.Namespace) -> None:
    """Usage check of ``--dynamic`` against the file ``-o`` writes (raises ``argparse.ArgumentTypeError``).

    Example:
        >>> check_dynamic(argparse.Namespace(dynamic=("batch", "length"), output="m.pt2", target="auto"))
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --dynamic batch,length: a .pt2 file takes --dynamic batch or none (an .onnx file takes any)
    """
    dynamic = getattr(args, "dynamic", "auto")
    text = dynamic if isinstance(dynamic, str) else ",".join(map(str, dynamic))
    if dynamic == "auto":
        return
    if not getattr(args, "output", None):
        raise argparse.ArgumentTypeError(f"--dynamic {text}: it is for the file -o writes (without -o, fxforge "
                                         "plans for the example's sizes and re-plans for others)")
    if dynamic == ("length",):
        raise argparse.ArgumentTypeError("--dynamic length: the length comes with the batch (batch,length), or "
                                         "give dim numbers (1)")
    if os.path.splitext(args.output)[1].lower() == ".pt2" and dynamic not in ("none", ("batch",)):
        raise argparse.ArgumentTypeError(f"--dynamic {text}: a .pt2 file takes --dynamic batch or none (an .onnx "
                                         "file takes any)")
