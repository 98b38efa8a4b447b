"""``python -m benchmarks accuracy``: train loss of the GPT per config x topology x seed x schedule.

Defaults are the project's 86M accuracy runs: GPT d768 L12 H12 on the byte corpus of examples/data.py (the Python
standard library source), micro-batch 8, seq 1024, AdamW lr 6e-4, 500 steps; ``--schedules constant`` (no
warm-up, no decay) and/or ``cosine`` (linear warm-up over 5% of the steps, or ``--warmup N`` steps: rows name that
schedule ``cosine-wN``; cosine to 0.1 x lr).  A seed sets
both the model initialisation (``--seed``) and the data order (``--data-seed``) of train_gpt.py.

``zero3:replay`` is the ZeRO-3 reference without the cost of a multi-rank run over sockets: world size 1 with
``--replay-ranks R`` (R = the topology's ranks), i.e. gradient accumulation over the micro-batches that ranks
0..R-1 of the real run draw, in order (same data, same global batch; tests/test_benchmarks.py checks it
against a real ZeRO-3 run).  Its rows have ``reference: "replay"`` and the topology they stand for.

Rows (merged into ``--results``, default OUT/accuracy.json): config, variant, replica, topology, ranks, seed,
schedule, steps, train_loss (mean of the last 50 steps), heldout_loss (final evaluation), ms_per_step, commit.

A run longer than one call of a GPU machine: ``--checkpoint-root DIR --stop-after N`` stops every run after step N
with a checkpoint in DIR/<run name> (row status ``stopped``); the same command again, with a larger or no
``--stop-after``, goes on from there (the learning-rate schedule is always that of ``--steps``);
``--stop-margin S`` instead stops each run after the first step that ends less than S seconds before the run would
be killed (its ``--timeout``, or the call's ``--deadline`` less 15 s; S covers the checkpoint and teardown), so
the same command, sent again each call, trains for as long as each call has (a run takes all the time left, so
give each config its own process, side by side; the next runs of one process find the deadline reached).  A run
already finished in its folder is skipped.  The finished run's row has every step's loss, ``resumed_at_step``, and
``earlier_parts`` (the row ids of every earlier part; their commands are in their run files and in
DIR/<run name>/parts.json); ``ms_per_step`` is the median over every part's steps.
The per-step losses go to ``--steps-file`` (default OUT/accuracy_steps.json, {row_id: [loss, ...]}), a stopped
part's too (its steps so far; the report counts a chain that never finished once, as a run cut short, by its part
with the most steps).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import List, Optional, Tuple

from . import suite


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="86M", choices=sorted(suite.MODELS))
    p.add_argument("--topologies", nargs="+", default=["2x2", "4x1"], help="NODESxGPUS")
    p.add_argument("--configs", nargs="+", default=["zero3:replay", "sdp4bit"],
                   help="NAME[:REPLICA] as for e2e, or zero3:replay (world-1 replay reference)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--schedules", nargs="+", choices=("constant", "cosine"), default=["constant"])
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="warm-up steps of the cosine schedule (default 5%% of --steps); another value names the "
                        "schedule cosine-wN in the rows, so their runs form groups of their own")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--ranks-per-gpu", type=int, default=1)
    p.add_argument("--share-gpu", action="store_true", help="all ranks of each run on one GPU")
    p.add_argument("--own-host", action="store_true",
                   help="GPU only: one rank per GPU, each rank its own NCCL host (sockets between every two ranks); "
                        "DeepSpeed then counts one GPU per node, so ZeRO++'s qgZ is active and hpZ 1, as when ranks "
                        "share a GPU, while their compute runs on separate GPUs")
    p.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU (automatic without a GPU)")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="default OUT/accuracy.json")
    p.add_argument("--steps-file", default=None, help="default OUT/accuracy_steps.json")
    p.add_argument("--timeout", type=float, default=3000.0, help="seconds per run")
    p.add_argument("--deadline", type=float, default=None, help="seconds for the whole call")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--deterministic", action="store_true",
                   help="train_gpt.py --deterministic: torch's deterministic algorithms, so that a repeat of a run "
                        "on a GPU can give the same losses (each row says whether its run had them; their step "
                        "times are not comparable with other rows'; the reports keep such rows in groups of their "
                        "own)")
    p.add_argument("--checkpoint-root", default=None, metavar="DIR",
                   help="one checkpoint folder per run under DIR (named by model, topology, config, seed, "
                        "schedule); a run whose folder holds a checkpoint goes on from it")
    p.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="stop each run after step N with a checkpoint (needs --checkpoint-root); a later call with "
                        "the same arguments and a larger or no --stop-after goes on: runs longer than one call")
    p.add_argument("--stop-margin", type=float, default=0.0, metavar="S",
                   help="stop each run with a checkpoint after the first step ending less than S seconds before it "
                        "would be killed (--timeout or --deadline); needs --checkpoint-root; 0: off")


def default_warmup(steps: int) -> int:
    return max(1, steps // 20)


def _schedule(schedule: str, args) -> Tuple[str, int, List[str]]:
    """(the rows' name of the schedule, its warm-up steps, train_gpt.py's arguments for it): ``cosine`` with the
    default warm-up (5% of the steps), ``cosine-wN`` with ``--warmup N``, ``constant`` (no warm-up, no decay)."""
    if schedule == "constant":
        return "constant", 0, ["--warmup", "0", "--min-lr-ratio", "1.0"]
    w = default_warmup(args.steps) if args.warmup is None else args.warmup
    name = "cosine" if w == default_warmup(args.steps) else f"cosine-w{w}"
    return name, w, ["--warmup", str(w), "--min-lr-ratio", "0.1"]


_RESUME_KEYS = ("model", "steps", "lr", "micro_batch", "seq", "eval_batches", "train_arg", "deterministic", "warmup")


def _filled(key: dict) -> dict:
    """A resume key with the values of flags it lacks or leaves open: ``deterministic`` off (folders from before
    the flag ran without it) and the warm-up as the cosine schedule resolves it (an explicit default is the run
    without the flag)."""
    key = {"deterministic": False, **key}
    if key.get("warmup") is None:
        key["warmup"] = default_warmup(key["steps"])
    return key


def _resume_key(args) -> dict:
    """What a checkpoint folder records of the arguments: a run goes on only under the same (:func:`_filled`)."""
    return _filled({k: getattr(args, k) for k in _RESUME_KEYS})


def _check_resume_folders(root: Path, args) -> None:
    """Refuse, before any run starts, a checkpoint folder under ``root`` left by other arguments."""
    mine = _resume_key(args)
    for parts_file in sorted(root.glob("*/parts.json")) if root.is_dir() else []:
        old = json.loads(parts_file.read_text()).get("args")
        old = _filled(old) if old is not None else None
        if old is not None and old != mine:
            raise SystemExit(f"accuracy: {parts_file.parent} holds a run of other arguments ({old}, now {mine}); "
                             f"remove it or use another --checkpoint-root")


def _finished_part(ckpt: Path) -> Optional[str]:
    """The row id of the part that finished the run kept in ``ckpt``, if one did."""
    parts_file = ckpt / "parts.json"
    if not parts_file.is_file():
        return None
    # a part killed in its teardown after its last step and final evaluation finished the run too (the report's
    # suite.finished_training; parts recorded before their steps were kept count by status only)
    done = [p["row_id"] for p in json.loads(parts_file.read_text())["parts"] if suite.finished_training(p)]
    return done[-1] if done else None


def _resume_args(ckpt: Path, args, row: dict, stop_at: Optional[float]) -> List[str]:
    """train_gpt.py's checkpoint arguments for a run kept in ``ckpt`` across calls (``parts.json`` records the
    arguments and every earlier part's row and status)."""
    ckpt.mkdir(parents=True, exist_ok=True)
    parts_file = ckpt / "parts.json"
    parts = json.loads(parts_file.read_text()) if parts_file.is_file() else {"args": None, "parts": []}
    # every earlier part, whatever its status (one killed or failed before this one was resumed is no run either)
    row["earlier_parts"] = [p["row_id"] for p in parts["parts"]]
    parts["args"] = _resume_key(args)
    parts["parts"].append({"row_id": row["row_id"], "commit": row["commit"], "command": None, "status": None})
    suite.write_json(parts_file, parts)
    out = ["--checkpoint-dir", str(ckpt)]
    if (ckpt / "latest").is_file():
        out.append("--resume")
    if args.stop_after:
        out += ["--stop-after", str(args.stop_after)]
    if stop_at is not None:
        out += ["--stop-at-time", f"{stop_at:.1f}"]
    return out


