"""resilience.keep_survivors inside a rank (hpkit.runtime.stay): which errors are a broken group, and the stop
signals while a rank leaves one."""

from __future__ import annotations

import signal

import pytest
import torch.distributed as dist

from hpkit.runtime.run import _stop_on_signals
from hpkit.runtime.stay import group_broke

GLOO_PEER_GONE = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:23704. "
    "This is typically caused by a remote worker crashing."
)


def test_a_peer_gone_under_gloo_or_a_distributed_error_is_a_broken_group_and_names_its_first_line() -> None:
    assert group_broke(RuntimeError(GLOO_PEER_GONE + "\nmore")) == GLOO_PEER_GONE
    assert group_broke(dist.DistNetworkError("Failed to recv, got 0 bytes")) == "Failed to recv, got 0 bytes"
    # Raised while handling one (a finally's own error during the unwinding): the cause is still seen.
    try:
        try:
            raise RuntimeError(GLOO_PEER_GONE)
        except RuntimeError:
            raise OSError("a flush failed")  # noqa: B904 (the implicit context is what is tested)
    except OSError as exc:
        assert group_broke(exc) == GLOO_PEER_GONE


@pytest.mark.parametrize(
    "error", [ValueError("bad batch"), RuntimeError("CUDA out of memory"), KeyError("x")]
)
def test_any_other_error_is_not_a_broken_group(error: BaseException) -> None:
    assert group_broke(error) is None


@pytest.mark.parametrize(
    "may_stay, broke, left",
    [(True, True, signal.SIG_IGN), (True, False, signal.SIG_DFL), (False, True, signal.SIG_DFL)],
)
def test_a_rank_that_may_stay_ignores_stop_signals_once_its_group_broke(may_stay, broke, left) -> None:
    """The launcher stops its ranks on the same failure (torchrun's agent: SIGTERM within milliseconds): a rank on
    its way to stay must not die of it. Any other error, or a rank that cannot stay, gets the defaults back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)}
    try:
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, signal.SIG_DFL)
        with pytest.raises(RuntimeError), _stop_on_signals(lambda _signum: None, may_stay):
            raise RuntimeError(GLOO_PEER_GONE if broke else "a bug")
        assert signal.getsignal(signal.SIGTERM) == left
        assert signal.getsignal(signal.SIGUSR1) == left
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_a_rank_told_its_step_ended_leaves_before_its_next_step_and_says_why(monkeypatch) -> None:
    """park.STEP_ENDED_SIGNAL set the flag: the loop's check raises before another step is trained, and the run's
    end is a reason to stay, as a broken group is."""
    from hpkit.runtime.stay import leave_if_step_ended, why_leaving
    from hpkit.warm import park

    monkeypatch.setattr(park, "step_ended", False)
    leave_if_step_ended()
    monkeypatch.setattr(park, "step_ended", True)
    with pytest.raises(park.StepEnded) as info:
        leave_if_step_ended()
    assert (
        why_leaving(info.value)
        == "its step ended while its group still worked (the launcher's process is gone)"
    )
    assert why_leaving(RuntimeError(GLOO_PEER_GONE)) == f"its process group broke ({GLOO_PEER_GONE})"
    assert why_leaving(ValueError("bad batch")) is None


@pytest.mark.parametrize(
    "keep, on_gpus, stays",
    [
        (None, False, True),
        (None, True, False),
        (True, True, True),
        (False, False, False),
        (True, False, True),
    ],
)
def test_survivors_stay_where_asked_and_left_out_on_cpus_only(keep, on_gpus, stays) -> None:
    """keep_survivors left out: gloo's ranks stay (a lost peer closes its sockets, which every drill has run);
    NCCL's only when asked, its communicator's abort not yet run on a GPU. The rank and the spec ask this one rule."""
    from hpkit.runtime.config import ResilienceSpec

    assert ResilienceSpec(keep_survivors=keep).survivors_stay(on_gpus=on_gpus) is stays
