"""Runs over several machines, on real network stacks: nodes are network namespaces on this machine (tests/nodes.py),
each with its own address, and nothing tells a worker which interface to use. Skipped where namespaces cannot be
made (not root)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from multigpu.core.ports import free_port
from multigpu.launch.stop import alive
from tests.dist import ROOT, descendants, run_each_in_processes, run_reference
from tests.nodes import Cluster, Node, NodesRefused, cluster
from tests.reference import Case, train_reference
from tests.strategies.test_equivalence import assert_matches

DEMO = ["-n", "1", "-m", "multigpu.recipes.demo", "--epochs", "2"]


@pytest.fixture(scope="module")
def nodes() -> Iterator[Cluster]:
    """Two nodes, shared by every test here (each test leaves their links up)."""
    try:
        with cluster(2) as made:
            yield made
    except NodesRefused as refused:
        pytest.skip(f"no network namespaces on this machine: {refused}")


class Launch:
    """`multigpu ARGS` started on one node; `finish` waits for it, killing its whole tree at the deadline."""

    def __init__(self, node: Node, args: list[str], log: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.pop(name, None)  # the launcher must find the interface itself
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                node.multigpu(*args), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.tree: set[int] = set()

    def watch(self) -> None:
        """Notes the processes it has started so far (to find orphans later)."""
        self.tree |= set(descendants(self.process.pid))

    def workers(self) -> set[int]:
        """Its workers running now, and the processes below them (not the launcher's own helpers)."""
        found = set()
        for pid in descendants(self.process.pid):
            with contextlib.suppress(OSError):
                if b"multigpu.launch.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found |= {pid, *descendants(pid)}
        return found

    def left_behind(self, pids: set[int] | None = None) -> list[int]:
        """Of `pids` (those noted by watch), the ones still alive 5 s on (a killed process may take a moment to be
        reaped)."""
        deadline = time.monotonic() + 5
        while (left := [pid for pid in sorted(self.tree if pids is None else pids) if alive(pid)]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        return left

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [self.process.pid, *descendants(self.process.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(f"did not finish within {timeout} s:\n{self.log.read_text()}") from None
        return self.process.returncode, self.log.read_text()


def on_nodes(nodes: Cluster, args: list[str], tmp: Path, per_node: list[list[str]] | None = None) -> list[Launch]:
    """`multigpu run` on every node at once, node 0 at the first node's address, a fresh port."""
    port = str(free_port())
    launches = []
    for node in nodes.nodes:
        where = ["--nnodes", str(len(nodes.nodes)), "--node-rank", str(node.index)]
        where += ["--master-addr", nodes.master.address, "--master-port", port]
        extra = per_node[node.index] if per_node else []
        launches.append(Launch(node, ["run", *where, *args, *extra], tmp / f"node{node.index}.log"))
    return launches


def accuracies(output: str) -> list[str]:
    return re.findall(r"val accuracy [0-9.]+", output)


def test_two_nodes_find_their_interface_and_train_as_one_machine(nodes: Cluster, tmp_path: Path) -> None:
    """No *_SOCKET_IFNAME set: each node names the interface that reaches node 0, torch's warnings about nameless
    addresses are gone, and the demo's accuracies are those of the same 2 processes on one machine."""
    ended = [launch.finish(120) for launch in on_nodes(nodes, DEMO, tmp_path)]
    one_machine = run_reference(DEMO[3], DEMO[4:], 2)  # `multigpu run -n 2 -m ...` on one machine
    for node, (code, output) in zip(nodes.nodes, ended, strict=True):
        assert code == 0, output
        assert f"node {node.index} of 2 talks to node 0 ({nodes.master.address}:" in output
        assert f"on {node.interface}, {node.address} (GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to" in output
        assert "hostname of the client socket" not in output and "Traceback" not in output
    assert accuracies(ended[0][1]) == accuracies(one_machine) and len(accuracies(one_machine)) == 2


def test_a_node_killed_whole_is_named_by_the_others_in_seconds(nodes: Cluster, tmp_path: Path) -> None:
    """kill -9 of node 1's launcher and workers: node 0's worker sees its peer vanish (which reads as the ranks going
    different ways), and node 0 names the node that was lost instead, within 30 s, without a traceback."""
    launches = on_nodes(nodes, ["--node-timeout", "5", *DEMO[:-1], "1000"], tmp_path)
    deadline = time.monotonic() + 90
    while "epoch 3/" not in launches[0].log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = time.monotonic()
    for pid in [launches[1].process.pid, *descendants(launches[1].process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    code, output = launches[0].finish(60)
    assert time.monotonic() - killed < 30
    assert code == 1, output
    assert output.splitlines()[-1] == (
        "multigpu run: node 1 of 2 (rank 1, 10.231.0.2) was lost: no heartbeat for 5 s; this node's workers were "
        "stopped."
    )
    assert "Traceback" not in output and "went different ways" not in output
    launches[1].process.wait()


def test_a_node_that_never_comes_is_named_when_the_join_timeout_runs_out(nodes: Cluster, tmp_path: Path) -> None:
    """Two of three nodes start: both say how many arrived and which did not; a node whose node 0 never starts says
    that node 0 did not answer."""
    port = str(free_port())
    where = ["--nnodes", "3", "--master-addr", nodes.master.address, "--master-port", port, "--join-timeout", "4"]
    started = [
        Launch(node, ["run", *where, "--node-rank", str(node.index), *DEMO], tmp_path / f"node{node.index}.log")
        for node in nodes.nodes
    ]
    alone = Launch(nodes.nodes[1], ["run", *where[:-4], "--master-port", str(free_port()), "--join-timeout", "2",
                                    "--node-rank", "1", *DEMO], tmp_path / "alone.log")  # fmt: skip
    for code, output in [launch.finish(60) for launch in started]:
        assert code == 1, output
        assert (
            "multigpu run: 2 of 3 nodes arrived within 4 s (--join-timeout); node 2 did not: start it with the same "
            in (output)
        )
    code, output = alone.finish(60)
    assert code == 1 and f"multigpu run: node 0 did not answer at {nodes.master.address}:" in output, output
    assert "within 2 s (--join-timeout): start it (--node-rank 0, the same --master-port)" in output


SCRIPT_SAVING = """
import sys
import torch
import multigpu as mg

engine = mg.Engine(strategy="ddp")
model, optimizer = engine.setup(torch.nn.Linear(4, 2), None)
print("saving", flush=True)
engine.save(sys.argv[1] + "/step-1", {"model": model})
print("saved", flush=True)
"""


def test_a_save_dir_the_nodes_do_not_share_is_named_before_anything_is_written(nodes: Cluster, tmp_path: Path) -> None:
    """Each node's own path (as each node's local disk would be): one sentence on every node, exit code 2."""
    script = tmp_path / "save.py"
    script.write_text(SCRIPT_SAVING)
    dirs = [[str(tmp_path / f"disk{node.index}")] for node in nodes.nodes]
    for code, output in [launch.finish(90) for launch in on_nodes(nodes, ["-n", "1", str(script)], tmp_path, dirs)]:
        assert code == 2, output
        assert "is not one directory every node shares: rank 1 cannot see the file rank 0 wrote there; put it on a" in (
            output
        )
        assert "saved" not in output and "Traceback" not in output


FINETUNE = ["-m", "multigpu.recipes.finetune", "--model", "tiny", "--method", "full", "--multi-gpu", "ddp",
            "--max-steps", "12", "--save-every", "4", "--seq-len", "32", "--batch-size", "2",
            "--log-every", "1"]  # fmt: skip


def test_a_restart_after_the_link_returns_ends_with_the_uninterrupted_weights(nodes: Cluster, tmp_path: Path) -> None:
    """--max-restarts 1: the link goes down at step 6 (a pulled cable: no collective fails, gloo would wait for its
    30-minute timeout), and both nodes stop within 30 s, each naming the other node, no traceback, no worker of the
    first start left; they arrive again once it is back and resume from step 4's checkpoint; the model written at
    the end is the uninterrupted run's on one machine, bitwise (the same 2 ranks, the same sums).

    (A pulled cable without restarts was a launch of its own: this one's first start ends as that one did, the two
    lines within 30 s, every worker gone, no traceback. Only the branch multigpu.launch.several_nodes takes next
    differs; its other branch, a node's exit code 1 once no restart is left, is the kill test's, above.)"""
    save = tmp_path / "run"
    args = ["--max-restarts", "1", "--node-timeout", "5", "-n", "1", *FINETUNE, "--save-dir", str(save)]
    launches = on_nodes(nodes, args, tmp_path)
    deadline = time.monotonic() + 120
    while not re.search(r"^step 6 ", launches[0].log.read_text(), re.M) and time.monotonic() < deadline:
        time.sleep(0.1)
    for launch in launches:
        launch.watch()
    first_start = [launch.workers() for launch in launches]
    nodes.link(nodes.nodes[1], up=False)
    down = time.monotonic()
    try:
        while not all("restarting" in launch.log.read_text() for launch in launches) and time.monotonic() < deadline:
            time.sleep(0.2)
        took = time.monotonic() - down
        left = [
            pid for launch, workers in zip(launches, first_start, strict=True) for pid in launch.left_behind(workers)
        ]
    finally:
        nodes.link(nodes.nodes[1], up=True)
    ended = [launch.finish(180) for launch in launches]
    orphans = [pid for launch in launches for pid in launch.left_behind()]  # the first start's tree, all of it
    run_reference(FINETUNE[1], [*FINETUNE[2:], "--save-dir", str(tmp_path / "reference")], 2, timeout=180)
    out0, out1 = (output for _, output in ended)
    assert took < 30, f"the nodes stopped {took:.0f} s after the link went down:\n{out0}\n{out1}"
    assert all(first_start) and not left, f"workers of the first start left behind as it restarted: {left}"
    assert not orphans, f"processes left behind: {orphans}"
    assert (
        "multigpu run: node 1 of 2 (rank 1, 10.231.0.2) was lost: no heartbeat for 5 s; this node's workers were "
        f"stopped; the last complete checkpoint is {save / 'checkpoints' / 'step-00000004'}.\n" in out0
    )
    assert (
        "multigpu run: node 0 of 2 (rank 0, 10.231.0.1) was lost: it did not answer for 5 s; this node's workers were "
        "stopped.\n" in out1
    )
    assert "Traceback" not in out0 + out1
    for code, output in ended:
        assert code == 0, output
        assert "restarting every node's workers (1 of 1) once all 2 nodes are back" in output
    assert "resumed from " in out0 and "step-00000004" in out0
    got, want = (load_file(next(Path(run, "model").glob("*.safetensors"))) for run in (save, tmp_path / "reference"))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


CELLS = [Case("ddp"), Case("zero3"), Case("hsdp", replicate=2)]


def test_strategies_across_nodes_compute_what_one_process_does(nodes: Cluster) -> None:
    """2 nodes x 2 processes, each rank in its node's namespace (the Engine finds the interface): ddp, zero3 and hsdp
    (shards inside a node, replicas across) against the one-process reference, within fp32's 1e-5 (test_equivalence's
    bound); and the demo's MLP in 2 pipeline stages, one per node (pp crosses the nodes; 2 hsdp replicas inside each
    stage), on one process's loss and accuracy within test_model_parallel's bounds."""
    calls = [{"function": "tests.reference:train_engine", "kwargs": {"case": case}} for case in CELLS]
    calls.append({"function": "tests.strategies.test_model_parallel:run_cells", "kwargs": {
        "workdir": "", "runs": [], "demos": ["hsdp-x-pp"]}})  # fmt: skip
    names = [node.namespace for node in nodes.nodes]
    outcomes = run_each_in_processes("tests.launch.test_nodes:call", 4, calls, timeout=240, nodes=names)
    for index, case in enumerate(CELLS):
        assert_matches(case, outcomes[0][index], train_reference(case, world_size=4))
    import multigpu as mg
    from multigpu.recipes import demo
    from tests.strategies.test_model_parallel import DEMOS

    _, settings, demo_settings = DEMOS["one-process-10-rows"]
    loss, accuracy = demo.train(mg.Engine(**settings), demo.DemoConfig(**demo_settings))
    split_loss, split_accuracy = outcomes[0][-1]["demo hsdp-x-pp"]
    assert split_loss == pytest.approx(loss, rel=1e-3) and abs(split_accuracy - accuracy) <= 2 / 1024


def call(function: str, kwargs: dict) -> object:
    from multigpu.core.lazy import imported

    return imported(function)(**kwargs)
