"""Build recipe of the SDP4Bit CUDA extension (``sdp4bit.py``: ``SDP4BitBuilder``, a DeepSpeed CUDAOpBuilder).

This folder is data, not an importable API: ``deepspeed_sdp4bit._native`` loads ``sdp4bit.py`` by file path
under a private module name.  This file deliberately imports nothing and defines no ``__deepspeed__``:
when a source checkout's root is on ``sys.path``, DeepSpeed's accelerator probes ``from op_builder import
__deepspeed__`` to detect its own builders, and that probe must fail cleanly (ImportError) here.
"""
