"""A paper model of communication per training step: bytes per GPU and time on a given inter-node link.

This is a model, not a measurement.  Assumptions (stated so they can be argued with):
  * Psi parameters, bf16 weights and gradients, one optimizer step per global batch, no gradient
    accumulation; N nodes x G GPUs, data parallelism only; every collective is bandwidth-bound.
  * The bottleneck is each node's inter-node link, ``link_gbps`` Gb/s shared by its G GPUs; intra-node links
    are treated as free next to it (NVLink is 10-100x faster).  What must cross a node's link per step is the
    data the node does not hold, (N-1)/N of the collective's payload, whatever the algorithm (ring or
    hierarchical) -- a lower bound that NCCL's ring approaches.
  * ZeRO-3: bf16 all-gather in forward and again in backward, bf16 reduce-scatter of gradients:
    3 x 2 bytes/value.
  * ZeRO++: qwZ int8 forward all-gather (+ fp32 scale per 2048 values), hpZ backward gather inside the node,
    qgZ 4-bit gradients across nodes (+ scales, about one per row; taken as 1 per 2048): ~1 + 0.5 bytes/value.
  * SDP4Bit: qWD 4-bit weight differences once per step (group 2048: 4.016 bits), gathers inside the node,
    TLq-HS gradients at 4 bits + fp32 scale per 128 across nodes (4.25 bits): ~1.03 bytes/value.
  * Kernel time: the quantize/dequantize passes over each GPU's share of values, at ``kernel_gbs`` GB/s
    of logical bytes (measured in benchmarks/results when available); added to communication, not overlapped.

    python -m benchmarks projection --params 1.3e9 --nodes 2 4 8 16 --gpus-per-node 8 --link-gbps 100

prints per scheme: inter-node bytes per GPU per step and the projected communication time per step.  The
bytes come from the project's one bytes model, ``deepspeed_sdp4bit/step_bytes.py`` (also behind
``python -m deepspeed_sdp4bit --ds-config ... --params P``).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_sdp4bit.config import parse_block  # noqa: E402
from deepspeed_sdp4bit.step_bytes import SCHEMES, node_link_bytes, step_bytes  # noqa: E402
from deepspeed_sdp4bit.topology import TopologyShape  # noqa: E402

# logical bytes the sdp4bit kernels touch per parameter per step on each GPU share (read + written):
# gradients: bf16 in, 8-bit out (op 1), 8-bit in x G, 4-bit out (op 2), 4-bit in x N, bf16 out (op 3);
# weights: fp32 master + bf16 replica in, 4-bit out, bf16 replica out (op 4), 4-bit in x N + bf16 rw (op 5).
KERNEL_BYTES_PER_PARAM = {"zero3": 0.0, "zero++": 6.0, "sdp4bit": 14.0}


def project(params, nodes, gpus_per_node, link_gbps, kernel_gbs):
    rows = []
    cfg = parse_block({})  # the default block: the paper's SDP4Bit
    for n in nodes:
        world = n * gpus_per_node
        shape = TopologyShape(n, gpus_per_node)
        for name in SCHEMES:
            # crossing one node's link per step (deepspeed_sdp4bit/step_bytes.py: the project's bytes model)
            node_bytes = node_link_bytes(step_bytes(name, int(params), shape, cfg), shape)
            per_gpu = node_bytes / gpus_per_node
            comm_s = node_bytes * 8 / (link_gbps * 1e9)
            kern_s = KERNEL_BYTES_PER_PARAM[name] * params / world / (kernel_gbs * 1e9) if kernel_gbs else 0.0
            rows.append({"scheme": name, "nodes": n, "gpus_per_node": gpus_per_node, "params": params,
                         "inter_node_bytes_per_gpu": per_gpu, "comm_ms": comm_s * 1e3,
                         "kernel_ms": kern_s * 1e3, "total_ms": (comm_s + kern_s) * 1e3})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1.3e9)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--link-gbps", type=float, default=100.0, help="inter-node bandwidth per node, Gb/s")
    ap.add_argument("--kernel-gbs", type=float, default=0.0,
                    help="measured quantize-kernel throughput in GB/s (0 = leave kernel time out)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = project(args.params, args.nodes, args.gpus_per_node, args.link_gbps, args.kernel_gbs)
    print(f"{'scheme':8} {'nodes':>5} {'GB/GPU/step':>12} {'comm ms':>9} {'kernel ms':>9} {'total ms':>9}")
    for r in rows:
        print(f"{r['scheme']:8} {r['nodes']:5d} {r['inter_node_bytes_per_gpu'] / 1e9:12.3f} "
              f"{r['comm_ms']:9.1f} {r['kernel_ms']:9.2f} {r['total_ms']:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
