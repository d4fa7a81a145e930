"""Training: a step's memory predicted from its forward and backward graphs, and checkpointing under a budget.

- :func:`~fxforge.training.breakdown.training_memory` predicts weights, gradients, optimizer state,
  activations and the step's peak with fake tensors; ``.measure()`` runs one real step beside it.
- :func:`~fxforge.training.checkpointing.plan_checkpointing` chooses what to recompute under a budget (the
  least recompute over the forward's chain of pieces, checked by simulating the whole step), and
  :class:`~fxforge.training.module.CheckpointedModule` runs it (``fxforge.optimize(..., memory_budget=)``).
- :mod:`fxforge.training.step_graph` traces the step (AOTAutograd's joint graph, partitioned),
  :mod:`fxforge.training.timeline` replays it storage by storage.

Example:
    >>> tm = training_memory(torch.nn.Linear(8, 8), (torch.randn(4, 8),), optimizer="sgd")
    >>> tm.optimizer_state_bytes
    288
"""

from fxforge.training.breakdown import TrainingMemory, training_memory
from fxforge.training.checkpointing import BudgetError, CheckpointPlan
from fxforge.training.module import CheckpointedModule, plan_checkpointing

__all__ = ["BudgetError", "CheckpointPlan", "CheckpointedModule", "TrainingMemory", "plan_checkpointing",
           "training_memory"]
