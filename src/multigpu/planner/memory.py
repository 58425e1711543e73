"""Memory per GPU for every strategy: model states, activations, temporary buffers, overhead. Pure arithmetic."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from multigpu.core.errors import UsageError
from multigpu.planner.activations import transformer_activations
from multigpu.planner.config import OPTIMIZERS, PlanConfig, parse_bytes, takes_cp  # noqa: F401  (importers)
from multigpu.planner.layout import Stage, held_shape, pipeline_stages, stage_activations
from multigpu.planner.setup_memory import BUILD_BYTES, setup_bytes, setup_fits, setup_warning
from multigpu.planner.shapes import ModelShape

#: From fastest to most frugal: the planner recommends the first that fits (the guides' decision tree).
ORDER = ("ddp", "zero1", "zero2", "zero3", "zero3+offload")
#: Shown too, for one GPU and for the guides' simple mode; dp's GPU 0 holds the whole model and optimizer.
REPORTED = ("single", "dp", *ORDER)
#: With tp_size or pp_size: the data-parallel strategies that compose with them, fastest first (hsdp shards
#: inside a node and replicates across nodes, between zero2's and zero3's traffic).
COMPOSED = ("zero2", "hsdp", "zero3")
DEEPSPEED = ("deepspeed1", "deepspeed2", "deepspeed3")  # reported, never recommended: DeepSpeed is optional
FRAMEWORK_OVERHEAD = 1 << 30  # CUDA context, kernels, allocator slack: about 1 GiB that no tensor accounts for


@dataclass
class StrategyMemory:
    strategy: str
    params: float
    grads: float
    optimizer: float
    activations: float
    temporary: float
    overhead: float
    cpu: float = 0.0  # host memory per process (offload)
    total: float = 0.0
    fits: bool = False  # training's peak fits the GPU (setup aside)
    max_batch_size: int = 0
    max_seq_len: int = 0  # the longest sequence that fits at batch size 1, a multiple of 2 x cp (0: none, or unknown)
    setup: float = 0.0  # a rank's peak while the model is built whole (see setup_memory.py)
    setup_init_module: float = 0.0  # the same when built under engine.init_module()
    setup_fits: str = ""  # "yes" (plain build), "with init_module" or "no"
    pp_rank: int = 0  # with pp_size: the pipeline rank reported, the one whose total binds


@dataclass
class Plan:
    model: str
    params: int
    trainable: int
    config: PlanConfig
    strategies: list[StrategyMemory] = field(default_factory=list)
    recommendation: str | None = None
    reason: str = ""
    setup_warning: str = ""  # the recommended strategy fits in training but not with a plain build
    cp_size: int = 1  # the cp degree the recommendation needs: the one asked for, or more where that does not fit
    left_out: str = ""  # the strategies not shown, and why

    def to_dict(self) -> dict:
        return asdict(self)


def _bytes_per_param(precision: str) -> int:
    """Stored weights and their gradients: fp32 master weights in every mode but bf16-true."""
    return 2 if precision == "bf16-true" else 4


def _optimizer_bytes(optimizer: str, precision: str) -> float:
    state = _bytes_per_param(precision)
    return {"adamw": 2 * state, "sgd": state, "adamw8bit": 2.0}[optimizer]  # sgd: one momentum buffer


def model_states(shape: ModelShape, config: PlanConfig) -> tuple[float, float, float, int]:
    """Unsharded bytes of parameters, gradients and optimizer states, and the trainable parameter count."""
    weight = _bytes_per_param(config.precision)
    if config.lora_r is None:
        trainable = shape.params if shape.trainable is None else shape.trainable
        params = shape.params * weight
    else:
        trainable = sum(config.lora_r * (i + o) for i, o in shape.lora_shapes)
        base = shape.params * weight
        if config.qlora:
            # nf4: half a byte per weight of the quantised linears, plus an fp32 scale per block of 64 weights.
            frozen_16bit = (shape.params - shape.linear_params) * 2
            base = shape.linear_params * (0.5 + 4 / 64) + frozen_16bit
        params = base + trainable * weight
    return params, trainable * weight, trainable * _optimizer_bytes(config.optimizer, config.precision), trainable


def built_model(shape: ModelShape, config: PlanConfig) -> tuple[float, int]:
    """Bytes and parameters of the whole model as built: fp32 (QLoRA: quantised as it loads), adapters included."""
    params, _, _, trainable = model_states(shape, config)
    if config.lora_r is None:
        return shape.params * BUILD_BYTES, shape.params
    built = params if config.qlora else (shape.params + trainable) * BUILD_BYTES
    return built, shape.params + trainable


def activations_per_gpu(shape: ModelShape, config: PlanConfig, batch: int, cp: int = 1) -> float:
    """`cp`: the ranks each sequence is split over (a measured module's positions are taken to split evenly)."""
    if shape.transformer is None:
        return shape.activation_bytes_per_sample * batch / cp
    found = transformer_activations(
        shape.transformer,
        batch,
        config.seq_len,
        config.precision,
        config.activation_checkpointing,
        cp,
        config.cp_method,
    )
    return float(found.peak)


def autocast_weights_bytes(shape: ModelShape, config: PlanConfig) -> float:
    """autocast keeps a 16-bit copy of every weight it casts until backward (FSDP gathers 16-bit units instead)."""
    return shape.params * 2 if config.precision in ("bf16-mixed", "fp16-mixed") else 0


def _accumulates_unsharded(config: PlanConfig) -> bool:
    return config.unsharded_grad_accum and config.grad_accum_steps > 1


def _fsdp_grads(grads: float, n: int, config: PlanConfig) -> float:
    """FSDP's gradients per rank: a shard, or whole while micro-steps defer their reduce-scatter."""
    return grads if _accumulates_unsharded(config) else grads / n


def model_parallel_name(config: PlanConfig) -> str:
    """The row's name when tp x pp takes every GPU, leaving no data parallelism."""
    return "+".join(name for name, size in (("tp", config.tp_size), ("pp", config.pp_size)) if size > 1)


def strategy_memory(name: str, shape: ModelShape, config: PlanConfig, batch: int) -> StrategyMemory:
    """Per GPU; under pp, the pipeline rank with the largest total (the others fit if it does)."""
    stages = _stages(shape, config)
    return max((_stage_memory(name, shape, config, batch, stage) for stage in stages), key=lambda m: m.total)


def _stages(shape: ModelShape, config: PlanConfig) -> list[Stage]:
    layers = shape.transformer.layers if shape.transformer else 0
    return pipeline_stages(
        layers, config.pp_size, config.pp_stages_per_rank, config.pp_schedule, config.microbatches or 1
    )


def _stage_memory(name: str, whole: ModelShape, config: PlanConfig, batch: int, stage: Stage) -> StrategyMemory:
    shape = held_shape(whole, config.tp_size, config.pp_size, stage)
    params, grads, optim, _ = model_states(shape, config)
    n = _data_parallel(name, config)
    compute = 4 if config.precision == "32" else 2
    unit = (shape.largest_unit or shape.params // 10) * compute
    cp = config.cp_size if takes_cp(name) else 1
    if config.model_parallel:
        activations = stage_activations(
            shape,
            stage,
            config.tp_size,
            batch,
            config.seq_len,
            config.precision,
            config.activation_checkpointing,
            config.sequence_parallel,
            cp,
            config.cp_method,
        )
    else:
        activations = activations_per_gpu(shape, config, batch, cp)
    memory = StrategyMemory(name, params, grads, optim, activations, 0.0, FRAMEWORK_OVERHEAD, pp_rank=stage.rank)
    if name in ("single", "dp") or (config.model_parallel and name == model_parallel_name(config)):
        memory.temporary = autocast_weights_bytes(shape, config)
    autocast_weights = autocast_weights_bytes(shape, config)
    if name == "ddp":
        memory.temporary = grads + autocast_weights  # DDP keeps a flat bucket copy of every gradient
    elif name == "zero1":
        memory.optimizer = optim / n
        memory.temporary = grads + autocast_weights
    elif name == "zero2":
        memory.params, memory.grads, memory.optimizer = params / n, _fsdp_grads(grads, n, config), optim / n
        memory.temporary = shape.params * compute  # parameters stay gathered from forward to backward
    elif name in ("zero3", "hsdp"):
        memory.params, memory.grads, memory.optimizer = params / n, _fsdp_grads(grads, n, config), optim / n
        memory.temporary = 2 * unit  # the unit in use and the next one, prefetched
    elif name in DEEPSPEED:
        # DeepSpeed keeps an fp32 master copy of this rank's partition of the trainable weights beside the
        # weights forward uses, in fp32 training too; stage 3 partitions those weights as well.
        stage = int(name[-1])
        master = grads / n
        memory.optimizer = optim / n
        memory.params = (params / n if stage == 3 else params) + master
        memory.grads = grads if stage == 1 else grads / n
        memory.temporary = 2 * unit if stage == 3 else autocast_weights
    elif name == "zero3+offload":
        memory.cpu = (params + grads + optim) / n
        memory.params = memory.optimizer = 0.0
        # Deferred reduce-scatters keep the whole gradients on the GPU until the window's last micro-step.
        memory.grads = grads if _accumulates_unsharded(config) else 0.0
        memory.temporary = 2 * unit
    memory.total = (
        memory.params + memory.grads + memory.optimizer + memory.activations + memory.temporary + memory.overhead
    )
    memory.fits = memory.total <= config.gpu_bytes
    return memory


def plan_shape(shape: ModelShape, config: PlanConfig, per: str = "GPU") -> Plan:
    """`per`: what the memory is of, in the reasons ("GPU"; "process" for `auto` on CPU, where it is RAM)."""
    _, _, _, trainable = model_states(shape, config)
    plan = Plan(shape.name, shape.params, trainable, config)
    _check_tp_divides_heads(shape, config.tp_size)
    for name in _rows(config):
        memory = strategy_memory(name, shape, config, config.batch_size)
        memory.max_batch_size = _max_batch(name, shape, config)
        memory.max_seq_len = longest_sequence(name, shape, config)
        memory.setup, memory.setup_init_module = _setup(name, shape, config, memory.pp_rank)
        memory.setup_fits = setup_fits(memory, config.gpu_bytes, FRAMEWORK_OVERHEAD)
        plan.strategies.append(memory)
    if config.cp_size > 1 and not config.model_parallel:
        plan.left_out = f"{', '.join(DEEPSPEED)}: DeepSpeed lays out its own process groups, without --cp-size"
    candidates = _candidates(config)
    fitting = [m for m in plan.strategies if m.strategy in candidates and m.fits]
    allowed = [m for m in fitting if m.strategy != "zero3+offload" or config.cpu_offload]
    memory = f"{config.gpu_bytes / 2**30:.2f} GiB per {per}"
    # Where nothing fits, not even with offload, a sequence split over more GPUs may.
    split = _more_cp(shape, config) if not fitting else None
    if allowed or split:
        best, cp = (allowed[0], config.cp_size) if allowed else split
        plan.recommendation, plan.cp_size = best.strategy, cp
        faster = ", ".join(
            m.strategy for m in plan.strategies if m.strategy in candidates[: candidates.index(best.strategy)]
        )
        split_further = f" with --cp-size {cp}" if cp != config.cp_size else ""
        plan.reason = f"{best.strategy} needs {best.total / 2**30:.2f} GiB of {memory}{split_further}" + (
            f"; {faster} would not fit" if faster else " and is the fastest choice"
        )
        if split_further:  # the sequence fits only split further over the GPUs
            plan.reason += f"; at --cp-size {config.cp_size} nothing fits {config.batch_size} x {config.seq_len} tokens"
        # The choice stays on training memory: whether the model is built whole is the user's choice, not the
        # config's, and the warning says how to build it when it matters.
        plan.setup_warning = setup_warning(best, config.gpu_bytes, config.precision, per)
        return plan
    more = "GPUs" if per == "GPU" else "machines"
    instead = (
        f"lower --batch-size or --seq-len, add --activation-checkpointing full, more {more} or "
        "--tp-size/--pp-size/--cp-size, LoRA/QLoRA"
    )
    if fitting:  # zero3+offload alone, which the config does not allow: the table says it fits, and so must this
        plan.reason = (
            f"only zero3+offload fits {memory} at batch size {config.batch_size}, and it keeps the model states "
            f"in host memory ({fitting[0].cpu / 2**30:.2f} GiB per process): pass --cpu-offload to allow it, "
            f"or {instead}"
        )
    else:
        plan.reason = f"nothing fits {memory} at batch size {config.batch_size}: {instead}"
    return plan


def _candidates(config: PlanConfig) -> tuple[str, ...]:
    """The rows a recommendation is drawn from. One GPU: single unless only offload fits; several: the guides'
    order, fastest first."""
    return ("single", "zero3+offload") if config.world == 1 else _rows(config) if config.model_parallel else ORDER


def _more_cp(shape: ModelShape, config: PlanConfig) -> tuple[StrategyMemory, int] | None:
    """Where nothing fits a transformer's sequence: the fastest row under the smallest larger cp degree (twice,
    four times, ... the one asked) that fits without offload, with that degree; None where none does."""
    if shape.transformer is None or config.world == 1:
        return None
    cp = 2 * config.cp_size
    while config.world % (config.tp_size * config.pp_size * cp) == 0 and config.seq_len % (2 * cp) == 0:
        split = replace(config, cp_size=cp)
        rows = [strategy_memory(name, shape, split, split.batch_size) for name in _rows(split)]
        allowed = [m for m in rows if m.strategy in _candidates(split) and m.fits and m.strategy != "zero3+offload"]
        if allowed:
            best = allowed[0]
            best.setup, best.setup_init_module = _setup(best.strategy, shape, split, best.pp_rank)
            best.setup_fits = setup_fits(best, split.gpu_bytes, FRAMEWORK_OVERHEAD)
            return best, cp
        cp *= 2
    return None


def _rows(config: PlanConfig) -> tuple[str, ...]:
    if not config.model_parallel:
        if config.cp_size > 1:
            return ORDER  # DeepSpeed's rows take no cp (Plan.left_out)
        return REPORTED if config.world == 1 else (*ORDER, *DEEPSPEED)
    if config.data_parallel == 1 and config.cp_size == 1:
        return (model_parallel_name(config),)
    # hsdp is a row of its own only where it replicates; with one node's worth of shards it is zero3.
    return tuple(name for name in COMPOSED if name != "hsdp" or config.layout("hsdp").replicate > 1)


def _data_parallel(name: str, config: PlanConfig) -> int:
    """The ranks a row's strategy divides model states over: hsdp's shards (its replicas each hold them whole),
    every data-parallel rank for the others, each times cp."""
    dims = config.layout(name)
    # The cp ranks of a replica reduce gradients, and shard parameters, together with its data-parallel ranks.
    return (dims.shard if name == "hsdp" else dims.data_parallel_size) * dims.cp


def _check_tp_divides_heads(shape: ModelShape, tp: int) -> None:
    t = shape.transformer
    if t is None or tp == 1:
        return
    for count, what in ((t.heads, "attention heads"), (t.kv_heads, "key/value heads")):
        if count % tp:
            raise UsageError(f"--tp-size {tp} does not divide the model's {count} {what}; choose one that does.")


def _setup(name: str, shape: ModelShape, config: PlanConfig, pp_rank: int) -> tuple[float, float]:
    """(plain build, under engine.init_module()). A plain build makes the whole model on every rank before tp/pp
    slice it; under init_module a rank materialises its own slice, sharded over the data-parallel ranks."""
    if not config.model_parallel:
        return setup_bytes(name, shape, config.world, *built_model(shape, config))
    stage = _stages(shape, config)[pp_rank]
    held = held_shape(shape, config.tp_size, config.pp_size, stage)
    n = _data_parallel(name, config)
    slices, init_module = setup_bytes(name, held, n, *built_model(held, config))
    whole, _ = built_model(shape, config)
    held_bytes, _ = built_model(held, config)
    return whole + slices - held_bytes, init_module


def _max_batch(name: str, shape: ModelShape, config: PlanConfig) -> int:
    """The largest per-device batch that fits (0: not even 1); model states do not depend on it."""
    if not strategy_memory(name, shape, config, 1).fits:
        return 0
    if shape.transformer is None and not shape.activation_bytes_per_sample:
        return config.batch_size if strategy_memory(name, shape, config, config.batch_size).fits else 0
    low, high = 1, 2
    while strategy_memory(name, shape, config, high).fits and high < 1 << 20:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if strategy_memory(name, shape, config, middle).fits else (low, middle)
    return low


def longest_sequence(name: str, shape: ModelShape, config: PlanConfig) -> int:
    """The longest sequence a row fits at batch size 1: a multiple of 2 x cp (each cp rank holds a head and a tail
    chunk), found by bisection on the memory model. 0: not even 2 x cp tokens fit, or activations are unknown."""
    if shape.transformer is None:
        return 0
    step = 2 * (config.cp_size if takes_cp(name) else 1)

    def fits(chunks: int) -> bool:
        return strategy_memory(name, shape, replace(config, seq_len=chunks * step), 1).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high) and high < 1 << 32:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step
