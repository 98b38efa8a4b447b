"""Where the CUDA sources and their DeepSpeed op builder live, and loading the builder.

Two layouts:

* installed wheel: ``setup.py`` copies them as package data to ``deepspeed_sdp4bit/_native/op_builder/`` and
  ``deepspeed_sdp4bit/_native/csrc/``;
* source checkout: ``op_builder/`` and ``csrc/`` at the repository root, beside this package.

The builder module is loaded by file path under a private module name.  The folder is never put on
``sys.path``: a top-level ``op_builder`` package is what DeepSpeed probes to find its own builders.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from types import ModuleType
from typing import Optional, Tuple

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_BUILDER_FILE = "sdp4bit.py"
_KERNEL_FILE = "sdp4bit_kernels.cuh"
_PRIVATE_NAME = "deepspeed_sdp4bit._native_op_builder_sdp4bit"

# SDP4BIT_NATIVE_DIR points at a folder holding op_builder/ and csrc/ (e.g. a patched copy): checked first.
ENV_DIR = "SDP4BIT_NATIVE_DIR"
# module name of an ahead-of-time build (SDP4BitBuilder.absolute_name)
AOT_MODULE = "deepspeed_sdp4bit._sdp4bit_quant_op"


def _candidates():
    env = os.environ.get(ENV_DIR)
    if env:
        yield env, f"${ENV_DIR}"
    yield os.path.join(_PKG_DIR, "_native"), "the installed package data"
    yield os.path.dirname(_PKG_DIR), "the source checkout"


def native_dirs() -> Tuple[str, str]:
    """``(op_builder_dir, csrc_dir)`` of the first layout that has both files; raises ``FileNotFoundError``."""
    tried = []
    for root, what in _candidates():
        ob = os.path.join(root, "op_builder")
        cs = os.path.join(root, "csrc")
        if os.path.isfile(os.path.join(ob, _BUILDER_FILE)) and os.path.isfile(os.path.join(cs, _KERNEL_FILE)):
            return ob, cs
        tried.append(f"{root} ({what})")
    raise FileNotFoundError(f"sdp4bit CUDA sources not found: looked for op_builder/{_BUILDER_FILE} and "
                            f"csrc/{_KERNEL_FILE} under " + "; ".join(tried))


def builder_module() -> ModuleType:
    """The ``op_builder/sdp4bit.py`` module, loaded once by path under a private name."""
    mod = sys.modules.get(_PRIVATE_NAME)
    if mod is not None:
        return mod
    ob, _ = native_dirs()
    spec = importlib.util.spec_from_file_location(_PRIVATE_NAME, os.path.join(ob, _BUILDER_FILE))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_PRIVATE_NAME] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(_PRIVATE_NAME, None)
        raise
    return mod


def make_builder(csrc_dir: Optional[str] = None):
    """An ``SDP4BitBuilder`` pointing at the located ``csrc/`` (or ``csrc_dir``)."""
    mod = builder_module()
    return mod.SDP4BitBuilder(csrc_dir=csrc_dir or native_dirs()[1])


_EXT = None
_EXT_ERROR: Optional[BaseException] = None


def lock_hint(name: str) -> Optional[str]:
    """A warning when torch's JIT build folder of extension ``name`` holds a ``lock`` file, else None.

    torch waits for that file without a timeout: a build killed mid-way (a job timeout, Ctrl-C) leaves it, and
    every later run then hangs silently before training (seen on the GPU machines).
    """
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    if not os.path.exists(lock):
        return None
    return (f"sdp4bit: {lock} exists: another process (e.g. another rank) is building the CUDA extension, or an "
            f"interrupted build left it; torch waits for it without a timeout, so if no other process is "
            f"building, delete it")


def load_extension(verbose: bool = False):
    """The compiled ``sdp4bit_quant`` extension module (JIT-built on first use, then cached in-process).

    A failed build is remembered and re-raised as ``RuntimeError`` with the original reason, so callers do not
    retry a long failing compile on every call.
    """
    global _EXT, _EXT_ERROR
    if _EXT is not None:
        return _EXT
    if _EXT_ERROR is not None:
        raise RuntimeError(f"the sdp4bit_quant CUDA extension failed to build earlier: {_EXT_ERROR}") from _EXT_ERROR
    try:
        # an ahead-of-time build (setup.py with the builder's CUDAExtension) wins over a JIT build
        _EXT = importlib.import_module(AOT_MODULE)
        return _EXT
    except ImportError:
        pass
    try:
        builder = make_builder()
        try:
            hint = lock_hint(builder.name)
        except Exception:  # noqa: BLE001 - a diagnostic never stops the load
            hint = None
        if hint:
            warnings.warn(hint)
        _EXT = builder.load(verbose=verbose)
    except Exception as e:  # noqa: BLE001 - kept and reported with its reason
        _EXT_ERROR = e
        raise RuntimeError(f"building the sdp4bit_quant CUDA extension failed: {type(e).__name__}: {e}") from e
    return _EXT
