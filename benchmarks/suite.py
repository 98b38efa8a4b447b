"""What every question of the suite shares: models, configs, topologies, launching, machine facts, results files.

Results files
-------------
Each run of a question writes one file ``<out>/<question>_<run_id>.json``::

    {"meta": {"question", "run_id", "commit", "command", "created", "machine": {...}, "versions": {...},
              "args": {...}},
     "rows": [...]}

and merges its rows into a cumulative JSON list (``--results``, e.g. ``<out>/throughput.json``) after every
config, so a config that fails or hangs loses nothing of the others.  Rows carry ``run_id``; merging replaces a
row with the same ``row_id`` and keeps all others (several runs of one config stay side by side: the report
compares configs inside one run).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train_gpt.py"
SHARE_GPU = Path(__file__).resolve().parent / "share_gpu.py"
CONFIG_DIR = REPO / "configs"
RESULTS = REPO / "benchmarks" / "results"
ONE_GPU = RESULTS / "one_gpu"

# GPT shapes of the suite (examples/gpt.py); vocab 50304 with random tokens, 256 with the byte corpus.
MODELS: Dict[str, Dict[str, int]] = {
    "406M": {"d_model": 1024, "layers": 24, "heads": 16},
    "1.3B": {"d_model": 2048, "layers": 24, "heads": 16},
    "86M": {"d_model": 768, "layers": 12, "heads": 12},
    "tiny": {"d_model": 64, "layers": 2, "heads": 4},       # CPU runs and tests
}

# NCCL settings of a single multi-GPU host (e2e --transport); share-GPU mode is always sockets.  "nodes": each
# logical node of the topology (its GPUs) is its own NCCL host (share_gpu.py's SDP4BIT_GPUS_PER_HOST): NVLink
# inside a node, sockets (NCCL's network transport, shaped by the link knob) between nodes.
TRANSPORTS: Dict[str, Dict[str, str]] = {
    "nvlink": {},
    "net": {"NCCL_P2P_DISABLE": "1"},
    "sockets": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
    "nodes": {},
}
# transports whose traffic (all of it, or between nodes) goes over TCP, where the link knob acts
TCP_TRANSPORTS = ("sockets", "nodes")


# ------------------------------------------------------------------------------------------- topologies

def parse_topology(spec: str) -> Tuple[int, int]:
    """``"NODESxGPUS"`` (``"2x2"``, ``"4x1"``, ``"1x1"``) -> (nodes, gpus_per_node); ValueError otherwise."""
    m = re.fullmatch(r"(\d+)x(\d+)", str(spec).strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"topology {spec!r} is not NODESxGPUS with both >= 1 (e.g. 2x2, 4x1, 1x1)")
    return int(m.group(1)), int(m.group(2))


# ------------------------------------------------------------------------------------------- configs

@dataclass(frozen=True)
class Variant:
    """A config of the suite: ``NAME[:REPLICA]``.

    NAME is a file of configs/ (``zero3``, ``zeropp``, ``sdp4bit``, ``qwd``, ``tlq_hs`` ...) or a path to a
    ds_config JSON; REPLICA (``node`` / ``full``) sets ``sdp4bit.weights.replica`` explicitly.  ``sdp4bit``
    without a replica is the shipped configs/sdp4bit.json unchanged (only the topology's gpus_per_node is
    injected, as a user does): those rows carry ``default: true``.
    """

    name: str
    replica: Optional[str] = None

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        name, _, rep = str(spec).partition(":")
        if rep and rep not in ("node", "full"):
            raise ValueError(f"config {spec!r}: the replica after ':' must be node or full, got {rep!r}")
        v = cls(name, rep or None)
        v.path()  # fail early on unknown names
        if v.replica and "sdp4bit" not in v.load():
            raise ValueError(f"config {spec!r}: {name} has no sdp4bit block, so no replica to set")
        return v

    @property
    def label(self) -> str:
        return self.name + (f":{self.replica}" if self.replica else "")

    @property
    def config(self) -> str:
        return Path(self.name).stem

    def path(self) -> Path:
        p = Path(self.name)
        if p.suffix == ".json" and p.is_file():
            return p
        q = CONFIG_DIR / f"{self.name}.json"
        if q.is_file():
            return q
        have = ", ".join(sorted(x.stem for x in CONFIG_DIR.glob("*.json")))
        raise ValueError(f"no config {self.name!r} (configs/ has: {have})")

    def load(self) -> dict:
        with open(self.path()) as f:
            return json.load(f)

    @property
    def is_default(self) -> bool:
        return self.path().resolve() == (CONFIG_DIR / "sdp4bit.json").resolve() and self.replica is None

    def ds_set(self, gpus_per_node: int, share_gpu: bool) -> List[str]:
        """``--ds-set`` arguments of train_gpt.py for this config at a topology with ``gpus_per_node``."""
        cfg = self.load()
        out: List[str] = []
        if "sdp4bit" in cfg:
            out.append(f"sdp4bit.topology.gpus_per_node={gpus_per_node}")
            if self.replica:
                out.append(f'sdp4bit.weights.replica="{self.replica}"')
        zo = cfg.get("zero_optimization") or {}
        if zo.get("zero_hpz_partition_size", 1) not in (None, 1):
            # Share-GPU mode: DeepSpeed counts one GPU per node (each rank sees one device), so hpZ must be 1.
            out.append(f"zero_optimization.zero_hpz_partition_size={1 if share_gpu else gpus_per_node}")
        return out


# ------------------------------------------------------------------------------------------- what a row ran

def _flat(d: dict, prefix: str = "") -> Dict[str, object]:
    out: Dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_snapshot(cfg: dict, replica: Optional[str], parse_block) -> Dict[str, object]:
    """The ds_config a run used, as dotted keys: its ``"sdp4bit"`` block resolved by ``parse_block`` (every
    default filled in as the measured code read it) with ``replica`` set as the variant sets it, the per-run
    ``topology.gpus_per_node`` left out, and the old ``"auto"`` spelling of an automatic choice read as omitted
    (None: the same choice, spelt the way ``"auto"``-free configs spell it since 2d0adef).  Rows are compared
    with today's default config through it (``config_differences``)."""
    cfg = json.loads(json.dumps(cfg))
    block = cfg.pop("sdp4bit", None)
    out = _flat(cfg)
    if block is not None:
        if replica:
            block.setdefault("weights", {})["replica"] = replica
        resolved = _flat(parse_block(block).model_dump(), "sdp4bit.")
        resolved.pop("sdp4bit.topology.gpus_per_node", None)
        out.update({k: (None if v == "auto" else v) for k, v in resolved.items()})
    return out


