"""Planning on paper: the published clusters, and ``fxforge.parallelize(..., cluster=...)`` on a LLaMA-style
8B model on the meta device (issue 52, item 5), its memory and MFU against hand calculation."""

from __future__ import annotations

import time

import pytest
import torch

import fxforge
from fxforge.core.links import PUBLISHED
from fxforge.parallel.cluster import PUBLISHED_CLUSTERS, Cluster
from fxforge.parallel.paper import fold_blocks

transformers = pytest.importorskip("transformers")
from benchmarks.parallel_scale import Logits, cross_entropy_like

H100 = PUBLISHED_CLUSTERS["h100-sxm-8x"]
SEQ = 2048


@pytest.fixture(scope="module")
def llama8b() -> torch.nn.Module:
    """torchtitan's llama3 8B shape (32 layers of 4096, 32 heads, 8 key/value heads, FFN 14336), on meta."""
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                      max_position_embeddings=SEQ)
    with torch.device("meta"):
        return Logits(transformers.LlamaForCausalLM(config))


def plan(model: torch.nn.Module, gpus: int, rows: int, **options):
    ids = torch.zeros(rows, SEQ, dtype=torch.long, device="meta")
    return fxforge.parallelize(model, (ids,), devices=gpus, cluster=H100, loss=cross_entropy_like,
                               optimizer="adamw", precision="bf16", activation_checkpointing="full", **options)


def test_published_clusters_and_placement():
    h100 = H100.scaled(64)
    assert (h100.gpus, h100.nodes, h100.peak_tflops, h100.gpus_per_node) == (64, 8, 989.4, 8)
    assert "1,979 TFLOPS with sparsity" in h100.source and "torchtitan" in h100.efficiency_source
    assert h100.group_link(8, stride=1) == h100.intra                    # TP inside a node
    assert h100.group_link(8, stride=8).bandwidth_gbs == pytest.approx(40.0)   # one GPU per node: IB x0.8
    assert h100.group_link(16, stride=1).bandwidth_gbs == pytest.approx(320.0)  # 8 NICs per node share it
    a100 = PUBLISHED_CLUSTERS["a100-sxm-8x"]
    assert (a100.peak_tflops, a100.intra.bandwidth_gbs, a100.inter.bandwidth_gbs) == (312.0, 240.0, 20.0)
    with pytest.raises(ValueError, match="efficiency"):
        Cluster(8, 8, 1.0, 1.0, PUBLISHED["pcie4-x16"], PUBLISHED["ethernet-25g"], "x", "made up", efficiency=1.5)


def test_fold_blocks_counts_two_blocks_for_all(llama8b):
    short, fold = fold_blocks(llama8b)
    assert len(short.lm.model.layers) == 2 and len(llama8b.lm.model.layers) == 32
    assert fold.container == "lm.model.layers" and fold.weight(["lm.model.layers.1.mlp"]) == 31


def test_precision_is_for_paper_plans_only():
    with pytest.raises(ValueError, match="cluster="):
        fxforge.parallelize(torch.nn.Linear(2, 2), (torch.ones(2, 2),), devices=2, precision="bf16")


def test_llama8b_on_8_gpus_fits_and_matches_hand_figures(llama8b):
    params = sum(p.numel() for p in llama8b.parameters())
    start = time.process_time()  # CPU time: a busy machine's waits do not count (about 6 s when idle)
    p = plan(llama8b, 8, rows=8)
    took = time.process_time() - start
    assert took < 20, f"planning took {took:.1f} s of CPU"
    assert p.chosen.fits and p.chosen.memory_per_device <= H100.memory_bytes
    fsdp8 = next(c for c in p.options if c.name == "fsdp8")
    # FSDP2 bf16 mixed precision: float32 master weights (4 B), float32 gradients (4 B), AdamW's two float32
    # moments (8 B) per parameter, sharded 8 ways (each tensor's dim 0 padded to a multiple of 8; AdamW's
    # step is one float32 scalar per tensor).
    assert fsdp8.memory["weights"] == pytest.approx(4 * params / 8, rel=1e-3)
    assert fsdp8.memory["gradients"] == pytest.approx(4 * params / 8, rel=1e-3)
    assert fsdp8.memory["optimizer_state"] == pytest.approx(8 * params / 8, rel=1e-3)
    # Gathered: three bf16 blocks (FSDP2's all-gather output, the unsharded copy, the next one prefetched)
    # plus the root's embedding and head.
    block = sum(q.numel() for q in llama8b.lm.model.layers[0].parameters())
    root = params - 32 * block
    assert fsdp8.memory["gathered"] == pytest.approx(2 * (3 * block + root), rel=1e-3)
    # MFU: counted FLOPs ~ 6 x (parameters without the embedding) x tokens + attention 12 x layers x dim x seq
    # per token (torchtitan's formula); full AC recomputes each block's forward, so at 40 % of peak the MFU is
    # at most 0.40 x 6 / 8 and near it when FSDP hides behind the compute.
    tokens = 8 * SEQ
    formula = (6 * (params - 128256 * 4096) + 12 * 32 * 4096 * SEQ) * tokens
    counted = fsdp8.mfu * fsdp8.step_s * 8 * H100.peak_flops
    assert counted == pytest.approx(formula, rel=0.03)
    assert 0.25 < fsdp8.mfu <= 0.40 * 6 / 8 + 1e-3
    assert fsdp8.tokens_per_s == pytest.approx(tokens / fsdp8.step_s / 8)
    assert "tokens/s per GPU" in p.why and "planned on paper" in str(p)


def test_llama8b_on_64_gpus_and_single_gpu_refused(llama8b):
    start = time.process_time()
    p = plan(llama8b, 64, rows=64, mesh={"fsdp": 8, "tp": 8})
    assert time.process_time() - start < 15
    assert p.strategy == {"pp": 1, "dp": 1, "fsdp": 8, "tp": 8}
    assert p.tp_plan["lm.model.layers.31.mlp.down_proj"] == "rowwise"
    kinds = {(c.group, c.kind) for c in p.collectives}
    assert ("tp", "all_gather") in kinds and ("fsdp", "reduce_scatter") in kinds
    with pytest.raises(ValueError, match=r"nothing fits in 79.60 GiB per GPU on 1 GPUs; the smallest need is") as error:
        plan(llama8b, 1, rows=1)
    need = float(str(error.value).split("need is ")[1].split(" GiB")[0])
    params = sum(q.numel() for q in llama8b.parameters())
    assert need > 16 * params / 2**30   # master weights, gradients and AdamW alone: 16 B per parameter


def test_capture_on_meta_checks_layout_not_values():
    """A model on the meta device has shapes and no values: capture compares the outputs' layout only (it used
    to fail copying a meta tensor out); real tensors are still compared by value."""
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    cap = fxforge.capture(net, (torch.empty(2, 8, device="meta"),), method="export")
    assert cap.graph_module(torch.empty(2, 8, device="meta")).shape == (2, 4)
    from fxforge.training.breakdown import training_memory

    tm = training_memory(net, (torch.empty(2, 8, device="meta"),), optimizer="adamw")
    assert tm.weights_bytes == 4 * (8 * 16 + 16 + 16 * 4 + 4) and tm.optimizer_state_bytes > 2 * tm.weights_bytes
