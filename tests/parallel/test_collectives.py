"""Collectives counted as they run equal those predicted from the parameters, exactly (kind, bytes, group
size, group, phase, count): FSDP2 ``fully_shard`` per block + root, DDP (its three kinds of step) and
FSDP2's ``replicate``, on an MLP, a transformers LLaMA and GPT-2 (tied embeddings)
(fxforge/parallel/collectives.py).

Everything runs in this process on the fake backend (collectives that move nothing) except one check that
two real gloo workers count what the fake backend counts.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from fxforge.parallel.collectives import (
    Collective,
    CollectiveCounter,
    apply_fully_shard,
    blocking_allreduce_hook,
    collectives_table,
    comparable,
    data_parallel_collectives,
    fsdp_blocks,
    fsdp_collectives,
    total_bytes,
)
from fxforge.parallel.overlap import gradient_ready_order
from fxforge.parallel.processes import run_workers, worker_main


class MLP(torch.nn.Module):
    """Blocks in a ModuleList, and sizes that do not divide by 3 or 4 (FSDP2 pads them)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 10)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(10, 15), torch.nn.ReLU(), torch.nn.Linear(15, 10))
            for _ in range(3))
        self.out = torch.nn.Linear(10, 5)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP()
    import transformers

    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128))
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32))
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def batch(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, generator=g) if name == "mlp" else torch.randint(0, 128, (2, 8), generator=g)


def loss_of(out) -> torch.Tensor:
    return (out if isinstance(out, torch.Tensor) else out.logits).float().square().mean()


