"""``python -m benchmarks linkrate``: the bandwidth knob of the suite, and the rate each setting really gives.

The knob
--------
The GPU hosts have no ``tc`` (iproute2 is not installed); their container does hold CAP_NET_ADMIN (``CapEff``
000001fffeffffff on an H200 host, 2026-11-25), so a qdisc on ``lo`` set over netlink might work there, but it was
not tried and would shape every rank's traffic on the host together.  The suite limits each process's TCP egress
itself: ``benchmarks/link_shim.c``, loaded with
``LD_PRELOAD``, paces send / sendto / sendmsg / write / writev on AF_INET / AF_INET6 stream sockets through a
token bucket shared by all threads of the process (NCCL's socket transport sends from several threads).  It
needs no privileges; it is compiled on first use with the system C compiler (``$CC``, else ``cc``, else
``gcc``) into ``$SDP4BIT_LINK_CACHE`` (default ``~/.cache/sdp4bit_link``; the file name carries a hash of the
source).  In share-GPU mode every rank is its own NCCL host and all its traffic is TCP, so the limit is the
rank's link rate (in 4x1, one rank per node: the node's link; in 2x2 both levels go over it).

NCCL's socket transport calls libc's ``send()`` (misc/socket.cc, ``socketProgressOpt``: ``MSG_DONTWAIT`` for
progress, blocking for set-up) from its proxy and helper threads; ``libnccl.so.2`` reaches libc through its
dynamic symbol table, so the interposed ``send`` is the one it calls.  Every run with the knob writes the
shim's own count of the bytes it paced (``SDP4BIT_LINK_STATS_DIR``), and ``linkrate`` checks that count
against the bytes the collective had to send: if NCCL ever bypassed the shim, that row says so.

Receiving is not limited (each process limits what it sends, like one direction of a full-duplex NIC).

Latency (``--link-delay-us`` / ``linkrate --delay-us``, ``SDP4BIT_LINK_DELAY_US``): a sender-side sleep per call
would serialize NCCL's pipelined chunks (up to 8 in flight per channel) and measure an artefact, so the shim
keeps a delay line instead: send() copies the bytes into the socket's queue stamped "due at now + delay" and
returns; one writer thread per process hands them to the kernel in order when due, one piece per socket in turn
(through the rate limit when one is set); close() returns at once and the writer closes the socket once its
queue is out; shutdown() and exit (_exit too) deliver the queue first, and what could not be delivered is
counted (``dropped_bytes``) and said.  A sender keeps its rate only while it keeps rate x delay bytes in
flight (NCCL: 8 steps of its chunk per channel).  ``linkrate`` adds a round-trip row per setting (one byte there
and back, the echo not delayed: the delay once plus the loopback's own).  Measured on this project's 2-core CPU
machine, ``linkrate --cpu --gbps off --delay-us off|1000 --mb 64``: round trip 13 / 1053 us.  A qdisc (netem) on
``lo`` would be the kernel's way; netem is not in the kernel of the CPU machine (ENOENT) and was not tried on a
GPU host.  The step-time model (benchmarks/projection.py) has no latency term: rows with a delay
are left out of its fit and said so.

Unset (``--link-gbps`` not given): no ``LD_PRELOAD`` at all.  ``--nccl-sockets TxS`` sets
``NCCL_SOCKET_NTHREADS=T NCCL_NSOCKS_PERTHREAD=S`` (NCCL allows 1-16 threads, T x S <= 64; ``default``: neither
set, NCCL's own choice, one socket per connection driven by the proxy thread on a plain host): the unshaped
loopback through that single socket may be slower than the rates asked for, and more sockets raise the ceiling.

The question
------------
``linkrate --gbps off 10 25 ...`` measures, per setting, the rate a plain transfer really gets through the
knob: ``tcp`` (always): one process streams ``--mb`` MiB (at least rate x ``--seconds``) to another over loopback
TCP (rate = bytes x 8 / the receiver's time from first to last byte); with ``--collective`` (automatic on a GPU):
``--ranks`` processes (share-GPU NCCL ranks on one GPU; gloo on CPU) run all-gather and all-to-all of ``--mb`` MiB
per rank (rate = bytes each rank sends x 8 / median time per collective; benchmarks/link_collective.py), once
unshaped (no shim) and once for all shaped rates in one process group (the rate set in place), per
``--nccl-sockets`` setting.  Rows go to ``OUT/linkrate.json``.

``e2e --probe-link`` runs the same collectives (:func:`measure_collectives`) inside an e2e run, once per (rate,
rank count) before its first config, so each row's ``link_measured_gbps`` comes from the same machine, rank
count, socket setting and hour as its step time (machines of one kind differed by up to 1.5x in this mode, and
8-rank rows had only 4-rank measurements to go by).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import suite

SHIM_SRC = Path(__file__).resolve().parent / "link_shim.c"
COLLECTIVE_SCRIPT = Path(__file__).resolve().parent / "link_collective.py"
GBPS_VAR, BURST_VAR, STATS_VAR = "SDP4BIT_LINK_GBPS", "SDP4BIT_LINK_BURST_KB", "SDP4BIT_LINK_STATS_DIR"
DELAY_VAR = "SDP4BIT_LINK_DELAY_US"


# ------------------------------------------------------------------------------------------- values

def parse_gbps(value, name: str = "--link-gbps") -> Optional[float]:
    """A rate in Gb/s (> 0, finite) or ``None`` for "off" / "none" (unshaped); ValueError naming ``name``."""
    if value is None or str(value).strip().lower() in ("off", "none", "unshaped"):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {value!r} is not a rate in Gb/s (a number > 0, or 'off' for unshaped)") from None
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name}: {value!r} is not a rate in Gb/s (a number > 0, or 'off' for unshaped)")
    return x


def parse_sockets(spec: str) -> Tuple[Optional[int], Optional[int]]:
    """``--nccl-sockets``: ``"TxS"`` -> (NCCL_SOCKET_NTHREADS, NCCL_NSOCKS_PERTHREAD); ``"default"`` -> (None, None)."""
    if str(spec).strip().lower() == "default":
        return None, None
    t, x, s = str(spec).strip().partition("x")
    if not (x and t.isdigit() and s.isdigit()):
        raise ValueError(f"--nccl-sockets: {spec!r} is not THREADSxSOCKETS (e.g. 4x4) or 'default'")
    check_nccl_sockets(int(t), int(s))
    return int(t), int(s)


def check_nccl_sockets(threads: Optional[int], nsocks: Optional[int]) -> None:
    """NCCL's own limits for NCCL_SOCKET_NTHREADS (1-16) and NCCL_NSOCKS_PERTHREAD (product <= 64)."""
    if threads is not None and not 1 <= threads <= 16:
        raise ValueError(f"--nccl-sockets: NCCL_SOCKET_NTHREADS must be 1..16, got {threads}")
    if nsocks is not None and nsocks < 1:
        raise ValueError(f"--nccl-sockets: NCCL_NSOCKS_PERTHREAD must be >= 1, got {nsocks}")
    if (threads or 1) * (nsocks or 1) > 64:
        raise ValueError(f"NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD must be <= 64 (NCCL's limit), "
                         f"got {threads} x {nsocks}")


