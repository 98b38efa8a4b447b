"""The ``"sdp4bit"`` block of a ds_config, as one pydantic model.

Unknown keys are refused (``extra="forbid"``) with a did-you-mean hint, because a misspelt key that is
silently ignored would train with defaults the user did not ask for.  Checks that need the rest of the
ds_config (ZeRO stage, ZeRO++ keys, offload) live in :func:`validate_against_ds_config`.
"""

from __future__ import annotations

import difflib
import json
import numbers
from typing import Any, Dict, List, Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BLOCK_KEY = "sdp4bit"


class SDP4BitConfigError(ValueError):
    """A bad ``sdp4bit`` block or a combination of ds_config settings that sdp4bit cannot run."""


def _nearest(word: str, options) -> Optional[str]:
    """The option spelt most like ``word`` (difflib's ratio >= 0.6), or None."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return close[0] if close else None


def _did_you_mean(word: str, options) -> str:
    close = _nearest(word, options)
    return f"; did you mean {close!r}?" if close else ""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _unknown_keys(cls, data: Any):
        # pydantic's own "extra inputs are not permitted" says nothing of what was meant: say it here.
        if isinstance(data, dict):
            allowed = set(cls.model_fields)
            said = []
            for key in data:   # every unknown key of the block in one message
                if key not in allowed:
                    home = _home_of(str(key), cls)
                    said.append(f"unknown key {key!r}"
                                + (f"; it belongs in {home}" if home else _did_you_mean(str(key), allowed)))
            if said:
                raise ValueError("; ".join(said) + f" (allowed here: {', '.join(sorted(allowed))})")
        return data


Rounding = Literal["nearest", "stochastic"]


class WeightsConfig(_Strict):
    """qWD: the weight all-gather becomes a 4-bit all-gather of differences to a persistent replica."""

    enabled: bool = Field(True,
                          description="qWD on (the weight all-gather as 4-bit differences to a persistent replica)")
    # diff = the paper's qWD; direct = the qW ablation (quantize the weights themselves: known to stall).
    mode: Literal["diff", "direct"] = Field("diff",
                                            description=("`diff` = qWD (the paper's method); `direct` = the qW "
                                                         "ablation (the weights themselves quantized; known to "
                                                         "stall)"))
    bits: Literal[4, 8] = Field(4, description="bits per value of the weight differences")
    # 2048 is the paper's choice: 4 + 32/2048 = 4.016 bits per value on the wire.
    group_size: int = Field(2048, ge=32, le=1 << 20,
                            description=("values per quantization group (one fp32 scale each); 2048 = 4.016 bits per "
                                         "value; a multiple of 32"))
    # Nearest is the paper's formula; the error is carried into the next difference either way.
    rounding: Rounding = Field("nearest",
                               description=("rounding of the differences (the error is carried into the next step "
                                            "either way)"))
    # node = one replica per node (DeepSpeed hpZ secondary partition kept across steps),
    # full = every rank keeps all weights (the paper's Megatron setting; no gathers in forward/backward).
    # Omitted = chosen when the engine is built (integration.choose_replica): full when the model's bf16 copy
    # fits ``full_replica_budget`` of the accelerator's memory, node otherwise; the choice is logged once.
    # (Never spelt "auto": HF accelerate takes every "auto" in a ds_config for its own placeholder.)
    replica: Optional[Literal["node", "full"]] = Field(None,
                                                       description=("`node` = one bf16 copy per node (DeepSpeed's "
                                                                    "hpZ partition), `full` = the whole bf16 model "
                                                                    "on every rank (no weight gathers in forward and "
                                                                    "backward)"))
    # Fraction of one accelerator's memory the full bf16 replica (2 bytes per parameter) may take when
    # ``replica`` is omitted.  0.25 leaves three quarters for activations, master weights and optimizer state.
    full_replica_budget: float = Field(0.25, gt=0.0, le=1.0,
                                       description=("the share of one accelerator's memory (host RAM under "
                                                    "DeepSpeed's CPU accelerator) a `full` replica may take when "
                                                    "`replica` is omitted"))
    # The step's refresh runs in this many pieces (fewer where a piece would hold less than 16 quantization
    # groups per rank), cut at module boundaries by parameter count in the order the model registers its
    # modules; each piece is quantized, exchanged and applied on its own (its own quantization groups), so
    # the exchange buffers hold one piece, not a whole sub-group.  Full replica, with ``overlap``: the pieces
    # run on a side stream and a module's forward waits only for the pieces holding the parameters below it
    # (as FSDP2 prefetches), so the next forward starts before the whole exchange has arrived; without it the
    # refresh completes inside ``step()``.  The node replica is always refreshed inside ``step()`` (DeepSpeed's
    # own gathers read it, prefetching ahead of the forward).
    pieces: int = Field(16, ge=1, le=256,
                        description=("the weight refresh after each step runs in this many pieces cut at module "
                                     "boundaries (smaller exchange buffers)"))
    # Omitted (None) = decided when the engine is built (integration.choose_overlap): on where the link between
    # nodes, probed then (Topology.probe_inter_gbps), carries less than ``overlap_below_gbps`` per rank, logged
    # once.  Timed both ways in one process with one rank per GPU, the overlap ran faster in every cell measured
    # at 5 Gb/s per rank and was resolved as slower nowhere, but at about 14 Gb/s three cells had an upper 95%
    # bound above 1.01 (benchmarks/results/findings.md, "overlap"): so where the link is fast it stays off.
    overlap: Optional[bool] = Field(None,
                                    description=("`full` replica on a GPU: the pieces on a side stream, each "
                                                 "module's forward waiting only for its own; with it, DeepSpeed's "
                                                 "timers.throughput.synchronized is set to false where omitted and "
                                                 "refused where true (the automatic choice stays off instead). "
                                                 "`true` / `false` force it"))
    # 6: e2e's own probe in the 22nd session's runs read 3.9-4.9 Gb/s per rank at the 5 Gb/s knob (the overlap
    # faster in every cell) and 11.6-14.5 unshaped (one run 4.93), where its gain was not resolved in most cells;
    # the engine's probe reads about the knob's rate at the knob but read 37.95 where e2e's read 14.4 (23rd session).
    overlap_below_gbps: float = Field(6.0, gt=0.0, le=1e6,
                                      description=("with `overlap` omitted: the overlap is on where the link between "
                                                   "nodes, probed when the engine is built, carries less than this "
                                                   "many Gb/s per rank"))

    @model_validator(mode="after")
    def _threshold_only_for_the_automatic_choice(self):
        if "overlap_below_gbps" in self.model_fields_set and self.overlap is not None:
            raise ValueError(f"overlap_below_gbps is read only when overlap is omitted (the automatic choice), but "
                             f"overlap is {json.dumps(self.overlap)}: remove one of the two keys")
        return self

    @field_validator("group_size")
    @classmethod
    def _even(cls, v):
        if v % 32:
            raise ValueError(f"must be a multiple of 32 (kernel tiles, int4 packing), got {v}")
        return v


class GradientsConfig(_Strict):
    """TLq-HS: the gradient reduce-scatter becomes two quantized all-to-alls."""

    enabled: bool = Field(True, description="TLq-HS on (the gradient reduce-scatter as two quantized all-to-alls)")
    # 16 = that level is sent unquantized (in the communication dtype).
    intra_bits: Literal[4, 8, 16] = Field(8, description="bits per value inside a node (16 = unquantized)")
    inter_bits: Literal[4, 8, 16] = Field(4, description="bits per value between nodes (16 = unquantized)")
    group_size: int = Field(128, ge=32, le=1 << 16,
                            description="values per quantization group; a multiple of 32 and of `hadamard_size`")
    hadamard: bool = Field(True, description="the Hadamard transform before quantizing (spreads outliers over a block)")
    hadamard_size: int = Field(32, description="Hadamard block size: a power of two in 32..256")
    # The authors' code rounds gradients stochastically (unbiased); nearest is available for ablations.
    rounding: Rounding = Field("stochastic",
                               description=("rounding of the gradient quantization (stochastic: unbiased, as the "
                                            "authors' code)"))
    # Split each bucket so chunk i's inter-node all-to-all overlaps chunk i+1's intra-node one.
    pipeline_chunks: int = Field(1, ge=1, le=64,
                                 description=("chunks per bucket, so one chunk's inter-node all-to-all overlaps the "
                                              "next one's intra-node work"))
    # Each parameter's piece of a bucket starts a new quantization group (and Hadamard block), so a large
    # gradient's abs-max never sets the scale of a neighbouring bias or norm gain (issue 21); costs < group_size
    # zeros per parameter per segment.  False = DeepSpeed's packed layout (for ablations).
    align_params: bool = Field(True,
                               description=("each parameter's piece of a bucket starts a new quantization group (a "
                                            "bias never shares a large weight gradient's scale); `false` = "
                                            "DeepSpeed's packed layout, for ablations"))

    # Issue 21: the 4-bit inter-node level's rounding error carried into the next step's send (as qWD carries the
    # weights'), so the sum of what is sent over the steps follows the sum of the true gradients.
    error_feedback: bool = Field(False,
                                 description=("ablation: carry the inter-node level's quantization error into the "
                                              "next step's send (a bf16 residual per rank: 2 bytes per parameter / "
                                              "gpus_per_node; not in checkpoints; not with fp16); measured: a larger "
                                              "loss gap, not a smaller one"))

    # Issue 21: under a short lr warm-up the 4-bit node sums cost loss right after the lr peak, the trajectory leaving
    # ZeRO-3's there; 8 bits between nodes for the first steps only (then inter_bits) measured closer to ZeRO-3 in
    # the GPU simulation (benchmarks/results/accuracy_sim/README.md).  Opt-in until measured under every schedule.
    inter8_steps: int = Field(0, ge=0, le=1 << 30,
                              description=("the first N optimizer steps (overflow-skipped ones included) send the "
                                           "inter-node level at 8 bits, then `inter_bits` (4); 0 = never; for short "
                                           "lr warm-ups: measured closer to ZeRO-3 with 100 (a checkpoint resumes "
                                           "the count)"))

    @field_validator("hadamard_size")
    @classmethod
    def _pow2(cls, v):
        if v < 32 or v > 256 or v & (v - 1):
            raise ValueError(f"must be a power of two in 32..256, got {v}")
        return v

    @model_validator(mode="after")
    def _group_vs_hadamard(self):
        if self.group_size % 32:
            raise ValueError(f"group_size must be a multiple of 32 (kernel tiles, 4-bit packing), got "
                             f"{self.group_size}")
        if self.error_feedback and self.inter_bits == 16:
            raise ValueError("error_feedback carries the inter-node level's quantization error, but inter_bits is "
                             "16 (unquantized): set inter_bits to 4 or 8, or error_feedback to false")
        if self.inter8_steps and self.inter_bits != 4:
            raise ValueError(f"inter8_steps sends the inter-node level at 8 bits before it drops to inter_bits 4, but "
                             f"inter_bits is {self.inter_bits}: set inter8_steps to 0 (omit it), or inter_bits to 4")
        if self.hadamard and self.group_size % self.hadamard_size:
            raise ValueError(f"group_size ({self.group_size}) must be a multiple of hadamard_size "
                             f"({self.hadamard_size}): scales are computed over whole transformed blocks")
        return self


class TopologyConfig(_Strict):
    # Omitted (None) = the launcher's LOCAL_WORLD_SIZE; an int lets one host act as several logical nodes.
    gpus_per_node: Optional[int] = Field(None,
                                         description=("ranks per node; an integer lets one host act as several "
                                                      "logical nodes"))

    @field_validator("gpus_per_node")
    @classmethod
    def _positive(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"topology.gpus_per_node must be a positive integer (omit it for the launcher's "
                             f"LOCAL_WORLD_SIZE), got {v!r}")
        return v


class SDP4BitConfig(_Strict):
    """The whole ``"sdp4bit"`` block."""

    enabled: bool = Field(True, description="SDP4Bit on (`false`, or no block: plain ZeRO-3)")
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    gradients: GradientsConfig = Field(default_factory=GradientsConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    # Omitted (None): on GPUs each op from the fastest measured backend that runs there (ops.AUTO_ORDER, the
    # backend ops.py calls "auto"), torch on CPU.  A name forces that backend for every op.
    kernel_backend: Optional[Literal["cuda", "triton", "torch"]] = Field(None,
                                                                         description="kernel backend for every op")
    # Seeds every stochastic-rounding stream together with (step, rank, bucket, level): reproducible runs.
    seed: int = Field(1234, ge=0, lt=1 << 32,
                      description=("seeds every stochastic-rounding stream (with step, rank, bucket, level): "
                                   "reproducible runs"))
    # Print the per-step communication summary every N optimizer steps on rank 0 (0 = never).
    summary_interval: int = Field(0, ge=0,
                                  description=("print the per-step communication summary every N optimizer steps on "
                                               "rank 0 (0 = never)"))
    # With one node there is no slow link to save: SDP4Bit stays off (plain ZeRO-3, bit for bit) unless this
    # is true.  Inside a node NVLink carries ZeRO-3's bf16 collectives faster than a quantized all-to-all.
    quantize_single_node: bool = Field(False,
                                       description=("quantize on a single node too (off: one node has no slow link, "
                                                    "and NVLink carries ZeRO-3's bf16 collectives faster)"))

    @property
    def active(self) -> bool:
        return self.enabled and (self.weights.enabled or self.gradients.enabled)

    @property
    def never_overlaps(self) -> Optional[str]:
        """Why a run of this config never overlaps its weight refresh, as words that follow its name ("runs
        without SDP4Bit", "runs without the weight replica", "turns off": ``weights.overlap`` false); None where it
        may: ``weights.overlap`` true, or omitted (the engine decides: on a GPU with the full replica between
        nodes, by its probe of the link)."""
        if not self.active:
            return "runs without SDP4Bit"
        if not self.weights.enabled:
            return "runs without the weight replica"
        return "turns off" if self.weights.overlap is False else None

    @property
    def backend_name(self) -> str:
        """The name for :func:`deepspeed_sdp4bit.ops.get_backend`: the key's value, or its automatic choice."""
        return self.kernel_backend or "auto"


# What an omitted key means, for the keys whose default is chosen at run time (named in the "auto" error).
AUTOMATIC = {
    "topology.gpus_per_node": "the launcher's LOCAL_WORLD_SIZE",
    "kernel_backend": "per op the fastest kernel backend that runs on the device",
    "weights.replica": "`full` when the bf16 copy fits `full_replica_budget`, else `node` (logged)",
    "weights.overlap": ("on where the link between nodes, probed when the engine is built, is slower than "
                        "`overlap_below_gbps` (logged)"),
}


def key_table() -> str:
    """Every key of the block as a markdown table (key, default, allowed values, the field's description):
    README.md's key reference (``python -m deepspeed_sdp4bit --keys``; the tests check the README against it)."""
    def allowed(field) -> str:
        ann = field.annotation
        args = [a for a in get_args(ann) if a is not type(None)]
        lits = [x for a in args for x in get_args(a)] or list(get_args(ann))
        if lits and all(not isinstance(x, type) for x in lits):
            return ", ".join(f"`{json.dumps(x)}`" for x in lits)
        lo = hi = ""
        for m in field.metadata:
            if getattr(m, "ge", None) is not None:
                lo = f"{m.ge}"
            if getattr(m, "gt", None) is not None:
                lo = f"> {m.gt}"
            if getattr(m, "le", None) is not None:
                hi = f"{m.le}"
            if getattr(m, "lt", None) is not None:
                hi = f"< {m.lt}"
        kind = {int: "integer", float: "number", bool: "`true`, `false`"}[args[0] if args else ann]
        return kind + (f" {lo}..{hi}" if lo or hi else "")

    rows = ["| key | default | allowed | what |", "|---|---|---|---|"]
    for prefix, model in (("", SDP4BitConfig), ("weights.", WeightsConfig), ("gradients.", GradientsConfig),
                          ("topology.", TopologyConfig)):
        for name, field in model.model_fields.items():
            if isinstance(field.default_factory, type):   # a section: its keys follow
                continue
            if not field.description:
                raise AssertionError(f"sdp4bit.{prefix}{name} has no description")
            default = ("omitted: " + AUTOMATIC.get(prefix + name, "chosen at run time") if field.default is None
                       else f"`{json.dumps(field.default)}`")
            rows.append(f"| `{prefix}{name}` | {default} | {allowed(field)} | {field.description} |")
    return "\n".join(rows) + "\n"


def _home_of(key: str, where) -> Optional[str]:
    """Where an unknown ``key`` of section ``where`` is a key after all (``sdp4bit.gradients.hadamard`` for a
    ``hadamard`` written at the top of the block), or None."""
    sections = {"": SDP4BitConfig, "weights.": WeightsConfig, "gradients.": GradientsConfig,
                "topology.": TopologyConfig}
    homes = [f"{BLOCK_KEY}.{prefix}{key}" for prefix, model in sections.items()
             if model is not where and key in model.model_fields]
    return " or ".join(homes) or None


def _wants_int(annotation) -> bool:
    """Whether a field takes integers (int, Optional[int], Literal[4, 8], ...)."""
    if annotation is int:
        return True
    return any(_wants_int(a) or (isinstance(a, int) and not isinstance(a, bool)) for a in get_args(annotation))


def _json_kind(annotation) -> Optional[str]:
    """The JSON type a field takes: "boolean", "integer", "number", or None (strings, sections)."""
    args = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    if all(a is bool for a in args):
        return "boolean"
    if _wants_int(annotation):
        return "integer"
    if all(a is float for a in args):
        return "number"
    return None


def _is_bool(value) -> bool:
    # (numpy's too, as a dict built in Python may carry: np.bool_, called np.bool since numpy 2)
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value)   # (numpy's numbers too)


