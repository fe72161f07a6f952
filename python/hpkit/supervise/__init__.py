"""The training job's supervisor (`python -m hpkit.supervise`), started by the batch script.

It owns what the job does between steps: the step loop, probes of nodes that do not answer, spare swaps and
HyperPod's node replacement, restarts after a hang, the requeue decision and the one restart budget, and it
writes the job's events file (hpkit.job_events). `plan` is what the rendered script tells it, `cluster` the
one boundary to Slurm (srun itself, the rest through hpkit.slurm.client), `machine` the state machine, `budget` the
budget kept with the job. It never imports torch, except to serve the hang watchdog's store where it can.
"""
