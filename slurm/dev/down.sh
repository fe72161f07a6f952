#!/usr/bin/env bash
# Stop the local development cluster: only the daemons whose pid files live in its directory.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${HPKIT_DEV_CLUSTER_DIR:-$(cd "$here/../.." && pwd)/.dev-cluster}
[[ -d $dir/run ]] || { echo "cluster-down: nothing to stop in $dir"; exit 0; }
export SLURM_CONF=$dir/etc/slurm.conf
# A SLURM=24.11 cluster's commands are its wrappers into the Slurm 24.11 root (up.sh).
if [[ -x $dir/bin/.in-root ]]; then export PATH=$dir/bin:$PATH; fi

# Jobs first, so their steps end before the slurmds that watch them.
if [[ -s $dir/run/slurmctld.pid ]] && kill -0 "$(cat "$dir/run/slurmctld.pid")" 2>/dev/null; then
  scancel --full --quiet --state=RUNNING 2>/dev/null || true
  scancel --quiet 2>/dev/null || true
fi

# TERM to every daemon of a kind at once, then wait for them all (KILL after 5 s): 24.11's slurmd takes
# about 2 s to stop, so one after the other would cost 2 s a node.
stop() {
  local pidfile pid pids=()
  for pidfile in "$@"; do
    [[ -s $pidfile ]] || continue
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
  done
  rm -f "$@"
}

stop "$dir"/run/slurmd-*.pid

# A step on a node cut off from the others (test_node_network's cut link) never hears the scancel above: its
# slurmstepd outlives its slurmd, and its tasks with it (a warm-start zygote holds 350 MB). What is left of this
# cluster's steps goes now: each slurmstepd whose SLURM_CONF is this cluster's, and everything under it.
reap_steps() {
  local environ pid children=() tree=()
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurmstepd ]] &&
      grep -qzxF "SLURM_CONF=$SLURM_CONF" "$environ" 2>/dev/null; then
      tree+=("$pid")
    fi
  done
  local i=0
  while ((i < ${#tree[@]})); do
    mapfile -t children < <(pgrep -P "${tree[i]}" || true)
    tree+=("${children[@]}")
    i=$((i + 1))
  done
  if ((${#tree[@]})); then
    kill -9 "${tree[@]}" 2>/dev/null || true
  fi
  return 0
}
reap_steps
stop "$dir/run/slurmctld.pid"
# ACCOUNTING=1: the cluster's slurmdbd, and its database in the machine's MariaDB (mariadb.sh).
stop "$dir/run/slurmdbd.pid"
if [[ -s $dir/etc/accounting-db ]]; then
  "$here/mariadb.sh" drop "$(cat "$dir/etc/accounting-db")" || true
  rm -f "$dir/etc/accounting-db"
fi
stop "$dir/run/munged.pid"
# NET=netns: every namespace, veth and the bridge that up.sh made (net.sh).
if [[ -s $dir/etc/net ]]; then "$here/net.sh" "$dir" teardown; fi
echo "cluster-down: stopped the cluster in $dir"
