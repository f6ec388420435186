"""How replicas average their pseudo-gradients: one interface, pluggable strategies.

An exchange takes this replica's pseudo-gradients for one fragment and returns the
average over the replicas that contributed. It runs inside a torchft quorum, over
the manager's reconfigured process group, and never decides about commits: any
collective error is recorded by the manager, ``should_commit()`` then fails on
every replica and the outer loop discards the result. Compression codecs and their
error-feedback state plug in here (replica-local state: ``state_dict`` goes into
this replica's checkpoint, never to a healing peer, and ``reset`` runs on heal).

Bytes are counted where tensors are handed to a collective (the tensor given to the
all-reduce, the buffers an all-gather fills), not estimated from a formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.distributed_c10d import ReduceOp
from torchtitan.config import Configurable

EXCHANGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PendingExchange:
    """An exchange in flight; ``wait`` gives the averaged pseudo-gradients."""

    bytes_sent: int = 0
    bytes_received: int = 0
    contributors: int = 0
    """Replicas whose Δ is in the average (known after ``wait``)."""

    def wait(self) -> list[torch.Tensor]:
        raise NotImplementedError


class Exchange(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config):
        self.config = config

    def start(
        self,
        manager: Any,
        names: list[str],
        deltas: list[torch.Tensor],
        contributes: bool,
    ) -> PendingExchange:
        """Start averaging ``deltas`` (this replica's Δ for one fragment).

        ``contributes=False`` (a replica that has just healed and holds a copy of a
        peer's state) adds nothing to the average but still takes part in the
        collective so every replica's buffers have the same size.
        """
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def reset(self) -> None:
        """Forget replica-local state (after healing from a peer)."""


class _PendingAllReduce(PendingExchange):
    def __init__(self, work, flat: torch.Tensor, shapes: list[torch.Size]):
        self._work, self._flat, self._shapes = work, flat, shapes
        self.bytes_sent = self.bytes_received = flat.numel() * flat.element_size()

    def wait(self) -> list[torch.Tensor]:
        self._work.wait()
        flat = self._flat.float()
        # The last element carries the number of contributing replicas.
        self.contributors = int(flat[-1].round())
        count = flat[-1].clamp(min=1.0)
        total = flat[:-1].div_(count)
        return [t.view(s) for t, s in zip(total.split([s.numel() for s in self._shapes]), self._shapes)]


class DenseAllReduce(Exchange):
    """One all-reduce per fragment of the flattened pseudo-gradient, in ``dtype``.

    The buffer ends with a 1 (contributing) or 0 (healing) so the sum also counts
    contributors: the average is exact without trusting the quorum size, and a
    replica that just received a peer's state does not count that peer twice.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Exchange.Config):
        dtype: str = "float32"
        """float32 | bfloat16 | float16: the dtype summed on the wire."""

        def validate(self) -> None:
            if self.dtype not in EXCHANGE_DTYPES:
                raise ValueError(
                    f"outer.exchange.dtype must be one of {', '.join(EXCHANGE_DTYPES)}; got {self.dtype!r}"
                )

    def __init__(self, config: Config):
        config.validate()
        super().__init__(config)
        self.dtype = EXCHANGE_DTYPES[config.dtype]

    def start(self, manager, names, deltas, contributes):
        flag = torch.ones(1, device=deltas[0].device) if contributes else torch.zeros(1, device=deltas[0].device)
        flat = torch.cat([d.reshape(-1) for d in deltas] + [flag]).to(self.dtype)
        if not contributes:
            flat.zero_()
        work = manager.allreduce(flat, reduce_op=ReduceOp.SUM)
        return _PendingAllReduce(work, flat, [d.shape for d in deltas])
