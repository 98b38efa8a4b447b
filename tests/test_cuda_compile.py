"""CPU-runnable checks of the CUDA build: every .cu compiles with nvcc, and the op builder / source locator work.

The kernels (csrc/*.cu) and the micro-benchmarks (benchmarks/micro/*.cu) include only CUDA headers, so they
compile without a CUDA build of torch. The torch binding (csrc/sdp4bit_bindings.cpp) needs torch's CUDA headers,
which the CPU torch wheel does not ship complete (no c10/cuda/impl/cuda_cmake_macros.h); it is syntax-checked
only where they are present.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from deepspeed_sdp4bit import _native

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(REPO, "csrc")


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    cand = os.path.join(home, "bin", "nvcc")
    return cand if os.path.isfile(cand) else None


CU_FILES = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
# the benchmarks' standalone CUDA programs (no torch): compiled too, so that every .cu in the tree builds
MICRO_CU_FILES = sorted(glob.glob(os.path.join(REPO, "benchmarks", "micro", "*.cu")))


def test_there_are_cuda_sources():
    assert CU_FILES, f"no .cu files under {CSRC}"


def test_cu_files_compile_for_sm90(tmp_path):
    """Every csrc/*.cu and benchmarks/micro/*.cu compiles to an sm_90 object (in parallel: the kernel templates
    take a while), and the kernel objects of the build's source list link into one shared library with no
    undefined symbol (op 1's kernels are explicit instantiations in one file per dtype: a missing one would
    otherwise show only at import on a GPU machine, as torch's JIT links without that check).  The binding
    (sdp4bit_bindings.cpp) needs torch's CUDA headers and is not linked here: a launcher called only from it is
    checked by its declaration in sdp4bit_kernels.cuh alone."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (not on PATH, nor under $CUDA_HOME/bin or /usr/local/cuda/bin)")

    def compile_one(path):
        obj = tmp_path / (os.path.basename(path) + ".o")
        cmd = [nvcc, "-arch=sm_90", "-std=c++17", "-Xcompiler", "-fPIC", "-I", CSRC, "-c", path, "-o", str(obj)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        ok = res.returncode == 0 and obj.is_file() and obj.stat().st_size > 0
        return path, ok, f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}"

    with ThreadPoolExecutor(max_workers=max(1, min(len(CU_FILES), os.cpu_count() or 1))) as pool:
        results = list(pool.map(compile_one, CU_FILES + MICRO_CU_FILES))
    failed = [msg for _, ok, msg in results if not ok]
    assert not failed, "\n\n".join(failed)
    # the build's own list (op_builder SOURCES) names every kernel file: a .cu left out of it would pass the link
    # below and fail at import
    builder_cu = [f for f in _native.make_builder(csrc_dir=CSRC).sources() if f.endswith(".cu")]
    assert sorted(map(os.path.basename, builder_cu)) == sorted(map(os.path.basename, CU_FILES))
    objs = [str(tmp_path / (os.path.basename(p) + ".o")) for p in builder_cu]
    cmd = [nvcc, "-arch=sm_90", "-shared", "-Xlinker", "--no-undefined", *objs, "-o", str(tmp_path / "kernels.so")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}"


def test_bindings_syntax_with_cuda_torch_headers(tmp_path):
    """The binding against torch's headers: needs a CUDA build of torch (the GPU machine has one)."""
    from torch.utils import cpp_extension
    incs = cpp_extension.include_paths()
    if not any(os.path.isfile(os.path.join(i, "c10", "cuda", "impl", "cuda_cmake_macros.h")) for i in incs):
        pytest.skip("this torch wheel lacks its CUDA headers (c10/cuda/impl/cuda_cmake_macros.h): CPU-only torch")
    nvcc = _nvcc()
    cuda_inc = os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include") if nvcc else "/usr/local/cuda/include"
    if not os.path.isfile(os.path.join(cuda_inc, "cuda_runtime.h")):
        pytest.skip(f"CUDA headers not found (looked in {cuda_inc})")
    import sysconfig
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler (c++/g++) on PATH")
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=sdp4bit_quant",
           "-I", CSRC, "-I", cuda_inc, "-I", sysconfig.get_paths()["include"]]
    for i in incs:
        cmd += ["-isystem", i]
    cmd.append(os.path.join(CSRC, "sdp4bit_bindings.cpp"))
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}"


# ----------------------------------------------------------------------------------------------------------
# locating and loading the op builder (no compiler needed)
# ----------------------------------------------------------------------------------------------------------
def test_native_dirs_found_in_checkout():
    ob, cs = _native.native_dirs()
    assert os.path.isfile(os.path.join(ob, "sdp4bit.py"))
    assert os.path.isfile(os.path.join(cs, "sdp4bit_kernels.cuh"))


def test_native_dirs_env_override_and_clear_error(tmp_path, monkeypatch):
    (tmp_path / "op_builder").mkdir()
    (tmp_path / "csrc").mkdir()
    shutil.copy(os.path.join(REPO, "op_builder", "sdp4bit.py"), tmp_path / "op_builder" / "sdp4bit.py")
    shutil.copy(os.path.join(CSRC, "sdp4bit_kernels.cuh"), tmp_path / "csrc" / "sdp4bit_kernels.cuh")
    monkeypatch.setenv(_native.ENV_DIR, str(tmp_path))
    assert _native.native_dirs() == (str(tmp_path / "op_builder"), str(tmp_path / "csrc"))
    # nothing anywhere: the error lists where it looked
    monkeypatch.setattr(_native, "_candidates", lambda: iter([(str(tmp_path / "nope"), "test")]))
    with pytest.raises(FileNotFoundError, match="nope"):
        _native.native_dirs()


def test_builder_loads_privately_and_never_as_op_builder():
    before = "op_builder" in sys.modules
    mod = _native.builder_module()
    assert mod.__name__ != "op_builder" and not mod.__name__.startswith("op_builder.")
    assert ("op_builder" in sys.modules) == before
    b = _native.make_builder()
    assert b.NAME == "sdp4bit_quant"
    assert all(os.path.isabs(s) and os.path.isfile(s) for s in b.sources())
    assert b.absolute_name() == _native.AOT_MODULE
    # DeepSpeed's own probe for its builders must not find ours
    from deepspeed.accelerator import get_accelerator
    assert "sdp4bit" not in get_accelerator().op_builder_dir()


def test_op_builder_package_defines_no_deepspeed_marker():
    text = open(os.path.join(REPO, "op_builder", "__init__.py")).read()
    assert "__deepspeed__ =" not in text and "import" not in text.split('"""')[-1]


@pytest.mark.parametrize("text,flags", [
    ("9.0a", ["-gencode=arch=compute_90a,code=sm_90a"]),
    ("9.0", ["-gencode=arch=compute_90,code=sm_90"]),
    ("8.0;9.0a", ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"]),
    ("8.6+PTX 9.0a", ["-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_86,code=compute_86",
                      "-gencode=arch=compute_90a,code=sm_90a"]),
    ("Hopper", ["-gencode=arch=compute_90a,code=sm_90a"]),
    ("9.0a;9.0a", ["-gencode=arch=compute_90a,code=sm_90a"]),
    ("10.0f", ["-gencode=arch=compute_100f,code=sm_100f"]),
])
def test_arch_list_parsing(text, flags, monkeypatch):
    mod = _native.builder_module()
    assert mod.gencode_flags(mod.parse_arch_list(text)) == flags
    # through the builder, as DeepSpeed's jit_load calls it
    monkeypatch.delenv(mod.ARCH_ENV, raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", text)
    assert _native.make_builder().compute_capability_args() == flags


def test_arch_env_of_this_op_wins_and_bad_entries_are_named(monkeypatch):
    mod = _native.builder_module()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv(mod.ARCH_ENV, "9.0a")
    assert _native.make_builder().compute_capability_args() == ["-gencode=arch=compute_90a,code=sm_90a"]
    monkeypatch.setenv(mod.ARCH_ENV, "9.x")
    with pytest.raises(ValueError, match=r"SDP4BIT_CUDA_ARCH_LIST.*'9\.x'"):
        _native.make_builder().compute_capability_args()


def test_nvcc_args_keep_ieee_arithmetic(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    b = _native.make_builder()
    b.build_for_cpu = False
    args = b.nvcc_args()
    assert "--use_fast_math" not in args and "--fmad=false" in args and "-ftz=false" in args
    assert "-gencode=arch=compute_90a,code=sm_90a" in args


def test_cuda_backend_unavailable_on_cpu_with_reason():
    from deepspeed_sdp4bit import ops
    from deepspeed_sdp4bit.kernels import cuda_backend
    b = cuda_backend.make_backend()
    ok, why = b.available("cpu")
    assert not ok and "CUDA tensors" in why
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        ops.get_backend("cuda", "cpu")


def test_lock_left_by_an_interrupted_build_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = _native.make_builder().name
    assert _native.lock_hint(name) is None
    (tmp_path / name).mkdir(exist_ok=True)
    (tmp_path / name / "lock").write_text("")
    hint = _native.lock_hint(name)
    assert hint and str(tmp_path / name / "lock") in hint and "delete it" in hint
