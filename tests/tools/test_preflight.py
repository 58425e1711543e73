"""`multigpu env` on this machine: facts, a real 2-process all-reduce, and advice when something is wrong; and on
two nodes (network namespaces): each node's interface and address, the links within a node and between nodes, and
the files `multigpu simulate` reads."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multigpu.cli import build_parser
from multigpu.config.flags import config_from_args
from multigpu.core.network import INTERFACE_VARIABLES
from multigpu.launch.launcher import LaunchConfig
from multigpu.tools.preflight import EnvConfig
from multigpu.tools.simulate_request import load_calibration
from tests.dist import ROOT, descendants, multigpu, refusal, run_command
from tests.nodes import Cluster, NodesRefused, cluster


def test_reports_the_machine_and_a_working_all_reduce() -> None:
    result = multigpu("env", "--json", "--size-mb", "4", "--iterations", "3", timeout=90)
    assert result.returncode == 0, result.stdout
    report = json.loads(result.stdout[result.stdout.index("{") :])
    # The command sets its OpenMP threads to sleep when idle (a run in its process must not crawl on a busy machine).
    assert "OMP_WAIT_POLICY=PASSIVE" in report["facts"]["variables"], report["facts"]["variables"]
    assert report["facts"]["torch"].startswith("2.")
    assert "skipped: no GPU here" in report["facts"]["GPU checks"]  # says what it cannot check
    smoke = report["smoke_test"]
    assert smoke["world"] == 2 and smoke["backend"] == "gloo" and smoke["correct"]
    assert smoke["busbw_GBps"] == pytest.approx(smoke["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert report["problems"] == []


def test_a_broken_network_setting_fails_with_advice() -> None:
    result = multigpu("env", "--size-mb", "1", env={"GLOO_SOCKET_IFNAME": "nonexistent0"}, timeout=90)
    assert result.returncode == 1
    assert "GLOO_SOCKET_IFNAME=nonexistent0" in result.stdout
    assert "The 2-process all-reduce failed" in result.stdout


def test_bad_input_exits_2() -> None:
    result = multigpu("env", "--nproc", "0")
    assert result.returncode == 2
    assert "--nproc and --iterations must be 1 or more" in result.stdout


def test_the_command_module_leaves_torch_unloaded_until_it_has_set_openmps_idle_policy() -> None:
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads it: `multigpu`'s entry point sets it and only then imports
    the CLI (threads spinning idle made a one-process run crawl on a busy machine; docs/benchmarks.md). The report
    above shows it set; this shows it set in time."""
    probe = "import sys, multigpu.__main__; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = run_command([sys.executable, "-c", probe], timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout


