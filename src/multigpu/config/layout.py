"""How a job's processes are laid out: the degrees a run asks for, what the dimensions that take them do with the
model (their options), and ParallelDims, every degree resolved once, from the request and the world size, by
`resolve_layout`. Strategies, the data loader, the planner, the simulator and `auto` read the ParallelDims; nothing
else derives a degree. Pure arithmetic: no process group (the DeviceMesh is built in parallel/mesh.py).

The dimensions, outermost first (MESH_ORDER): pp (consecutive layers on consecutive groups of processes, across
nodes), replicate (whole copies whose gradients are averaged), shard (slices of parameters, gradients and optimizer
states), cp (slices of each sequence), tp (slices of each layer's matrices, between neighbouring processes, so
inside a node). ep (experts spread over ranks) reuses processes of shard x cp rather than adding its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from multigpu.config.settings import Settings, StrategyOptions, setting
from multigpu.core.errors import UsageError, require

#: Mesh dimensions outermost first. Ranks that differ only in the innermost dimension are neighbours (consecutive
#: ranks, so the same node), which is where tp's per-layer collectives must run; pp talks least, so it spans nodes.
MESH_ORDER = ("pp", "replicate", "shard", "cp", "tp")
#: How attention sees a whole sequence split over the cp ranks: ulysses (all-to-all from position slices to head
#: slices around attention and back; any device) or ring (torch's context_parallel passes keys and values round the
#: ranks; CUDA only).
CP_METHODS = ("ulysses", "ring")
EVEN = "even"  # batch_shares: every data-parallel rank reads batch_size samples of each global batch
AUTO = "auto"  # batch_shares and pp_split: measured as the run goes (engine/balance.py, strategies/pp.py)


@dataclass
class LayoutSettings(Settings):
    """The degrees a run asks for; the strategy's dimension takes the processes they leave (resolve_layout)."""

    replicate: int | None = setting(
        None, "hsdp: whole model replicas, each sharded over its processes (default: one per node)"
    )
    tp_size: int | None = setting(
        None,
        "tensor parallel degree: each layer of the model's tp_plan split over this many processes, which read the "
        "same batch (strategy tp: every process; zero2, zero3, hsdp: inside their data parallelism)",
    )
    pp_size: int | None = setting(
        None,
        "pipeline stages' processes: strategy pp over the rest as whole replicas, or zero2, zero3 or hsdp inside "
        "each stage (default for pp: every process outside tp)",
    )
    cp_size: int | None = setting(
        None,
        "context parallel degree: each sequence split by position over this many processes, which read the same "
        "batch (beside ddp, zero1, zero2, zero3, hsdp and pp; the sequence length a multiple of 2 x cp_size)",
    )
    ep_size: int | None = setting(
        None,
        "expert parallel degree: a mixture-of-experts model's experts spread over this many of the data-parallel "
        "processes (times cp), tokens sent to their experts' ranks and back by all-to-all (beside ddp, zero2, zero3, "
        "hsdp and pp; the number of experts a multiple of it)",
    )
    cp_method: str = setting(
        "ulysses",
        "with cp_size: ulysses (all-to-all to whole sequences of a slice of the heads around attention; any device) "
        "or ring (torch's ring attention; CUDA only)",
        choices=CP_METHODS,
    )
    batch_shares: str = setting(
        EVEN,
        "each data-parallel rank's part of every global batch: even; auto (from even, moved toward each rank's "
        "measured speed every few steps, within what its memory holds); or one weight per data-parallel rank "
        "(replicas x shards, in rank order; the tp, cp and pp ranks of a group share its part), e.g. 3,1 for a GPU "
        "three times as fast as the other; the global batch stays batch_size x data-parallel ranks",
    )

    def check(self) -> None:
        parse_shares(self.batch_shares)
        require(
            (
                self.replicate is None or self.replicate >= 1,
                f"replicate must be 1 or more (got {self.replicate}); leave it unset for one replica per node.",
            ),
            (
                self.tp_size is None or self.tp_size >= 1,
                f"tp_size must be 1 or more (got {self.tp_size}); leave it unset for none.",
            ),
            (
                self.pp_size is None or self.pp_size >= 1,
                f"pp_size must be 1 or more (got {self.pp_size}); leave it unset for none.",
            ),
            (
                self.cp_size is None or self.cp_size >= 1,
                f"cp_size must be 1 or more (got {self.cp_size}); leave it unset for none.",
            ),
            (
                self.ep_size is None or self.ep_size >= 1,
                f"ep_size must be 1 or more (got {self.ep_size}); leave it unset for none.",
            ),
        )


