"""Which rank is stuck?

gloo: each rank runs a heartbeat thread that posts, twice a second, where its main thread is to the process group's
store: the optimizer steps it finished, the micro-steps it began and the collective it is inside, if any. The main
thread only replaces a tuple in memory, and the posts stay current while it is stuck. When a collective times out,
the waiting rank reads every post at once (no waiting for anyone to post) and names the ranks that are not in that
collective, with the exact step where they stopped. It leaves that verdict in the store: the heartbeat of a rank it
names prints the rank's Python stack, and ends the process a few seconds later if the launcher's SIGTERM did not (a
SIGTERM handler and a main thread stuck in C++ otherwise cost torchrun's 30 s before SIGKILL). A wait in a collective
that outlives its timeout without raising is reported by the waiting rank's heartbeat in the same words.

Ranks that went different ways (one evaluates or saves alone, one leaves the loop a batch early) are named within
seconds instead, whatever the timeout: each post also holds the rank's last Engine calls and model forwards, the
user's line that made each, and whether its main thread is blocked; see multigpu.observers.divergence.

NCCL: the heartbeat only posts (multigpu.observers.flight_recorder names the stuck rank): ending a rank could cut
short its flight-recorder dump, so neither the timeout's verdict nor a divergence is acted on there.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from multigpu.core import launcher_notes
from multigpu.core.errors import Explained
from multigpu.core.launcher_notes import DIVERGED, ScriptEnd, attempt, launched, note_for_launcher
from multigpu.observers import divergence, stuck_stack
from multigpu.observers.observe import StepObserver, StepStats
from multigpu.observers.posts import Where, describe, frozen, where_of

BEAT_S = 0.5  # how often each rank posts where it is: the most a post can lag behind
ACK_S = 1.0  # how long a waiting rank lets the ranks it names print their stacks before it raises
WATCH_GRACE_S = 1.0  # a wait this long past the timeout did not raise by itself: the heartbeat reports it
STOP_GRACE_S = 5.0  # a named rank still alive this long after printing its stack ends itself


class CollectiveTimeout(Explained):
    """A collective waited past the process-group timeout; the message names the ranks that never came."""


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


class Progress:
    def __init__(
        self, rank: int, world_size: int, timeout_s: float, store: dist.Store | None = None, log_dir: str | None = None
    ) -> None:
        self.rank, self.world_size, self.timeout_s, self.log_dir = rank, world_size, timeout_s, log_dir
        # (step, micro-step, op, since): replaced whole, never changed in place, so the heartbeat reads it whole.
        self._at: tuple[int, int, str | None, float] = (0, 0, None, time.monotonic())
        self._calls: tuple[int, tuple] = (0, ())  # (calls begun, the last HISTORY of them), replaced whole too
        self._clock = divergence.MainClock()
        self._blocked_s = 0.0
        self._beats = 0  # posts made: a peer that sees this count stand still knows this process is stopped
        self._finished = False
        self._failed = False  # the script raised an error of its own
        self._ending = False  # this process has seen the ranks go different ways: it ends, and says nothing more
        self._suspect: tuple[str, float] | None = None  # a divergence seen, and when first: confirmed a beat later
        self._store = store
        self._watch = True  # False under NCCL: see the module's doc
        self._following = False
        self._reported = False  # this rank has had its say about a timeout
        # A restarted job may keep the store: each attempt posts under keys of its own.
        # The group's MASTER_PORT too: processes a script starts of its own may post to the launcher's store as well.
        self._prefix = f"multigpu/progress/{attempt()}/{os.environ.get('MASTER_PORT', '')}/"
        self._server: str | None = None  # the process serving the store (`host:pid`), once rank 0 has posted

    @property
    def step(self) -> int:
        return self._at[0]

    @property
    def micro_step(self) -> int:
        return self._at[1]

    @property
    def op(self) -> str | None:
        """The op the main thread is inside, None outside any."""
        return self._at[2]

    def _key(self, name: object) -> str:
        return self._prefix + str(name)

    def _the_store(self) -> dist.Store | None:
        if self._store is None and dist.is_available() and dist.is_initialized() and self.world_size > 1:
            self._watch = "nccl" not in str(dist.get_backend())
            # The launcher's, which outlives every worker (no peer's death closes it); else the default group's
            # (torchrun's, or the one init_process_group made): private, but stable.
            self._store = launcher_notes.launcher_store() or dist.distributed_c10d._get_default_store()
        return self._store

    def _store_gone(self) -> bool:
        """Whether rank 0, which serves the store (unless torchrun's agent or multigpu's launcher does), has ended
        on this machine: an op on its closed socket makes c10d print a warning with a C++ stack of 20-odd frames,
        after which this rank has nothing to say that the launcher's line naming the rank that died does not."""
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or launcher_notes.launcher_store_address()
        if self.rank == 0 or self._store is None or agent:
            return False
        if self._server is None:
            if not self._store.check([self._key(0)]):
                return False
            self._server = where_of(self._store.get(self._key(0))).process
        return stuck_stack.ended_here(self._server)

    def advance(self) -> None:
        """A micro-step begins (before its backward)."""
        step, micro_step, op, _ = self._at
        self._at = (step, micro_step + 1, op, time.monotonic())
        self.follow()

    def follow(self) -> None:
        """Starts posting where this rank is (at setup, or at the first backward of a model set up elsewhere)."""
        if not self._following:
            self._following = True
            if dist.is_available() and dist.is_initialized() and self._the_store() is not None:
                _follow(self)

    def resume_at(self, step: int) -> None:
        """Continues the count of optimizer steps from a checkpoint's."""
        _, micro_step, op, since = self._at
        self._at = (step, micro_step, op, since)

    def finish_step(self) -> None:
        """An optimizer step is done."""
        step, micro_step, op, _ = self._at
        self._at = (step + 1, micro_step, op, time.monotonic())

    def enter(self, op: str) -> str | None:
        """The main thread enters `op`; returns the op it was in, for `leave`. A call made outside any other is
        counted, with the user's line that made it."""
        step, micro_step, outer, _ = self._at
        if outer is None and self.world_size > 1:
            calls, history = self._calls
            site = divergence.call_site(skip=2)  # this method and its caller (Diagnosing, a forward hook) are ours
            self._calls = (calls + 1, (*history[1 - divergence.HISTORY :], (op, site)))
        self._at = (step, micro_step, op, time.monotonic())
        return outer

    def leave(self, outer: str | None) -> None:
        step, micro_step, _, _ = self._at
        self._at = (step, micro_step, outer, time.monotonic())

    def diagnose(self, op: str) -> Diagnosing:
        """The main thread is inside `op` within it; a collective that times out there raises CollectiveTimeout,
        which names the ranks that are not in it."""
        return Diagnosing(self, op)

    def _where(self) -> Where:
        step, micro_step, op, since = self._at
        calls, history = self._calls
        blocked = round(self._blocked_s, 2)
        at = (step, micro_step, op, round(time.monotonic() - since, 2), calls, history, blocked, self._finished)
        return Where(*at, stuck_stack.this_process(), self._failed, self._beats)

    def _post(self) -> None:
        self._blocked_s = self._clock.blocked_s(self._calls[0] if self._at[2] is not None else None)
        self._beats += 1
        self._store.set(self._key(self.rank), json.dumps(self._where()))

    def _read_posts(self) -> dict[int, Where | None]:
        keys = [self._key(rank) for rank in range(self.world_size)]
        if self._store.check(keys):
            values = self._store.multi_get(keys)  # one round trip, however many ranks
        else:
            values = [self._store.get(key) if self._store.check([key]) else None for key in keys]
        return {rank: None if value is None else where_of(value) for rank, value in enumerate(values)}

    def explain(self, op: str) -> str:
        """Names the ranks that are not in the collective `op` this rank timed out in, and where they stopped."""
        self._reported = True
        self._the_store()
        try:
            return self._verdict(op, *self._read_twice())
        except (RuntimeError, ValueError):  # the store went away: the launcher is already tearing the run down
            return (
                f"A collective in {op} on rank {self.rank} timed out after {self.timeout_s:g}s, and the other ranks "
                "can no longer be asked where they are (the run is ending): look for the first error above."
            )

    def _read_twice(self) -> tuple[dict[int, Where | None], frozenset[int]]:
        """Every post, read again more than a beat after a first read: the ranks whose posts did not change in
        between are stopped whole (a post made before the stop may be a beat old). The wait also lets a rank that
        began waiting just now see the posts of the others that wait with it."""
        first = self._read_posts()
        time.sleep(1.5 * BEAT_S)
        second = self._read_posts()
        return second, frozen(first, second)

    def _verdict(self, op: str, posts: dict[int, Where | None], stopped: frozenset[int]) -> str:
        """The message; and, where it names ranks, the verdict that makes them print their stacks."""
        posts[self.rank] = self._where()
        text, absent = describe(self.rank, self.timeout_s, posts, frozen=stopped)
        if absent and self._watch:
            self._store.set(self._key("verdict"), json.dumps({"stuck": absent, "by": self.rank, "op": op}))
            stuck_stack.continue_stopped([posts[rank].process for rank in absent if posts[rank] is not None])
            if self._acknowledged(absent):
                stacks = stuck_stack.where_written(self.log_dir, absent)
                text, _ = describe(self.rank, self.timeout_s, posts, stacks, stopped)
        return text

    def _acknowledged(self, ranks: list[int], kind: str = "ack") -> bool:
        keys = [self._key(f"{kind}/{rank}") for rank in ranks]
        deadline = time.monotonic() + ACK_S
        # Polled: the store's own wait with a timeout logs a C++ warning each time it expires.
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _check_divergence(self, after_error: bool = False) -> None:
        """Says that the ranks went different ways, once, and ends this process, where every rank's post shows it
        (see multigpu.observers.divergence) twice in a row, CONFIRM_S apart; at once `after_error`."""
        posts = self._read_posts()
        posts[self.rank] = self._where()
        text = divergence.diverged(posts, after_error)
        now = time.monotonic()
        if text is not None and not after_error and (self._suspect is None or self._suspect[0] != text):
            self._suspect = (text, now)
        elif text is not None and (after_error or now - self._suspect[1] >= divergence.CONFIRM_S):
            self._declare(text)
        elif text is None:
            self._suspect = None

    def _declare(self, text: str) -> None:
        self._ending = True
        try:
            # compare_set: of the ranks that see it at once, exactly one says it.
            if self._store.compare_set(self._key("diverged/by"), "", str(self.rank)) != str(self.rank).encode():
                self._end_if_diverged(said=True)
            if launched():  # the launcher prints it, once, and no line of torchrun's about the failed workers
                note_for_launcher(DIVERGED, text)
                ScriptEnd.now(divergence.DIVERGED_EXIT).note()
            else:
                print(f"multigpu: error: {text}", file=sys.stderr, flush=True)
            self._store.set(self._key("diverged"), text)
            # The others end first, a moment after they saw it: this rank may host the store they read it from.
            self._acknowledged([rank for rank in range(self.world_size) if rank != self.rank], "diverged/ack")
        finally:
            _end_process()

    def _end_if_diverged(self, said: bool = False) -> None:
        """Ends this process, once it has acknowledged it, where a rank has said that the ranks went different ways
        (`said`: the rank that claims it will say so)."""
        if said or self._store.check([self._key("diverged")]):
            self._ending = True
            with contextlib.suppress(RuntimeError, ValueError):
                self._store.set(self._key(f"diverged/ack/{self.rank}"), "1")
                time.sleep(ACK_S / 2)  # while the rank that said it sees the acknowledgement in the store
            _end_process()

    def finish(self) -> None:
        """The script has ended: posts it, and waits (up to the timeout) until every rank's script has, so that a
        rank left waiting in a call this one never made is told apart from one that is still working."""
        self._finished = True
        if not self._following or not self._watch or self._store is None:
            return
        deadline = time.monotonic() + self.timeout_s
        with contextlib.suppress(RuntimeError, ValueError):  # the store went away: the run is over
            self._post()
            while time.monotonic() < deadline:
                self._end_if_diverged()
                if all(where is None or where.finished for where in self._read_posts().values()):
                    return
                time.sleep(BEAT_S / 2)

    def after_error(self, error: BaseException) -> None:
        """The script raised `error`: where a collective failed because the ranks went different ways (gloo raises
        on a peer that left, or data of another size), says that sentence and ends the process instead."""
        if self._ending:  # the peers this process let go first broke the collective: its heartbeat ends it
            time.sleep(5 * ACK_S)
            _end_process()
        # A rank that has had its say about a timeout, or was named in one, has nothing to add, and the store may be
        # closing with rank 0 (whose process is still ending, so _store_gone cannot tell yet).
        if not self._following or not self._watch or self._store is None or self._reported or self._store_gone():
            return
        with contextlib.suppress(RuntimeError, ValueError):
            if not divergence.from_a_collective(error):  # its own error: posted at once, so the peers whose
                self._failed = True  # collectives it breaks by dying report a crash, not ranks gone different ways
                self._post()
                return
            self._end_if_diverged()
            self._check_divergence(after_error=True)

    def beat(self) -> bool:
        """One heartbeat: posts where this rank is; reports a wait that outlived its timeout without raising;
        prints this rank's stack if a waiting rank named it. Returns True in that last case."""
        if self._store_gone():
            return False
        self._post()
        _, _, op, since = self._at
        if not self._watch:
            return False
        self._end_if_diverged()
        if self._blocked_s >= divergence.BLOCKED_S or self._finished:
            self._check_divergence()
        if self._reported:
            return False
        if op is not None and time.monotonic() - since > self.timeout_s + WATCH_GRACE_S:
            posts, stopped = self._read_twice()
            # Every rank inside the same call for that long (a slow save, say) is no one's fault: nothing to say.
            mine = self._where()[:3]
            if any(where is None or where[:3] != mine for where in posts.values()):
                self._reported = True
                print(f"multigpu: {self._verdict(op, posts, stopped)}", file=sys.stderr, flush=True)
            return False
        verdict_key = self._key("verdict")
        if not self._store.check([verdict_key]):
            return False
        verdict = json.loads(self._store.get(verdict_key))
        if self.rank not in verdict["stuck"]:
            return False
        self._reported = True
        stuck_stack.write_stack(
            self.log_dir, self.rank, f"rank {self.rank} is the rank that rank {verdict['by']} waited for in "
            f"{verdict['op']}, after {self._where()}"
        )  # fmt: skip
        self._store.set(self._key(f"ack/{self.rank}"), "1")
        return True


