"""The Engine: the few calls a training loop makes, the same for every strategy and number of processes."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset
from torch.utils.flop_counter import FlopCounterMode

from multigpu import checkpoint, harness
from multigpu.data import Batch, DistributedLoader
from multigpu.env import BACKENDS, DistEnv, check_backend, collective_device, init_process_group
from multigpu.errors import UsageError
from multigpu.monitor import MetricsLog, StepMonitor, peak_memory_bytes
from multigpu.planner import choose_strategy
from multigpu.precision import PRECISIONS, Precision
from multigpu.progress import Progress
from multigpu.schedule import SampleSchedule
from multigpu.strategies import STRATEGIES, DataParallel, Strategy, resolve_strategy
from multigpu.strategies.deepspeed import DeepSpeedOptions

UNSHARDED_GRAD_ACCUM_HELP = (
    "zero2/zero3: accumulate whole gradients locally and reduce-scatter once per optimizer step (less "
    "communication, a full gradient per rank) instead of on every micro-step"
)
PEAK_TFLOPS_HELP = "the device's dense peak TFLOPS for MFU (default: looked up by the GPU's exact name)"
FIND_UNUSED_HELP = (
    "ddp/zero1: let some parameters get no gradient in a step (costs a pass over the autograd graph every step)"
)
SYNC_BATCHNORM_HELP = (
    "convert BatchNorm to SyncBatchNorm, so every process normalises with the global batch's statistics "
    "(process-group strategies on GPUs; one process has nothing to synchronise)"
)
STEP_BEFORE_BACKWARD = (
    "engine.step() was called before engine.backward(loss) in this step; call engine.backward(loss) first."
)
REDUCE_OPS = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass
class EngineConfig(DeepSpeedOptions):
    strategy: str = field(
        default="auto", metadata={"help": "how to spread training over processes", "choices": STRATEGIES}
    )
    precision: str = field(default="32", metadata={"help": "number format for training", "choices": PRECISIONS})
    grad_accum_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_grad_norm: float | None = field(default=None, metadata={"help": "clip the global gradient norm to this"})
    seed: int = field(default=0, metadata={"help": "seed for model init and data order (the same on every rank)"})
    cpu_offload: bool = field(default=False, metadata={"help": "keep zero3's sharded parameters in CPU memory"})
    unsharded_grad_accum: bool = field(default=False, metadata={"help": UNSHARDED_GRAD_ACCUM_HELP})
    find_unused_parameters: bool = field(default=False, metadata={"help": FIND_UNUSED_HELP})
    sync_batchnorm: bool = field(default=False, metadata={"help": SYNC_BATCHNORM_HELP})
    backend: str | None = field(
        default=None,
        metadata={"help": "process-group backend (default: nccl on GPUs, gloo on CPU)", "choices": BACKENDS},
    )
    timeout_s: float = field(default=1800.0, metadata={"help": "seconds a collective may wait before the run fails"})
    log_every: int = field(
        default=0, metadata={"help": "report memory, throughput and MFU every N optimizer steps (0: never)"}
    )
    log_dir: str | None = field(default=None, metadata={"help": "also write those reports as JSONL and TensorBoard"})
    peak_tflops: float | None = field(default=None, metadata={"help": PEAK_TFLOPS_HELP})

    def __post_init__(self) -> None:
        # Strategy names are checked where they are resolved (resolve_strategy), precisions by Precision.
        super().__post_init__()
        Precision(self.precision)
        if self.grad_accum_steps < 1:
            raise UsageError(f"grad_accum_steps must be 1 or more (got {self.grad_accum_steps}).")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise UsageError(f"max_grad_norm must be positive (got {self.max_grad_norm}); leave it unset for none.")
        if self.timeout_s <= 0:
            raise UsageError(f"timeout_s must be positive (got {self.timeout_s}).")
        if self.log_every < 0:
            raise UsageError(f"log_every must be 0 or more (got {self.log_every}).")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise UsageError(f"peak_tflops must be positive (got {self.peak_tflops}).")


@dataclass
class _Window:
    """What one optimizer step's micro-batches add up to."""

    busy_s: float = 0.0  # data loading and forward, i.e. the time outside backward and the optimizer step
    samples: int = 0  # real samples in the global batch (engine loader only)
    count: torch.Tensor | None = None  # this rank's units (tokens) when the loss is a sum; see backward
    loss: torch.Tensor | None = None  # this rank's share of the step's loss, when the harness records it
    other_work: bool = False  # a checkpoint, evaluation or FLOP count ran inside this step's time


