"""The torchft Manager for one replica group, configured from the job config.

torchtitan's ``TorchFTManager`` builds ``torchft.Manager`` with hard-coded timeouts,
an async quorum unless a torchft semi-sync method is chosen, and the unsafe default
healing transport. muloco owns the outer loop, so the quorum is always synchronous
(it is taken at sync points only), ``init_sync`` is off (replicas start from the same
seeded initialisation, so step 0 needs no healing), and every timeout is a config
field. The lighthouse address comes from ``--fault_tolerance.lighthouse`` or
``TORCHFT_LIGHTHOUSE``.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from dataclasses import dataclass
from datetime import timedelta

import torchft
from torchtitan.experiments.torchft.manager import TorchFTManager

from torchtitan.tools.logging import logger

from muloco.compat import healing_transport

REPLICA_ID_PREFIX = "muloco_replica_"


class ReplicaGroupError(RuntimeError):
    """The replica group cannot reach or keep its torchft lighthouse / quorum."""


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
        heartbeat_interval_ms: int = 100
        max_commit_failures: int = 20
        """Consecutive failed commits before the replica gives up (-1 = never)."""
        start_wait_seconds: float = 60.0
        """Before the first step, wait up to this long until all group_size replica groups
        are up (0 = don't): otherwise a group that starts first syncs alone."""

        def lighthouse_url(self) -> str:
            url = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
            if not url:
                raise ReplicaGroupError(
                    "no torchft lighthouse given: start one with ./torchft_lighthouse and pass "
                    "--fault_tolerance.lighthouse http://HOST:PORT (or set TORCHFT_LIGHTHOUSE), "
                    "or use jobs/local/diloco.sh, which starts it for you"
                )
            return url

    def __init__(self, config: Config) -> None:
        self._manager = None
        if not config.enable:
            return
        self.use_async_quorum = False
        self.group_size = config.group_size
        self.replica_id = config.replica_id
        timeout = timedelta(seconds=config.timeout_seconds)
        url = config.lighthouse_url()
        try:
            self._manager = torchft.Manager(
                pg=_process_group(config.process_group, timedelta(milliseconds=config.process_group_timeout_ms)),
                min_replica_size=config.min_replica_size,
                load_state_dict=None,
                state_dict=None,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=config.quorum_timeout_seconds),
                connect_timeout=timedelta(seconds=config.connect_timeout_seconds),
                lighthouse_addr=url,
                replica_id=f"{REPLICA_ID_PREFIX}{config.replica_id}",
                heartbeat_interval=timedelta(milliseconds=config.heartbeat_interval_ms),
                checkpoint_transport=healing_transport.build(timeout),
                init_sync=False,
                max_retries=None if config.max_commit_failures < 0 else config.max_commit_failures,
            )
        except Exception as err:  # the Rust client raises plain RuntimeError/TimeoutError
            raise ReplicaGroupError(
                f"replica {config.replica_id} cannot reach the torchft lighthouse at {url} "
                f"within {config.connect_timeout_seconds:g}s ({str(err).strip().splitlines()[0]}). "
                "Is it running? Start it with ./torchft_lighthouse, check the address and port, "
                "or raise --fault_tolerance.connect_timeout_seconds."
            ) from err


def heartbeating_replicas(lighthouse_url: str, timeout: float = 5.0) -> set[int]:
    """Ids of the replica groups whose managers heartbeat to the lighthouse right now.

    torchft 0.2.0 has no client call for this; its status page lists heartbeats as
    ``<replica_id>:<uuid>: seen <age>s ago``. The page is what torchft's own dashboard
    polls; if its format changes this returns an empty set and callers stop waiting.
    """
    with urllib.request.urlopen(f"{lighthouse_url.rstrip('/')}/status", timeout=timeout) as page:
        text = page.read().decode("utf-8", "replace")
    return {int(m) for m in re.findall(rf"{REPLICA_ID_PREFIX}(\d+):[\w-]+: seen", text)}


def wait_for_replica_groups(lighthouse_url: str, expected: int, timeout: float, poll: float = 0.1) -> int:
    """Block until ``expected`` replica groups heartbeat (or ``timeout``); returns how many did.

    The lighthouse forms a quorum from the groups that are up: without this, a group
    that starts a few seconds before the others syncs alone, and the others then
    heal from it instead of contributing their first round.
    """
    deadline = time.monotonic() + timeout
    seen: set[int] = set()
    last_report = 0.0
    while True:
        try:
            seen = heartbeating_replicas(lighthouse_url)
        except OSError:
            seen = set()
        if len(seen) >= expected or time.monotonic() >= deadline:
            break
        if time.monotonic() - last_report > 10:
            logger.info(f"waiting for replica groups: {len(seen)}/{expected} up")
            last_report = time.monotonic()
        time.sleep(poll)
    if len(seen) < expected:
        logger.warning(
            f"only {len(seen)}/{expected} replica groups up after {timeout:g}s; starting anyway "
            "(the others heal from a peer when they arrive)"
        )
    return len(seen)
