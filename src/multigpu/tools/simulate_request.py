"""`multigpu simulate` around the arithmetic of simulate.py: links calibrated from measured collectives
(`multigpu bench --collectives`), a step's compute from a bench run or from FLOPs, the request the CLI maps onto,
and the table or JSON it prints.
"""

from __future__ import annotations

import functools
import io
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from multigpu.config.flags import json_value, parse_groups, parse_list, read_json
from multigpu.config.layout import LayoutSettings
from multigpu.config.pipeline import PipelineOptions
from multigpu.config.settings import Settings, setting, shown, shown_group
from multigpu.core.errors import UsageError
from multigpu.engine.config import EngineConfig
from multigpu.parallel.compression import Compression, CompressionOptions, payload_bytes, refuse_powersgd
from multigpu.planner.failures import FailureSettings
from multigpu.planner.rows import simulated
from multigpu.planner.simulate import (
    INTERCONNECTS,
    OPS,
    Link,
    Links,
    MixedPrediction,
    Prediction,
    SimulateConfig,
    compute_time,
    flops_per_token,
    hops_and_factor,
    simulate,
    simulate_mixed,
)
from multigpu.planner.simulate_advice import link_advice
from multigpu.strategies import strategy_class
from multigpu.tools.simulate_failures import assumptions, failure_rows, failure_table
from multigpu.transforms.recompute import FORWARD_RUN_AGAIN

if TYPE_CHECKING:  # the planner's shapes are imported where a request is resolved
    from multigpu.planner.shapes import ModelShape, Transformer


def fit_link(results: list[dict[str, Any]], world_size: int) -> Link:
    """Least-squares alpha and bus bandwidth from collective timings, under simulate.py's ring model."""
    if not isinstance(world_size, int) or world_size < 2:
        raise UsageError(f"Calibration needs timings from 2 or more ranks (got world_size {world_size}).")
    rows, sizes = [], set()
    for result in results:
        if isinstance(result, dict) and result.get("correct") is False:  # the bench flags wrong answers; skip them
            continue
        try:
            hops, factor = hops_and_factor(result["op"], world_size)
            size, seconds = float(result["bytes"]), float(result["time_s"])
        except (KeyError, TypeError, ValueError) as error:
            raise UsageError(f"A calibration result needs op, bytes and time_s ({error!r} in {result}).") from None
        # Dividing each row by its time fits relative error, so the small messages that fix alpha count as much
        # as the large ones that fix bandwidth.
        if not seconds > 0:
            raise UsageError(f"A calibration time must be positive (got {seconds:g} s for {size:g} bytes).")
        rows.append([hops / seconds, factor * size / seconds])
        sizes.add(factor * size)
    if len(sizes) < 2:
        raise UsageError("Calibration needs timings at two or more message sizes; rerun the benchmark with more.")
    a, b = np.array(rows), np.ones(len(rows))
    (alpha, inverse_bw), *_ = np.linalg.lstsq(a, b, rcond=None)
    if alpha < 0:  # latency below resolution: refit the bandwidth alone
        alpha, inverse_bw = 0.0, float(a[:, 1] @ b / (a[:, 1] @ a[:, 1]))
    if not inverse_bw > 0:
        raise UsageError("The timings do not grow with message size, so no bandwidth fits; rerun with larger sizes.")
    return Link(alpha_s=float(alpha), bandwidth_Bps=float(1 / inverse_bw))


