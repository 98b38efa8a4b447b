"""deepspeed_sdp4bit: ~4-bit communication for DeepSpeed ZeRO-3 (SDP4Bit, NeurIPS 2024).

``import deepspeed_sdp4bit`` checks the DeepSpeed version and installs the integration hooks, after which a
ds_config with an ``"sdp4bit"`` block turns the method on in ``deepspeed.initialize``.
"""

__version__ = "0.1.0"

from .config import SDP4BitConfig, SDP4BitConfigError, parse_block, parse_ds_config  # noqa: F401
from .topology import Topology, TopologyShape  # noqa: F401
from . import reference  # noqa: F401
from . import ops  # noqa: F401
from . import integration  # noqa: F401,E402 - checks the DeepSpeed version, installs the hooks
integration.install()
