"""What `multigpu run` says when its workers fail or stop: the first failure in one sentence, and torchrun's own lines
about the workers dropped where that sentence says it all (a UsageError, a divergence, a stop), or held until the run
has ended and shown only where a worker's own error is printed above them (not after a kill from outside, nor a
fault the ranks explained)."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from multigpu.core.errors import UsageError
from multigpu.core.launcher_notes import (
    DIVERGED,
    LOST_PEER,
    SAID,
    USAGE_ERROR,
    ScriptEnd,
    launcher_note,
    usage_error_noted,
)
from multigpu.launch.exit_watch import STUCK, ended_after_script, stuck_lines
from multigpu.launch.stop import checkpoint_note
from multigpu.observers.flight_recorder import explain_nccl_timeout, read_nccl_traces


@contextlib.contextmanager
def filtering(logger_name: str, keep: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """Within it, the records of the logger `logger_name` that `keep` refuses are dropped."""
    logger = logging.getLogger(logger_name)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


ELASTIC_WORKERS_LOG = "torch.distributed.elastic.multiprocessing.api"  # torchrun's lines about each worker
ELASTIC_AGENT_LOG = "torch.distributed.elastic.agent.server.api"


def quiet_after_usage_error(exits: Path) -> contextlib.AbstractContextManager[None]:
    """Keeps torchrun's own lines about failed and stopped workers out of a run that a UsageError ended, or whose
    launcher ended a worker stuck after its script: the launcher says what happened in one sentence, and those lines
    would bury it (a crash still gets them)."""
    return filtering(
        ELASTIC_WORKERS_LOG,
        lambda record: (
            not (usage_error_noted(exits) or any(exits.glob(f"{STUCK}*")) or launcher_note(exits, DIVERGED) is not None)
        ),
    )


def holding_failure_lines(held: list[logging.LogRecord]) -> contextlib.AbstractContextManager[None]:
    """Within it, torchrun's lines about failed workers (the first failure, the survivors sent SIGTERM) go to `held`
    rather than to the screen: whether they help is known only once the run has ended (report_failure), and the
    survivors are signalled before the failure is logged."""

    def hold(record: logging.LogRecord) -> bool:
        failure = str(record.msg).startswith(("failed (exitcode", "Sending process %s closing signal"))
        if failure:
            held.append(record)
        return not failure

    return filtering(ELASTIC_WORKERS_LOG, hold)


def release(held: list[logging.LogRecord]) -> None:
    """Shows the lines `holding_failure_lines` held, as torchrun would have."""
    for record in held:
        logging.getLogger(record.name).handle(record)
    held.clear()


@contextlib.contextmanager
def quiet_when_stopped() -> Iterator[None]:
    """Keeps torchrun's warnings about a SIGINT or SIGTERM (the signal received, then each worker sent it) out of
    the run that it stopped: report_stop says it in one line. A crash's lines, which name the survivors it sent
    SIGTERM, stay: they only go once the agent has said that it received a stop signal."""
    stopping = False

    def not_the_signal(record: logging.LogRecord) -> bool:
        nonlocal stopping
        signal_line = str(record.msg).startswith("Received %s death signal")
        stopping = stopping or signal_line
        return not signal_line

    def not_its_forwarding(record: logging.LogRecord) -> bool:
        return not (stopping and str(record.msg).startswith("Sending process %s closing signal"))

    with filtering(ELASTIC_AGENT_LOG, not_the_signal), filtering(ELASTIC_WORKERS_LOG, not_its_forwarding):
        yield


def report_failure(error: ChildFailedError, exits: Path, held: Sequence[logging.LogRecord] = ()) -> int:
    """Prints which worker failed first and returns its exit code; raises the UsageError that ended it, if one
    did, so that its sentence is printed once (rather than by every rank) and the run ends with exit code 2.

    A crash makes its peers fail too, blocked in collectives, often within the same second; torchrun's own
    timestamps cannot order them, so each worker records the nanosecond its script ended (multigpu.launch.worker).
    `held`: torchrun's lines about the failed workers, shown before the summary only where a worker's own error
    is (a rank killed from outside, or a fault one sentence explains, is said in that sentence alone).
    """
    for line in stuck_lines(exits):
        print(line, file=sys.stderr)
    said = first_said(error, exits)
    if said is not None:  # a fault the ranks explained (a collective timed out: who is stuck, and where)
        print(f"multigpu run: {said[1]}", file=sys.stderr)
        return said[0]
    if all(ended_after_script(exits, rank) for rank in error.failures):
        return 0  # every script finished; the launcher ended the workers that then did not exit, and said so
    rank, code, how = first_failure(error, exits)
    failure, checkpoint = error.failures[rank], checkpoint_note(exits)
    if how.startswith("was killed") and ScriptEnd.read(exits, rank) is None:
        # Killed from outside, or aborted by a library's own check (gloo's, on a collective whose data has another
        # size than its peer's): every other worker only lost it, and their errors (gloo's) are not printed.
        why = (
            "by a library's own check (its lines above say which; gloo's 'collective mismatch' means the ranks made "
            "different collectives: evaluate and save on every rank)"
            if "SIGABRT" in how
            else "from outside its script (the out-of-memory killer? dmesg says)"
        )
        print(
            f"multigpu run: worker rank {rank} (pid {failure.pid}) {how} {why}, so every worker was stopped"
            f"{f'; {checkpoint}' if checkpoint else ''}.",
            file=sys.stderr,
        )
        return code
    release(list(held))
    others = len(error.failures) - 1
    also = f" ({others} more worker{'s' if others > 1 else ''} failed after it)" if others else ""
    above = "" if how.startswith("lost") else "; errors are printed above"  # a lost peer's error is not printed
    print(
        f"multigpu run: worker rank {rank} (pid {failure.pid}) {how}{also}{above}"
        f"{f'; {checkpoint}' if checkpoint else ''}.",
        file=sys.stderr,
    )
    stuck = explain_nccl_timeout(read_nccl_traces(exits))
    if stuck is not None:
        print(f"multigpu run: {stuck}", file=sys.stderr)
    return code


def first_said(error: ChildFailedError, exits: Path) -> tuple[int, str] | None:
    """The exit code of the failed rank whose script ended first with a sentence that explains the fault, and that
    sentence; None where no rank's did."""
    said = {rank: launcher_note(exits, f"{SAID}{rank}") for rank in error.failures}
    ends = [end for rank, text in said.items() if text is not None and (end := ScriptEnd.read(exits, rank))]
    if not ends:
        return None
    first = min(ends, key=lambda end: end.stamp_ns)
    return first.code, said[first.rank]


