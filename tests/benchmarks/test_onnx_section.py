"""The ONNX section (issue 6): its entries, contenders and summary lines against the issue's targets."""

from benchmarks import report, suite
from benchmarks.timed import TIMED


def _row(model, contender, ms):
    return {"model": model, "contender": contender, "status": "ok", "median_ms": ms}


def test_section_reuses_the_attention_and_cnn_entries():
    tagged = [e.name for e in suite.select(None, tag="onnx")]
    assert tagged == [n for n in [e.name for e in suite.SUITE] if n in suite.ONNX_MODELS]
    assert sorted(tagged) == sorted(suite.ONNX_MODELS)
    assert TIMED["onnx"].contenders == ("eager", "ort", "ort-transformers-optimizer", "fxforge-ort")


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


def test_a_ratio_below_one_on_the_same_optimized_graph_is_noise_not_a_slower_export():
    def with_graph(row, digest):
        return dict(row, info={"optimized_graph": digest})

    rows = [with_graph(_row("hf_resnet50", "ort", 10.0), "abc"), with_graph(_row("hf_resnet50", "fxforge-ort", 10.3), "abc"),
            with_graph(_row("mobilenet", "ort", 10.0), "x"), with_graph(_row("mobilenet", "fxforge-ort", 9.0), "y")]
    line = report.onnx_summary(rows)[2]
    assert line == ("- fxforge-ort never slower than ort: slowest hf_resnet50 0.97×; ORT optimizes both exports of "
                    "hf_resnet50 into the same graph (same kernels on the same shapes), so its ratio below 1.00× is "
                    "timing noise (met)")
    rows[1]["info"]["optimized_graph"] = "different"
    assert report.onnx_summary(rows)[2].endswith("slowest hf_resnet50 0.97× (**not met**)")


def test_the_optimized_graph_digest_ignores_names_and_sees_structure(tmp_path):
    import onnx
    import torch
    from onnx import TensorProto, helper

    from benchmarks.contenders import optimized_graph_digest

    def model(names, op):
        x = helper.make_tensor_value_info(names[0], TensorProto.FLOAT, [2, 3])
        y = helper.make_tensor_value_info(names[2], TensorProto.FLOAT, [2, 3])
        nodes = [helper.make_node(op, [names[0]], [names[1]], name=names[1]),
                 helper.make_node("Relu", [names[1]], [names[2]], name=names[2])]
        return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)],
                                 ir_version=8)

    digests = []
    for i, (names, op) in enumerate([(("a", "b", "c"), "Sigmoid"), (("p", "q", "r"), "Sigmoid"), (("a", "b", "c"), "Tanh")]):
        path = str(tmp_path / f"m{i}.onnx")
        onnx.save(model(names, op), path)
        digests.append(optimized_graph_digest(path, torch.device("cpu")))
    assert digests[0] == digests[1] != digests[2]
    # Independent branches listed in either order: the same graph.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("s", "t")]
    branches = [helper.make_node("Sigmoid", ["x"], ["s"], name="s"), helper.make_node("Tanh", ["x"], ["t"], name="t")]
    for i, nodes in enumerate([branches, branches[::-1]]):
        path = str(tmp_path / f"b{i}.onnx")
        onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], outs), ir_version=8,
                                    opset_imports=[helper.make_opsetid("", 17)]), path)
        digests.append(optimized_graph_digest(path, torch.device("cpu")))
    assert digests[3] == digests[4]


def test_a_model_without_both_rows_is_said_so():
    lines = report.onnx_summary([_row("bert_s1024", "ort", 1.0)])
    assert lines == ["- bert_s1024: fxforge-ort or ort did not run"]


def test_fxforge_ort_note_counts_each_attention_kernel():
    from benchmarks.onnx_contenders import RESIDUAL_NORM_RULE, ort_kernels

    translations = ["attention -> com.microsoft.MultiHeadAttention: 2",
                    "attention mask checked at run time (a mask that masks nothing: flash attention): 2",
                    "attention -> com.microsoft.GroupQueryAttention (causal): 3",
                    "causal attention as MultiHeadAttention: head size 12 is not a multiple of 8 (...)",
                    "fxforge::linear_pointwise -> MatMul + Add + gelu: 4"]
    assert RESIDUAL_NORM_RULE == "residual_norm"
    assert ort_kernels(translations, {"onnx residual_norm": 9, "attention": 2}) == {"MultiHeadAttention": 2, "GroupQueryAttention": 3,
                                         "Sum+LayerNormalization": 9}
