"""Run by test_smp_checkpoint.py under torchrun: SMP checkpoints round-trip on a pipeline x tensor layout."""

from __future__ import annotations

import json
import sys

import smdistributed.modelparallel.torch as smp
import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


@smp.step
def train_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


@smp.step
def eval_step(model, x):
    return model(x)


def main(root: str, layout: str) -> None:
    smp.init(json.loads(layout))
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        net = Mlp()
    torch.manual_seed(0)
    # The same model on this process alone is the reference for every loss; SGD, unlike Adam, changes
    # its steps with the gradients' scale, so a wrong microbatch or replica scaling shows in the losses.
    single = Mlp()
    single_opt = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    x, y = torch.randn(8, 8), torch.randn(8, 4)

    def one_step() -> float:
        opt.zero_grad()
        loss = train_step(model, x, y).reduce_mean().item()
        opt.step()
        return loss

    def single_step() -> float:
        single_opt.zero_grad()
        loss = F.mse_loss(single(x), y)
        loss.backward()
        single_opt.step()
        return loss.item()

    losses = [one_step()]
    expected = [single_step()]
    smp.save_checkpoint(root, "after-1", model=model, optimizer=opt, user_content={"step": 1})
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    loss_2 = one_step()  # moves weights and optimizer state on
    moved = any(not torch.equal(v, model.state_dict()[k]) for k, v in saved_model.items())
    content = smp.resume_from_checkpoint(root)
    back_model, back_opt = model.state_dict(), opt.state_dict()
    same_model = all(torch.equal(saved_model[k], back_model[k]) for k in saved_model)
    same_opt = sorted(saved_opt) == sorted(back_opt) and all(
        torch.equal(v, back_opt[k]) if isinstance(v, torch.Tensor) else v == back_opt[k]
        for k, v in saved_opt.items()
    )
    again = one_step()  # the resumed run repeats step 2 exactly
    losses += [loss_2, one_step()]
    expected += [single_step(), single_step()]
    # smp.save/smp.load: one file per model shard.
    smp.save(model.local_state_dict(), f"{root}/local.pt", partial=True)
    local = smp.load(f"{root}/local.pt", partial=True)
    same_local = all(torch.equal(v, model.local_state_dict()[k]) for k, v in local.items())
    # A forward-only step (no grad): the last stage's outputs reach every rank, and equal one process's
    # forward of the gathered weights.
    model.eval()
    with torch.no_grad():
        out = eval_step(model, x).concat()
    reference = Mlp()
    reference.load_state_dict(model.state_dict())
    record = {
        "eval_matches": bool(torch.allclose(out.cpu(), reference(x), atol=1e-5)),
        "rank": smp.rank(),
        "losses": losses,
        "expected": expected,
        "moved": moved,
        "same_model": same_model,
        "same_opt": same_opt,
        "content": content,
        "repeat": again == loss_2,
        "same_local": same_local,
        "keys": sorted(back_model),
    }
    print(f"smp-ckpt {json.dumps(record)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
