# As run in the twenty-sixth session (call 3, 851dc6d): it printed op 1 and then stopped at op 2, which it passed
# lists where reference.dequant_sum_requant takes stacked [k, ...] tensors. Kept as it ran; the CUDA tests' torch-on-cuda
# parametrization (tests/test_kernels_cuda.py, fixture kb) checks every op this way now.
"""Which gradient-path op differs between the torch backend on CUDA, Triton on CUDA and the reference on CPU."""
import torch
from deepspeed_sdp4bit import ops, reference as R

torch.manual_seed(0)
dev = torch.device("cuda")
B = {"torch": ops.get_backend("torch", dev), "triton": ops.get_backend("triton", dev)}
key = R.make_key(1234, 3, 1, 0)


def cmp(name, outs):
    ref = outs["ref"]
    for b in ("torch", "triton"):
        o = outs[b]
        o = o if isinstance(o, tuple) else (o,)
        r = ref if isinstance(ref, tuple) else (ref,)
        msg = []
        for i, (x, y) in enumerate(zip(o, r)):
            x = x.cpu()
            if x.dtype.is_floating_point:
                bad = (x.view(torch.int32 if x.dtype == torch.float32 else torch.int16) != y.view(x.dtype).view(torch.int32 if x.dtype == torch.float32 else torch.int16)).sum().item()
                msg.append(f"out{i}: {bad}/{x.numel()} differ, max |d| {(x.float() - y.float()).abs().max().item():.3g}")
            else:
                msg.append(f"out{i}: {(x != y).sum().item()}/{x.numel()} differ")
        print(f"{name:40s} {b:6s} vs ref(cpu): " + "; ".join(msg), flush=True)


for dtype in (torch.bfloat16, torch.float32):
    for n in (4096, 131072, 1 << 20):
        x = (torch.randn(n) * torch.logspace(-4, 1, n)[torch.randperm(n)]).to(dtype)
        for rounding in ("stochastic", "nearest"):
            outs = {"ref": R.hadamard_quantize(x, 8, 128, 32, rounding, key, 0)}
            for b, be in B.items():
                outs[b] = be.hadamard_quantize(x.to(dev), 8, 128, 32, rounding, key, 0)
            cmp(f"hadamard_quantize {dtype} n={n} {rounding}", outs)
            chunks = [R.hadamard_quantize((x * (i + 1)).to(dtype), 8, 128, 32, rounding, R.make_key(9, i), 0) for i in range(2)]
            pl, sc = [c[0] for c in chunks], [c[1] for c in chunks]
            outs = {"ref": R.dequant_sum_requant(pl, sc, 8, 4, 128, rounding, key, 0)}
            for b, be in B.items():
                outs[b] = be.dequant_sum_requant([p.to(dev) for p in pl], [s.to(dev) for s in sc], 8, 4, 128, rounding, key, 0)
            cmp(f"dequant_sum_requant n={n} {dtype} {rounding}", outs)
            q4 = [R.dequant_sum_requant(pl, sc, 8, 4, 128, rounding, R.make_key(5, i), 0) for i in range(2)]
            p4, s4 = [q[0] for q in q4], [q[1] for q in q4]
            for post in (1.0, 0.25):
                outs = {"ref": R.dequant_sum_inverse_hadamard(p4, s4, 4, 128, 32, torch.float32, post)}
                for b, be in B.items():
                    outs[b] = be.dequant_sum_inverse_hadamard([p.to(dev) for p in p4], [s.to(dev) for s in s4], 4, 128, 32, torch.float32, post)
                cmp(f"dequant_sum_inverse_hadamard n={n} post={post}", outs)
