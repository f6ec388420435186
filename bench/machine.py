"""Machine facts the benchmarks print next to their figures (the machine is shared)."""


def loadavg() -> str:
    """The 1/5/15-minute load averages, or n/a where /proc is missing."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"
