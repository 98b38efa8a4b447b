"""Op dispatch (``deepspeed_sdp4bit.ops``) on a CPU machine: ``auto``'s per-op choice, with stand-in backends.

The stand-ins say whether they run on a device through the same probe a real backend has; their ops are the
torch backend's, and each call records the stand-in's name, so a test sees which backend an ``auto`` op ran.
"""

from __future__ import annotations

import logging

import pytest
import torch

from deepspeed_sdp4bit import ops


CALLS = []


def _stand_in(name, runs_on_cuda):
    def tagged(op):
        f = getattr(ops.TORCH_BACKEND, op)

        def call(*args, **kwargs):
            CALLS.append(name)
            return f(*args, **kwargs)
        return call

    def probe(device):
        ok = runs_on_cuda and device.type == "cuda"
        return ok, "stand-in runs" if ok else f"stand-in {name} cannot run on {device.type}"

    return ops.Backend(name, {op: tagged(op) for op in ops.OP_NAMES}, probe)


@pytest.fixture
def registry(monkeypatch):
    """Stand-ins for cuda and triton (both run on CUDA devices unless a test says otherwise)."""
    monkeypatch.setattr(ops, "_FACTORIES", dict(ops._FACTORIES))
    monkeypatch.setattr(ops, "_CACHE", {})
    monkeypatch.setattr(ops, "_ANNOUNCED", set())

    def install(cuda=True, triton=True):
        ops.register_backend("cuda", lambda: _stand_in("cuda", cuda))
        ops.register_backend("triton", lambda: _stand_in("triton", triton))

    return install


def _inputs(op, k=2):
    """Small valid CPU arguments of ``op`` (op 2 and op 3 with k chunks)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, generator=g)
    if op == "hadamard_quantize":
        return (x, 4, 128, 32)
    if op in ("dequant_sum_requant", "dequant_sum_inverse_hadamard"):
        p, s = ops.TORCH_BACKEND.hadamard_quantize(torch.randn(k * 256, generator=g), 4, 128, None)
        rest = (4, 4, 128) if op == "dequant_sum_requant" else (4, 128, 32)
        return (p.view(k, -1), s.view(k, -1)) + rest
    if op == "weight_delta_quantize":
        return (x, x.bfloat16(), 4, 128)
    p, s = ops.TORCH_BACKEND.hadamard_quantize(x, 4, 128, None)
    if op == "dequant_add_segments_":
        from deepspeed_sdp4bit.segments import make_segment_plan
        dst = x.bfloat16()
        return (dst, p, s, 4, 128, "diff", make_segment_plan([0, 101], [155, 0], [101, 155], dst))
    return (x.bfloat16(), p, s, 4, 128)


def _ran(backend, op, k=2):
    """The backend whose op ran when ``backend``'s op was called (with k chunks for ops 2 and 3)."""
    CALLS.clear()
    getattr(backend, op)(*_inputs(op, k))
    return CALLS[0] if CALLS else "torch"


def _runs(order, runs):
    return next(n for n in order if runs[n])


def test_auto_picks_each_op_from_its_order(registry, caplog):
    registry()
    with caplog.at_level(logging.INFO, logger="deepspeed_sdp4bit"):
        b = ops.get_backend("auto", torch.device("cuda"))
    assert b.name == "auto"
    first = {op: order[0] for op, order in ops.AUTO_ORDER.items()}
    assert {op: _ran(b, op) for op in ops.OP_NAMES} == first
    assert set(first.values()) == {"cuda", "triton"}  # the list mixes the two compiled backends
    op3 = "dequant_sum_inverse_hadamard"
    max_k, many = ops.AUTO_ORDER_MANY_CHUNKS[op3]
    assert many[0] != first[op3]  # a different backend above max_k chunks
    assert _ran(b, op3, max_k) == first[op3] and _ran(b, op3, max_k + 1) == many[0]
    said = " ".join(r.getMessage() for r in caplog.records)
    for op, name in b.picks.items():
        assert f"{op}={name}" in said  # says which
    assert f"{op3}={first[op3]} (k <= {max_k}), {many[0]} (k > {max_k})" in said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deepspeed_sdp4bit"):
        ops.get_backend("auto", torch.device("cuda"))
    assert not caplog.records  # once


@pytest.mark.parametrize("cuda,triton", [(True, False), (False, True), (False, False)])
def test_auto_falls_back_per_op(registry, caplog, cuda, triton):
    registry(cuda=cuda, triton=triton)
    with caplog.at_level(logging.INFO, logger="deepspeed_sdp4bit"):
        b = ops.get_backend("auto", torch.device("cuda"))
    runs = {"cuda": cuda, "triton": triton, "torch": True}
    for op in ops.OP_NAMES:
        assert _ran(b, op) == _runs(ops.AUTO_ORDER[op], runs), op
    for op, (max_k, order) in ops.AUTO_ORDER_MANY_CHUNKS.items():
        assert _ran(b, op, max_k + 1) == _runs(order, runs), op
        if _runs(order, runs) == _runs(ops.AUTO_ORDER[op], runs):
            assert getattr(b, op) is getattr(ops.get_backend(_runs(order, runs), torch.device("cuda")), op)
    said = " ".join(r.getMessage() for r in caplog.records)
    for name in ("cuda", "triton"):
        assert (f"stand-in {name} cannot run" in said) == (not runs[name])  # says why one was skipped


