"""``python -m benchmarks projection``: a step-time model fitted on the measured rows, and what it projects.

The model (per config k: ``zero3``, ``zeropp``, ``sdp4bit/full``, ``sdp4bit/node``, ablations alike)::

    step = c_k * C  +  X / e  -  phi_k * min(c_k * C, X / e)

* ``C``: compute, the world-1 ZeRO-3 step of the same model x the ranks sharing one device (the rows'
  ``bound_ms``; on a real cluster, one rank per GPU: the world-1 step itself).  ``c_k`` (searched in [0.2, 4])
  takes in what a config adds to it (quantize kernels, extra copies, per-collective latency) and, below 1, what
  ranks sharing one GPU gain by filling it (in that mode ``C`` is no bound); a ``c_k`` on an edge of its range
  is flagged: the model does not describe those rows.
* ``X``: bytes one rank sends per step over the shaped link (:func:`link_bytes`: counted by the run where it
  counted, else SDP4Bit's own count and DeepSpeed's formula with its gathers as counted for the model; at scale the
  bytes crossing one node's link, ``deepspeed_sdp4bit/step_bytes.py``) x 8 / the link rate.  Rows are fitted per
  mode (:func:`family`): with ranks sharing a GPU every byte of every level goes over the rank's own (shaped) TCP
  link; on a multi-GPU host's logical nodes (``e2e --transport nodes``) only what crosses nodes does, and only
  knob rows count there, besides the host's NVLink runs as points with nothing on the slow link
  (:func:`nvlink_point`).  The rate is the one ``linkrate`` measured for that setting (``link_measured_gbps``),
  else the requested one (said so); a share-GPU row without the knob counts only with the rate measured inside
  its own run (``e2e --probe-link``): the loopback's own rate differs from call to call.
  ``e``: the fraction of that rate the training's collectives get, one for all configs.
* ``phi_k`` in [0, 1]: the overlap, the share of the shorter of compute and communication hidden under the
  longer one.

``e``, ``c_k`` and ``phi_k`` are fitted (least squares of log step times, grid then refined grid) on part of the
measured rows with a link rate (``--split``: ``alternate`` = every other rate of each model / topology / config;
``model:NAME`` = fit on the other models, check on NAME) and checked on the rest: the report gives the largest
relative error on the check rows and on every row (goal: every measured point within 20%; the cluster
projection is printed only then, and only when each config it compares has at least 3 fitted rows and a checked
one; else with ``--force``, marked NOT VALIDATED).

Then, for a user's model size, nodes, GPUs per node and inter-node link rate (Gb/s per node; the intra-node
level is free unless ``--intra-gbps`` is given), it prints the projected step time of ZeRO-3, ZeRO++ and
SDP4Bit, SDP4Bit's speed-up, and the break-even rate below which SDP4Bit is faster.  Caveats, printed with
it: a fit made in share-GPU mode (ranks' compute serialized on one GPU, ``--family share``, the default) need not
carry its overlap over to one rank per GPU (``--family "4 GPUs, nodes"`` fits a multi-GPU host's rows); the world-1
step time of the user's model is the user's (``--world1-ms``) or scaled from
the measured one by parameter count.

Without rows that have a link rate, only the bytes model is printed (bytes per GPU and pure transmission time,
no compute, no overlap), as before this model existed.

    python -m benchmarks projection --params 1.3e9 --nodes 2 4 8 16 --gpus-per-node 8 --link-gbps 100
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import link, suite  # noqa: E402
from deepspeed_sdp4bit.config import parse_block  # noqa: E402
from deepspeed_sdp4bit.step_bytes import node_link_bytes, step_bytes  # noqa: E402
from deepspeed_sdp4bit.topology import TopologyShape  # noqa: E402

# The paper's clusters (/work/shared/paper.md): rate per node and GPUs per node; per GPU = rate / GPUs.
PAPER_CLUSTERS = [
    {"name": "paper: Slingshot-10, 100 Gb/s per node of 4 A100", "label": "paper: Slingshot-10,\n 100 Gb/s / 4 A100",
     "node_gbps": 100.0, "gpus_per_node": 4},
    # the InfiniBand cluster (8 x H800 per node): the rate is not stated in paper.md, so it is not marked
]
GOAL = 0.20  # largest relative error allowed on any measured point, checked or fitted (issue 23)

# fit keys -> (scheme of step_bytes, sdp4bit block)
def scheme_of(key: str) -> Tuple[str, Optional[dict]]:
    name, _, replica = key.partition("/")
    if name == "zero3":
        return "zero3", None
    if name == "zeropp":
        return "zero++", None
    if name == "sdp4bit":
        return "sdp4bit", {"weights": {"replica": replica or "full"}}
    raise ValueError(f"no bytes model for config {key!r} at scale (zero3, zeropp, sdp4bit/full, sdp4bit/node)")


def fit_key(row: dict) -> str:
    """The config a row measured: its configs/ name, with the replica the engine ran for SDP4Bit configs."""
    rep = row.get("replica") or row.get("replica_requested")
    return row["config"] if row["config"] in ("zero3", "zeropp") or not rep else f"{row['config']}/{rep}"


# ------------------------------------------------------------------------------------------- points

@dataclass
class Point:
    key: str
    model: str
    topology: str
    C: float            # ms: compute (bound_ms)
    bytes: float        # per rank per step, over the shaped link
    gbps: float         # link rate of the point
    rate_source: str    # "measured" / "requested"
    ms: float           # measured step time (0 for synthetic curves)
    row_id: str = ""
    link_gbps: Optional[float] = None  # requested (None: unshaped)
    bytes_source: str = "formula"      # "counted" (examples/wire_count.py) / "formula" / "formula, ..."

    @property
    def X(self) -> float:  # ms to send the bytes at the rate
        return self.bytes * 8 / (self.gbps * 1e9) * 1e3


SHARE = "share"   # the family of share-GPU rows (and rows without a mode: every byte over the rank's TCP link)


def family(row: dict) -> str:
    """Which fit a row may join: the row's mode where it is a multi-GPU host's, one rank per GPU (``"N GPUs, ..."``,
    e.g. ``"4 GPUs, nodes"``:
    NVLink inside a logical node, shaped sockets between; only what crosses nodes is on the link), else ``"share"``
    (ranks sharing a GPU, world size 1, CPU, or no mode recorded: every byte of every level over the rank's
    shaped TCP link, compute serialized).  Fits never mix families: compute and bytes on the link mean different
    things in each."""
    m = str(row.get("mode") or "")
    return m if re.match(r"\d+ GPUs, ", m) else SHARE


def ds_gathers(model: str, counts: Sequence[dict]) -> Optional[float]:
    """How many times per step ZeRO-3 gathers the model (1 = forward only; 2 = again in backward, the formula's
    assumption), from the newest counted ZeRO-3 row of ``model`` (``wire_counts.json``: train_gpt
    ``--count-wire-bytes``): the volume of its all-gathers (every all-gather op; a ZeRO-3 row has no others) over
    the bf16 parameter bytes; None without such a row or where it counted no gather."""
    rows = [r for r in counts if r.get("model") == model and r.get("config") == "zero3"
            and r.get("wire_counted_per_step") and r.get("n_params")]
    if not rows:
        return None
    r = max(rows, key=lambda r: r.get("created", ""))
    vol = 0.0
    for k, b in r["wire_counted_per_step"].items():
        op, _, rest = k.partition("@")
        g = int(rest.split(":")[0])
        if op.startswith("all_gather") and g > 1:
            vol += b * g / (g - 1)   # the gathered tensor's bytes (this rank sent (g - 1)/g of them)
    return vol / (2 * r["n_params"]) if vol > 0 else None


def logical_nodes(fam: str) -> bool:
    """Whether a family (:func:`family`; for a host's row, its mode) is a multi-GPU host's logical nodes
    (``e2e --transport nodes``: NVLink inside a node, the shaped link between)."""
    return str(fam).endswith(", nodes")


def all_on_link(row: dict) -> bool:
    """Whether every byte a rank sends crosses the shaped link: ranks sharing a GPU, CPU (gloo), and a multi-GPU
    host with NCCL's sockets or network transport; not ``--transport nodes`` (NVLink inside a logical node)."""
    return not logical_nodes(family(row))


def _byte_twin(r: dict) -> tuple:
    """What fixes the bytes a rank sends per step: the mode, model, shape of the batch, topology and config (its
    name with the replica, its full snapshot, and the bytes the engine's own model gives); not the link rate,
    which only sets how long they take."""
    snap = json.dumps(r.get("config_snapshot"), sort_keys=True)
    wire = json.dumps(r.get("wire_bytes_per_step"), sort_keys=True)
    return (family(r), r.get("model"), r.get("micro_batch"), r.get("seq"), r.get("topology"), r.get("ranks"),
            r.get("gpus_per_node"), fit_key(r), snap, wire)


def twin_count(r: dict, rows: Sequence[dict]) -> Optional[dict]:
    """The newest other row of the same byte twin (:func:`_byte_twin`) that counted its bytes, for a row that did
    not (e.g. a rate point run before the counter existed): what it sends per step is the same at every rate."""
    key = _byte_twin(r)
    got = [x for x in rows if x is not r and x.get("wire_counted_total") is not None and x.get("status") == "ok"
           and _byte_twin(x) == key]
    return max(got, key=lambda x: str(x.get("created") or "")) if got else None


def _counted(r: dict) -> float:
    return float(r["wire_counted_total"] if all_on_link(r) else r["wire_counted_inter"])


def link_bytes(r: dict, counts: Sequence[dict], rows: Sequence[dict] = ()) -> Tuple[Optional[float], str]:
    """Bytes one rank sends per step over the link the knob shapes, and where the number comes from (in the
    formula, ZeRO++'s int8 gathers are taken as often as ZeRO-3's were counted: the same coordinator decides when a
    parameter is released).

    Counted where the run counted: ``wire_counted_total`` where every byte crosses the link (:func:`all_on_link`),
    ``wire_counted_inter`` (collectives whose group spans NCCL hosts) on logical nodes; else as counted by another
    run of ``rows`` of the same config, model and topology at another rate (:func:`twin_count`); else, where every byte
    crosses the link, the row's formula bytes with DeepSpeed's gathers taken as often as ``ds_gathers`` counted
    them for the model (the formula assumes two per step; without a count the row's bytes are unknown: None).
    In ``--transport nodes`` rows without a count: SDP4Bit's inter level (its intra level and a node replica's
    gathers stay on NVLink) and DeepSpeed's gathers and reduce-scatters over the world (a ring
    runs at its slowest hop, which crosses nodes); ZeRO++ with hpZ > 1 has no such formula here (None).
    """
    if r.get("wire_counted_total") is not None:   # counted: every byte, or what crossed logical nodes
        return _counted(r), "counted"
    twin = twin_count(r, rows)
    if twin is not None:
        return _counted(twin), f"counted in {twin.get('run_id')} (same config at another rate)"
    w = r.get("wire_bytes_per_step") or {}
    if not w:   # a row with a total only (no levels to tell apart)
        return r.get("wire_bytes_total"), "the row's wire_bytes_total"
    n = ds_gathers(r.get("model"), counts)
    ds = {k: v for k, v in w.items() if not k.startswith("sdp4bit_")}
    gathers = {k: v for k, v in ds.items() if "allgather" in k}
    if gathers and n is None:
        return None, (f"DeepSpeed's gathers not counted for {r.get('model')} (the formula's two per step is an "
                      "upper bound)")
    scaled = {k: (v * n / 2 if k in gathers else v) for k, v in ds.items()}
    src = ("formula" + (f", DeepSpeed's gathers x {n:.2f} per step as counted for ZeRO-3" if gathers else "")) \
        if ds else "engine.sdp4bit_summary()"
    if all_on_link(r):
        return sum(v for k, v in w.items() if k.startswith("sdp4bit_")) + sum(scaled.values()), src
    if r.get("config") == "zeropp" and (r.get("gpus_per_node") or 1) > 1:
        return None, "ZeRO++ with hpZ across logical nodes: no formula for what crosses them (not counted)"
    inter = sum(v for k, v in w.items() if k.startswith("sdp4bit_") and k.endswith("_inter"))
    return inter + sum(v for k, v in scaled.items() if k.endswith("_world")), src + ", what crosses nodes"


def rate_of(r: dict, link_rows: Sequence[dict]) -> Tuple[Optional[float], str]:
    """The link rate (Gb/s per rank) a throughput row ran at and where it comes from: ``measured (same run)``
    (``e2e --probe-link``), ``measured`` (the ``linkrate`` row of its settings and machine measured nearest in
    time, another call), ``measured (N ranks)`` (such a row at another rank count), ``requested`` (the knob's
    setting), else None; a row whose own probe failed gets None (no other call's rate stands in for it, as
    e2e.py records it)."""
    if r.get("link_probe") is False:
        return None, "probe failed"
    gbps, src = r.get("link_measured_gbps"), "measured (same run)" if r.get("link_probe") else "measured"
    if not gbps and not r.get("link_gbps"):   # the loopback's own rate (no knob rate) varies from call to call
        return None, "no rate set by the knob, none measured in the run"
    if not gbps:   # a knob rate: what linkrate measured for that setting, else the setting itself
        m = link.measured_rate(r, link_rows)
        gbps = m["measured_gbps"] if m else None
        if m and m.get("ranks") != r.get("ranks"):
            src = f"measured ({m.get('ranks')} ranks)"   # no linkrate row at this rank count
        if not gbps:
            gbps, src = r["link_gbps"], "requested"
    return gbps, src


NVLINK = "NVLink (nothing on a shaped link)"   # the rate source of a logical-nodes family's X = 0 points


def nvlink_point(r: dict, fam: str) -> bool:
    """Whether row ``r`` is an X = 0 point of the logical-nodes family ``fam`` (``"N GPUs, nodes"``): the same
    host's ``--transport nvlink`` run of the same config with the nodes on NVLink, i.e. the family's limit of an
    unbounded link (compute alone). Topologies with several logical nodes qualify, and for a config that ignores
    the topology (ZeRO-3) a single node too."""
    if not logical_nodes(fam) or family(r) != fam[:-len("nodes")] + "nvlink":
        return False
    return (r.get("nodes") or 1) > 1 or bool(r.get("topology_independent"))


def points(rows: Sequence[dict], link_rows: Sequence[dict], fam: str = SHARE,
           counts: Sequence[dict] = ()) -> Tuple[List[Point], List[str]]:
    """Fit points of one family (:func:`family`) from throughput rows (ok, several ranks, a compute bound, bytes
    on the link (:func:`link_bytes`), and a known link rate); for a multi-GPU host's logical nodes also its
    NVLink runs as points with nothing on the link (:func:`nvlink_point`: ``X = 0``, rate ``inf``)."""
    out, skipped = [], []
    for r in rows:
        if not suite.timed_alone(r) or (r.get("ranks") or 1) < 2 or r.get("reused_from"):
            continue  # a reused row (ZeRO-3 / ZeRO++ standing for another topology) is its source's point again; a
            # paired one (e2e --paired) shared its process with another engine; one of e2e --overlap-blocks mixed
            # two modes in its steps
        # an opt-in variant (e.g. sdp4bit_overlap): no projection compares it, and its own parameters would fit its
        # few rows exactly
        opt_in = fit_key(r) not in PROJECTED
        if nvlink_point(r, fam) and r.get("bound_ms") and not opt_in:
            out.append(Point(fit_key(r), r["model"], r["topology"], float(r["bound_ms"]), 0.0, math.inf, NVLINK,
                             float(r["ms_per_step"]), r.get("row_id", ""), None, "none on a shaped link"))
            continue
        if family(r) != fam:
            continue
        if opt_in:
            skipped.append(f"{r.get('row_id')}: {fit_key(r)} is none of the configs a projection compares "
                           f"({', '.join(PROJECTED)})")
            continue
        if not r.get("bound_ms") or not r.get("wire_bytes_total"):
            skipped.append(f"{r.get('row_id')}: no compute bound or bytes")
            continue
        if r.get("link_delay_us"):
            skipped.append(f"{r.get('row_id')}: a delay of {r['link_delay_us']:g} us (the model has no latency term)")
            continue
        if fam != SHARE and r.get("link_gbps") is None:
            skipped.append(f"{r.get('row_id')}: unshaped (no knob rate: the probe's collective rate is not the rate "
                           "every config's traffic got)")
            continue
        nbytes, bsrc = link_bytes(r, counts, rows)
        if not nbytes:
            skipped.append(f"{r.get('row_id')}: {bsrc}")
            continue
        gbps, src = rate_of(r, link_rows)
        if not gbps:
            skipped.append(f"{r.get('row_id')}: {src}")
            continue
        out.append(Point(fit_key(r), r["model"], r["topology"], float(r["bound_ms"]), float(nbytes),
                         float(gbps), src, float(r["ms_per_step"]), r.get("row_id", ""), r.get("link_gbps"), bsrc))
    return out, skipped


def split(pts: Sequence[Point], how: str = "alternate") -> Tuple[List[Point], List[Point]]:
    """(fit, check).  ``alternate``: per (config, model, topology), rates in order, every other one is checked
    (the lowest and highest are fitted when there are three or more).  ``model:NAME`` / ``topology:NAME``: the rows
    of that model / topology are checked, the others fitted."""
    for what in ("model", "topology"):
        if how.startswith(what + ":"):
            name = how.split(":", 1)[1]
            return ([p for p in pts if getattr(p, what) != name], [p for p in pts if getattr(p, what) == name])
    if how != "alternate":
        raise ValueError(f"--split must be 'alternate', 'model:NAME' or 'topology:NAME', got {how!r}")
    groups: Dict[tuple, List[Point]] = {}
    for p in pts:
        groups.setdefault((p.key, p.model, p.topology), []).append(p)
    fit, check = [], []
    for g in groups.values():
        g = sorted(g, key=lambda p: (p.gbps, p.row_id))
        for i, p in enumerate(g):
            (check if i % 2 == 1 and i != len(g) - 1 else fit).append(p)
    return fit, check


# ------------------------------------------------------------------------------------------- the model

def step_ms(C, X, c: float, phi: float, e: float):
    """The model's step time (works on floats and numpy arrays alike)."""
    import numpy as np
    comp, comm = c * np.asarray(C, dtype=float), np.asarray(X, dtype=float) / e
    return comp + comm - phi * np.minimum(comp, comm)


@dataclass
class Fit:
    e: float
    c: Dict[str, float]
    phi: Dict[str, float]
    n_fit: Dict[str, int] = field(default_factory=dict)
    loss: float = 0.0
    at_bound: List[str] = field(default_factory=list)   # parameters that ended on an edge of their search range
    compute_seen: Dict[str, int] = field(default_factory=dict)   # fitted runs with nothing on the link

    def predict(self, p: Point) -> Optional[float]:
        if p.key not in self.c:
            return None
        return float(step_ms(p.C, p.X, self.c[p.key], self.phi[p.key], self.e))

    def as_dict(self) -> dict:
        return {"e": self.e, "c": self.c, "phi": self.phi, "n_fit": self.n_fit, "loss": self.loss}


def _best_for_key(C, X, T, e: float, cs, phis):
    """Best (sse, c, phi) of one config's points for a given e over the grids cs x phis."""
    import numpy as np
    comm = X / e                                                     # (n,)
    comp = cs[:, None] * C[None, :]                                  # (nc, n)
    pred = comp[:, None, :] + comm[None, None, :] - phis[None, :, None] * np.minimum(comp, comm)[:, None, :]
    sse = (np.log(pred / T) ** 2).sum(-1)                           # (nc, nphi)
    i, j = np.unravel_index(np.argmin(sse), sse.shape)
    return float(sse[i, j]), float(cs[i]), float(phis[j])


def fit(pts: Sequence[Point], e_range=(0.05, 2.0), c_range=(0.2, 4.0)) -> Fit:
    """Least squares of log step times over e (shared) and c_k, phi_k (per config): a grid, then a finer grid
    around the best point (deterministic; no optimizer library needed)."""
    import numpy as np
    if not pts:
        raise ValueError("no points to fit")
    by: Dict[str, List[Point]] = {}
    for p in pts:
        by.setdefault(p.key, []).append(p)
    arrays = {k: (np.array([p.C for p in v]), np.array([p.X for p in v]), np.array([p.ms for p in v]))
              for k, v in by.items()}

    def search(es, grids):
        best = None
        for e in es:
            tot, cs_, ph_ = 0.0, {}, {}
            for k, (C, X, T) in arrays.items():
                s, c, ph = _best_for_key(C, X, T, e, *grids[k])
                tot, cs_[k], ph_[k] = tot + s, c, ph
            if best is None or tot < best[0]:
                best = (tot, float(e), cs_, ph_)
        return best

    cs0, phis0 = np.linspace(*c_range, 76), np.linspace(0.0, 1.0, 41)
    log_es = np.linspace(math.log(e_range[0]), math.log(e_range[1]), 61)
    tot, e, cs, phs = search(np.exp(log_es), {k: (cs0, phis0) for k in arrays})
    de, dc, dph = log_es[1] - log_es[0], cs0[1] - cs0[0], phis0[1] - phis0[0]
    for _ in range(12):  # a grid of +-2 steps around the best point, then half the step
        es = np.exp(np.linspace(math.log(e) - 2 * de, math.log(e) + 2 * de, 17))
        grids = {k: (np.linspace(max(c_range[0], cs[k] - 2 * dc), min(c_range[1], cs[k] + 2 * dc), 17),
                     np.linspace(max(0.0, phs[k] - 2 * dph), min(1.0, phs[k] + 2 * dph), 17)) for k in arrays}
        tot, e, cs, phs = search(es, grids)
        de, dc, dph = de / 2, dc / 2, dph / 2
    edge = []   # a parameter on its range's edge: the optimum lies outside, the model does not explain the rows
    if min(abs(e - e_range[0]), abs(e - e_range[1])) < 1e-6 * e_range[1]:
        edge.append(f"e = {e:.3f}")
    for k, c in cs.items():
        if min(abs(c - c_range[0]), abs(c - c_range[1])) < 1e-6 * c_range[1]:
            edge.append(f"{k}: c = {c:.3f}")
    return Fit(e, cs, phs, {k: len(v) for k, v in by.items()}, tot, edge,
               {k: len({p.row_id.split("/")[0] for p in v if p.X == 0}) for k, v in by.items()})


def check(f: Fit, pts: Sequence[Point]) -> List[dict]:
    """Predicted vs measured per point: ``{"row_id", "key", "model", "topology", "gbps", "ms", "pred", "rel"}``."""
    out = []
    for p in pts:
        pred = f.predict(p)
        out.append({"row_id": p.row_id, "key": p.key, "model": p.model, "topology": p.topology, "gbps": p.gbps,
                    "rate_source": p.rate_source, "ms": p.ms, "pred": pred,
                    "rel": None if pred is None else pred / p.ms - 1})
    return out


def repeats(rows: Sequence[dict], pts: Sequence[Point]) -> List[dict]:
    """Points measured more than once at one knob setting (same model, config, ranks, rate, sockets and delay;
    the topology too unless the config ignores it; same machine kind, mode, micro-batch and sequence), in
    different runs: the machine's own repeat noise, which bounds how closely any model of the rate can match its
    points (their measured rates are printed beside them: the bound holds as far as those agree).
    ``{"model", "key", "ranks", "setting", "ms", "gbps", "spread", "floor"}`` with ``spread`` = largest / smallest
    step time - 1 and ``floor`` the least error (as prediction / measured - 1) one prediction for all of them must
    have on one: (largest - smallest) / their sum."""
    by_id = {r.get("row_id"): r for r in rows}
    groups: Dict[tuple, List[Tuple[Point, dict]]] = {}
    for p in pts:
        r = by_id.get(p.row_id)
        if r is None or (r.get("link_gbps") is None and p.X != 0):   # unshaped: the loopback's own rate differs
            continue                                                     # from call to call (NVLink points: none)
        topo = None if r.get("topology_independent") else p.topology
        same = (r.get("machine"), r.get("mode"), r.get("micro_batch"), r.get("seq"))
        groups.setdefault((p.model, p.key, r.get("ranks"), topo, link.settings_of(r), same), []).append((p, r))
    out = []
    for (model, key, ranks, topo, setting, _), g in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if len({r.get("run_id") for _, r in g}) < 2:
            continue
        ms = [p.ms for p, _ in g]
        out.append({"model": model, "key": key, "ranks": ranks, "topology": topo, "setting": setting,
                    "ms": ms, "gbps": [p.gbps for p, _ in g], "commits": [r.get("commit") for _, r in g],
                    "spread": max(ms) / min(ms) - 1, "floor": (max(ms) - min(ms)) / (max(ms) + min(ms))})
    return out


def fit_and_check(rows: Sequence[dict], link_rows: Sequence[dict], how: str = "alternate", fam: str = SHARE,
                  counts: Sequence[dict] = ()) -> Optional[dict]:
    """Everything the report and the command line need, for the rows of one family (:func:`family`); None when
    no measured row of it has a link rate."""
    pts, skipped = points(rows, link_rows, fam, counts)
    if not pts:
        return None
    fit_pts, check_pts = split(pts, how)
    if not fit_pts:
        return None
    f = fit(fit_pts)
    checked = check(f, check_pts)
    fitted = check(f, fit_pts)
    errs = [abs(c["rel"]) for c in checked if c["rel"] is not None]
    every = errs + [abs(c["rel"]) for c in fitted if c["rel"] is not None]
    return {"fit": f, "split": how, "family": fam, "fit_rows": fitted, "check_rows": checked, "skipped": skipped,
            "max_check_error": max(errs) if errs else None, "max_error": max(every) if every else None,
            "points": pts, "repeats": repeats(rows, pts), "counts": list(counts)}


# ------------------------------------------------------------------------------------------- at scale

def cluster_step(f: Fit, key: str, params: float, nodes: int, gpn: int, node_gbps: float, world1_ms: float,
                 intra_gbps: Optional[float] = None) -> Optional[dict]:
    """Projected step of config ``key`` for ``params`` values on nodes x gpn GPUs, ``node_gbps`` per node."""
    if key not in f.c:
        return None
    scheme, block = scheme_of(key)
    if block and block["weights"]["replica"] == "node" and gpn == 1:
        return None  # one rank per node: the node replica is the full one
    shape = TopologyShape(nodes, gpn)
    rows = step_bytes(scheme, int(params), shape, parse_block(block) if block is not None else None)
    node_bytes = node_link_bytes(rows, shape)
    X = node_bytes * 8 / (node_gbps * 1e9) * 1e3
    intra = sum(r["bytes"] for r in rows if r["level"] == "intra")
    if intra_gbps:
        X += intra * 8 / (intra_gbps * 1e9) * 1e3
    return {"key": key, "nodes": nodes, "gpus_per_node": gpn, "node_gbps": node_gbps,
            "inter_bytes_per_gpu": node_bytes / gpn, "intra_bytes_per_gpu": intra, "comm_ms": X / f.e,
            "step_ms": float(step_ms(world1_ms, X, f.c[key], f.phi[key], f.e))}


def break_even(f: Fit, key: str, base: str, params: float, nodes: int, gpn: int, world1_ms: float,
               intra_gbps: Optional[float] = None, lo: float = 0.01, hi: float = 1e5) -> Tuple[str, Optional[float]]:
    """The link rate (Gb/s per node) below which ``key`` is faster than ``base``: ("below", R), ("always", None)
    (faster at every rate up to ``hi``), ("never", None) (slower down to ``lo``) or ("n/a", None)."""
    def ratio(r):
        a = cluster_step(f, base, params, nodes, gpn, r, world1_ms, intra_gbps)
        b = cluster_step(f, key, params, nodes, gpn, r, world1_ms, intra_gbps)
        return None if a is None or b is None else a["step_ms"] / b["step_ms"]
    rl, rh = ratio(lo), ratio(hi)
    if rl is None or rh is None:
        return "n/a", None
    if rh >= 1.0:
        return "always", None
    if rl < 1.0:
        return "never", None
    for _ in range(60):  # bisection on log rate: ratio(lo) >= 1 > ratio(hi)
        mid = math.sqrt(lo * hi)
        if ratio(mid) >= 1.0:
            lo = mid
        else:
            hi = mid
    return "below", math.sqrt(lo * hi)


def share_curve(f: Fit, key: str, C: float, nbytes: float, rates: Sequence[float]) -> List[float]:
    """Model step times of one share-GPU setting (compute C, bytes per rank) over ``rates`` (Gb/s per rank)."""
    return [float(step_ms(C, nbytes * 8 / (r * 1e9) * 1e3, f.c[key], f.phi[key], f.e)) for r in rates]


def world1_estimate(params: float, rows: Sequence[dict]) -> Optional[Tuple[float, str]]:
    """World-1 ZeRO-3 step time for ``params``: the measured model nearest in size, scaled by parameter count."""
    cands = [r for r in rows if r.get("status") == "ok" and r.get("topology") == "1x1" and r.get("config") == "zero3"
             and r.get("ms_per_step") and r.get("n_params") and not r.get("paired_with")]
    if not cands:
        return None
    r = min(cands, key=lambda r: abs(math.log(r["n_params"] / params)))
    return r["ms_per_step"] * params / r["n_params"], (f"{r['ms_per_step']:.0f} ms of {r['model']} "
                                                       f"({r['n_params'] / 1e6:.0f}M, {r.get('machine')}) x "
                                                       f"{params / r['n_params']:.2f}")


# ------------------------------------------------------------------------------------------- output

def bytes_table(params, nodes, gpus_per_node, link_gbps, replica) -> List[str]:
    """The bytes model alone (no compute, no overlap): inter-node bytes per GPU and transmission time."""
    lines = [f"{'scheme':16} {'nodes':>5} {'GB/GPU/step':>12} {'comm ms':>9}"]
    for n in nodes:
        shape = TopologyShape(n, gpus_per_node)
        for key in ("zero3", "zeropp", f"sdp4bit/{replica}"):
            scheme, block = scheme_of(key)
            if block and replica == "node" and gpus_per_node == 1:
                continue
            nb = node_link_bytes(step_bytes(scheme, int(params), shape,
                                            parse_block(block) if block is not None else None), shape)
            lines.append(f"{key:16} {n:5d} {nb / gpus_per_node / 1e9:12.3f} {nb * 8 / (link_gbps * 1e9) * 1e3:9.1f}")
    return lines


PROJECTED = ("zero3", "zeropp", "sdp4bit/full", "sdp4bit/node")  # what a projection compares
COUNTS_FILE = "wire_counts.json"   # counted rows that say how often DeepSpeed gathers a model (ds_gathers)


def default_split(fam: str, rows: Sequence[dict] = (), counts: Sequence[dict] = ()) -> str:
    """The split each family is checked with: share-GPU rows span several rates per cell (``alternate``); a
    multi-GPU host's have had two knob rates per cell, where ``alternate`` checks nothing, so where the family has
    knob rows at 2x2 and at 4x1 they are fitted on 2x2 and checked on 4x1, a topology the fit has not seen
    (``alternate`` otherwise)."""
    if fam == SHARE:
        return "alternate"
    topos = {r.get("topology") for r in rows if family(r) == fam and r.get("link_gbps") is not None
             and suite.timed_alone(r) and link_bytes(r, counts, rows)[0] is not None}
    return "topology:4x1" if {"2x2", "4x1"} <= topos else "alternate"


def problems(res: dict, keys: Sequence[str] = PROJECTED) -> List[str]:
    """Why the fit may not be used for projections of ``keys`` (empty: it may): every measured point within the
    goal, no parameter on its range's edge (both over every config: the link efficiency is shared), and for each
    key more fitted rows than its two own parameters plus a checked row (a config fitted on one or two rows
    matches them whatever the model)."""
    out = []
    if res.get("max_error") is None or res["max_error"] > GOAL:
        out.append(f"a measured point is off by more than {100 * GOAL:.0f}%")
    if res["fit"].at_bound:
        out.append("a parameter lies on its range's edge")
    checked = {c["key"] for c in res["check_rows"] if c["rel"] is not None}   # a config the fit has no
    nodes = logical_nodes(res.get("family", SHARE))
    for k in keys:                                                             # parameters for is not checked
        n, fast = res["fit"].n_fit.get(k, 0), res["fit"].compute_seen.get(k, 0)
        why = ([f"{n} fitted row(s), 3 needed"] if n < 3 else []) + (["no checked row"] if k not in checked else [])
        if nodes and n and fast < 2:
            # knob rows are link-bound: they fix (1 - phi) c, not c, so the step on a fast link (and the rate where
            # SDP4Bit stops paying) would be extrapolated; NVLink runs of the config bound it (two runs at least:
            # one run's step carries the host's run-to-run noise)
            why.append(f"{fast} fitted run(s) with nothing on the link, 2 needed "
                       "(its step on a fast link is not measured)")
        if why:
            out.append(f"{k}: " + ", ".join(why))
    return out


def validated(res: dict, keys: Sequence[str] = PROJECTED) -> bool:
    return not problems(res, keys)


def fit_lines(res: dict, keys: Sequence[str] = PROJECTED) -> List[str]:
    f: Fit = res["fit"]
    lines = [f"fit ({res['split']} split; {sum(f.n_fit.values())} rows): link efficiency e = {f.e:.3f}"]
    for k in sorted(f.c):
        lines.append(f"  {k:16} compute factor c = {f.c[k]:.3f}   overlap phi = {f.phi[k]:.2f}   ({f.n_fit[k]} rows)")
    unpredicted = sum(c["rel"] is None for c in res["check_rows"])   # check rows of configs the fit has not
    if res["max_check_error"] is None:
        lines.append("check: no rows left to check (all were used for the fit)")
    else:
        ok = "within" if res["max_check_error"] <= GOAL else "NOT within"
        lines.append(f"check on {len(res['check_rows']) - unpredicted} other rows: largest error "
                     f"{100 * res['max_check_error']:.1f}% ({ok} the {100 * GOAL:.0f}% goal)"
                     + (f"; {unpredicted} more of configs without fitted rows, not predicted" if unpredicted else ""))
    if res["check_rows"]:
        checked = sorted({c["key"] for c in res["check_rows"] if c["rel"] is not None})
        unchecked = sorted(set(f.c) - set(checked))
        lines.append(f"  (checked rows exist for {', '.join(checked)}"
                     + (f" only; {', '.join(unchecked)}: fitted rows only)" if unchecked else ")"))
    if res.get("max_error") is not None:
        ok = "within" if res["max_error"] <= GOAL else "NOT within"
        lines.append(f"every measured point (fitted and checked): largest error {100 * res['max_error']:.1f}% "
                     f"({ok} the {100 * GOAL:.0f}% goal)"
                     + (f", less the {unpredicted} not predicted" if unpredicted else ""))
    if f.at_bound:
        lines.append(f"at the edge of the search range (the best fit lies outside it: the model does not describe "
                     f"these rows): {'; '.join(f.at_bound)}")
    if not validated(res, keys):
        lines.append(f"NOT VALIDATED for {', '.join(keys)}: projections from this fit are not to be trusted: "
                     + "; ".join(problems(res, keys)))
    for rp in res.get("repeats", ()):
        gbps, threads, nsocks, delay = rp["setting"]
        sock = f"{link.sockets_label(threads, nsocks)} sockets" + (f", delay {delay:g} us" if delay else "")
        where = f"knob {gbps:g} Gb/s, {sock}" if gbps is not None else "NVLink"
        lines.append(f"repeat in another run: {rp['model']} {rp['key']} {rp['ranks']} ranks"
                     + (f" {rp['topology']}" if rp["topology"] else "") + f", {where}: "
                     + " / ".join(f"{m:.0f} ms ({g:.2f} Gb/s, {c})" if math.isfinite(g) else f"{m:.0f} ms ({c})"
                                  for m, g, c in zip(rp["ms"], rp["gbps"], rp["commits"]))
                     + f": {100 * rp['spread']:.1f}% apart; a model of the rate alone misses one of them by at "
                       f"least {100 * rp['floor']:.1f}%")
    for c in res["check_rows"]:
        model = "no fitted rows of this config" if c["rel"] is None else \
            f"model {c['pred']:8.0f} ms, {100 * c['rel']:+.1f}%"
        rate = f"{c['gbps']:8.2f} Gb/s ({c['rate_source']})" if math.isfinite(c["gbps"]) else c["rate_source"]
        lines.append(f"  {c['model']:5} {c['topology']:4} {c['key']:16} {rate}: measured {c['ms']:8.0f} ms, {model}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1.3e9)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--link-gbps", type=float, default=100.0, help="inter-node bandwidth per node, Gb/s")
    ap.add_argument("--intra-gbps", type=float, default=None, help="intra-node rate per GPU, Gb/s (default: free)")
    ap.add_argument("--world1-ms", type=float, default=None,
                    help="your model's step time on one GPU (default: the measured one scaled by parameters)")
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0,
                    help="accelerator memory, for SDP4Bit's default replica choice (full if the bf16 copy fits "
                         "a quarter of it)")
    ap.add_argument("--dir", default=str(suite.ONE_GPU), help="folder with throughput.json and linkrate.json")
    ap.add_argument("--split", default=None, help="alternate | model:NAME | topology:NAME (see the module docstring; "
                    "default: the report's split of the family)")
    ap.add_argument("--family", default=SHARE, help="which rows to fit: 'share' (ranks sharing a GPU) or a "
                    "multi-GPU host's mode, e.g. '4 GPUs, nodes' (benchmarks/projection.py's family())")
    ap.add_argument("--json", default=None)
    ap.add_argument("--force", action="store_true", help="print the projection even when the fit is not validated "
                    "(a measured point off by more than 20%%, or a parameter on its range's edge)")
    args = ap.parse_args(argv)
    if args.link_gbps <= 0 or args.params < 1 or args.gpus_per_node < 1 or min(args.nodes) < 1:
        raise SystemExit("projection: --link-gbps > 0, --params >= 1, --gpus-per-node >= 1 and --nodes >= 1")
    from deepspeed_sdp4bit.integration import choose_replica
    replica = choose_replica(args.gpus_per_node, int(args.params), 0.25, int(args.gpu_mem_gib * 2 ** 30))[0] or "node"
    d = Path(args.dir)
    rows, link_rows = suite.load_rows(d / "throughput.json"), suite.load_rows(d / "linkrate.json")
    counts = suite.load_rows(d / COUNTS_FILE)
    res = fit_and_check(rows, link_rows, args.split or default_split(args.family, rows, counts), args.family, counts)
    out: dict = {"args": vars(args), "replica": replica}
    if res is None:
        print(f"No step-time fit: no measured row in {d} has a link rate yet (run `python -m benchmarks "
              f"linkrate` and `e2e --link-gbps ...` on a GPU machine). The bytes model alone "
              f"(no compute, no overlap), {args.link_gbps:g} Gb/s per node:")
        print("\n".join(bytes_table(args.params, args.nodes, args.gpus_per_node, args.link_gbps, replica)))
    else:
        f = res["fit"]
        keys = ("zero3", "zeropp", f"sdp4bit/{replica}")
        print("\n".join(fit_lines(res, keys)))
        out["validated"] = validated(res, keys)
        out["fit"] = f.as_dict()
        out["check_rows"] = [dict(c, gbps=c["gbps"] if math.isfinite(c["gbps"]) else None)   # JSON has no inf
                             for c in res["check_rows"]]
        out["max_check_error"], out["max_error"] = res["max_check_error"], res["max_error"]
        if not out["validated"] and not args.force:
            print("\nNo projection printed: the model does not fit the measured points well enough to project "
                  "(above). --force prints it anyway.")
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(out, fh, indent=1, default=str)
            return
        if not out["validated"]:
            print("\n*** NOT VALIDATED (--force): the numbers below come from a model that misses measured points "
                  "***")
        w1 = (args.world1_ms, "given") if args.world1_ms else world1_estimate(args.params, rows)
        if w1 is None:
            raise SystemExit("projection: no measured world-1 step time to scale; pass --world1-ms")
        sdp = f"sdp4bit/{replica}"
        how = ("A model fitted in share-GPU mode (several ranks' compute serialized on one GPU): its overlap need "
               "not carry over to one rank per GPU." if args.family == SHARE else
               f"A model fitted on rows of '{args.family}' (one rank per GPU of one host).")
        print(f"\nProjection for {args.params / 1e9:.2f}B parameters, {args.gpus_per_node} GPUs per node, "
              f"{args.link_gbps:g} Gb/s per node; world-1 step {w1[0]:.0f} ms ({w1[1]}); SDP4Bit's default "
              f"replica here: {replica}. {how}")
        print(f"{'nodes':>5} {'ZeRO-3 ms':>10} {'ZeRO++ ms':>10} {'SDP4Bit ms':>10} {'vs ZeRO-3':>9} {'vs ZeRO++':>9}"
              f"  SDP4Bit pays (vs ZeRO-3; vs ZeRO++) below")
        out["rows"] = []
        for n in args.nodes:
            z3, zp, s = (cluster_step(f, k, args.params, n, args.gpus_per_node, args.link_gbps, w1[0],
                                      args.intra_gbps) for k in ("zero3", "zeropp", sdp))
            be = [break_even(f, sdp, b, args.params, n, args.gpus_per_node, w1[0], args.intra_gbps)
                  for b in ("zero3", "zeropp")]
            fmt = lambda x: f"{x['step_ms']:10.0f}" if x else f"{'not fitted':>10}"  # noqa: E731
            sp = lambda a: f"{a['step_ms'] / s['step_ms']:8.2f}x" if a and s else f"{'-':>9}"  # noqa: E731
            bes = "; ".join(f"{R:.1f} Gb/s" if how == "below" else
                            {"always": "at every rate", "never": "never", "n/a": "-"}[how] for how, R in be)
            print(f"{n:5d} {fmt(z3)} {fmt(zp)} {fmt(s)} {sp(z3)} {sp(zp)}  {bes}")
            out["rows"].append({"nodes": n, "zero3": z3, "zeropp": zp, "sdp4bit": s,
                                "break_even_vs_zero3": be[0], "break_even_vs_zeropp": be[1]})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
