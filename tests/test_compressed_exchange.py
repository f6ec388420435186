"""Compressed exchanges over real torchft Managers in separate processes.

Three replica processes (each its own Manager, TCPStore and gloo group; the lighthouse
runs in this process) exchange seeded pseudo-gradients through both strategies; this
process recomputes what the average must be from the codec alone (encode, decode, mean,
and for reduce-scatter the re-encoding of each range) and checks every replica got
exactly that, bitwise the same on all replicas, with byte counts equal to the wire
format's formula.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from muloco import compat

compat.apply()

from torchft.coordination import LighthouseServer  # noqa: E402

from conftest import run_together  # noqa: E402
from muloco.compress.error_feedback import ErrorFeedback  # noqa: E402
from muloco.outer.compressed_exchange import FLAG_BYTES, ranges, wire_bytes  # noqa: E402
from muloco.outer.exchange import Exchange  # noqa: E402

NAMES = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention_norm.weight", "output.weight"]
SHAPES = [(50, 16), (16, 16), (16,), (50, 16)]
ROUNDS = 3

WORKER = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import torch
    from muloco import compat; compat.apply()
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from muloco.outer.exchange import Exchange

    url, r, k, settings, out, rounds, idle = sys.argv[1:8]
    r, k, rounds = int(r), int(k), int(rounds)
    idle = json.loads(idle)   # [round, replica] pairs that do not contribute
    names, shapes = json.loads(sys.argv[8]), [tuple(s) for s in json.loads(sys.argv[9])]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), load_state_dict=None, state_dict=None,
        min_replica_size=k, use_async_quorum=False, store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=url, replica_id=f"cx_{r}", init_sync=False,
        timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=30))
    exchange = Exchange.Config(**json.loads(settings)).build()
    results = []
    for t in range(rounds):
        manager.start_quorum()
        g = torch.Generator().manual_seed(1000 * t + r)
        deltas = [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(shapes)]
        contributes = [t, r] not in idle
        pending = exchange.start(manager, names, deltas, contributes)
        avg = pending.wait()
        results.append(dict(avg=avg, committed=manager.should_commit(), sent=pending.bytes_sent,
                            received=pending.bytes_received, payload=pending.payload_bytes,
                            contributors=pending.contributors, rank=manager._pg.parent.rank()))
    torch.save(results, out)
    manager.shutdown(wait=False)
    """
)


def _deltas(t: int, r: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * t + r)
    return [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(SHAPES)]


def _run(tmp_path, settings: dict, k: int = 3, idle: list | None = None) -> list[list[dict]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=k, join_timeout_ms=200)
    url = lighthouse.address().replace(lighthouse.address().split("//")[1].split(":")[0], "127.0.0.1")
    commands = [[sys.executable, str(script), url, str(r), str(k), json.dumps(settings), str(tmp_path / f"r{r}.pt"),
                 str(ROUNDS), json.dumps(idle or []), json.dumps(NAMES), json.dumps(SHAPES)] for r in range(k)]
    try:
        results = run_together(commands, [{"RUST_LOG": "warn"}] * k, timeout=150)
    finally:
        lighthouse.shutdown()
    assert all(code == 0 for code, _ in results), "\n".join(out[-3000:] for _, out in results)
    return [torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(k)]


def _streams(deltas, skip: bool):
    comp = torch.cat([d.reshape(-1) for n, d in zip(NAMES, deltas) if not (skip and "norm" in n)])
    dense = torch.cat([d.reshape(-1) for n, d in zip(NAMES, deltas) if skip and "norm" in n] or [torch.zeros(0)])
    return comp, dense


def _join(comp, dense, skip: bool) -> list[torch.Tensor]:
    it_c, it_d = iter(comp.split([torch.Size(s).numel() for n, s in zip(NAMES, SHAPES) if not (skip and "norm" in n)])), None
    if skip:
        it_d = iter(dense.split([torch.Size(s).numel() for n, s in zip(NAMES, SHAPES) if "norm" in n]))
    return [(next(it_d) if skip and "norm" in n else next(it_c)).view(s) for n, s in zip(NAMES, SHAPES)]


