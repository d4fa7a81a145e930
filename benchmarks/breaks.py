"""``python -m benchmarks --suite breaks``: models with graph breaks, fxforge against eager and ``torch.compile``
(issue 49).

Each model cannot be one graph (a branch on a tensor's value, boolean indexing, a loop over a tensor's value, a
generation loop that stops at ``eos``). Per model, in a new process (empty dynamo, Inductor and autotune caches),
empty autotune, target and Inductor caches, Inductor's caches off (no contender reuses another's compile of the
same graph), ``torch._dynamo.config.recompile_limit`` raised to 64 for every contender (they share dynamo's
per-function cache):

1. dynamo's own view, ``torch._dynamo.explain``: graphs, breaks, ops captured;
2. four contenders built on the example, each timed on its first call (``prepare s``: optimize or compile, and
   the call): ``eager``; ``fxforge`` (``fxforge.optimize(model, example)``, ``method="auto"``, which takes the
   dynamo path since neither fx nor export captures the model; the native target), ``fxforge-inductor``
   (``target="inductor"``: each graph's rewritten plan compiled by Inductor), ``fxforge-auto`` (``target="auto"``:
   the fastest of them against eager, raced; ONNX Runtime refuses a model with breaks); ``compile``
   (``torch.compile(model)``); and ``compile-freezing`` (``options={"freezing": True}``, Inductor's CPU-inference
   setting);
3. steady latency under ``torch.no_grad()``: ``--rounds`` rounds in a rotating order, ``--reps`` calls each
   (``benchmarks.rounds.time_interleaved``), medians; ratios against eager and against ``compile`` in the same run;
4. the first call at a new size (``new size s``: a re-plan for fxforge, a recompile for torch.compile), and the
   largest difference from eager at the example and the new size;
5. fxforge's report: graphs, breaks, the share of eager's FLOPs inside its optimized graphs.

Writes ``benchmarks/out/results-breaks.json`` and the block between ``<!-- harness:breaks:begin -->`` and
``<!-- harness:breaks:end -->`` of ``RESULTS.md``.

Example::

    python -m benchmarks --suite breaks
    python -m benchmarks --suite breaks --models ragged_gru --rounds 3 --reps 5 --no-markdown
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.cold_section import cold_section, ratio

HERE = Path(__file__).resolve().parents[1]
OUT = HERE / "benchmarks" / "out" / "results-breaks.json"
BLOCK = "breaks"
CONTENDERS = ("eager", "fxforge", "fxforge-inductor", "fxforge-auto", "compile", "compile-freezing")
MODELS = ("resnet_branch", "bert_masked_pool", "ragged_gru", "gpt2_greedy")


def _resnet_branch() -> tuple[Any, tuple, tuple]:
    """A ResNet-18 (basic blocks 2-2-2-2, written out: torchvision is not installed here) whose last stage is taken
    one of two ways by the sign of the features' mean."""
    import torch
    from torch import nn

    class Basic(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            h = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(h)) + self.down(x))

    def stage(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(Basic(cin, cout, stride), Basic(cout, cout, 1))

    class ResNetBranch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1), stage(64, 64, 1), stage(64, 128, 2), stage(128, 256, 2))
            self.layer4, self.fc = stage(256, 512, 2), nn.Linear(512, 100)

        def forward(self, x):
            h = self.stem(x)
            if h.mean() > 0:
                h = self.layer4(h)
            else:
                h = self.layer4(-h)
            return self.fc(torch.flatten(h.mean((2, 3)), 1))

    torch.manual_seed(0)
    model = ResNetBranch().train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 3, 96, 96))
    return model.eval(), (torch.randn(4, 3, 160, 160),), (torch.randn(2, 3, 192, 192),)


