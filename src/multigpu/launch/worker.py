"""What each process started by `multigpu run` executes: the user's script, unchanged, then a clean exit.

    python -m multigpu.launch.worker SCRIPT [ARGS...]
    python -m multigpu.launch.worker -m MODULE [ARGS...]

(`multigpu bench` and `multigpu verify` run a script through multigpu.tools.harness, which prepares the process and
then hands over to `main` here.)

Why: a gloo process group's destructor (c10d::ProcessGroupGloo) locks the group's work queue and joins its threads
while the thread that runs it holds the GIL. A gloo thread that has just finished a collective started inside
backward (DDP's all-reduces) frees it while holding that lock, and freeing it needs the GIL: it drops the Python
context autograd keeps with the work. When the script drops its last reference to the group right after a backward
(a DDP model going out of scope at the end of `main()`, after `destroy_process_group()`), the two wait for each
other forever; at the interpreter's teardown the same race aborts the process ("terminate called without an active
exception"). So the worker keeps every process group the script destroys referenced until the process ends
(`keep_destroyed_groups`), and ends the process itself once every exit handler has run, after flushing every open
file, without finalising the interpreter (`end_process`): no group's destructor ever runs, and no library thread
can race the teardown of the objects it uses. A rank that still has not ended some time after its script did is
ended by its launcher, which says so (multigpu.launch.launcher).

Why a plain `torchrun script.py` hangs there less often (measured with torch 2.13 on CPU, the DDP tutorial's
shape, 2 processes: 0 hangs in 8 runs, against 3 in 8 under `multigpu run` before this): DDP imports torch._dynamo
lazily while it is built, and that import leaves references to the group's Python object behind, so the group
outlives the model and dies only at the interpreter's teardown. multigpu's modules import torch._dynamo before the
script runs; then the model's reducer is the group's last holder, and the group dies with the model.

Before the script runs, the worker also arranges to die with its launcher and to end at once when the launcher
stops it (multigpu.launch.stop), makes accelerate's PartialState use the CPU where Accelerator does, and refuses
torch.multiprocessing.spawn in a group of several (below). A script's uncaught exception is printed from the
script's own first frame: the worker's and runpy's frames above it say nothing to the script's author.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import gc
import importlib.abc
import importlib.machinery
import io
import os
import re
import runpy
import signal
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any, NoReturn

import torch.distributed as dist
import torch.multiprocessing
from torch.distributed import distributed_c10d

from multigpu.core.env import destroy_process_groups
from multigpu.core.errors import Explained, UsageError, report_usage_error
from multigpu.core.launcher_notes import (
    LAUNCHER_DIR,
    LOST_PEER,
    SAID,
    STACKS,
    ScriptEnd,
    launched,
    note_for_launcher,
    usage_error_noted,
)
from multigpu.launch import stop
from multigpu.launch.exit_watch import finished_already

_exit_code = 1  # what the process ends with unless the script finishes: an unhandled exception's code


def record_exit(code: int) -> None:
    """Notes when and how the script ended, so the launcher can tell the first failure from its echoes, and a rank
    that does not end after its script did; from now on SIGUSR1 writes this process's stacks for the launcher."""
    global _exit_code, _stacks
    _exit_code = code
    if not launched():
        return
    ScriptEnd.now(code).note()
    # faulthandler writes from C, without the GIL: it works in a process stuck with the GIL held.
    _stacks = open(os.path.join(os.environ[LAUNCHER_DIR], f"{STACKS}{os.environ['RANK']}"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)


_stacks: io.TextIOWrapper | None = None  # open until the process ends, for faulthandler


_kept_groups: list[dist.ProcessGroup] = []  # every group the script destroyed, referenced until the process ends


def keep_destroyed_groups() -> None:
    """Makes torch.distributed.destroy_process_group keep the groups it destroys referenced, so that no reference the
    script drops can run a group's destructor (see the module's doc). Set before the script imports it."""
    destroy = distributed_c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_keeping_groups(group: dist.ProcessGroup | None = None) -> None:
        _kept_groups.extend(distributed_c10d._world.pg_map)  # its keys are every group the process has
        destroy(group)

    dist.destroy_process_group = distributed_c10d.destroy_process_group = destroy_keeping_groups


def end_process() -> None:
    """The last exit handler: flushes what Python still buffers, then ends the process (see the module's doc)."""
    # type(), not isinstance: isinstance also reads each object's __class__, which some deprecated objects warn on.
    buffered = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for stream in gc.get_objects():
        if issubclass(type(stream), buffered) and not stream.closed:
            # A pipe whose reader is gone, a stream detached from its buffer: nothing more to save there.
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(_exit_code)


class AccelerateOnCpu(importlib.abc.MetaPathFinder):
    """When the script imports accelerate, makes PartialState() honour ACCELERATE_USE_CPU as Accelerator() does.

    `multigpu run` sets ACCELERATE_USE_CPU=true on machines without CUDA GPUs (worker_env.use_cpu_for_accelerate).
    Accelerator() reads it and passes cpu=True to PartialState; accelerate 1.15's PartialState() reads no such
    variable, finds no accelerator and reports num_processes 1 in every worker, so each trains alone.
    """

    def find_spec(
        self, name: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "accelerate.state":
            return None
        finders = (finder for finder in sys.meta_path if finder is not self and hasattr(finder, "find_spec"))
        spec = next((found for finder in finders if (found := finder.find_spec(name, path, target))), None)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            if module.__name__ == name:  # a loader may serve other modules too (a zip importer does)
                use_cpu_in_partial_state(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def honour_accelerate_use_cpu() -> None:
    """PartialState() honours ACCELERATE_USE_CPU (AccelerateOnCpu): patched now where accelerate.state was imported
    before this worker ran (a process this one was forked from had imported it), else as the script imports it."""
    imported = sys.modules.get("accelerate.state")
    if imported is not None:
        use_cpu_in_partial_state(imported)
    else:
        sys.meta_path.insert(0, AccelerateOnCpu())


def use_cpu_in_partial_state(state: ModuleType) -> None:
    init = state.PartialState.__init__

    @functools.wraps(init)
    def __init__(self: Any, cpu: bool = False, **kwargs: Any) -> None:
        init(self, cpu or state.parse_flag_from_env("ACCELERATE_USE_CPU"), **kwargs)

    state.PartialState.__init__ = __init__


def refuse_own_processes(world_size: int) -> None:
    """In a group of several, makes torch.multiprocessing.spawn (and start_processes) raise a UsageError.

    A script that starts its own processes (the PyTorch DDP tutorial's way) would start them once in every worker
    of `multigpu run -n 2`: each set names the same MASTER_PORT, so one fails with EADDRINUSE, or both run the
    whole job. In one worker (`-n 1`) it runs as it would under `python`.
    """
    if world_size <= 1:
        return

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise UsageError(
            f"This script starts its own processes (torch.multiprocessing.spawn), so each of the {world_size} "
            "processes multigpu started would start them again on the same port; run it in one: multigpu run -n 1."
        )

    # mp.spawn calls the start_processes of its own module; torch.multiprocessing re-exports that function.
    sys.modules["torch.multiprocessing.spawn"].start_processes = refused  # type: ignore[attr-defined]
    torch.multiprocessing.start_processes = refused  # type: ignore[assignment]


def print_from_the_script(error: BaseException) -> None:
    """Prints `error` as Python would, its traceback starting at the script's first frame."""
    traceback = error.__traceback__
    while traceback is not None and _is_launching(traceback.tb_frame):
        traceback = traceback.tb_next
    # Python prints the exception's own traceback, whichever one it is handed. None (no frame of the script, as for
    # a SyntaxError in it) prints the exception alone, as `python SCRIPT` does.
    error.__traceback__ = traceback
    sys.excepthook(type(error), error, traceback)


# How gloo says that the other end of a connection went away: a peer died (SIGKILL, the OOM killer) or was ended.
_LOST_PEER = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe")


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` (or an error it wraps) is a collective's transport failing because a peer went away."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, RuntimeError) and _LOST_PEER.search(str(error)):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def said_for_the_launcher(error: BaseException) -> bool:
    """Leaves the launcher what `error` means instead of printing its traceback, where it has nothing to add: a
    sentence that says it all (Explained), said once by the launcher for every rank that raised it; or a lost peer,
    an echo of another worker's end that the launcher names (multigpu.launch.launcher.report_failure)."""
    if not launched():
        return False
    if isinstance(error, Explained):
        note_for_launcher(f"{SAID}{os.environ['RANK']}", str(error))
    elif lost_a_peer(error):
        note_for_launcher(f"{LOST_PEER}{os.environ['RANK']}", "")
    else:
        return False
    return True


def _is_launching(frame: FrameType) -> bool:
    """Whether `frame` is this module's or runpy's: the frames between the worker's main and the script."""
    return frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>")


def _tell_the_heartbeat(error: BaseException | None) -> None:
    """Hands the script's end to the Engine's heartbeat, if an Engine was built (the worker imports no Engine)."""
    progress = sys.modules.get("multigpu.observers.progress")
    if progress is not None:
        progress.script_ended(error)


def main(argv: list[str] | None = None, after: Callable[[], None] | None = None) -> None:
    """Runs the script or module `argv` names (default: this process's arguments), then `after`, if given."""
    if finished_already():
        return  # a restart after every script had finished: nothing to do again (multigpu.launch.exit_watch)
    stop.die_with_launcher()
    stop.end_at_once_on_stop()
    honour_accelerate_use_cpu()
    keep_destroyed_groups()
    refuse_own_processes(int(os.environ.get("WORLD_SIZE", "1")))
    atexit.register(end_process)  # registered first, so it runs after every other exit handler
    atexit.register(destroy_process_groups)
    args = sys.argv[1:] if argv is None else argv
    try:
        if args and args[0] == "-m":
            sys.argv = args[1:]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))  # as `python SCRIPT` would set it
            runpy.run_path(args[0], run_name="__main__")
        if after is not None:
            after()
        _tell_the_heartbeat(None)
    except UsageError as error:  # one sentence, printed once by the launcher: no traceback from every rank
        report_usage_error(error)
        record_exit(2)
        raise SystemExit(2) from None
    except SystemExit as exit_:
        code = exit_.code
        record_exit(code if isinstance(code, int) else (0 if code is None else 1))
        raise
    except BaseException as error:
        _tell_the_heartbeat(error)  # ends the process where the ranks went different ways, in one sentence
        record_exit(1)
        if not usage_error_noted() and not said_for_the_launcher(error):
            # (A peer that lost the rank which raised a UsageError prints nothing: it would only bury that sentence.)
            print_from_the_script(error)
        raise SystemExit(1) from None
    record_exit(0)


if __name__ == "__main__":
    main()