def label(gbps: Optional[float]) -> str:
    return "off" if gbps is None else f"{gbps:g}"


def sockets_label(threads: Optional[int], nsocks: Optional[int]) -> str:
    """``"4x4"`` for NCCL's socket threads x sockets per thread, ``default`` for each left to NCCL."""
    return f"{threads or 'default'}x{nsocks or 'default'}"


# ------------------------------------------------------------------------------------------- the shim

def cache_dir() -> Path:
    return Path(os.environ.get("SDP4BIT_LINK_CACHE") or Path.home() / ".cache" / "sdp4bit_link")


def compiler() -> Optional[str]:
    """The C compiler the shim is built with: ``$CC`` (a name on PATH or a path), else ``cc``, else ``gcc``;
    None when there is none (or ``$CC`` names nothing that exists)."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return shutil.which("cc") or shutil.which("gcc")


def build_shim() -> Path:
    """The compiled shim (built on first use; the name carries a hash of the source, so an edit rebuilds)."""
    src = SHIM_SRC.read_bytes()
    out = cache_dir() / f"link_shim_{hashlib.sha256(src).hexdigest()[:16]}.so"
    if out.is_file():
        return out
    cc = compiler()
    if not cc:
        raise RuntimeError("the link knob needs a C compiler to build benchmarks/link_shim.c: set CC or install "
                           f"cc/gcc (CC={os.environ.get('CC')!r})")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".link_shim.", suffix=".so")
    os.close(fd)
    cmd = [cc, "-O2", "-Wall", "-shared", "-fPIC", "-o", tmp, str(SHIM_SRC), "-ldl", "-lpthread", "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building the link shim failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def parse_delay_us(value, name: str = "--link-delay-us") -> Optional[float]:
    """A one-way delay in microseconds (0 .. 1e7) or ``None`` for 0 / "off"; ValueError naming ``name``."""
    if value is None or str(value).strip().lower() in ("off", "none", "0", "0.0"):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {value!r} is not a delay in microseconds (0 .. 10000000, or 'off')") from None
    if not math.isfinite(x) or not 0 <= x <= 1e7:
        raise ValueError(f"{name}: {value!r} is not a delay in microseconds (0 .. 10000000, or 'off')")
    return x or None


def knob_env(gbps: Optional[float], stats_dir: Optional[Path] = None, threads: Optional[int] = None,
             nsocks: Optional[int] = None, burst_kb: Optional[float] = None,
             delay_us: Optional[float] = None) -> Dict[str, str]:
    """Environment that puts a process (and its children) under the knob; ``{}`` when nothing is set.

    ``gbps`` and ``delay_us`` None: no shim at all (not preloaded).  ``delay_us``: one-way delay of every byte
    the process sends on TCP (the shim's delay line).  ``threads`` / ``nsocks``: NCCL's socket settings.
    """
    check_nccl_sockets(threads, nsocks)
    env: Dict[str, str] = {}
    if threads is not None:
        env["NCCL_SOCKET_NTHREADS"] = str(threads)
    if nsocks is not None:
        env["NCCL_NSOCKS_PERTHREAD"] = str(nsocks)
    delay_us = parse_delay_us(delay_us, "delay_us")
    if gbps is None and delay_us is None:
        return env
    pre = os.environ.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = str(build_shim()) + (" " + pre if pre else "")
    if delay_us is not None:
        env[DELAY_VAR] = repr(float(delay_us))
    if stats_dir is not None:
        Path(stats_dir).mkdir(parents=True, exist_ok=True)
        env[STATS_VAR] = str(stats_dir)
    if gbps is None:
        return env
    gbps = parse_gbps(gbps)
    if burst_kb is not None and not 1.0 <= float(burst_kb) <= 1048576.0:
        raise ValueError(f"{BURST_VAR} (burst_kb) must be 1 .. 1048576 KiB, got {burst_kb!r}")
    env[GBPS_VAR] = repr(float(gbps))
    if burst_kb is not None:
        env[BURST_VAR] = repr(float(burst_kb))
    return env


def read_stats(stats_dir: Path) -> List[dict]:
    """The shim's per-process counts written at exit (``link_<pid>.json``), largest sender first."""
    out = []
    for f in sorted(Path(stats_dir).glob("link_*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return sorted(out, key=lambda s: -s.get("bytes", 0))


def stats_summary(stats: Sequence[dict]) -> Optional[dict]:
    if not stats:
        return None
    return {"processes": len(stats), "bytes_max": max(s["bytes"] for s in stats),
            "bytes_total": sum(s["bytes"] for s in stats), "sleep_s_max": max(s["sleep_s"] for s in stats),
            "gbps": stats[0].get("gbps")}


def uncounted(row: dict) -> Optional[str]:
    """Why the shim's count on a shaped e2e ``row`` cannot have seen the run's traffic, or None when it can.

    Every byte a rank sends in this mode goes through a socket, so the busiest process's count must reach at least
    one step's ``wire_bytes_per_step`` (the run took several steps). A count below that means the ranks' sends
    went past the shim or their counts were not written (ranks that leave through ``os._exit`` skip the
    destructors: the shim writes from its ``_exit`` too since this check exists).
    """
    wire = sum(v for v in (row.get("wire_bytes_per_step") or {}).values() if isinstance(v, (int, float)))
    if not wire or row.get("status") != "ok":
        return None
    counted = (row.get("link_stats") or {}).get("bytes_max") or 0
    if counted >= wire:
        return None
    return (f"the link shim counted {counted} bytes in the busiest process, less than one step's {wire} bytes on "
            f"the wire: its count does not cover this run's traffic")


def settings_of(row: dict) -> tuple:
    """What a row's link was asked to be: (link_gbps, NCCL socket threads, sockets per thread, one-way delay us)."""
    return (row.get("link_gbps"), row.get("nccl_socket_nthreads"), row.get("nccl_nsocks_perthread"),
            row.get("link_delay_us"))


def unshaped(row: dict) -> bool:
    """No knob setting at all (NCCL's default sockets, no rate, no delay)."""
    return all(x is None for x in settings_of(row))


def measured_rate(row: dict, link_rows: Sequence[dict]) -> Optional[dict]:
    """The ok ``linkrate`` collective row measured with ``row``'s link settings on its machine, preferring the same
    number of ranks, then one of the same run (``e2e --probe-link``), then all-gather, then the one measured
    nearest in time to ``row`` (the loopback differs from call to call: a later call's rate must not stand in for
    the one an older row had; without times, the newest); None when there is none (then the requested rate is all
    we know)."""
    cands = [r for r in link_rows if r.get("status") == "ok" and r.get("measured_gbps")
             and r.get("kind") in ("nccl", "gloo") and settings_of(r) == settings_of(row)
             and r.get("machine") == row.get("machine")]
    if not cands:
        return None
    near = suite.closeness_in_time(row)
    return max(cands, key=lambda r: (r.get("ranks") == row.get("ranks"), r.get("run_id") == row.get("run_id"),
                                     r.get("op") == "all_gather", near(r)))


# ------------------------------------------------------------------------------------------- plain TCP

def _pattern(seed: int, n: int = 1 << 20) -> bytes:
    import random
    return random.Random(seed).randbytes(n)


def _sender(port: int, nbytes, seed, methods: str, verify) -> None:
    """Child side: stream ``nbytes`` of a seeded pattern, cycling through the interposed calls (arguments as
    given on the command line: numbers and ``verify`` "1" / "0" as strings)."""
    nbytes, seed, verify = int(nbytes), int(seed), verify in (True, "1")
    block = _pattern(seed)
    s = socket.create_connection(("127.0.0.1", port))
    h = hashlib.sha256()
    sent, i = 0, 0
    while sent < nbytes:
        n = min(len(block), nbytes - sent)
        off = (sent * 7) % (len(block) - n + 1)  # vary the slice so the pattern is not periodic per call
        data = block[off:off + n]
        how = methods[i % len(methods)]
        if how == "s":
            s.sendall(data)
        elif how == "w" or how == "v":
            view, done = memoryview(data), 0
            while done < n:
                if how == "w":
                    done += os.write(s.fileno(), view[done:])
                else:
                    third = max(1, (n - done) // 3)
                    done += os.writev(s.fileno(), [view[done:done + third], view[done + third:]])
        else:  # "m": sendmsg with three buffers
            view, done = memoryview(data), 0
            while done < n:
                a = max(1, (n - done) // 3)
                done += s.sendmsg([view[done:done + a], view[done + a:done + 2 * a], view[done + 2 * a:]])
        if verify:
            h.update(data)
        sent += n
        i += 1
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # wait until the receiver has everything
    s.close()
    try:
        import ctypes
        fn = ctypes.CDLL(None).sdp4bit_link_gbps
        fn.restype = ctypes.c_double
        shim = fn()
    except (AttributeError, OSError):
        shim = None  # the shim is not loaded in this process
    print(json.dumps({"sha256": h.hexdigest(), "bytes": sent, "shim_gbps": shim,
                      "shim_loaded": any("link_shim" in ln for ln in open("/proc/self/maps"))}), flush=True)


def _child_on_loopback(env: Dict[str, str], call: str, args: Sequence[str], serve, timeout: float, what: str) -> dict:
    """Run ``benchmarks.link.<call>(port, *args)`` in a child process under ``env`` against a loopback listener
    that ``serve(srv)`` (a thread of this process) handles; returns the child's last stdout line (JSON)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    full_env = dict(os.environ)
    full_env.update(env)
    pp = full_env.get("PYTHONPATH", "")
    full_env["PYTHONPATH"] = str(suite.REPO) + (os.pathsep + pp if pp else "")
    code = f"import sys; from benchmarks.link import {call}; {call}(int(sys.argv[1]), *sys.argv[2:])"
    child = subprocess.Popen([sys.executable, "-c", code, str(port)] + list(args), env=full_env, cwd=suite.REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    srv.settimeout(timeout)
    th = threading.Thread(target=serve, args=(srv,), daemon=True)
    th.start()
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    th.join(timeout=30)
    srv.close()
    if child.returncode != 0:
        raise RuntimeError(f"the {what} exited with {child.returncode}: {err.strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def tcp_transfer(env: Dict[str, str], nbytes: int, seed: int = 0, verify: bool = False, methods: str = "s",
                 timeout: float = 600.0) -> dict:
    """Stream ``nbytes`` from a child process (under ``env``) to this one over loopback TCP.

    Returns ``{"bytes", "seconds" (first to last byte at the receiver), "gbps", "sender": the child's report,
    "intact": sha256 equal (with ``verify``)}``.  ``methods``: the child's calls in turn, ``s`` send(all),
    ``w`` write, ``v`` writev, ``m`` sendmsg.
    """
    result: dict = {}

    def receive(srv):
        try:
            conn, _ = srv.accept()
        except OSError as e:
            result["error"] = f"no connection from the sender: {e}"
            return
        h = hashlib.sha256()
        buf = bytearray(4 << 20)
        got, t0, t1 = 0, None, None
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            t1 = time.perf_counter()
            if t0 is None:
                t0 = t1
            got += n
            if verify:
                h.update(memoryview(buf)[:n])
        conn.sendall(b"k")
        conn.close()
        result.update(bytes=got, seconds=(t1 - t0) if t0 is not None else 0.0,
                      sha256=h.hexdigest() if verify else None)

    sender = _child_on_loopback(env, "_sender", [str(nbytes), str(seed), methods, "1" if verify else "0"], receive,
                                timeout, "sender")
    if "error" in result:
        raise RuntimeError(result["error"])
    result["sender"] = sender
    result["gbps"] = result["bytes"] * 8 / result["seconds"] / 1e9 if result["seconds"] > 0 else None
    if verify:
        result["intact"] = result["sha256"] == sender["sha256"] and result["bytes"] == sender["bytes"] == nbytes
    return result


def _pinger(port: int, count) -> None:
    """Child side of :func:`tcp_rtt`: ``count`` one-byte round trips, their times in microseconds."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(int(count)):
        t0 = time.perf_counter()
        s.sendall(b"p")
        if s.recv(1) != b"p":
            raise SystemExit("tcp_rtt: the echo broke off")
        rtts.append((time.perf_counter() - t0) * 1e6)
    s.close()
    print(json.dumps({"rtt_us": rtts}), flush=True)


def tcp_rtt(env: Dict[str, str], count: int = 20, timeout: float = 120.0) -> dict:
    """Round trips of one byte between a child process (under ``env``, the side that sends first) and this one
    (not under the knob: the echo adds no delay) over loopback TCP with TCP_NODELAY.  Returns ``{"rtt_us":
    [...], "median_us", "min_us"}``: under a delay D the child's sends wait D, so a round trip takes D plus the
    loopback's own."""

    def echo(srv):
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            b = conn.recv(1)
            if not b:
                break
            conn.sendall(b)
        conn.close()

    rtts = _child_on_loopback(env, "_pinger", [str(count)], echo, timeout, "pinger")["rtt_us"]
    return {"rtt_us": rtts, "median_us": suite.median(rtts), "min_us": min(rtts)}


# ------------------------------------------------------------------------------------------- the question

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gbps", nargs="+", default=["off"], help="rates to measure, Gb/s per process ('off': unshaped)")
    p.add_argument("--mb", type=float, default=256.0, help="MiB per transfer (tcp) / per rank and collective")
    p.add_argument("--seconds", type=float, default=2.0,
                   help="at least this long per setting: the tcp transfer grows to rate x seconds")
    p.add_argument("--ranks", nargs="+", type=int, default=[2], help="ranks of the collective measurement")
    p.add_argument("--collective", action="store_true",
                   help="also time collectives between ranks (automatic on a GPU: share-GPU NCCL ranks)")
    p.add_argument("--ops", nargs="+", default=["all_gather", "all_to_all"], choices=["all_gather", "all_to_all"])
    p.add_argument("--nccl-sockets", nargs="+", default=["default"], metavar="TxS",
                   help="NCCL socket settings to measure: THREADSxSOCKETS (NCCL_SOCKET_NTHREADS x "
                        "NCCL_NSOCKS_PERTHREAD, e.g. 4x4) or 'default' (NCCL's own)")
    p.add_argument("--delay-us", default=None, metavar="D",
                   help="one-way delay in microseconds added to every setting (the shim's delay line); each tcp "
                        "setting also gets a round-trip row (op rtt)")
    p.add_argument("--cpu", action="store_true", help="collectives with gloo on CPU even on a GPU machine")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="JSON list the rows are merged into (default OUT/linkrate.json)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement before it is killed")
    p.add_argument("--deadline", type=float, default=None, help="seconds for the whole call")


def _row(meta: dict, gpu, **kw) -> dict:
    return dict({"run_id": meta["run_id"], "created": meta["created"], "commit": meta["commit"], "gpu": gpu,
                 "machine": suite.device_label(meta["machine"])}, **kw)


def measure_collectives(meta: dict, work: Path, cpu: bool, ranks: int, group: Sequence[Optional[float]],
                        threads: Optional[int], nsocks: Optional[int], mb: float, seconds: float,
                        ops: Sequence[str], timeout: float, deadline: "suite.Deadline",
                        delay_us: Optional[float] = None) -> List[dict]:
    """Rows of one process group of ``ranks`` ranks (share-GPU NCCL ranks on one GPU; gloo on CPU) running
    ``ops`` of ``mb`` MiB per rank at each rate of ``group`` (``[None]``: unshaped; else shaped rates, the
    shim's rate set in place between them), with the NCCL socket setting ``threads`` x ``nsocks`` and a one-way
    delay of ``delay_us`` (None: none)."""
    gpu = None if cpu else meta["machine"]["gpu_name"]
    run_id = meta["run_id"]
    rates = "off" if list(group) == [None] else "shaped_" + "-".join(label(g) for g in group)
    name = (f"{'gloo' if cpu else 'nccl'}_{ranks}r_{rates}_{f'{threads}x{nsocks}' if threads else 'default'}"
            + (f"_d{delay_us:g}us" if delay_us else ""))  # (one stats folder per setting: no stale counts)
    stats = work / f"{name}_stats"
    log_json = work / f"{name}.json"
    sargs = ["--out-json", str(log_json), "--mb", str(mb), "--seconds", str(seconds),
             "--ops"] + list(ops) + (["--cpu"] if cpu else [])
    if list(group) != [None]:
        sargs += ["--rates"] + [repr(g) for g in group]
    cmd, env = suite.launch_command(COLLECTIVE_SCRIPT, sargs, ranks, ranks, cpu)
    env.update(knob_env(group[0], stats, threads, nsocks, delay_us=delay_us))
    if deadline.left() < 45:
        rc, wall, res = "skipped", 0.0, {}
    else:
        rc, wall = suite.run_process(cmd, env, work / f"{name}.log", min(timeout, deadline.left() - 10))
        res = json.loads(log_json.read_text()) if log_json.is_file() else {}
    shim = stats_summary(read_stats(stats))
    rows = []
    for gbps, op in ((g, o) for g in group for o in ops):
        row = _row(meta, gpu, row_id=f"{run_id}/{name}_{label(gbps)}_{op}", kind="gloo" if cpu else "nccl",
                   op=op, ranks=ranks, link_gbps=gbps, nccl_socket_nthreads=threads,
                   nccl_nsocks_perthread=nsocks, link_delay_us=delay_us,
                   ranks_per_device=None if cpu else ranks, rc=rc,
                   wall_s=round(wall, 1), shim=shim,
                   command=" ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(cmd))
        m = ((res.get("by_rate") or {}).get(str(gbps)) or {}).get(op)
        if rc == "skipped":
            row.update(status="skipped", reason="the call's --deadline was reached")
        elif rc == 0 and m:
            row.update(status="ok" if m["intact"] else "failed", **m)
            if gbps is not None or delay_us:
                # the knob's own count must cover what the collectives sent: else they bypassed it
                row["shim_saw_traffic"] = bool(shim) and shim["bytes_max"] >= res["bytes_sent_all_ops"]
                if not row["shim_saw_traffic"]:
                    row.update(status="failed", error="the shim paced fewer bytes than the collectives "
                                                      "sent: this transport bypasses the knob")
        else:
            row.update(status="timeout" if rc == "timeout" else "failed",
                       error_tail=suite.log_tail(work / f"{name}.log"))
        print(f"[linkrate] {name} {label(gbps)} {op}: " + (
            f"{row['measured_gbps']:.2f} Gb/s per rank" if row.get("status") == "ok" else row["status"]),
            flush=True)
        rows.append(row)
    return rows


def run(args) -> int:
    try:
        rates = [parse_gbps(g, "--gbps") for g in args.gbps]
        sockets = [parse_sockets(s) for s in args.nccl_sockets]
        delay = parse_delay_us(args.delay_us, "--delay-us")
    except ValueError as e:
        raise SystemExit(f"linkrate: {e}")
    cpu = args.cpu or not suite.on_gpu()
    collective = args.collective or not cpu
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else out / "linkrate.json"
    run_id = suite.new_run_id("linkrate")
    meta = suite.run_meta("linkrate", run_id, args)
    gpu = None if cpu else meta["machine"]["gpu_name"]
    work = suite.work_dir(run_id)
    deadline = suite.Deadline(args.deadline)
    rows: List[dict] = []
    doc = {"meta": meta, "rows": rows}
    res_file = out / f"{run_id}.json"

    def keep(row: dict) -> None:
        rows.append(row)
        suite.write_json(res_file, doc)
        suite.merge_rows(results, [row])

    for gbps in rates:
        name = f"tcp_{label(gbps)}"
        stats = work / f"{name}_stats"
        nbytes = int(args.mb * 2 ** 20)
        if gbps is not None:
            nbytes = max(nbytes, min(int(gbps * 1e9 / 8 * args.seconds), 16 << 30))
        row = _row(meta, gpu, row_id=f"{run_id}/{name}", kind="tcp", op="stream", ranks=2, link_gbps=gbps,
                   nccl_socket_nthreads=None, nccl_nsocks_perthread=None, link_delay_us=delay,
                   bytes_per_rank=nbytes)
        if deadline.left() < 20:
            keep(dict(row, status="skipped", reason="the call's --deadline was reached"))
            continue
        try:
            r = tcp_transfer(knob_env(gbps, stats, delay_us=delay), nbytes, timeout=min(args.timeout, deadline.left()))
            row.update(status="ok", seconds=r["seconds"], measured_gbps=r["gbps"],
                       shim=stats_summary(read_stats(stats)))
        except RuntimeError as e:
            row.update(status="failed", error=str(e)[-2000:])
        print(f"[linkrate] {name}: " + (f"{row['measured_gbps']:.2f} Gb/s" if row.get("measured_gbps")
                                        else row["status"]), flush=True)
        keep(row)
        rrow = _row(meta, gpu, row_id=f"{run_id}/{name}_rtt", kind="tcp", op="rtt", ranks=2, link_gbps=gbps,
                    nccl_socket_nthreads=None, nccl_nsocks_perthread=None, link_delay_us=delay)
        try:  # one-byte round trips, the echo side not under the knob: the delay once plus loopback's own
            r = tcp_rtt(knob_env(gbps, delay_us=delay), 20, timeout=min(args.timeout, max(5.0, deadline.left())))
            rrow.update(status="ok", rtt_us_median=r["median_us"], rtt_us_min=r["min_us"])
        except RuntimeError as e:
            rrow.update(status="failed", error=str(e)[-2000:])
        print(f"[linkrate] {name} rtt: " + (f"{rrow['rtt_us_median']:.0f} us" if rrow.get("rtt_us_median")
                                            else rrow["status"]), flush=True)
        keep(rrow)

    if collective:
        # one process group for the unshaped setting, one for all shaped rates (the shim's rate is changed in
        # place between them: NCCL's start-up is paid once), per socket setting and rank count
        shaped = [g for g in rates if g is not None]
        groups = ([[None]] if None in rates else []) + ([shaped] if shaped else [])
        for (threads, nsocks), ranks, group in ((s_, r_, g_) for s_ in sockets for r_ in args.ranks
                                                for g_ in groups):
            for row in measure_collectives(meta, work, cpu, ranks, group, threads, nsocks, args.mb, args.seconds,
                                           args.ops, args.timeout, deadline, delay_us=delay):
                keep(row)
    suite.write_json(res_file, doc)
    suite.pack_logs(work, out / f"{run_id}_logs.tar.gz")
    print(f"[linkrate] results: {res_file}; rows merged into {results}", flush=True)
    return 0 if all(r.get("status") in ("ok", "skipped") for r in rows) else 1