_JSON_TYPES = {bool: "a boolean", str: "a string", int: "an integer", float: "a number", list: "a list",
               dict: "an object"}   # what json.loads gives, in words


def _said(value) -> str:
    """A raw value as an error shows it: JSON with its type in words (null alone), else its repr and type name."""
    if value is None:
        return "null"
    if type(value) in _JSON_TYPES:
        return f"{json.dumps(value)} ({_JSON_TYPES[type(value)]})"
    return f"{value!r} ({type(value).__name__})"


_KIND_WORDS = {"boolean": "`true` or `false`", "integer": "an integer", "number": "a number"}


def _raw_problems(block: Dict[str, Any], model, prefix: str) -> List[str]:
    """What pydantic would not say about the raw JSON values: "auto" strings, values of the wrong JSON type.

    "auto" is refused in every key: Hugging Face accelerate treats ANY "auto" in a ds_config as its own
    placeholder to fill (and raises for keys it does not know), so our automatic choices are omitted keys.
    pydantic's lax mode would read ``true`` as 1 for an integer key, ``"4"`` as 4, and ``"no"``, ``"off"`` or
    ``0`` as false for a boolean key (so a typo'd word could switch a feature off): a value whose JSON type
    is not the key's is refused here, naming the key and what was given.
    """
    out = []
    for key, value in block.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue  # unknown keys are reported by the model, with a did-you-mean
        path = f"{prefix}{key}"
        if isinstance(value, str) and value.strip().lower() == "auto":
            meant = AUTOMATIC.get(path)
            out.append(f"{path}: {json.dumps(value)} is not a value here; omit the key for "
                       + (f"the automatic choice ({meant})" if meant else "its default")
                       + ' (Hugging Face accelerate reserves "auto" in a ds_config for its own placeholders)')
        elif (kind := _json_kind(field.annotation)) is not None and not (
                value is None and type(None) in get_args(field.annotation)) and not (
                _is_bool(value) if kind == "boolean" else _is_number(value)):
            out.append(f"{path}: must be {_KIND_WORDS[kind]}, got {_said(value)}")
        elif isinstance(value, dict) and isinstance(field.annotation, type) and issubclass(field.annotation, _Strict):
            out += _raw_problems(value, field.annotation, path + ".")
    return out


