"""The simulator's request, checked: the model's work per step, the cluster, the strategy and its layout
(simulate.py predicts from it). Pure: no process group."""

from __future__ import annotations

import math
from dataclasses import dataclass

from multigpu.config.layout import CP_METHODS, HYBRID, SHARDS, LayoutSettings, ParallelDims, resolve_layout
from multigpu.config.pipeline import ZERO_BUBBLE, check_microbatches, check_schedule
from multigpu.core.errors import UsageError
from multigpu.planner.links import INTERCONNECTS
from multigpu.planner.rows import simulated, strategy_facts
from multigpu.strategies.facts import Communication


@dataclass(frozen=True)
class SimulateConfig:
    params: int
    compute_s: float  # one training step on one device (forward, backward, optimizer) at the per-device batch
    units_per_step: float  # samples or tokens per device per step
    layers: int = 1  # equal-sized units; zero3 gathers and scatters one at a time
    unit: str = "samples"
    gpus: tuple[int, ...] = (1, 2, 4, 8)
    gpus_per_node: int = 8
    interconnect: str = "infiniband"  # between nodes
    intra: str = "nvlink"  # inside a node
    strategy: str = "ddp"
    grad_bytes: int = 4  # 4: fp32 reductions, 2: bf16
    grad_payload: float | None = None  # a step's gradient bytes as compressed (grad_compression); None: uncompressed
    param_bytes: int = 4  # of parameter all-gathers; 2 for bf16 mixed precision
    bucket_mb: float = 25.0  # DDP's bucket_cap_mb (MiB)
    backward_fraction: float = 2 / 3  # backward is about twice the forward's FLOPs
    overlap: bool = True
    # A CPU host: processes on a node share its cores, so with more processes per node than slots each one's
    # compute stretches by processes / slots. None: every process has its own device.
    compute_slots_per_node: int | None = None
    # Model parallelism (tp inside a node, pp outermost, as the mesh lays them out). With either above 1,
    # compute_s and units_per_step are one data-parallel rank's: its batch, timed as if one device ran it all.
    tp_size: int = 1
    pp_size: int = 1
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    microbatches: int | None = None  # pipeline micro-batches per step; None: pp_size (x 2 for zbv, dualpipev)
    hidden: int = 0  # the model's width: tp's all-reduces and pp's sends move tokens x hidden activations
    tokens_per_unit: float = 1.0  # seq_len where the unit is samples
    activation_bytes: int = 2
    activation_checkpointing: str = "none"  # full's recomputed forward repeats its tp all-reduces
    tp_overlap: bool = False  # async tp: each all-reduce runs under the matmul it feeds, hidden up to the compute
    # Context parallelism: each sequence split over cp ranks (inside a node beside tp, as the mesh lays them out).
    cp_size: int = 1
    cp_method: str = "ulysses"
    heads: int = 0  # attention heads and key/value heads: what Ulysses' all-to-alls and ring's exchanges move
    kv_heads: int = 0
    attention_fraction: float = 0.0  # the share of compute_s in attention's score and value matmuls (ring hides
    # its exchanges under them)
    # Expert parallelism: a mixture's experts split over ep of the data-parallel x cp ranks (no GPUs of its own).
    ep_size: int = 1
    expert_params: int = 0  # of params, the routed experts' (their gradients reduce over data parallel / ep ranks)
    moe_layers: int = 0  # the layers that route tokens to experts: one dispatch and one combine each
    experts: int = 0  # routed experts per mixture layer (ep must divide them)
    experts_per_token: int = 0  # top-k: copies of each token the all-to-alls move

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", tuple(self.gpus))  # a list from the CLI would leave the config unhashable
        self._check_layout()
        positive = {"--params": self.params, "--compute-s": self.compute_s, "--units-per-step": self.units_per_step}
        for flag, value in positive.items():
            if not 0 < value < math.inf:
                raise UsageError(f"{flag} must be positive and finite (got {value:g}).")
        at_least_one = {
            "--layers": self.layers,
            "--gpus-per-node": self.gpus_per_node,
            "--grad-bytes": self.grad_bytes,
            "--param-bytes": self.param_bytes,
        }
        if self.compute_slots_per_node is not None:
            at_least_one["--compute-slots-per-node"] = self.compute_slots_per_node
        for flag, value in at_least_one.items():
            if not value >= 1:
                raise UsageError(f"{flag} must be 1 or more (got {value}).")
        if not self.gpus or any(not isinstance(g, int) or g < 1 for g in self.gpus):
            raise UsageError(f"--gpus must list GPU counts of 1 or more (got {list(self.gpus)}).")
        for flag, name in (("--interconnect", self.interconnect), ("--intra", self.intra)):
            if name not in INTERCONNECTS:
                raise UsageError(f"{flag} must be one of {', '.join(INTERCONNECTS)} (got {name!r}).")
        if self.strategy not in (modelled := simulated()):  # those whose facts describe their collectives
            raise UsageError(f"--strategy must be one of {', '.join(modelled)} (got {self.strategy!r}).")
        if not 0 < self.bucket_mb < math.inf:
            raise UsageError(f"--bucket-mb must be positive and finite (got {self.bucket_mb:g}).")
        if not 0 < self.backward_fraction < 1:
            raise UsageError(f"--backward-fraction must lie between 0 and 1 (got {self.backward_fraction:g}).")

    @property
    def communication(self) -> Communication:
        """The strategy's collectives (strategies/facts.py), which the simulator models."""
        communication = strategy_facts(self.strategy).communication
        assert communication is not None, f"{self.strategy} has no collectives to simulate (check refuses it)"
        return communication

    @property
    def model_parallel(self) -> int:
        """GPUs one model replica's weights are split over: tp x pp."""
        return self.tp_size * self.pp_size

    @property
    def replica_span(self) -> int:
        """GPUs one batch is split over: tp x pp x cp (cp's ranks each hold the whole weights of their stage)."""
        return self.model_parallel * self.cp_size

    def dims(self, n: int) -> ParallelDims:
        """The layout of `n` GPUs: tp x pp x cp per replica, the data-parallel strategy over the rest (resolved as
        zero3's is: every data-parallel strategy modelled here but hsdp needs only how many ranks share the rest;
        hsdp's replicas are one per node, its shards inside one)."""
        request = LayoutSettings(tp_size=self.tp_size, pp_size=self.pp_size, cp_size=self.cp_size, ep_size=self.ep_size)
        # A strategy whose shards' gradients are all-reduced across replicas (hsdp: zero3 over each node's GPUs,
        # whole replicas across the nodes); the others spread their collectives over every GPU.
        spread = HYBRID if self.communication.across_replicas else SHARDS
        return resolve_layout(request, spread, n, -(-n // self.gpus_per_node), self.strategy)

    def _check_layout(self) -> None:
        object.__setattr__(self, "pp_stages_per_rank", check_schedule(self.pp_schedule, self.pp_stages_per_rank))
        if self.microbatches is None:  # one per stage: per rank, as it always was here, for the older schedules
            per_rank = self.pp_stages_per_rank if self.pp_schedule in ZERO_BUBBLE else 1
            object.__setattr__(self, "microbatches", self.pp_size * per_rank)
        for flag, value in (
            ("--tp-size", self.tp_size),
            ("--pp-size", self.pp_size),
            ("--cp-size", self.cp_size),
            ("--ep-size", self.ep_size),
            ("--microbatches", self.microbatches),
        ):
            if not value >= 1:
                raise UsageError(f"{flag} must be 1 or more (got {value}).")
        if self.pp_size > 1:
            check_microbatches(self.pp_schedule, self.pp_size, self.pp_stages_per_rank, self.microbatches)
        if self.cp_method not in CP_METHODS:
            raise UsageError(f"--cp-method must be one of {', '.join(CP_METHODS)} (got {self.cp_method!r}).")
        self._check_experts()
        if self.replica_span == 1:
            return
        if self.hidden < 1 or not self.tokens_per_unit > 0:
            raise UsageError("tp, pp and cp move activations, so they need the model's width: give --model.")
        if self.cp_size > 1 and not (self.heads >= 1 and self.kv_heads >= 1):
            raise UsageError("cp moves attention's heads, so it needs the model's heads: give --model.")
        uneven = [n for n in self.gpus if n % self.replica_span]
        if uneven:
            cp = f" x cp {self.cp_size}" if self.cp_size > 1 else ""
            raise UsageError(
                f"--gpus {','.join(map(str, uneven))} cannot be split into tp {self.tp_size} x pp {self.pp_size}{cp} "
                f"groups; list multiples of {self.replica_span}."
            )

    def _check_experts(self) -> None:
        if self.ep_size == 1:
            return
        if not (self.experts and self.moe_layers and self.experts_per_token and self.hidden >= 1):
            raise UsageError(
                f"--ep-size {self.ep_size} splits a mixture's experts, so it needs a mixture-of-experts model's "
                "experts, top-k and width: give --model with one."
            )
        if self.experts % self.ep_size:
            raise UsageError(
                f"--ep-size {self.ep_size} does not divide the model's {self.experts} experts per layer; choose an ep "
                f"size that divides {self.experts}."
            )
