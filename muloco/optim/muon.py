"""Muon for 2-D hidden weight matrices, correct on FSDP-sharded (DTensor) parameters.

Per matrix W (fan_out × fan_in) with gradient G:
  B ← μ·B + (1 − μ)·G (EMA momentum, as torch.optim.Muon and Keller Jordan's Muon);
  U = (1 − μ)·G + μ·B with Nesterov, else B;
  O = NS(U)  (Newton–Schulz, bf16, on the *whole* matrix);
  W ← W·(1 − lr·wd) − lr·s·O  with the base (scheduled) lr for decay and s from
  ``lr_scaling``: original √max(1, fan_out/fan_in), match_rms_adamw 0.2·√max(fan_out, fan_in),
  spectral √(fan_out/fan_in).

Sharded parameters: orthogonalising a shard on its own is a different (wrong) update
(36–54% relative error measured). Each matrix is gathered once, the Newton–Schulz work
is spread over the ranks of the shard group (matrix i on rank i mod W, same-shape
matrices batched), and every rank keeps its shard of each result.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from muloco.optim.newton_schulz import COEFFICIENTS, orthogonalize_many

LR_SCALINGS = ("original", "match_rms_adamw", "spectral")


def lr_scale(shape: torch.Size, rule: str) -> float:
    fan_out, fan_in = shape[-2], shape[-1]
    if rule == "original":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    if rule == "spectral":
        return math.sqrt(fan_out / fan_in)
    raise ValueError(f"unknown Muon lr_scaling {rule!r}; choose one of {', '.join(LR_SCALINGS)}")


def check_settings(momentum: float, ns_steps: int, coefficients: str, lr_scaling: str) -> None:
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
    if ns_steps < 1:
        raise ValueError(f"Muon ns_steps must be >= 1, got {ns_steps}")
    if coefficients not in COEFFICIENTS:
        raise ValueError(
            f"unknown Newton–Schulz coefficient set {coefficients!r}; choose one of {', '.join(COEFFICIENTS)}"
        )
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(f"unknown Muon lr_scaling {lr_scaling!r}; choose one of {', '.join(LR_SCALINGS)}")


class Muon(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        coefficients: str = "keller",
        lr_scaling: str = "original",
        eps: float = 1e-7,
        **_implementation_kwargs,  # torchtitan adds fused/foreach to every group
    ):
        check_settings(momentum, ns_steps, coefficients, lr_scaling)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            coefficients=coefficients,
            lr_scaling=lr_scaling,
            eps=eps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon takes 2-D matrices only; got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates = self._momentum(group, params)
            ortho = self._orthogonalize(group, params, updates)
            self._apply(group, params, ortho)
        return loss

    def _momentum(self, group, params) -> list[torch.Tensor]:
        mu = group["momentum"]
        grads = [_local(p.grad) for p in params]
        bufs = []
        for p, g in zip(params, grads):
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            bufs.append(_local(state["momentum_buffer"]))
        torch._foreach_lerp_(bufs, grads, 1.0 - mu)
        if group["nesterov"]:
            return list(torch._foreach_lerp(grads, bufs, mu))
        return bufs  # read, never written, by the orthogonalisation

    def _orthogonalize(self, group, params, updates) -> list[torch.Tensor]:
        """Local shards of NS(full update) for every parameter, in order."""
        kwargs = dict(coefficients=group["coefficients"], steps=group["ns_steps"], eps=group["eps"])
        plain = [i for i, p in enumerate(params) if not _sharded(p)]
        sharded = [i for i, p in enumerate(params) if _sharded(p)]
        out = dict(zip(plain, orthogonalize_many([updates[i] for i in plain], **kwargs)))
        if sharded:
            out.update(_orthogonalize_sharded(params, updates, sharded, kwargs))
        return [out[i] for i in range(len(params))]

    def _apply(self, group, params, ortho) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        weights = [_local(p) for p in params]
        if wd:
            torch._foreach_mul_(weights, 1.0 - lr * wd)
        torch._foreach_mul_(ortho, [-lr * lr_scale(p.shape, group["lr_scaling"]) for p in params])
        torch._foreach_add_(weights, ortho)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sharded(p: torch.Tensor) -> bool:
    """Split over more than one rank (a one-rank FSDP mesh holds the whole matrix locally)."""
    return isinstance(p, DTensor) and p.device_mesh.size() > 1 and any(pl.is_shard() for pl in p.placements)


def _by_shape(params, indices) -> dict[tuple, list[int]]:
    """Indices grouped by shape up to transposition (how Newton–Schulz batches them)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i in indices:
        groups[tuple(sorted(params[i].shape))].append(i)
    return groups


