"""How replicas average their pseudo-gradients: a codec, a strategy, error feedback, buckets.

An exchange takes this replica's pseudo-gradient Δ for one fragment and returns the
average over the replicas that contributed. It runs inside a torchft quorum, over the
manager's reconfigured process group, and never decides about commits: any collective
error is recorded by the manager, ``should_commit()`` then fails on every replica and the
outer loop discards the result (and calls ``rollback``).

What it is made of, each chosen by its own config class (torchtitan's ``Configurable``):

- the **codec** (``compress/``): ``dense`` (its dtype on the wire), ``quantize`` or
  ``topk``; on the command line ``--outer.exchange.codec quantize`` picks it and
  ``--outer.exchange.codec.bits 2`` sets its own settings (a setting of another codec is
  an error that names the codec);
- the **strategy** (``strategies.py``): ``allreduce`` (dense only), ``allgather`` or
  ``reduce_scatter``; unset, ``allreduce`` for the dense codec and ``allgather`` otherwise;
- **error feedback** (replica-local state: ``state_dict`` goes into this replica's
  checkpoint, never to a healing peer, and ``reset`` runs on heal);
- tensors matching ``skip_pattern`` (norms, say) form a second stream sent dense in
  ``skip_dtype``, through the same strategy;
- **buckets**: both streams are processed ``bucket_mb`` MB of parameters at a time, a few
  buckets in flight (``pipeline.py``): the memory of a sync is O(n) + O(K · bucket).

Bytes are counted from the buffers handed to each collective: what this replica's
collectives carry to and from the *other* replicas (a ring all-reduce of B bytes:
2(K−1)/K·B each way; an all-gather: (K−1)·B; an all-to-all: the splits for other
ranks). ``payload_bytes`` is the size of this replica's encoded Δ, from which the bits
per parameter follow. :meth:`Exchange.wire_bytes` gives the same from the formulas, for any K,
and :meth:`Exchange.link_transfers` the collectives one by one, as the emulated link
(``link.py``) and the link planner see them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import tyro
from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from muloco.compress import CodecConfig, Dense, ErrorFeedback, Pieces
from muloco.compress.dense import DTYPES
from muloco.compress.kernels import KERNELS, use_compiled
from muloco.outer.exchange.layout import COMPRESSED, DENSE, FragmentLayout, stream_buckets
from muloco.outer.exchange.link import Link, Transfer
from muloco.outer.exchange.pipeline import TIMINGS, PendingExchange, Plan, Sync, Work, record_bytes
from muloco.outer.exchange.strategies import STRATEGIES, AllGather, AllReduce, StrategyConfig

MB = 2**20
WEIGHTINGS = ("auto", "equal", "tokens")


class Exchange(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        codec: tyro.conf.AvoidSubcommands[CodecConfig] = field(default_factory=Dense.Config)
        """dense | quantize | topk: pick with ``--outer.exchange.codec NAME``, then set its
        own settings as ``--outer.exchange.codec.SETTING`` (see --help after picking)."""
        strategy: tyro.conf.AvoidSubcommands[StrategyConfig | None] = None
        """allreduce (dense only) | allgather | reduce_scatter; unset: allreduce for the
        dense codec, allgather for the others."""
        error_feedback: ErrorFeedback.Config = field(default_factory=ErrorFeedback.Config)
        """What a lossy codec dropped is added to the next Δ (e ← β·e + Δ)."""
        skip_pattern: str = ""
        """Regex on parameter names sent dense in ``skip_dtype`` (e.g. norms: ``norm\\.weight$``)."""
        skip_dtype: str = "float32"
        """float32 | bfloat16 | float16: dtype of the tensors matched by ``skip_pattern``."""
        bucket_mb: float = 64.0
        """Parameters (float32 MB) encoded, exchanged and decoded at a time."""
        pipeline_depth: int = 2
        """Buckets in flight (2: bucket b+1 is encoded while bucket b's collective runs)."""
        kernels: str = "auto"
        """auto (eager: on an H200 the faster for the default 2-bit codec and every decode,
        docs/gpu.md) | eager | compiled (torch.compile; the
        same payloads byte for byte)."""
        weighting: str = "auto"
        """auto (the round mode's: tokens in deadline rounds, equal in lockstep rounds) | equal (every contributor's
        Δ counts the same) | tokens (each counts by the tokens its
        group trained since its last sync, agreed in one 40-byte record per replica and sync:
        ``pipeline.work_weights``). Groups that train the same number of steps get the plain
        mean bit for bit; groups that train different numbers of steps per round (replica
        groups of unequal speed) enter by the work they did."""
        timing: str = "host"
        """How a sync's parts are timed: host (the time the host blocked in each part; on CUDA
        a part absorbs the kernels queued before its first wait) or device (each part waits for
        the device work queued before it, counted as ``queued``, and for its own kernels: where
        a sync's time goes, at the cost of its overlap)."""
        tiles: int = 0
        """Top-k only: store each matrix as tiles of up to ``tiles`` × ``tiles`` (the largest
        divisors of its dimensions), so each top-k chunk of ``tiles²`` is one tile: SparseLoCo's
        64×64 layout (``layout.py``). 0: the flat stream, chunks of consecutive elements."""

        def validate(self) -> None:
            try:
                self.codec.validate()
            except ValueError as err:
                raise ValueError(f"outer.exchange.codec ({_codec_name(self.codec)}): {err}") from None
            try:
                self.error_feedback.validate()
            except ValueError as err:
                raise ValueError(f"outer.exchange.error_feedback.{err}") from None
            try:
                re.compile(self.skip_pattern)
            except re.error as err:
                raise ValueError(f"outer.exchange.skip_pattern is not a valid regex: {err}") from None
            if self.skip_dtype not in DTYPES:
                raise ValueError(
                    f"outer.exchange.skip_dtype must be one of {', '.join(DTYPES)}; got {self.skip_dtype!r}"
                )
            if not (math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
                raise ValueError(f"outer.exchange.bucket_mb must be a positive number, got {self.bucket_mb!r}")
            if self.pipeline_depth < 1:
                raise ValueError(f"outer.exchange.pipeline_depth must be >= 1, got {self.pipeline_depth!r}")
            if self.kernels not in KERNELS:
                raise ValueError(f"outer.exchange.kernels must be one of {', '.join(KERNELS)}; got {self.kernels!r}")
            if self.weighting not in WEIGHTINGS:
                raise ValueError(
                    f"outer.exchange.weighting must be one of {', '.join(WEIGHTINGS)}; got {self.weighting!r}"
                )
            self.check_weighting("equal")  # auto: the outer loop checks it with its round mode's meaning
            if self.timing not in TIMINGS:
                raise ValueError(f"outer.exchange.timing must be one of {', '.join(TIMINGS)}; got {self.timing!r}")
            if self.tiles < 0:
                raise ValueError(f"outer.exchange.tiles must be >= 0 (0: no tiles), got {self.tiles!r}")
            if self.tiles:
                chunk = getattr(self.codec, "chunk_size", None)
                if chunk is None:
                    raise ValueError(
                        f"outer.exchange.tiles lays out top-k chunks; the {_codec_name(self.codec)} "
                        f"codec has none: use --outer.exchange.codec topk or --outer.exchange.tiles 0"
                    )
                if chunk != self.tiles**2:
                    raise ValueError(
                        f"outer.exchange.tiles {self.tiles} makes tiles of {self.tiles**2} elements; "
                        f"set --outer.exchange.codec.chunk_size {self.tiles**2} so a chunk is a tile"
                    )
            strategy = self.resolved_strategy().build()
            try:
                strategy.check_codec(self.codec.build())
            except ValueError as err:
                raise ValueError(f"outer.exchange.strategy {strategy.name}: {err}") from None

        def resolved_weighting(self, auto: str) -> str:
            """equal or tokens: ``auto`` is what the round mode says (``RoundMode.Config.auto_weighting``)."""
            return auto if self.weighting == "auto" else self.weighting

        def check_weighting(self, auto: str, rounds: str = "") -> None:
            """A weighted all-reduce scales each Δ before the sum: only lossless payloads allow it
            (``auto``: the round mode's weighting, ``rounds``: its name, for the message)."""
            if self.resolved_weighting(auto) != "tokens" or not isinstance(self.resolved_strategy(), AllReduce.Config):
                return
            why = (
                "outer.exchange.weighting tokens"
                if self.weighting == "tokens"
                else f"{rounds or 'these'} rounds weigh each group's Δ by its tokens (outer.exchange.weighting auto; "
                "equal turns it off), which"
            )
            carried = [self.codec] + ([Dense.Config(dtype=self.skip_dtype)] if self.skip_pattern else [])
            lossy = [c.describe() for c in (c.build() for c in carried) if not c.lossless]
            if lossy:
                raise ValueError(
                    f"{why} scales each Δ by its weight before an all-reduce sums it, which only a "
                    f"lossless (float32) payload allows; with {lossy[0]} use "
                    f"--outer.exchange.strategy allgather"
                )

        def carries_feedback(self) -> bool:
            """Whether any stream of this exchange keeps an error-feedback residual (a lossy codec with
            feedback on)."""
            feedback = self.error_feedback.build()
            carried = [self.codec] + ([Dense.Config(dtype=self.skip_dtype)] if self.skip_pattern else [])
            return any(feedback.applies_to(c.build()) for c in carried)

        def resolved_strategy(self):
            if self.strategy is not None:
                return self.strategy
            return AllReduce.Config() if isinstance(self.codec, Dense.Config) else AllGather.Config()

    def __init__(
        self,
        config: Config,
        *,
        device: torch.device | None = None,
        link: Link | None = None,
        auto_weighting: str = "equal",
        gathers_work: bool = False,
    ):
        """``auto_weighting``: what ``auto`` means in the loop's round mode; ``gathers_work``: every sync
        gathers each replica's work record whatever the weighting (a weighted exchange always does), as
        deadline rounds need for their paces."""
        config.validate()
        self.config = config
        self.weighting = config.resolved_weighting(auto_weighting)
        """equal or tokens (``auto`` resolved by the round mode)."""
        config.check_weighting(auto_weighting)
        self.records = gathers_work or self.weighting == "tokens"
        self.device = device or torch.device("cpu")
        self.link = link or Link.Config().build()
        self.compiled = use_compiled(config.kernels, self.device)
        self.codec = config.codec.build(compiled=self.compiled)
        self.codecs = {COMPRESSED: self.codec, DENSE: Dense.Config(dtype=config.skip_dtype).build()}
        self.strategy = config.resolved_strategy().build()
        self.feedback = config.error_feedback.build()
        self.skip = re.compile(config.skip_pattern) if config.skip_pattern else None
        self.bucket_numel = max(1, int(config.bucket_mb * MB) // 4)
        self.plans: dict[tuple[str, ...], Plan] = {}

    def describe(self) -> str:
        fed = [s for s, c in self.codecs.items() if self.feedback.applies_to(c)]
        ef = f"error feedback β={self.feedback.beta:g}" if fed else "no error feedback"
        skip = f", {self.config.skip_pattern!r} dense {self.config.skip_dtype}" if self.skip else ""
        kernels = "compiled" if self.compiled else "eager"
        skip += f", {self.config.tiles}x{self.config.tiles} tiles" if self.config.tiles else ""
        link = f", {self.link.config.describe()}" if self.link.enabled else ""
        link += ", weighted by tokens" if self.weighted else ""
        return (
            f"{self.codec.describe()}, {ef}, {self.strategy.name}{skip}, buckets of "
            f"{self.config.bucket_mb:g} MB, {kernels} kernels{link}"
        )

    @property
    def feedback_beta(self) -> float | None:
        """The error-feedback β of the next encode (None: the codec is lossless or feedback is off)."""
        return self.feedback.beta if self.feedback.applies_to(self.codec) else None

    def set_feedback_beta(self, beta: float) -> None:
        """β for the syncs from now on (the outer loop's schedule sets it at each prepare)."""
        self.feedback.beta = float(beta)

    def set_outer_lr(self, lr: float) -> None:
        """The outer lr of the sync about to start: folded into the residual with
        ``error_feedback.fold_outer_lr`` (SparseLoCo's reference code), unused otherwise."""
        self.feedback.delta_scale = float(lr) if self.config.error_feedback.fold_outer_lr else 1.0

    # ------------------------------------------------------------------- state

    def allocate(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Once per fragment (this rank's tensors), before training: its layout, and zero
        residuals so a checkpoint load (DCP loads in place) finds them."""
        layout = FragmentLayout(names, [t.shape for t in tensors], self.skip, tile=self.config.tiles)
        irregular = layout.irregular_tiles(self.config.tiles)
        if irregular:
            logger.info(
                f"tile layout: {', '.join(irregular)} have dimensions {self.config.tiles} does not divide: "
                f"their tiles are smaller, and a top-k chunk spans several of them"
            )
        self.plans[tuple(names)] = Plan(
            layout,
            self.strategy,
            self.codecs,
            self.feedback,
            self.bucket_numel,
            self.config.pipeline_depth,
            self.device,
            self.link,
            self.config.timing,
        )
        for stream, codec in self.codecs.items():
            if self.feedback.applies_to(codec) and layout.numel[stream]:
                self.feedback.allocate(f"{layout.key}/{stream}", layout.numel[stream], tensors[0].device)

    def state_dict(self) -> dict[str, Any]:
        """Residuals under this rank's key: under FSDP each rank's residuals cover its own
        shards, and distinct keys keep DCP from treating them as one replicated tensor."""
        residuals = self.feedback.state_dict()
        return {
            _rank_key(): {s: {k: t for k, t in residuals.items() if k.endswith("/" + s)} for s in (COMPRESSED, DENSE)}
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = state.get(_rank_key())
        if mine is None:
            raise ValueError(f"the checkpoint has no error-feedback residuals for {_rank_key()}")
        self.feedback.load_state_dict({k: t for s in (COMPRESSED, DENSE) for k, t in mine.get(s, {}).items()})

    def reset(self) -> None:
        """Zero the residuals (after healing from a peer: they describe a trajectory this
        replica no longer follows). Zeroed, not dropped, so a checkpoint taken before the
        next sync still has every key a later load expects."""
        self.feedback.reset()

    # -------------------------------------------------------------------- sync

    def start(
        self,
        manager: Any,
        names: list[str],
        fill: Callable[[list[torch.Tensor]], None],
        contributes: bool,
        quorum_seconds: float = 0.0,
        work: Work | None = None,
    ) -> PendingExchange:
        """Start averaging one fragment's Δ, which ``fill`` writes into the views it is given
        (one per tensor of the fragment, in ``names`` order).

        ``contributes=False`` (a replica that has just healed and holds a copy of a peer's
        state) adds nothing to the average but still takes part in the collectives so every
        replica's buffers have the same size. ``quorum_seconds``: how long this replica's
        quorum took, sent along so each replica can tell its wait for the slowest apart.
        ``work``: what this replica trained since its last sync, gathered
        from every replica when the exchange keeps records (its weight, when the exchange is weighted).
        """
        plan = self.plans.get(tuple(names))
        if plan is None:
            raise ValueError(f"exchange.allocate was not called for the fragment {names[0]}..{names[-1]}")
        if self.records and work is None:
            raise ValueError("this exchange gathers work records: start() needs this replica's work")
        return Sync(
            plan,
            manager,
            fill,
            contributes=contributes,
            quorum_seconds=quorum_seconds,
            work=work if self.records else None,
            weighted=self.weighted,
        )

    @property
    def weighted(self) -> bool:
        return self.weighting == "tokens"

    def wire_phases(
        self, k: int, numel: int, numel_dense: int = 0, rank: int = 0, sizes: list[int] | None = None
    ) -> list[dict[str, float]]:
        """Replica ``rank``'s collectives in one sync of a fragment with ``numel`` compressed and
        ``numel_dense`` skipped elements, from the wire format alone, for any K: per collective
        its payload and the bytes it sends and receives (what the exchange counts from its
        buffers; a sync's one-off bytes ride with the first collective listed, as they ride with
        the first one issued). Listed stream by stream, which need not be the issue order: the
        sums, and the link's queued time, do not depend on it. ``sizes``: the compressed
        tensors' elements, for a codec whose blocks are whole tensors (default: one tensor)."""
        phases: list[dict[str, float]] = []
        layout = {COMPRESSED: (numel, sizes if sizes is not None else [numel]), DENSE: (numel_dense, [numel_dense])}
        for stream, codec in self.codecs.items():
            for bucket in stream_buckets(stream, *layout[stream], codec, self.bucket_numel):
                piece_codec = Pieces(codec, bucket.pieces) if bucket.pieces else codec
                phases += [dict(p) for p in self.strategy.bucket_phases(k, piece_codec, bucket.numel, rank)]
        once = self.strategy.sync_bytes(k, rank, self.weighted)
        if self.records:  # the work records, gathered before any bucket
            once = {key: value + once[key] for key, value in record_bytes(k).items()}
        if not phases:
            phases.append({"payload": 0.0, "sent": 0.0, "received": 0.0})
        for key, value in once.items():
            phases[0][key] = phases[0].get(key, 0.0) + value
        return phases

    def wire_bytes(
        self, k: int, numel: int, numel_dense: int = 0, rank: int = 0, sizes: list[int] | None = None
    ) -> dict[str, float]:
        """Bytes replica ``rank`` sends and receives in one sync (and its payload): the sum of
        :meth:`wire_phases`."""
        total = {"payload": 0.0, "sent": 0.0, "received": 0.0}
        for phase in self.wire_phases(k, numel, numel_dense, rank, sizes):
            for key in total:
                total[key] += phase.get(key, 0.0)
        return total

    def link_transfers(
        self, k: int, numel: int, numel_dense: int = 0, rank: int = 0, sizes: list[int] | None = None
    ) -> list[Transfer]:
        """The collectives of one sync as the emulated link sees them (``link.py``)."""
        rounds = self.strategy.rounds(k) if k > 1 else 0
        return [
            Transfer(p["sent"], p["received"], rounds) for p in self.wire_phases(k, numel, numel_dense, rank, sizes)
        ]


def _rank_key() -> str:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return f"rank_{rank}"


def _codec_name(config: Any) -> str:
    owner = getattr(type(config), "_owner", None)
    return getattr(owner, "name", type(config).__name__)


__all__ = ["STRATEGIES", "Exchange", "PendingExchange"]
