"""Run ``examples/train_gpt.py`` for a matrix of configs x topologies x transports and summarise the runs.

Each cell is one subprocess (torchrun or the deepspeed launcher) with its own ``--log-json``; when all are
done, one summary JSON is written with, per run:

* ``mean_ms`` / ``median_ms``: step time over the last K steps (``--last-k``, default 50; fewer when the run
  is shorter, the first step is never counted: it includes warm-up work),
* ``tokens_per_s`` = tokens per step (micro-batch x grad-accum x seq x ranks) / mean step time,
* ``tflops_per_gpu`` = 6 * n_params * tokens_per_s / n_ranks / 1e12 (the dense-matmul estimate; attention
  FLOPs not included, the same for every config, so ratios between configs are unaffected),
* ``peak_mem_bytes`` (the maximum over ranks; CUDA max allocated on GPUs, peak RSS on CPU),
* ``train_loss_last50`` (mean train loss of the last 50 steps) and ``heldout_loss`` (final evaluation),
* the sdp4bit communication summary of the last step, when the run had one.

Usage (everything after ``--`` goes to train_gpt.py unchanged)::

    python benchmarks/run_matrix.py --configs zero3 zeropp sdp4bit --topologies 4 2x2 \\
        --transports nvlink sockets --out benchmarks/results/gpt406m -- \\
        --d-model 1024 --layers 24 --heads 16 --seq 1024 --micro-batch 4 --steps 60 --random-tokens \\
        --eval-batches 0 --torch-adam yes

    # the driver itself on this CPU machine (gloo; transports do not apply):
    python benchmarks/run_matrix.py --cpu --configs zero3 --topologies 4 --out /tmp/m -- \\
        --d-model 64 --layers 2 --heads 4 --seq 64 --micro-batch 4 --steps 30

Topologies: ``N`` = N ranks on this host, the config untouched (sdp4bit's omitted ``topology.gpus_per_node`` makes them
one node).  ``AxB`` = A logical nodes of B ranks: sets ``sdp4bit.topology.gpus_per_node = B`` for configs with
an sdp4bit block and ``zero_optimization.zero_hpz_partition_size = B`` for configs that use hpZ; with B = 1
on GPUs it also passes ``--one-gpu-per-rank`` so that DeepSpeed's ZeRO++ (which counts nodes as
world_size / device_count) sees one GPU per node and really runs its inter-node paths.

Transports (NCCL only; they apply to every communicator of the process): ``nvlink`` (NCCL defaults),
``net`` (``NCCL_P2P_DISABLE=1``: traffic through host memory, like a fast network), ``sockets``
(``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``: TCP sockets, like a slow network).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train_gpt.py"
CONFIG_DIR = REPO / "configs"

TRANSPORTS: Dict[str, Dict[str, str]] = {
    "nvlink": {},
    "net": {"NCCL_P2P_DISABLE": "1"},
    "sockets": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}
FLOPS_FORMULA = "tflops_per_gpu = 6 * n_params * tokens_per_s / n_ranks / 1e12 (attention FLOPs excluded)"


def parse_topology(spec: str):
    """``"N"`` -> (N, None); ``"AxB"`` -> (A * B, B).  Raises ValueError naming the spec otherwise."""
    m = re.fullmatch(r"(\d+)(?:x(\d+))?", spec.strip())
    if not m:
        raise ValueError(f"--topologies: {spec!r} is not N or AxB (e.g. 4 or 2x2)")
    a = int(m.group(1))
    if m.group(2) is None:
        if a < 1:
            raise ValueError(f"--topologies: {spec!r} needs at least one rank")
        return a, None
    b = int(m.group(2))
    if a < 1 or b < 1:
        raise ValueError(f"--topologies: {spec!r} needs A >= 1 and B >= 1")
    return a * b, b


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_config(name: str) -> Path:
    """A config name (``zero3``) or path to the JSON file; raises FileNotFoundError listing what exists."""
    p = Path(name)
    if p.suffix == ".json" and p.is_file():
        return p
    q = CONFIG_DIR / f"{name}.json"
    if q.is_file():
        return q
    have = ", ".join(sorted(x.stem for x in CONFIG_DIR.glob("*.json")))
    raise FileNotFoundError(f"--configs: no config {name!r} (in {CONFIG_DIR}: {have})")


def build_command(*, config: Path, world: int, gpus_per_node: Optional[int], launcher: str, cpu: bool,
                  log_json: Path, train_args: List[str], sdp4bit_set: Optional[List[str]] = None) -> List[str]:
    """The launcher command line for one run.

    ``sdp4bit_set``: ``KEY=JSON`` overrides of the sdp4bit block, applied only to configs that have one (so
    that, say, a kernel backend can be chosen without giving the ZeRO-3 baseline an sdp4bit block).
    """
    with open(config) as f:
        cfg = json.load(f)
    extra: List[str] = []
    if "sdp4bit" in cfg:
        for kv in sdp4bit_set or []:
            extra += ["--ds-set", f"sdp4bit.{kv}"]
    if gpus_per_node is not None:
        if "sdp4bit" in cfg:
            extra += ["--ds-set", f"sdp4bit.topology.gpus_per_node={gpus_per_node}"]
            # With one rank per node a per-node replica is a full replica; the integration refuses
            # replica="node" there (hpZ of 1 has no secondary partition), so ask for "full".
            weights = cfg["sdp4bit"].get("weights") or {}
            if gpus_per_node == 1 and weights.get("enabled", True):
                extra += ["--ds-set", 'sdp4bit.weights.replica="full"']
        if (cfg.get("zero_optimization") or {}).get("zero_hpz_partition_size", 1) not in (None, 1):
            extra += ["--ds-set", f"zero_optimization.zero_hpz_partition_size={gpus_per_node}"]
        if gpus_per_node == 1 and not cpu:
            extra += ["--one-gpu-per-rank"]
    script = [str(TRAIN), "--ds-config", str(config), "--log-json", str(log_json), "--no-progress"]
    if launcher == "torchrun":
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    elif launcher == "deepspeed":
        launch = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(world),
                  "--master_port", str(_free_port())]
    else:
        raise ValueError(f"--launcher must be torchrun or deepspeed, got {launcher!r}")
    return launch + script + extra + list(train_args)


def summarize_log(log_path: Path, last_k: int) -> Dict[str, object]:
    """Numbers of one finished (or partial) train_gpt.py log; see the module docstring."""
    with open(log_path) as f:
        doc = json.load(f)
    meta, steps, final = doc.get("meta", {}), doc.get("steps", []), doc.get("final") or {}
    out: Dict[str, object] = {"n_params": meta.get("n_params"), "world_size": meta.get("world_size"),
                              "tokens_per_step": meta.get("tokens_per_step"), "steps_done": len(steps),
                              "device": meta.get("device"), "peak_mem_kind": meta.get("peak_mem_kind"),
                              "startup_s": meta.get("startup_s")}
    timed = steps[1:] if len(steps) > 1 else steps
    tail = timed[-last_k:] if timed else []
    if tail:
        ms = sorted(r["ms"] for r in tail)
        mean_ms = sum(ms) / len(ms)
        out.update(timed_steps=len(tail), mean_ms=mean_ms, median_ms=ms[len(ms) // 2])
        tps = meta["tokens_per_step"] / (mean_ms / 1e3)
        out["tokens_per_s"] = tps
        out["tflops_per_gpu"] = 6.0 * meta["n_params"] * tps / meta["world_size"] / 1e12
        last50 = steps[-50:]
        out["train_loss_last50"] = sum(r["loss"] for r in last50) / len(last50)
        out["peak_mem_bytes"] = final.get("peak_mem_bytes_max_over_ranks",
                                          max(r.get("peak_mem_bytes", 0) for r in steps))
    evals = doc.get("evals", [])
    out["heldout_loss"] = final.get("heldout_loss", evals[-1]["heldout_loss"] if evals else None)
    out["finished"] = bool(final) and "error" not in final
    if final.get("error"):
        out["error"] = final["error"]
    if meta.get("sdp4bit_config") is not None:
        out["sdp4bit_summary_source"] = meta.get("sdp4bit_summary_source")
        out["sdp4bit_last"] = final.get("sdp4bit") or (steps[-1].get("sdp4bit") if steps else None)
    return out


def main(argv=None) -> int:
    """Run the matrix; returns 0 when every run finished, 1 otherwise."""
    if argv is None:
        argv = sys.argv[1:]
    train_args: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", required=True, help="names in configs/ (zero3 sdp4bit ...) or paths")
    p.add_argument("--topologies", nargs="+", default=["4"], help="N or AxB (see above)")
    p.add_argument("--transports", nargs="+", default=["nvlink"], choices=sorted(TRANSPORTS))
    p.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="torchrun")
    p.add_argument("--cpu", action="store_true", help="CPU ranks with gloo (DS_ACCELERATOR=cpu)")
    p.add_argument("--out", required=True, help="directory for the logs and summary.json")
    p.add_argument("--last-k", type=int, default=50, help="steps averaged for the timing")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it is killed")
    p.add_argument("--skip-existing", action="store_true", help="reuse runs whose log already has a final")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--sdp4bit-set", nargs="*", default=[], metavar="KEY=JSON",
                   help="override keys of the sdp4bit block (only in configs that have one), e.g. "
                        "kernel_backend='\"triton\"'")
    a = p.parse_args(argv)
    if a.last_k < 1:
        p.error(f"--last-k must be >= 1, got {a.last_k}")
    if a.cpu and a.transports != ["nvlink"]:
        p.error("--transports selects NCCL settings; with --cpu (gloo) leave it at the default")
    configs = [resolve_config(c) for c in a.configs]
    topologies = [(t, *parse_topology(t)) for t in a.topologies]
    for flag in ("--log-json", "--ds-config", "--no-progress"):
        if flag in train_args:
            p.error(f"{flag} is set by the driver; do not pass it after --")

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for cfg in configs:
        for topo, world, gpn in topologies:
            for transport in a.transports:
                name = f"{cfg.stem}__{topo}__{'cpu' if a.cpu else transport}"
                log_json, log_txt = out / f"{name}.json", out / f"{name}.log"
                cmd = build_command(config=cfg, world=world, gpus_per_node=gpn, launcher=a.launcher,
                                    sdp4bit_set=a.sdp4bit_set,
                                    cpu=a.cpu, log_json=log_json, train_args=train_args)
                env = dict(os.environ)
                env.update(TRANSPORTS[transport])
                env["PYTHONUNBUFFERED"] = "1"
                if a.cpu:
                    env["DS_ACCELERATOR"] = "cpu"
                run = {"name": name, "config": cfg.stem, "config_path": str(cfg), "topology": topo,
                       "transport": "gloo" if a.cpu else transport, "world_size": world,
                       "launcher": a.launcher, "env": TRANSPORTS[transport] if not a.cpu else {},
                       "command": shlex.join(cmd), "log_json": str(log_json), "stdout": str(log_txt)}
                print(f"[run_matrix] {name}: {run['command']}", flush=True)
                if a.dry_run:
                    continue
                reuse = False
                if a.skip_existing and log_json.exists():
                    try:
                        reuse = bool(json.loads(log_json.read_text()).get("final"))
                    except (OSError, json.JSONDecodeError):
                        reuse = False
                if reuse:
                    run.update(rc=0, wall_s=None, reused=True)
                else:
                    if log_json.exists():
                        log_json.unlink()  # never summarise a previous run's log as this one
                    t0 = time.time()
                    with open(log_txt, "w") as f:
                        try:
                            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                                timeout=a.timeout).returncode
                        except subprocess.TimeoutExpired:
                            rc = "timeout"
                    run.update(rc=rc, wall_s=round(time.time() - t0, 1))
                if log_json.exists():
                    run.update(summarize_log(log_json, a.last_k))
                else:
                    run["finished"] = False
                if run.get("rc") != 0 or not run.get("finished"):
                    tail = log_txt.read_text(errors="replace").splitlines()[-15:] if log_txt.exists() else []
                    run["error_tail"] = tail
                    print(f"[run_matrix] {name}: FAILED (rc {run.get('rc')}); see {log_txt}", flush=True)
                else:
                    print(f"[run_matrix] {name}: {run.get('mean_ms', float('nan')):.1f} ms/step, "
                          f"train loss {run.get('train_loss_last50')}, held-out {run.get('heldout_loss')}",
                          flush=True)
                runs.append(run)
                _write_summary(out, a, train_args, runs)
    if a.dry_run:
        return 0
    _write_summary(out, a, train_args, runs)
    print(f"[run_matrix] summary: {out / 'summary.json'}", flush=True)
    return 0 if all(r.get("rc") == 0 and r.get("finished") for r in runs) else 1


def _write_summary(out: Path, a, train_args, runs) -> None:
    doc = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "flops_formula": FLOPS_FORMULA,
           "last_k": a.last_k, "train_args": train_args, "cpu": a.cpu, "runs": runs}
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    os.replace(tmp, out / "summary.json")


if __name__ == "__main__":
    sys.exit(main())
