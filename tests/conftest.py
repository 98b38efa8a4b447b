"""Test-session settings: CPU runs use DeepSpeed's CPU accelerator and Triton's interpreter."""

import os
import sys

# Must be set before torch/triton/deepspeed are imported anywhere in the session.
_HAS_GPU = os.path.exists("/dev/nvidia0") or os.environ.get("CUDA_VISIBLE_DEVICES") not in (None, "")
if not _HAS_GPU:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, os.path.dirname(__file__))
