"""When each fragment is exchanged, and which parameters a fragment holds.

Streaming DiLoCo splits the model into P fragments and syncs one of them every
H / P inner steps, so every fragment is synced once per H steps while the network
carries 1/P of the model at a time. A sync is *prepared* (pseudo-gradient taken,
exchange started) τ steps before it is *performed* (exchange awaited, outer step,
commit), so the exchange overlaps τ inner steps.

Which fragment a sync carries is the torchft step modulo P, not a function of the
trainer step: the torchft step is what a healing replica receives from its peer,
so all replicas agree on the fragment even right after one of them rejoined.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from muloco.utils.errors import BadInput


class ScheduleError(BadInput, ValueError):
    pass


@dataclass(frozen=True)
class SyncSchedule:
    sync_every: int
    """H: inner steps between two syncs of the same fragment."""
    num_fragments: int = 1
    """P: fragments synced in turn, one every H / P inner steps."""
    delay: int = 0
    """τ: inner steps between starting a fragment's exchange and applying it."""

    def __post_init__(self) -> None:
        h, p, tau = self.sync_every, self.num_fragments, self.delay
        if h < 1:
            raise ScheduleError(f"outer.sync_every must be >= 1, got {h}")
        if p < 1:
            raise ScheduleError(f"outer.num_fragments must be >= 1, got {p}")
        if h % p:
            raise ScheduleError(
                f"outer.sync_every ({h}) must be a multiple of outer.num_fragments ({p}) "
                f"so fragments are evenly spaced; try --outer.sync_every {max(p, h - h % p)}"
            )
        if not 0 <= tau < h // p:
            raise ScheduleError(
                f"outer.fragment_sync_delay must be in [0, {h // p}) (the spacing between "
                f"fragment syncs, sync_every / num_fragments), got {tau}"
            )

    @property
    def interval(self) -> int:
        """Inner steps between two consecutive syncs (of different fragments)."""
        return self.sync_every // self.num_fragments

    def prepare_due(self, step: int) -> bool:
        """Start an exchange after inner step ``step`` (1-based)."""
        return step >= 1 and (step + self.delay) % self.interval == 0

    def perform_due(self, step: int) -> bool:
        """Finish the exchange started ``delay`` steps earlier."""
        return step >= 1 and step % self.interval == 0

    def in_flight(self, step: int) -> bool:
        """An exchange is open after inner step ``step`` (nothing may be checkpointed)."""
        return step >= 1 and (step + self.delay) % self.interval < self.delay

    def round_complete(self, step: int) -> bool:
        """Every fragment has been synced since the last full-round boundary."""
        return step >= 1 and step % self.sync_every == 0


def _units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as a sequence of layer-sized units.

    Modules before the layer stack (embeddings) form one unit each, every block of
    the stack is a unit, and everything after it (final norm, output head) is one
    unit, as in MuLoCo's split. Works for any depth, and through wrappers that
    keep the stack as a ModuleDict/ModuleList child.
    """
    children = list(model.named_children())
    stack = next(
        (i for i, (_, m) in enumerate(children) if isinstance(m, (nn.ModuleDict, nn.ModuleList))),
        None,
    )
    if stack is None:
        return children
    head = children[:stack]
    name, layers = children[stack]
    body = [(f"{name}.{n}", m) for n, m in layers.named_children()]
    tail = children[stack + 1 :]
    tail_unit = [("+".join(n for n, _ in tail), nn.ModuleList([m for _, m in tail]))] if tail else []
    return head + body + tail_unit


def model_fragments(model: nn.Module, num_fragments: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Split the model's trainable parameters into contiguous fragments of whole layers.

    The units are divided as evenly as possible; earlier fragments take the
    remainder. Parameters held directly by the root module join the last fragment.
    Returns, per fragment, (fully qualified name, parameter) pairs in model order. Units with
    nothing to train (a LoRA run's embedding and head) are left out, so no fragment is empty.
    """
    units = [(name, m) for name, m in _units(model) if any(p.requires_grad for p in m.parameters())]
    if num_fragments > len(units):
        raise ScheduleError(
            f"outer.num_fragments={num_fragments} is more than the model's {len(units)} "
            "layer units (embedding, each block, head; with LoRA only the blocks train); lower it"
        )
    base, extra = divmod(len(units), num_fragments)
    owner: dict[int, int] = {}
    start = 0
    for frag in range(num_fragments):
        size = base + (1 if frag < extra else 0)
        for _, module in units[start : start + size]:
            for p in module.parameters():
                owner.setdefault(id(p), frag)
        start += size
    fragments: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(num_fragments)]
    for name, p in model.named_parameters():
        if p.requires_grad:
            fragments[owner.get(id(p), num_fragments - 1)].append((name, p))
    return fragments
