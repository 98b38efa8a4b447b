"""The one module that touches DeepSpeed internals: SDP4Bit wired into DeepSpeed 0.19.x ZeRO stage 3.

``install()`` (run by ``import deepspeed_sdp4bit``) patches, once per process:

* ``deepspeed.initialize``: the ds_config (dict or path) goes through :func:`config.parse_ds_config` (a
  misspelt top-level ``"sdp4bits"``, stage != 3, ZeRO++ keys and offload are refused, naming the key), then
  :func:`plan_run` decides what runs: nothing at world size 1 or on one node (plain ZeRO-3, one log line
  why; ``engine.sdp4bit`` is None), an omitted ``weights.replica`` chosen by memory (:func:`choose_replica`).
  With an active ``"sdp4bit"`` block the config DeepSpeed sees is adjusted (hpZ size for ``replica="node"``,
  persistence thresholds for ``replica="full"``) and the returned engine gets an :class:`SDP4BitState`
  attached to its stage-3 optimizer (``engine.sdp4bit``, ``engine.sdp4bit_summary()``).
* a handful of ``DeepSpeedZeroOptimizer_Stage3`` methods.  Every patched method first looks for the state of
  *its own* optimizer instance (``self._sdp4bit``) and runs DeepSpeed's original code when there is none, so
  plain ZeRO-3 engines in the same process are untouched and two SDP4Bit engines never share state.

What is replaced, and why (details at each patch):

gradients   ``__avg_scatter_grads`` / ``__avg_scatter_contiguous_grads``: DeepSpeed reduce-scatters each
            bucket of full gradients with ``reduce_scatter_coalesced`` (or all-reduces the contiguous bucket);
            we send the whole bucket through ONE :class:`GradientReducer.reduce_scatter` (TLq-HS) with the
            same layout and the same pre/post scaling and dtype casts.
weights     ``_reassign_or_swap_out_partitioned_parameters``: DeepSpeed copies the fp32 master partition into
            the bf16 partition after each sub-group's optimizer step; we run :meth:`WeightDeltaAllGather.
            refresh` instead, which makes the bf16 partition the *owner's replica value* (not bf16(master))
            and updates every rank's persistent replica with 4-bit weight differences.
            ``replica="node"``: the replica is DeepSpeed's hpZ secondary tensor (``zero_hpz_partition_size =
            gpus_per_node``), created up front and never invalidated (``invalidate_secondary_tensor``), so the
            forward/backward gathers only run inside a node.  ``replica="full"``: every parameter is
            persistent and its full data lives in a buffer we own; ``_post_step`` re-points ``param.data`` at
            it instead of all-gathering.
            Invariant: every replica copy of a partition is bit-identical to the owner's bf16 partition, so
            anything DeepSpeed still gathers from primary partitions (a param whose secondary was dropped,
            persistent params at node level) gets the same values.
overflow    a quantized reduce-scatter need not carry an inf to the owner, so a non-finite local gradient is
            flagged before quantization (every dtype).  fp16 (``has_overflow``): OR-ed into DeepSpeed's overflow
            tracker, which DeepSpeed all-reduces.  bf16/fp32 (``step``): DeepSpeed skips a step whose global
            gradient norm is not finite, so the flagged rank puts a NaN into its gradient partition before the
            norm is taken.  Either way the step is skipped on every rank, as plain ZeRO-3 skips it, and nothing
            is refreshed.
gathers     ``GatheredParameters.__exit__``: full-level params are pointed back at their replica views
            instead of being left for the next forward to gather a second copy (after a ``modifier_rank``
            write, every replica is first re-synchronised from the owners' partitions).
checkpoints ``state_dict`` / ``_rigid_load_state_dict`` carry the bf16 replica partitions and our step
            counter; ``checkpoint_event_epilogue`` re-synchronises every replica exactly (``full_sync``)
            after a save or a load, so a resumed run continues like an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import logging
import os
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from .config import (BLOCK_KEY, SDP4BitConfig, SDP4BitConfigError, ds_int, hpz_size, parse_ds_config,
                     validate_against_ds_config)
from .topology import Topology, job_gpus_per_node, launcher_ranks_per_host

logger = logging.getLogger("deepspeed_sdp4bit")

SUPPORTED_DEEPSPEED = "0.19."
_STATE_ATTR = "_sdp4bit"          # on the stage-3 optimizer instance
_CKPT_KEY = "sdp4bit"             # our entry in the optimizer state dict
_INSTALLED = False
_ORIG: Dict[str, Any] = {}
_FULL_REPLICAS: "weakref.WeakSet[_Replica]" = weakref.WeakSet()   # live full replicas (GatheredParameters)


# ----------------------------------------------------------------------------------------------------------
# version check and installation
# ----------------------------------------------------------------------------------------------------------
def check_deepspeed_version(version: Optional[str] = None) -> str:
    """Raise ImportError unless ``version`` (default: the installed DeepSpeed's) is 0.19.x; return it.

    The patches below replace private methods of ``DeepSpeedZeroOptimizer_Stage3`` whose bodies we mirror;
    another DeepSpeed release may have changed them, and silently training with a half-applied patch would
    be far worse than refusing.
    """
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    if not str(version).startswith(SUPPORTED_DEEPSPEED):
        raise ImportError(f"deepspeed_sdp4bit supports DeepSpeed {SUPPORTED_DEEPSPEED}x only (it patches "
                          f"private ZeRO-3 internals), but DeepSpeed {version} is installed")
    return str(version)


def install() -> bool:
    """Install the hooks (idempotent).  Returns True when DeepSpeed is present and hooked.

    Raises ImportError for an unsupported DeepSpeed version.  Without DeepSpeed installed nothing is hooked
    (the kernels and collectives remain usable on their own) and a warning says so.
    """
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - DeepSpeed is a dependency in this project's environment
        warnings.warn(f"deepspeed_sdp4bit: DeepSpeed is not importable ({e}); the deepspeed.initialize hook "
                      f"is not installed")
        return False
    check_deepspeed_version()
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S3

    if not getattr(deepspeed.initialize, "_sdp4bit_wrapped", False):
        _ORIG["initialize"] = deepspeed.initialize
        deepspeed.initialize = _marking_build(_make_initialize(deepspeed.initialize))
    from deepspeed.runtime.zero.partition_parameters import Init

    if not getattr(Init.__init__, "_sdp4bit_wrapped", False):
        _ORIG["Init.__init__"] = Init.__init__
        Init.__init__ = _make_zero_init(Init.__init__)
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    if not getattr(GatheredParameters.__exit__, "_sdp4bit_wrapped", False):
        _ORIG["GatheredParameters.__exit__"] = GatheredParameters.__exit__
        GatheredParameters.__exit__ = _make_gathered_exit(GatheredParameters.__exit__)
    if not getattr(GatheredParameters.__enter__, "_sdp4bit_wrapped", False):
        _ORIG["GatheredParameters.__enter__"] = GatheredParameters.__enter__
        GatheredParameters.__enter__ = _make_gathered_enter(GatheredParameters.__enter__)

    patches = {
        "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads": _avg_scatter_grads,
        "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads": _avg_scatter_contiguous_grads,
        "_reassign_or_swap_out_partitioned_parameters": _reassign_or_swap_out_partitioned_parameters,
        "_post_step": _post_step,
        "invalidate_secondary_tensor": _invalidate_secondary_tensor,
        "has_overflow": _has_overflow,
        "step": _step,
        "state_dict": _state_dict,
        "_rigid_load_state_dict": _rigid_load_state_dict,
        "checkpoint_event_prologue": _waiting_first,
        "checkpoint_event_epilogue": _checkpoint_event_epilogue,
        "refresh_fp32_params": _waiting_first,
        "_restore_from_bit16_weights": _waiting_first,
        "empty_partition_cache": _empty_partition_cache,
    }
    for name, factory in patches.items():
        orig = S3.__dict__.get(name)
        if orig is None:
            raise ImportError(f"deepspeed_sdp4bit: DeepSpeedZeroOptimizer_Stage3.{name} not found in DeepSpeed "
                              f"{deepspeed.__version__}; the integration does not match this release")
        if getattr(orig, "_sdp4bit_wrapped", False):
            continue
        _ORIG[name] = orig
        wrapped = factory(orig)
        wrapped._sdp4bit_wrapped = True
        setattr(S3, name, wrapped)
    _install_engine_checks()
    _INSTALLED = True
    return True


def get_state(optimizer) -> Optional["SDP4BitState"]:
    """The :class:`SDP4BitState` attached to a stage-3 optimizer (or an engine), or None."""
    for obj in (optimizer, getattr(optimizer, "optimizer", None)):
        st = getattr(obj, _STATE_ATTR, None)
        if st is not None:
            return st
    return None


# ----------------------------------------------------------------------------------------------------------
# deepspeed.initialize
# ----------------------------------------------------------------------------------------------------------
def _load_config(config) -> Dict[str, Any]:
    if isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


@dataclasses.dataclass
class RunPlan:
    """What SDP4Bit does in one run, decided before DeepSpeed builds anything (:func:`plan_run`).

    Attributes:
        ds_config: the config DeepSpeed should see (the caller's dict when SDP4Bit is off or inactive).
        cfg: the block with every automatic choice made (``weights.replica`` filled in; ``enabled=False``
            when SDP4Bit is off for this run, ``weights.enabled=False`` when only the weights are).
        off_reason: why SDP4Bit is off although the block asks for it, else None.
        notes: one line per automatic choice or per part turned off, for the log.
    """

    ds_config: Dict[str, Any]
    cfg: SDP4BitConfig
    off_reason: Optional[str] = None
    notes: List[str] = dataclasses.field(default_factory=list)


def choose_replica(gpus_per_node: int, n_params: Optional[int], budget: float, device_bytes: Optional[int],
                   hpz: int = 1) -> Tuple[Optional[str], str]:
    """The replica level for an omitted ``weights.replica``: (``"full"``, ``"node"`` or None = no replica
    fits, so the weights go uncompressed), and why.

    ``full`` when the model's bf16 copy (2 bytes per parameter) fits ``budget`` of one accelerator's memory,
    ``node`` otherwise.  An explicit ``zero_hpz_partition_size > 1`` asks for the node layout.  With one rank
    per node the node replica would be the whole model too, so only ``full`` (or nothing) is left.  Under
    ``deepspeed.zero.Init`` the size is not known when parameters are partitioned (``n_params=None``): then
    ``node`` (``full`` with one rank per node), the same answer in ``zero.Init`` and ``deepspeed.initialize``.
    """
    if hpz > 1:
        return "node", f"zero_optimization.zero_hpz_partition_size={hpz} asks for per-node copies"
    if n_params is None or not device_bytes:
        what = ("the model size is not known: under deepspeed.zero.Init, as transformers builds a model for a "
                "ZeRO-3 Trainer, parameters are partitioned while they are created (the linter: --params)"
                if n_params is None else "the accelerator's memory is not known (the linter: --device-memory-gb)")
        if gpus_per_node == 1:
            return "full", f"one rank per node, where a per-node copy is the whole model; {what}"
        return "node", what
    need, allowed = 2 * int(n_params), budget * int(device_bytes)
    fits = need <= allowed
    copy = f"{need / 2**30:.2f} GiB" if need >= 2**28 else f"{need / 2**20:.1f} MiB"   # (a small model: MiB)
    why = (f"bf16 copy {copy} {'<=' if fits else '>'} {budget:g} x {int(device_bytes) / 2**30:.1f} "
           f"GiB of one accelerator's memory (the smallest over the ranks; host RAM under DeepSpeed's CPU "
           f"accelerator; weights.full_replica_budget)")
    if fits:
        return "full", why
    return ("node" if gpus_per_node > 1 else None), why


def plan_run(ds_config: Dict[str, Any], world_size: int, n_params: Optional[int] = None,
             device_bytes: Optional[int] = None) -> RunPlan:
    """Validate a ds_config dict and decide what SDP4Bit does in a run of ``world_size`` data-parallel ranks.

    Nothing to send, nothing done: with one rank, or one node without ``quantize_single_node``, SDP4Bit is
    off and DeepSpeed gets the caller's config untouched (plain ZeRO-3, bit for bit).  A node replica on one
    node would be each rank's own partition: the weights are then left to ZeRO-3.

    With an active block the returned config is a deep copy with:
    * ``replica="node"`` (several nodes of several ranks): ``zero_hpz_partition_size = gpus_per_node``
      (DeepSpeed's secondary partition is our node replica); a different explicit value is refused.
    * ``replica="full"``: ``stage3_param_persistence_threshold`` / ``stage3_model_persistence_threshold``
      raised so that every parameter is persistent (kept whole on every rank); explicit smaller values are
      overridden with a warning (they are performance knobs; the replica must hold everything).
    ``n_params`` / ``device_bytes`` size an omitted ``weights.replica`` (:func:`choose_replica`).
    Raises SDP4BitConfigError / NotImplementedError naming the offending key.
    """
    cfg = parse_ds_config(ds_config)
    if not cfg.active:
        return RunPlan(ds_config, cfg)
    off = cfg.model_copy(update={"enabled": False})
    if world_size == 1:
        # before the topology: a single process needs no LOCAL_WORLD_SIZE, and a cluster's gpus_per_node holds
        return RunPlan(ds_config, off, "world size 1: there is nothing to send")
    try:   # (a node larger than the job: every rank on one node)
        gpn = job_gpus_per_node(cfg.topology.gpus_per_node, world_size)
    except ValueError as e:
        raise SDP4BitConfigError(str(e)) from None
    nodes = world_size // gpn
    if nodes == 1 and not cfg.quantize_single_node:
        return RunPlan(ds_config, off, f"one node of {gpn} ranks: no inter-node link to save, and inside a node "
                                       f"ZeRO-3's bf16 collectives are faster than quantized ones; set "
                                       f"sdp4bit.quantize_single_node=true to quantize them anyway, or a smaller "
                                       f"sdp4bit.topology.gpus_per_node to run the host as several logical nodes")
    ds = copy.deepcopy(ds_config)
    zero = ds.setdefault("zero_optimization", {})
    if ds_int(ds.get("sequence_parallel_size"), 1) > 1:
        raise NotImplementedError("sdp4bit does not support sequence_parallel_size > 1 yet")
    for key in ("zenflow", "super_offload"):
        if zero.get(key):
            raise SDP4BitConfigError(f"zero_optimization.{key} cannot be combined with sdp4bit")
    notes: List[str] = []
    hpz = hpz_size(ds)
    w = cfg.weights
    if w.enabled and w.replica is None:
        replica, why = choose_replica(gpn, n_params, w.full_replica_budget, device_bytes, hpz)
        if replica is None:
            w = w.model_copy(update={"enabled": False})
            notes.append(f"weights: uncompressed (no replica fits: {why}; one rank per node leaves no smaller "
                         f"one); set sdp4bit.weights.replica to force one")
        else:
            w = w.model_copy(update={"replica": replica})
            notes.append(f"weights: replica {replica!r} ({why}); set sdp4bit.weights.replica to choose")
    if w.enabled and w.replica == "node" and nodes == 1:
        w = w.model_copy(update={"enabled": False})
        notes.append("weights: left to ZeRO-3 (a node replica on one node is each rank's own partition: there is "
                     "no copy to refresh)")
    if w.enabled and w.overlap is True and w.replica == "node":
        notes.append("weights.overlap: applies to the full replica only; the node replica's refresh runs inside "
                     "step(), not overlapped")
    cfg = cfg.model_copy(update={"weights": w})
    if not cfg.active:
        return RunPlan(ds_config, cfg.model_copy(update={"enabled": False}), "; ".join(notes), notes)
    g = cfg.gradients
    if g.enabled and g.inter8_steps and nodes > 1:
        notes.append(f"gradients: the inter-node level at 8 bits for the first {g.inter8_steps} optimizer steps, then "
                     f"{g.inter_bits} (gradients.inter8_steps)")
    validate_against_ds_config(cfg, ds_config)
    # The block DeepSpeed sees says what was decided here, so planning that config again gives the same run:
    # DeepSpeed's engine partitions the model through deepspeed.zero.Init with this very config, and our
    # zero.Init wrapper plans it without the model size; an omitted replica chosen "full" here would be
    # planned "node" there (hpZ secondary partitions nobody refreshes, stale after a checkpoint load).
    given = (ds_config.get(BLOCK_KEY) or {}).get("weights") or {}
    if given.get("replica") != w.replica or given.get("enabled", True) != w.enabled:
        block = ds.setdefault(BLOCK_KEY, {})
        block["weights"] = dict(block.get("weights") or {}, enabled=w.enabled,
                                **({"replica": w.replica} if w.replica is not None else {}))
    if w.enabled and w.replica == "node":
        if gpn == 1:
            raise NotImplementedError(
                "sdp4bit.weights.replica='node' with one rank per node keeps the whole model on every rank: "
                "use sdp4bit.weights.replica='full' for that layout")
        if hpz not in (1, gpn):
            raise SDP4BitConfigError(
                f"zero_optimization.zero_hpz_partition_size={hpz} must equal the ranks per node "
                f"({gpn}, sdp4bit.topology.gpus_per_node) for sdp4bit.weights.replica='node'; "
                f"remove it and sdp4bit sets it")
        zero["zero_hpz_partition_size"] = gpn
    elif w.enabled:
        big = 1 << 62
        for key in ("stage3_param_persistence_threshold", "stage3_model_persistence_threshold"):
            alias = key[len("stage3_"):]
            for k in (key, alias):
                # (an HF "auto" there, filled by transformers only later, is replaced as well)
                if k in zero and isinstance(zero[k], int) and not isinstance(zero[k], bool) and zero[k] < big:
                    warnings.warn(f"sdp4bit.weights.replica='full' keeps every parameter whole on every "
                                  f"rank: overriding zero_optimization.{k}={zero[k]}")
                zero.pop(k, None)
            zero[key] = big
        if w.overlap is True:   # (omitted: decided in attach, choose_overlap)
            _unsynchronize_throughput_timer(ds, notes)
    return RunPlan(ds, cfg, None, notes)


def _throughput_timer_block(ds: Dict[str, Any]) -> Dict[str, Any]:
    """The ds_config's own ``timers.throughput`` block as the user wrote it ({} where absent or not a dict): what
    the user set there (e.g. ``synchronized``) is theirs, what is absent is DeepSpeed's default."""
    timers = ds.get("timers")
    tp = timers.get("throughput") if isinstance(timers, dict) else None
    return tp if isinstance(tp, dict) else {}


def user_synchronized_timer(ds: Dict[str, Any]) -> bool:
    """Whether the ds_config itself asks DeepSpeed's throughput timer to synchronize the device (its
    ``timers.throughput.synchronized`` given and true, the timer enabled), as DeepSpeed reads the block: that
    waits for the whole device at every step's end, so the weight refresh cannot overlap (refused with
    ``weights.overlap: true``; the automatic choice stays off, unprobed).  False where DeepSpeed would refuse the
    block itself (it says so when the engine reads it)."""
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig   # (how DeepSpeed reads the block)
    tp = _throughput_timer_block(ds)
    try:
        read = DeepSpeedThroughputTimerConfig(**tp)
    except Exception:
        return False
    return bool(read.enabled and "synchronized" in tp and read.synchronized)


def _unsynchronize_throughput_timer(ds: Dict[str, Any], notes: List[str]) -> None:
    """``weights.overlap``: DeepSpeed's throughput timer (``timers.throughput``, on and synchronized by default)
    synchronizes the whole device when ``step()`` ends and when a forward starts, which would wait for the
    refresh left in flight on its side stream every step; set it unsynchronized (CPU clock) where the key is
    omitted, refuse an explicit ``true``."""
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig   # (how DeepSpeed reads the block)
    timers, tp = ds.get("timers"), _throughput_timer_block(ds)
    try:
        read = DeepSpeedThroughputTimerConfig(**tp)
    except Exception:   # DeepSpeed refuses the block itself, naming it, when the engine reads it
        return
    if not read.enabled:
        return
    if user_synchronized_timer(ds):
        raise SDP4BitConfigError(
            "sdp4bit.weights.overlap leaves the weight refresh in flight when step() returns, but "
            f"timers.throughput.synchronized={json.dumps(tp['synchronized'])} makes DeepSpeed wait for the whole "
            "device at the end of every step: remove that key (sdp4bit sets it to false) or set weights.overlap to "
            "false")
    if "synchronized" not in tp:
        ds["timers"] = dict(timers if isinstance(timers, dict) else {}, throughput=dict(tp, synchronized=False))
        notes.append("weights.overlap: timers.throughput.synchronized set to false (DeepSpeed's throughput timer "
                     "would wait for the whole device, the refresh included, at the end of every step)")


def prepare_ds_config(ds_config: Dict[str, Any], world_size: int, n_params: Optional[int] = None,
                      device_bytes: Optional[int] = None) -> Tuple[Dict[str, Any], SDP4BitConfig]:
    """``(config DeepSpeed should see, resolved sdp4bit block)`` of :func:`plan_run`."""
    plan = plan_run(ds_config, world_size, n_params, device_bytes)
    return plan.ds_config, plan.cfg


def _say(msg: str) -> None:
    """One line on data-parallel rank 0 (every rank takes the same decisions)."""
    import torch.distributed as tdist

    if not tdist.is_initialized() or tdist.get_rank() == 0:
        logger.warning("sdp4bit: %s", msg)


_SIZE_ATTR = "_sdp4bit_n_params"


def _model_size(model) -> Optional[int]:
    """Parameter count the replica level of ``model``'s engine is chosen from (:func:`choose_replica`).

    A model not yet partitioned: its count, remembered on the module, because an engine partitions it and a
    later engine of the same module (the HF Trainer's optimizer-less evaluate() engine, then train()'s) must
    choose what the first one partitioned for.  A model partitioned by ``deepspeed.zero.Init`` (no count
    remembered): None, as zero.Init chose without the size.
    """
    if model is None:
        return None
    if _partitioned(model):
        return getattr(model, _SIZE_ATTR, None)
    n = sum(p.numel() for p in model.parameters())
    setattr(model, _SIZE_ATTR, n)
    return n


def _partitioned(model) -> bool:
    """Whether ``deepspeed.zero.Init`` (or an earlier engine) partitioned ``model``'s parameters."""
    return model is not None and any(hasattr(p, "ds_id") for p in model.parameters())


def _collective_device() -> str:
    """Where a small tensor for a collective before DeepSpeed has set this rank's device goes: the CPU under
    gloo, else this rank's own accelerator (``LOCAL_RANK``, as DeepSpeed picks it; the current one where unset):
    with every rank of a host on the current device, NCCL would see one GPU shared by all of them."""
    import torch.distributed as tdist
    from deepspeed.accelerator import get_accelerator

    if tdist.get_backend() == "gloo":
        return "cpu"
    acc = get_accelerator()
    local = os.environ.get("LOCAL_RANK")
    return acc.device_name(int(local)) if local is not None and local.strip().isdigit() else acc.current_device_name()


def _check_hosts_agree(cfg: SDP4BitConfig) -> None:
    """With ``topology.gpus_per_node`` omitted every rank reads its own host's ``LOCAL_WORLD_SIZE``: ranks of
    hosts with different counts would plan different layouts and hang creating their process groups (or one
    would raise while the others wait).  Compared over the world first (collective: every rank calls it with
    the same config), so every rank raises the same error."""
    import torch.distributed as tdist

    if not (cfg.active and cfg.topology.gpus_per_node is None and tdist.is_initialized()
            and tdist.get_world_size() > 1):
        return
    mine = launcher_ranks_per_host()
    mine = -1 if mine is None else mine
    t = torch.tensor([mine, -mine], dtype=torch.int64, device=_collective_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    hi, lo = int(t[0].item()), -int(t[1].item())
    if hi != lo:
        seen = "not set on some hosts" if lo < 0 else f"from {lo} to {hi}"
        raise SDP4BitConfigError(
            f"sdp4bit.topology.gpus_per_node is omitted (= the launcher's ranks per host, LOCAL_WORLD_SIZE), but "
            f"the ranks per host differ between hosts ({seen}): set sdp4bit.topology.gpus_per_node to the "
            f"number of ranks of one node, the same on every host")


def _device_bytes() -> Optional[int]:
    """One accelerator's memory, the smallest over the ranks (every rank must choose the same replica), or
    None when some accelerator cannot say."""
    import torch.distributed as tdist
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    try:
        mine = int(acc.total_memory())
    except Exception:  # noqa: BLE001 - an accelerator that cannot say: the replica is chosen without it
        mine = -1
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        t = torch.tensor([mine], dtype=torch.int64, device=_collective_device())
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
        mine = int(t.item())
    return mine if mine > 0 else None


def _off_without_optimizer(engine) -> None:
    """An engine without an optimizer: nothing to reduce or refresh, SDP4Bit off (said once, recorded)."""
    reason = "no optimizer in this engine: nothing to reduce or refresh"
    _say(f"off, the engine runs as plain ZeRO-3 ({reason})")
    _mark_off(engine, reason)


def _mark_off(engine, reason: str) -> None:
    """SDP4Bit off for this engine: plain ZeRO-3, with the reason reachable where users look for the state."""
    engine.sdp4bit = None
    engine.sdp4bit_summary = lambda: {"active": False, "reason": reason}


def _make_initialize(orig_initialize):
    sig = inspect.signature(orig_initialize)

    @functools.wraps(orig_initialize)
    def initialize(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        a = bound.arguments
        cli_args = a.get("args")
        config = a.get("config")
        if config is None and a.get("config_params") is not None:
            config = a.get("config_params")  # kept: the no-sdp4bit path passes the call on unchanged
        from_cli = config is None and getattr(cli_args, "deepspeed_config", None) is not None
        if from_cli:
            config = cli_args.deepspeed_config
        if config is None:
            return orig_initialize(*bound.args, **bound.kwargs)
        ds_config = _load_config(config)
        # Validate before DeepSpeed does anything (a misspelt key must fail fast, on every rank alike).
        requested = parse_ds_config(ds_config)
        import deepspeed.comm as ds_dist
        from deepspeed.accelerator import get_accelerator

        # DeepSpeed would initialize torch.distributed itself a few lines later; doing it first (same
        # arguments, idempotent) lets us size the topology before the config is handed over.
        init_kwargs = {"dist_backend": get_accelerator().communication_backend_name()}
        if "distributed_port" in a:
            init_kwargs["distributed_port"] = a["distributed_port"]
        if "dist_init_required" in a:
            init_kwargs["dist_init_required"] = a["dist_init_required"]
        ds_dist.init_distributed(**init_kwargs)
        import torch.distributed as tdist

        _check_hosts_agree(requested)
        # the memory (a collective over the ranks) only where an omitted replica will be chosen from it
        sized = (requested.active and requested.weights.enabled and requested.weights.replica is None
                 and tdist.get_world_size() > 1)
        plan = plan_run(ds_config, tdist.get_world_size(), n_params=_model_size(a.get("model")),
                        device_bytes=_device_bytes() if sized else None)
        new_config, cfg = plan.ds_config, plan.cfg
        for line in plan.notes if plan.off_reason is None else []:
            _say(line)
        if not cfg.active:
            # plain configs are DeepSpeed's business, untouched, but for an hpZ group SDP4Bit made DeepSpeed build
            if plan.off_reason is not None or _caused_hpz_cached():
                _prepare_hpz_group(ds_config)
            result = orig_initialize(*bound.args, **bound.kwargs)
            if plan.off_reason is not None:
                _say(f"off, training is plain ZeRO-3 ({plan.off_reason})")
                _mark_off(result[0], plan.off_reason)
            return result

        def hand_over(config_for_ds: Dict[str, Any]):
            """DeepSpeed's initialize with ``config_for_ds`` in place of the user's config (file or dict)."""
            if from_cli:
                a["args"] = copy.copy(cli_args)
                a["args"].deepspeed_config = None
            a["config"] = config_for_ds
            _prepare_hpz_group(config_for_ds)
            out = orig_initialize(*bound.args, **bound.kwargs)
            _note_caused_hpz(ds_config, config_for_ds)
            return out

        if a.get("optimizer") is None and not ds_config.get("optimizer") and not _partitioned(a.get("model")):
            # no optimizer (a forward-only engine, e.g. a reference model) and a model zero.Init did not
            # partition: SDP4Bit would be off (below), so DeepSpeed gets the user's config without the block:
            # plain ZeRO-3 (prepared, DeepSpeed 0.19.8 builds such an engine's hpZ group with a method only its
            # stage-3 optimizer has; with the block, the zero.Init DeepSpeed runs inside would prepare it again)
            result = hand_over({k: v for k, v in ds_config.items() if k != BLOCK_KEY})
            _off_without_optimizer(result[0])
            return result
        mpu = a.get("mpu")
        if mpu is not None and mpu.get_data_parallel_world_size() != tdist.get_world_size():
            raise NotImplementedError(
                f"sdp4bit needs the data-parallel group to be the whole world; the mpu gives "
                f"{mpu.get_data_parallel_world_size()} of {tdist.get_world_size()} ranks (model parallelism "
                f"together with sdp4bit is not supported yet)")
        model = a.get("model")
        from deepspeed.pipe import PipelineModule

        if isinstance(model, PipelineModule):
            raise NotImplementedError("sdp4bit does not support pipeline parallelism (PipelineModule) yet")
        result = hand_over(new_config)
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

        if isinstance(getattr(result[0], "optimizer", None), DeepSpeedZeRoOffload):
            # no optimizer (an inference engine, e.g. the HF Trainer's evaluate() before any training): no
            # gradients to reduce, no step to refresh; the config stays prepared (hpZ as zero.Init partitioned)
            _off_without_optimizer(result[0])
            return result
        attach(result[0], cfg)
        return result

    initialize._sdp4bit_wrapped = True
    return initialize


def _make_zero_init(orig_init):
    """``deepspeed.zero.Init`` partitions parameters as its config says; with an sdp4bit block, give it the
    config ``deepspeed.initialize`` will see (hpZ = gpus_per_node for node replicas, persistence for full ones),
    so a model built under ``zero.Init(config_dict_or_path=ds_config)`` matches the engine without the user
    preparing the config by hand."""
    sig = inspect.signature(orig_init)

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        a = bound.arguments
        key = "config_dict_or_path" if a.get("config_dict_or_path") is not None else "config"
        config = a.get(key)
        if config is not None and a.get("enabled", True):
            ds_config = _load_config(config)
            requested = parse_ds_config(ds_config)
            if requested.active:
                import deepspeed.comm as ds_dist
                import torch.distributed as tdist

                ds_dist.init_distributed()
                _check_hosts_agree(requested)
                # The model does not exist yet: an omitted replica is chosen without its size, as
                # deepspeed.initialize will do for a model partitioned here (choose_replica).
                new_config, _ = prepare_ds_config(ds_config, tdist.get_world_size())
                a[key] = new_config
                _prepare_hpz_group(new_config)
                # zero.Init creates DeepSpeed's hpZ group unconditionally and asserts when an earlier engine
                # of this process already made it: hand it the cached group (of the right size) instead.
                from deepspeed.utils import groups

                cached = groups._get_zero_param_intra_parallel_group()
                if cached is not None and a.get("zero_param_parallel_group") is None:
                    a["zero_param_parallel_group"] = cached
                out = orig_init(*bound.args, **bound.kwargs)
                _note_caused_hpz(ds_config, new_config)
                return out
        return orig_init(*bound.args, **bound.kwargs)

    __init__._sdp4bit_wrapped = True
    return __init__


def _replicas_holding(ctx) -> List["_Replica"]:
    """The live full replicas that hold some parameter of a ``GatheredParameters`` context."""
    if not (getattr(ctx, "enabled", True) and _FULL_REPLICAS):
        return []
    ids = {id(p) for p in getattr(ctx, "params", ())}
    return [rep for rep in list(_FULL_REPLICAS) if any(i in rep for i in ids)]


def _make_gathered_enter(orig_enter):
    """Inside ``deepspeed.zero.GatheredParameters`` the full-replica parameters are read (or written) directly:
    wait for a refresh still in flight (``weights.overlap``) first."""

    @functools.wraps(orig_enter)
    def __enter__(self):
        for rep in _replicas_holding(self):
            rep.wait()
        return orig_enter(self)

    __enter__._sdp4bit_wrapped = True
    return __enter__


def _make_gathered_exit(orig_exit):
    """``deepspeed.zero.GatheredParameters`` partitions its parameters on exit, which would leave full-replica
    parameters empty (the next forward would gather a second copy of them): point them at their replica
    again.  With ``modifier_rank`` DeepSpeed broadcasts each parameter's data from that rank into every rank's
    data and partitions from it.  Where the data is the replica view, a change made in place reaches every
    replica and owner alike.  Only where a rank's data is another tensor (``p.data = ...``, or DeepSpeed's
    gather into a fresh buffer after a checkpoint prologue partitioned everything) whose values differ from
    the replica's is every replica re-synchronised from the owners (DeepSpeed's 16-bit save gathers each
    module with ``modifier_rank=0`` and changes nothing: a resync there cost a whole-model exchange per
    module)."""

    @functools.wraps(orig_exit)
    def __exit__(self, *exc):
        reps = _replicas_holding(self)
        params = list(getattr(self, "params", ()))
        broadcast = getattr(self, "src_rank", None) is not None
        changed = [rep.changed_elsewhere(params) if broadcast else False for rep in reps]   # (before the exit)
        result = orig_exit(self, *exc)
        for rep, modified in zip(reps, changed):
            rep.after_gathered(modified=modified)
        return result

    __exit__._sdp4bit_wrapped = True
    return __exit__


_CAUSED_HPZ = [None]   # the hpZ group DeepSpeed built for a config SDP4Bit prepared, where the user's asked for none


def _note_caused_hpz(user_config: Dict[str, Any], prepared: Dict[str, Any]) -> None:
    """After DeepSpeed built an engine or a zero.Init from ``prepared``: remember its hpZ group if SDP4Bit asked
    for it (the node replica) and the user did not."""
    from deepspeed.utils import groups

    if hpz_size(prepared) > 1 and hpz_size(user_config) <= 1:
        _CAUSED_HPZ[0] = groups._get_zero_param_intra_parallel_group()


def _caused_hpz_cached() -> bool:
    """Whether DeepSpeed's cached hpZ group is one SDP4Bit caused: a later plain engine must not adopt it (its
    parameters would get hpZ copies the user never asked for, with DeepSpeed's stale-copy resume of frozen
    parameters)."""
    from deepspeed.utils import groups

    cached = groups._get_zero_param_intra_parallel_group()
    return cached is not None and cached is _CAUSED_HPZ[0]


def _prepare_hpz_group(ds_config: Dict[str, Any]) -> None:
    """Drop DeepSpeed's cached hpZ group unless the engine about to be built wants one of that size.

    DeepSpeed keeps ONE module-level hpZ group, and stage 3 adopts it for every later engine whatever that
    engine's ``zero_hpz_partition_size``: after a node-replica engine, a plain ZeRO-3 or full-replica engine in
    the same process would get secondary partitions it never asked for (seen: a full-replica run resumed
    from a checkpoint after a node-replica engine diverged from the uninterrupted run at its second step).
    Engines built earlier keep their group (each parameter holds its own reference).
    """
    from deepspeed.utils import groups
    import torch.distributed as tdist

    hpz = hpz_size(ds_config)
    cached = groups._get_zero_param_intra_parallel_group()
    if cached is not None and (hpz <= 1 or tdist.get_world_size(cached) != hpz):
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None


# ----------------------------------------------------------------------------------------------------------
# the per-optimizer state
# ----------------------------------------------------------------------------------------------------------
def _remove_handles(handles) -> None:
    for h in handles:
        h.remove()


class _Replica:
    """The persistent bf16 replica of one engine: its layout, buffers, refresh, resync and ``p.data``.

    Built once when SDP4Bit is attached; a step then runs :meth:`WeightDeltaAllGather.refresh` calls with segment
    plans prepared here (one fused op-6 launch per source and call, nothing per parameter in Python).

    * ``layout[k]``: sub-group ``k``'s parameters as ``(param, offset in the flat partition, partition numel
      P)``, DeepSpeed's flat partition order (the same on every rank).
    * ``flat[k]``: ONE buffer per sub-group.  ``full``: every parameter's full data back to back (each start
      rounded up to ``ALIGN`` elements, the kernels' vector width), ``param.data`` a view of it
      (:meth:`point_params`); source ``s``'s piece of ``p`` is elements ``[s*P, min((s+1)*P, numel))`` of it.
      ``node``: the parameters' hpZ secondary tensors (DeepSpeed's node replica), views of the buffer kept for
      good (never invalidated): local rank ``l`` keeps primary partitions ``l*N .. l*N+N-1`` of each parameter.
    * ``runs``: the step's refresh and every resync in pieces (both levels: the exchange buffers hold one run,
      not a whole sub-group), each with its plans ({source rank: :class:`~deepspeed_sdp4bit.segments.SegmentPlan`
      of its pieces in the sub-group's buffer}, checked once).  Every parameter gets a *stage*: the model's modules
      in registration order, cut into ``weights.pieces`` stages of about equal parameter count at module
      boundaries (a parameter belongs to the first module that registers it).  A run is a range of a
      sub-group's flat partition (cut where the stage changes, at offsets that are multiples of ``ALIGN``, into
      runs of >= 16 quantization groups) with its own plans; a run's stage is its earliest parameter's; runs
      execute in stage order, and after the runs of stage ``s`` the replica of every parameter of stages
      ``<= s`` is current.  With ``weights.overlap`` on a CUDA device the runs execute on a side stream after
      ``step()`` has returned, an event marks the end of each stage, and a forward pre-hook on every module
      makes the current stream wait for the last stage of the parameters below it (:meth:`hook_stages`).
    Invariant: every copy of a partition is bit-identical to its owner's bf16 partition (once :meth:`wait`
    has returned, or the module's forward has started).
    """

    ALIGN = 16

    @classmethod
    def _pieces(cls, items, topology, level):
        """Where each source's pieces of ``items`` go in a sub-group buffer: ``({source: [(src offset, dst
        offset, length, item index)]}, starts, sizes, buffer numel)`` (see :meth:`sub_group`)."""
        W, N = topology.world_size, topology.num_nodes
        pieces: Dict[int, List[Tuple[int, int, int, int]]] = {}
        starts, sizes, start = [], [], 0
        for i, (p, off, P) in enumerate(items):
            size = p.ds_numel if level == "full" else N * P
            if level == "full":
                for s in range(W):
                    if s * P < size:
                        pieces.setdefault(s, []).append((off, start + s * P, min(P, size - s * P), i))
            else:
                for j in range(N):
                    pieces.setdefault(topology.local * N + j, []).append((off, start + j * P, P, i))
            starts.append(start)
            sizes.append(size)
            start += -(-size // cls.ALIGN) * cls.ALIGN
        return pieces, starts, sizes, start

    @staticmethod
    def _plans(pieces, needed, buf, src_numel, lo=0, hi=None, base=0):
        """{source: SegmentPlan} of the pieces of items ``lo..hi-1`` (source offsets minus ``base``) for every
        needed source ([] where a source has none there)."""
        from .segments import make_segment_plan

        out: Dict[int, Any] = {}
        for src in needed:
            segs = [x for x in pieces.get(src, ()) if lo <= x[3] and (hi is None or x[3] < hi)]
            out[src] = (make_segment_plan([x[0] - base for x in segs], [x[1] for x in segs], [x[2] for x in segs],
                                          buf, src_numel=src_numel) if segs else [])
        return out

    @classmethod
    def sub_group(cls, items, M: int, topology, level: str, needed, dtype, device, new=None, geometry=None,
                  plans: bool = True):
        """One sub-group's flat buffer, each parameter's view of it and the segment plan of every kept source.

        ``items``: [(param, offset in the flat partition, P)] (a param needs ``ds_numel``); ``M``: the flat
        partition's numel; ``needed``: the source ranks this rank keeps; ``new(numel, dtype, device)`` makes
        the buffer (default: zeros at node level, like DeepSpeed's secondary padding; empty at full level,
        where every element is written by the first resync).  Returns ``(buf, [view per item], {source:
        SegmentPlan})``; the views are the full data (``full``) or the hpZ secondary tensor (``node``).
        ``geometry``: :meth:`_pieces` of these items, when the caller has it already; ``plans=False``: no plans
        (``{}``).
        """
        pieces, starts, sizes, numel = geometry or cls._pieces(items, topology, level)
        if new is None:
            new = lambda n, dtype, device: (torch.zeros if level == "node" else torch.empty)(  # noqa: E731
                n, dtype=dtype, device=device)
        buf = new(numel, dtype, device)
        views = [buf[a:a + n] for a, n in zip(starts, sizes)]
        if not plans:
            return buf, views, {}
        return buf, views, {src: plan for src, plan in cls._plans(pieces, needed, buf, M).items() if src in pieces}

    @staticmethod
    def stages(module, params, pieces: int, min_numel: int = 1) -> Dict[int, int]:
        """{id(param): stage}: ``module``'s modules in registration order cut into at most ``pieces`` stages of
        about equal parameter count (by ``ds_numel``) and at least ``min_numel`` parameters each, never inside a
        module's own parameters; a parameter belongs to the first module that registers it, one outside
        ``module`` to stage 0."""
        first: Dict[int, int] = {}
        if module is not None:
            for mi, m in enumerate(module.modules()):
                for p in m.parameters(recurse=False):
                    first.setdefault(id(p), mi)
        ours = sorted(range(len(params)), key=lambda i: (first.get(id(params[i]), -1), i))
        total = sum(p.ds_numel for p in params) or 1
        pieces = max(1, min(pieces, total // max(1, min_numel)))
        out: Dict[int, int] = {}
        done, prev_mod, stage = 0, None, 0
        for i in ours:
            p = params[i]
            mod = first.get(id(p), -1)
            if mod != prev_mod:
                stage = min(pieces - 1, done * pieces // total)
                prev_mod = mod
            out[id(p)] = stage
            done += p.ds_numel
        return out

    def __init__(self, opt, state: "SDP4BitState", module=None, overlap: bool = False):
        self.topology = state.topology
        self.weights = state.weights
        self.level = state.level
        self.layout: List[List[Tuple[torch.nn.Parameter, int, int]]] = []
        for group in opt.fp16_groups:
            off, items = 0, []
            for p in group:
                P = p.partition_numel()
                items.append((p, off, P))
                off += P
            self.layout.append(items)
        self.params: List[torch.nn.Parameter] = [p for items in self.layout for p, _, _ in items]
        self._ids = frozenset(id(p) for p in self.params)
        self.flat: List[Optional[torch.Tensor]] = []
        self._views: Dict[int, torch.Tensor] = {}
        # [(stage, sub-group, a, b, {source: plan})], in execution order (both levels)
        self.runs: List[Tuple[int, int, int, int, Dict[int, Any]]] = []
        self.stage_of: Dict[int, int] = {}
        needed = self.weights.sources_needed()
        wcfg = state.cfg.weights
        # each run of a stage holds >= 16 quantization groups per rank: its own padding stays <= 1/16
        self.stage_of = self.stages(module, self.params, wcfg.pieces,
                                    16 * wcfg.group_size * self.topology.world_size)
        for k, items in enumerate(self.layout):
            if not items:
                self.flat.append(None)
                continue
            ref = items[0][0].ds_tensor
            M = opt.fp16_partitioned_groups_flat[k].numel()
            geometry = self._pieces(items, self.topology, self.level)
            buf, views, _ = self.sub_group(items, M, self.topology, self.level, needed, ref.dtype, ref.device,
                                           geometry=geometry, plans=False)   # (the runs have their own)
            self.flat.append(buf)
            for (p, _, _), view in zip(items, views):
                if self.level == "full":
                    self._views[id(p)] = view
                else:
                    self._set_secondary(p, view)
            self._add_runs(k, items, geometry[0], buf, needed, 16 * wcfg.group_size)
        self.runs.sort(key=lambda r: (r[0], r[1], r[2]))
        self._runs_of: Dict[int, List[int]] = {}   # sub-group -> its runs' indices, in order
        for i, r in enumerate(self.runs):
            self._runs_of.setdefault(r[1], []).append(i)
        self.n_stages = 1 + max((r[0] for r in self.runs), default=0)
        self._dirty: set = set()
        dev = next((b.device for b in self.flat if b is not None), None)
        self._stream = None
        overlap = self.level == "full" and overlap and dev is not None
        if overlap and dev.type != "cuda":
            _say(f"weights.overlap: needs a CUDA device (a side stream); on {dev.type} the refresh runs inside step()")
        elif overlap:
            self._stream = torch.cuda.Stream(device=dev)
            self._events = [torch.cuda.Event() for _ in range(self.n_stages)]
            # memory the side stream works on, allocated on another stream: freed (engine deleted with a
            # refresh in flight) only once the side stream's work queued by then is done
            for k, buf in enumerate(self.flat):
                if buf is not None:
                    for t in (buf, opt.fp16_partitioned_groups_flat[k], opt.fp32_partitioned_groups_flat[k]):
                        t.record_stream(self._stream)
            weakref.finalize(self, self._stream.synchronize)   # (the plans' tile tables)
        self._waited = self.n_stages - 1      # stages whose end the current stream has waited for
        self.overlapping = self._stream is not None   # SDP4BitState.overlap switches it (the side stream stays)
        self._hooks = self._hook(module) if self._stream is not None and module is not None else []
        self._opt = weakref.ref(opt)
        if self.level == "full":
            _FULL_REPLICAS.add(self)

    def _add_runs(self, k: int, items, pieces, buf, needed, min_run: int) -> None:
        """Cut sub-group ``k`` into runs where the stage changes (at ALIGN-multiple offsets, runs of at least
        ``min_run`` elements: a smaller one joins the run before it, which keeps the lower stage) and plan each
        from ``pieces`` (:meth:`_pieces` of the items)."""
        bounds = [0]
        for i in range(1, len(items)):
            if (self.stage_of[id(items[i][0])] != self.stage_of[id(items[i - 1][0])]
                    and items[i][1] % self.ALIGN == 0 and items[i][1] - items[bounds[-1]][1] >= min_run):
                bounds.append(i)
        M = items[-1][1] + items[-1][2]
        if len(bounds) > 1 and M - items[bounds[-1]][1] < min_run:
            bounds.pop()   # a short tail joins the run before it
        bounds.append(len(items))
        for lo, hi in zip(bounds, bounds[1:]):
            a = items[lo][1]
            b = items[hi - 1][1] + items[hi - 1][2]
            stage = min(self.stage_of[id(items[i][0])] for i in range(lo, hi))
            self.runs.append((stage, k, a, b, self._plans(pieces, needed, buf, b - a, lo, hi, base=a)))

    @staticmethod
    def hook_stages(module, stage_of: Dict[int, int]) -> List[Tuple[torch.nn.Module, int]]:
        """``[(submodule, stage its forward waits for)]``.

        A module waits for the last stage of every parameter below it, not only its own: a module may read
        its children's weights without calling their forward (``nn.MultiheadAttention`` reads ``out_proj``,
        ``nn.TransformerEncoderLayer``'s fast path reads every child).  The root waits only for its own
        parameters and stage 0 (parameters outside every module), else it would wait for everything before
        the first layer; a parameter the root's own code reads from deeper down must be read through a
        submodule's forward.
        """
        out = []
        for m in module.modules():
            ps = m.parameters(recurse=m is not module)   # the root: its own parameters only
            stage = max((stage_of[id(p)] for p in ps if id(p) in stage_of), default=0 if m is module else None)
            if stage is not None:
                out.append((m, stage))
        return out

    def _hook(self, module) -> list:
        """Forward pre-hooks making each module wait for its stage (:meth:`hook_stages`); removed with the
        replica."""
        handles = []
        me = weakref.ref(self)
        for m, stage in self.hook_stages(module, self.stage_of):

            def pre_hook(_mod, _args, stage=stage):
                rep = me()
                if rep is not None:
                    rep.wait(stage)

            handles.append(m.register_forward_pre_hook(pre_hook))
        weakref.finalize(self, _remove_handles, handles)
        return handles

    def wait(self, stage: Optional[int] = None) -> None:
        """Make the current stream wait until the replica of every parameter of stages ``<= stage`` (default:
        all) is current.  No host synchronisation; a no-op where the refresh ran inside ``step()``."""
        s = self.n_stages - 1 if stage is None else min(stage, self.n_stages - 1)
        if s > self._waited:
            torch.cuda.current_stream(self._stream.device).wait_event(self._events[s])
            self._waited = s

    def __getitem__(self, param_id: int) -> torch.Tensor:
        """Full level: the replica view (bf16 [ds_numel]) of the parameter with this ``id``."""
        return self._views[param_id]

    def __contains__(self, param_id: int) -> bool:
        """Whether the parameter with this ``id`` is one of the replica's (the optimizer's), at either level."""
        return param_id in self._ids

    @staticmethod
    def _set_secondary(p, view: torch.Tensor) -> None:
        """Make ``view`` the hpZ secondary tensor of ``p`` (DeepSpeed would create one lazily at the first
        release of the gathered parameter and drop it after every step; ours lives for good)."""
        from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

        view.requires_grad = False
        view.ds_numel = view.numel()
        view.status = PartitionedParamStatus.AVAILABLE
        view.final_location = None
        p.ds_secondary_tensor = view

    def refresh(self, opt, k: int, step: int) -> None:
        """After the optimizer step of sub-group ``k``: node level refreshes it now, run by run (DeepSpeed's
        gather of the persistent parameters at the end of the step reads the secondaries); full level marks it
        for :meth:`flush` at the end of the step."""
        own = opt.fp16_partitioned_groups_flat[k]
        if not own.numel():
            return
        if self.level == "full":
            self._dirty.add(k)
            return
        master = opt.fp32_partitioned_groups_flat[k]
        for i in self._runs_of.get(k, ()):
            _, _, a, b, plans = self.runs[i]
            self.weights.refresh(master[a:b], own[a:b], plans, step=step, bucket_id=i)

    def flush(self, opt, step: int) -> None:
        """Full level, end of the step: the runs of the refreshed sub-groups, in stage order (on the side stream
        with an event per stage when overlapping, else now on the current stream)."""
        dirty, self._dirty = self._dirty, set()
        if not dirty:
            return
        side = self._stream
        ctx = contextlib.nullcontext()
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))
            ctx = torch.cuda.stream(side)
        with ctx:
            stage = 0
            for i, (s, k, a, b, plans) in enumerate(self.runs):
                if side is not None:
                    while stage < s:
                        self._events[stage].record(side)
                        stage += 1
                if k in dirty:
                    self.weights.refresh(opt.fp32_partitioned_groups_flat[k][a:b],
                                         opt.fp16_partitioned_groups_flat[k][a:b], plans, step=step, bucket_id=i)
            if side is not None:
                while stage < self.n_stages:
                    self._events[stage].record(side)
                    stage += 1
        if side is not None:
            if self.overlapping:
                self._waited = -1
            else:   # switched off (SDP4BitState.overlap): the same stream and memory, but step() waits for it all
                torch.cuda.current_stream(side.device).wait_stream(side)

    def zero_padding(self, opt) -> None:
        """Zero the alignment padding of the flat partitions (DeepSpeed leaves it uninitialized).

        A NaN there would poison the absmax of its quantization group; zeros stay zero (zero gradient, and
        Adam with weight decay keeps 0 at 0).
        """
        rank = self.topology.rank
        for i, items in enumerate(self.layout):
            for flat in (opt.fp16_partitioned_groups_flat[i], opt.fp32_partitioned_groups_flat[i]):
                for p, off, P in items:
                    real = max(0, min(P, p.ds_numel - rank * P))
                    if real < P:
                        flat.data[off + real:off + P].zero_()

    def resync(self, opt) -> None:
        """Exact re-synchronisation of every copy from the owners' bf16 partitions (collective)."""
        self.wait()
        opt._partition_all_parameters()
        for i, (_, k, a, b, plans) in enumerate(self.runs):   # run by run: bf16 rows of one run at a time
            self.weights.full_sync(opt.fp16_partitioned_groups_flat[k][a:b], plans, bucket_id=i)
        self.point_params()

    def changed_elsewhere(self, params) -> bool:
        """Whether on any rank one of our ``params`` holds data that is not its replica view and differs from it
        (full level; collective over the data-parallel group, every rank calls it with the same ``params``).
        Data that IS the view needs no look: a change made to it is a change of the replica itself."""
        import torch.distributed as tdist

        def differs(p) -> bool:
            view = self._views[id(p)]
            if p.data.data_ptr() == view.data_ptr() and p.data.numel() == view.numel():
                return False
            if p.data.numel() != view.numel() or p.data.dtype != view.dtype:
                return True
            # bit for bit: torch.equal calls -0.0 and +0.0 equal
            return not torch.equal(p.data.reshape(-1).contiguous().view(torch.uint8), view.view(torch.uint8))

        local = any(id(p) in self._views and differs(p) for p in params)
        dev = next(b.device for b in self.flat if b is not None)
        flag = torch.tensor([int(local)], dtype=torch.int32, device=dev)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=self.topology.group)
        return bool(flag.item())

    def after_gathered(self, modified: bool) -> None:
        """After a ``GatheredParameters`` context over some of our parameters (every rank calls it)."""
        opt = self._opt()
        if modified and opt is not None:
            self.resync(opt)     # the owners' partitions hold what the modifier rank wrote
        else:
            self.point_params()

    def point_params(self) -> None:
        """Full level: make each parameter's data its replica view (what DeepSpeed's gather would make)."""
        if self.level != "full":
            return
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        for p in self.params:
            if p.ds_status == ZeroParamStatus.INFLIGHT:
                raise RuntimeError(f"sdp4bit: parameter {p.ds_id} is being gathered while its replica is "
                                   f"re-pointed")
            p.data = self._views[id(p)].view(p.ds_shape)
            p.ds_status = ZeroParamStatus.AVAILABLE


class SDP4BitState:
    """SDP4Bit attached to one ``DeepSpeedZeroOptimizer_Stage3`` instance (``engine.sdp4bit``).

    Attributes:
        cfg: the parsed :class:`SDP4BitConfig`.
        topology: the :class:`Topology` over the optimizer's data-parallel group.
        reducer: the :class:`GradientReducer` (None when gradients are disabled).
        weights: the :class:`WeightDeltaAllGather` (None when weights are disabled).
        level: ``"node"`` / ``"full"`` (weights) or None.
        step: optimizer steps taken (skipped overflow steps included): the stochastic-rounding step word.
        bucket: reduce-scatter calls since the last optimizer step: the bucket word.
        last_summary: :meth:`summary` of the last step.
    """

    def __init__(self, optimizer, cfg: SDP4BitConfig):
        from .collectives.gradients import GradientReducer
        from .collectives.weights import WeightDeltaAllGather

        self.cfg = cfg
        self.topology = Topology.build(cfg.topology.gpus_per_node, group=optimizer.dp_process_group)
        self.reducer = (GradientReducer(self.topology, cfg.gradients, cfg.seed, backend=cfg.backend_name)
                        if cfg.gradients.enabled else None)
        self.weights = None
        self.level = None
        if cfg.weights.enabled:
            self.level = cfg.weights.replica
            self.weights = WeightDeltaAllGather(self.topology, cfg.weights, cfg.seed, backend=cfg.backend_name,
                                                level=self.level)
        self.step = 0
        self.step_restored = False   # set by a checkpoint load that read SDP4Bit's own step
        self.bucket = 0
        self.nonfinite: Optional[torch.Tensor] = None   # bool [] "a local gradient was not finite"
        self.last_summary: Dict[str, Any] = {}
        self._prev = self._cumulative()
        # weights.overlap omitted: what choose_overlap measured and decided (None otherwise)
        self.overlap_choice: Optional[Dict[str, Any]] = None
        # The persistent replica (layout, buffers, destination maps): built once, in attach().
        self.replica: Optional[_Replica] = None

    @property
    def layout(self) -> List[List[Tuple[torch.nn.Parameter, int, int]]]:
        """Per sub-group: [(param, offset in the flat partition, partition numel P)] (see :class:`_Replica`)."""
        return self.replica.layout if self.replica is not None else []

    # -- gradients ----------------------------------------------------------------------------------------
    def reduce_grads(self, opt, params, grads, communication_data_type) -> List[torch.Tensor]:
        """DeepSpeed's ``__avg_scatter_grads`` with the coalesced reduce-scatter replaced by TLq-HS.

        grads: full gradients [numel_i] of ``params`` (one bucket, same order on every rank).  Returns one
        1-D partition per gradient (``reduce_scatter_coalesced``'s layout, possibly shorter than the
        partition on the last ranks) in ``opt.gradient_accumulation_dtype``.
        """
        import deepspeed.comm as dist

        process_group = opt._get_param_partition_group(params[0])
        world = dist.get_world_size(group=process_group)
        if world != self.topology.world_size:
            raise RuntimeError(f"sdp4bit: parameter partition group has {world} ranks, the topology "
                               f"{self.topology.world_size}")
        if communication_data_type != opt.dtype:
            grads = [g.to(communication_data_type) for g in grads]
        if opt.postscale_gradients and opt.gradient_predivide_factor != 1.0:
            grads = [g.div(opt.gradient_predivide_factor) for g in grads]
        # DeepSpeed finds non-finite gradients in the *reduced* partitions (fp16: has_overflow; bf16/fp32: a
        # non-finite global norm); a quantizer may turn an inf into finite garbage on the way, so look at the
        # local inputs while they are still exact, in every dtype.  The flag stays on the device (no host
        # sync here); has_overflow (fp16) or flag_nonfinite_for_norm (bf16/fp32) hands it to DeepSpeed.
        # one fused pass, no sync; fp64 norms, as DeepSpeed's own: an fp32 norm reads inf for a finite gradient
        # whose sum of squares passes 3.4e38 (a norm above 1.8e19: a bf16 loss times 1e20 gives one), and the
        # step would be skipped where plain ZeRO-3 takes it
        bad = ~torch.isfinite(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))).all()
        self.nonfinite = bad if self.nonfinite is None else (self.nonfinite | bad)
        # error feedback only: the bucket's residual is named by its parameters (no per-parameter work otherwise)
        rkey = tuple(getattr(p, "ds_id", id(p)) for p in params) if self.reducer.residuals is not None else None
        parts = self.reducer.reduce_scatter(grads, op="mean", step=self.step, bucket_id=self.bucket,
                                            residual_key=rkey)
        self.bucket += 1
        if (opt.postscale_gradients and opt.gradient_predivide_factor != 1.0
                and opt.gradient_predivide_factor != world):
            parts = [g.mul(opt.gradient_predivide_factor) for g in parts]
        averaging = opt._gradient_averaging_world_size(params, world)
        if averaging != world:
            scale = world / float(averaging)
            parts = [g.mul(scale) for g in parts]
        if communication_data_type != opt.gradient_accumulation_dtype:
            parts = [g.to(opt.gradient_accumulation_dtype) for g in parts]
        return parts

    def flag_nonfinite_for_norm(self, opt) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """bf16/fp32: make DeepSpeed skip the step when a local gradient of this rank was not finite.

        There DeepSpeed has no overflow check; it skips a step whose global gradient norm (summed over the
        ranks) is not finite, which is what plain ZeRO-3 does with an inf/NaN gradient.  The quantized
        reduce-scatter may have delivered finite garbage instead, so a flagged rank writes a NaN into one
        element of its own gradient partition: the norm is NaN on every rank and DeepSpeed skips the step
        everywhere (``overflow``, ``skipped_steps``, gradients dropped) as for plain ZeRO-3, with no extra
        collective.  All on the device (``where`` on the flag, no host sync): an unflagged rank's element is
        rewritten with its own value.  Returns (that element, its value) for :meth:`unflag`, or None.
        """
        if self.nonfinite is None or opt.dtype == torch.float16:
            return None
        for i, group in enumerate(opt.fp16_groups):
            for j, p in enumerate(group):
                if p.requires_grad:
                    g = opt.averaged_gradients[i][j].view(-1)[:1]
                    saved = g.clone()
                    g.copy_(torch.where(self.nonfinite, torch.full_like(g, float("nan")), g))
                    return g, saved
        return None

    def unflag(self, flagged: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Undo :meth:`flag_nonfinite_for_norm` on a flagged rank (device-side; the step was skipped there)."""
        if flagged is not None:
            g, saved = flagged
            g.copy_(torch.where(self.nonfinite, saved, g))

    # -- weights ------------------------------------------------------------------------------------------
    def _node_replica_active(self) -> bool:
        return self.level == "node"

    def refresh(self, opt, sub_group_id: int) -> None:
        """After the optimizer step of one sub-group: qWD instead of DeepSpeed's fp32 -> bf16 copy."""
        self.replica.refresh(opt, sub_group_id, self.step)

    def flush(self, opt) -> None:
        """End of the step (full level): run the refresh of the stepped sub-groups (see :class:`_Replica`)."""
        self.replica.flush(opt, self.step)

    def wait(self) -> None:
        """Make the current stream wait until every replica is current (see :meth:`_Replica.wait`).

        With ``weights.overlap`` the full replica's refresh is still in flight when ``step()`` returns; each
        module's forward waits for its own parameters, and so do checkpoints, ``GatheredParameters`` and the
        next step.  Call this before reading parameters outside a forward (e.g. a weight norm for logging)."""
        if self.replica is not None:
            self.replica.wait()

    @property
    def overlap(self) -> bool:
        """Whether the full replica's refresh is left in flight when ``step()`` returns (``weights.overlap`` on a
        CUDA device).  Settable where it is built so, e.g. to time both ways in one process
        (``examples/train_gpt.py --overlap-blocks``): False makes the current stream wait for a refresh in flight
        now and for each later one inside the ``step()`` that queued it (still run on the side stream, so both ways
        use the same memory; the forward hooks stay and then return at once)."""
        rep = self.replica
        return rep is not None and rep._stream is not None and rep.overlapping

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"sdp4bit: engine.sdp4bit.overlap must be True or False, got {on!r}")
        rep = self.replica
        if rep is None or rep._stream is None:
            chosen = getattr(self, "overlap_choice", None)
            raise ValueError("sdp4bit: engine.sdp4bit.overlap can only be switched where weights.overlap is on and "
                             "active (the full replica on a CUDA device); here the refresh always runs inside step()"
                             + (f" (weights.overlap omitted and decided off: {chosen['reason']})"
                                if chosen and not chosen["on"] else ""))
        if not on:
            rep.wait()
        rep.overlapping = on

    def resync(self, opt) -> None:
        """Exact re-synchronisation of every replica from the owners' bf16 partitions (collective)."""
        if self.replica is not None:
            self.replica.resync(opt)

    def point_params(self) -> None:
        if self.replica is not None:
            self.replica.point_params()

    # -- accounting ---------------------------------------------------------------------------------------
    def _cumulative(self) -> Dict[str, Dict[str, Any]]:
        out = {}
        for name, coll in (("gradients", self.reducer), ("weights", self.weights)):
            if coll is not None:
                out[name] = {"bytes_by_level": dict(coll.stats.bytes_by_level),
                             "baseline_bytes": coll.stats.baseline_bytes}
        return out

    def end_step(self, opt) -> None:
        """Bookkeeping after each ``optimizer.step()`` (overflow-skipped steps included)."""
        cur = self._cumulative()
        summary: Dict[str, Any] = {"step": self.step, "skipped": bool(getattr(opt, "overflow", False))}
        total = base = 0
        for name, c in cur.items():
            p = self._prev.get(name, {"bytes_by_level": {}, "baseline_bytes": 0})
            levels = {k: v - p["bytes_by_level"].get(k, 0) for k, v in c["bytes_by_level"].items()}
            b = c["baseline_bytes"] - p["baseline_bytes"]
            sent = sum(levels.values())
            summary[name] = {"bytes_by_level": levels, "bytes": sent, "baseline_bytes": b,
                             "compression": (b / sent) if sent else None}
            total += sent
            base += b
        summary["bytes"] = total
        summary["baseline_bytes"] = base
        summary["compression"] = (base / total) if total else None
        self.last_summary = summary
        self._prev = cur
        if self.reducer is not None and self.reducer.residuals is not None:
            self.reducer.residuals.end_step(skipped=summary["skipped"])
        self.step += 1
        if (self.reducer is not None and self.step == self.cfg.gradients.inter8_steps
                and self.topology.num_nodes > 1):
            _say(f"step {self.step}: the inter-node gradient level now at {self.cfg.gradients.inter_bits} bits "
                 f"(gradients.inter8_steps)")
        self.bucket = 0
        self.nonfinite = None
        every = self.cfg.summary_interval
        if every and self.step % every == 0 and self.topology.rank == 0:
            print(f"[sdp4bit] {format_summary(summary)}", flush=True)

    def summary(self) -> Dict[str, Any]:
        """Bytes this rank sent in the last optimizer step, per collective and level, vs the baseline.

        ``step`` is the 0-based index of the optimizer step described (4 after five steps).
        ``{"active": True, "step", "skipped", "gradients": {"bytes_by_level", "bytes", "baseline_bytes", "compression"},
        "weights": {...}, "bytes", "baseline_bytes", "compression"}``.  The gradient baseline is the bf16
        ring reduce-scatter ZeRO-3 would run on the same buckets; the weight baseline is the same replica
        refresh sent unquantized (ZeRO-3's own forward/backward gathers of the replica are not counted).
        """
        return {"active": True, **copy.deepcopy(self.last_summary)}


def format_summary(s: Dict[str, Any]) -> str:
    """One line for a :meth:`SDP4BitState.summary` dict."""
    parts = [f"step {s.get('step')}" + (" (skipped)" if s.get("skipped") else "")]
    for name in ("gradients", "weights"):
        if name in s:
            d = s[name]
            lv = ", ".join(f"{k} {v} B" for k, v in sorted(d["bytes_by_level"].items()))
            ratio = f"{d['compression']:.2f}x" if d["compression"] else "-"
            parts.append(f"{name}: {lv or 'nothing'} (baseline {d['baseline_bytes']} B, {ratio})")
    return "; ".join(parts)


def attach(engine, cfg: SDP4BitConfig) -> SDP4BitState:
    """Attach SDP4Bit to ``engine``'s stage-3 optimizer; returns the state (also ``engine.sdp4bit``)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if getattr(engine, "has_moe_layers", False):
        # expert parameters are reduced over expert-data-parallel groups, not the data-parallel world that
        # the TLq-HS topology and the replicas are built over
        raise NotImplementedError("sdp4bit does not support mixture-of-experts layers (deepspeed.moe) yet; "
                                  "remove the 'sdp4bit' block for this model")
    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        raise NotImplementedError(f"sdp4bit needs DeepSpeed's ZeRO stage-3 optimizer, the engine has "
                                  f"{type(opt).__name__} (no optimizer, or an unsupported wrapper)")
    if getattr(opt, _STATE_ATTR, None) is not None:
        raise RuntimeError("sdp4bit is already attached to this optimizer")
    if cfg.kernel_backend is not None:
        # a backend given that cannot run here fails now, naming the key, not in the first backward hook
        from . import ops

        ops.get_backend(cfg.backend_name, torch.device(engine.device))
    for attr, what in (("offload_optimizer", "zero_optimization.offload_optimizer"),
                       ("offload_param", "zero_optimization.offload_param"),
                       ("swap_optimizer", "optimizer NVMe swapping")):
        if getattr(opt, attr, False):
            raise SDP4BitConfigError(f"{what} is not supported by sdp4bit")
    if getattr(opt, "all2all_process_group", None) is not None:
        raise SDP4BitConfigError("zero_optimization.zero_quantized_gradients (ZeRO++) cannot be combined with "
                                 "sdp4bit")
    if getattr(opt, "zenflow", False) or getattr(opt, "use_muon", False):
        raise NotImplementedError("sdp4bit does not support ZenFlow or the Muon optimizer with ZeRO-3")
    if getattr(opt, "sequence_parallel_size", 1) != 1:
        raise NotImplementedError("sdp4bit does not support sequence parallelism yet")
    if getattr(opt, "autoep_folding_tp_group", None) is not None:
        raise NotImplementedError("sdp4bit does not support AutoEP / AutoTP folding yet")
    state = SDP4BitState(opt, cfg)
    if state.weights is not None:
        opt_params = [p for group in opt.fp16_groups for p in group]
        hpz = getattr(opt, "zero_hpz_partition_size", 1)
        want = state.topology.gpus_per_node if state._node_replica_active() else 1
        if hpz != want:
            raise SDP4BitConfigError(f"zero_optimization.zero_hpz_partition_size is {hpz} but sdp4bit "
                                     f"weights.replica={state.level!r} needs {want}")
        if state._node_replica_active():
            # A model partitioned earlier by a user-side deepspeed.zero.Init without hpZ keeps that Init's
            # (hpZ-less) gather code: it would gather our secondary tensors over the wrong group.
            foreign = [p.ds_id for p in opt_params if getattr(p, "ds_zero_param_process_group", None) is None]
            if foreign:
                raise SDP4BitConfigError(
                    "the model was partitioned by deepspeed.zero.Init without zero_hpz_partition_size; build it "
                    "with the config from deepspeed_sdp4bit.integration.prepare_ds_config(ds_config, "
                    "world_size)[0] (it sets zero_hpz_partition_size = gpus_per_node), or use "
                    "sdp4bit.weights.replica='full'")
        if state.level == "full":
            small = [p.ds_id for p in opt_params if not p.ds_persist]
            if small:
                raise SDP4BitConfigError("sdp4bit.weights.replica='full' needs every parameter persistent "
                                         "(stage3_param_persistence_threshold); use deepspeed.initialize "
                                         "after importing deepspeed_sdp4bit so the config is adjusted")
        # (the engine's device: the same kind on every rank, so every rank takes the probe's path or none does)
        state.replica = _Replica(opt, state, module=engine.module,
                                 overlap=choose_overlap(engine, state, torch.device(engine.device)))
        state.replica.zero_padding(opt)
    setattr(opt, _STATE_ATTR, state)
    # Start from exact replicas: DeepSpeed built them from the initial bf16 weights, but a resync makes the
    # invariant (replica == owner's bf16 partition, bit for bit) hold by construction.
    state.resync(opt)
    engine.sdp4bit = state
    engine.sdp4bit_summary = state.summary
    _say(_on_line(state))
    return state


def _overlap_possible(device) -> bool:
    """Whether an overlapped refresh can run on ``device`` (it needs a side stream: CUDA)."""
    return device.type == "cuda"


def choose_overlap(engine, state: "SDP4BitState", device) -> bool:
    """``weights.overlap`` for this engine's full replica: the key's value, or, with the key omitted, on where the
    link between nodes is slow: :meth:`Topology.probe_inter_gbps` (every rank gets the same number, so every
    rank decides alike) below ``weights.overlap_below_gbps``.  What was measured and decided goes to
    ``state.overlap_choice`` and one log line.  Turning it on sets DeepSpeed's throughput timer unsynchronized
    (it would wait for the whole device, the refresh in flight included, at every step's end), unless the
    ds_config sets ``timers.throughput.synchronized`` itself: then the overlap stays off (a true there is the
    user's; an explicit ``weights.overlap: true`` is refused with it, in :func:`plan_run`); an explicit ``false``
    there is taken as it is.  With the node replica it is off (recorded, not logged: it never overlaps)."""
    w = state.cfg.weights
    if w.overlap is not None:
        return w.overlap and state.level == "full"
    thr = w.overlap_below_gbps
    gbps, on = None, False
    if state.level != "full":
        state.overlap_choice = {"automatic": True, "gbps": None, "below_gbps": thr, "on": False,
                                "reason": f"the {state.level} replica is refreshed inside step()"}
        return False   # (nothing to say: the node replica never overlaps)
    timer = getattr(getattr(engine, "tput_timer", None), "config", None)
    synced = bool(timer is not None and timer.enabled and timer.synchronized)
    if not _overlap_possible(device):
        why = f"no side stream on {device.type}: the refresh runs inside step()"
    elif state.topology.num_nodes == 1:
        why = "one node: no link between nodes"
    elif synced and user_synchronized_timer(getattr(getattr(engine, "_config", None), "_param_dict", None) or {}):
        why = ("the ds_config sets timers.throughput.synchronized=true, which waits for the whole device at every "
               "step's end (the link not probed)")
    else:
        gbps = state.topology.probe_inter_gbps(device)
        measured = f"the link between nodes measured {gbps:.2f} Gb/s per rank"
        if gbps >= thr:
            why = f"{measured}, not below weights.overlap_below_gbps={thr:g}"
        else:
            on = True
            why = f"{measured}, below weights.overlap_below_gbps={thr:g}"
            if synced:
                timer.synchronized = False
                why += ("; timers.throughput.synchronized set to false (it would wait for the refresh at every "
                        "step's end)")
    state.overlap_choice = {"automatic": True, "gbps": gbps, "below_gbps": thr, "on": on, "reason": why}
    _say(f"weights.overlap: {'on' if on else 'off'} ({why}); set sdp4bit.weights.overlap to choose")
    return on


def _on_line(state: "SDP4BitState") -> str:
    """The start-up line that says SDP4Bit is on and what it sends (a user's check that the import took)."""
    topo, g, w = state.topology, state.cfg.gradients, state.cfg.weights
    if state.weights is None:
        weights = "ZeRO-3's gathers"
    elif w.mode == "direct":
        weights = f"{w.bits}-bit weights themselves (the qW ablation), {state.level!r} replica"
    else:
        weights = f"{w.bits}-bit differences to the {state.level!r} replica"
    if state.reducer is None:
        grads = "ZeRO-3's reduce-scatter"
    else:
        from .collectives.gradients import make_plan

        levels = []   # the levels a reduce runs, as the config linter (__main__.plan) lists them
        for lvl in make_plan(1 << 20, topo.shape, g).levels:
            bits = g.intra_bits if lvl.name == "intra" else g.inter_bits
            levels.append(("bf16 (unquantized)" if bits == 16 else f"{bits}-bit")
                          + (" inside a node" if lvl.name == "intra" else " between nodes")
                          + (f" (8-bit for the first {g.inter8_steps} steps)"
                             if lvl.name == "inter" and g.inter8_steps else ""))
        grads = ", ".join(levels)
    return (f"on: {topo.num_nodes} node(s) x {topo.gpus_per_node} rank(s); weights: {weights}; gradients: {grads} "
            f"(engine.sdp4bit_summary() after a step)")


# ----------------------------------------------------------------------------------------------------------
# traps caught when the engine is built or a checkpoint is loaded
# ----------------------------------------------------------------------------------------------------------
_BUILDING = 0   # > 0 while our deepspeed.initialize wrapper is running (engines built through it)


def _marking_build(initialize):
    """Marks engines built through our ``deepspeed.initialize`` (see :func:`_engine_init`)."""
    @functools.wraps(initialize)
    def wrapper(*args, **kwargs):
        global _BUILDING
        _BUILDING += 1
        try:
            return initialize(*args, **kwargs)
        finally:
            _BUILDING -= 1

    wrapper._sdp4bit_wrapped = True
    return wrapper


def _install_engine_checks() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name, factory in (("__init__", _engine_init), ("load_checkpoint", _engine_load_checkpoint)):
        orig = DeepSpeedEngine.__dict__[name]
        if not getattr(orig, "_sdp4bit_wrapped", False):
            _ORIG["DeepSpeedEngine." + name] = orig
            wrapped = factory(orig)
            wrapped._sdp4bit_wrapped = True
            setattr(DeepSpeedEngine, name, wrapped)


def _engine_init(orig):
    # `from deepspeed import initialize` before `import deepspeed_sdp4bit` binds DeepSpeed's own function: the
    # engine would train as plain ZeRO-3 with the "sdp4bit" block silently ignored.  Every engine built outside
    # our wrapper whose config has an active block is refused here, when it is built.
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if _BUILDING:
            return
        raw = getattr(getattr(self, "_config", None), "_param_dict", None)
        if isinstance(raw, dict) and parse_ds_config(raw).active:
            raise SDP4BitConfigError(
                "this DeepSpeed engine was built with an active 'sdp4bit' block but not through "
                "deepspeed_sdp4bit's deepspeed.initialize, so SDP4Bit would be silently ignored: the usual cause "
                "is `from deepspeed import initialize` (or another reference to deepspeed.initialize) taken "
                "before `import deepspeed_sdp4bit`. Import deepspeed_sdp4bit first, or call "
                "deepspeed.initialize(...) through the module")

    return __init__


def _saved_dp_world_size(engine, load_dir: str, tag) -> Tuple[Optional[int], Optional[str]]:
    """(data-parallel world size the checkpoint was saved with, its tag), read from DeepSpeed's model-states
    file before DeepSpeed loads anything; (None, tag) when there is nothing to read (DeepSpeed then reports)."""
    import glob
    import os

    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    files = sorted(glob.glob(os.path.join(load_dir, str(tag), "*model_states.pt")))
    if not files:
        return None, tag
    ck = engine.checkpoint_engine.load(files[0], map_location=torch.device("cpu"))
    return ck.get("dp_world_size"), tag


def _note_universal_frozen(engine) -> None:
    """DeepSpeed's ZeRO-3 universal checkpoints hold the optimizer's parameters only: a parameter outside the
    optimizer (e.g. frozen) keeps the loading engine's own value, in plain ZeRO-3 as here.  Said once per load."""
    inside = {id(p) for group in engine.optimizer.fp16_groups for p in group}
    outside = [n for n, p in engine.module.named_parameters()
               if id(p) not in inside and getattr(p, "ds_numel", p.numel()) > 0]
    if outside:
        _say(f"a universal checkpoint holds only the optimizer's parameters: {len(outside)} parameter(s) outside "
             f"it (e.g. frozen: {outside[0]!r}) keep the values this engine was built with (DeepSpeed's "
             f"ds_to_universal, plain ZeRO-3 alike): the saved ones where the model was built as the saved run's "
             f"(frozen parameters do not train; the Trainer's checkpoint-N holds them too)")


def _engine_load_checkpoint(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        st = get_state(self.optimizer) if getattr(self, "optimizer", None) is not None else None
        if st is None:
            return orig(self, load_dir, tag, *args, **kwargs)
        # A universal checkpoint (DeepSpeed's ds_to_universal output, ds_config checkpoint.load_universal) may come
        # from another world size or layout: DeepSpeed sets every bf16 partition to bf16(fp32 master) and the
        # epilogue rebuilds every replica from them exactly (the not-yet-sent rounding residual of the saved
        # replica is not in such a checkpoint: the run goes on from bf16(master), as a plain ZeRO-3 run does); the
        # step comes from DeepSpeed's count below.
        universal = bool(self.load_universal_checkpoint())
        # A checkpoint folder holds per-rank pieces (optimizer partitions, frozen parameters' fragments, model-state
        # files) of the world size that saved it: DeepSpeed fails on another one in most cases (a tensor-size error,
        # missing files on the extra ranks, or a one-element fragment broadcast silently), and checks the world size
        # itself only when it reaches the optimizer shards, after the module: so it is refused up front
        if not universal:
            saved, t = _saved_dp_world_size(self, load_dir, tag)
            cur = st.topology.world_size
            if saved is not None and saved != cur:
                raise RuntimeError(
                    f"sdp4bit: the checkpoint {load_dir}/{t} was saved by {saved} data-parallel ranks, this job "
                    f"has {cur}: SDP4Bit, like ZeRO-3's partitioned optimizer state, resumes only at the world "
                    f"size it was saved with. Resume with {saved} ranks, or convert it with DeepSpeed's "
                    f"ds_to_universal and load that with ds_config checkpoint.load_universal: true (the optimizer "
                    f"state is carried over), or take the weights (engine.save_16bit_model / the Trainer's "
                    f"save_model, or DeepSpeed's zero_to_fp32.py) and start a new run from them with {cur} ranks")
        st.wait()   # the module's weights are loaded before the optimizer's prologue runs
        st.step_restored = False
        out = orig(self, load_dir, tag, *args, **kwargs)
        if out[0] is None:
            return out
        if universal:
            _note_universal_frozen(self)
        if st.reducer is not None and st.reducer.residuals is not None:
            st.reducer.residuals.clear()   # error feedback: a loaded state starts with no residual
        module_only = sig.bind(self, load_dir, tag, *args, **kwargs).arguments.get("load_module_only")
        if not st.step_restored and not module_only:
            # SDP4Bit's step (the rounding streams' step word, inter8_steps' count) comes with the optimizer
            # state; where none was read (load_optimizer_states false) or it had no SDP4Bit entry (a plain
            # ZeRO-3 checkpoint) take DeepSpeed's step count, which counts skipped steps too, as ours does
            st.step = int(self.global_steps)
        return out

    return load_checkpoint


# ----------------------------------------------------------------------------------------------------------
# the patched DeepSpeedZeroOptimizer_Stage3 methods
# ----------------------------------------------------------------------------------------------------------
def _active(self):
    return getattr(self, _STATE_ATTR, None)


def _avg_scatter_grads(orig):
    # DeepSpeed: cast the bucket's full grads to the communication dtype, optional pre-division,
    # reduce_scatter_coalesced (pre-divides by the world size and sums), optional post-multiplication,
    # averaging-world-size correction, cast to the accumulation dtype.  We keep every scaling step and swap
    # only the collective for ONE TLq-HS call over the whole bucket.
    @functools.wraps(orig)
    def __avg_scatter_grads(self, params_to_reduce, communication_data_type):
        st = _active(self)
        if st is None or st.reducer is None:
            return orig(self, params_to_reduce, communication_data_type)
        self._assert_same_partition_group(params_to_reduce)
        return st.reduce_grads(self, params_to_reduce, [p.grad for p in params_to_reduce],
                               communication_data_type)

    return __avg_scatter_grads


def _avg_scatter_contiguous_grads(orig):
    # DeepSpeed (reduce_scatter=False with contiguous gradients): all-reduce the whole contiguous bucket and
    # slice each rank's partitions out of it.  An all-reduce sends every value to everyone; we route the
    # bucket through the same quantized reduce-scatter as the other path (grads are views of the buffer,
    # same order on every rank), which returns exactly the slices DeepSpeed would have taken.
    @functools.wraps(orig)
    def __avg_scatter_contiguous_grads(self, buffer_to_reduce, communication_data_type):
        st = _active(self)
        if st is None or st.reducer is None:
            return orig(self, buffer_to_reduce, communication_data_type)
        params = self.ipg_buckets[communication_data_type].params
        self._assert_same_partition_group(params)
        grads, off = [], 0
        for p in params:
            n = p.grad.numel()
            grads.append(buffer_to_reduce.narrow(0, off, n))
            off += n
        return st.reduce_grads(self, params, grads, communication_data_type)

    return __avg_scatter_contiguous_grads


def _reassign_or_swap_out_partitioned_parameters(orig):
    # DeepSpeed: copy the fp32 master partition of the sub-group into the bf16 partition and re-point the
    # params' ds_tensor at it; the replicas are rebuilt later by full all-gathers.  We run the qWD refresh:
    # the bf16 partition becomes the owner's replica value and every replica is updated with 4-bit deltas.
    @functools.wraps(orig)
    def _reassign(self, sub_group_id):
        st = _active(self)
        if st is None or st.weights is None or self.fp16_partitioned_groups_flat[sub_group_id] is None:
            return orig(self, sub_group_id)
        st.refresh(self, sub_group_id)
        self._unflatten_partitioned_parameters(sub_group_id)

    return _reassign


def _post_step(orig):
    # DeepSpeed: all-gather the persistent params from their (new) partitions, then drop the hpZ secondary
    # tensors.  Full level: the replica buffers already hold the new weights, so the params are re-pointed
    # at them instead of gathered (only params outside the optimizer are left to DeepSpeed's gather).  Node
    # level: invalidate_secondary_tensor is a no-op for us (patched below); persistent params are gathered
    # by DeepSpeed from the refreshed secondaries, which equal the owners' partitions.
    @functools.wraps(orig)
    def _post(self, timer_names):
        st = _active(self)
        if st is None or st.level != "full":
            return orig(self, timer_names)
        saved = self.persistent_parameters
        self.persistent_parameters = [p for p in saved if id(p) not in st.replica]
        try:
            orig(self, timer_names)
        finally:
            self.persistent_parameters = saved
        st.flush(self)
        st.point_params()

    return _post


def _invalidate_secondary_tensor(orig):
    # DeepSpeed drops every hpZ secondary tensor after each step (they hold last step's weights) and rebuilds
    # them from a full gather in the next forward.  Our secondaries ARE the refreshed node replica: keep them.
    @functools.wraps(orig)
    def invalidate_secondary_tensor(self):
        st = _active(self)
        if st is not None and st._node_replica_active():
            return None
        return orig(self)

    return invalidate_secondary_tensor


def _has_overflow(orig):
    # DeepSpeed checks the reduced gradient partitions for inf/nan and all-reduces the flag; we OR in the
    # flag raised on the exact local gradients before quantization (see SDP4BitState.reduce_grads).
    @functools.wraps(orig)
    def has_overflow(self, partition_gradients=True):
        st = _active(self)
        if st is not None and st.nonfinite is not None:
            if not partition_gradients:
                raise NotImplementedError("sdp4bit: overflow check without partitioned gradients")
            flag = st.nonfinite.to(self.inf_or_nan_tracker.device).view(1)
            if hasattr(self.inf_or_nan_tracker, "logical_or_"):
                self.inf_or_nan_tracker.logical_or_(flag)
            else:
                self.inf_or_nan_tracker = (self.inf_or_nan_tracker + flag) > 0
        return orig(self, partition_gradients)

    return has_overflow


def _step(orig):
    # The whole DeepSpeed step runs unchanged (our pieces are hooked inside it); afterwards we advance the
    # step counter of the rounding streams and record the communication summary.  An overflow (fp16) or a
    # non-finite gradient norm (bf16/fp32: flag_nonfinite_for_norm) returns early from DeepSpeed's step,
    # before any refresh: the replicas stay as they were.  DeepSpeed has partitioned every parameter by then
    # and skips _post_step, so full-level params are pointed back at their (unchanged) replicas here.
    @functools.wraps(orig)
    def step(self, *args, **kwargs):
        st = _active(self)
        if st is None:
            return orig(self, *args, **kwargs)
        st.wait()   # the last step's refresh reads the master and bf16 partitions this step writes
        flagged = st.flag_nonfinite_for_norm(self)
        try:
            result = orig(self, *args, **kwargs)
        finally:
            st.unflag(flagged)
        if self.overflow:
            st.point_params()
        st.end_step(self)
        return result

    return step


def _state_dict(orig):
    # DeepSpeed saves the fp32 partitions and restores bf16 = bf16(fp32) on load; with qWD the bf16
    # partition is the replica value (bf16(master) minus the not-yet-sent quantization residual), so we save
    # it too, with the step counter of the rounding streams.
    @functools.wraps(orig)
    def state_dict(self):
        st = _active(self)
        if st is not None:
            st.wait()
        sd = orig(self)
        if st is not None:
            extra = {"step": st.step, "topology": [st.topology.num_nodes, st.topology.gpus_per_node]}
            if st.weights is not None:
                extra["replica_partitions"] = [f.detach().clone() for f in self.fp16_partitioned_groups_flat]
            sd[_CKPT_KEY] = extra
        return sd

    return state_dict


def _rigid_load_state_dict(orig):
    @functools.wraps(orig)
    def _rigid_load(self, state_dict, load_optimizer_states=True):
        st = _active(self)
        extra = state_dict.get(_CKPT_KEY) if isinstance(state_dict, dict) else None
        if st is not None and extra is not None and extra.get("topology") is not None:
            # another layout at the same world size (the engine's load checked the world size): every rank's bf16
            # partition (replica value) is restored as saved, and the epilogue rebuilds the replicas of this
            # layout from them exactly; the rounding streams go on from the saved step with this layout's ranks
            (n0, g0), (n1, g1) = extra["topology"], (st.topology.num_nodes, st.topology.gpus_per_node)
            if (n0, g0) != (n1, g1):
                _say(f"resuming a checkpoint saved at {n0} node(s) x {g0} GPU(s) per node at {n1} x {g1}"
                     + (": the replicas are rebuilt from the loaded partitions" if st.weights is not None else ""))
        if st is not None:
            st.wait()
        orig(self, state_dict, load_optimizer_states=load_optimizer_states)
        if st is None or extra is None:
            return
        if "step" in extra:
            st.step, st.step_restored = int(extra["step"]), True
        saved = extra.get("replica_partitions")
        if st.weights is not None and saved is not None:
            flats = self.fp16_partitioned_groups_flat
            if len(saved) != len(flats) or any(a.numel() != b.numel() for a, b in zip(saved, flats)):
                raise RuntimeError("sdp4bit: the checkpoint's replica partitions do not match this model's "
                                   "sub-groups (different model, world size or sub_group_size)")
            for flat, s in zip(flats, saved):
                flat.data.copy_(s.to(device=flat.device, dtype=flat.dtype))
            for i in range(len(flats)):
                self._unflatten_partitioned_parameters(i)

    return _rigid_load


def _waiting_first(orig):
    # DeepSpeed methods that read or write the bf16 / fp32 partitions outside a step: a refresh in flight
    # (weights.overlap) finishes first.  checkpoint_event_prologue starts every save and load (universal
    # loads too, which bypass _rigid_load_state_dict); also module-only loads and refresh_fp32_params.
    @functools.wraps(orig)
    def waiting(self, *args, **kwargs):
        st = _active(self)
        if st is not None:
            st.wait()
        return orig(self, *args, **kwargs)

    return waiting


def _empty_partition_cache(orig):
    # engine.empty_partition_cache() (e.g. between generation and training in RLHF loops) releases every gathered
    # parameter.  A full replica is persistent by design, so nothing of it is freed, and a parameter left released
    # would make the next forward gather a second, unquantized copy of the model: point them back at the replica.
    release = _waiting_first(orig)   # (a refresh in flight finishes first)

    @functools.wraps(orig)
    def empty_partition_cache(self):
        release(self)
        st = _active(self)
        if st is not None:
            st.point_params()

    return empty_partition_cache


def _checkpoint_event_epilogue(orig):
    # DeepSpeed (after save and load): drop the secondaries and re-gather the persistent params from the
    # primary partitions.  We instead re-synchronise every replica exactly from the owners' bf16 partitions
    # (after a load those are the saved replica values), which also re-points full-level params.
    @functools.wraps(orig)
    def checkpoint_event_epilogue(self):
        st = _active(self)
        if st is None or st.weights is None:
            return orig(self)
        st.wait()
        # a load writes the partitions' padding as it was saved: uninitialized memory in a checkpoint that held
        # no replica (plain ZeRO-3, or SDP4Bit without weights), where a huge value or a NaN would set the scale of
        # its quantization group in every later refresh
        st.replica.zero_padding(self)
        st.resync(self)
        if st.level == "full":
            # as DeepSpeed does: any hpZ secondary partition is DeepSpeed's own here (the node replica is one,
            # kept and resynced above); one left over would hold the weights of before the load
            self.invalidate_secondary_tensor()
        else:
            # the node replica covers the optimizer's parameters only; a parameter outside it (frozen:
            # requires_grad False) keeps DeepSpeed's own hpZ secondary, which a load does not rewrite (DeepSpeed
            # writes the primary partition and drops only the optimizer's secondaries): drop it, so the next
            # gather rebuilds it from the loaded primary
            for p in self.module.parameters():
                if getattr(p, "ds_secondary_tensor", None) is not None and id(p) not in st.replica:
                    p.ds_secondary_tensor = None
        rest = [p for p in self.persistent_parameters if id(p) not in st.replica]
        if st.level == "full" and rest:
            rest[0].all_gather(rest)
        elif st.level != "full" and self.persistent_parameters:
            self.persistent_parameters[0].all_gather(self.persistent_parameters)

    return checkpoint_event_epilogue
