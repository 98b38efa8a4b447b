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


def pytest_report_header(config):
    """Say so when the suite runs as if the CPU had no fp16 (ds_utils.NO_FP16_ENV)."""
    from ds_utils import NO_FP16_ENV, fp16_masked

    if fp16_masked():
        return f"{NO_FP16_ENV}={os.environ[NO_FP16_ENV]}: engine tests run as on a CPU without fp16"
    return None
