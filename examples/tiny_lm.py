"""The model, the data and the training state of ``train_tiny_lm.py``: a small decoder-only transformer
(tied embedding and head, dropout), a synthetic but learnable stream of tokens, and a `Trainer` whose whole
state (model, AdamW, LR scheduler, data generator, global RNG) goes into each checkpoint.

The data: each sequence is drawn from one of a few fixed sparse bigram "languages", so the model must learn
the tables and infer from the context which one it is reading. Every batch is drawn from the trainer's own
generator, so that the data order does not depend on how much randomness dropout consumed.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

# -- model ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    seq_len: int = 64
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.1


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """Decoder-only transformer; the output head shares the token embedding's weight (tied)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # the engine stores a tied tensor once and re-ties it on load
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        # Small weights: with the default N(0, 1) embedding, the tied head starts with huge logits.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -- data -------------------------------------------------------------------------------------------------


def make_languages(vocab: int, n_languages: int = 4, successors: int = 4, seed: int = 1234) -> torch.Tensor:
    """Transition tables [n_languages, vocab, vocab]: each token has a few likely successors per language."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_languages, vocab, vocab, generator=g) * 2
    keep = logits.topk(successors, dim=-1).indices
    sparse = torch.full_like(logits, -math.inf).scatter(-1, keep, logits.gather(-1, keep))
    return sparse.softmax(-1)


def entropy_floor(tables: torch.Tensor) -> float:
    """Mean entropy of a next token, in nats: roughly the lowest loss reachable once the language is known."""
    return -(tables * tables.clamp_min(1e-30).log()).sum(-1).mean().item()


def sample_batch(tables: torch.Tensor, gen: torch.Generator, batch: int, seq_len: int) -> torch.Tensor:
    """A batch of seq_len + 1 tokens per row (inputs and shifted targets), drawn only from `gen`."""
    n_lang, vocab, _ = tables.shape
    lang = torch.randint(n_lang, (batch,), generator=gen)
    tokens = [torch.randint(vocab, (batch,), generator=gen)]
    for _ in range(seq_len):
        probs = tables[lang, tokens[-1]]
        tokens.append(torch.multinomial(probs, 1, generator=gen).squeeze(1))
    return torch.stack(tokens, dim=1)


# -- training state ---------------------------------------------------------------------------------------


@dataclass
class Trainer:
    """Everything a training step touches; all of its state goes into each checkpoint."""

    model: TinyLM
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data_gen: torch.Generator
    tables: torch.Tensor
    batch: int
    seq_len: int


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then a cosine down to 0.1 at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def build_trainer(args: argparse.Namespace, cfg: ModelConfig) -> Trainer:
    torch.manual_seed(args.seed)  # model init and dropout draw from the global RNG
    model = TinyLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps // 10, args.steps))
    # A generator of its own, so that the data order does not depend on how much dropout consumed.
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    return Trainer(model, optimizer, scheduler, data_gen, make_languages(cfg.vocab), args.batch, cfg.seq_len)


def capture_state(tr: Trainer, step: int) -> dict[str, Any]:
    """Everything an exact resume needs. Tensors are referenced, not copied: the engine copies them."""
    return {
        "model": tr.model.state_dict(),
        "optimizer": tr.optimizer.state_dict(),
        "scheduler": tr.scheduler.state_dict(),
        "step": step,
        "rng": {"torch": torch.get_rng_state(), "data": tr.data_gen.get_state()},
    }


def restore_state(tr: Trainer, state: dict[str, Any]) -> int:
    """Loads a captured state into a freshly built trainer; returns the step it was captured after."""
    tr.model.load_state_dict(state["model"])
    tr.optimizer.load_state_dict(state["optimizer"])
    tr.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    tr.data_gen.set_state(state["rng"]["data"])
    return state["step"]


def train_step(tr: Trainer) -> torch.Tensor:
    """Forward and backward of one batch; the optimizer step is left to the caller (it must wait first)."""
    tokens = sample_batch(tr.tables, tr.data_gen, tr.batch, tr.seq_len)
    logits = tr.model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    tr.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach()
