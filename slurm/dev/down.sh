#!/usr/bin/env bash
# Stop the local development cluster: only the daemons whose pid files live in its directory.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${HPKIT_DEV_CLUSTER_DIR:-$(cd "$here/../.." && pwd)/.dev-cluster}
[[ -d $dir/run ]] || { echo "cluster-down: nothing to stop in $dir"; exit 0; }
export SLURM_CONF=$dir/etc/slurm.conf

# Jobs first, so their steps end before the slurmds that watch them.
if [[ -s $dir/run/slurmctld.pid ]] && kill -0 "$(cat "$dir/run/slurmctld.pid")" 2>/dev/null; then
  scancel --full --quiet --state=RUNNING 2>/dev/null || true
  scancel --quiet 2>/dev/null || true
fi

stop() {
  local pidfile=$1 pid
  [[ -s $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$pidfile"
}

for pidfile in "$dir"/run/slurmd-*.pid; do [[ -e $pidfile ]] && stop "$pidfile"; done
stop "$dir/run/slurmctld.pid"
stop "$dir/run/munged.pid"
echo "cluster-down: stopped the cluster in $dir"
