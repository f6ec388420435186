"""Error feedback: what compression dropped this round is sent in later rounds.

Per key (one stream of one fragment) a flat float32 residual e on the delta's device::

    e ← β·e + Δ;   payload = encode(e);   e ← e − decode(payload)

With β = 1 nothing is ever lost: after any number of rounds, the sum of the decoded
payloads plus the residual equals the sum of the deltas (to float rounding), which is what
makes biased compressors (top-k, coarse quantizers) converge. β < 1 lets stale error
decay. The compressed configs use β = 0.95 with a plain SGD outer step at lr 1: the residual
is then the outer momentum (SparseLoCo's design), which measured better than Nesterov momentum
stacked on top of it, and than EF21 or residuals rescaled by the learning rate
(``docs/compression.md``). The outer learning rate is not folded into e: the pseudo-gradient Δ goes in as it
is and the outer optimizer applies its learning rate once, to the decoded average
(MuLoCo's reference applies it to e and again in the outer step). ``fold_outer_lr`` does what
SparseLoCo's reference code does, for reproducing it: e ← β·e + η·Δ, and the outer step applies η
again (at η = 1, its published setting, nothing differs).

The exchange compresses a stream piece by piece (``offset``: a bucket's place in the
stream). A sync that does not commit must take its update back; instead of cloning every
residual at each sync, ``compress`` can hand the residual it replaces to the caller, in a
buffer the caller no longer needs (the exchange uses the piece of Δ it just encoded), and
``restore`` puts it back. No memory beyond the residuals and the caller's Δ, no extra pass.

The buffers are plain tensors keyed by name, so ``state_dict()`` checkpoints with
``torch.save`` / ``torch.load(weights_only=True)`` or DCP. ``reset()`` zeroes them, which a
replica does after healing from a peer: its residuals describe a trajectory it no longer
follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.config import Configurable

from .codec import Codec


class ErrorFeedback(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enabled: bool = True
        """Keep what a lossy codec dropped and add it to the next Δ."""
        beta: float = 0.9
        """β, the decay of the residual (e ← β·e + Δ), in [0, 1]."""
        fold_outer_lr: bool = False
        """e ← β·e + η·Δ with η the outer lr, which the outer step then applies again (SparseLoCo's
        reference code; ``diloco/sparseloco_published``). Off: η is applied once, to the average.
        Streams without a residual (lossless ones: fp32 norms sent whole) are not scaled: at η ≠ 1
        their step is η·Δ, not the reference's η²·Δ."""

        def validate(self) -> None:
            if not 0.0 <= self.beta <= 1.0:  # also rejects NaN
                raise ValueError(f"beta must be in [0, 1], got {self.beta!r}")

    def __init__(self, config: Config | None = None):
        config = config or ErrorFeedback.Config()
        config.validate()
        self.config = config
        self.beta = float(config.beta)
        self.enabled = bool(config.enabled)
        self.delta_scale = 1.0
        """η with ``fold_outer_lr`` (the outer loop sets it each sync), else 1."""
        self._residuals: dict[str, torch.Tensor] = {}

    def applies_to(self, codec: Codec) -> bool:
        """Whether ``codec`` gets a residual (a lossless one has nothing to carry)."""
        return self.enabled and not codec.lossless

    def allocate(self, key: str, numel: int, device: torch.device) -> None:
        """A zero residual for ``key`` now (so a checkpoint load, which DCP does in place, finds it)."""
        if key not in self._residuals:
            self._residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)

    def compress(
        self, key: str, delta: torch.Tensor, codec: Codec, offset: int = 0, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Encode ``delta`` (a piece of ``key``'s stream starting at ``offset``) plus its carried error.

        ``keep`` (as many elements as ``delta``; it may be ``delta`` itself) receives the
        residual piece as it was before this call, for :meth:`restore`.
        """
        flat = delta.detach().reshape(-1)
        if not self.enabled:
            return codec.encode(flat)
        e = self._residual(key, offset + flat.numel(), flat.device)[offset : offset + flat.numel()]
        if self.delta_scale == 1.0:
            target = torch.add(flat, e, alpha=self.beta)  # β·e + Δ in one pass
        else:
            target = torch.mul(e, self.beta).add_(flat, alpha=self.delta_scale)  # β·e + η·Δ
        payload = codec.encode(target)
        if keep is not None:
            keep.view(-1).copy_(e)
        torch.sub(target, codec.decode(payload, target.numel()), out=e)
        return payload

    def restore(self, key: str, saved: torch.Tensor, offset: int = 0) -> None:
        """Put back the residual piece ``compress(..., keep=saved)`` replaced."""
        e = self._residuals.get(key)
        if e is not None:
            e[offset : offset + saved.numel()].copy_(saved.reshape(-1))

    def _residual(self, key: str, numel: int, device: torch.device) -> torch.Tensor:
        e = self._residuals.get(key)
        if e is None:
            e = self._residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif e.numel() < numel:
            raise ValueError(f"error feedback residual {key!r} has {e.numel()} elements, the delta reaches {numel}")
        elif e.device != device:  # e.g. loaded from a CPU checkpoint
            e = self._residuals[key] = e.to(device)
        return e

    def residual(self, key: str) -> torch.Tensor | None:
        """The carried error of ``key`` (flat float32), or None before its first round."""
        return self._residuals.get(key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residuals = {key: t.detach().reshape(-1).to(torch.float32, copy=True) for key, t in state.items()}

    def reset(self) -> None:
        """Zero every residual in place (keys kept: a later checkpoint load expects them)."""
        for e in self._residuals.values():
            e.zero_()

    def __len__(self) -> int:
        return len(self._residuals)
