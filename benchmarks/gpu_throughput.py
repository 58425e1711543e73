"""GPU throughput of a 1.24B-parameter Llama on one GPU through the Engine (issue 31): tokens/s/GPU, MFU and peak
memory for eager bf16, then + compile, + selective activation checkpointing, + float8, + fused loss, each row
adding its settings to the row before it (as torchtitan's published rows do), beside the published figures.

The model has Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocabulary
128256, tied embeddings), random weights built under `engine.init_module()`, batch 4 x 2048 tokens, AdamW, precision
bf16-mixed. Each row runs in a process of its own (a fresh allocator, compiler cache and CUDA context, and a row that
fails or hangs cannot take the others with it) within a shared time budget; warm-up steps are not timed, and a
compiled row's warm-up time beyond its steady steps is reported as its compile time.

    python benchmarks/gpu_throughput.py [--rows eager,compile,...] [--out results.json]   # GPU only
    python benchmarks/gpu_throughput.py --smoke          # CPU: a 2-layer model, 2 steps, the eager row, in-process
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Each row adds its settings to the previous row's; all are Engine settings (config/settings.py ComputeSettings).
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "eager": ("eager bf16", {}),
    "compile": ("+ compile", {"compile": True}),
    "selective_ac": ("+ selective AC", {"activation_checkpointing": "selective"}),
    "float8": ("+ float8 tensorwise", {"float8": "tensorwise"}),
    "fused_loss": ("+ fused loss, liger", {"loss": "fused", "liger": True}),
}
# Llama-3.2-1B's shape; smoke: the same architecture small enough for a CPU test in a few seconds.
MODELS: dict[str, dict[str, Any]] = {
    "llama-1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
    },
    "smoke": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
# Published by others, on other models and hardware: context for the rows above, not a comparison of like with like.
PUBLISHED = [
    ("torchtitan, Llama 3.1 8B, 8x H100 (96 GB, 500 W), FSDP", 5762),
    ("torchtitan, same, + torch.compile", 6667),
    ("torchtitan, same, + compile + float8", 8532),
    ("torchao, Llama 3 8B, seq 8192, 8x H100, bf16", 6150),
    ("torchao, same, tensorwise float8 (float8 all-gather)", 7690),
    ("torchao, same, rowwise float8", 6768),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)} (default all)")
    parser.add_argument("--model", default="llama-1b", choices=MODELS, help="the model's shape (default llama-1b)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, 2 or more (default 3)")
    parser.add_argument("--precision", default="bf16-mixed", help="the Engine's precision (default bf16-mixed)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="seconds for all rows together (default 330)")
    parser.add_argument("--row-timeout-s", type=float, default=150.0, help="seconds one row may take (default 150)")
    parser.add_argument("--out", help="also write the results to this JSON file")
    parser.add_argument("--in-process", action="store_true", help="run the rows in this process, one after another")
    parser.add_argument("--smoke", action="store_true", help="CPU check: the smoke model, 2+2 steps, eager, in-process")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run this one row and write --result
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.batch_size, args.seq_len, args.steps, args.warmup = "smoke", 2, 32, 2, 2
        args.in_process = True
        if "--rows" not in (argv if argv is not None else sys.argv):
            args.rows = "eager"
    args.rows = [name.strip() for name in args.rows.split(",") if name.strip()]
    unknown = [name for name in args.rows if name not in ROWS]
    if unknown or not args.rows:
        parser.error(f"--rows takes names from {', '.join(ROWS)} (got {', '.join(unknown) or 'none'})")
    if args.warmup < 2:
        parser.error("--warmup must be 2 or more: the FLOP count takes the second step")
    return args


def row_settings(row: str) -> dict[str, Any]:
    """The Engine settings of `row`: its own and every earlier row's."""
    settings: dict[str, Any] = {}
    for name, (_, own) in ROWS.items():
        settings.update(own)
        if name == row:
            return settings
    raise KeyError(row)


