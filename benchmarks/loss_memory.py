"""Peak memory and time of a language model's loss, plain against chunked (multigpu.transforms.loss), on SmolLM2-135M's
output head (49,152 x 576, tied to its embeddings) at one sequence of 2048 tokens.

    python benchmarks/loss_memory.py [--seq-len 2048] [--chunks 0,64,512,2048] [--rounds 5] [--step]

The loss alone: forward and backward of the head and the cross-entropy, from hidden states that need a gradient
and the head's weight, which needs one too (full fine-tuning). With --step, also a whole forward and backward of
SmolLM2 full fine-tuning through engine.forward_backward and engine.lm_loss.

Memory: each variant in a fresh process, after a warm-up on 8 tokens (which leaves nothing large with the
allocator), as the growth of the process's resident memory from just before the call to its peak during it (Linux's
VmHWM, reset first). It counts every allocation torch makes on the CPU (tracemalloc sees none of them) and the
gradients the call leaves, as a training step holds them until the optimizer's step.
Time: every variant in one process, one call of each in turn for --rounds rounds, so that they share the
machine's load; the median of each. One thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def memory(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_growth(call: Callable[[], None]) -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from what the process holds now
    before = memory("VmRSS")
    call()
    return memory("VmHWM") - before


def head_weight() -> torch.Tensor:
    from safetensors import safe_open

    from multigpu.models import lm_models

    with safe_open(str(lm_models.model_dir("smollm2") / "model.safetensors"), "pt") as stored:
        return stored.get_tensor("model.embed_tokens.weight").float()  # the head is tied to it


def loss_call(mode: str, chunk: int, seq_len: int, weight: torch.Tensor | None = None) -> Callable[[int], None]:
    """A call of the loss alone over `tokens` tokens (forward, backward, the gradients dropped after)."""
    from multigpu.transforms.loss import linear_cross_entropy

    weight = (head_weight() if weight is None else weight).requires_grad_()
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, seq_len, weight.shape[1], generator=generator).requires_grad_()
    targets = torch.randint(0, weight.shape[0], (1, seq_len), generator=generator)

    def call(tokens: int = seq_len) -> None:
        loss, _ = linear_cross_entropy(
            hidden[:, :tokens], weight, targets[:, :tokens], mode=mode, chunk_tokens=chunk or None
        )
        loss.backward()
        hidden.grad = weight.grad = None

    return call


def step_call(mode: str, chunk: int, seq_len: int) -> Callable[[int], None]:
    """A whole forward and backward of SmolLM2 full fine-tuning with the Engine, over `tokens` tokens."""
    import multigpu as mg
    from multigpu.models import lm_models

    engine = mg.Engine(strategy="single", loss=mode)
    model = lm_models.load_model("smollm2", "full")
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))  # a step that keeps none
    loss_fn = engine.lm_loss(model.lm_head, chunk_tokens=chunk or None)
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))

    def call(tokens: int = seq_len) -> None:
        engine.forward_backward(model, {"input_ids": ids[:, :tokens]}, ids[:, :tokens], loss_fn)
        engine.step(optimizer)  # the gradients are held until here, as in training

    return call


def one_variant(what: str, mode: str, chunk: int, seq_len: int) -> int:
    """The peak growth of one variant's call, in this (fresh) process."""
    call = {"loss": loss_call, "step": step_call}[what](mode, chunk, seq_len)
    call(8)  # loads the kernels; leaves nothing large behind
    return peak_growth(call)


def interleaved_times(variants: list[tuple[str, int]], seq_len: int, rounds: int) -> list[float]:
    weight = head_weight()
    calls = [loss_call(mode, chunk, seq_len, weight.clone()) for mode, chunk in variants]
    times: list[list[float]] = [[] for _ in calls]
    for call in calls:
        call(8)
    for _ in range(rounds):
        for index, call in enumerate(calls):
            started = time.perf_counter()
            call()
            times[index].append(time.perf_counter() - started)
    return [statistics.median(found) for found in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--chunks", default="0,64,512,2048", help="tokens per chunk of chunked (0: its default)")
    parser.add_argument("--rounds", type=int, default=5, help="timed calls of each variant, in turn")
    parser.add_argument("--step", action="store_true", help="also a whole SmolLM2 forward and backward")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one variant's memory, in its own process: what,mode,chunk
    args = parser.parse_args()
    if args.one:
        what, mode, chunk = args.one.split(",")
        print(json.dumps(one_variant(what, mode, int(chunk), args.seq_len)))
        return
    variants = [("plain", 0), *(("chunked", int(chunk)) for chunk in args.chunks.split(","))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    peaks = {}
    for what in ("loss", "step") if args.step else ("loss",):
        for mode, chunk in variants if what == "loss" else [("plain", 0), ("chunked", 0)]:
            command = [sys.executable, __file__, "--seq-len", str(args.seq_len), "--one", f"{what},{mode},{chunk}"]
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            peaks[what, mode, chunk] = json.loads(done.stdout.strip().splitlines()[-1])
    torch.set_num_threads(1)
    seconds = dict(zip(variants, interleaved_times(variants, args.seq_len, args.rounds), strict=True))
    print(f"SmolLM2-135M head 49,152 x 576, 1 x {args.seq_len} tokens, fp32, torch {torch.__version__}, 1 thread")
    print(f"{'what':<6}{'loss':<9}{'chunk':>8}{'peak MiB':>10}{'seconds':>9}")
    for (what, mode, chunk), peak in peaks.items():
        shown = "-" if mode == "plain" else str(chunk or "default")
        timed = f"{seconds[mode, chunk]:>9.2f}" if what == "loss" else f"{'':>9}"
        print(f"{what:<6}{mode:<9}{shown:>8}{peak / 2**20:>10.0f}{timed}")


if __name__ == "__main__":
    main()
