"""``fxforge.lint``: the silent tensor bugs a graph shows and source code hides, as rules over a captured graph.

- :mod:`~fxforge.lint.run`: :func:`lint` captures the model and runs the rules;
- :mod:`~fxforge.lint.rule`: :class:`Rule` (one rule as data) and the registry (:func:`register`);
- :mod:`~fxforge.lint.graph`: :class:`LintGraph`, what a rule reads (nodes by op name, shapes, source lines);
- :mod:`~fxforge.lint.finding`: :class:`Finding` and :class:`Findings` (a table, text, HTML);
- :mod:`~fxforge.lint.rules`: the built-in rules, one per module.

Example:
    >>> from fxforge.lint import lint
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Softmax(dim=-1))
    >>> lint(model, (torch.ones(2, 4),)).rules()
    ['reduce-size-one']
"""

from fxforge.lint.finding import Finding, Findings
from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import RULES, Rule, UnknownRuleError, register, unregister
from fxforge.lint.rules import BUILTIN
from fxforge.lint.run import lint

RULES.update(BUILTIN)

__all__ = ["BUILTIN", "RULES", "Finding", "Findings", "LintGraph", "Rule", "UnknownRuleError", "lint", "register",
           "unregister"]