def _bert_masked_pool() -> tuple[Any, tuple, tuple]:
    """A transformers BERT (random weights, 4 layers, hidden 256) whose head averages the tokens its mask keeps
    (boolean indexing: an output size that depends on values)."""
    import torch
    from torch import nn
    from transformers import BertConfig, BertModel

    class MaskedPool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertModel(BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                             intermediate_size=1024, vocab_size=2000))
            self.score = nn.Linear(256, 1)
            self.head = nn.Linear(256, 8)

        def forward(self, ids):
            h = self.bert(ids).last_hidden_state
            kept = h[self.score(h).squeeze(-1) > 0]
            return self.head(kept.mean(0) if kept.numel() else h.mean((0, 1)))

    torch.manual_seed(0)
    return MaskedPool().eval(), (torch.randint(0, 2000, (4, 128)),), (torch.randint(0, 2000, (2, 96)),)


def _ragged_gru() -> tuple[Any, tuple, tuple]:
    """A GRU cell stepped ``lengths.max()`` times (a loop over a tensor's value), outputs appended to a list."""
    import torch
    from torch import nn

    class RaggedGRU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(64, 256)
            self.cell = nn.GRUCell(256, 256)
            self.out = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 32))

        def forward(self, x, lengths):
            h = torch.zeros(x.shape[0], 256)
            steps = []
            for t in range(int(lengths.max())):
                h = self.cell(torch.tanh(self.embed(x[:, t])), h)
                steps.append(self.out(h))
            return torch.stack(steps, 1)

    torch.manual_seed(0)
    return (RaggedGRU().eval(), (torch.randn(16, 24, 64), torch.full((16,), 24)),
            (torch.randn(8, 24, 64), torch.full((8,), 24)))


