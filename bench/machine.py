"""Machine facts the benchmarks print next to their figures (the machine is shared), and the
process handling they share. A library for the scripts in bench/, not a benchmark."""


def loadavg() -> str:
    """The 1/5/15-minute load averages, or n/a where /proc is missing."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def exit_on_sigterm() -> None:
    """SIGTERM (a time limit, e.g. bench/gpu_suite.py's) raises SystemExit in the main thread,
    so the ``finally`` blocks that stop a bench's own children (lighthouse, replica groups)
    run; Python's default would end the process with its children still running."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
