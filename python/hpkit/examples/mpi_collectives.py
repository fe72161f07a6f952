"""The SageMaker MPI example (point-to-point, broadcast, gather then broadcast the mean), under Slurm.

Run it with the `mpi` launcher (`srun --mpi=pmix`, one task per rank): mpi4py on Open MPI wires up
through Slurm's PMIx server, as it did under SageMaker's mpirun. Each rank prints one JSON line with
what it received; the exit code says whether every value was the expected one.

Changes from the original: `np.float` is gone from NumPy, and the mean (float64) is broadcast as
MPI.DOUBLE; the original sent it as MPI.FLOAT, which reinterprets half of the bytes.
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD


def point_to_point(rank: int) -> list[int] | None:
    """Rank 0 sends [0, 1, 2] to rank 1 with the buffer (upper-case) API."""
    if rank == 0:
        comm.Send([np.array([0, 1, 2], dtype=np.intc), MPI.INT], dest=1)
        return None
    if rank == 1:
        data = np.empty(3, dtype=np.intc)
        comm.Recv([data, MPI.INT], source=0)
        return data.tolist()
    return None


def broadcast(rank: int) -> list[int]:
    """Rank 0 broadcasts 0..9 to everyone."""
    data = np.arange(10, dtype=np.intc) if rank == 0 else np.empty(10, dtype=np.intc)
    comm.Bcast([data, MPI.INT], root=0)
    return data.tolist()


def gather_mean_broadcast(rank: int, size: int) -> tuple[list[list[int]] | None, list[float]]:
    """Gather each rank's [rank]*10 on rank 0, average there, broadcast the mean back.

    The pattern of averaging weights on one worker and synchronising the others.
    """
    sendbuf = np.zeros(10, dtype=np.intc) + rank
    recvbuf = np.empty([size, 10], dtype=np.intc) if rank == 0 else None
    comm.Gather(sendbuf, recvbuf, root=0)
    avg = np.mean(recvbuf, axis=0, dtype=np.float64) if rank == 0 else np.empty(10, dtype=np.float64)
    comm.Bcast([avg, MPI.DOUBLE], root=0)
    return (recvbuf.tolist() if recvbuf is not None else None), avg.tolist()


def main() -> int:
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        print("mpi_collectives: needs at least 2 ranks for point-to-point", flush=True)
        return 2
    received = point_to_point(rank)
    bcast = broadcast(rank)
    gathered, avg = gather_mean_broadcast(rank, size)
    expected_avg = (size - 1) / 2
    ok = (
        (rank != 1 or received == [0, 1, 2])
        and bcast == list(range(10))
        and (rank != 0 or gathered == [[r] * 10 for r in range(size)])
        and avg == [expected_avg] * 10
    )
    record = {
        "rank": rank,
        "size": size,
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "received": received,
        "bcast": bcast,
        "gathered": gathered,
        "avg": avg,
        "ok": ok,
    }
    print("mpi " + json.dumps(record, sort_keys=True), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
