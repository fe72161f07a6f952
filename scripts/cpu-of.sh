#!/usr/bin/env bash
# cpu-of.sh COMMAND [ARGS...]: run COMMAND and print the CPU seconds it and everything it started used, daemons
# included: the local cluster's slurmctld and slurmds a test brings up, their jobs, torchrun's ranks.
#
# `make test` keeps both cores of the 2-vCPU machine about 90 % busy (sampled from /proc/stat over a whole
# run), so a test's wall time on it says more about its neighbours than about itself, and running a test's launches
# side by side only moves CPU from one xdist worker to another. CPU seconds are what a change to the suite must
# cut; load barely changes them. The command runs in a cgroup of its own (cgroup v1's cpuacct, or cgroup v2), which
# every process it forks stays in, daemonised or not; rusage would miss those. Needs root (a new cgroup).
#
#   scripts/cpu-of.sh .venv/bin/pytest -q -p no:cacheprovider tests/integration/test_moe.py
set -euo pipefail

die() { echo "cpu-of: $*" >&2; exit 2; }
(($# > 0)) || die "usage: cpu-of.sh COMMAND [ARGS...]"
[[ $(id -u) == 0 ]] || die "run as root: it makes a cgroup"

if [[ -d /sys/fs/cgroup/cpuacct ]]; then
  parent=/sys/fs/cgroup/cpuacct procs=tasks
elif [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
  parent=/sys/fs/cgroup procs=cgroup.procs
elif [[ -f /sys/fs/cgroup/unified/cgroup.controllers ]]; then
  parent=/sys/fs/cgroup/unified procs=cgroup.procs
else
  die "no cgroup v1 cpuacct or cgroup v2 hierarchy under /sys/fs/cgroup"
fi

group=$parent/hpkit-cpu-of-$$
mkdir "$group"
used_ns() {
  if [[ -f $group/cpuacct.usage ]]; then
    cat "$group/cpuacct.usage"
  else
    echo $(($(sed -n 's/^usage_usec //p' "$group/cpu.stat") * 1000))
  fi
}
# shellcheck disable=SC2329  # run by the EXIT trap
leave() {
  # Back to the parent, with whatever the command left running (a daemon it started), so the group can go.
  local pid
  while read -r pid; do echo "$pid" >"$parent/$procs" 2>/dev/null || true; done <"$group/$procs"
  rmdir "$group" 2>/dev/null || echo "cpu-of: $group left behind" >&2
}
trap leave EXIT

start=$(date +%s.%N)
status=0
# The command runs in a child shell moved into the group first, so every process it forks starts inside.
bash -c 'echo $$ >"$1/$2"; shift 2; exec "$@"' cpu-of "$group" "$procs" "$@" || status=$?
end=$(date +%s.%N)
awk -v ns="$(used_ns)" -v s="$start" -v e="$end" -v rc="$status" \
  'BEGIN { printf "cpu-of: %.1f CPU s in %.1f s wall (%.2f cores), exit %d\n", ns / 1e9, e - s, ns / 1e9 / (e - s), rc }' >&2
exit "$status"
