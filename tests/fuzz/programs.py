"""Random programs for the differential fuzz suite: convolutional and linear models, attention blocks, the
state changes a user makes after optimize, and the conditions a call is made under.

Every random choice is drawn from hypothesis' ``data`` so a failure shrinks to a small program and prints
the draws that made it.
"""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F


class NewGELU(nn.Module):
    """transformers' ``gelu_new``: GELU's tanh approximation written out (the rewrite makes it the op)."""

    def forward(self, y):
        return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))


ACTIVATIONS = {
    "relu": nn.ReLU, "relu6": nn.ReLU6, "hardtanh": lambda: nn.Hardtanh(-0.5, 1.5), "gelu": nn.GELU,
    "silu": nn.SiLU, "hardswish": nn.Hardswish, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "gelu_new": NewGELU,
    "leaky_relu": lambda: nn.LeakyReLU(0.1), "relu_inplace": lambda: nn.ReLU(inplace=True),
}


# ---------------------------------------------------------------------------------------------- conv


class Block(nn.Module):
    """conv -> [BatchNorm] -> [activation] [+ residual], by the drawn flags; ``shape_read``: the conv output's
    rank and sizes are read around the BatchNorm (timm's ``BatchNormAct2d``), which must not stop a fold."""

    def __init__(self, channels: int, out: int, kernel: int, stride: int, groups: int, bias: bool, norm: bool,
                 activation: str | None, residual: bool, functional: bool, shape_read: bool = False,
                 post: str | None = None):
        super().__init__()
        self.shape_read, self.post = shape_read, post
        # after the convolution (issue 50): a layer scale, a constant shift, a gate subtracted (broadcast)
        self.gamma = nn.Parameter(torch.rand(out) + 0.5) if post == "scale" else None
        self.conv = nn.Conv2d(channels, out, kernel, stride, padding=kernel // 2, groups=groups, bias=bias)
        self.bn = nn.BatchNorm2d(out) if norm else nn.Identity()
        self.act = ACTIVATIONS[activation]() if activation and not functional else nn.Identity()
        self.functional = activation if functional else None
        self.residual = residual and stride == 1 and channels == out

    def forward(self, x):
        z = self.conv(x)
        if self.post == "scale":
            z = z * self.gamma[:, None, None]
        elif self.post == "shift":
            z = torch.add(z, 0.5)
        elif self.post == "gate":
            z = z - torch.sigmoid(z.mean((2, 3), keepdim=True))
        if self.shape_read:
            torch._assert(z.ndim == 4, "expected a 4-d input")
        y = self.act(self.bn(z))
        if self.shape_read:
            y = y.reshape(z.size(0), -1, z.shape[2], z.shape[3])
        if self.functional == "relu":
            y = F.relu(y)
        elif self.functional == "gelu":
            y = F.gelu(y)
        elif self.functional == "gelu_new":
            y = NewGELU()(y)
        elif self.functional is not None:
            y = torch.clamp(y, -1.0, 1.0)
        return y + x if self.residual else y


class ConvNet(nn.Module):
    def __init__(self, blocks: list[Block], channels: int, head: int | None, dropout: float, mutate_input: bool):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(channels, head) if head else None
        self.temperature = 1.0
        self.mutate_input = mutate_input

    def forward(self, x):
        if self.mutate_input:
            x.mul_(0.5)  # an input changed in place: the caller sees it once per call, as in eager
        y = self.blocks(x)
        if self.head is not None:
            y = self.head(self.drop(y.mean((2, 3))))
        return y / self.temperature


@st.composite
def conv_nets(draw) -> tuple[nn.Module, tuple[int, ...]]:
    """A random :class:`ConvNet` with BatchNorm statistics set by train-mode passes, and its input shape."""
    channels = draw(st.integers(1, 6))
    batch, size = draw(st.integers(1, 3)), draw(st.integers(4, 9))
    blocks, width = [], channels
    for _ in range(draw(st.integers(1, 3))):
        out = draw(st.sampled_from([width, draw(st.integers(1, 8))]))
        depthwise = out == width and draw(st.booleans())
        blocks.append(Block(width, out, draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 1, 2])),
                            width if depthwise else 1, draw(st.booleans()), draw(st.booleans()),
                            draw(st.sampled_from([None, *ACTIVATIONS])), draw(st.booleans()),
                            draw(st.booleans()), draw(st.booleans()),
                            draw(st.sampled_from([None, None, "scale", "shift", "gate"]))))
        width = out
    head = draw(st.sampled_from([None, 3]))
    model = ConvNet(blocks, width, head, draw(st.sampled_from([0.0, 0.3])), draw(st.booleans()))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    for p in model.parameters():
        nn.init.normal_(p, 0.0, 0.5)
    with torch.no_grad():
        for _ in range(2):
            model.train()(torch.randn(4, channels, size, size))
    if draw(st.booleans()):  # weights in channels-last memory, as model.to(memory_format=...) leaves them
        model = model.to(memory_format=torch.channels_last)
    return model.eval(), (batch, channels, size, size)


