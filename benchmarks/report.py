"""``python -m benchmarks report``: markdown tables, PNG plots and the README headline from the results files.

Nothing here is typed by hand: every number comes from the rows of ``throughput.json`` / ``accuracy.json``
(and the per-step losses of ``accuracy_steps.json``) in ``--dir`` (default benchmarks/results/one_gpu).
Writes there ``throughput.md``, ``throughput.png``, ``accuracy.md``, ``accuracy.png``, ``goals.md`` (the open
issues' goals against every run that measured them; also README.md's goals table); when rows were measured under
the bandwidth knob (``linkrate.json``, ``e2e --link-gbps``) also ``linkrate.md``, ``projection.md`` (the step-time
model's fit and check, benchmarks/projection.py) and ``speedup_vs_rate.png``; when a run timed
``weights.overlap`` on and off, ``overlap.md``; and rewrites the part
of README.md between ``<!-- suite:headline:begin -->`` and ``<!-- suite:headline:end -->``, its "Where it stands"
numbers (``suite:standing``) and its goals table (``suite:goals``) (``--no-readme``: leave them).  Cells without a
measurement say "not measured".  The throughput table and the headline show rows without link settings
(unshaped, NCCL's default sockets); the rate sweep has its own files.

Speed-ups compare configs inside one run (same ``run_id``) where the run has the baseline; otherwise the
baseline row of the same model, topology and machine measured nearest in time is used and the cell is marked with
``*``.

``python -m benchmarks merge FILES...``: results files brought back from a GPU machine (``<run_id>.json``:
copied to DIR/runs/ and their rows merged into DIR/throughput.json, DIR/accuracy.json or DIR/linkrate.json; row
lists are merged
the same way; ``accuracy_steps.json`` files are merged into DIR/accuracy_steps.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import accuracy, e2e, link, projection, suite

README = suite.REPO / "README.md"
BEGIN, END = "<!-- suite:headline:begin -->", "<!-- suite:headline:end -->"
STANDING_BEGIN, STANDING_END = "<!-- suite:standing:begin -->", "<!-- suite:standing:end -->"
GOALS_BEGIN, GOALS_END = "<!-- suite:goals:begin -->", "<!-- suite:goals:end -->"
# what the headline covers (issue 19): models x topologies
HEADLINE_CELLS = [("406M", "1x1"), ("406M", "2x2"), ("406M", "4x1"), ("406M", "2x4"), ("406M", "8x1"),
                  ("1.3B", "1x1"), ("1.3B", "2x2"), ("1.3B", "4x1")]
ORDER = ["zero3", "zeropp", "sdp4bit", "sdp4bit:node", "sdp4bit:full", "sdp4bit_overlap", "sdp4bit_no_overlap",
         "sdp4bit_one_piece", "qwd", "qwd:node", "qwd:full", "tlq_hs", "tlq", "ulq", "qw"]
NM = "not measured"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=str(suite.ONE_GPU), help="folder with throughput.json / accuracy.json")
    p.add_argument("--no-readme", action="store_true", help="do not rewrite README.md's generated blocks")
    p.add_argument("--no-png", action="store_true", help="tables only (no matplotlib needed)")
    p.add_argument("--smooth", type=int, default=25, help="moving-average window (steps) of the loss plot")


def add_merge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", help="results files, row lists or accuracy_steps.json files")
    p.add_argument("--dir", default=str(suite.ONE_GPU), help="the committed results folder")
    p.add_argument("--backfill-configs", action="store_true",
                   help="give the throughput rows without a config_snapshot the one their commit's code reads from "
                        "their configs/ file (git show; rows measured before e2e recorded it)")


# ------------------------------------------------------------------------------------------- selection

def _ok(rows: Sequence[dict], paired: bool = False) -> List[dict]:
    """The finished timed rows; a paired row (``e2e --paired``: two engines in one process, a step slower than a
    process of its own) only with ``paired`` (the same-code goals and their baselines), never in tables or bounds;
    never a row whose steps switched the overlap on and off (``overlap_ab``: its median mixes two modes; it has a
    table of its own in overlap.md): :func:`suite.timed_alone`."""
    return [r for r in rows if suite.timed_alone(r, paired)]


def _key(r: dict) -> Tuple[str, str, str]:
    return r.get("model"), r.get("topology"), r.get("variant")


def latest(rows: Sequence[dict], per_machine: bool = False) -> Dict[tuple, dict]:
    """The newest ok row per (model, topology, variant), of the rows without link settings; with ``per_machine``
    per (model, topology, variant, machine and mode), so one machine's or mode's newer rows do not hide another's."""
    out: Dict[tuple, dict] = {}
    for r in _ok(rows):
        if not link.unshaped(r):
            continue
        k = _key(r) + ((_where(r),) if per_machine else ())
        if k not in out or r.get("created", "") > out[k].get("created", ""):
            out[k] = r
    return out


def _where(r: dict) -> str:
    """A row's machine, with its mode where that is a multi-GPU host's (one rank per GPU)."""
    fam = projection.family(r)
    return str(r.get("machine")) + ("" if fam == projection.SHARE else f" ({fam})")


def one_gpu(rows: Sequence[dict]) -> List[dict]:
    """The rows of the one-GPU suite (ranks sharing a GPU, world size 1, or no mode recorded): the headline's
    and the one-GPU goals' rows; a multi-GPU host's have their own table."""
    return [r for r in rows if projection.family(r) == projection.SHARE]


def today_default() -> Dict[str, object]:
    """``suite.config_snapshot`` of today's shipped configs/sdp4bit.json, read by today's code."""
    from deepspeed_sdp4bit.config import parse_block

    return suite.config_snapshot(json.loads((suite.CONFIG_DIR / "sdp4bit.json").read_text()), None, parse_block)


AUTO_OVERLAP_KEYS = ("sdp4bit.weights.overlap", "sdp4bit.weights.overlap_below_gbps")


def _overlap_cannot_apply(r: dict) -> bool:
    """Rows on which today's automatic ``weights.overlap`` (the key omitted) is off whatever the link: one node
    (SDP4Bit off there, or no link between nodes to probe) and the node replica (refreshed inside ``step()``)."""
    nodes = str(r.get("topology", "")).split("x")[0]
    return nodes == "1" or r.get("replica") == "node"


def differences_from_default(r: dict, today: Dict[str, object]) -> Optional[Dict[str, tuple]]:
    """How the config a row ran differs from today's default ({} = the same); None when the row has no
    ``config_snapshot`` (see ``merge --backfill-configs``).  A row that ran without the overlap (``false``, or
    before the key) where today's automatic choice cannot turn it on (:func:`_overlap_cannot_apply`) ran what
    today's default runs there: those keys are not counted."""
    snap = r.get("config_snapshot")
    if snap is None:
        return None
    diff = suite.config_differences(snap, today)
    if (today.get(AUTO_OVERLAP_KEYS[0]) is None and diff.get(AUTO_OVERLAP_KEYS[0], (None,))[0] in (False, "absent")
            and _overlap_cannot_apply(r)):
        for k in AUTO_OVERLAP_KEYS:
            diff.pop(k, None)
    return diff


def _diff_text(diff: Dict[str, tuple]) -> str:
    def val(v):
        return "absent" if v == "absent" else json.dumps(v)
    return ", ".join(f"{k[len('sdp4bit.'):] if k.startswith('sdp4bit.') else k} {val(a)} (today {val(b)})"
                     for k, (a, b) in diff.items())


# Fixes after which a row measures something else than before, with the rows they concern: a row whose commit
# lacks one ran today's default config, perhaps, but not today's code (``merge`` records them: ``fixes_missing``).
RESULT_FIXES = {
    "81caf8d": ("DeepSpeed's zero.Init also built hpZ secondary partitions for an omitted replica with several "
                "ranks per node", lambda r: (r.get("gpus_per_node") or 1) > 1 and _omitted_replica(r)),
}


def _omitted_replica(r: dict) -> bool:
    snap = r.get("config_snapshot") or {}
    return bool(snap.get("sdp4bit.enabled")) and snap.get("sdp4bit.weights.enabled", True) \
        and snap.get("sdp4bit.weights.replica", "absent") is None


