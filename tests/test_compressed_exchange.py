"""Exchanges over real torchft Managers in separate processes.

Three replica processes (each its own Manager, TCPStore and gloo group; the lighthouse
runs in this process) exchange seeded pseudo-gradients through each strategy; this
process recomputes what the average must be from the codec alone (encode, decode, mean,
and for reduce-scatter the re-encoding of each range) and checks every replica got
exactly that, bitwise the same on all replicas, with byte counts equal to the wire
format's formula. Cutting the streams into buckets, and keeping several buckets in
flight, changes nothing bitwise; the memory a sync takes, measured in the replica processes
(every storage aten allocates, alive until freed), stays within O(n) + O(K · bucket).
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from muloco import compat

compat.apply()

from conftest import run_together  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

from muloco.compress import Dense, ErrorFeedback, Pieces, Quantizer, TopK  # noqa: E402
from muloco.outer.exchange import Exchange  # noqa: E402
from muloco.outer.exchange.bucket import HEADER_BYTES  # noqa: E402
from muloco.outer.exchange.layout import ranges, whole_tensors  # noqa: E402
from muloco.outer.exchange.pipeline import RECORD_BYTES  # noqa: E402
from muloco.outer.exchange.strategies import AllGather, AllReduce, ReduceScatter  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "bench"
NAMES = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention_norm.weight", "output.weight"]
SHAPES = [(50, 16), (16, 16), (16,), (50, 16)]
ROUNDS = 3

# A spec is JSON: codec [kind, settings], strategy name or null, and the exchange's other fields.
BUILD = textwrap.dedent(
    """
    from muloco.compress import Dense, ErrorFeedback, Quantizer, TopK
    from muloco.outer.exchange import Exchange
    from muloco.outer.exchange.strategies import AllGather, AllReduce, ReduceScatter
    from muloco.outer.exchange.pipeline import Work

    CODECS = {"dense": Dense, "quantize": Quantizer, "topk": TopK}
    STRATEGIES = {"allreduce": AllReduce, "allgather": AllGather, "reduce_scatter": ReduceScatter}

    def exchange_config(spec):
        kind, settings = spec["codec"]
        strategy = spec.get("strategy")
        rest = {k: v for k, v in spec.items() if k not in ("codec", "strategy", "error_feedback", "work")}
        return Exchange.Config(codec=CODECS[kind].Config(**settings),
                               strategy=STRATEGIES[strategy].Config() if strategy else None,
                               error_feedback=ErrorFeedback.Config(**spec.get("error_feedback", {})), **rest)
    """
)
exec(BUILD)  # the same builder here and in the workers

WORKER = BUILD + textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    import torch
    from muloco import compat; compat.apply()
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    url, r, k, spec, out, rounds, idle = sys.argv[1:8]
    bench = sys.argv[10]
    r, k, rounds = int(r), int(k), int(rounds)
    idle = json.loads(idle)   # [round, replica] pairs that do not contribute
    names, shapes = json.loads(sys.argv[8]), [tuple(s) for s in json.loads(sys.argv[9])]
    spec = json.loads(spec)
    profile = spec.pop("profile_memory", False)
    work = spec.pop("work", [0.0] * k)  # per replica: tokens trained since its last sync
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(  # every wait for a peer is only a hang timeout
        pg=ProcessGroupGloo(timeout=timedelta(seconds=240)), load_state_dict=None, state_dict=None,
        min_replica_size=k, use_async_quorum=False, store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=url, replica_id=f"cx_{r}", init_sync=False,
        timeout=timedelta(seconds=240), quorum_timeout=timedelta(seconds=240))
    exchange = exchange_config(spec).build()
    exchange.allocate(names, [torch.zeros(s) for s in shapes])
    results = []
    for t in range(rounds):
        manager.start_quorum()
        g = torch.Generator().manual_seed(1000 * t + r)
        deltas = [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(shapes)]
        contributes = [t, r] not in idle

        def fill(views):
            torch._foreach_copy_(views, deltas)

        def run():
            pending = exchange.start(manager, names, fill, contributes, quorum_seconds=0.01 * (r + 1),
                                     work=Work(tokens=work[r], steps=1 + r, seconds=0.5, group=r))
            return pending, pending.wait()

        if profile:
            # Every tensor storage aten ops allocate, alive until it is freed (bench/live_bytes.py):
            # a dispatch mode sees one thread, so the exchange's worker runs inline here
            # (the same schedule, on this thread) while it measures.
            sys.path.insert(0, bench)
            from live_bytes import LiveBytes, exchange_worker_inline

            with exchange_worker_inline(), LiveBytes() as live:
                pending, avg = run()
            peak = live.peak
        else:
            pending, avg = run()
            peak = None
        avg = [a.clone() for a in avg]
        results.append(dict(avg=avg, committed=manager.should_commit(), sent=pending.bytes_sent,
                            received=pending.bytes_received, payload=pending.payload_bytes,
                            contributors=pending.contributors, rank=manager._pg.parent.rank(),
                            tally_peak=pending.peak_extra_bytes, measured_peak=peak,
                            slowest=pending.wait_for_slowest(), times=pending.times, weights=pending.weights,
                            records=pending.records))
    torch.save(results, out)
    manager.shutdown(wait=False)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)  # done; gloo's threads can abort interpreter teardown ("terminate called ...", seen in CI)
    """
)


