"""deepspeed_sdp4bit: ~4-bit communication for DeepSpeed ZeRO-3 (SDP4Bit, NeurIPS 2024).

``import deepspeed_sdp4bit`` checks the DeepSpeed version and installs the integration hooks, after which a
ds_config with an ``"sdp4bit"`` block turns the method on in ``deepspeed.initialize``.
"""

__version__ = "0.1.0"

import contextlib as _contextlib
import sys as _sys


def _running_as_cli() -> bool:
    """``python -m deepspeed_sdp4bit``: that process's stdout carries the report (``--json`` is read by tools), so
    DeepSpeed, imported below, must not log there (its logger binds a handler to ``sys.stdout`` when it is created,
    and warns on import, e.g. 'Setting accelerator to CPU' on a machine without a GPU)."""
    argv = list(getattr(_sys, "orig_argv", ()))
    return "-m" in argv[:-1] and argv[argv.index("-m") + 1] == __name__


# in the command-line process DeepSpeed's logger is created on stderr; an importing program is left as it is
with _contextlib.redirect_stdout(_sys.stderr) if _running_as_cli() else _contextlib.nullcontext():
    from .config import SDP4BitConfig, SDP4BitConfigError, parse_block, parse_ds_config  # noqa: F401
    from .topology import Topology, TopologyShape  # noqa: F401
    from . import reference  # noqa: F401
    from . import ops  # noqa: F401
    from . import integration  # noqa: F401 - checks the DeepSpeed version, installs the hooks
    integration.install()   # imports DeepSpeed
