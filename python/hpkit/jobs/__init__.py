"""Jobs from Python: submit a spec, watch it, find its files. The CLI's job commands are a thin shell over this.

    from hpkit.jobs.submission import prepare, submit
    from hpkit.jobs.watch import exit_status, wait_for
    from hpkit.slurm import get_backend

    backend = get_backend()
    job = submit(prepare("job.yaml"), backend)
    status = exit_status(wait_for(backend, [job.job_id]))

- submission: check a spec, write its snapshot and sbatch script (`prepare`), sbatch it (`submit`);
- watch: Slurm's state and the run's progress (`JobWatcher`, `follow`), a log as it grows (`LogFollower`);
- files: where a job's spec, metrics and checkpoints are, from the controller or the submit note (`locate`);
- index: the notes `submit` leaves for jobs the controller has forgotten;
- path: the PATH a job gets, and the programs it must find on it.
- why: why a job ended (`hpkit why`): the rule; why_scan turns log lines into findings, why_gather reads them.
"""
