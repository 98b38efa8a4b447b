"""Run a function on N gloo (or NCCL) ranks in fresh processes (file store, no fixed ports).

Usage in a test::

    results = run_distributed(_worker, world_size=4, args=(1, 2))

``_worker(rank, world_size, *args)`` must be a module-level function.  Inside it torch.distributed is
initialized (gloo, WORLD = all ranks) and the usual launcher variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE) are set, with ``local_world_size`` ranks per logical host.  The return values come back
as a list by rank; an exception on any rank fails the call with that rank's traceback.

How the ranks start: every rank of every call is a new process that has run no test code.  A CPU session's gloo
ranks are forked from a server process (multiprocessing's forkserver, started once per session) that has
imported torch and DeepSpeed and nothing else: each rank then starts in well under a second instead of paying
those imports again (~10 s of CPU per rank, most of a 4-rank call on a 2-core machine).  deepspeed_sdp4bit is
not imported there (a rank imports it itself, after DeepSpeed, as test_traps' import-order trap needs), and a
rank takes the caller's environment as it is at the call, as a spawned one would.  Anything else (an ``env`` of
its own, NCCL, a session without ``DS_ACCELERATOR=cpu``, or an environment that changed since the server
imported DeepSpeed under it) is started with spawn: a new interpreter, as before.
"""

from __future__ import annotations

import importlib
import os
import pickle
import tempfile
import time
import traceback

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 600
TEARDOWN_S = 60   # how long a rank that has reported may take to leave

# what the forkserver imports once: torch (with the compiler front end that DeepSpeed's first optimizer pulls in)
# and DeepSpeed's engine; never deepspeed_sdp4bit
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "deepspeed",
            "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3", "pytest"]
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)   # pytest rewrites it for every test
_server_env = None   # the environment the forkserver imported under (None: not started by this process)


def _env_now():
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}


def _context(env, backend):
    """(multiprocessing context, the caller's environment for the ranks to take) for one call."""
    global _server_env
    if env or backend != "gloo" or os.environ.get("DS_ACCELERATOR") != "cpu" \
            or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn"), None
    if _server_env is None:
        # the same imports here first: what they do to the environment (DeepSpeed's import sets
        # PYTORCH_NVML_BASED_CUDA_CHECK) is then done before the server starts, not only in it
        for name in _PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
        _server_env = _env_now()
    elif _env_now() != _server_env:
        return mp.get_context("spawn"), None
    return mp.get_context("forkserver"), dict(os.environ)


def _take_env(parent_env):
    """A process forked from the forkserver takes the caller's environment, as a spawned one would have it."""
    if parent_env is not None:
        os.environ.clear()
        os.environ.update(parent_env)


def process_pool(workers: int):
    """A ``concurrent.futures.ProcessPoolExecutor`` of ``workers`` processes started as the gloo ranks are (forked
    from the server with the caller's environment where that applies, else spawned): single-process work of a
    test spread over the machine's cores (each task a module-level function, its exception the caller's)."""
    from concurrent.futures import ProcessPoolExecutor

    ctx, parent_env = _context(None, "gloo")
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_take_env, initargs=(parent_env,))


def _entry(rank, world_size, fn, args, store_path, out_dir, local_world_size, env, backend, parent_env=None):
    _take_env(parent_env)
    os.environ.update({k: v.replace("{rank}", str(rank)) for k, v in env.items()})
    os.environ.update({
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "LOCAL_SIZE": str(local_world_size),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    })
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = {"ok": True, "value": None}
    try:
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        result["value"] = _on_cpu(fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        result = {"ok": False, "error": traceback.format_exc()}
    # the result first (written whole, then renamed): a rank that hangs in the process group's teardown below,
    # as gloo rarely does, has still reported
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".part", path)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _on_cpu(value):
    """A rank's return value with every tensor in it moved to the CPU (an NCCL rank's CUDA tensors would come back
    on the caller's current GPU, beside CPU tensors of the same test)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_on_cpu(v) for v in value)
    return value


def run_distributed(fn, world_size: int, args=(), local_world_size: int = None, env=None,
                    timeout: float = DEFAULT_TIMEOUT_S, backend: str = "gloo"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend``; return the values by rank.

    ``env``: variables set in each rank before anything else, ``{rank}`` in a value replaced by the rank (e.g.
    ``NCCL_HOSTID="fakehost{rank}"``: NCCL ranks sharing one GPU, each its own host)."""
    local_world_size = local_world_size or world_size
    with tempfile.TemporaryDirectory(prefix="sdp4bit_dist_") as tmp:
        store = os.path.join(tmp, "store")
        ctx, parent_env = _context(env, backend)
        procs = [ctx.Process(target=_entry, args=(r, world_size, fn, args, store, tmp, local_world_size,
                                                  dict(env or {}), backend, parent_env))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        reported = lambda r: os.path.exists(os.path.join(tmp, f"rank{r}.pkl"))  # noqa: E731
        while time.monotonic() < deadline and not all(reported(r) or not p.is_alive() for r, p in enumerate(procs)):
            time.sleep(0.05)
        for p in procs:   # every rank reported or exited: a short wait for the teardown, then no more
            p.join(min(TEARDOWN_S, max(0.0, deadline - time.monotonic())))
        hung = [r for r, p in enumerate(procs) if p.is_alive() and not reported(r)]
        for p in procs:
            if p.is_alive():   # a rank that reported its result and hangs in teardown is not the test's failure
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout} s")
        results = []
        errors = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r} exited with code {procs[r].exitcode} and no result")
                continue
            with open(path, "rb") as f:
                res = pickle.load(f)
            if not res["ok"]:
                errors.append(f"rank {r} failed:\n{res['error']}")
            results.append(res.get("value"))
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
