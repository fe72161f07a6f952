"""What runs inside the job. The root keeps the entry point (run), the configuration (config), who this process
is (env) and who a run is and where its files go (run_identity); each room does one job: parallel/,
checkpoints/, watchdog/, loop/ (the step and validation) and observe/ (metrics). The model families, with
their adapters, are hpkit.models."""
