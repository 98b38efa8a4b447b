"""GPT-2 trained through the Hugging Face ``Trainer`` (accelerate underneath) with DeepSpeed ZeRO-3 and SDP4Bit.

The Trainer path of a DeepSpeed user: ``TrainingArguments(deepspeed=ds_config)``, a model from a config, a
``Trainer``; the only SDP4Bit-specific line is ``import deepspeed_sdp4bit``.  The model is GPT-2 built from a
``GPT2Config`` (tiny by default: nothing is downloaded), over bytes (vocab 256) of local text: the
standard-library corpus of ``examples/data.py`` or ``--data FILES_OR_DIRS``.  Any ds_config of ``configs/``
runs unchanged: the learning rate, Adam betas/eps, weight decay, clipping and bf16/fp16 of the
TrainingArguments are taken from the ds_config, so the Trainer finds nothing to "correct".

GPUs (one rank per GPU)::

    torchrun --nproc_per_node 4 examples/train_hf.py --ds-config configs/sdp4bit.json --out runs/hf
    # or (not tested with this example): deepspeed --num_gpus 4 examples/train_hf.py ...   /   accelerate launch ...

CPU (gloo ranks; see ``_cpu_workarounds`` for what the example does there and why)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 examples/train_hf.py \\
        --ds-config configs/sdp4bit.json --out /tmp/hf --max-steps 20 --max-bytes 2000000

``--resume`` continues from the latest ``checkpoint-*`` in ``--out`` (``resume_from_checkpoint``);
``--stop-at N`` stops after step N of a ``--max-steps`` schedule (what an interrupted run looks like).  At the
end the weights go through ``trainer.save_model(OUT/final)`` (the bf16 weights the model trained with: the
example turns on ``stage3_gather_16bit_weights_on_model_save`` when the config does not say), are loaded
back with ``from_pretrained`` on rank 0 and evaluated on the same held-out batches as the engine.  Rank 0
writes ``OUT/log.json``: per-step loss (mean over ranks, the Trainer's log), held-out losses, the last
step's ``engine.sdp4bit_summary()`` and ``sdp4bit_state`` (the replica the engine keeps and whether its refresh is
left in flight, ``engine.sdp4bit.overlap``; null with SDP4Bit off).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _p in (_HERE, _REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

ON_CPU = not torch.cuda.is_available()
if ON_CPU:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed_sdp4bit  # noqa: E402,F401  (before the engine is built: installs the DeepSpeed hooks)
import transformers  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

from data import load_corpus, split_corpus  # noqa: E402
from dsconfig import apply_ds_set  # noqa: E402
from shutdown import exit_ranks  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ds-config", required=True, help="ds_config JSON (e.g. configs/sdp4bit.json)")
    p.add_argument("--ds-set", action="append", default=[], metavar="KEY=JSON",
                   help="override a ds_config entry by dotted path, e.g. sdp4bit.topology.gpus_per_node=2")
    p.add_argument("--out", required=True, help="output dir: checkpoints, final model, log.json")
    p.add_argument("--data", nargs="*", default=None, help="text files/dirs (default: the stdlib corpus)")
    p.add_argument("--max-bytes", type=int, default=0, help="use only the first N bytes of the corpus (0 = all)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0 = only --stop-at)")
    p.add_argument("--stop-at", type=int, default=0, help="stop after this step (checkpointed), 0 = run all")
    p.add_argument("--resume", action="store_true", help="resume_from_checkpoint=True (latest in --out)")
    p.add_argument("--eval-samples", type=int, default=64, help="held-out windows evaluated at the end")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq`` bytes; labels = inputs (GPT-2 shifts them itself)."""

    def __init__(self, data: torch.Tensor, seq: int, limit: int = 0):
        n = data.numel() // seq
        if n < 1:
            raise ValueError(f"the text ({data.numel()} bytes) is shorter than one window of {seq}")
        self.data, self.seq, self.n = data, seq, (min(n, limit) if limit else n)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = self.data[i * self.seq:(i + 1) * self.seq].long()
        return {"input_ids": x, "labels": x}


def training_args_from_ds_config(ds: dict, args: argparse.Namespace) -> dict:
    """The TrainingArguments the Trainer compares with the ds_config: taken from it, so nothing mismatches."""
    opt = (ds.get("optimizer") or {}).get("params", {})
    kw = {}
    if "lr" in opt:
        kw["learning_rate"] = float(opt["lr"])
    if "betas" in opt:
        kw["adam_beta1"], kw["adam_beta2"] = (float(b) for b in opt["betas"])
    if "eps" in opt:
        kw["adam_epsilon"] = float(opt["eps"])
    if "weight_decay" in opt:
        kw["weight_decay"] = float(opt["weight_decay"])
    if "gradient_clipping" in ds:
        kw["max_grad_norm"] = float(ds["gradient_clipping"])
    kw["bf16"] = bool((ds.get("bf16") or {}).get("enabled", False))
    kw["fp16"] = bool((ds.get("fp16") or {}).get("enabled", False))
    return kw


