"""The emulated link (``--outer.link.mbps``), the link planner (``model_map --link-mbps``) and
``compare --link``.

The link's time is measured on a fake clock (time moves only when a thread sleeps on it), so
the assertions are exact and no figure depends on this machine's speed: a collective is held
for bytes / bandwidth + rounds × latency, collectives queue on the link, a collective's real
time is not counted twice, τ overlapped steps hide the hold up to their length, and the parts
of a sync still add up with the link part. The planner is checked against hand-computed cases
and against the bytes a real exchange hands its collectives.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
import threading

import pytest
from conftest import REPO, run_together, run_watched

from muloco.models.flavors import count_parameters
from muloco.outer.exchange.link import Clock, Link
from muloco.sizing import link_plan
from muloco.sizing.cli import main as model_map_main
from muloco.utils import round_budget
from muloco.utils.link_model import Transfer, format_rate, parse_rate, transfer_seconds


class FakeClock(Clock):
    """Per-thread virtual time: ``sleep_until`` jumps this thread's time, a worker thread starts
    at its creator's time, and joining a worker moves the joiner to the worker's end."""

    def __init__(self):
        self._local = threading.local()

    def now(self) -> float:
        return getattr(self._local, "now", 0.0)

    def sleep_until(self, deadline: float) -> None:
        self._local.now = max(self.now(), deadline)

    def start_thread(self, at: float) -> None:
        self._local.now = at

    def advance(self, seconds: float) -> None:
        self._local.now = self.now() + seconds


def _link(mbps=100.0, latency_ms=0.0, clock=None) -> Link:
    return Link.Config(mbps=mbps, latency_ms=latency_ms).build(clock=clock or FakeClock())


# ------------------------------------------------------------------------- the model on a fake clock


def test_a_collective_is_held_for_its_bytes_over_the_bandwidth_plus_latency():
    clock = FakeClock()
    session = _link(100, 50, clock).session()
    # 12.5 MB at 100 Mbps is 1 s; the larger direction counts (full duplex); 2 rounds of 50 ms
    deadline = session.reserve(Transfer(sent=12.5e6, received=1e6, rounds=2))
    assert deadline == pytest.approx(1.1)
    session.hold(deadline)
    assert clock.now() == pytest.approx(1.1)


def test_collectives_queue_on_the_link_and_real_time_is_not_counted_twice():
    clock = FakeClock()
    session = _link(80, 0, clock).session()  # 10 MB/s
    first = session.reserve(Transfer(10e6, 10e6, 1))  # 1 s
    second = session.reserve(Transfer(5e6, 5e6, 1))  # issued at once, starts when the first ends
    assert (first, second) == pytest.approx((1.0, 1.5))
    clock.advance(0.4)  # the real collective took 0.4 s of the emulated 1 s: held 0.6 more, not 1
    session.hold(first)
    assert clock.now() == pytest.approx(1.0)
    clock.advance(2.0)  # the real network was slower than the emulated one: no hold at all
    session.hold(second)
    assert clock.now() == pytest.approx(3.0)


def test_the_link_off_holds_nothing_and_nothing_crossing_it_costs_nothing():
    assert Link.Config().build().session().reserve(Transfer(1e9, 1e9, 4)) is None
    assert _link(100, 50).session().reserve(Transfer(0, 0, 2)) is None  # K=1: no bytes, no latency
    assert transfer_seconds(Transfer(1e6, 2e6, 3), 8.0, 10.0) == pytest.approx(2.0 + 0.03)


@pytest.mark.parametrize(
    "config,match",
    [
        (dict(mbps=-1.0), "outer.link.mbps must be a finite number >= 0"),
        (dict(mbps=math.inf), "outer.link.mbps must be a finite number >= 0"),
        (dict(mbps=math.nan), "outer.link.mbps must be a finite number >= 0"),
        (dict(mbps=10.0, latency_ms=-5.0), "outer.link.latency_ms must be a finite number >= 0"),
        (dict(latency_ms=5.0), "needs an emulated bandwidth: set --outer.link.mbps"),
    ],
)
def test_a_bad_link_value_is_one_clear_error(config, match):
    with pytest.raises(ValueError, match=match):
        Link.Config(**config).validate()


@pytest.mark.parametrize(
    "args,key",
    [
        (["--outer.link.mbps", "-1"], "outer.link.mbps"),
        (["--outer.link.latency_ms", "20"], "outer.link.latency_ms 20 needs an emulated bandwidth"),
        (["--outer.link.mbps", "inf"], "outer.link.mbps"),
    ],
)
def test_a_bad_link_setting_stops_the_trainer_before_it_writes_anything(tmp_path, capsys, args, key):
    from muloco import compat

    compat.apply()
    from muloco.train import main

    out = tmp_path / "run"
    assert main(["--config", "diloco/muloco_2bit", "--dump_folder", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert key in err and err.count("error:") == 1, err
    assert not out.exists()


def test_link_speeds_parse_and_print():
    assert [parse_rate(t) for t in ("100mbps", "1Gbps", "10 gbps", "500kbps", "2.5Gb/s")] == [
        100,
        1000,
        10000,
        0.5,
        2500,
    ]
    assert [format_rate(v) for v in (100, 1000, 2500, 0.5)] == ["100 Mbps", "1 Gbps", "2.5 Gbps", "500 kbps"]
    for bad in ("100", "fast", "0mbps", "-1gbps", "1tbps", "nanmbps"):
        with pytest.raises(ValueError, match="is not a link speed"):
            parse_rate(bad)


# ------------------------------------------------------------- a real exchange on the fake clock

WORKER = textwrap.dedent(
    """
    import json, os, sys, threading
    from datetime import timedelta
    import torch
    from muloco import compat; compat.apply()
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from muloco.compress import Dense, Quantizer
    from muloco.outer.exchange import Exchange
    from muloco.outer.exchange.link import Clock, Link
    from muloco.outer.exchange.strategies import AllGather, AllReduce, ReduceScatter

    class FakeClock(Clock):  # as tests/test_link.py's
        def __init__(self): self._local = threading.local()
        def now(self): return getattr(self._local, "now", 0.0)
        def sleep_until(self, deadline): self._local.now = max(self.now(), deadline)
        def start_thread(self, at): self._local.now = at

    url, r, k, cases, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=240)), load_state_dict=None, state_dict=None,
                      min_replica_size=k, use_async_quorum=False, store_addr="127.0.0.1", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=url, replica_id=f"lk_{r}", init_sync=False,
                      timeout=timedelta(seconds=240), quorum_timeout=timedelta(seconds=240))
    codecs = {"dense": Dense.Config(), "2bit": Quantizer.Config(bits=2)}
    strategies = {"allreduce": AllReduce.Config(), "allgather": AllGather.Config(),
                  "reduce_scatter": ReduceScatter.Config()}
    results = []
    for case in cases:
        clock = FakeClock()
        link = Link.Config(mbps=case["mbps"], latency_ms=case["latency_ms"]).build(clock=clock)
        config = Exchange.Config(codec=codecs[case["codec"]], strategy=strategies[case["strategy"]],
                                 bucket_mb=case["bucket_mb"])
        exchange = config.build(link=link)
        names, shapes = ["a.weight", "b.weight"], [tuple(s) for s in case["shapes"]]
        exchange.allocate(names, [torch.zeros(s) for s in shapes])
        manager.start_quorum()
        deltas = [torch.randn(s, generator=torch.Generator().manual_seed(r)) for s in shapes]
        pending = exchange.start(manager, names, lambda views: torch._foreach_copy_(views, deltas), True)
        clock.sleep_until(case["overlap"])  # the τ inner steps the exchange runs behind
        pending.wait()
        window = clock.now() - case["overlap"]
        numel = sum(torch.Size(s).numel() for s in shapes)
        planned = exchange.link.seconds(exchange.link_transfers(k, numel, rank=manager._pg.parent.rank()))
        results.append(dict(times=pending.times, window=window, sent=pending.bytes_sent,
                            received=pending.bytes_received, planned=planned, committed=manager.should_commit()))
    with open(out, "w") as f:
        json.dump(results, f)
    manager.shutdown(wait=False)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)  # done; gloo's threads can abort interpreter teardown ("terminate called ...")
    """
)


def _exchange_on_fake_clock(tmp_path, cases: list[dict], k: int = 2) -> list[list[dict]]:
    from torchft.coordination import LighthouseServer

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=k, join_timeout_ms=200)
    url = lighthouse.address().replace(lighthouse.address().split("//")[1].split(":")[0], "127.0.0.1")
    try:
        results = run_together(
            [
                [sys.executable, str(script), url, str(r), str(k), json.dumps(cases), str(tmp_path / f"r{r}.json")]
                for r in range(k)
            ],
            [{"RUST_LOG": "warn"}] * k,
            quiet_s=480,
        )
    finally:
        lighthouse.shutdown()
    assert all(code == 0 for code, _ in results), "\n".join(out[-3000:] for _, out in results)
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(k)]


def _by_hand(case: dict, k: int) -> float:
    """The emulated time of one sync, from the wire format written out for this case."""
    from muloco.compress import Quantizer

    bps = case["mbps"] * 1e6 / 8
    lat = case["latency_ms"] / 1000
    numel = sum(math.prod(s) for s in case["shapes"])
    if case["strategy"] == "allreduce":  # one fp32 bucket and the contributor count, issued together
        return 2 * (k - 1) / k * (4 * numel + 4) / bps + 2 * (k - 1) * lat
    codec = Quantizer.Config(bits=2).build()
    bucket = int(case["bucket_mb"] * 2**20) // 4
    pieces = [min(bucket, numel - a) for a in range(0, numel, bucket)]
    assert case["strategy"] == "allgather" and all(p % 4096 == 0 for p in pieces)
    return sum((k - 1) * (5 + codec.payload_bytes(p)) / bps + (k - 1) * lat for p in pieces)


@pytest.mark.timeout(600)
def test_an_exchange_is_held_as_the_model_says_and_overlap_hides_it(tmp_path):
    k = 2
    cases = [
        # dense all-reduce, nothing overlapped: the whole hold is blocked time
        dict(
            codec="dense",
            strategy="allreduce",
            shapes=[[64, 64], [64]],
            bucket_mb=64,
            mbps=1.0,
            latency_ms=20,
            overlap=0.0,
        ),
        # 2-bit all-gather in two buckets (they queue), half the emulated time overlapped by τ steps
        dict(
            codec="2bit",
            strategy="allgather",
            shapes=[[128, 64], [128, 64]],
            bucket_mb=8192 * 4 / 2**20,
            mbps=0.5,
            latency_ms=10,
            overlap=None,
        ),
        # reduce-scatter, overlapped by more than it takes: fully hidden
        dict(
            codec="2bit",
            strategy="reduce_scatter",
            shapes=[[128, 64], [128, 64]],
            bucket_mb=64,
            mbps=0.5,
            latency_ms=10,
            overlap=100.0,
        ),
    ]
    cases[1]["overlap"] = _by_hand(cases[1], k) / 2
    results = _exchange_on_fake_clock(tmp_path, cases, k)
    for rank_results in results:
        dense, gathered, scattered = rank_results
        assert all(r["committed"] for r in rank_results)
        # held for exactly bytes / bandwidth + rounds x latency (what the planner computes too)
        assert dense["times"]["link"] == pytest.approx(_by_hand(cases[0], k), rel=1e-9)
        assert dense["planned"] == pytest.approx(_by_hand(cases[0], k), rel=1e-9)
        assert gathered["planned"] == pytest.approx(_by_hand(cases[1], k), rel=1e-9)
        # τ steps hide the first half; the second half is blocked time
        assert gathered["times"]["link"] == pytest.approx(_by_hand(cases[1], k) / 2, rel=1e-9)
        assert scattered["times"].get("link", 0.0) == 0.0 and scattered["planned"] > 0
        for r in rank_results:  # the parts still add up: Δ before the wait, the rest is the blocked window
            waited = sum(v for key, v in r["times"].items() if key != "pseudo_gradient")
            assert waited == pytest.approx(r["window"], abs=1e-9)
            assert r["sent"] > 0 and r["received"] > 0


# ------------------------------------------------------------------------------------ the planner


def _inputs(**kw) -> link_plan.Inputs:
    base = dict(flavor="llama3-w1024-d12-h8", replicas=8, mbps=1000.0, sync_every=30, step_seconds=0.5)
    return link_plan.Inputs(**{**base, **kw})


def test_the_planner_against_hand_computed_cases():
    n = count_parameters("llama3-w1024-d12-h8", 128256)
    # dense fp32 ring all-reduce over K=8 at 1 Gbps: 2·7/8·4n bytes each way (+ the 4-byte count)
    p = link_plan.plan(_inputs(bits=32))
    ring = 2 * 7 / 8 * (4 * n + 4)
    assert p.round.sync.sent == pytest.approx(ring)
    assert p.round.sync.seconds == pytest.approx(ring * 8 / 1e9)
    assert p.round.compute == pytest.approx(15.0) and p.round.share == pytest.approx(
        p.round.sync.seconds / (15.0 + p.round.sync.seconds)
    )
    # H for a 5% share: exposed·0.95 / (0.05·0.5), rounded up
    assert p.h_for_share == math.ceil(p.round.sync.seconds * 0.95 / 0.025)
    tokens = 512 // 8 * 2048
    assert p.tokens_per_second == pytest.approx(tokens * 30 / (15.0 + p.round.sync.seconds))
    # latency: 2(K-1) rounds per collective; 26 fp32 buckets of 64 MB
    q = link_plan.plan(_inputs(bits=32, latency_ms=10))
    buckets = math.ceil(n / (64 * 2**20 // 4))
    assert q.round.sync.collectives == buckets
    assert q.round.sync.seconds == pytest.approx(p.round.sync.seconds + buckets * 14 * 0.010)
    # streaming: 3 fragments (5, 5 and 4 of the 14 units), each sync overlapped by 4 steps of 0.5 s
    s = link_plan.plan(_inputs(bits=32, fragments=3, overlap=4))
    sizes = link_plan.fragment_sizes("llama3-w1024-d12-h8", 128256, 3)
    embedding, block = 128256 * 1024, (n - 2 * 128256 * 1024 - 1024) // 12
    assert [size for size, _ in sizes] == [embedding + 4 * block, 5 * block, 3 * block + embedding + 1024]
    each = [2 * 7 / 8 * (4 * size + 4) * 8 / 1e9 for size, _ in sizes]  # each sync's contributor count too
    assert s.round.sync.fragment_seconds == pytest.approx(each)
    assert s.round.exposed == pytest.approx(sum(max(0.0, f - 2.0) for f in each))
    # step time from FLOPs: 6·(n − embedding) + 12·L·d·T per token, at 40% of an H100's 989 TFLOPS
    f = link_plan.plan(_inputs(step_seconds=None, mfu=0.4, gpu="h100"))
    per_token = 6 * (n - 128256 * 1024) + 12 * 12 * 1024 * 2048
    assert f.step_seconds == pytest.approx(per_token * tokens / (0.4 * 989e12))
    assert link_plan.plan(_inputs(step_seconds=None, mfu=0.4, gpu="989")).step_seconds == pytest.approx(f.step_seconds)


def test_unequal_groups_cost_a_lockstep_round_what_the_slowest_makes_the_others_wait():
    """--group-slowdowns: the round lasts the slowest group's H steps; the others' idle time and the
    job's compute-only tokens/s at each group's own pace, against a hand computation."""
    equal, p = (
        link_plan.plan(_inputs(bits=2, replicas=4)),
        link_plan.plan(_inputs(bits=2, replicas=4, group_slowdowns=(1, 1, 1, 1.5))),
    )
    assert equal.idle_seconds_per_round == 0 and equal.idle_share == 0 and link_plan.as_dict(equal)["groups"] is None
    assert "waiting for the slowest" not in link_plan.text(equal)
    assert p.group_step_seconds == (0.5, 0.5, 0.5, 0.75)
    assert p.round.compute == pytest.approx(30 * 0.75) and p.round.sync.seconds == equal.round.sync.seconds
    assert p.idle_seconds_per_round == pytest.approx(3 * 30 * 0.25)
    assert p.idle_share == pytest.approx(22.5 / (4 * (22.5 + p.round.sync.seconds)))
    tokens = 512 // 4 * 2048
    assert p.compute_tokens_per_second == pytest.approx(tokens / 0.75)
    assert p.tokens_per_second == pytest.approx(tokens * 30 / (22.5 + p.round.sync.seconds))
    assert p.own_pace_compute_tokens_per_second == pytest.approx(tokens * (3 / 0.5 + 1 / 0.75))
    # the link share and the H that keeps it under --max-share follow from the slowest group's step
    assert p.h_for_share == math.ceil(p.round.sync.seconds * 0.95 / (0.05 * 0.75))
    got = link_plan.as_dict(
        link_plan.plan(_inputs(bits=2, replicas=4, gpus_per_group=8, group_slowdowns=(1, 1, 1, 1.5)))
    )
    assert got["groups"]["idle_gpu_seconds_per_round"] == pytest.approx(8 * 22.5)
    assert got["groups"]["own_pace_compute_tokens_per_second"] == pytest.approx(p.own_pace_compute_tokens_per_second)
    text = link_plan.text(p)
    assert (
        "groups' steps: 0.500, 0.500, 0.500, 0.750 s" in text
        and f"{100 * p.idle_share:.1f}% of all groups' time" in text
    )
    assert "+37.5%" in text  # (3/0.5 + 1/0.75) / (4/0.75) - 1


def test_round_budgets_by_hand():
    """Deadline rounds: the steps of each group's pace that fit in H times the quantile step, clamped."""
    assert round_budget.budgets(30, [0.5, 0.5, 0.5, 0.75]) == [45, 45, 45, 30]  # 22.5 s / 0.5 s
    assert round_budget.budgets(10, [1.0, 3.0]) == [20, 10]  # 30 s would fit 30: clamped to 2H
    assert round_budget.budgets(10, [1.0, 3.0], max_steps=40) == [30, 10]
    assert round_budget.budgets(10, [0.1, 0.1, 0.1]) == [10, 10, 10]  # equal groups: H, whatever the rounding
    assert round_budget.budgets(10, [0.3, 0.7, 0.7 / 3], max_steps=40) == [23, 10, 30]  # ⌊23.3⌋; 7 / (0.7/3) is 30
    # quantile 0.5 of four groups: the 2nd smallest step (1.0): D = 10 s; the 4 s group trains 2 steps, floor 3
    assert round_budget.budgets(10, [1.0, 1.0, 2.0, 4.0], quantile=0.5) == [10, 10, 5, 2]
    assert round_budget.budgets(10, [1.0, 1.0, 2.0, 4.0], quantile=0.5, min_steps=3) == [10, 10, 5, 3]
    assert round_budget.progress([20, 10]) == 15.0 and round_budget.progress([10, 10]) == 10.0
    assert round_budget.round_seconds([20, 10], [1.0, 3.0]) == 30.0
    assert round_budget.idle_seconds([20, 10], [1.0, 3.0]) == 10.0  # the fast group, clamped at 20 steps
    assert round_budget.last_round([20, 10], 90.0, 100) == [14, 7]  # 10 left of a 15-step round: ⌈13.3⌉, ⌈6.7⌉
    assert round_budget.last_round([20, 10], 70.0, 100) == [20, 10]  # a full round fits, and half of one after it
    # a full round would leave 5 steps, a third of a round: this round takes them ([26.7], [13.3] rounded up)
    assert round_budget.last_round([20, 10], 80.0, 100) == [27, 14]
    assert round_budget.last_round([10, 10], 14.0, 24) == [10, 10]  # ends the run exactly: no 0-step round
    assert round_budget.progress(round_budget.last_round([20, 10], 90.0, 100)) >= 10