def _gpt2_greedy() -> tuple[Any, tuple, tuple]:
    """transformers' GPT-2 (random weights, 4 layers, hidden 256) decoding 8 tokens greedily, stopping early
    when every row emitted ``eos`` (a branch on a tensor's value inside the loop)."""
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    class Greedy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2000, n_positions=256,
                                                 bos_token_id=0, eos_token_id=1))

        def forward(self, ids):
            for _ in range(8):
                nxt = self.lm(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
                if bool((nxt == 1).all()):
                    break
            return ids

    torch.manual_seed(0)
    return Greedy().eval(), (torch.randint(2, 2000, (2, 32)),), (torch.randint(2, 2000, (3, 40)),)


BUILDERS = {"resnet_branch": _resnet_branch, "bert_masked_pool": _bert_masked_pool, "ragged_gru": _ragged_gru,
            "gpt2_greedy": _gpt2_greedy}


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def measure(name: str, rounds: int, reps: int) -> dict[str, Any]:
    """One model's row (see the module docstring)."""
    import torch
    import torch._dynamo

    import fxforge
    from benchmarks.rounds import max_abs_error, time_interleaved

    torch._dynamo.config.recompile_limit = 64
    model, example, new = BUILDERS[name]()
    row: dict[str, Any] = {"model": name, "example": [list(t.shape) for t in example],
                           "new": [list(t.shape) for t in new], "contenders": {}}
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(*example)
        row["dynamo"] = {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
                         "ops": explained.op_count}
        torch._dynamo.reset()
        reference, reference_new = model(*example), model(*new)
        builders = {"eager": lambda: model, "fxforge": lambda: fxforge.optimize(model, example),
                    "fxforge-inductor": lambda: fxforge.optimize(model, example, target="inductor"),
                    "fxforge-auto": lambda: fxforge.optimize(model, example, target="auto"),
                    "compile": lambda: torch.compile(model),
                    "compile-freezing": lambda: torch.compile(model, options={"freezing": True})}
        fns = {}
        for contender, build in builders.items():
            start = time.perf_counter()
            fn = build()
            out = fn(*example)
            prepare = time.perf_counter() - start
            fns[contender] = fn
            row["contenders"][contender] = {"prepare_s": prepare, "error": max_abs_error(reference, out)}
        times, failures = time_interleaved(fns, example, warmup=2, rounds=rounds, reps=reps)
        for contender, fn in fns.items():
            entry = row["contenders"][contender]
            if contender in failures:
                entry["failed"] = repr(failures[contender])[:300]
                continue
            entry["ms"] = statistics.median(t for r in times[contender] for t in r)
            first, out = _timed(fn, *new)
            entry["new_size_s"], entry["error"] = first, max(entry["error"], max_abs_error(reference_new, out))
        opt = fns["fxforge"]
        rep = opt.report
        auto = fns["fxforge-auto"].report
        row["auto_returned"] = auto.race.winner if auto is not None and auto.race is not None else "?"
        row["fxforge"] = {"method": rep.method, "graphs": len(rep.graphs), "breaks": [str(b) for b in rep.breaks],
                          "nodes": rep.nodes_before, "flop_share": rep.flop_share, "time_share": rep.time_share,
                          "counts": rep.counts, "plans_built": opt.plans_built}
    row["load"] = os.getloadavg()[0]
    return row


def markdown(rows: list[dict], command: str) -> str:
    """The block: per model and contender, latency, its ratios, prepare and new-size seconds, max error; then
    dynamo's graphs and fxforge's report figures."""
    lines = ["## Graph breaks: fxforge through dynamo against eager and torch.compile (issue 49)", "",
             (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores, CPU. "
              "Latency: medians of interleaved rounds under `torch.no_grad()` in one process per model; "
              "`speed vs eager` is eager's latency / the contender's (above 1: faster), `vs compile` the same "
              "against `torch.compile(model)`. `prepare s`: optimize or compile plus the first call; `new size s`: "
              "the first call at the new size (a re-plan, a recompile). `load`: the 1-minute load average at the end."),
             "", ("| model (example → new) | contender | ms | speed vs eager | vs compile | prepare s | new size s | "
                 "max abs err | load |"), "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | failed: {report.md_cell(row['error'])} | | | | | | | |")
            continue
        shapes = f"{'x'.join(map(str, row['example'][0]))} → {'x'.join(map(str, row['new'][0]))}"
        eager, compiled = (row["contenders"][c].get("ms") for c in ("eager", "compile"))
        for contender in CONTENDERS:
            entry = row["contenders"][contender]
            if "failed" in entry:
                lines.append(f"| {row['model']} ({shapes}) | {contender} | failed: {report.md_cell(entry['failed'])}"
                             " | | | | | | |")
                continue
            lines.append(f"| {row['model']} ({shapes}) | {contender} | {entry['ms']:.2f} | {ratio(eager, entry['ms'])} | "
                         f"{ratio(compiled, entry['ms'])} | {entry['prepare_s']:.1f} | {entry.get('new_size_s', 0):.2f} | "
                         f"{entry['error']:.1e} | {row['load']:.1f} |")
    lines += ["", ("| model | dynamo (explain): graphs, breaks, ops | fxforge: method, graphs, nodes captured, "
                  "FLOPs inside optimized graphs, rewrites | breaks fxforge names |"), "|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            continue
        dyn, fx = row["dynamo"], row["fxforge"]
        share = f"{fx['flop_share']:.1%}" if fx["flop_share"] is not None else "?"
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(fx["counts"].items())) or "none"
        lines.append(f"| {row['model']} | {dyn['graphs']}, {dyn['breaks']}, {dyn['ops']} | {fx['method']}, "
                     f"{fx['graphs']}, {fx['nodes']}, {share}, {counts}; auto returned {row.get('auto_returned', '?')} | "
                     f"{report.md_cell('; '.join(fx['breaks']), 400)} |")
    return "\n".join(lines)


SECTION = cold_section("breaks", "models with graph breaks: fxforge (dynamo, graph by graph) against eager and "
                       "torch.compile: latency, prepare, new size, FLOP share (issue 49)", "benchmarks.breaks", MODELS,
                       BLOCK, OUT, markdown)

if __name__ == "__main__":  # one model in this process (a cold_section child): its row as JSON
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