class Diagnosing:
    """Progress.diagnose: a class rather than a generator's context, as every engine op of every step enters one."""

    __slots__ = ("op", "outer", "progress")

    def __init__(self, progress: Progress, op: str) -> None:
        self.progress, self.op = progress, op

    def __enter__(self) -> None:
        self.outer = self.progress.enter(self.op)

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: Any) -> None:
        progress = self.progress
        try:
            timed_out = isinstance(error, RuntimeError) and not isinstance(error, CollectiveTimeout)
            if timed_out and progress._the_store() is not None and _is_timeout(error):
                raise CollectiveTimeout(progress.explain(self.op)) from error  # said while still inside the op
        finally:
            progress.leave(self.outer)


# One heartbeat thread per process, posting for the newest Progress (an Engine made later replaces the first). Held
# strongly, not by a weak reference: a rank whose Engine was collected before its script ended must still post that
# it finished, or a peer whose Engine lived on waits for it in `finish` for the whole timeout (the collector's timing
# differs between ranks).
_target: Progress | None = None
_thread: threading.Thread | None = None
_stop = threading.Event()


def _follow(progress: Progress) -> None:
    global _target, _thread
    _target = progress
    if _thread is None:
        _thread = threading.Thread(target=_beat_until_exit, name="multigpu-heartbeat", daemon=True)
        _thread.start()
        # Before the process group is destroyed (that handler was registered earlier, so it runs later).
        atexit.register(_stop_heartbeat)