def test_the_node_flags_are_the_launchers() -> None:
    """--nnodes, --node-rank, --master-addr and --master-port are `multigpu run`'s settings, shown: one definition."""
    flags = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29501"]
    args = build_parser("env").parse_args(["env", *flags, "--links-out", "links"])
    config = config_from_args(EnvConfig, args)
    assert (config.nnodes, config.node_rank, config.master_addr, config.master_port) == (2, 1, "10.0.0.1", 29501)
    assert config.launch_config == LaunchConfig(
        nproc=2, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29501
    )
    launcher = {field.name: field for field in dataclasses.fields(LaunchConfig)}
    for field in dataclasses.fields(EnvConfig):
        if field.name in ("nnodes", "node_rank", "master_addr", "master_port"):
            assert field.metadata["help"].startswith(launcher[field.name].metadata["help"]), field.name


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--nnodes", "2"], "Several nodes need the same --master-port on every node"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "29500"], "--node-rank must be in 0..1"),
        (
            ["--nnodes", "2", "--master-port", "70000"],
            "--master-port must be in 1..",
        ),  # the launcher's own check and sentence
        (["--nnodes", "two"], "argument --nnodes: invalid int value"),
        (["--nproc", "1", "--links-out", "{tmp}"], "one process on one node has none; pass --nproc 2 or more"),
        (["--size-mb", "0.5", "--links-out", "{tmp}"], "pass --size-mb 1 or more"),
        (["--links-out", "{tmp}/file"], "is not a directory; pass a directory"),
        (["--links-out", "{tmp}/file/links"], "cannot be made (Not a directory); pass a directory you can write to"),
    ],
)
def test_bad_node_flags_and_links_out_are_refused_in_one_sentence(flags: list[str], said: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    printed = refusal("env", *(flag.format(tmp=tmp_path) for flag in flags))
    assert said in printed, printed
    assert printed.count("\n") == 1 and printed.startswith("multigpu"), printed


# -- two nodes -----------------------------------------------------------------------------------------------------
def test_two_nodes_each_say_their_interface_and_measure_both_links(tmp_path: Path) -> None:
    """`multigpu env` typed on each of two nodes (network namespaces, each its own address), as a user types it:
    each names its interface and address toward node 0 and the all-reduce over both nodes; node 0 lists both nodes
    and writes the two links, which `multigpu simulate` loads."""
    try:
        with cluster(2) as nodes:
            outputs, codes = run_on_nodes(nodes, tmp_path)
    except NodesRefused as refused:
        pytest.skip(str(refused))
    assert codes == [0, 0], outputs
    first, second = nodes.nodes
    master = f"talks to node 0 ({first.address}:29500)"
    for node, output in zip(nodes.nodes, outputs, strict=True):
        assert f"node: {node.index} of 2, {master} on {node.interface} ({node.address})" in output, output
        inter = re.search(
            r"inter-node: all-reduce over 4 processes on 2 nodes, gloo, 16 MB: .*busbw ([\d.]+) GB/s", output
        )
        assert inter and float(inter[1]) > 0, output
        assert (
            f"node {node.index}: {node.interface} ({node.address}); intra-node all-reduce over its 2 processes"
            in output
        )
    assert f"node 1: {second.interface} ({second.address})" in outputs[0]  # node 0 lists every node
    links = tmp_path / "links"
    assert f"wrote {links / 'intra.json'} and {links / 'inter.json'}" in outputs[0], outputs[0]
    assert "node 0 writes them" in outputs[1]
    for name, flag, ranks in (("intra", "--calibration", 2), ("inter", "--inter-calibration", 4)):
        assert json.loads((links / f"{name}.json").read_text())["world_size"] == ranks
        assert load_calibration(links / f"{name}.json", flag)["all_reduce"].bandwidth_Bps > 0


def run_on_nodes(nodes: Cluster, tmp_path: Path, timeout: float = 150) -> tuple[list[str], list[int]]:
    """Each node's `multigpu env`, started together; their outputs and exit codes. Every process they started is
    killed if they outlive `timeout`."""
    # No interface variable is passed on: the launcher finds each node's interface itself.
    env = {k: v for k, v in os.environ.items() if k not in INTERFACE_VARIABLES} | {"OMP_NUM_THREADS": "1"}
    flags = ["--nnodes", "2", "--master-addr", nodes.master.address, "--master-port", "29500", "--nproc", "2"]
    flags += ["--size-mb", "16", "--iterations", "3", "--links-out", str(tmp_path / "links")]
    logs = [tmp_path / f"node{node.index}.log" for node in nodes.nodes]
    processes = []
    for node, log in zip(nodes.nodes, logs, strict=True):
        with log.open("w") as out:
            argv = node.multigpu("env", *flags, "--node-rank", str(node.index))
            processes.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        codes = [process.wait(timeout=max(0.1, deadline - time.monotonic())) for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            for pid in [process.pid, *descendants(process.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()
        printed = "\n".join(log.read_text() for log in logs)
        raise AssertionError(f"multigpu env on two nodes did not finish within {timeout}s:\n{printed}") from None
    return [log.read_text() for log in logs], codes
