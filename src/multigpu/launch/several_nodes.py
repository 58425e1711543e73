"""A run over several machines, one node's part: its workers started once every node has arrived, stopped when a
node is lost, restarted together, and what it says of a lost node (multigpu.launch.heartbeat watches the nodes;
multigpu.launch.launcher starts the workers)."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from multigpu.core.launcher_notes import DIVERGED, LOST_PEER, launcher_note
from multigpu.launch.heartbeat import NodeLost, NodeWatch
from multigpu.launch.stop import checkpoint_note


def run_nodes(start_workers: Callable[[], int], watch: NodeWatch, config: Any) -> int:
    """This node's workers (`start_workers`: one start, its exit code), started once every node has arrived, and
    again (up to --max-restarts) after a failure anywhere: torch's static rendezvous restarts one node alone, which
    its peers never join. `config`: the LaunchConfig."""
    last_checkpoint: str | None = None
    for attempt in range(config.max_restarts + 1):
        try:
            watch.arrive()
        except NodeLost as lost:
            print(f"multigpu run: {lost}.", file=sys.stderr)
            return 1
        with holding_rendezvous_store(config):
            with watch.beating():
                code = start_workers()
            watch.ended("finished" if code == 0 and watch.lost is None else "failed")
            if code == 0 and watch.lost is None:
                watch.linger()
                return 0
        last_checkpoint = watch.last_checkpoint or last_checkpoint
        if attempt < config.max_restarts:
            print(
                f"multigpu run: restarting every node's workers ({attempt + 1} of {config.max_restarts}) once all "
                f"{config.nnodes} nodes are back{f', from {last_checkpoint}' if last_checkpoint else ''}.",
                file=sys.stderr,
            )
    return code or 1


@contextlib.contextmanager
def holding_rendezvous_store(config: Any) -> Iterator[None]:
    """On node 0, serves torch's rendezvous store from this process (its agent shares it) for one start of the
    workers, and past it, until every node has ended its own: the agent alone would close it as it leaves, and a
    node still in torch's exit barrier then fails with a traceback (measured). A new store each start: the workers'
    keys would otherwise meet those of the start before."""
    if config.node_rank != 0:
        yield
        return
    store = dist.TCPStore(
        config.master_addr, config.master_port, None, True, timedelta(seconds=config.join_timeout),
        wait_for_workers=False, multi_tenant=True,
    )  # fmt: skip
    try:
        yield
    finally:
        del store
        gc.collect()  # the agent's reference too (it may sit in a cycle): the server closes with its last one


def a_lost_node_explains(watch: NodeWatch, exits: Path) -> bool:
    """Whether this node's workers failed because a node was lost: one the heartbeat has named, or, where they failed
    for want of a peer, one it names within --node-timeout (a node that died closes its connections at once, before
    its heartbeat is missed)."""
    watch.workers_ended()
    if watch.lost is not None:
        return True
    return peer_trouble(exits) and watch.wait_for_news(diverged_only(exits)) is not None


def peer_trouble(exits: Path) -> bool:
    """Whether a worker of this node failed for want of a peer: it lost its connection to one, or saw the ranks go
    different ways (a peer on a node that died stops posting its calls, which reads as a divergence)."""
    return any(exits.glob(f"{LOST_PEER}*")) or launcher_note(exits, DIVERGED) is not None


def diverged_only(exits: str | Path) -> bool:
    """Whether the workers saw only a divergence (no lost connection): then only a node that stopped beating
    explains it better; a node that failed on its own has seen the same divergence."""
    return not any(Path(exits).glob(f"{LOST_PEER}*"))


def report_lost(watch: NodeWatch, exits: Path) -> int:
    """The one line for a node that was lost: which, what was seen, that this node's workers were stopped."""
    checkpoint = checkpoint_note(exits)
    print(
        f"multigpu run: {watch.lost}; this node's workers were stopped{f'; {checkpoint}' if checkpoint else ''}.",
        file=sys.stderr,
    )
    return 1