def _end_process(code: int = divergence.DIVERGED_EXIT) -> None:
    """Ends this process at once (a main thread stuck in a collective would never return), its output flushed."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def script_ended(error: BaseException | None) -> None:
    """The worker's word that the script ended (None: without an error), for the newest Engine's heartbeat."""
    if _target is not None:
        _target.finish() if error is None else _target.after_error(error)


def _stop_heartbeat() -> None:
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2 * BEAT_S)


def _beat_until_exit() -> None:
    # The first post at once: a rank may part from the others before its first beat (nanoGPT evaluates at step 0).
    while not _beat_once() and not _stop.wait(BEAT_S):
        pass


def _beat_once() -> bool:
    """One beat for the newest Progress; True when the process is exiting and the thread should stop."""
    progress = _target
    if progress is None or not dist.is_initialized():
        return False
    try:
        named = progress.beat()
    except (RuntimeError, ValueError):
        return False  # the store went away with the run (rank 0 or the launcher hosted it): nothing to post to
    if named:
        # The peers have raised and the launcher is stopping every process; if its SIGTERM did not end this
        # one (a handler waits for a main thread stuck in C++), end it here rather than after torchrun's 30 s.
        if _stop.wait(STOP_GRACE_S):
            return True  # the process is exiting on its own
        _end_process(1)
    return False


class Heartbeat(StepObserver):
    """Progress attached to every Engine: each op the engine runs is watched, each micro-step and optimizer step
    counted, and a resumed run's count of steps carried on."""

    def attach(self, engine: Any) -> None:
        self.progress = Progress(engine.rank, engine.world_size, engine.config.timeout_s, log_dir=engine.config.log_dir)

    def on_setup(self, model: Any) -> None:
        # One process cannot go its own way. A model's own forward pre-hooks (FSDP's all-gather) run before the
        # Engine's forward: hooks of the heartbeat's go first. Without such hooks (ddp), the Engine's forward is
        # where a forward starts, and its watch makes it a call (`watch`): two hooks on every forward fewer.
        if self.progress.world_size > 1 and model._forward_pre_hooks:
            divergence.watch_forwards(model, self.progress.enter, self.progress.leave)
        self.progress.follow()

    def watch(self, op: str) -> contextlib.AbstractContextManager[None]:
        if op == "forward" and self.progress.op is None:  # no hook of the model's entered it (see on_setup)
            op = "model forward" if torch.is_grad_enabled() else divergence.EVALUATION
        return Diagnosing(self.progress, op)  # progress.diagnose(op), a call less on every op

    def on_backward_start(self) -> None:
        self.progress.advance()

    def on_step_end(self, stats: StepStats) -> None:
        self.progress.finish_step()

    def on_resume(self, step: int) -> None:
        self.progress.resume_at(step)
