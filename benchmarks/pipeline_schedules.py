"""Every pipeline schedule on 2 and 4 gloo processes: step time, each rank's idle share and its peak of saved
activations, beside the planner's bubble and activations for the same layout.

    python benchmarks/pipeline_schedules.py [--sizes 2,4] [--steps 6] [--microbatches 8]

One launch per process count runs every schedule in turn (strategy pp, pp_size = the processes) on a tiny Llama of
8 layers (enough for zbv's 2 stages per rank on 4 ranks), hidden 256, a vocabulary of 512 so that the embedding and
the head weigh no more than a layer (the stages are alike, as the planner's formulas assume), random tokens, batches
of 16 rows x 64 tokens in `--microbatches` micro-batches, fp32 AdamW. Per schedule, after 2 warm-up steps:
- s/step: the median step's wall time (forward_backward and the optimizer step), the slowest rank's;
- idle: 1 - (the rank's compute demand / the step's wall time), the mean over ranks and steps. Compute demand is
  the main thread's time on a CPU plus its time waiting for one (/proc/thread-self/schedstat: core/compute_clock),
  so a rank blocked in a pipeline receive is idle, while a rank waiting for a core that another process holds is
  not. This is the measured bubble (and any other wait: the optimizer step's, the loss's all-reduce);
- activations: the peak, over the step, of the bytes autograd keeps saved for backward (each storage once,
  parameters left out), on the rank where it is largest, relative to 1f1b's on the same processes;
- planned bubble and planned activations: planner.layout.bubble_fraction and micro_batches_in_flight (the busiest
  rank, relative to 1f1b's) for the same pp, micro-batches and stages per rank.
The zero-bubble schedules split each backward into two autograd passes; on a CPU the second pass costs more than
the one it replaces, so their step time can lose what their bubble saves. With 4 processes on a 2-core machine the
processes share cores: the step times are no speed figures, and the idle share counts only blocking waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("interleaved-zb", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]
ROWS, SEQ = 16, 64


class SavedPeak:
    """The peak of the bytes autograd keeps saved (each storage once, parameters left out), tracked as they are
    packed and as autograd lets them go."""

    def __init__(self, skip: set[int]) -> None:
        self.skip, self.count, self.size = skip, {}, {}
        self.live = self.peak = 0

    def pack(self, tensor: object) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.device.type == "meta":
            return tensor
        if self.count.get(key, 0) == 0:
            self.size[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.count[key] = self.count.get(key, 0) + 1
        return _Held(tensor, key, self)

    def release(self, key: int) -> None:
        self.count[key] -= 1
        if self.count[key] == 0:
            self.live -= self.size.pop(key)


class _Held:
    def __init__(self, tensor: object, key: int, peak: SavedPeak) -> None:
        self.tensor, self.key, self.peak = tensor, key, peak

    def __del__(self) -> None:
        self.peak.release(self.key)


def unpack(held: object) -> object:
    return held.tensor if isinstance(held, _Held) else held


def run_schedule(schedule: str, per_rank: int, micro: int, steps: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import multigpu as mg
    from multigpu.core.compute_clock import cpu_demand_s

    engine = mg.Engine(strategy="pp", pp_schedule=schedule, pp_stages_per_rank=per_rank, pp_microbatches=micro, seed=0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    tokens = torch.randint(0, 512, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    walls, idles, peaks = [], [], []
    for step in range(steps + 2):
        saved = SavedPeak({p.untyped_storage().data_ptr() for p in model.parameters()})
        start, demand = time.perf_counter(), cpu_demand_s()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, unpack):
            engine.forward_backward(model, {"input_ids": tokens[:, :-1]}, tokens[:, 1:], loss_fn)
        engine.step(optimizer)
        wall = time.perf_counter() - start
        if step >= 2:
            walls.append(wall)
            idles.append(1 - (cpu_demand_s() - demand) / wall)
            peaks.append(saved.peak)
    slowest = engine.reduce(torch.tensor(statistics.median(walls)), op="max")
    idle = engine.reduce(torch.tensor(statistics.mean(idles)), op="mean")
    peak = engine.reduce(torch.tensor(float(max(peaks))), op="max")
    engine.close()
    return {"s_step": float(slowest), "idle": float(idle), "activations": float(peak)}


def worker(size: int, steps: int, micro: int, out: str) -> None:
    import torch.distributed as dist

    results = {}
    for schedule, per_rank in SCHEDULES:
        results[schedule] = run_schedule(schedule, per_rank, micro, steps)
    if dist.get_rank() == 0:
        Path(out, f"pp{size}.json").write_text(json.dumps(results))


def main() -> None:
    from multigpu.launch.launcher import LaunchConfig, launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,4", help="process counts (pp_size), one launch each")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per schedule (after 2 warm-up)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (dualpipev: >= 2 x pp)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.steps, args.microbatches, args.worker[1])
        return
    with tempfile.TemporaryDirectory() as folder:
        for size in map(int, args.sizes.split(",")):
            argv = [__file__, "--steps", str(args.steps), "--microbatches", str(args.microbatches)]
            if launch(LaunchConfig(nproc=size), [*argv, "--worker", str(size), folder]):
                sys.exit(1)
            print_rows(size, args.microbatches, json.loads(Path(folder, f"pp{size}.json").read_text()))


def print_rows(pp: int, micro: int, results: dict) -> None:
    from multigpu.planner.model_parallel import bubble_fraction, micro_batches_in_flight

    def planned_held(schedule: str, per_rank: int) -> float:
        return max(micro_batches_in_flight(schedule, pp, rank, per_rank, micro) for rank in range(pp))

    base, planned_base = results["1f1b"]["activations"], planned_held("1f1b", 1)
    print(f"\n{pp} processes (pp {pp}), {micro} micro-batches of {ROWS // micro} rows")
    print(f"{'schedule':<15} {'s/step':>7} {'idle':>6} {'planned bubble':>15} {'activations':>12} {'planned':>8}")
    for schedule, per_rank in SCHEDULES:
        r = results[schedule]
        bubble = bubble_fraction(pp, micro, per_rank, schedule)
        held = planned_held(schedule, per_rank) / planned_base
        print(f"{schedule:<15} {r['s_step']:>7.3f} {r['idle']:>6.1%} {bubble:>15.1%} "
              f"{r['activations'] / base:>11.2f}x {held:>7.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
