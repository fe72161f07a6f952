"""hpkit.runtime.loop.grad_norm: the global gradient norm and the clip that uses it.

The integration layouts (tests/integration/test_training_correctness.py) clip on every step, so there the
clip's factor is always below 1 and its clamp never acts: these tests check the other side, a norm under the
threshold, and the pipeline stages' norms summed in squares over a real 2-rank gloo group.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _gloo import run_ranks
from torch import nn

from hpkit.runtime.loop.grad_norm import clip_grads_, total_grad_norm


def _params(*grads: list[float]) -> list[nn.Parameter]:
    params = []
    for values in grads:
        grad = torch.tensor(values)
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        params.append(param)
    return params


def test_a_norm_under_the_threshold_leaves_the_gradients_as_they_are() -> None:
    params = _params([0.3, 0.4], [0.0])
    norm = total_grad_norm(params)
    assert norm.item() == pytest.approx(0.5)
    clip_grads_(params, max_norm=1.0, total_norm=norm)
    # Not scaled up to the threshold: clipping only ever shrinks.
    assert torch.equal(params[0].grad, torch.tensor([0.3, 0.4]))


def test_a_norm_over_the_threshold_is_scaled_down_to_it_in_the_same_direction() -> None:
    params = _params([3.0, 4.0], [12.0])
    norm = total_grad_norm(params)
    assert norm.item() == pytest.approx(13.0)
    clip_grads_(params, max_norm=1.0, total_norm=norm)
    assert total_grad_norm(params).item() == pytest.approx(1.0, rel=1e-5)
    assert torch.allclose(params[0].grad, torch.tensor([3.0, 4.0]) / 13.0)
    # A parameter without a gradient (frozen, or unused this step) is left out, not an error.
    frozen = nn.Parameter(torch.ones(2))
    assert total_grad_norm([*params, frozen]).item() == pytest.approx(1.0, rel=1e-5)


def test_the_infinity_norm_is_the_largest_element() -> None:
    assert total_grad_norm(_params([3.0, -4.0], [2.0]), norm_type=math.inf).item() == 4.0


def _stages_norm(rank: int, world: int) -> None:
    # Stage 0 holds a gradient of norm 3, stage 1 one of norm 4: the model's norm is 5, not either stage's.
    params = _params([3.0, 0.0] if rank == 0 else [0.0, 4.0])
    group = dist.new_group(list(range(world)))
    assert total_grad_norm(params, pp_group=group).item() == pytest.approx(5.0)
    assert total_grad_norm(params, pp_group=group, norm_type=math.inf).item() == 4.0


def test_pipeline_stages_sum_their_norms_in_squares(tmp_path: Path) -> None:
    run_ranks(_stages_norm, 2, tmp_path)