def test_the_planner_projects_deadline_rounds_beside_lockstep():
    """With --group-slowdowns the plan adds deadline rounds: the budgets, the round (the last group to
    finish, plus the link), the waiting share and the job's tokens/s with the link, by hand."""
    p = link_plan.plan(_inputs(bits=2, replicas=4, group_slowdowns=(1, 1, 1, 1.5)))
    assert p.deadline_steps == [45, 45, 45, 30]
    assert p.deadline_round_seconds == pytest.approx(22.5 + p.round.exposed) and p.deadline_idle_share == 0
    tokens = 512 // 4 * 2048
    jobs = p.job_tokens_per_second
    assert jobs["lockstep"] == pytest.approx(4 * tokens * 30 / (22.5 + p.round.exposed))
    assert jobs["deadline"] == pytest.approx(165 * tokens / (22.5 + p.round.exposed))
    capped = link_plan.plan(
        _inputs(bits=2, replicas=3, global_batch=384, group_slowdowns=(1, 1, 3), round_max_steps=45)
    )
    assert capped.deadline_steps == [45, 45, 30]  # 90 steps would fit: clamped
    idle = 2 * (30 * 1.5 - 45 * 0.5)
    assert capped.deadline_idle_share == pytest.approx(idle / (3 * (45 + capped.round.exposed)))
    text = link_plan.text(p)
    assert "the groups train 45, 45, 45, 30 steps per round" in text
    assert f"({jobs['deadline'] / jobs['lockstep']:.2f}x)" in text
    got = link_plan.as_dict(p)["groups"]
    assert got["deadline"]["steps"] == [45, 45, 45, 30] and got["job_tokens_per_second"] == pytest.approx(jobs)
    # a quantile below 1 shortens the round: the link's share is of that round, not of the lockstep one
    short = link_plan.plan(_inputs(bits=2, replicas=4, group_slowdowns=(1, 1, 1, 4), round_quantile=0.5))
    assert short.deadline_link_share == pytest.approx(short.round.exposed / short.deadline_round_seconds)
    assert short.deadline_link_share > 2 * short.round.share
    assert f"link share of such a round {100 * short.deadline_link_share:.1f}%" in link_plan.text(short)
    # streaming fragments (or τ > 0) and deadline rounds do not go together in the trainer: not planned
    streaming = link_plan.plan(_inputs(bits=2, replicas=4, group_slowdowns=(1, 1, 1, 1.5), fragments=3, overlap=2))
    assert "deadline rounds: not with --streaming-fragments 3 / --overlap 2" in link_plan.text(streaming)
    assert link_plan.as_dict(streaming)["groups"]["deadline"] is None