def _reference(settings: dict, k: int, idle: list | None = None) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Per round: the average every replica must receive, and each replica's payload size."""
    cfg = Exchange.Config(**settings)
    codec = cfg.make_codec()
    skip = bool(cfg.skip_pattern)
    strategy = cfg.strategy
    feedback = [ErrorFeedback(beta=cfg.ef_beta, enabled=cfg.error_feedback) for _ in range(k)]
    history = []
    for t in range(ROUNDS):
        contributing = [r for r in range(k) if [t, r] not in (idle or [])]
        streams = [_streams(_deltas(t, r), skip) for r in range(k)]
        n = streams[0][0].numel()
        if strategy == "allgather":
            decoded = [codec.decode(feedback[r].compress("c", streams[r][0], codec), n) for r in contributing]
            comp = torch.stack(decoded).mean(0)
        else:
            align = getattr(codec, "block_size", None) or getattr(codec, "chunk_size", None) or 1
            bounds = ranges(n, k, align)

            class Ranged:
                def encode(self, x):
                    return torch.cat([codec.encode(x[a:b]) for a, b in bounds if b > a])

                def decode(self, p, numel):
                    sizes = [codec.payload_bytes(b - a) for a, b in bounds if b > a]
                    kept = [(a, b) for a, b in bounds if b > a]
                    return torch.cat([codec.decode(q, b - a) for q, (a, b) in zip(p.split(sizes, -1), kept)], -1)

            decoded = [Ranged().decode(feedback[r].compress("c", streams[r][0], Ranged()), n) for r in contributing]
            mean = torch.stack(decoded).mean(0)
            comp = Ranged().decode(Ranged().encode(mean), n)   # each owner re-encodes its range
        dense = torch.stack([streams[r][1] for r in contributing]).mean(0)
        history.append(_join(comp, dense, skip))
    return history


CASES = {
    "allgather-2bit": dict(codec="quantize", bits=2, block_size=64, strategy="allgather"),
    "reduce_scatter-2bit": dict(codec="quantize", bits=2, block_size=64, strategy="reduce_scatter"),
    "allgather-topk": dict(codec="topk", topk_fraction=0.25, topk_chunk=64, strategy="allgather"),
    "reduce_scatter-topk-skipnorm": dict(codec="topk", topk_fraction=0.25, topk_chunk=64,
                                         strategy="reduce_scatter", skip_pattern=r"norm\.weight$"),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(CASES))
def test_strategies_average_like_the_reference_on_three_processes(tmp_path, case):
    settings = CASES[case]
    got = _run(tmp_path, settings)
    want = _reference(settings, 3)
    for t in range(ROUNDS):
        for r in range(3):
            res = got[r][t]
            assert res["committed"] and res["contributors"] == 3
            for a, b, name in zip(res["avg"], want[t], NAMES):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{case} round {t} replica {r} {name}")
        for r in (1, 2):  # every replica holds the same average, bitwise
            assert all(torch.equal(a, b) for a, b in zip(got[0][t]["avg"], got[r][t]["avg"]))
    _check_bytes(settings, got)


def _check_bytes(settings: dict, got: list[list[dict]]) -> None:
    cfg = Exchange.Config(**settings)
    codec = cfg.make_codec()
    skip = bool(cfg.skip_pattern)
    comp_n, dense_n = (x.numel() for x in _streams(_deltas(0, 0), skip))
    dense_bytes = dense_n * 4
    k = len(got)
    for r in range(k):
        res = got[r][0]
        formula = wire_bytes(cfg.strategy, k, codec, comp_n, dense_n, rank=res["rank"])
        assert formula == {"payload": res["payload"], "sent": res["sent"], "received": res["received"]}
        if cfg.strategy == "allgather":
            payload = FLAG_BYTES + codec.payload_bytes(comp_n) + dense_bytes
            assert res["payload"] == payload
            assert res["sent"] == res["received"] == (k - 1) * payload
        else:
            align = getattr(codec, "block_size", None) or getattr(codec, "chunk_size", None) or 1
            cs = [codec.payload_bytes(b - a) if b > a else 0 for a, b in ranges(comp_n, k, align)]
            ds = [4 * (b - a) for a, b in ranges(dense_n, k, 1)]
            me = res["rank"]
            pieces = [FLAG_BYTES + c + d for c, d in zip(cs, ds)]
            chunks = [c + d for c, d in zip(cs, ds)]
            assert res["payload"] == sum(pieces)
            assert res["sent"] == sum(p for j, p in enumerate(pieces) if j != me) + (k - 1) * chunks[me]
            assert res["received"] == (k - 1) * pieces[me] + sum(c for j, c in enumerate(chunks) if j != me)