def load_calibration(path: str | Path, flag: str = "--calibration") -> Links:
    """One Link per collective, each fitted to that op's timings in a `multigpu bench --collectives` JSON file.

    gloo's reduce-scatter, the one FSDP calls, runs a whole all-reduce (the bench times a true reduce-scatter
    instead and notes it), so on gloo it is costed as the all-reduce it is: twice the hops and the bytes.
    """
    how, what = "write it with `multigpu bench --collectives` first", "a JSON file from `multigpu bench --collectives`"
    data = read_json(path, how, flag, what)
    get = functools.partial(json_value, file=path, advice="use the file `multigpu bench --collectives` writes")
    get(data, None, dict)
    world = get(data, "world_size", int, minimum=2, advice="calibrate with `multigpu bench --collectives --nproc 2`")
    results = get(data, "results", list, items=dict)
    for index, row in enumerate(results):
        get(row, "op", str, f"results[{index}]", choices=OPS)
        for key in ("bytes", "time_s"):
            get(row, key, float, f"results[{index}]", positive=True)
        get(row, "correct", bool, f"results[{index}]", optional=True)
    backend = get(data, "backend", str, optional=True)
    measured = {row["op"] for row in results}
    links = {op: fit_link([r for r in results if r["op"] == op], world) for op in OPS if op in measured}
    fallback = fit_link(results, world)
    links = {op: links.get(op, fallback) for op in OPS}
    if backend == "gloo":
        ring = links["all_reduce"]
        links["reduce_scatter"] = Link(2 * ring.alpha_s, ring.bandwidth_Bps / 2)
    return links


def to_json(predictions: list[Prediction], failures: list[dict[str, Any]] | None = None) -> str:
    rows = [asdict(p) for p in predictions]
    for row, failure in zip(rows, failures or [], strict=False):  # --mtbf-hours: each count's goodput beside it
        row["failures"] = failure
    return json.dumps(rows, indent=2)


def format_table(predictions: list[Prediction], title: str | None = None) -> str:
    """A rich table as text, for a terminal or a log."""
    from rich.table import Table

    unit = predictions[0].unit if predictions else "samples"
    table = Table(title=title)
    pipelined, routed = any(p.bubble_s for p in predictions), any(p.all_to_all_s for p in predictions)
    times = ("step s", "compute s", "comm s", "exposed s", *(("bubble s",) if pipelined else ()))
    times += ("all-to-all s",) if routed else ()
    for column in ("GPUs", "nodes", *times, f"{unit}/s", f"{unit}/s/GPU", "speedup", "efficiency"):
        table.add_column(column, justify="right")
    for p in predictions:
        seconds = (p.step_s, p.compute_s, p.comm_s, p.exposed_comm_s, *((p.bubble_s,) if pipelined else ()))
        seconds += (p.all_to_all_s,) if routed else ()
        times = (f"{t:.4f}" for t in seconds)
        rates = (f"{p.throughput:,.1f}", f"{p.per_gpu_throughput:,.1f}", f"{p.speedup:.2f}", f"{p.efficiency:.1%}")
        table.add_row(str(p.gpus), str(p.nodes), *times, *rates)
    return rendered(table)