def _orthogonalize_sharded(params, updates, indices, kwargs) -> dict[int, torch.Tensor]:
    """Orthogonalise full matrices with each rank doing a share of the work.

    One all-to-all brings every shard of matrix i to its owner, which runs Newton–Schulz on
    all its matrices of a shape in one batch; a second all-to-all returns to every rank its
    shard of each result. Each rank thus receives about 2/W of the matrices' size (in bf16,
    the dtype Newton–Schulz runs in, so the wire adds no rounding) instead of the whole of
    every matrix, as a full_tensor() gather would give it.
    """
    mesh = params[indices[0]].device_mesh
    if any(params[i].device_mesh != mesh for i in indices):
        raise NotImplementedError("Muon expects every sharded matrix on one mesh (FSDP2's)")
    if mesh.ndim != 1:
        raise NotImplementedError("Muon on sharded parameters supports a 1-D shard mesh (FSDP)")
    world, rank = mesh.size(), mesh.get_local_rank()
    layout = _ShardLayout(params, indices, world)
    mine = layout.owned_by(rank)

    # Shards of every matrix to its owner.
    send = [[updates[i].to(torch.bfloat16).reshape(-1) for i in layout.owned_by(d)] for d in range(world)]
    like = updates[indices[0]]
    recv = _all_to_all(send, [[layout.numel(i, s) for i in mine] for s in range(world)], mesh.get_group(), like)
    fulls = {
        i: torch.cat([recv[s][n].view(layout.local_shape(i, s)) for s in range(world)], dim=layout.dim(i))
        for n, i in enumerate(mine)
    }
    done = dict(zip(mine, orthogonalize_many([fulls[i] for i in mine], **kwargs)))

    # Every rank's shard of each result back to it.
    send = [
        [done[i].narrow(layout.dim(i), *layout.bounds(i, d)).contiguous().reshape(-1) for i in mine]
        for d in range(world)
    ]
    recv = _all_to_all(
        send, [[layout.numel(i, rank) for i in layout.owned_by(s)] for s in range(world)], mesh.get_group(), like
    )
    results: dict[int, torch.Tensor] = {}
    for s in range(world):
        for n, i in enumerate(layout.owned_by(s)):
            results[i] = recv[s][n].view(layout.local_shape(i, rank)).to(updates[i].dtype)
    return results


class _ShardLayout:
    """Who owns which matrix, and each rank's slice of it (torch.chunk rules, as DTensor Shard)."""

    def __init__(self, params, indices, world: int):
        self.params, self.world = params, world
        for i in indices:
            placement = params[i].placements[0]
            if not placement.is_shard():
                raise NotImplementedError(f"Muon expects Shard placements, got {placement}")
        # Round-robin within each shape, continuing across shapes, so same-shape matrices
        # batch on their owner and the leftover of one shape does not always land on rank 0.
        self.owner: dict[int, int] = {}
        for n, i in enumerate(i for members in _by_shape(params, indices).values() for i in members):
            self.owner[i] = n % world
        self.indices = indices

    def owned_by(self, r: int) -> list[int]:
        return [i for i in self.indices if self.owner[i] == r]

    def dim(self, i: int) -> int:
        return self.params[i].placements[0].dim

    def bounds(self, i: int, r: int) -> tuple[int, int]:
        """(offset, length) of rank r's shard along the sharded dim."""
        size, offset = Shard.local_shard_size_and_offset(self.params[i].shape[self.dim(i)], self.world, r)
        return int(offset), int(size)

    def local_shape(self, i: int, r: int) -> tuple[int, ...]:
        shape = list(self.params[i].shape)
        shape[self.dim(i)] = self.bounds(i, r)[1]
        return tuple(shape)

    def numel(self, i: int, r: int) -> int:
        return math.prod(self.local_shape(i, r))


def _all_to_all(send, recv_sizes, group, like: torch.Tensor) -> list[list[torch.Tensor]]:
    """The flat pieces send[d] go to rank d; returns recv[s], rank s's pieces of recv_sizes[s]."""
    pieces = [t for to_rank in send for t in to_rank]
    flat_send = torch.cat(pieces) if pieces else like.new_empty(0, dtype=torch.bfloat16)
    in_splits = [sum(t.numel() for t in to_rank) for to_rank in send]
    out_splits = [sum(sizes) for sizes in recv_sizes]
    flat_recv = flat_send.new_empty(sum(out_splits))
    dist.all_to_all_single(flat_recv, flat_send, out_splits, in_splits, group=group)
    return [list(chunk.split(sizes)) for chunk, sizes in zip(flat_recv.split(out_splits), recv_sizes)]
