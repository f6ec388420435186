"""The torchft Manager for one replica group, configured from the job config.

torchtitan's ``TorchFTManager`` builds ``torchft.Manager`` with hard-coded timeouts,
an async quorum unless a torchft semi-sync method is chosen, and the unsafe default
healing transport. muloco owns the outer loop, so the quorum is always synchronous
(it is taken at sync points only), ``init_sync`` is off (replicas start from the same
seeded initialisation, so step 0 needs no healing), and every timeout is a config
field. The lighthouse address comes from ``--fault_tolerance.lighthouse`` or
``TORCHFT_LIGHTHOUSE``.

A sync commits only in a quorum of at least ``min_replica_size`` replica groups, by
default a majority of ``group_size`` (⌊K/2⌋+1): two majorities always share a group, so
two disjoint sets of replicas can never both commit a step (split brain). Lower values
trade that guarantee for availability and are announced with a warning.
"""

from __future__ import annotations

import math
import os
import time
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta

import torchft
from torchtitan.experiments.torchft.manager import TorchFTManager
from torchtitan.tools.logging import logger

from muloco.compat import healing_transport
from muloco.outer.lighthouse_status import REPLICA_ID_PREFIX, LighthouseUnreachable, check_url, fetch_status, majority
from muloco.utils.errors import OUT_OF_DATE, REPLICA_GROUP, MulocoError
from muloco.utils.interfaces import interface_of, is_ipv4, route_address
from muloco.utils.values import require_at_least_zero, require_positive


class ReplicaGroupError(MulocoError, RuntimeError):
    """The replica group cannot reach or keep its torchft lighthouse / quorum."""

    exit_status = REPLICA_GROUP


class ReplicaOutOfDate(ReplicaGroupError):
    """The replica group ended behind its peers, with nobody left to heal from."""

    exit_status = OUT_OF_DATE


def _process_group(name: str, timeout: timedelta):
    if name == "gloo":
        return torchft.ProcessGroupGloo(timeout=timeout)
    if name == "nccl":
        return torchft.ProcessGroupNCCL(timeout=timeout)
    raise ValueError(f"fault_tolerance.process_group must be gloo or nccl, got {name!r}")