def _cpu_workarounds(ds: dict, hf_kwargs: dict) -> bool:
    """What the CPU branch needs that a GPU run does not; returns whether bf16 is to be set after construction.

    1. accelerate decides that a torchrun launch on a machine without an accelerator is NOT distributed when
       DeepSpeed is used (its backend probe finds no GPU, and no backend means one process): every rank would
       train alone, world size 1.  We make the probe answer gloo on CPU (the backend DeepSpeed's CPU
       accelerator uses), and accelerate then sees the real world size.
    2. transformers refuses ``bf16=True`` unless a bf16 GPU is present (or ``use_cpu``, which turns DeepSpeed
       off), while the Trainer refuses a ds_config whose ``bf16.enabled`` differs from ``args.bf16``: the
       flag is set after the TrainingArguments are built (DeepSpeed's CPU accelerator runs bf16).
    3. DeepSpeed's AdamW is its FusedAdam, a JIT-built op; on CPU the ds_config asks for torch's AdamW
       (``optimizer.params.torch_adam``), the same math.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    orig = PartialState._prepare_backend
    if not getattr(orig, "_cpu_gloo", False):
        def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
            b, kind = orig(self, cpu, sagemaker_dp, backend)
            if kind == DistributedType.NO and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                return "gloo", DistributedType.MULTI_CPU
            return b, kind

        _prepare_backend._cpu_gloo = True
        PartialState._prepare_backend = _prepare_backend
    if "optimizer" in ds:
        ds["optimizer"].setdefault("params", {})["torch_adam"] = True
    bf16 = hf_kwargs.pop("bf16", False)
    return bf16


class LossLog(TrainerCallback):
    """Collects the Trainer's logged loss per step and the engine's SDP4Bit summary of the last step."""

    def __init__(self, stop_at: int = 0):
        self.losses = {}
        self.summary = None
        self.state = None
        self.stop_at = stop_at
        self.trainer = None

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses[int(state.global_step)] = float(logs["loss"])  # mean over ranks (Trainer's gather)

    def on_step_end(self, args, state, control, **kw):
        engine = getattr(self.trainer, "model_wrapped", None)
        if engine is not None and hasattr(engine, "sdp4bit_summary"):
            self.summary = engine.sdp4bit_summary()
        st = getattr(engine, "sdp4bit", None)
        if st is not None:   # which replica the engine keeps, and whether its refresh was left in flight
            self.state = {"replica": st.level, "overlap": st.overlap}
        if self.stop_at and state.global_step >= self.stop_at:
            control.should_save = True
            control.should_training_stop = True


@torch.no_grad()
def heldout_loss(model, dataset, batch: int, device) -> float:
    """Mean loss of ``model`` (a plain model or the DeepSpeed engine) over ``dataset``, batch by batch."""
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(dataset), batch):
        x = torch.stack([dataset[j]["input_ids"] for j in range(i, min(i + batch, len(dataset)))]).to(device)
        tot += float(model(input_ids=x, labels=x).loss) * x.shape[0]
        n += x.shape[0]
    return tot / n


def main(argv=None) -> dict:
    args = parse_args(argv)
    done = finished_steps(args.out)   # the latest checkpoint's step in --out, None without one
    if not args.resume and done is not None:
        # a new run beside another run's checkpoints: a later --resume would take whichever is latest
        raise SystemExit(f"[train_hf] --out {args.out} already holds checkpoints of another run (the latest at step "
                         f"{done}): pass --resume to go on from it, or give an empty --out")
    with open(args.ds_config) as f:
        ds = apply_ds_set(json.load(f), args.ds_set)
    # Batch keys the Trainer fills from TrainingArguments: HF's "auto" placeholders (outside the sdp4bit block,
    # where "auto" is refused: accelerate would try to fill it too).
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        ds.setdefault(key, "auto")
    zero = ds.setdefault("zero_optimization", {})
    # save_model() then writes the bf16 weights the model trains and evaluates with (README: "which export
    # gives which weights"); without it the Trainer saves no weights for ZeRO-3, only the DeepSpeed checkpoint.
    zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    hf = training_args_from_ds_config(ds, args)
    late_bf16 = _cpu_workarounds(ds, hf) if ON_CPU else False

    targs = TrainingArguments(
        output_dir=args.out, deepspeed=ds, per_device_train_batch_size=args.micro_batch,
        per_device_eval_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps, logging_steps=1, save_strategy="steps",
        save_steps=args.save_steps or args.stop_at or args.max_steps, save_only_model=False, report_to=[],
        seed=args.seed, data_seed=args.seed, dataloader_drop_last=True, disable_tqdm=True, **hf)
    if late_bf16:
        # see _cpu_workarounds (2); then what TrainingArguments.__post_init__ does with the ds_config, again
        from accelerate.utils import DeepSpeedPlugin
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        targs.bf16 = True
        targs.hf_deepspeed_config = HfTrainerDeepSpeedConfig(targs.deepspeed)
        targs.hf_deepspeed_config.trainer_config_process(targs)
        targs.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=targs.hf_deepspeed_config)

    data, desc = load_corpus(args.data)
    if args.max_bytes and args.max_bytes < data.numel():
        data = data[:args.max_bytes]
        desc += f", its first {args.max_bytes} bytes (--max-bytes)"
    train, held = split_corpus(data)
    train_ds = ByteWindows(train, args.seq)
    eval_ds = ByteWindows(held, args.seq, limit=args.eval_samples)

    # from_config after the TrainingArguments: with ZeRO-3 the model is built under deepspeed.zero.Init
    # (partitioned at construction), the ds_config going through the sdp4bit hook.
    cfg = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.d_model, n_layer=args.layers,
                     n_head=args.heads, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg)

    log = LossLog(stop_at=args.stop_at)
    if args.resume:
        if done is not None and done >= args.max_steps:
            # transformers would still run one more step past max_steps (and save checkpoint-<max_steps + 1>)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"[train_hf] {args.out}: its latest checkpoint is at step {done}, which --max-steps "
                      f"{args.max_steps} already reached: nothing to resume (raise --max-steps to train on)",
                      flush=True)
            return {}
        log.losses = {int(k): v for k, v in (_read(args.out) or {}).get("losses", {}).items() if int(k) <= (done or 0)}
    trainer = Trainer(model=model, args=targs, train_dataset=train_ds, callbacks=[log])
    log.trainer = trainer
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    out = {"corpus": desc, "world": targs.world_size, "losses": log.losses, "sdp4bit_summary": log.summary,
           "sdp4bit_state": log.state, "transformers": transformers.__version__}
    if args.stop_at and args.stop_at < args.max_steps:
        if trainer.is_world_process_zero():
            _write(args.out, out)
        trainer.model_wrapped.destroy()   # the DeepSpeed engine; exit_ranks runs no destructors
        return out
    # The engine's held-out loss, by the same loop as the reloaded model's below (every rank runs every batch:
    # ZeRO-3's forward is collective).
    device = torch.device("cpu") if ON_CPU else torch.device("cuda", torch.cuda.current_device())
    out["eval_loss"] = heldout_loss(trainer.model_wrapped, eval_ds, args.micro_batch, device)
    final = os.path.join(args.out, "final")
    trainer.save_model(final)
    trainer.model_wrapped.destroy()
    if trainer.is_world_process_zero():
        # A plain model, as anyone loading the saved directory would get it: with the Trainer's ZeRO-3 config
        # still registered, from_pretrained would build it under deepspeed.zero.Init (collective) instead.
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        dtype = torch.bfloat16 if targs.bf16 else (torch.float16 if targs.fp16 else torch.float32)
        reloaded = AutoModelForCausalLM.from_pretrained(final, dtype=dtype)
        out["reloaded_eval_loss"] = heldout_loss(reloaded.to(device), eval_ds, args.micro_batch, device)
        summary = out["sdp4bit_summary"] or {}
        state = out["sdp4bit_state"] or {}
        kept = (f", replica {state['replica']}{', refresh overlapped' if state.get('overlap') else ''}"
                if state.get("replica") else "")
        sdp = (f"sdp4bit active ({summary.get('compression') or math.nan:.2f}x fewer bytes sent in the last "
               f"step{kept})" if summary.get("active") else f"sdp4bit off ({summary.get('reason', 'no summary')})")
        print(f"[train_hf] {desc}; world {out['world']}; {sdp}; final loss "
              f"{out['losses'].get(max(out['losses']), math.nan):.4f}; held-out loss {out['eval_loss']:.4f} "
              f"(engine) / {out['reloaded_eval_loss']:.4f} (save_model -> from_pretrained)", flush=True)
        _write(args.out, out)
    return out


def finished_steps(out_dir: str):
    """The global step of the latest ``checkpoint-*`` in ``out_dir`` (None when there is none)."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(out_dir) if os.path.isdir(out_dir) else None
    if last is None:
        return None
    with open(os.path.join(last, "trainer_state.json")) as f:
        return int(json.load(f)["global_step"])


def _read(out_dir: str):
    path = os.path.join(out_dir, "log.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write(out_dir: str, out: dict) -> None:
    path = os.path.join(out_dir, "log.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
    # rank 0 evaluates the reloaded model alone; the others wait for it here.
    exit_ranks()