def first_failure(error: ChildFailedError, exits: Path) -> tuple[int, int, str]:
    """The rank that failed first, its exit code, and how it ended; raises the UsageError or the divergence that
    ended the run, said once."""
    ended: dict[int, tuple[int, int]] = {}  # rank -> (nanosecond its script ended, the script's exit code)
    for rank in error.failures:
        end = ScriptEnd.read(exits, rank)
        if end is not None and end.code != 0:
            ended[rank] = (end.stamp_ns, end.code)
    # Killed from outside (SIGKILL, the OOM killer, a segfault) before its script could end: that one came first,
    # before any divergence its peers' collectives seemed to show. torchrun itself only sends SIGTERM, to the others.
    stuck = {rank for rank in error.failures if ended_after_script(exits, rank)}
    killed = [
        r
        for r, f in error.failures.items()
        if r not in ended and r not in stuck and f.exitcode < 0 and -f.exitcode != signal.SIGTERM
    ]
    if killed:
        rank = min(killed, key=lambda r: error.failures[r].timestamp)
        exitcode = error.failures[rank].exitcode
        return rank, 128 - exitcode, f"was killed by {signal.Signals(-exitcode).name}"
    diverged = launcher_note(exits, DIVERGED)
    if diverged is not None:  # the ranks went different ways: that sentence, said once (multigpu.observers.divergence)
        raise UsageError(diverged)
    if ended:
        # The script's own code: torchrun may SIGTERM the originator while it is still shutting down. A rank that
        # only lost a peer is an echo: the first rank that did not, if any, is the cause.
        causes = [rank for rank in ended if launcher_note(exits, f"{LOST_PEER}{rank}") is None] or list(ended)
        rank = min(causes, key=lambda r: ended[r][0])
        usage = launcher_note(exits, f"{USAGE_ERROR}{rank}")
        if usage is not None:
            raise UsageError(usage.split(" ", 1)[1])
        if launcher_note(exits, f"{LOST_PEER}{rank}") is not None:
            return rank, ended[rank][1], "lost its connection to another worker, which died or could not be reached"
        return rank, ended[rank][1], f"exited with code {ended[rank][1]}"
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:
        return rank, 128 - failure.exitcode, f"was killed by {signal.Signals(-failure.exitcode).name}"
    return rank, failure.exitcode, f"exited with code {failure.exitcode}"