def count_steps(model, wrapped, name, labels, steps) -> list[list[Collective]]:
    """Each step's collectives: forward, backward, and the optimizer step marked "optimizer"."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counted = []
    for _ in range(steps):
        with CollectiveCounter(labels) as counter:
            loss_of(wrapped(batch(name))).backward()
            with counter.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        counted.append(counter.collectives)
    return counted


@pytest.fixture
def fake(request):
    """The fake backend over ``request.param`` ranks (default 4), destroyed after the test."""
    world = getattr(request, "param", 4)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield world
    finally:
        dist.destroy_process_group()


def test_the_counter_records_kind_bytes_group_and_phase(fake):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    x = torch.ones(8, requires_grad=True)
    with CollectiveCounter({dist.group.WORLD: "world", tp.get_group(): "tp"}) as counter:
        dist.all_reduce(torch.ones(8))
        dist.all_gather_single(torch.empty(32), torch.ones(8))
        dist.reduce_scatter_single(torch.empty(2), torch.ones(8))
        dist.broadcast(torch.ones(3, dtype=torch.float64), src=0)
        dist.all_to_all_single(torch.empty(8), torch.ones(8))
        funcol.all_reduce(torch.ones(8), "sum", tp)
        with counter.phase("optimizer"):
            dist.all_reduce(torch.ones(2), group=tp.get_group())
        funcol.all_gather_single_autograd(x, 0, tp).sum().backward()    # its backward: a reduce-scatter
    assert [(c.kind, c.nbytes, c.ranks, c.group, c.phase) for c in counter.collectives] == [
        ("all_reduce", 32, 4, "world", "forward"), ("all_gather", 128, 4, "world", "forward"),
        ("reduce_scatter", 32, 4, "world", "forward"), ("broadcast", 24, 4, "world", "forward"),
        ("all_to_all", 32, 4, "world", "forward"), ("all_reduce", 32, 2, "tp", "forward"),
        ("all_reduce", 8, 2, "tp", "optimizer"), ("all_gather", 64, 2, "tp", "forward"),
        ("reduce_scatter", 64, 2, "tp", "backward")]
    # A mesh labels its groups by its dimension names; a group left unnamed keeps its own name.
    with CollectiveCounter(mesh) as by_mesh:
        funcol.all_reduce(torch.ones(8), "sum", mesh["dp"])
        dist.all_reduce(torch.ones(8))
    assert [c.group for c in by_mesh.collectives] == ["dp", dist.group.WORLD.group_name]
    assert total_bytes(counter.collectives, group="tp") == 32 + 8 + 64 + 64
    assert total_bytes(counter.collectives, phase="backward", kind="reduce_scatter") == 64


@pytest.mark.parametrize("fake", [2], indirect=True)
def test_the_counter_sees_what_dtensor_tensor_parallel_issues(fake):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (fake,), mesh_dim_names=("tp",))
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with CollectiveCounter(mesh) as counter:
        mlp(torch.randn(4, 8, requires_grad=True)).sum().backward()
    # Row-wise: the output (4 x 8 floats) all-reduced; column-wise: the input's gradient in backward.
    assert [_fields(c) for c in counter.collectives] == [("all_reduce", 128, 2, "tp", "forward", ""),
                                                          ("all_reduce", 128, 2, "tp", "backward", "")]


def test_every_known_op_names_its_group_where_the_counter_reads_it():
    from fxforge.parallel.collectives import _OPS

    found = 0
    for qualified, (kind, tensor_index, _, group_index) in _OPS.items():
        namespace, name = qualified.split(".")
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is None:              # a variant this torch does not define
            continue
        arguments = packet.default._schema.arguments
        assert arguments[group_index].name in ("group_name", "process_group"), qualified
        assert "Tensor" in str(arguments[tensor_index].type), qualified
        found += 1
    assert found >= 30


def test_the_blocks_are_the_children_of_the_outermost_module_lists():
    assert fsdp_blocks(MLP()) == ["layers.0", "layers.1", "layers.2"]
    assert fsdp_blocks(build("llama")) == ["model.layers.0", "model.layers.1"]
    assert fsdp_blocks(build("gpt2")) == ["transformer.h.0", "transformer.h.1"]


@pytest.mark.parametrize("fake", [4, 3], indirect=True, ids=["4ranks", "3ranks"])
@pytest.mark.parametrize("name", ["mlp", "llama", "gpt2"])
def test_fsdp_predicted_equals_counted(fake, name):
    model = build(name)
    predicted = fsdp_collectives(model, fake)
    mesh = init_device_mesh("cpu", (fake,), mesh_dim_names=("fsdp",))
    apply_fully_shard(model, mesh)
    for counted in count_steps(model, model, name, mesh, steps=2):
        # The same records in the same order (the backward prefetch included); none in the optimizer step.
        assert [c[:5] for c in map(_fields, counted)] == [c[:5] for c in map(_fields, predicted)]
    kinds = collectives_table(predicted, counted).set_index(["phase", "kind"])
    blocks = len(fsdp_blocks(build(name)))
    assert kinds.loc[("forward", "all_gather"), "count_measured"] == blocks + 1
    assert kinds.loc[("backward", "all_gather"), "count_measured"] == blocks       # the root keeps its own
    assert kinds.loc[("backward", "reduce_scatter"), "count_measured"] == blocks + 1
    assert (kinds.bytes_predicted == kinds.bytes_measured).all()
    # Padding to a multiple of the ranks is sent: at 3 ranks every model here moves more than its bytes.
    parameter_bytes = sum(p.numel() * p.element_size() for p in build(name).parameters())
    assert (total_bytes(predicted, phase="forward") > parameter_bytes) == (fake == 3 or name == "mlp")


def _fields(c: Collective) -> tuple:
    return (c.kind, c.nbytes, c.ranks, c.group, c.phase, c.where)


@pytest.mark.parametrize("reshard", [False, True])
def test_fsdp_resharding_after_forward_or_not(fake, reshard):
    model = build("mlp")
    predicted = fsdp_collectives(model, fake, reshard_after_forward=reshard)
    mesh = init_device_mesh("cpu", (fake,), mesh_dim_names=("fsdp",))
    apply_fully_shard(model, mesh, reshard_after_forward=reshard)
    (counted,) = count_steps(model, model, "mlp", mesh, steps=1)
    assert list(map(_fields, counted)) == [_fields(c)[:5] + ("",) for c in predicted]
    # False: one all-gather per group in forward only; True: the root's gathered again too.
    assert [c.phase for c in predicted if c.kind == "all_gather"].count("backward") == (4 if reshard else 0)


def test_fsdp_gathers_frozen_parameters_but_reduces_only_trainable_ones(fake):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor([2.0]))
            self.frozen = torch.nn.Linear(3, 3).requires_grad_(False)
            self.head = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.head(self.frozen(x)) * self.scale

    model = Net()
    predicted = fsdp_collectives(model, fake)
    mesh = init_device_mesh("cpu", (fake,), mesh_dim_names=("fsdp",))
    apply_fully_shard(model, mesh)
    with CollectiveCounter(mesh) as counter:
        model(torch.ones(2, 3)).sum().backward()
    # Gathered: 4 + 4x3 + 4 (frozen, padded) + 4 + 4x3 + 4 floats; reduced: the trainable 4 + 4 + 4x3.
    assert [_fields(c)[:5] for c in counter.collectives] == [_fields(c)[:5] for c in predicted] == [
        ("all_gather", 144, 4, "fsdp", "forward"), ("reduce_scatter", 80, 4, "fsdp", "backward")]
    model.scale = torch.nn.Parameter(torch.tensor(2.0))
    with pytest.raises(ValueError, match="scalar parameters: scale"):
        fsdp_collectives(model, 4)


@pytest.mark.parametrize("name,bucket_cap_mb", [("mlp", 0.0005), ("llama", 0.05), ("llama", None),
                                                 ("gpt2", 0.1)])
def test_ddp_predicted_equals_counted_step_by_step(fake, name, bucket_cap_mb):
    model = build(name)
    order = gradient_ready_order(copy.deepcopy(model), (batch(name),), loss_of)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(None, blocking_allreduce_hook)
    counted = count_steps(model, ddp, name, {dist.group.WORLD: "dp"}, steps=3)
    for step, measured in enumerate(counted, 1):
        predicted = data_parallel_collectives(model, fake, step=step, bucket_cap_mb=bucket_cap_mb,
                                              ready_order=order)
        assert [_fields(c)[:5] for c in measured] == [_fields(c)[:5] for c in predicted], f"step {step}"
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert total_bytes(measured, phase="backward") == gradient_bytes     # the buckets hold every grad
    buckets = [c for c in counted[-1] if c.kind == "all_reduce"]
    assert len(buckets) == (1 if bucket_cap_mb is None else {"mlp": 7, "llama": 5, "gpt2": 4}[name])


def test_ddp_without_the_ready_order_cuts_elsewhere_but_moves_the_same_bytes():
    model = build("llama")
    guessed = data_parallel_collectives(model, 4, bucket_cap_mb=0.05)
    exact = data_parallel_collectives(model, 4, bucket_cap_mb=0.05, ready_order=gradient_ready_order(
        model, (batch("llama"),), loss_of))
    assert total_bytes(guessed) == total_bytes(exact) and comparable(guessed) != comparable(exact)
    with pytest.raises(ValueError, match="every trainable parameter"):
        data_parallel_collectives(model, 4, ready_order=["lm_head.weight"])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_replicate_predicted_equals_counted(fake, name):
    from torch.distributed._composable.replicate_with_fsdp import replicate

    model = build(name)
    predicted = data_parallel_collectives(model, fake, style="replicate")
    mesh = init_device_mesh("cpu", (fake,), mesh_dim_names=("dp",))
    for block in fsdp_blocks(model):
        replicate(model.get_submodule(block), mesh=mesh)
    replicate(model, mesh=mesh)
    for counted in count_steps(model, model, name, mesh, steps=2):
        assert [_fields(c)[:5] for c in counted] == [_fields(c)[:5] for c in predicted]
    assert {c.kind for c in predicted} == {"all_reduce"} and len(predicted) == 3


# ------------------------------------------------------------------------------- real gloo worker processes


def run_rank(payload, rank, world, device):
    """One gloo worker: FSDP2 (2 steps) and DDP with its own reducer (3 steps, no comm hook) counted."""
    name = payload["model"]
    model = build(name)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fully_shard(model, mesh)
    fsdp = count_steps(model, model, name, mesh, steps=2)
    model = build(name)
    ddp = DistributedDataParallel(model, bucket_cap_mb=payload["bucket_cap_mb"])
    return {"fsdp": fsdp, "ddp": count_steps(model, ddp, name, {dist.group.WORLD: "dp"}, steps=3)}


def main(argv: list[str]) -> int:
    return worker_main(argv, run_rank)


def test_gloo_workers_count_what_the_fake_backend_counts():
    name, cap = "mlp", 0.0005
    results = run_workers("tests.parallel.test_collectives", {"model": name, "bucket_cap_mb": cap,
                                                              "backend": "gloo"}, 2, threads=1, timeout=120)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = build(name)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
        apply_fully_shard(model, mesh)
        fsdp = count_steps(model, model, name, mesh, steps=2)
        model = build(name)
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap)
        ddp.register_comm_hook(None, blocking_allreduce_hook)
        ddp_steps = count_steps(model, ddp, name, {dist.group.WORLD: "dp"}, steps=3)
    finally:
        dist.destroy_process_group()
    for result in results:
        assert [list(map(_fields, s)) for s in result["fsdp"]] == [list(map(_fields, s)) for s in fsdp]
        # DDP's own reducer (no hook) issues its bucket all-reduces where the counter sees them.
        assert [list(map(_fields, s)) for s in result["ddp"]] == [list(map(_fields, s)) for s in ddp_steps]
    assert len([c for c in ddp_steps[-1] if c.kind == "all_reduce"]) == 7


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