@functools.lru_cache(maxsize=None)
def _has_fix(fix: str, commit: str) -> Optional[bool]:
    """Whether ``commit`` contains ``fix`` (git ancestry); None when git cannot tell here."""
    try:
        rc = subprocess.run(["git", "merge-base", "--is-ancestor", fix, commit], cwd=suite.REPO,
                            capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(rc)


def fixes_missing(r: dict) -> Optional[List[str]]:
    """The RESULT_FIXES that concern ``r`` and that its commit lacks (git ancestry); None when its commit is not
    known to git here (or was a dirty tree)."""
    commit = str(r.get("commit") or "")
    if not commit or "+" in commit or commit == "unknown":
        return None
    out = []
    for fix, (_, applies) in RESULT_FIXES.items():
        if not applies(r):
            continue
        has = _has_fix(fix, commit)
        if has is None:
            return None
        if not has:
            out.append(fix)
    return out


def runs_today(r: dict, today: Dict[str, object], ignore: Sequence[str] = ()) -> Optional[bool]:
    """Whether ``r`` ran today's default: its config (less the keys of ``ignore``) and every fix of RESULT_FIXES
    that concerns it; None when either is not recorded (``merge --backfill-configs``)."""
    diff = differences_from_default(r, today)
    if diff is None:
        return None
    if any(k not in ignore for k in diff):
        return False
    missing = r.get("fixes_missing")
    return None if missing is None else not missing


def config_run(r: dict, today: Dict[str, object]) -> str:
    """The headline's words for what ``r`` ran, against today's default."""
    diff, missing = differences_from_default(r, today), r.get("fixes_missing")
    if diff is None or missing is None:
        return "not known (no config snapshot or commit)"
    before = "; ".join(f"before {f} ({RESULT_FIXES[f][0]})" for f in missing)
    if not diff:
        return "today's default" + (f" config, {before}" if before else "")
    return f"the default of {r.get('commit')}: {_diff_text(diff)}" + (f"; {before}" if before else "")


def default_rows(rows: Sequence[dict], model: str, topo: str, today: Dict[str, object],
                 paired: bool = False) -> List[dict]:
    """Every ok unshaped row of the one-GPU suite at (model, topology) that ran today's default config (whatever its
    variant was called) or the shipped default of its own commit (``default``), oldest first (``paired``: with the
    paired rows)."""
    return sorted((r for r in _ok(one_gpu(rows), paired) if link.unshaped(r) and r.get("model") == model
                   and r.get("topology") == topo and (r.get("default") or differences_from_default(r, today) == {})),
                  key=lambda r: r.get("created", ""))


def one_per_run(rs: Sequence[dict], today: Dict[str, object]) -> List[dict]:
    """Of rows of several runs, one per run: the one nearest today's default (today's > today's config > its
    commit's default), oldest run first."""
    def rank(r):
        return (runs_today(r, today) is True, differences_from_default(r, today) == {}, r.get("created", ""))
    best: Dict[str, dict] = {}
    for r in rs:
        k = r.get("run_id")
        if k not in best or rank(r) > rank(best[k]):
            best[k] = r
    return sorted(best.values(), key=lambda r: r.get("created", ""))


def headline_row(rows: Sequence[dict], model: str, topo: str, today: Dict[str, object]) -> Optional[dict]:
    """The newest row that ran today's default (config and code), else the newest that ran its config, else the
    newest shipped default of its commit."""
    cands = default_rows(rows, model, topo, today)
    same = [r for r in cands if runs_today(r, today) is True]
    config = [r for r in cands if differences_from_default(r, today) == {}]
    return (same or config or cands or [None])[-1]


def baseline(r: dict, rows: Sequence[dict], config: str) -> Tuple[Optional[dict], bool]:
    """The ``config`` row to compare ``r`` with: same run if it has one (True), else the same-machine one measured
    nearest in time to ``r`` (False).

    A row marked ``topology_independent`` (its command does not depend on the node layout: ZeRO-3 and ZeRO++ in
    share-GPU mode) stands for every topology with the same number of ranks.
    """
    same = [b for b in _ok(rows, paired=True) if b.get("config") == config and b.get("variant") == config
            and link.settings_of(b) == link.settings_of(r) and bool(b.get("paired_with")) == bool(r.get("paired_with"))
            and b.get("model") == r.get("model") and (b.get("topology") == r.get("topology") or (
                b.get("topology_independent") and b.get("ranks") == r.get("ranks")))]
    in_run = [b for b in same if b.get("run_id") == r.get("run_id")]
    if in_run:
        return in_run[-1], True
    other = [b for b in same if b.get("machine") == r.get("machine") and b.get("mode") == r.get("mode")]
    return (max(other, key=suite.closeness_in_time(r)), False) if other else (None, False)


def _ratio(r: dict, rows: Sequence[dict], config: str) -> str:
    b, same_run = baseline(r, rows, config)
    if b is None:
        return NM
    return f"{b['ms_per_step'] / r['ms_per_step']:.2f}x" + ("" if same_run else "*")


def _header(*cols: str) -> List[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


# ------------------------------------------------------------------------------------------- throughput

def throughput_table(rows: Sequence[dict]) -> str:
    best = latest(rows, per_machine=True)
    if not best:
        return "No throughput rows yet (run `python -m benchmarks e2e ...`).\n"
    lines = _header("model", "topology", "mode", "config", "replica", "default", "ms/step (min-max)", "tokens/s",
                    "peak mem GiB", "wire MB/step/rank", "bound fraction", "vs ZeRO-3", "vs ZeRO++", "machine",
                    "commit")

    def order(k):   # each cell's rows by machine, then config
        model, topo, var, machine = k
        n, g = suite.parse_topology(topo)
        return (model, n * g, topo, machine, ORDER.index(var) if var in ORDER else len(ORDER), var)

    today = today_default()

    def default_cell(r):   # today's default (config and fixes), or the default of its commit then
        return "today" if runs_today(r, today) else ("then" if r.get("default") else "")

    for k in sorted(best, key=order):
        r = best[k]
        wire = r.get("wire_bytes_total")
        lines.append("| " + " | ".join([
            str(r["model"]), str(r["topology"]), str(r.get("mode")), str(r["variant"]),
            str(r.get("replica") or "-"), default_cell(r),
            f"{r['ms_per_step']:.1f} ({r['ms_min']:.0f}-{r['ms_max']:.0f})",
            _fmt(r.get("tokens_per_s"), ",.0f"),
            _fmt(r["peak_mem_bytes"] / 2 ** 30 if r.get("peak_mem_bytes") else None, ".1f"),
            _fmt(wire / 1e6 if wire is not None else None, ",.0f"),
            _fmt(r.get("bound_fraction"), ".2f"),
            _ratio(r, rows, "zero3"), _ratio(r, rows, "zeropp"), str(r.get("machine")),
            str(r.get("commit"))]) + " |")
    # runs that did not finish, of the cells (knob settings included) with no finished run: a later run that did
    # stands for them, and so does a topology-independent run (ZeRO-3 / ZeRO++ in share-GPU mode) of the ranks
    def cell(r):
        return _key(r), link.settings_of(r), _where(r)

    def ranks_cell(r):   # a topology-independent run covers every topology of its rank count
        return r.get("model"), r.get("ranks"), r.get("variant"), link.settings_of(r), _where(r)

    done = {cell(r) for r in _ok(rows)}
    anywhere = {ranks_cell(r) for r in _ok(rows) if r.get("topology_independent")}
    failed = [r for r in rows if r.get("status") != "ok" and not r.get("paired_with") and cell(r) not in done
              and ranks_cell(r) not in anywhere]
    note = ("\nms/step: median of the timed steps of one run (after the warm-up steps), min-max beside it. default: "
            "`today` = today's shipped default (config and the fixes that change results), `then` = the shipped "
            "default of the row's commit. "
            "bound fraction: the world-1 ZeRO-3 step of the same model x the ranks sharing one device, divided by "
            "this step time. vs ZeRO-3 / ZeRO++: their ms/step / this ms/step inside the same run (`*`: from "
            "another run on the same machine and mode). wire: bytes one rank sends per step (SDP4Bit's from "
            "`engine.sdp4bit_summary()`, DeepSpeed's by formula, see benchmarks/e2e.py).\n")
    if failed:   # one entry per cell and outcome, however many runs it failed or was skipped in
        notes = [f"{r.get('model')} {r.get('topology')} {r.get('variant')} ({_short(_where(r))})"
                 + ("" if link.unshaped(r) else f" (knob {link.label(r.get('link_gbps'))} Gb/s"
                    + (f", {r['link_delay_us']:g} us" if r.get("link_delay_us") else "") + ")")
                 + f": {r.get('status')}" + (f" ({r.get('reason')})" if r.get("reason") else "") for r in failed]
        note += "\nCells with no finished run: " + "; ".join(dict.fromkeys(notes)) + ".\n"
    return "\n".join(lines) + "\n" + note


def _short(machine) -> str:
    """``H100`` for "NVIDIA H100 80GB HBM3"; a mode in parentheses is kept ("H200 (4 GPUs, nodes)")."""
    name, paren, mode = str(machine).partition(" (")
    words = name.replace("NVIDIA ", "").split()
    return (words[0] if words else name) + (paren + mode if paren else "")


def throughput_png(rows: Sequence[dict], png: Path) -> bool:
    best = {(m, t, v, _short(g)): r for (m, t, v, g), r in latest(rows, per_machine=True).items()}
    cells = sorted({(m, t, g) for m, t, _, g in best if t != "1x1"},
                   key=lambda c: (c[0], suite.parse_topology(c[1])[0] * suite.parse_topology(c[1])[1], c[1], c[2]))
    if not cells:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [v for v in ORDER if any(k[2] == v for k in best)] + sorted({k[2] for k in best} - set(ORDER))
    variants = [v for v in variants if v != "zero3"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4.5))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs, ys = [], []
        for j, (m, t, g) in enumerate(cells):
            r = best.get((m, t, v, g))
            b = baseline(r, rows, "zero3")[0] if r else None
            if r and b:
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                ys.append(b["ms_per_step"] / r["ms_per_step"])
        ax.bar(xs, ys, width, label=v)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{m}\n{t}\n{g}" for m, t, g in cells], fontsize=8)
    ax.set_ylabel("speed-up vs ZeRO-3 (step time ratio)")
    machines = sorted({str(best[k].get("machine")) for k in best})
    modes = sorted({str(best[k].get("mode")) for k in best if k[1] != "1x1"})
    ax.set_title(f"{', '.join(machines)}; {', '.join(modes)}", fontsize=9)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------- accuracy

HEADLINE_MIN_STEPS = 100   # the README's loss table: runs of at least this many steps (accuracy.md has every run)


def _acc_groups(rows: Sequence[dict]):
    """ok accuracy rows grouped as {(ranks, schedule, steps): {variant@topology: [rows]}} plus ZeRO-3 refs."""
    groups: Dict[tuple, Dict[str, List[dict]]] = {}
    for r in rows:
        if not suite.finished_training(r) or r.get("train_loss") is None:
            continue
        # runs under deterministic algorithms form groups of their own ("model" says so: 86M deterministic)
        model = r.get("model") if not r.get("deterministic") else f"{r.get('model')} deterministic"
        g = groups.setdefault((r["ranks"], r["schedule"], r["steps"], model), {})
        name = "zero3" if r["config"] == "zero3" and r.get("variant") in ("zero3", "zero3:replay") \
            else f"{r['variant']} {r['topology']}"
        g.setdefault(name, []).append(r)
    for g in groups.values():
        for name, rs in g.items():
            # every run counts: repeats of one seed differ on a GPU (its kernels are not deterministic: two runs
            # of one config and seed were seen 1.9% apart at step 300), so they belong to the band too
            g[name] = sorted(rs, key=lambda r: (r["seed"], r.get("created", "")))
    return groups


def _acc_order(item) -> tuple:
    """Order of ``_acc_groups`` items: model, ranks, schedule, then steps as numbers (500 before 2000)."""
    ranks, sched, steps, model = item[0]
    return str(model), ranks or 0, str(sched), steps or 0


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _paired(rs: Sequence[dict], ref: Sequence[dict], key: str) -> List[Tuple[int, float]]:
    """(seed, % difference) of each seed's mean ``key`` over ``rs`` against ZeRO-3's mean over its runs of the
    same seed, for the seeds both have (data order and initialisation are the seed's: the paired comparison)."""
    out = []
    for seed in sorted({r["seed"] for r in rs} & {r["seed"] for r in ref}):
        a = [r[key] for r in rs if r["seed"] == seed and r.get(key) is not None]
        b = [r[key] for r in ref if r["seed"] == seed and r.get(key) is not None]
        if a and b:
            out.append((seed, 100 * (_mean(a) / _mean(b) - 1)))
    return out


def _paired_cell(rs: Sequence[dict], ref: Sequence[dict], key: str, seed_labels: bool) -> Optional[str]:
    """``"+m% (d1, d2, ...)"``: the mean of the same-seed differences, then each (``s1: d1`` with seed labels);
    None when no seed has both."""
    pd = _paired(rs, ref, key)
    if not pd:
        return None
    each = ", ".join((f"s{s_}: " if seed_labels else "") + f"{d:+.2f}%" for s_, d in pd)
    return f"{_mean([d for _, d in pd]):+.2f}% ({each})"


def accuracy_table(rows: Sequence[dict], losses: Optional[Dict[str, List[float]]] = None) -> str:
    groups = _acc_groups(rows)
    if not groups:
        return "No accuracy rows yet (run `python -m benchmarks accuracy ...`).\n"
    lines = _header("model", "ranks", "schedule", "steps", "config", "topology", "runs (seed each)",
                    "train loss (last 50), mean", "min-max", "vs ZeRO-3 mean", "vs ZeRO-3, same seed",
                    "held-out", "held-out vs ZeRO-3, same seed", "machine", "commit")
    for (ranks, sched, steps, model), g in sorted(groups.items(), key=_acc_order):
        ref = g.get("zero3")
        ref_mean = _mean([r["train_loss"] for r in ref]) if ref else None
        for name in sorted(g, key=lambda n: (n != "zero3", n)):
            rs = g[name]
            tl = [r["train_loss"] for r in rs]
            m = _mean(tl)
            diff = f"{100 * (m / ref_mean - 1):+.2f}%" if ref_mean and name != "zero3" else ("-" if name == "zero3"
                                                                                            else NM)
            paired = {key: ("-" if name == "zero3" else
                            (_paired_cell(rs, ref, key, seed_labels=True) if ref else None) or NM)
                      for key in ("train_loss", "heldout_loss")}
            ho = [r["heldout_loss"] for r in rs if r.get("heldout_loss") is not None]
            topo = "any (" + ", ".join(sorted({r["topology"] for r in rs})) + ")" if name == "zero3" else rs[0]["topology"]
            seeds = ",".join(str(r["seed"]) + ("*" if r.get("status") != "ok" else "") for r in rs)
            lines.append("| " + " | ".join([
                str(model), str(ranks), sched, str(steps), rs[0]["variant"] if name != "zero3" else "zero3", topo,
                seeds, f"{m:.4f}", f"{min(tl):.4f}-{max(tl):.4f}", diff, paired["train_loss"],
                f"{_mean(ho):.4f}" if ho else "-", paired["heldout_loss"],
                _distinct(rs, "machine", "-"), _distinct(rs, "commit", sep=",")]) + " |")
    return ("\n".join(lines) + "\n\nZeRO-3 rows pool real runs and world-1 replays (`zero3:replay`) of the same "
            "ranks and seeds. vs ZeRO-3 mean: mean train loss over the runs relative to ZeRO-3's mean; same "
            "seed: each seed's difference to ZeRO-3's run(s) of that seed (same initialisation and data order), "
            "their mean first; min-max: the spread over the runs, seeds and repeats of a seed alike (ZeRO-3's is "
            "the noise band; without `--deterministic` GPU kernels are not deterministic, so repeats of one seed "
            "differ). `*`: a run stopped by its timeout after its last step and final evaluation (its teardown ran "
            "late; losses complete).\n" + gap_over_run(rows, losses or {}) + cut_short(rows, losses or {})
            + repeat_check(rows, losses or {}) + replay_check(rows, losses or {}))


def gap_over_run(rows: Sequence[dict], losses: Dict[str, List[float]], min_steps: int = 1000,
                 windows: int = 8) -> str:
    """For runs of ``min_steps`` or more: each config's gap to ZeRO-3 of the same seed (mean train loss over each
    of ``windows`` equal spans of the run), so a long run shows whether a gap closes or grows. Empty without one."""
    out = []
    for (ranks, sched, steps, model), g in sorted(_acc_groups(rows).items(), key=_acc_order):
        if steps < min_steps or "zero3" not in g:
            continue
        w = steps // windows
        for name in sorted(n for n in g if n != "zero3"):
            for r in g[name]:
                refs = [losses[z["row_id"]] for z in g["zero3"] if z["seed"] == r["seed"] and z["row_id"] in losses]
                la = losses.get(r["row_id"])
                if not refs or not la or min(len(x) for x in refs + [la]) < steps:
                    continue
                cells = []
                for i in range(0, steps - w + 1, w):
                    ref = _mean([_mean(x[i:i + w]) for x in refs])
                    cells.append(f"{i + 1}-{i + w}: {100 * (_mean(la[i:i + w]) / ref - 1):+.2f}%")
                out.append(f"- {model}, {ranks} ranks, {sched} lr, {steps} steps, {name}, seed {r['seed']}: "
                           + ", ".join(cells))
    if not out:
        return ""
    return ("\nGap over a long run: mean train loss of each span of steps against ZeRO-3's run(s) of the same seed "
            "over the same span:\n\n" + "\n".join(out) + "\n")


def _chain(head: dict, by_id: Dict[str, dict]) -> List[dict]:
    """``head``'s run as rows: the earlier parts it lists (``earlier_parts``, those in ``by_id``), then itself."""
    return [by_id[rid] for rid in (head.get("earlier_parts") or ()) if rid in by_id] + [head]


def _runs_with_losses(rows: Sequence[dict], losses: Dict[str, List[float]], min_steps: int) -> List[dict]:
    """Rows that are a run with at least ``min_steps`` per-step losses, one per run: a row and the earlier parts it
    lists (``earlier_parts``: parts of one run split over calls by ``--stop-after`` / ``--stop-margin``, whatever
    their status) are one run, counted once, by its finished row where it has one, else by the part with the most
    steps (the latest of equals): a part that died before its log lost nothing of what an earlier one holds."""
    by_id = {r.get("row_id"): r for r in rows}
    later = {rid for r in rows for rid in (r.get("earlier_parts") or ())}
    out = []
    for head in rows:
        if head.get("row_id") in later:
            continue   # a part of a later row's run
        chain = _chain(head, by_id)
        done = [r for r in chain if suite.finished_training(r)]
        best = done[-1] if done else max(reversed(chain), key=lambda r: len(losses.get(r.get("row_id"), ())))
        if len(losses.get(best.get("row_id"), ())) >= min_steps and best not in out:
            out.append(best)   # (a part two chains both list stands for one run, not two)
    return out


def _run_setting(r: dict) -> tuple:
    """What makes two accuracy runs runs of the same training, but for config, topology and seed: model, ranks,
    schedule, steps, deterministic algorithms or not, lr, micro-batch, sequence length."""
    return (r.get("model"), r.get("ranks"), r.get("schedule"), r.get("steps"), bool(r.get("deterministic")),
            r.get("lr"), r.get("micro_batch"), r.get("seq"))


def _finished_first(rs: Sequence[dict]) -> List[dict]:
    """Per seed, its finished runs where it has one, else all its runs (those cut short)."""
    done = {r["seed"] for r in rs if suite.finished_training(r)}
    return [r for r in rs if r["seed"] not in done or suite.finished_training(r)]


def cut_short(rows: Sequence[dict], losses: Dict[str, List[float]], min_steps: int = 100, tail: int = 50) -> str:
    """Runs that ended before their last step (killed by a timeout or failure, or the last part of a chain of
    stopped parts that never finished; per-step losses kept) against ZeRO-3 of the same seed, for the configs with
    a seed that no finished run of theirs has: the last step ``n`` (>= ``min_steps``) that the compared runs and
    their seeds' ZeRO-3 runs all reached (per seed its finished runs where it has one, cut at ``n`` too, else its
    runs cut short), then each seed's mean train loss of steps n-tail+1..n against ZeRO-3's over the same steps,
    their mean (SE from 2 seeds on), and the default config's gap over the same seeds and steps where it has runs
    that long (the yardstick for an ablation cut short).  Under a constant lr (no warm-up, no decay) a run cut at
    step n IS an n-step run, as the schedule does not depend on ``--steps``; under warm-up + cosine it is the first
    n steps of the longer schedule.  Empty without such a run."""
    refs: Dict[tuple, List[dict]] = {}
    cfgs: Dict[tuple, List[dict]] = {}
    for r in _runs_with_losses(rows, losses, min_steps):
        if r.get("config") == "zero3" and r.get("variant") in ("zero3", "zero3:replay"):
            refs.setdefault(_run_setting(r), []).append(r)
        else:
            cfgs.setdefault(_run_setting(r) + (r.get("variant"), r.get("topology")), []).append(r)

    def gaps_at(rs, zs, seeds, lo, n):
        def span(group, seed):
            return _mean([_mean(losses[r["row_id"]][lo:n]) for r in group if r["seed"] == seed])
        return [(s, 100 * (span(rs, s) / span(zs, s) - 1)) for s in seeds]

    out = []
    for key in sorted(cfgs, key=str):
        rs, zs = _finished_first(cfgs[key]), _finished_first(refs.get(key[:-2], []))
        seeds = sorted({r["seed"] for r in rs} & {z["seed"] for z in zs})
        mine = [r for r in rs + zs if r["seed"] in seeds]
        if not seeds or all(suite.finished_training(r) for r in mine):
            continue   # nothing cut short among the runs compared: the main table has them
        n = min(len(losses[r["row_id"]]) for r in mine)
        lo = max(0, n - tail)
        gaps = gaps_at(rs, zs, seeds, lo, n)
        mean = _mean([g for _, g in gaps])
        se = suite.mean_se([g for _, g in gaps])[1]
        se = f", SE {se:.2f}" if se is not None else ""
        model, ranks, sched, steps, det = key[:5]
        what = ("a complete run of that many steps under a constant lr" if sched == "constant"
                else f"the first {n} steps of the {steps}-step schedule")
        cut = ", ".join(f"{r['variant']} s{r['seed']} {r.get('status')} after {len(losses[r['row_id']])}"
                        for r in sorted(mine, key=lambda r: (r["config"] == "zero3", r["seed"], r.get("created", "")))
                        if not suite.finished_training(r))
        dflt = ""
        if not rs[0].get("default"):
            d_rs = [r for k, g in cfgs.items() if k[:-2] == key[:-2] and k[-1] == key[-1] for r in _finished_first(g)
                    if r.get("default") and r["seed"] in seeds and len(losses[r["row_id"]]) >= n]
            if {r["seed"] for r in d_rs} == set(seeds):
                dg = gaps_at(d_rs, zs, seeds, lo, n)
                dflt = (f"; the default config over the same seeds and steps: {_mean([g for _, g in dg]):+.2f}% ("
                        + ", ".join(f"s{s}: {g:+.2f}%" for s, g in dg) + "; "
                        + ", ".join(sorted({f"{r.get('machine')} {r.get('commit')}" for r in d_rs})) + ")")
        out.append(f"- {model}{' deterministic' if det else ''}, {ranks} ranks, {sched} lr, {key[-2]} {key[-1]}, at "
                   f"step {n} ({what}; cut short: {cut}), steps {lo + 1}-{n}: {mean:+.2f}%{se} ("
                   + ", ".join(f"s{s}: {g:+.2f}%" for s, g in gaps) + "; "
                   + ", ".join(sorted({f"{r.get('machine')} {r.get('commit')}" for r in mine})) + f"){dflt}")
    if not out:
        return ""
    return ("\nRuns cut short (ended before their last step: killed by a timeout or a failure, or stopped parts "
            "never continued), with the seeds they share with ZeRO-3: each config's gap to ZeRO-3 of the same seed "
            f"over the last {tail} steps that all of them reached (machines and commits in brackets: runs of one "
            "seed on different GPU models or commits part at the first steps):\n\n" + "\n".join(out) + "\n")


def _per_step_said(curves: Sequence[List[float]]) -> Tuple[int, str]:
    """Curves against the first over the steps all logged: (common steps, what they say)."""
    n = min(len(c) for c in curves)
    rel = [max(abs(c[i] / curves[0][i] - 1) for c in curves[1:]) for i in range(n)]
    return n, ("identical at every step" if max(rel) == 0 else
               f"largest per-step difference {100 * max(rel):.2f}% (step {rel.index(max(rel)) + 1}), at step {n} "
               f"{100 * rel[-1]:.2f}%")


def _chain_of(rows: Sequence[dict]) -> Dict[str, List[dict]]:
    """Each row's run as rows: the row, or every part of the chain it belongs to (``earlier_parts`` + the row
    that lists them), by row id."""
    by_id = {r.get("row_id"): r for r in rows}
    out: Dict[str, List[dict]] = {}
    for head in rows:
        chain = _chain(head, by_id)
        for r in chain:
            if r.get("row_id") is not None and len(chain) >= len(out.get(r.get("row_id"), ())):
                out[r.get("row_id")] = chain
    return out


def _distinct(rows: Sequence[dict], key: str, missing=None, sep: str = ", ") -> str:
    """The distinct values of ``key`` over ``rows`` (``missing`` where a row has none), sorted, as one cell."""
    return sep.join(sorted({str(r.get(key, missing)) for r in rows}))


def _chain_values(chain: Sequence[dict], key: str) -> Optional[List[str]]:
    """The distinct machines or commits (``key``) of a run's parts, in part order; None where a part does not say."""
    vals = [r.get(key) for r in chain]
    if any(v is None for v in vals):
        return None
    return list(dict.fromkeys(vals))


def _chain_value(chain: Sequence[dict], key: str) -> Optional[str]:
    """The machine or commit (``key``) of a run's parts as a label: the one value, "A + B" where they differ, None
    where a part does not say."""
    vals = _chain_values(chain, key)
    return None if vals is None else " + ".join(vals)


def repeat_check(rows: Sequence[dict], losses: Dict[str, List[float]], min_steps: int = 10) -> str:
    """Repeats of one run (same model, ranks, schedule, steps, lr, batch, variant, topology, seed, commit, machine
    and deterministic algorithms or not): per-step train loss of each against the earliest, over the steps all
    logged (finished runs and runs cut short alike: :func:`_runs_with_losses`).  Then runs under deterministic
    algorithms of one setting and commit on different GPU models: the earliest run of each model against that of
    the model named first (alphabetically).  A run whose parts ran on different machines or commits, or whose
    machine is not recorded, is no repeat of anything.  Empty without either."""
    chains = _chain_of(rows)
    groups: Dict[tuple, List[dict]] = {}
    for r in _runs_with_losses(rows, losses, min_steps):
        chain = chains.get(r.get("row_id"), [r])
        machines, commits = _chain_values(chain, "machine"), _chain_values(chain, "commit")
        if machines is None or commits is None or len(machines) != 1 or len(commits) != 1:
            continue   # parts on different machines or commits, or one that does not say: no repeat of anything
        machine, commit = machines[0], commits[0]
        key = _run_setting(r) + (r.get("variant"), r.get("topology"), r.get("seed"), commit)
        groups.setdefault(key, []).append((machine, r))
    out, across = [], []
    for key, ms in sorted(groups.items(), key=lambda kv: str(kv[0])):
        (model, ranks, sched, steps, det, _, _, _), (variant, topo, seed, commit) = key[:8], key[8:]
        head = f"- {model}, {ranks} ranks, {sched} lr, {steps} steps, {variant} {topo}, seed {seed}"
        by_machine: Dict[str, List[dict]] = {}
        for machine, r in sorted(ms, key=lambda mr: mr[1].get("created") or ""):
            by_machine.setdefault(machine, []).append(r)
        for machine, same in sorted(by_machine.items()):
            if len(same) < 2:
                continue
            n, said = _per_step_said([losses[r["row_id"]] for r in same])
            out.append(f"{head}, {'deterministic algorithms' if det else 'default algorithms'}: {len(same)} runs "
                       f"({machine}, {commit}), {n} common steps: {said}")
        if det and len(by_machine) > 1:
            names = sorted(by_machine)
            n, said = _per_step_said([losses[by_machine[m][0]["row_id"]] for m in names])
            across.append(f"{head}: {' / '.join(names)} ({commit}), {n} common steps: {said}")
    text = ""
    if out:
        text += ("\nRepeats of one run, same code and GPU model (per-step train loss against the first; "
                 "`--deterministic`: torch's deterministic algorithms):\n\n" + "\n".join(out) + "\n")
    if across:
        text += ("\nOne run under `--deterministic` on different GPU models, same code (per-step train loss of "
                 "each model's first run against the first model's; shown for these runs only):\n\n"
                 + "\n".join(across) + "\n")
    return text


def replay_check(rows: Sequence[dict], losses: Dict[str, List[float]]) -> str:
    """The replay reference against a real multi-rank ZeRO-3 run of the same training (:func:`_run_setting`) and
    seed: per-step loss difference over the steps both logged (either may have stopped early), and the mean of
    the last 50 common steps, real against replay.  Replays that are identical over those steps (one
    deterministic run made on two machines) share one line.  Empty without such a pair."""
    chains = _chain_of(rows)
    runs = _runs_with_losses(rows, losses, 1)
    real = sorted((r for r in runs if r.get("variant") == "zero3"), key=lambda r: r.get("created") or "")
    rep = sorted((r for r in runs if r.get("variant") == "zero3:replay"), key=lambda r: r.get("created") or "")

    def where(r):
        chain = chains.get(r.get("row_id"), [r])
        return f"{_chain_value(chain, 'machine') or 'machine not recorded'}, {_chain_value(chain, 'commit') or '?'}"

    out = []
    for a in real:
        la = losses[a["row_id"]]
        groups: List[Tuple[List[float], List[dict]]] = []   # (common steps of the group's curves, replays)
        for b in rep:
            if _run_setting(a) != _run_setting(b) or a.get("seed") != b.get("seed"):
                continue
            lb = losses[b["row_id"]][:len(la)]
            if not lb:
                continue
            for i, (common, bs) in enumerate(groups):
                n = min(len(common), len(lb))
                if common[:n] == lb[:n]:   # identical over the steps both logged: one group, its shorter length
                    groups[i] = (common[:n], bs + [b])
                    break
            else:
                groups.append((lb, [b]))
        for lb, bs in groups:
            n = len(lb)
            rel = [abs(x / y - 1) for x, y in zip(la[:n], lb)]
            first = next((i for i, v in enumerate(rel) if v > 1e-3), None)
            reps = " / ".join(f"({b.get('status')}, {len(losses[b['row_id']])} steps logged; {where(b)})" for b in bs)
            out.append(f"- {a['model']}, {a['ranks']} ranks, seed {a['seed']}, {a['schedule']} lr: real ZeRO-3 "
                       f"({a['topology']}, {a.get('status')}, {len(la)} steps logged; {where(a)}) vs "
                       + (f"the replay {reps}" if len(bs) == 1 else f"{len(bs)} replays identical over these steps "
                          f"{reps}") + f", {n} common "
                       f"steps: largest per-step difference {100 * max(rel):.2f}%, median "
                       f"{100 * suite.median(rel):.3f}%, within 0.1% "
                       + (f"up to step {first} (step {first + 1}: {100 * rel[first]:.2f}%)" if first is not None
                          else "at every step") + f", last step {100 * rel[n - 1]:.2f}%"
                       + (f"; mean of steps {n - 49}-{n}, real against replay, "
                          f"{100 * (sum(la[n - 50:n]) / sum(lb[n - 50:n]) - 1):+.2f}%" if n >= 50 else "") + ".")
    if not out:
        return ""
    return "\nReplay reference against a real ZeRO-3 run (per-step train loss):\n\n" + "\n".join(out) + "\n"


def _smooth(xs: Sequence[float], w: int) -> List[float]:
    out, acc = [], 0.0
    for i, v in enumerate(xs):
        acc += v
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def accuracy_png(rows: Sequence[dict], losses: Dict[str, List[float]], png: Path, smooth: int) -> bool:
    """One panel per training (model, ranks, schedule, steps) with ZeRO-3 and another config, three panels a row:
    the train loss against ZeRO-3 of the same seed in %, smoothed, one line per config (each seed's runs against
    ZeRO-3's runs of that seed, the mean over the seeds both have, as the tables pair them), the band of ZeRO-3's
    runs around their mean shaded.  Trainings shorter than ``HEADLINE_MIN_STEPS`` (checks such as the determinism
    repeats) are left out, as they are from the README's loss table."""
    groups = {k: g for k, g in _acc_groups(rows).items() if "zero3" in g and len(g) > 1 and (k[2] or 0) >= HEADLINE_MIN_STEPS}
    if not groups:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, len(groups))
    nrows = -(-len(groups) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.5 * nrows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, ((ranks, sched, steps, model), g) in zip(axes.flat, sorted(groups.items(), key=_acc_order)):
        zs = [(r["seed"], _smooth(losses[r["row_id"]], smooth)) for r in g["zero3"] if r["row_id"] in losses]
        ref_curves = [c for _, c in zs]
        if not ref_curves:
            continue
        n = min(len(c) for c in ref_curves)
        ref = [_mean([c[i] for c in ref_curves]) for i in range(n)]
        xs = list(range(1, n + 1))
        if len(ref_curves) > 1:
            lo = [100 * (min(c[i] for c in ref_curves) / ref[i] - 1) for i in range(n)]
            hi = [100 * (max(c[i] for c in ref_curves) / ref[i] - 1) for i in range(n)]
            ax.fill_between(xs, lo, hi, color="0.8",
                            label=f"ZeRO-3's {len(ref_curves)} runs around their mean (unpaired)")
        ax.axhline(0.0, color="k", linewidth=0.8)
        by_seed: Dict[int, List[List[float]]] = {}
        for seed, c in zs:
            by_seed.setdefault(seed, []).append(c[:n])
        for name in sorted(n_ for n_ in g if n_ != "zero3"):
            # seed-paired as the tables: each seed's runs against ZeRO-3's runs of that seed, the seeds' mean
            seeds = sorted({r["seed"] for r in g[name] if r["row_id"] in losses} & set(by_seed))
            mine = {s_: [_smooth(losses[r["row_id"]], smooth) for r in g[name]
                         if r["seed"] == s_ and r["row_id"] in losses] for s_ in seeds}
            if not seeds:
                continue
            m = min(n, min(len(c) for cs in mine.values() for c in cs))
            gap = [_mean([100 * (_mean([c[i] for c in mine[s_]]) / _mean([c[i] for c in by_seed[s_]]) - 1)
                          for s_ in seeds]) for i in range(m)]
            runs = sum(len(cs) for cs in mine.values())
            ax.plot(xs[:m], gap, label=f"{name} ({runs} run{'s' if runs > 1 else ''}, {len(seeds)} "
                                       f"seed{'s' if len(seeds) > 1 else ''})", linewidth=1.2)
        ax.set_title(f"{model}, {ranks} ranks, {sched} lr, {steps} steps", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(f"train loss vs ZeRO-3, same seed, % (moving avg {smooth})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------- link rate

def linkrate_table(link_rows: Sequence[dict]) -> Optional[str]:
    """What each setting of the bandwidth knob really gave (``linkrate`` rows); None without rows."""
    ok = [r for r in link_rows if r.get("status") in ("ok", "failed", "timeout")]
    if not ok:
        return None
    lines = _header("kind", "op", "ranks", "requested Gb/s", "NCCL threads x socks", "delay us",
                    "measured Gb/s per rank", "round trip us (median)", "shim bytes (busiest process)", "status",
                    "machine", "commit")
    for r in sorted(ok, key=lambda r: (r.get("machine") or "", r.get("kind"), r.get("op"), r.get("ranks"),
                                       r.get("nccl_socket_nthreads") or 0, r.get("link_gbps") or 1e9)):
        shim = r.get("shim") or {}
        lines.append("| " + " | ".join([
            str(r.get("kind")), str(r.get("op")), str(r.get("ranks")), link.label(r.get("link_gbps")),
            f"{r.get('nccl_socket_nthreads') or 'default'} x {r.get('nccl_nsocks_perthread') or 'default'}",
            _fmt(r.get("link_delay_us"), "g"), _fmt(r.get("measured_gbps"), ".2f"),
            _fmt(r.get("rtt_us_median"), ".0f"),
            _fmt(shim.get("bytes_max"), ",d"), str(r.get("status")),
            str(r.get("machine")), str(r.get("commit"))]) + " |")
    return ("\n".join(lines) + "\n\nmeasured: bytes each rank sends per call x 8 / the median time of a call "
            "(tcp: one stream between two processes, first to last byte at the receiver); the knob limits each "
            "process's TCP egress (benchmarks/link.py). shim bytes: the knob's own count, which must cover what "
            "the collectives sent (else the row failed: the traffic bypassed the knob). delay: the knob's one-way "
            "delay of every byte a process sends (its delay line); round trip: one byte there and back between a "
            "process under the knob and one that is not (the delay once, plus the loopback's own).\n")


def projection_md(res: dict, rows: Sequence[dict] = ()) -> str:
    """The step-time model's fit and its check against every measured point (benchmarks/projection.py)."""
    f = res["fit"]
    fam = res.get("family", projection.SHARE)
    where = ("ranks sharing one GPU (every byte of every level over the rank's shaped TCP link)"
             if fam == projection.SHARE else f"'{fam}' (one rank per GPU; only what crosses the logical nodes is on the shaped link)")
    lines = ["Generated by `python -m benchmarks report` (benchmarks/projection.py's model, fitted on the rows "
             f"of throughput.json that have a link rate, of {where}"
             + (", and the host's NVLink runs as points with nothing on that link" if projection.logical_nodes(fam)
                else "")
             + "; do not edit by hand).", "", "```"]
    lines += projection.fit_lines(res, fit_keys(res)) + ["```", ""]
    pts = {p.row_id: p for p in res["points"]}
    lines += _header("model", "topology", "config", "rate Gb/s", "rate from", "MB on the link per step",
                     "bytes from", "measured ms", "model ms", "error", "used for")
    for used, rs in (("fit", res["fit_rows"]), ("check", res["check_rows"])):
        for c in sorted(rs, key=lambda c: (c["model"], c["topology"], c["key"], c["gbps"])):
            rate = f"{c['gbps']:.2f}" if math.isfinite(c["gbps"]) else "-"
            lines.append(f"| {c['model']} | {c['topology']} | {c['key']} | {rate} | {c['rate_source']} | "
                         f"{pts[c['row_id']].bytes / 1e6:,.0f} | {pts[c['row_id']].bytes_source} | "
                         f"{c['ms']:.0f} | {_fmt(c['pred'], '.0f')} | "
                         f"{'-' if c['rel'] is None else format(100 * c['rel'], '+.1f') + '%'} | {used} |")
    lines += ["", "Measured speed-up of SDP4Bit at each knob setting (ratios of step times; `*`: the baseline comes "
              "from another run of the same machine, mode and knob setting):", ""]
    lines += _header("model", "topology", "config", "knob Gb/s", "rate Gb/s (from)", "NCCL sockets", "SDP4Bit ms",
                     "vs ZeRO-3", "vs ZeRO++", "commit")
    by_id = {r.get("row_id"): r for r in rows}
    for pt in sorted(res["points"], key=lambda q: (q.model, q.topology, q.key, q.gbps)):
        r = by_id.get(pt.row_id)
        if r is None or r.get("config") != "sdp4bit" or not r.get("link_gbps"):
            continue
        sock = link.sockets_label(r.get("nccl_socket_nthreads"), r.get("nccl_nsocks_perthread"))
        lines.append(f"| {pt.model} | {pt.topology} | {pt.key} | {r['link_gbps']:g} | {pt.gbps:.2f} "
                     f"({pt.rate_source}) | {sock} | {r['ms_per_step']:.0f} | {_ratio(r, rows, 'zero3')} | "
                     f"{_ratio(r, rows, 'zeropp')} | {r.get('commit')} |")
    delayed = sorted((r for r in _ok(rows) if r.get("link_delay_us") and r.get("config") == "sdp4bit"
                      and projection.family(r) == fam),
                     key=lambda r: (r["model"], r["topology"], r["link_delay_us"], r.get("created") or ""))
    if delayed:   # measured points the model cannot describe (no latency term): shown, never fitted
        lines += ["", "Measured speed-up of SDP4Bit under the knob's one-way delay (not in the model, which has no "
                  "latency term; rate: NCCL's all-gather rate measured in the run under that delay):", ""]
        lines += _header("model", "topology", "config", "variant", "delay us", "knob Gb/s", "rate Gb/s",
                         "NCCL sockets", "SDP4Bit ms", "vs ZeRO-3", "vs ZeRO++", "commit")
        for r in delayed:
            sock = link.sockets_label(r.get("nccl_socket_nthreads"), r.get("nccl_nsocks_perthread"))
            lines.append(f"| {r['model']} | {r['topology']} | {projection.fit_key(r)} | {r.get('variant') or '-'} | "
                         f"{r['link_delay_us']:g} | "
                         f"{format(r['link_gbps'], 'g') if r.get('link_gbps') else 'off'} | "
                         f"{_fmt(r.get('link_measured_gbps'), '.2f')} | {sock} | {r['ms_per_step']:.0f} | "
                         f"{_ratio(r, rows, 'zero3')} | {_ratio(r, rows, 'zeropp')} | {r.get('commit')} |")
    if res["skipped"]:
        lines += ["", "Rows left out: " + "; ".join(res["skipped"]) + "."]
    lines += ["", f"Parameters: link efficiency e = {f.e:.3f}; per config compute factor c and overlap phi as "
              "above (step = c C + X/e - phi min(c C, X/e)).", ""]
    return "\n".join(lines)


def _pairs(rows: Sequence[dict], pts: Sequence[projection.Point], base: str):
    """(sdp4bit point, its row, the baseline row) for every SDP4Bit point with a baseline of the same settings;
    without a knob rate (the loopback's own rate, which differs from call to call) only a baseline of the same run."""
    by_id = {r.get("row_id"): r for r in rows}
    for p in pts:
        r = by_id.get(p.row_id)
        if r is None or r.get("config") != "sdp4bit":
            continue
        b, _ = baseline(r, rows, base)
        if b is not None and (r.get("link_gbps") or b.get("run_id") == r.get("run_id")):
            yield p, r, b


def rate_png(rows: Sequence[dict], res: dict, png: Path) -> bool:
    """Speed-up of SDP4Bit vs ZeRO-3 and vs ZeRO++ against the link rate: measured points over the model's
    curves, per model / topology / SDP4Bit variant; the paper's cluster rates (per GPU) marked."""
    f, pts = res["fit"], res["points"]
    ok = projection.validated(res, fit_keys(res))
    series: Dict[Tuple[str, str, str], dict] = {}
    for i, base in enumerate(("zero3", "zeropp")):
        for p, r, b in _pairs(rows, pts, base):
            if not math.isfinite(p.gbps):   # an NVLink point: no rate to plot it at
                continue
            s = series.setdefault((p.model, p.topology, r["variant"]), {"pts": ([], []), "curve": {}})
            s["pts"][i].append((p.gbps, b["ms_per_step"] / r["ms_per_step"]))
            bb = projection.link_bytes(b, res.get("counts", ()), rows)[0]
            if bb:
                s["curve"].setdefault(base, (p.key, p.C, p.bytes, projection.fit_key(b), bb))
    if not series:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    allx = [x for s in series.values() for side in s["pts"] for x, _ in side]
    lo, hi = min(allx) / 2, max(allx) * 2
    for c in projection.PAPER_CLUSTERS:
        lo, hi = min(lo, c["node_gbps"] / c["gpus_per_node"] / 2), max(hi, c["node_gbps"] / c["gpus_per_node"] * 2)
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 6.0), sharey=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (ax, base) in enumerate(zip(axes, ("ZeRO-3", "ZeRO++"))):
        for j, (name, s) in enumerate(sorted(series.items())):
            col = colors[j % len(colors)]
            pts_ = sorted(s["pts"][i])
            if pts_:
                ax.plot([x for x, _ in pts_], [y for _, y in pts_], "o", color=col, label=" ".join(name) + " measured")
            cur = s["curve"].get(("zero3", "zeropp")[i])
            if cur and cur[0] in f.c and cur[3] in f.c:
                key, C, nb, bkey, bb = cur
                sdp, bas = projection.share_curve(f, key, C, nb, xs), projection.share_curve(f, bkey, C, bb, xs)
                ax.plot(xs, [a / b for a, b in zip(bas, sdp)], "-" if ok else ":", color=col, linewidth=1.2,
                        alpha=0.8, label=" ".join(name) + (" model" if ok else " model (not validated)"))
        for c in projection.PAPER_CLUSTERS:
            x = c["node_gbps"] / c["gpus_per_node"]
            ax.axvline(x, color="0.4", linestyle="--", linewidth=0.9)
            ax.text(x, 0.98, f" {c['label']}\n {x:g} Gb/s per GPU", transform=ax.get_xaxis_transform(),
                    fontsize=7, va="top")
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)   # both panels over the same rates (a panel without a curve would shrink to its points)
        ax.set_xlabel("link rate per rank, Gb/s (measured in the run, else by linkrate)")
        ax.set_ylabel(f"SDP4Bit speed-up vs {base} (step time ratio)")
        ax.grid(alpha=0.3, which="both")
        # below the axes: inside, it covered points and the paper's rate label
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    ids = {p.row_id for p in pts}
    machines = sorted({str(r.get("machine")) for r in rows if r.get("row_id") in ids})
    mode = ("share-GPU mode (each rank its own host, all levels over its shaped TCP link)"
            if res.get("family", projection.SHARE) == projection.SHARE else
            f"{res['family']} (one rank per GPU; NVLink inside a logical node, the shaped link between)")
    fig.suptitle(f"{', '.join(machines)}; {mode}\nmodel: benchmarks/projection.py"
                 f"{'' if ok else ' (NOT VALIDATED)'}, largest error "
                 f"{_fmt(None if res['max_check_error'] is None else 100 * res['max_check_error'], '.0f')}% on the "
                 f"checked points, {_fmt(None if res.get('max_error') is None else 100 * res['max_error'], '.0f')}% "
                 f"on all (goal: 20%)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------- a multi-GPU host

def host_rows(rows: Sequence[dict], today: Dict[str, object], paired: bool = False) -> List[dict]:
    """Ok rows of the default config (today's or its commit's) measured on a multi-GPU host, one rank per GPU
    (``e2e --transport ...``), with or without the knob, in order of model, mode, topology, rate, time."""
    def rate(r):
        return r.get("link_gbps") or 1e9
    return sorted((r for r in _ok(rows, paired) if projection.family(r) != projection.SHARE and (r.get("ranks") or 1) > 1
                   and (r.get("default") or differences_from_default(r, today) == {})),
                  key=lambda r: (r.get("model"), str(r.get("mode")), r.get("topology"), -rate(r),
                                 r.get("created", "")))


def _knob(r: dict) -> str:
    if link.unshaped(r):
        return "off"
    return (f"{link.label(r.get('link_gbps'))}" + (f", {r['link_delay_us']:g} us" if r.get("link_delay_us") else "")
            + f", {link.sockets_label(r.get('nccl_socket_nthreads'), r.get('nccl_nsocks_perthread'))} sockets")


def host_table(rows: Sequence[dict]) -> Optional[str]:
    """The default config on a multi-GPU host against ZeRO-3 and ZeRO++ of the same run, per mode, topology and
    knob setting; None without such rows."""
    today = today_default()
    hr = host_rows(rows, today)
    if not hr:
        return None
    lines = _header("model", "topology", "mode", "knob (Gb/s per rank)", "link per rank, Gb/s, in the run",
                    "SDP4Bit default ms/step", "vs ZeRO-3", "vs ZeRO++", "share of the no-communication bound",
                    "replica", "machine", "commit")
    for r in hr:
        lines.append("| " + " | ".join([
            str(r["model"]), str(r["topology"]), str(r.get("mode")), _knob(r), _link_cell(r),
            f"{r['ms_per_step']:.0f} ({r['ms_min']:.0f}-{r['ms_max']:.0f})", _ratio(r, rows, "zero3"),
            _ratio(r, rows, "zeropp"), _fmt(r.get("bound_fraction"), ".0%", NM), str(r.get("replica") or "off"),
            str(r.get("machine")), _mark(r, today)]) + " |")
    return "\n".join(lines) + "\n"


HOST_NOTE = ("One rank per GPU of one host. `nodes`: each logical node's GPUs are one NCCL host (`e2e --transport "
             "nodes`), so ranks of a node talk over NVLink and nodes over sockets, where the knob (`--link-gbps`) "
             "limits each rank's TCP egress; the link column is NCCL's all-gather rate between the nodes measured in "
             "the run (`--probe-link`, one rank per node). `nvlink`: NCCL's default on the host, one node (1xG; "
             "SDP4Bit is off there, `replica` off) or logical nodes that all talk over NVLink. The knob limits each "
             "rank (a NIC per GPU), not each node. Ratios: the same run; the bound is the world-1 ZeRO-3 step of the "
             "model on the same GPU type, of that kind of host where one was measured (else of a one-GPU machine). "
             "Commit with ° where the row did not run today's default.")


OVERLAP_KEY = "sdp4bit.weights.overlap"


def step_sync(r: dict) -> str:
    """What the row's timed steps waited for (e2e --step-sync): rows from before the field, every stream."""
    return r.get("step_sync") or "device"


def overlap_pairs(rows: Sequence[dict]) -> List[Tuple[dict, dict]]:
    """(overlapped, inside step()) pairs of ok rows of ONE run (same ``run_id``) whose configs differ in
    ``sdp4bit.weights.overlap`` alone (their ``config_snapshot``s otherwise equal) and that ran the same model,
    topology, replica and link setting: the weight refresh overlapped with the next forward against the refresh
    inside ``step()``, each in its own process.  Rows without a snapshot are left out."""
    def setting(r):
        snap = {k: v for k, v in (r.get("config_snapshot") or {}).items() if k != OVERLAP_KEY}
        return (r.get("run_id"), r.get("model"), r.get("topology"), r.get("replica"), r.get("link_gbps"),
                r.get("nccl_socket_nthreads"), r.get("nccl_nsocks_perthread"), r.get("link_delay_us"),
                step_sync(r), json.dumps(snap, sort_keys=True))
    ok = [r for r in _ok(rows) if (r.get("config_snapshot") or {}).get("sdp4bit.enabled")
          and (r.get("config_snapshot") or {}).get(OVERLAP_KEY) is not None]
    inside = {}
    for r in ok:
        if not r["config_snapshot"][OVERLAP_KEY]:
            inside.setdefault(setting(r), []).append(r)
    pairs = [(r, b) for r in ok if r["config_snapshot"][OVERLAP_KEY] for b in inside.get(setting(r), [])]
    return sorted(pairs, key=lambda p: (str(p[0].get("mode")), p[0].get("model"), p[0].get("topology"),
                                        p[0].get("link_gbps") or 1e9, p[0].get("created", "")))


def overlap_table(rows: Sequence[dict]) -> Optional[str]:
    """``weights.overlap`` on against off, per pair of :func:`overlap_pairs` (pooled per cell) and per run that
    switched it in one process (:func:`overlap_ab_table`); None without either."""
    pairs = overlap_pairs(rows)
    ab = overlap_ab_table(rows)
    if not pairs:
        return ab
    lines = _header("model", "topology", "mode", "knob (Gb/s per rank)", "replica", "step timing waits for",
                    "overlapped ms/step", "inside step() ms/step", "overlapped / inside",
                    "end to end: overlapped / inside", "machine", "commit")
    for a, b in pairs:
        ca, cb = a.get("cycle_ms_per_step"), b.get("cycle_ms_per_step")
        lines.append("| " + " | ".join([
            str(a["model"]), str(a["topology"]), str(a.get("mode")), _knob(a), str(a.get("replica") or "-"),
            e2e.STEP_SYNC[step_sync(a)],
            f"{a['ms_per_step']:.0f} ({a['ms_min']:.0f}-{a['ms_max']:.0f})",
            f"{b['ms_per_step']:.0f} ({b['ms_min']:.0f}-{b['ms_max']:.0f})",
            f"{a['ms_per_step'] / b['ms_per_step']:.3f}",
            f"{ca / cb:.3f} ({ca:.0f} / {cb:.0f} ms)" if ca and cb else "not recorded",
            str(a.get("machine")), str(a.get("commit"))]) + " |")
    pooled = overlap_pooled(pairs)
    return ("\n".join(lines) + "\n\n" + (pooled + "\n\n" if pooled else "") + OVERLAP_NOTE + "\n"
            + ("\n" + ab if ab else ""))


def _overlap_interval(m: float, se: float, n: int) -> Tuple[float, float, float, str]:
    """exp of a mean log ratio (overlapped / inside) over ``n`` >= 2 pairs with its Student's t interval (95%), and
    the verdict: ``overlap faster`` (the interval below 1), ``overlap slower`` (above 1) or ``not resolved``."""
    lo, hi = math.exp(m - t_factor(n) * se), math.exp(m + t_factor(n) * se)
    return math.exp(m), lo, hi, "overlap faster" if hi < 1 else "overlap slower" if lo > 1 else "not resolved"


def _ab_cell(st: dict, name: str) -> str:
    """One ratio of :func:`e2e.overlap_ab_stats` with its Student's t interval over the pairs of blocks."""
    n = st.get(f"{name}n")
    if not n:
        return "not recorded"
    g, lo, hi, verdict = _overlap_interval(st[f"{name}log_ratio_mean"], st[f"{name}log_ratio_se"], n)
    return (f"{g:.3f} ({lo:.3f} .. {hi:.3f}, {n} pairs of blocks; "
            f"{st[f'on_{name}ms']:.0f} / {st[f'off_{name}ms']:.0f} ms): {verdict}")


def overlap_ab_rows(rows: Sequence[dict]) -> List[dict]:
    """The finished runs of ``e2e --overlap-blocks`` (rows with ``overlap_ab``), by mode, model, topology, knob,
    time."""
    return sorted((r for r in rows if r.get("status") == "ok" and "overlap_ab" in r),
                  key=lambda r: (str(r.get("mode")), r["model"], r["topology"], r.get("link_gbps") or 1e9,
                                 r.get("created", "")))


def overlap_ab_table(rows: Sequence[dict]) -> Optional[str]:
    """Rows of ``e2e --overlap-blocks`` (train_gpt.py switching ``weights.overlap`` in blocks of steps, one
    process): the overlapped refresh against the refresh inside ``step()``; None without such a row."""
    ab = overlap_ab_rows(rows)
    if not ab:
        return None
    lines = _header("model", "topology", "mode", "knob (Gb/s per rank)", "config: the overlap", "step timing waits for",
                    "blocks of", "timed steps: overlapped / inside", "end to end: overlapped / inside", "machine",
                    "commit")
    for r in ab:
        st = r["overlap_ab"]
        cells = ([str(st["blocks"]), _ab_cell(st, ""), _ab_cell(st, "cycle_")] if st else
                 ["-", r.get("overlap_ab_error") or "fewer than 2 pairs of blocks timed", "-"])
        choice = r.get("overlap_choice")
        how = (("probe " + (f"{choice['gbps']:.2f} Gb/s: " if choice.get("gbps") is not None else "none: ")
                + ("on" if choice.get("on") else "off")) if choice else "given")
        lines.append("| " + " | ".join([str(r["model"]), str(r["topology"]), str(r.get("mode")), _knob(r),
                                         f"{r.get('config')}: {how}", e2e.STEP_SYNC[step_sync(r)]] + cells
                                        + [str(r.get("machine")), str(r.get("commit"))]) + " |")
    return ("Generated by `python -m benchmarks report` from throughput.json. "
            "In one process (`e2e --overlap-blocks N`: train_gpt.py switches `engine.sdp4bit.overlap` in blocks of N "
            "steps, on off off on ..., so both modes share the process, its host state and its link; the first "
            "step of each block is half of either mode and left out): per pair of adjacent blocks the on block's "
            "median step over the off block's, the geometric mean over the pairs with Student's t interval (95%)."
            "\n\n" + "\n".join(lines) + "\n")


OVERLAP_RULE_CONFIG = "sdp4bit_overlap"   # the rule's runs: configs/sdp4bit_overlap.json, logical nodes of a host
OVERLAP_RULE_CELLS = tuple((m, t, k) for k in ("off", "5") for m in ("406M", "1.3B") for t in ("2x1", "4x1", "2x2"))


def _overlap_rule_cell(r: dict) -> Optional[Tuple[str, str, str]]:
    """A run's cell of the overlap's default rule (model, topology, knob "off" or the Gb/s per rank), or None where
    the run is outside the rule (another config, not logical nodes of a multi-GPU host, another cell)."""
    if (r.get("config") != OVERLAP_RULE_CONFIG or not str(r.get("mode", "")).endswith("nodes")
            or r.get("link_delay_us")):
        return None
    cell = (str(r["model"]), str(r["topology"]), link.label(r.get("link_gbps")))   # "off" where no rate is set
    return cell if cell in OVERLAP_RULE_CELLS else None


def _overlap_default_goal(tp_rows: Sequence[dict]) -> Tuple[str, str]:
    """The rule for ``weights.overlap``'s default, set before the runs that judge it (findings.md, "overlap"): on
    where it applies (the full replica on a GPU) only if, in every cell of :data:`OVERLAP_RULE_CELLS` (both modes
    in one process, ``e2e --overlap-blocks`` with :data:`OVERLAP_RULE_CONFIG` on logical nodes, timed on the
    current stream), the end-to-end (``cycle_``) upper 95% bound is at most :data:`OVERLAP_RULE_BOUND` and none
    is "overlap slower".  Each run is judged alone (a failing run keeps the verdict "not met" whatever runs are
    added; so does a run without an end-to-end interval, "not resolved"); a cell without a run leaves it "not
    resolved" at best."""
    parts, verdicts, seen, outside = [], [], set(), 0
    for r in overlap_ab_rows(tp_rows):
        cell = _overlap_rule_cell(r) if step_sync(r) == "stream" else None
        if cell is None:
            outside += 1
            continue
        seen.add(cell)
        name = f"{' '.join(cell[:2])} knob {_knob(r)} ({r.get('mode')}, {r.get('machine')}, {r.get('commit')})"
        verdict, text = _overlap_run_verdict(r)
        parts.append(f"{name}: {text}")
        verdicts.append(verdict)
    if not verdicts:
        return (f"{outside} run(s), all outside the rule" if outside else NM), NM
    missing = [f"{m} {t} knob {k}" for m, t, k in OVERLAP_RULE_CELLS if (m, t, k) not in seen]
    if missing:
        parts.append("not measured: " + ", ".join(missing))
        verdicts.append("not resolved")
    head = (f"{len(verdicts) - bool(missing)} run(s), {verdicts.count('not met')} failing"
            + (f"; {outside} run(s) outside the rule" if outside else ""))
    return _combined([head] + parts, verdicts)


AUTO_RULE_CONFIG = "sdp4bit"   # the default: weights.overlap omitted, decided by the engine's probe of the link
AUTO_RULE_KNOB = "5"           # the slow link of the rule (Gb/s per rank)
AUTO_RULE_THRESHOLD = 6.0      # weights.overlap_below_gbps of the rule's default
AUTO_RULE_CELLS = tuple((m, t) for m in ("406M", "1.3B") for t in ("2x1", "4x1", "2x2"))
AUTO_RULE_DEFAULT_RUN = ("2x1",)   # topologies whose cells need a run of the default config itself


def _overlap_run_verdict(r: dict) -> Tuple[str, str]:
    """(verdict, text) of one ``e2e --overlap-blocks`` run's end-to-end ratio by the bar both overlap rules share:
    "met" with the upper 95% bound at most :data:`OVERLAP_RULE_BOUND` and not "overlap slower", else "not met";
    "not resolved" for a run without an end-to-end interval."""
    st = r["overlap_ab"] or {}
    if not st.get("cycle_n"):
        why = r.get("overlap_ab_error") or ("fewer than 2 pairs of blocks timed" if not st else "not recorded")
        return "not resolved", f"no end-to-end interval ({why})"
    _, _, hi, verdict = _overlap_interval(st["cycle_log_ratio_mean"], st["cycle_log_ratio_se"], st["cycle_n"])
    fail = hi > OVERLAP_RULE_BOUND or verdict == "overlap slower"
    why = "slower" if verdict == "overlap slower" else f"upper bound above {OVERLAP_RULE_BOUND}"
    return "not met" if fail else "met", _ab_cell(st, "cycle_") + (f". Rule: fails ({why})" if fail else "")


def _switched(r: dict) -> bool:
    """A run of ``e2e --overlap-blocks 5`` timed on the current stream without a delay (the overlap rules' runs)."""
    st = r.get("overlap_ab")
    return ("overlap_ab" in r and step_sync(r) == "stream" and (st is None or st.get("blocks") == 5)
            and not r.get("link_delay_us"))


def _auto_default(r: dict) -> bool:
    """A run of the default's automatic overlap: :data:`AUTO_RULE_CONFIG` with ``weights.overlap`` omitted and the
    threshold of the rule (its config snapshot), its engine's choice recorded, the full replica on several nodes (the
    node replica never overlaps: not the rule's)."""
    snap = r.get("config_snapshot") or {}
    return (r.get("config") == AUTO_RULE_CONFIG and r.get("overlap_choice") is not None
            and r.get("replica") == "full" and not _overlap_cannot_apply(r)
            and snap.get("sdp4bit.weights.overlap", "absent") is None
            and snap.get("sdp4bit.weights.overlap_below_gbps") == AUTO_RULE_THRESHOLD)


def _overlap_auto_goal(tp_rows: Sequence[dict]) -> Tuple[str, str]:
    """The rule for ``weights.overlap`` omitted (decided by the engine's probe of the link between nodes), set before
    the runs that judge it (findings.md, "overlap", twenty-third session), over runs on logical nodes of a host:
    (1) every run of the default (:func:`_auto_default`) at the :data:`AUTO_RULE_KNOB` Gb/s knob, switching or
    not, has the overlap turned on; (2) every run in which it was on and switched (``e2e --overlap-blocks 5``, timed
    on the current stream, without a delay: the default's where the probe turned it on, any knob, and
    :data:`OVERLAP_RULE_CONFIG`'s at the knob) passes :func:`_overlap_run_verdict`; (3) every cell of
    :data:`AUTO_RULE_CELLS` at the knob has a judged ratio, those of :data:`AUTO_RULE_DEFAULT_RUN` a run of the
    default.  Each run judged alone."""
    parts, verdicts, ratio_seen, default_seen, outside = [], [], set(), set(), 0
    for r in _ok(tp_rows, paired=True) + overlap_ab_rows(tp_rows):   # (ok: rows that did not switch)
        knob = link.label(r.get("link_gbps"))
        cell = (str(r["model"]), str(r["topology"]))
        nodes = str(r.get("mode", "")).endswith("nodes")
        switched = _switched(r)
        auto = _auto_default(r)
        explicit = r.get("config") == OVERLAP_RULE_CONFIG and knob == AUTO_RULE_KNOB and switched
        if not nodes or not (auto and (knob == AUTO_RULE_KNOB or switched) or explicit):
            outside += "overlap_ab" in r   # (runs that switched nothing and are not the default's: not counted)
            continue
        choice = r["overlap_choice"] if auto else None
        name = f"{' '.join(cell)} knob {_knob(r)} ({r.get('config')}, {r.get('mode')}, {r.get('machine')}, " \
               f"{r.get('commit')})"
        if choice:
            gbps = choice.get("gbps")
            name += f", probe {gbps:.2f} Gb/s: {'on' if choice.get('on') else 'off'}" if gbps is not None else \
                f", {'on' if choice.get('on') else 'off'} ({choice.get('reason')})"
            if knob == AUTO_RULE_KNOB:
                default_seen.add(cell)
                if not choice.get("on"):
                    parts.append(f"{name}. Rule: fails (left off at the {AUTO_RULE_KNOB} Gb/s knob)")
                    verdicts.append("not met")
                    continue
            elif not choice.get("on"):
                if switched:
                    parts.append(f"{name}: the default as before (not judged)")
                continue
            if not switched:   # on, at the knob (rule 1 holds), with no ratio the rule reads
                parts.append(f"{name}: no ratio of the rule (not switched in blocks of 5 on the current stream "
                             f"without a delay)")
                continue
        verdict, text = _overlap_run_verdict(r)
        if knob == AUTO_RULE_KNOB and verdict != "not resolved":
            ratio_seen.add(cell)
        parts.append(f"{name}: {text}")
        verdicts.append(verdict)
    missing = [f"{m} {t}" + (" (a run of the default)" if (m, t) in ratio_seen else "")
               for m, t in AUTO_RULE_CELLS
               if (m, t) not in ratio_seen or (t in AUTO_RULE_DEFAULT_RUN and (m, t) not in default_seen)]
    if not parts:
        return (f"{outside} run(s), all outside the rule" if outside else NM), NM
    head = (f"{len(verdicts)} judged run(s), {verdicts.count('not met')} failing"
            + (f"; {outside} run(s) outside the rule" if outside else ""))
    if missing:
        parts.append(f"not measured at the {AUTO_RULE_KNOB} Gb/s knob: " + ", ".join(missing))
        verdicts.append("not resolved")
    return _combined([head] + parts, verdicts)


THRESHOLD_RULE_CANDIDATE = 12.0        # the weights.overlap_below_gbps the rule would move the default to
THRESHOLD_RULE_PROBE = (8.0, 12.0)     # the default's probe readings (Gb/s per rank) whose cells the rule judges
THRESHOLD_RULE_CELLS = (("406M", "2x1"), ("1.3B", "2x1"))   # cells that must have a judged run


def _overlap_threshold_goal(tp_rows: Sequence[dict]) -> Tuple[str, str]:
    """The rule for moving ``weights.overlap_below_gbps`` from :data:`AUTO_RULE_THRESHOLD` to
    :data:`THRESHOLD_RULE_CANDIDATE`, set before its runs (findings.md, "overlap", twenty-fourth session): on logical
    nodes of a host, in each e2e run (one process per cell) where the default (:func:`_auto_default`) recorded a
    probe reading inside :data:`THRESHOLD_RULE_PROBE`, every switched run of :data:`OVERLAP_RULE_CONFIG` (forced
    on) passes :func:`_overlap_run_verdict`; the cells of :data:`THRESHOLD_RULE_CELLS` need such a run.  A forced
    run whose cell's default read outside the range is listed, not judged; one without a default beside it is not
    the rule's.  Each run judged alone: one failing run makes it "not met" (the threshold stays)."""
    probe = {(r.get("run_id"), r["model"], r["topology"]): r["overlap_choice"]["gbps"] for r in tp_rows
             if r.get("status") == "ok" and _auto_default(r) and str(r.get("mode", "")).endswith("nodes")
             and r["overlap_choice"].get("gbps") is not None}
    lo, hi = THRESHOLD_RULE_PROBE
    parts, verdicts, seen, outside = [], [], set(), []
    for r in overlap_ab_rows(tp_rows):
        gbps = probe.get((r.get("run_id"), r["model"], r["topology"]))
        if r.get("config") != OVERLAP_RULE_CONFIG or not _switched(r) or gbps is None:
            continue
        name = (f"{r['model']} {r['topology']} knob {_knob(r)} ({r.get('mode')}, {r.get('machine')}, "
                f"{r.get('commit')}), the default's probe {gbps:.2f} Gb/s")
        if not lo <= gbps <= hi:
            outside.append(name)
            continue
        verdict, text = _overlap_run_verdict(r)
        if verdict != "not resolved":
            seen.add((str(r["model"]), str(r["topology"])))
        parts.append(f"{name}: {text}")
        verdicts.append(verdict)
    if not parts and not outside:
        return NM, NM
    head = (f"{len(verdicts)} judged run(s), {verdicts.count('not met')} failing"
            + (f"; {len(outside)} with the probe outside {lo:g}-{hi:g} Gb/s (not judged): " + "; ".join(outside)
               if outside else ""))
    missing = [f"{m} {t}" for m, t in THRESHOLD_RULE_CELLS if (m, t) not in seen]
    if missing:
        parts.append("not judged: " + ", ".join(missing))
        verdicts.append("not resolved")
    return _combined([head] + parts, verdicts)


def _pool_ratios(ratios: Sequence[float]) -> Tuple[float, float, float, str]:
    """Geometric mean of ``ratios`` (>= 2) with its Student's t interval over the log ratios, and the verdict:
    ``faster`` (the interval below 1), ``slower`` (above 1) or ``not resolved``."""
    m, se = suite.mean_se([math.log(x) for x in ratios])
    return _overlap_interval(m, se, len(ratios))


def overlap_pooled(pairs: Sequence[Tuple[dict, dict]]) -> Optional[str]:
    """Per cell (model, topology, mode, knob, machine) with two or more pairs timed on the current stream (those
    that can show a gain): the pairs' ratios pooled (:func:`_pool_ratios`), of the timed steps over every pair
    and end to end over the pairs that recorded it.  None where no cell has two such pairs."""
    cells: Dict[tuple, List[Tuple[dict, dict]]] = {}
    for a, b in pairs:
        if step_sync(a) == "stream":
            key = (str(a["model"]), str(a["topology"]), str(a.get("mode")), _knob(a), str(a.get("machine")))
            cells.setdefault(key, []).append((a, b))
    out = []
    for key, ps in sorted(cells.items()):
        if len(ps) < 2:
            continue
        parts = []
        for num in ("ms_per_step", "cycle_ms_per_step"):
            rs = [a[num] / b[num] for a, b in ps if a.get(num) and b.get(num)]
            if len(rs) >= 2:
                g, lo, hi, verdict = _pool_ratios(rs)
                parts.append(f"{g:.3f} ({lo:.3f} .. {hi:.3f}, {len(rs)} pairs): {verdict}")
            else:
                parts.append(f"{len(rs)} pair(s) recorded")
        out.append("| " + " | ".join(list(key) + [str(len(ps))] + parts) + " |")
    if not out:
        return None
    return ("Pooled, cells with two or more pairs timed on the current stream (of any commit): the geometric mean "
            "of the pairs' overlapped / inside ratios with Student's t interval (95%, over the log ratios; each pair "
            "its own processes, so the interval carries the spread between processes)\n\n"
            + "\n".join(_header("model", "topology", "mode", "knob (Gb/s per rank)", "machine", "pairs",
                                 "timed steps", "end to end") + out))


OVERLAP_NOTE = ("Generated by `python -m benchmarks report` from throughput.json: `sdp4bit.weights.overlap` (the weight "
                "refresh left in flight when `step()` returns, each forward stage waiting for its own pieces) against "
                "the refresh inside `step()`, rows of one run whose configs differ in that key alone; each row its "
                "own process, so a ratio also carries the mode's spread between processes (repeats of one config: "
                "throughput.json). ms/step: the median of the timed steps (min-max). End to end: the median time "
                "from one step's end to the next (`cycle_ms_per_step`, recorded from d5eaee5 on; every row before "
                "lacks it), which adds what the loop does between timed steps (its record, the grad norm, the "
                "per-step log write that e2e asks for), during which an overlapped refresh still runs, uncounted "
                "by ms/step. Step timing: where a timed step waits for every stream of the device (`e2e "
                "--step-sync device`, every row before the option), the overlapped refresh is waited for inside the "
                "step that queued it and never runs beside the next forward, so such a row shows what the overlap "
                "costs, not what it can hide; `--step-sync stream` (the current stream, as a training loop that "
                "reads its loss) lets it run there. DeepSpeed's throughput timer, when synchronized (its default), "
                "waits for every stream as `device` does: from a4ae335 the plan turns that off for the overlapped "
                "config only, so a fair pair sets `timers.throughput.synchronized` false for both (it then shows "
                "in both snapshots).")

# ------------------------------------------------------------------------------------------- headline

def _link_cell(r: dict) -> str:
    """The headline's link rate: only one measured in the row's own run (the loopback's rate differs between
    calls, so another call's rate does not describe this one)."""
    if (r.get("ranks") or 1) < 2:
        return "-"
    if r.get("link_probe") and r.get("link_measured_gbps"):
        return f"{r['link_measured_gbps']:.2f}"
    return "probe failed" if r.get("link_probe") is False else "not measured in the run"


def headline(tp_rows: Sequence[dict], acc_rows: Sequence[dict]) -> str:
    """The README's headline: the default SDP4Bit config per model x topology against ZeRO-3 and ZeRO++, then
    the default config's loss against ZeRO-3 per accuracy run set (model, ranks, topology, schedule, steps)."""
    today = today_default()
    lines = ["| model | topology | SDP4Bit default ms/step | vs ZeRO-3 | vs ZeRO++ | share of the no-communication "
             "bound | link per rank, Gb/s, in the run | config run | machine, mode |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, topo in HEADLINE_CELLS:
        r = headline_row(tp_rows, model, topo, today)
        if r is None:
            cells, where = [NM, NM, NM, NM, NM, "-"], "-"
        else:
            cells = [f"{r['ms_per_step']:.0f}", _ratio(r, tp_rows, "zero3"), _ratio(r, tp_rows, "zeropp"),
                     _fmt(r.get("bound_fraction"), ".0%", NM), _link_cell(r), config_run(r, today)]
            where = f"{r.get('machine')}, {r.get('mode')} ({r.get('commit')})"
        lines.append(f"| {model} | {topo} | " + " | ".join(cells) + f" | {where} |")
    loss = ["| model | ranks | topology | lr schedule | steps | runs (seeds) | train loss vs ZeRO-3, same seed | "
            "held-out vs ZeRO-3, same seed | ZeRO-3 runs: spread | machine |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (ranks, sched, steps, model), ref, rs in _default_loss_groups(acc_rows):
        band = [r["train_loss"] for r in ref]
        spread = (f"{len(band)}: {100 * (max(band) / min(band) - 1):.2f}%" if len(band) > 1 else "1: -")
        cells = [_paired_cell(rs, ref, key, seed_labels=False) or NM for key in ("train_loss", "heldout_loss")]
        loss.append(f"| {model} | {ranks} | {rs[0]['topology']} | {sched} | {steps} | "
                    f"{len(rs)} ({','.join(str(r['seed']) for r in rs)}) | {cells[0]} | {cells[1]} | {spread} | "
                    f"{_distinct(rs, 'machine', '-')} |")
    if len(loss) == 2:
        loss.append("| " + " | ".join([NM] * 10) + " |")
    host = host_table(tp_rows)
    host_part = ("\nOn a multi-GPU host (" + HOST_NOTE + " All rows: `benchmarks/results/one_gpu/throughput.md`):\n\n"
                 + host + "\n") if host else ""
    return ("Generated by `python -m benchmarks report` from `benchmarks/results/one_gpu/` (do not edit by hand). "
            "Several ranks share one GPU, each its own NCCL host, so all traffic goes over sockets (an extreme "
            "slow network); topologies are NODESxGPUS of logical nodes. Ratios compare step times inside one run "
            "(`*`: across runs). The no-communication bound is the world-1 ZeRO-3 step x the ranks; above 100% "
            "it is no bound: one rank alone leaves the GPU idle between its launches, several ranks fill it. "
            "At 1x1 SDP4Bit is off (nothing to send: plain ZeRO-3), so that row times ZeRO-3 twice and its "
            "ratio is the run-to-run spread of the machine (the same code timed in one process, `e2e --paired`: "
            "the goals table). The loopback's rate is not the same from call to call, "
            "nor ZeRO-3's step (see the support table), so ratios across runs (`*`) compare different links; "
            "the link column is NCCL's all-gather rate per rank measured inside the row's own run "
            "(`e2e --probe-link`), where it was. Each cell shows the newest run of today's default (its config, "
            "whatever the file was called then, and the fixes that change results, `report.RESULT_FIXES`), else the "
            "newest run of its commit's shipped default; the `config run` column says how that differs from "
            "today's.\n\n"
            + "\n".join(lines) + "\n" + host_part + "\n"
            "Loss of the default config against ZeRO-3 (mean of the last 50 train losses; each seed against "
            "ZeRO-3's runs of the same seed, their mean first; ZeRO-3's own spread over its runs beside it, "
            "the noise any single difference carries; runs of " + str(HEADLINE_MIN_STEPS) + "+ steps; all rows, the shorter "
            "checks (repeats under `--deterministic`, the replay reference) and runs cut short in "
            "`benchmarks/results/one_gpu/accuracy.md`):"
            "\n\n" + "\n".join(loss) + "\n")


# ---------------------------------------------------------------------------------------- standing

STANDING_MIN_SEEDS = 3   # README's "Where it stands": loss run sets of at least this many seeds (fewer: goals table)


def _sched_label(sched: str, rs: Sequence[dict]) -> str:
    """An accuracy run set's schedule as a reader says it: "cosine, 25-step warm-up", "constant" (rows from before
    ``warmup`` was recorded ran accuracy's default warm-up for their steps)."""
    if not rs or not sched.startswith("cosine"):
        return sched
    w = rs[0].get("warmup")
    return f"cosine, {accuracy.default_warmup(rs[0]['steps']) if w is None else w}-step warm-up"


def _set_label(model: str, ranks, steps) -> str:
    return f"{model.replace(' deterministic', '')}, {ranks} ranks, {steps} steps" + (
        ", `--deterministic`" if model.endswith(" deterministic") else "")


def standing(tp_rows: Sequence[dict], acc_rows: Sequence[dict]) -> str:
    """README's "Where it stands" numbers, from the goals' own computations: the default's loss against ZeRO-3
    per run set of STANDING_MIN_SEEDS or more seeds (:func:`_gap_verdict`), the paper's ablations of a run set where
    two ablation configs have that many seeds (:func:`_ablation_groups`), the default on a multi-GPU host's logical
    nodes against ZeRO-3 and ZeRO++ of the same run (:func:`_host_speed_goal`'s rows), and where SDP4Bit is off
    the pooled paired runs (:func:`_pool_verdict`), each part with its goal's verdict."""
    today = today_default()
    out = ["Generated by `python -m benchmarks report` from `benchmarks/results/one_gpu/` (do not edit by hand; "
           "every run and verdict: [goals](#goals-of-the-open-issues); °: the run's commit had another default "
           "config, or lacked a fix that changes results).", ""]
    loss = _header("run set", "lr schedule", "topology", "train loss vs ZeRO-3, seed-paired: verdict")
    for (ranks, sched, steps, model), ref, rs in _default_loss_groups(acc_rows):
        d = [x for _, x in _paired(rs, ref, "train_loss")]
        if len(d) >= STANDING_MIN_SEEDS:
            loss.append(f"| {_set_label(model, ranks, steps)} | {_sched_label(sched, rs)} | {rs[0]['topology']} | "
                        f"{_gap_verdict(d)[0]} |")
    out += [f"**Loss** (issue 21: the default within +{GOAL_GAP}% of ZeRO-3, as a whole **{_accuracy_goal(acc_rows)[1]}**; "
            f"mean of the last 50 train losses, each seed against ZeRO-3's runs of the same seed; run sets of "
            f"{STANDING_MIN_SEEDS} or more seeds):", ""]
    out += (loss if len(loss) > 2 else [NM]) + [""]
    for (ranks, sched, steps, model), gaps, claims in _ablation_groups(acc_rows):
        ablated = [d for n, d in gaps.items() if n not in ("default", "ZeRO++")]
        if sum(len(d) >= STANDING_MIN_SEEDS for d in ablated) >= 2:   # else the goals table has them
            scheds = _sched_label(sched, [r for r in acc_rows if (r.get("schedule"), r.get("steps")) == (sched, steps)])
            out += [f"**The paper's ablations** ({_set_label(model, ranks, steps)}, 2x2, {scheds}), gap to ZeRO-3 "
                    f"(seeds): {_gaps_text(gaps)}.", ""] + [f"- {c}" for c, _ in claims] + [""]
    fast, other = {}, 0
    for r, z, pp in _logical_node_runs(tp_rows, today):
        if z is None or not r.get("link_measured_gbps"):
            other += 1
            continue
        fast.setdefault(f"{r['model']} {r['topology']}", []).append(
            f"{z['ms_per_step'] / r['ms_per_step']:.2f}x" + (f" ({pp['ms_per_step'] / r['ms_per_step']:.2f}x ZeRO++)"
                                                              if pp else "")
            + f" at {r['link_measured_gbps']:.2f} Gb/s" + (" (no limit)" if link.unshaped(r) else "")
            + f" ({_mark(r, today)})")
    if fast:
        out += [f"**Speed on logical nodes of a multi-GPU host** (issue 20: the default >= {GOAL_SPEEDUP:g}x ZeRO-3 and "
                f"ZeRO++ of the same run, **{_host_speed_goal(tp_rows, today)[1]}**; one rank per GPU, NVLink inside a "
                "node, sockets between nodes, each rank's rate limited by the knob or not; by the link rate measured "
                "in the run):", ""] + [f"- {k}: " + ", ".join(v) for k, v in sorted(fast.items())]
        out += ([f"- {other} more run(s) without a ZeRO-3 run or a link rate of their own: the host table in "
                 "[Results](#results)"] if other else []) + [""]
    off = []
    for where, cands in (("world size 1", _world1_cands(tp_rows, today)), ("one node", _one_node_cands(tp_rows, today))):
        for (what, machine), rs in _paired_pools(cands, tp_rows).items():
            text, v = _pool_verdict(rs, short=True)
            off.append(f"- {what} ({where}, {machine}): {text}: {v}")
    if off:
        out += ["**Where SDP4Bit is off** (world size 1, one node: the same code as ZeRO-3; both engines timed in one "
                "process, steps alternating, the runs of both build orders pooled; issue 20: within "
                f"{100 * (GOAL_WORLD1 - 1):g}%):", ""] + off + [""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- goals

GOAL_SPEEDUP = 6.0          # issue 20: the default >= 6x ZeRO-3 (and ZeRO++) with 4 and 8 ranks sharing a GPU
GOAL_BOUND = {"2x2": 0.45, "4x1": 0.60}   # issue 20: share of the no-communication bound
GOAL_WORLD1 = 1.01          # issue 20: world size 1, default step / ZeRO-3 step
GOAL_GAP = 0.3              # issue 21: mean train-loss gap to ZeRO-3, %
OVERLAP_RULE_BOUND = 1.01   # issue 20: weights.overlap on by default only where every bound is at most this


def _same_run(r: dict, rows: Sequence[dict], config: str) -> Optional[dict]:
    b, same = baseline(r, rows, config)
    return b if same else None


def _mark(r: dict, today: Dict[str, object], ignore: Sequence[str] = ()) -> str:
    """A row's commit, with ° when it did not run today's default (config or fixes) and ? when not known."""
    t = runs_today(r, today, ignore)
    return f"{r.get('commit')}" + ("" if t is True else "?" if t is None else "°")


def _verdict(status: Sequence[str], unmeasured: Sequence[str] = ()) -> str:
    """Runs' outcomes ("met", "not met", "incomplete": a baseline missing from the run) as one verdict."""
    if not status:
        return NM
    met, inc, n = status.count("met"), status.count("incomplete"), len(status)
    if met == n and not unmeasured:
        out = "met"
    elif met == 0 and inc == 0:
        out = "not met"
    else:
        out = f"met in {met} of {n} runs" + (f" ({inc} without every baseline in the run)" if inc else "")
    return out + (f"; not measured: {', '.join(unmeasured)}" if unmeasured else "")


def _combined(parts: Sequence[str], verdicts: Sequence[str]) -> Tuple[str, str]:
    """Measured lines and one verdict: met when every one is, not met when any is, else not resolved."""
    if not verdicts:
        return NM, NM
    return "<br>".join(parts), ("met" if all(v == "met" for v in verdicts) else
                                "not met" if "not met" in verdicts else "not resolved")


def _speed_goal(rows: Sequence[dict], cells: Sequence[Tuple[str, str]], configs: Sequence[str],
                today: Dict[str, object]) -> Tuple[str, str]:
    """Per cell, every run of the default with its same-run ratios against ``configs``: a run meets the goal when
    every one of them ran beside it and is >= GOAL_SPEEDUP x its step ("incomplete" when one did not run)."""
    parts, status, unmeasured = [], [], []
    for model, topo in cells:
        runs = []
        for r in one_per_run(default_rows(rows, model, topo, today), today):
            ratios = {c: (b["ms_per_step"] / r["ms_per_step"] if b else None)
                      for c, b in ((c, _same_run(r, rows, c)) for c in configs)}
            if all(v is None for v in ratios.values()):
                continue
            got = [v for v in ratios.values() if v is not None]
            status.append("not met" if any(v < GOAL_SPEEDUP for v in got) else
                          "met" if len(got) == len(configs) else "incomplete")
            runs.append(" / ".join("-" if v is None else f"{v:.2f}x" for v in ratios.values())
                        + f" ({_mark(r, today)})")
        if not runs:
            unmeasured.append(f"{model} {topo}")
        parts.append(f"{model} {topo}: " + ("; ".join(runs) if runs else NM))
    return "<br>".join(parts), _verdict(status, unmeasured)


def _bound_goal(rows: Sequence[dict], today: Dict[str, object]) -> Tuple[str, str]:
    parts, status, unmeasured = [], [], []
    for model in ("406M", "1.3B"):
        for topo, goal in GOAL_BOUND.items():
            fr = [r for r in one_per_run(default_rows(rows, model, topo, today), today) if r.get("bound_fraction")]
            status += ["met" if r["bound_fraction"] >= goal else "not met" for r in fr]
            if not fr:
                unmeasured.append(f"{model} {topo}")
            parts.append(f"{model} {topo} (>= {goal:.0%}): " + (", ".join(
                f"{r['bound_fraction']:.0%} ({_mark(r, today)})" for r in fr) if fr else NM))
    return "<br>".join(parts), _verdict(status, unmeasured)


def _world1_goal(rows: Sequence[dict], today: Dict[str, object]) -> Tuple[str, str]:
    """The default's step over ZeRO-3's in the same run at world size 1 (where SDP4Bit is off: both time the same
    code), with each step's min-max: "not resolved" when the ratio is above the goal but the ranges, the
    goal's 1% allowed, overlap (the run's own spread)."""
    return _same_code_goal(_world1_cands(rows, today), rows, today)


def _world1_cands(rows: Sequence[dict], today: Dict[str, object]) -> List[dict]:
    return [r for model in ("406M", "1.3B") for r in one_per_run(default_rows(rows, model, "1x1", today, paired=True),
                                                                 today)]


def _one_node_goal(rows: Sequence[dict], today: Dict[str, object]) -> Tuple[str, str]:
    """The same as at world size 1 for one node of a multi-GPU host (1xG on NVLink), where SDP4Bit is off too."""
    return _same_code_goal(_one_node_cands(rows, today), rows, today)


def _one_node_cands(rows: Sequence[dict], today: Dict[str, object]) -> List[dict]:
    one = [r for r in host_rows(rows, today, paired=True) if link.unshaped(r)
           and suite.parse_topology(r["topology"])[0] == 1]
    return [r for m in sorted({r["model"] for r in one}) for r in one_per_run([r for r in one if r["model"] == m], today)]


def _paired_verdict(r: dict) -> Tuple[str, str]:
    """A paired row's (``e2e --paired``: both engines in one process, steps alternating) measured text and verdict
    from its per-step log ratios to ZeRO-3: met when exp(mean + 2 SE) <= GOAL_WORLD1, not met when exp(mean - 2 SE)
    > GOAL_WORLD1, otherwise not resolved (also with fewer than e2e.PAIRED_MIN_STEPS steps or an odd number)."""
    return _log_ratio_verdict(r["paired"], f"paired in one process, {r['paired']['n']} alternating steps")


def _too_few_steps(st: dict) -> bool:
    """Paired steps that decide nothing: fewer than e2e.PAIRED_MIN_STEPS, or an odd number (one engine first more
    often than the other)."""
    return st.get("n", 0) < e2e.PAIRED_MIN_STEPS or st.get("n", 0) % 2 == 1


def _log_ratio_verdict(st: dict, label: str) -> Tuple[str, str]:
    """Met when exp(mean + k SE) <= GOAL_WORLD1: k = 2 for one run (its many steps), Student's t for a pool of
    paired runs (``st["runs"]``: :func:`pool_build_orders`), whose SE few runs estimate only roughly (the two
    orders' means take two degrees of freedom: :func:`t_factor` of runs - 1)."""
    k = t_factor(st["runs"] - 1) if st.get("runs", 1) > 2 else 2.0
    lo, mid, hi = (math.exp(st["log_ratio_mean"] + f * st["log_ratio_se"]) for f in (-k, 0, k))
    v = "met" if hi <= GOAL_WORLD1 else "not met" if lo > GOAL_WORLD1 else "not resolved"
    if _too_few_steps(st):
        v = "not resolved"
    median = f"; median step ratio {st['ratio_median']:.4f}" if st.get("ratio_median") is not None else ""
    return (f"{label}: {100 * (mid - 1):+.2f}% ({100 * (lo - 1):+.2f} .. {100 * (hi - 1):+.2f}%, {k:g} SE{median})",
            v)


def pool_paired(stats: Sequence[dict]) -> dict:
    """Paired runs of one cell taken together, as random effects: a process may carry an offset between its two
    engines that its own steps do not see (the same code measured 5.5% apart in one 1.3B process on an H100), so
    the between-process variance tau^2 is estimated from the runs' spread (DerSimonian-Laird: from Cochran's Q over
    the inverse-variance weights; 0 where the runs agree within their own SEs) and every run weighs 1 / (SE^2 +
    tau^2).  The SE is that pool's, and at least the plain spread of the run means (SD / sqrt(runs)), which few
    runs can estimate only roughly: :data:`PAIRED_MIN_RUNS` per build order.  ``n``: their steps.  Every SE must be
    > 0 (:func:`pool_build_orders` leaves runs without a spread out)."""
    y = [st["log_ratio_mean"] for st in stats]
    v = [st["log_ratio_se"] ** 2 for st in stats]
    w = [1 / vi for vi in v]
    fixed = sum(wi * yi for wi, yi in zip(w, y)) / sum(w)
    q = sum(wi * (yi - fixed) ** 2 for wi, yi in zip(w, y))
    # sum(w) - sum(w^2) / sum(w), as a sum of positive terms (no cancellation when the weights differ by far)
    denom = 2 * sum(w[i] * w[j] for i in range(len(w)) for j in range(i + 1, len(w))) / sum(w)
    tau2 = max(0.0, (q - (len(y) - 1)) / denom) if len(y) > 1 and denom > 0 else 0.0
    w = [1 / (vi + tau2) for vi in v]
    mean = sum(wi * yi for wi, yi in zip(w, y)) / sum(w)
    se = math.sqrt(1 / sum(w))
    spread = suite.mean_se(y)[1]   # the plain spread of the run means (None for one run)
    if spread is not None:
        se = max(se, spread)
    return {"n": sum(st["n"] for st in stats), "log_ratio_mean": mean, "log_ratio_se": se, "runs": len(stats),
            "tau": math.sqrt(tau2)}


PAIRED_MIN_RUNS = 3   # per build order: the spread between processes, from fewer, says too little


def pool_build_orders(rows: Sequence[dict]) -> Tuple[Optional[dict], str]:
    """One cell's paired SDP4Bit rows on one machine kind: the runs with SDP4Bit's engine built first and those with
    it built second (:func:`e2e.paired_built`) each pooled (:func:`pool_paired`), the two orders weighted equally
    (mean of the two means; SE the root of the sum of their squared SEs, halved).  The engine a process builds
    second measured slower in the 1.3B world-1 runs on H200 and the 406M on H100, not the 1.3B on H100
    (``one_gpu/README.md``), so only both orders together estimate SDP4Bit's own cost: ``(None, why)`` where one
    order is missing or has fewer than :data:`PAIRED_MIN_RUNS` runs; runs of unknown order, without a spread (SE 0)
    or of too few (or an odd number of) steps are left out."""
    by: Dict[Optional[str], List[dict]] = {}
    for r in rows:
        st = r.get("paired") or {}
        order = e2e.paired_built(r)
        if (st.get("log_ratio_se") or 0) <= 0 or _too_few_steps(st):   # an SE of 0 would outweigh the rest
            order = "short"
        by.setdefault(order if order in ("first", "second", "short") else None, []).append(st)
    unknown = "".join(f"; {len(by[k])} run(s) {what} left out" for k, what in (
        (None, "of unknown build order"), ("short", f"without a spread or of fewer than {e2e.PAIRED_MIN_STEPS} (or an odd "
                                                    f"number of) steps")) if k in by)
    pooled = {k: pool_paired(v) for k, v in by.items() if k in ("first", "second")}
    said = "; ".join(f"SDP4Bit's engine built {k}: {100 * (math.exp(st['log_ratio_mean']) - 1):+.2f}% "
                     f"({st['runs']} run(s), {st['n']} steps)" for k, st in sorted(pooled.items()))
    if len(pooled) < 2:
        return None, (f"{said or 'no paired run of known build order'}{unknown}: one build order only (the engine a "
                      f"process builds second can be the slower one: runs with the other order needed)")
    short = [k for k, st in sorted(pooled.items()) if st["runs"] < PAIRED_MIN_RUNS]
    if short:
        return None, (f"{said}{unknown}: fewer than {PAIRED_MIN_RUNS} runs with SDP4Bit's engine built "
                      f"{' and '.join(short)} (a process may carry an offset between its engines that its own steps "
                      f"do not see: runs needed to measure their spread)")
    f, s = pooled["first"], pooled["second"]
    st = {"n": f["n"] + s["n"], "runs": f["runs"] + s["runs"],
          "log_ratio_mean": (f["log_ratio_mean"] + s["log_ratio_mean"]) / 2,
          "log_ratio_se": math.sqrt(f["log_ratio_se"] ** 2 + s["log_ratio_se"] ** 2) / 2}
    return st, f"{st['runs']} paired runs, both build orders weighted equally ({said}{unknown})"


def _same_code_goal(cands: Sequence[dict], rows: Sequence[dict], today: Dict[str, object]) -> Tuple[str, str]:
    """Each candidate default row against ZeRO-3 of its run, where both run the same code (SDP4Bit off), with each
    step's min-max: "not resolved" when the ratio is above the goal but the ranges, the goal's 1% allowed, overlap
    (the run's own spread), or when the two medians are of unequal step counts.  Paired rows (``e2e --paired``)
    are judged by their step-by-step ratios instead (:func:`_paired_verdict`); where a (model, topology) has them,
    they decide it: its rows timed in separate processes are listed as superseded, and its paired runs on one
    machine kind are pooled over the two build orders (:func:`pool_build_orders`), the pool giving that machine's
    verdict (not resolved while an order is missing or has too few runs)."""
    parts, verdicts = [], []
    pairs = [(r, b) for r, b in ((r, _same_run(r, rows, "zero3")) for r in cands) if b]
    is_paired = [_paired_with(r, b) for r, b in pairs]
    paired_cells = {(r["model"], r["topology"]) for (r, _), p in zip(pairs, is_paired) if p}
    for (r, b), p in zip(pairs, is_paired):
        what = _cell_name(r)
        if p:
            text, _ = _paired_verdict(r)
            parts.append(f"{what}: {text}, SDP4Bit's engine built {e2e.paired_built(r) or '(order unknown)'} "
                         f"({_where(r)}, {_mark(r, today)})")
            continue
        q = r["ms_per_step"] / b["ms_per_step"]
        overlap = r.get("ms_min", r["ms_per_step"]) <= GOAL_WORLD1 * b.get("ms_max", b["ms_per_step"])
        v = "met" if q <= GOAL_WORLD1 else ("not resolved" if overlap else "not met")
        n, nb = r.get("timed_steps"), b.get("timed_steps")
        why = ""
        if n != nb:   # e.g. ZeRO-3 under e2e's --timed-slow: the two medians are not of the same kind
            v, why = "not resolved", f" (timed steps: {n} vs {nb})"
        if (r["model"], r["topology"]) in paired_cells:
            v, why = "superseded", " by the paired runs of this cell"
        else:
            verdicts.append(v)
        parts.append(f"{what}: {r['ms_per_step']:.1f} ({r.get('ms_min', 0):.0f}-{r.get('ms_max', 0):.0f}) vs "
                     f"{b['ms_per_step']:.1f} ({b.get('ms_min', 0):.0f}-{b.get('ms_max', 0):.0f}) ms, "
                     f"{100 * (q - 1):+.2f}%: {v}{why} ({_where(r)}, {_mark(r, today)})")
    for (what, where), rs in _paired_pools(cands, rows).items():
        text, v = _pool_verdict(rs)
        verdicts.append(v)
        parts.append(f"{what}: {text}: {v} ({where})")
    return _combined(parts, verdicts)


def _paired_with(r: dict, b: Optional[dict]) -> bool:
    """Whether ``r`` was timed step by step beside ZeRO-3's row ``b`` in one process (``e2e --paired``)."""
    return bool(b and r.get("paired") and r.get("paired_with") == b.get("row_id"))


def _cell_name(r: dict) -> str:
    return r["model"] + ("" if r.get("topology") == "1x1" else f" {r['topology']}")


def _paired_pools(cands: Sequence[dict], rows: Sequence[dict]) -> Dict[Tuple[str, str], List[dict]]:
    """The candidates timed beside ZeRO-3 in one process, by (cell, machine kind), in the candidates' order."""
    pools: Dict[Tuple[str, str], List[dict]] = {}
    for r in cands:
        if _paired_with(r, _same_run(r, rows, "zero3")):
            pools.setdefault((_cell_name(r), _where(r)), []).append(r)
    return pools


def _pool_verdict(rs: Sequence[dict], short: bool = False) -> Tuple[str, str]:
    """A cell's paired runs on one machine kind pooled over both build orders (:func:`pool_build_orders`): the
    measured text (``short``: the pool labelled by its run count alone) and verdict (not resolved while an order is
    missing or has too few runs)."""
    st, label = pool_build_orders(rs)
    if st is None:
        return label, "not resolved"
    return _log_ratio_verdict(st, f"{st['runs']} runs" if short else label)


def _logical_node_runs(rows: Sequence[dict], today: Dict[str, object]):
    """(default row, ZeRO-3's and ZeRO++'s rows of the same run or None) of every default run on a multi-GPU host's
    logical nodes (``--transport nodes``) with two or more nodes."""
    for r in host_rows(rows, today):
        if projection.logical_nodes(r.get("mode")) and suite.parse_topology(r["topology"])[0] >= 2:
            yield (r, *(_same_run(r, rows, c) for c in ("zero3", "zeropp")))


def _host_speed_goal(rows: Sequence[dict], today: Dict[str, object]) -> Tuple[str, str]:
    """The default on a multi-GPU host's logical nodes (``--transport nodes``) against ZeRO-3 and ZeRO++ of the
    same run, per knob setting: met where both ran beside it and are >= GOAL_SPEEDUP x its step."""
    parts, status = [], []
    for r, z, pp in _logical_node_runs(rows, today):
        ratios = [(b["ms_per_step"] / r["ms_per_step"] if b else None) for b in (z, pp)]
        if all(x is None for x in ratios):
            continue
        got = [x for x in ratios if x is not None]
        status.append("not met" if any(x < GOAL_SPEEDUP for x in got) else "met" if len(got) == 2 else "incomplete")
        parts.append(f"{r['model']} {r['topology']} knob {_knob(r)} (probe {_link_cell(r)} Gb/s): "
                     + " / ".join("-" if x is None else f"{x:.2f}x" for x in ratios) + f" ({_mark(r, today)})")
    return "<br>".join(parts) or NM, _verdict(status)


def _default_but(r: dict, today: Dict[str, object], *keys: str) -> bool:
    """Whether ``r``'s config is today's default but for ``keys``."""
    d = differences_from_default(r, today)
    return d is not None and set(d) <= set(keys)


def _memory_goal(rows: Sequence[dict], replica: str, today: Dict[str, object]) -> Tuple[str, str]:
    """Peak memory per rank above ZeRO-3 of the same run, per parameter, of the rows that ran today's default or
    its commit's, or that config with the replica forced, and ran ``replica``: full <= 2 B, node <= 2/gpn."""
    parts, status = [], []
    key = "sdp4bit.weights.replica"
    cells = sorted({(r.get("model"), r.get("topology")) for r in _ok(rows)})
    for model, topo in cells:
        cands = [r for r in _ok(rows) if link.unshaped(r) and r.get("model") == model and r.get("topology") == topo
                 and r.get("replica") == replica and r.get("peak_mem_bytes") and r.get("n_params")
                 and (r.get("default") or r.get("variant") == f"sdp4bit:{replica}" or _default_but(r, today, key))]
        for r in one_per_run(cands, today):
            b = _same_run(r, rows, "zero3")
            if not b or not b.get("peak_mem_bytes"):
                continue
            per = (r["peak_mem_bytes"] - b["peak_mem_bytes"]) / r["n_params"]
            gpn = r.get("gpus_per_node") or suite.parse_topology(r["topology"])[1]
            goal = 2.0 if replica == "full" else 2.0 / gpn
            status.append("met" if per <= goal else "not met")
            where = "" if projection.family(r) == projection.SHARE else f", {r.get('mode')}"
            parts.append(f"{model} {topo}: {per:+.2f} B/param (<= {goal:g}; {_mark(r, today, ignore=(key,))}{where})")
    return "<br>".join(parts) or NM, _verdict(status)


def _accuracy_goal(acc_rows: Sequence[dict]) -> Tuple[str, str]:
    """Mean of the seed-paired train-loss differences of the default config, with its standard error: shown
    when mean + t SE <= GOAL_GAP, missed when mean - t SE > GOAL_GAP (:func:`_gap_verdict`), otherwise not resolved
    by the seeds run."""
    parts, verdicts = [], []
    for (ranks, sched, steps, model), ref, rs in _default_loss_groups(acc_rows):
        d = [x for _, x in _paired(rs, ref, "train_loss")]
        if not d:
            continue
        text, v = _gap_verdict(d)
        verdicts.append(v)
        parts.append(f"{model} {rs[0]['topology']} {sched} {steps} steps: {text}")
    return _combined(parts, verdicts)


def _default_loss_groups(acc_rows: Sequence[dict]):
    """(group key, ZeRO-3's runs, the default config's runs) of every accuracy group of HEADLINE_MIN_STEPS or
    more steps that has both: the README's loss table and issue 21's goal (shorter runs are checks: repeats under
    ``--deterministic``, the replay reference)."""
    for key, g in sorted(_acc_groups(acc_rows).items(), key=_acc_order):
        ref = g.get("zero3")
        if not ref or (key[2] or 0) < HEADLINE_MIN_STEPS:
            continue
        for name, rs in sorted(g.items()):
            if name != "zero3" and rs[0].get("default"):
                yield key, ref, rs


# Issue 21's ablations (configs/NAME.json, run at 2x2 beside the default) and how the paper orders them
ABLATIONS = {"qw": "qW", "qwd": "qWD", "tlq": "TLq", "tlq_hs": "TLq-HS", "zeropp": "ZeRO++"}


def _diff_verdict(d: Sequence[float]) -> Tuple[str, str]:
    """Seed-paired differences (points) -> ("mean (SE, n seeds)", verdict): met when mean - t SE > 0, not met when
    mean + t SE < 0 (t: :func:`t_factor` of the seeds), otherwise not resolved by the seeds run."""
    m, se = suite.mean_se(d)
    if se is None:
        return f"{m:+.2f} (1 seed)", "not resolved (one seed)"
    t = t_factor(len(d))
    v = "met" if m - t * se > 0 else "not met" if m + t * se < 0 else "not resolved"
    return f"{m:+.2f} (SE {se:.2f}, {len(d)} seeds; {m - t * se:+.2f} .. {m + t * se:+.2f})", v


def _ablation_groups(acc_rows: Sequence[dict]):
    """Issue 21's ablation order at 2x2, per accuracy group of HEADLINE_MIN_STEPS or more steps with ZeRO-3 and at
    least two of the ablation configs: (group key, each config's seed-paired gaps to ZeRO-3 {name: {seed: %}}, as
    the loss goal pairs them, and the paper's claims [(text, verdict)] on seed-paired differences of those gaps: qW
    above every other config (the default included), TLq above TLq-HS, qWD within the loss goal
    (:func:`_gap_verdict`)).  A claim is met when its differences' mean +- t SE lies above 0, not met when below,
    else not resolved.  Groups with no claim to judge are left out."""
    for key, g in sorted(_acc_groups(acc_rows).items(), key=_acc_order):
        ref = g.get("zero3")
        if not ref or (key[2] or 0) < HEADLINE_MIN_STEPS:
            continue
        gaps = {name: dict(_paired(g[f"{c} 2x2"], ref, "train_loss"))
                for c, name in ABLATIONS.items() if f"{c} 2x2" in g}
        gaps = {name: d for name, d in gaps.items() if d}   # a config with no seed of ZeRO-3's pairs with nothing
        if len(set(gaps) - {"ZeRO++"}) < 2:
            continue
        dflt = dict(_paired([r for r in g.get("sdp4bit 2x2", []) if r.get("default")], ref, "train_loss"))
        if dflt:
            gaps["default"] = dflt

        def diff(a, b):
            return [gaps[a][s] - gaps[b][s] for s in sorted(set(gaps[a]) & set(gaps[b]))]

        claims = []
        if "qW" in gaps:
            over = {o: diff("qW", o) for o in gaps if o not in ("qW", "ZeRO++")}
            sub = [(o, *_diff_verdict(d)) for o, d in over.items() if d]
            if sub:
                v = _combined((), [x for _, _, x in sub])[1]
                claims.append(("qW worst: qW minus " + "; ".join(f"{o} {t}: {x}" for o, t, x in sub), v))
        tlq = diff("TLq", "TLq-HS") if "TLq" in gaps and "TLq-HS" in gaps else []
        if tlq:
            t, v = _diff_verdict(tlq)
            claims.append((f"TLq worse than TLq-HS: TLq minus TLq-HS {t}: {v}", v))
        if "qWD" in gaps:
            t, v = _gap_verdict([gaps["qWD"][s] for s in sorted(gaps["qWD"])])
            claims.append((f"qWD within +{GOAL_GAP}% of ZeRO-3: {t}", v))
        if claims:   # (none e.g. for TLq and ZeRO++ without seeds in common with the other configs)
            yield key, gaps, claims


def _gaps_text(gaps: Dict[str, Dict[int, float]]) -> str:
    return ", ".join(f"{n} {_mean(list(d.values())):+.2f}% ({len(d)})" for n, d in gaps.items())


def _ablation_goal(acc_rows: Sequence[dict]) -> Tuple[str, str]:
    """Issue 21's ablation order (:func:`_ablation_groups`): each group's gaps and claims, one verdict."""
    parts, verdicts = [], []
    for (ranks, sched, steps, model), gaps, claims in _ablation_groups(acc_rows):
        parts.append(f"{model} 2x2 {sched} {steps} steps, gap to ZeRO-3 (seeds): {_gaps_text(gaps)}; "
                     + "; ".join(c for c, _ in claims))
        verdicts += [v for _, v in claims]
    return _combined(parts, verdicts)


# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30), then at 40 and 60 degrees.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_T95_40, _T95_60 = 2.021, 2.000


def t_factor(n: int) -> float:
    """The multiple of the standard error that bounds a mean of ``n`` seeds (n >= 2): Student's t, two-sided 95%,
    n - 1 degrees of freedom (a few seeds' SE is itself uncertain: 3.18 for 4 seeds); between tabulated degrees
    the value of the next lower one (never smaller than the exact one), 2 from 61 seeds."""
    if n < 2:
        raise ValueError(f"t_factor: a standard error needs at least 2 seeds, got {n}")
    df = n - 1
    if df <= len(_T95):
        return _T95[df - 1]
    return _T95[-1] if df < 40 else _T95_40 if df < 60 else _T95_60


def _gap_verdict(d: Sequence[float]) -> Tuple[str, str]:
    """Seed-paired gaps (%) -> ("mean +- SE (...)", verdict): met when mean + t SE <= GOAL_GAP, not met when
    mean - t SE > GOAL_GAP (t: :func:`t_factor` of the seeds), otherwise not resolved by the seeds run."""
    m, se = suite.mean_se(d)
    t = t_factor(len(d)) if se is not None else 0.0
    if se is None:
        v = "not resolved (one seed)"
    elif m + t * se <= GOAL_GAP:
        v = "met"
    elif m - t * se > GOAL_GAP:
        v = "not met"
    else:
        v = "not resolved"
    return (f"{m:+.2f}%" + (f" +- {se:.2f} (SE, {len(d)} seeds; mean +- t SE {m - t * se:+.2f} .. {m + t * se:+.2f}%)"
                            if se is not None else " (1 seed)") + f": {v}", v)


SIM_GPU_RUNS = suite.REPO / "benchmarks" / "results" / "accuracy_sim"   # gpu_*.json: accuracy-sim on a GPU


def load_sim_runs(d: Path = SIM_GPU_RUNS) -> List[dict]:
    """The finished runs of the committed GPU accuracy-sim files (``gpu_*.json``), each with its file's name."""
    return [dict(r, file=f.name) for f in sorted(d.glob("gpu_*.json"))
            for r in json.loads(f.read_text()).get("runs", []) if r.get("status", "ok") == "ok"]


ISSUE21_MODEL = (768, 12)    # issue 21: the 86M GPT (d_model, layers)


def _sim_accuracy_goal(runs: Sequence[dict]) -> Tuple[str, str]:
    """Issue 21's goal on the deterministic simulation (accuracy-sim: every run repeats bit for bit, so a pair
    differs by the quantization alone): the shipped config (variant ``sdp4bit``) against ZeRO-3 of the same data
    seed, paired as accuracy-sim's own report pairs them (``accuracy_sim.paired``), per file, setting (model,
    schedule, steps) and topology; only runs of the issue's model (``ISSUE21_MODEL``): the smaller models' screens
    have their own reports and do not measure this goal."""
    from . import accuracy_sim as S

    groups: Dict[tuple, List[float]] = {}
    for f in sorted({r["file"] for r in runs}):
        for r, ref in S.paired([r for r in runs if r["file"] == f]):
            st = S.setting(r)
            model = tuple(st[S.SETTING_ARGS.index(k)] for k in ("d_model", "layers"))
            if r["variant"] == "sdp4bit" and model == ISSUE21_MODEL:
                groups.setdefault((f, st, r["topology"]), []).append((r, S.gap_pct(r, ref)))
    parts, verdicts = [], []
    for (f, st, topo), g in sorted(groups.items(), key=lambda kv: repr(kv[0])):
        text, v = _gap_verdict([d for _, d in sorted(g, key=lambda x: x[0]["data_seed"])])
        verdicts.append(v)
        a = dict(zip(S.SETTING_ARGS, st))
        sched = (f"lr {a['lr']}" + ("" if not a["warmup"] else f", warm-up {a['warmup']}")
                 + (", constant" if a["min_lr_ratio"] == 1 else f", cosine to {a['min_lr_ratio']}x"))
        machine = g[0][0].get("machine", "?").split(",")[0]
        parts.append(f"d{a['d_model']} L{a['layers']} {topo} {st[-1]} steps, {sched} ({f}, {machine}): {text}")
    return _combined(parts, verdicts)


GOALS_NOTE = ("Generated by `python -m benchmarks report` from the same rows (do not edit by hand): each open "
              "issue's goal against every run that measured it, one row per run, ratios only between rows of one "
              "run (the no-communication bound: the world-1 ZeRO-3 step of the same GPU, from any run). `not "
              "resolved`: the runs cannot tell the result from the goal (for the loss, mean +- t standard errors "
              "over seeds straddles it, t from Student's t for the seeds run, two-sided 95%: 3.18 for 4 seeds, "
              "about 2 for many; the interval given; at world size 1, the steps' own min-max spread does, or for "
              "paired runs (`e2e --paired`, which decide their cell) the mean log step ratio +- 2 standard errors, "
              "and +- t of the runs for a machine's runs pooled as random effects, the two build orders weighted "
              f"equally, and not resolved with fewer than {PAIRED_MIN_RUNS} runs of either order). °: the run did not "
              "run today's default (another default then, or before a fix that changes results; the headline's "
              "`config run` column says how); ?: not known.\n\n")


def goals_table(tp_rows: Sequence[dict], acc_rows: Sequence[dict], fits,
                sim_runs: Sequence[dict] = ()) -> str:
    """The open issues' goals against what the committed rows measured (ratios only inside one run), one row
    per goal: issue, goal, measured, verdict."""
    rows: List[Tuple[str, str, str, str]] = []
    today = today_default()
    m, v = _world1_goal(tp_rows, today)
    rows.append(("20", f"world size 1: default step <= {GOAL_WORLD1}x ZeRO-3 (same run; SDP4Bit is off there, so "
                 "both time the same code; its parameters are tested bit-equal on CPU)", m, v))
    four = [("406M", "2x2"), ("406M", "4x1"), ("1.3B", "2x2"), ("1.3B", "4x1")]
    m, v = _speed_goal(tp_rows, four, ["zero3", "zeropp"], today)
    rows.append(("20", f"4 ranks on one GPU: default >= {GOAL_SPEEDUP:g}x ZeRO-3 and ZeRO++ (each run: vs ZeRO-3 / "
                 "vs ZeRO++, `-` where it did not run in the same run)", m, v))
    m, v = _speed_goal(tp_rows, [("406M", "2x4"), ("406M", "8x1")], ["zero3"], today)
    rows.append(("20", f"8 ranks on one GPU: default >= {GOAL_SPEEDUP:g}x ZeRO-3", m, v))
    m, v = _bound_goal(tp_rows, today)
    rows.append(("20", "4 ranks: default's share of the no-communication bound", m, v))
    m, v = _host_speed_goal(tp_rows, today)
    rows.append(("20", f"a multi-GPU host as logical nodes (`e2e --transport nodes`: NVLink inside a node, the "
                 f"knob on the sockets between): default >= {GOAL_SPEEDUP:g}x ZeRO-3 / ZeRO++ (same run), per knob "
                 "setting", m, v))
    m, v = _one_node_goal(tp_rows, today)
    rows.append(("20", f"one node of a multi-GPU host on NVLink: default step <= {GOAL_WORLD1}x ZeRO-3 (same run; "
                 "SDP4Bit is off on one node, so both time the same code)", m, v))
    for replica, goal in (("full", "<= 2 B/param"), ("node", "<= 2/gpus_per_node B/param")):
        m, v = _memory_goal(tp_rows, replica, today)
        rows.append(("20", f"peak memory per rank above ZeRO-3 (same run), replica {replica}: {goal}", m, v))
    m, v = _overlap_default_goal(tp_rows)
    models, topos, knobs = (" and ".join(", ".join(dict.fromkeys(c[i] for c in OVERLAP_RULE_CELLS)).rsplit(", ", 1))
                            for i in range(3))
    rows.append(("20", "`weights.overlap` on by default where it applies (the full replica on a GPU), by the rule "
                 "set before the runs that judge it: both modes in one process (`e2e --overlap-blocks`, "
                 f"`--step-sync stream`), {models} as {topos} logical nodes, knob {knobs} Gb/s per "
                 f"rank; in every run the end-to-end overlapped / inside step() upper 95% bound <= {OVERLAP_RULE_BOUND}"
                 " and none slower (met: the default is to be switched on in config.py; not met: it stays opt-in; "
                 "superseded for the default by the automatic choice, next row)",
                 m, v))
    m, v = _overlap_auto_goal(tp_rows)
    models, topos = (" and ".join(", ".join(dict.fromkeys(c[i] for c in AUTO_RULE_CELLS)).rsplit(", ", 1))
                     for i in range(2))
    rows.append(("20", "`weights.overlap` omitted: on where the engine's probe of the link between nodes reads below "
                 "`weights.overlap_below_gbps` (6 Gb/s per rank), by the rule set before the runs that judge it: "
                 f"every run of the default at the {AUTO_RULE_KNOB} Gb/s knob turns it on; every run where it was "
                 f"on and switched (`e2e --overlap-blocks`, `--step-sync stream`, logical nodes) has its end-to-end "
                 f"upper 95% bound <= {OVERLAP_RULE_BOUND} and none slower; {models} at {topos} judged at the knob "
                 f"(not met: the omitted key means off again)", m, v))
    m, v = _overlap_threshold_goal(tp_rows)
    probe_lo, probe_hi = THRESHOLD_RULE_PROBE
    rows.append(("20", f"`weights.overlap_below_gbps` moved from {AUTO_RULE_THRESHOLD:g} to "
                 f"{THRESHOLD_RULE_CANDIDATE:g} Gb/s per rank, by the rule set before the runs that judge it: on "
                 f"logical nodes, in every cell where the default's probe read {probe_lo:g}-{probe_hi:g} Gb/s (so "
                 f"it left the overlap off), the forced overlap (`{OVERLAP_RULE_CONFIG}`, switched in the same e2e "
                 f"process) has its end-to-end upper 95% bound <= {OVERLAP_RULE_BOUND} and none slower; "
                 + " and ".join(f"{model} {topo}" for model, topo in THRESHOLD_RULE_CELLS)
                 + f" judged at least (not met: the threshold stays {AUTO_RULE_THRESHOLD:g})", m, v))
    m, v = _accuracy_goal(acc_rows)
    rows.append(("21", f"default's train loss (last 50 steps) within +{GOAL_GAP}% of ZeRO-3, seed-paired", m, v))
    m, v = _ablation_goal(acc_rows)
    rows.append(("21", "ablations at 2x2 in the paper's order (qW worst; TLq worse than TLq-HS; qWD ~ ZeRO-3, "
                 f"judged as the loss goal: at most +{GOAL_GAP}%), seed-paired; differences in points of the gap to "
                 "ZeRO-3", m, v))
    if sim_runs:
        m, v = _sim_accuracy_goal(sim_runs)
        rows.append(("21", f"the same on the deterministic simulation on a GPU (`accuracy-sim`: a pair of runs "
                     "differs by the quantization alone)", m, v))
    if not isinstance(fits, dict):   # one fit (the share-GPU rows') given alone
        fits = {projection.SHARE: fits}
    for fam, res in fits.items():
        fast = " and NVLink runs" if projection.logical_nodes(fam) else ""
        what = ("ranks sharing one GPU" if fam == projection.SHARE else f"{fam} (knob rows{fast}; {res['split']} split)"
                if res is not None else fam)
        if res is None:
            rows.append(("23", f"step-time model within 20% of every measured point: {what}", NM, NM))
            continue
        errs = (f"largest error on checked rows {100 * res['max_check_error']:.1f}%, on all "
                f"{100 * res['max_error']:.1f}%" if res.get("max_check_error") is not None else "nothing checked")
        keys = fit_keys(res)
        unfit = [k for k in projection.PROJECTED if k not in keys]
        if unfit:   # a met row must not read as a check of the configs this family never ran
            errs += f" ({', '.join(keys)} only; {', '.join(unfit)} not measured in this family)"
        probs = projection.problems(res, keys)
        rows.append(("23", f"step-time model within 20% of every measured point (fitted and checked): {what}",
                     errs + ("; " + "; ".join(probs) if probs else ""), "met" if not probs else "not met"))
    return "\n".join(_header("issue", "goal", "measured", "verdict")
                     + [f"| {i} | {g} | {m} | **{v}** |" for i, g, m, v in rows]) + "\n"


def fit_keys(res: dict) -> Tuple[str, ...]:
    """The configs a fit must describe to be used: all of projection.PROJECTED for the share-GPU rows, the ones
    measured for another family (a multi-GPU host has not run every replica)."""
    if res.get("family", projection.SHARE) == projection.SHARE:
        return projection.PROJECTED
    return tuple(k for k in projection.PROJECTED if k in {p.key for p in res["points"]})


def _slug(fam: str) -> str:
    """A family's file-name part: "4 GPUs, nodes" -> "4gpus_nodes"."""
    return "_".join(w for w in re.split(r"[^0-9a-z]+", fam.lower().replace(" gpus", "gpus")) if w)


def replace_between(text: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"README.md has no {begin} ... {end} markers")
    a, rest = text.split(begin, 1)
    _, b = rest.split(end, 1)
    return f"{a}{begin}\n{body}{end}{b}"


def fits_of(d: Path, tp: Sequence[dict], link_rows: Sequence[dict]) -> Dict[str, Optional[dict]]:
    """The step-time model fitted and checked per family of throughput rows (ranks sharing one GPU first; None
    where a family has no row with a link rate)."""
    counts = suite.load_rows(d / projection.COUNTS_FILE)
    fams = [projection.SHARE] + sorted({projection.family(r) for r in tp if not link.unshaped(r)}
                                       - {projection.SHARE})
    return {fam: projection.fit_and_check(tp, link_rows, projection.default_split(fam, tp, counts), fam, counts)
            for fam in fams}


def readme_with(text: str, tp: Sequence[dict], acc: Sequence[dict], goals: str) -> str:
    """README.md's text with its generated blocks (headline, "Where it stands", goals) made from the rows."""
    text = replace_between(text, headline(tp, acc))
    text = replace_between(text, standing(tp, acc), STANDING_BEGIN, STANDING_END)
    return replace_between(text, GOALS_NOTE + goals, GOALS_BEGIN, GOALS_END)


def readme_from_committed(d: Path) -> str:
    """What ``report`` would write into README.md from the results committed in ``d`` (nothing written)."""
    tp, acc = suite.load_rows(d / "throughput.json"), suite.load_rows(d / "accuracy.json")
    goals = goals_table(tp, acc, fits_of(d, tp, suite.load_rows(d / "linkrate.json")), load_sim_runs())
    return readme_with(README.read_text(), tp, acc, goals)


def run(args) -> int:
    d = Path(args.dir)
    tp = suite.load_rows(d / "throughput.json")
    acc = suite.load_rows(d / "accuracy.json")
    steps_path = d / "accuracy_steps.json"
    losses = json.loads(steps_path.read_text()) if steps_path.is_file() else {}
    d.mkdir(parents=True, exist_ok=True)
    (d / "throughput.md").write_text(throughput_table(tp))
    (d / "accuracy.md").write_text(accuracy_table(acc, losses))
    written = ["throughput.md", "accuracy.md"]
    if not args.no_png:
        if throughput_png(tp, d / "throughput.png"):
            written.append("throughput.png")
        if accuracy_png(acc, losses, d / "accuracy.png", args.smooth):
            written.append("accuracy.png")
    link_rows = suite.load_rows(d / "linkrate.json")
    lt = linkrate_table(link_rows)
    if lt:
        (d / "linkrate.md").write_text(lt)
        written.append("linkrate.md")
    ot = overlap_table(tp)
    if ot:
        (d / "overlap.md").write_text(ot)
        written.append("overlap.md")
    fits = fits_of(d, tp, link_rows)
    for fam, res in fits.items():
        md, png = (("projection.md", "speedup_vs_rate.png") if fam == projection.SHARE else
                   (f"projection_{_slug(fam)}.md", f"speedup_vs_rate_{_slug(fam)}.png"))
        if res is None:
            print(f"report: no throughput row has a link rate yet{'' if fam == projection.SHARE else ' in ' + fam} "
                  f"(e2e --link-gbps, linkrate): {md} and {png} not produced")
            continue
        (d / md).write_text(projection_md(res, tp))
        written.append(md)
        if not args.no_png and rate_png(tp, res, d / png):
            written.append(png)
    goals = goals_table(tp, acc, fits, load_sim_runs())
    (d / "goals.md").write_text(goals)
    written.append("goals.md")
    if not args.no_readme:
        README.write_text(readme_with(README.read_text(), tp, acc, goals))
        written.append(str(README))
    print("report: wrote " + ", ".join(written) + f" (in {d})")
    return 0


def backfill_configs(rows: List[dict]) -> List[str]:
    """What a throughput row ran, for rows measured before e2e recorded it: ``config_snapshot``
    (suite.config_snapshot_at: the row's configs/ file read by its commit's code, assuming the run used that
    commit's tree; rows of a dirty tree stay unknown) where missing, and ``fixes_missing`` (the RESULT_FIXES its
    commit lacks) on every ok row, recomputed so that a fix added to the list reaches old rows.  Returns the ids
    of the rows that got a snapshot."""
    done = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        commit = str(r.get("commit") or "")
        if r.get("config_snapshot") is None and commit and "+" not in commit and r.get("config"):
            snap = suite.config_snapshot_at(commit, r["config"], r.get("replica_requested"))
            if snap is not None:
                r["config_snapshot"] = snap
                done.append(r["row_id"])
        r["fixes_missing"] = fixes_missing(r)
    return done


def _backfill_gpu_count(rows: List[dict], runs: Path) -> None:
    """``gpu_count`` (the kind of machine: GPUs on the host) for rows measured before e2e recorded it, from their
    run's meta in ``runs/`` where that file is kept."""
    metas: Dict[str, Optional[int]] = {}
    for r in rows:
        rid = r.get("run_id")
        if r.get("gpu_count") is not None or not rid:
            continue
        if r.get("gpu") is None:   # a CPU row (e2e gives those 0, whatever GPUs its host had)
            r["gpu_count"] = 0
            continue
        if rid not in metas:
            f = runs / f"{rid}.json"
            metas[rid] = (json.loads(f.read_text()).get("meta", {}).get("machine", {}).get("gpu_count")
                          if f.is_file() else None)
        if metas[rid] is not None:
            r["gpu_count"] = metas[rid]


def run_merge(args) -> int:
    d = Path(args.dir)
    if not args.files and not getattr(args, "backfill_configs", False):
        raise SystemExit("merge: name the files to merge (or --backfill-configs)")
    if getattr(args, "backfill_configs", False):
        rows = suite.load_rows(d / "throughput.json")
        done = backfill_configs(rows)
        _backfill_gpu_count(rows, d / "runs")
        rebound = [r["row_id"] for r in rows if e2e.rebind(r, rows)]
        suite.write_json(d / "throughput.json", rows)
        print(f"merge: config snapshots set for {len(done)} rows of {d / 'throughput.json'}"
              + (f"; bounds of their own kind of machine for {', '.join(rebound)}" if rebound else ""))
    for f in args.files:
        f = Path(f)
        if f.suffix != ".json":
            print(f"merge: {f}: not JSON, skipped (log archives stay out of the repository)")
            continue
        doc = json.loads(f.read_text())
        if isinstance(doc, dict) and "meta" in doc and "rows" in doc:
            q = doc["meta"].get("question")
            (d / "runs").mkdir(parents=True, exist_ok=True)
            kept = d / "runs" / f"{doc['meta']['run_id']}.json"
            if not (kept.exists() and kept.resolve() == f.resolve()):   # merging a kept run file again
                shutil.copyfile(f, kept)
            rows = doc["rows"]
        elif isinstance(doc, list):
            rows = doc
            first = str(rows[0].get("run_id", "")) if rows else ""
            q = next((k for k in ("accuracy", "linkrate") if first.startswith(k)), "e2e")
        elif isinstance(doc, dict):
            suite.merge_dict(d / "accuracy_steps.json", doc)
            print(f"merge: {f}: {len(doc)} loss curves -> accuracy_steps.json")
            continue
        else:
            raise SystemExit(f"merge: {f} is neither a results file, a row list nor a loss-curve file")
        targets = {"e2e": "throughput.json", "accuracy": "accuracy.json", "linkrate": "linkrate.json"}
        if q not in targets:
            print(f"merge: {f}: a {q} results file, kept in {d / 'runs'}")
            continue
        if q == "e2e":   # what each new row ran, and the fixes its commit lacks
            backfill_configs(rows)
        merged = suite.merge_rows(d / targets[q], rows)
        print(f"merge: {f}: {len(rows)} rows -> {d / targets[q]}")
        if q == "e2e":   # rows whose call had no world-1 row of their machine take it from the merged rows
            _backfill_gpu_count(merged, d / "runs")   # (rows before e2e recorded it: from their kept run file)
            filled = [r["row_id"] for r in merged if e2e.set_bound(r, merged) or e2e.rebind(r, merged)]
            suite.write_json(d / targets[q], merged)   # (the gpu counts too)
            if filled:
                print(f"merge: bounds set for {', '.join(filled)}")
        probes = doc.get("link_probes") if isinstance(doc, dict) else None
        if probes:  # e2e --probe-link: the rates its rows name in link_measured_source
            suite.merge_rows(d / "linkrate.json", probes)
            print(f"merge: {f}: {len(probes)} link probe rows -> {d / 'linkrate.json'}")
    return 0
