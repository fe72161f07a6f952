"""hpkit plan's host memory: in-memory checkpoints' copies per rank and per node (checkpoint.memory), against the
node's RAM, and `--explain`."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpkit.cli import main as cli
from hpkit.models.llama.shape import shape_named
from hpkit.plan.host_memory import HOST_RAM_SHARE, host_bytes_per_rank, state_bytes_per_rank
from hpkit.plan.layout import Layout
from hpkit.plan.memory import predict
from hpkit.runtime.config import MemoryCheckpointSpec

SPEC = """\
name: host
nodes: 2
gpus_per_node: 8
instance_type: p5en.48xlarge
command: [hpkit, train]
model: {{name: 70B, seq_len: 4096}}
parallelism: {{tp: 8, pp: 2, microbatches: 2}}
train: {{local_batch_size: 2, activation_checkpoint: full}}
{checkpoint}
"""


def test_a_ranks_host_bytes_are_the_specs_copies_of_its_checkpoint_state() -> None:
    shape = shape_named("8B", 8192)
    layout = Layout(dp_shard=16, local_batch_size=1)
    worst = predict(shape, layout).worst.breakdown
    state = state_bytes_per_rank(shape, layout)
    assert state == worst.params + worst.optimizer  # fp32 shard of the weights and AdamW's moments
    spec = MemoryCheckpointSpec(replicas=1)
    assert host_bytes_per_rank(state, spec) == spec.host_copies * state
    assert host_bytes_per_rank(state, None) == MemoryCheckpointSpec().host_copies * state


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_copies_that_do_not_fit_the_nodes_ram_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 70B over tp 8 x pp 2 without FSDP: 246 GiB of state copies per rank, 8 ranks a node, against 80 % of 2 TiB.
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC.format(checkpoint="checkpoint: {memory: {replicas: 1}}"))
    rc, out, _ = plan(capsys, str(spec))
    verdict = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert rc == 1 and "checkpoint.memory: 5 in-memory copies" in verdict
    assert f"{HOST_RAM_SHARE:.0%} of the node's 2048 GiB" in verdict and "host GiB/rank" in out
    # Without checkpoint.memory the same layout is shown what one copy set would cost, and nothing is refused.
    spec.write_text(SPEC.format(checkpoint=""))
    rc, out, _ = plan(capsys, str(spec))
    assert rc == 0 and "verdict: fits" in out
    assert "no checkpoint.memory; with one (replicas 1: 5 copies" in out and "per node (8 ranks)" in out


def test_explain_names_each_memory_and_time_term_with_its_inputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC.format(checkpoint=""))
    rc, out, _ = plan(capsys, str(spec), "--explain")
    assert rc == 0
    why = out.split("why tp=8")[1]
    for term in ("params", "optimizer", "activations", "logits_loss", "reserve", "fixed", "compute"):
        assert f"  {term} " in why, term
    assert "attention kernel flash" in why and "bytes per token per block (ac full" in why
    assert "max_memory_allocated" in why and "tokens/s per GPU, MFU" in why
