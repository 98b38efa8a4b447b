"""Install deepspeed_sdp4bit.

The CUDA sources (csrc/) and their DeepSpeed op builder (op_builder/) are copied into the package as
``deepspeed_sdp4bit/_native/{csrc,op_builder}`` so that JIT builds work from an installed wheel.  They are
package *data*, never a top-level ``op_builder`` package: DeepSpeed imports that name to find its own builders.
"""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE_DIRS = ("csrc", "op_builder")
NATIVE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".py")


class BuildPyWithNative(build_py):
    """build_py that also copies csrc/ and op_builder/ under deepspeed_sdp4bit/_native/."""

    def run(self):
        super().run()
        for d in NATIVE_DIRS:
            src = os.path.join(HERE, d)
            if not os.path.isdir(src):
                continue
            dst = os.path.join(self.build_lib, "deepspeed_sdp4bit", "_native", d)
            os.makedirs(dst, exist_ok=True)
            for name in sorted(os.listdir(src)):
                if name.endswith(NATIVE_SUFFIXES):
                    shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def _version():
    with open(os.path.join(HERE, "deepspeed_sdp4bit", "__init__.py")) as f:
        for line in f:
            if line.startswith("__version__"):
                return line.split("=")[1].strip().strip('"')
    raise RuntimeError("no __version__ in deepspeed_sdp4bit/__init__.py")


setup(
    name="deepspeed_sdp4bit",
    version=_version(),
    description="SDP4Bit (NeurIPS 2024): ~4-bit weight and gradient communication for DeepSpeed ZeRO-3",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=find_packages(include=["deepspeed_sdp4bit", "deepspeed_sdp4bit.*"]),
    cmdclass={"build_py": BuildPyWithNative},
    # torch first on CPU machines: `pip install torch==2.13.0` before this package, or pip pulls a CUDA build.
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19,<0.20",
        "pydantic>=2.0,<3",
        "ninja",
    ],
    extras_require={
        "triton": ["triton>=3.0"],
        "test": ["pytest>=7"],
        "plot": ["matplotlib"],
        # examples/train_hf.py and its test (tried with transformers 5.24, accelerate 1.15)
        "hf": ["transformers>=5.24", "accelerate>=1.15"],
    },
)
