#!/usr/bin/env bash
# Bring up a real Slurm cluster on this one machine: munged, slurmctld and N emulated nodes
# (one `slurmd -N nodeN` each, on its own port). All state lives under one directory.
# Idempotent: daemons already running from this directory are left as they are. etc/oci.conf lets steps
# run in Slurm's OCI containers (srun --container=BUNDLE, run by runc); steps that ask for none do not use it.
#
#   HPKIT_DEV_CLUSTER_DIR  state directory            (default: <repo>/.dev-cluster)
#   NODES                  emulated nodes             (default: 2)
#   CPUS                   CPUs per node              (default: 2)
#   HPKIT_DEV_PORT         slurmctld port; slurmd ports follow it (default: 6817)
#   FIRST_JOB_ID           first job id; a second cluster on the same host should start elsewhere,
#                          since job scripts derive their rendezvous port from the job id (default: 1)
#   SLURMD_TIMEOUT         seconds without a node's answer before slurmctld declares it DOWN
#                          (default: 30; node-loss tests lower it on their own cluster)
#   MESSAGE_TIMEOUT        Slurm's MessageTimeout (default: 20). A client command (squeue, scontrol) keeps trying
#                          a controller that is down for about this long before it fails; a test that stops
#                          the controller lowers it on its own cluster
#   MIN_JOB_AGE            seconds the controller keeps an ended job (default: 600; a test of
#                          forgotten jobs lowers it on its own cluster)
#   BF_INTERVAL            seconds between the backfill scheduler's passes (default: Slurm's own, 30). A requeued
#                          job may start cred_expire (20 s) after its requeue, and it is the next backfill pass that
#                          starts it; node-loss tests lower it on their own cluster
#   CRED_EXPIRE            AuthInfo's cred_expire (default: 20; Slurm's minimum 5): a requeued job may start this long
#                          after its requeue (and slurmd refuses the old run's credentials as long); a test that
#                          requeues a job lowers it on its own cluster
#   MEMORY_KILL            1: memory is scheduled (CR_CPU_Memory, 1 GiB per CPU, the default per
#                          CPU asked for) and enforced: jobacct_gather/linux reads each step's memory
#                          every second and kills a step over its job's --mem (OverMemoryKill), as a
#                          cluster without cgroups does. Default 0: memory is neither (2 GiB nodes)
#   SLURM                  22.05: the host's Debian 12 packages (default). 24.11 (HyperPod's): the daemons and
#                          the client commands run from a Debian trixie root (slurm-root.sh builds and caches it
#                          once per machine) through wrappers in <dir>/bin, first on PATH in <dir>/etc/env
#   HPKIT_SLURM_BINDS      24.11: paths (colon-separated) that jobs use besides the checkout, /tmp, $HOME and <dir>
#   NET                    loopback: every node's NodeAddr is 127.0.0.1 (default; no namespaces needed). netns: each
#                          slurmd (and so its job steps) runs in a network namespace of its own, node i at
#                          10.<port/256>.<port%256>.(i+1) on a bridge at .1 where slurmctld is reached (net.sh; its
#                          fault helpers cut, slow and second-if act on a node's link). down.sh removes them all
#   ACCOUNTING             0: no accounting database (AccountingStorageType=accounting_storage/none; default). 1: this
#                          cluster's own slurmdbd (22.05: the host's; 24.11: the root's) on DBD_PORT (default: the
#                          port after the last node's), keeping its records in database hpkit_acct_<port> of the
#                          machine's MariaDB (mariadb.sh starts it), with cluster hpkit-dev and account hpkit made by
#                          sacctmgr; sacct then answers for jobs the controller has forgotten. down.sh drops the database.
#                          QOS high preempts (cancels, PreemptType=preempt/qos) normal jobs: sbatch --qos=high
#   TOPOLOGY               none: no TopologyPlugin (default). tree | block (block: 24.11 only): TopologyPlugin=topology/...
#                          and a topology.conf naming every node, TOPOLOGY_GROUP (default 2) nodes a leaf switch or a
#                          block, rendered by hpkit (python3 -m hpkit.slurm.topology render), as HyperPod manages one
#
# <dir>/etc/env sets SLURM_CONF (and PATH for 24.11): `. <dir>/etc/env` and sbatch, squeue, hpkit reach this cluster.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${HPKIT_DEV_CLUSTER_DIR:-$(cd "$here/../.." && pwd)/.dev-cluster}
nodes=${NODES:-2}
cpus=${CPUS:-2}
port=${HPKIT_DEV_PORT:-6817}
first_job_id=${FIRST_JOB_ID:-1}
slurmd_timeout=${SLURMD_TIMEOUT:-30}
min_job_age=${MIN_JOB_AGE:-600}
message_timeout=${MESSAGE_TIMEOUT:-20}
bf_interval=${BF_INTERVAL:-30}
cred_expire=${CRED_EXPIRE:-20}
memory_kill=${MEMORY_KILL:-0}
slurm=${SLURM:-22.05}
net=${NET:-loopback}
topo=${TOPOLOGY:-none}
topo_group=${TOPOLOGY_GROUP:-2}
accounting=${ACCOUNTING:-0}
dbd_port=${DBD_PORT:-}  # default below, once NODES and the port are known to be numbers

