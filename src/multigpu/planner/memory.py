"""Memory per GPU for every strategy: model states, activations, temporary buffers, overhead. Pure arithmetic."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from multigpu.planner.activations import transformer_activations
from multigpu.planner.gpus import MixedGpus, parse_bytes  # noqa: F401  (importers)
from multigpu.planner.model_parallel import Stage, held_shape, pipeline_stages, stage_activations
from multigpu.planner.plan_config import OPTIMIZERS, PlanConfig, takes_cp, takes_ep  # noqa: F401  (importers)
from multigpu.planner.rows import row as row_of
from multigpu.planner.setup_memory import BUILD_BYTES, setup_bytes, setup_fits
from multigpu.planner.shapes import ModelShape
from multigpu.planner.states import model_states, sharded_states
from multigpu.strategies.facts import GATHERED_MODEL, GRAD_BUCKET, TWO_UNITS, MemoryModel

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
    ep_size: int = 1  # expert parallelism: a mixture's experts split over this many ranks


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
    ep_size: int = 1  # the ep degree the recommendation runs at: the one asked for, or the smallest that fits
    experts: int = 0  # a mixture's routed experts per layer; 0: a dense model
    active_params: int = 0  # a mixture's parameters per token (0: a dense model, all of them)
    left_out: str = ""  # the strategies not shown, and why
    mixed: MixedGpus | None = None  # a node of different GPUs: what each holds, and the batch shares that fit

    def to_dict(self) -> dict:
        return asdict(self)


def built_model(shape: ModelShape, config: PlanConfig) -> tuple[float, int]:
    """Bytes and parameters of the whole model as built: fp32 (QLoRA: quantised as it loads), adapters included."""
    params, _, _, trainable = model_states(shape, config)
    if config.lora_r is None:
        return shape.params * BUILD_BYTES, shape.params
    built = params if config.qlora else (shape.params + trainable) * BUILD_BYTES
    return built, shape.params + trainable


def activations_per_gpu(shape: ModelShape, config: PlanConfig, batch: int, cp: int = 1, ep: int = 1) -> float:
    """`cp`: the ranks each sequence is split over (a measured module's positions are taken to split evenly);
    `ep`: the ranks a mixture's experts are split over (their all-to-alls' buffers)."""
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
        ep,
    )
    return float(found.peak)


def autocast_weights_bytes(shape: ModelShape, config: PlanConfig) -> float:
    """autocast keeps a 16-bit copy of every weight it casts until backward (FSDP gathers 16-bit units instead)."""
    return shape.params * 2 if config.precision in ("bf16-mixed", "fp16-mixed") else 0


def _accumulates_unsharded(config: PlanConfig) -> bool:
    return config.unsharded_grad_accum and config.grad_accum_steps > 1


def model_parallel_name(config: PlanConfig) -> str:
    """The row's name when tp x pp takes every GPU, leaving no data parallelism."""
    return "+".join(name for name, size in (("tp", config.tp_size), ("pp", config.pp_size)) if size > 1)


def row_ep(name: str, config: PlanConfig) -> int:
    """The ep degree a row runs at: the one asked for where its strategy takes ep, else 1."""
    return (config.ep_size or 1) if takes_ep(name) else 1


def strategy_memory(name: str, shape: ModelShape, config: PlanConfig, batch: int) -> StrategyMemory:
    """Per GPU; under pp, the pipeline rank with the largest total (the others fit if it does)."""
    stages = _stages(shape, config)
    return max((_stage_memory(name, shape, config, batch, stage) for stage in stages), key=lambda m: m.total)


def _stages(shape: ModelShape, config: PlanConfig) -> list[Stage]:
    layers = shape.transformer.layers if shape.transformer else 0
    return pipeline_stages(
        layers, config.pp_size, config.pp_stages_per_rank, config.pp_schedule, config.microbatches or 1, config.pp_split
    )


