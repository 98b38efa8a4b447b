"""DeepSpeed op builder of the SDP4Bit CUDA kernels (``csrc/sdp4bit_*``).

Loaded by file path from ``deepspeed_sdp4bit/_native.py`` (never as a top-level ``op_builder`` package,
a name DeepSpeed probes for its own builders).  ``SDP4BitBuilder(csrc_dir=...).load()`` JIT-builds the
extension through DeepSpeed/torch (cached under ``TORCH_EXTENSIONS_DIR``), ``.builder()`` gives a
setuptools ``CUDAExtension`` for ahead-of-time builds.

Why the overrides:

* ``compute_capability_args``: DeepSpeed 0.19.8's parser does ``int("0a")`` and crashes on arch-specific
  entries such as ``9.0a``, which is what Hopper machines preset.  We parse ``X.Y``, ``X.Ya``, ``X.Yf`` and
  ``+PTX`` ourselves and always return explicit ``-gencode`` flags (torch then adds none of its own), so
  ``9.0a`` builds ``-gencode=arch=compute_90a,code=sm_90a``.
* ``nvcc_args``: DeepSpeed's default adds ``--use_fast_math``, which flushes fp32 denormals to zero; group
  scales of tiny gradients are denormal, and the reference keeps them.  The kernels use explicitly rounded
  intrinsics, and ``--fmad=false`` keeps any other arithmetic from being contracted as well.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

from deepspeed.ops.op_builder.builder import CUDAOpBuilder

# one .cu per op family so that ninja compiles them in parallel
# (op 1's kernel template, the slowest to compile, once per input dtype: ~35 s each instead of ~100 s as one file)
SOURCES = ("sdp4bit_quantize.cu", "sdp4bit_quantize_f32.cu", "sdp4bit_quantize_f16.cu", "sdp4bit_quantize_bf16.cu",
           "sdp4bit_reduce.cu", "sdp4bit_weights.cu", "sdp4bit_bindings.cpp")
HEADERS = ("sdp4bit_kernels.cuh", "sdp4bit_device.cuh", "sdp4bit_quantize_impl.cuh")

# Names torch accepts in TORCH_CUDA_ARCH_LIST, mapped to numeric entries (Hopper gets its full target).
_NAMED_ARCHES = {
    "volta": "7.0", "turing": "7.5", "ampere": "8.0;8.6", "ada": "8.9", "hopper": "9.0a",
    "blackwell": "10.0;12.0",
}
_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([af]?)(\+ptx)?$", re.IGNORECASE)

# The env var that, when set, picks the archs of this op alone (DeepSpeed's own ops keep
# TORCH_CUDA_ARCH_LIST).
ARCH_ENV = "SDP4BIT_CUDA_ARCH_LIST"


def parse_arch_list(text: str, source: str = "TORCH_CUDA_ARCH_LIST") -> List[Tuple[int, int, str, bool]]:
    """Parse an arch list (``;`` or space separated) into sorted unique ``(major, minor, suffix, ptx)``.

    Accepts ``8.0``, ``9.0a``, ``10.0f``, ``8.6+PTX`` and the names torch knows (``Hopper`` -> ``9.0a``).
    Raises ``ValueError`` naming ``source`` for anything else.
    """
    items = [t for t in re.split(r"[;\s]+", text.strip()) if t]
    if not items:
        raise ValueError(f"{source} is empty")
    out = {}
    for item in items:
        expanded = _NAMED_ARCHES.get(item.lower().replace("+ptx", ""))
        if expanded is not None:
            ptx = item.lower().endswith("+ptx")
            subs = [f"{e}+PTX" if ptx and i == len(expanded.split(";")) - 1 else e
                    for i, e in enumerate(expanded.split(";"))]
        else:
            subs = [item]
        for sub in subs:
            m = _ARCH_RE.match(sub)
            if not m:
                raise ValueError(f"{source}: cannot parse arch {item!r} (expected e.g. 8.0, 9.0a, 8.6+PTX or Hopper)")
            key = (int(m.group(1)), int(m.group(2)), m.group(3).lower())
            out[key] = out.get(key, False) or bool(m.group(4))
    return [(ma, mi, suf, ptx) for (ma, mi, suf), ptx in sorted(out.items())]


def gencode_flags(archs: List[Tuple[int, int, str, bool]]) -> List[str]:
    """``-gencode`` flags for parsed archs: SASS for each, plus PTX where ``+PTX`` was asked for."""
    flags = []
    for major, minor, suffix, ptx in archs:
        num = f"{major}{minor}{suffix}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def default_csrc_dir() -> str:
    """``csrc/`` beside this file's folder (a source checkout, or the wheel's ``_native`` copy)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


