"""`multigpu finetune`: full, LoRA or QLoRA fine-tuning of a causal language model with the Engine (`python -m
multigpu.recipes.finetune --model smollm2 --data shakespeare --method lora ...`). The loss of each step is the mean
over the target tokens of its whole global batch: every micro-batch backs up its *summed* token loss with its token
count (`loss_fn` returns both to `engine.forward_backward`), so 1 process x 8 sequences, 2 x 4 and 2 x 2 x 2
accumulation give the same gradients.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from multigpu.config.flags import Parser, add_config_arguments, config_from_args
from multigpu.config.layout import ParallelDims, cp_chunks
from multigpu.config.settings import setting, shown, shown_group
from multigpu.core.errors import exit_on_usage_error, require
from multigpu.data import lm_data, packing
from multigpu.engine.config import EngineConfig
from multigpu.engine.engine import Engine
from multigpu.engine.lr_schedule import SampleSchedule
from multigpu.launch.launcher import RAY, RECOVERY, LaunchConfig
from multigpu.models import lm_models
from multigpu.models.lm_experts import check_experts, expert_progress, expert_summary
from multigpu.recipes import lm_fit
from multigpu.recipes.common import (
    NOT_SHOWN_BY_RECIPES,
    NPROC_NOTE,
    NPROC_UNSET,
    OptimizerChoice,
    ProgressBar,
    RecipeSettings,
    RunDirSettings,
    as_launched,
    finish_complete_run,
    peak_memory_mb,
    recipe_engine,
    record_run,
    resolve_resume,
    run_recipe,
    skipped_note,
    step_checkpoint,
)
from multigpu.recipes.lm_results import outputs, save_result
from multigpu.recipes.resume_changes import FINETUNE, check_resume, follow_changes, following_hyperparameters
from multigpu.strategies import lays_out_along
from multigpu.transforms.loss import TokenLoss, summed_cross_entropy


@dataclass
class FinetuneSettings(RecipeSettings, OptimizerChoice):
    """The launch's, the run directory's and the Engine's settings that finetune shows, each keeping its one
    definition (config/settings.py: shown); the strategy is --multi-gpu here."""

    nproc: int | None = shown(LaunchConfig, note=NPROC_NOTE, unset=NPROC_UNSET)
    gpu_ids: str | None = shown(LaunchConfig)
    share_gpus: bool = shown(LaunchConfig)
    _recovery = shown_group(LaunchConfig, *RECOVERY)
    _ray = shown_group(LaunchConfig, *RAY)
    save_dir: str = shown(RunDirSettings, default="checkpoints/finetune")
    resume: str = shown(RunDirSettings)
    save_every: int = shown(RunDirSettings)
    multi_gpu: str = shown(EngineConfig, "strategy")
    log_every: int = shown(EngineConfig, default=10)
    _engine = shown_group(EngineConfig, omit=NOT_SHOWN_BY_RECIPES)


@dataclass
class FinetuneConfig(lm_data.DataSettings, FinetuneSettings, lm_models.ModelSettings):
    method: str = setting("lora", "what trains", choices=lm_models.METHODS)
    batch_size: int = setting(4, "sequences per device per micro-batch")
    lr: float = setting(2e-4, "peak learning rate")
    epochs: int = setting(1, "passes over the data (unless --max-steps stops sooner)")
    max_steps: int | None = setting(None, "stop after this many optimizer steps' samples at the starting world size")
    warmup_steps: int = setting(10, "linear warm-up over this many steps' samples, then cosine decay")
    lora_r: int = setting(8, "LoRA rank")
    lora_alpha: int = setting(16, "LoRA scaling numerator (scale = alpha / r)")
    lora_experts: bool = setting(
        False,
        "lora/qlora on a mixture of experts: also adapt each layer's experts and router (peft's target_parameters; "
        "by default the adapters go on the attention projections only)",
    )
    merge: bool = setting(False, "also write the base model with the adapter merged in")
    sample_prompt: str | None = setting(None, "print this prompt's greedy continuation before and after training")
    eval_batches: int = setting(20, "validation batches per rank per evaluation (0: all)")

    def check(self) -> None:
        require(
            (self.batch_size >= 1, f"--batch-size must be 1 or more (got {self.batch_size}); it is per device."),
            (0 < self.lr < math.inf, f"--lr must be a positive finite number (got {self.lr})."),
            (self.warmup_steps >= 0, f"--warmup-steps must be 0 or more (got {self.warmup_steps})."),
            (self.epochs >= 1, f"--epochs must be 1 or more (got {self.epochs})."),
            (self.max_steps is None or self.max_steps >= 1, f"--max-steps must be 1 or more (got {self.max_steps})."),
            (self.eval_batches >= 0, f"--eval-batches must be 0 or more (got {self.eval_batches})."),
            (
                not self.data_streaming or self.max_steps is not None,
                "--data-streaming reads a stream whose length is unknown until its end; pass --max-steps.",
            ),
            (
                not self.data_streaming or self.epochs == 1,
                "--data-streaming trains --max-steps steps, the stream going round its epochs; drop --epochs.",
            ),
            (self.lora_r >= 1 and self.lora_alpha >= 1, "--lora-r and --lora-alpha must be 1 or more."),
            (
                self.seq_len % cp_chunks(self.cp_size or 1) == 0,
                f"--cp-size {self.cp_size} cuts each sequence into 2 x {self.cp_size} = {cp_chunks(self.cp_size or 1)} "
                f"equal chunks, and --seq-len {self.seq_len} is not a multiple of {cp_chunks(self.cp_size or 1)}; "
                "choose a --seq-len that is.",
            ),
            (
                (self.cp_size or 1) == 1 or not self.sample_prompt,
                "--sample-prompt generates token by token, which context parallelism's split attention does not; "
                "drop --sample-prompt or --cp-size.",
            ),
            (not self.merge or self.method != "full", "--merge merges an adapter; drop it for --method full."),
            (
                self.method != "qlora" or ((self.tp_size or 1) == 1 and not lays_out_along(self.multi_gpu, "tp")),
                "--method qlora's 4-bit weights cannot be split by tensor parallelism; use --method lora or full "
                "under --multi-gpu tp and --tp-size, or drop them.",
            ),
            (
                (self.method != "qlora" and not self.sample_prompt) or not lays_out_along(self.multi_gpu, "pp"),
                "Under --multi-gpu pp, --method qlora and --sample-prompt do not run yet (4-bit layers and generation "
                "need the whole model in one process); use --method full or lora and drop --sample-prompt.",
            ),
        )


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy over the target tokens, their number); labels are already aligned with inputs."""
    return summed_token_loss(model(**model_inputs(batch)), batch["labels"])


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the model reads: a padded batch its attention mask, a packed one each document's positions."""
    if "position_ids" in batch:
        return packing.model_inputs(batch)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def summed_token_loss(output: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy of `output`'s logits over the target tokens, their number); under pp `output` is the
    last stage's, the logits themselves."""
    return summed_cross_entropy(getattr(output, "logits", output), labels)


def lm_loss(engine: Engine, model: nn.Module) -> TokenLoss:
    """The loss of the engine's `loss` setting, with the set-up model's output head (under pp, the whole model's:
    the last stage holds it)."""
    return engine.lm_loss(engine.unwrap(model).get_output_embeddings())


def build(config: FinetuneConfig, engine: Engine) -> tuple[nn.Module, torch.optim.Optimizer, Any, lm_data.LMData]:
    """Tokenizer, data, model and optimizer, set up for the engine's strategy."""
    tokenizer = lm_models.load_tokenizer(config.model)
    data = lm_data.load(config, tokenizer)
    # Built from the config with its parameters on the meta device and filled from the checkpoint in setup, so
    # that zero2/zero3 ranks never hold the whole model; qlora quantises as it reads, so it reads first.
    skeleton = config.method != "qlora"
    with engine.init_module(meta=True) if skeleton else contextlib.nullcontext():
        model = lm_models.load_model(
            config.model,
            config.method,
            config.lora_r,
            config.lora_alpha,
            lora_experts=config.lora_experts,
            precision=engine.precision.name,  # the engine's: bench and verify may run another than the config's
            skeleton=skeleton,
        )
    if skeleton:
        engine.load_pretrained(model, lm_models.model_dir(config.model))
    model, optimizer = engine.setup(model, engine.optimizer(model, config.lr))
    return model, optimizer, tokenizer, data


@torch.no_grad()
def sample(model: nn.Module, tokenizer: Any, prompt: str, engine: Engine, new_tokens: int = 40) -> str:
    """Greedy continuation; every rank runs it (sharded models gather weights in forward)."""
    inner = engine.unwrap(model)
    inner.eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(engine.device)
    out = inner.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    inner.train()
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def evaluate(engine: Engine, model: nn.Module, loader: Any, batches: int, loss_fn: Any = summed_token_loss) -> float:
    """Mean loss per target token over the validation set (its first `batches` per rank), all ranks together."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for number, batch in enumerate(loader):
            if batches and number == batches:  # every rank has as many batches, so all stop together
                break
            real = loader.yielded[-1].real > 0  # a padding-only batch counts nothing
            loss, count = engine.forward_loss(model, model_inputs(batch), batch["labels"], loss_fn)
            totals += torch.tensor([loss.item(), count.item()], dtype=torch.float64) * real
    model.train()
    totals = engine.reduce(totals, op="sum")
    return float(totals[0] / totals[1].clamp(min=1))


def validate(
    engine: Engine, model: nn.Module, loader: Any, config: FinetuneConfig, loss_fn: Any, step: int, note: str = ""
) -> dict[str, Any]:
    """The history entry of `step`: its validation loss, printed (none without validation data: said once)."""
    if loader is None:
        engine.print(f"step {step}: no validation (--data-streaming holds nothing out; pass --eval-data)" + note)
        return {"step": step}
    val_loss = evaluate(engine, model, loader, config.eval_batches, loss_fn)
    engine.print(f"step {step}: validation loss {val_loss:.4f}" + note)
    return {"step": step, "val_loss": val_loss}


def describe(data: lm_data.LMData) -> str:
    packed = "packed" if data.packed else "padded"
    if isinstance(data.train, lm_data.TokenStream):
        held = f"{len(data.validation)} validation" if data.validation is not None else "no validation"
        return f"{data.source}: streamed {packed} training sequences ({data.kind}), {held} sequences"
    return (
        f"{data.source}: {len(data.train)} training / {len(data.validation)} validation {packed} sequences "
        f"({data.kind})"
    )


@dataclass
class FinetuneRun:
    """What the training loop works on: the set-up model and optimizer, the tokenizer, data and loaders, the loss,
    the lr schedule and its plan (warm-up and total samples), and the state checkpoints hold."""

    engine: Engine
    config: FinetuneConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    data: lm_data.LMData
    loss_fn: TokenLoss
    train_loader: Any
    val_loader: Any
    scheduler: SampleSchedule
    plan: tuple[int, int]
    state: dict[str, Any]

    def validate(self, note: str = "") -> dict[str, Any]:
        return validate(self.engine, self.model, self.val_loader, self.config, self.loss_fn, self.state["step"], note)

    def sample(self) -> str:
        return sample(self.model, self.tokenizer, self.config.sample_prompt, self.engine)


def set_up(config: FinetuneConfig, engine: Engine) -> FinetuneRun:
    """The model, optimizer and data (build), their loaders, the loss and the lr schedule."""
    model, optimizer, tokenizer, data = build(config, engine)
    loss_fn = lm_loss(engine, model)
    collate = data.collate_fn(engine.sequence_multiple)
    train_loader = engine.dataloader(data.train, batch_size=config.batch_size, collate_fn=collate)
    val_loader = None
    if data.validation is not None:
        val_loader = engine.dataloader(data.validation, batch_size=config.batch_size, shuffle=False, collate_fn=collate)
    # The schedule and --max-steps are planned in samples at the start (those of that many steps at this world
    # size) and kept in the checkpoint: a resume at another world size trains on the same samples, same lr at each.
    # A stream's length is unknown: --max-steps alone plans it.
    steps_samples = train_loader.samples_in_steps
    if config.data_streaming:
        total_samples = steps_samples(config.max_steps)
    else:
        data_samples = len(data.train) * config.epochs
        total_samples = min(steps_samples(config.max_steps), data_samples) if config.max_steps else data_samples
    plan = (steps_samples(config.warmup_steps), total_samples)
    scheduler = SampleSchedule(optimizer, train_loader, *plan)
    state = {"model": model, "optimizer": optimizer, "loader": train_loader, "scheduler": scheduler, "step": 0}
    engine.heal_with(state)  # under fault tolerance, what a replica group that rejoins copies from a live one
    return FinetuneRun(
        engine, config, model, optimizer, tokenizer, data, loss_fn, train_loader, val_loader, scheduler, plan, state
    )


def resume(run: FinetuneRun, resume_from: Path) -> bool:
    """Loads the checkpoint `resume_from` into the run; whether its training is complete already (the adapter or
    model written at its end then stays, or is written now)."""
    engine, config, scheduler = run.engine, run.config, run.scheduler
    record = check_resume(config, resume_from, FINETUNE)
    with following_hyperparameters(run.optimizer):
        engine.load(resume_from, run.state)
    engine.print(f"resumed from {resume_from} at step {run.state['step']} ({scheduler.seen} samples done)")
    for line in follow_changes(scheduler, config, record, FINETUNE, run.plan, config.lr):
        engine.print(line)
    if not scheduler.done:
        return False
    finish = functools.partial(save_result, config, engine, run.model, run.tokenizer)
    finish_complete_run(engine, config, run.state["step"], "--max-steps or --epochs", outputs(config), finish)
    return True


def announce(run: FinetuneRun) -> int:
    """Prints what trains and on what; returns the steps left to train (for the progress bar)."""
    engine, config, scheduler = run.engine, run.config, run.scheduler
    global_batch = config.batch_size * engine.data_parallel_size * config.grad_accum_steps
    total = run.state["step"] + math.ceil((scheduler.total_samples - scheduler.seen) / global_batch)
    # ZeRO-3 under DeepSpeed leaves each parameter empty outside forward; ds_numel is its real size.
    parameters = engine.unwrap(run.model).parameters()
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in parameters if p.requires_grad)
    engine.print(
        f"{describe(run.data)}, {config.model} {config.method}: {trainable:,} trainable parameters; strategy "
        f"{engine.strategy}, {engine.world_size} process(es), {total} steps"
    )
    if run.data.report:
        engine.print(run.data.report)
    return total


def finetune(config: FinetuneConfig) -> dict[str, Any]:
    engine = recipe_engine(config)
    engine.log_config(asdict(config))
    run = set_up(config, engine)
    resume_from = resolve_resume(config, engine.print)
    if resume_from is not None and resume(run, resume_from):  # nothing to train
        return {"history": [], "steps": run.state["step"], "skipped_steps": 0, "output": None, "model": run.model}
    if engine.is_main_process:  # once the save dir and the checkpoint resumed from are known good
        record_run(config, "finetune")
    total = announce(run)
    if config.sample_prompt:
        engine.print(f"before: {config.sample_prompt}{run.sample()}")
    history = [run.validate()]
    expert_load = train_steps(run, ProgressBar(engine, total))
    save_step(engine, config, run.state)
    if isinstance(run.data.train, lm_data.TokenStream) and run.data.train.report():
        engine.print(run.data.train.report())
    history.append(run.validate(skipped_note(engine)))
    if expert_load is not None:
        engine.print(expert_summary(expert_load))
        history[-1]["aux_loss"] = expert_load["moe_aux_loss"]
    validated = {"val_loss": history[-1]["val_loss"]} if "val_loss" in history[-1] else {}
    engine.log(run.state["step"], {**validated, "skipped_steps": engine.skipped_steps})
    if config.sample_prompt:
        engine.print(f"after: {config.sample_prompt}{run.sample()}")
    out = save_result(config, engine, run.model, run.tokenizer)
    engine.print(f"wrote {out}; peak memory per rank (MB): {peak_memory_mb(engine)}")
    return {
        "history": history,
        "expert_load": expert_load,
        "grad_norm": engine.last_grad_norm,  # the last step's, before clipping
        "steps": run.state["step"],
        "skipped_steps": engine.skipped_steps,
        "output": str(out),
        "model": run.model,
    }


def train_steps(run: FinetuneRun, progress: ProgressBar) -> dict[str, Any] | None:
    """Trains until the schedule's samples are done, checkpointing every --save-every steps; returns the last
    step's expert load (None for a dense model)."""
    engine, config, state, scheduler = run.engine, run.config, run.state, run.scheduler
    start, tokens, expert_load = time.perf_counter(), 0.0, None
    while not scheduler.done:
        for batch in run.train_loader:
            loss = engine.forward_backward(run.model, model_inputs(batch), batch["labels"], run.loss_fn)
            count = (batch["labels"] != -100).sum()
            tokens += float(count) * engine.data_parallel_size
            if engine.step(run.optimizer, scheduler):
                state["step"] += 1
                rate = tokens / (time.perf_counter() - start)
                status = f"loss {loss.item() / max(float(count), 1):.3f} lr {scheduler.get_last_lr()[0]:.2e} "
                routers, expert_load = expert_progress(engine, state["step"], config.log_every)
                status += routers
                progress.advance(state["step"], status + f"{rate:,.0f} tokens/s")
                if config.save_every and state["step"] % config.save_every == 0:
                    save_step(engine, config, state)
                if scheduler.done:
                    break
    progress.close()
    return expert_load


def save_step(engine: Engine, config: FinetuneConfig, state: dict[str, Any]) -> None:
    engine.save(step_checkpoint(config.save_dir, state["step"]), state, keep_last=2)
    if engine.is_main_process:
        record_run(config, "finetune", after_save=True)


def check(config: FinetuneConfig, layout: ParallelDims) -> None:
    """What `multigpu finetune` refuses before any process starts: a --resume or --save-dir that cannot work, a
    change the resume cannot take (resume_changes), a model or data it cannot find, or that does not fit the flags
    under the workers' `layout` (lm_fit). The Engine's settings (the loss and liger among them) were refused before
    this, by engine.start.check."""
    check_resume(config, resolve_resume(config), FINETUNE)  # first: the model's checks import transformers
    lm_models.check(config.model)
    lm_fit.check_fits(config, layout)
    lm_data.check(config)
    if config.loss != "plain":
        lm_models.check_plain_head(config.model, config.loss)
    if (config.ep_size or 1) > 1:
        check_experts(lm_models.model_dir(config.model), config.model, config.ep_size)
    if not config.data_streaming:  # tokenised here, once, so that bad data is refused before any process starts
        lm_data.load(config, lm_models.load_tokenizer(config.model))


def run(config: FinetuneConfig) -> int:
    """What `multigpu finetune` does: train here (1 process, or already under a launcher) or launch --nproc."""
    return run_recipe(config, "multigpu.recipes.finetune", finetune, check)


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m multigpu.recipes.finetune", description=__doc__)
    add_config_arguments(parser, FinetuneConfig)
    finetune(as_launched(config_from_args(FinetuneConfig, parser.parse_args(argv))))


if __name__ == "__main__":
    sys.exit(exit_on_usage_error(main))