die() { echo "cluster-up: $*" >&2; exit 1; }
[[ $nodes =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive integer, not '$nodes'"
[[ $cpus =~ ^[1-9][0-9]*$ ]] || die "CPUS must be a positive integer, not '$cpus'"
if ! [[ $port =~ ^[0-9]+$ ]] || ((port < 1024 || port + nodes > 65535)); then
  die "HPKIT_DEV_PORT must be a port in 1024..65535"
fi
[[ $first_job_id =~ ^[1-9][0-9]*$ ]] || die "FIRST_JOB_ID must be a positive integer, not '$first_job_id'"
[[ $slurmd_timeout =~ ^[1-9][0-9]*$ ]] || die "SLURMD_TIMEOUT must be a positive integer, not '$slurmd_timeout'"
[[ $message_timeout =~ ^[1-9][0-9]*$ ]] || die "MESSAGE_TIMEOUT must be a positive integer, not '$message_timeout'"
[[ $min_job_age =~ ^[1-9][0-9]*$ ]] || die "MIN_JOB_AGE must be a positive integer, not '$min_job_age'"
[[ $bf_interval =~ ^[1-9][0-9]*$ ]] || die "BF_INTERVAL must be a positive integer, not '$bf_interval'"
if ! [[ $cred_expire =~ ^[0-9]+$ ]] || ((cred_expire < 5)); then die "CRED_EXPIRE must be an integer of 5 or more (Slurm's minimum), not '$cred_expire'"; fi
[[ $memory_kill =~ ^[01]$ ]] || die "MEMORY_KILL must be 0 or 1, not '$memory_kill'"
[[ $slurm == 22.05 || $slurm == 24.11 ]] || die "SLURM must be 22.05 (the host's packages) or 24.11, not '$slurm'"
[[ $net == loopback || $net == netns ]] || die "NET must be loopback or netns, not '$net'"
[[ $topo == none || $topo == tree || $topo == block ]] || die "TOPOLOGY must be none, tree or block, not '$topo'"
[[ $accounting =~ ^[01]$ ]] || die "ACCOUNTING must be 0 or 1, not '$accounting'"
[[ -n $dbd_port ]] || dbd_port=$((port + nodes + 1))
if ((accounting)) && { ! [[ $dbd_port =~ ^[0-9]+$ ]] || ((dbd_port < 1024 || dbd_port > 65535)); }; then
  die "DBD_PORT must be a port in 1024..65535, not '$dbd_port'"
fi
[[ $topo_group =~ ^[1-9][0-9]*$ ]] || die "TOPOLOGY_GROUP must be a positive integer, not '$topo_group'"
[[ $topo != block || $slurm != 22.05 ]] || die "TOPOLOGY=block needs Slurm 23.11 or later: use SLURM=24.11, or TOPOLOGY=tree"
[[ $(id -u) == 0 ]] || die "run as root: slurmd must be able to start jobs as any user"
# Each job step's slurmstepd listens on a Unix socket <spool>/<node>/<node>_<job>.<step>, at most 107 characters:
# past that it cannot, and every job goes back to PENDING and is requeued for ever. A cluster that runs no job is
# fine (a test of up/down), so this warns rather than refuses.
longest_socket="$dir/spool/node$nodes/node${nodes}_67043328.4294967291"  # MaxJobId's default; the batch step
if ((${#longest_socket} > 107)); then
  echo "cluster-up: warning: the cluster's folder $dir is too deep for Slurm's step sockets (${#longest_socket} characters of 107 in $longest_socket): its jobs may never start; use a folder $((${#longest_socket} - 107)) characters shorter (HPKIT_DEV_CLUSTER_DIR, or a shorter TMPDIR for the tests)" >&2
fi

alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

if alive "$dir/run/slurmctld.pid" && [[ $(cat "$dir/etc/slurm-version" 2>/dev/null || echo 22.05) != "$slurm" ]]; then
  die "the cluster in $dir runs Slurm $(cat "$dir/etc/slurm-version" 2>/dev/null || echo 22.05), not $slurm: stop it first (make cluster-down)"
fi
if alive "$dir/run/slurmctld.pid" && [[ $(cat "$dir/etc/net-layout" 2>/dev/null || echo loopback) != "$net" ]]; then
  die "the cluster in $dir runs with NET=$(cat "$dir/etc/net-layout" 2>/dev/null || echo loopback), not $net: stop it first (make cluster-down)"
fi
if alive "$dir/run/slurmctld.pid" && [[ $(cat "$dir/etc/accounting" 2>/dev/null || echo 0) != "$accounting" ]]; then
  die "the cluster in $dir runs with ACCOUNTING=$(cat "$dir/etc/accounting" 2>/dev/null || echo 0), not $accounting: stop it first (make cluster-down)"
fi
# A port another process already listens on (most often a cluster left running by a test run that was killed: its
# daemons outlive it) made slurmctld or a slurmd exit at once, with "Address already in use" only in its log.
# Checked before anything starts: one line naming the port, who holds it and the fix. (With NET=netns the slurmds
# listen in their own namespaces, so only the controller's port can collide.)
taken() {
  local holder pid
  holder=$(ss -ltnpH "sport = :$1" 2>/dev/null | head -n 1)
  [[ -n $holder ]] || return 0
  pid=$(grep -o 'pid=[0-9]*' <<<"$holder" | head -n 1 | cut -d= -f2)
  die "port $1 ($2) is taken${pid:+ by pid $pid: $(ps -o args= -p "$pid" 2>/dev/null | cut -c1-200)}; stop what holds it (a cluster's folder: slurm/dev/down.sh with HPKIT_DEV_CLUSTER_DIR set to it), or choose another HPKIT_DEV_PORT"
}
if ! alive "$dir/run/slurmctld.pid"; then taken "$port" slurmctld; fi
if [[ $net == loopback ]]; then
  for ((i = 1; i <= nodes; i++)); do
    alive "$dir/run/slurmd-node$i.pid" || taken $((port + i)) "slurmd of node$i"
  done
fi
mkdir -p "$dir"/{etc,state,run,log,munge,spool,tmp}
chmod 0755 "$dir/munge"
conf=$dir/etc/slurm.conf
export SLURM_CONF=$conf

if [[ $slurm == 24.11 ]]; then
  # The wrappers of a running cluster stay: its job steps call them.
  if ! alive "$dir/run/slurmctld.pid" || [[ ! -x $dir/bin/.in-root ]]; then
    command -v unshare >/dev/null || die "unshare not found: install util-linux"
    root=$("$here/slurm-root.sh") || die "the Slurm 24.11 root could not be built (slurm/dev/slurm-root.sh)"
    # Bound into the root at the same paths: the checkout and its venv, /tmp, the home directory (pyenv's
    # Python), this cluster's directory, the base interpreter of the Python on PATH (the venv's), and
    # HPKIT_SLURM_BINDS (colon-separated: where else jobs read or write).
    binds=("$(cd "$here/../.." && pwd)" /tmp "${HOME:-/root}" "$dir")
    IFS=: read -r -a extra <<<"${HPKIT_SLURM_BINDS:-}"
    binds+=("${extra[@]}")
    if base=$(python3 -c 'import sys; print(sys.base_prefix)' 2>/dev/null); then
      if [[ $base == /usr ]]; then  # Debian's own python3.X: its binary (each link to it) and standard library
        mapfile -t -O "${#binds[@]}" binds < <(python3 -c 'import os, sys, sysconfig
path, paths = sys.executable, [sys.executable]
while os.path.islink(path):
    path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    paths.append(path)
print(*[p for p in paths if p.startswith("/usr/")], sysconfig.get_paths()["stdlib"], sep="\n")')
      else
        binds+=("$base")
      fi
    fi
    rm -rf "${dir:?}/bin"
    mkdir -p "$dir/bin"
    sed -e "s|@ROOT@|$root|" -e "s|@BINDS@|${binds[*]}|" "$here/in-root.sh" >"$dir/bin/.in-root"
    chmod 0755 "$dir/bin/.in-root"
    for cmd in munged munge slurmctld slurmd slurmdbd sbatch salloc srun squeue sacct sacctmgr scontrol sinfo scancel sstat; do
      ln -s .in-root "$dir/bin/$cmd"
    done
  fi
  export PATH=$dir/bin:$PATH
  # shellcheck disable=SC2016  # $PATH is the sourcing shell's
  printf 'export SLURM_CONF=%q\nexport PATH=%q:"$PATH"\n' "$conf" "$dir/bin" >"$dir/etc/env"
else
  rm -rf "${dir:?}/bin"
  for cmd in munged slurmctld slurmd scontrol sinfo; do
    command -v "$cmd" >/dev/null || die "$cmd not found: install Debian's slurm-wlm and munge (make system-deps)"
  done
  if ((accounting)); then
    command -v slurmdbd >/dev/null || die "slurmdbd not found: install Debian's slurmdbd (make system-deps ACCOUNTING=1)"
  fi
  printf 'export SLURM_CONF=%q\n' "$conf" >"$dir/etc/env"
fi
echo "$slurm" >"$dir/etc/slurm-version"

ctld_addr=127.0.0.1
if [[ $net == netns ]]; then
  # A cluster that is not running gets its network afresh: an earlier one on this port may have had other nodes,
  # or have been left behind (its namespaces and links are named for the port).
  fresh=fresh
  alive "$dir/run/slurmctld.pid" && fresh=""
  "$here/net.sh" "$dir" setup "$nodes" "$port" $fresh
  ctld_addr=10.$((port / 256)).$((port % 256)).1
fi
echo "$net" >"$dir/etc/net-layout"
alive "$dir/run/slurmctld.pid" || echo "$accounting" >"$dir/etc/accounting"

# A running cluster keeps its config: rewriting it under live daemons would split their view.
if ! alive "$dir/run/slurmctld.pid"; then
  select_params="SelectTypeParameters=CR_CPU"$'\n'
  jobacct="JobAcctGatherType=jobacct_gather/none"$'\n'
  storage="AccountingStorageType=accounting_storage/none"$'\n'
  if ((accounting)); then
    storage="AccountingStorageType=accounting_storage/slurmdbd"$'\n'"AccountingStorageHost=127.0.0.1"$'\n'"AccountingStoragePort=$dbd_port"$'\n'
    # The munge socket for connections to slurmdbd (AuthInfo's is for the controller's only).
    storage+="AccountingStoragePass=$dir/munge/munge.socket.2"$'\n'
    # Preemption as QOS "high" (sacctmgr, below) gives it: a job in QOS high cancels normal jobs in its way
    # (state PREEMPTED). No QOS preempts another unless told, so other jobs never see it.
    storage+="PreemptType=preempt/qos"$'\n'"PreemptMode=CANCEL"$'\n'
  fi
  memory=2048
  if ((memory_kill)); then
    select_params="SelectTypeParameters=CR_CPU_Memory"$'\n'"DefMemPerCPU=1024"$'\n'
    jobacct="JobAcctGatherType=jobacct_gather/linux"$'\n'"JobAcctGatherParams=OverMemoryKill"$'\n'"JobAcctGatherFrequency=task=1"$'\n'
    memory=$((cpus * 1024))
  fi
  node_lines=""
  node_names_new=()
  for ((i = 1; i <= nodes; i++)); do
    mkdir -p "$dir/spool/node$i" "$dir/tmp/node$i"
    addr=127.0.0.1
    # net.sh's layout (node i at .(i+1) of the port's /24), inline: a net.sh run per node costs seconds at 64 nodes.
    [[ $net == loopback ]] || addr=10.$((port / 256)).$((port % 256)).$((i + 1))
    node_names_new+=("node$i")
    node_lines+="NodeName=node$i NodeHostname=$(hostname) NodeAddr=$addr Port=$((port + i)) CPUs=$cpus RealMemory=$memory State=UNKNOWN"$'\n'
  done
  sed -e "s|@DIR@|$dir|g" -e "s|@HOST@|$(hostname)|g" -e "s|@CTLD_PORT@|$port|g" -e "s|@CTLD_ADDR@|$ctld_addr|g" -e "s|@FIRST_JOB_ID@|$first_job_id|g" -e "s|@SLURMD_TIMEOUT@|$slurmd_timeout|g" -e "s|@MIN_JOB_AGE@|$min_job_age|g" -e "s|@MESSAGE_TIMEOUT@|$message_timeout|g" -e "s|@BF_INTERVAL@|$bf_interval|g" -e "s|@CRED_EXPIRE@|$cred_expire|g" "$here/slurm.conf.in" >"$conf.tmp"
  # The node and accounting lines hold newlines, which sed's replacement cannot carry portably.
  awk -v nodes="$node_lines" -v select_params="$select_params" -v jobacct="$jobacct" -v storage="$storage" '{
    if ($0 == "@NODES@") printf "%s", nodes
    else if ($0 == "@SELECT_PARAMS@") printf "%s", select_params
    else if ($0 == "@JOBACCT_GATHER@") printf "%s", jobacct
    else if ($0 == "@ACCOUNTING_STORAGE@") printf "%s", storage
    else print
  }' "$conf.tmp" >"$conf"
  rm -f "$conf.tmp"
  if ((accounting)); then
    # As on clusters that keep accounting (HyperPod's): sacct is the record of ended jobs, no completion log.
    sed -i -e 's|^JobCompType=.*|JobCompType=jobcomp/none|' -e '/^JobCompLoc=/d' "$conf"
  fi
  rm -f "$dir/etc/topology.conf"
  if [[ $topo != none ]]; then
    # As HyperPod's clusters: the plugin, and a topology.conf that names every node (without one, 24.11's
    # slurmctld stops at start; with a node left out, sbatch refuses jobs that need it).
    PYTHONPATH="$here/../../python${PYTHONPATH:+:$PYTHONPATH}" python3 -m hpkit.slurm.topology render --plugin "$topo" \
      --nodes "$(IFS=,; echo "${node_names_new[*]}")" --group-size "$topo_group" >"$dir/etc/topology.conf.tmp" ||
      die "cannot render a topology.conf for TOPOLOGY=$topo TOPOLOGY_GROUP=$topo_group (see above)"
    mv "$dir/etc/topology.conf.tmp" "$dir/etc/topology.conf"
    echo "TopologyPlugin=topology/$topo" >>"$conf"
  fi
  # Slurm's OCI containers (--container=BUNDLE) run by runc: only a step that asks for one uses it.
  sed -e "s|@DIR@|$dir|g" "$here/oci.conf.in" >"$dir/etc/oci.conf"
  if [[ $slurm == 24.11 ]]; then
    # 24.11 binds each task's spool folder into its container, at /var/run/slurm unless told: a folder that a
    # read-only image lacks ("create mount destination ... read-only file system"). /run is in every image.
    echo "MountSpoolDir=/run" >>"$dir/etc/oci.conf"
  fi
  sed -e "s|@DIR@|$dir|g" "$here/task-prolog.sh" >"$dir/etc/task-prolog.sh"
  chmod 0755 "$dir/etc/task-prolog.sh"
fi

if ! alive "$dir/run/munged.pid"; then
  if [[ ! -s $dir/munge/munge.key ]]; then
    (umask 077 && head -c 1024 /dev/urandom >"$dir/munge/munge.key")
  fi
  chmod 0600 "$dir/munge/munge.key"
  munged --force \
    --socket="$dir/munge/munge.socket.2" \
    --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/run/munged.pid" \
    --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge/munged.seed"
fi

if ((accounting)) && ! alive "$dir/run/slurmdbd.pid"; then
  db=hpkit_acct_$port
  # A fresh cluster gets a fresh database; a running one keeps its records.
  if ! alive "$dir/run/slurmctld.pid"; then
    "$here/mariadb.sh" create "$db"
    # The state folder names the cluster id of the database it last ran with: slurmctld refuses a new one.
    rm -f "$dir/state/clustername"
  fi
  echo "$db" >"$dir/etc/accounting-db"
  # slurmdbd reads slurmdbd.conf beside SLURM_CONF's slurm.conf, and refuses one that others may read.
  (umask 077 && cat >"$dir/etc/slurmdbd.conf" <<EOF
# This cluster's slurmdbd (slurm/dev/up.sh, ACCOUNTING=1): its records in database $db of the machine's MariaDB.
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket.2
DbdHost=$(hostname)
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
LogFile=$dir/log/slurmdbd.log
PidFile=$dir/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=${HPKIT_MARIADB_PORT:-13306}
StorageUser=hpkit
StoragePass=hpkit
StorageLoc=$db
EOF
  )
  slurmdbd
  # Ready when it answers sacctmgr (its first start creates the tables: seconds).
  deadline=$((SECONDS + 60))
  until sacctmgr -n -P list cluster >/dev/null 2>&1 || ((SECONDS > deadline)); do sleep 0.5; done
  sacctmgr -n -P list cluster >/dev/null 2>&1 || { tail -n 20 "$dir/log/slurmdbd.log" >&2; die "slurmdbd did not answer in 60 s"; }
  if [[ -z $(sacctmgr -n -P list cluster hpkit-dev format=cluster 2>/dev/null) ]]; then
    sacctmgr -i -Q add cluster hpkit-dev >/dev/null
    sacctmgr -i -Q add qos high Preempt=normal >/dev/null
    sacctmgr -i -Q add account hpkit Cluster=hpkit-dev Description=hpkit Organization=hpkit >/dev/null
    for user in root "$(id -un)" ${SUDO_USER:+"$SUDO_USER"}; do
      sacctmgr -i -Q add user "$user" Account=hpkit DefaultAccount=hpkit Cluster=hpkit-dev QOS=normal,high >/dev/null 2>&1 || true
    done
  fi
fi

if ! alive "$dir/run/slurmctld.pid"; then
  # -i: ignore state from an earlier run whose nodes may have changed.
  slurmctld -i -f "$conf"
fi

mapfile -t node_names < <(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$conf")
for name in "${node_names[@]}"; do
  if ! alive "$dir/run/slurmd-$name.pid"; then
    if [[ $net == netns ]]; then
      "$here/net.sh" "$dir" exec "$name" slurmd -N "$name" -f "$conf"
    else
      slurmd -N "$name" -f "$conf"
    fi
  fi
done

# Ready means every node is idle (or busy with jobs) in the controller's view.
for _ in $(seq 1 60); do
  states=$(sinfo -h -N -o '%N %t' 2>/dev/null || true)
  ready=$(awk '$2 ~ /^(idle|alloc|mix|comp)$/' <<<"$states" | wc -l)
  if ((ready == ${#node_names[@]})); then
    echo "cluster-up: ${#node_names[@]} nodes ready, Slurm $slurm, NET=$net (. $dir/etc/env to use it: SLURM_CONF=$conf)"
    exit 0
  fi
  down=$(awk '$2 ~ /^(down|drain|drng|fail)/ {print $1}' <<<"$states")
  for name in $down; do scontrol update NodeName="$name" State=RESUME 2>/dev/null || true; done
  sleep 0.5
done
echo "cluster-up: nodes not ready after 30 s:" >&2
sinfo -N -l >&2 || true
tail -n 20 "$dir/log/slurmctld.log" >&2 || true
exit 1
