#!/bin/bash
# A command of the SLURM=24.11 local cluster (munged, slurmctld, slurmd, sbatch, srun, squeue, ...): up.sh copies
# this file to <cluster>/bin/.in-root and links each command's name to it. Run from the host, it enters a private
# mount namespace, binds the host's paths that jobs and clients use into the trixie root at the same paths
# (/work: the checkout and its .venv; /tmp; the home directory, where pyenv keeps Python; the cluster's
# directory), changes root there and runs Slurm 24.11's command in the caller's working directory. Run inside
# the root (a job step, the batch script's srun), it runs the command directly. Nothing is mounted on the host.
set -euo pipefail

name=${0##*/}
root=@ROOT@
binds=(@BINDS@)

in_root() {
  local dir
  for dir in /usr/sbin /usr/bin /sbin /bin; do
    [[ -x $dir/$name ]] && exec "$dir/$name" "$@"
  done
  echo "$name: not in the Slurm 24.11 root" >&2
  exit 127
}

[[ -e /etc/hpkit-slurm-root ]] && in_root "$@"
if [[ -z ${HPKIT_IN_ROOT_NS:-} ]]; then
  # unshare's default propagation is private: the binds below never reach the host's mount table, and
  # vanish with the last process (a daemon, its job steps) of this namespace.
  HPKIT_IN_ROOT_NS=1 exec unshare --mount -- "$0" "$@"
fi
unset HPKIT_IN_ROOT_NS
# The root made a mount point of its own: runc (Slurm's OCI containers) remounts / as a slave and pivots out of
# it, which fails ("mount /, flags: 0x84000: invalid argument") when / is a plain folder of the host's disk.
mount --bind "$root" "$root"
mount --rbind /proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
[[ -e $root/etc/hosts ]] || : >"$root/etc/hosts"
mount --bind /etc/hosts "$root/etc/hosts"
for path in "${binds[@]}"; do
  if [[ $path == / || $path != /* ]]; then
    continue  # a bind over the root's own / would hide Slurm 24.11 behind the host's files
  elif [[ -d $path ]]; then
    mkdir -p "$root$path"
  elif [[ -f $path ]]; then
    mkdir -p "$root${path%/*}"
    [[ -e $root$path ]] || : >"$root$path"
  else
    continue
  fi
  mount --bind "$path" "$root$path"
done
# shellcheck disable=SC2016  # expanded by the shell inside the root
exec chroot "$root" /bin/bash -c 'cd "$1" 2>/dev/null || cd /; shift; exec "$@"' in-root "$PWD" "$0" "$@"
