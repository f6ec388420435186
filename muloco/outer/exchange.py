"""How replicas average their pseudo-gradients: one interface, pluggable strategies.

An exchange takes this replica's pseudo-gradients for one fragment and returns the
average over the replicas that contributed. It runs inside a torchft quorum, over
the manager's reconfigured process group, and never decides about commits: any
collective error is recorded by the manager, ``should_commit()`` then fails on
every replica and the outer loop discards the result. Compression codecs and their
error-feedback state plug in here (replica-local state: ``state_dict`` goes into
this replica's checkpoint, never to a healing peer, and ``reset`` runs on heal).

Bytes are counted from the buffers handed to each collective: what this replica's
collectives carry to and from the *other* replicas (a ring all-reduce of B bytes:
2(K−1)/K·B each way; an all-gather: (K−1)·B; an all-to-all: the splits for other
ranks). ``payload_bytes`` is the size of this replica's encoded Δ, from which the bits
per parameter follow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.distributed_c10d import ReduceOp
from torchtitan.config import Configurable

EXCHANGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PendingExchange:
    """An exchange in flight; ``wait`` gives the averaged pseudo-gradients."""

    bytes_sent: float = 0
    bytes_received: float = 0
    payload_bytes: int = 0
    """Size of this replica's encoded Δ (flag bytes included)."""
    dense_fp32_bytes: float = 0
    """What a dense fp32 ring all-reduce of the same Δ would carry each way, for comparison."""
    contributors: int = 0
    """Replicas whose Δ is in the average (known after ``wait``)."""

    def wait(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def rollback(self) -> None:
        """The sync did not commit: undo any replica-local state change it made."""


class Exchange(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        codec: Literal["dense", "quantize", "topk"] = "dense"
        """dense: one all-reduce in ``dtype``; quantize / topk: compressed payloads with error feedback."""
        dtype: str = "float32"
        """float32 | bfloat16 | float16: the dense all-reduce's dtype; with a codec, the dtype
        of tensors matched by ``skip_pattern``."""
        strategy: Literal["allgather", "reduce_scatter"] = "allgather"
        """allgather (exact, receives (K−1)× payload) or reduce_scatter (about 2× payload for any K)."""
        bits: int = 2
        """quantize: bits per element, 1 | 2 | 4 | 8."""
        scheme: str = "statistical"
        """quantize: statistical (mean, σ-range bins, centroid table) | absmax | minmax (uniform per block)."""
        block_size: int = 0
        """quantize: elements per block of statistics / scales (0 = the codec's default for
        ``bits``: 4096, larger at 4 and 8 bits so the statistical tables stay ≤ 0.125 bits/element)."""
        range_sigmas: float = 0.0
        """quantize statistical: bin range in σ (0 = the default for ``bits``, near Lloyd–Max)."""
        topk_fraction: float = 0.1
        """topk: fraction of each chunk kept, in (0, 1]."""
        topk_chunk: int = 4096
        """topk: chunk size (≤ 65536: indices are chunk-local, 16 bits)."""
        topk_value_dtype: str = "bfloat16"
        """topk: dtype of kept values (float32 | bfloat16 | float16) unless ``topk_value_bits``."""
        topk_value_bits: int = 0
        """topk: quantize kept values to 2 | 4 | 8 bits (0 = send them in ``topk_value_dtype``)."""
        error_feedback: bool = True
        """Keep what compression dropped and add it to the next Δ (e ← β·e + Δ)."""
        ef_beta: float = 0.9
        """β, decay of the error-feedback buffer, in [0, 1]."""
        skip_pattern: str = ""
        """Regex on parameter names sent dense in ``dtype`` (e.g. norms: ``norm\\.weight$``)."""

        def validate(self) -> None:
            if self.dtype not in EXCHANGE_DTYPES:
                raise ValueError(
                    f"outer.exchange.dtype must be one of {', '.join(EXCHANGE_DTYPES)}; got {self.dtype!r}"
                )
            if self.codec == "dense":
                return
            if self.strategy not in ("allgather", "reduce_scatter"):
                raise ValueError(f"outer.exchange.strategy must be allgather or reduce_scatter, got {self.strategy!r}")
            if not 0.0 <= self.ef_beta <= 1.0:
                raise ValueError(f"outer.exchange.ef_beta must be in [0, 1], got {self.ef_beta}")
            try:
                re.compile(self.skip_pattern)
            except re.error as err:
                raise ValueError(f"outer.exchange.skip_pattern is not a valid regex: {err}") from None
            try:
                self.make_codec()
            except ValueError as err:
                raise ValueError(f"outer.exchange ({self.codec}): {err}") from None

        def make_codec(self):
            from muloco.compress.build import make_codec

            if self.codec == "quantize":
                return make_codec("quantize", bits=self.bits, scheme=self.scheme, block_size=self.block_size or None,
                                  range_sigmas=self.range_sigmas or None)
            if self.codec == "topk":
                return make_codec("topk", fraction=self.topk_fraction, chunk_size=self.topk_chunk,
                                  value_dtype=self.topk_value_dtype, value_bits=self.topk_value_bits)
            raise ValueError(f"outer.exchange.codec must be dense, quantize or topk, got {self.codec!r}")

        def build(self, **kwargs) -> "Exchange":
            if self.codec == "dense":
                return DenseAllReduce(self)
            from muloco.outer.compressed_exchange import CompressedExchange

            return CompressedExchange(self)

    def __init__(self, config: Config):
        self.config = config

    def describe(self) -> str:
        c = self.config
        if c.codec == "dense":
            return f"dense {c.dtype} all-reduce"
        ef = f"error feedback β={c.ef_beta:g}" if c.error_feedback else "no error feedback"
        skip = f", {c.skip_pattern!r} dense {c.dtype}" if c.skip_pattern else ""
        return f"{c.make_codec().describe()}, {ef}, {c.strategy}{skip}"

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

    def allocate(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Called once per fragment (this rank's tensors) before training: create any
        replica-local state now, so a checkpoint can be loaded into it."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def reset(self) -> None:
        """Forget replica-local state (after healing from a peer)."""


class _PendingAllReduce(PendingExchange):
    def __init__(self, work, flat: torch.Tensor, shapes: list[torch.Size], k: int):
        self._work, self._flat, self._shapes = work, flat, shapes
        self.payload_bytes = flat.numel() * flat.element_size()
        self.bytes_sent = self.bytes_received = 2 * (k - 1) / k * self.payload_bytes
        self.dense_fp32_bytes = 2 * (k - 1) / k * 4 * (flat.numel() - 1)

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

    def __init__(self, config: Exchange.Config):
        config.validate()
        super().__init__(config)
        self.dtype = EXCHANGE_DTYPES[config.dtype]

    def start(self, manager, names, deltas, contributes):
        from muloco.outer.collectives import group_size

        flag = torch.ones(1, device=deltas[0].device) if contributes else torch.zeros(1, device=deltas[0].device)
        flat = torch.cat([d.reshape(-1) for d in deltas] + [flag]).to(self.dtype)
        if not contributes:
            flat.zero_()
        work = manager.allreduce(flat, reduce_op=ReduceOp.SUM)
        return _PendingAllReduce(work, flat, [d.shape for d in deltas], group_size(manager))
