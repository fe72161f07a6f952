"""The job's recovery state machine: run the step, and when it ends decide what comes next.

After a step ends, first match wins:
1. USR1 came (a time limit or preemption is near): requeue while the budget lasts.
2. With spares: nodes that do not answer, or a hang verdict's culprit nodes, are swapped for spares and the
   step restarts in the allocation; a lost node with no spare left requeues the job.
3. A hang verdict of this attempt: the step restarts in the allocation from the last checkpoint.
4. A failed step without spares: a node slurmctld calls gone (or one that stops answering) is Slurm's to
   requeue or end.
5. Every node answering: a rank SIGKILLed (the OOM killer, an operator, a node's health agent; srun's task line or,
   under torchrun, the rank's agent says so) restarts the step in the allocation on the same nodes; any other
   failure is the program's own, which is not requeued.
Every restart, in the allocation or by a requeue, is paid from one budget (hpkit.supervise.budget).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpkit import job_events as ev
from hpkit.supervise.budget import Budget
from hpkit.supervise.cluster import WARM_STEP_NAME, Cluster, Step, TaskExit, task_on_each_node
from hpkit.supervise.hangs import culprit_nodes, verdict_judge, verdict_path
from hpkit.supervise.plan import Plan, Run
from hpkit.supervise.ready import READY_ENV, all_ready
from hpkit.warm.protocol import ready_node

POLL_S = 0.5
# A step that has started to fail (a failed task, a hang verdict) and still runs this long after is stopped
# (at once where the probe of its nodes, started when it began to fail, names one that does not answer): srun
# would otherwise wait for slurmctld to declare a dead node down (SlurmdTimeout).
STEP_GRACE_S = 3.0
# How long a restarted step waits for the stopped step's rendezvous store to close, where both have the same
# node and port: the store's agent may still be ending (SIGTERM, then its ranks), and a new agent on it cannot
# bind the port while the others would join the old store's rendezvous.
STORE_GONE_S = 30.0
# How long the zygotes' step has to end after SIGTERM when the job's run ends, before it is killed.
WARM_STOP_S = 5.0
# How long the first step waits for its nodes' zygotes to serve. A zygote imports what a cold rank would, once
# per node instead of once per rank and agent, so the wait costs the first step nothing; a zygote that is later
# than this (a stuck file system) leaves its node's first ranks to start cold.
WARM_READY_S = 120.0


@dataclass
class _Restart:
    """The step restarts in the allocation."""


@dataclass
class _End:
    exit: int


class Supervisor:
    def __init__(
        self,
        plan: Plan,
        run: Run,
        cluster: Cluster,
        srun_args: Sequence[str],
        step_command: str,
        env: Mapping[str, str],
        say: Callable[[str], None] = print,
        usr1_flag: Path | None = None,
    ):
        self.plan, self.run_, self.cluster = plan, run, cluster
        self.srun_args, self.step_command, self.env = list(srun_args), step_command, dict(env)
        self._say = say
        self.usr1_flag = usr1_flag
        folder = run.path(plan.output_dir)
        # Named as users name the job (JOB_TASK for an array task): each task of an array has its own.
        self.events_file = ev.events_path(folder, run.name)
        self.runs_file = ev.runs_path(folder, run.name)
        self.budget_file = ev.budget_path(folder, run.name)
        self.hangs_dir = run.path(plan.hangs_dir)
        self.budget = Budget(plan.max_restarts)
        self.attempt = 0
        self.signalled = False
        self._usr1_at = 0.0  # when USR1 came (the cluster's clock): Slurm's kill follows signal_grace_s later
        self.step: Step | None = None
        self._forwarded: Step | None = None
        self._held: Step | None = None
        self.step_nodes: list[str] = []
        self.spares: list[str] = []
        self.logs: Callable[[], dict[str, int]] = dict
        self._probe: Future[list[str]] | None = None
        self.probed: list[str] | None = None
        # The step's task exits before this supervisor stopped it (its own SIGKILL is no rank's fault).
        self.task_exits: list[TaskExit] = []
        self.failed_ranks: list[ev.RankFailed] = []  # and what its torchrun agents said of their ranks
        self._store: tuple[str, str] | None = None  # the last step's rendezvous store: address, port

    # -- what it tells: one line for people, one event for hpkit why ------------------------------------------

    def say(self, text: str) -> None:
        self._say(f"hpkit: {text}")

    def event(self, kind: str, **fields: Any) -> None:
        record = {
            "type": kind,
            "job": self.run_.name,
            "restart": self.run_.restart,
            "attempt": self.attempt,
        }
        try:
            ev.append(self.events_file, {**record, **fields})
        except OSError as exc:
            self.say(f"warning: cannot write the events file {self.events_file}: {exc.strerror or exc}")

    # -- signals --------------------------------------------------------------------------------------------

    def on_usr1(self) -> None:
        """Slurm's warning signal: remember it, and pass it to the step (once per step)."""
        if not self.signalled:
            self.signalled, self._usr1_at = True, self.cluster.monotonic()
            self.say("USR1 received: asking the ranks to checkpoint and stop")
            self.event(ev.USR1)
        self._pass_usr1()

    def _pass_usr1(self) -> None:
        """Pass USR1 to the running step once, and only once its ranks have their handlers: before that, the
        signal's default action would kill them (a step just started, or restarted, is still setting up). Held
        for at most plan.usr1_hold_s after it came: ranks that never say so (a rank stuck setting up, a ready
        folder that cannot be written) must not keep the others from saving before Slurm's kill."""
        step = self.step
        if step is None or self._forwarded is step:
            return
        if self.plan.ranks_ready and not all_ready(self.ready_dir()):
            held_s = self.cluster.monotonic() - self._usr1_at
            if held_s < self.plan.usr1_hold_s:
                if self._held is not step:
                    self._held = step
                    self.say("USR1 held until the step's ranks have installed their signal handlers")
                return
            then = (
                "the job resumes from its last checkpoint"
                if self.budget.can_restart()
                else f"no restart is left (resilience.max_restarts={self.plan.max_restarts})"
            )
            self.say(
                f"USR1 passed on {held_s:.0f} s after it came though not every rank has said its signal handler is "
                f"in place (half of resilience.signal_grace_s is all it waits): a rank still setting up ends, and {then}"
            )
        self._forwarded = step
        step.signal(signal.SIGUSR1)

    def _check_flag(self) -> None:
        if self.usr1_flag is not None and self.usr1_flag.exists():
            self.on_usr1()

    # -- the run --------------------------------------------------------------------------------------------

    def run(self) -> int:
        ended = self.start_run()
        if ended is not None:
            return ended
        warm = self.start_warm()
        if warm is not None:
            self.await_warm(warm)
        try:
            while True:
                self._check_flag()
                status = self.run_step()
                decision = self.after_step(status)
                if isinstance(decision, _End):
                    return decision.exit
                self.attempt += 1
        finally:
            if warm is not None:
                warm.end(WARM_STOP_S)

    def start_warm(self) -> Step | None:
        """resilience.warm_start: a zygote (hpkit.warm.zygote) on every node of the allocation, spares included,
        for the run's length, from which each step's ranks fork (a rank whose node has none starts cold).

        One step over all the nodes, a task on each, with --no-kill: slurmctld then ends only a failed node's task,
        and the survivors' zygotes (their ranks with them) outlive it (checked on 22.05 and 24.11). A step per node
        did the same with as many srun processes on the batch host: thousands, at thousands of nodes."""
        if not self.plan.warm:
            return None
        nodes = [*self.step_nodes, *self.spares]
        self.say(f"warm starts (resilience.warm_start): a zygote on {' '.join(nodes)}")
        return self.cluster.start_step(
            [
                "bash",
                "-c",
                f'exec srun "$@" {self.plan.warm}',
                WARM_STEP_NAME,
                *self.srun_args,
                f"--job-name={WARM_STEP_NAME}",
                *task_on_each_node(nodes),
            ],
            self.env,
            ready_when=ready_node,
        )

    def await_warm(self, step: Step) -> None:
        """The first step's ranks fork too: wait until the zygote of each of its nodes serves (its ready line), up
        to WARM_READY_S. A node whose zygote ended or is late starts its first ranks cold."""
        began = self.cluster.monotonic()
        while True:
            ready = step.ready()
            ended = (
                {t.node for t in step.task_exits()} if step.poll() is None else set(self.step_nodes)
            ) - ready
            waiting = [n for n in self.step_nodes if n not in ready and n not in ended]
            waited = self.cluster.monotonic() - began
            if not waiting or waited >= WARM_READY_S:
                break
            self.cluster.sleep(0.1)
        ended_nodes = [n for n in self.step_nodes if n in ended]
        if not waiting and not ended_nodes:
            self.say(f"warm starts: every zygote serves after {waited:.1f} s: the first step's ranks fork")
        for nodes, why in ((waiting, f"is late after {WARM_READY_S:.0f} s"), (ended_nodes, "ended")):
            if nodes:
                self.say(f"warm starts: the zygote on {' '.join(nodes)} {why}: its first ranks start cold")

    def start_run(self) -> int | None:
        """Place the steps, settle the budget for this run, record it; an exit status if the run must not go on."""
        run, plan = self.run_, self.plan
        nodes = self.cluster.hostnames(run.nodelist) or [run.batch_host]
        if plan.spare_nodes:
            # The batch host is the first spare: losing a training node never takes this supervisor with it.
            ordered = [n for n in nodes if n != run.batch_host] + [n for n in nodes if n == run.batch_host]
            self.step_nodes, self.spares = ordered[: plan.nodes], ordered[plan.nodes :]
        else:
            self.step_nodes = nodes
        # A first run starts a fresh budget: a file left by an earlier job with the same id (a cluster whose
        # job ids started over) is not this job's.
        self.budget = (
            Budget.load(self.budget_file, plan.max_restarts) if run.restart else Budget(plan.max_restarts)
        )
        requeued_by, lost = self._previous_run()
        for restart in range(1, run.restart + 1):
            self.budget.count_run(restart)  # a requeue hpkit did not count (Slurm's) counts now
        self._save_budget()
        self.say(
            f"job {run.name} (restart {run.restart} of at most {plan.max_restarts}) on {run.nodelist}; "
            f"{self.budget.left} restart(s) left"
        )
        if plan.spare_nodes:
            self.say(
                f"steps run on {' '.join(self.step_nodes)}; spare node(s): {' '.join(self.spares) or 'none'}"
            )
        self.event(
            ev.RUN_STARTED,
            nodes=run.nodelist,
            batch_host=run.batch_host,
            step_nodes=self.step_nodes,
            spares=self.spares,
            max_restarts=plan.max_restarts,
            budget_left=self.budget.left,
            launcher=plan.launcher,
            hangs_dir=str(self.hangs_dir),
            logs=self.logs(),
            requeued_by=requeued_by,
            lost_nodes=lost,
        )
        if self.budget.used > plan.max_restarts:
            self.say(
                f"the restart budget (resilience.max_restarts={plan.max_restarts}) is spent: not resuming"
            )
            self.event(ev.END, outcome=ev.BUDGET_SPENT, exit=1, **self._budget_fields())
            return 1
        if (plan.requeue_on_failure and not self.budget.can_restart()) or (
            not plan.requeue_on_failure and run.restart >= 1
        ):
            # A node failure must now end the job, not requeue it: the budget is spent, or only hpkit's own
            # USR1 requeue was meant (resilience.requeue_on_failure is off).
            self.requeue_off()
        with contextlib.suppress(OSError):
            self.runs_file.write_text(f"nodes {run.nodelist}\n", encoding="utf-8")
        return None

    def _previous_run(self) -> tuple[str | None, list[str]]:
        """Who requeued this run ("hpkit", "slurm" or None for a first run) and the previous run's lost nodes."""
        restart = self.run_.restart
        if restart <= 0:
            return None, []
        try:
            lines = self.runs_file.read_text(encoding="utf-8").splitlines()
        except OSError:
            lines = []
        if f"requeued-by-hpkit {restart}" in lines:
            self.say(
                f"restart {restart}: hpkit requeued the job itself after USR1 (time limit or preemption)"
            )
            return "hpkit", []
        previous = next((line.split(" ", 1)[1] for line in lines if line.startswith("nodes ")), "")
        lost = self.cluster.lost_nodes(previous, self.plan.lost_node_states) if previous else []
        if lost:
            self.say(
                f"restart {restart}: Slurm requeued the job after a node failure: node(s) {','.join(lost)} "
                f"of the previous run ({previous}) are down"
            )
        else:
            self.say(
                f"restart {restart}: Slurm requeued the job (node failure, preemption or administrator); the "
                f"previous run's nodes ({previous or 'unknown'}) are up now"
            )
        return "slurm", lost

    def requeue_off(self) -> None:
        ok = self.cluster.set_requeue(self.run_.name, False)
        if not ok:
            self.say(f"warning: could not turn Slurm's requeue off for job {self.run_.name}")
        self.event(ev.REQUEUE_OFF, ok=ok)

    def _save_budget(self) -> None:
        try:
            self.budget.save(self.budget_file)
        except OSError as exc:
            self.say(f"warning: cannot keep the restart budget in {self.budget_file}: {exc.strerror or exc}")

    def _budget_fields(self) -> dict[str, int]:
        return {"budget_left": self.budget.left, "max_restarts": self.plan.max_restarts}

    # -- one step -------------------------------------------------------------------------------------------

    def step_argv(self) -> list[str]:
        placement: list[str] = []
        if self.plan.spare_nodes:
            placement = [
                *(["--overlap"] if self.attempt else []),
                f"--nodes={self.plan.nodes}",
                f"--ntasks={self.plan.step_tasks}",
                f"--ntasks-per-node={self.plan.tasks_per_node}",
                f"--nodelist={','.join(self.step_nodes)}",
            ]
        # The launch command is shell text rendered by hpkit.render (quoted there): bash reads it once.
        return [
            "bash",
            "-c",
            f'exec srun "$@" {self.step_command}',
            "hpkit-step",
            *self.srun_args,
            *placement,
        ]

    def ready_dir(self) -> Path:
        """Where this attempt's ranks announce their signal handlers (hpkit.supervise.ready)."""
        run = self.run_
        return run.path(self.plan.output_dir) / ".ready" / f"{run.job_id}-{run.restart}-{self.attempt}"

    def step_env(self) -> dict[str, str]:
        first = self.step_nodes[0] if self.step_nodes else self.run_.batch_host
        ready = {READY_ENV: str(self.ready_dir())} if self.plan.ranks_ready else {}
        # A SageMaker script's world is SM_HOSTS, and its rank 0 (the first host's) serves the store at MASTER_ADDR.
        hosts = {"SM_HOSTS": json.dumps(self.step_nodes)} if self.plan.sagemaker_hosts else {}
        return {
            **self.env,
            **ready,
            **hosts,
            "HPKIT_STEP_ATTEMPT": str(self.attempt),
            # Rendezvous on the step's first node, by its NodeAddr (node names need not resolve in DNS);
            # hpkit-torchrun serves the store there, and only there.
            "MASTER_ADDR": self.cluster.node_addr(first),
            "HPKIT_RDZV_NODE": first,
        }

    def await_store_gone(self, env: Mapping[str, str]) -> None:
        """A restarted step whose rendezvous store has the stopped step's node and port starts once the old store
        no longer listens (up to STORE_GONE_S)."""
        store = (env["MASTER_ADDR"], env.get("MASTER_PORT", ""))
        previous, self._store = self._store, store
        if store != previous or not store[1].isdigit():
            return
        addr, port = store[0], int(store[1])
        began = self.cluster.monotonic()
        if not self.cluster.listens(addr, port):
            return
        self.say(
            f"the stopped step's rendezvous store still listens on {addr}:{port}: waiting for it to close"
        )
        while self.cluster.listens(addr, port):
            if self.cluster.monotonic() - began >= STORE_GONE_S:
                self.say(f"it still listens after {STORE_GONE_S:.0f} s: starting the step anyway")
                return
            self.cluster.sleep(0.2)
        self.say(f"the old store closed after {self.cluster.monotonic() - began:.1f} s")

    def run_step(self) -> int:
        """Start the step, watch it, and return its exit status once it has ended (or been stopped)."""
        env = self.step_env()
        self.await_store_gone(env)
        self.event(ev.STEP_STARTED, nodes=self.step_nodes, spares=self.spares, logs=self.logs())
        step = self.cluster.start_step(self.step_argv(), env)
        self.step = step
        if self.signalled:
            self.on_usr1()  # a signal that came before the step: passed on once its ranks are ready
        self._probe, self.probed = None, None
        failing_since: float | None = None
        stopped = False  # by this supervisor, after the grace
        with ThreadPoolExecutor(max_workers=1) as pool:
            while step.poll() is None:
                self._check_flag()
                if self.signalled:
                    self._pass_usr1()  # held until the ranks' handlers are in place
                # Ranks that stay in their processes (resilience.keep_survivors) do not end their tasks: the step
                # is stopped here, spares or not, and the next one takes them over.
                if (self.plan.spare_nodes or self.plan.keep_survivors) and not self.signalled:
                    now = self.cluster.monotonic()
                    if failing_since is None:
                        # srun's task lines, torchrun's agents' rank lines (an agent prints its rank's failure
                        # before it closes the rendezvous, which may take seconds before srun hears of its exit),
                        # hpkit train's lines for ranks that stay, or the hang watchdog's verdict.
                        exits, ranks, verdict = step.task_exits(), step.failed_ranks(), self.verdict()
                        stays = step.staying_ranks()
                        if exits or ranks or stays or verdict is not None:
                            failing_since = now
                            # When the fault was seen: a recovery's detection ends here (bench_recovery).
                            self.event(
                                ev.STEP_FAILING,
                                tasks=[{**asdict(t), "exit_code": t.exit_code} for t in exits],
                                ranks=[asdict(r) for r in ranks],
                                stays=[asdict(r) for r in stays],
                                verdict=str(verdict) if verdict is not None else None,
                            )
                            # Probe while the step has its grace: the answer is ready when it is needed.
                            self._probe = pool.submit(self.cluster.unanswering, list(self.step_nodes))
                    silent = self._probe.result() if self._probe is not None and self._probe.done() else []
                    all_left = failing_since is not None and self._every_rank_left(step)
                    if (
                        silent
                        or all_left
                        or (failing_since is not None and now - failing_since >= STEP_GRACE_S)
                    ):
                        # A node that does not answer cannot finish the step, nor can ranks that have all ended or
                        # stay in their processes: no grace is waited for.
                        self.say(
                            f"the step is failing and node(s) {' '.join(silent)} do not answer: stopping it"
                            if silent
                            else "every rank of the step has ended or stays in its process: stopping it"
                            if all_left
                            else f"the step is failing and still running {STEP_GRACE_S:.0f} s later: stopping it"
                        )
                        self.task_exits, self.failed_ranks, stopped = (
                            step.task_exits(),
                            step.failed_ranks(),
                            True,
                        )
                        step.kill()
                        self.cluster.cancel_steps(self.run_.name)
                        break
                step.join(POLL_S)
            status = step.wait()
            if not stopped:
                self.task_exits, self.failed_ranks = step.task_exits(), step.failed_ranks()
            self.probed = self._probe.result() if self._probe is not None else None
        self.step = None
        if self.plan.ranks_ready:
            shutil.rmtree(self.ready_dir(), ignore_errors=True)
        self.event(
            ev.STEP_ENDED,
            exit=status,
            signalled=self.signalled,
            tasks=[{**asdict(t), "exit_code": t.exit_code} for t in step.task_exits()],
        )
        return status

    def _every_rank_left(self, step: Step) -> bool:
        """resilience.keep_survivors: whether every rank of the step has ended (srun's task lines under launcher
        srun, torchrun's agents' rank lines) or said it stays in its process: nothing more will come, and the
        grace would only delay the restart."""
        if not self.plan.keep_survivors or not self.plan.ranks:
            return False
        left = {r.rank for r in step.staying_ranks()} | {r.rank for r in step.failed_ranks()}
        if self.plan.launcher != "torchrun":  # one task per rank: srun's task ids are the ranks
            left |= {i for t in step.task_exits() for i in t.task_ids}
        return len(left) >= self.plan.ranks

    def verdict(self) -> Path | None:
        # The watchdog names its folders as the job's files are named (hpkit.job_events.job_key).
        return verdict_path(self.hangs_dir, self.run_.name, self.run_.restart, self.attempt)

    # -- after the step -------------------------------------------------------------------------------------

    def after_step(self, status: int) -> _Restart | _End:
        if self.signalled:
            return self.requeue(status, "usr1")
        if status == 0:
            self.event(ev.END, outcome=ev.COMPLETED, exit=0, **self._budget_fields())
            return _End(0)
        verdict = self.verdict()
        if self.plan.spare_nodes:
            decided = self._spares(status, verdict)
            if decided is not None:
                return decided
        if verdict is not None:
            folder = str(verdict.parent)
            if self.budget.can_restart():
                self._restart("hang", verdict)
                self.say(
                    f"the step hung ({folder}): restarting it in this allocation from the last checkpoint "
                    f"(restart {self.budget.used} of {self.plan.max_restarts})"
                )
                return _Restart()
            self.say(
                f"the step hung ({folder}) and the restart budget (resilience.max_restarts="
                f"{self.plan.max_restarts}) is spent: ending the job"
            )
            self.event(
                ev.END,
                outcome=ev.HANG_BUDGET_SPENT,
                exit=status,
                verdict=str(verdict),
                **self._budget_fields(),
            )
            return _End(status)
        if self.plan.spare_nodes:
            # Every node answered the probe, and no hang named one.
            return self._killed_rank(status) or self._program_failed(status)
        return self._failed_without_spares(status)

    def _killed_rank(self, status: int) -> _Restart | None:
        """A rank SIGKILLed on a node that answers: the step restarts in the allocation, on the same nodes, while
        the budget lasts (a rank killed again and again spends it, then the job ends as the program's failure)."""
        # Under torchrun, the rank's agent says so itself (srun may have killed that agent, --kill-on-bad-exit,
        # after a peer's agent exited 1, before reporting its exit of 128 + 9); srun's line for its node adds nothing.
        ranks = [r for r in self.failed_ranks if r.exit_code == -signal.SIGKILL]
        killed = [f"rank {r.rank} on {r.node}" for r in ranks]
        named = {r.node for r in ranks}
        killed += [f"task {t.tasks} on {t.node}" for t in self.task_exits if t.killed and t.node not in named]
        if not killed or not self.budget.can_restart():
            return None
        self._restart("killed", None)
        where = ", ".join(killed)
        self.say(
            f"a rank was killed (SIGKILL: {where}) and every node answers: restarting the step on "
            f"{','.join(self.step_nodes)} in this allocation from the last checkpoint (restart {self.budget.used} "
            f"of {self.plan.max_restarts})"
        )
        return _Restart()

    def _restart(self, reason: str, verdict: Path | None) -> None:
        self.budget.spend()
        self._save_budget()
        self.event(
            ev.RESTART,
            reason=reason,
            verdict=str(verdict) if verdict else None,
            nodes=self.step_nodes,
            spares=self.spares,
            **self._budget_fields(),
        )
        if self.plan.requeue_on_failure and not self.budget.can_restart():
            self.requeue_off()

    def _spares(self, status: int, verdict: Path | None) -> _Restart | _End | None:
        lost = self.probed if self.probed is not None else self.cluster.unanswering(list(self.step_nodes))
        self.event(ev.PROBE, nodes=self.step_nodes, unanswering=lost)
        suspects = culprit_nodes(verdict) if verdict is not None else []
        judge = verdict_judge(verdict) if verdict is not None else None
        if suspects and judge in lost:
            # The judge's own node does not answer: cut off, it saw every other node go silent, and names the
            # nodes it lost sight of (the watchdog store's node cut: its judge named the healthy survivors).
            self.say(
                f"the hang verdict was judged on node {judge}, which does not answer: its culprit node(s) "
                f"{' '.join(suspects)} stay in the step"
            )
            suspects = []
        if not lost and not suspects:
            return None
        self.say(
            f"the step ended (exit {status}); node(s) not answering: {' '.join(lost) or 'none'}; "
            f"hang culprit node(s): {' '.join(suspects) or 'none'}"
        )
        if not self.budget.can_restart():
            self.say(
                f"the restart budget (resilience.max_restarts={self.plan.max_restarts}) is spent: ending the job"
            )
            outcome = ev.HANG_BUDGET_SPENT if verdict is not None else ev.BUDGET_SPENT
            verdict_field = str(verdict) if verdict else None
            self.event(ev.END, outcome=outcome, exit=status, verdict=verdict_field, **self._budget_fields())
            return _End(status)
        unreplaced = self._swap([*lost, *suspects])
        still_lost = [n for n in unreplaced if n in lost]
        if still_lost:
            self.say(f"no spare node left for {' '.join(still_lost)}")
            return self.requeue(status, "no_spare")
        self._restart("hang" if verdict is not None and not lost else "node", verdict)
        self.say(
            f"restarting the step on {','.join(self.step_nodes)} in this allocation from the last checkpoint "
            f"(restart {self.budget.used} of {self.plan.max_restarts}; spare(s) left: {' '.join(self.spares) or 'none'})"
        )
        return _Restart()

    def _swap(self, bad: list[str]) -> list[str]:
        """Put a spare in the place of each bad step node while spares last; returns the ones left in place."""
        unreplaced = []
        for node in dict.fromkeys(bad):
            if node not in self.step_nodes:
                continue
            if not self.spares:
                unreplaced.append(node)
                continue
            spare = self.spares.pop(0)
            self.step_nodes[self.step_nodes.index(node)] = spare
            self.say(f"node {node} is out of the job's steps; spare {spare} takes its place")
            self.event(ev.SPARE_SWAP, node=node, spare=spare, spares_left=list(self.spares))
            if self.plan.replace_bad_nodes and self.cluster.hyperpod():
                ok = self.cluster.replace_node(node)
                self.say(
                    f"asked HyperPod to replace node {node}"
                    if ok
                    else f"warning: could not ask for node {node}'s replacement; an administrator can run: "
                    f'scontrol update node={node} state=fail reason="Action:Replace"'
                )
                self.event(ev.REPLACE_ASKED, node=node, ok=ok)
        return unreplaced

    def requeue(self, status: int, reason: str) -> _End:
        run = self.run_
        if not self.budget.can_restart():
            self.say(f"restart budget of {self.plan.max_restarts} spent: not requeueing")
            outcome = ev.SIGNALLED if reason == "usr1" else ev.BUDGET_SPENT
            self.event(ev.END, outcome=outcome, exit=status, **self._budget_fields())
            return _End(status)
        self.budget.count_run(run.restart + 1)
        self._save_budget()
        self.say(
            f"requeueing job {run.name} (restart {self.budget.used} of {self.plan.max_restarts}); "
            "it resumes from its last checkpoint"
        )
        try:
            with open(self.runs_file, "a", encoding="utf-8") as runs:
                runs.write(f"requeued-by-hpkit {run.restart + 1}\n")
        except OSError:
            pass
        self.event(ev.REQUEUE, reason=reason, to_restart=run.restart + 1, **self._budget_fields())
        if not self.plan.requeue_on_failure:
            # The job is not requeueable (no --requeue), so that a node failure ends it: this requeue only.
            self.cluster.set_requeue(run.name, True)
        ok = self.cluster.requeue(run.name)
        if not ok:
            self.say(f"warning: scontrol requeue {run.name} failed")
        self.event(ev.END, outcome=ev.REQUEUED, exit=0, requeued=ok, **self._budget_fields())
        return _End(0 if ok else max(status, 1))

    def _all_answer(self) -> bool:
        answered = self.cluster.all_answer(len(self.step_nodes))
        self.event(ev.PROBE, nodes=self.step_nodes, all_answer=answered)
        return answered

    def _program_failed(self, status: int) -> _End:
        self.say(f"the training program failed on healthy nodes (exit {status}); not requeued")
        self.event(ev.END, outcome=ev.PROGRAM_FAILED, exit=status, **self._budget_fields())
        return _End(status)

    def _failed_without_spares(self, status: int) -> _End:
        """A step with a task on a lost node returns once slurmctld has declared the node failed, and slurmctld
        then requeues the job (or ends it), this supervisor with it. Only a step that fails while every node
        answers is the program's own failure (bad code, bad data): requeueing it would only fail again."""
        nodelist, states = self.run_.nodelist, self.plan.lost_node_states
        lost = self.cluster.lost_nodes(nodelist, states)
        self.event(ev.PROBE, nodes=self.step_nodes, down=lost)
        if not lost and not self._all_answer():
            # The surviving ranks can fail before slurmctld has noticed the node: wait for its verdict rather
            # than call a node failure the program's.
            deadline = self.cluster.monotonic() + self.cluster.slurmd_timeout() + 30
            while not lost and self.cluster.monotonic() < deadline:
                self.cluster.sleep(2)
                lost = self.cluster.lost_nodes(nodelist, states)
        if not lost:
            return self._killed_rank(status) or self._program_failed(status)
        requeued = self.plan.requeue_on_failure and self.budget.can_restart()
        then = (
            "Slurm requeues the job, which resumes from its last checkpoint"
            if requeued
            else f"the restart budget (resilience.max_restarts={self.plan.max_restarts}) is used up, so Slurm "
            "ends the job as NODE_FAIL"
            if self.plan.requeue_on_failure
            else "resilience.requeue_on_failure is off, so Slurm ends the job as NODE_FAIL"
        )
        self.say(f"the step ended (exit {status}) after node(s) {','.join(lost)} stopped answering: {then}")
        self.event(ev.NODE_LOST, nodes=lost, exit=status, then="requeued" if requeued else "ended")
        self.cluster.sleep(self.cluster.slurmd_timeout() + 30)
        self.say(f"Slurm did not act on the lost node(s) {','.join(lost)}: ending the job")
        self.event(ev.END, outcome=ev.NODE_LOST_UNHANDLED, exit=status, nodes=lost, **self._budget_fields())
        return _End(status)


__all__ = ["STEP_GRACE_S", "Supervisor", "TaskExit"]
