"""The outer loop's math, schedule and fragments.

The loop is driven by real torchft Managers (one per replica, as threads of this
process, each with its own TCPStore and gloo group, and an in-process lighthouse),
as torchft tests itself; the inner steps are deterministic parameter updates so a
float64 reference written out by hand can follow every round.
"""

from __future__ import annotations

import math
import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.nn as nn

from muloco import compat

compat.apply()

from torch.distributed import TCPStore  # noqa: E402
from torchft import Manager, ProcessGroupGloo  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

from muloco.compat.healing_transport import SafeHTTPTransport  # noqa: E402
from muloco.compress import Dense, Quantizer  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.config.loader import ConfigError  # noqa: E402
from muloco.outer import OuterLoop, SyncSchedule, model_fragments  # noqa: E402
from muloco.outer.exchange import PARTS, ReduceScatter  # noqa: E402
from muloco.outer.optimizer import SGD, Averaging, Nesterov  # noqa: E402
from muloco.outer.schedule import ScheduleError  # noqa: E402
from muloco.outer.step_schedule import StepSchedules, ValueSchedule  # noqa: E402


# ----------------------------------------------------------------- schedule
@pytest.mark.parametrize("h,p,tau", [(1, 1, 0), (12, 1, 0), (12, 3, 0), (12, 3, 3), (30, 2, 5), (8, 4, 1)])
def test_each_fragment_synced_once_per_round_with_prepare_tau_steps_before(h, p, tau):
    s = SyncSchedule(h, p, tau)
    steps = range(1, 4 * h + 1)
    performs = [t for t in steps if s.perform_due(t)]
    prepares = [t for t in steps if s.prepare_due(t)]
    assert performs == list(range(h // p, 4 * h + 1, h // p))
    assert [t + tau for t in prepares] == performs[: len(prepares)]
    # an exchange is open exactly between a prepare and its perform
    open_after = {t for t in steps if s.in_flight(t)}
    assert open_after == {t for pr in prepares for t in range(pr, pr + tau)}
    assert [t for t in steps if s.round_complete(t)] == list(range(h, 4 * h + 1, h))


@pytest.mark.parametrize(
    "h,p,tau,match",
    [
        (0, 1, 0, "sync_every"),
        (10, 0, 0, "num_fragments"),
        (10, 3, 0, "multiple"),
        (10, 2, 5, r"\[0, 5\)"),
        (10, 1, -1, "delay"),
    ],
)
def test_bad_schedules_are_refused(h, p, tau, match):
    with pytest.raises(ScheduleError, match=match):
        SyncSchedule(h, p, tau)


class Tiny(nn.Module):
    """Embedding, a stack of blocks and a head, like the real models."""

    def __init__(self, depth: int, width: int = 4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, width)
        self.layers = nn.ModuleDict({str(i): nn.Linear(width, width) for i in range(depth)})
        self.norm = nn.LayerNorm(width)
        self.output = nn.Linear(width, 8, bias=False)


@pytest.mark.parametrize("depth", [1, 2, 4, 7, 12])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_fragments_cover_the_model_once_in_contiguous_layer_order(depth, p):
    model = Tiny(depth)
    frags = model_fragments(model, p)
    names = [n for f in frags for n, _ in f]
    assert names == [n for n, _ in model.named_parameters()]  # every parameter once, in order
    units = depth + 2
    sizes = [
        len({n.split(".")[0] if not n.startswith("layers") else ".".join(n.split(".")[:2]) for n, _ in f})
        for f in frags
    ]
    # output and norm share the tail unit
    sizes[-1] -= 1
    assert sum(sizes) == units
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_more_fragments_than_layers_is_refused():
    with pytest.raises(ScheduleError, match="num_fragments=5"):
        model_fragments(Tiny(2), 5)


# ---------------------------------------------------------- outer optimizer
@pytest.mark.parametrize("name", ["nesterov", "sgd", "none"])
def test_outer_optimizer_matches_hand_written_reference(name):
    torch.manual_seed(0)
    theta = [torch.randn(5, 3), torch.randn(7)]
    ref = [t.double().clone() for t in theta]
    buf = [torch.zeros_like(t) for t in ref]
    lr, mu = 0.7, 0.9
    opt = _optimizer(name, lr, mu).build(params=theta)
    for _ in range(5):
        grads = [torch.randn_like(t) for t in theta]
        opt.step([g.clone() for g in grads])  # step consumes its grads
        for r, b, g in zip(ref, buf, grads):
            g = g.double()
            if name == "none":
                r -= g
                continue
            b.mul_(mu).add_(g)
            r -= lr * (g + mu * b) if name == "nesterov" else lr * b
    for t, r in zip(theta, ref):
        torch.testing.assert_close(t.double(), r, rtol=1e-5, atol=1e-6)


def _optimizer(name: str, lr: float, mu: float):
    return {"nesterov": Nesterov, "sgd": SGD}[name].Config(lr=lr, momentum=mu) if name != "none" else Averaging.Config()


@pytest.mark.parametrize("kwargs,match", [({"lr": 0}, "lr"), ({"momentum": 1.0}, "momentum")])
def test_bad_outer_optimizer_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Nesterov.Config(**kwargs).validate()


def test_the_outer_optimizer_is_picked_by_name_and_keeps_lr_and_momentum_across_nesterov_and_sgd():
    """``--outer.optimizer NAME`` and ``--outer.optimizer.name NAME`` pick the same variant; a switch
    between nesterov and sgd keeps the lr and momentum a config module or an earlier flag set (they
    are declared once, for both); an unknown name is one clear error naming the choices."""
    _, config = parse_args(["--config", "diloco/diloco", "--outer.optimizer.lr", "0.3", "--outer.optimizer", "sgd"])
    assert isinstance(config.outer.optimizer, SGD.Config) and config.outer.optimizer.lr == 0.3
    assert config.outer.optimizer.momentum == 0.9  # diloco's, carried over
    _, config = parse_args(["--config", "diloco/muloco_2bit", "--outer.optimizer.name", "nesterov"])
    assert isinstance(config.outer.optimizer, Nesterov.Config)
    assert (config.outer.optimizer.lr, config.outer.optimizer.momentum) == (1.0, 0.0)
    _, config = parse_args(["--config", "diloco/diloco", "--outer.optimizer", "none"])
    assert isinstance(config.outer.optimizer, Averaging.Config)
    assert config.outer.optimizer.facts() == {"name": "none", "label": "avg"}
    with pytest.raises(ConfigError, match="--outer.optimizer must be one of nesterov, sgd, none; got 'adam'"):
        parse_args(["--config", "diloco/diloco", "--outer.optimizer", "adam"])
    with pytest.raises(ConfigError, match="lr"):  # averaging has no lr to set
        parse_args(["--config", "diloco/diloco", "--outer.optimizer", "none", "--outer.optimizer.lr", "0.5"])


# ------------------------------------------------------ outer-step schedules
def test_schedules_give_the_hand_computed_factors_over_a_run():
    total = 100
    build = lambda **kw: ValueSchedule.Config(**kw).build(total_steps=total)  # noqa: E731
    constant = build()
    assert [constant.factor(s) for s in (0, 10, 100)] == [1.0, 1.0, 1.0]
    warm = build(warmup=0.2, start=0.5)  # 0.5 -> 1 over steps 0..20, then 1
    assert [warm.factor(s) for s in (0, 10, 20, 60)] == [0.5, 0.75, 1.0, 1.0]
    linear = build(decay="linear", decay_from=0.5, final=0.2)  # 1 until step 50, then down to 0.2 at 100
    assert [linear.factor(s) for s in (30, 50, 75, 100)] == pytest.approx([1.0, 1.0, 0.6, 0.2])
    pier = build(warmup=0.1, start=0.0, decay="cosine", decay_from=0.2, final=0.9)
    assert pier.factor(5) == pytest.approx(0.5)
    assert pier.factor(15) == 1.0
    q = (60 / 100 - 0.2) / 0.8
    assert pier.factor(60) == pytest.approx(0.9 + 0.1 * 0.5 * (1 + math.cos(math.pi * q)))
    assert pier.factor(100) == pytest.approx(0.9) and pier.factor(150) == pytest.approx(0.9)  # past the end: held
    inner = ValueSchedule.Config(decay="inner").build(total_steps=total, inner_factor=lambda step: 1 / (1 + step))
    assert [inner.factor(s) for s in (0, 3)] == [1.0, 0.25]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"decay": "exp"}, "decay must be one of none, linear, cosine, inner"),
        ({"warmup": 1.0}, r"warmup is a share of the run, in \[0, 1\)"),
        ({"warmup": 0.3, "decay": "linear", "decay_from": 0.1}, "decay_from .* must be at least .*warmup"),
        ({"warmup": 0.1, "decay": "inner"}, "follows the inner schedule, warmup included"),
        ({"final": -1.0}, "final must be a finite factor >= 0"),
    ],
)
def test_bad_schedules_are_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ValueSchedule.Config(**kwargs).validate("outer.step_schedule.lr")


