"""`hpkit-torchrun ARGS`: torchrun whose rendezvous store outlives every agent of the step.

torchrun's agent on the rendezvous host serves the c10d store inside its own process and exits as soon as
its exit barrier returns. The other agents still use the store after that barrier (they close the
rendezvous): when it is already gone they print `Failed to recv` tracebacks, and a job whose training
finished can end FAILED. And torchrun decides who hosts by hostname: an agent that fails to bind the port
(another program holds it) silently becomes a client of that program and waits minutes before failing.

hpkit's job scripts name the store's node (HPKIT_RDZV_NODE, next to MASTER_ADDR). On that node this
launcher binds the store itself before torchrun starts (torchrun's agent shares it: multi-tenant), says
plainly when the port is taken, and after a successful run waits until every other agent has said it is
done with the store. Elsewhere it tells torchrun not to try hosting. Its workers learn the store's address
(HPKIT_WATCH_STORE): the hang watchdog's nodes report through it. Without HPKIT_RDZV_NODE or
SLURMD_NODENAME (a bare launch) it is torchrun unchanged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from hpkit.job_events import AGENT_PREFIX, HANG_EXIT, rank_failed_line
from hpkit.rendezvous import source_address
from hpkit.watch_store import export

# How long the store's host waits for the other agents after its own run succeeded. They are done
# within a second of the exit barrier; an agent that died never reports, and then the host stops waiting.
AGENTS_DONE_WAIT_S = 60.0
# Connecting to say "done" and saying it: short, since the host may have stopped waiting.
DONE_REPORT_TIMEOUT_S = 10.0
DONE_POLL_S = 0.05
# How long the agent gives its workers to exit after SIGTERM when it stops them for a failure (a worker
# failed, the rendezvous store is gone) rather than for a signal it was sent. torchrun waits its shutdown
# timeout (30 s) in both cases, then SIGKILLs; but a rank whose peer died is blocked in a collective, and its
# SIGTERM handler only asks for a checkpoint at the step's end, which never comes: a lost node cost 30 s
# more to notice whenever a survivor was blocked (bench/bench_recovery.py: detection 33 s against 5 s).
# A signal (Slurm's USR1 or SIGTERM, passed on) keeps torchrun's timeout: the ranks checkpoint and stop. So does a
# worker that exited with HANG_EXIT: the hang watchdog's ranks are writing their stacks and the verdict, and each
# exits by itself once done.
FAILED_STOP_S = 1
RDZV_NODE_ENV = "HPKIT_RDZV_NODE"


def hosts_store(env: Mapping[str, str]) -> bool | None:
    """Whether this node serves the rendezvous store; None where the job script did not say."""
    store_node, this_node = env.get(RDZV_NODE_ENV), env.get("SLURMD_NODENAME")
    if not store_node or not this_node:
        return None
    return store_node == this_node


def with_is_host(rdzv_conf: str, is_host: bool) -> str:
    """torchrun's `--rdzv-conf` (k1=v1,k2=v2) with is_host set: the decision is made here, not by hostname."""
    entries = [
        entry
        for entry in rdzv_conf.split(",")
        if entry.strip() and entry.split("=", 1)[0].strip() != "is_host"
    ]
    return ",".join([*entries, f"is_host={'true' if is_host else 'false'}"])


def done_key(run_id: str) -> str:
    """The counter each agent but the store's host adds to when it no longer needs the store."""
    return f"hpkit-torchrun/{run_id}/agents-done"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    is_host = hosts_store(os.environ)
    if is_host is None or args.rdzv_backend != "c10d" or args.standalone:
        _run(args)
        return
    args.rdzv_conf = with_is_host(args.rdzv_conf, is_host)
    host, port = _endpoint(args.rdzv_endpoint)
    # The first agent's address becomes its workers' MASTER_ADDR: torchrun takes the hostname, which may
    # resolve to loopback or to an interface the other nodes cannot reach; the address that routes to the
    # store is reachable by construction (NET=netns clusters, nodes with several interfaces).
    if not args.local_addr and (source := source_address(host)) and not source.startswith("127."):
        args.local_addr = source
    agents = _max_nodes(args.nnodes)
    counter = done_key(args.rdzv_id)
    stop_failed_workers_at_once()
    store = _serve(host, port) if is_host else None
    # The hang watchdog's nodes report through this store too: it lives outside the training processes.
    export(os.environ, host, port, os.environ.get(RDZV_NODE_ENV, ""))
    failed = _run_reporting(args)
    if failed is not None:  # the step ends then, and nobody needs the store any more
        raise SystemExit(failed)
    if store is not None:
        _wait_for_agents(store, counter, agents - 1)
    elif agents > 1:
        _report_done(host, port, counter)


