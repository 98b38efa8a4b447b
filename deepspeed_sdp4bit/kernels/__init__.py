"""Fused SDP4Bit kernels (Triton and CUDA backends of the six ops in ``reference.py``).

The backends are imported lazily by :mod:`deepspeed_sdp4bit.ops` (``get_backend``), never at package import
time, so a machine without Triton or a CUDA toolchain can still use the torch backend (only ``_common``, the
shared argument checks, is imported with ``ops``: it needs torch alone).  The shared types come from the leaf
module :mod:`deepspeed_sdp4bit.backend`; nothing here imports ``ops``.

* ``triton_backend``: ``make_backend()`` returns the ``"triton"`` :class:`~deepspeed_sdp4bit.backend.Backend`.
  It runs on CUDA devices; with ``TRITON_INTERPRET=1`` set before it is imported, it also accepts CPU
  tensors and runs them through Triton's interpreter (slow; this is how CI tests it on CPU).
* ``cuda_backend``: ``make_backend()`` returns the ``"cuda"`` backend (compiled extension).
"""