def build_model(model: str) -> Any:
    """A Llama of the named shape with random weights (no download): transformers' LlamaForCausalLM."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[model], tie_word_embeddings=True, use_cache=False, max_position_embeddings=8192)
    return LlamaForCausalLM(config)


class LogitsWatch:
    """Watches the model's output head (a forward hook): remembers whether it ever handed out the whole logits,
    vocabulary wide, which it never does under a fused or chunked loss (engine.lm_loss has it hand its input, the
    hidden states, through): how the benchmark tells that such a row's setting took effect."""

    def __init__(self, head: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.saw_whole_logits = False
        head.register_forward_hook(self.look)

    def look(self, head: Any, args: Any, output: Any) -> None:
        if getattr(output, "shape", (0,))[-1] == self.vocab_size:
            self.saw_whole_logits = True


def check_applied(model: Any, settings: dict[str, Any], watch: LogitsWatch) -> None:
    """Raises, in one sentence, where a setting of the row left the model or the step as the plain path has them:
    a row must measure its feature or fail, never time the plain path under the feature's name."""
    from multigpu.transforms.modules import default_units

    problems = []
    blocks = default_units(model)
    mode = settings.get("activation_checkpointing", "none")
    if mode != "none" and not all(getattr(b, "_recompute_mode", None) == mode for b in blocks):
        problems.append(f"activation_checkpointing={mode!r} left blocks without it (transforms/recompute.py's marker)")
    if settings.get("compile") and not all(getattr(b, "_compiled_call_impl", None) for b in blocks):
        problems.append("compile=True left blocks uncompiled")
    float8_layers = sum(type(m).__name__ == "Float8Linear" for m in model.modules())  # torchao's class
    if settings.get("float8", "none") != "none" and not float8_layers:
        problems.append(f"float8={settings['float8']!r} converted no linear layer to torchao's Float8Linear")
    if settings.get("liger") and not any(_from_liger(m) for m in model.modules()):
        problems.append("liger=True replaced no module's forward with Liger-Kernel's")
    if settings.get("loss", "plain") != "plain" and watch.saw_whole_logits:
        problems.append(f"loss={settings['loss']!r} still handed the whole logits tensor to the loss")
    if problems:
        raise RuntimeError(f"Not applied by the Engine: {'; '.join(problems)}.")


def _from_liger(module: Any) -> bool:
    forward = getattr(module.forward, "__func__", module.forward)
    return any((getattr(o, "__module__", "") or "").startswith("liger_kernel") for o in (type(module), forward))


def set_up_row(row: str, args: argparse.Namespace) -> tuple[Any, Any, Any, Callable[[], Any], LogitsWatch]:
    """The Engine with the row's settings, the model and AdamW set up by it, and one training step on a fixed
    batch of random tokens (data loading is not what is measured), with the loss of the row's `loss` setting
    (engine.lm_loss, as the fine-tune recipe takes it)."""
    import torch

    import multigpu as mg
    from multigpu.recipes.finetune import lm_loss

    # The eager row counts one step's FLOPs with the Engine's own counter (the monitor's, on the second step; a
    # log_every it never reaches reports nothing); every row does the same model arithmetic, so MFU uses that count.
    count = {"log_every": 10**9} if row == "eager" else {}
    engine = mg.Engine(strategy="single", precision=args.precision, seed=0, **row_settings(row), **count)
    # Built on the device itself: 1.24B random values drawn on a CPU take tens of seconds, a row's budget.
    with engine.init_module(), engine.device:
        model = build_model(args.model)
    fused_adam = engine.device.type == "cuda"  # one kernel per step for all parameters: the usual choice on a GPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused_adam)
    model, optimizer = engine.setup(model, optimizer)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch_size, args.seq_len)
    inputs = {"input_ids": torch.randint(0, vocab, shape, generator=generator).to(engine.device)}
    labels = torch.randint(0, vocab, shape, generator=generator).to(engine.device)
    loss_fn = lm_loss(engine, model)
    watch = LogitsWatch(engine.unwrap(model).get_output_embeddings(), vocab)

    def step() -> Any:
        loss = engine.forward_backward(model, inputs, labels, loss_fn)
        engine.step(optimizer)
        return loss

    return engine, model, labels, step, watch


