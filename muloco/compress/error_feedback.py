"""Error feedback: what compression dropped this round is sent in later rounds.

Per tensor name a float32 residual e (on the delta's device)::

    e ← β·e + Δ;   payload = encode(e);   e ← e − decode(payload)

With β = 1 nothing is ever lost: after any number of rounds, the sum of the decoded
payloads plus the residual equals the sum of the deltas (to float rounding), which is what
makes biased compressors (top-k, coarse quantizers) converge. β < 1 lets stale error
decay. The outer learning rate is not folded into e: the pseudo-gradient Δ goes in as it
is and the outer optimizer applies its learning rate once, to the decoded average
(MuLoCo's reference applies it to e and again in the outer step).

The buffers are plain tensors keyed by name, so ``state_dict()`` checkpoints with
``torch.save`` / ``torch.load(weights_only=True)`` or DCP. ``reset()`` forgets them all,
which a replica does after healing from a peer: its residuals describe a trajectory it no
longer follows.
"""

from __future__ import annotations

import torch

from .codec import Codec


class ErrorFeedback:
    def __init__(self, beta: float = 1.0, enabled: bool = True):
        if not 0.0 <= beta <= 1.0:  # also rejects NaN
            raise ValueError(f"error feedback beta must be in [0, 1], got {beta!r}")
        self.beta = float(beta)
        self.enabled = bool(enabled)
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(self, name: str, delta: torch.Tensor, codec: Codec) -> torch.Tensor:
        """Encode ``delta`` (any shape, any float dtype) plus the carried error of ``name``."""
        flat = delta.detach().reshape(-1)
        if not self.enabled:
            return codec.encode(flat)
        e = self._residual(name, flat)
        torch.add(flat, e, alpha=self.beta, out=e)  # e ← β·e + Δ in one pass
        payload = codec.encode(e)
        e.sub_(codec.decode(payload, e.numel()))
        return payload

    def _residual(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        e = self._residuals.get(name)
        if e is None:
            e = self._residuals[name] = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        elif e.numel() != flat.numel():
            raise ValueError(f"error feedback residual {name!r} has {e.numel()} elements, the delta {flat.numel()}")
        elif e.device != flat.device:  # e.g. loaded from a CPU checkpoint
            e = self._residuals[name] = e.to(flat.device)
        return e

    def residual(self, name: str) -> torch.Tensor | None:
        """The carried error of ``name`` (flat float32), or None before its first round."""
        return self._residuals.get(name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residuals = {name: t.detach().reshape(-1).to(torch.float32, copy=True) for name, t in state.items()}

    def reset(self) -> None:
        self._residuals.clear()

    def __len__(self) -> int:
        return len(self._residuals)