def test_a_momentum_schedule_that_would_reach_one_is_refused():
    schedules = StepSchedules(momentum=ValueSchedule.Config(warmup=0.1, start=1.2))
    with pytest.raises(ValueError, match="momentum must stay < 1"):
        schedules.validate(momentum=0.9, beta=0.95)
    cfg = OuterLoop.Config()
    cfg.optimizer = Averaging.Config()
    cfg.step_schedule.lr.decay = "cosine"
    with pytest.raises(ValueError, match="none averages the models"):
        cfg.validate()


# ------------------------------------------------ the loop on real torchft
def _inner_update(p: torch.Tensor, replica: int, step: int, index: int) -> torch.Tensor:
    """A deterministic stand-in for an inner optimizer step (differs per replica)."""
    n = torch.arange(p.numel(), dtype=torch.float64).view(p.shape)
    return 0.01 * (replica + 1) * torch.sin(n + step + 3 * index)


def _reference(init, k, steps, h, p, tau, alpha, lr, mu, name, lr_at=None, mu_at=None):
    """DiLoCo written out by hand, float64: returns θ_g after every sync; ``lr_at``/``mu_at``:
    the outer lr and momentum of the sync performed after step t (scheduled), else constant."""
    model = Tiny(4)
    frags = [[n for n, _ in f] for f in model_fragments(model, p)]
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    local = [{n: t.clone() for n, t in init.items()} for _ in range(k)]
    glob = {n: t.clone() for n, t in init.items()}
    mom = {n: torch.zeros_like(t) for n, t in init.items()}
    interval, syncs, history, snap = h // p, 0, [], None
    for t in range(1, steps + 1):
        for r in range(k):
            for n in local[r]:
                local[r][n] += _inner_update(local[r][n], r, t, index[n])
        if (t + tau) % interval == 0:
            frag = frags[syncs % p]
            snap = {n: sum(glob[n] - local[r][n] for r in range(k)) / k for n in frag}
        if t % interval == 0:
            lr, mu = (lr_at(t) if lr_at else lr), (mu_at(t) if mu_at else mu)
            for n, g in snap.items():
                if name == "none":
                    glob[n] = glob[n] - g
                else:
                    mom[n] = mu * mom[n] + g
                    glob[n] = glob[n] - lr * ((g + mu * mom[n]) if name == "nesterov" else mom[n])
                for r in range(k):
                    local[r][n] = glob[n] + alpha * (local[r][n] - glob[n])
            syncs += 1
            history.append({n: v.clone() for n, v in glob.items()})
    return history


