"""Fault tolerance across replica groups on torchft: the Engine's side of it.

A replica group is one launch of the run's processes (`multigpu run --replica-groups N`, multigpu.launch); inside
it the strategy runs as usual (ddp, or FSDP2's shards under hsdp), and across the groups torchft's Manager forms a
quorum of the groups alive at every optimizer step, averages their gradients and has every group vote on the
commit. A group that dies costs the others one step run again, never a restart: its launcher restarts it, and it
heals by copying a live group's state over the network before it trains again.

What keeps it exact (torchft alone trains the alive groups' shares and drops the dead one's): each step's global
batch is every group's batches together (batch_size x ranks x N), split among the ranks of the groups in that
step's quorum (the loader's `set_split`), and a step whose commit failed runs again on the same global batch
(`rewind_window`). So a run that loses a group trains on the samples of the run that did not, each step's gradient
the mean over them. The quorum is asked as the loader plans a window's first batch; which step it is, the weights,
the optimizer's and scheduler's states, the loaders' positions and the script's counters (`engine.heal_with`) are
what a healing group copies.

torchft is imported here only, and this module only where a run asks for fault tolerance.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn

from multigpu.core import faults
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.core.launcher_notes import attempt
from multigpu.core.lazy import is_dtensor
from multigpu.core.network import interface_environment, route_to
from multigpu.core.replica_env import ReplicaGroup
from multigpu.core.tensor_trees import map_tensors

BUCKET_BYTES = 25 * 2**20  # gradients averaged across groups a bucket at a time, as DDP's buckets
QUORUM_TIMEOUT_S = 60.0  # a quorum waits this long for enough groups (the lighthouse's heartbeat timeout is 5 s)
FIRST_QUORUM_POLL_S = 0.2
# The first step waits for every group this many quorums (a minute at least), counted in quorums rather than seconds
# because every rank of a group asks for each of them: its ranks stop waiting at the same one.
FIRST_QUORUM_TRIES = int(QUORUM_TIMEOUT_S / FIRST_QUORUM_POLL_S)


class Replicas:
    """This process's replica group and torchft's Manager for it; see the module's doc."""

    def __init__(self, group: ReplicaGroup, env: DistEnv, timeout_s: float, state: Callable[[], dict[str, Any]]):
        quiet_torchft()
        try:
            import torchft  # noqa: F401
        except ImportError:
            raise UsageError("Fault tolerance runs on torchft; pip install 'multigpu[ft]'.") from None
        self.group = group
        self.quorum = group.groups  # replica groups in the last quorum
        self.place = 0  # this group's place in it
        self.reruns = 0  # steps run again so far, for a failed commit
        self.healed_at: int | None = None  # the step this group healed at, once
        self.unplaced: dict[str, Any] = {}  # healed state with no place yet: the Engine places it when it can
        self._state, self._env, self._timeout = state, env, timedelta(seconds=min(timeout_s, 60.0))
        self._meeting: dist.TCPStore | None = None  # where the groups meet (group rank 0's, at its first quorum)
        self._manager: Any = None

    @property
    def manager(self) -> Any:
        """torchft's Manager, made at the first quorum: its heartbeat starts then, not while the model loads. A
        group that heartbeats and has not asked for a quorum yet holds back the others' (a majority of the groups
        that heartbeat must agree), so a group starting again would stop them for as long as it loads."""
        if self._manager is None:
            self._manager = self._new_manager()
        return self._manager

    def _new_manager(self) -> Any:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.http_transport import HTTPTransport

        group, env, timeout = self.group, self._env, self._timeout
        route = route_to(urlparse(group.lighthouse).hostname or "127.0.0.1", "--lighthouse")
        address = route.address  # what the other groups reach this node at (not the hostname's loopback)
        os.environ.update(interface_environment(route))  # gloo and NCCL across groups: that interface's address
        port = self._meeting_port(address)

        class Transport(HTTPTransport):  # healing fetches from the address that routes, not gethostname()'s
            def __init__(self, **settings: Any) -> None:
                super().__init__(**settings)
                self._server.RequestHandlerClass.log_message = lambda *args: None  # a line per request otherwise

            def address(self) -> str:
                return f"http://{address}:{self._server.socket.getsockname()[1]}/checkpoint/"

        pg = ProcessGroupNCCL(timeout=timeout) if env.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=group.min_replicas,
            use_async_quorum=False,  # a healing group then trains its share in the step it joins (async: zeros)
            timeout=timeout,
            quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
            rank=env.rank,
            world_size=env.world_size,
            store_addr=address,  # the group's rank 0 serves it, and the quorum's first group's is where all meet
            store_port=port,
            lighthouse_addr=group.lighthouse,
            replica_id=f"multigpu_{group.group_id:04d}",  # the quorum ranks groups in the order of their ids
            hostname=address,
            checkpoint_transport=Transport(timeout=timeout, num_chunks=0),
        )
        manager.register_state_dict_fn("multigpu", self._load, self._save)
        return manager

    def _meeting_port(self, address: str) -> int:
        """The port of a store group rank 0 serves for torchft at `address`, told to the group's ranks. Not the
        group's own store: torchrun's listens where the group's ranks reach it, not where the other groups do."""
        if self._env.rank == 0:
            self._meeting = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
        port = [self._meeting.port if self._meeting is not None else 0]
        if dist.is_initialized():
            dist.broadcast_object_list(port, src=0)
        return port[0]

    # -- a step ---------------------------------------------------------------------------------------------
    def begin_step(self) -> tuple[int, int]:
        """Forms this step's quorum (healing this group first if it is behind); returns this group's place among
        the groups in it and how many they are."""
        first = self.manager.current_step() == 0
        for tries in itertools.count():
            self._start_quorum()
            alive = self.manager.num_participants()
            if not self._waits_for_every_group(first, alive, tries):
                break
            time.sleep(FIRST_QUORUM_POLL_S)
        step = self.manager.current_step()
        if step > 0 and first:
            self.healed_at = step
            self._say(f"healed from a live replica group at step {step}, without reading a checkpoint")
        if alive != self.quorum:
            self._say(f"{alive} of {self.group.groups} replica groups train step {step + 1}")
        self.quorum, self.place = alive, self.manager.participating_rank() or 0
        faults.inject("quorum", step, self._env.rank)  # tests' MULTIGPU_FAULT: a group lost inside a step
        return self.place, alive

    def _waits_for_every_group(self, first: bool, alive: int, tries: int) -> bool:
        """Whether to ask for this step's quorum again. A run's first step waits for every group, so that none
        starts from other weights; a group started again after the others trained has healed past step 0 by now.
        Asked again without a vote in between: torchft copies the first group's weights to the others in every
        quorum at step 0, and a vote stops serving them (a copy still under way would wait a minute for the next)."""
        if not first or self.manager.current_step() > 0 or alive >= self.group.groups:
            return False
        if attempt() > 0 and alive == 1:
            raise UsageError(
                f"Replica group {self.group.group_id} started again, and no live replica group has trained to "
                "heal it from (they finished or are gone); restart the run from its last checkpoint."
            )
        return tries < FIRST_QUORUM_TRIES  # then the groups that came train the whole global batch together

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as error:  # torchft raises a TimeoutError or a RuntimeError from its Rust client
            raise UsageError(self._quorum_failure(error)) from None

    def _quorum_failure(self, error: Exception) -> str:
        lighthouse = urlparse(self.group.lighthouse)
        step = self.manager.current_step()
        try:
            socket.create_connection((lighthouse.hostname, lighthouse.port), timeout=3).close()
        except OSError:
            return (
                f"The lighthouse at {lighthouse.netloc} stopped answering at step {step}; start it again "
                "(multigpu lighthouse) and restart the run from its last checkpoint."
            )
        return (
            f"Fewer than --min-replicas {self.group.min_replicas} replica group(s) were alive for "
            f"{QUORUM_TIMEOUT_S:g} s at step {step} ({type(error).__name__}); restart the lost groups, or lower "
            "--min-replicas."
        )

    def average(self, model: nn.Module) -> None:
        """Averages the gradients (this rank's local part of them) with the same rank of every other group."""
        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.manager.allreduce(flat).wait()
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def sum(self, totals: torch.Tensor) -> torch.Tensor:
        """`totals` summed over the groups in the quorum."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(totals, reduce_op=ReduceOp.SUM).wait()
        return totals

    def commit(self) -> bool:
        """Whether every rank of this group may step (its collectives with the other groups all succeeded)."""
        error = self.manager.errored()
        committed = self.manager.should_commit()
        if not committed:
            self.reruns += 1
            cause = error.original_exception if error is not None else None
            words = str(cause).split("] ", 1)[-1].split(". ")[0] if cause else "a group of the quorum voted no"
            self._say(
                f"step {self.manager.current_step() + 1} runs again on the same global batch: a collective with the "
                f"other replica groups failed ({words})"
            )
        return committed

    def _say(self, text: str) -> None:
        if self._env.rank == 0:  # each group's first rank
            print(f"multigpu: replica group {self.group.group_id}: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)

    # -- healing --------------------------------------------------------------------------------------------
    def _save(self) -> dict[str, Any]:
        return _saved(self._state())

    def _load(self, saved: dict[str, Any]) -> None:
        self.unplaced = _load_into(self._state(), saved)


def quiet_torchft() -> None:
    """Keeps torchft's own lines off the screen: the Rust side's INFO line per quorum and commit (RUST_LOG), its
    warning that a CPU build has no NCCL flight recorder to reset, and its traceback of a collective that failed
    with a lost group (`commit` says that in one line, with the error's own words)."""
    os.environ.setdefault("RUST_LOG", "warn")
    said = ("flight recorder", "got exception")
    logging.getLogger("torchft.manager").addFilter(lambda record: not any(s in record.getMessage() for s in said))
    # The healed state arrives in a read-only buffer that is copied into the live tensors at once.
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)


