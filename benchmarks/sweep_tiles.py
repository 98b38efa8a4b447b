"""Work per program (Triton) and threads per block (CUDA) against op speed, at the sizes where the tail of the
grid matters (64 MiB and up: a few waves of programs).

    python benchmarks/sweep_tiles.py --sizes-mb 64,128,512 --triton-rows 32,64,128,256 --cuda-threads 64,128,256

Triton: ``triton_backend._GPU_ROWS`` rows per program, one per thread (32 rows = one warp).  CUDA: the
extension rebuilt from a copy of ``csrc/`` with ``kWideThreads`` threads per block in the wide kernels (ops 1-3
on the gradient path; their launch bounds keep the resident warps per SM, so the register caps stay); the
in-tree value is built as it is.  Each variant is first checked against the reference
(``bench_kernels.check_correct``).

Cases: op 1 (bf16, Hadamard 32, 8-bit g128, stochastic, swizzle), op 2 with k = 4 and k = 2 (8-bit g128 -> 4-bit
g128), op 3 with k = 2 (4-bit g128 -> bf16, Hadamard 32), as in bench_kernels.py and bench_chunk_counts.py.
Prints % of the copy bandwidth of the same size and writes the rows as JSON when ``--out`` is given.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_chunk_counts as C  # noqa: E402
import bench_kernels as B  # noqa: E402

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def variant_csrc(threads: int, root: str) -> str:
    """A copy of csrc/ whose wide kernels (ops 1-3) have ``threads`` threads per block (launch bounds follow)."""
    dst = os.path.join(root, f"csrc_t{threads}")
    shutil.copytree(CSRC, dst)
    path = os.path.join(dst, "sdp4bit_device.cuh")
    text = open(path).read()
    new, count = re.subn(r"constexpr int kWideThreads = \d+;", f"constexpr int kWideThreads = {threads};", text)
    if count != 1:
        raise RuntimeError(f"{path}: expected one kWideThreads definition, found {count}")
    open(path, "w").write(new)
    return dst


def in_tree_threads() -> int:
    text = open(os.path.join(CSRC, "sdp4bit_device.cuh")).read()
    return int(re.search(r"constexpr int kWideThreads = (\d+);", text).group(1))


BUILD = """
import sys
from deepspeed_sdp4bit import _native
b = _native.builder_module().SDP4BitBuilder(name=sys.argv[1], csrc_dir=sys.argv[2])
b.load(verbose=False)
print("built", sys.argv[1])
"""


def start_builds(threads, root):
    """{threads: (name, csrc_dir, process)}: the variants compile in parallel subprocesses."""
    jobs = {}
    for t in threads:
        if t != in_tree_threads():
            name, src = f"sdp4bit_quant_t{t}", variant_csrc(t, root)
            jobs[t] = (name, src, subprocess.Popen([sys.executable, "-c", BUILD, name, src]))
    return jobs


def load_variant(job):
    from deepspeed_sdp4bit import _native
    name, src, proc = job
    if proc.wait() != 0:
        raise RuntimeError(f"building {name} failed")
    return _native.builder_module().SDP4BitBuilder(name=name, csrc_dir=src).load(verbose=False)


def cases(size):
    ops = B.op_cases(size)[:3]  # op 1, op 2 (k = 4), op 3 (k = 2)
    out = [(c["op"] + " " + c["config"].split()[0], c["make"], c["in_bytes"], c["out_bytes"], c["run"]) for c in ops]
    name, make, in_b, out_b, run = C.cases(size, 2)[0]  # op 2 with k = 2
    out.insert(2, (name + " k2", make, in_b, out_b, run))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="64,128,512")
    ap.add_argument("--triton-rows", default="32,64,128,256", help="Triton rows per program ('' skips Triton)")
    ap.add_argument("--cuda-threads", default="64,128,256", help="CUDA threads per block ('' skips CUDA)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    from deepspeed_sdp4bit import _native
    from deepspeed_sdp4bit.kernels import cuda_backend, triton_backend as T

    rows_list = [int(v) for v in args.triton_rows.split(",") if v]
    threads_list = [int(v) for v in args.cuda_threads.split(",") if v]
    variants = {}  # label -> (backend, setup callable)
    if threads_list:
        jobs = start_builds(threads_list, tempfile.mkdtemp(prefix="sdp4bit_tiles_"))
        default_ext = _native.load_extension()  # the in-tree build, meanwhile
        for t in threads_list:
            ext = default_ext if t == in_tree_threads() else load_variant(jobs[t])
            variants[f"cuda t{t}"] = (cuda_backend.make_backend(), lambda ext=ext: setattr(_native, "_EXT", ext))
    default_rows = T._GPU_ROWS
    for r in rows_list:
        variants[f"triton R{r}"] = (T.make_backend(), lambda r=r: setattr(T, "_GPU_ROWS", r))

    rows = []
    print(f"{torch.cuda.get_device_name()}; variants {list(variants)}")
    for label, (b, setup) in variants.items():
        setup()
        ok = B.check_correct(b)
        print(f"{label}: correct vs reference {ok}")
        if not all(ok.values()):
            raise SystemExit(f"{label} is not correct: {ok}")
    for mb in (int(v) for v in args.sizes_mb.split(",") if v):
        size = mb * B.MB
        cp = B.copy_bandwidth(size)
        print(f"copy {mb} MiB: {cp['gbps']:.0f} GB/s")
        for op, make, in_b, out_b, run in cases(size):
            sets = [make() for _ in range(B.n_sets(in_b))]
            line = []
            for label, (b, setup) in variants.items():
                setup()
                t = B.time_calls([(lambda d=d, b=b: run(b, d)) for d in sets], in_b + out_b)
                pct = 100 * (in_b + out_b) / t["median_s"] / 1e9 / cp["gbps"]
                rows.append(dict(op=op, size_mb=mb, variant=label, median_us=t["median_s"] * 1e6, pct_copy=pct))
                line.append(f"{label} {pct:5.1f}")
            print(f"  {op:34s} {mb:5d} MiB  " + "  ".join(line), flush=True)
            del sets
            torch.cuda.empty_cache()
    T._GPU_ROWS = default_rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
