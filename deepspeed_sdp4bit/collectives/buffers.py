"""Grow-only communication buffers shared by the collectives (the paper's buffer-reuse point).

Each collective keeps one :class:`BufferPool`; a buffer is allocated the first time a (role, dtype, device)
needs more room than it has, and reused by every later call, so steady-state steps allocate no
communication buffers.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch


class BufferPool:
    """Grow-only flat buffers keyed by (role, dtype, device); ``get`` returns a prefix view."""

    def __init__(self):
        self._bufs: Dict[Tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.allocations = 0

    def get(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D ``dtype`` view of ``numel`` elements on ``device`` (contents undefined)."""
        key = (role, dtype, torch.device(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[key] = buf
            self.allocations += 1
        return buf[:numel]

    def sizes(self) -> Dict[str, int]:
        """Elements held per role (the largest buffer of the role)."""
        out: Dict[str, int] = {}
        for (role, _, _), buf in self._bufs.items():
            out[role] = max(out.get(role, 0), buf.numel())
        return out

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()