@dataclass
class TensorParallelOptions(StrategyOptions):
    """What tensor parallelism splits besides the layers of the model's tp_plan."""

    sequence_parallel: bool = setting(
        False,
        "with tp: also split a Hugging Face decoder's norms and residual stream by sequence position over the tp "
        "processes (less activation memory; the sequence length must be a multiple of tp_size)",
    )

    def splits_sequence(self) -> bool:
        """Strategy.splits_sequence, for the strategies that take these options."""
        return self.sequence_parallel


@dataclass
class ShardingOptions(StrategyOptions):
    """What zero2, zero3 and hsdp do with their shards (the planner counts both)."""

    cpu_offload: bool = setting(False, "zero3: keep the sharded parameters in CPU memory, and step there")
    unsharded_grad_accum: bool = setting(
        False,
        "zero2/zero3: accumulate whole gradients locally and reduce-scatter once per optimizer step (less "
        "communication, a full gradient per rank) instead of on every micro-step",
    )


def check_tp_heads(config: object, degree: int) -> None:
    """Refuses a tp degree that does not divide a Hugging Face config's attention heads (each process must get whole
    heads). The CLI asks this of the model's config before any process starts; strategy tp of the model it builds."""
    for heads in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, heads, None)
        if isinstance(count, int) and count % degree:
            raise UsageError(
                f"A tensor-parallel degree of {degree} (tp_size, or the processes of strategy tp) does not divide the "
                f"model's {count} {heads.replace('num_', '').replace('_', ' ')}; choose a degree that divides it."
            )


def cp_chunks(cp: int) -> int:
    """The equal chunks context parallelism over `cp` ranks cuts each sequence into: 2 x cp, each rank a head and a
    tail chunk (so that under causal attention every rank has the same work); 1 without context parallelism."""
    return 2 * cp if cp > 1 else 1


def parse_shares(text: str) -> tuple[float, ...] | None:
    """batch_shares' weights, or None for even (and auto, which starts even); one sentence refuses anything else."""
    if text.strip() in (EVEN, AUTO):
        return None
    try:
        weights = tuple(float(part) for part in text.split(","))
    except ValueError:
        weights = ()
    if not weights or not all(0 < weight < math.inf for weight in weights):
        raise UsageError(
            f"batch_shares must be even, auto or positive finite weights separated by commas, one per data-parallel "
            f"rank (e.g. 3,1), not {text!r}."
        )
    if math.isinf(sum(weights)):  # each finite, their sum not: every part would come out NaN
        raise UsageError(
            f"batch_shares {text} adds up to more than a float holds; give weights in proportion to each rank's part, "
            "of ordinary size (e.g. 3,1)."
        )
    return weights


def split_by_shares(samples: int, shares: Sequence[float]) -> list[int]:
    """`samples` split over the ranks in proportion to `shares`, the parts adding up to `samples` and each at least
    one (`samples` >= ranks): the whole parts of the exact shares, then the rest by largest remainder (ties to the
    lower rank). Pure arithmetic on the same numbers, so every rank computes every rank's part alike."""
    total = sum(shares)
    exact = [samples * share / total for share in shares]
    parts = [max(1, math.floor(value)) for value in exact]
    ranks = range(len(shares))
    while sum(parts) < samples:
        parts[max(ranks, key=lambda rank: (exact[rank] - parts[rank], -rank))] += 1
    while sum(parts) > samples:  # the minimum of one overshot: back from the part furthest above its share
        parts[max((rank for rank in ranks if parts[rank] > 1), key=lambda rank: (parts[rank] - exact[rank], rank))] -= 1
    return parts