def test_the_planner_agrees_with_the_exchanges_own_byte_count():
    """The planner's bytes are the wire format the exchange counts its real bytes by (the exchange
    tests check those against the buffers handed to the collectives)."""
    from muloco.outer.exchange import Exchange

    inputs = _inputs(flavor="llama3-w128-d4-h2", replicas=2, bits=2, vocab=2048)
    sync = link_plan.project_sync(inputs)
    config = link_plan.exchange_config(2, "auto")
    [(n, norms)] = link_plan.fragment_sizes("llama3-w128-d4-h2", 2048, 1)
    assert n == count_parameters("llama3-w128-d4-h2", 2048) and norms == 4 * 2 * 128 + 128
    wire = Exchange(config).wire_bytes(2, n - norms, norms)
    assert sync.sent == wire["sent"] and sync.bits_per_parameter == pytest.approx(8 * wire["payload"] / n)


@pytest.mark.parametrize(
    "flavor,n", [("llama3-w128-d4-h2", 3), ("llama3-w64-d2-h2_qk_torch-rmsnorm_pa_pf", 2), ("llama3-w128-d4-h2", 6)]
)
def test_the_planners_fragments_are_the_outer_loops(flavor, n):
    """Streaming: the planner sizes each fragment as ``model_fragments`` splits the built model (the
    embedding and the head make the end fragments larger), norm weights counted apart."""
    import torch

    from muloco import compat

    compat.apply()  # the model imports torchtitan: compat first (the test may run alone)
    from muloco.models import ModelConfig, build_model_config
    from muloco.outer.schedule import model_fragments

    with torch.device("meta"):
        model = build_model_config(ModelConfig(flavor=flavor, vocab_multiple_of=1), vocab_size=512).build()
    built = [
        (sum(p.numel() for _, p in frag), sum(p.numel() for name, p in frag if name.endswith("norm.weight")))
        for frag in model_fragments(model, n)
    ]
    assert link_plan.fragment_sizes(flavor, 512, n) == built


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--link-mbps", "-5"], "--link-mbps -5.0: must be a positive number"),
        (["--link-mbps", "100", "--bits", "3"], "--bits 3: use one of"),
        (["--link-mbps", "100", "--replicas", "1"], "a link joins at least 2 replica groups"),
        (["--link-mbps", "100", "--step-seconds", "0"], "--step-seconds 0.0: must be positive"),
        (["--link-mbps", "100", "--step-seconds", "1", "--mfu", "0.4"], "give one or the other"),
        (["--link-mbps", "100", "--mfu", "7"], "--mfu 7.0: a fraction between 0 and 1"),
        (["--link-mbps", "100", "--mfu", "0.4", "--gpu", "tpu"], "--gpu 'tpu': one of h100"),
        (["--link-mbps", "100", "--step-seconds", "1", "--overlap", "30"], "--overlap 30: must be >= 0 and below"),
        (
            ["--link-mbps", "100", "--step-seconds", "1", "--bits", "2", "--strategy", "allreduce"],
            "allreduce sums dense numbers only",
        ),
        (["--link-mbps", "100", "--group-slowdowns", "1", "1.5"], "gives 2 numbers for --replicas 8"),
        (["--link-mbps", "100", "--replicas", "2", "--group-slowdowns", "1", "0"], "each must be a positive multiple"),
        (
            ["--link-mbps", "100", "--replicas", "2", "--group-slowdowns", "1", "nan"],
            "each must be a positive multiple",
        ),
        (["--group-slowdowns", "1", "2"], "--group-slowdowns is a link planner option"),
        (["--link-mbps", "100", "--replicas", "2", "--round-quantile", "0"], "--round-quantile 0.0: a fraction in"),
        (["--link-mbps", "100", "--replicas", "2", "--round-min-steps", "90"], "need 1 <= min <= max"),
    ],
)
def test_bad_planner_inputs_are_one_clear_error(argv, match, capsys):
    base = ["--flavor", "llama3-w1024-d12-h8", "--replicas", "8"]
    assert model_map_main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("muloco map: error: ") and match in err and "Traceback" not in err