@functools.lru_cache(maxsize=None)
def _dsconfig_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sdp4bit_examples_dsconfig", REPO / "examples" / "dsconfig.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def apply_ds_set(cfg: dict, items: Sequence[str]) -> dict:
    """examples/dsconfig.py's ``apply_ds_set`` (train_gpt.py's ``--ds-set KEY=VALUE``): the same code."""
    return _dsconfig_module().apply_ds_set(cfg, items)


def ds_sets_of(train_args: Sequence[str]) -> List[str]:
    """The ``KEY=VALUE`` of every ``--ds-set`` in a train_gpt.py argument list (``--ds-set X`` or ``--ds-set=X``)."""
    out, args = [], list(train_args)
    for i, a in enumerate(args):
        if a == "--ds-set" and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith("--ds-set="):
            out.append(a[len("--ds-set="):])
    return out


def mean_se(xs: Sequence[float]) -> Tuple[float, Optional[float]]:
    """Mean of ``xs`` and its standard error (sample standard deviation / sqrt(n)); None for one value."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) ** 0.5


# Keys added after rows were measured whose value here is what the code did before the key existed: a row
# without the key ran that value (an opt-in feature added later changes nothing a row measured).
BEHAVIOUR_BEFORE_KEY = {"sdp4bit.gradients.error_feedback": False, "sdp4bit.gradients.inter8_steps": 0}


def config_differences(row_snapshot: Dict[str, object], today: Dict[str, object]) -> Dict[str, tuple]:
    """{key: (the row's value, today's)} where they differ; a key the row's version did not have reads
    ``"absent"`` (that version could not be set that way), unless BEHAVIOUR_BEFORE_KEY says what it did."""
    def row(k):
        return row_snapshot.get(k, BEHAVIOUR_BEFORE_KEY.get(k, "absent"))

    keys = sorted(set(row_snapshot) | set(today))
    return {k: (row(k), today.get(k, "absent")) for k in keys if row(k) != today.get(k, "absent")}


def config_snapshot_at(commit: str, config: str, replica: Optional[str]) -> Optional[Dict[str, object]]:
    """``config_snapshot`` of ``configs/<config>.json`` as the code of ``commit`` read it (its own
    ``config.py`` from git), for rows measured before rows carried their snapshot.  It assumes the row ran
    that commit's file with only the replica and the topology set on the command line (what e2e passed before
    it recorded the snapshot).  None, with the reason printed, where git, the commit or a file is missing or
    that config.py does not run here."""
    import types

    def show(path: str) -> Optional[str]:
        try:
            r = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, text=True,
                               timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"config_snapshot_at {commit}: git failed: {e}", file=sys.stderr)
            return None
        return r.stdout if r.returncode == 0 else None

    src, cfg = show("deepspeed_sdp4bit/config.py"), show(f"configs/{config}.json")
    if src is None or cfg is None:
        return None
    name = f"_sdp4bit_config_at_{commit}"
    if name not in sys.modules:
        mod = types.ModuleType(name)
        sys.modules[name] = mod   # pydantic resolves the module's annotations through sys.modules
        try:
            exec(compile(src, f"{commit}:deepspeed_sdp4bit/config.py", "exec"), mod.__dict__)
        except Exception as e:  # noqa: BLE001  (old code: whatever it raises, this commit has no snapshot)
            del sys.modules[name]
            print(f"config_snapshot_at {commit}: its config.py does not run here: {e!r}", file=sys.stderr)
            return None
    try:
        return config_snapshot(json.loads(cfg), replica, sys.modules[name].parse_block)
    except Exception as e:  # noqa: BLE001
        print(f"config_snapshot_at {commit}: configs/{config}.json does not parse there: {e!r}", file=sys.stderr)
        return None


# ------------------------------------------------------------------------------------------- machine facts

def git_commit() -> str:
    """``$SDP4BIT_COMMIT`` when set (the device machine's copy of the tree carries git metadata that is not
    this checkout's: it named the base commit of the session there), else the checkout's commit (``+dirty``
    when tracked files differ), else unknown."""
    if os.environ.get("SDP4BIT_COMMIT"):
        return os.environ["SDP4BIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=20)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=20).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("SDP4BIT_COMMIT") or "unknown"


def _pkg_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def machine_info() -> Dict[str, object]:
    """GPU name / count / driver (nvidia-smi), CPU, host, and the torch / DeepSpeed / NCCL versions."""
    info: Dict[str, object] = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                               "cpu_count": os.cpu_count(), "python": platform.python_version()}
    gpus: List[Dict[str, str]] = []
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        for line in q.stdout.strip().splitlines():
            name, driver, mem = [x.strip() for x in line.split(",")]
            gpus.append({"name": name, "driver": driver, "memory": mem})
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    info["gpus"] = gpus
    info["gpu_name"] = gpus[0]["name"] if gpus else None
    info["gpu_count"] = len(gpus)
    info["driver"] = gpus[0]["driver"] if gpus else None
    versions = {"deepspeed": _pkg_version("deepspeed"), "deepspeed_sdp4bit": _pkg_version("deepspeed_sdp4bit"),
                "triton": _pkg_version("triton")}
    try:
        import torch
        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        versions["torch"] = f"unavailable ({e})"
    info["versions"] = versions
    return info


def device_label(info: Dict[str, object]) -> str:
    """Short machine name for tables: the GPU name, or ``cpu (N cores)``."""
    return str(info.get("gpu_name") or f"cpu ({info.get('cpu_count')} cores)")


def new_run_id(question: str) -> str:
    return f"{question}_{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}_{os.getpid()}"


def run_meta(question: str, run_id: str, args) -> Dict[str, object]:
    info = machine_info()
    return {"question": question, "run_id": run_id, "commit": git_commit(),
            "command": shlex.join([sys.executable, "-m", "benchmarks"] + sys.argv[1:]) if sys.argv else "",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": info, "versions": info.pop("versions"),
            "args": {k: v for k, v in vars(args).items() if k != "func"}}


# ------------------------------------------------------------------------------------------- files

def write_json(path: Path, obj) -> None:
    """Atomic JSON write (a crash leaves the previous version)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def load_rows(path: Path) -> List[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of rows")
    return data


def load_rows_from(paths: Sequence[Path]) -> List[dict]:
    """The rows of every readable row file of ``paths`` (a missing or unreadable file adds none)."""
    found: List[dict] = []
    for f in paths:
        try:
            found += load_rows(f)
        except (OSError, ValueError, json.JSONDecodeError):
            pass
    return found


def merge_rows(path: Path, rows: Sequence[dict]) -> List[dict]:
    """Merge ``rows`` into the JSON list at ``path`` (same ``row_id`` replaced, others kept); returns it."""
    old = load_rows(path)
    new_ids = {r["row_id"] for r in rows}
    merged = [r for r in old if r.get("row_id") not in new_ids] + list(rows)
    write_json(path, merged)
    return merged


def merge_dict(path: Path, items: Dict[str, object]) -> None:
    """Merge ``items`` into the JSON object at ``path`` (same keys replaced)."""
    path = Path(path)
    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc.update(items)
    write_json(path, doc)


# ------------------------------------------------------------------------------------------- launching

def on_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def launch_command(script: Path, script_args: List[str], world: int, ranks_per_gpu: int,
                   cpu: bool, gpus_per_host: Optional[int] = None) -> Tuple[List[str], Dict[str, str]]:
    """torchrun command and extra env for ``world`` ranks of ``script``.

    ``ranks_per_gpu`` > 1 (GPU only): the ranks share GPUs through ``share_gpu.py``, which gives every rank
    its own NCCL host id and one visible GPU before torch is imported (see that file).
    ``gpus_per_host`` (GPU only, one rank per GPU): the same wrapper makes every ``gpus_per_host`` consecutive
    ranks one NCCL host that sees its own GPUs (NVLink inside, sockets between hosts).
    """
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    env: Dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
        return launch + [str(script)] + script_args, env
    if ranks_per_gpu > 1 and gpus_per_host is not None:
        raise ValueError("launch_command: ranks sharing a GPU and hosts of several GPUs exclude each other")
    if ranks_per_gpu > 1:
        env["SDP4BIT_RANKS_PER_GPU"] = str(ranks_per_gpu)
        return launch + [str(SHARE_GPU), str(script)] + script_args, env
    if gpus_per_host is not None:
        env["SDP4BIT_GPUS_PER_HOST"] = str(gpus_per_host)
        return launch + [str(SHARE_GPU), str(script)] + script_args, env
    return launch + [str(script)] + script_args, env


def run_process(cmd: List[str], env_extra: Dict[str, str], log_path: Path, timeout_s: float) -> Tuple[object, float]:
    """Run ``cmd`` (its own process group, output to ``log_path``); returns (returncode or "timeout", wall s).

    On timeout the whole process group (torchrun and its ranks) is killed.
    """
    env = dict(os.environ)
    env.update(env_extra)
    pp = env.get("PYTHONPATH", "")
    if str(REPO) not in pp.split(os.pathsep):
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + pp if pp else "")
    t0 = time.time()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as f:
        f.write("$ " + " ".join(f"{k}={v}" for k, v in env_extra.items()) + " " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)

        def _stop_group() -> None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue

        def _on_term(signum, frame):   # the suite itself stopped (e.g. `timeout`): take the ranks along
            _stop_group()
            raise SystemExit(128 + signum)

        main_thread = threading.current_thread() is threading.main_thread()
        old_term = signal.signal(signal.SIGTERM, _on_term) if main_thread else None
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            rc = "timeout"
            _stop_group()
        except BaseException:
            _stop_group()
            raise
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, old_term)
    return rc, time.time() - t0