def run_row(row: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row in this process: set up, warm-up steps (compilation among them), timed steps; its figures."""
    import torch

    from multigpu.observers.monitor import Monitor, peak_memory_bytes

    torch._dynamo.reset()  # a row run after another in one process compiles afresh
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine, model, labels, step, watch = set_up_row(row, args)
    on_gpu = engine.device.type == "cuda"
    warmup_s = []
    for _ in range(args.warmup):
        started = time.perf_counter()
        step()
        if on_gpu:
            torch.cuda.synchronize(engine.device)  # time the queued work, not its launch
        warmup_s.append(time.perf_counter() - started)
    settings = row_settings(row)
    check_applied(model, settings, watch)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(engine.device)  # the steady state: weights, AdamW's state, one step
    started = time.perf_counter()
    for _ in range(args.steps):
        last = step()
    if on_gpu:
        torch.cuda.synchronize(engine.device)
    step_s = (time.perf_counter() - started) / args.steps
    monitor = next((o for o in engine.observers if isinstance(o, Monitor)), None)
    compiled = bool(settings.get("compile"))
    return {
        "row": row,
        "status": "ok",
        "settings": settings,
        "step_s": step_s,
        "tokens_per_step": labels.numel(),
        "tokens_per_s": labels.numel() / step_s,
        "peak_memory_gib": peak_memory_bytes(engine.device) / 2**30,
        "first_step_s": warmup_s[0],
        "compile_s": sum(warmup_s) - len(warmup_s) * step_s if compiled else None,
        "graphs": counters["stats"]["unique_graphs"] if compiled else None,
        "graph_breaks": sum(counters["graph_break"].values()) if compiled else None,
        "flops_per_step": monitor.flops_per_step if monitor is not None and row == "eager" else None,
        "final_loss": float(last) / labels.numel(),
        "params": sum(p.numel() for p in model.parameters()),
    }


def run_in_subprocess(argv: list[str], result: Path, timeout: float) -> dict[str, Any]:
    """Runs `argv` (a row) in a session of its own and reads the JSON it writes to `result`; on a failure, the
    last lines it printed. A row past `timeout` is killed with everything it started (inductor's compile workers)."""
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as process:
        try:
            output, _ = process.communicate(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            output = None
        finally:  # also when this process is stopped (SIGTERM, Ctrl-C): nothing of a row may outlive it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        if output is None:
            output, _ = process.communicate()
            return {"status": "failed", "error": f"timed out after {timeout:.0f} s", "output": output[-2000:]}
    if process.returncode == 0 and result.is_file():
        return json.loads(result.read_text())
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return {
        "status": "failed",
        "error": lines[-1] if lines else f"exit code {process.returncode}",
        "output": output[-4000:],
    }


def run_rows(args: argparse.Namespace, forwarded: list[str]) -> list[dict[str, Any]]:
    """Every asked-for row, in order, each within what is left of the budget."""
    deadline = time.monotonic() + args.budget_s
    results = []
    for row in args.rows:
        left = deadline - time.monotonic()
        if left <= 0:
            results.append({"row": row, "status": "not run", "error": f"the {args.budget_s:.0f} s budget was spent"})
            continue
        print(f"== {row}: {ROWS[row][0]}", flush=True)
        if args.in_process:
            outcome = _in_process(lambda row=row: run_row(row, args))
        else:
            with tempfile.TemporaryDirectory() as folder:
                result = Path(folder) / "row.json"
                argv = [sys.executable, __file__, *forwarded, "--row", row, "--result", str(result)]
                outcome = run_in_subprocess(argv, result, min(left, args.row_timeout_s))
        outcome.setdefault("row", row)
        outcome.setdefault("settings", row_settings(row))
        results.append(outcome)
        print(f"   {outcome['status']}" + (f": {outcome['error']}" if outcome.get("error") else ""), flush=True)
    return results


def _in_process(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return run()
    except Exception as error:  # a row's failure is its result; the next row still runs
        return {"status": "failed", "error": f"{type(error).__name__}: {error}".splitlines()[0]}


def add_mfu(results: list[dict[str, Any]], peak_tflops: float | None) -> float | None:
    """MFU of every row from the eager row's FLOPs per token (the same model arithmetic in every row; recomputation
    is not useful work, so activation checkpointing does not raise it); returns those FLOPs per token."""
    eager = next((r for r in results if r["row"] == "eager" and r.get("flops_per_step")), None)
    flops_per_token = eager["flops_per_step"] / eager["tokens_per_step"] if eager else None
    for result in results:
        ok = result["status"] == "ok" and flops_per_token and peak_tflops
        result["mfu"] = flops_per_token * result["tokens_per_s"] / (peak_tflops * 1e12) if ok else None
    return flops_per_token


def format_table(results: list[dict[str, Any]], device: str, peak_tflops: float | None) -> str:
    """The rows measured here, then the published figures, as a Markdown table."""
    lines = [
        f"Measured on {device} (peak {peak_tflops or '?'} dense TFLOP/s for MFU):",
        "",
        "| row | tokens/s/GPU | MFU | peak memory GiB | step ms | compile s | graph breaks |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        label = ROWS[r["row"]][0]
        if r["status"] != "ok":
            lines.append(f"| {label} | {r['status']}: {r.get('error', '')} | | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        compiled = r.get("compile_s") is not None
        compile_s = f"{r['compile_s']:.1f}" if compiled else "-"
        breaks = str(r["graph_breaks"]) if compiled else "-"
        lines.append(
            f"| {label} | {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_memory_gib']:.1f} | {r['step_s'] * 1e3:.1f} "
            f"| {compile_s} | {breaks} |"
        )
    if peak_tflops and any(r["status"] == "ok" and r.get("mfu") is None for r in results):
        lines += ["", "MFU -: every row's MFU takes the eager row's FLOP count, and this run has none; run that row."]
    lines += ["", "Published (other models and hardware, 8 GPUs: context only):", "", "| run | tokens/s/GPU |"]
    lines += ["| --- | ---: |", *(f"| {run} | {tokens:,} |" for run, tokens in PUBLISHED)]
    return "\n".join(lines)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row:  # one row, in its own process, for the parent below
        Path(args.result).write_text(json.dumps(run_row(args.row, args)))
        return 0
    import torch

    from multigpu.observers.monitor import peak_tflops

    if not torch.cuda.is_available() and args.model != "smoke":
        print("gpu_throughput: no CUDA GPU here; run it on one, or --smoke for the CPU check.", file=sys.stderr)
        return 2
    forwarded = ["--model", args.model, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    forwarded += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", args.precision]
    started = time.perf_counter()
    # A timeout's SIGTERM becomes SystemExit, so the row under way is killed on the way out (run_in_subprocess).
    stopped = signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    try:
        results = run_rows(args, forwarded)
    finally:
        signal.signal(signal.SIGTERM, stopped)
    device, peak = device_name(), peak_tflops(device_name(), args.precision)
    flops_per_token = add_mfu(results, peak)
    print("\n" + format_table(results, device, peak))
    report = {
        "device": device,
        "torch": torch.__version__,
        "model": {"shape": args.model, **MODELS[args.model]},
        "precision": args.precision,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "peak_tflops": peak,
        "flops_per_token": flops_per_token,
        "wall_s": time.perf_counter() - started,
        "rows": results,
        "published_tokens_per_s_per_gpu": dict(PUBLISHED),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