def test_the_planner_command_prints_the_projection():
    out = run_watched(
        [
            sys.executable,
            "-m",
            "muloco.model_map",
            "--flavor",
            "llama3-w1024-d12-h8",
            "--replicas",
            "8",
            "--link-mbps",
            "1000",
            "--bits",
            "2",
            "--sync-every",
            "30",
            "--mfu",
            "0.45",
            "--gpu",
            "h100",
        ],
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    for text in (
        "projected sync time on the link",
        "link share of a round",
        "tokens/s per replica group",
        "to keep the share <= 5%: H >= ",
        "2-bit quantized, reduce_scatter",
        "989 TFLOPS peak (h100)",
        "SparseLoCo, allgather                   0.223",
    ):
        assert text in out.stdout


def test_the_planner_defaults_are_said_in_its_output():
    """Without --step-seconds, --gpu or --mfu the step time is an H100 at 40% MFU, and the output says
    so; without --replicas the link joins K=2 groups, said too."""
    out = run_watched(
        [sys.executable, "-m", "muloco.model_map", "--flavor", "llama3-w1024-d12-h8", "--link-mbps", "1000"], cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert "assumed --gpu h100 and --mfu 0.4" in out.stdout and "K=2 replica groups" in out.stdout
    assert "K=2 is the default: set --replicas K" in out.stdout
    expected = link_plan.plan(_inputs(replicas=2, step_seconds=None))
    assert f"step: {expected.step_seconds:.3f} s" in out.stdout


def test_the_plan_as_json(capsys):
    assert (
        model_map_main(
            [
                "--flavor",
                "llama3-w1024-d12-h8",
                "--replicas",
                "8",
                "--link-mbps",
                "1000",
                "--bits",
                "2",
                "--step-seconds",
                "0.5",
                "--json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    want = link_plan.plan(_inputs(bits=2))
    assert got["inputs"]["replicas"] == 8 and got["inputs"]["gpu"] is None and got["step_seconds"] == 0.5
    assert got["chosen"]["exchange"] == want.round.sync.label
    assert got["chosen"]["sent_bytes_per_round"] == want.round.sync.sent
    assert got["chosen"]["h_for_share"] == want.h_for_share and got["tokens_per_second"] == want.tokens_per_second
    assert [a["exchange"] for a in got["alternatives"]] == [sync.label for sync, _, _ in want.candidates]


def test_the_planners_sparseloco_is_the_shipped_configs():
    """The planner builds SparseLoCo's exchange without loading a trainer config; on every field
    but the strategy (it plans all-gather) it is the one ``diloco/sparseloco`` ships."""
    import dataclasses

    from muloco import compat
    from muloco.config import load_config

    compat.apply()  # loading a config imports torchtitan's trainer: compat first (the test may run alone)
    shipped = load_config(link_plan.SPARSELOCO_CONFIG).outer.exchange
    [planned] = link_plan.sparseloco_exchanges()
    for f in dataclasses.fields(planned):
        if f.name not in ("strategy", "error_feedback"):  # error feedback changes what is sent, not its size
            assert getattr(planned, f.name) == getattr(shipped, f.name), f.name


def test_the_planner_loads_no_trainer():
    code = (
        "import sys; from muloco.sizing.cli import main; main(['--flavor', 'llama3-w1024-d12-h8', '--link-mbps', "
        "'1000', '--json']); bad = [m for m in ('torchtitan.trainer', 'torchft', 'datasets') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = run_watched([sys.executable, "-c", code], cwd=REPO)
    assert proc.returncode == 0, proc.stderr