def rendered(table: Any) -> str:
    """A rich table as text, 150 columns wide, without colour."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=150, color_system=None)
    console.print(table)
    return console.file.getvalue()


def format_mixed(mixed: MixedPrediction) -> str:
    """Even against speed-balanced batch shares, as a table, and the --batch-shares that balance them."""
    from rich.table import Table

    kinds = " + ".join(f"{mixed.tflops.count(peak)} x {peak:g}" for peak in dict.fromkeys(mixed.tflops))
    unit = mixed.even.unit
    table = Table(title=f"{len(mixed.tflops)} GPUs of {kinds} peak TFLOPS, data parallel")
    for column in ("batch shares", "step s", "compute s", "exposed comm s", f"{unit}/s", "vs even"):
        table.add_column(column, justify="right")
    for name, p in (("even", mixed.even), ("by speed", mixed.balanced)):
        speedup = mixed.even.step_s / p.step_s
        times = (f"{t:.4f}" for t in (p.step_s, p.compute_s, p.exposed_comm_s))
        table.add_row(name, *times, f"{p.throughput:,.1f}", f"{speedup:.2f}x")
    weights = ",".join(f"{peak:g}" for peak in mixed.tflops)
    return rendered(table) + f"balanced by: --batch-shares {weights}\n"


@dataclass
class SimulateRequest(Settings):
    """`multigpu simulate`'s flags, one to one; `resolve` turns them into a SimulateConfig and its links. The strategy
    and layout simulated are the Engine's settings (config/settings.py: shown); simulate models the data-parallel
    strategies."""

    strategy: str = shown(EngineConfig, default="ddp", note="; simulate: the data-parallel one", choices=simulated())
    activation_checkpointing: str = shown(
        EngineConfig,
        note=" (simulate: full runs the forward again, a third more compute with --tflops, and tp's forward "
        "all-reduces again; offload's copies to host memory are not modelled)",
    )
    tp_size: int | None = shown(EngineConfig, default=1, note="; simulate: inside a node")
    pp_size: int | None = shown(EngineConfig, default=1)
    cp_size: int | None = shown(
        EngineConfig,
        default=1,
        note="; simulate: inside a node beside tp where they fit; --gpus lists multiples of tp x pp x cp",
    )
    ep_size: int | None = shown(
        EngineConfig,
        default=1,
        note="; simulate: each mixture layer's dispatch and combine all-to-alls, the experts' gradients reduced "
        "over the data-parallel ranks / ep, compute from the active parameters; --gpus lists multiples of tp x pp "
        "x ep",
    )
    microbatches: int | None = shown(EngineConfig, "pp_microbatches")
    # The layout's, the pipeline's and the compression's other settings, as the Engine defines them.
    _layout = shown_group(
        EngineConfig,
        LayoutSettings,
        PipelineOptions,
        CompressionOptions,
        omit=("replicate", "batch_shares", "pp_split"),
    )
    # The model, the cluster and the step, simulate's own.
    model: str | None = setting(None, "a built-in model name or a config.json (or its dir)")
    params: float | None = setting(None, "parameter count instead of --model, e.g. 7e9")
    layers: int | None = setting(None, "with --params: layers (zero3's units)")
    gpus: str = setting("1,2,4,8,16,32,64,128", "comma-separated GPU counts")
    gpus_per_node: int = setting(8, "GPUs in one node")
    interconnect: str = setting("infiniband", "fabric between nodes", choices=INTERCONNECTS)
    intra: str = setting("nvlink", "link inside a node", choices=INTERCONNECTS)
    compute_s: float | None = setting(None, "seconds of one step on one device, if known")
    units_per_step: float | None = setting(None, "with --compute-s: samples per device")
    bench: str | None = setting(None, "take compute time and units from a bench.json's 1-process cell")
    tflops: str | None = setting(
        None,
        "device peak TFLOPS, to derive the compute time; GPUs of different speeds as one value per GPU or "
        "COUNTxTFLOPS groups (4x989,4x312): the step with even batch shares against shares by speed",
    )
    mfu: float = setting(0.4, "with --tflops: the utilisation assumed")
    seq_len: int = setting(2048, "tokens per sample (--tflops; tp/pp's activations)")
    batch_size: int = setting(1, "with --tflops: samples per device per step (with tp/pp: per replica)")
    grad_bytes: int = setting(4, "bytes per gradient element reduced (4: fp32, 2: bf16)")
    param_bytes: int = setting(2, "bytes per parameter all-gathered (2: bf16 compute)")
    bucket_mb: float = setting(25.0, "DDP bucket size, MiB")
    overlap: bool = setting(True, "overlap communication with backward / prefetch")
    compute_slots_per_node: int | None = setting(
        None, "CPU hosts: cores shared by a node's processes (compute slows beyond it)"
    )
    calibration: str | None = setting(None, "a bench --collectives JSON: replaces the intra-node link")
    inter_calibration: str | None = setting(
        None, "a bench --collectives JSON taken across nodes: replaces the inter-node link"
    )
    tp_overlap: bool = setting(False, "async tp: hide tp's all-reduces under the matmuls")
    _failures = shown_group(FailureSettings)  # --mtbf-hours and what failures cost (planner/failures.py)


def resolve(request: SimulateRequest) -> tuple[SimulateConfig, Link | None, Link | None]:
    shape = requested_shape(request)
    check_layout(request, shape)
    gpus = gpu_counts(request)
    compute, units, unit = step_compute(request, shape)
    config = SimulateConfig(
        params=shape.params,
        compute_s=compute,
        units_per_step=units,
        layers=shape.transformer.layers if shape.transformer else (request.layers or 1),
        unit=unit,
        gpus=gpus,
        gpus_per_node=request.gpus_per_node,
        interconnect=request.interconnect,
        intra=request.intra,
        strategy=request.strategy,
        grad_bytes=request.grad_bytes,
        grad_payload=compressed_gradients(request, shape),
        param_bytes=request.param_bytes,
        bucket_mb=request.bucket_mb,
        overlap=request.overlap,
        compute_slots_per_node=request.compute_slots_per_node,
        tp_size=request.tp_size,
        pp_size=request.pp_size,
        pp_schedule=request.pp_schedule,
        pp_stages_per_rank=request.pp_stages_per_rank,
        microbatches=request.microbatches,
        hidden=shape.transformer.hidden if shape.transformer else 0,
        tokens_per_unit=1.0 if unit == "tokens" else float(request.seq_len),
        activation_checkpointing=request.activation_checkpointing,
        tp_overlap=request.tp_overlap,
        cp_size=request.cp_size,
        cp_method=request.cp_method,
        heads=shape.transformer.heads if shape.transformer else 0,
        kv_heads=shape.transformer.kv_heads if shape.transformer else 0,
        attention_fraction=attention_fraction(shape, request.seq_len),
        ep_size=request.ep_size,
        expert_params=shape.expert_params,
        moe_layers=shape.transformer.moe_layers if shape.transformer else 0,
        experts=shape.experts,
        experts_per_token=shape.transformer.experts_per_token if shape.transformer else 0,
    )
    intra = load_calibration(request.calibration) if request.calibration else None
    inter = load_calibration(request.inter_calibration, "--inter-calibration") if request.inter_calibration else None
    return config, intra, inter


def requested_shape(request: SimulateRequest) -> ModelShape:
    """The model's shape, from --model or --params (one of them)."""
    from multigpu.planner.shapes import from_counts, load_shape

    if (request.model is None) == (request.params is None):
        raise UsageError("Give the model as --model (a name or config.json) or as --params, not both.")
    if request.model is not None:
        return load_shape(request.model)
    return from_counts(request.params, None, None, None, None)


