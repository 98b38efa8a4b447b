"""Loss curves (PNG) and a markdown table from a ``run_matrix.py`` summary.

Usage::

    python benchmarks/plot_results.py benchmarks/results/gpt86m/summary.json \\
        [--png loss.png] [--table results.md] [--smooth 20] [--baseline zero3]

The PNG shows the train loss of every run (a trailing moving average over ``--smooth`` steps; raw values
are too noisy at small batch sizes) and the held-out evaluations as markers.  The table has one row per run;
``speedup`` is the baseline config's mean step time divided by this run's, for the same topology and
transport.  matplotlib is only needed for the PNG (``--table`` alone works without it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(summary: dict, baseline: str = "zero3") -> str:
    """A markdown table (one row per run of ``summary["runs"]``) as a string."""
    runs = summary.get("runs", [])
    base_ms: Dict[tuple, float] = {(r["topology"], r["transport"]): r["mean_ms"] for r in runs
                                   if r.get("config") == baseline and r.get("mean_ms")}
    head = ("| config | topology | transport | ranks | ms/step | tokens/s | TFLOPS/GPU | speedup | peak mem GiB "
            "| train loss (last 50) | held-out loss | status |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in runs:
        b = base_ms.get((r.get("topology"), r.get("transport")))
        speed = (b / r["mean_ms"]) if (b and r.get("mean_ms")) else None
        mem = r.get("peak_mem_bytes")
        status = "ok" if r.get("rc") == 0 and r.get("finished") else f"FAILED (rc {r.get('rc')})"
        lines.append("| " + " | ".join([
            str(r.get("config")), str(r.get("topology")), str(r.get("transport")), str(r.get("world_size")),
            _fmt(r.get("mean_ms"), ".1f"), _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get("tflops_per_gpu"), ".3g"),
            _fmt(speed, ".2f") + ("x" if speed else ""), _fmt(mem / 2 ** 30 if mem else None, ".2f"),
            _fmt(r.get("train_loss_last50"), ".4f"), _fmt(r.get("heldout_loss"), ".4f"), status]) + " |")
    timed = sorted({r.get("timed_steps") for r in summary.get("runs", []) if r.get("timed_steps")})
    counted = "/".join(str(t) for t in timed) if timed else summary.get("last_k")
    note = (f"\nms/step: mean over the last {counted} steps of each run (at most {summary.get('last_k')}; the "
            f"first step excluded). "
            f"{summary.get('flops_formula', '')}. speedup: {baseline} ms/step / this ms/step, same topology "
            f"and transport.")
    return "\n".join(lines) + "\n" + note + "\n"


def _moving_average(values: List[float], window: int) -> List[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_losses(summary: dict, png: Path, smooth: int, title: Optional[str] = None) -> None:
    """Write the loss-curve PNG; raises RuntimeError with install advice when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; no display on the machines this runs on
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plot_results.py needs matplotlib for the PNG (pip install matplotlib); "
                           "--table works without it") from e
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in summary.get("runs", []):
        log = Path(r.get("log_json", ""))
        if not log.is_file():
            continue
        doc = json.loads(log.read_text())
        steps = doc.get("steps", [])
        if not steps:
            continue
        label = f"{r['config']} {r['topology']} {r['transport']}"
        line, = ax.plot([s["step"] for s in steps], _moving_average([s["loss"] for s in steps], smooth),
                        label=label, linewidth=1.2)
        ev = [e for e in doc.get("evals", []) if e["step"] > 0]
        if ev:
            ax.plot([e["step"] for e in ev], [e["heldout_loss"] for e in ev], "o", color=line.get_color(),
                    markersize=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"train loss (moving average, {smooth} steps); dots: held-out")
    ax.set_title(title or "train_gpt.py runs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary", help="summary.json written by run_matrix.py")
    p.add_argument("--png", default=None, help="loss-curve image (default: next to the summary)")
    p.add_argument("--table", default=None, help="markdown file (default: next to the summary)")
    p.add_argument("--no-png", action="store_true", help="only the table")
    p.add_argument("--smooth", type=int, default=20, help="moving-average window in steps")
    p.add_argument("--baseline", default="zero3", help="config name the speedup is relative to")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    if a.smooth < 1:
        p.error(f"--smooth must be >= 1, got {a.smooth}")
    src = Path(a.summary)
    summary = json.loads(src.read_text())
    table = markdown_table(summary, a.baseline)
    tpath = Path(a.table) if a.table else src.with_name("results.md")
    tpath.write_text(table)
    print(table)
    print(f"table: {tpath}")
    if not a.no_png:
        png = Path(a.png) if a.png else src.with_name("loss.png")
        try:
            plot_losses(summary, png, a.smooth, a.title)
        except RuntimeError as e:
            print(f"plot_results.py: {e}", file=sys.stderr)
            return 2
        print(f"png: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