class ReplicaGroupManager(TorchFTManager):
    @dataclass(kw_only=True, slots=True)
    class Config(TorchFTManager.Config):
        enable: bool = True
        lighthouse: str = ""
        """Lighthouse URL (http://host:port); empty = the TORCHFT_LIGHTHOUSE variable."""
        timeout_seconds: float = 60.0
        """Collectives, commit votes and healing transfers fail after this long."""
        quorum_timeout_seconds: float = 300.0
        """Longest wait for a quorum (must exceed the time between syncs)."""
        connect_timeout_seconds: float = 30.0
        """Connecting to the lighthouse and to peers' manager servers."""
        lighthouse_lost_seconds: float = 0.0
        """How long the lighthouse may stay unreachable mid-run before this group gives up
        (0: connect_timeout_seconds). SLURM jobs set 600: their lighthouse is a job of its own
        that may be requeued onto another node, and the groups follow it through a relay
        (muloco.launch.lighthouse_relay); torchft retries its quorum call meanwhile."""
        heartbeat_interval_ms: int = 100
        max_commit_failures: int = 20
        """Consecutive failed commits before the replica gives up (-1 = never)."""
        sync_retries: int = 1
        """Fresh quorums a sync whose exchange failed (a peer died or was cut off inside it, or a
        heal in its quorum failed) is tried in again before it is rolled back: the lighthouse leaves
        the lost group out, so the others commit the round without it (0: roll back at once). Each
        try waits for its quorum like a sync does. Needs outer.fragment_sync_delay 0 (with τ > 0 the
        Δ is gone by then)."""
        start_wait_seconds: float = 60.0
        """Before the first step, wait up to this long until all group_size replica groups
        are up (0 = don't): otherwise a group that starts first syncs alone. A group that
        is behind its peers waits as long for a majority to be up before it heals."""
        end_wait_seconds: float = 120.0
        """After the last step, meet the other groups until all group_size stand at the same
        sync, for up to this long: a group that restarts late, or whose last sync failed,
        heals to the final state before anyone exits."""
        min_replica_size: int = 0
        """Replica groups a quorum needs to commit (0 = a majority of group_size, which rules
        out split brain; lower values allow it and are warned about)."""
        advertise_address: str = ""
        """The IPv4 address the other groups reach this one at: its torchft manager, healing
        server and cross-group store, and the interface its cross-group gloo/NCCL use. Empty:
        torchft's own choice, this host's name (socket.gethostname()); 'route': the address of
        the interface that reaches the lighthouse. Set it where the hostname resolves to another
        interface than the peers reach (several NICs, a network namespace); it must be an
        address of this host."""

        def validate(self) -> None:
            """The replica groups of a DiLoCo run: muloco's outer loop, not torchtitan's, and
            settings a quorum can meet."""
            if not self.enable:
                raise ValueError("fault_tolerance.enable is false; a DiLoCo config needs its replica groups.")
            if self.semi_sync_method is not None:
                raise ValueError(
                    "fault_tolerance.semi_sync_method must stay unset: muloco's outer loop "
                    "(--outer.*) replaces torchtitan's torchft DiLoCo."
                )
            require_positive("fault_tolerance.group_size", self.group_size, "the number of replica groups (>= 1)")
            if not 0 <= self.replica_id < self.group_size:
                raise ValueError(
                    f"fault_tolerance.replica_id is {self.replica_id}; it must be in [0, "
                    f"{self.group_size}) (fault_tolerance.group_size is the number of replica groups)."
                )
            for key in ("timeout_seconds", "quorum_timeout_seconds", "connect_timeout_seconds"):
                require_positive(f"fault_tolerance.{key}", getattr(self, key))
            if self.lighthouse_lost_seconds < 0:
                raise ValueError(
                    f"fault_tolerance.lighthouse_lost_seconds is {self.lighthouse_lost_seconds:g}; it "
                    "must be >= 0 (0 = fault_tolerance.connect_timeout_seconds)."
                )
            if not 0 <= self.min_replica_size <= self.group_size:
                raise ValueError(
                    f"fault_tolerance.min_replica_size is {self.min_replica_size}; it must be in [0, "
                    f"{self.group_size}] (0 = a majority of fault_tolerance.group_size; a larger value "
                    "could never commit)."
                )
            for key in ("start_wait_seconds", "end_wait_seconds"):
                require_at_least_zero(f"fault_tolerance.{key}", getattr(self, key))
            if self.advertise_address not in ("", "route") and not is_ipv4(self.advertise_address):
                raise ValueError(
                    f"fault_tolerance.advertise_address is {self.advertise_address!r}; give an IPv4 "
                    "address of this host, 'route' (the interface that reaches the lighthouse), or "
                    "leave it empty (torchft's choice: the hostname)."
                )
            require_at_least_zero("fault_tolerance.sync_retries", self.sync_retries)
            if self.max_commit_failures < -1:
                raise ValueError(
                    f"fault_tolerance.max_commit_failures is {self.max_commit_failures}; it must be "
                    ">= 0, or -1 for no limit."
                )

        def lighthouse_url(self) -> str:
            url = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
            if not url:
                raise ReplicaGroupError(
                    "no torchft lighthouse given: start one with ./torchft_lighthouse and pass "
                    "--fault_tolerance.lighthouse http://HOST:PORT (or set TORCHFT_LIGHTHOUSE), "
                    "or use jobs/local/diloco.sh, which starts it for you"
                )
            try:
                return check_url(url)
            except ValueError as err:
                raise ReplicaGroupError(f"{err}; fix --fault_tolerance.lighthouse or TORCHFT_LIGHTHOUSE") from None

        def lost_seconds(self) -> float:
            """How long the lighthouse may be unreachable before the group gives up."""
            return self.lighthouse_lost_seconds or self.connect_timeout_seconds

        def quorum_retries(self) -> int:
            """torchft's retries of a failed quorum call, so a lighthouse that is away (or moving)
            is asked again instead of failing the sync; torchft waits quorum_timeout / (retries + 1)
            between tries, and its Python client bounds the whole call by the quorum timeout."""
            return math.ceil(self.lost_seconds() / self.connect_timeout_seconds) - 1

        def quorum_size(self, replicas: int | None = None) -> int:
            """Replica groups needed to commit a sync, of ``replicas`` (default: group_size)."""
            return self.min_replica_size or majority(replicas or self.group_size)

        def join_timeout_ms(self) -> int:
            """The lighthouse's join timeout for these replicas: 90% of their quorum timeout.

            The lighthouse then waits for every heartbeating group that has not joined yet
            (starting, healing, a slow step) almost as long as a replica itself waits, so slightly
            late healthy groups are in the quorum instead of healing afterwards; a dead group stops
            heartbeating and drops out after the heartbeat timeout, so it does not hold the others
            up that long."""
            return int(self.quorum_timeout_seconds * 900)

    def __init__(self, config: Config) -> None:
        self._manager = None
        if not config.enable:
            return
        self.use_async_quorum = False
        self.group_size = config.group_size
        self.replica_id = config.replica_id
        timeout = timedelta(seconds=config.timeout_seconds)
        url = config.lighthouse_url()
        wait_until_reachable(url, config.replica_id, config.connect_timeout_seconds)
        self.quorum_size = config.quorum_size()
        _announce_quorum_rule(self.quorum_size, config.group_size)
        address = advertised_address(config.advertise_address, url, config.replica_id)
        try:
            self._manager = torchft.Manager(
                pg=_process_group(config.process_group, timedelta(milliseconds=config.process_group_timeout_ms)),
                min_replica_size=self.quorum_size,
                load_state_dict=None,
                state_dict=None,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=config.quorum_timeout_seconds),
                quorum_retries=config.quorum_retries(),
                connect_timeout=timedelta(seconds=config.connect_timeout_seconds),
                lighthouse_addr=url,
                replica_id=f"{REPLICA_ID_PREFIX}{config.replica_id}",
                heartbeat_interval=timedelta(milliseconds=config.heartbeat_interval_ms),
                checkpoint_transport=healing_transport.build(timeout, address),
                **({"hostname": address} if address else {}),  # the store: MASTER_ADDR (torchrun's --local-addr)
                init_sync=False,
                max_retries=None,  # the outer loop counts failed syncs and says why they failed
            )
        except (RuntimeError, TimeoutError) as err:  # what the Rust client raises when it cannot connect
            raise ReplicaGroupError(
                f"replica {config.replica_id} cannot reach the torchft lighthouse at {url} "
                f"within {config.connect_timeout_seconds:g}s ({str(err).strip().splitlines()[0]}). "
                "Is it running? Start it with ./torchft_lighthouse, check the address and port, "
                "or raise --fault_tolerance.connect_timeout_seconds."
            ) from err