def check_layout(request: SimulateRequest, shape: ModelShape) -> None:
    """Refuses a compute time given other than one way, and a layout the model's shape cannot be split by."""
    sources = [request.compute_s is not None, request.bench is not None, request.tflops is not None]
    if sum(sources) != 1:
        raise UsageError("Give the compute time one way: --compute-s (with --units-per-step), --bench or --tflops.")
    mp = request.tp_size * request.pp_size * request.cp_size
    if (mp > 1 or request.ep_size > 1) and shape.transformer is None:
        raise UsageError(
            "--tp-size, --pp-size, --cp-size and --ep-size move activations, so they need the model's width: give "
            "--model."
        )
    cp = request.cp_size
    if cp > 1 and request.seq_len % (2 * cp):
        raise UsageError(
            f"--seq-len {request.seq_len} is not a multiple of 2 x --cp-size {cp} = {2 * cp} (each cp rank holds a "
            f"head and a tail chunk of every sequence); choose a multiple of {2 * cp}."
        )


def device_tflops(request: SimulateRequest) -> list[float]:
    """--tflops: one peak (every GPU alike), or one per GPU of a mixed cluster; [] without --tflops."""
    if request.tflops is None:
        return []
    # (str: a number given from Python or a config file reads as its text)
    return parse_groups(str(request.tflops), "--tflops", float, "989, or 4x989,4x312 for GPUs of two speeds")


