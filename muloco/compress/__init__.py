"""Pseudo-gradient compression: codecs with fixed-size payloads, and error feedback.

A codec is chosen by its own config class (``Dense.Config``, ``Quantizer.Config``,
``TopK.Config``; ``CodecConfig`` is the choice among them, named ``dense``, ``quantize``
and ``topk`` on the command line) and made with ``build()`` (``codec.py``: ``encode`` a
flat tensor to uint8 bytes whose count depends only on numel, ``decode`` a batch of
payloads at once); ``ErrorFeedback`` carries what a codec dropped into the next round.
Figures: ``bench/codecs.py``.
"""

from typing import Annotated

import tyro

from .codec import Codec
from .dense import Dense
from .error_feedback import ErrorFeedback
from .packing import pack, packed_bytes, unpack
from .pieces import Pieces
from .quantize import Quantizer
from .topk import TopK, sparseloco_codec

CODECS: tuple[type[Codec], ...] = (Dense, Quantizer, TopK)

CodecConfig = (
    Annotated[Dense.Config, tyro.conf.subcommand(Dense.name)]
    | Annotated[Quantizer.Config, tyro.conf.subcommand(Quantizer.name)]
    | Annotated[TopK.Config, tyro.conf.subcommand(TopK.name)]
)
"""One codec's config; the command line picks it by name (``--outer.exchange.codec quantize``)."""

__all__ = [
    "CODECS",
    "Codec",
    "CodecConfig",
    "Dense",
    "ErrorFeedback",
    "Pieces",
    "Quantizer",
    "TopK",
    "pack",
    "packed_bytes",
    "sparseloco_codec",
    "unpack",
]