def _deltas(t: int, r: int, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * t + r)
    return [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(shapes)]


def _run(
    tmp_path, spec: dict, k: int = 3, idle: list | None = None, names=NAMES, shapes=SHAPES, rounds: int = ROUNDS
) -> list[list[dict]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=k, join_timeout_ms=200)
    url = lighthouse.address().replace(lighthouse.address().split("//")[1].split(":")[0], "127.0.0.1")
    commands = [
        [
            sys.executable,
            str(script),
            url,
            str(r),
            str(k),
            json.dumps(spec),
            str(tmp_path / f"r{r}.pt"),
            str(rounds),
            json.dumps(idle or []),
            json.dumps(names),
            json.dumps(shapes),
            str(BENCH),
        ]
        for r in range(k)
    ]
    try:
        results = run_together(commands, [{"RUST_LOG": "warn"}] * k, quiet_s=480)
    finally:
        lighthouse.shutdown()
    assert all(code == 0 for code, _ in results), "\n".join(out[-3000:] for _, out in results)
    return [torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(k)]


def _sides(shape, tiles: int) -> tuple[int, int]:
    """SparseLoCo's tile of a matrix: the largest divisors of its dimensions up to ``tiles``."""
    return tuple(max(d for d in range(1, tiles + 1) if n % d == 0) for n in shape)


