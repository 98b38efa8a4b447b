"""Run examples/train_hf.py as ``__main__`` after the CPU test settings of ds_utils.prepare_deepspeed_env.

torchrun starts this file on every rank (``tests/test_hf_trainer.py``); the settings skip DeepSpeed's ~40 s
JIT build of its shared-memory all-reduce, which the example itself leaves to DeepSpeed.
"""

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ds_utils  # noqa: E402

ds_utils.prepare_deepspeed_env()
example = os.path.join(os.path.dirname(HERE), "examples", "train_hf.py")
sys.argv = [example] + sys.argv[1:]
runpy.run_path(example, run_name="__main__")
