"""What runs inside the job. The root keeps the entry point (run), the configuration (config), who this process
is (env), who a run is and where its files go (run_identity), and the tensor-parallel styles that the model
adapters' plans use (tp_styles); each room does one job: adapters/ (model families), parallel/, checkpoints/,
watchdog/, loop/ (the step and validation) and observe/ (metrics)."""
