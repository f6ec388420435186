"""The link planner: what a link between replica groups will cost a run, before a cluster is booked.

``python -m muloco.model_map --flavor F --replicas K --link-mbps B --bits b --sync-every H
--step-seconds s [--streaming-fragments n --overlap τ --max-share 0.05]`` projects, for one
replica of K, the time a sync spends on the link, its share of a round of H inner steps, the
H or the bits that keep that share under ``--max-share``, and the tokens per second per
replica group that follow.

The sync time is the emulated link's model (``muloco/utils/link_model.py``) applied to the bytes the
exchange would hand its collectives (``Exchange.link_transfers``, the wire format the exchange
counts its real bytes by), so the planner and a run with ``--outer.link.mbps B`` agree on the
link part of a sync. What the planner leaves out, and a measured sync has: the quorum, encoding
and decoding, the outer step (small beside a slow link; ``docs``' comparison shows how small).

A round: H inner steps of ``s`` seconds, then the sync's time on the link less what the τ
overlapped inner steps hide (streaming: with n fragments, n syncs of 1/n of the model per
round, each overlapped by τ steps). With ``--group-slowdowns f1 .. fK`` the groups differ
(group i steps in f_i·s): a lockstep round then lasts the slowest group's H steps, and the plan
says what the others lose waiting for it (their idle share and GPU-seconds) and what the job
would train if each group kept its own pace, and what deadline rounds (``round_budget.py``: each
group trains the steps of its own pace that fit in the slowest group's H steps, clamped) train
and wait instead. Step time is ``--step-seconds``, or FLOPs per step over
``--mfu`` × the peak of ``--gpu`` × ``--gpus-per-group`` (torchtitan's 6·N + 12·L·d·T FLOPs
per token; both numbers come from the user, the peak table is printed where it is used).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from muloco.models.flavors import (
    LLAMA3_VOCAB,
    block_parameters,
    count_parameters,
    parse_flavor,
)
from muloco.utils import round_budget
from muloco.utils.errors import BadInput
from muloco.utils.link_model import format_rate, transfer_seconds

GPU_PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "a100": 312.0, "b200": 2250.0, "l40s": 362.0}
"""Dense bf16 peak TFLOPS by GPU (vendors' datasheets, SXM parts; no sparsity). ``--gpu`` also
takes a number of TFLOPS."""

BITS = (32, 16, 8, 4, 2, 1)
"""What ``--bits`` offers: 32 and 16 dense (float32, bfloat16), 8 to 1 the statistical
quantizer of the shipped compressed configs (norm weights dense in float32, as they send them).
The table of alternatives adds the shipped SparseLoCo config (``diloco/sparseloco``)."""

STRATEGIES = ("auto", "allreduce", "allgather", "reduce_scatter")

DEFAULT_GPU = "h100"
DEFAULT_MFU = 0.4
"""The step time without ``--step-seconds``, ``--gpu`` or ``--mfu``: an H100 at 40% MFU (our trainer
measured 45.8% on the 416M shape compiled, ``docs/gpu.md``); the output says when it is assumed."""


class PlanError(BadInput, ValueError):
    """A planner input that cannot be planned: one line naming it and the fix."""


@dataclass(frozen=True)
class Inputs:
    flavor: str
    replicas: int
    mbps: float
    sync_every: int
    bits: int = 32
    latency_ms: float = 0.0
    strategy: str = "auto"
    step_seconds: float | None = None
    mfu: float | None = None
    gpu: str | None = None
    gpus_per_group: int = 1
    fragments: int = 1
    overlap: int = 0
    max_share: float = 0.05
    global_batch: int = 512
    seq_len: int = 2048
    vocab: int = LLAMA3_VOCAB
    group_slowdowns: tuple[float, ...] = ()
    """Each replica group's step time as a multiple of the step (K numbers); () for equal groups."""
    round_quantile: float = 1.0
    """Deadline rounds (``round_budget.py``): the round ends at H times this quantile of the step times."""
    round_min_steps: int = 1
    round_max_steps: int = 0
    """Deadline rounds: a group's inner steps per round are clamped to [min, max] (max 0: 2H)."""

    def check(self) -> None:
        parse_flavor(self.flavor)
        if self.replicas < 2:
            raise PlanError(f"--replicas {self.replicas}: a link joins at least 2 replica groups")
        if not (math.isfinite(self.mbps) and self.mbps > 0):
            raise PlanError(f"--link-mbps {self.mbps!r}: must be a positive number of megabits per second")
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise PlanError(f"--latency-ms {self.latency_ms!r}: must be a number >= 0")
        if self.bits not in BITS:
            raise PlanError(f"--bits {self.bits}: use one of {', '.join(map(str, BITS))}")
        if self.strategy not in STRATEGIES:
            raise PlanError(f"--strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}")
        if self.bits < 16 and self.strategy == "allreduce":
            raise PlanError(
                f"--strategy allreduce sums dense numbers only; with --bits {self.bits} use allgather or reduce_scatter"
            )
        if self.sync_every < 1 or self.fragments < 1 or self.sync_every % self.fragments:
            raise PlanError(
                f"--sync-every {self.sync_every} must be a positive multiple of --streaming-fragments {self.fragments}"
            )
        if not 0 <= self.overlap < self.sync_every // self.fragments:
            raise PlanError(
                f"--overlap {self.overlap}: must be >= 0 and below H/n = "
                f"{self.sync_every // self.fragments} (the steps between two fragments' syncs)"
            )
        if not 0 < self.max_share < 1:
            raise PlanError(f"--max-share {self.max_share}: a fraction between 0 and 1, e.g. 0.05")
        if self.global_batch % self.replicas:
            raise PlanError(f"--global-batch {self.global_batch} does not split over --replicas {self.replicas}")
        if self.group_slowdowns and len(self.group_slowdowns) != self.replicas:
            raise PlanError(
                f"--group-slowdowns gives {len(self.group_slowdowns)} numbers for --replicas "
                f"{self.replicas}: give one per replica group (1 for a group at the step's pace)"
            )
        if not all(math.isfinite(f) and f > 0 for f in self.group_slowdowns):
            raise PlanError(
                f"--group-slowdowns {' '.join(f'{f:g}' for f in self.group_slowdowns)}: each must be a "
                "positive multiple of the step time (1.5: a group 1.5x slower)"
            )
        if not 0 < self.round_quantile <= 1:
            raise PlanError(
                f"--round-quantile {self.round_quantile}: a fraction in (0, 1]; 1 ends a round at the "
                "slowest group's H steps"
            )
        if not 1 <= self.round_min_steps <= self.round_max_steps_or_default:
            raise PlanError(
                f"--round-min-steps {self.round_min_steps} and --round-max-steps "
                f"{self.round_max_steps}: need 1 <= min <= max (max 0: 2H)"
            )
        if self.step_seconds is None:
            if not (math.isfinite(self.mfu_or_default) and 0 < self.mfu_or_default <= 1):
                raise PlanError(f"--mfu {self.mfu}: a fraction between 0 and 1, e.g. 0.4")
            peak_tflops(self.gpu_or_default)
            if self.gpus_per_group < 1:
                raise PlanError(f"--gpus-per-group {self.gpus_per_group}: at least 1")
        elif self.mfu is not None or self.gpu is not None:
            raise PlanError("--step-seconds gives the step time; --mfu and --gpu derive it: give one or the other")
        elif not (math.isfinite(self.step_seconds) and self.step_seconds > 0):
            raise PlanError(f"--step-seconds {self.step_seconds}: must be positive")

    @property
    def round_max_steps_or_default(self) -> int:
        return self.round_max_steps or 2 * self.sync_every

    @property
    def gpu_or_default(self) -> str:
        return DEFAULT_GPU if self.gpu is None else self.gpu

    @property
    def mfu_or_default(self) -> float:
        return DEFAULT_MFU if self.mfu is None else self.mfu


def peak_tflops(gpu: str) -> float:
    try:
        value = float(gpu)
    except ValueError:
        value = GPU_PEAK_TFLOPS.get(gpu.lower(), -1.0)
        if value < 0:
            raise PlanError(
                f"--gpu {gpu!r}: one of {', '.join(GPU_PEAK_TFLOPS)} or its peak in TFLOPS (e.g. --gpu 989)"
            ) from None
    if not (math.isfinite(value) and value > 0):
        raise PlanError(f"--gpu {gpu!r}: a peak must be a positive number of TFLOPS")
    return value


def flops_per_token(flavor: str, vocab: int, seq_len: int) -> float:
    """torchtitan's count (``get_nparams_and_flops``): 6 × the parameters but the embedding table,
    plus 12 · layers · dim · seq_len for attention."""
    shape = parse_flavor(flavor).shape
    # all but the input embedding table (a tied one is also the head, which multiplies: torchtitan keeps it)
    dense = count_parameters(flavor, vocab) - (0 if shape.tied else vocab * shape.dim)
    return 6 * dense + 12 * shape.depth * shape.dim * seq_len


def tokens_per_step(inputs: Inputs) -> int:
    """Tokens one replica group trains per inner step: its share of the global batch."""
    return inputs.global_batch // inputs.replicas * inputs.seq_len


def step_time(inputs: Inputs) -> tuple[float, str]:
    """(seconds per inner step, how it was obtained)."""
    if inputs.step_seconds is not None:
        return inputs.step_seconds, "--step-seconds"
    gpu, mfu = inputs.gpu_or_default, inputs.mfu_or_default
    peak = peak_tflops(gpu)
    flops = flops_per_token(inputs.flavor, inputs.vocab, inputs.seq_len) * tokens_per_step(inputs)
    seconds = flops / (mfu * peak * 1e12 * inputs.gpus_per_group)
    assumed = [
        what
        for what, given in ((f"--gpu {DEFAULT_GPU}", inputs.gpu), (f"--mfu {DEFAULT_MFU:g}", inputs.mfu))
        if given is None
    ]
    how = (
        f"{flops / 1e12:,.1f} TFLOP per step ({tokens_per_step(inputs):,} tokens x "
        f"{flops_per_token(inputs.flavor, inputs.vocab, inputs.seq_len) / 1e9:.2f} GFLOP) / "
        f"({100 * mfu:g}% MFU x {peak:g} TFLOPS peak ({gpu}) x {inputs.gpus_per_group} GPU)"
    )
    if assumed:
        how += f"; assumed {' and '.join(assumed)}: give --step-seconds, or --gpu and --mfu, for your cluster"
    return seconds, how


def exchange_config(bits: int, strategy: str):
    """The exchange ``--bits`` stands for (the shipped configs' codecs)."""
    # torch-bound, so imported only when a sync is projected: the model map's table needs no torch
    from muloco.compress import Dense, Quantizer
    from muloco.outer.exchange import Exchange
    from muloco.outer.exchange.strategies import AllGather, AllReduce, ReduceScatter

    chosen = {
        "auto": None,
        "allreduce": AllReduce.Config(),
        "allgather": AllGather.Config(),
        "reduce_scatter": ReduceScatter.Config(),
    }[strategy]
    if bits >= 16:
        return Exchange.Config(codec=Dense.Config(dtype="float32" if bits == 32 else "bfloat16"), strategy=chosen)
    return Exchange.Config(
        codec=Quantizer.Config(bits=bits, scheme="statistical"), strategy=chosen, skip_pattern=r"norm\.weight$"
    )


@dataclass
class Sync:
    """A round's syncs on the link (one per fragment), for one replica."""

    label: str
    sent: float
    """Bytes each way over the round (every fragment's sync)."""
    collectives: int
    fragment_seconds: list[float]
    """Each fragment's sync on the link, in fragment order."""
    bits_per_parameter: float

    @property
    def seconds(self) -> float:
        """Link time per round (one sync per fragment)."""
        return sum(self.fragment_seconds)

    def exposed(self, hidden: float) -> float:
        """Link time per round that ``hidden`` seconds of overlapped steps per sync leave blocked."""
        return sum(max(0.0, f - hidden) for f in self.fragment_seconds)


def fragment_sizes(flavor: str, vocab: int, n: int) -> list[tuple[int, int]]:
    """(parameters, norm parameters) of each of ``n`` fragments, split as the outer loop splits the
    model (``outer/schedule.py``: units of whole layers — the embedding, each block, the final norm
    with the head — divided as evenly as possible, earlier fragments taking the remainder)."""
    f = parse_flavor(flavor)
    s = f.shape
    block_norms = (2 + int(f.post_attention_norm) + int(f.post_ffn_norm)) * s.dim + (2 * s.head_dim if f.qk_norm else 0)
    head = 0 if s.tied else vocab * s.dim  # a tied head is the embedding's matrix
    units = [(vocab * s.dim, 0)] + [(block_parameters(f), block_norms)] * s.depth + [(head + s.dim, s.dim)]
    if n > len(units):
        raise PlanError(f"--streaming-fragments {n} is more than the model's {len(units)} layer units")
    base, extra = divmod(len(units), n)
    out, start = [], 0
    for frag in range(n):
        size = base + (1 if frag < extra else 0)
        chunk = units[start : start + size]
        out.append((sum(u[0] for u in chunk), sum(u[1] for u in chunk)))
        start += size
    return out


SPARSELOCO_CONFIG = "diloco/sparseloco"
"""The shipped SparseLoCo config, planned as its own row (its exchange as it ships; a test checks
the planner's copy against the loaded config, so the planner needs no trainer config)."""


def sparseloco_exchanges() -> list:
    """SparseLoCo's exchange (``diloco/sparseloco``: its codec, nothing sent dense), over all-gather
    (a sparse codec cannot go over reduce-scatter: its owners' re-encode would drop coordinates)."""
    # torch-bound, so imported only when a sync is projected: the model map's table needs no torch
    from muloco.compress import sparseloco_codec
    from muloco.outer.exchange import Exchange
    from muloco.outer.exchange.strategies import AllGather

    return [Exchange.Config(codec=sparseloco_codec(), skip_pattern="", strategy=AllGather.Config())]


def project_sync(
    inputs: Inputs, bits: int | None = None, strategy: str | None = None, config=None, label: str | None = None
) -> Sync:
    """The link time of a round's syncs, fragment by fragment (the emulated link's model on the
    wire format), for ``--bits``/``--strategy`` or the given exchange ``config``."""
    bits = inputs.bits if bits is None else bits
    config = config or exchange_config(bits, strategy or inputs.strategy)
    exchange = config.build()
    sent = payload = collectives = 0.0
    seconds = []
    for numel, norms in fragment_sizes(inputs.flavor, inputs.vocab, inputs.fragments):
        dense = norms if config.skip_pattern else 0  # the shipped configs' skip pattern: norm weights
        transfers = exchange.link_transfers(inputs.replicas, numel - dense, dense)
        wire = exchange.wire_bytes(inputs.replicas, numel - dense, dense)
        seconds.append(sum(transfer_seconds(t, inputs.mbps, inputs.latency_ms) for t in transfers))
        sent += max(wire["sent"], wire["received"])
        payload += wire["payload"]
        collectives += len(transfers)
    label = label or f"{bits}-bit {'dense' if bits >= 16 else 'quantized'}"
    label = f"{label}, {exchange.strategy.name}"
    return Sync(label, sent, int(collectives), seconds, 8 * payload / count_parameters(inputs.flavor, inputs.vocab))


@dataclass
class Round:
    step_seconds: float
    sync: Sync
    exposed: float
    """Link time per round that the overlapped steps do not hide (all fragments)."""
    compute: float

    @property
    def seconds(self) -> float:
        return self.compute + self.exposed

    @property
    def share(self) -> float:
        return self.exposed / self.seconds


def project_round(inputs: Inputs, sync: Sync, step_seconds: float, sync_every: int | None = None) -> Round:
    h = inputs.sync_every if sync_every is None else sync_every
    return Round(step_seconds, sync, sync.exposed(inputs.overlap * step_seconds), h * step_seconds)


def h_needed(inputs: Inputs, sync: Sync, step_seconds: float) -> int | None:
    """The smallest H (a multiple of the fragments, > their overlap) whose link share is at most
    ``max_share``; 1·n when the link is fully hidden."""
    n = inputs.fragments
    exposed = sync.exposed(inputs.overlap * step_seconds)
    smallest = n * (inputs.overlap + 1)
    if exposed == 0:
        return smallest
    # exposed / (H·s + exposed) <= m  <=>  H >= exposed (1 - m) / (m s)
    h = math.ceil(exposed * (1 - inputs.max_share) / (inputs.max_share * step_seconds) - 1e-9)
    return max(smallest, -(-h // n) * n)


@dataclass
class Plan:
    inputs: Inputs
    step_seconds: float
    step_source: str
    round: Round
    h_for_share: int | None
    bits_for_share: Sync | None
    """The exchange with the most bits per parameter (any strategy) that keeps the share at H."""
    candidates: list[tuple[Sync, Round, int | None]] = field(default_factory=list)

    @property
    def group_step_seconds(self) -> tuple[float, ...]:
        """Each group's own step time (all ``step_seconds`` when the groups are equal)."""
        return (
            tuple(self.step_seconds * f for f in self.inputs.group_slowdowns)
            or (self.step_seconds,) * self.inputs.replicas
        )

    @property
    def tokens_per_second(self) -> float:
        """Per replica group, in lockstep: H steps' tokens per round, the round set by the slowest group."""
        return tokens_per_step(self.inputs) * self.inputs.sync_every / self.round.seconds

    @property
    def compute_tokens_per_second(self) -> float:
        return tokens_per_step(self.inputs) / max(self.group_step_seconds)

    @property
    def idle_seconds_per_round(self) -> float:
        """Group-seconds per lockstep round that faster groups spend waiting for the slowest one."""
        slowest = max(self.group_step_seconds)
        return sum(self.inputs.sync_every * (slowest - s) for s in self.group_step_seconds)

    @property
    def idle_share(self) -> float:
        """Share of all groups' time in a lockstep round spent waiting for the slowest group."""
        return self.idle_seconds_per_round / (self.inputs.replicas * self.round.seconds)

    @property
    def deadline_steps(self) -> list[int]:
        """Each group's inner steps in a deadline round (``round_budget.budgets``)."""
        i = self.inputs
        return round_budget.budgets(
            i.sync_every,
            list(self.group_step_seconds),
            i.round_quantile,
            i.round_min_steps,
            i.round_max_steps_or_default,
        )

    @property
    def deadline_possible(self) -> bool:
        """Deadline rounds sync the whole model at a round's end with nothing overlapped (the trainer
        refuses streaming fragments and τ > 0 with them)."""
        return self.inputs.fragments == 1 and self.inputs.overlap == 0

    @property
    def deadline_round_seconds(self) -> float:
        """A deadline round: the last group to finish its budget, then the sync's exposed link time."""
        return round_budget.round_seconds(self.deadline_steps, list(self.group_step_seconds)) + self.round.exposed

    @property
    def deadline_link_share(self) -> float:
        """The link's share of a deadline round (shorter than a lockstep one when its quantile is below 1)."""
        return self.round.exposed / self.deadline_round_seconds

    @property
    def deadline_idle_share(self) -> float:
        """Share of all groups' time in a deadline round spent waiting for the last group."""
        idle = round_budget.idle_seconds(self.deadline_steps, list(self.group_step_seconds))
        return idle / (self.inputs.replicas * self.deadline_round_seconds)

    @property
    def job_tokens_per_second(self) -> dict[str, float]:
        """The job's tokens/s, link included, in lockstep and in deadline rounds."""
        b = tokens_per_step(self.inputs)
        return {
            "lockstep": self.inputs.replicas * self.tokens_per_second,
            "deadline": sum(self.deadline_steps) * b / self.deadline_round_seconds,
        }

    @property
    def own_pace_compute_tokens_per_second(self) -> float:
        """The job's compute-only tokens/s if every group trained at its own pace (no waiting): the
        most a round mode that does not wait for the slowest group could reach, link left out."""
        return sum(tokens_per_step(self.inputs) / s for s in self.group_step_seconds)


def plan(inputs: Inputs) -> Plan:
    inputs.check()
    seconds, source = step_time(inputs)
    # a lockstep round lasts the slowest group's H steps; its link share and H follow from that step
    slowest = seconds * max(inputs.group_slowdowns, default=1.0)
    chosen = project_sync(inputs)
    rnd = project_round(inputs, chosen, slowest)
    candidates = []
    for bits in BITS:
        for strategy in ("allreduce",) if bits >= 16 else ("allgather", "reduce_scatter"):
            sync = project_sync(inputs, bits, strategy)
            candidates.append((sync, project_round(inputs, sync, slowest), h_needed(inputs, sync, slowest)))
    for config in sparseloco_exchanges():
        sync = project_sync(inputs, config=config, label="SparseLoCo")
        candidates.append((sync, project_round(inputs, sync, slowest), h_needed(inputs, sync, slowest)))
    fits = [sync for sync, r, _ in candidates if r.share <= inputs.max_share]
    best = max(fits, key=lambda sync: sync.bits_per_parameter) if fits else None
    return Plan(inputs, seconds, source, rnd, h_needed(inputs, chosen, slowest), best, candidates)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def text(p: Plan) -> str:
    i, r, s = p.inputs, p.round, p.round.sync
    params = count_parameters(i.flavor, i.vocab)
    latency = f", {i.latency_ms:g} ms per round" if i.latency_ms else ""
    streaming = (f", {i.fragments} fragments (streaming)" if i.fragments > 1 else "") + (
        f", overlap τ={i.overlap} steps" if i.overlap else ""
    )
    share_ok = "met" if r.share <= i.max_share else "over"
    lines = [
        f"link plan: {i.flavor} ({params / 1e6:,.1f}M parameters), K={i.replicas} replica groups, "
        f"{format_rate(i.mbps)} between them{latency}; H={i.sync_every}{streaming}",
        f"  step: {p.step_seconds:.3f} s ({p.step_source}); {tokens_per_step(i):,} tokens per replica group per step",
        f"  exchange: {s.label}, {s.bits_per_parameter:.3f} bits/param; per replica and round: "
        f"{_bytes(s.sent)} each way in {s.collectives} collective(s)",
        (
            f"  projected sync time on the link: {s.seconds:.3f} s per sync"
            if i.fragments == 1
            else "  projected sync time on the link: "
            + " / ".join(f"{f:.3f}" for f in s.fragment_seconds)
            + f" s per fragment's sync ({s.seconds:.3f} s per round)"
        )
        + " (the emulated link's model: bytes / bandwidth + rounds x latency)",
        f"  round: {r.compute:.2f} s of compute + {r.exposed:.2f} s of link not hidden by the overlap "
        f"= {r.seconds:.2f} s",
        f"  link share of a round: {100 * r.share:.1f}% (target <= {100 * i.max_share:g}%: {share_ok})",
        *_group_lines(p),
        f"  tokens/s per replica group: {p.tokens_per_second:,.0f} (compute alone: {p.compute_tokens_per_second:,.0f})",
        f"  to keep the share <= {100 * i.max_share:g}%: H >= {p.h_for_share} at these bits; at H={i.sync_every}: "
        + (
            f"{p.bits_for_share.label} ({p.bits_for_share.bits_per_parameter:.2f} bits/param) or fewer bits"
            if p.bits_for_share
            else "no exchange below is enough (raise H, or add fragments with overlap)"
        ),
        "",
        f"  {'exchange':<34}{'bits/param':>11}{'sent/round':>12}{'link s':>9}{'share':>8}{'H for share':>13}",
    ]
    for sync, rnd, h in p.candidates:
        lines.append(
            f"  {sync.label:<34}{sync.bits_per_parameter:>11.3f}{_bytes(sync.sent):>12}{sync.seconds:>9.3f}"
            f"{100 * rnd.share:>7.1f}%{h:>13}"
        )
    return "\n".join(lines)


def _group_lines(p: Plan) -> list[str]:
    """What unequal groups cost a lockstep round (nothing when the groups are equal)."""
    i = p.inputs
    if not i.group_slowdowns:
        return []
    steps = ", ".join(f"{s:.3f}" for s in p.group_step_seconds)
    lockstep = i.replicas * p.compute_tokens_per_second
    own = p.own_pace_compute_tokens_per_second
    return [
        f"  groups' steps: {steps} s (--group-slowdowns {' '.join(f'{f:g}' for f in i.group_slowdowns)}); a lockstep "
        f"round lasts the slowest group's {i.sync_every} steps",
        f"  waiting for the slowest: {100 * p.idle_share:.1f}% of all groups' time, "
        f"{p.idle_seconds_per_round * i.gpus_per_group:,.1f} GPU-seconds per round "
        f"({i.gpus_per_group} GPU{'s' if i.gpus_per_group > 1 else ''} per group)",
        f"  the job's compute-only tokens/s: {lockstep:,.0f} in lockstep; {own:,.0f} if each group kept its own pace "
        f"(+{100 * (own / lockstep - 1):.1f}%, the most a round that does not wait could add)",
    ] + (
        _deadline_lines(p)
        if p.deadline_possible
        else [
            f"  deadline rounds: not with --streaming-fragments {i.fragments} / --overlap {i.overlap} "
            "(a deadline round "
            "syncs the whole model at its end, nothing overlapped); plan them with --streaming-fragments 1 --overlap 0"
        ]
    )


def _deadline_lines(p: Plan) -> list[str]:
    i, jobs = p.inputs, p.job_tokens_per_second
    return [
        f"  deadline rounds (--outer.round deadline, quantile {i.round_quantile:g}, {i.round_min_steps}-"
        f"{i.round_max_steps_or_default} steps): the groups train {', '.join(map(str, p.deadline_steps))} steps per "
        f"round of {p.deadline_round_seconds:.2f} s; waiting {100 * p.deadline_idle_share:.1f}% of all groups' time; "
        f"link share of such a round {100 * p.deadline_link_share:.1f}%",
        f"  the job's tokens/s with the link: {jobs['lockstep']:,.0f} in lockstep, {jobs['deadline']:,.0f} in deadline "
        f"rounds ({jobs['deadline'] / jobs['lockstep']:.2f}x)",
    ]


def _sync_dict(sync: Sync, rnd: Round, h: int | None = None) -> dict:
    out = {
        "exchange": sync.label,
        "bits_per_parameter": sync.bits_per_parameter,
        "sent_bytes_per_round": sync.sent,
        "collectives": sync.collectives,
        "link_seconds_per_round": sync.seconds,
        "fragment_link_seconds": list(sync.fragment_seconds),
        "exposed_seconds_per_round": rnd.exposed,
        "round_seconds": rnd.seconds,
        "link_share": rnd.share,
    }
    return out if h is None else {**out, "h_for_share": h}


def as_dict(p: Plan) -> dict:
    """The plan as plain JSON values (``--json``): the inputs as planned, the chosen exchange's
    round, and every alternative's."""
    return {
        "inputs": {
            **asdict(p.inputs),
            "gpu": None if p.inputs.step_seconds else p.inputs.gpu_or_default,
            "mfu": None if p.inputs.step_seconds else p.inputs.mfu_or_default,
        },
        "parameters": count_parameters(p.inputs.flavor, p.inputs.vocab),
        "step_seconds": p.step_seconds,
        "step_source": p.step_source,
        "tokens_per_step": tokens_per_step(p.inputs),
        "tokens_per_second": p.tokens_per_second,
        "compute_tokens_per_second": p.compute_tokens_per_second,
        "groups": None
        if not p.inputs.group_slowdowns
        else {
            "step_seconds": list(p.group_step_seconds),
            "idle_share": p.idle_share,
            "idle_gpu_seconds_per_round": p.idle_seconds_per_round * p.inputs.gpus_per_group,
            "lockstep_compute_tokens_per_second": p.inputs.replicas * p.compute_tokens_per_second,
            "own_pace_compute_tokens_per_second": p.own_pace_compute_tokens_per_second,
            "job_tokens_per_second": p.job_tokens_per_second if p.deadline_possible else None,
            "deadline": {
                "steps": p.deadline_steps,
                "round_seconds": p.deadline_round_seconds,
                "idle_share": p.deadline_idle_share,
                "link_share": p.deadline_link_share,
            }
            if p.deadline_possible
            else None,
        },
        "chosen": _sync_dict(p.round.sync, p.round, p.h_for_share),
        "bits_for_share": p.bits_for_share.label if p.bits_for_share else None,
        "alternatives": [_sync_dict(sync, rnd, h) for sync, rnd, h in p.candidates],
    }
