"""Fault-tolerant replica groups, the launcher's side: the settings refused before anything starts, `multigpu
lighthouse`, and what `multigpu run --replica-groups N` gives each group's workers (scripts that build no Engine,
so nothing here depends on the workers' side)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from multigpu.core.errors import UsageError
from multigpu.core.ports import free_port
from multigpu.core.replica_env import GROUP_ID, GROUPS, LIGHTHOUSE, MIN_REPLICAS
from multigpu.launch import replica_groups
from multigpu.launch.launcher import LaunchConfig, replica_environment, usable_gpus
from multigpu.launch.replica_groups import STARTED_HERE, group_devices, run_code
from tests.dist import ROOT, descendants, multigpu, refusal

# The launches here need no GPU, and two groups of one process each would refuse a machine of one GPU.
CPU = {"CUDA_VISIBLE_DEVICES": ""}
SHOW = f"""
import os, sys
names = {[GROUP_ID, GROUPS, LIGHTHOUSE, MIN_REPLICAS, STARTED_HERE, "RANK", "WORLD_SIZE"]!r}
print("env " + " ".join(f"{{name}}={{os.environ.get(name)}}" for name in names), flush=True)
code = os.environ.get("EXIT_IN_GROUP_" + os.environ[{GROUP_ID!r}])
sys.exit(int(code) if code else 0)
"""


@pytest.fixture
def show(tmp_path: Path) -> str:
    """A script that prints its replica group's variables and exits (EXIT_IN_GROUP_I: that code in group I)."""
    path = tmp_path / "show.py"
    path.write_text(SHOW)
    return str(path)


def shown_env(output: str) -> dict[str, dict[str, str]]:
    """{the line's prefix ("[group 1] " or ""): its variables} of each `env` line the script printed."""
    found = {}
    for prefix, pairs in re.findall(r"^(\[group \d\] )?env (.*)$", output, flags=re.MULTILINE):
        found[prefix] = dict(pair.split("=", 1) for pair in pairs.split())
    return found


def nothing_started(*args: str) -> str:
    """refusal(ARGS), where no group or lighthouse may start either (those start no torchrun in this process)."""

    def started(*_: object) -> None:
        raise AssertionError(f"multigpu {' '.join(args)} started a process")

    with mock.patch.object(replica_groups, "start", started):
        return refusal(*args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replica-groups", "0"], "--replica-groups must be 1 or more (got 0)."),
        (["--replica-groups", "2", "--min-replicas", "3"], "--min-replicas must be in 1..2 for --replica-groups 2"),
        (["--replica-groups", "2", "--min-replicas", "0"], "--min-replicas must be in 1..2 for --replica-groups 2"),
        (
            ["--replica-groups", "2", "--replica-id", "2", "--lighthouse", "node0:29510"],
            "--replica-id must be in 0..1 for --replica-groups 2 (got 2).",
        ),
        (["--replica-groups", "2", "--replica-id", "1"], "pass --lighthouse HOST:PORT of the one"),
        (["--replica-groups", "2", "--lighthouse", "node0:29510"], "pass this launch's --replica-id too"),
        (
            ["--replica-groups", "2", "--replica-id", "0", "--lighthouse", "node0"],
            "--lighthouse 'node0' must be HOST:PORT of a lighthouse",
        ),
        (
            ["--replica-groups", "2", "--replica-id", "0", "--lighthouse", "node0:70000"],
            "--lighthouse 'node0:70000' must be HOST:PORT",
        ),
        (
            ["--replica-groups", "2", "--nnodes", "2", "--master-port", "29500"],
            "A replica group runs on one node here; start one `multigpu run --replica-id I` per node",
        ),
        (["--replica-groups", "2", "--master-port", "29500"], "drop --master-port."),
    ],
)
def test_run_refuses_replica_settings_no_launch_can_run(args: list[str], message: str, show: str) -> None:
    printed = nothing_started("run", *args, "-n", "1", show)
    assert printed.startswith("multigpu: error: ") and message in printed and printed.count("\n") == 1, printed


@pytest.mark.parametrize("verb", ["demo", "train", "finetune"])
def test_the_recipes_ask_for_fault_tolerance_by_name(verb: str, tmp_path: Path) -> None:
    save = [] if verb == "demo" else ["--save-dir", str(tmp_path / "run")]
    printed = nothing_started(verb, "--nproc", "1", "--replica-groups", "2", *save)
    assert "--replica-groups 2 trains the groups under torchft's fault tolerance; add --fault-tolerance." in printed
    assert printed.count("\n") == 1, printed


def test_a_machine_without_torchft_is_told_how_to_install_it(show: str) -> None:
    with mock.patch.dict(sys.modules, {"torchft": None}):  # find_spec then finds nothing, as where it is missing
        for args in (("run", "--replica-groups", "2", "-n", "1", show), ("lighthouse",)):
            printed = nothing_started(*args)
            assert "needs torchft, which is not installed; pip install 'multigpu[ft]'." in printed, printed


def test_the_lighthouse_refuses_settings_it_cannot_serve() -> None:
    assert "--min-replicas must be 1 or more (got 0)." in nothing_started("lighthouse", "--min-replicas", "0")
    assert "--port must be in 1..65535 (got 70000)." in nothing_started("lighthouse", "--port", "70000")