def log_tail(path: Path, n: int = 25) -> List[str]:
    """The last ``n`` informative lines of a run's output (DeepSpeed's per-rank noise dropped)."""
    if not Path(path).is_file():
        return []
    lines = Path(path).read_text(errors="replace").splitlines()
    keep = [ln for ln in lines if ln.strip() and "FutureWarning" not in ln and "warnings.warn" not in ln]
    return keep[-n:]


class Deadline:
    """A wall-clock budget for one call of the suite (the GPU machine allows 10 minutes per command)."""

    def __init__(self, seconds: Optional[float]):
        self.end = time.time() + seconds if seconds else None

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()


def work_dir(run_id: str) -> Path:
    """Scratch folder of one run (train_gpt.py logs and outputs), outside the results folder."""
    d = Path(tempfile.gettempdir()) / "sdp4bit_bench" / run_id
    d.mkdir(parents=True, exist_ok=True)
    return d


def pack_logs(work: Path, archive: Path) -> None:
    """All logs of a run as one archive next to its results file (then the scratch folder is removed)."""
    import shutil
    import tarfile

    if not Path(work).is_dir():
        return
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(work, arcname=Path(work).name)
    shutil.rmtree(work, ignore_errors=True)


def finished_training(row: dict) -> bool:
    """An accuracy row whose training ran to its last step and final evaluation: ``status`` ok, or a run
    killed by its timeout only after both (steps_done == steps and a held-out loss recorded: what remained
    was the ranks' teardown).  Its losses are complete; the report counts it, marked."""
    if row.get("status") == "ok":
        return True
    return (row.get("status") == "timeout" and row.get("steps") is not None
            and row.get("steps_done") == row.get("steps") and row.get("heldout_loss") is not None)


def closeness_in_time(row: dict):
    """A sort key for rows measured to stand in for ``row`` (a baseline, a link rate from another call): larger
    for one measured nearer in time to ``row`` (``created``); without ``row``'s time, larger for the newer. The
    machines' loopback differs from call to call, so the nearest measurement is the likeliest to share its link."""
    def when(r: dict) -> Optional[float]:
        try:
            return _dt.datetime.fromisoformat(str(r.get("created"))).timestamp()
        except ValueError:
            return None

    t = when(row)

    def key(c: dict) -> float:
        tc = when(c)
        return float("-inf") if tc is None else (tc if t is None else -abs(tc - t))
    return key


def timed_alone(r: dict, paired: bool = False) -> bool:
    """A finished row whose step time is one config's alone: ok with ``ms_per_step``, never an ``e2e
    --overlap-blocks`` row (``overlap_ab``: its steps switched between two modes), and a paired one (``e2e --paired``:
    two engines in one process) only with ``paired``."""
    return (r.get("status") == "ok" and bool(r.get("ms_per_step")) and "overlap_ab" not in r
            and (paired or not r.get("paired_with")))


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
