"""The benchmark suite: ``python -m benchmarks QUESTION ...`` (run from the repository root).

Questions:
  kernels      bandwidth of the SDP4Bit kernels vs a device copy and DeepSpeed's quantizer (one GPU;
               benchmarks/bench_kernels.py's options; ``--chunk-counts``: bench_chunk_counts.py's sweep)
  collectives  the quantized collectives alone vs NCCL bf16 (``--layout`` GPT: the weight refresh on
               DeepSpeed's real per-parameter partition layout, one GPU)
  e2e          step time of the GPT per config x topology (``--ranks-per-gpu`` / ``--share-gpu``: several
               ranks on one GPU, each its own NCCL host)
  accuracy     loss of the GPT per config x topology x seed, with a world-1 replay reference for ZeRO-3
  linkrate     the bandwidth knob (an LD_PRELOAD rate limit on TCP egress): the rate each setting really gives
  projection   a step-time model fitted on the measured rows: step time and speed-up at a user's scale
  report       tables (markdown), plots (PNG) and the README headline from the committed results
  merge        merge rows of results files (brought back from a GPU machine) into the committed ones

``python -m benchmarks QUESTION --help`` lists each question's options; benchmarks/results/README.md says
which command produced which file.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="question", required=True)

    import importlib
    for name, helptext in (("e2e", "step time per config x topology"),
                           ("accuracy", "loss per config x topology x seed"),
                           ("collectives", "collectives alone; --layout gpt: the weight refresh"),
                           ("linkrate", "the rate each setting of the bandwidth knob really gives"),
                           ("report", "tables, plots and the README headline"),
                           ("merge", "merge results rows (e.g. from a GPU machine) into the committed files")):
        if argv and argv[0] != name and argv[0] not in ("-h", "--help"):
            sub.add_parser(name, help=helptext)  # listed; its module is imported only when asked for
            continue
        mod = importlib.import_module(f".{ {'merge': 'report', 'linkrate': 'link'}.get(name, name)}", __package__)
        sp = sub.add_parser(name, help=helptext, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == "merge":
            mod.add_merge_args(sp)
            sp.set_defaults(func=mod.run_merge)
        else:
            mod.add_args(sp)
            sp.set_defaults(func=mod.run)
    # kernels and projection keep their own command lines: everything after the question goes to them.
    sub.add_parser("kernels", help="kernel bandwidth (benchmarks/bench_kernels.py's options)", add_help=False)
    sub.add_parser("projection", help="step time and speed-up at scale, fitted on the measured rows "
                   "(benchmarks/projection.py's options)",
                   add_help=False)
    sub.add_parser("accuracy-sim", help="loss-gap causes: W ranks simulated in one process through the real "
                   "quantization code (benchmarks/accuracy_sim.py's options)", add_help=False)
    if argv and argv[0] == "accuracy-sim":
        from . import accuracy_sim
        return accuracy_sim.main(argv[1:]) or 0
    if argv and argv[0] in ("kernels", "projection"):
        if argv[0] == "kernels" and "--chunk-counts" in argv:
            from . import bench_chunk_counts
            return bench_chunk_counts.main([a for a in argv[1:] if a != "--chunk-counts"]) or 0
        if argv[0] == "kernels":
            from . import bench_kernels
            return bench_kernels.main(argv[1:]) or 0
        from . import projection
        return projection.main(argv[1:]) or 0
    args = p.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
