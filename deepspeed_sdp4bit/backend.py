"""The shared types of the kernel backends: the op names and :class:`Backend` (a leaf module).

:mod:`deepspeed_sdp4bit.ops` (dispatch) and the backends in :mod:`deepspeed_sdp4bit.kernels` both import this
module and nothing imports back, so ``ops`` -> ``kernels`` stays one-way.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

OP_NAMES = (
    "hadamard_quantize",             # op 1
    "dequant_sum_requant",           # op 2
    "dequant_sum_inverse_hadamard",  # op 3
    "weight_delta_quantize",         # op 4
    "dequant_add_",                  # op 5
    "dequant_add_segments_",         # op 6
)
BACKEND_NAMES = ("auto", "cuda", "triton", "torch")


class Backend:
    """A named set of the ops (``OP_NAMES``) and a probe saying whether it can run on a device."""

    def __init__(self, name: str, ops: Dict[str, Callable], probe: Callable[[torch.device], Tuple[bool, str]]):
        missing = [n for n in OP_NAMES if n not in ops]
        if missing:
            raise ValueError(f"backend {name!r} lacks ops {missing}")
        self.name = name
        self._ops = dict(ops)
        self._probe = probe
        for n, f in ops.items():
            setattr(self, n, f)

    def available(self, device: torch.device) -> Tuple[bool, str]:
        try:
            return self._probe(torch.device(device))
        except Exception as e:  # noqa: BLE001 - the reason is reported to the user
            return False, f"{type(e).__name__}: {e}"

    def __repr__(self):
        return f"Backend({self.name!r})"