def test_auto_by_chunks_passes_bad_input_to_the_op_that_reports_it(registry):
    """The chunk-count dispatch never fails on its own: bad payloads reach the first backend, which names them."""
    registry()
    b = ops.get_backend("auto", torch.device("cuda"))
    op3 = "dequant_sum_inverse_hadamard"
    for bad, err, what in ((torch.zeros(3, dtype=torch.uint8), ValueError, "payloads must be 2-D"),
                           ([[1, 2]], TypeError, "payloads must be a torch.Tensor")):
        CALLS.clear()
        with pytest.raises(err, match=what):
            b.dequant_sum_inverse_hadamard(bad, torch.ones(1), 4, 128, 32)
        assert CALLS == [ops.AUTO_ORDER[op3][0]]


@pytest.mark.parametrize("op", ops.OP_NAMES)
def test_torch_backend_rejects_what_the_kernels_reject(op):
    """The torch backend runs the kernel backends' shared checks: inputs the reference alone would compute with
    (or fail on deep inside) get the kernels' message naming the argument."""
    args = list(_inputs(op))
    if op == "hadamard_quantize":
        args[0], what = args[0].int(), "x must be float32, float16 or bfloat16"
    elif op in ("dequant_sum_requant", "dequant_sum_inverse_hadamard"):
        args[0], what = args[0].reshape(-1), "payloads must be 2-D"
    elif op == "weight_delta_quantize":
        args[0], what = args[0][:128], "master has 128 elements but replica has 256"
    else:
        args[2], what = args[2][:1], "needs 2 scales"
    with pytest.raises((TypeError, ValueError), match=what):
        getattr(ops.TORCH_BACKEND, op)(*args)


def test_auto_on_cpu_is_torch(registry):
    registry()
    assert ops.get_backend("auto", "cpu") is ops.TORCH_BACKEND


def test_auto_results_match_torch(registry):
    """A mixed backend is the ops it picked: same results as the torch backend on the same inputs."""
    registry()
    b = ops.get_backend("auto", torch.device("cuda"))
    for op in ops.OP_NAMES:
        max_k = ops.AUTO_ORDER_MANY_CHUNKS.get(op, (0,))[0]
        for k in (2, max_k + 1) if max_k else (2,):
            args = _inputs(op, k)
            got = getattr(b, op)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            want = getattr(ops.TORCH_BACKEND, op)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (op, k)


def test_auto_order_covers_every_op_and_ends_in_torch():
    assert set(ops.AUTO_ORDER) == set(ops.OP_NAMES) and set(ops.AUTO_ORDER_MANY_CHUNKS) <= set(ops.OP_NAMES)
    orders = list(ops.AUTO_ORDER.values()) + [o for _, o in ops.AUTO_ORDER_MANY_CHUNKS.values()]
    for order in orders:
        assert order[-1] == "torch" and set(order) == {"cuda", "triton", "torch"}, order


def test_named_backend_that_cannot_run_is_an_error(registry):
    registry(triton=False)
    with pytest.raises(RuntimeError, match="kernel_backend='triton' cannot run on cuda: stand-in triton"):
        ops.get_backend("triton", torch.device("cuda"))
    with pytest.raises(ValueError, match="must be one of"):
        ops.get_backend("fastest", "cpu")


def test_kernels_do_not_import_the_dispatch():
    """ops -> kernels is one-way: the backends take their shared types from the leaf module ``backend``."""
    import ast
    import pathlib

    pkg = pathlib.Path(ops.__file__).parent
    for f in sorted((pkg / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
                assert not (node.level == 2 and node.module is None and "ops" in names), f
                assert not (node.level == 2 and node.module == "ops"), f
                assert not (node.level == 0 and node.module == "deepspeed_sdp4bit" and "ops" in names), f
                assert not (node.level == 0 and node.module == "deepspeed_sdp4bit.ops"), f
            if isinstance(node, ast.Import):
                assert all(a.name != "deepspeed_sdp4bit.ops" for a in node.names), f
    assert ops.Backend is __import__("deepspeed_sdp4bit.backend", fromlist=["Backend"]).Backend


def _redefined(tree):
    """Names a module or class body defines twice (the later definition shadows the earlier: a test defined twice
    never runs its first body); a property's setter / getter / deleter is not a redefinition."""
    import ast
    import collections

    def accessor(node):
        return any(isinstance(d, ast.Attribute) and d.attr in ("setter", "getter", "deleter")
                   for d in getattr(node, "decorator_list", []))

    out = []
    for body in [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        names = collections.Counter(n.name for n in body
                                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                                    and not accessor(n))
        out += [name for name, k in names.items() if k > 1]
    return out


def test_no_module_defines_a_name_twice():
    import ast
    import pathlib

    root = pathlib.Path(ops.__file__).parent.parent
    files = [f for d in ("deepspeed_sdp4bit", "tests", "benchmarks", "examples") for f in (root / d).rglob("*.py")]
    assert len(files) > 20, "the repository's files were not found"
    assert _redefined(ast.parse("def f(): pass\ndef f(): pass\n")) == ["f"]   # the check itself
    found = {str(f.relative_to(root)): names for f in files if (names := _redefined(ast.parse(f.read_text())))}
    assert not found, f"defined twice (the first is shadowed): {found}"