HANG_S = 120
"""Every wait for a peer (quorum, collective, commit) is only a hang timeout."""


def _run_replica(r, k, lighthouse, init, steps, cfg, out, errors, poison_step=None):
    """One replica group's loop on a real torchft manager; at ``poison_step`` replica 1's
    model becomes infinite (a diverged replica)."""
    try:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=HANG_S)),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=k,
            use_async_quorum=False,
            store_addr="127.0.0.1",
            store_port=store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse,
            replica_id=f"test_{r}",
            init_sync=False,
            timeout=timedelta(seconds=HANG_S),
            quorum_timeout=timedelta(seconds=HANG_S),
            checkpoint_transport=SafeHTTPTransport(timedelta(seconds=HANG_S), num_chunks=0),
        )
        model = Tiny(4)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(init[n])
        loop = cfg.build(model=model, manager=manager, device=torch.device("cpu"), total_steps=steps)
        history = []
        for t in range(1, steps + 1):
            with torch.no_grad():
                for i, (n, p) in enumerate(model.named_parameters()):
                    p += _inner_update(p, r, t, i).float()
                    if r == 1 and t == poison_step:
                        p.fill_(math.inf)
            if loop.after_inner_step(t) is not None:
                history.append({n: g.clone() for f in loop.fragments for n, g in zip(f.names, f.globals)})
        out[r] = (history, loop.records, {n: p.detach().clone() for n, p in model.named_parameters()})
        manager.shutdown(wait=False)
    except BaseException as err:  # surfaced by the test thread
        errors.append(err)


