"""The SMP compat layer's pieces in one process: parameters, marks, the partition, the TP plan, StepOutput."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hpkit.compat.smp import set_tensor_parallelism, tensor_parallelism
from hpkit.compat.smp.model import tp_plan
from hpkit.compat.smp.partition import balance, partition, trace
from hpkit.compat.smp.step import StepOutput, split_microbatches
from hpkit.compat.smp.topology import SmpConfig, check_degrees
from hpkit.compat.smp.unsupported import SmpExit


class Net(nn.Module):  # seed 000's model
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), 1)


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.c(self.b(h)) + h  # h skips over b into c's stage


def one_line(exc: pytest.ExceptionInfo) -> str:
    line = exc.value.line
    assert "\n" not in line
    return line


def test_balance_minimises_the_largest_stage_along_module_order():
    # Net: conv1, conv2, fc1, fc2 -> fc1 alone outweighs the rest, so the cut is before it.
    assert balance([320, 18496, 1179776, 1290], 2) == [0, 0, 1, 1]
    assert balance([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1, 1]
    assert balance([1, 2, 3], 3) == [0, 1, 2]


def test_partition_keeps_the_original_names_and_modules():
    model = Net()
    parts = partition(model, 2)
    assert parts.units == ["conv1", "conv2", "fc1", "fc2"]
    first, second = (dict(s.named_parameters()) for s in parts.stages)
    assert sorted(first) == ["conv1.bias", "conv1.weight", "conv2.bias", "conv2.weight"]
    assert sorted(second) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert second["fc1.weight"] is model.fc1.weight  # the same module, not a copy
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(parts.stages[1](parts.stages[0](x)), model(x))


def test_pp_larger_than_the_modules_is_one_line_naming_the_parameter():
    with pytest.raises(SmpExit) as exc:
        partition(Net(), 5)
    assert one_line(exc).startswith("smp: pipeline_parallel_degree=5 is larger than the model's 4 modules")


def test_a_skip_connection_across_stages_is_refused():
    with pytest.raises(SmpExit) as exc:
        partition(Skip(), 3)
    assert "stage 2 needs values that stage 1 does not return" in one_line(exc)


def test_marks_inside_the_context_and_by_module():
    with tensor_parallelism():
        model = Net()
        with tensor_parallelism(False):
            off = nn.Linear(2, 2)
    emb = nn.Embedding(10, 4)
    after = nn.Linear(2, 2)
    marked = {n for n, m in model.named_modules() if getattr(m, "_hpkit_smp_tensor_parallel", False)}
    assert marked == {"fc1", "fc2"}  # Linear only; convolutions have no tensor-parallel form here
    assert not getattr(off, "_hpkit_smp_tensor_parallel", False)
    assert not getattr(after, "_hpkit_smp_tensor_parallel", False)
    set_tensor_parallelism(nn.Sequential(emb), True)
    assert emb._hpkit_smp_tensor_parallel


def test_tp_plan_pairs_a_linear_chain_and_keeps_lone_layers_whole():
    with tensor_parallelism():
        model = Net()
    plan = tp_plan(model, trace(model))
    assert isinstance(plan["fc1"], ColwiseParallel) and isinstance(plan["fc2"], RowwiseParallel)
    lone = Net()
    set_tensor_parallelism(lone.fc1)
    plan = tp_plan(lone, trace(lone))
    assert list(plan) == ["fc1"] and isinstance(plan["fc1"], ColwiseParallel)
    assert plan["fc1"].output_layouts == (Replicate(),)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"fp16": True}, "smp: the SMP parameter fp16=True is not supported"),
        ({"shard_optimizer_state": True}, "fully_shard"),
        ({"active_microbatches": 2}, "Schedule1F1B"),
        ({"optimize": "speed"}, "optimize='speed'"),
        ({"tensor_parallel_degree": 0}, "smp: tensor_parallel_degree=0 must be a positive integer"),
        ({"no_such_thing": 1}, "unknown SMP parameter no_such_thing"),
        ({"partitions": 2, "pipeline_parallel_degree": 4}, "partitions and pipeline_parallel_degree differ"),
    ],
)
def test_parameters_that_cannot_run_stop_with_one_line(params, words):
    with pytest.raises(SmpExit) as exc:
        SmpConfig.from_parameters(params)
    assert words in one_line(exc)


def test_degrees_against_the_world():
    assert check_degrees(SmpConfig.from_parameters({"tensor_parallel_degree": 2, "ddp": True}), 4) == 2
    with pytest.raises(SmpExit) as exc:
        check_degrees(SmpConfig.from_parameters({"pipeline_parallel_degree": 3}), 4)
    assert one_line(exc).startswith("smp: pipeline_parallel_degree: ")
    with pytest.raises(SmpExit) as exc:
        check_degrees(SmpConfig.from_parameters({"tensor_parallel_degree": 2}), 4)
    assert "set ddp: true" in one_line(exc)
    with pytest.raises(SmpExit) as exc:
        check_degrees(SmpConfig.from_parameters({"pipeline_parallel_degree": 2, "microbatches": 1}), 2)
    assert "microbatches=1 must be at least pipeline_parallel_degree=2" in one_line(exc)


def test_only_rank_0_prints_the_line(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SmpExit) as exc:
        SmpConfig.from_parameters({"fp16": True})
    assert exc.value.code == 1 and "fp16" in exc.value.line


def test_microbatches_split_tensors_and_pass_the_rest():
    x, y = torch.arange(8).reshape(8, 1), torch.arange(8)
    pieces = split_microbatches((x, "tag"), {"y": y}, 4)
    assert [a[0].flatten().tolist() for a, _ in pieces] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(a[1] == "tag" for a, _ in pieces)
    assert pieces[3][1]["y"].tolist() == [6, 7]
    with pytest.raises(SmpExit) as exc:
        split_microbatches((torch.zeros(6),), {}, 4)
    assert "microbatches=4 does not divide the batch dimension (6)" in one_line(exc)


def test_step_output_reductions():
    out = StepOutput([torch.tensor(1.0), torch.tensor(3.0)])
    assert out.reduce_mean().item() == 2.0 and out.reduce_sum().item() == 4.0
    assert out.stack().tolist() == [1.0, 3.0]
    rows = StepOutput([torch.zeros(2, 3), torch.ones(1, 3)])
    assert rows.concat().shape == (3, 3)
    nested = StepOutput([(torch.zeros(2), {"k": torch.ones(1)}), (torch.ones(2), {"k": torch.zeros(1)})])
    merged = nested.merge()
    assert merged[0].tolist() == [0, 0, 1, 1] and merged[1]["k"].tolist() == [1, 0]


def test_smp_nn_layers_stop_with_the_torch_native_way(monkeypatch):
    from hpkit.compat import SHIM_DIR

    monkeypatch.syspath_prepend(str(SHIM_DIR))
    before = set(sys.modules)
    try:
        import smdistributed.modelparallel.torch as smp

        with pytest.raises(SmpExit) as exc:
            smp.nn.DistributedTransformerLMHead  # noqa: B018 - the attribute access is what stops
        assert one_line(exc).startswith("smp: smp.nn.DistributedTransformerLMHead is not supported")
        assert smp.DistributedModel is not None and smp.step is not None
    finally:
        # The shim must not outlive this test: later tests ask whether SMDDP is really installed.
        for name in set(sys.modules) - before:
            if name.split(".")[0] == "smdistributed":
                del sys.modules[name]