def _log_stamp(path: Path) -> Optional[Tuple[int, int]]:
    """(inode, mtime in ns) of a run's JSON log, None without one: train_gpt.py replaces the file on every write
    (a new inode), so a stamp unchanged across a part means that part wrote nothing (no clock involved)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _record_part(ckpt: Path, row: dict) -> None:
    parts_file = ckpt / "parts.json"
    parts = json.loads(parts_file.read_text())
    parts["parts"][-1].update({k: row.get(k) for k in ("command", "status", "steps", "steps_done", "heldout_loss")})
    suite.write_json(parts_file, parts)


def run(args) -> int:
    if args.stop_after and not args.checkpoint_root:
        raise SystemExit("accuracy: --stop-after needs --checkpoint-root")
    if args.stop_after < 0 or (args.stop_after and args.stop_after >= args.steps):
        raise SystemExit(f"accuracy: --stop-after must be 0 (none) or 1 .. {args.steps - 1} (below --steps), got "
                         f"{args.stop_after}")
    if args.stop_margin < 0 or (args.stop_margin and not args.checkpoint_root):
        raise SystemExit(f"accuracy: --stop-margin must be >= 0 and needs --checkpoint-root, got {args.stop_margin}")
    if args.warmup is not None and not (0 <= args.warmup < args.steps and "cosine" in args.schedules):
        raise SystemExit(f"accuracy: --warmup is the cosine schedule's (pass --schedules cosine) and must be 0 .. "
                         f"{args.steps - 1} (below --steps), got {args.warmup}")
    clash = [a for a in args.train_arg if a.startswith("--") and len(a.split("=")[0]) > 2
             and any(full.startswith(a.split("=")[0]) for full in ("--warmup", "--min-lr-ratio"))]   # argparse prefixes
    if clash:
        raise SystemExit(f"accuracy: --train-arg {clash[0]} would override the schedule the rows name; use --warmup "
                         f"(and --schedules) instead")
    if args.checkpoint_root:
        _check_resume_folders(Path(args.checkpoint_root), args)
    cpu = args.cpu or not suite.on_gpu()
    if args.own_host and (cpu or args.share_gpu or args.ranks_per_gpu > 1):
        raise SystemExit("accuracy: --own-host runs one rank per GPU, each its own NCCL host: not with --share-gpu, "
                         "--ranks-per-gpu > 1 or on the CPU (gloo ranks have no GPU to own)")
    specs = []
    for c in args.configs:
        if c == "zero3:replay":
            specs.append((suite.Variant("zero3"), True))
        else:
            specs.append((suite.Variant.parse(c), False))
    topos = [(t, suite.parse_topology(t)) for t in args.topologies]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else out / "accuracy.json"
    steps_file = Path(args.steps_file) if args.steps_file else out / "accuracy_steps.json"
    run_id = suite.new_run_id("accuracy")
    meta = suite.run_meta("accuracy", run_id, args)
    n_gpus = meta["machine"]["gpu_count"] if not cpu else 0
    work = suite.work_dir(run_id)  # outside OUT: only a few files may come back from a GPU machine
    deadline = suite.Deadline(args.deadline)
    rows: List[dict] = []
    doc = {"meta": meta, "rows": rows}
    res_file = out / f"{run_id}.json"
    shape = suite.MODELS[args.model]
    done_replay = set()
    for sched_arg in args.schedules:
        schedule, warmup, sched_targs = _schedule(sched_arg, args)
        for seed in args.seeds:
            for topo, (nodes, gpn) in topos:
                world = nodes * gpn
                for v, replay in specs:
                    if replay and (schedule, seed, world) in done_replay:
                        continue  # the replay stands for every topology with this many ranks
                    run_world = 1 if replay else world
                    rpg = max(1, min(run_world if args.share_gpu else args.ranks_per_gpu, run_world))
                    if not cpu and run_world > rpg * max(n_gpus, 1):
                        raise SystemExit(f"accuracy: {topo} has {world} ranks but {n_gpus} GPU(s) x "
                                         f"--ranks-per-gpu {rpg}; "
                                         + ("--own-host needs a GPU per rank" if args.own_host else
                                            "pass --share-gpu"))
                    share = (not cpu) and rpg > 1
                    own = args.own_host and run_world > 1   # (a replay is one rank: nothing to talk to)
                    label = v.label + (":replay" if replay else "")
                    name = f"{args.model}_{topo}_{label.replace(':', '-')}_s{seed}_{schedule}"
                    row = {"row_id": f"{run_id}/{name}", "run_id": run_id, "created": meta["created"],
                           "commit": meta["commit"], "machine": suite.device_label(meta["machine"]),
                           "config": v.config, "variant": label, "replica_requested": v.replica,
                           "default": v.is_default and not replay, "reference": "replay" if replay else None,
                           "topology": f"{world}r" if replay else topo, "ranks": world,
                           "model": args.model, "seed": seed, "schedule": schedule, "warmup": warmup,
                           "steps": args.steps,
                           "lr": args.lr, "micro_batch": args.micro_batch, "seq": args.seq}
                    if v.replica == "node" and gpn == 1 and nodes > 1:
                        row.update(status="skipped", reason="replica node with one rank per node is refused")
                        rows.append(row)
                        continue
                    ckpt = Path(args.checkpoint_root) / name if args.checkpoint_root else None
                    finished = _finished_part(ckpt) if ckpt else None
                    if finished:   # the same command again after the run ended: nothing left to do
                        row.update(status="skipped", reason=f"finished in {finished}")
                        rows.append(row)
                        if replay:
                            done_replay.add((schedule, seed, world))
                        continue
                    if deadline.left() < 120 + args.stop_margin:  # too little left for start-up and a run
                        row.update(status="skipped", reason="the call's --deadline was reached")
                        rows.append(row)
                        continue
                    log_json = ckpt / "log.json" if ckpt else work / f"{name}.json"
                    targs = ["--ds-config", str(v.path()), "--log-json", str(log_json), "--no-progress",
                             "--d-model", str(shape["d_model"]), "--layers", str(shape["layers"]),
                             "--heads", str(shape["heads"]), "--seq", str(args.seq),
                             "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
                             "--lr", str(args.lr), "--seed", str(seed), "--data-seed", str(seed),
                             "--eval-every", "0", "--eval-batches", str(args.eval_batches),
                             "--torch-adam", "yes"] + sched_targs
                    if replay:
                        targs += ["--replay-ranks", str(world)]
                    else:
                        for kv in v.ds_set(gpn, share or own):   # each rank sees one GPU either way
                            targs += ["--ds-set", kv]
                    if args.model == "tiny":
                        targs += ["--ds-set", "zero_optimization.stage3_param_persistence_threshold=0"]
                    targs += list(args.train_arg) + ["--deterministic"] * args.deterministic
                    timeout = min(args.timeout, deadline.left() - 15)
                    if ckpt:
                        stop_at = time.time() + timeout - args.stop_margin if args.stop_margin else None
                        if stop_at is not None and timeout - args.stop_margin < 60:
                            print(f"[accuracy] {name}: warning: --stop-margin {args.stop_margin:g} leaves "
                                  f"{timeout - args.stop_margin:.0f} s before the stop (start-up included): "
                                  f"it will stop after its first step", flush=True)
                        targs += _resume_args(ckpt, args, row, stop_at)
                    cmd, env = suite.launch_command(suite.TRAIN, targs, run_world, rpg, cpu,
                                                    gpus_per_host=1 if own else None)
                    row["command"] = " ".join(f"{k}={val}" for k, val in env.items()) + " " + " ".join(cmd)
                    print(f"[accuracy] {name}", flush=True)
                    before = _log_stamp(log_json)
                    rc, wall = suite.run_process(cmd, env, work / f"{name}.log", timeout)
                    row.update(rc=rc, wall_s=round(wall, 1))
                    losses, final = [], {}
                    # a part that died before writing its log leaves the previous part's: not this part's steps
                    if _log_stamp(log_json) not in (None, before):
                        log = json.loads(log_json.read_text())
                        steps = log.get("steps", [])
                        final = log.get("final") or {}
                        losses = [s["loss"] for s in steps]
                        row["replica"] = log.get("meta", {}).get("sdp4bit_replica")
                        row["resumed_at_step"] = log.get("meta", {}).get("start_step") or None
                        row["deterministic"] = bool(log.get("meta", {}).get("deterministic_algorithms"))
                        if steps:  # every part's steps (the median passes over each part's slow first step)
                            row["ms_per_step"] = suite.median([s["ms"] for s in steps[1:] or steps])
                        row["steps_done"] = len(steps)
                    ok = rc == 0 and row.get("steps_done") == args.steps
                    stopped = (rc == 0 and final.get("stopped_after") is not None
                               and final["stopped_after"] == row.get("steps_done") < args.steps)
                    if row.get("steps_done") == args.steps:  # complete (a teardown past the timeout too)
                        tail = losses[-min(50, len(losses)):]
                        row["train_loss"] = sum(tail) / len(tail)
                        row["heldout_loss"] = final.get("heldout_loss")
                    row["status"] = ("ok" if ok else "stopped" if stopped
                                     else "timeout" if rc == "timeout" else "failed")
                    if stopped:
                        by = ("--stop-after" if final["stopped_after"] == args.stop_after else "--stop-margin")
                        row["reason"] = (f"stopped after step {final['stopped_after']} ({by}): checkpoint in {ckpt}, "
                                         f"the next call goes on")
                        # kept under this part's row id: the finished run's row carries every step, and a chain
                        # that never finishes (a fresh machine, /tmp bare) still leaves its steps so far
                    elif not ok:
                        row["error_tail"] = suite.log_tail(work / f"{name}.log")
                    if replay and (ok or stopped):
                        done_replay.add((schedule, seed, world))
                    if ckpt:
                        _record_part(ckpt, row)
                    rows.append(row)
                    print(f"[accuracy] {name}: {row['status']}, train loss {row.get('train_loss')}, "
                          f"held-out {row.get('heldout_loss')}, wall {wall:.0f} s", flush=True)
                    suite.write_json(res_file, doc)
                    suite.merge_rows(results, [row])
                    if losses:
                        suite.merge_dict(steps_file, {row["row_id"]: losses})
    suite.write_json(res_file, doc)
    suite.merge_rows(results, rows)
    suite.pack_logs(work, out / f"{run_id}_logs.tar.gz")
    print(f"[accuracy] results: {res_file}; rows merged into {results}, losses into {steps_file}", flush=True)
    return 0 if all(r.get("status") in ("ok", "skipped", "stopped") for r in rows) else 1
