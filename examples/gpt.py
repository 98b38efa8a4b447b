"""A small GPT in plain PyTorch, the model of the example training job.

Token + learned position embeddings, ``n_layers`` pre-LayerNorm blocks (causal self-attention through
``F.scaled_dot_product_attention``, then a 4x GELU MLP), a final LayerNorm and an output head tied to the
token embedding.  No dropout: the runs compare communication schemes, and dropout would only add noise.

Initialisation is deterministic from ``seed`` and happens inside each leaf module's constructor, so that it
also works under ``deepspeed.zero.Init`` (which partitions a module's parameters as soon as that module's
``__init__`` returns: an ``apply(init_fn)`` over the finished model would only see empty shards).  Every
rank draws the same values from a CPU generator, whatever the device, so all ranks build identical weights.

Tied head under ZeRO-3: the head reads ``wte.weight`` from :meth:`GPT.forward`, outside the embedding
module's own forward, so DeepSpeed must be told to gather it for the whole model forward:
``deepspeed.zero.register_external_parameter(model, model.wte.weight)`` (the training script does this;
this file does not import DeepSpeed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

INIT_STD = 0.02


@dataclass
class GPTConfig:
    """Shape of the model.

    Attributes:
        vocab: vocabulary size (256 = raw bytes; 50304 = GPT-2's 50257 rounded up to a multiple of 64).
        seq_len: the longest sequence the position embedding covers.
        d_model: hidden size; must be divisible by ``n_heads``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        mlp_ratio: MLP hidden size = ``mlp_ratio * d_model``.
    """

    vocab: int = 256
    seq_len: int = 1024
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    mlp_ratio: int = 4

    def __post_init__(self):
        for name in ("vocab", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    def n_params(self) -> int:
        """Parameter count of :class:`GPT` with this shape (the tied head counted once)."""
        d, f = self.d_model, self.mlp_ratio * self.d_model
        block = (2 * 2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return self.vocab * d + self.seq_len * d + self.n_layers * block + 2 * d


def _normal_(param: torch.Tensor, std: float, gen: torch.Generator) -> None:
    # Draw on the CPU generator, then copy: identical values on every rank and every device type.  The
    # explicit device matters: deepspeed.zero.Init patches torch.randn to default to the accelerator, where a
    # CPU generator cannot be used.
    with torch.no_grad():
        param.copy_(torch.randn(tuple(param.shape), generator=gen, dtype=torch.float32, device="cpu") * std)


class _Linear(nn.Linear):
    """``nn.Linear`` with N(0, std) weights and zero bias drawn from ``gen`` at construction."""

    def __init__(self, d_in: int, d_out: int, gen: torch.Generator, std: float = INIT_STD):
        self._gen, self._std = gen, std
        super().__init__(d_in, d_out, bias=True)
        del self._gen, self._std

    def reset_parameters(self) -> None:
        # nn.Linear.__init__ calls this; the generator is only there during construction.
        gen = getattr(self, "_gen", None)
        if gen is None:
            raise RuntimeError("_Linear.reset_parameters needs the construction-time generator; "
                               "rebuild the model with GPT(config, seed=...) to re-initialise it")
        _normal_(self.weight, self._std, gen)
        with torch.no_grad():
            self.bias.zero_()


class _Embedding(nn.Embedding):
    """``nn.Embedding`` with N(0, 0.02) weights drawn from ``gen`` at construction."""

    def __init__(self, num: int, dim: int, gen: torch.Generator):
        self._gen = gen
        super().__init__(num, dim)
        del self._gen

    def reset_parameters(self) -> None:
        gen = getattr(self, "_gen", None)
        if gen is None:
            raise RuntimeError("_Embedding.reset_parameters needs the construction-time generator; "
                               "rebuild the model with GPT(config, seed=...) to re-initialise it")
        _normal_(self.weight, INIT_STD, gen)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: (B, T, d) -> (B, T, d)."""

    def __init__(self, cfg: GPTConfig, gen: torch.Generator):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = _Linear(cfg.d_model, 3 * cfg.d_model, gen)
        # GPT-2's scaling of the residual projections keeps the residual stream's variance flat in depth.
        self.proj = _Linear(cfg.d_model, cfg.d_model, gen, std=INIT_STD / math.sqrt(2 * cfg.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """Position-wise GELU MLP: (B, T, d) -> (B, T, d)."""

    def __init__(self, cfg: GPTConfig, gen: torch.Generator):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = _Linear(cfg.d_model, hidden, gen)
        self.proj = _Linear(hidden, cfg.d_model, gen, std=INIT_STD / math.sqrt(2 * cfg.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x)); (B, T, d) -> (B, T, d)."""

    def __init__(self, cfg: GPTConfig, gen: torch.Generator):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)  # default init (ones, zeros) is already deterministic
        self.attn = CausalSelfAttention(cfg, gen)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The language model.

    Args:
        cfg: a :class:`GPTConfig` (or a dict of its fields).
        seed: the initialisation seed; the same seed gives bit-identical weights on every rank.

    ``forward(idx, targets=None)``: ``idx`` int64 (B, T) token ids with T <= ``cfg.seq_len``.  Returns the
    logits (B, T, vocab) in the activation dtype, or, when ``targets`` (B, T) is given, the mean next-token
    cross-entropy (a scalar, computed in fp32).
    """

    def __init__(self, cfg: Union[GPTConfig, dict], seed: int = 0):
        super().__init__()
        if isinstance(cfg, dict):
            cfg = GPTConfig(**cfg)
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"cfg must be a GPTConfig or a dict of its fields, got {type(cfg).__name__}")
        self.cfg = cfg
        gen = torch.Generator().manual_seed(int(seed))
        self.wte = _Embedding(cfg.vocab, cfg.d_model, gen)
        self.wpe = _Embedding(cfg.seq_len, cfg.d_model, gen)
        self.blocks = nn.ModuleList(Block(cfg, gen) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, seq) token ids, got shape {tuple(idx.shape)}")
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight)  # tied head
        if targets is None:
            return logits
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def config_dict(self) -> dict:
        """The shape as a plain dict (for logs and checkpoints)."""
        return asdict(self.cfg)


def count_params(model: nn.Module) -> int:
    """Number of parameters of ``model``, also when ZeRO-3 has partitioned them (uses ``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def flops_per_token(cfg: GPTConfig) -> Tuple[int, int]:
    """(dense, attention) training FLOPs per token: ``6 * n_params`` and ``12 * n_layers * d_model * seq_len``.

    The usual estimate: forward + backward cost 6 FLOPs per parameter per token for the matmuls, plus the
    attention score and value products (``6 * 2 * L * d * T``, ignored by the simple ``6 N`` formula).
    """
    return 6 * cfg.n_params(), 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
