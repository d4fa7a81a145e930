"""Where in the user's code something happened: a node's source line, or the line an exception broke at.

Example:
    >>> user_frame_of(ValueError("x")) is None
    True
"""

from __future__ import annotations

import os
import re
import traceback
from types import TracebackType

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXFORGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_MARKERS = (os.sep + "site-packages" + os.sep + "torch" + os.sep, os.sep + "contextlib.py")
_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>[^\n]*)')


def _is_library_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith((_TORCH_DIR, _FXFORGE_DIR)):
        return True
    return any(marker in path for marker in _LIBRARY_MARKERS) or filename.startswith("<")


def format_location(filename: str, lineno: int | str, code: str = "") -> str:
    """``file.py:12: code`` with the path shortened to the current directory where possible.

    Example:
        >>> format_location("/abs/model.py", 3, "x = y")
        '/abs/model.py:3: x = y'
    """
    try:
        rel = os.path.relpath(filename)
        name = rel if not rel.startswith("..") else filename
    except ValueError:
        name = filename
    return f"{name}:{lineno}: {code.strip()}" if code else f"{name}:{lineno}"


def user_frame_of(error: BaseException) -> str | None:
    """The innermost frame of ``error``'s traceback that is the user's code (not torch, not fxforge).

    Example:
        >>> try:
        ...     raise RuntimeError("boom")
        ... except RuntimeError as e:
        ...     where = user_frame_of(e)
    """
    tb: TracebackType | None = error.__traceback__
    frames = traceback.extract_tb(tb) if tb is not None else []
    for frame in reversed(frames):
        if not _is_library_file(frame.filename):
            return format_location(frame.filename, frame.lineno or 0, frame.line or "")
    cause = error.__cause__ or error.__context__
    if cause is not None and cause is not error:
        return user_frame_of(cause)
    return None


def user_line_of_stack_trace(stack_trace: str | None) -> str | None:
    """The innermost user frame in a recorded ``node.meta['stack_trace']`` string.

    Example:
        >>> user_line_of_stack_trace('  File "/m.py", line 4, in forward\\n    return x.relu()\\n')
        '/m.py:4: return x.relu()'
    """
    if not stack_trace:
        return None
    frames = list(_FRAME_RE.finditer(stack_trace))
    for match in reversed(frames):
        if not _is_library_file(match["file"]):
            return format_location(match["file"], match["line"], match["code"])
    return None


def node_source(node: torch.fx.Node) -> str | None:
    """The user's source line for an fx node, where torch recorded one.

    Example:
        >>> g = torch.fx.Graph(); n = g.placeholder("x")
        >>> node_source(n) is None
        True
    """
    return node.meta.get("fxforge_source") or user_line_of_stack_trace(node.meta.get("stack_trace"))


def inherit_origin(new_nodes: list[torch.fx.Node], replaced: list[torch.fx.Node], gm: torch.nn.Module) -> None:
    """Give the nodes a rewrite created the origin of the nodes they replace: the user's source line
    (``meta['fxforge_source']``) and module (``meta['nn_module_stack']``) of the first replaced node that has
    one, so reports and profiles still point at the user's code and module after a rewrite.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
        >>> relu = next(n for n in gm.graph.nodes if n.op == "call_module")
        >>> with gm.graph.inserting_after(relu):
        ...     new = gm.graph.call_function(torch.relu, (relu.args[0],))
        >>> inherit_origin([new], [relu], gm)
        >>> list(new.meta["nn_module_stack"].values())[-1][0]
        '0'
    """
    source = next((s for s in map(node_source, replaced) if s), None)
    stack = None
    for node in replaced:
        if node.op == "call_module":
            stack = dict(node.meta.get("nn_module_stack") or {})
            stack[str(node.target)] = (str(node.target), type(gm.get_submodule(str(node.target))))
            break
        if node.meta.get("nn_module_stack"):
            stack = dict(node.meta["nn_module_stack"])
            break
    for node in new_nodes:
        node.meta["fxforge_source"] = source
        if stack is not None:
            node.meta["nn_module_stack"] = dict(stack)


def first_line(error: BaseException) -> str:
    """A one-line description of an exception: its type and the first non-empty line of its message.

    Example:
        >>> first_line(ValueError("bad\\nmore"))
        'ValueError: bad'
    """
    text = str(error).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{type(error).__name__}: {line}" if line else type(error).__name__