class SDP4BitBuilder(CUDAOpBuilder):
    """Builds ``sdp4bit_quant``: the five SDP4Bit ops (see ``csrc/sdp4bit_kernels.cuh``)."""

    BUILD_VAR = "DS_BUILD_SDP4BIT_QUANT"
    NAME = "sdp4bit_quant"

    def __init__(self, name: Optional[str] = None, csrc_dir: Optional[str] = None):
        super().__init__(name=self.NAME if name is None else name)
        self.csrc_dir = os.path.abspath(csrc_dir or default_csrc_dir())

    def absolute_name(self) -> str:
        # where an ahead-of-time build (setup.py, builder()) puts the module; _native.py imports it first
        return f"deepspeed_sdp4bit._{self.NAME}_op"

    def sources(self) -> List[str]:
        # absolute paths: DeepSpeed resolves relative ones against its own package
        return [os.path.join(self.csrc_dir, s) for s in SOURCES]

    def include_paths(self) -> List[str]:
        return [self.csrc_dir]

    def is_compatible(self, verbose: bool = False) -> bool:
        missing = [p for p in self.sources() + [os.path.join(self.csrc_dir, h) for h in HEADERS]
                   if not os.path.isfile(p)]
        if missing:
            self.warning(f"{self.NAME}: sources not found: {missing}")
            return False
        return super().is_compatible(verbose)

    def _arch_text(self, cross_compile_archs: Optional[str]) -> Tuple[str, str]:
        """The arch list to build and where it came from."""
        own = os.environ.get(ARCH_ENV, "").strip()
        if own:
            return own, ARCH_ENV
        # In JIT mode DeepSpeed stashes the caller's TORCH_CUDA_ARCH_LIST before touching the variable.
        stashed = getattr(self, "_jit_arch_list", None) if self.jit_mode else None
        env = (stashed or os.environ.get("TORCH_CUDA_ARCH_LIST", "")).strip()
        if env:
            return env, "TORCH_CUDA_ARCH_LIST"
        if cross_compile_archs:
            return cross_compile_archs, "cross_compile_archs"
        import torch
        if torch.cuda.is_available():
            caps = []
            for i in range(torch.cuda.device_count()):
                major, minor = torch.cuda.get_device_capability(i)
                # Hopper's arch-specific target: the kernels need nothing beyond sm_90, but it is the chip's
                # full target and the tested one.
                caps.append(f"{major}.{minor}{'a' if (major, minor) == (9, 0) else ''}")
            return ";".join(caps), "the visible GPUs"
        return "8.0;9.0", "the default (no GPU visible, no arch list set)"

    def compute_capability_args(self, cross_compile_archs: Optional[str] = None) -> List[str]:
        """Explicit ``-gencode`` flags; understands ``9.0a`` (DeepSpeed 0.19.8's own parser does not)."""
        text, source = self._arch_text(cross_compile_archs)
        archs = parse_arch_list(text, source)
        # DeepSpeed reads this flag to add -DBF16_AVAILABLE; the kernels only convert bf16, which any
        # arch CUDA 12+ supports, so it is informational.
        self.enable_bf16 = all(major >= 8 for major, _, _, _ in archs)
        return gencode_flags(archs)

    def nvcc_args(self) -> List[str]:
        if self.build_for_cpu:
            return []
        try:
            threads = int(os.environ.get("DS_NVCC_THREADS", "0"))
        except ValueError:
            threads = 0
        if threads <= 0:
            threads = min(os.cpu_count() or 1, 8)
        return ["-O3", "-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
                f"--threads={threads}", "-lineinfo"] + self.compute_capability_args()

    def cxx_args(self) -> List[str]:
        return [a for a in super().cxx_args() if a != "-g"]
