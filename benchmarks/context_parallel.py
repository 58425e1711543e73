"""Per-rank memory of a long sequence under context parallelism against one process: SmolLM2-135M fine-tuned with
`multigpu finetune`'s own parts on Shakespeare at --seq-len 8192, --cp-size 1 (one process) and --cp-size 2 (two).

    python benchmarks/context_parallel.py [--seq-len 8192] [--method lora] [--loss chunked] [--sizes 1,2] [--steps 2]

Each size is one launch of cp processes (ddp with one replica: every rank reads the same batch and keeps its own
half of each sequence). Per rank it reports:
- activations: the bytes autograd saves for backward in the first step's forward (each storage once, parameters
  left out), all held at the end of the forward: what a sequence costs, which context parallelism divides; beside
  it the planner's figure for the same layout, and its peak, which adds what backward holds on top (the loss's
  gradients over the vocabulary, a layer's recomputation);
- peak RSS: the process's whole peak resident memory (weights, optimizer, the allocator's slack, torch itself);
- s/step: the last step's time (on one CPU the cp ranks share its cores, so this is no speed figure).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Subset

from multigpu.launch.launcher import LaunchConfig, launch


class SavedBytes:
    """Bytes of the distinct storages autograd saves, parameters left out."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip and storage.device.type != "meta":
            self.seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def worker(cp: int, seq_len: int, method: str, loss: str, steps: int, out: str) -> None:
    from multigpu.observers.monitor import peak_memory_bytes
    from multigpu.recipes.common import per_rank, recipe_engine
    from multigpu.recipes.finetune import FinetuneConfig, build, lm_loss, model_inputs

    config = FinetuneConfig(model="smollm2", method=method, seq_len=seq_len, cp_size=cp, batch_size=1, loss=loss,
                            multi_gpu="ddp" if cp > 1 else "single", log_every=0, save_dir=out)  # fmt: skip
    engine = recipe_engine(config)
    model, optimizer, _, data = build(config, engine)
    loss_fn = lm_loss(engine, model)
    # Whole pieces of one play each (one document per row): both layouts then attend with plain causal attention,
    # and the first step's sequence is the same in every launch.
    whole = [i for i, documents in enumerate(data.train.bins) if len(documents) == 1][:steps]
    collate = data.collate_fn(engine.sequence_multiple)
    loader = engine.dataloader(Subset(data.train, whole), batch_size=1, shuffle=False, collate_fn=collate)
    saved, seconds = SavedBytes(model), []
    for step, batch in enumerate(loader):
        start = time.perf_counter()
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t) if step == 0 else None
        with hooks or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            engine.forward_backward(model, model_inputs(batch), batch["labels"], loss_fn)
        engine.step(optimizer)
        seconds.append(time.perf_counter() - start)
        if step + 1 == steps:
            break
    activations, peaks = per_rank(engine, saved.total), per_rank(engine, peak_memory_bytes(engine.device))
    if engine.is_main_process:
        result = {"activations": activations, "peak_rss": peaks, "seconds": seconds[-1]}
        Path(out, "result.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--method", default="lora", choices=("lora", "full"))
    parser.add_argument("--loss", default="plain", choices=("plain", "chunked"))
    parser.add_argument("--sizes", default="1,2", help="cp sizes, one launch of that many processes each")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per launch")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.seq_len, args.method, args.loss, args.steps, args.worker[1])
        return
    print(f"SmolLM2-135M {args.method}, --loss {args.loss}, one sequence of {args.seq_len} tokens per step, fp32, CPU")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for cp in map(int, args.sizes.split(",")):
            out = Path(folder, f"cp{cp}")
            argv = [__file__, "--seq-len", str(args.seq_len), "--method", args.method, "--loss", args.loss]
            argv += ["--steps", str(args.steps)]
            if launch(LaunchConfig(nproc=cp), [*argv, "--worker", str(cp), str(out)]):
                sys.exit(1)
            rows.append((cp, json.loads((out / "result.json").read_text())))
    print_rows(rows, args.seq_len, args.loss)


def print_rows(rows: list[tuple[int, dict]], seq_len: int, loss: str) -> None:
    """The table; the planner's figures beside under the plain loss (it does not count the chunked loss's saving)."""
    from multigpu.planner.activations import transformer_activations
    from multigpu.planner.shapes import load_shape

    shape = load_shape("smollm2-135m").transformer
    base = max(next((r for cp, r in rows if cp == 1), rows[0][1])["activations"])
    planner = loss == "plain"
    planned_columns = f" {'planned':>8} {'planned/measured':>16} {'planned peak':>13}" if planner else ""
    print(f"{'cp':>3} {'activations/rank (MiB)':>22} {'of cp 1':>8}{planned_columns} "
          f"{'peak RSS/rank (MiB)':>20} {'s/step':>7}")  # fmt: skip
    for cp, r in rows:
        measured = max(r["activations"])
        line = f"{cp:>3} {measured / 2**20:>22,.0f} {measured / base:>8.2f}"
        if planner:
            planned = transformer_activations(shape, 1, seq_len, "32", "none", cp)
            line += f" {planned.saved / 2**20:>8,.0f} {planned.saved / measured:>16.2f} {planned.peak / 2**20:>13,.0f}"
        print(f"{line} {max(r['peak_rss']) / 2**20:>20,.0f} {r['seconds']:>7.1f}")


if __name__ == "__main__":
    main()
