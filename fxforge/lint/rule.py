"""``Rule``: one lint rule as data (a name, a severity, what it finds, and a check over the captured graph),
and the registry of the rules :func:`fxforge.lint` runs.

A rule reads like a sentence: *where the graph does this* (the check walks :class:`~fxforge.lint.graph.LintGraph`'s
nodes), *it is likely a bug or a cost* (``doc``), *do that instead* (each finding's ``fix``). A check returns
findings made with :meth:`LintGraph.finding <fxforge.lint.graph.LintGraph.finding>`; the rule stamps its name
and severity on those that do not set their own.

Example:
    >>> def wide_exp(graph):
    ...     for node in graph.calls("exp"):
    ...         yield graph.finding(node, "exp of a wide tensor", "use a narrower one")
    >>> rule = Rule("wide-exp", "info", wide_exp, "exp over wide tensors")
    >>> register(rule) is rule, "wide-exp" in RULES
    (True, True)
    >>> unregister("wide-exp")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from fxforge.lint.finding import SEVERITIES, Finding


@dataclasses.dataclass(frozen=True)
class Rule:
    """One lint rule.

    Attributes:
        name: kebab-case, what ``# fxforge: ignore[name]`` names.
        severity: the default level of its findings: ``"error"``, ``"warning"`` or ``"info"``.
        check: ``LintGraph -> iterable of Finding``.
        doc: what it finds and why that is a bug or a cost.
        needs_graph: False for a rule that also runs without a graph (from the capture's failure: graph breaks).

    Example:
        >>> Rule("no-op", "info", lambda graph: [], "finds nothing").name
        'no-op'
    """

    name: str
    severity: str
    check: Callable[[Any], Iterable[Finding]]
    doc: str
    needs_graph: bool = True

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"rule {self.name!r}: severity {self.severity!r} is not one of {', '.join(SEVERITIES)}")

    def run(self, graph: Any) -> list[Finding]:
        """The rule's findings on ``graph``, each stamped with the rule's name (and severity where it set none).

        Example:
            >>> Rule("no-op", "info", lambda graph: [], "finds nothing").run(None)
            []
        """
        return [dataclasses.replace(f, rule=self.name, severity=f.severity or self.severity)
                for f in self.check(graph)]


RULES: dict[str, Rule] = {}
"""The rules :func:`fxforge.lint` runs by default, by name: the built-in ones (:mod:`fxforge.lint.rules`) and
those :func:`register` added."""


class UnknownRuleError(ValueError):
    """A rule name that is not registered; the message lists the registered names.

    Example:
        >>> str(UnknownRuleError("nope")).startswith("unknown lint rule 'nope'")
        True
    """

    def __init__(self, name: str):
        super().__init__(f"unknown lint rule {name!r}; rules: {', '.join(RULES)}")


def register(rule: Rule) -> Rule:
    """Add ``rule`` to the rules every :func:`fxforge.lint` runs (replacing one of the same name); returns it,
    so it works as ``RULE = register(Rule(...))``.

    Example:
        >>> register(Rule("quiet", "info", lambda graph: [], "finds nothing")).name
        'quiet'
        >>> unregister("quiet")
    """
    if not isinstance(rule, Rule):
        raise TypeError(f"register takes a fxforge.lint.Rule, not {type(rule).__name__}")
    RULES[rule.name] = rule
    return rule


def unregister(name: str) -> None:
    """Remove the rule called ``name`` (nothing where there is none).

    Example:
        >>> unregister("never-registered")
    """
    RULES.pop(name, None)


def resolve_rules(rules: Iterable[Rule | str] | None) -> list[Rule]:
    """``rules=`` of :func:`fxforge.lint` as rules: None is every registered rule; otherwise names of registered
    rules and :class:`Rule` objects, mixed.

    Raises:
        UnknownRuleError: a name that is not registered.

    Example:
        >>> [r.name for r in resolve_rules(["host-sync"])]
        ['host-sync']
    """
    if rules is None:
        return list(RULES.values())
    if isinstance(rules, (str, Rule)):
        rules = [rules]
    resolved = []
    for rule in rules:
        if isinstance(rule, str):
            if rule not in RULES:
                raise UnknownRuleError(rule)
            rule = RULES[rule]
        elif not isinstance(rule, Rule):
            raise TypeError(f"rules= takes rule names and fxforge.lint.Rule objects, not {type(rule).__name__}")
        resolved.append(rule)
    return resolved