def check_mixed(request: SimulateRequest, peaks: list[float]) -> None:
    """A mixed cluster's --tflops counts its GPUs, and is simulated where each GPU reads its own share of the batch."""
    if request.gpus != SimulateRequest.gpus and parse_list(request.gpus, "--gpus", int) != [len(peaks)]:
        raise UsageError(
            f"--tflops lists {len(peaks)} GPUs and --gpus {request.gpus} says otherwise; drop --gpus (the --tflops "
            "groups count the GPUs)."
        )
    if request.tp_size * request.pp_size * request.cp_size * request.ep_size > 1:
        raise UsageError(
            "GPUs of different speeds are simulated under data parallelism alone, each GPU taking its own share of "
            "the batch; drop --tp-size, --pp-size, --cp-size and --ep-size."
        )
    if not all(0 < peak < math.inf for peak in peaks):
        raise UsageError(f"--tflops must be positive (got {request.tflops}).")
    if request.mtbf_hours is not None:
        raise UsageError("--mtbf-hours is simulated for GPUs of one speed; drop it, or give --tflops one value.")


def gpu_counts(request: SimulateRequest) -> tuple[int, ...]:
    """The GPU counts of --gpus; of the default list, those the layout divides; a mixed cluster's count."""
    peaks = device_tflops(request)
    if len(peaks) > 1:
        check_mixed(request, peaks)
        return (len(peaks),)
    gpus = tuple(parse_list(request.gpus, "--gpus", int))
    mp = request.tp_size * request.pp_size * request.cp_size
    divides = math.lcm(mp, request.tp_size * request.pp_size * request.ep_size)  # ep: of the dp x cp ranks
    if divides > 1 and request.gpus == SimulateRequest.gpus:  # the default list: keep the counts the layout divides
        gpus = tuple(n for n in gpus if n % divides == 0) or (divides,)
    return gpus


def step_compute(request: SimulateRequest, shape: ModelShape) -> tuple[float, float, str]:
    """(seconds of one step on one device, the units it trains, their name) from --compute-s, --bench or --tflops."""
    if request.compute_s is not None:
        if request.units_per_step is None:
            raise UsageError("--compute-s needs --units-per-step, the samples one device trains per step.")
        return request.compute_s, request.units_per_step, "samples"
    if request.bench is not None:
        return from_bench(Path(request.bench), request.strategy)
    units = request.batch_size * request.seq_len
    compute = compute_time(flops_per_token(shape, request.seq_len), units, max(device_tflops(request)), request.mfu)
    compute *= 1 + FORWARD_RUN_AGAIN[request.activation_checkpointing] / 3  # a forward: a third of the FLOPs
    return compute, units, "tokens"


def attention_fraction(shape: ModelShape, seq_len: int) -> float:
    """The share of a step's FLOPs in attention's score and value matmuls (flops_per_token's second term); 0
    without a transformer's dimensions."""
    t = shape.transformer
    return 12.0 * t.layers * t.q_hidden * seq_len / flops_per_token(shape, seq_len) if t else 0.0


def compressed_gradients(request: SimulateRequest, shape: ModelShape) -> float | None:
    """A step's gradient bytes as grad_compression sends them (None: uncompressed, params x grad_bytes): 2 per
    element with bf16 or fp16, PowerSGD's factors of each matrix of the model (needs its shape: --model)."""
    compression = Compression.parse(request.grad_compression)
    if compression.kind == "none":
        return None
    if "powersgd" not in strategy_class(request.strategy).composes_with:  # DDP's communication hook runs it
        refuse_powersgd(request.strategy, request.grad_compression)
    if compression.kind != "powersgd":
        return float(payload_bytes([(shape.params,)], compression, request.grad_bytes))
    if shape.transformer is None:
        raise UsageError("PowerSGD's bytes depend on the model's matrices; give --model instead of --params.")
    return float(payload_bytes(gradient_shapes(shape.transformer), compression, request.grad_bytes))


