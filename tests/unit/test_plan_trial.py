"""`hpkit plan --trial`'s pure parts: which layouts, each trial's spec, reading a metrics file, the verdict on a
failed job, the re-ranking and the table; and its bad input as one line. The jobs themselves:
tests/integration/test_plan_trial_jobs.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hpkit.cli import main as cli
from hpkit.jobs.submission import prepare
from hpkit.metrics.file import read_metrics
from hpkit.metrics.records import EndEvent, StartEvent, StepRecord
from hpkit.plan import trial
from hpkit.plan.recipe import layout_spec
from hpkit.plan.search import SearchResult, search
from hpkit.plan.shapes import shape_of_spec
from hpkit.plan.speed import hardware_for
from hpkit.runtime.config import ModelSpec
from hpkit.slurm import JobInfo, JobState
from hpkit.spec import JobSpec

TINY = {
    "name": "debug",
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 4,
    "ffn_dim": 64,
    "vocab_size": 128,
    "seq_len": 16,
}
HW = replace(hardware_for("p5.48xlarge", "fp32"), gpus_per_node=1)


@pytest.fixture(scope="module")
def result() -> SearchResult:
    shape = shape_of_spec(ModelSpec(**TINY))
    return search(shape, HW, 2, 4, "fp32", "p5.48xlarge", 80)


def base_spec(**over) -> dict:
    spec = {
        "name": "tiny",
        "nodes": 2,
        "tasks_per_node": 1,
        "partition": "train",
        "time_limit": "00:30:00",
        "output_dir": "runs",
        "env": {"NCCL_DEBUG": "WARN"},
        "launcher": "srun",
        "command": ["python", "-m", "hpkit", "train"],
        "parallelism": {"dp_shard": 2},
        "model": TINY,
        "train": {
            "steps": 1000,
            "warmup_steps": 100,
            "lr": 0.01,
            "mixed_precision": "fp32",
            "log_every": 50,
            "metrics_file": "/shared/metrics.jsonl",
            "prometheus": {"port": 9400},
        },
        "checkpoint": {"dir": "ckpt-%j", "interval": 10},
        "resilience": {"max_restarts": 5, "signal_grace_s": 30},
    }
    return spec | over


def test_choose_takes_the_top_k_in_the_searchs_order(result: SearchResult) -> None:
    trials = trial.choose(result, 3, "tiny")
    assert [t.candidate for t in trials] == result.ranked[:3]
    assert [(t.predicted_rank, t.name) for t in trials] == [
        (1, "tiny-trial1"),
        (2, "tiny-trial2"),
        (3, "tiny-trial3"),
    ]
    assert len(trial.choose(result, 100, "tiny")) == len(result.ranked)


def test_a_trial_is_the_written_spec_under_the_base_job_fields(
    result: SearchResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # prepare writes into output_dir, from here
    base = JobSpec.model_validate(base_spec()).document()
    t = trial.choose(result, 2, "tiny")[1]
    job = trial.job_fields(base, HW)
    spec = trial.trial_spec(t, base["model"], HW, 2, job, base["train"], steps=6)
    written = layout_spec(t.name, base["model"], HW, 2, t.candidate.layout, 6)
    # The layout and model are --write's; the job-level fields are the base's.
    assert spec["parallelism"] == written["parallelism"] == t.candidate.layout.parallelism_fields()
    assert spec["model"] == written["model"]
    assert (spec["partition"], spec["time_limit"], spec["output_dir"]) == ("train", "00:30:00", "runs")
    assert (spec["launcher"], spec["command"], spec["env"]) == (
        "srun",
        base["command"],
        {"NCCL_DEBUG": "WARN"},
    )
    assert (spec["name"], spec["nodes"], spec["tasks_per_node"]) == ("tiny-trial2", 2, 1)
    # The base names no instance_type: neither does its trial (the search's --instance is for the prediction).
    assert "instance_type" not in spec and spec["gpus_per_node"] == 0
    train = spec["train"]
    assert train["steps"] == 6 and train["log_every"] == 1 and train["lr"] == 0.01
    assert train["local_batch_size"] == t.candidate.layout.local_batch_size
    # Its own metrics file, no exporter on the base's port, no LR warm-up longer than the trial.
    assert train["metrics_file"] is None and train["prometheus"] is None and "warmup_steps" not in train
    # Never the real run's checkpoints, and a failure is a row, not a requeue.
    assert "checkpoint" not in spec and "eval" not in spec
    assert spec["resilience"]["max_restarts"] == 0 and spec["resilience"]["signal_grace_s"] == 30
    # `hpkit submit`'s own checks take it as written: it renders an sbatch script.
    path = tmp_path / "trial.yaml"
    path.write_text(yaml.safe_dump(spec))
    submission = prepare(path)
    assert submission.spec.run.parallelism.dp_replicate == t.candidate.layout.dp_replicate
    assert submission.script.is_file() and submission.spec.run.checkpoint.dir is None
    assert submission.out_dir == tmp_path / "runs"


def test_without_a_base_the_trial_takes_named_defaults(
    result: SearchResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    t = trial.choose(result, 1, "plan-debug")[0]
    spec = trial.trial_spec(t, dict(TINY), HW, 2, trial.job_fields(None, HW))
    assert spec["time_limit"] == trial.DEFAULT_TIME_LIMIT and spec["output_dir"] == trial.DEFAULT_OUTPUT_DIR
    assert spec["gpus_per_node"] == 1 and spec["instance_type"] == "p5.48xlarge"
    assert spec["train"]["steps"] == trial.TRIAL_STEPS
    path = tmp_path / "trial.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert prepare(path).spec.job.name == "plan-debug-trial1"


def metrics(path: Path, records: list) -> Path:
    lines = [json.dumps(r.to_json(100.0) if not isinstance(r, StepRecord) else r.to_json()) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def step(n: int, tps: float, mem: float = 1.0) -> StepRecord:
    return StepRecord(step=n, loss=1.0, tokens_per_s=tps, memory_gib=mem, memory_kind="max_rss")


def test_measure_is_the_median_after_the_warmup_and_the_peak_of_the_run(tmp_path: Path) -> None:
    # A first run that was requeued: only the last run counts.
    records = [StartEvent(0), step(1, 1e6), StartEvent(0, restart=1)]
    records += [step(1, 10.0, 3.0), step(2, 20.0, 2.0), step(3, 400.0, 2.5), step(4, 300.0), step(5, 500.0)]
    records.append(EndEvent(5, total_steps=5))
    log = read_metrics(metrics(tmp_path / "m.jsonl", records))
    m = trial.measure(log, world=4, warmup=2)
    assert m is not None
    assert (m.tokens_per_s, m.tokens_per_s_per_gpu, m.steps) == (400.0, 100.0, 3)
    assert (m.peak_memory_gib, m.memory_kind) == (3.0, "max_rss")
    short = read_metrics(metrics(tmp_path / "s.jsonl", [StartEvent(0), step(1, 5.0), step(2, 6.0)]))
    assert trial.measure(short, world=4, warmup=2) is None


def info(state: JobState, code: int | None = None) -> JobInfo:
    return JobInfo(job_id="77", name="tiny-trial1", state=state, exit_code=code)


@pytest.mark.parametrize(
    ("job", "tail", "says"),
    [
        (info(JobState.OUT_OF_MEMORY), "", "out of memory (job 77 OUT_OF_MEMORY)"),
        (
            info(JobState.FAILED, 1),
            "torch.OutOfMemoryError: CUDA out of memory.",
            "out of memory (job 77 FAILED)",
        ),
        (info(JobState.TIMEOUT), "", "reached its time limit (job 77)"),
        (info(JobState.FAILED, 3), "Traceback", "failed, exit code 3: `hpkit why 77`"),
        (info(JobState.CANCELLED), "", "cancelled: `hpkit why 77`"),
        (info(JobState.COMPLETED, 0), "", "job 77 completed with 2 step record(s), none after the 2 warm-up"),
    ],
)
def test_a_failed_trial_says_why_in_one_phrase(job: JobInfo, tail: str, says: str) -> None:
    assert says in trial.failure(job, tail, logged_steps=2, warmup=2)


def measured(tps: float) -> trial.Measured:
    return trial.Measured(tps * 2, tps, 1.5, "max_allocated", 6)


def test_rerank_orders_by_measurement_and_the_table_shows_both(result: SearchResult) -> None:
    trials = trial.choose(result, 4, "tiny")
    trials[0].measured, trials[0].job_id = measured(100.0), "11"
    trials[1].problem, trials[1].job_id = "out of memory (job 12 OUT_OF_MEMORY)", "12"
    trials[2].measured, trials[2].job_id = measured(300.0), "13"
    trials[3].problem = "not submitted: spec.yaml: container.image: no such bundle"
    order = trial.rerank(trials)
    assert [t.predicted_rank for t in order] == [3, 1, 2, 4]
    lines = trial.table(order).splitlines()
    assert lines[0].split()[:3] == ["#", "pred", "#"] and "meas tok/s/GPU" in lines[0]
    assert lines[1].split()[:2] == ["1", "3"] and "300" in lines[1] and "1.50 (max_allocated)" in lines[1]
    assert lines[2].split()[:2] == ["2", "1"] and "ok, median of 6 steps" in lines[2]
    assert lines[3].split()[:2] == ["-", "2"] and "out of memory" in lines[3]
    assert lines[4].endswith("not submitted: spec.yaml: container.image: no such bundle")
    assert trials[2].to_json()["measured_tokens_per_s_per_gpu"] == 300.0
    assert trials[1].to_json()["problem"].startswith("out of memory")


def test_a_refused_spec_is_a_row_and_nothing_is_submitted(result: SearchResult, tmp_path: Path) -> None:
    base = base_spec(container={"runtime": "oci", "image": str(tmp_path / "no-bundle")}, launcher="torchrun")
    base = JobSpec.model_validate(base).document()
    trials = trial.choose(result, 2, "tiny")
    job = trial.job_fields(base, HW)
    specs = [trial.trial_spec(t, base["model"], HW, 2, job, base["train"]) for t in trials]
    # No job reaches Slurm, so the backend is never asked (None would raise if it were).
    done = trial.run_trials(trials, specs, tmp_path, None, world=2)  # type: ignore[arg-type]
    assert all(t.job_id is None and t.problem and t.problem.startswith("not submitted: ") for t in done)
    assert "no-bundle" in (done[0].problem or "")


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = cli(["plan", *args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["debug", "--instance", "p5.48xlarge", "--nodes", "2", "--spec-base", "b.yaml"],
            "--spec-base: only with",
        ),
        (
            ["debug", "--instance", "p5.48xlarge", "--nodes", "2", "--trial", "2", "--trial-steps", "2"],
            "--trial-steps 2",
        ),
        (["SPEC", "--trial", "2", "--spec-base", "b.yaml"], "is a job spec already"),
        (["SPEC", "--trial", "2"], "instance_type: missing"),
    ],
)
def test_trial_bad_input_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], says: str
) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(base_spec()))
    rc, err = plan(capsys, *[str(spec) if a == "SPEC" else a for a in args])
    assert rc == 1 and says in err and len(err.strip().splitlines()) == 1, err
