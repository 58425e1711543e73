"""`multigpu generate`: batched text generation from a JSONL file of prompts, in 1 or N processes.

Each process loads its own copy of the model (on its GPU, or the CPU) and takes every N-th prompt; rank 0
gathers the outputs and writes them in input order. With --device-map, one process splits one model over all
of its GPUs instead (transformers' device_map, through accelerate).

Prompts file, one JSON object a line (blank lines are skipped):
    {"prompt": "The capital of France is"}
    {"messages": [{"role": "user", "content": "Hi"}]}      (always rendered with the chat template)
Output file, one line per prompt, in input order; other keys of the input line are kept:
    {"index": 0, "prompt": "The capital of France is", "output": " Paris."}

Outputs do not depend on the number of processes or the batch size: greedy decoding (--temperature 0) takes
the most likely token, and sampling draws each prompt's tokens from its own random generator, seeded by
--seed and the prompt's index (see PromptSampler). One caveat for both: a padded batch computes the logits in
another order than a lone prompt, so where two tokens are within rounding of each other (more likely on GPUs,
whose kernels change with the batch shape) the choice can differ; tested on CPU, outputs match exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from multigpu.config.flags import Parser, add_config_arguments, check_path, config_from_args, config_to_argv
from multigpu.config.settings import Settings, TrainingSettings, setting, shown
from multigpu.core.env import DistEnv, init_process_group
from multigpu.core.errors import UsageError, exit_on_usage_error
from multigpu.data import lm_data
from multigpu.launch.launcher import LaunchConfig, launch
from multigpu.models import lm_models
from multigpu.models.lm_models import ModelSettings
from multigpu.recipes.common import check_new_output

DEVICE_MAPS = ("auto", "balanced", "sequential")
GATHER_TIMEOUT_S = 3600.0  # how long rank 0 waits for the slowest rank's last batch
PROGRESS_EVERY_S = 5.0


@dataclass
class GenerateSettings(Settings):
    """The launch's process count and the sampling seed, as the launch and the Engine define them."""

    nproc: int | None = shown(LaunchConfig, note=" (when not under a launcher): one model copy each", unset="1")
    seed: int = shown(TrainingSettings, note=" (generate: with it a prompt's output does not depend on N)")


