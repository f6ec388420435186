"""Free TCP ports for the stores of locally started replica groups.

A port found by binding to port 0 comes from the kernel's ephemeral range, the same
range torchft's manager and healing servers draw from when they start; between
picking the port and the store binding it, another process of the same job can take
it (seen in tests: EADDRINUSE). Ports below the ephemeral range are never handed out
for port 0, so picking there (and checking each is free) avoids that race.
"""

from __future__ import annotations

import random
import socket

_FALLBACK_EPHEMERAL_LOW = 32768
_LOWEST = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, outside the ephemeral range when it allows."""
    high = _ephemeral_low()
    low = _LOWEST if high - _LOWEST > 4 * n + 100 else 1024
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(200 * n):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, rng.randrange(low, high)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # crowded machine: let the kernel pick
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
