#!/usr/bin/env bash
# Installs what tests/test_slurm.py needs to start a one-node Slurm cluster on this machine:
# Debian's Slurm 22.05 controller, node daemon and client commands, and munge (Slurm's
# authentication). Six small packages (about 3 MB); a few seconds when the package lists are
# present, plus an `apt-get update` when they are not. Does nothing when everything is there.
#
#   bash scripts/install_slurm.sh        # as root (Debian 12)
#
# Exit status: 0 installed or already there; 2 cannot install here (not root, no apt-get);
# 1 apt-get failed (its output's end is shown).
#
# The packages' own services are not needed (the test runs its daemons with its own key,
# configuration and directories); without a configuration in /etc/slurm, slurmctld's and
# slurmd's services do not start, and a system munged, where the package starts one, does not
# get in the way: the test's daemons use their own socket.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
COMMANDS=(munged slurmctld slurmd sbatch srun scontrol sinfo scancel)
export PATH="$PATH:/usr/sbin:/sbin"

say() { printf '[install_slurm] %s\n' "$*"; }
# (not `srun --version`: without a slurm.conf it fails looking for a controller)
versions() { dpkg-query -W -f='${Package} ${Version}, ' slurmd munge 2>/dev/null | sed 's/, $//'; }

missing=()
for command in "${COMMANDS[@]}"; do
    command -v "$command" >/dev/null 2>&1 || missing+=("$command")
done
if [ ${#missing[@]} -eq 0 ]; then
    say "already installed: $(versions)"
    exit 0
fi
say "missing: ${missing[*]}"
[ "$(id -u)" = 0 ] || { say "not root: cannot install ${PACKAGES[*]}"; exit 2; }
command -v apt-get >/dev/null 2>&1 || { say "no apt-get: install ${PACKAGES[*]} (Slurm and munge) by other means"; exit 2; }

export DEBIAN_FRONTEND=noninteractive
# Wait for another apt-get or dpkg (up to a minute) rather than fail on its lock; never wait
# forever for a mirror: each apt-get call gets 2 minutes (about 10 s are usual), so the whole
# script ends within 6 minutes, which tests/test_slurm.py relies on.
APT=(timeout 120 apt-get -y -q -o DPkg::Lock::Timeout=60)
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
start=$SECONDS
# Try with the package lists as they are first: an `apt-get update` costs more than the install.
if ! "${APT[@]}" install --no-install-recommends "${PACKAGES[@]}" >"$LOG" 2>&1; then
    say "installing with the current package lists failed; running apt-get update first"
    if ! { "${APT[@]}" update && "${APT[@]}" install --no-install-recommends "${PACKAGES[@]}"; } >"$LOG" 2>&1; then
        tail -n 30 "$LOG" >&2
        say "FAILED: apt-get install ${PACKAGES[*]}"
        exit 1
    fi
fi
say "installed ${PACKAGES[*]} in $((SECONDS - start)) s: $(versions)"
