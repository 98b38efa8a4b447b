"""Ops 2 and 3 against the number of received chunks k (the GPUs of a node, or the nodes), per backend.

bench_kernels.py times k = 4 (op 2) and k = 2 (op 3); the collectives see k = GPUs per node (up to 8) and k =
nodes.  This sweeps k at a fixed input size with the same timing (CUDA graphs, input sets rotated past the L2):

    python -m benchmarks kernels --chunk-counts --size-mb 512 --ks 2,4,8,9 --backends cuda,triton

Op 2: k chunks of 8-bit g128 codes -> 4-bit g128 stochastic (as in bench_kernels.py); op 3: k chunks of 4-bit
g128 codes -> bf16 with Hadamard 32.  The input size counts all k chunks, so each k moves the same bytes.
Prints GB/s of logical bytes and % of the elementwise copy of the same size.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels as B  # noqa: E402
from deepspeed_sdp4bit import reference as R  # noqa: E402

G = 128


def cases(size: int, k: int, row_pad: int = 0):
    """Op 2 and op 3 cases; ``row_pad``: bytes between the chunks' payload rows (a strided [k, bytes] view)."""
    key = R.make_key(7, 1)
    m2 = size // k // G * G  # op 2: 8-bit codes, 1 byte per element
    m3 = size * 2 // k // G * G  # op 3: 4-bit codes, half a byte per element

    def payload(nbytes):
        return B.rand_payload(k, nbytes + row_pad)[:, :nbytes]

    def make2():
        return {"p": payload(m2), "s": B.rand_scales(k, m2 // G),
                "out": torch.empty(m2 // 2, dtype=torch.uint8, device="cuda"),
                "os": torch.empty(m2 // G, device="cuda")}

    def make3():
        return {"p": payload(m3 // 2), "s": B.rand_scales(k, m3 // G),
                "out": torch.empty(m3, dtype=torch.bfloat16, device="cuda")}

    return [
        ("dequant_sum_requant", make2, k * m2 + k * (m2 // G) * 4, m2 // 2 + m2 // G * 4,
         lambda b, d: b.dequant_sum_requant(d["p"], d["s"], 8, 4, G, "stochastic", key, out=d["out"],
                                            out_scales=d["os"])),
        ("dequant_sum_inverse_hadamard", make3, k * m3 // 2 + k * (m3 // G) * 4, m3 * 2,
         lambda b, d: b.dequant_sum_inverse_hadamard(d["p"], d["s"], 4, G, 32, out=d["out"])),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=512, help="input MiB (all chunks together)")
    ap.add_argument("--ks", default="2,4,8,9", help="chunk counts, comma separated")
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--triton-loop", action="store_true",
                    help="Triton with the run-time chunk loop for every k (triton_backend._UNROLL_CHUNKS off)")
    ap.add_argument("--op3-ptx-min-k", type=int, default=None,
                    help="Triton op 3 decodes with PTX from this many chunks on (triton_backend._OP3_PTX_DECODE_MIN_K; "
                         "1: always, a large number: never)")
    ap.add_argument("--row-pad", type=int, default=0,
                    help="bytes between the chunks' payload rows (Triton only: the CUDA binding takes contiguous "
                         "chunks and would copy)")
    ap.add_argument("--op2-row64-max-k", type=int, default=None,
                    help="Triton op 2 takes rows of 64 elements up to this many chunks, 32 above "
                         "(triton_backend._OP2_ROW64_MAX_K; 0: never, 8: always)")
    ap.add_argument("--op2-persist", type=int, default=None,
                    help="Triton op 2 as the persistent kernel (1) or one program per tile (0) "
                         "(triton_backend._OP2_PERSIST)")
    ap.add_argument("--op2-pps", type=int, default=None,
                    help="the persistent op 2's programs per SM (triton_backend._PERSIST_PROGRAMS_PER_SM)")
    ap.add_argument("--op2-persist-ks", default=None,
                    help="Triton op 2 (8-bit input) as the persistent kernel for these chunk counts (comma separated, "
                         "'' none; triton_backend._OP2_PERSIST_KS)")
    ap.add_argument("--op3-persist-ks", default=None,
                    help="Triton op 3 as the persistent kernel for these chunk counts (comma separated, '' none; "
                         "triton_backend._OP3_PERSIST_KS)")
    ap.add_argument("--triton-rows", type=int, default=None,
                    help="Triton row kernels' rows per program (triton_backend._GPU_ROWS)")
    args = ap.parse_args(argv)
    for flag, name in ((args.op2_persist_ks, "_OP2_PERSIST_KS"), (args.op3_persist_ks, "_OP3_PERSIST_KS")):
        if flag is not None:
            from deepspeed_sdp4bit.kernels import triton_backend
            setattr(triton_backend, name, tuple(int(v) for v in flag.split(",") if v))
    if args.triton_rows is not None:
        from deepspeed_sdp4bit.kernels import triton_backend
        triton_backend._GPU_ROWS = args.triton_rows
    if args.op2_persist is not None or args.op2_pps is not None:
        from deepspeed_sdp4bit.kernels import triton_backend
        if args.op2_persist is not None:
            triton_backend._OP2_PERSIST = bool(args.op2_persist)
        if args.op2_pps is not None:
            triton_backend._PERSIST_PROGRAMS_PER_SM = args.op2_pps
    if args.op2_row64_max_k is not None:
        from deepspeed_sdp4bit.kernels import triton_backend
        triton_backend._OP2_ROW64_MAX_K = args.op2_row64_max_k
    if args.row_pad and "cuda" in args.backends.split(","):
        ap.error("--row-pad needs --backends triton (the CUDA binding would copy strided chunks)")
    if args.triton_loop or args.op3_ptx_min_k is not None:
        from deepspeed_sdp4bit.kernels import triton_backend
        if args.triton_loop:
            triton_backend._UNROLL_CHUNKS = False
        if args.op3_ptx_min_k is not None:
            triton_backend._OP3_PTX_DECODE_MIN_K = args.op3_ptx_min_k
    size = args.size_mb * B.MB
    backends = {n: b for n, b in B.load_backends(args.backends.split(",")).items() if not isinstance(b, str)}
    cp = B.copy_bandwidth(size)
    print(f"{torch.cuda.get_device_name()}; backends {list(backends)}; copy {args.size_mb} MiB {cp['gbps']:.0f} GB/s")
    print(f"{'op':30s} {'k':>3s} {'backend':8s} {'median_us':>10s} {'GB/s':>7s} {'%copy':>6s}")
    for k in (int(v) for v in args.ks.split(",") if v):
        for op, make, in_b, out_b, run in cases(size, k, args.row_pad):
            sets = [make() for _ in range(B.n_sets(in_b))]
            for name, b in backends.items():
                t = B.time_calls([(lambda d=d, b=b: run(b, d)) for d in sets], in_b + out_b)
                gbps = (in_b + out_b) / t["median_s"] / 1e9
                pct = 100 * gbps / cp["gbps"]
                print(f"{op:30s} {k:3d} {name:8s} {t['median_s'] * 1e6:10.1f} {gbps:7.0f} {pct:6.1f}")
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