def _stage_memory(name: str, whole: ModelShape, config: PlanConfig, batch: int, stage: Stage) -> StrategyMemory:
    """`shape` is the stage's (tp's slice) whole; `held`, what a rank of it holds before data-parallel sharding
    (1/ep of the experts): what replicated rows keep and sharded rows gather."""
    ep = row_ep(name, config)
    shape = held_shape(whole, config.tp_size, config.pp_size, stage)
    held = held_shape(whole, config.tp_size, config.pp_size, stage, ep)
    params, grads, optim, _ = model_states(held, config)
    n = data_parallel(name, config)
    shard_params, shard_grads, shard_optim = sharded_states(shape, config, n, ep)
    fsdp_grads = grads if _accumulates_unsharded(config) else shard_grads  # whole while reduce-scatters wait
    compute = 4 if config.precision == "32" else 2
    unit = (held.largest_unit or held.params // 10) * compute
    activations = _activations(name, shape, config, batch, stage, ep)
    memory = StrategyMemory(
        name, params, grads, optim, activations, 0.0, FRAMEWORK_OVERHEAD, pp_rank=stage.rank, ep_size=ep
    )
    model = row_of(name).memory
    if model.offload:  # the sharded states in host memory
        memory.cpu = shard_params + shard_grads + shard_optim
        memory.params = memory.optimizer = 0.0
        # Deferred reduce-scatters keep the whole gradients on the GPU until the window's last micro-step.
        memory.grads = grads if _accumulates_unsharded(config) else 0.0
    elif model.partitions:
        # DeepSpeed keeps an fp32 master copy of this rank's partition of the trainable weights beside the
        # weights forward uses, in fp32 training too; stage 3 partitions those weights as well.
        memory.optimizer = optim / n
        memory.params = (params / n if "params" in model.sharded else params) + grads / n
        memory.grads = grads / n if "grads" in model.sharded else grads
    else:
        if "optimizer" in model.sharded:
            memory.optimizer = shard_optim
        if "params" in model.sharded:  # FSDP shards parameters and gradients together
            memory.params, memory.grads = shard_params, fsdp_grads
    memory.temporary = _temporary(model, grads, autocast_weights_bytes(held, config), held.params * compute, unit)
    memory.total = (
        memory.params + memory.grads + memory.optimizer + memory.activations + memory.temporary + memory.overhead
    )
    memory.fits = memory.total <= config.gpu_bytes
    return memory


def _temporary(model: MemoryModel, grads: float, autocast: float, gathered: float, unit: float) -> float:
    """What a rank holds beside its states (strategies/facts.py names each kind)."""
    if model.temporary == GRAD_BUCKET:
        return grads + autocast  # DDP keeps a flat bucket copy of every gradient
    if model.temporary == GATHERED_MODEL:
        return gathered  # parameters stay gathered from forward to backward
    if model.temporary == TWO_UNITS:
        return 2 * unit  # the unit in use and the next one, prefetched
    return autocast


def _activations(name: str, shape: ModelShape, config: PlanConfig, batch: int, stage: Stage, ep: int) -> float:
    """A GPU's activations under row `name`: its pipeline stage's share (tp's slice) under model parallelism."""
    cp = config.cp_size if takes_cp(name) else 1
    if not config.model_parallel:
        return activations_per_gpu(shape, config, batch, cp, ep)
    return stage_activations(
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
        ep,
    )


def filled_row(name: str, shape: ModelShape, config: PlanConfig) -> StrategyMemory:
    """A row of the plan: its memory at the asked batch, the largest batch and longest sequence it fits, and its
    setup's peak."""
    memory = strategy_memory(name, shape, config, config.batch_size)
    memory.max_batch_size = _max_batch(name, shape, config)
    memory.max_seq_len = longest_sequence(name, shape, config)
    memory.setup, memory.setup_init_module = setup(name, shape, config, memory.pp_rank)
    memory.setup_fits = setup_fits(memory, config.gpu_bytes, FRAMEWORK_OVERHEAD)
    return memory


def data_parallel(name: str, config: PlanConfig) -> int:
    """The ranks a row's strategy divides model states over: hsdp's shards (its replicas each hold them whole),
    every data-parallel rank for the others, each times cp."""
    dims = config.layout(name)
    # The cp ranks of a replica reduce gradients, and shard parameters, together with its data-parallel ranks.
    return (dims.shard if row_of(name).memory.shards_within_replica else dims.data_parallel_size) * dims.cp


def setup(name: str, shape: ModelShape, config: PlanConfig, pp_rank: int) -> tuple[float, float]:
    """(plain build, under engine.init_module()). A plain build makes the whole model on every rank before tp/pp
    slice it; under init_module a rank materialises its own slice, sharded over the data-parallel ranks."""
    if not config.model_parallel:
        return setup_bytes(row_of(name).memory.build, shape, config.world, *built_model(shape, config))
    stage = _stages(shape, config)[pp_rank]
    held = held_shape(shape, config.tp_size, config.pp_size, stage)
    n = data_parallel(name, config)
    slices, init_module = setup_bytes(row_of(name).memory.build, held, n, *built_model(held, config))
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
