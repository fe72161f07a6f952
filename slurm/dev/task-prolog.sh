#!/bin/bash
# TaskProlog of the development cluster (up.sh fills in the cluster directory): slurmstepd adds each
# `export NAME=value` line printed here to the task's environment.
#
# The emulated nodes share one host and one hostname, so Open MPI's shared-memory segments, named
# after the hostname, the job and the local rank, collide between node1's and node2's local rank 0
# and the ranks crash. Each node gets its own directory for them (its TmpFS). Real nodes need none.
# up.sh creates it; made here too: Open MPI cannot create its segment in a folder that is not there (open(2):
# ENOENT), which is how node2's ranks of test_mpi_jobs failed once in CI (why the folder was missing is not known).
shm_dir="@DIR@/tmp/${SLURMD_NODENAME:-unknown}"
mkdir -p "$shm_dir"
echo "export OMPI_MCA_btl_vader_backing_directory=$shm_dir"

# Per-node settings: each NAME=value line of etc/node-env/<node> is exported into that node's tasks,
# e.g. HPKIT_SYSROOT to give one emulated node another view of the system than its peers.
env_file="@DIR@/etc/node-env/${SLURMD_NODENAME:-unknown}"
if [[ -r $env_file ]]; then
  while IFS= read -r line || [[ -n $line ]]; do
    [[ $line =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] && echo "export $line"
  done <"$env_file"
fi
exit 0
