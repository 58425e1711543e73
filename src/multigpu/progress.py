"""Which rank is stuck? Each rank posts its micro-step to the process group's store; a timed-out collective
reads them all and names the ranks that fell behind, instead of gloo's bare "Timed out waiting 5000ms".

A post is a round trip to the store, so ranks post at most once a second while training. When a collective
times out, every waiting rank posts its exact micro-step and gives the others a moment to do the same before
reading: the ranks still showing an older micro-step are the ones that never arrived."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch.distributed as dist

POST_INTERVAL_S = 1.0
SETTLE_S = 2.0


class CollectiveTimeout(RuntimeError):
    """A collective waited past the process-group timeout; the message names the ranks that never came."""


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


class Progress:
    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.micro_step = 0
        self._store = None
        self._posted_at = float("-inf")

    def _key(self, rank: int) -> str:
        return f"multigpu/progress/{rank}"

    def _the_store(self) -> dist.Store | None:
        if self._store is None and dist.is_available() and dist.is_initialized() and self.world_size > 1:
            # The default group's store (torchrun's, or the one init_process_group made): private, but stable.
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def advance(self) -> None:
        self.micro_step += 1
        now = time.monotonic()
        if now - self._posted_at >= POST_INTERVAL_S:
            self._post()
            self._posted_at = now

    def _post(self) -> None:
        store = self._the_store()
        if store is not None:
            store.set(self._key(self.rank), str(self.micro_step))

    @contextlib.contextmanager
    def diagnose(self, op: str) -> Iterator[None]:
        try:
            yield
        except CollectiveTimeout:
            raise
        except RuntimeError as error:
            if self._the_store() is None or not _is_timeout(error):
                raise
            raise CollectiveTimeout(self.explain(op)) from error

    def explain(self, op: str) -> str:
        store = self._the_store()
        self._post()
        time.sleep(SETTLE_S)  # the other waiting ranks time out within moments and post theirs
        steps = {}
        for rank in range(self.world_size):
            key = self._key(rank)
            steps[rank] = int(store.get(key)) if store.check([key]) else 0
        behind = sorted(rank for rank, step in steps.items() if step < self.micro_step)
        where = f"{op} on rank {self.rank} at micro-step {self.micro_step}"
        if not behind:
            return (
                f"A collective in {where} timed out after {self.timeout_s:g}s although every rank reached this "
                "micro-step; some rank is inside a different collective (a rank-only branch around a collective?)."
            )
        lagging = ", ".join(f"rank {rank} (last seen at micro-step {steps[rank]})" for rank in behind)
        return (
            f"A collective in {where} timed out after {self.timeout_s:g}s: {lagging} stopped reaching collectives "
            "while the others waited; look at what that rank was doing (a hang, a deadlock, a much slower data "
            "path). The launcher stops every process."
        )
