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


# One process imports fxforge.cli (which imports torch: most of a failing command's seconds) once, then forks a
# child per command that runs ``python -m fxforge.cli ARGS`` as the interpreter would: in its folder, with its own
# stdout and stderr, the cwd first on sys.path, the exit status from SystemExit (an uncaught exception: traceback
# and 1), exit handlers run.
_FORKED_RUNS = r'''
import atexit, json, os, runpy, sys, traceback
import fxforge.cli

results = []
for args, cwd, stdout, stderr in json.load(sys.stdin):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(cwd)
            for fd, path in ((1, stdout), (2, stderr)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.path[0] = os.getcwd()
            sys.argv = ["-m", *args]
            try:
                runpy.run_module("fxforge.cli", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as exit_:
                if exit_.code is None or isinstance(exit_.code, int):
                    code = exit_.code or 0
                else:
                    print(exit_.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    results.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(results))
'''


def run_cli_forked(runs, logs: Path, timeout=240):
    """``python -m fxforge.cli ARGS`` for each ``(args, cwd)`` of ``runs``, each in a child forked from one process
    that imported fxforge.cli once; ``logs``: a folder for their stdout and stderr. The results, in order, as
    :func:`run_cli` gives them."""
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    jobs = [([str(a) for a in args], str(cwd), str(logs / f"{i}.out"), str(logs / f"{i}.err"))
            for i, (args, cwd) in enumerate(runs)]
    driver = subprocess.run([sys.executable, "-c", _FORKED_RUNS], input=json.dumps(jobs), capture_output=True,
                            text=True, check=True, timeout=timeout, env=env)
    codes = json.loads(driver.stdout.strip().splitlines()[-1])
    return [subprocess.CompletedProcess([sys.executable, "-m", "fxforge.cli", *args], code,
                                        Path(out).read_text(), Path(err).read_text())
            for (args, _, out, err), code in zip(jobs, codes, strict=True)]