def advertised_address(setting: str, lighthouse_url: str, replica_id: int) -> str | None:
    """The address this group gives its peers (None: torchft's, the hostname), checked to be one of
    this host's; its interface then carries the cross-group collectives (gloo's and NCCL's
    bootstrap), unless the environment already names one."""
    if not setting:
        return None
    if setting == "route":
        parsed = urllib.parse.urlsplit(lighthouse_url)
        setting = route_address(parsed.hostname or "127.0.0.1", parsed.port or 80)
    interface = interface_of(setting)
    if interface is None:
        raise ReplicaGroupError(
            f"replica {replica_id}: fault_tolerance.advertise_address {setting} is not an "
            "address of this host (no interface holds it); give one of this host's "
            "addresses (ip -4 addr), or 'route' for the one that reaches the lighthouse."
        )
    given = os.environ.get("GLOO_SOCKET_IFNAME")
    if given and given != interface:  # gloo would listen where no peer can reach it
        logger.warning(
            f"replica {replica_id}: GLOO_SOCKET_IFNAME={given} does not hold the advertised address "
            f"{setting}; the cross-group gloo uses {interface}"
        )
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)  # NCCL's own syntax (^docker,lo) is kept as given
    logger.info(f"replica {replica_id}: peers reach this group at {setting} (interface {interface})")
    return setting


def wait_until_reachable(url: str, replica_id: int, connect_timeout: float) -> None:
    """Fail within the connect timeout, saying how, when the lighthouse cannot be reached
    (torchft's own client would report a refused connection as a generic transport error)."""
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            fetch_status(url, timeout=min(5.0, connect_timeout))
            return
        except LighthouseUnreachable as err:
            if time.monotonic() >= deadline:
                raise ReplicaGroupError(
                    f"replica {replica_id}: {err} (tried for {connect_timeout:g}s). Start it with "
                    "./torchft_lighthouse, check --fault_tolerance.lighthouse / TORCHFT_LIGHTHOUSE, "
                    "or raise --fault_tolerance.connect_timeout_seconds."
                ) from None
            time.sleep(0.25)


def _announce_quorum_rule(size: int, group_size: int) -> None:
    if size < majority(group_size):
        logger.warning(
            f"fault_tolerance.min_replica_size={size} is below a majority of {group_size} replica groups "
            f"({majority(group_size)}): two disjoint groups of replicas could both commit the same sync "
            "(split brain) if the lighthouse lets them form separate quorums"
        )
    else:
        logger.info(f"quorum: a sync commits with at least {size} of {group_size} replica groups")
