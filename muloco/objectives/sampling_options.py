"""The diffusion sampler's named options, without torch: ``generate --help`` lists them before
anything heavy loads (``sampling.py`` checks a run's choice against the same tuples)."""

from __future__ import annotations

from dataclasses import dataclass

READOUT_KEY = "diffusion_readout"
"""The ``config.json`` key an export writes a non-default :class:`Readout` under."""


@dataclass(frozen=True)
class Readout:
    """How a masked-diffusion model's outputs line up with its canvas, which its recipe fixed
    (:mod:`muloco.objectives.recipes`) and every sampler and scorer must follow."""

    shift: bool = False
    """The output at i − 1 predicts token i (``dream``; ``block`` with ``shift``)."""
    block_size: int | None = None
    """Block-wise attention in blocks of this many tokens (``block``); None: the whole canvas."""

    def to_json(self) -> dict | None:
        """What an export's ``config.json`` records (None: the default, nothing to record)."""
        return None if self == Readout() else {"shift": self.shift, "block_size": self.block_size}

    @classmethod
    def from_json(cls, value) -> Readout:
        """The readout a ``config.json`` records (none: the default); ValueError if malformed."""
        if value is None:
            return cls()
        block = value.get("block_size") if isinstance(value, dict) else None
        if (
            not isinstance(value, dict)
            or set(value) - {"shift", "block_size"}
            or not isinstance(value.get("shift", False), bool)
            or not (block is None or (type(block) is int and block > 0))
        ):
            raise ValueError(
                f"config.json's {READOUT_KEY} {value!r} is not {{'shift': bool, 'block_size': int or null}}"
            )
        return cls(shift=value.get("shift", False), block_size=value.get("block_size"))


ORDERS = ("confidence", "margin", "entropy", "random")
"""Which masked positions a step fills first: the predicted token's probability, the gap between
the two most likely tokens, the negative entropy, or a random order."""
CACHES = ("none", "prefix", "dual", "block")
"""``prefix``: Fast-dLLM's block-wise prefix cache; ``dual``: its dual cache (prefix and suffix);
``block``: the exact key/value cache of a block-wise model's finished blocks."""
