"""Fault injection for testing recovery, from MULTIGPU_FAULT (test-only; nothing else is configured this way).

    MULTIGPU_FAULT="crash,step=5,rank=1"   rank 1 raises after optimizer step 5 (first attempt only)
    MULTIGPU_FAULT="hang,step=3,rank=1"    rank 1 stops reaching collectives after step 3
    MULTIGPU_FAULT="stop,step=3,rank=1"    rank 1 stops itself with SIGSTOP after step 3 (a Ctrl-Z of that process)
    MULTIGPU_FAULT="kill,step=8,group=1"   replica group 1's rank 0 SIGKILLs itself after step 8, or its first step
                                           past it (attempts=2: again once healed, a group lost twice)
    MULTIGPU_FAULT="kill-in-step,step=3,group=1"   the same inside step 4, once its quorum has formed: the other
                                                   groups' collectives of that step fail, and they run it again
    MULTIGPU_FAULT="kill-in-save,step=4"   rank 0 is SIGKILLed while the checkpoint of step 4 is being written
    MULTIGPU_FAULT="disk-full,step=4,rank=1"   rank 1's disk fills as it writes the checkpoint of step 4: from
                                               then on, no file it writes can pass 1 KiB (bytes=N: N bytes)
    MULTIGPU_FAULT="disk-full-result"      the disk fills as a result is written (a run's final model, adapter or
                                           merged model, an export): from then on, as disk-full (bytes=N)
Faults fire only on a job's first attempt (or its first `attempts`), so that a restarted job can show that it
recovers; `group=G` narrows one to replica group G.
"""

from __future__ import annotations

import os
import resource
import signal
import time

from multigpu.core.launcher_notes import attempt


def _spec() -> tuple[str, dict[str, int]] | None:
    raw = os.environ.get("MULTIGPU_FAULT")
    if not raw:
        return None
    kind, *pairs = raw.split(",")
    where = {key: int(value) for key, value in (pair.split("=") for pair in pairs)}
    if attempt() >= where.get("attempts", 1) or where.get("group", -1) != int(os.environ.get("REPLICA_GROUP_ID", "-1")):
        return None
    return kind, where


def inject(point: str, step: int, rank: int) -> None:
    """Called at `point` ("step", "write", "save" or "result"); fires the configured fault if it matches."""
    spec = _spec()
    if spec is None:
        return
    kind, where = spec
    if point == "result":  # written once, by one process: no step or rank to match
        if kind == "disk-full-result":
            limit_file_size(where.get("bytes", 1024))
        return
    if where.get("rank", 0) != rank or not (step == where.get("step") or (kind == "kill" and step > where["step"])):
        return
    if point == "step" and kind == "crash":
        raise RuntimeError(f"injected crash at step {step} on rank {rank} (MULTIGPU_FAULT)")
    if point == "step" and kind == "hang":
        while True:
            time.sleep(60)
    if point == "step" and kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if (point, kind) in (("step", "kill"), ("quorum", "kill-in-step")):
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "write" and kind == "disk-full":
        # The default leaves room for the launcher's notes (a sentence each), not for a checkpoint's files.
        limit_file_size(where.get("bytes", 1024))
    if point == "save" and kind == "kill-in-save":
        os.kill(os.getpid(), signal.SIGKILL)


def limit_file_size(limit: int) -> int:
    """From now on, writing past `limit` bytes of any file fails in this process; returns the limit before.

    A real write failure, not a raised one: the kernel refuses each write past the limit (EFBIG, as a full disk
    refuses with ENOSPC), so it reaches multigpu through every layer that writes (torch.save's zip writer, DCP's
    writer) the way a full disk does. Python ignores SIGXFSZ, which would otherwise kill the process.
    """
    before, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    return before
