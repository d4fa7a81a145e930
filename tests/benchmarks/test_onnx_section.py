"""The ONNX section (issue 6): its entries, contenders and summary lines against the issue's targets."""

from benchmarks import report, suite
from benchmarks.run import SECTIONS


def _row(model, contender, ms):
    return {"model": model, "contender": contender, "status": "ok", "median_ms": ms}


def test_section_reuses_the_attention_and_cnn_entries():
    tagged = [e.name for e in suite.select(None, tag="onnx")]
    assert tagged == [n for n in [e.name for e in suite.SUITE] if n in suite.ONNX_MODELS]
    assert sorted(tagged) == sorted(suite.ONNX_MODELS)
    assert SECTIONS["onnx"].contenders == ("eager", "ort", "ort-transformers-optimizer", "fxforge-ort")


def test_summary_reads_ratios_against_the_plain_export_and_the_targets():
    rows = [
        _row("bert_s1024", "ort", 100.0), _row("bert_s1024", "fxforge-ort", 80.0),
        _row("bert_s1024", "ort-transformers-optimizer", 90.0),
        _row("llama_s2048", "ort", 100.0), _row("llama_s2048", "fxforge-ort", 90.0),
        _row("hf_resnet50", "ort", 10.0), _row("hf_resnet50", "fxforge-ort", 10.5),
    ]
    lines = report.onnx_summary(rows)
    assert lines[0] == ("- bert_s1024: ort ms / fxforge-ort ms = 1.25×; "
                        "ORT transformers optimizer ms / fxforge-ort ms = 1.12×")
    assert "slowest hf_resnet50 0.95× (**not met**)" in lines[3]
    assert lines[4] == ("- attention models at S ≥ 1024: fxforge-ort vs ort bert_s1024 1.25×, llama_s2048 1.11× "
                        "(target ≥ 1.20×: **not met**)")


def test_a_model_without_both_rows_is_said_so():
    lines = report.onnx_summary([_row("bert_s1024", "ort", 1.0)])
    assert lines == ["- bert_s1024: fxforge-ort or ort did not run"]


def test_fxforge_ort_note_counts_each_attention_kernel():
    from benchmarks.onnx_contenders import attention_kernels

    translations = ["attention -> com.microsoft.MultiHeadAttention: 2",
                    "attention mask checked at run time (a mask that masks nothing: flash attention): 2",
                    "attention -> com.microsoft.GroupQueryAttention (causal): 3",
                    "causal attention as MultiHeadAttention: head size 12 is not a multiple of 8 (...)",
                    "fxforge::linear_pointwise -> MatMul + Add + gelu: 4"]
    assert attention_kernels(translations) == {"MultiHeadAttention": 2, "GroupQueryAttention": 3}
