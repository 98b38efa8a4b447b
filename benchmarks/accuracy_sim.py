"""Single-process simulation of W-rank ZeRO-3 training with SDP4Bit's real quantization code paths (issue 21).

One process plays all W data-parallel ranks of ``examples/train_gpt.py``: every step it computes the W ranks'
micro-batch gradients one after the other (bf16 model, the same batches as train_gpt.py: ``WindowSampler``
seeded by (data seed, step, micro, rank)), then

* gradients: ZeRO-3's reduce-scatter, either exact (bf16 pre-division by W, bf16 sum, as DeepSpeed's
  ``reduce_scatter_coalesced``) or through :func:`collectives.gradients.simulate_reduce_scatter`, which is
  :meth:`GradientReducer.reduce_scatter` (the call ``integration.reduce_grads`` makes) for all ranks in one
  process: same layout (DeepSpeed's per-parameter pieces of ceil(n/W) elements; buckets of
  ``--bucket-size`` elements filled in backward order, sorted by parameter id as DeepSpeed does), same kernels,
  same stochastic-rounding keys (seed, step, bucket, level, rank, chunk), same bits;
* optimizer: the fp32 master partitions [W, M] (DeepSpeed's flat partition: the per-parameter pieces
  concatenated in parameter order), gradient clipping on the global norm as DeepSpeed, torch AdamW (what
  train_gpt.py uses on CPU), the warm-up + cosine schedule of train_gpt.py;
* weights: the bf16 partitions, either ``bf16(master)`` (ZeRO-3) or qWD through
  ``reference.weight_delta_quantize`` on each rank's flat partition with the key the collective uses
  (``make_key(seed, step, sub_group, owner)``); every replica copy is bit-identical to the owner's partition
  (the invariant the integration keeps), so the model simply runs on the owners' partitions.

Besides the loss it records, every ``--probe-every`` steps, the relative error per parameter tensor of the
reduced gradient (against the exact reduce of the same local gradients) and of the bf16 weights the model
runs on (against the fp32 master), and at the end the distance of every parameter tensor to the ZeRO-3 run
with the same data seed (when that run is in the same invocation).

    export PYTHONPATH=$PWD
    python benchmarks/accuracy_sim.py --variants zero3 sdp4bit sdp4bit_packed --topologies 2x2 \\
        --data-seeds 1 --steps 300 --out benchmarks/results/accuracy_sim/runs.json

Results of the issue-21 study: ``benchmarks/results/accuracy_sim/README.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from gpt import GPT, GPTConfig  # noqa: E402
from data import WindowSampler, load_corpus, split_corpus  # noqa: E402
from deepspeed_sdp4bit import reference as R  # noqa: E402
from deepspeed_sdp4bit.ops import get_backend  # noqa: E402
from deepspeed_sdp4bit.collectives.gradients import ResidualStore, simulate_reduce_scatter  # noqa: E402
from deepspeed_sdp4bit.config import GradientsConfig, WeightsConfig  # noqa: E402
from deepspeed_sdp4bit.topology import TopologyShape  # noqa: E402

# configs/sdp4bit.json's blocks; a variant overrides some keys (None = that path is exact ZeRO-3).
SDP_GRADS = dict(intra_bits=8, inter_bits=4, group_size=128, hadamard=True, hadamard_size=32,
                 rounding="stochastic")
SDP_WEIGHTS = dict(mode="diff", bits=4, group_size=2048, rounding="nearest")
PACKED = {"align_params": False}   # the layout before issue 21: groups span parameter boundaries

VARIANTS: Dict[str, Dict[str, Optional[dict]]] = {
    "zero3": {"grads": None, "weights": None},
    # ZeRO-3 with the gradient sum in fp32 (a rounding-sized perturbation): how far a trajectory drifts from
    # ZeRO-3's by chaos alone, the floor for every paired gap
    "zero3_fp32": {"grads": None, "weights": None, "fp32_reduce": True},
    "sdp4bit": {"grads": {}, "weights": {}},
    "sdp4bit_packed": {"grads": PACKED, "weights": {}},
    # qWD with groups restarting at every parameter's piece of the flat partition (simulated here only: the
    # weight kernels work on the contiguous flat partition); measures whether the weight side needs it
    "sdp4bit_wq_aligned": {"grads": {}, "weights": {}, "weights_aligned": True},
    "qwd": {"grads": None, "weights": {}},
    "qw": {"grads": None, "weights": {"mode": "direct"}},
    "tlq_hs": {"grads": {}, "weights": None},
    "tlq_hs_packed": {"grads": PACKED, "weights": None},
    "tlq": {"grads": {"hadamard": False}, "weights": None},
    "tlq_packed": {"grads": {"hadamard": False, **PACKED}, "weights": None},
    "tlq_hs_nearest": {"grads": {"rounding": "nearest"}, "weights": None},
    "tlq_hs_nearest_packed": {"grads": {"rounding": "nearest", **PACKED}, "weights": None},
    "tlq_hs_g32_packed": {"grads": {"group_size": 32, **PACKED}, "weights": None},
    "tlq_hs_g512_packed": {"grads": {"group_size": 512, **PACKED}, "weights": None},
    "tlq_hs_g512": {"grads": {"group_size": 512}, "weights": None},
    "tlq_hs_8bit_packed": {"grads": {"inter_bits": 8, **PACKED}, "weights": None},
    # the whole method with the node sums sent at 8 bits between nodes, or rounded to nearest: does the second
    # (4-bit) quantization of node sums at NxG (G > 1) cost loss that 4x1 does not pay?
    "sdp4bit_inter8": {"grads": {"inter_bits": 8}, "weights": {}},
    "sdp4bit_nearest": {"grads": {"rounding": "nearest"}, "weights": {}},
    # the Hadamard block as large as the group: one transform spreads a group's outliers over all of it, so the
    # group's abs-max (and the noise it sets for every element) follows the group's RMS, not its loudest block
    "sdp4bit_h128": {"grads": {"hadamard_size": 128}, "weights": {}},
    # smaller gradient groups (4 + 32/g bits per value for the scales): at g = 32 every Hadamard block has its
    # own scale, so a quiet block's noise follows its own abs-max, not the loudest block of its group of 128;
    # without the transform each group of 32 raw values keeps its own scale
    "sdp4bit_g32": {"grads": {"group_size": 32}, "weights": {}},
    "sdp4bit_g64": {"grads": {"group_size": 64}, "weights": {}},
    "sdp4bit_noh_g32": {"grads": {"group_size": 32, "hadamard": False}, "weights": {}},
    # the inter-node level's rounding error carried into the next step (gradients.error_feedback)
    "sdp4bit_ef": {"grads": {"error_feedback": True}, "weights": {}},
    # 4 bits at both levels, no transform: the paper's ULq (ZeRO++'s qgZ), here with our groups of 128
    # (qgZ's scales are coarser, about one per row), so an upper bound on qgZ's accuracy
    "ulq": {"grads": {"intra_bits": 4, "hadamard": False}, "weights": None},
    # ZeRO++-like: ULq gradients as above and the weights sent directly at 8 bits (qwZ; groups of 2048 here)
    "zeropp_like": {"grads": {"intra_bits": 4, "hadamard": False}, "weights": {"mode": "direct", "bits": 8}},
    # the shipped config with the node sums at 8 bits for the first 100 steps only (gradients.inter8_steps): the
    # 25-step warm-up's cost appeared right after the lr peak (issue 21)
    "sdp4bit_inter8_first100": {"grads": {"inter8_steps": 100}, "weights": {}},
}


def lr_at(step: int, a) -> float:
    """train_gpt.py's schedule: linear warm-up, then cosine to lr * min_lr_ratio."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    span = max(1, a.steps - a.warmup)
    progress = min(1.0, (step - a.warmup) / span)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Partition:
    """DeepSpeed ZeRO-3's flat partition of a parameter list over W ranks: [W, M], rank r's row is the
    concatenation of each parameter's piece r of ``ceil(n / W)`` elements (the last ones zero-padded)."""

    def __init__(self, params: List[torch.nn.Parameter], world: int):
        self.W = world
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.parts = [-(-n // world) for n in self.numels]
        self.offs = [sum(self.parts[:i]) for i in range(len(params))]
        self.M = sum(self.parts)

    def to_part(self, fulls: List[torch.Tensor], dtype) -> torch.Tensor:
        out = torch.zeros(self.W, self.M, dtype=dtype, device=fulls[0].device)
        for t, n, P, o in zip(fulls, self.numels, self.parts, self.offs):
            buf = torch.zeros(self.W * P, dtype=dtype, device=t.device)
            buf[:n] = t.reshape(-1)
            out[:, o:o + P] = buf.view(self.W, P)
        return out

    def to_full(self, part: torch.Tensor) -> List[torch.Tensor]:
        return [part[:, o:o + P].reshape(-1)[:n].view(s)
                for n, P, o, s in zip(self.numels, self.parts, self.offs, self.shapes)]


def buckets_for(numels: List[int], bucket_size: int) -> List[List[int]]:
    """DeepSpeed's gradient buckets: parameters in backward order (reverse of definition), a bucket is
    reduced before a parameter that would overflow it is added; each bucket sorted by parameter id."""
    out, cur, elems = [], [], 0
    for i in reversed(range(len(numels))):
        if cur and elems + numels[i] > bucket_size:
            out.append(sorted(cur))
            cur, elems = [], 0
        cur.append(i)
        elems += numels[i]
    if cur:
        out.append(sorted(cur))
    return out


def exact_reduce(grads_r: List[torch.Tensor], W: int, fp32: bool = False) -> torch.Tensor:
    """ZeRO-3: ``g.div_(W)`` in bf16, then a bf16 sum in rank order; returned as fp32.  ``fp32``: the sum in
    fp32 instead (the ``zero3_fp32`` variant: ZeRO-3 up to rounding, for the trajectories' own noise floor)."""
    if fp32:
        return sum(g.float() for g in grads_r) / W
    acc = grads_r[0] / W
    for g in grads_r[1:]:
        acc = acc + g / W
    return acc.float()


def param_class(name: str) -> str:
    if name.endswith(".bias"):
        return "bias"
    if ".ln" in name or name.startswith("ln_"):
        return "ln_gain"
    if name.startswith(("wte", "wpe")):
        return "embedding"
    return "matrix"


def run(a, variant: str, topo: str, data_seed: int, corpus) -> dict:
    spec = VARIANTS[variant]
    N, g = (int(x) for x in topo.split("x"))
    shape = TopologyShape(N, g)
    W = shape.world_size
    gcfg = GradientsConfig(**{**SDP_GRADS, **spec["grads"]}) if spec["grads"] is not None else None
    wcfg = WeightsConfig(**{**SDP_WEIGHTS, **spec["weights"]}) if spec["weights"] is not None else None
    model = GPT(GPTConfig(d_model=a.d_model, n_layers=a.layers, n_heads=a.heads, seq_len=a.seq),
                seed=a.model_seed).to(device=a.device, dtype=torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    part = Partition(params, W)
    be = get_backend(a.backend, torch.device(a.device))
    master = part.to_part([p.detach().float() for p in params], torch.float32).view(-1).requires_grad_(False)
    master_param = torch.nn.Parameter(master)
    opt = torch.optim.AdamW([master_param], lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    own = master_param.data.view(W, part.M).to(torch.bfloat16)   # the bf16 partitions (all ranks identical)
    train, held = split_corpus(corpus)
    samplers = [WindowSampler(train, a.seq, a.micro_batch, data_seed, r, W) for r in range(W)]
    evals = [WindowSampler(held, a.seq, a.micro_batch, data_seed, r, W) for r in range(W)]
    buckets = buckets_for(part.numels, a.bucket_size)
    residuals = ([ResidualStore() for _ in range(W)] if gcfg is not None and gcfg.error_feedback
                 else None)   # per rank, as each rank's reducer keeps them
    losses, probes = [], []
    t0 = time.time()
    stop_at = a.deadline_at if getattr(a, "deadline_at", None) else None

    def load_weights():
        for p, w in zip(params, part.to_full(own)):
            p.data.copy_(w)

    load_weights()
    for step in range(a.steps):
        if stop_at is not None and step and time.time() + (1 + a.eval_batches / 2) * (time.time() - t0) / step > stop_at:
            break   # the next step and the evaluation (~1/3 step per batch) would not end before it
        lr = lr_at(step, a)
        opt.param_groups[0]["lr"] = lr
        grads_r, loss_r = [], []
        for r in range(W):
            x, y = samplers[r].batch(step, 0)
            model.zero_grad(set_to_none=True)
            loss = model(x.to(a.device), y.to(a.device))
            loss.backward()
            grads_r.append([p.grad.detach().clone() for p in params])
            loss_r.append(float(loss.detach()))
        losses.append(sum(loss_r) / W)
        probe = a.probe_every and (step % a.probe_every == 0 or step == a.steps - 1)
        if gcfg is None:
            full = [exact_reduce([grads_r[r][i] for r in range(W)], W, spec.get("fp32_reduce", False))
                    for i in range(len(params))]
        else:
            full = [None] * len(params)
            for b, idx in enumerate(buckets):
                outs = simulate_reduce_scatter([[grads_r[r][i] for i in idx] for r in range(W)], shape, gcfg,
                                               a.sdp_seed, step=step, bucket_id=b, op="mean",
                                               backend=a.backend, residuals=residuals,
                                               residual_key=("bucket", b))
                for k, i in enumerate(idx):
                    full[i] = torch.cat([outs[d][k] for d in range(W)]).float().view(params[i].shape)
            for store in residuals or ():
                store.end_step()
        rec = {}
        if probe:
            ex = full if gcfg is None else [exact_reduce([grads_r[r][i] for r in range(W)], W)
                                            for i in range(len(params))]
            rec["grad_rel_err"] = {n: float((f - e).norm() / e.norm().clamp_min(1e-30))
                                   for n, f, e in zip(names, full, ex)}
            rec["grad_norm"] = {n: float(e.norm()) for n, e in zip(names, ex)}
        gpart = part.to_part(full, torch.float32)
        norm = float(gpart.norm())
        clip = (norm + 1e-6) / a.clip
        if clip > 1:
            gpart.div_(clip)
        master_param.grad = gpart.view(-1)
        opt.step()
        m = master_param.data.view(W, part.M)
        if wcfg is None:
            own.copy_(m)
        else:
            for r in range(W):
                key = (R.make_key(a.sdp_seed, step, 0, r) if wcfg.rounding == "stochastic" else None)
                if not spec.get("weights_aligned"):
                    be.weight_delta_quantize(m[r], own[r], wcfg.bits, wcfg.group_size, wcfg.rounding, key, 0,
                                             wcfg.mode)
                    continue
                for o, P in zip(part.offs, part.parts):   # group g of piece i <-> its own scale
                    be.weight_delta_quantize(m[r, o:o + P], own[r, o:o + P], wcfg.bits, wcfg.group_size,
                                             wcfg.rounding, key, o, wcfg.mode)
        load_weights()
        if probe:
            mf, of = part.to_full(m), part.to_full(own.float())
            rec["replica_rel_err"] = {n: float((o - w).norm() / w.norm().clamp_min(1e-30))
                                      for n, o, w in zip(names, of, mf)}
            rec["bf16_rel_err"] = {n: float((w.bfloat16().float() - w).norm() / w.norm().clamp_min(1e-30))
                                   for n, w in zip(names, mf)}
            rec["step"] = step
            probes.append(rec)
        if a.verbose and step % 50 == 0:
            print(f"  {variant} {topo} seed {data_seed} step {step} loss {losses[-1]:.4f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    with torch.no_grad():
        held_loss = sum(float(model(*(t.to(a.device) for t in evals[r].eval_batch(i))))
                        for r in range(W) for i in range(a.eval_batches))
    k = min(50, len(losses))
    done = len(losses)
    return {"variant": variant, "topology": topo, "data_seed": data_seed, "sdp_seed": a.sdp_seed,
            "model_seed": a.model_seed, "steps": a.steps, "steps_done": done,
            "status": "ok" if done == a.steps else "stopped",
            "grads": gcfg.model_dump() if gcfg else None, "weights": wcfg.model_dump() if wcfg else None,
            "train_loss": sum(losses[-k:]) / k, "heldout_loss": held_loss / (W * a.eval_batches),
            "losses": losses, "probes": probes, "seconds": time.time() - t0,
            "ms_per_step": 1000 * (time.time() - t0) / max(1, done),
            "final_weights": {n: w.cpu() for n, w in zip(names, part.to_full(own.float()))},
            "classes": {n: param_class(n) for n in names}, "numels": dict(zip(names, part.numels))}


TABLE_CONFIGS = {   # gradient configs of the error table: name -> overrides of SDP_GRADS
    "tlq_hs": {}, "tlq_hs_packed": PACKED,
    "tlq": {"hadamard": False}, "tlq_packed": {"hadamard": False, **PACKED},
    "tlq_hs_nearest": {"rounding": "nearest"}, "tlq_hs_nearest_packed": {"rounding": "nearest", **PACKED},
    "tlq_hs_g32_packed": {"group_size": 32, **PACKED},
    "tlq_hs_g512": {"group_size": 512}, "tlq_hs_g512_packed": {"group_size": 512, **PACKED},
    "ulq_packed": {"intra_bits": 4, "hadamard": False, **PACKED},
    "8bit_both_packed": {"inter_bits": 8, **PACKED},
}


def error_table(a, corpus) -> dict:
    """Per-tensor relative error of the reduced gradient for many configs, on the same real gradients.

    The model is trained with exact ZeRO-3 for ``--table-warm`` steps; then, for ``--table-batches`` steps'
    batches, the W ranks' gradients are reduced exactly and through every config of TABLE_CONFIGS on every
    topology; per tensor the error is ``||q - e|| / ||e||``, summarised per parameter class (median, max) over
    tensors and batches.
    """
    W = 4
    model = GPT(GPTConfig(d_model=a.d_model, n_layers=a.layers, n_heads=a.heads, seq_len=a.seq),
                seed=a.model_seed).to(torch.bfloat16)
    if a.table_warm:
        warm = argparse.Namespace(**{**vars(a), "steps": a.table_warm, "probe_every": 0})
        w = run(warm, "zero3", "2x2", a.data_seeds[0], corpus)["final_weights"]
        for n, p in model.named_parameters():
            p.data.copy_(w[n])
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    train, _ = split_corpus(corpus)
    samplers = [WindowSampler(train, a.seq, a.micro_batch, a.data_seeds[0], r, W) for r in range(W)]
    errs: Dict[str, Dict[str, List[float]]] = {}
    for b in range(a.table_batches):
        grads_r = []
        for r in range(W):
            model.zero_grad(set_to_none=True)
            model(*samplers[r].batch(a.table_warm + b, 0)).backward()
            grads_r.append([p.grad.detach().clone() for p in params])
        ex = [exact_reduce([grads_r[r][i] for r in range(W)], W) for i in range(len(params))]
        for topo in a.topologies:
            shape = TopologyShape(*(int(x) for x in topo.split("x")))
            for cname, over in TABLE_CONFIGS.items():
                cfg = GradientsConfig(**{**SDP_GRADS, **over})
                outs = simulate_reduce_scatter(grads_r, shape, cfg, a.sdp_seed, step=a.table_warm + b)
                d = errs.setdefault(f"{cname}@{topo}", {})
                for i, n in enumerate(names):
                    q = torch.cat([outs[r][i] for r in range(W)]).float()
                    e = ex[i].reshape(-1)
                    d.setdefault(n, []).append(float((q - e).norm() / e.norm().clamp_min(1e-30)))
    classes = {n: param_class(n) for n in names}
    summary = {}
    for key, per in errs.items():
        row = {}
        for c in sorted(set(classes.values())):
            vals = sorted(v for n, vs in per.items() if classes[n] == c for v in vs)
            row[c] = {"median": vals[len(vals) // 2], "max": vals[-1]}
        summary[key] = row
    return {"summary": summary, "per_tensor": {k: {n: sum(v) / len(v) for n, v in per.items()}
                                              for k, per in errs.items()},
            "classes": classes, "warm_steps": a.table_warm, "batches": a.table_batches}


def _median(vals):
    """The upper median (a value of the list), NaN for none."""
    return statistics.median_high(vals) if vals else float("nan")


PROBE_METRICS = ("grad_rel_err", "replica_rel_err", "bf16_rel_err")
DEFAULT_SDP_SEED = 1234   # --sdp-seed's default: the stochastic-rounding seed of every run unless repeated on purpose


def rounding_seed(r: dict) -> int:
    """A run's stochastic-rounding seed (rows written before it was recorded used the default)."""
    return r.get("sdp_seed", DEFAULT_SDP_SEED)


def probe_summary(r: dict) -> Dict[str, Dict[str, float]]:
    """Per parameter class and probe metric, the median over the class's tensors and the run's probes (what
    the report shows).  A run stored without its probes (``--compact``) carries this as ``probe_summary``."""
    if "probe_summary" in r:
        return r["probe_summary"]
    out: Dict[str, Dict[str, float]] = {}
    for c in sorted(set(r["classes"].values())):
        names = [n for n, k in r["classes"].items() if k == c]
        out[c] = {m: _median([p[m][n] for p in r["probes"] if m in p for n in names]) for m in PROBE_METRICS}
    return out


def compact(r: dict) -> dict:
    """A run without its per-tensor probes (replaced by :func:`probe_summary`), losses to 5 decimals."""
    r = dict(r)
    r["probe_summary"] = probe_summary(r)
    r.pop("probes", None)
    r["losses"] = [round(x, 5) for x in r["losses"]]
    return r


SETTING_ARGS = ("d_model", "layers", "heads", "seq", "micro_batch", "lr", "warmup", "min_lr_ratio")


def setting(r: dict) -> tuple:
    """What a run trained (model, batch, schedule, steps): only runs of one setting are compared."""
    a = r.get("args") or {}
    return tuple(a.get(k) for k in SETTING_ARGS) + (r["steps"],)


def zero3_refs(runs: List[dict]) -> Dict[tuple, dict]:
    """The finished ZeRO-3 runs by (setting, data seed): the reference of every paired gap."""
    return {(setting(r), r["data_seed"]): r for r in runs if r["variant"] == "zero3" and r.get("status", "ok") == "ok"}


def paired(runs: List[dict], refs: Optional[Dict[tuple, dict]] = None) -> List[tuple]:
    """(run, its ZeRO-3 reference) for the finished non-ZeRO-3 runs of the default rounding seed that have one:
    what every mean, median, curve and goal over runs counts (a repeat under another rounding seed is shown,
    not counted)."""
    refs = zero3_refs(runs) if refs is None else refs
    out = []
    for r in runs:
        ref = refs.get((setting(r), r["data_seed"]))
        if (r["variant"] != "zero3" and ref is not None and r.get("status", "ok") == "ok"
                and rounding_seed(r) == DEFAULT_SDP_SEED):
            out.append((r, ref))
    return out


def gap_pct(r: dict, ref: dict, key: str = "train_loss") -> float:
    """``r``'s ``key`` against its ZeRO-3 reference, in %."""
    return 100 * (r[key] / ref[key] - 1)


def _seed_label(r: dict) -> str:
    """The data seed, with the stochastic-rounding seed where it is not the default."""
    sdp = rounding_seed(r)
    return str(r["data_seed"]) + ("" if sdp == DEFAULT_SDP_SEED else f" (rounding seed {sdp})")


def _smooth(xs: List[float], k: int) -> List[float]:
    """Trailing mean over up to ``k`` values."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def gap_curves(runs: List[dict], window: int = 50, min_runs: int = 3) -> dict:
    """What ``--plot`` draws, per topology: the ZeRO-3 data-seed band (each seed's smoothed loss against the
    seeds' mean, in %, min and max per step) and, per variant with at least ``min_runs`` finished runs of the
    default rounding seed paired with ZeRO-3, the mean over runs of the smoothed paired gap in % (with its run
    count).

    Returns ``{"band": (lo, hi) | None, "topologies": {topo: {variant: (curve, n)}}}``.
    """
    refs = zero3_refs(runs)
    smooth = {id(r): _smooth(r["losses"], window) for r in refs.values()}
    band = None
    if len(refs) > 1:
        curves = list(smooth.values())
        n = min(len(c) for c in curves)
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
        rel = [[100 * (c[i] / mean[i] - 1) for i in range(n)] for c in curves]
        band = ([min(col) for col in zip(*rel)], [max(col) for col in zip(*rel)])
    per: Dict[tuple, List[List[float]]] = {}
    for r, ref in paired(runs, refs):
        mine = _smooth(r["losses"], window)
        per.setdefault((r["topology"], r["variant"]), []).append(
            [100 * (a / b - 1) for a, b in zip(mine, smooth[id(ref)])])
    topos: Dict[str, dict] = {}
    for (topo, v), cs in sorted(per.items()):
        if len(cs) < min_runs:
            continue
        n = min(len(c) for c in cs)
        topos.setdefault(topo, {})[v] = ([sum(c[i] for c in cs) / len(cs) for i in range(n)], len(cs))
    return {"band": band, "topologies": topos}


def plot_gaps(runs: List[dict], path: str, title: str, window: int = 50, min_runs: int = 3) -> None:
    """One panel per topology: the mean paired gap to ZeRO-3 in % over steps, one line per variant, over the
    ZeRO-3 data-seed band (grey)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g = gap_curves(runs, window, min_runs)
    topos = sorted(g["topologies"])
    if not topos:
        raise ValueError(f"nothing to plot: no variant has {min_runs} finished runs paired with ZeRO-3")
    fig, axes = plt.subplots(1, len(topos), figsize=(6 * len(topos), 4.2), sharey=True, squeeze=False)
    for ax, topo in zip(axes[0], topos):
        if g["band"]:
            lo, hi = g["band"]
            ax.fill_between(range(len(lo)), lo, hi, color="0.85", label="ZeRO-3 data seeds (spread)")
        ax.axhline(0, color="0.4", lw=0.8)
        ax.axhline(0.3, color="0.4", lw=0.8, ls=":", label="goal +0.3%")
        for v, (curve, n) in sorted(g["topologies"][topo].items()):
            ax.plot(range(len(curve)), curve, lw=1.4, label=f"{v} ({n} runs)")
        ax.set_title(f"{topo}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel(f"loss vs ZeRO-3 of the same data seed, % ({window}-step mean)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


GAP_WINDOWS = (0, 25, 50, 100, 200, 300, 400, 450)   # first steps of the 25-step windows of window_gap_table


def window_gap_table(runs: List[dict], refs: Dict[tuple, dict], width: int = 25) -> List[str]:
    """When a gap opens: per variant and topology (runs of the default rounding seed paired with ZeRO-3), the mean
    over runs of the paired gap of the train loss averaged over ``width`` steps starting at each of GAP_WINDOWS
    (those that fit the runs' steps)."""
    groups: Dict[tuple, List[List[float]]] = {}
    for r, ref in paired(runs, refs):
        starts = [a for a in GAP_WINDOWS if a + width <= min(len(r["losses"]), len(ref["losses"]))]
        if not starts:
            continue   # shorter than one window
        groups.setdefault((r["variant"], r["topology"], tuple(starts)), []).append(
            [100 * (sum(r["losses"][a:a + width]) / sum(ref["losses"][a:a + width]) - 1) for a in starts])
    if not groups:
        return []
    out = [f"When the gap opens: the paired gap of the train loss averaged over {width} steps from each step below, "
           "mean over the runs of the table above:", ""]
    for starts in sorted({k[2] for k in groups}):
        out.append("| variant | topology | runs | " + " | ".join(f"from {a}" for a in starts) + " |")
        out.append("|---|---|---|" + "---|" * len(starts))
        for (v, topo, st), gs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if st == starts:
                out.append(f"| {v} | {topo} | {len(gs)} | " + " | ".join(
                    f"{sum(g[i] for g in gs) / len(gs):+.2f}%" for i in range(len(st))) + " |")
        out.append("")
    return out


SHIPPED = "sdp4bit"   # the variant the others are set against in against_shipped_table


def _matrix_distance(r: dict) -> Optional[float]:
    """The median over the run's matrices of their final relative distance to ZeRO-3's (None without distances)."""
    d = r.get("final_rel_dist_to_zero3")
    names = [n for n, c in r["classes"].items() if c == "matrix"]
    return _median([d[n] for n in names]) if d and names and all(n in d for n in names) else None


def against_shipped_table(runs: List[dict], refs: Dict[tuple, dict]) -> List[str]:
    """Each variant against the shipped config on the same data seeds (runs of the default rounding seed paired with
    ZeRO-3): the mean and SE over seeds of (its gap - the shipped config's gap), in points, and on how many seeds its
    matrices end closer to ZeRO-3's than the shipped config's (:func:`_matrix_distance`)."""
    from benchmarks.suite import mean_se

    pr = paired(runs, refs)
    shipped = {(setting(r), r["topology"], r["data_seed"]): (r, ref) for r, ref in pr if r["variant"] == SHIPPED}
    groups: Dict[tuple, List[tuple]] = {}
    for r, ref in pr:
        s = shipped.get((setting(r), r["topology"], r["data_seed"]))
        if r["variant"] in (SHIPPED, "zero3") or s is None:
            continue
        groups.setdefault((r["variant"], r["topology"], r["steps"]), []).append(
            (gap_pct(r, ref) - gap_pct(*s), _matrix_distance(r), _matrix_distance(s[0])))
    if not groups:
        return []
    out = [f"Against the shipped config ({SHIPPED}) on the same data seeds: the variant's paired gap minus the shipped "
           "config's (points, mean and SE over seeds), and on how many seeds its matrices end closer to ZeRO-3's "
           "(median over matrices of the final relative distance):", "",
           "| variant | topology | steps | seeds | gap - shipped gap | SE | weights closer to ZeRO-3 |",
           "|---|---|---|---|---|---|---|"]
    for (v, topo, steps), xs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        m, se = mean_se([x[0] for x in xs])
        both = [(a, b) for _, a, b in xs if a is not None and b is not None]
        closer = f"{sum(a < b for a, b in both)} of {len(both)}" if both else "-"
        out.append(f"| {v} | {topo} | {steps} | {len(xs)} | {m:+.2f} | " + ("-" if se is None else f"{se:.2f}")
                   + f" | {closer} |")
    return out + [""]


def report(runs: List[dict]) -> str:
    from benchmarks.suite import mean_se

    """Markdown tables from the runs of one or more ``--out`` files (what the README shows).  Only finished runs
    count (a run stopped by --deadline is named at the end); each run is paired with the ZeRO-3 run of the same
    data seed and steps, and the paired gaps get their mean and standard error over the seeds."""
    lines = []
    stopped = [r for r in runs if r.get("status", "ok") != "ok"]
    runs = [r for r in runs if r.get("status", "ok") == "ok"]
    z = zero3_refs(runs)
    zl = sorted(r["train_loss"] for r in z.values())
    zh = sorted(r["heldout_loss"] for r in z.values())
    if zl:
        mean = sum(zl) / len(zl)
        lines.append(f"ZeRO-3 over {len(zl)} data seed(s): train loss (mean of the last 50 steps) {zl[0]:.4f} .. "
                     f"{zl[-1]:.4f} (band {100 * (zl[-1] - zl[0]) / mean:.2f}% of the mean {mean:.4f}); "
                     f"held-out {zh[0]:.4f} .. {zh[-1]:.4f}.")
        lines.append("")
    lines.append("| variant | topology | data seed | steps | train loss | vs ZeRO-3 (same seed) | held-out | vs ZeRO-3 |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (r["variant"] != "zero3", r["topology"], r["variant"], r["data_seed"])):
        ref = z.get((setting(r), r["data_seed"]))
        gap = f"{gap_pct(r, ref):+.2f}%" if ref and r is not ref else "-"
        hgap = f"{gap_pct(r, ref, 'heldout_loss'):+.2f}%" if ref and r is not ref else "-"
        topo = "any" if r["variant"] == "zero3" else r["topology"]
        lines.append(f"| {r['variant']} | {topo} | {_seed_label(r)} | {r['steps']} | {r['train_loss']:.4f} | {gap} | "
                     f"{r['heldout_loss']:.4f} | {hgap} |")
    lines.append("")
    lines.append("Paired gap (train loss vs the ZeRO-3 run of the same data seed), per variant and topology, over the "
                 "runs of the default rounding seed (a repeat under another rounding seed is listed above only):")
    lines.append("")
    lines.append("| variant | topology | steps | runs | mean gap | standard error | median | min .. max |")
    lines.append("|---|---|---|---|---|---|---|---|")
    groups: Dict[tuple, List[float]] = {}
    for r, ref in paired(runs, z):
        groups.setdefault((r["variant"], r["topology"], r["steps"]), []).append(gap_pct(r, ref))
    for (v, topo, steps), gaps in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        m, se = mean_se(gaps)
        lines.append(f"| {v} | {topo} | {steps} | {len(gaps)} | {m:+.2f}% | "
                     + ("-" if se is None else f"{se:.2f}%") + f" | {statistics.median(gaps):+.2f}% | "
                     f"{min(gaps):+.2f}% .. {max(gaps):+.2f}% |")
    lines.append("")
    lines += window_gap_table(runs, z)
    lines += against_shipped_table(runs, z)
    classes = sorted({c for r in runs for c in r["classes"].values()})
    lines.append("Per parameter class, median over tensors and probes (every 25 or 50 steps): relative error of the "
                 "reduced gradient vs the exact reduce of the same local gradients; of the bf16 weights the "
                 "model runs on vs the fp32 master (bf16(master) for reference); final distance to the ZeRO-3 "
                 "run of the same seed.")
    lines.append("")
    lines.append("| variant | topology | seed | " + " | ".join(
        f"{c}: grad err / weight err / dist" for c in classes) + " |")
    lines.append("|---|---|---|" + "---|" * len(classes))
    for r in sorted(runs, key=lambda r: (r["topology"], r["variant"], r["data_seed"])):
        cells, summary = [], probe_summary(r)
        for c in classes:
            names = [n for n, k in r["classes"].items() if k == c]
            ge, we, be = (summary[c][m] for m in PROBE_METRICS)
            dist = (f"{_median([r['final_rel_dist_to_zero3'][n] for n in names]):.3f}"
                    if "final_rel_dist_to_zero3" in r else "-")
            cells.append(f"{ge:.3f} / {we:.4f} ({be:.4f}) / {dist}")
        lines.append(f"| {r['variant']} | {r['topology']} | {_seed_label(r)} | " + " | ".join(cells) + " |")
    if stopped:
        lines += ["", "Stopped before their last step (not counted): " + "; ".join(
            f"{r['variant']} {r['topology']} seed {r['data_seed']} ({r.get('steps_done')} of {r['steps']} steps)"
            for r in stopped) + "."]
    return "\n".join(lines) + "\n"


def report_table(t: dict) -> str:
    """Markdown of an ``--error-table`` JSON: per config and topology, per class, median / max error."""
    rows = t["summary"]
    classes = sorted(next(iter(rows.values())))
    lines = [f"Relative error ||q - e|| / ||e|| of the reduced gradient per parameter tensor, median / max over the "
             f"tensors of each class and {t['batches']} batches, after {t['warm_steps']} exact ZeRO-3 steps.", "",
             "| config | topology | " + " | ".join(classes) + " |", "|---|---|" + "---|" * len(classes)]
    for key, row in rows.items():
        name, topo = key.split("@")
        lines.append(f"| {name} | {topo} | " + " | ".join(f"{row[c]['median']:.3f} / {row[c]['max']:.3f}"
                                                         for c in classes) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["zero3", "sdp4bit"], choices=sorted(VARIANTS))
    p.add_argument("--topologies", nargs="+", default=["2x2"])
    p.add_argument("--data-seeds", nargs="+", type=int, default=[1234])
    p.add_argument("--model-seed", type=int, default=1234)
    p.add_argument("--sdp-seed", type=int, default=DEFAULT_SDP_SEED, help="the sdp4bit block's seed")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bucket-size", type=int, default=50_000_000, help="reduce_bucket_size (elements)")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--probe-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms (and cuBLAS's fixed workspace): a run repeats bit for "
                        "bit, so two variants of one data seed differ by their quantization alone (on a GPU, "
                        "atomics in backward otherwise add run-to-run noise of their own)")
    p.add_argument("--device", default="cpu", help="cpu or cuda: the W ranks share this one device")
    p.add_argument("--backend", default="torch", help="kernel backend (torch, triton, cuda, auto)")
    p.add_argument("--out", required=True, help="JSON file; runs are appended to it (keyed by variant/topo/seed)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--error-table", action="store_true",
                   help="instead of training runs: the per-tensor gradient error table (see error_table)")
    p.add_argument("--table-warm", type=int, default=50)
    p.add_argument("--table-batches", type=int, default=2)
    p.add_argument("--ref-cache", default="/tmp/accuracy_sim_ref",
                   help="where every run leaves its final weights (ZeRO-3's: for the distance of later runs)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds from the start: a run stops early (row status 'stopped', steps_done) when its "
                        "next step and evaluation would end later; a later run of the invocation is skipped when "
                        "the previous run's pace says it would not finish by then")
    p.add_argument("--distances", nargs="*", metavar="RUNS_JSON",
                   help="only fill final_rel_dist_to_zero3 of these --out files' runs from --ref-cache's weights "
                        "(for runs made in parallel processes, where the ZeRO-3 run ended after them)")
    p.add_argument("--compact", nargs="*", metavar="RUNS_JSON",
                   help="write these --out files' runs, without per-tensor probes (their per-class summary kept), "
                        "to --out (for committing many large runs)")
    p.add_argument("--plot", metavar="PNG", help="with --report: the paired gap to ZeRO-3 over steps (gap_curves)")
    p.add_argument("--plot-title", default=None, help="with --plot: the figure's title")
    p.add_argument("--report", nargs="*", metavar="RUNS_JSON",
                   help="only print the markdown tables of these --out files (written to --out as .md)")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    a.deadline_at = time.time() + a.deadline if a.deadline else None
    if a.distances:
        for f in a.distances:
            print(f"{f}: distances filled for {fill_distances(Path(f), Path(a.ref_cache))} run(s)")
        return
    if a.compact:
        runs = [compact(r) for f in a.compact for r in json.loads(Path(f).read_text()).get("runs", [])]
        Path(a.out).write_text(json.dumps({"runs": runs}))
        print(f"{a.out}: {len(runs)} run(s)")
        return
    if a.report:
        docs = [json.loads(Path(f).read_text()) for f in a.report]
        runs = [r for d in docs for r in d.get("runs", [])]
        text = "\n".join([report(runs)] * bool(runs) + [report_table(d) for d in docs if "summary" in d])
        Path(a.out).write_text(text)
        if a.plot:
            plot_gaps(runs, a.plot, a.plot_title or ", ".join(a.report))
        print(text)
        return
    torch.set_num_threads(a.threads)
    if a.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # read when cuBLAS starts: before any matmul
        torch.use_deterministic_algorithms(True)
    corpus, desc = load_corpus(None)
    out = Path(a.out)
    doc = json.loads(out.read_text()) if out.exists() else {"runs": []}
    from benchmarks.suite import git_commit   # $SDP4BIT_COMMIT on the device machine (its tree's git is not ours)
    commit = git_commit()
    args = {k: v for k, v in vars(a).items() if k not in ("variants", "topologies", "data_seeds", "out",
                                                           "verbose", "threads", "deadline_at", "distances")}
    machine = (f"{torch.cuda.get_device_name(a.device)}, torch {torch.__version__}" if a.device.startswith("cuda")
               else f"{os.cpu_count()}-core CPU, torch {torch.__version__}")
    if a.error_table:
        t = error_table(a, corpus)
        t.update({"args": args, "commit": commit, "corpus": desc})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(t, indent=1))
        for key, row in t["summary"].items():
            print(f"{key:28s} " + "  ".join(f"{c} {v['median']:.3f}/{v['max']:.3f}" for c, v in row.items()))
        return
    pace = 0.0   # seconds per step of the previous run (with its evaluation): a run that cannot finish is skipped
    for seed in a.data_seeds:
        for topo in a.topologies:
            for v in a.variants:
                if v == "zero3" and topo != a.topologies[0]:
                    continue   # exact ZeRO-3 does not depend on the topology: one run per seed
                if a.deadline_at and time.time() + pace * a.steps > a.deadline_at:
                    print(f"{v:24s} {topo} seed {seed}: skipped (--deadline: {a.deadline_at - time.time():.0f} s "
                          f"left, the previous run took {pace * a.steps:.0f} s)", flush=True)
                    continue
                r = run(a, v, topo, seed, corpus)
                pace = r["seconds"] / max(1, r["steps_done"])
                cache = Path(a.ref_cache)
                cache.mkdir(parents=True, exist_ok=True)
                torch.save(r.pop("final_weights"), cache / weights_file(r, a))
                r.update({"args": args, "commit": commit, "corpus": desc, "machine": machine})
                doc["runs"] = [x for x in doc["runs"] if run_key(x) != run_key(r)] + [r]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(doc))
                fill_distances(out, cache)
                print(f"{v:24s} {topo} seed {seed}: train {r['train_loss']:.4f} held-out {r['heldout_loss']:.4f} "
                      f"({r['seconds']:.0f} s, {r['status']} after {r['steps_done']} steps)", flush=True)


def run_key(r: dict) -> tuple:
    """One row per (variant, topology, data seed, rounding seed, steps) in an --out file."""
    return r["variant"], r["topology"], r["data_seed"], rounding_seed(r), r["steps"]


def weights_file(r: dict, a=None) -> str:
    """The --ref-cache file of a run's final weights (fp32, by parameter name).  ZeRO-3's name has no
    topology and no rounding seed: it does not depend on them."""
    shape = f"d{r['args']['d_model'] if a is None else a.d_model}_L{r['args']['layers'] if a is None else a.layers}"
    tail = f"seed{r['data_seed']}_steps{r['steps']}_{shape}"
    if r["variant"] == "zero3":
        return f"zero3_{tail}.pt"
    return f"{r['variant']}_{r['topology']}_sdp{rounding_seed(r)}_{tail}.pt"


def fill_distances(out: Path, cache: Path) -> int:
    """Per tensor ||w - w_zero3|| / ||w_zero3|| of the final weights, for the runs of ``out`` that lack it and
    whose weights and the ZeRO-3 run's (same data seed, steps, shape) are in ``cache``; returns how many."""
    doc = json.loads(out.read_text())
    n = 0
    for r in doc["runs"]:
        if r["variant"] == "zero3" or "final_rel_dist_to_zero3" in r or r.get("status", "ok") != "ok":
            continue
        ref_f = cache / weights_file({**r, "variant": "zero3"})
        own_f = cache / weights_file(r)
        if not (ref_f.is_file() and own_f.is_file()):
            continue
        ref, w = torch.load(ref_f), torch.load(own_f)
        r["final_rel_dist_to_zero3"] = {k: float((w[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30))
                                        for k in w}
        n += 1
    if n:
        out.write_text(json.dumps(doc))
    return n

if __name__ == "__main__":
    main()
