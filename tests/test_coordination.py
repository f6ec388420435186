"""Quorums and the lighthouse: status parsing, fail-fast, majority commits, the quorum record.

Real torchft pieces throughout: an in-process lighthouse (``LighthouseServer``), real
``torchft.Manager`` instances (each with its own TCPStore and gloo group) driven from
threads of this process, as torchft tests itself.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from muloco import compat

compat.apply()

from progress import until  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torchft import Manager, ProcessGroupGloo  # noqa: E402
from torchft.coordination import LighthouseClient, LighthouseServer  # noqa: E402

from muloco.compat.quorum_record import RecordingClient, record_quorums  # noqa: E402
from muloco.outer.coordinator import CoordinationError, Coordinator, QuorumView  # noqa: E402
from muloco.outer.lighthouse_status import (  # noqa: E402
    LighthouseUnreachable,
    check_url,
    fetch_status,
    group_of,
    majority,  # noqa: E402
    parse_status,
)


def _lighthouse(min_replicas: int, **kw) -> tuple[LighthouseServer, str]:
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, **kw)
    return lh, "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]


HANG_S = 120
"""Every wait for a peer (quorum, collective, heal) is only a hang timeout."""


def _manager(url: str, group: int, min_size: int, quorum_timeout: float = HANG_S, **kw) -> Manager:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        **kw,
        pg=ProcessGroupGloo(timeout=timedelta(seconds=HANG_S)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_size,
        use_async_quorum=False,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=url,
        replica_id=f"muloco_replica_{group}",
        init_sync=False,
        timeout=timedelta(seconds=HANG_S),
        quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=timedelta(seconds=HANG_S),
    )
    manager.test_store = store  # the group's store must live as long as its manager
    return manager


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------- status page
@pytest.mark.timeout(300)
def test_status_page_shows_alive_groups_last_quorum_steps_and_next_quorum():
    # a heartbeat counts for an hour: nothing here depends on how soon the page is read
    lh, url = _lighthouse(2, join_timeout_ms=3_600_000, heartbeat_timeout_ms=3_600_000)
    try:
        client = LighthouseClient(url, connect_timeout=timedelta(seconds=HANG_S))
        for i in (0, 1, 2):
            client.heartbeat(f"muloco_replica_{i}:uuid-{i}")
        status = fetch_status(url)
        assert status.alive_groups() == {0, 1, 2} and status.members == {} and status.max_step == -1
        assert "need min_replicas 2" in status.next_quorum
        results = {}

        def ask(i, step):
            c = LighthouseClient(url, connect_timeout=timedelta(seconds=HANG_S))
            results[i] = c.quorum(
                replica_id=f"muloco_replica_{i}:uuid-{i}", timeout=timedelta(seconds=HANG_S), step=step
            )

        threads = [threading.Thread(target=ask, args=(i, s)) for i, s in ((0, 3), (1, 5), (2, 5))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
        status = fetch_status(url)
        assert status.members == {
            "muloco_replica_0:uuid-0": 3,
            "muloco_replica_1:uuid-1": 5,
            "muloco_replica_2:uuid-2": 5,
        }
        assert status.max_step == 5 and status.member_groups() == {0, 1, 2}
        # a group that restarts from sync 5 is behind while a member that asked with 5 is alive:
        # that quorum began the sync after its checkpoint (the page learns of a commit only later)
        assert status.alive_members_at(5) == {"muloco_replica_1:uuid-1", "muloco_replica_2:uuid-2"}
        assert status.alive_members_at(3) == {"muloco_replica_0:uuid-0"} and status.alive_members_at(6) == set()
    finally:
        lh.shutdown()


@pytest.mark.timeout(300)
def test_status_page_marks_groups_old_past_the_heartbeat_timeout():
    lh, url = _lighthouse(1, heartbeat_timeout_ms=100)
    try:
        LighthouseClient(url, connect_timeout=timedelta(seconds=HANG_S)).heartbeat("muloco_replica_0:uuid-0")
        until(
            "the page never marked the silent group old",
            lambda: fetch_status(url).heartbeats == {"muloco_replica_0:uuid-0": False},
        )
        assert fetch_status(url).alive_groups() == set()
    finally:
        lh.shutdown()


def test_unknown_page_parses_to_nothing_instead_of_failing():
    status = parse_status("<html>something else</html>")
    assert status.alive_groups() == set() and status.max_step == -1 and status.next_quorum == ""


@pytest.mark.parametrize(
    "rid,group",
    [
        ("muloco_replica_3:ab-cd", 3),
        ("muloco_replica_12", 12),
        ("torchtitan_ft_1:x", None),
        ("muloco_replica_x:1", None),
    ],
)
def test_group_of_replica_ids(rid, group):
    assert group_of(rid) == group


@pytest.mark.parametrize(
    "url", ["127.0.0.1:29510", "http://127.0.0.1", "http://:29510", "ftp://h:1", "http://127.0.0.1:notaport", ""]
)
def test_invalid_lighthouse_urls_are_named(url):
    with pytest.raises(ValueError, match="not a URL like http://HOST:PORT"):
        check_url(url)


@pytest.mark.timeout(120)
def test_refused_and_unresolvable_lighthouses_say_which():
    port = _free_port()
    with pytest.raises(LighthouseUnreachable, match="refused the connection"):
        fetch_status(f"http://127.0.0.1:{port}", timeout=2)
    with pytest.raises(LighthouseUnreachable, match="does not resolve"):
        fetch_status("http://no-such-host.invalid:29510", timeout=2)


@pytest.mark.timeout(300)
def test_start_waits_until_the_replica_groups_heartbeat_and_gives_up_in_time():
    lh, url = _lighthouse(1, heartbeat_timeout_ms=3_600_000)
    try:
        client = LighthouseClient(url, connect_timeout=timedelta(seconds=HANG_S))
        for i in (0, 1):
            client.heartbeat(f"muloco_replica_{i}:uuid-{i}")
        coordinator = Coordinator(SimpleNamespace(_client=None), lighthouse_url=url, group_size=3)
        assert coordinator.wait_for_groups(2, timeout=HANG_S, what="test") == {0, 1}
        started = time.monotonic()
        # group 2 never comes: returning at all (not a hang) is giving up; no sooner than told
        assert coordinator.wait_for_groups(3, timeout=0.5, what="test") == {0, 1}
        assert time.monotonic() - started >= 0.5
    finally:
        lh.shutdown()


# ------------------------------------------------------------------ quorums
def test_majority():
    assert [majority(k) for k in (1, 2, 3, 4, 5, 8)] == [1, 2, 2, 3, 3, 5]


@pytest.mark.timeout(300)
def test_a_minority_quorum_never_commits_even_if_the_lighthouse_forms_it():
    """A lighthouse started with --min_replicas 1 lets one group of three form a quorum alone
    (its peers gone): with a majority min_replica_size its commit vote fails, so it cannot
    commit a step that the other two might commit on their own (split brain)."""
    lh, url = _lighthouse(1, join_timeout_ms=100)
    manager = _manager(url, 0, min_size=majority(3))
    try:
        view = Coordinator(manager, lighthouse_url=url, group_size=3, quorum_size=2, lost_timeout=HANG_S).quorum()
        assert view.size == 1 and view.groups == (0,)
        assert manager.should_commit() is False and manager.current_step() == 0
    finally:
        manager.shutdown(wait=False)
        lh.shutdown()


@pytest.mark.timeout(300)
def test_quorum_view_records_members_steps_and_who_heals():
    lh, url = _lighthouse(2, join_timeout_ms=3_600_000)  # both groups, however late one asks
    managers = [_manager(url, i, min_size=2) for i in range(2)]
    managers[1].load_state_dict({"step": 4, "batches_committed": 8})  # group 1 is ahead
    for m in managers:  # the healing group receives state: register trivial callbacks
        m.register_state_dict_fn("x", lambda sd: None, lambda: {})
    views: dict[int, QuorumView] = {}
    try:

        def join(i):
            views[i] = Coordinator(managers[i], lighthouse_url=url, group_size=2, quorum_size=2).quorum()

        threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * HANG_S)
        assert set(views) == {0, 1}
        for v in views.values():
            assert v.groups == (0, 1) and v.max_step == 4 and v.at_max_step == 1 and not v.settled
        assert views[0].healed_from == 1 and views[1].healed_from is None
        assert managers[0].current_step() == 4
        assert isinstance(managers[0]._client, RecordingClient) and record_quorums(managers[0]) is managers[0]._client
    finally:
        for m in managers:
            m.shutdown(wait=False)
        lh.shutdown()


@pytest.mark.timeout(300)
def test_waiting_quorum_fails_within_the_connect_timeout_when_the_lighthouse_dies():
    """torchft's own call would block for the whole quorum timeout (60 s here: a hang for a
    2 s connect timeout; its own error would name no refused connection). The lighthouse dies
    once it lists this group in the quorum it is forming (the only other group never comes).
    Not longer: torchft's quorum call may go on retrying that long on a thread that the
    interpreter waits for when it exits."""
    lh, url = _lighthouse(2, join_timeout_ms=3_600_000)
    manager = _manager(url, 0, min_size=2, quorum_timeout=60)
    coordinator = Coordinator(manager, lighthouse_url=url, group_size=2, quorum_size=2, lost_timeout=2)

    def kill_once_waiting():
        until(
            "the group never joined the forming quorum",
            lambda: "only have 1 participants" in fetch_status(url).next_quorum,
        )
        lh.shutdown()

    killer = threading.Thread(target=kill_once_waiting, daemon=True)
    try:
        killer.start()
        with pytest.raises(CoordinationError, match="refused the connection .*while waiting for a quorum"):
            coordinator.quorum()
    finally:
        killer.join(HANG_S)
        manager.shutdown(wait=False)


@pytest.mark.timeout(300)
def test_a_heal_that_fails_is_logged_and_recorded_as_failed_naming_the_peer_and_the_cause(caplog):
    """torchft starts a heal from the group ahead and the download fails (the peer went away):
    the group stays where it was, says so with the peer and the cause, records a failed heal
    (not a heal), and its quorum view names nobody it healed from."""
    import torch

    from muloco.compat.healing_transport import SafeHTTPTransport
    from muloco.outer.loop import OuterLoop

    class LostPeer(SafeHTTPTransport):  # the test's fault: the source's state server goes away
        def recv_checkpoint(self, *args, **kwargs):
            raise ConnectionError("the peer's state server closed the connection")

    lh, url = _lighthouse(2, join_timeout_ms=3_600_000)
    behind = _manager(url, 0, min_size=2, checkpoint_transport=LostPeer(timedelta(seconds=HANG_S), num_chunks=0))
    ahead = _manager(url, 1, min_size=2)
    ahead.load_state_dict({"step": 4, "batches_committed": 8})
    for m in (behind, ahead):
        m.register_state_dict_fn("x", lambda sd: None, lambda: {})
    model = torch.nn.Module()
    model.tok_embeddings, model.output = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)  # two layer units
    loop = OuterLoop.Config().build(model=model, manager=behind, device=torch.device("cpu"))
    try:
        peer = threading.Thread(
            target=lambda: Coordinator(ahead, lighthouse_url=url, group_size=2, quorum_size=2).quorum()
        )
        peer.start()
        with caplog.at_level("WARNING"):
            view, step = loop._meet(30, "start")
        peer.join(2 * HANG_S)
        assert view.healed_from is None and step == 30 and behind.errored() is not None
        (heal,) = loop.heals
        assert heal.peer == 1 and heal.failure.startswith("healing from replica 1 failed: ")
        assert "closed the connection" in heal.failure and heal.step_to == 30
        assert "healing from replica 1 failed" in caplog.text and "stays at step 30" in caplog.text
        summary = loop.summary(steps=30)
        assert summary["heals"] == 0 and summary["heals_failed"] == 1 and summary["healed_from"] == []
    finally:
        for m in (behind, ahead):
            m.shutdown(wait=False)
        lh.shutdown()
