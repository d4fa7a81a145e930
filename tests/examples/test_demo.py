"""`make demo` (examples/demo.py) prints a short summary: repeated report entries collapse into one line with a
count, and it ends with a command the CLI takes."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples import demo
from fxforge.cli import build_parser
from fxforge.core.report import Applied

MAX_LINES = 25


def test_grouped_collapses_repeated_entries():
    entries = [Applied("conv_bn_fold", "conv2d + batch_norm", [f"c{i}", f"b{i}"], "m/net.py:7: y = self.bn(self.conv(x))")
               for i in range(20)]
    entries += [Applied("memory_reorder", f"segment {i} reordered (exact): simulated peak {i}.5 -> 0.2 MiB", [], "m/net.py:9: z")
                for i in range(3)]
    entries += [Applied("conv_activation", "relu(conv2d)", [f"r{i}"], "m/net.py:7: y") for i in range(2)]
    entries.append(Applied("cleanup", "dropout in eval removed", ["d"], None))
    assert demo.grouped(entries, lambda e: e.what) == [
        (20, "conv_bn_fold", "conv2d + batch_norm", "net.py:7"),
        (3, "memory_reorder", "segment N reordered", "net.py:9"),
        (2, "conv_activation", "relu(conv2d)", "net.py:7"),
        (1, "cleanup", "dropout in eval removed", "(no source line)"),
    ]


@pytest.mark.slow
def test_demo_prints_a_short_summary_and_the_next_command(capsys):
    demo.main("inception")
    out = capsys.readouterr().out
    lines = out.rstrip("\n").splitlines()
    assert len(lines) <= MAX_LINES, out
    text = [line for line in lines if line.strip()]
    assert len(text) == len(set(text)), f"repeated lines:\n{out}"
    fold = next(line for line in lines if "conv_bn_fold" in line and " x" in line)
    # the twenty BatchNorms of the example's one conv-bn-relu helper: one line, the user's file and line
    assert "x20" in fold and "inception_block.py:32" in fold, fold
    assert "max abs error vs eager" in out and "(ok)" in out, out
    command = shlex.split(lines[-1])
    assert command[0] == ".venv/bin/fxforge", lines[-1]
    args = build_parser().parse_args(command[1:])  # the command it suggests is one the CLI takes
    assert args.model == "examples/models/resnet_cnn.py:ResNetCNN"
    assert (ROOT / args.model.split(":")[0]).is_file()


def test_demo_refuses_an_unknown_example():
    with pytest.raises(SystemExit, match="unknown example 'nope'; examples: resnet_cnn"):
        demo.main("nope")