@dataclass
class GenerateConfig(GenerateSettings, ModelSettings):
    adapter: str | None = setting(None, "a peft (LoRA) adapter directory to apply", metavar="DIR")
    prompts: str | None = setting(
        None, 'required: JSONL, one {"prompt": ...} or {"messages": [...]} a line', metavar="FILE"
    )
    out: str | None = setting(
        None, "required: JSONL to write (not there yet), one line per prompt in input order", metavar="FILE"
    )
    max_new_tokens: int = setting(128, "tokens to generate at most per prompt")
    temperature: float = setting(0.0, "0: greedy; above 0: sample at this temperature")
    batch_size: int = setting(8, "prompts per forward pass in each process")
    chat: bool = setting(False, "apply the chat template to plain prompts too ('messages' always get it)")
    device_map: str | None = setting(
        None, "split one model over this process's GPUs (with --nproc 1)", choices=DEVICE_MAPS
    )

    def check(self) -> None:
        checks = [
            (self.prompts is not None, "Pass the prompts as --prompts FILE.jsonl, one JSON object a line."),
            (self.out is not None, "Pass --out FILE.jsonl, where the outputs are written in input order."),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be 1 or more (got {self.max_new_tokens})."),
            (
                0 <= self.temperature < math.inf,
                f"--temperature must be 0 (greedy) or a positive finite number (got {self.temperature}).",
            ),
            (self.batch_size >= 1, f"--batch-size must be 1 or more (got {self.batch_size}); it is per process."),
            (
                self.device_map is None or self.nproc is None or self.nproc == 1,
                "--device-map splits one model over this process's GPUs; run it with --nproc 1 (or drop "
                "--device-map to run one model copy per process).",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        if self.device_map is not None and not torch.cuda.is_available():
            raise UsageError(
                "--device-map splits one model over GPUs and this machine has none; drop --device-map to "
                "generate on the CPU."
            )


# -- prompts ---------------------------------------------------------------------------------------------------
def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """The prompt records of a JSONL file, checked; a bad line is a UsageError naming it."""
    path = check_path(path, "file", "--prompts", "a JSONL file of prompts")
    prompts = []
    for number, record in lm_data.records(path):
        where = f"{path} line {number}"
        if ("prompt" in record) == ("messages" in record):
            raise UsageError(f'{where} needs exactly one of "prompt" and "messages"; write one of them.')
        if "messages" in record:
            lm_data.check_messages(record["messages"], where)
        elif not isinstance(record["prompt"], str) or not record["prompt"]:
            raise UsageError(f"{where}: prompt must be a non-empty string; fix that line.")
        prompts.append(record)
    return prompts


def encode(tokenizer: Any, record: dict[str, Any], chat: bool) -> list[int]:
    """A prompt's token ids: raw text, or the chat template ending in the assistant's turn."""
    if "messages" in record or chat:
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens
    return tokenizer(record["prompt"])["input_ids"]


# -- model -----------------------------------------------------------------------------------------------------
def load_split_model(name: str, adapter: str | None, device_map: str) -> Any:
    """One model spread over this process's GPUs by transformers' device_map (accelerate's dispatch)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lm_models.model_dir(name), dtype=torch.float32, device_map=device_map)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)  # peft puts each LoRA weight beside its base layer
    return model


def check_inputs(config: GenerateConfig) -> list[dict[str, Any]]:
    """The prompts, once the files the run reads and writes are known to be usable."""
    prompts = read_prompts(config.prompts)
    check_new_output(Path(config.out), "--out", f"{config.out}/out.jsonl")
    lm_models.check(config.model)
    if config.adapter is not None:
        lm_models.check_adapter(config.adapter, config.model)
    return prompts


def prepare(config: GenerateConfig) -> None:
    """Before launching: refuses what every process would refuse, and converts smollm2 once, not in each."""
    check_inputs(config)
    lm_models.model_dir(config.model)


# -- sampling --------------------------------------------------------------------------------------------------
def prompt_seed(seed: int, index: int) -> int:
    """A generator seed for one prompt: a hash of (seed, index), so that no two pairs share a random stream.

    32 bits, because the CPU generator (mt19937) ignores the rest: seeds 5 and 5 + 2**32 give the same draws. A
    hash rather than `seed * K + index`, which would give prompt i + 1 of one seed the stream of prompt i of another.
    """
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class PromptSampler:
    """A logits processor that samples each row's next token from that row's own prompt generator.

    `model.generate(do_sample=True)` draws the whole batch from the global generator, so a prompt's tokens
    would depend on which prompts share its batch. Here each prompt owns a torch.Generator seeded from
    (--seed, its index) and draws exactly one token per step from it; the chosen token gets score 0 and the rest
    -inf, and greedy decoding then picks it. Left padding makes every row start at the same step, so the k-th
    draw is always the prompt's k-th new token, whatever the batch or number of processes.
    """

    def __init__(self, temperature: float, seeds: list[int]) -> None:
        self.temperature = temperature
        self.seeds = seeds
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:
            self.generators = [torch.Generator(scores.device).manual_seed(s) for s in self.seeds]
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        chosen = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators, strict=True)])
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(chosen), device=scores.device), chosen] = 0.0
        return out


# -- generation ------------------------------------------------------------------------------------------------
def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids = model.generation_config.eos_token_id
    found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found


def cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for position, token in enumerate(tokens):
        if token in eos:
            return tokens[:position]
    return tokens


def generate_batch(
    model: Any, tokenizer: Any, batch: list[list[int]], indices: list[int], config: GenerateConfig, eos: set[int]
) -> list[list[int]]:
    """New tokens for each prompt of `batch` (left-padded), cut before the first EOS."""
    from transformers import GenerationConfig, LogitsProcessorList

    padded = tokenizer.pad({"input_ids": batch}, padding_side="left", return_tensors="pt")
    device = model.get_input_embeddings().weight.device
    processors = LogitsProcessorList()
    if config.temperature > 0:
        processors.append(PromptSampler(config.temperature, [prompt_seed(config.seed, i) for i in indices]))
    # A plain config, so the model's own generation defaults (top_p, repetition penalty...) do not apply.
    generation = GenerationConfig(
        max_new_tokens=config.max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=sorted(eos),
        bos_token_id=model.generation_config.bos_token_id,
    )
    sequences = model.generate(
        input_ids=padded["input_ids"].to(device),
        attention_mask=padded["attention_mask"].to(device),
        generation_config=generation,
        logits_processor=processors,
    )
    new = sequences[:, padded["input_ids"].shape[1] :].tolist()
    return [cut_at_eos(tokens, eos) for tokens in new]


def generate(config: GenerateConfig) -> None:
    """Generates this process's share of the prompts; rank 0 gathers all outputs and writes --out."""
    began = time.perf_counter()
    env = DistEnv.from_environ()
    if config.device_map is not None and env.world_size > 1:
        raise UsageError(
            "--device-map splits one model over this process's GPUs; run it with --nproc 1 (or drop "
            "--device-map to run one model copy per process)."
        )
    prompts = check_inputs(config)
    tokenizer = prompt_tokenizer(config, prompts)
    if env.world_size > 1:
        init_process_group(env, env.default_backend(), timedelta(seconds=GATHER_TIMEOUT_S))

    mine = range(env.rank, len(prompts), env.world_size)  # round robin: every rank gets similar work
    encoded = {i: encode(tokenizer, prompts[i], config.chat) for i in mine}
    model = generation_model(config, env)
    say = print if env.rank == 0 else (lambda *_, **__: None)
    say(
        f"generating {len(prompts)} prompts with {config.model}"
        f"{f' + {config.adapter}' if config.adapter else ''} in {env.world_size} process(es), "
        f"{'greedy' if config.temperature == 0 else f'temperature {config.temperature:g}'}, "
        f"up to {config.max_new_tokens} new tokens",
        flush=True,
    )
    start = time.perf_counter()
    gathered = gather_on_rank_0(generate_all(model, tokenizer, encoded, config, say, start), env)
    if env.rank != 0:
        return
    merged = {index: result for part in gathered for index, result in part.items()}
    seconds = time.perf_counter() - start
    total = sum(count for _, count in merged.values())
    write_outputs(Path(config.out), prompts, merged)
    print(
        f"wrote {len(merged)} outputs to {config.out}: {total} tokens in {duration(seconds)} of generation, "
        f"{total / seconds:.1f} tokens/s over {env.world_size} process(es); "
        f"{duration(time.perf_counter() - began)} in all, with loading the model",
        flush=True,
    )


def prompt_tokenizer(config: GenerateConfig, prompts: list[dict[str, Any]]) -> Any:
    """The model's tokenizer, padding on the left; refuses chat prompts for a model without a chat template."""
    tokenizer = lm_models.load_tokenizer(config.model)
    tokenizer.padding_side = "left"  # right padding puts pads between a prompt and its new tokens
    if (config.chat or any("messages" in p for p in prompts)) and not tokenizer.chat_template:
        raise UsageError(
            f"--model {config.model} has no chat template; drop --chat and give plain prompts, not messages."
        )
    return tokenizer


def generation_model(config: GenerateConfig, env: DistEnv) -> Any:
    """The model (with its adapter) in eval mode, on this process's device or split over its GPUs (--device-map)."""
    if config.device_map is not None:
        model = load_split_model(config.model, config.adapter, config.device_map)
    else:
        model = lm_models.load_model(config.model, adapter=config.adapter).to(env.device)
    model.eval()
    return model


def generate_all(
    model: Any,
    tokenizer: Any,
    encoded: dict[int, list[int]],
    config: GenerateConfig,
    say: Callable[..., None],
    start: float,
) -> dict[int, tuple[str, int]]:
    """(text, new tokens) of each prompt in `encoded` (index -> its tokens), in batches of --batch-size; the
    progress since `start` said every PROGRESS_EVERY_S seconds."""
    eos = eos_ids(model, tokenizer)
    # Longest first, so a batch holds prompts of similar length and wastes little on padding.
    order = sorted(encoded, key=lambda i: -len(encoded[i]))
    results: dict[int, tuple[str, int]] = {}
    printed, tokens = start, 0
    with torch.inference_mode():
        for first in range(0, len(order), config.batch_size):
            indices = order[first : first + config.batch_size]
            outputs = generate_batch(model, tokenizer, [encoded[i] for i in indices], indices, config, eos)
            for index, new in zip(indices, outputs, strict=True):
                results[index] = (tokenizer.decode(new, skip_special_tokens=True), len(new))
                tokens += len(new)
            now = time.perf_counter()
            if now - printed >= PROGRESS_EVERY_S or len(results) == len(encoded):
                printed = now
                say(
                    f"rank 0: {len(results)}/{len(encoded)} prompts, {tokens} tokens, "
                    f"{tokens / (now - start):.1f} tokens/s",
                    flush=True,
                )
    return results


def gather_on_rank_0(results: dict[int, Any], env: DistEnv) -> list[dict[int, Any]] | None:
    """Every rank's `results` on rank 0 (None on the others)."""
    if env.world_size == 1:
        return [results]
    gathered: list[Any] | None = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    return gathered


def duration(seconds: float) -> str:
    """Seconds to three significant digits under 10 s (a short run on a fast model takes hundredths of a second,
    which one decimal would show as 0.0 s), to a tenth above."""
    return f"{seconds:.3g} s" if seconds < 10 else f"{seconds:.1f} s"


def write_outputs(out: Path, prompts: list[dict[str, Any]], results: dict[int, tuple[str, int]]) -> None:
    """One line per prompt in input order, written under a temporary name and renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    with partial.open("w", encoding="utf-8") as file:
        for index, prompt in enumerate(prompts):
            kept = {key: value for key, value in prompt.items() if key not in ("index", "output")}
            record = {"index": index, **kept, "output": results[index][0]}
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(partial, out)


# -- entry points ----------------------------------------------------------------------------------------------
def run(config: GenerateConfig) -> int:
    """What `multigpu generate` does: generate here (1 process, or already under a launcher) or launch N."""
    if "RANK" in os.environ or (config.nproc or 1) == 1:
        generate(config)
        return 0
    prepare(config)
    argv = config_to_argv(config, skip=("nproc",))
    return launch(LaunchConfig(nproc=config.nproc), ["multigpu.recipes.generate", *argv], module=True)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m multigpu.recipes.generate", description=__doc__.split("\n\n")[0])
    add_config_arguments(parser, GenerateConfig)
    return run(config_from_args(GenerateConfig, parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(exit_on_usage_error(main))
