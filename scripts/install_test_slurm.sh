#!/usr/bin/env bash
# Install the Debian packages for a private single-node SLURM used by the test suite
# (tests/slurm_cluster.py). Only the four packages that are needed: the slurm-wlm
# metapackage would pull ~43 packages (hdf5, rrd, rocm plugins ...).
# No daemon is started here; the tests start their own against a private slurm.conf.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live in sbin, missing from some PATHs

have_all() {
    local b
    for b in slurmctld slurmd sbatch munged; do
        command -v "$b" >/dev/null 2>&1 || return 1
    done
}

if have_all; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_test_slurm.sh: must run as root to apt-get install slurmctld slurmd slurm-client munge" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_test_slurm.sh: apt-get not found; install slurmctld, slurmd, slurm-client and munge by hand" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge

if ! have_all; then
    echo "install_test_slurm.sh: packages installed but slurmctld/slurmd/sbatch/munged still not on PATH" >&2
    exit 1
fi
