#!/bin/sh
# Install what the real-Slurm tests need on a Debian/Ubuntu machine: slurmctld, slurmd, the Slurm clients and
# munge (Debian 12: Slurm 22.05, about 10 s). Idempotent and quiet: exits 0 at once when all are present. Nothing
# is started (the tests start their own daemons, by pid, in a throwaway directory). Needs root (apt-get). Used by
# tests/helpers/slurm.py when something is missing; safe to run by hand.
set -eu

have() {
    [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
        && command -v sbatch >/dev/null 2>&1 && command -v mungekey >/dev/null 2>&1
}

if have; then
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "install_slurm_deps.sh: needs root to apt-get install slurmctld slurmd slurm-client munge" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp /tmp/ftkit-install-slurm.XXXXXX)
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge; } \
        >"$log" 2>&1; then
    echo "install_slurm_deps.sh: apt-get failed; last lines of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
fi
rm -f "$log"

if ! have; then
    echo "install_slurm_deps.sh: installed, but slurmctld/slurmd/munged/sbatch still not found" >&2
    exit 1
fi