@pytest.mark.timeout(200)
def test_a_replica_that_does_not_contribute_adds_nothing(tmp_path):
    settings = dict(codec="quantize", bits=4, block_size=64, strategy="allgather")
    idle = [[1, 2]]  # round 1: replica 2 has just healed
    got = _run(tmp_path, settings, idle=idle)
    want = _reference(settings, 3, idle=idle)
    assert [got[r][1]["contributors"] for r in range(3)] == [2, 2, 2]
    for r in range(3):
        for a, b in zip(got[r][1]["avg"], want[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(codec="quantize", bits=3), "bits must be one of"),
        (dict(codec="quantize", block_size=-1), "block_size must be > 0"),
        (dict(codec="topk", topk_fraction=0.0), "fraction must be in"),
        (dict(codec="topk", topk_fraction=1.5), "fraction must be in"),
        (dict(codec="quantize", ef_beta=1.5), "ef_beta must be in"),
        (dict(codec="quantize", strategy="ring"), "strategy must be"),
        (dict(codec="quantize", skip_pattern="norm("), "skip_pattern is not a valid regex"),
        (dict(codec="zip"), "codec must be dense, quantize or topk"),
    ],
)
def test_bad_exchange_settings_are_clear_errors(settings, match):
    with pytest.raises(ValueError, match=match):
        Exchange.Config(**settings).validate()


def test_bad_setting_stops_the_trainer_before_it_writes_anything(tmp_path):
    from conftest import run_train

    out = tmp_path / "run"
    proc = run_train(["--config", "diloco/muloco_2bit", "--outer.exchange.bits", "3", "--dump_folder", str(out)])
    assert proc.returncode == 2
    assert "outer.exchange (quantize): bits must be one of (1, 2, 4, 8), got 3" in proc.stderr
    assert not out.exists()


def test_residuals_are_saved_per_rank_preallocated_and_reset_on_heal():
    ex = Exchange.Config(codec="quantize", bits=2, block_size=64, skip_pattern=r"norm\.weight$").build()
    tensors = [torch.zeros(s) for s in SHAPES]
    ex.allocate(NAMES, tensors)
    state = ex.state_dict()
    assert list(state) == ["rank_0"]
    (key, residual), = state["rank_0"]["c"].items()
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
    """One real replica (Manager, gloo group, lighthouse): compress, then roll back as the
    outer loop does when should_commit() fails; the residual is what it was before."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    url = lighthouse.address().replace(lighthouse.address().split("//")[1].split(":")[0], "127.0.0.1")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None, state_dict=None,
                      min_replica_size=1, use_async_quorum=False, store_addr="127.0.0.1", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=url, replica_id="rollback", init_sync=False,
                      timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=10))
    try:
        ex = Exchange.Config(codec="quantize", bits=2, block_size=64).build()
        ex.allocate(NAMES, [torch.zeros(s) for s in SHAPES])
        residuals = ex.state_dict()["rank_0"]["c"]
        manager.start_quorum()
        ex.start(manager, NAMES, _deltas(0, 0), True).wait()
        manager.start_quorum()
        before = {n: t.clone() for n, t in residuals.items()}
        assert all(t.abs().sum() > 0 for t in before.values())  # round 1 left an error to carry
        pending = ex.start(manager, NAMES, _deltas(1, 0), True)
        pending.wait()
        assert any(not torch.equal(before[n], t) for n, t in residuals.items())
        pending.rollback()
        assert all(torch.equal(before[n], t) for n, t in residuals.items())
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()