def test_each_group_takes_its_slice_of_the_gpus() -> None:
    def devices(visible: str | None = None, present: int = 4, **settings: object) -> tuple[int, list[str | None]]:
        config = LaunchConfig(replica_groups=2, **settings)  # type: ignore[arg-type]
        return group_devices(config, usable_gpus(config, present, visible))

    assert devices() == (2, ["0,1", "2,3"])
    assert devices(nproc=1) == (1, ["0", "1"])
    assert devices("3,5,6,7", gpu_ids="1,2,3") == (1, ["5", "6"])  # --gpu-ids index what CUDA_VISIBLE_DEVICES shows
    assert devices(present=1, nproc=2, share_gpus=True) == (2, ["0", "0"])
    assert devices(present=0, nproc=3) == (3, [None, None])  # no GPUs: the CPU, as asked
    with pytest.raises(UsageError, match=r"--replica-groups 2 of 2 process\(es\) each need 4 GPUs and 3 are usable"):
        devices(present=3, nproc=2)


def test_the_run_ends_well_where_one_group_finished(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_code([0, 0]) == 0 and not capsys.readouterr().err
    assert run_code([0, 3, 0]) == 0
    assert capsys.readouterr().err == (
        "multigpu run: group 1 ended with exit code 3 while the others finished the run.\n"
    )
    assert run_code([1, 3]) == 1


def answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
        return True
    return False


@contextlib.contextmanager
def started(*args: str) -> Iterator[subprocess.Popen]:
    """`multigpu ARGS` in the background, its output kept; killed with all it started if the block leaves it."""
    argv = [sys.executable, "-m", "multigpu", *args]
    env = {**os.environ, **CPU}
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield process
    finally:
        for pid in [process.pid, *descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.communicate()


def test_the_lighthouse_answers_on_its_port_until_sigterm() -> None:
    port = free_port()
    with started("lighthouse", "--port", str(port), "--bind-address", "127.0.0.1", "--min-replicas", "2") as process:
        deadline = time.monotonic() + 30
        while not answers(port):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=15)
    assert process.returncode == 143, output
    assert "multigpu lighthouse: listening on http://" in output and f":{port} for replica groups (min 2)" in output
    assert output.rstrip().endswith("multigpu lighthouse: stopped by SIGTERM."), output
    assert not answers(port)


def test_one_machine_starts_every_group_with_its_variables_and_then_stops_the_lighthouse(show: str) -> None:
    """Two groups, the second failing (exit 3) while the first finishes: both printed their variables, the run
    says which group failed and ends 0, and the lighthouse it started is gone."""
    env = {"EXIT_IN_GROUP_1": "3", **CPU}
    result = multigpu("run", "--replica-groups", "2", "-n", "1", show, timeout=90, env=env)
    assert result.returncode == 0, result.stdout
    env = shown_env(result.stdout)
    assert set(env) == {"[group 0] ", "[group 1] "}, result.stdout
    for group in (0, 1):
        seen = env[f"[group {group}] "]
        assert seen[GROUP_ID] == str(group) and seen[GROUPS] == "2" and seen[MIN_REPLICAS] == "1", seen
        assert seen[STARTED_HERE] == "1" and seen["RANK"] == "0" and seen["WORLD_SIZE"] == "1", seen
    lighthouse = env["[group 0] "][LIGHTHOUSE]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", lighthouse) and env["[group 1] "][LIGHTHOUSE] == lighthouse
    assert "multigpu run: group 1 ended with exit code 3 while the others finished the run." in result.stdout
    assert not answers(int(lighthouse.rsplit(":", 1)[1])), "the lighthouse outlived the run"


def test_a_cluster_group_is_given_its_id_and_lighthouse(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--replica-id` on one node of a cluster: the variables its workers inherit (the launch above runs the same
    function for each group it starts), the lighthouse as torchft's Manager takes it; a launch of no group takes
    away the variables a launch above it gave."""
    environ = {GROUPS: "5", MIN_REPLICAS: "5"}
    monkeypatch.setattr(os, "environ", environ)
    settings = {"replica_groups": 3, "replica_id": 2, "lighthouse": "node0:29510", "min_replicas": 2}
    replica_environment(LaunchConfig(**settings))  # type: ignore[arg-type]
    assert environ == {GROUP_ID: "2", GROUPS: "3", LIGHTHOUSE: "http://node0:29510", MIN_REPLICAS: "2"}
    replica_environment(LaunchConfig())
    assert environ == {GROUP_ID: "2", LIGHTHOUSE: "http://node0:29510"}  # torchft's own names, perhaps the user's


def test_a_worker_records_its_launch_so_that_its_config_relaunches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from multigpu.recipes.common import as_launched
    from multigpu.recipes.demo import DemoRun

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    group = {GROUP_ID: "1", GROUPS: "2", LIGHTHOUSE: "http://node0:29510", MIN_REPLICAS: "1"}
    for name, value in group.items():
        monkeypatch.setenv(name, value)
    config = as_launched(DemoRun())
    assert (config.replica_groups, config.replica_id, config.lighthouse) == (2, 1, "node0:29510")
    monkeypatch.setenv(STARTED_HERE, "1")  # groups started on one machine: started so again
    config = as_launched(DemoRun())
    assert (config.replica_groups, config.replica_id, config.lighthouse) == (2, None, None)


def test_sigterm_stops_every_group_and_the_lighthouse(tmp_path: Path) -> None:
    """SIGTERM to the run: each group stops its workers and says so, the run ends 143, nothing it started lives on."""
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    with started("run", "--replica-groups", "2", "-n", "1", str(script)) as process:
        assert process.stdout is not None
        lines, deadline = [], time.monotonic() + 60
        while sum("ready" in line for line in lines) < 2:
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            lines.append(process.stdout.readline())
        below = descendants(process.pid)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    output = "".join(lines) + output
    assert process.returncode == 143, output
    for group in (0, 1):
        assert f"[group {group}] multigpu run: stopped by SIGTERM; every worker was stopped." in output, output
    alive = [pid for pid in below if Path(f"/proc/{pid}").exists() and "Z" not in stat_state(pid)]
    assert not alive, f"processes outlived the run: {alive}\n{output}"


def stat_state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return "Z"
