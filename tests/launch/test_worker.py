"""The worker's bootstrap, in this process: accelerate's PartialState() honours ACCELERATE_USE_CPU whether accelerate
was imported before the worker ran (as in a worker forked from a process that had imported it: the tests' commands)
or is imported by the script (a fresh interpreter)."""

import importlib.util
import sys

import pytest

from multigpu.launch import worker


def test_partial_state_is_told_cpu_whether_accelerate_was_imported_before_or_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import accelerate.state

    told = []
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setattr(accelerate.state.PartialState, "__init__", lambda self, cpu=False: told.append(cpu))
    worker.honour_accelerate_use_cpu()  # imported already: patched at once
    accelerate.state.PartialState()
    assert told == [True]

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "accelerate.state")
    worker.honour_accelerate_use_cpu()  # not imported yet: patched as it is imported
    spec = sys.meta_path[0].find_spec("accelerate.state", accelerate.__path__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)  # a module of its own: the imported one stays as it was
    for name in ("LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # one process: no group to join
    assert fresh.PartialState()._cpu  # False unless told: no accelerator here, and cpu defaults to False
