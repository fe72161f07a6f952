"""`hpkit plan`: the search's table and JSON, --write's spec, judging a spec, and bad input as one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.cli import main as cli
from hpkit.render import render
from hpkit.spec import JobSpec
from hpkit.validation import load_document

REPO = Path(__file__).resolve().parents[2]


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_search_ranks_fitting_layouts_by_predicted_speed(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = plan(capsys, "8B", "--instance", "ml.p5.48xlarge", "--nodes", "2", "--json", "--top", "50")
    assert rc == 0
    doc = json.loads(out)
    assert doc["world"] == 16 and doc["global_batch"] == 16 and doc["fit"] > 10
    ranked = doc["ranked"]
    speeds = [c["speed"]["tokens_per_s_per_gpu"] for c in ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(c["fits"] and c["peak_gib"] <= 80 for c in ranked)
    # tp never spans nodes, and what the runtime refuses never ranks.
    assert all(c["parallelism"]["tp"] <= 8 for c in ranked)
    assert doc["rejected"] > 0


def test_table_names_why_the_others_lost_and_what_was_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = plan(capsys, "70B", "--instance", "p4de.24xlarge", "--nodes", "4", "--top", "3")
    assert rc == 0
    assert "tok/s/GPU" in out and "why the others rank lower:" in out and "#2:" in out
    assert "rejected (memory)" in out and "GiB more than the 80 GiB a GPU has" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["8B", "--instance", "p9.48xlarge", "--nodes", "2"], "--instance p9.48xlarge: unknown"),
        (["8B", "--nodes", "2"], "--instance: missing"),
        (["8B", "--instance", "p5.48xlarge", "--nodes", "2", "--global-batch", "17"], "--global-batch 17"),
        (
            ["8B", "--instance", "p5.48xlarge", "--nodes", "2", "--global-tokens", "1000"],
            "--global-tokens 1000",
        ),
        (["9B", "--instance", "p5.48xlarge", "--nodes", "2"], "model '9B'"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    rc, out, err = plan(capsys, *args)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


def test_a_model_that_fits_nowhere_says_by_how_much_for_the_closest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, _, err = plan(capsys, "70B", "--instance", "p4d.24xlarge", "--nodes", "1")
    assert rc == 1 and err.count("\n") == 1
    assert "fits no layout on 1 x p4d.24xlarge: the closest" in err and "GiB more than the 40 GiB" in err


def test_an_unsupported_hugging_face_family_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    rc, _, err = plan(capsys, str(tmp_path), "--instance", "p5.48xlarge", "--nodes", "1")
    assert rc == 1 and err.count("\n") == 1 and "model_type: 'gpt2'" in err


def test_a_mixtral_config_plans_with_expert_parallel(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, out, _ = plan(
        capsys, str(tmp_path), "--instance", "p5.48xlarge", "--nodes", "2", "--json", "--top", "100"
    )
    assert rc == 0
    assert any(c["parallelism"]["ep"] > 1 for c in json.loads(out)["ranked"])


def test_write_gives_a_spec_that_submit_takes_and_plan_judges_as_fitting(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "job.yaml"
    rc, out, _ = plan(
        capsys, "8B", "--instance", "p5.48xlarge", "--nodes", "2", "--top", "4", "--write", str(path)
    )
    assert rc == 0 and f"wrote {path}" in out
    text = path.read_text()
    assert "Runners-up and why they lost:" in text
    assert text.count("#   #") == 3  # the three runners-up, each with its reason
    spec = load_document(JobSpec, path)
    assert spec.job.instance_type == "p5.48xlarge" and spec.job.world_size == 16
    assert "#SBATCH --nodes=2" in render(spec)
    rc, out, _ = plan(capsys, str(path), "--json")
    judged = json.loads(out)
    assert rc == 0 and judged["fits"]
    winner = text.split("Predicted: ")[1].split(" GiB")[0]
    assert judged["peak_gib"] == pytest.approx(float(winner), abs=0.06)


def test_judging_a_spec_names_its_verdict(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    demo = REPO / "slurm/jobs/demo.yaml"
    rc, _, err = plan(capsys, str(demo))
    assert rc == 1 and "instance_type: missing" in err and err.count("\n") == 1
    rc, out, _ = plan(capsys, str(demo), "--instance", "p4d.24xlarge")
    assert rc == 0 and "verdict: fits" in out and "dp_shard=2 tp=2" in out
    big = tmp_path / "big.yaml"
    big.write_text(demo.read_text().replace("name: debug", "name: 70B"))
    rc, out, _ = plan(capsys, str(big), "--instance", "p4d.24xlarge")
    assert rc == 1 and "verdict: does not fit: needs" in out


def test_judging_a_pipeline_whose_local_batch_the_microbatches_do_not_divide_gives_the_runtimes_refusal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The search never builds such a layout (its local batches are multiples of pp and its microbatches are
    # chosen to divide them), so only a spec written by hand reaches this rule: it must not be judged to fit.
    from hpkit.layout_rules.pipeline import microbatch_problem

    demo = (REPO / "slurm/jobs/demo.yaml").read_text()
    piped = demo.replace("  tp: 2\n", "  pp: 2\n  microbatches: 2\n").replace(
        "local_batch_size: 4", "local_batch_size: 3"
    )
    assert piped.count("pp: 2") == 1 and "local_batch_size: 3" in piped
    path = tmp_path / "pp.yaml"
    path.write_text(piped)
    refusal = microbatch_problem(3, 2)
    assert refusal is not None
    rc, out, _ = plan(capsys, str(path), "--instance", "p4d.24xlarge")
    assert rc == 1 and f"verdict: does not fit: {refusal}" in out, out


def test_plan_imports_no_torch() -> None:
    code = (
        "import sys\nfrom hpkit.cli import main\n"
        "assert main(['plan', '70B', '--instance', 'p5.48xlarge', '--nodes', '16', '--json']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "python")},
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_model_block_file_plans_a_shape_with_overrides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    mixtral = REPO / "slurm/recipes/models/mixtral-8x7b.yaml"
    path = tmp_path / "mixtral.yaml"
    rc, _, _ = plan(capsys, str(mixtral), "--instance", "p5.48xlarge", "--nodes", "4", "--write", str(path))
    assert rc == 0
    spec = load_document(JobSpec, path)
    model = spec.run.model
    assert model.vocab_size == 32000 and model.moe is not None and model.moe.experts == 8
    assert model.seq_len == 8192
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: 8B, dim: 3}\n")
    rc, _, err = plan(capsys, str(bad), "--instance", "p5.48xlarge", "--nodes", "4")
    assert rc == 1 and err.count("\n") == 1 and "dim" in err


def test_check_with_torch_refuses_what_the_tracker_cannot_follow_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, _, err = plan(
        capsys, str(REPO / "slurm/jobs/demo.yaml"), "--instance", "p4d.24xlarge", "--check-with-torch"
    )
    assert rc == 1 and err.count("\n") == 1 and "--check-with-torch follows FSDP-only layouts" in err


def test_a_reader_that_goes_away_ends_the_command_quietly_as_sigpipe_would() -> None:
    # `hpkit plan ... | head -3`: stdout's reader closes first. A traceback there is noise; exit 141 is what a
    # shell reports for a program SIGPIPE ended.
    code = (
        "import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from hpkit.cli import main; "
        "sys.exit(main(['plan', '8B', '--instance', 'p5.48xlarge', '--nodes', '2']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 141 and done.stderr == "", done.stderr[-2000:]


@pytest.mark.timeout(60)
def test_a_huge_node_count_is_one_line_not_a_hang(capsys: pytest.CaptureFixture[str]) -> None:
    """--nodes 99999999999999999999 searched a world's divisors for hours (in O(sqrt n): 2.8e10 of them). A count
    past any cluster (hpkit.slurm.options.MAX_NODES, a spec's `nodes` bound too) is refused in one line; up to it,
    the degrees come from the divisors, found as counting them one by one would."""
    from hpkit.plan.search import _divisors
    from hpkit.slurm.options import MAX_NODES

    assert all(_divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 400))
    assert _divisors(8 * MAX_NODES)[:6] == [1, 2, 4, 5, 8, 10]
    for nodes in ("99999999999999999999", str(MAX_NODES + 1)):
        rc, out, err = plan(capsys, "8B", "--nodes", nodes, "--instance", "p5.48xlarge")
        assert rc == 1 and out == "" and err.count("\n") == 1, err
        assert err.strip().endswith(
            f"--nodes: {nodes} is more than any cluster holds: give at most 1,000,000"
        ), err
