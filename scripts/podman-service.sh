#!/usr/bin/env bash
# Bring up (or stop) podman's Docker Engine API service with the settings this kind of machine needs
# (see ARCHITECTURE.md): runc (crun fails on hybrid cgroups), cgroupfs, file events, and default
# ulimits lowered to the hard limits because root here lacks CAP_SYS_RESOURCE.
#
#   scripts/podman-service.sh start [DIR]   start a service whose socket, config and state live in DIR
#   scripts/podman-service.sh stop  [DIR]   stop the service started in DIR (only that one)
#   scripts/podman-service.sh env   [DIR]   print the export line for DOCKER_HOST
#
# DIR defaults to $HPKIT_PODMAN_DIR, else /run/hpkit-podman. With HPKIT_PODMAN_OWN_STORAGE=1 images and
# containers are stored under DIR too (tests use this so that they never touch the machine's images);
# otherwise podman's default storage is used, so images built here show up in `podman images`.
set -euo pipefail

usage() {
  echo "usage: $0 start|stop|env [DIR]" >&2
  exit 2
}

[ $# -ge 1 ] || usage
action=$1
dir=${2:-${HPKIT_PODMAN_DIR:-/run/hpkit-podman}}
sock="$dir/podman.sock"
pidfile="$dir/service.pid"
logfile="$dir/service.log"

running() {
  [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

ping_ok() {
  curl -fsS --max-time 2 --unix-socket "$sock" http://d/_ping >/dev/null 2>&1
}

# The hard limit NAME ("Max processes") of process PID, as /proc shows it.
hard_limit() {
  awk -v name="$2" 'index($0, name) == 1 { n = split(substr($0, length(name) + 1), f, " "); print f[2] }' \
    "/proc/$1/limits"
}

# write_config NOFILE NPROC
write_config() {
  local hard_nofile=$1 hard_nproc=$2
  [ "$hard_nofile" = unlimited ] && hard_nofile=1048576
  [ "$hard_nproc" = unlimited ] && hard_nproc=1048576
  mkdir -p "$dir/tmp"
  cat >"$dir/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=${hard_nofile}:${hard_nofile}", "nproc=${hard_nproc}:${hard_nproc}"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$dir/events.log"
tmp_dir = "$dir/tmp"
EOF
  if [ "${HPKIT_PODMAN_OWN_STORAGE:-0}" = 1 ]; then
    mkdir -p "$dir/storage" "$dir/run"
    cat >"$dir/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$dir/storage"
runroot = "$dir/run"
EOF
  fi
}

start() {
  command -v podman >/dev/null || {
    echo "podman is not installed: apt-get install --no-install-recommends podman runc" >&2
    exit 1
  }
  mkdir -p "$dir"
  if running && ping_ok; then
    echo "export DOCKER_HOST=unix://$sock"
    return 0
  fi
  write_config "$(ulimit -Hn)" "$(ulimit -Hu)"
  launch
  # podman lowers its own RLIMIT_NPROC (32768 measured here) and runc cannot raise a container's
  # limit above the service's: take the service's own hard limits and start again with those.
  local nofile nproc
  nofile=$(hard_limit "$(cat "$pidfile")" "Max open files")
  nproc=$(hard_limit "$(cat "$pidfile")" "Max processes")
  if ! grep -q "\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"" "$dir/containers.conf"; then
    stop
    write_config "$nofile" "$nproc"
    launch
  fi
  echo "export DOCKER_HOST=unix://$sock"
}

launch() {
  rm -f "$sock"
  export CONTAINERS_CONF="$dir/containers.conf"
  if [ -f "$dir/storage.conf" ]; then export CONTAINERS_STORAGE_CONF="$dir/storage.conf"; fi
  # setsid: the service must outlive the shell that started it, and a Ctrl-C there must not reach it.
  setsid podman system service --time=0 "unix://$sock" >>"$logfile" 2>&1 </dev/null &
  echo $! >"$pidfile"
  for _ in $(seq 1 100); do
    ping_ok && return 0
    if ! running; then
      echo "podman system service exited; its log ($logfile) ends with:" >&2
      tail -n 5 "$logfile" >&2
      exit 1
    fi
    sleep 0.2
  done
  echo "podman system service did not answer on $sock within 20 s; see $logfile" >&2
  exit 1
}

stop() {
  if ! running; then
    rm -f "$pidfile"
    return 0
  fi
  local pid
  pid=$(cat "$pidfile")
  kill "$pid"
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$pidfile" "$sock"
  # The overlay driver bind-mounts its own folder; with storage under DIR, unmount it so DIR can be removed.
  if [ -f "$dir/storage.conf" ]; then
    awk -v root="$dir/storage/" 'index($5, root) == 1 { print $5 }' /proc/self/mountinfo |
      sort -r | while read -r point; do umount "$point" 2>/dev/null || umount -l "$point" || true; done
  fi
}

case "$action" in
  start) start ;;
  stop) stop ;;
  env) echo "export DOCKER_HOST=unix://$sock" ;;
  *) usage ;;
esac
