"""Op dispatch (``deepspeed_sdp4bit.ops``) on a CPU machine: ``auto``'s per-op choice, with stand-in backends.

The stand-ins say whether they run on a device through the same probe a real backend has; their ops are the
torch backend's, tagged with the backend's name, so the test can see which backend an ``auto`` op came from.
"""

from __future__ import annotations

import logging

import pytest
import torch

from deepspeed_sdp4bit import ops


def _stand_in(name, runs_on_cuda):
    def tagged(op):
        f = getattr(ops.TORCH_BACKEND, op)

        def call(*args, **kwargs):
            return f(*args, **kwargs)
        call.backend = name
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


def _origin(backend, op):
    return getattr(getattr(backend, op), "backend", "torch")


def test_auto_picks_each_op_from_its_order(registry, caplog):
    registry()
    with caplog.at_level(logging.INFO, logger="deepspeed_sdp4bit"):
        b = ops.get_backend("auto", torch.device("cuda"))
    want = {op: order[0] for op, order in ops.AUTO_ORDER.items()}
    assert b.name == "auto" and b.picks == want
    assert {op: _origin(b, op) for op in ops.OP_NAMES} == want
    assert set(want.values()) == {"cuda", "triton"}  # the list mixes the two compiled backends
    said = " ".join(r.getMessage() for r in caplog.records)
    for op, name in want.items():
        assert f"{op}={name}" in said  # says which
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
        want = next(n for n in ops.AUTO_ORDER[op] if runs[n])
        assert b.picks[op] == want and _origin(b, op) == want, op
    said = " ".join(r.getMessage() for r in caplog.records)
    for name in ("cuda", "triton"):
        assert (f"stand-in {name} cannot run" in said) == (not runs[name])  # says why one was skipped


def test_auto_on_cpu_is_torch(registry):
    registry()
    assert ops.get_backend("auto", "cpu") is ops.TORCH_BACKEND


def test_auto_results_match_torch(registry):
    """A mixed backend is the ops it picked: same results as the torch backend on the same inputs."""
    registry()
    b = ops.get_backend("auto", torch.device("cuda"))
    x = torch.randn(4 * 256, generator=torch.Generator().manual_seed(3))
    got = b.hadamard_quantize(x, 4, 256, 32, "stochastic", 11, 0, (2, 2))
    want = ops.TORCH_BACKEND.hadamard_quantize(x, 4, 256, 32, "stochastic", 11, 0, (2, 2))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_auto_order_covers_every_op_and_ends_in_torch():
    assert set(ops.AUTO_ORDER) == set(ops.OP_NAMES)
    for op, order in ops.AUTO_ORDER.items():
        assert order[-1] == "torch" and set(order) == {"cuda", "triton", "torch"}, op


def test_named_backend_that_cannot_run_is_an_error(registry):
    registry(triton=False)
    with pytest.raises(RuntimeError, match="kernel_backend='triton' cannot run on cuda: stand-in triton"):
        ops.get_backend("triton", torch.device("cuda"))
    with pytest.raises(ValueError, match="must be one of"):
        ops.get_backend("fastest", "cpu")