def gradient_shapes(t: Transformer) -> list[tuple[int, ...]]:
    """The shapes of a decoder's parameters, as torch holds them: each projection (out, in), the embeddings and
    head (vocab, hidden), and the RMSNorm weights (hidden)."""
    norms = [(t.hidden,)] * 2
    layer = [(o, i) for i, o in t.linears().values()] + norms
    # a mixture layer: its linears, the router, and the experts' two 3-D weights (gate_up and down), as Hugging Face
    # holds them
    experts = [(t.experts, t.hidden), (t.experts, 2 * t.expert_intermediate, t.hidden)]
    experts += [(t.experts, t.hidden, t.expert_intermediate)]
    mixture = [(o, i) for i, o in t.moe_linears().values()] + experts + norms
    embeddings = [(t.vocab, t.hidden)] * (1 if t.tied_embeddings else 2)
    return layer * t.dense_layers + mixture * t.moe_layers + embeddings + [(t.hidden,)]


def from_bench(path: Path, strategy: str) -> tuple[float, float, str]:
    """(seconds per step, units per device per step, unit) from a bench.json's 1-process cell: the strategy's own
    (bench --baseline same) where there is one, as it carries the strategy's overhead; else the single one."""
    data = read_json(path, "write it with `multigpu bench --nproc 1,...` first", "--bench", "a bench.json")
    get = functools.partial(json_value, file=path, advice="use the bench.json that `multigpu bench` writes")
    get(data, None, dict)
    cells = get(data, "cells", list, items=dict)
    ones = [i for i, cell in enumerate(cells) if get(cell, "nproc", int, f"cells[{i}]", minimum=1) == 1]
    if not ones:
        raise UsageError(f"{path} has no 1-process cell; rerun bench with 1 in --nproc.")
    index = next((i for i in ones if get(cells[i], "strategy", str, f"cells[{i}]") == strategy), ones[0])
    cell, at = cells[index], f"cells[{index}]"
    step = get(cell, "step_time_s.median", float, at, positive=True)
    if get(cell, "tokens_per_s", (dict, type(None)), at, optional=True):
        return step, get(cell, "tokens_per_s.median", float, at, positive=True) * step, "tokens"
    return step, get(cell, "samples_per_s.median", float, at, positive=True) * step, "samples"


def run(request: SimulateRequest, as_json: bool) -> int:
    """`multigpu simulate`: the predictions for `request`, as a table or (`as_json`) as JSON."""
    config, intra, inter = resolve(request)
    peaks = device_tflops(request)
    if len(peaks) > 1:
        mixed = simulate_mixed(config, peaks, intra, inter)
        print(json.dumps({**asdict(mixed), "speedup": mixed.speedup}, indent=2) if as_json else format_mixed(mixed))
        return 0
    predictions = simulate(config, intra, inter)
    settings = FailureSettings(**request.values_for(FailureSettings))
    failures = failure_rows(settings, request.gpus_per_node, config.params, predictions)
    if as_json:
        print(to_json(predictions, failures))
    else:
        title = f"{config.strategy}, {config.intra} in a node, {config.interconnect} between nodes"
        if config.tp_size > 1:
            title += f"; tp {config.tp_size}"
        if config.cp_size > 1:
            title += f"; cp {config.cp_size} ({config.cp_method})"
        if config.ep_size > 1:
            title += f"; ep {config.ep_size} ({config.experts} experts, {config.experts_per_token} per token)"
        if request.grad_compression != "none":
            title += f"; gradients {request.grad_compression}"
        if config.pp_size > 1:
            title += f"; pp {config.pp_size} ({config.pp_schedule}, {config.microbatches} micro-batches)"
        print(format_table(predictions, title=title), end="")
        if advice := link_advice(request, predictions, lambda changed: simulate(*resolve(changed))[0]):
            print(advice)
        if failures:
            print(rendered(failure_table(failures)) + assumptions(failures), end="")
    return 0
