"""A GPT as a layer list: embedding, transformer blocks, head (nanoGPT's shape; dropout off by default)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeflow.data.text import StdlibText, SyntheticTokens
from pipeflow.models.checks import check_flags, check_sizes
from pipeflow.spec import ModelSpec


class Embedding(nn.Module):
    def __init__(self, vocab: int, d_model: int, seq_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        return self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))


def check_heads(d_model: int, heads: int) -> None:
    """Attention splits d_model over its heads (Block, Attention, AttentionCore)."""
    if d_model % heads:
        raise ValueError(f"d_model {d_model} must be divisible by heads {heads}")


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        check_heads(d_model, heads)
        self.heads = heads
        self.dropout = dropout  # nanoGPT's places: attention weights and both residual branches
        self.drop = nn.Dropout(dropout)
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return feed_forward(self, attend(self, x))


class Attention(nn.Module):
    """The first half of a Block as a layer of its own (granularity "sublayer"): x + attention(ln1(x)). Same
    parameter names and initialisation order as Block, so the two forms build the same weights."""

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        check_heads(d_model, heads)
        self.heads, self.dropout = heads, dropout
        self.drop = nn.Dropout(dropout)
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attend(self, x)


class MLP(nn.Module):
    """The second half of a Block as a layer of its own: x + mlp(ln2(x))."""

    def __init__(self, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return feed_forward(self, x)


def attend(m: Block | Attention, x: torch.Tensor) -> torch.Tensor:
    """x + causal self-attention(ln1(x)) with `m`'s weights: the first half of a Block, or an Attention layer."""
    return x + m.drop(m.proj(attention_core(m, x)))


def attention_core(m: Block | Attention | AttentionCore, x: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of ln1(x) with `m`'s weights, its heads joined again, before the projection."""
    b, t, d = x.shape
    q, k, v = m.qkv(m.ln1(x)).split(d, dim=2)
    q, k, v = (z.view(b, t, m.heads, d // m.heads).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=m.dropout if m.training else 0.0)
    return y.transpose(1, 2).reshape(b, t, d)


def feed_forward(m: Block | MLP, x: torch.Tensor) -> torch.Tensor:
    """x + mlp(ln2(x)) with `m`'s weights: the second half of a Block, or an MLP layer."""
    return x + m.drop(m.out(F.gelu(m.fc(m.ln2(x)))))


class AttentionCore(nn.Module):
    """Granularity "fine", the first of a block's four layers: x -> (x, attention of ln1(x) before the
    projection). The fine layers keep Block's parameter names and initialisation order (ln1, qkv | proj | ln2,
    fc | out), so every granularity builds the same weights and computes the same outputs."""

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        check_heads(d_model, heads)
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, attention_core(self, x)


class Projection(nn.Module):
    """(x, y) -> x + proj(y): attention's projection and residual."""

    def __init__(self, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = xy
        return x + self.drop(self.proj(y))


class Expand(nn.Module):
    """x -> (x, gelu(fc(ln2(x)))): the MLP's first linear layer, its output four times the model's width."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, F.gelu(self.fc(self.ln2(x)))


class Contract(nn.Module):
    """(x, h) -> x + out(h): the MLP's second linear layer and residual."""

    def __init__(self, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, xh: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, h = xh
        return x + self.drop(self.out(h))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.lm = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def flops_per_sequence(matmul_params: int, layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs of one sequence (PaLM, Chowdhery et al. 2022, appendix B): 6 N per token for the weight
    matmuls forward and backward, N the parameters that multiply (blocks and head; the embeddings are lookups),
    plus 12 L d T per token for attention's score and value matmuls (counted in full, causal masking or not):
    6 N T + 12 L d T^2 per sequence of T tokens."""
    return 6.0 * matmul_params * seq_len + 12.0 * layers * d_model * seq_len ** 2


GRANULARITIES = ("block", "sublayer", "fine")


def build(layers: int = 4, d_model: int = 128, heads: int = 4, seq_len: int = 64, vocab: int = 256,
          dataset: str = "stdlib", dataset_size: int = 4096, dropout: float = 0.0, tie: bool = False,
          granularity: str = "block") -> ModelSpec:
    """`layers` transformer blocks, so len(spec.layers) == layers + 2. The stdlib dataset is byte-level
    (tokens < 256 <= vocab); `dataset="synthetic"` draws random tokens below `vocab`. `dropout` (nanoGPT's
    places) draws per (seed, microbatch, layer) under pipeflow-train (docs/reproducibility.md). `tie`: the
    head's weight is the token embedding's (GPT-2, Press & Wolf 2017), one Parameter held by the first and last
    layer. `granularity="sublayer"` gives each block as two layers, Attention then MLP (2 * layers + 2 layers),
    `"fine"` as four, AttentionCore, Projection, Expand, Contract (4 * layers + 2; the boundaries inside a
    sublayer carry two tensors, the residual and the branch): the same weights and outputs (dropout draws per
    layer, so with dropout the masks differ), so that a planner can cut inside a block. The eval_dataset (held out,
    for --eval-every): the stdlib corpus's last 10%, or dataset_size // 8 random sequences of another seed."""
    check_sizes("gpt", layers=layers, d_model=d_model, heads=heads, seq_len=seq_len, vocab=vocab,
                dataset_size=dataset_size)
    check_flags("gpt", tie=tie)
    if granularity not in GRANULARITIES:
        raise ValueError(f"gpt granularity must be one of {', '.join(map(repr, GRANULARITIES))}, "
                         f"found {granularity!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"gpt needs 0 <= dropout < 1, found {dropout}")
    if dataset == "stdlib":
        if vocab < 256:
            raise ValueError(f"the stdlib byte dataset needs vocab >= 256, found {vocab}")
        data: torch.utils.data.Dataset = StdlibText(seq_len)
        held_out: torch.utils.data.Dataset = StdlibText(seq_len, split="val")
    elif dataset == "synthetic":
        data = SyntheticTokens(seq_len, vocab, size=dataset_size)
        held_out = SyntheticTokens(seq_len, vocab, size=max(1, dataset_size // 8), seed=4321)  # training's is 1234
    else:
        raise ValueError(f"unknown gpt dataset {dataset!r}: expected 'stdlib' or 'synthetic'")
    embed = Embedding(vocab, d_model, seq_len, dropout)
    mods: list[nn.Module] = [embed]
    for _ in range(layers):
        if granularity == "block":
            mods.append(Block(d_model, heads, dropout))
        elif granularity == "sublayer":
            mods += [Attention(d_model, heads, dropout), MLP(d_model, dropout)]
        else:
            mods += [AttentionCore(d_model, heads, dropout), Projection(d_model, dropout), Expand(d_model),
                     Contract(d_model, dropout)]
    head = Head(d_model, vocab)
    if tie:
        head.lm.weight = embed.tok.weight
    mods.append(head)
    matmul = sum(p.numel() for m in mods[1:] for p in m.parameters())  # a tied weight counts once, in the head
    return ModelSpec(layers=mods, loss_fn=lm_loss, dataset=data, tokens_per_sample=seq_len,
                     flops_per_sample=flops_per_sequence(matmul, layers, d_model, seq_len), eval_dataset=held_out)
