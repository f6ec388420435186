"""``make_codec(kind, **settings)``: a codec from plain settings (a config section, a CLI).

Every kind names its settings explicitly, so a misspelt or misplaced setting is an error
that lists the valid ones rather than a silently ignored keyword.
"""

from __future__ import annotations

from .codec import Codec
from .identity import Identity
from .quantize import Quantizer
from .topk import TopK

# kind -> (class, the settings its constructor takes)
KINDS: dict[str, tuple[type[Codec], tuple[str, ...]]] = {
    "quantize": (Quantizer, ("bits", "scheme", "block_size", "range_sigmas")),
    "topk": (TopK, ("fraction", "chunk_size", "value_dtype", "value_bits")),
    "identity": (Identity, ("dtype",)),
}


def make_codec(kind: str, **settings) -> Codec:
    if kind not in KINDS:
        valid = "; ".join(f"{k} ({', '.join(s)})" for k, (_, s) in KINDS.items())
        raise ValueError(f"unknown codec kind {kind!r}; valid kinds (settings): {valid}")
    cls, names = KINDS[kind]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(map(repr, unknown))} for codec {kind!r}; "
                         f"valid settings: {', '.join(names)}")
    return cls(**settings)