def _buckets(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        if bucket and (size + tensor.numel() * tensor.element_size() > BUCKET_BYTES or tensor.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


def _saved(value: Any) -> Any:
    """What a healing group receives of `value`: local tensors (every group shards alike), states, plain values."""
    if type(value) is dict:
        return {key: _saved(item) for key, item in value.items()}
    if isinstance(value, nn.Module):
        return {key: local_tensor(tensor).detach().cpu() for key, tensor in value.state_dict().items()}
    if isinstance(value, torch.optim.Optimizer):
        return map_tensors(value.state_dict(), lambda tensor: local_tensor(tensor).detach().cpu())
    if hasattr(value, "state_dict"):
        return value.state_dict()
    return value


def _load_into(state: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """Copies `saved` into `state` in place (tensors into the live ones, states through load_state_dict, plain
    values replaced); returns what `state` has no place for yet (a scheduler first seen at the next step)."""
    unplaced: dict[str, Any] = {}
    for name, entry in saved.items():
        value = state.get(name)
        if type(value) is dict and type(entry) is dict:
            unplaced |= {f"{name}/{key}": item for key, item in _load_into(value, entry).items()}
        elif isinstance(value, nn.Module):
            with torch.no_grad():
                for key, tensor in value.state_dict().items():
                    local_tensor(tensor).copy_(entry[key])
        elif isinstance(value, torch.optim.Optimizer):
            value.load_state_dict(_placed_like(value, entry))
        elif hasattr(value, "load_state_dict"):
            value.load_state_dict(entry)
        elif name in state or type(entry) is not dict:
            state[name] = entry
        else:
            unplaced[name] = entry
    return unplaced


def _placed_like(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """`saved`'s local tensors made into tensors shaped as each parameter is (DTensor shards under FSDP2)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    states = {}
    for index, entry in saved["state"].items():
        param = params[int(index)]
        states[index] = {
            key: DTensor.from_local(
                t.to(param.device),
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
            if isinstance(param, DTensor) and isinstance(t, torch.Tensor) and t.dim() > 0
            else t
            for key, t in entry.items()
        }
    return {**saved, "state": states}


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor` (a DTensor's local shard, which shares its storage), or `tensor` itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
