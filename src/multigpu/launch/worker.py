"""What each process started by `multigpu run` executes: the user's script, unchanged, then a clean exit.

    python -m multigpu.launch.worker SCRIPT [ARGS...]
    python -m multigpu.launch.worker -m MODULE [ARGS...]

(`multigpu bench` and `multigpu verify` run a script through multigpu.tools.harness, which prepares the process and
then hands over to `main` here.)

Why: if a process group is still alive when Python finalises, gloo's run-loop threads can release their last
tensors after the interpreter has started shutting down; taking the GIL then kills the thread and aborts the
process ("terminate called without an active exception", exit 134) after the work has finished. Measured with
torch 2.13 on CPU: 2 in 30 runs of a script that never calls destroy_process_group, 6 in 30 of one that raises.
Destroying the groups in an atexit handler, while the interpreter is whole, closes that window for the groups;
threads of other libraries (DeepSpeed's among them) can still be running when the interpreter finalises. So once
every exit handler has run, the worker flushes every open file and ends the process with the script's exit code,
without finalising the interpreter: the work and its output are complete, and no library thread can race the
teardown of the objects it uses.

Before the script runs, the worker also arranges to die with its launcher and to end at once when the launcher
stops it (multigpu.launch.stop), makes accelerate's PartialState use the CPU where Accelerator does, and refuses
torch.multiprocessing.spawn in a group of several (below). A script's uncaught exception is printed from the
script's own first frame: the worker's and runpy's frames above it say nothing to the script's author.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib.abc
import importlib.machinery
import io
import os
import runpy
import sys
import time
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any, NoReturn

import torch.multiprocessing

from multigpu.core.env import destroy_process_groups
from multigpu.core.errors import UsageError, report_usage_error
from multigpu.core.notes import LAUNCHER_DIR, usage_error_noted
from multigpu.launch import stop

_exit_code = 1  # what the process ends with unless the script finishes: an unhandled exception's code


def record_exit(code: int) -> None:
    """Notes when and how the script ended, so the launcher can tell the first failure from its echoes."""
    global _exit_code
    _exit_code = code
    folder = os.environ.get(LAUNCHER_DIR)
    if folder and "RANK" in os.environ:
        with open(os.path.join(folder, f"rank{os.environ['RANK']}"), "w") as file:
            file.write(f"{time.time_ns()} {code}")


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

    `multigpu run` sets ACCELERATE_USE_CPU=true on machines without CUDA GPUs (launch.use_cpu_for_accelerate).
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


def _is_launching(frame: FrameType) -> bool:
    """Whether `frame` is this module's or runpy's: the frames between the worker's main and the script."""
    return frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>")


def main(argv: list[str] | None = None, after: Callable[[], None] | None = None) -> None:
    """Runs the script or module `argv` names (default: this process's arguments), then `after`, if given."""
    stop.die_with_launcher()
    stop.end_at_once_on_stop()
    sys.meta_path.insert(0, AccelerateOnCpu())
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
    except UsageError as error:  # one sentence, printed once by the launcher: no traceback from every rank
        report_usage_error(error)
        record_exit(2)
        raise SystemExit(2) from None
    except SystemExit as exit_:
        code = exit_.code
        record_exit(code if isinstance(code, int) else (0 if code is None else 1))
        raise
    except BaseException as error:
        record_exit(1)
        if not usage_error_noted():
            # (A peer that lost the rank which raised a UsageError prints nothing: it would only bury that sentence.)
            print_from_the_script(error)
        raise SystemExit(1) from None
    record_exit(0)


if __name__ == "__main__":
    main()