LAYOUTS = ("contiguous", "channels_last", "transposed", "sliced", "expanded")


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x``'s values in the memory ``layout`` a user's input may have (issue 50: any layout, the same answer).

    ``transposed``: H and W swapped in memory; ``sliced``: every other column of a wider tensor; ``expanded``:
    the first sample broadcast over the batch (stride 0), values then as the expansion gives them.
    """
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        return x.transpose(2, 3).contiguous().transpose(2, 3)
    if layout == "sliced":
        wide = torch.zeros(*x.shape[:3], 2 * x.shape[3])
        wide[..., ::2] = x
        return wide[..., ::2]
    if layout == "expanded":
        return x[:1].expand_as(x)
    return x


# ---------------------------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Hand-written attention in one of the drawn forms."""

    def __init__(self, dim: int, heads: int, scale_form: str, mask_form: str, softmax_form: str,
                 fill: float, causal: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.wide = False  # values twice as wide as queries and keys (LeViT): SDPA's math kernel, left as written
        self.scale_form, self.mask_form, self.softmax_form = scale_form, mask_form, softmax_form
        self.fill, self.causal = fill, causal
        self.softmax = nn.Softmax(-1)
        self.drop = nn.Dropout(0.1)
        self.head_scale = nn.Parameter(torch.linspace(0.5, 1.5, heads))  # scale_form "per_head"
        self.views = False  # the masks added to a [B, H, L, S] view of 3-d bmm scores (MBart)
        self.causal_form = "tril"  # or "arange": transformers' kv_idx <= q_idx, proven for every size

    def widen(self) -> Attention:
        dim = self.heads * self.head_dim
        self.wide, self.v, self.o = True, nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        return self

    def split(self, t):
        b, s, width = t.shape
        return t.view(b, s, self.heads, width // self.heads).transpose(1, 2)

    def forward(self, x, mask):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        if self.scale_form == "div":
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        elif self.scale_form == "mul":
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim ** -0.5
        elif self.scale_form == "per_head":
            scores = q @ k.mT * self.head_scale.view(1, -1, 1, 1)
        else:
            scores = q @ k.mT
        b, h, length = q.shape[:3]  # (sizes read from the scores themselves keep them alive: a near miss)
        if self.views:
            scores = scores.reshape(b * h, length, length).view(b, h, length, length)
        if self.mask_form == "additive":
            scores = scores + mask[:, None, None, :]
        elif self.mask_form == "fill":
            scores = scores.masked_fill(~mask[:, None, None, :], self.fill)
        elif self.mask_form == "additive_from_keep":  # transformers: where(keep, 0, fill), finite or not
            scores = scores + torch.where(mask, 0.0, self.fill)[:, None, None, :]
        elif self.mask_form == "bool_added":  # promoted to 0/1
            scores = scores + mask[:, None, None, :]
        elif self.mask_form == "fill_expand_as":  # DistilBERT
            scores = scores.masked_fill((mask == 0).view(b, 1, 1, length).expand_as(scores), self.fill)
        if self.views:
            scores = scores.view(b * h, length, length).view(b, h, length, length)
        if self.causal:
            length = q.size(-2)
            if self.causal_form == "arange":
                index = torch.arange(length, device=x.device)
                keep = index[None, :] <= index[:, None]
            else:
                keep = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if self.softmax_form == "module":
            probs = self.softmax(scores)
        elif self.softmax_form == "method":
            probs = scores.softmax(dim=-1)
        else:
            probs = F.softmax(scores, dim=-1)
        out = self.drop(probs) @ v
        return self.o(out.transpose(1, 2).reshape(*x.shape[:2], -1))


@st.composite
def attentions(draw) -> tuple[nn.Module, dict]:
    """A random :class:`Attention` and how its inputs are made (see :func:`attention_inputs`)."""
    heads = draw(st.sampled_from([1, 2, 4]))
    dim = heads * draw(st.sampled_from([4, 8]))
    mask_form = draw(st.sampled_from(["none", "additive", "additive_from_keep", "fill", "bool_added",
                                      "fill_expand_as"]))
    fill = draw(st.sampled_from([float("-inf"), torch.finfo(torch.float32).min, -1e4, -1e9]))
    model = Attention(dim, heads, draw(st.sampled_from(["div", "mul", "none", "per_head"])), mask_form,
                      draw(st.sampled_from(["module", "method", "function"])), fill, draw(st.booleans()))
    model.views = draw(st.booleans())
    if draw(st.booleans()):
        model.widen()
    model.causal_form = draw(st.sampled_from(["tril", "arange"]))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    shape = {"batch": draw(st.integers(1, 3)), "length": draw(st.integers(1, 7)), "dim": dim,
             "mask_form": mask_form, "fill": fill}
    return model.eval(), shape


def attention_inputs(shape: dict, lengths: list[int], seed: int, nan: bool = False) -> tuple:
    """``(x, mask)`` for an attention: padding masks from ``lengths`` (0 hides every key of that row)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape["batch"], shape["length"], shape["dim"], generator=gen)
    if nan:
        x[0, 0, 0] = float("nan")
    keep = torch.arange(shape["length"])[None, :] < torch.tensor(lengths)[:, None]
    if shape["mask_form"] == "additive":
        return x, torch.zeros(keep.shape).masked_fill(~keep, shape["fill"])
    return x, keep


# ---------------------------------------------------------------------------------------------- token readers


class MLPBlock(nn.Module):
    """A pre-norm MLP block with a residual (LayerNorm or RMSNorm, the drawn activation)."""

    def __init__(self, dim: int, norm: str, activation: str):
        super().__init__()
        self.norm = nn.LayerNorm(dim) if norm == "layer" else nn.RMSNorm(dim)
        self.up, self.down, self.act = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), ACTIVATIONS[activation]()

    def forward(self, x, mask):
        return x + self.down(self.act(self.up(self.norm(x))))


class NormedMLPBlock(nn.Module):
    """LeViT's MLP: linear layers each followed by a BatchNorm1d over the flattened tokens (folded into them)."""

    def __init__(self, dim: int, activation: str):
        super().__init__()
        self.up, self.up_bn = nn.Linear(dim, 2 * dim, bias=False), nn.BatchNorm1d(2 * dim)
        self.down, self.down_bn = nn.Linear(2 * dim, dim, bias=False), nn.BatchNorm1d(dim)
        self.act = ACTIVATIONS[activation]()
        for bn in (self.up_bn, self.down_bn):  # statistics as a few training passes leave them
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x, mask):
        y = self.up(x)
        y = self.act(self.up_bn(y.flatten(0, 1)).reshape_as(y))
        z = self.down(y)
        return x + self.down_bn(z.flatten(0, 1)).reshape_as(z)


class SDPABlock(nn.Module):
    """Attention through ``F.scaled_dot_product_attention``: a padding mask on the keys, or causal."""

    def __init__(self, dim: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        keep = None if self.causal else (mask if mask.dtype == torch.bool else mask == 0)[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=self.causal)
        return x + self.o(out.transpose(1, 2).reshape(b, s, d))


class HandWritten(nn.Module):
    """The drawn hand-written :class:`Attention` as a residual block."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention = attention

    def forward(self, x, mask):
        return x + self.attention(x, mask)


class TokenReader(nn.Module):
    """Blocks over tokens, a final norm, then one token read and a head: a classifier reading its class token
    (or a decoder its last position), whose unread rows cleanup's dead rows leaves out."""

    def __init__(self, blocks: list[nn.Module], dim: int, read: str, index: int):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 3)
        self.read, self.index = read, index

    def forward(self, x, mask):
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        if self.read == "getitem":
            x = x[:, self.index]
        elif self.read == "select":
            x = x.select(1, self.index)
        else:  # "tokens first"
            x = x.transpose(0, 1)[self.index]
        return self.head(x)


@st.composite
def token_readers(draw) -> tuple[nn.Module, dict]:
    """A random :class:`TokenReader` and how its inputs are made (see :func:`attention_inputs`)."""
    heads = draw(st.sampled_from([1, 2]))
    dim = heads * draw(st.sampled_from([4, 8]))
    length = draw(st.integers(2, 7))
    mask_form = draw(st.sampled_from(["none", "additive", "fill"]))
    torch.manual_seed(draw(st.integers(0, 2**16)))  # the weights: a failing program replays as drawn
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["mlp", "bn-mlp", "sdpa", "hand-written"]))
        if kind == "bn-mlp":
            blocks.append(NormedMLPBlock(dim, draw(st.sampled_from(["relu", "gelu", "hardswish"]))))
        elif kind == "mlp":
            blocks.append(MLPBlock(dim, draw(st.sampled_from(["layer", "rms"])),
                                   draw(st.sampled_from(["relu", "gelu", "silu", "tanh", "gelu_new"]))))
        elif kind == "sdpa":
            blocks.append(SDPABlock(dim, heads, draw(st.booleans())))
        else:
            blocks.append(HandWritten(Attention(dim, heads, draw(st.sampled_from(["div", "mul"])), mask_form,
                                                "function", -1e9, draw(st.booleans()))))
    model = TokenReader(blocks, dim, draw(st.sampled_from(["getitem", "select", "tokens first"])),
                        draw(st.sampled_from([0, -1, length - 2])))
    shape = {"batch": draw(st.integers(1, 3)), "length": length, "dim": dim, "mask_form": mask_form, "fill": -1e9}
    return model.eval(), shape