def _format_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        elif err.get("type") == "model_type":   # pydantic names its class ("... instance of WeightsConfig")
            msg = f"must be a JSON object of keys, got {json.dumps(err.get('input'), default=str)}"
        elif err.get("type") in ("literal_error", "enum"):   # "Input should be 4 or 8": say what was given
            msg = f"{msg}, got {_said(err.get('input'))}"
        lines.append(f"  {BLOCK_KEY}.{loc}: {msg}" if loc else f"  {BLOCK_KEY}: {msg}")
    return "invalid sdp4bit config:\n" + "\n".join(lines)


def parse_block(block: Optional[Dict[str, Any]]) -> SDP4BitConfig:
    """Validate an ``sdp4bit`` block (a dict) into :class:`SDP4BitConfig`."""
    if block is None:
        return SDP4BitConfig(enabled=False)
    if isinstance(block, SDP4BitConfig):
        return block
    if not isinstance(block, dict):
        raise SDP4BitConfigError(f"the {BLOCK_KEY!r} block must be a JSON object, got {type(block).__name__}")
    problems = [f"  {BLOCK_KEY}.{p}" for p in _raw_problems(block, SDP4BitConfig, "")]
    try:
        parsed, error = SDP4BitConfig.model_validate(block), None
    except ValidationError as e:
        parsed, error = None, _format_error(e)
    except Exception:   # noqa: BLE001 - a validator tripped by a value the raw check already names
        if not problems:
            raise
        parsed, error = None, None
    if problems:
        # every problem in one message: the model's own (unknown keys with a did-you-mean, ranges) where the raw
        # check did not already name that key
        named = {p.split(":", 1)[0] for p in problems}

        def own(line: str) -> bool:
            # the model's line for a key the raw check named, or a check of its section across keys (which read
            # the value pydantic converted, e.g. true as 1): left out; an unknown key of that section is kept
            at = line.split(":", 1)[0]
            return at not in named and ("unknown key" in line or not any(n.startswith(at + ".") for n in named))
        more = [x for x in (error or "").splitlines()[1:] if own(x)]
        raise SDP4BitConfigError("invalid sdp4bit config:\n" + "\n".join(problems + more))
    if error is not None:
        raise SDP4BitConfigError(error)
    return parsed


