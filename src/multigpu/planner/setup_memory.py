"""A rank's peak memory while its model is built and handed to engine.setup, before the first step.

Today's default, the plain build, builds (or loads) the whole model in every process first, so the memory that
ZeRO-3 saves during training is spent, N times over, at setup:
  plain build            every rank holds every parameter in the build dtype: fp32 (bf16-true casts the model after
                         building, so the fp32 build is its peak; QLoRA quantises as it loads, so its build is the
                         quantised model). zero2/zero3 hold this whole copy and, while fully_shard copies each
                         rank's slices out of it, the slices too: 1 + 1/N of the model (measured).
  engine.init_module()   the model's parameters are built on the meta device. Under zero2, zero3 and zero3+offload
                         setup shards it there, gives each rank storage for its shards only, and fills them from
                         rank 0, which makes one unit at a time in host memory (a plain build's values, or a
                         pretrained checkpoint read a tensor at a time) and scatters each tensor's rows: on the
                         device, a rank holds its shards, and rank 0 one whole tensor being scattered (the largest
                         parameter: a transformer's embedding or widest projection). DeepSpeed ZeRO-3's zero.Init
                         partitions each parameter as it is created: a rank holds its shard, one whole unit and
                         one whole tensor. The figure is rank 0's, the highest. Under single, dp, ddp, zero1 and
                         DeepSpeed stages 1-2 every rank needs the whole model anyway: the plain build's figure.
Buffers are not counted (ModelShape has none; a Llama's are a few KB). The figures are tensors only: the fit check
adds the framework's overhead, as training's total does. Where the model lies is the user's choice (host memory
when built on the CPU); the planner takes the worst case, the build on the GPU, which zero2/zero3 reach anyway by
moving the whole model there before slicing it. zero3+offload keeps it in host memory: its figures are host bytes.
"""

from __future__ import annotations

from typing import Protocol

from multigpu.planner.rows import row
from multigpu.planner.shapes import ModelShape
from multigpu.strategies.facts import FSDP_SLICES, WHOLE


class StrategyMemory(Protocol):
    """What these functions read of a row of the plan (memory.StrategyMemory, which imports this module)."""

    strategy: str
    fits: bool
    setup: float
    setup_init_module: float
    setup_fits: str


BUILD_BYTES = 4  # models are built in fp32
#: setup_fits: the plain build fits; only a build under engine.init_module() does; neither does.
FITS, WITH_INIT_MODULE, NO = "yes", "with init_module", "no"


def setup_bytes(build: str, shape: ModelShape, world: int, built: float, built_params: int) -> tuple[float, float]:
    """(plain build, under engine.init_module()) bytes per rank of a row whose model builds as `build`
    (strategies/facts.py: WHOLE, FSDP_SLICES, PARTITIONED). `built`: the whole built model's bytes, of
    `built_params` parameters (LoRA adapters included)."""
    if build == WHOLE:
        return built, built
    # fully_shard copies each rank's slices out of the whole model before the whole is freed: measured 1 + 1/N
    # of the model per rank (benchmarks/setup_memory.py). DeepSpeed's own partitioning is counted as the whole.
    plain = built * (1 + 1 / world) if build == FSDP_SLICES else built
    width = built / built_params  # bytes per parameter, below 4 where QLoRA's weights are quantised
    unit = shape.largest_unit or shape.params // 10  # as training's gathered unit counts it
    tensor = shape.largest_tensor or unit
    whole_on_device = tensor if build == FSDP_SLICES else unit + tensor  # FSDP's rank 0 makes units on the host
    return plain, built / world + whole_on_device * width


def setup_fits(memory: StrategyMemory, gpu_bytes: float, overhead: float) -> str:
    """Whether setup fits the GPU, as FITS, WITH_INIT_MODULE or NO. A row that offloads (zero3+offload) builds in
    host memory, which the planner does not know: its GPU holds no weights at setup."""
    if row(memory.strategy).offloads or memory.setup + overhead <= gpu_bytes:
        return FITS
    return WITH_INIT_MODULE if memory.setup_init_module + overhead <= gpu_bytes else NO


def setup_warning(memory: StrategyMemory, gpu_bytes: float, precision: str, per: str = "GPU") -> str:
    """One sentence for a strategy whose training fits but whose plain build does not; empty otherwise. `per`:
    what the memory is of ("GPU", or "process" on CPU)."""
    if not memory.fits or memory.setup_fits == FITS:
        return ""
    gib = 2**30
    head = (
        f"{memory.strategy}'s training fits, but setup does not: building the whole model on every rank takes "
        f"{memory.setup / gib:.2f} GiB per {per} plus 1 GiB of overhead, over {gpu_bytes / gib:.2f} GiB"
    )
    if memory.setup_fits == WITH_INIT_MODULE:
        return (
            f"{head}; build it under engine.init_module(), so that each rank materialises only its shard "
            f"({memory.setup_init_module / gib:.2f} GiB)"
        )
    if memory.setup_init_module < memory.setup:
        head += f", and {memory.setup_init_module / gib:.2f} GiB under engine.init_module()"
    if precision == "bf16-true":
        return f"{head}; build the model in bf16 directly (the planner counts an fp32 build cast afterwards)"
    return f"{head}; use more {'GPUs' if per == 'GPU' else 'machines'}"