@dataclass(frozen=True)
class ParallelDims:
    """Every degree of a job, resolved: their product is the number of processes; and each data-parallel rank's
    share of the global batch (None: even)."""

    replicate: int = 1  # full model copies whose gradients are averaged (ddp)
    shard: int = 1  # processes that each hold a slice of parameters, gradients and optimizer states (zero2/zero3)
    cp: int = 1  # context parallel: each sequence split by position
    tp: int = 1  # tensor parallel: each layer's matrices split across processes
    pp: int = 1  # pipeline parallel: consecutive groups of layers on different processes
    ep: int = 1  # expert parallel: a mixture's experts spread over data-parallel x cp ranks (no processes of its own)
    shares: tuple[float, ...] | None = None  # batch_shares, one weight per data-parallel rank

    def __post_init__(self) -> None:
        for item in fields(self):
            if item.name == "shares":
                continue
            degree = getattr(self, item.name)
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise UsageError(
                    f"The {item.name} degree must be a whole number of at least 1, not {degree!r}; "
                    f"set {item.name} to 1 or more."
                )
        pool, named = self.expert_pool
        if pool % self.ep:
            raise UsageError(
                f"ep_size {self.ep} spreads experts over the {pool} data-parallel processes ({named}) and does not "
                f"divide them; choose an ep_size that divides {pool}."
            )

    @property
    def expert_pool(self) -> tuple[int, str]:
        """How many processes an ep group is drawn from, and which dimensions those are: the shards (x cp) where
        parameters are sharded, else the replicas (x cp). An ep group is `ep` consecutive ranks of that pool, so
        its all-to-alls stay inside a node as the shards' collectives do."""
        inner = "shard" if self.shard > 1 else "replicate"
        degree = getattr(self, inner) * self.cp
        return degree, f"{inner} {getattr(self, inner)}" + (f" x cp {self.cp}" if self.cp > 1 else "")

    @property
    def world_size(self) -> int:
        """The number of processes this layout needs."""
        return math.prod(getattr(self, name) for name in MESH_ORDER)

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step trains on: replicas and shards each read their own."""
        return self.replicate * self.shard

    @property
    def batch_fractions(self) -> tuple[float, ...]:
        """Each data-parallel rank's fraction of every global batch, in data-parallel rank order: its batch_shares
        weight over their sum (equal fractions when even)."""
        shares = self.shares or (1.0,) * self.data_parallel_size
        return tuple(share / sum(shares) for share in shares)

    def data_parallel_rank(self, rank: int) -> int:
        """Which of the data-parallel ranks global `rank` is: its index over (replicate, shard), as the mesh lays
        ranks out (MESH_ORDER: the cp and tp ranks of one replica are consecutive and read the same batch)."""
        return (rank // (self.cp * self.tp)) % self.data_parallel_size

    def sequence_multiple(self, sequence_parallel: bool) -> int:
        """What each batch's sequence length must be a multiple of: the tensor-parallel degree under
        sequence_parallel (every tp process takes an equal slice of the positions) and cp_chunks under context
        parallelism."""
        return math.lcm(self.tp if sequence_parallel else 1, cp_chunks(self.cp))

    def in_mesh(self, keep: Sequence[str] = ()) -> tuple[tuple[str, int], ...]:
        """(name, degree) of the mesh's dimensions, outermost first: those of degree above 1, and those in `keep`
        whatever their degree (a strategy keeps its own, so that `mesh["shard"]` works in a one-process run)."""
        unknown = [name for name in keep if name not in MESH_ORDER]
        if unknown:
            raise UsageError(f"Unknown mesh dimension(s) {unknown}; choose from {', '.join(MESH_ORDER)}.")
        return tuple((name, getattr(self, name)) for name in MESH_ORDER if getattr(self, name) > 1 or name in keep)

    @property
    def names(self) -> tuple[str, ...]:
        """The dimensions in use (degree above 1), outermost first."""
        return tuple(name for name, _ in self.in_mesh())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(degree for _, degree in self.in_mesh())

    def check(self, world_size: int) -> None:
        """Refuses a layout that does not use exactly the `world_size` processes launched."""
        if self.world_size != world_size:
            product = " x ".join(f"{name} {getattr(self, name)}" for name in ("replicate", "shard", "cp", "tp", "pp"))
            launched = f"{world_size} was" if world_size == 1 else f"{world_size} were"
            raise UsageError(
                f"{product} = {self.world_size} processes, but {launched} launched; launch {self.world_size} "
                f"(multigpu run -n {self.world_size}) or choose degrees whose product is {world_size}."
            )


@dataclass(frozen=True)
class Spread:
    """How a strategy lays processes out: `takes`, the degrees a run may ask for beside it (tp_size, pp_size,
    replicate), and `fills`, the dimensions that take the processes those leave (the first one not asked for takes
    them all)."""

    fills: tuple[str, ...] = ()
    takes: frozenset[str] = field(default_factory=frozenset)
    gpus_in_process: bool = False  # one process drives several GPUs: batch_shares splits each batch over them


ALONE = Spread()  # one process: single
IN_PROCESS = Spread(gpus_in_process=True)  # dp: one process, a replica per GPU
REPLICAS = Spread(("replicate",), frozenset({"cp", "ep"}))  # ddp
# zero1: ZeroRedundancyOptimizer partitions whole parameters over the replicas, which ep's experts are not
OPTIMIZER_SHARDS = Spread(("replicate",), frozenset({"cp"}))
SHARDS = Spread(("shard",), frozenset({"tp", "pp", "cp", "ep"}))  # zero2, zero3
# hsdp: replicas (one per node), shards inside
HYBRID = Spread(("shard",), frozenset({"replicate", "tp", "pp", "cp", "ep"}))
TENSOR = Spread(("tp",), frozenset({"tp"}))  # tp: every process splits every planned layer
#: pp: stages over the rest, or pp_size and replicas
PIPELINE = Spread(("pp", "replicate"), frozenset({"pp", "tp", "cp", "ep"}))
OWN_GROUPS = Spread(("shard",))  # deepspeed: every process a ZeRO partition, in groups DeepSpeed makes itself


def resolve_layout(request: LayoutSettings, spread: Spread, world: int, nodes: int = 1, name: str = "") -> ParallelDims:
    """The degrees of `world` processes on `nodes` machines under a strategy `name` that spreads them so: those asked
    for, a replicate beside the shards defaulting to one per node (per pipeline), and the rest on the strategy's
    dimension. Refuses, with the numbers, degrees that do not divide the processes."""
    pp, tp, cp = request.pp_size or 1, request.tp_size or 1, request.cp_size or 1
    if world % pp:
        raise UsageError(
            f"pp_size {pp} does not divide the {world} processes launched; choose a pp_size that divides {world}, or "
            f"launch a multiple of {pp}."
        )
    if spread.fills == ("tp",) and tp not in (1, world):  # strategy tp: the layers split over every process
        raise UsageError(
            f"Strategy {name} splits each layer over every process, so tp_size {tp} needs {tp} processes, but {world} "
            f"were launched; launch {tp}, or add data parallelism with strategy zero2, zero3 or hsdp and tp_size {tp}."
        )
    if (world // pp) % tp:
        what = f"pp {pp} x tp {tp}" if pp > 1 else f"{name} x tp {tp}"
        raise UsageError(
            f"{what} needs a multiple of {pp * tp} processes, but {world} were launched; launch a multiple of "
            f"{pp * tp} or choose a tp_size that divides {world // pp}."
        )
    if (world // (pp * tp)) % cp:
        beside = "".join(f" x {dim} {size}" for dim, size in (("pp", pp), ("tp", tp)) if size > 1)
        raise UsageError(
            f"cp_size {cp}{beside} needs a multiple of {pp * tp * cp} processes, but {world} were launched; launch a "
            f"multiple of {pp * tp * cp} or choose a cp_size that divides {world // (pp * tp)}."
        )
    sizes = (("pp", request.pp_size), ("tp", request.tp_size), ("cp", request.cp_size))
    degrees = {dim: size for dim, size in sizes if size is not None}
    groups = world // (pp * tp * cp)
    if "replicate" in spread.takes:
        replicate = request.replicate or max(1, nodes // pp)
        if groups % replicate:
            divisors = ", ".join(str(d) for d in range(1, groups + 1) if groups % d == 0)
            split = " x ".join(f"{dim} {size}" for dim, size in (("cp", cp), ("tp", tp)) if size > 1)
            of = f"groups of {split}" if split else "processes"
            raise UsageError(
                f"{name} cannot split {groups} {of} into {replicate} equal replicas; choose a replicate degree that "
                f"divides {groups} ({divisors})."
            )
        degrees["replicate"] = replicate
    rest = world // math.prod(degrees.values())
    taker = next((dim for dim in spread.fills if dim not in degrees), None)
    if taker is not None:
        degrees[taker] = rest
    elif rest != 1:
        raise UsageError(
            f"Strategy {name} runs in one process, but {world} were launched and would each train alone; launch one "
            "process, or use ddp/zero1/zero2/zero3."
        )
    dims = ParallelDims(**degrees, ep=request.ep_size or 1)
    if spread.gpus_in_process:  # the shares split each batch over the process's GPUs: the strategy takes them
        return dims
    return replace(dims, shares=resolve_shares(getattr(request, "batch_shares", EVEN), dims, name))


def node_crossings(dims: ParallelDims, per_node: int) -> list[str]:
    """A sentence for each group of `dims` that talks at every layer yet would span two nodes of `per_node`
    processes: tp's and cp's groups, and the shards inside each replica (hsdp: its all-gathers run every layer, its
    replicas only once a step). Consecutive ranks share a node, and a group of b consecutive ranks stays inside one
    exactly when b divides the processes per node. pp's stages may cross nodes: they pass activations once a layer
    group."""
    blocks = [("tp", dims.tp, "tp_size"), ("cp", dims.cp * dims.tp, "cp_size")]
    if dims.replicate > 1 and dims.shard > 1:
        blocks.append(("shard", dims.shard * dims.cp * dims.tp, "replicate"))
    lines = []
    for dim, size, flag in blocks:
        if getattr(dims, dim) > 1 and per_node % size:
            fix = (
                f"set replicate to {dims.world_size // per_node} (one replica per node)"
                if dim == "shard" and dims.world_size % per_node == 0
                else f"choose a {flag} whose group divides the {per_node} processes of a node"
            )
            lines.append(
                f"the {dim} groups of {size} processes cross the node boundaries ({per_node} processes per node), so "
                f"their collectives at every layer go over the network; {fix}"
            )
    return lines


def resolve_shares(text: str, dims: ParallelDims, name: str) -> tuple[float, ...] | None:
    """batch_shares' weights for `dims`, one per data-parallel rank; one sentence refuses a count that differs."""
    shares, readers = parse_shares(text), dims.data_parallel_size
    auto = text.strip() == AUTO
    if (shares is None and not auto) or (shares is not None and len(shares) == readers) or (auto and readers > 1):
        return shares
    if readers == 1:
        raise UsageError(
            f"batch_shares {text} splits each global batch between data-parallel ranks, but {name} on "
            f"{dims.world_size} process{'es' if dims.world_size > 1 else ''} has one (every process reads the same "
            "batch); drop batch_shares, or add data parallelism (ddp, zero2, zero3 or hsdp)."
        )
    groups = " x ".join(f"{dim} {getattr(dims, dim)}" for dim in ("replicate", "shard") if getattr(dims, dim) > 1)
    inside = " x ".join(f"{dim} {getattr(dims, dim)}" for dim in ("pp", "cp", "tp") if getattr(dims, dim) > 1)
    shared = f"; the {inside} ranks of each share its part" if inside else ""
    raise UsageError(
        f"batch_shares names {len(shares)} weight{'s' if len(shares) > 1 else ''}, but {name} on {dims.world_size} "
        f"processes reads {readers} different batches ({groups}{shared}); give {readers} weights, or even."
    )
