"""Pseudo-gradient compression: codecs with fixed-size payloads, and error feedback.

``make_codec("quantize" | "topk" | "identity", **settings)`` builds a ``Codec``
(``codec.py``: ``encode`` a flat tensor to uint8 bytes whose count depends only on numel,
``decode`` a batch of payloads at once); ``ErrorFeedback`` carries what a codec dropped
into the next round. Figures: ``bench/codecs.py``.
"""

from .build import KINDS, make_codec
from .codec import Codec
from .error_feedback import ErrorFeedback
from .identity import Identity
from .packing import pack, packed_bytes, unpack
from .quantize import Quantizer
from .topk import TopK

__all__ = ["KINDS", "Codec", "ErrorFeedback", "Identity", "Quantizer", "TopK", "make_codec", "pack",
           "packed_bytes", "unpack"]
