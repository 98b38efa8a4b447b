"""Quantized collectives of SDP4Bit: the gradient reduce-scatter (``gradients``), the weight all-gather
(``weights``) and their shared byte accounting (``stats``)."""
