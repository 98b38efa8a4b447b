"""A/B of the Triton row kernels' optional steps: the inline PTX (``triton_backend._PTX_ROUND``: rounding and
packing in ops 1 and 2; ``_PTX_DECODE``: decoding in op 2; ``_PTX_WIDEN``: bf16 widening in op 1) and the
unrolled chunk loop of op 2 (``_UNROLL_CHUNKS``). Switch the named ones off, then run ``bench_kernels.py``
with the remaining arguments.

    python benchmarks/ab_triton_ptx.py _PTX_DECODE --out ab.json --sizes-mb 128,2048 --backends triton \
        --no-deepspeed

The first argument is a comma-separated list of those names ("" or "none": all steps on). They are read when a
kernel first compiles or launches, so they are set before any kernel runs; each switched-off step is replaced by
plain Triton code (or the run-time loop) with the same bits.
"""
import os
import sys

import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepspeed_sdp4bit.kernels import triton_backend as T  # noqa: E402

import bench_kernels  # noqa: E402

STEPS = ("_PTX_ROUND", "_PTX_DECODE", "_PTX_WIDEN", "_UNROLL_CHUNKS")

if __name__ == "__main__":
    off = [s for s in sys.argv[1].split(",") if s and s != "none"]
    bad = [s for s in off if s not in STEPS]
    if bad:
        sys.exit(f"unknown step(s) {bad}; choose from {STEPS}")
    for name in off:
        setattr(T, name, tl.constexpr(False))
    print(f"steps off: {off or 'none'}; on: {[s for s in STEPS if s not in off and bool(getattr(T, s))]}")
    bench_kernels.main(sys.argv[2:])
