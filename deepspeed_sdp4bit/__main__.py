"""``python -m deepspeed_sdp4bit``: the environment report, and a config linter with a bytes plan.

Without arguments: versions (Python, torch, DeepSpeed, Triton, CUDA, nvcc, ninja; transformers/accelerate
when installed), which sdp4bit kernel backends run here, and whether the CUDA op is built or buildable
(nothing is built).

With ``--ds-config F --world N [--gpus-per-node G] [--params P]``: validates F exactly as
``deepspeed.initialize`` would with N ranks, G per host (the same errors; exit status 1 on any, so it works as
a config linter in CI), prints what SDP4Bit will do at each level, and with ``--params`` the bytes each GPU
sends per optimizer step against ZeRO-3 and ZeRO++ (:mod:`deepspeed_sdp4bit.step_bytes`, a model).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import warnings
from typing import Any, Dict, List, Optional

import torch

from . import __version__
from .config import SDP4BitConfigError


# ----------------------------------------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------------------------------------
def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed (no __version__)")
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        return f"not usable ({type(e).__name__}: {e})" if not isinstance(e, ImportError) else "not installed"


def _tool(cmd: List[str]) -> str:
    exe = shutil.which(cmd[0])
    if exe is None:
        return "not found on PATH"
    try:
        out = subprocess.run([exe] + cmd[1:], capture_output=True, text=True, timeout=30)
        text = (out.stdout or out.stderr).strip().splitlines()
        return f"{text[-1] if text else '?'} ({exe})"
    except Exception as e:  # noqa: BLE001
        return f"{exe}: {type(e).__name__}: {e}"


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home:
        try:
            from torch.utils.cpp_extension import CUDA_HOME as home  # noqa: N811
        except Exception:  # noqa: BLE001
            home = None
    cand = os.path.join(home, "bin", "nvcc") if home else None
    if cand and os.path.isfile(cand):
        return _tool([cand, "--version"])
    return _tool(["nvcc", "--version"])


def cuda_op_status() -> Dict[str, Any]:
    """Whether the ``sdp4bit_quant`` CUDA extension is built (ahead of time, or in the JIT cache) and whether
    it could be built here; builds nothing."""
    from . import _native

    st: Dict[str, Any] = {}
    st["aot_build"] = importlib.util.find_spec(_native.AOT_MODULE) is not None
    try:
        ob, cs = _native.native_dirs()
        st["sources"] = cs
    except FileNotFoundError as e:
        st["sources"] = None
        st["buildable"] = False
        st["why"] = str(e)
        st["jit_cache"] = None
        return st
    try:
        from torch.utils.cpp_extension import _get_build_directory

        builder = _native.make_builder()
        d = _get_build_directory(builder.name, False)
        so = [f for f in os.listdir(d) if f.endswith(".so")] if os.path.isdir(d) else []
        st["jit_cache"] = os.path.join(d, so[0]) if so else None
    except Exception as e:  # noqa: BLE001
        builder = None
        st["jit_cache"] = None
        st["why"] = f"op builder: {type(e).__name__}: {e}"
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU build")
    elif not torch.cuda.is_available():
        reasons.append("no CUDA device visible")
    if shutil.which("ninja") is None:
        reasons.append("ninja not found")
    if "not found" in _nvcc():
        reasons.append("nvcc not found (set CUDA_HOME)")
    if builder is not None and not reasons:
        with contextlib.redirect_stdout(sys.stderr):
            if not builder.is_compatible(verbose=False):
                reasons.append("DeepSpeed's op builder says not compatible")
    st["buildable"] = not reasons
    if reasons:
        st["why"] = "; ".join(reasons)
    return st


def backend_status() -> Dict[str, str]:
    """Each kernel backend on this machine's device (cuda if visible, else cpu): usable or why not.  The CUDA
    backend is not probed (its probe would JIT-build the extension): see :func:`cuda_op_status`."""
    from . import ops

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    out = {}
    for name in ("torch", "triton"):
        b, why = ops._try(name, dev)
        out[name] = ("usable: " if b is not None else "not usable: ") + why
    if dev.type != "cuda":
        out["cuda"] = "not usable: no CUDA device (the cuda backend runs on CUDA tensors only)"
    else:
        st = cuda_op_status()
        built = st["aot_build"] or st["jit_cache"]
        out["cuda"] = ("built, loads on first use" if built else
                       "buildable: JIT-built on first use (about a minute)" if st["buildable"] else
                       f"not usable: {st.get('why')}")
    if dev.type == "cuda":
        order = ", ".join(f"{op}: {'/'.join(o)}" for op, o in ops.AUTO_ORDER.items())
        out["automatic (kernel_backend omitted)"] = f"per op the first usable of {order}"
    else:
        out["automatic (kernel_backend omitted)"] = "torch (CPU tensors)"
    return out


def environment() -> Dict[str, Any]:
    env: Dict[str, Any] = {
        "deepspeed_sdp4bit": f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})",
        "python": platform.python_version(),
        "torch": f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'})",
        "deepspeed": _version("deepspeed"),
        "triton": _version("triton"),
        "cuda devices": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        if torch.cuda.is_available() else "none visible",
        "nvcc": _nvcc(),
        "ninja": _tool(["ninja", "--version"]),
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
    }
    from .integration import SUPPORTED_DEEPSPEED

    if not env["deepspeed"].startswith(SUPPORTED_DEEPSPEED):
        env["deepspeed"] += f"  <-- sdp4bit supports {SUPPORTED_DEEPSPEED}x only"
    env["kernel backends"] = backend_status()
    env["cuda op"] = cuda_op_status()
    return env


def format_environment(env: Dict[str, Any]) -> str:
    lines = ["deepspeed_sdp4bit environment report", "-" * 36]
    for k, v in env.items():
        if isinstance(v, dict):
            lines.append(f"{k}:")
            lines += [f"  {kk}: {vv}" for kk, vv in v.items()]
        else:
            lines.append(f"{k}: {v}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# config linter and plan
# ----------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _launcher_env(gpus_per_node: Optional[int]):
    """What the launcher would set for the automatic topology (LOCAL_WORLD_SIZE = ranks on this host)."""
    keys = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ.pop(k, None)
    if gpus_per_node is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(gpus_per_node)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3f} {unit}"
    return f"{int(n)} B"


def _check_zero_section(ds_config: Dict[str, Any]) -> None:
    """DeepSpeed's own validation of ``zero_optimization`` (a misspelt key, a value of the wrong type), as
    ``deepspeed.initialize`` runs it on the ds_config it is given (DeepSpeed itself skips ``"auto"`` values, which HF
    accelerate fills): raised here as a ValueError naming the section and every key it refuses."""
    from deepspeed.runtime.zero.config import get_zero_config

    try:
        get_zero_config(ds_config)
    except Exception as e:   # noqa: BLE001 - DeepSpeed's own error (pydantic's ValidationError, a TypeError ...)
        errors = getattr(e, "errors", None)
        said = ("; ".join(".".join(map(str, er["loc"])) + ": " + er["msg"] for er in errors()) if callable(errors)
                else str(e))
        raise ValueError(f"zero_optimization: deepspeed.initialize refuses it (DeepSpeed's own check): "
                         f"{said}") from None


def plan(ds_config: Dict[str, Any], world: int, gpus_per_node: Optional[int] = None,
         params: Optional[int] = None, device_bytes: Optional[int] = None) -> Dict[str, Any]:
    """Validate ``ds_config`` for ``world`` ranks, ``gpus_per_node`` per host, as ``deepspeed.initialize``
    would (raises its errors), and describe what SDP4Bit does; with ``params``, the bytes per GPU per step."""
    from . import integration
    from .collectives import gradients as G
    from .config import parse_ds_config
    from .step_bytes import SCHEMES, node_link_bytes, step_bytes, totals
    from .topology import TopologyShape, job_gpus_per_node

    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    with _launcher_env(gpus_per_node):
        requested = parse_ds_config(ds_config)
        # what deepspeed.initialize decides for this job (automatic choices made, parts turned off)
        try:
            with warnings.catch_warnings(record=True) as warned:   # sdp4bit's own: notes below; others re-emitted
                warnings.simplefilter("always")
                rp = integration.plan_run(ds_config, world, n_params=params, device_bytes=device_bytes)
        except SDP4BitConfigError as e:
            if gpus_per_node is None and "LOCAL_WORLD_SIZE" in str(e):
                raise SDP4BitConfigError(f"{e} (here: pass --gpus-per-node G, the ranks per host)") from None
            if gpus_per_node is not None and "LOCAL_WORLD_SIZE=" in str(e):
                raise SDP4BitConfigError(f"{e} (here: --gpus-per-node {gpus_per_node})") from None
            raise
        _check_zero_section(rp.ds_config)   # what DeepSpeed is given (sdp4bit's own settings made)
        new_config, cfg, off_reason, notes = rp.ds_config, rp.cfg, rp.off_reason, list(rp.notes)
        for w in warned:
            if str(w.message).startswith("sdp4bit"):
                notes.append(str(w.message))
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        out: Dict[str, Any] = {"world": world, "active": cfg.active, "lines": [], "cfg": cfg.model_dump()}
        lines = out["lines"]
        if not requested.active:
            lines.append("no active sdp4bit block: DeepSpeed runs as configured (plain ZeRO), nothing of "
                         "sdp4bit is used")
            return out
        lines += [f"note: {n}" for n in notes]
        from deepspeed.utils.config import get_timers_config
        try:   # a block DeepSpeed refuses (the overlap's choice reads it): said here, not at the engine's build
            get_timers_config(ds_config)
        except Exception as e:   # noqa: BLE001 - DeepSpeed's own error, whatever its type
            first = (str(e).strip().splitlines() or [""])[0]
            lines.append(f"note: deepspeed.initialize will refuse this ds_config's timers block "
                         f"({type(e).__name__}: {first})")
        if not any(k in ds_config for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
            lines.append("note: no train_batch_size / train_micro_batch_size_per_gpu: deepspeed.initialize refuses a "
                         "config without one (the examples and the HF Trainer add it; a script of your own must)")
        if not ds_config.get("optimizer") and cfg.active:
            lines.append("note: no optimizer in this ds_config: unless deepspeed.initialize is given one (the HF "
                         "Trainer passes its own), the engine has none and SDP4Bit is off there, plain ZeRO-3 (a "
                         "forward-only engine, e.g. a reference model)")
        given = requested.topology.gpus_per_node
        if given is not None and gpus_per_node is not None and int(given) != int(gpus_per_node):
            lines.append(f"note: the config's sdp4bit.topology.gpus_per_node={given} is used, not --gpus-per-node "
                         f"{gpus_per_node}")
        if not cfg.active:
            lines.append(f"SDP4Bit is off for this job: {off_reason or 'nothing of it is enabled'}")
        try:
            gpn = job_gpus_per_node(cfg.topology.gpus_per_node, world)
        except ValueError as e:
            raise SDP4BitConfigError(str(e)) from None
    src = ("one process" if world == 1 else "sdp4bit.topology.gpus_per_node" if cfg.topology.gpus_per_node is not None
           else "gpus_per_node omitted: the launcher's ranks per host, --gpus-per-node")
    shape = TopologyShape(world // gpn, gpn)
    N, g = shape.num_nodes, shape.gpus_per_node
    out["shape"] = [N, g]
    lines.append(f"topology: {N} node(s) x {g} GPU(s) per node ({src})")
    zero_old = ds_config.get("zero_optimization") or {}
    zero_new = new_config.get("zero_optimization") or {}
    changed = {k: v for k, v in zero_new.items() if zero_old.get(k) != v}
    if changed:
        lines.append("ds_config keys sdp4bit sets for DeepSpeed: "
                     + ", ".join(f"zero_optimization.{k}={v}" for k, v in sorted(changed.items())))
    w = cfg.weights
    if w.enabled and cfg.enabled:
        what = f"{w.bits}-bit {'differences to the replica (qWD)' if w.mode == 'diff' else 'weights (qW)'}, " \
               f"group {w.group_size}, {w.rounding} rounding"
        if w.replica == "full":
            lines.append(f"weights: every rank keeps all weights (replica 'full'); after each step: {what}; "
                         f"inter-node all-gather among the {N} ranks of each local index, intra-node "
                         f"all-gather over {g}; no gathers in forward/backward")
            if N > 1:
                lines.append("weights.overlap: " + (
                    "off: the ds_config sets timers.throughput.synchronized=true, which waits for the whole device "
                    "at every step's end (the link not probed; remove that key to let the engine decide)"
                    if w.overlap is None and integration.user_synchronized_timer(ds_config)
                    else f"decided when the engine is built: on where the link between nodes measures below "
                    f"{w.overlap_below_gbps:g} Gb/s per rank (weights.overlap_below_gbps), on a GPU; logged"
                    if w.overlap is None else f"{'on' if w.overlap else 'off'} (given)"
                    + " on a GPU; the refresh runs inside step() on a CPU" * bool(w.overlap)))
        elif N > 1:
            lines.append(f"weights: one replica per node (replica 'node', DeepSpeed hpZ of size {g}); after "
                         f"each step: {what}; inter-node all-gather among the {N} ranks of each local index, "
                         f"intra-node all-to-all to the rank keeping each part; forward/backward gathers bf16 "
                         f"inside the node")
            lines.append("weights.overlap: off (the node replica is refreshed inside step(); only the full "
                         "replica overlaps its refresh)")
        else:
            lines.append("weights: one node, so each rank's own partition is its node replica: nothing is sent "
                         "at the refresh; forward/backward gathers as ZeRO-3's, inside the node")
    else:
        lines.append("weights: off (ZeRO-3's bf16 all-gathers)")
    gr = cfg.gradients
    if gr.enabled and cfg.enabled:
        p = G.make_plan(1 << 20, shape, gr)
        if not p.levels:
            lines.append("gradients: one rank, nothing to reduce")
        for lvl in p.levels:
            bits = gr.intra_bits if lvl.name == "intra" else gr.inter_bits
            how = "bf16, unquantized" if bits == 16 else f"{bits}-bit, group {gr.group_size}"
            lines.append(f"gradients, {lvl.name}-node all-to-all over {lvl.peers} ranks: {how}"
                         + (f", Hadamard {gr.hadamard_size}" if p.hadamard and bits != 16 else "")
                         + f", {gr.rounding} rounding" * (bits != 16))
    else:
        lines.append("gradients: off (ZeRO-3's bf16 reduce-scatter)")
    lines.append(f"kernel backend: {cfg.kernel_backend or 'automatic (per op the fastest that runs)'}")
    if params:
        accum = ds_config.get("gradient_accumulation_steps", 1)
        accum = accum if isinstance(accum, int) and not isinstance(accum, bool) and accum > 0 else 1
        out["accum"] = accum
        out["bytes"] = {}
        for scheme in SCHEMES:
            rows = step_bytes(scheme, int(params), shape, cfg, accum=accum)
            out["bytes"][scheme] = {"rows": rows, "totals": totals(rows),
                                    "node_link": node_link_bytes(rows, shape)}
    return out


def format_plan(p: Dict[str, Any]) -> str:
    from .step_bytes import node_link_bytes
    from .topology import TopologyShape

    lines = list(p["lines"])
    if "bytes" in p:
        lines.append("")
        early = (p.get("cfg") or {}).get("gradients", {}).get("inter8_steps")
        lines.append(f"bytes each GPU sends per optimizer step (a model: deepspeed_sdp4bit/step_bytes.py; "
                     f"gradient_accumulation_steps={p['accum']}"
                     + (f"; of the steps after the first {early}, which send more between nodes: "
                        f"gradients.inter8_steps" if early else "") + "):")
        for scheme, d in p["bytes"].items():
            t = d["totals"]
            lines.append(f"  {scheme}: total {_fmt_bytes(t['total'])} ("
                         + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in t.items() if k != "total")
                         + f"); crossing each node's link: {_fmt_bytes(d['node_link'])} per node")
            for r in d["rows"]:
                lines.append(f"      {r['collective']:36} {r['level']:6} {_fmt_bytes(r['bytes']):>12}  {r['note']}")
        s = p["bytes"]["sdp4bit"]
        lines.append(f"  {'sdp4bit sends, as a fraction of':42} {'per GPU':>8}  across each node's link")

        def fraction(a: float, b: float) -> str:
            return f"{a / b:.3f}x" if b else "-"
        for other in ("zero3", "zero++"):
            o = p["bytes"][other]
            lines.append(f"    {other:40} {fraction(s['totals']['total'], o['totals']['total']):>8}  "
                         f"{fraction(s['node_link'], o['node_link'])}")
            # DeepSpeed may skip the backward gathers (below): the fractions with them left out too
            fwd = [r for r in o["rows"] if not r["collective"].startswith("backward all-gather")]
            once, once_link = sum(r["bytes"] for r in fwd), node_link_bytes(fwd, TopologyShape(*p["shape"]))
            if len(fwd) < len(o["rows"]) and once:
                lines.append(f"    {other + ', its backward gathers skipped':40} "
                             f"{fraction(s['totals']['total'], once):>8}  {fraction(s['node_link'], once_link)}")
        lines.append("  (ZeRO-3's and ZeRO++'s backward all-gathers are an upper bound: DeepSpeed skips them for "
                     "parameters it keeps from forward, those whose next use lies within "
                     "stage3_max_reuse_distance, 1e9 elements by default; counted, a 406M GPT was gathered once "
                     "per step, benchmarks/results/one_gpu/wire_counts.json)")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepspeed_sdp4bit", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ds-config", help="a ds_config JSON file to validate and plan (needs --world)")
    ap.add_argument("--world", type=int, help="number of ranks (GPUs) of the job (required with --ds-config)")
    ap.add_argument("--gpus-per-node", type=int,
                    help="ranks per host (what the launcher sets as LOCAL_WORLD_SIZE); needed for an active "
                         "sdp4bit block with --world > 1 unless it sets topology.gpus_per_node")
    ap.add_argument("--params", type=float, help="model parameters, e.g. 1.3e9: prints bytes per step per GPU")
    ap.add_argument("--device-memory-gb", type=float,
                    help="memory of one accelerator (GiB): with --params, an omitted weights.replica is chosen "
                         "exactly as at run time")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    ap.add_argument("--keys", action="store_true", help="print every key of the sdp4bit block (markdown table)")
    a = ap.parse_args(argv)
    if a.keys:
        from .config import key_table

        print(key_table(), end="")
        return 0
    if a.ds_config is None:
        if a.world is not None or a.gpus_per_node is not None or a.params is not None:
            ap.error("--world/--gpus-per-node/--params need --ds-config")
        env = environment()
        print(json.dumps(env, indent=1) if a.json else format_environment(env))
        return 0
    if a.world is None:
        ap.error("--ds-config needs --world")
    try:
        with open(a.ds_config) as f:
            ds_config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: --ds-config {a.ds_config}: {e}", file=sys.stderr)
        return 1
    if not isinstance(ds_config, dict):
        print(f"error: --ds-config {a.ds_config}: the file must hold a JSON object", file=sys.stderr)
        return 1
    try:
        p = plan(ds_config, a.world, a.gpus_per_node, int(a.params) if a.params else None,
                 int(a.device_memory_gb * 2 ** 30) if a.device_memory_gb else None)
    except (SDP4BitConfigError, NotImplementedError, ValueError) as e:
        print(f"error: {a.ds_config}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    ranks = f"{a.world} rank{'' if a.world == 1 else 's'}"
    print(json.dumps(p, indent=1) if a.json else f"{a.ds_config}: OK for {ranks}\n" + format_plan(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
