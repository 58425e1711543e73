"""The Engine: the few calls a training loop makes, the same for every strategy and number of processes.

What is specific to a strategy lives in its file (multigpu.strategies); what watches the run (the stuck-rank
heartbeat, the metrics monitor, bench and verify's recorder) attaches through multigpu.observers.observe.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from multigpu.config.layout import AUTO
from multigpu.config.precision import Precision
from multigpu.core import faults
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.core.replica_env import ReplicaGroup
from multigpu.data.iterable import make_loader
from multigpu.data.loader import Batch
from multigpu.data.stream import Loader, WindowedStream
from multigpu.engine import model_values, start
from multigpu.engine.balance import Balancer
from multigpu.engine.config import EngineConfig
from multigpu.engine.cross_rank import AcrossRanks
from multigpu.engine.lr_schedule import SampleSchedule
from multigpu.engine.micro_step import MicroSteps
from multigpu.engine.parallelize import parallelize
from multigpu.engine.replica_steps import ReplicaSteps
from multigpu.engine.saving import Saving
from multigpu.engine.window import Window, accumulation_for
from multigpu.observers.observe import Hooks, Reporting, StepObserver, StepStats, new_observers, watched, watching
from multigpu.optimizers.build import build_optimizer
from multigpu.parallel.experts import MixtureOfExperts
from multigpu.strategies import Strategy
from multigpu.transforms.float8 import refresh_all_gather_scales
from multigpu.transforms.loss import TokenLoss
from multigpu.transforms.modules import on_meta
from multigpu.transforms.pretrained import SafetensorsCheckpoint


class Engine(MicroSteps, Saving, Reporting, AcrossRanks, ReplicaSteps):
    def __init__(
        self, strategy: str | Strategy = "auto", *, observers: Sequence[StepObserver] = (), **settings: Any
    ) -> None:
        """`strategy`: a name or a configured Strategy; `settings`: any other field of EngineConfig (precision,
        grad_accum_steps, max_grad_norm, seed, ...; see its help texts); `observers`: StepObservers of the
        script's own, after the registered ones (multigpu.observers.observe)."""
        self.observers = [*new_observers(), *observers]
        config = EngineConfig.of(strategy if isinstance(strategy, str) else strategy.name, settings)
        for observer in self.observers:  # bench and verify decide some settings, whatever the script asks for
            config = observer.configure(config)
        group = ReplicaGroup.from_environ()  # this process's replica group under fault tolerance, else None
        self.config = config = start.with_replicas(replace(config), group)  # checked again: observers change it
        self.env = DistEnv.from_environ()
        self._strategy = start.resolve(strategy, self.env, config, self.print)
        self._auto_pending = config.strategy == "auto" and self.env.is_distributed
        self.precision = Precision(config.precision)
        self._plan = start.precision_plan(self._strategy, config, self.env)
        self.device = self.env.device
        start.join(self.env, self._strategy, config)
        self._scaler: torch.amp.GradScaler | None = None
        # Which batch this rank reads, among how many: the ranks of one replica's tp and pp groups read the same one.
        layout = self._strategy.layout
        self._data_rank, self._data_world = layout.data_parallel_rank(self.env.rank), layout.data_parallel_size
        self._group_rank, self._group_world = self._data_rank, self._data_world
        self._ft_loaders, self._ft_optimizers = [], []
        if group is not None:  # the loaders split the batches of every group's ranks (engine/replicas.py)
            self._replicas = start.replicas(group, self.env, config, self._heal_state)
            self._data_rank += group.group_id * self._data_world
            self._data_world *= group.groups
        self._cp = start.context_parallel(self._strategy, config)
        wants_loss = any(observer.wants_loss for observer in self.observers)
        # The ranks whose gradients are averaged: the data-parallel ones and, each with its own tokens, the cp ones.
        self._window = Window(config.grad_accum_steps, self._data_world, self.device, wants_loss, layout.cp)
        auto_shares = config.batch_shares.strip() == AUTO
        self._balance = (
            Balancer(layout, self.env.rank, self.env.world_size, self.device, self.print) if auto_shares else None
        )
        self._backward_ran = False  # since the last engine.step
        self._lm_loss_made = False  # engine.lm_loss made the loss function a loss setting other than plain needs
        self._loader: Loader | None = None
        self._train_loader: Loader | None = None  # the loader backward last saw
        self._printed_batch_size = False
        self.last_grad_norm: float | None = None
        self.last_step_applied = True  # False after a step that fp16 loss scaling skipped
        self.skipped_steps = 0  # optimizer steps skipped so far for inf/nan gradients (fp16-mixed)
        self._init_rng: torch.Tensor | None = None  # the random stream where init_module's build began
        self._pretrained: dict[int, SafetensorsCheckpoint] = {}  # load_pretrained's, by model, until setup
        self._model: nn.Module | None = None
        self._experts: MixtureOfExperts | None = None  # the model's mixture of experts, found by setup
        self._set_up: list[nn.Module] = []  # what setup was given and returned, so a second setup is caught
        self._built_optimizers: list[torch.optim.Optimizer] = []  # engine.optimizer's, which setup accepts
        self._step_end = time.perf_counter()
        self._steps = 0
        self._faults = "MULTIGPU_FAULT" in os.environ  # a test's fault, set before the Engine is built: read once
        self._synchronizes = any(observer.synchronizes for observer in self.observers)
        for observer in self.observers:
            observer.attach(self)
        self._hooks = Hooks(self.observers)  # the observers are fixed from here on

    # -- who am I ---------------------------------------------------------------------------------------------
    @property
    def strategy(self) -> str:
        """The resolved strategy's name; "auto" with several processes until setup has chosen."""
        return "auto" if self._auto_pending else self._strategy.name

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one micro-step trains on (replicate x shard; a tp or pp group shares one):
        the loader's batch_size is per data-parallel rank, so a global batch is batch_size x this x accumulation."""
        return self._data_world

    @property
    def data_parallel_rank(self) -> int:
        """Which of the data_parallel_size batches of a micro-step this rank reads."""
        return self._data_rank

    @property
    def batch_shares(self) -> tuple[float, ...]:
        """Each data-parallel rank's fraction of every global batch (ParallelDims.batch_fractions; under
        batch_shares auto, the split it settled on so far)."""
        moved = self._balance.fractions if self._balance is not None else None
        return moved or self._strategy.layout.batch_fractions

    @property
    def batch_speeds(self) -> tuple[str, list[float]] | None:
        """Under batch_shares auto, after its first check: what each data-parallel rank's speed is measured in
        (samples_per_s on CPUs, probe_tflops on GPUs), and its speeds."""
        balance = self._balance
        return None if balance is None or balance.speeds is None else (balance.speed_unit, balance.speeds)

    def batch_shares_summary(self) -> str | None:
        """Under batch_shares auto, once: the split the run settled on and the step time it saved (measured)."""
        return self._balance.summary() if self._balance is not None else None

    @property
    def sequence_multiple(self) -> int:
        """What each batch's sequence length must be a multiple of (ParallelDims.sequence_multiple). Pad each batch
        to it, on the right, with the padding masked out of the loss, as `multigpu finetune` does."""
        return self._strategy.layout.sequence_multiple(self.config.sequence_parallel)

    @property
    def experts(self) -> MixtureOfExperts | None:
        """The model's mixture of experts once set up (`experts.metrics()`), None for a dense model."""
        return self._experts

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
        start.check_optimizer(self.config, optimizer, self._built_optimizers)
        if self._auto_pending:
            self._strategy = start.strategy_for(model, optimizer, self.env, self.config, self.print)
            self._plan = start.precision_plan(self._strategy, self.config, self.env)
            self._auto_pending = False
        build = (self._init_rng, self._pretrained.pop(id(model), None))
        model, optimizer, self._experts = parallelize(
            self._strategy, model, optimizer, self.env, self._plan, self.config, build, self.print, self._cp
        )
        model.forward = watched(self._hooks.watchers, "forward", self._plan.wrap_forward(model.forward, self.device))
        self._scaler = self._plan.scaler() if self._plan.scaler is not None else None
        self._model = model
        self._ft_optimizers += [optimizer] if optimizer is not None else []
        self._set_up += [given, model]
        for observer in self.observers:
            observer.on_setup(model)
        self._hooks = Hooks(self.observers)  # found again: an observer leaves out the hooks of a feature that is off
        self._window.mark = self._step_end = time.perf_counter()
        return model, optimizer

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """The optimizer the `optimizer` setting names, with its settings, over `model`'s trainable parameters at
        `lr` (muon: the matrices to Muon, the rest to AdamW); pass it to setup with the model."""
        built = build_optimizer(model, self.config, lr)
        self._built_optimizers.append(built)
        return built

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model engine.setup was given, from the one it returned, for the model's own methods and attributes
        (nanoGPT's estimate_mfu, a Hugging Face model's config): ddp, dp, deepspeed and pp return a wrapper around
        it, the sharding strategies and tp the model itself, changed in place."""
        returned = {id(out): given for given, out in zip(self._set_up[::2], self._set_up[1::2], strict=True)}
        return returned.get(id(model), model)

    @contextlib.contextmanager
    def init_module(self, meta: bool | None = None) -> Iterator[None]:
        """Builds the model made inside it with parameters on the meta device where the strategy shards (zero2,
        zero3, auto; DeepSpeed ZeRO-3: zero.Init instead), or always with meta=True; setup gives each rank only
        its shards, with a plain build's values or load_pretrained's (see docs/guide.md)."""
        self._init_rng = torch.get_rng_state()
        with start.build_context(self._strategy, meta, self._auto_pending, self.env, self._plan):
            yield

    def load_pretrained(self, model: nn.Module, path: str | Path) -> None:
        """Gives `model`, built and not yet set up, a Hugging Face safetensors checkpoint's weights (a directory or a
        file), by name, a tensor at a time. On the meta device, setup streams them from rank 0 into the shards."""
        if any(model is known for known in self._set_up):
            raise UsageError("engine.load_pretrained() fills a model before setup; call it before engine.setup().")
        read = SafetensorsCheckpoint(path)
        model_values.check_loadable(model, read)
        if on_meta(model):
            self._pretrained[id(model)] = read
        else:
            self.print(read.summary(model_values.load_whole(model, read)))

    def dataloader(
        self,
        dataset: Dataset | WindowedStream | Iterable[Any],
        batch_size: int = 32,
        shuffle: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> Loader:
        """This rank's shard of `dataset`, `batch_size` samples per device, moved to `engine.device`. An iterable
        dataset (multigpu.data.iterable) streams, a `for` over it ending with each epoch of the stream; a
        WindowedStream of its own (the recipes' --data-streaming) is endless over epochs: stop it on a step budget."""
        if self.config.global_batch_size is not None:  # resolved here, where the per-device batch size is known
            steps = accumulation_for(self.config.global_batch_size, batch_size, self._data_world)
            self.config = replace(self.config, global_batch_size=None, grad_accum_steps=steps)
            self._window.grad_accum_steps = steps
        loader = make_loader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=num_workers,
            collate_fn=collate_fn,
            rank=self._data_rank,
            world_size=self._data_world,
            grad_accum_steps=self.config.grad_accum_steps,
            seed=self.config.seed,
            device=self.device,
            on_batch=self._on_batch,
            shares=self._strategy.layout.shares,
        )
        self._follow_replicas(loader, num_workers)
        if not self._printed_batch_size:
            self._printed_batch_size = True
            # Under tp, pp and cp "processes" counts the data-parallel ranks; say who reads the same batch.
            layout = self._strategy.layout
            shared = layout.cp * layout.tp * layout.pp
            together = f" (each read by the {shared} processes of a replica, which split the model or the sequence)"
            together = together if shared > 1 else ""
            self.print(loader.batch_size_line() + together)
        return loader

    def _on_batch(self, loader: Loader, batch: Batch) -> None:
        self._loader, self._window.batch = loader, batch
        if self._train_loader is not None and loader is not self._train_loader:
            self.mark_untimed()  # an evaluation pass between two training steps

    def lm_loss(self, head: nn.Module, ignore_index: int = -100, chunk_tokens: int | None = None) -> TokenLoss:
        """A language model's loss_fn for forward_backward and forward_loss in the `loss` setting's mode: (output,
        targets) -> (the cross-entropy summed over targets not `ignore_index`, their count). `head`: the set-up
        model's output layer (get_output_embeddings()), which hands the loss its input under chunked and fused."""
        if self._model is None:
            raise UsageError("engine.lm_loss(head) takes the set-up model's head; call it after engine.setup().")
        holders = [self._model, *self._strategy.local_stages()]  # a pipeline's stages are FSDP roots
        self._lm_loss_made = True
        return TokenLoss(head, self.config.loss, ignore_index, chunk_tokens, holders)

    def step(self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None = None) -> bool:
        """Once the accumulation window's backwards are done: unscale, clip, step, zero the gradients, advance
        `scheduler` and return True; before that, return False. Call it after every micro-step's backward, or once
        after the window's grad_accum_steps backwards (as nanoGPT and torchtune loops do): both step alike.

        fp16-mixed skips the update of a step whose gradients overflowed (the loss scale is lowered instead): that
        step still ends its window and returns True, but leaves `scheduler` where it was, so the learning-rate
        schedule follows the updates that happened. `skipped_steps` counts such steps.
        """
        if not self._backward_ran:
            raise UsageError(
                "engine.step() was called before engine.backward(loss) in this step; call engine.backward(loss) first."
            )
        if self.config.loss != "plain" and not self._lm_loss_made:  # it would change nothing: say so
            raise UsageError(
                f"loss {self.config.loss} is the loss function engine.lm_loss(head) makes, and this script trains "
                "without one; pass engine.lm_loss(head) to forward_backward, or drop loss (--loss)."
            )
        self._backward_ran = False
        self._window.batch = None
        if not self._window.done:
            return False
        self._follow_step(optimizer, scheduler)
        with watching(self._hooks.watchers, "optimizer step"):
            count, loss = self._window.global_totals(self._sum_over_replicas)
            if not self._commit_across_replicas(optimizer):
                return False  # the same global batch comes again, for the groups alive now
            outcome = self._strategy.optimizer_step(
                self._model, optimizer, self._scaler, count, self.config.max_grad_norm
            )
            if outcome.applied and self.config.float8 == "tensorwise":
                refresh_all_gather_scales(self._model)  # the next all-gathers' float8 scales, from the new weights
        if outcome.grad_norm is not None:
            self.last_grad_norm = outcome.grad_norm
        self.last_step_applied = outcome.applied
        if not outcome.applied:
            self.skipped_steps += 1
            if isinstance(scheduler, SampleSchedule):
                scheduler.skip(self._window.totals.samples)
        elif scheduler is not None:
            scheduler.step()
        self._end_window(count, loss, outcome.applied)
        return True

    def _end_window(self, count: float | None, loss: float | None, applied: bool) -> None:
        """Times the step just ended and tells the observers; the next step's time starts now."""
        if self._synchronizes and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's time must include its queued GPU work
        now = time.perf_counter()
        totals = self._window.close()
        seconds, self._step_end = now - self._step_end, now
        self._steps += 1
        stats = StepStats(
            self._steps, seconds, totals.samples, count or 0.0, totals.busy_s, not totals.other_work, loss, applied
        )
        self._hooks.step_end(stats)
        if self._balance is not None:  # after the observers saw the split this step trained with
            self._balance.end_step(seconds, stats.timed, self._train_loader)
        if self._faults:
            faults.inject("step", self._steps, self.rank)  # tests' MULTIGPU_FAULT, in any script's loop
        self._window.mark = time.perf_counter()

    def close(self) -> None:
        """Ends the run's logging (Reporting.close), after saying what batch_shares auto settled on."""
        summary = self.batch_shares_summary()
        if summary is not None:
            self.print(summary)
        if self._replicas is not None:
            self._replicas.close()
        super().close()

    def mark_untimed(self) -> None:
        """The step under way does other work (evaluation, a checkpoint, a FLOP count): left out of throughput."""
        self._window.totals.other_work = True