def stop_failed_workers_at_once(grace_s: float = FAILED_STOP_S) -> None:
    """torchrun's agent stops its workers with SIGTERM and SIGKILL after `grace_s` (FAILED_STOP_S) when it stops
    them for anything but a signal it received (those keep torchrun's shutdown timeout)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    original = LocalElasticAgent._shutdown
    if getattr(original, "hpkit_failed_stop", False):
        return

    def _shutdown(self: Any, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # The agent calls this in its `except SignalException` (a signal came) or in its `finally`.
        if not isinstance(sys.exc_info()[1], SignalException) and not _hang_called(self._pcontext):
            timeout = min(timeout, grace_s)
        original(self, death_sig, timeout)

    _shutdown.hpkit_failed_stop = True  # type: ignore[attr-defined]
    LocalElasticAgent._shutdown = _shutdown  # type: ignore[method-assign]


def _hang_called(workers: Any) -> bool:
    """A worker of this agent exited with HANG_EXIT: the hang watchdog called a hang (torchrun's launches of a
    command keep each worker's Popen in `subprocess_handlers`)."""
    handlers = getattr(workers, "subprocess_handlers", None) or {}
    return any(handler.proc.poll() == HANG_EXIT for handler in handlers.values())


def _run(args: Any) -> None:
    # Exactly what the `torchrun` console script runs (its error-file handling included).
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import run

    record(run)(args)


def _run_reporting(args: Any) -> int | None:
    """`_run`; when a worker failed, after printing torchrun's table of the failed ranks (its "Root Cause"
    block, which `hpkit why` reads) without this agent's own Python traceback, which only says a child failed
    and sat above every job log's real error, and one line per failed rank naming this node (`hpkit why`'s node for
    the rank), the agent's exit status (`failed_status`); None when all went well."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        _run(args)
    except ChildFailedError as exc:
        return _report(exc)
    except SignalException as exc:
        # A signal while torchrun, its rank failed, still closed the rendezvous (seconds: its log records walk the
        # stack): srun stopping this agent (--kill-on-bad-exit) because a peer's agent, whose rank died of this
        # one's failure, exited first. This node's failure is the news; the signal follows from it.
        failed = _context_of(exc, ChildFailedError)
        if failed is None:
            raise
        return _report(failed)
    return None


def _report(exc: Any) -> int:
    """Print the ChildFailedError's table and a line per failed rank naming this node; the exit status."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    placed = "".join(
        f"\n{rank_failed_line(rank, node, f.exitcode)}" for rank, f in sorted(exc.failures.items())
    )
    print(f"{AGENT_PREFIX}ChildFailedError: {exc}{placed}", file=sys.stderr, flush=True)
    return failed_status(exc.get_first_failure()[1].exitcode)


def _context_of(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The exception of `kind` that `exc` was raised while handling, however deep, or None."""
    seen: set[int] = set()
    context = exc.__context__
    while context is not None and id(context) not in seen:
        if isinstance(context, kind):
            return context
        seen.add(id(context))
        context = context.__context__
    return None


def failed_status(first_exitcode: int) -> int:
    """The agent's exit status from its first failed worker's exit code: 128 + the signal where a signal killed it
    (the job's supervisor restarts a step whose rank was SIGKILLed on a node that answers), else 1 as torchrun."""
    return 128 - first_exitcode if first_exitcode < 0 else 1


def _endpoint(endpoint: str) -> tuple[str, int]:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    # torchrun's own default, so that an endpoint without a port means the same store to both.
    return parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)


def _max_nodes(nnodes: str) -> int:
    from torch.distributed.run import parse_min_max_nnodes

    return int(parse_min_max_nnodes(nnodes)[1])


def _serve(host: str, port: int) -> Any:
    from torch.distributed import TCPStore

    try:
        # multi_tenant: torchrun's agent, asking for a server on the same port in this process, shares this one.
        return TCPStore(
            host,
            port,
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )
    except (RuntimeError, ValueError) as exc:
        node = os.environ.get("SLURMD_NODENAME", host)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        sys.exit(
            f"hpkit-torchrun: cannot serve the rendezvous store on port {port} of {node} ({host}): {first_line}. "
            "Another job or program on that node holds the port; resubmit (the port follows the job id: "
            "hpkit.rendezvous), or free it"
        )


def _wait_for_agents(store: Any, counter: str, others: int) -> None:
    # Polled rather than waited on: the store answers an agent's `add` before it reads this process's next
    # poll, so when the count is seen every reply has left, and exiting cannot cut one off.
    deadline = time.monotonic() + AGENTS_DONE_WAIT_S
    while others > 0 and time.monotonic() < deadline:
        if store.add(counter, 0) >= others:
            return
        time.sleep(DONE_POLL_S)


def _report_done(host: str, port: int, counter: str) -> None:
    from torch.distributed import TCPStore

    # An error here means the host stopped waiting (its wait is bounded): this run succeeded all the same.
    with contextlib.suppress(Exception):
        TCPStore(host, port, is_master=False, timeout=timedelta(seconds=DONE_REPORT_TIMEOUT_S)).add(
            counter, 1
        )


if __name__ == "__main__":
    main()