def _tiled(d: torch.Tensor, tiles: int) -> torch.Tensor:
    """The reference's ``(y h) (x w) -> y x h w``, flattened."""
    if not tiles or d.dim() != 2:
        return d.reshape(-1)
    (rows, cols), (h, w) = d.shape, _sides(d.shape, tiles)
    return d.reshape(rows // h, h, cols // w, w).permute(0, 2, 1, 3).reshape(-1)


def _untiled(x: torch.Tensor, shape, tiles: int) -> torch.Tensor:
    if not tiles or len(shape) != 2:
        return x.view(shape)
    (rows, cols), (h, w) = shape, _sides(shape, tiles)
    return x.reshape(rows // h, cols // w, h, w).permute(0, 2, 1, 3).reshape(shape)


def _streams(deltas, skip: bool, tiles: int = 0):
    comp = torch.cat([_tiled(d, tiles) for n, d in zip(NAMES, deltas) if not (skip and "norm" in n)])
    dense = torch.cat([d.reshape(-1) for n, d in zip(NAMES, deltas) if skip and "norm" in n] or [torch.zeros(0)])
    return comp, dense


def _join(comp, dense, skip: bool, tiles: int = 0) -> list[torch.Tensor]:
    it_c = iter(comp.split([torch.Size(s).numel() for n, s in zip(NAMES, SHAPES) if not (skip and "norm" in n)]))
    it_d = iter(dense.split([torch.Size(s).numel() for n, s in zip(NAMES, SHAPES) if skip and "norm" in n]))
    return [
        next(it_d).view(s) if skip and "norm" in n else _untiled(next(it_c), s, tiles) for n, s in zip(NAMES, SHAPES)
    ]


def _reference(spec: dict, k: int, idle: list | None = None) -> list[list[torch.Tensor]]:
    """Per round: the average every replica must receive (one bucket; no pipeline)."""
    cfg = exchange_config(spec)  # noqa: F821 - defined by exec(BUILD)
    codec = mean_codec = cfg.codec.build()
    skip = bool(cfg.skip_pattern)
    if codec.per_tensor:  # tensor by tensor, each with its own table
        codec = Pieces(codec, _bounds(_compressed_sizes(skip)))
    strategy = cfg.resolved_strategy()
    feedback = [ErrorFeedback(cfg.error_feedback) for _ in range(k)]
    history = []
    for t in range(ROUNDS):
        contributing = [r for r in range(k) if [t, r] not in (idle or [])]
        weights = _weights(spec, k, contributing)
        streams = [_streams(_deltas(t, r), skip, cfg.tiles) for r in range(k)]
        n = streams[0][0].numel()
        if isinstance(strategy, ReduceScatter.Config):
            bounds = ranges(n, k, codec.alignment)

            class Ranged:
                lossless = codec.lossless

                def encode(self, x):
                    return torch.cat([codec.encode(x[a:b]) for a, b in bounds])

                def decode(self, p, numel):
                    sizes = [codec.payload_bytes(b - a) for a, b in bounds]
                    return torch.cat([codec.decode(q, b - a) for q, (a, b) in zip(p.split(sizes, -1), bounds)], -1)

            decoded = [Ranged().decode(feedback[r].compress("c", streams[r][0], Ranged()), n) for r in contributing]
            mean = _mean(decoded, codec, weights)
            comp = Ranged().decode(Ranged().encode(mean), n)  # each owner re-encodes its range
        else:
            decoded = [codec.decode(feedback[r].compress("c", streams[r][0], codec), n) for r in contributing]
            comp = _mean(decoded, mean_codec, weights)
        dense = _mean([streams[r][1] for r in contributing], None, weights)
        history.append(_join(comp, dense, skip, cfg.tiles))
    return history


def _compressed_sizes(skip: bool) -> list[int]:
    return [torch.Size(s).numel() for n, s in zip(NAMES, SHAPES) if not (skip and "norm" in n)]


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [(e - n, e) for n, e in zip(sizes, ends)]


def _weights(spec: dict, k: int, contributing: list[int]) -> list[float] | None:
    """The contributors' weights in a weighted exchange, by hand: work over the most any
    contributor did (the work here are small multiples, so the 2⁻¹⁶ grid is exact)."""
    if spec.get("weighting") != "tokens":
        return None
    work = [spec["work"][r] for r in contributing]
    return [w / max(work) for w in work]


def _mean(decoded: list[torch.Tensor], codec, weights: list[float] | None = None) -> torch.Tensor:
    """The average of the decoded payloads, in float64: over the replicas, or per coordinate
    over those that selected it (top-k's ``mean_over_selectors``, SparseLoCo's rule); with
    ``weights``, each row counts by its weight (in the selectors' sum too)."""
    rows = torch.stack(decoded).double()
    w = torch.tensor(weights or [1.0] * rows.shape[0], dtype=torch.float64).view(-1, *[1] * (rows.dim() - 1))
    if getattr(codec, "mean_over_selectors", False):
        selected = ((rows != 0) * w).sum(0)
        return ((rows * w).sum(0) / torch.where(selected > 0, selected, 1.0)).float()
    return ((rows * w).sum(0) / w.sum()).float()


SPARSELOCO = dict(
    fraction=0.25,
    chunk_size=64,
    value_bits=2,
    value_scheme="statistical",
    value_block_chunks=2,
    index_bits=12,
    mean_over_selectors=True,
)

CASES = {
    "allgather-2bit": dict(codec=["quantize", dict(bits=2, block_size=64)], strategy="allgather"),
    "reduce_scatter-2bit": dict(codec=["quantize", dict(bits=2, block_size=64)], strategy="reduce_scatter"),
    "allgather-topk": dict(codec=["topk", dict(fraction=0.25, chunk_size=64)], strategy="allgather"),
    "reduce_scatter-4bit-skipnorm": dict(
        codec=["quantize", dict(bits=4, block_size=64)], strategy="reduce_scatter", skip_pattern=r"norm\.weight$"
    ),
    "allreduce-dense": dict(codec=["dense", {}]),
    "allgather-sparseloco": dict(codec=["topk", SPARSELOCO], strategy="allgather", error_feedback=dict(beta=0.95)),
    # SparseLoCo as published, in miniature: its 4x4-tile layout ((50, 16) matrices get 2x4 tiles,
    # (16, 16) 4x4), one 2-bit table per tensor (value_block_chunks 0) and buckets of whole tensors
    # (of 1,101 elements here: the embedding and wq share one, the output has its own; the
    # bucketing must change nothing); "allgather-sparseloco" has fixed-size value blocks
    "allgather-sparseloco-tiles": dict(
        codec=[
            "topk",
            {
                **SPARSELOCO,
                "chunk_size": 16,
                "value_block_chunks": 0,
                "value_range_sigmas": 6.0,
                "value_mean_at": "centre",
                "value_sample_sigma": True,
            },
        ],
        strategy="allgather",
        error_feedback=dict(beta=0.95, fold_outer_lr=True),
        tiles=4,
        skip_pattern=r"norm\.weight$",
        bucket_mb=0.0042,
    ),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_strategies_average_like_the_reference_on_three_processes(tmp_path, case):
    spec = CASES[case]
    got = _run(tmp_path, spec)
    want = _reference(spec, 3)
    for t in range(ROUNDS):
        for r in range(3):
            res = got[r][t]
            assert res["committed"] and res["contributors"] == 3
            for a, b, name in zip(res["avg"], want[t], NAMES):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{case} round {t} replica {r} {name}")
        for r in (1, 2):  # every replica holds the same average, bitwise
            assert all(torch.equal(a, b) for a, b in zip(got[0][t]["avg"], got[r][t]["avg"]))
    _check_bytes(spec, got)


def _check_bytes(spec: dict, got: list[list[dict]]) -> None:
    """Counted from the buffers == the formula, and (one bucket each) the formula spelt out."""
    exchange = exchange_config(spec).build()  # noqa: F821
    skip = bool(spec.get("skip_pattern"))
    comp_n, dense_n = (x.numel() for x in _streams(_deltas(0, 0), skip))
    codec, k = exchange.codec, len(got)
    for r in range(k):
        res = got[r][0]
        formula = exchange.wire_bytes(k, comp_n, dense_n, rank=res["rank"], sizes=_compressed_sizes(skip))
        assert formula == {"payload": res["payload"], "sent": res["sent"], "received": res["received"]}
        if exchange.weighted:  # the work records, then the buckets alone
            record = RECORD_BYTES * (k - 1)
            plain = exchange_config({**spec, "weighting": "equal"}).build()  # noqa: F821
            alone = plain.wire_bytes(k, comp_n, dense_n, rank=res["rank"])
            once = plain.strategy.sync_bytes(k, res["rank"])  # AllReduce's flag count: the records replace it
            assert res["payload"] == alone["payload"] - once["payload"] + RECORD_BYTES
            assert res["sent"] == pytest.approx(alone["sent"] - once["sent"] + record)
            assert res["received"] == pytest.approx(alone["received"] - once["received"] + record)
            continue
        if isinstance(exchange.strategy, AllReduce):  # the buffer, and the contributor count once
            ring = 2 * (k - 1) / k * 4 * comp_n + 2 * (k - 1) / k * 4
            assert res["payload"] == 4 * (comp_n + 1) and res["sent"] == res["received"] == pytest.approx(ring)
        elif codec.per_tensor:  # buckets of whole tensors: a header each, then each tensor's own payload
            buckets = whole_tensors(_compressed_sizes(skip), exchange.bucket_numel)
            assert [len(pieces) for _, _, pieces in buckets] == [2, 1]
            payload = sum(HEADER_BYTES + sum(codec.payload_bytes(b - a) for a, b in pieces) for _, _, pieces in buckets)
            payload += HEADER_BYTES + 4 * dense_n if dense_n else 0
            assert res["payload"] == payload and res["sent"] == res["received"] == (k - 1) * payload
        elif isinstance(exchange.strategy, AllGather):
            payload = HEADER_BYTES + codec.payload_bytes(comp_n) + (HEADER_BYTES + 4 * dense_n if dense_n else 0)
            assert res["payload"] == payload and res["sent"] == res["received"] == (k - 1) * payload
        else:
            me = res["rank"]
            chunks = [codec.payload_bytes(b - a) for a, b in ranges(comp_n, k, codec.alignment)]
            dense = [4 * (b - a) for a, b in ranges(dense_n, k, 1)] if dense_n else [0] * k
            pieces = [HEADER_BYTES + c for c in chunks] + ([HEADER_BYTES + d for d in dense] if dense_n else [])
            assert res["payload"] == sum(pieces)
            sent = sum(HEADER_BYTES + c for j, c in enumerate(chunks) if j != me) + (k - 1) * chunks[me]
            if dense_n:
                sent += sum(HEADER_BYTES + d for j, d in enumerate(dense) if j != me) + (k - 1) * dense[me]
            assert res["sent"] == sent


@pytest.mark.timeout(600)
def test_a_replica_that_does_not_contribute_adds_nothing(tmp_path):
    spec = dict(codec=["quantize", dict(bits=4, block_size=64)], strategy="allgather")
    idle = [[1, 2]]  # round 1: replica 2 has just healed
    got = _run(tmp_path, spec, idle=idle)
    want = _reference(spec, 3, idle=idle)
    assert [got[r][1]["contributors"] for r in range(3)] == [2, 2, 2]
    for r in range(3):
        for a, b in zip(got[r][1]["avg"], want[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


WEIGHTED = {
    "allreduce-fp32": dict(codec=["dense", {}]),
    "reduce_scatter-2bit-ef": dict(
        codec=["quantize", dict(bits=2, block_size=64)], strategy="reduce_scatter", skip_pattern=r"norm\.weight$"
    ),
    "allgather-sparseloco": dict(codec=["topk", SPARSELOCO], strategy="allgather", error_feedback=dict(beta=0.95)),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(WEIGHTED))
def test_a_weighted_exchange_counts_each_delta_by_the_work_behind_it(tmp_path, case):
    """Replicas that trained 1, 2 and 4 units of work since their last sync (a group of
    unequal speed) enter the average with weights 1/4, 1/2 and 1, for every strategy (the
    all-reduce scales its own Δ before the sum, the others weigh decoded rows, top-k's
    selector counts are weighted too); in round 1 the busiest replica has just healed and
    sends nothing, so the weights are over the other two (1/2, 1). Every replica gets the same
    bits, and the bytes are the buckets' plus one 16-byte record per replica."""
    spec = {**WEIGHTED[case], "weighting": "tokens", "work": [1000.0, 2000.0, 4000.0]}
    idle = [[1, 2]]
    got = _run(tmp_path, spec, idle=idle)
    want = _reference(spec, 3, idle=idle)
    assert [got[r][0]["weights"] for r in range(3)] == [[0.25, 0.5, 1.0]] * 3
    assert [got[r][1]["weights"] for r in range(3)] == [[0.5, 1.0, 0.0]] * 3
    # every replica holds every record: flag, tokens, steps, seconds, group
    assert [got[r][1]["records"] for r in range(3)] == [
        [[1.0, 1000.0, 1.0, 0.5, 0.0], [1.0, 2000.0, 2.0, 0.5, 1.0], [0.0, 4000.0, 3.0, 0.5, 2.0]]
    ] * 3
    for t in range(ROUNDS):
        for r in range(3):
            assert got[r][t]["committed"] and got[r][t]["contributors"] == (2 if t == 1 else 3)
            for a, b, name in zip(got[r][t]["avg"], want[t], NAMES):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{case} round {t} replica {r} {name}")
            assert all(torch.equal(a, b) for a, b in zip(got[0][t]["avg"], got[r][t]["avg"]))
    _check_bytes(spec, got)


@pytest.mark.timeout(600)
def test_equal_work_weighs_nothing_the_weighted_average_is_the_plain_one_bitwise(tmp_path):
    """Groups that trained the same (lockstep rounds) get weights of exactly 1.0, and the
    weighted exchange's averages equal the plain exchange's bit for bit."""
    spec = dict(codec=["quantize", dict(bits=2, block_size=64)], strategy="allgather", error_feedback=dict(beta=0.9))
    runs = {}
    for name, extra in {"plain": {}, "weighted": dict(weighting="tokens", work=[512.0] * 3)}.items():
        folder = tmp_path / name
        folder.mkdir()
        runs[name] = _run(folder, {**spec, **extra})
    for t in range(ROUNDS):
        for r in range(3):
            assert runs["weighted"][r][t]["weights"] == [1.0, 1.0, 1.0] and runs["plain"][r][t]["weights"] is None
            assert all(torch.equal(a, b) for a, b in zip(runs["plain"][r][t]["avg"], runs["weighted"][r][t]["avg"]))


# --------------------------------------------------------------- buckets, overlap, memory

BIG_NAMES = ["layers.0.w1.weight", "layers.0.norm.weight", "layers.0.w2.weight", "output.weight"]
BIG_SHAPES = [(384, 256), (256,), (256, 384), (300, 257)]
"""About 274k elements: a 2-bit payload of ~70 kB, buckets of 16k elements (64 kB)."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy,skip_dtype", [("allgather", "bfloat16"), ("reduce_scatter", "float32")])
def test_buckets_and_overlap_change_nothing_bitwise_and_memory_stays_bounded(tmp_path, strategy, skip_dtype):
    """One bucket, one in flight (today's unbucketed exchange) against 17 buckets, 3 in
    flight: the same averages bitwise on every replica, every round (one bucket at a time
    against three in flight: tests/test_outer.py). The measured
    peak of a sync's allocations at K=3 stays below 2 copies of Δ plus 12 buckets' worth,
    far from the K+1 copies of Δ that decoding every payload at once takes; the peak the
    sync itself reports (its own buffers) is below the measured one."""
    base = dict(
        codec=["quantize", dict(bits=2)], strategy=strategy, skip_pattern=r"norm\.weight$", skip_dtype=skip_dtype
    )
    bucket_mb = 16384 * 4 / 2**20
    runs = {}
    for name, extra in {
        "whole": dict(bucket_mb=64.0, pipeline_depth=1),
        "overlapped": dict(bucket_mb=bucket_mb, pipeline_depth=3, profile_memory=True),
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        runs[name] = _run(folder, {**base, **extra}, names=BIG_NAMES, shapes=BIG_SHAPES)
    for t in range(ROUNDS):
        for r in range(3):
            whole = runs["whole"][r][t]["avg"]
            assert all(torch.equal(a, b) for a, b in zip(whole, runs["overlapped"][r][t]["avg"])), (t, r)
            assert all(torch.equal(a, b) for a, b in zip(whole, runs["whole"][0][t]["avg"]))
    n_bytes = 4 * sum(torch.Size(s).numel() for s in BIG_SHAPES)
    bucket_bytes = 16384 * 4
    bound = 2 * n_bytes + 12 * bucket_bytes
    for r in range(3):
        for t in range(1, ROUNDS):  # round 0 also allocates first-use state (e.g. gloo buffers)
            res = runs["overlapped"][r][t]
            print(
                f"{strategy} r{r} round {t}: measured peak {res['measured_peak'] / n_bytes:.2f}×Δ, "
                f"tally {res['tally_peak'] / n_bytes:.2f}×Δ, bound {bound / n_bytes:.2f}×Δ"
            )
            assert res["tally_peak"] <= res["measured_peak"] <= bound
            assert res["measured_peak"] < (3 + 1) * n_bytes


@pytest.mark.timeout(600)
def test_time_waiting_for_the_slowest_is_told_apart_from_the_headers(tmp_path):
    """Each replica reports a different quorum time (0.01·(r+1) s here); each one's wait for
    the slowest is its own minus the fastest's, and the exchange's parts are measured."""
    got = _run(tmp_path, dict(codec=["quantize", dict(bits=2, block_size=64)], strategy="reduce_scatter"), rounds=1)
    for r in range(3):
        assert got[r][0]["slowest"] == pytest.approx(0.01 * r, abs=1e-6)
        times = got[r][0]["times"]
        assert times["pseudo_gradient"] > 0 and times.get("encode", 0) + times.get("collective", 0) >= 0


# ------------------------------------------------------------------ settings and state


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: Exchange.Config(codec=Quantizer.Config(bits=3)),
            r"outer.exchange.codec \(quantize\): bits must be one of",
        ),
        (lambda: Exchange.Config(codec=Quantizer.Config(block_size=-1)), "block_size must be > 0"),
        (lambda: Exchange.Config(codec=TopK.Config(fraction=0.0)), r"codec \(topk\): fraction must be in"),
        (lambda: Exchange.Config(codec=TopK.Config(fraction=1.5)), "fraction must be in"),
        (
            lambda: Exchange.Config(error_feedback=ErrorFeedback.Config(beta=1.5)),
            r"outer.exchange.error_feedback.beta must be in",
        ),
        (
            lambda: Exchange.Config(codec=Quantizer.Config(), strategy=AllReduce.Config()),
            "strategy allreduce: allreduce sums payloads as numbers",
        ),
        (
            lambda: Exchange.Config(codec=TopK.Config(), strategy=ReduceScatter.Config()),
            r"strategy reduce_scatter: .* would drop about half .* use --outer.exchange.strategy allgather with topk",
        ),
        (lambda: Exchange.Config(skip_pattern="norm("), "skip_pattern is not a valid regex"),
        (lambda: Exchange.Config(skip_dtype="int8"), "skip_dtype must be one of"),
        (lambda: Exchange.Config(bucket_mb=0.0), "bucket_mb must be a positive number"),
        (lambda: Exchange.Config(kernels="fast"), "kernels must be one of"),
        (lambda: Exchange.Config(codec=Dense.Config(dtype="int8")), r"codec \(dense\): dtype must be one of"),
        (lambda: Exchange.Config(weighting="steps"), "weighting must be one of auto, equal, tokens"),
        (
            lambda: Exchange.Config(codec=Dense.Config(dtype="bfloat16"), weighting="tokens"),
            r"weighting tokens scales each Δ .* lossless .* use --outer.exchange.strategy allgather",
        ),
        (
            lambda: Exchange.Config(skip_pattern="norm", skip_dtype="bfloat16", weighting="tokens"),
            r"weighting tokens .* with dense\(bfloat16\) use --outer.exchange.strategy allgather",
        ),
    ],
)
def test_bad_exchange_settings_are_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make().validate()


def test_bad_setting_stops_the_trainer_before_it_writes_anything(tmp_path):
    from conftest import run_train

    out = tmp_path / "run"
    proc = run_train(["--config", "diloco/muloco_2bit", "--outer.exchange.codec.bits", "3", "--dump_folder", str(out)])
    assert proc.returncode == 2
    assert "outer.exchange.codec (quantize): bits must be one of (1, 2, 4, 8), got 3" in proc.stderr
    assert not out.exists()


def test_residuals_are_saved_per_rank_preallocated_and_reset_on_heal():
    ex = Exchange.Config(codec=Quantizer.Config(bits=2, block_size=64), skip_pattern=r"norm\.weight$").build()
    tensors = [torch.zeros(s) for s in SHAPES]
    ex.allocate(NAMES, tensors)
    state = ex.state_dict()
    assert list(state) == ["rank_0"]
    ((key, residual),) = state["rank_0"]["c"].items()
    assert residual.numel() == sum(t.numel() for n, t in zip(NAMES, tensors) if "norm" not in n)
    assert state["rank_0"]["d"] == {}  # fp32 dense tensors lose nothing: no residual
    residual.fill_(1.0)
    ex.reset()  # healing: zeroed in place, keys kept for the next checkpoint
    assert ex.state_dict()["rank_0"]["c"][key].abs().sum() == 0
    with pytest.raises(ValueError, match="no error-feedback residuals for rank_0"):
        ex.load_state_dict({"rank_1": state["rank_0"]})
    ex.load_state_dict(state)
    assert torch.equal(ex.state_dict()["rank_0"]["c"][key], residual)


@pytest.mark.timeout(60)
def test_a_sync_that_does_not_commit_takes_back_its_error_feedback_update():
    """One real replica (Manager, gloo group, lighthouse), several buckets: compress, then
    roll back as the outer loop does when should_commit() fails; the residual is what it
    was before (kept in Δ's buffer, not in a clone)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    url = lighthouse.address().replace(lighthouse.address().split("//")[1].split(":")[0], "127.0.0.1")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=url,
        replica_id="rollback",
        init_sync=False,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=10),
    )
    try:
        ex = Exchange.Config(codec=Quantizer.Config(bits=2, block_size=64), bucket_mb=256 * 4 / 2**20).build()
        ex.allocate(NAMES, [torch.zeros(s) for s in SHAPES])
        residuals = ex.state_dict()["rank_0"]["c"]

        def fill(t):
            return lambda views: torch._foreach_copy_(views, _deltas(t, 0))

        manager.start_quorum()
        ex.start(manager, NAMES, fill(0), True).wait()
        manager.start_quorum()
        before = {n: t.clone() for n, t in residuals.items()}
        assert all(t.abs().sum() > 0 for t in before.values())  # round 1 left an error to carry
        pending = ex.start(manager, NAMES, fill(1), True)
        pending.wait()
        assert any(not torch.equal(before[n], t) for n, t in residuals.items())
        pending.rollback()
        assert all(torch.equal(before[n], t) for n, t in residuals.items())
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


# ------------------------------------------------------------------ SparseLoCo's tile layout


def test_tile_layout_index_sets_equal_a_per_tile_topk_reference():
    """64×64 tiles on a 128×192 matrix (and a 96×40 one whose tiles are 32×40): after the layout
    permutes Δ into tiles, top-k chunks of 4096 keep, in every tile, exactly the k largest |Δ| of
    that tile (the reference's ``(y h) (x w) -> y x h w`` then top-k per tile); the average comes
    back row by row; pieces of any size give the same bytes."""
    from muloco.outer.exchange.layout import COMPRESSED, FragmentLayout

    names = ["a.weight", "norm.weight", "b.weight"]
    shapes = [torch.Size([128, 192]), torch.Size([192]), torch.Size([96, 40])]
    layout = FragmentLayout(names, shapes, re.compile(r"norm\.weight$"), tile=64)
    assert layout.irregular_tiles(64) == ["b.weight"]
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(s, generator=gen) for s in shapes]
    for max_numel in (1, 4096 * 3, 10**9):  # one tile row at a time, three, everything at once
        buffers = layout.new_buffers(torch.device("cpu"))
        for view, d in zip(layout.views(buffers), deltas):
            view.copy_(d)
        layout.to_tiles(buffers, max_numel)
        a = deltas[0].reshape(2, 64, 3, 64).permute(0, 2, 1, 3).reshape(-1)
        b = deltas[2].reshape(3, 32, 1, 40).permute(0, 2, 1, 3).reshape(-1)
        assert torch.equal(buffers[COMPRESSED], torch.cat([a, b]))
        layout.from_tiles(buffers, max_numel)
        views = layout.views(buffers)
        assert torch.equal(views[0], deltas[0]) and torch.equal(views[2], deltas[2])
    codec = TopK.Config(fraction=64 / 4096, chunk_size=4096, value_dtype="float32").build()
    tiled = deltas[0].reshape(2, 64, 3, 64).permute(0, 2, 1, 3).reshape(6, 4096)
    kept = codec.decode(codec.encode(tiled.reshape(-1)), tiled.numel()).view(6, 4096)
    for tile, got in zip(tiled, kept):
        want = set(tile.abs().topk(64).indices.tolist())
        assert set(got.nonzero().view(-1).tolist()) == want


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: Exchange.Config(codec=Quantizer.Config(), tiles=64), "lays out top-k chunks; the quantize codec"),
        (
            lambda: Exchange.Config(codec=TopK.Config(chunk_size=1024), tiles=64),
            "set --outer.exchange.codec.chunk_size 4096",
        ),
        (lambda: Exchange.Config(codec=TopK.Config(), tiles=-1), "tiles must be >= 0"),
    ],
)
def test_bad_tile_settings_are_one_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make().validate()
