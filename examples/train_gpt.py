"""Train the example GPT with DeepSpeed ZeRO-3, plain or with sdp4bit / ZeRO++ communication.

The ds_config (``--ds-config``, e.g. one of ``configs/*.json``) chooses the method; an ``"sdp4bit"`` block
turns SDP4Bit on.  ``import deepspeed_sdp4bit`` happens before ``deepspeed.initialize`` (the package installs
its hooks at import) and a failing import stops the run: it never falls back to plain ZeRO-3 silently.

Launch (one process per GPU / per CPU rank)::

    # GPUs, NCCL (the deepspeed launcher or torchrun):
    python -m deepspeed.launcher.runner --num_gpus 4 examples/train_gpt.py --ds-config configs/sdp4bit.json \\
        --d-model 768 --layers 12 --heads 12 --seq 1024 --micro-batch 8 --steps 500 --lr 6e-4 \\
        --log-json runs/sdp4bit.json
    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py --ds-config configs/zero3.json ...

    # CPU, gloo (DS_ACCELERATOR=cpu is set by the script when torch sees no GPU; both launchers work).
    # Checked on a 2-core machine: 150 steps, loss 5.37 -> 2.64 (last 50), held-out 2.55, ~210 ms/step,
    # 61 s in all (about 20 s of it start-up: imports 6 s, deepspeed.initialize 10 s, corpus 2 s):
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 examples/train_gpt.py \\
        --ds-config configs/zero3.json --d-model 64 --layers 2 --heads 4 --seq 64 --micro-batch 4 \\
        --steps 150 --lr 3e-3 --eval-every 50 --eval-batches 4 --log-json /tmp/zero3_cpu.json
    DS_ACCELERATOR=cpu python -m deepspeed.launcher.runner --num_gpus 4 examples/train_gpt.py ...same...

On CPU the script also turns off DeepSpeed's shared-memory allreduce op (a ~40 s JIT build; gloo is
enough), uses torch's AdamW (``--torch-adam auto``; FusedAdam would need a JIT build) and gives each rank
cores // ranks-per-host threads when OMP_NUM_THREADS is unset (the deepspeed launcher leaves it unset;
oversubscribed ranks ran ~10x slower).  ZeRO++ (configs/zeropp.json) does not run on CPU: its quantizer op
has no CPU implementation.

Data: by default the bytes of the Python standard library source (vocab 256), last 5% held out; ``--data
PATH...`` trains on your files instead; ``--random-tokens`` draws uniform ids (vocab 50304) for throughput
runs.  Batches depend only on (``--data-seed``, step, micro-batch, rank), so every config sees the same data;
``--replay-ranks K`` makes each rank draw the micro-batches of K ranks in turn as gradient accumulation, so
world size 1 with K = 4 replays a 4-rank run's data and global batch (the accuracy benchmark's ZeRO-3
reference; tests/test_benchmarks.py checks it against a real 4-rank run).

Schedule: linear warm-up over ``--warmup`` steps to ``--lr``, then cosine decay to ``--lr * --min-lr-ratio``
at ``--steps``.  The script sets the learning rate itself; a ``"scheduler"`` block in the ds_config is
removed (with a notice).  ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` come from
``--micro-batch`` / ``--grad-accum`` and override the file; ``train_batch_size`` is derived by DeepSpeed.
``--ds-set KEY=JSON`` overrides any ds_config entry (dotted path), e.g.
``--ds-set zero_optimization.stage3_param_persistence_threshold=0`` (needed for tiny models: by default
ZeRO-3 keeps every parameter with < 1e5 elements unpartitioned, which for d=64 is all of them).

Log (``--log-json``, written by rank 0, rewritten atomically every ``--log-flush`` steps): ``meta`` (args,
world size, parameter count, FLOP formula, corpus, final ds_config, the parsed sdp4bit block, where the
sdp4bit communication summary comes from or why it is absent), ``steps`` (per optimizer step: loss = mean
over ranks and micro-batches, lr, ms, tokens/s, peak memory of rank 0, grad norm, the sdp4bit summary),
``evals`` (held-out loss) and ``final``.  ms/step is wall time from before the first micro-batch to after
the optimizer step and the loss all-reduce (evaluation and checkpointing are outside it).  ``cycle_ms`` (one
engine only; None for the first step of a run or of a resumed run, and with ``--paired-ds-config``): from the
previous step's end to this one's, i.e. ``ms`` plus whatever the loop did between them (the record, the log
write, an evaluation or a save, which inflate the next step's value), during which work ``step()`` left in flight
(an overlapped weight refresh) still runs.  ``--overlap-blocks N`` switches the overlapped weight refresh on and off
in blocks of N steps (records get ``overlap`` and ``block_first``): both modes timed in one process.

Checkpoints: ``--checkpoint-dir DIR --save-every N`` (and always at the end); ``--resume`` continues from
DIR's latest checkpoint (data order and schedule continue exactly; the log is continued too).
"""

from __future__ import annotations

import os
import sys
import time

