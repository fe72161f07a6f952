"""What the rendered job script hands the supervisor: the restart policy (JSON, decided by hpkit.render) and
the run's own facts (Slurm's environment)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpkit.job_events import job_key


@dataclass(frozen=True)
class Plan:
    """The job's restart policy and step shape, as hpkit.render decided them."""

    max_restarts: int
    requeue_on_failure: bool
    spare_nodes: int
    nodes: int  # nodes a step runs on
    step_tasks: int
    tasks_per_node: int
    replace_bad_nodes: bool
    launcher: str
    output_dir: str  # where the log, the events, runs and budget files go (relative: to the job's cwd)
    hangs_dir: str  # where the hang watchdog writes its verdicts (relative: to the job's cwd)
    lost_node_states: str  # a regex over sinfo's short states (%t)
    # Serve the hang watchdog's store on the batch host (launcher srun | mpi, running hpkit train's watchdog).
    watch_store: bool = False
    # The step's ranks announce when their signal handlers are in place (hpkit train: hpkit.supervise.ready): a
    # USR1 is held until then.
    ranks_ready: bool = False
    # How long that hold lasts at most, from the signal's arrival (half the grace: the other half is the save's).
    usr1_hold_s: float = 60.0
    # resilience.warm_start: the zygote's command (hpkit.warm.zygote, shell text), run as a background step on
    # every node of the allocation for its whole length; "" for none.
    warm: str = ""
    # sagemaker_env: SM_HOSTS is each step's nodes, its rendezvous node first (set here, not by the batch shell:
    # spares are in the allocation but not in a step, and a swap changes a step's nodes).
    sagemaker_hosts: bool = False
    # resilience.keep_survivors: ranks whose group broke stay in their processes and do not end their tasks, so
    # the supervisor watches every step for a failing one (not only with spares).
    keep_survivors: bool = False
    # The step's ranks (nodes x ranks per node): with keep_survivors, a step whose every rank has ended or stays is
    # stopped without its grace. 0: unknown.
    ranks: int = 0

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})

    def to_json(self) -> str:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        # Absent unless set: the scripts of jobs without them read as before.
        for name in ("warm", "sagemaker_hosts", "keep_survivors"):
            if not data[name]:
                del data[name]
        return json.dumps(data, sort_keys=True)


@dataclass(frozen=True)
class Run:
    """This run of the job, from Slurm's variables."""

    job_id: str
    restart: int  # SLURM_RESTART_COUNT: how many times Slurm has requeued the job
    nodelist: str  # SLURM_JOB_NODELIST
    batch_host: str  # SLURMD_NODENAME of the batch script
    cwd: Path
    # JOB_TASK for a task of a job array (hpkit.job_events.job_key), else the job id: how the job's files and
    # events name it, and what the supervisor's Slurm commands (requeue, update, squeue -s) must name. A task's
    # own SLURM_JOB_ID can be the array's id, which names every task (scontrol requeue of it requeues them all).
    key: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Run:
        return cls(
            job_id=env.get("SLURM_JOB_ID", "0"),
            restart=int(env.get("SLURM_RESTART_COUNT") or 0),
            nodelist=env.get("SLURM_JOB_NODELIST", ""),
            batch_host=env.get("SLURMD_NODENAME", ""),
            cwd=Path(os.getcwd()),
            key=job_key(env) or env.get("SLURM_JOB_ID", "0"),
        )

    @property
    def name(self) -> str:
        return self.key or self.job_id

    def path(self, relative: str) -> Path:
        return (self.cwd / relative).resolve() if not Path(relative).is_absolute() else Path(relative)