class Engine:
    def __init__(
        self,
        strategy: str | Strategy = "auto",
        precision: str = "32",
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        seed: int = 0,
        cpu_offload: bool = False,
        unsharded_grad_accum: bool = False,
        backend: str | None = None,
        timeout_s: float = 1800.0,
        log_every: int = 0,
        log_dir: str | None = None,
        peak_tflops: float | None = None,
        zero_stage: int | None = None,
        offload_optimizer: bool = False,
        offload_param: bool = False,
        deepspeed_config: str | None = None,
        find_unused_parameters: bool = False,
        sync_batchnorm: bool = False,
    ) -> None:
        self._harness = harness.active()
        if self._harness is not None:  # bench / verify decide these, whatever the script asks for
            strategy = self._harness.strategy or strategy
            precision = self._harness.precision or precision
            grad_accum_steps *= self._harness.grad_accum_factor
        name = strategy if isinstance(strategy, str) else strategy.name
        deepspeed = DeepSpeedOptions(zero_stage, offload_optimizer, offload_param, deepspeed_config)
        self.config = EngineConfig(
            **asdict(deepspeed),
            strategy=name,
            precision=precision,
            grad_accum_steps=grad_accum_steps,
            max_grad_norm=max_grad_norm,
            seed=seed,
            cpu_offload=cpu_offload,
            unsharded_grad_accum=unsharded_grad_accum,
            backend=backend,
            timeout_s=timeout_s,
            log_every=log_every,
            log_dir=log_dir,
            peak_tflops=peak_tflops,
            find_unused_parameters=find_unused_parameters,
            sync_batchnorm=sync_batchnorm,
        )
        self.env = DistEnv.from_environ()
        self._strategy = resolve_strategy(
            strategy,
            self.env,
            cpu_offload,
            say=self.print,
            deepspeed=deepspeed,
            max_grad_norm=max_grad_norm,
            unsharded_grad_accum=unsharded_grad_accum,
            find_unused_parameters=find_unused_parameters,
            sync_batchnorm=sync_batchnorm,
        )
        self._auto_pending = strategy == "auto" and self.env.is_distributed
        self.precision = Precision(precision)
        self.device = self.env.device
        if self._strategy.needs_process_group:
            backend = backend or self.env.default_backend()
            init_process_group(self.env, backend, timedelta(seconds=timeout_s))
        elif backend is not None:
            check_backend(backend, self.device)
        # The same seed on every rank: models built after this start identical everywhere.
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self._scaler: torch.amp.GradScaler | None = None
        self._micro_steps = 0  # micro-steps since the last optimizer step
        self._backward_ran = False  # since the last engine.step
        self._batch: Batch | None = None  # the engine-loader batch being trained on, if any
        self._loader: DistributedLoader | None = None
        self._train_loader: DistributedLoader | None = None  # the loader whose batches backward last saw
        self._printed_batch_size = False
        self.last_grad_norm: float | None = None
        self.last_step_applied = True  # False after a step that fp16 loss scaling skipped
        self.skipped_steps = 0  # optimizer steps skipped so far for inf/nan gradients (fp16-mixed)
        self._progress = Progress(self.rank, self.world_size, timeout_s)
        self._pending_save: tuple[Future, Path] | None = None  # a background save and where it goes
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._model: nn.Module | None = None
        self._set_up: list[nn.Module] = []  # what setup was given and returned, so a second setup is caught
        self._window = _Window(other_work=True)  # the first step also pays for lazy initialisation
        self._mark = self._step_end = time.perf_counter()
        self._steps = 0
        self._count_flops = False
        self._flop_counter: FlopCounterMode | None = None
        self._log = MetricsLog(Path(log_dir)) if log_dir is not None and self.is_main_process else None
        self._monitor = StepMonitor(
            self.rank, self.world_size, self.device, precision, log_every, self._log, peak_tflops, self.print
        )
        self._recorder: harness.Recorder | None = None
        if self._harness is not None:
            self._recorder = harness.Recorder(self._harness, self.rank)
            harness.on_finish(self._finish_harness)

    # -- who am I ---------------------------------------------------------------------------------------------
    @property
    def strategy(self) -> str:
        """The resolved strategy's name; "auto" with several processes until setup has chosen."""
        return "auto" if self._auto_pending else self._strategy.name

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main_process(self) -> bool:
        return self.env.rank == 0

    # -- setup ------------------------------------------------------------------------------------------------
    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Moves the model to this rank's device and wraps model and optimizer for the strategy.

        Build schedulers on the optimizer returned here (zero1 replaces it with a sharded one).
        """
        if any(model is known for known in self._set_up):
            raise UsageError(
                "engine.setup() was already called on this model; call it once and use the model it returned."
            )
        given = model
        if self._auto_pending:
            self._strategy = self._choose_strategy(model, optimizer)
            self._auto_pending = False
        model = self._batchnorm(model)
        if self.precision.name == "bf16-true":
            model.to(torch.bfloat16)
        model, optimizer = self._strategy.setup(model, optimizer, self.env, self.precision)
        model.forward = self._watched(
            "forward", self.precision.wrap_forward(model.forward, self.device, self._strategy.uses_autocast)
        )
        if self.precision.needs_grad_scaler:
            self._scaler = self._strategy.grad_scaler(self.device)
        self._model = model
        self._set_up += [given, model]
        if self._harness is not None and not self._harness.grad_sync:
            # Entered for good: every backward keeps its gradients local (bench's communication share).
            self._strategy.no_sync(model).__enter__()
        if self._recorder is not None:
            self._recorder.meta = {
                "strategy": self._strategy.name,
                "precision": self.precision.name,
                "world_size": self.world_size,
                "grad_accum_steps": self.config.grad_accum_steps,
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            }
            self._recorder.dump_params("initial_params", model, self._trained_state)
        self._mark = self._step_end = time.perf_counter()
        return model, optimizer

    def _choose_strategy(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Strategy:
        """`auto` with several processes: the planner's fastest strategy that fits this device's memory."""
        if self.device.type == "cuda":
            memory = torch.cuda.get_device_properties(self.device).total_memory
        else:  # the processes of a node share its RAM
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / self.env.local_world_size
        kind = "sgd" if isinstance(optimizer, torch.optim.SGD) else "adamw"  # others counted as Adam (2 states)
        name, reason = choose_strategy(
            model,
            kind,
            gpus=self.env.local_world_size,
            nodes=max(1, self.world_size // self.env.local_world_size),
            gpu_bytes=memory,
            precision=self.precision.name,
            offload_possible=self.device.type == "cuda",
            grad_accum_steps=self.config.grad_accum_steps,
            unsharded_grad_accum=self.config.unsharded_grad_accum,
        )
        self.print(f"strategy auto -> {name}: {reason}")
        fsdp = name.startswith("zero2") or name.startswith("zero3")
        return resolve_strategy(
            "zero3" if name == "zero3+offload" else name,
            self.env,
            name == "zero3+offload",
            unsharded_grad_accum=fsdp and self.config.unsharded_grad_accum,
            find_unused_parameters=self.config.find_unused_parameters,
            sync_batchnorm=self.config.sync_batchnorm,
        )

    def _batchnorm(self, model: nn.Module) -> nn.Module:
        """BatchNorm turned into SyncBatchNorm when asked, else a warning where processes or replicas normalise
        alone. A warning, not engine.print: a run that wants per-process statistics can filter it out."""
        layers = sum(isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm) for m in model.modules())
        if not layers:
            return model
        if self.config.sync_batchnorm and self._strategy.needs_process_group:
            # Keeps the Parameter objects, so an optimizer built before setup stays valid.
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if isinstance(self._strategy, DataParallel):
            parts = f"each of the {torch.cuda.device_count()} GPUs' slices of a batch under dp with that slice's"
            remedy = "use strategy ddp with sync_batchnorm=True (--sync-batchnorm) to synchronise them"
        elif self._strategy.needs_process_group and self.world_size > 1:
            parts = f"each of the {self.world_size} processes' batches under {self._strategy.name} with that process's"
            remedy = "pass sync_batchnorm=True (--sync-batchnorm) to synchronise them"
            if self.device.type != "cuda":
                remedy = "sync_batchnorm=True (--sync-batchnorm) synchronises them when training on GPUs"
        else:
            return model
        if self.is_main_process:  # one warning per run, not one per rank
            warnings.warn(
                f"The model's {layers} BatchNorm layer(s) normalise {parts} own statistics rather than the global "
                f"batch's (running statistics included); {remedy}.",
                stacklevel=3,
            )
        return model

    def dataloader(
        self,
        dataset: Dataset,
        batch_size: int = 32,
        shuffle: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> DistributedLoader:
        """This rank's shard of `dataset`, `batch_size` samples per device, moved to `engine.device`."""
        loader = DistributedLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=num_workers,
            collate_fn=collate_fn,
            rank=self.rank,
            world_size=self.world_size,
            grad_accum_steps=self.config.grad_accum_steps,
            seed=self.config.seed,
            device=self.device,
            on_batch=self._on_batch,
        )
        if not self._printed_batch_size:
            self._printed_batch_size = True
            accum, world = self.config.grad_accum_steps, self.world_size
            self.print(
                f"effective batch size {batch_size * accum * world} = {batch_size} per device x "
                f"{accum} accumulation step{'s' if accum > 1 else ''} x {world} process{'es' if world > 1 else ''}"
            )
        return loader

    def _on_batch(self, loader: DistributedLoader, batch: Batch) -> None:
        self._loader, self._batch = loader, batch
        if self._train_loader is not None and loader is not self._train_loader:
            self._window.other_work = True  # an evaluation pass between two training steps

    # -- the training step ------------------------------------------------------------------------------------
    def _syncs_now(self) -> bool:
        """Whether this micro-step ends the accumulation window (and so must synchronise gradients)."""
        if self._batch is not None:
            return self._batch.ends_window
        return (self._micro_steps + 1) % self.config.grad_accum_steps == 0

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Iterator[None]:
        """Skips gradient communication on every micro-step but the last of an accumulation window, where the
        strategy accumulates that way (zero2/zero3 reduce-scatter every micro-step unless unsharded_grad_accum)."""
        if self._syncs_now() or not self._strategy.accumulates_unsynced:
            yield
        else:
            with self._strategy.no_sync(model):
                yield

    def backward(self, loss: torch.Tensor, count: int | torch.Tensor | None = None) -> None:
        """Backward of `loss` so that each optimizer step's gradient is the mean over its whole global batch.

        Without `count`, `loss` is the mean over this rank's batch; it is weighted by the batch's share of the
        step's samples (exact for uneven last batches and padding with the engine's loader; without it, divided
        by grad_accum_steps). With `count`, `loss` is a *sum* over `count` units (e.g. the tokens that are not
        padding): the step's gradient is then divided by the units of all ranks and micro-batches together,
        the token-normalised loss one process would compute over the same global batch.
        """
        self._window.busy_s += time.perf_counter() - self._mark
        if self._batch is not None:
            self._window.samples += self._batch.global_size
            self._train_loader = self._loader
        summed = count is not None
        if self._micro_steps > 0 and summed != (self._window.count is not None):
            raise UsageError("Pass count= to engine.backward on every micro-step of an optimizer step, or on none.")
        if summed:
            count = torch.as_tensor(count, dtype=torch.float64, device=self.device).detach()
            self._window.count = count if self._window.count is None else self._window.count + count
            # DDP and FSDP average gradients over ranks; the world factor turns that back into a sum.
            weight = float(self.world_size)
            share = loss.detach().double()
        else:
            weight = self._batch.weight if self._batch is not None else 1.0 / self.config.grad_accum_steps
            share = loss.detach().double() * weight / self.world_size
        if self._recorder is not None and self._harness.record_loss:
            self._window.loss = share if self._window.loss is None else self._window.loss + share
        loss = loss * weight
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        self._progress.advance()
        with self._progress.diagnose("backward"):
            self._strategy.backward(self._model, loss, self._syncs_now())
        if self._flop_counter is not None:
            self._flop_counter.__exit__(None, None, None)
            counted = self._flop_counter.get_total_flops()
            self._monitor.flops_per_step = counted * self.config.grad_accum_steps * self.world_size
            self._flop_counter, self._count_flops = None, False
        self._mark = time.perf_counter()
        self._backward_ran = True

    def step(self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None = None) -> bool:
        """On the last micro-step of a window: unscale, clip, step, zero the gradients, advance `scheduler` and
        return True; on the others, return False.

        fp16-mixed skips the update of a step whose gradients overflowed (the loss scale is lowered instead): that
        step still ends its window and returns True, but leaves `scheduler` where it was, so the learning-rate
        schedule follows the updates that happened. `skipped_steps` counts such steps.
        """
        if not self._backward_ran:
            raise UsageError(STEP_BEFORE_BACKWARD)
        self._backward_ran = False
        syncs = self._syncs_now()
        self._batch = None
        if not syncs:
            self._micro_steps += 1
            return False
        self._micro_steps = 0
        with self._progress.diagnose("optimizer step"):
            count, loss = self._window_totals()
            outcome = self._strategy.optimizer_step(
                self._model, optimizer, self._scaler, count, self.config.max_grad_norm
            )
        self._progress.finish_step()
        if outcome.grad_norm is not None:
            self.last_grad_norm = outcome.grad_norm
        self.last_step_applied = outcome.applied
        if not outcome.applied:
            self.skipped_steps += 1
            if isinstance(scheduler, SampleSchedule):
                scheduler.skip(self._window.samples)
        elif scheduler is not None:
            scheduler.step()
        self._end_window(count, loss)
        return True

    def _window_totals(self) -> tuple[float | None, float | None]:
        """The step's units over all ranks (when the loss is a sum) and, for the harness, its global loss."""
        window = self._window
        if window.count is None and window.loss is None:
            return None, None
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        totals = torch.stack([zero if t is None else t for t in (window.count, window.loss)])
        if self._grouped:
            totals = totals.to(collective_device(self.device))
            with self._progress.diagnose("step totals"):
                dist.all_reduce(totals)
        count, loss = totals.tolist()
        if window.count is None:
            return None, loss
        return count, (loss / max(count, 1.0) if window.loss is not None else None)

    def _end_window(self, count: float | None, loss: float | None) -> None:
        """Times the step just ended; feeds the monitor and the harness; stops a harness run when it is done."""
        if self._recorder is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # per-step times for bench must include the queued GPU work
        now = time.perf_counter()
        window, self._window = self._window, _Window()
        seconds, self._step_end = now - self._step_end, now
        self._steps += 1
        tokens = count or 0.0
        self._monitor.add(self._steps, seconds, window.samples, tokens, window.busy_s, not window.other_work)
        if self._steps == 1 and (self._monitor.every or self._recorder is not None):
            # Step 2 counts one micro-step's FLOPs, forward to the end of backward; it is not timed.
            self._window.other_work = True
            self._count_flops = True
        if self._recorder is not None:
            record = {"time_s": seconds, "samples": window.samples, "tokens": tokens, "loss": loss}
            if self._recorder.add({**record, "flops": self._monitor.flops_per_step, "other_work": window.other_work}):
                self._finish_harness()
                raise harness.StopRun()
        self._mark = time.perf_counter()

    def _finish_harness(self) -> None:
        if self._recorder is not None:
            self._recorder.finish(self._model, self._trained_state, peak_memory_bytes(self.device))

    def _trained_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self._strategy.full_state_dict(model, trainable_only=True)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save(
        self, path: str | Path, state: dict[str, Any], async_save: bool = False, keep_last: int | None = None
    ) -> Path:
        """Writes `state` (modules, optimizers, anything with state_dict, plain values, RNG) as a sharded checkpoint.

        Every rank writes its own shards; nothing is gathered onto rank 0. The directory appears only once
        complete. With `async_save` the tensors are copied and written in the background: call
        `wait_for_checkpoint()` before exiting. `keep_last` removes all but the newest K `step-N` siblings.
        """
        self.wait_for_checkpoint()
        self._window.other_work = True
        path = Path(path)
        state = {**state, COUNTERS: _Counters(self)}
        if not async_save:
            with self._progress.diagnose("save"):
                checkpoint.save(path, state, self._strategy)
            if keep_last and self.is_main_process:
                checkpoint.prune(path.parent, keep_last)
            return path
        if self._checkpoint_group is None and self._grouped:
            # Background writes must not share a communicator with the training collectives running meanwhile.
            self._checkpoint_group = dist.new_group(backend="gloo")
        tmp, tensors = checkpoint.begin_save(path, state, self._strategy)
        self.barrier()  # every rank's small files are on disk before rank 0 may commit
        future = dcp.async_save(tensors, checkpoint_id=tmp, process_group=self._checkpoint_group)
        if self.is_main_process:
            # Rank 0's future completes after the metadata, i.e. after every rank's shards are written.
            future.add_done_callback(lambda done: _commit(done, path, keep_last))
        self._pending_save = (future, path)
        return path

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """What this rank writes of `model` into a checkpoint: its trainable weights and buffers, keyed as in the
        unwrapped model (whole tensors, DTensor shards under FSDP2, or this rank's share of the whole tensors under
        DeepSpeed). Every rank must call it: assembling them is a collective."""
        return self._strategy.model_state_dict(model)

    def full_state_dict(self, model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """`model`'s whole weights and buffers (frozen weights left out with `trainable_only`) on rank 0's CPU, an
        empty dict on the other ranks, keyed as in the unwrapped model: for writing a model or adapter out.
        Assembled one tensor at a time, so no device holds more than one whole tensor besides its own shard.
        Every rank must call it."""
        return self._strategy.full_state_dict(model, trainable_only)

    def wait_for_checkpoint(self) -> None:
        """Blocks until a background save has finished (and re-raises its error, if it failed)."""
        if self._pending_save is not None:
            (pending, path), self._pending_save = self._pending_save, None
            try:
                pending.result()
            except (Exception, CheckpointException) as error:
                raise checkpoint.translate_write_error(path, error) from error
            self.barrier()

    def load(self, path: str | Path, state: dict[str, Any]) -> None:
        """Restores `state` in place from a checkpoint written at any world size and with any strategy."""
        self.wait_for_checkpoint()
        self._window.other_work = True
        restored = {**state, COUNTERS: _Counters(self)}
        with self._progress.diagnose("load"):
            checkpoint.load(path, restored, self._strategy, optional=(COUNTERS,))
        state.update({key: restored[key] for key in state})  # plain values are replaced, not loaded in place

    # -- collectives ------------------------------------------------------------------------------------------
    @property
    def _grouped(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def reduce(self, value: float | torch.Tensor, op: str = "mean") -> float | torch.Tensor:
        """`value` combined over all ranks ("mean", "sum" or "max"), returned on every rank as the same type."""
        if op not in REDUCE_OPS:
            raise UsageError(f"Unknown reduce op {op!r}; choose one of {', '.join(REDUCE_OPS)}.")
        if not self._grouped:  # a copy, as with several processes: the caller may change its own in place
            return value.detach().clone() if isinstance(value, torch.Tensor) else value
        is_tensor = isinstance(value, torch.Tensor)
        tensor = value.detach() if is_tensor else torch.tensor(float(value), dtype=torch.float64)
        work = tensor.to(collective_device(self.device), copy=True)
        with self._progress.diagnose("reduce"):
            dist.all_reduce(work, op=REDUCE_OPS[op])
        if op == "mean":
            work = work / dist.get_world_size()
        return work.to(tensor.device) if is_tensor else float(work)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows from every rank, padding removed, in dataset order.

        `tensor`'s rows must belong to the last `len(tensor)` samples this rank's engine loader yielded (a batch's
        outputs, or everything collected over the epoch).
        """
        self._window.other_work = True  # evaluation, usually
        batches = self._loader.yielded if self._loader is not None else []
        owned = [(index, i < batch.real) for batch in batches for i, index in enumerate(batch.indices)]
        if len(tensor) > len(owned):
            raise UsageError(
                f"gather got {len(tensor)} rows but this rank's loader has yielded {len(owned)} samples this "
                "epoch; gather the outputs of samples from engine.dataloader."
            )
        owned = owned[len(owned) - len(tensor) :]
        indices = torch.tensor([index for index, _ in owned], dtype=torch.long)
        real = torch.tensor([is_real for _, is_real in owned], dtype=torch.bool)
        if self._grouped:
            with self._progress.diagnose("gather"):
                tensor, indices, real = (self._all_gather_rows(t) for t in (tensor, indices, real))
        order = torch.argsort(indices[real.to(indices.device)])
        return tensor[real.to(tensor.device)][order.to(tensor.device)]

    def _all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's rows, which may differ in number by rank."""
        world, device = dist.get_world_size(), collective_device(self.device)
        local = tensor.detach().to(device)
        sizes = [torch.zeros((), dtype=torch.long, device=device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor(len(local), device=device))
        longest = int(max(sizes))
        padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=device)
        padded[: len(local)] = local
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        rows = torch.cat([part[: int(size)] for part, size in zip(parts, sizes, strict=True)])
        return rows.to(tensor.device)

    def barrier(self) -> None:
        if self._grouped:
            with self._progress.diagnose("barrier"):
                dist.barrier()

    def _watched(self, op: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def watched(*args: Any, **kwargs: Any) -> Any:
            if self._count_flops and self._flop_counter is None:
                self._flop_counter = FlopCounterMode(display=False)
                self._flop_counter.__enter__()  # left at the end of the backward that follows
            with self._progress.diagnose(op):
                return function(*args, **kwargs)

        return watched

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Writes `record` to log_dir's metrics.jsonl and TensorBoard, on the main process (no-op without log_dir)."""
        if self._log is not None:
            self._log.write(step, record)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs, flush=True)


COUNTERS = "multigpu.engine"  # the engine's own entry in every checkpoint it writes


class _Counters:
    """The engine's counts, saved with each checkpoint so that a resumed run carries them on: the optimizer steps
    its reports, logs and stuck-rank messages number, and the steps fp16 loss scaling skipped."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.engine._steps, "skipped_steps": self.engine.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.engine._steps, self.engine.skipped_steps = int(state["steps"]), int(state["skipped_steps"])
        self.engine._progress.resume_at(self.engine._steps)


def _commit(done: Future, path: Path, keep_last: int | None) -> None:
    done.result()  # a failed write raises here, and never becomes a checkpoint
    checkpoint.commit(path)
    if keep_last:
        checkpoint.prune(path.parent, keep_last)
