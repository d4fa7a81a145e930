"""The auto-prepare section's table: each checkout's prepare seconds, winner, refusals and fresh inputs served."""

from __future__ import annotations

from benchmarks import auto_prepare


def row(model, prepare, winner, served, refused=()):
    contenders = [{"name": "eager", "latency_ms": 2.0, "refused": None},
                  {"name": "native", "latency_ms": 1.0, "refused": None}]
    contenders += [{"name": name, "latency_ms": None, "refused": "cannot serve the sizes eager serves"}
                   for name in refused]
    return {"model": model, "prepare_s": prepare, "winner": winner, "eager_ms": 2.0, "contenders": contenders,
            "served": served, "load": 0.5}


def test_the_block_puts_the_checkouts_side_by_side():
    runs = {"this": [row("unet", 12.3, "native", ["ok", "ok"], refused=["onnxruntime"])],
            "/tmp/parent": [row("unet", 25.6, "onnxruntime", ["ok", "InputShapeError"])],}
    block = auto_prepare.markdown(runs, "python -m benchmarks --suite auto-prepare")
    line = next(line for line in block.splitlines() if line.startswith("| unet"))
    this, parent = line.split(" | ")[1:3]
    assert "12.3 s → native, 1.00 ms vs eager 2.00 ms; refused: onnxruntime; fresh inputs served 2/2" in this
    assert "25.6 s → onnxruntime" in parent and "served 1/2 (ok, InputShapeError)" in parent


def test_a_failed_run_is_a_row_that_says_so():
    runs = {"this": [{"model": "gpt", "error": "RuntimeError: boom"}]}
    assert "failed: RuntimeError: boom" in auto_prepare.markdown(runs, "cmd")