_T_PROCESS = time.perf_counter()  # startup phases are logged relative to this

# Must happen before torch is imported: CUDA_VISIBLE_DEVICES is read once.  Each rank then sees one GPU,
# which makes DeepSpeed (ZeRO++ counts nodes as world_size / device_count) and sdp4bit's automatic topology
# (gpus_per_node omitted) treat every rank as its own node.
if "--one-gpu-per-rank" in sys.argv:
    _local = int(os.environ.get("LOCAL_RANK", "0"))
    _visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    _devices = _visible.split(",") if _visible else [str(i) for i in range(64)]
    os.environ["CUDA_VISIBLE_DEVICES"] = _devices[_local]
    os.environ["LOCAL_RANK"] = "0"
    os.environ["LOCAL_WORLD_SIZE"] = os.environ["LOCAL_SIZE"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
from typing import Optional  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

# DeepSpeed 0.19.8 calls torch.distributed.{all_gather_into_tensor,reduce_scatter_tensor}, which this torch
# deprecates with a FutureWarning per call site and rank: pure noise in a training log.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated", category=FutureWarning)

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _p in (_HERE, _REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

ON_CPU = not torch.cuda.is_available()
if ON_CPU:
    # DeepSpeed picks its accelerator at first import; without this it may probe for others and warn.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import wire_count  # noqa: E402

if "--count-wire-bytes" in sys.argv:
    # before DeepSpeed is imported: deepspeed.comm keeps the torch.distributed functions it finds at start
    wire_count.install()

import deepspeed  # noqa: E402

try:
    import deepspeed_sdp4bit  # noqa: E402  (installs the DeepSpeed integration at import)
except Exception as _e:  # noqa: BLE001 - re-raised with context: this must never be skipped silently
    raise SystemExit(f"train_gpt.py: `import deepspeed_sdp4bit` failed ({type(_e).__name__}: {_e}).\n"
                     f"The run stops here rather than silently training without the sdp4bit integration; "
                     f"fix the package (it is at {_REPO}) first.") from _e

from data import build_samplers  # noqa: E402
from dsconfig import apply_ds_set  # noqa: E402
from gpt import GPT, GPTConfig, count_params, flops_per_token  # noqa: E402
from shutdown import exit_ranks  # noqa: E402

DEFAULT_RANDOM_VOCAB = 50304
STEP_SYNCS = ("device", "stream")   # --step-sync


# ----------------------------------------------------------------------------------------------- arguments

def parse_args(argv=None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds-config", required=True, help="path of the DeepSpeed JSON config")
    p.add_argument("--ds-set", action="append", default=[], metavar="KEY=JSON",
                   help="override a ds_config entry by dotted path; the value is parsed as JSON if it can be")
    m = p.add_argument_group("model")
    m.add_argument("--d-model", type=int, default=768)
    m.add_argument("--layers", type=int, default=12)
    m.add_argument("--heads", type=int, default=12)
    m.add_argument("--seq", type=int, default=1024, help="sequence length (also the position-table size)")
    m.add_argument("--vocab", type=int, default=None,
                   help=f"vocabulary (default 256 for byte data, {DEFAULT_RANDOM_VOCAB} with --random-tokens)")
    m.add_argument("--seed", type=int, default=1234, help="model initialisation seed")
    m.add_argument("--zero-init", action="store_true", help="build the model under deepspeed.zero.Init")
    d = p.add_argument_group("data")
    d.add_argument("--data", nargs="+", default=None, metavar="PATH",
                   help="text files/directories to train on (default: the Python stdlib source)")
    d.add_argument("--random-tokens", action="store_true", help="uniform random token ids (throughput runs)")
    d.add_argument("--data-seed", type=int, default=None, help="batch-order seed (default: --seed)")
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per micro-batch")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--replay-ranks", type=int, default=1, metavar="K",
                   help="each rank replays the micro-batches of K data-parallel ranks in order, as gradient "
                        "accumulation (world size 1 with K=4 sees the data and global batch of a 4-rank run)")
    t.add_argument("--steps", type=int, default=500, help="optimizer steps in total")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 1%% of --steps, >= 1)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    t.add_argument("--deterministic", action="store_true",
                   help="torch's deterministic algorithms (CUBLAS_WORKSPACE_CONFIG=:4096:8, "
                        "torch.use_deterministic_algorithms(True); an op without a deterministic implementation "
                        "raises): on a GPU a repeat of a run can then give the same losses, so two configs of one "
                        "seed differ by what they compute, not by atomics")
    t.add_argument("--torch-adam", choices=("auto", "yes", "no"), default="auto",
                   help="use torch.optim.AdamW instead of DeepSpeed's FusedAdam (auto: yes on CPU, where "
                        "FusedAdam would need a JIT build)")
    e = p.add_argument_group("evaluation and logging")
    e.add_argument("--eval-every", type=int, default=100, help="held-out evaluation interval (0: only at end)")
    e.add_argument("--eval-batches", type=int, default=8, help="micro-batches per rank per evaluation (0: none)")
    e.add_argument("--log-json", default=None, help="where rank 0 writes the JSON log")
    e.add_argument("--log-flush", type=int, default=25, help="rewrite the log every N steps")
    e.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-dir", default=None)
    c.add_argument("--save-every", type=int, default=0, help="checkpoint interval in steps (0: only at end)")
    c.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir's latest checkpoint")
    c.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="stop after step N with a checkpoint, the schedule still that of --steps (0: run to --steps); "
                        "a later --resume goes on from there")
    c.add_argument("--stop-at-time", type=float, default=0.0, metavar="UNIX_SECONDS",
                   help="stop, as --stop-after does, after the first step that ends past this wall-clock time on any "
                        "rank (0: never); for a run split over calls of a lent machine")
    p.add_argument("--one-gpu-per-rank", action="store_true",
                   help="each rank sees only its own GPU and counts as its own node (see the code)")
    p.add_argument("--count-wire-bytes", action="store_true",
                   help="count the bytes this rank sends through torch.distributed collectives, per step "
                        "(examples/wire_count.py; every step's record gets wire_counted)")
    b = p.add_argument_group("benchmarking (timing only)")
    b.add_argument("--paired-ds-config", default=None, metavar="PATH",
                   help="build a second engine from this ds_config (same model, seed and batches) and time the two "
                        "in one process, their steps alternating A B B A ...: each step's record gets "
                        "paired_ms / paired_loss / paired_first; for ratios of two configs that a run-to-run "
                        "spread would hide (e.g. SDP4Bit off vs ZeRO-3); not with checkpoints, evaluation or "
                        "--count-wire-bytes (both engines' traffic would mix)")
    b.add_argument("--paired-ds-set", action="append", default=[], metavar="KEY=JSON",
                   help="--ds-set for the --paired-ds-config")
    b.add_argument("--overlap-blocks", type=int, default=0, metavar="N",
                   help="time the overlapped weight refresh against the refresh inside step() in ONE process: "
                        "steps in blocks of N, weights.overlap on in blocks 0, 3, 4, 7, 8, ... and off in the others "
                        "(on off off on: each mode first in every other pair of blocks), switched through "
                        "engine.sdp4bit.overlap; each step's record gets overlap (its mode) and block_first (the "
                        "first step of a block, half of either mode: its forward or its refresh meets the other "
                        "mode's).  Needs weights.overlap active (the full replica on a GPU; with the key omitted, "
                        "where the engine's probe of the link turned it on, else nothing is switched and the log's "
                        "meta says why); not with --paired-ds-config")
    b.add_argument("--step-sync", choices=STEP_SYNCS, default="device",
                   help="what a timed step waits for before and after it on a GPU: 'device' (default, every "
                        "committed row up to the nineteenth session) every stream of the device "
                        "(torch.cuda.synchronize), so work a config leaves in flight on a side stream (the "
                        "overlapped weight refresh, weights.overlap) is timed inside the step that queued it and "
                        "never beside the next one; 'stream' the current stream only, as a training loop that reads "
                        "its loss waits: what a side stream still runs is waited for where the next step needs it, "
                        "inside that step's time")
    b.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="torch.profiler over the last N steps (CPU and CUDA): rank 0 writes a Chrome trace and "
                        "the top ops to --profile-dir")
    b.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="where --profile-steps writes <log name>.trace.json.gz and <log name>.profile.txt")
    p.add_argument("--allow-no-sdp4bit-evidence", action="store_true",
                   help="run even when an sdp4bit config shows no sign of the integration after initialize")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    for name in ("d_model", "layers", "heads", "seq", "micro_batch", "grad_accum", "steps", "replay_ranks"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("eval_every", "eval_batches", "save_every", "stop_after"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if a.log_flush < 1:
        p.error(f"--log-flush must be >= 1, got {a.log_flush}")
    if a.count_wire_bytes and not wire_count.installed():
        p.error("--count-wire-bytes must be on the command line (the counter is installed before DeepSpeed is "
                "imported)")
    if not a.lr > 0:
        p.error(f"--lr must be > 0, got {a.lr}")
    if not 0.0 <= a.min_lr_ratio <= 1.0:
        p.error(f"--min-lr-ratio must be in [0, 1], got {a.min_lr_ratio}")
    if a.warmup is None:
        a.warmup = max(1, a.steps // 100)
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.vocab is None:
        a.vocab = DEFAULT_RANDOM_VOCAB if a.random_tokens else 256
    if a.data_seed is None:
        a.data_seed = a.seed
    if a.stop_at_time < 0:
        p.error(f"--stop-at-time must be >= 0, got {a.stop_at_time}")
    if (a.resume or a.save_every or a.stop_after or a.stop_at_time) and not a.checkpoint_dir:
        p.error("--resume, --save-every, --stop-after and --stop-at-time need --checkpoint-dir")
    if a.stop_after >= a.steps:
        p.error(f"--stop-after must be below --steps ({a.steps}), got {a.stop_after}")
    if a.d_model % a.heads:
        p.error(f"--d-model ({a.d_model}) must be divisible by --heads ({a.heads})")
    if a.paired_ds_set and not a.paired_ds_config:
        p.error("--paired-ds-set needs --paired-ds-config")
    if a.paired_ds_config and (a.checkpoint_dir or a.resume or a.count_wire_bytes or a.eval_every or a.eval_batches):
        p.error("--paired-ds-config times two engines: it excludes --checkpoint-dir / --resume / "
                "--count-wire-bytes, and needs --eval-every 0 --eval-batches 0")
    if a.paired_ds_config and a.step_sync == "stream":
        p.error("--paired-ds-config with --step-sync stream: what one engine leaves in flight (an overlapped weight "
                "refresh) would run during the other engine's timed step; pair with --step-sync device")
    if a.overlap_blocks < 0 or a.overlap_blocks == 1:
        p.error(f"--overlap-blocks must be 0 (off) or >= 2 (a block's first step is half of either mode), got "
                f"{a.overlap_blocks}")
    if a.overlap_blocks and a.paired_ds_config:
        p.error("--overlap-blocks and --paired-ds-config: one comparison per process")
    if a.profile_steps < 0 or a.profile_steps > a.steps:
        p.error(f"--profile-steps must be in [0, --steps={a.steps}], got {a.profile_steps}")
    if bool(a.profile_steps) != bool(a.profile_dir):
        p.error("--profile-steps and --profile-dir go together")
    return a


def overlap_blocks_left_off(engine, sdp_cfg) -> Optional[str]:
    """For ``--overlap-blocks``: None where ``engine`` overlaps its weight refresh (switchable); why not where the
    ds_config left ``weights.overlap`` to the engine (omitted) and it is off (a fast link, a CPU, the node replica,
    SDP4Bit off): such a run switches nothing.  An engine whose config turned it off, or that has no sdp4bit block
    at all, is refused (SystemExit)."""
    st = getattr(engine, "sdp4bit", None)
    if st is not None and getattr(st, "overlap", False):
        return None
    if sdp_cfg.never_overlaps is None and sdp_cfg.weights.overlap is None:
        chosen = getattr(st, "overlap_choice", None) if st is not None else None
        if chosen:
            return chosen["reason"]
        if st is None:   # SDP4Bit off for this engine: its summary says why
            summary = getattr(engine, "sdp4bit_summary", None)
            why = (summary() if callable(summary) else {}).get("reason")
            return f"SDP4Bit is off for this engine ({why or 'no reason recorded'})"
        return "no weight replica to refresh"
    raise SystemExit("train_gpt.py: --overlap-blocks switches weights.overlap step by step, but this engine does "
                     "not overlap its weight refresh (sdp4bit.weights.overlap true with the full replica on a "
                     "GPU is needed; on a CPU, with the node replica or with SDP4Bit off it never does)")


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine to lr * min_lr_ratio."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(1, args.steps - args.warmup)
    progress = min(1.0, (step - args.warmup) / span)
    floor = args.lr * args.min_lr_ratio
    return floor + (args.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------------- ds_config

def build_ds_config(args: argparse.Namespace, notices: list, paired: bool = False) -> dict:
    """The ds_config dict for this run: the file, the --ds-set overrides, then the batch/optimizer fields
    (``paired``: the same from --paired-ds-config / --paired-ds-set)."""
    path, sets = (args.paired_ds_config, args.paired_ds_set) if paired else (args.ds_config, args.ds_set)
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise SystemExit(f"{'--paired-ds-config' if paired else '--ds-config'} {path}: the file must hold a JSON "
                         "object")
    apply_ds_set(cfg, sets)
    if "train_batch_size" in cfg:
        notices.append("train_batch_size removed from the ds_config (derived from --micro-batch/--grad-accum)")
        cfg.pop("train_batch_size")
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    cfg["gradient_accumulation_steps"] = args.grad_accum * args.replay_ranks
    if "scheduler" in cfg:
        notices.append("ds_config 'scheduler' removed: train_gpt.py sets the learning rate itself")
        cfg.pop("scheduler")
    opt = cfg.setdefault("optimizer", {"type": "AdamW",
                                       "params": {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}})
    params = opt.setdefault("params", {})
    params["lr"] = args.lr
    use_torch_adam = args.torch_adam == "yes" or (args.torch_adam == "auto" and ON_CPU)
    if use_torch_adam:
        params["torch_adam"] = True
    elif args.torch_adam == "no":
        params.pop("torch_adam", None)
    # DeepSpeed's own periodic prints would tear the progress bar; the JSON log has the numbers.
    cfg.setdefault("steps_per_print", 10 ** 9)
    return cfg


# ----------------------------------------------------------------------------------------------- helpers

def _device() -> torch.device:
    if ON_CPU:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _sync(mode: str = "device") -> None:
    """Wait for the GPU's work (nothing on CPU): every stream of the device, or (``"stream"``) the current one."""
    if ON_CPU:
        return
    if mode == "stream":
        torch.cuda.current_stream().synchronize()
    else:
        torch.cuda.synchronize()


def _peak_mem_bytes() -> int:
    """Peak memory of this process: CUDA max allocated on GPUs, the process's peak RSS on CPU."""
    if not ON_CPU:
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _find_summary(engine):
    """The sdp4bit per-step communication summary callable, and a note on where it came from."""
    for owner_name, owner in (("engine", engine), ("engine.optimizer", getattr(engine, "optimizer", None))):
        fn = getattr(owner, "sdp4bit_summary", None) if owner is not None else None
        if callable(fn):
            return fn, f"{owner_name}.sdp4bit_summary()"
    return None, "absent: neither the engine nor its optimizer has sdp4bit_summary()"


def _sdp4bit_evidence(engine):
    """How the engine shows that the sdp4bit integration took over, or None when nothing does.

    Looks for an attribute named ``*sdp4bit*`` on the engine or its optimizer, or a class from the
    ``deepspeed_sdp4bit`` package in their class hierarchies.
    """
    for owner_name, owner in (("engine", engine), ("engine.optimizer", getattr(engine, "optimizer", None))):
        if owner is None:
            continue
        for cls in type(owner).__mro__:
            if cls.__module__.startswith("deepspeed_sdp4bit"):
                return f"{owner_name} is a {cls.__module__}.{cls.__qualname__}"
        names = [n for n in list(vars(owner)) + dir(type(owner)) if "sdp4bit" in n.lower()]
        if names:
            return f"{owner_name} has {sorted(set(names))}"
    return None


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


class JsonLog:
    """Rank 0's JSON log, rewritten atomically (a crash leaves the last complete version)."""

    def __init__(self, path, enabled: bool):
        self.path, self.enabled = path, bool(path) and enabled
        self.doc = {"meta": {}, "steps": [], "evals": [], "final": None}

    def continue_from(self, start_step: int) -> None:
        """Keep the existing log's records up to ``start_step`` (on resume)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            old = json.load(f)
        self.doc["steps"] = [r for r in old.get("steps", []) if r["step"] <= start_step]
        self.doc["evals"] = [r for r in old.get("evals", []) if r["step"] <= start_step]
        self.doc["meta"]["previous_meta"] = old.get("meta")

    def write(self) -> None:
        if not self.enabled:
            return
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".log_", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.doc, f, default=str)
        os.replace(tmp, self.path)


def _write_profile(prof, args: argparse.Namespace, n_steps: int) -> None:
    """--profile-steps: the Chrome trace (gzipped) and the top ops by self CPU and by self device time."""
    import gzip
    import shutil
    stem = os.path.splitext(os.path.basename(args.log_json or "train_gpt"))[0]
    os.makedirs(args.profile_dir, exist_ok=True)
    base = os.path.join(args.profile_dir, stem)
    prof.export_chrome_trace(base + ".trace.json")
    with open(base + ".trace.json", "rb") as f, gzip.open(base + ".trace.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(base + ".trace.json")
    ka = prof.key_averages()
    with open(base + ".profile.txt", "w") as f:
        f.write(f"{n_steps} profiled step(s); times are totals over them\n\n")
        for key in ("self_cpu_time_total",) + (() if ON_CPU else ("self_device_time_total",)):
            f.write(f"== by {key}\n{ka.table(sort_by=key, row_limit=40)}\n")


# ----------------------------------------------------------------------------------------------- main

def evaluate(engine, samplers, n_batches: int, device) -> float:
    """Mean held-out loss over ``n_batches`` micro-batches of each sampler (one per replayed rank) on every
    rank (all ranks see the same value)."""
    engine.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for sampler in samplers:
            for i in range(n_batches):
                x, y = sampler.eval_batch(i)
                total += engine(x.to(device), y.to(device)).double()
    engine.train()
    torch.distributed.all_reduce(total)
    return total.item() / (n_batches * len(samplers) * torch.distributed.get_world_size())


def replay_samplers(sampler, rank: int, world: int, k: int) -> list:
    """``k`` copies of ``sampler`` acting as data-parallel ranks ``rank*k .. rank*k+k-1`` of ``world*k``.

    Batches depend only on (data seed, step, micro, rank), so world size 1 with k = 4 draws exactly the
    micro-batches that ranks 0..3 of a 4-rank run draw.
    """
    if k == 1:
        return [sampler]
    out = []
    for j in range(k):
        c = copy.copy(sampler)
        c.rank, c.world_size = rank * k + j, world * k
        out.append(c)
    return out


def main(argv=None) -> dict:
    """Run the training job; returns the ``final`` record (on every rank)."""
    args = parse_args(argv)
    notices: list = []
    phases = {"imports": time.perf_counter() - _T_PROCESS}
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # read when cuBLAS starts: before any matmul
        torch.use_deterministic_algorithms(True)
    t_phase = time.perf_counter()

    def phase(name):
        nonlocal t_phase
        now = time.perf_counter()
        phases[name] = now - t_phase
        t_phase = now

    if ON_CPU:
        # The CPU accelerator otherwise JIT-compiles its shared-memory allreduce (~40 s) at init; gloo suffices.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # Oversubscribed CPU ranks (OpenMP spin-waits plus gloo) run many times slower: share the cores.
        # torchrun sets OMP_NUM_THREADS=1 and LOCAL_WORLD_SIZE; the deepspeed launcher only LOCAL_SIZE.
        local_ws = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1")
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_ws)))
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="gloo" if ON_CPU else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = _device()
    phase("init_distributed")

    ds_config = build_ds_config(args, notices)
    # Validate the sdp4bit block (and its cross-checks) before any expensive work; errors name the key.
    sdp_cfg = deepspeed_sdp4bit.parse_ds_config(ds_config)

    mcfg = GPTConfig(vocab=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                     n_heads=args.heads)

    def build_engine(cfg: dict):
        if args.zero_init:
            dtype = (torch.bfloat16 if cfg.get("bf16", {}).get("enabled")
                     else torch.float16 if cfg.get("fp16", {}).get("enabled") else torch.float32)
            with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=dtype):
                model = GPT(mcfg, seed=args.seed)
        else:
            model = GPT(mcfg, seed=args.seed)
        # The tied head uses wte.weight outside the embedding's own forward: ZeRO-3 must gather it for the
        # whole model forward (harmless for other stages).
        deepspeed.zero.register_external_parameter(model, model.wte.weight)
        n = count_params(model)
        phase("build_model")
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        phase("deepspeed_initialize")
        return eng, n

    engine, n_params = build_engine(ds_config)
    paired = paired_config = None
    paired_active = False
    if args.paired_ds_config:
        paired_config = build_ds_config(args, notices, paired=True)
        # its errors too name the key, before the build
        paired_active = deepspeed_sdp4bit.parse_ds_config(paired_config).active
        first = {k: phases[k] for k in ("build_model", "deepspeed_initialize")}
        paired, _ = build_engine(paired_config)
        phases["paired_engine"] = phases["build_model"] + phases["deepspeed_initialize"]
        phases.update(first)
    summary_fn, summary_source = _find_summary(engine)
    paired_summary_fn = _find_summary(paired)[0] if paired is not None else None
    evidence = _sdp4bit_evidence(engine) if sdp_cfg.active else None
    paired_evidence = _sdp4bit_evidence(paired) if paired_active else None
    for which, active, ev in (("--ds-config", sdp_cfg.active, evidence),
                              ("--paired-ds-config", paired_active, paired_evidence)):
        if not active or ev is not None:
            continue
        msg = (f"the {which} ds_config enables sdp4bit, but after deepspeed.initialize neither the engine nor its "
               "optimizer shows any trace of the sdp4bit integration (no *sdp4bit* attribute, no class from "
               "deepspeed_sdp4bit): this run would be plain ZeRO-3 under an sdp4bit label")
        if not args.allow_no_sdp4bit_evidence:
            raise SystemExit(f"train_gpt.py: {msg}. Stopping (override with --allow-no-sdp4bit-evidence).")
        notices.append("WARNING: " + msg)
    if sdp_cfg.active and summary_fn is None and rank == 0:
        print("WARNING: the ds_config enables sdp4bit but the engine exposes no sdp4bit_summary(); the log "
              "will carry no communication summary", file=sys.stderr, flush=True)

    chosen = getattr(getattr(engine, "sdp4bit", None), "overlap_choice", None)   # weights.overlap omitted
    # --overlap-blocks that switched nothing: why (the automatic choice left it off; the steps run as the default
    # runs there, and the log's meta says why: sdp4bit_overlap_choice)
    overlap_left_off = overlap_blocks_left_off(engine, sdp_cfg) if args.overlap_blocks else None
    if overlap_left_off is not None:
        notices.append("--overlap-blocks: nothing switched, weights.overlap omitted and decided off "
                       f"({overlap_left_off})")
        args.overlap_blocks = 0

    train_s, eval_s, data_desc = build_samplers(
        data_paths=args.data, random_tokens=args.random_tokens, vocab=args.vocab, seq_len=args.seq,
        micro_batch=args.micro_batch, seed=args.data_seed, rank=rank, world_size=world)
    train_list = replay_samplers(train_s, rank, world, args.replay_ranks)
    eval_list = replay_samplers(eval_s, rank, world, args.replay_ranks)
    phase("load_data")

    start_step = 0
    if args.resume:
        load_path, client = engine.load_checkpoint(args.checkpoint_dir)
        if load_path is None:
            notices.append(f"--resume: no checkpoint in {args.checkpoint_dir}; starting from step 0")
        else:
            start_step = int(client["step"])
            notices.append(f"resumed from {load_path} at step {start_step}")
        phase("load_checkpoint")

    tokens_per_step = args.micro_batch * args.grad_accum * args.replay_ranks * args.seq * world
    dense_fpt, attn_fpt = flops_per_token(mcfg)
    log = JsonLog(args.log_json, enabled=rank == 0)
    if args.resume:
        log.continue_from(start_step)
    log.doc["meta"].update({
        "args": vars(args), "world_size": world, "n_params": n_params, "model": mcfg.__dict__,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": {"dense_6N": dense_fpt, "attention": attn_fpt,
                            "formula": "TFLOPS/GPU = 6 * n_params * tokens_per_s / world_size / 1e12 "
                                       "(attention FLOPs 12*L*d*T per token not included)"},
        "data": data_desc, "device": (torch.cuda.get_device_name() if not ON_CPU else "cpu"),
        "backend": torch.distributed.get_backend(), "ds_config": ds_config,
        "sdp4bit_config": sdp_cfg.model_dump() if sdp_cfg.active else None,
        "sdp4bit_summary_source": summary_source, "sdp4bit_evidence": evidence,
        "sdp4bit_replica": getattr(getattr(engine, "sdp4bit", None), "level", None),
        "sdp4bit_overlap_choice": chosen, "overlap_blocks_left_off": overlap_left_off,
        "peak_mem_kind": "cpu_maxrss_bytes" if ON_CPU else "cuda_max_allocated_bytes",
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                     "deepspeed_sdp4bit": getattr(deepspeed_sdp4bit, "__version__", None),
                     "python": sys.version.split()[0],
                     "nccl": (".".join(map(str, torch.cuda.nccl.version())) if not ON_CPU else None)},
        "env": {k: os.environ[k] for k in sorted(os.environ)
                if k.startswith(("NCCL_", "DS_ACCELERATOR", "CUDA_VISIBLE", "OMP_NUM", "LOCAL_WORLD", "LOCAL_SIZE"))},
        "notices": notices, "startup_s": phases, "start_step": start_step,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "paired_ds_config": paired_config,
        "paired_sdp4bit_replica": getattr(getattr(paired, "sdp4bit", None), "level", None),
        "paired_sdp4bit_evidence": paired_evidence,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })
    if rank == 0:
        for n in notices:
            print(f"train_gpt.py: {n}", flush=True)
        print(f"train_gpt.py: {n_params / 1e6:.2f}M params, world {world}, {tokens_per_step} tokens/step, "
              f"data: {data_desc}", flush=True)
    log.write()

    def run_eval(step: int, pbar=None):
        if args.eval_batches == 0:
            return None
        loss = evaluate(engine, eval_list, args.eval_batches, device)
        log.doc["evals"].append({"step": step, "heldout_loss": loss})
        if rank == 0:
            msg = f"step {step}: held-out loss {loss:.4f}"
            pbar.write(msg) if pbar is not None else print(msg, flush=True)
        log.write()
        return loss

    def save(step: int):
        engine.save_checkpoint(args.checkpoint_dir, tag=f"step{step:07d}", client_state={"step": step})

    from tqdm import tqdm
    pbar = tqdm(total=args.steps, initial=start_step, disable=(rank != 0 or args.no_progress),
                dynamic_ncols=True, mininterval=1.0, desc="train")
    if args.eval_every and start_step == 0:
        run_eval(0, pbar)

    if args.stop_after and args.stop_after <= start_step:
        raise SystemExit(f"train_gpt.py: --stop-after {args.stop_after} is not after the step the checkpoint "
                         f"resumed at ({start_step})")
    end_step = args.stop_after or args.steps

    def train_step(eng, step: int, lr: float, tag: str):
        """One optimizer step of ``eng``: (mean loss, whether a rank is past --stop-at-time, seconds)."""
        for group in eng.optimizer.param_groups:
            group["lr"] = lr
        _sync(args.step_sync)
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"train_step {step + 1} {tag}"):   # marks steps in a --profile-steps trace
            # [summed loss, ranks past --stop-at-time]: one all-reduce per step carries both, so every rank stops
            # at the same step
            acc = torch.zeros(2, dtype=torch.float32, device=device)
            for sampler in train_list:  # replayed ranks in order (one unless --replay-ranks)
                for micro in range(args.grad_accum):
                    x, y = sampler.batch(step, micro)
                    loss = eng(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                    eng.backward(loss)
                    eng.step()  # DeepSpeed only updates at the last micro-batch of the accumulation window
                    acc[0] += loss.detach().float()
            if args.stop_at_time and time.time() > args.stop_at_time:
                acc[1] = 1.0
            torch.distributed.all_reduce(acc)
            loss_total, past = acc.tolist()
            _sync(args.step_sync)
        return loss_total / (args.grad_accum * args.replay_ranks * world), past, time.perf_counter() - t0

    def destroy():   # before exit_ranks, which runs no destructors (a decoupled checkpoint writer commits here)
        for eng in (engine, paired):
            if eng is not None:
                eng.destroy()

    prof = None
    # the last --profile-steps steps (from the first step of a resumed run that starts inside them)
    prof_from = max(end_step - args.profile_steps, start_step) if args.profile_steps else None
    prev_end = None   # when the previous step ended (cycle_ms; one engine only)
    with contextlib.ExitStack() as exits:   # closes the profiler however the loop ends
        for step in range(start_step, end_step):
            lr = lr_at(step, args)
            if step == prof_from:
                acts = [torch.profiler.ProfilerActivity.CPU] + ([] if ON_CPU else [torch.profiler.ProfilerActivity.CUDA])
                prof = exits.enter_context(torch.profiler.profile(activities=acts))
            sent0 = wire_count.snapshot() if args.count_wire_bytes else None
            pair = cycle_ms = None
            if args.overlap_blocks:   # blocks on off off on ...: each mode first in every other pair
                block = step // args.overlap_blocks
                engine.sdp4bit.overlap = block % 4 in (0, 3)
            if paired is None:
                mean_loss, past_time, dt = train_step(engine, step, lr, "A")
                # from the previous step's end to this one's: ``ms`` plus what the loop did between the two (its
                # record, the log write, an evaluation or save), during which work left in flight (an overlapped
                # weight refresh) runs uncounted by ``ms``
                t_end = time.perf_counter()
                cycle_ms, prev_end = (None if prev_end is None else (t_end - prev_end) * 1e3), t_end
            elif step % 2 == 0:   # A B, then B A: each engine goes first in every other step
                mean_loss, past_time, dt = train_step(engine, step, lr, "A")
                pair = train_step(paired, step, lr, "B")
            else:
                pair = train_step(paired, step, lr, "B")
                mean_loss, past_time, dt = train_step(engine, step, lr, "A")

            rec = {"step": step + 1, "loss": mean_loss, "lr": lr, "ms": dt * 1e3,
                   "cycle_ms": cycle_ms,
                   "tokens_per_s": tokens_per_step / dt, "peak_mem_bytes": _peak_mem_bytes()}
            if args.overlap_blocks:
                rec.update(overlap=engine.sdp4bit.overlap, block_first=step % args.overlap_blocks == 0)
            if pair is not None:
                rec.update(paired_loss=pair[0], paired_ms=pair[2] * 1e3, paired_first=step % 2 == 1)
                past_time = past_time or pair[1]
            gn = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
            rec["grad_norm"] = float(gn) if gn is not None else None
            if sent0 is not None:   # bytes this rank sent in the step, by "<op>@<group size>:<intra|inter>"
                rec["wire_counted"] = wire_count.delta(wire_count.snapshot(), sent0)
            if summary_fn is not None:
                rec["sdp4bit"] = _jsonable(summary_fn())
            if pair is not None and paired_summary_fn is not None:
                rec["paired_sdp4bit"] = _jsonable(paired_summary_fn())
            bad = [f"non-finite loss{w} {x} at step {step + 1}" for w, x in
                   (("", mean_loss), (" of the paired engine", pair and pair[0])) if x is not None and not math.isfinite(x)]
            if bad:
                log.doc["steps"].append(rec)
                log.doc["final"] = {"error": bad[0]}
                log.write()
                raise SystemExit(f"train_gpt.py: {bad[0]}")
            log.doc["steps"].append(rec)
            pbar.set_postfix(loss=f"{mean_loss:.4f}", ms=f"{dt * 1e3:.0f}", refresh=False)
            pbar.update(1)

            done = step + 1
            if args.eval_every and done % args.eval_every == 0 and done != args.steps:
                run_eval(done, pbar)
            if past_time and done < end_step:
                end_step = done   # --stop-at-time: stop here, as --stop-after would
            if args.checkpoint_dir and args.save_every and done % args.save_every == 0 and done != end_step:
                save(done)
            if done % args.log_flush == 0:
                log.write()
            if done == end_step:
                break
    pbar.close()
    if prof is not None:
        if rank == 0:
            _write_profile(prof, args, done - prof_from)

    if end_step < args.steps:  # --stop-after / --stop-at-time: a checkpoint to go on from, no final evaluation
        save(end_step)
        log.doc["final"] = {"stopped_after": end_step, "steps": args.steps,
                            "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        log.write()
        if rank == 0:
            print(f"train_gpt.py: stopped after step {end_step} of {args.steps} (checkpoint in "
                  f"{args.checkpoint_dir}; --resume goes on)", flush=True)
        destroy()
        return log.doc["final"]

    heldout = run_eval(args.steps)
    if args.checkpoint_dir and start_step < args.steps:
        save(args.steps)
    peak = torch.tensor([_peak_mem_bytes()], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    steps = log.doc["steps"]
    tail = steps[-min(50, len(steps)):] if steps else []
    final = {"steps": args.steps, "heldout_loss": heldout,
             "train_loss_last50": (sum(r["loss"] for r in tail) / len(tail)) if tail else None,
             "peak_mem_bytes_max_over_ranks": int(peak.item()),
             "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if summary_fn is not None:
        final["sdp4bit"] = _jsonable(summary_fn())
    log.doc["final"] = final
    log.write()
    if rank == 0:
        print("train_gpt.py: done " + json.dumps(final), flush=True)
    destroy()
    return final


if __name__ == "__main__":
    main()
    exit_ranks()
