"""What a rewrite pass is: a named function that edits a GraphModule and says what it did.

A pass is a plain function ``(graph_module, ctx) -> None`` that mutates the graph and tells ``ctx`` each
change (:meth:`PassContext.matched`) and each refusal (:meth:`PassContext.refused`, with a
:class:`Refusal`: the one way every check in fxforge says "no, because..."). The pipeline copies the
graph before the pass, lints and verifies after it, and rolls it back if results changed.

A pass that makes choices only measurement can settle (``conv_activation``: keep a fusion only where it
is faster) asks ``ctx.tuner``, a function the caller hands in (fxforge's autotune, with the caller's
tuning policy), and gets a :class:`Tuned` back; without a tuner it keeps its rewrite unmeasured.

Example:
    >>> import torch
    >>> def noop(gm, ctx):
    ...     pass
    >>> Pass("noop", noop, "does nothing").name
    'noop'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from fxforge.core.captured import LoweredRun
from fxforge.core.plan import CallConditions
from fxforge.core.report import Applied, NearMiss, Tuning
from fxforge.core.source import node_source


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a rule looked at a node and left it alone; it lands in the report as a near miss.

    Every check in fxforge returns a ``Refusal`` (or None when nothing is in the way): a rule's
    ``check``, cleanup's no-op rules, attention's readers.

    Example:
        >>> str(Refusal("dtypes differ")), Refusal.of("dtypes differ") == Refusal("dtypes differ")
        ('dtypes differ', True)
    """

    reason: str

    def __str__(self) -> str:
        return self.reason

    @classmethod
    def of(cls, value: Refusal | str | None) -> Refusal | None:
        """``value`` as a Refusal: a user's check may return the reason as a plain string."""
        if value is None or isinstance(value, Refusal):
            return value
        return cls(str(value)) if value else None


@dataclasses.dataclass(frozen=True)
class Tuned:
    """What a tuner decided for a rewritten graph (see :func:`fxforge.lowering.autotune.autotune`).

    Attributes:
        fused: whether the rewrite stays (False: the graph was put back as it was before it).
        lowered_run: the kept graph lowered and run on the verification inputs, handed on so that
            neither is done again (None when the tuner did not run it).

    Example:
        >>> Tuned(fused=False).lowered_run is None
        True
    """

    fused: bool
    lowered_run: LoweredRun | None = None


# (graph module after the rewrite, the graph module before it, the pass's context) -> Tuned
Tuner = Callable[[torch.fx.GraphModule, torch.fx.GraphModule, "PassContext"], Tuned]


@dataclasses.dataclass
class PassContext:
    """What a pass knows about the graph it edits, and where it writes down what it did.

    Attributes:
        rule: the pass's name, used in the report.
        training: whether the graph was captured in training mode.
        method: ``"fx"`` or ``"export"``.
        example_args, example_kwargs: the example inputs (None outside the pipeline), for passes that
            measure (autotune).
        check_inputs: the inputs verification will compare the rewritten graph on (the example inputs,
            then random ones; None without verification): a pass that runs its graph anyway can run it
            on these and hand the outputs on (``lowered_run``).
        tuner: measures choices a pass cannot prove (see the module docstring); None: nothing is timed.
        conditions: the calls the rewritten graph will serve (:class:`~fxforge.core.plan.CallConditions`):
            a rewrite that does not hold for them (folding parameters when gradients are recorded, fused
            ops under autocast) refuses.
        matches, near_misses, tuning: filled by :meth:`matched`, :meth:`refused` and :meth:`tuned`.
        lowered_run: the rewritten graph as the tuner lowered and ran it, for verification and lowering.

    Example:
        >>> ctx = PassContext("demo", training=False, method="fx")
        >>> g = torch.fx.Graph(); n = g.placeholder("x")
        >>> ctx.refused(n, Refusal("not a tensor")); ctx.near_misses[0].reason
        'not a tensor'
    """

    rule: str
    training: bool
    method: str
    example_args: tuple | None = None
    example_kwargs: dict | None = None
    check_inputs: list[tuple[tuple, dict]] | None = None
    tuner: Tuner | None = None
    conditions: CallConditions = dataclasses.field(default_factory=CallConditions)
    matches: list[Applied] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    tuning: list[Tuning] = dataclasses.field(default_factory=list)
    lowered_run: LoweredRun | None = None

    def matched(self, what: str, nodes: list[torch.fx.Node]) -> None:
        """Record one application that replaced ``nodes`` (call before erasing them)."""
        source = next((s for s in (node_source(n) for n in nodes) if s), None)
        self.matches.append(Applied(self.rule, what, [n.name for n in nodes], source))

    def refused(self, node: torch.fx.Node, refusal: Refusal | str) -> None:
        """Record that the pass looked at ``node`` and refused, with the reason."""
        self.near_misses.append(NearMiss(self.rule, node.name, str(refusal), node_source(node)))

    def tuned(self, subject: str, choice: str, timings: dict[str, float], note: str = "", *,
              unit: str = "ms", kind: str = "autotune") -> None:
        """Record a choice made by measurement, with the timings (milliseconds) behind it; ``unit`` and
        ``kind`` label other figures (``memory_reorder``: simulated peaks in MiB, ``kind="schedule"``)."""
        self.tuning.append(Tuning(self.rule, subject, choice, dict(timings), note, unit, kind))


@dataclasses.dataclass(frozen=True)
class Pass:
    """A named rewrite pass.

    Attributes:
        name: how users select it (``rewrites=["cleanup"]``) and how the report counts it.
        run: ``(graph_module, ctx) -> None``; edits the graph in place.
        description: one line for ``fxforge rewrites``.
        keeps_meta: the pass gives every node it creates shape metadata (``meta['val']``; the pattern
            engine does), so after it the pipeline only fills nodes that lack it instead of propagating
            shapes through the whole graph again.

    Example:
        >>> Pass("x", lambda gm, ctx: None, "one line").description
        'one line'
    """

    name: str
    run: Callable[[torch.fx.GraphModule, PassContext], None]
    description: str = ""
    keeps_meta: bool = False

    def apply(self, graph_module: torch.fx.GraphModule, ctx: PassContext) -> None:
        """Run the pass on ``graph_module`` (the pipeline calls this)."""
        self.run(graph_module, ctx)
