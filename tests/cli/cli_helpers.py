"""Helpers of the command-line tests: running ``python -m fxforge.cli`` as a user does, and the model file
they write outside the repository."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

USER_MODEL = textwrap.dedent('''
    import torch
    class Net(torch.nn.Module):
        def __init__(self, width=4):
            super().__init__()
            self.lin = torch.nn.Linear(width, width)
            self.drop = torch.nn.Dropout(0.5)
        def forward(self, x):
            return self.drop(self.lin(x))
    def build():
        return Net(width=8)
    def broken():
        raise ValueError("no weights for width 8")
    class Raises(torch.nn.Module):
        def forward(self, x):
            raise NotImplementedError("forward is not written yet")
    @torch.library.custom_op("fxclitest::mystery", mutates_args=())
    def mystery(x: torch.Tensor) -> torch.Tensor:
        return x * 2
    @mystery.register_fake
    def _(x):
        return torch.empty_like(x)
    class Mystery(torch.nn.Module):
        def forward(self, x):
            return torch.ops.fxclitest.mystery(x) + 1
    def exits():
        import sys
        sys.exit(3)
    class ExitsInForward(torch.nn.Module):
        def forward(self, x):
            import sys
            sys.exit(4)
''')


def run_cli(*args, cwd=None, timeout=240, env=None):
    """``python -m fxforge.cli ARGS`` in a subprocess (the repository importable, as when installed), with
    ``env`` added to the environment."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **(env or {}))
    return subprocess.run([sys.executable, "-m", "fxforge.cli", *map(str, args)], capture_output=True, text=True,
                          check=False, cwd=cwd, timeout=timeout, env=env)
