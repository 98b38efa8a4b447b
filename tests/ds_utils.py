"""Helpers for DeepSpeed ZeRO-3 engines inside gloo test workers (see ``dist_utils.run_distributed``).

Everything here runs on DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``).  The model is a tiny GPT-like
network (token + position embeddings, pre-LayerNorm attention and MLP blocks, tied-free LM head) and the data
is a deterministic function of (seed, step, micro-step, rank), so two engines built with the same seed see
exactly the same batches and can be compared step by step.
"""

from __future__ import annotations

import copy
import hashlib
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64
SEQ = 32


# Set to 1 to run the suite as if the CPU had no fp16 (as on an AMD EPYC without AVX512-FP16): fp16 engine
# tests are skipped, and DeepSpeed itself (in this process and in every spawned worker, which inherit the
# environment) refuses fp16 engines.  .ci/run runs the tests marked fp16 this way too.
NO_FP16_ENV = "SDP4BIT_TEST_NO_FP16"


def fp16_masked() -> bool:
    """True when ``SDP4BIT_TEST_NO_FP16`` asks to hide fp16 support."""
    return os.environ.get(NO_FP16_ENV, "").strip().lower() not in ("", "0", "false", "no")


def prepare_deepspeed_env() -> None:
    """Settings that must be in place before ``deepspeed`` builds an engine in a CPU test worker.

    DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op (``deepspeed_shm_comm``) on first
    use, which costs ~40 s: marking it incompatible makes DeepSpeed use the plain torch.distributed path.
    With ``SDP4BIT_TEST_NO_FP16`` set the accelerator answers that fp16 is not supported, as it does on a
    CPU without fp16 (DeepSpeed then refuses fp16 engines with "Type fp16 is not supported on your device").
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if fp16_masked():
        from deepspeed.accelerator import get_accelerator

        # an instance attribute shadows the method (supported_dtypes() and DeepSpeed's checks call it)
        get_accelerator().is_fp16_supported = lambda: False


def fp16_support() -> Tuple[bool, str]:
    """(whether DeepSpeed builds fp16 engines here, why not) -- the reason is what a skipped test prints."""
    prepare_deepspeed_env()
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if fp16_masked():
        return False, (f"fp16 masked by {NO_FP16_ENV}={os.environ[NO_FP16_ENV]} (the suite runs as on a CPU "
                       f"without fp16)")
    if acc.is_fp16_supported():
        return True, ""
    return False, (f"DeepSpeed's {acc.device_name()} accelerator does not support fp16 on this machine "
                   f"(is_fp16_supported() is falsy; DeepSpeed refuses fp16 engines here)")


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """A 2-layer GPT-like model; ``forward(tokens [B, T] int64) -> mean next-token loss (scalar)``."""

    def __init__(self, d: int = 32, layers: int = 2, heads: int = 2, vocab: int = VOCAB, seq: int = SEQ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([_Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)[None]
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def make_model(seed: int = 0, d: int = 32, layers: int = 2) -> TinyGPT:
    """The tiny model with deterministic initial weights (same on every rank for the same ``seed``)."""
    g = torch.random.fork_rng(devices=[])
    with g:
        torch.manual_seed(seed)
        return TinyGPT(d=d, layers=layers)


def batch(step: int, micro: int, rank: int, micro_batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Token batch [micro_batch, SEQ] int64 for (step, micro-step, rank): deterministic and learnable.

    Sequences are noisy arithmetic progressions mod VOCAB, so the loss goes down within a few steps.
    """
    g = torch.Generator().manual_seed(((seed * 1000003 + step) * 101 + micro) * 1009 + rank)
    start = torch.randint(0, VOCAB, (micro_batch, 1), generator=g)
    stride = torch.randint(1, 4, (micro_batch, 1), generator=g)
    toks = (start + stride * torch.arange(SEQ)[None]) % VOCAB
    noise = torch.rand(micro_batch, SEQ, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, (micro_batch, SEQ), generator=g), toks)


def base_config(dtype: str = "bf16", world_size: int = 4, micro_batch: int = 2, grad_accum: int = 1,
                sdp4bit: Optional[Dict[str, Any]] = None, zero_extra: Optional[Dict[str, Any]] = None,
                clip: float = 0.0, lr: float = 3e-3, **top) -> Dict[str, Any]:
    """A ZeRO-3 ds_config dict for the tiny model (AdamW from the config, small buckets)."""
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            # Small buckets so one backward makes several reduce-scatter buckets.
            "reduce_bucket_size": 4096,
            "stage3_prefetch_bucket_size": 4096,
            "stage3_param_persistence_threshold": 64,
            # Several optimizer sub-groups, so the weight refresh runs over several buckets per step.
            "sub_group_size": 2000,
        },
        "gradient_clipping": clip,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1,
                       "min_loss_scale": 1}
    elif dtype != "fp32":
        raise ValueError(f"dtype must be bf16, fp16 or fp32, got {dtype!r}")
    if zero_extra:
        cfg["zero_optimization"].update(zero_extra)
    if sdp4bit is not None:
        cfg["sdp4bit"] = copy.deepcopy(sdp4bit)
    cfg.update(top)
    return cfg


def make_engine(config: Dict[str, Any], seed: int = 0, d: int = 32, zero_init: bool = False,
                frozen: Sequence[str] = ()):
    """``deepspeed.initialize`` on the tiny model; returns the engine.

    ``zero_init``: build the model under ``deepspeed.zero.Init(config_dict_or_path=config)`` (partitioned at
    construction), as a user of a large model would.  ``frozen``: name prefixes of parameters set to
    ``requires_grad=False`` and left out of the optimizer (as a user freezing part of a model does).
    """
    prepare_deepspeed_env()
    import deepspeed

    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = make_model(seed, d=d)
    else:
        model = make_model(seed, d=d)
    for name, p in model.named_parameters():
        if name.startswith(tuple(frozen)):
            p.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=config)
    return engine


def train_steps(engine, steps: int, rank: int, start_step: int = 0, seed: int = 0,
                loss_hook=None, norms: Optional[list] = None) -> List[float]:
    """Run ``steps`` optimizer steps (with the engine's gradient accumulation); return the mean loss per step
    (averaged over micro-steps and ranks, as computed before any ``loss_hook``).

    ``loss_hook(loss, step, micro) -> loss`` (optional) may replace the loss that is back-propagated (e.g. to
    inject an overflow on one rank).  ``norms`` (optional list) receives the global gradient norm of each
    step (before clipping).
    """
    import torch.distributed as dist

    losses = []
    ga = engine.gradient_accumulation_steps()
    mb = engine.train_micro_batch_size_per_gpu()
    for step in range(start_step, start_step + steps):
        total = 0.0
        for micro in range(ga):
            loss = engine(batch(step, micro, rank, micro_batch=mb, seed=seed).to(engine.device))
            engine.backward(loss if loss_hook is None else loss_hook(loss, step, micro))
            engine.step()
            total += float(loss.detach())
        if norms is not None:
            norms.append(float(engine.get_global_grad_norm()))
        t = torch.tensor([total / ga], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
    return losses


def tensor_hash(t: torch.Tensor) -> str:
    """SHA-1 of a tensor's raw bytes (dtype-exact)."""
    t = t.detach().contiguous().cpu()
    return hashlib.sha1(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def full_params_fp32(engine) -> Dict[str, torch.Tensor]:
    """Every parameter gathered in full as fp32 (collective: call on all ranks)."""
    import deepspeed

    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().float().clone()
    return out