def _run_replicas(k, init, steps, cfg, poison_step=None):
    """K replica groups in threads, each with its own torchft manager, one lighthouse."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=k, join_timeout_ms=100)
    url = lighthouse.address().replace(lighthouse.address().split("//")[1].split(":")[0], "127.0.0.1")
    out, errors = {}, []
    threads = [
        threading.Thread(target=_run_replica, args=(r, k, url, init, steps, cfg, out, errors, poison_step), daemon=True)
        for r in range(k)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=2 * HANG_S)
    finally:
        lighthouse.shutdown()
    assert not errors, errors
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "h,p,tau,alpha,name,dtype,backup",
    [
        (4, 1, 0, 0.0, "nesterov", "float32", "auto"),
        (6, 2, 1, 0.5, "nesterov", "float32", "auto"),
        (6, 3, 1, 0.0, "sgd", "float32", "auto"),
        (4, 2, 0, 0.25, "none", "float32", "auto"),
        (4, 1, 0, 0.0, "nesterov", "bfloat16", "auto"),  # summed in bf16 on the wire
        (4, 1, 0, 0.0, "nesterov", "float32", "cpu"),  # θ_g in host memory (pinned on CUDA)
        (6, 2, 1, 0.5, "nesterov", "float32", "cpu"),
        (4, 1, 0, 0.0, "nesterov", "float32", "device"),
    ],
)
def test_loop_on_torchft_matches_reference_over_several_rounds(h, p, tau, alpha, name, dtype, backup):
    k, steps, lr, mu = 2, 3 * h, 0.7, 0.9
    torch.manual_seed(1)
    init = {n: t.detach().clone() for n, t in Tiny(4).named_parameters()}
    cfg = OuterLoop.Config(
        sync_every=h, num_fragments=p, fragment_sync_delay=tau, fragment_update_alpha=alpha, backup_device=backup
    )
    cfg.optimizer = _optimizer(name, lr, mu)
    cfg.exchange.codec = Dense.Config(dtype=dtype)
    tol = 1e-5 if dtype == "float32" else 5e-3
    out = _run_replicas(k, init, steps, cfg)
    expected = _reference({n: v.double() for n, v in init.items()}, k, steps, h, p, tau, alpha, lr, mu, name)
    assert len(expected) == 3 * p
    for r in range(k):
        history, records, _ = out[r]
        assert all(rec.committed for rec in records) and len(history) == len(expected)
        for got, want in zip(history, expected):
            for n in want:
                torch.testing.assert_close(got[n].double(), want[n], rtol=tol, atol=tol)
    for a, b in zip(out[0][0], out[1][0]):  # replicas agree bitwise after every sync
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert not math.isnan(sum(float(v.sum()) for v in out[0][0][-1].values()))
    for rec in out[0][1]:  # the blocked time, part by part, adds up
        assert set(rec.parts) == set(PARTS) and all(v >= 0 for v in rec.parts.values())
        assert sum(rec.parts.values()) == pytest.approx(rec.seconds, rel=1e-6, abs=1e-9)
        assert rec.peak_extra_bytes >= 4 * rec.numel


@pytest.mark.timeout(600)
def test_scheduled_outer_steps_match_the_hand_written_loop_and_agree_bitwise():
    """A Nesterov step whose lr warms up then decays by a cosine and whose momentum decays
    linearly (Pier's shape), each sync with its own η and μ: θ_g after every sync equals DiLoCo
    written out with those values, on both replicas bit for bit, and the records say them."""
    k, h, steps, lr, mu = 2, 4, 24, 0.8, 0.95
    torch.manual_seed(2)
    init = {n: t.detach().clone() for n, t in Tiny(4).named_parameters()}
    cfg = OuterLoop.Config(sync_every=h)
    cfg.optimizer.lr, cfg.optimizer.momentum = lr, mu
    cfg.step_schedule.lr = ValueSchedule.Config(warmup=0.25, start=0.5, decay="cosine", decay_from=0.5, final=0.1)
    cfg.step_schedule.momentum = ValueSchedule.Config(decay="linear", final=0.5)

    def lr_at(t):
        p = t / steps
        if p < 0.25:
            return lr * (0.5 + 0.5 * p / 0.25)
        if p <= 0.5:
            return lr
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (p - 0.5) / 0.5)))

    def mu_at(t):
        return mu * (0.5 + 0.5 * (1 - t / steps))

    out = _run_replicas(k, init, steps, cfg)
    expected = _reference(
        {n: v.double() for n, v in init.items()}, k, steps, h, 1, 0, 0.0, lr, mu, "nesterov", lr_at=lr_at, mu_at=mu_at
    )
    for r in range(k):
        history, records, _ = out[r]
        assert [rec.outer_lr for rec in records] == pytest.approx([lr_at(t) for t in range(h, steps + 1, h)])
        assert [rec.outer_momentum for rec in records] == pytest.approx([mu_at(t) for t in range(h, steps + 1, h)])
        for got, want in zip(history, expected, strict=True):
            for n in want:
                torch.testing.assert_close(got[n].double(), want[n], rtol=1e-5, atol=1e-5)
    for a, b in zip(out[0][0], out[1][0]):
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.timeout(900)
def test_buckets_in_flight_change_nothing_in_theta_g():
    """The compressed exchange over many small buckets, one at a time and three in flight
    (overlapped encode and collectives, τ = 1), against one bucket: θ_g bitwise equal after
    every sync, on both replicas."""
    torch.manual_seed(1)
    init = {n: t.detach().clone() for n, t in Tiny(4).named_parameters()}
    histories = []
    for bucket_mb, depth in ((64.0, 1), (8 * 4 / 2**20, 1), (8 * 4 / 2**20, 3)):
        cfg = OuterLoop.Config(sync_every=4, num_fragments=2, fragment_sync_delay=1)
        cfg.exchange.codec = Quantizer.Config(bits=2, block_size=8)
        cfg.exchange.strategy = ReduceScatter.Config()
        cfg.exchange.bucket_mb, cfg.exchange.pipeline_depth = bucket_mb, depth
        out = _run_replicas(2, init, 12, cfg)
        assert all(rec.committed for r in range(2) for rec in out[r][1])
        histories.append([out[r][0] for r in range(2)])
    for other in histories[1:]:
        for r in range(2):
            for a, b in zip(histories[0][r], other[r]):
                assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.timeout(600)
def test_a_non_finite_average_is_not_committed_anywhere_and_the_replicas_go_on():
    """Replica 1 diverges (its model becomes inf) in the second round: the averaged Δ is
    not finite, so no replica commits that sync (θ_g stays as after round 1, the record
    says why, local models are reset to θ_g) and the third round commits again."""
    k, h = 2, 4
    torch.manual_seed(1)
    init = {n: t.detach().clone() for n, t in Tiny(4).named_parameters()}
    cfg = OuterLoop.Config(sync_every=h, num_fragments=1, fragment_sync_delay=0)
    out = _run_replicas(k, init, 3 * h, cfg, poison_step=h + 2)
    for r in range(k):
        history, records, final = out[r]
        assert [rec.committed for rec in records] == [True, False, True]
        assert "not finite" in records[1].failure and records[1].contributors == k
        assert all(torch.equal(history[1][n], history[0][n]) for n in history[0])  # θ_g untouched
        assert all(torch.isfinite(v).all() for v in history[2].values())
        assert all(torch.isfinite(v).all() for v in final.values())
    assert all(torch.equal(out[0][0][2][n], out[1][0][2][n]) for n in out[0][0][2])


def test_device_timing_waits_for_the_queued_work_before_a_part_and_for_the_parts_own():
    """``--outer.exchange.timing device``: a part starts after the device work queued before it
    (a ``queued`` interval) and ends when its own work has run; host timing does neither."""
    from muloco.outer.exchange.link import Clock
    from muloco.outer.exchange.pipeline import PartTimer

    now = [0.0]

    class Counter(Clock):
        def now(self):
            return now[0]

    def settle():  # the device finishing what was queued: 5 s here
        now[0] += 5

    timer = PartTimer(Counter(), settle)
    with timer("encode"):
        now[0] += 1
    assert timer.segments == [("queued", 0, 5), ("encode", 5, 11)]
    assert timer.within(0, 11) == {"queued": 5, "encode": 6}
    with timer("collective"):  # no wait first: what is queued is the collective it waits for
        pass
    assert timer.segments[2:] == [("collective", 11, 16)]
    now[0] = 11
    host = PartTimer(Counter())
    with host("decode"):
        now[0] += 1
    assert host.segments == [("decode", 11, 12)] and "queued" in PARTS


def test_an_unknown_sync_timing_is_refused_by_name():
    from muloco.outer.exchange import Exchange

    with pytest.raises(ValueError, match="outer.exchange.timing must be one of host, device; got 'gpu'"):
        Exchange.Config(timing="gpu").validate()


def test_the_advertised_address_is_checked_and_route_finds_the_interface_to_the_lighthouse(monkeypatch):
    """``fault_tolerance.advertise_address``: 'route' is the address this host reaches the lighthouse
    from (loopback here) and names its interface for gloo/NCCL; an address no interface holds is one
    error naming the setting; empty keeps torchft's choice (the hostname)."""
    from muloco.outer.manager import ReplicaGroupError, advertised_address

    environ = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    monkeypatch.setattr(os, "environ", environ)  # what the function sets stays in this test (it set
    # GLOO_SOCKET_IFNAME=lo for every later test of its worker, which broke gloo across namespaces)
    assert advertised_address("", "http://127.0.0.1:29510", 0) is None
    assert advertised_address("route", "http://127.0.0.1:29510", 0) == "127.0.0.1"
    assert environ["GLOO_SOCKET_IFNAME"] == environ["NCCL_SOCKET_IFNAME"] == "lo"
    environ["GLOO_SOCKET_IFNAME"] = "eth9"  # one that does not hold the address: replaced, said
    assert advertised_address("127.0.0.1", "http://127.0.0.1:29510", 0) == "127.0.0.1"
    assert environ["GLOO_SOCKET_IFNAME"] == "lo"
    with pytest.raises(
        ReplicaGroupError,
        match=r"replica 1: fault_tolerance.advertise_address 198.51.100.7 is not "
        r"an address of this host",
    ):
        advertised_address("198.51.100.7", "http://127.0.0.1:29510", 1)