# ---------------------------------------------------------------------------------------------- state


def _first(model: nn.Module, kind: type) -> nn.Module | None:
    return next((m for m in model.modules() if isinstance(m, kind)), None)


def _scale_data(model, rng):
    p = list(model.parameters())[rng % len(list(model.parameters()))]
    p.data.mul_(1.5)


def _assign_data(model, rng):
    p = list(model.parameters())[rng % len(list(model.parameters()))]
    p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(rng)) * 0.5


def _reassign_parameter(model, rng):
    conv = _first(model, nn.Conv2d) or _first(model, nn.Linear)
    conv.weight = nn.Parameter(conv.weight.detach() * -1.0)


def _load_assign(model, rng):
    state = {k: v.clone() * (0.9 if v.is_floating_point() else 1) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def _vector(model, rng):
    vector = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # (channels-last weights: no view)
    torch.nn.utils.vector_to_parameters(vector * 0.8 + 0.01, model.parameters())


def _ema(model, rng):
    gen = torch.Generator().manual_seed(rng)
    for p in model.parameters():
        p.data.mul_(0.9).add_(torch.randn(p.shape, generator=gen), alpha=0.1)


def _bn_statistics(model, rng):
    bn = _first(model, nn.BatchNorm2d)
    if bn is not None:
        bn.running_var = bn.running_var * 2.0 + 0.1
        bn.eps = 0.25


def _swap_activation(model, rng):
    for block in model.modules():
        if isinstance(block, Block) and isinstance(block.act, nn.Identity):
            block.act = nn.Tanh()
            return


def _temperature(model, rng):
    if hasattr(model, "temperature"):
        model.temperature = 2.5


def _dropout_train(model, rng):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.train()


def _bn_train(model, rng):
    bn = _first(model, nn.BatchNorm2d)
    if bn is not None:
        bn.train()


def _buffer_data(model, rng):
    bn = _first(model, nn.BatchNorm2d)
    if bn is not None:  # a buffer changed through .data (no version bump): issue 50's unseen change
        bn.running_mean.data.add_(1.0)


def _scale_buffer_data(model, rng):
    for block in model.modules():
        if isinstance(block, Block) and block.gamma is not None:
            block.gamma.data.mul_(-2.0)
            return


def _dtype_round_trip(model, rng):
    model.to(torch.bfloat16).float()  # both round; the plan must follow the rounded tensors


def _model_train(model, rng):
    model.train()


# name -> change(model, rng): each applied to the model (after optimize) and its twin alike
STATE_CHANGES = {
    "none": lambda model, rng: None, "scale .data": _scale_data, "assign .data": _assign_data,
    "reassign parameter": _reassign_parameter, "load_state_dict(assign=True)": _load_assign,
    "vector_to_parameters": _vector, "EMA through .data": _ema, "BatchNorm statistics and eps": _bn_statistics,
    "swap a submodule": _swap_activation, "a float attribute": _temperature, "dropout.train()": _dropout_train,
    "bn.train()": _bn_train, "buffer .data edit": _buffer_data, "layer scale .data": _scale_buffer_data,
    "bf16 round trip": _dtype_round_trip, "model.train()": _model_train,
}


def twins(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The model and an independent copy: the optimized module wraps the first, eager runs the second."""
    return model, copy.deepcopy(model)


CONDITIONS = ["no_grad", "grad", "inference_mode", "autocast", "threads"]


# ---------------------------------------------------------------------------------------------- graph breaks


class Breaking(nn.Module):
    """A drawn network followed by what one graph cannot hold (issue 49): a branch on the features' value
    (``branch``), a boolean-indexed sum (``mask``: an output size that depends on values), or a Python float read
    off them (``item``, which symbolic tracing records as a node: that one is captured whole)."""

    def __init__(self, net: nn.Module, kind: str, threshold: float):
        super().__init__()
        self.net, self.kind, self.threshold = net, kind, threshold

    def forward(self, x):
        h = self.net(x)
        if self.kind == "branch":
            if h.mean() > self.threshold:
                h = h * 2.0
            else:
                h = h - 1.0
        elif self.kind == "mask":
            h = h + h[h > self.threshold].sum() * 0.01
        else:
            h = h / (1.0 + abs(h.detach().abs().amax().item()))
        return torch.tanh(h)


@st.composite
def breaking_nets(draw) -> tuple[nn.Module, tuple[int, ...]]:
    """A random conv net (:func:`conv_nets`) with a graph break after it, and its input shape."""
    net, shape = draw(conv_nets())
    kind = draw(st.sampled_from(["branch", "mask", "item"]))
    return Breaking(net, kind, draw(st.sampled_from([-0.5, 0.0, 0.5]))).eval(), shape


# ---------------------------------------------------------------------------------------------- branchy


class BranchyNet(nn.Module):
    """A random DAG of convolutions, pooling and gates over one width: each node reads one or two earlier
    values; the values no node read are concatenated and mixed by a 1x1 convolution. ``mutate``: one node
    adds into a value other nodes read, in place (its order against them decides the result)."""

    def __init__(self, width: int, nodes: list[tuple[str, tuple[int, ...]]], mutate: int | None):
        super().__init__()
        self.nodes, self.mutate = nodes, mutate
        self.convs = nn.ModuleDict({str(i): nn.Sequential(nn.Conv2d(width, width, 3 if op == "conv3" else 1,
                                                                    padding=1 if op == "conv3" else 0),
                                                          nn.BatchNorm2d(width), nn.ReLU())
                                    for i, (op, _) in enumerate(nodes) if op in ("conv3", "conv1")})
        read = {j for _, sources in nodes for j in sources}
        self.sinks = [i + 1 for i in range(len(nodes)) if i + 1 not in read] or [len(nodes)]
        self.head = nn.Conv2d(width * len(self.sinks), width, 1)

    def forward(self, x):
        values = [x]
        for i, (op, sources) in enumerate(self.nodes):
            a = values[sources[0]]
            if op in ("conv3", "conv1"):
                y = self.convs[str(i)](a)
            elif op == "pool":
                y = F.avg_pool2d(a, 3, 1, 1)
            elif op == "gate":
                y = a * torch.sigmoid(values[sources[1]])
            else:  # "add"
                y = a + values[sources[1]]
            if i == self.mutate:
                values[sources[0]].add_(0.5)
            values.append(y)
        return self.head(torch.cat([values[i] for i in self.sinks], 1))


@st.composite
def branchy_nets(draw) -> tuple[nn.Module, tuple[int, ...]]:
    """A random :class:`BranchyNet` (BatchNorm statistics set by train-mode passes) and its input shape."""
    width, size, batch = draw(st.integers(1, 6)), draw(st.integers(3, 8)), draw(st.integers(1, 2))
    nodes = []
    for i in range(draw(st.integers(2, 9))):
        op = draw(st.sampled_from(["conv3", "conv1", "conv3", "pool", "gate", "add"]))
        first = draw(st.integers(0, i))
        sources = (first, draw(st.integers(0, i))) if op in ("gate", "add") else (first,)
        nodes.append((op, sources))
    mutate = draw(st.sampled_from([None, None, None, draw(st.integers(1, len(nodes) - 1))]))
    if mutate is not None and nodes[mutate][1][0] == 0:
        mutate = None  # (not the caller's input: eager would write into it)
    model = BranchyNet(width, nodes, mutate)
    torch.manual_seed(draw(st.integers(0, 2**16)))
    with torch.no_grad():
        for _ in range(2):
            model.train()(torch.randn(4, width, size, size))
    return model.eval(), (batch, width, size, size)
