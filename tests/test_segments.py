"""Op 6 (``dequant_add_segments_``) on CPU: the segment plan (validation, tile tables) and the reference/torch
backend against op 5 applied element by element.  The compiled backends are compared with the reference in
test_kernels_triton.py (interpreter on CPU) and test_kernels_cuda.py (GPU), on layouts from :func:`segment_layout`.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepspeed_sdp4bit import ops
from deepspeed_sdp4bit import reference as R
from deepspeed_sdp4bit.segments import GPU_TILE, SegmentPlan, make_segment_plan, tile_table

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def segment_layout(M, gs, big_start, big_len, seed, gap=3):
    """Segments covering source elements [0, M) in pieces (lengths 1, odd starts, pieces across group boundaries,
    one empty segment, and one long piece [big_start, big_start + big_len) whose source and destination starts are
    multiples of 16), placed in a destination buffer in shuffled order with gaps of 1..gap elements.

    Returns ``(src_offset, dst_offset, length, dst_numel)``.
    """
    cuts = {0, 1, 2, 3, gs - 1, gs + 1, big_start, big_start + big_len, M}
    cuts |= {min(M, big_start + big_len + 7), min(M, big_start + big_len + 2 * gs + 3)}
    cuts = sorted(c for c in cuts if 0 <= c <= M)
    pieces = [(a, b - a) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    rng = random.Random(seed)
    rng.shuffle(pieces)
    so, do, ln, pos = [], [], [], rng.randint(1, gap)
    for a, n in pieces:
        if a == big_start:
            pos = -(-pos // 16) * 16 + (a % 16)  # the long piece: dst start = src start (mod 16)
        so.append(a), do.append(pos), ln.append(n)
        pos += n + rng.randint(1, gap)
    so.insert(2, 5), do.insert(2, 0), ln.insert(2, 0)  # an empty segment (skipped; may sit anywhere)
    return so, do, ln, pos


def apply_by_op5(dst, payload, scales, bits, gs, mode, so, do, ln):
    """The definition through op 5: each destination element updated by ``reference.dequant_add_`` on a one-element
    replica with the element's code and its group's scale (a whole group of codes, the element's at its place)."""
    codes = R.unpack_codes(payload, bits)
    for s0, d0, n in zip(so, do, ln):
        for j in range(n):
            i = s0 + j
            g = i // gs
            grp = codes[g * gs: (g + 1) * gs].clone()
            one = dst[d0 + j: d0 + j + 1].clone()
            # a replica of one element reads code 0 of the group: move the element's code there
            grp[0] = grp[i - g * gs]
            R.dequant_add_(one, R.pack_codes(grp, bits), scales[g: g + 1], bits, gs, mode)
            dst[d0 + j] = one[0]
    return dst


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def same(a, b):
    an, bn = torch.isnan(a), torch.isnan(b)
    return torch.equal(an, bn) and torch.equal(_bits(a[~an]), _bits(b[~bn]))


def _payload(M, bits, gs, seed):
    gen = torch.Generator().manual_seed(seed)
    G = R.num_groups(M, gs)
    payload = torch.randint(0, 256, (G * gs * bits // 8,), generator=gen, dtype=torch.int64).to(torch.uint8)
    scales = torch.rand(G, generator=gen) * 0.1
    scales[1], scales[-1] = float("inf"), float("nan")
    return payload, scales


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_is_op5_element_by_element(dtype, bits):
    gs, M = 16, 16 * 7 + 3
    payload, scales = _payload(M, bits, gs, seed=bits)
    so, do, ln, n = segment_layout(M, gs, 32, 48, seed=bits)
    gen = torch.Generator().manual_seed(3)
    base = (torch.randn(n, generator=gen) * 2).to(dtype)
    plan = make_segment_plan(so, do, ln, base)
    for mode in ("diff", "direct"):
        want = apply_by_op5(base.clone(), payload, scales, bits, gs, mode, so, do, ln)
        got = base.clone()
        assert R.dequant_add_segments_(got, payload, scales, bits, gs, mode, plan) is got
        assert same(got, want), mode
        got = base.clone()
        ops.TORCH_BACKEND.dequant_add_segments_(got, payload, scales, bits, gs, mode, plan)
        assert same(got, want), mode
        untouched = torch.ones(n, dtype=torch.bool)
        for d0, L in zip(do, ln):
            untouched[d0: d0 + L] = False
        assert torch.equal(_bits(got[untouched]), _bits(base[untouched]))  # gaps untouched


def test_owner_and_receiver_agree_through_any_layout():
    """Op 4 on the owner's shard, op 6 on pieces of it placed anywhere: the owner's bits."""
    gs, M, bits = 32, 32 * 9 + 5, 4
    gen = torch.Generator().manual_seed(0)
    owner = (0.05 * torch.randn(M, generator=gen)).to(torch.bfloat16)
    master = owner.float() + 0.02 * torch.randn(M, generator=gen)
    before = owner.clone()
    payload, scales = R.weight_delta_quantize(master, owner, bits, gs)
    so, do, ln, n = segment_layout(M, gs, 64, 128, seed=1)
    dst = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    for s0, d0, L in zip(so, do, ln):
        dst[d0: d0 + L] = before[s0: s0 + L]
    plan = make_segment_plan(so, do, ln, dst, src_numel=M)
    ops.TORCH_BACKEND.dequant_add_segments_(dst, payload, scales, bits, gs, "diff", plan)
    for s0, d0, L in zip(so, do, ln):
        assert torch.equal(_bits(dst[d0: d0 + L]), _bits(owner[s0: s0 + L]))


def test_tile_table():
    so, do, ln = [0, 10, 50, 7], [5, 100, 30, 0], [20, 0, 70, 3]
    t = tile_table(torch.tensor(so), torch.tensor(do), torch.tensor(ln), 32)
    # cut at multiples of 32 in dst coordinates, in segment order, empty segments give no tile
    assert t.tolist() == [[0, 5, 20], [50, 30, 2], [52, 32, 32], [84, 64, 32], [116, 96, 4], [7, 0, 3]]
    # every element once
    for block in (1, 8, 4096):
        t = tile_table(torch.tensor(so), torch.tensor(do), torch.tensor(ln), block)
        assert int(t[:, 2].sum()) == sum(ln) and int(t[:, 2].max()) <= block
        assert all(d // block == (d + c - 1) // block for _, d, c in t.tolist())


def test_plan_validation_names_the_segment():
    dst = torch.zeros(100, dtype=torch.bfloat16)
    plan = make_segment_plan([3, 0, 9], [50, 0, 10], [10, 0, 5], dst, src_numel=20)
    assert isinstance(plan, SegmentPlan)
    assert (plan.num_segments, plan.numel, plan.src_end, plan.dst_end) == (2, 15, 14, 60)
    assert plan.segments() == [(3, 50, 10), (9, 10, 5)]
    assert plan.tiles(GPU_TILE).shape == (2, 3) and plan.tiles(GPU_TILE) is plan.tiles(GPU_TILE)  # cached
    cases = [
        (([0, 5], [0, 8], [10, 4]), "segments 0 and 1 overlap in dst: \\[0, 10\\) and \\[8, 12\\)"),
        (([0], [95], [10]), "segment 0 writes dst\\[95:105\\], outside the buffer of 100"),
        (([15], [0], [10]), "segment 0 reads source elements \\[15, 25\\), outside the partition of 20"),
        (([0, -1], [0, 20], [1, 1]), "segment 1 .* must be >= 0"),
        (([0], [0], [-1]), "segment 0 .* must be >= 0"),
        (([0, 1], [0], [1]), "equally long"),
        (([0.5], [0], [1]), "must be an integer"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            make_segment_plan(*args, dst, src_numel=20)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        make_segment_plan([0], [0], [1], torch.zeros(4, 4))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        make_segment_plan([0], [0], [1], torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        make_segment_plan(torch.zeros(1), [0], [1], dst)
    # tensors work like lists
    p2 = make_segment_plan(torch.tensor([3, 9]), torch.tensor([50, 10]), torch.tensor([10, 5]), dst)
    assert p2.segments() == plan.segments()


@pytest.mark.parametrize("backend", ["torch"])
def test_bad_call_arguments(backend):
    b = ops.get_backend(backend, "cpu")
    dst = torch.zeros(64, dtype=torch.bfloat16)
    plan = make_segment_plan([0, 40], [0, 30], [20, 24], dst)
    payload, scales = _payload(64, 4, 16, seed=0)
    cases = [
        (lambda: b.dequant_add_segments_(dst, payload, scales, 4, 16, "diff", [(0, 0, 20)]), "SegmentPlan"),
        (lambda: b.dequant_add_segments_(dst[:50], payload, scales, 4, 16, "diff", plan), "write up to 54"),
        (lambda: b.dequant_add_segments_(dst.view(8, 8), payload, scales, 4, 16, "diff", plan), "1-D"),
        (lambda: b.dequant_add_segments_(dst, payload[:16], scales[:2], 4, 16, "diff", plan), "read up to 64"),
        (lambda: b.dequant_add_segments_(dst, payload, scales[:3], 4, 16, "diff", plan), "needs 4 scales"),
        (lambda: b.dequant_add_segments_(dst, payload, scales, 4, 16, "sum", plan), "mode must be"),
        (lambda: b.dequant_add_segments_(dst, payload, scales, 5, 16, "diff", plan), "bits must be 4 or 8"),
        (lambda: b.dequant_add_segments_(dst.int(), payload, scales, 4, 16, "diff", plan), "dst must be float32"),
        (lambda: b.dequant_add_segments_(dst, payload.char(), scales, 4, 16, "diff", plan), "payload must be"),
    ]
    for fn, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            fn()