def _normalize(key: str) -> str:
    return "".join(ch for ch in key.lower() if ch.isalnum())


def find_block(ds_config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``sdp4bit`` block of a ds_config dict, or None.

    DeepSpeed ignores unknown top-level keys, so a misspelt ``"sdp4bits"`` or ``"SDP4Bit"`` would silently
    train without SDP4Bit: any top-level key that looks like ours but is not exactly ``sdp4bit`` is an error.
    """
    for key in ds_config:
        if key == BLOCK_KEY:
            continue
        norm = _normalize(str(key))
        if "sdp4" in norm or difflib.SequenceMatcher(None, norm, BLOCK_KEY).ratio() >= 0.75:
            raise SDP4BitConfigError(f"ds_config has a top-level key {key!r}; did you mean {BLOCK_KEY!r}? "
                                     f"(DeepSpeed would silently ignore it)")
    if BLOCK_KEY in ds_config and ds_config[BLOCK_KEY] is None:
        # null is neither "on with defaults" ({}) nor "off" ({"enabled": false}): refused like any non-object.
        raise SDP4BitConfigError(f'the {BLOCK_KEY!r} block is null; write {{}} for SDP4Bit with its defaults, '
                                 f'{{"enabled": false}} (or no {BLOCK_KEY!r} key) to train without it')
    return ds_config.get(BLOCK_KEY)


def _get(d: Dict[str, Any], *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _ds_true(value: Any) -> bool:
    """Whether DeepSpeed's (lax, pydantic) config models read ``value`` as true: ``true``, a non-zero number, or a
    string such as "true", "1", "yes", "on"."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "y", "on", "t")
    return isinstance(value, (bool, int, float)) and bool(value)


def ds_int(value: Any, default: int = 1) -> int:
    """An integer key of DeepSpeed's own config as its (lax, pydantic) models read it: "2" and 2.0 are 2; absent
    (None) is ``default``; what they cannot read is left to DeepSpeed to refuse (``default`` here)."""
    if value is None:
        return default
    try:
        return int(value) if not isinstance(value, str) else int(value.strip())
    except (TypeError, ValueError):
        return default


def hpz_size(ds_config: Dict[str, Any]) -> int:
    """``zero_optimization.zero_hpz_partition_size`` as DeepSpeed reads it (1: no hpZ)."""
    return max(1, ds_int((ds_config.get("zero_optimization") or {}).get("zero_hpz_partition_size"), 1))


def validate_against_ds_config(cfg: SDP4BitConfig, ds_config: Dict[str, Any]) -> None:
    """Refuse ds_config combinations that sdp4bit does not support, naming the key."""
    if not cfg.active:
        return
    zero = ds_config.get("zero_optimization") or {}
    if not isinstance(zero, dict):   # DeepSpeed's legacy boolean form is stage 1
        raise SDP4BitConfigError(f"sdp4bit needs zero_optimization to be a block with stage 3 (sharded data "
                                 f"parallelism), got {ds_config.get('zero_optimization')!r}")
    stage = zero.get("stage", 0)
    if isinstance(stage, str) and stage.strip().isdigit():
        stage = int(stage)  # DeepSpeed's own config model reads "3" as 3
    if isinstance(stage, bool) or stage != 3:
        near = _nearest("zero_optimization", [k for k in ds_config if k != BLOCK_KEY])
        missing = "" if "zero_optimization" in ds_config else " (no zero_optimization block" + (
            f"; the ds_config has {near!r}: a misspelling?" if near else "") + ")"
        raise SDP4BitConfigError(f"sdp4bit needs zero_optimization.stage = 3 (sharded data parallelism), "
                                 f"got {zero.get('stage', 0)!r}{missing}")
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if _ds_true(zero.get(key)):
            raise SDP4BitConfigError(f"zero_optimization.{key} (ZeRO++) cannot be combined with sdp4bit: both "
                                     f"replace the same collective; remove one of them")
    for key in ("offload_param", "offload_optimizer"):
        device = _get(zero, key, "device", default="none")
        if device not in (None, "none"):
            raise SDP4BitConfigError(f"zero_optimization.{key}.device={device!r} is not supported by sdp4bit "
                                     f"yet (the replica and master shards must live on the accelerator); "
                                     f"use 'none'")
    # (DeepSpeed also reads the bf16 block under its old name, "bfloat16")
    for block, key in (("bf16", "bf16_master_weights_and_grads"), ("bfloat16", "bf16_master_weights_and_grads"),
                       ("fp16", "fp16_master_weights_and_grads")):
        if cfg.weights.enabled and _ds_true(_get(ds_config, block, key)):
            raise SDP4BitConfigError(f"{block}.{key} keeps the optimizer's master weights in 16 bits; "
                                     f"sdp4bit.weights sends the difference between an fp32 master and the bf16 "
                                     f"replica and needs the fp32 master: set it to false, or sdp4bit.weights.enabled "
                                     f"to false")
    if _ds_true(_get(ds_config, "compile", "deepcompile")):
        raise SDP4BitConfigError("compile.deepcompile replaces ZeRO-3's gradient hooks and parameter gathers with "
                                 "its own passes, which sdp4bit does not hook (its collectives would be bypassed): "
                                 "set it to false, or remove the sdp4bit block")
    tp = _get(ds_config, "tensor_parallel", "autotp_size", default=1)
    if ds_int(tp) > 1:
        raise SDP4BitConfigError(f"tensor_parallel.autotp_size={tp!r}: model parallelism together with sdp4bit is "
                                 f"not supported yet (the data-parallel group must be the whole world); remove it "
                                 f"or the sdp4bit block")
    hpz = hpz_size(ds_config)
    if cfg.weights.enabled and cfg.weights.replica == "full" and hpz != 1:
        raise SDP4BitConfigError(f"sdp4bit.weights.replica='full' keeps all weights on every rank; "
                                 f"zero_optimization.zero_hpz_partition_size={hpz} makes no sense with it "
                                 f"(remove it or use replica='node')")
    if cfg.gradients.enabled and cfg.gradients.error_feedback and _ds_true(_get(ds_config, "fp16", "enabled")):
        raise SDP4BitConfigError("sdp4bit.gradients.error_feedback does not support fp16 yet (its residuals would "
                                 "carry the loss scale of the step that made them): use bf16, or set "
                                 "error_feedback to false")
    gpn = cfg.topology.gpus_per_node
    # An omitted replica with an explicit hpZ size > 1 becomes "node" (integration.choose_replica).
    replica = cfg.weights.replica or ("node" if hpz != 1 else None)
    if (cfg.weights.enabled and replica == "node" and hpz != 1 and gpn is not None
            and hpz != gpn):
        raise SDP4BitConfigError(f"zero_optimization.zero_hpz_partition_size={hpz} must equal "
                                 f"sdp4bit.topology.gpus_per_node={gpn} (the replica is one copy per node)")


def parse_ds_config(ds_config: Dict[str, Any]) -> SDP4BitConfig:
    """Find, parse and cross-check the ``sdp4bit`` block of a whole ds_config dict."""
    cfg = parse_block(find_block(ds_config))
    validate_against_ds_config(cfg, ds_config)
    return cfg
