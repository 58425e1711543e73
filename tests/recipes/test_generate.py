"""`multigpu generate` on the tiny random Llama: 1 and 2 processes, greedy and sampled, with a LoRA adapter."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multigpu.core.errors import UsageError
from multigpu.models import lm_models
from multigpu.recipes.generate import (
    GenerateConfig,
    cut_at_eos,
    generate,
    load_split_model,
    main,
    prompt_seed,
    read_prompts,
)
from tests.dist import multigpu, run_command

# peft's get_peft_model calls a transformers method that 5.x deprecates; nothing for us to act on.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

NEW_TOKENS = 12
PROMPTS = [
    {"prompt": "Hi", "id": "first"},
    {"prompt": "The capital of France is"},
    {"messages": [{"role": "user", "content": "Name three colours."}]},
    {"prompt": "Once upon a time, in a land far away, there lived a king who had"},
    {"prompt": "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings"},
]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return lm_models.model_dir("tiny")  # the first time on a machine converts smollm2 (about 30 s)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [json.dumps(p) for p in PROMPTS]
    path.write_text("\n".join([*lines[:2], "", *lines[2:]]) + "\n")  # a blank line is skipped, not a prompt
    return path


def one_at_a_time(model: torch.nn.Module, tokenizer, new_tokens: int = NEW_TOKENS) -> list[str]:
    """Plain greedy `model.generate`, one unpadded prompt at a time: what every batching must reproduce."""
    outputs = []
    for record in PROMPTS:
        if "messages" in record:
            text = tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(record["prompt"])["input_ids"]
        with torch.inference_mode():
            sequence = model.generate(
                input_ids=torch.tensor([ids]),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids) :].tolist()
        new = sequence[: sequence.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in sequence else sequence
        outputs.append(tokenizer.decode(new, skip_special_tokens=True))
    return outputs


@pytest.fixture(scope="module")
def reference(tiny: Path) -> list[str]:
    return one_at_a_time(lm_models.load_model("tiny").eval(), lm_models.load_tokenizer("tiny"))


def read_outputs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def generate_here(prompts_file: Path, out: Path, **options) -> list[dict]:
    generate(GenerateConfig(model="tiny", prompts=str(prompts_file), out=str(out), **options))
    return read_outputs(out)


def cli_args(prompts_file: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", "tiny", "--prompts", str(prompts_file), "--out", str(out), *extra]


def generate_module(*args: str, timeout: int) -> subprocess.CompletedProcess:
    """`python -m multigpu.recipes.generate ARGS`, as a user (or the CLI) runs it."""
    return run_command([sys.executable, "-m", "multigpu.recipes.generate", *args], timeout=timeout)


def test_one_and_two_processes_write_what_greedy_gives_one_prompt_at_a_time(
    prompts_file: Path, reference: list[str], tmp_path: Path
) -> None:
    two = multigpu(
        "run",
        "-n",
        "2",
        "-m",
        "multigpu.recipes.generate",
        *cli_args(prompts_file, tmp_path / "two.jsonl", "--max-new-tokens", str(NEW_TOKENS), "--batch-size", "2"),
        timeout=180,
    )
    assert two.returncode == 0, two.stdout
    assert "tokens/s" in two.stdout and "wrote 5 outputs" in two.stdout
    one = generate_module(
        *cli_args(prompts_file, tmp_path / "one.jsonl", "--max-new-tokens", str(NEW_TOKENS)),
        timeout=120,
    )
    assert one.returncode == 0, one.stdout

    records = read_outputs(tmp_path / "two.jsonl")
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]
    for record, given in zip(records, PROMPTS, strict=True):
        assert {k: v for k, v in record.items() if k not in ("index", "output")} == given  # other keys are kept
    assert [r["output"] for r in records] == reference
    assert len(set(reference)) == len(reference)  # the prompts really gave different outputs
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "two.jsonl").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.jsonl", "two.jsonl"]  # no partial files left


def test_sampled_outputs_depend_on_the_seed_but_not_on_processes_or_batches(
    prompts_file: Path, reference: list[str], tmp_path: Path
) -> None:
    options = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0}
    one = generate_here(prompts_file, tmp_path / "one.jsonl", batch_size=8, **options)
    # --nproc 2 outside a launcher: the recipe launches itself, as `multigpu generate --nproc 2` does.
    two = generate_module(
        *cli_args(prompts_file, tmp_path / "two.jsonl", "--nproc", "2", "--batch-size", "1"),
        *("--max-new-tokens", str(NEW_TOKENS), "--temperature", "1.0"),
        timeout=180,
    )
    assert two.returncode == 0, two.stdout
    assert read_outputs(tmp_path / "two.jsonl") == one
    other_seed = generate_here(prompts_file, tmp_path / "seed1.jsonl", seed=1, **options)
    sampled, resampled = [r["output"] for r in one], [r["output"] for r in other_seed]
    assert all(a != b for a, b in zip(sampled, resampled, strict=True))
    assert all(a != b for a, b in zip(sampled, reference, strict=True))


def test_chat_applies_the_template_to_plain_prompts(tiny: Path, tmp_path: Path) -> None:
    plain, chat = tmp_path / "plain.jsonl", tmp_path / "chat.jsonl"
    plain.write_text(json.dumps({"prompt": "Name three colours."}) + "\n")
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Name three colours."}]}) + "\n")
    with_template = generate_here(plain, tmp_path / "a.jsonl", chat=True, max_new_tokens=NEW_TOKENS)
    as_messages = generate_here(chat, tmp_path / "b.jsonl", max_new_tokens=NEW_TOKENS)
    without = generate_here(plain, tmp_path / "c.jsonl", max_new_tokens=NEW_TOKENS)
    assert with_template[0]["output"] == as_messages[0]["output"] != without[0]["output"]


@pytest.fixture(scope="module")
def adapter(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model

    model = lm_models.load_model("tiny")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=lm_models.lora_targets(model), task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # zero at initialisation, which would leave the outputs unchanged
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    directory = tmp_path_factory.mktemp("adapter") / "lora"
    model.save_pretrained(directory)
    return directory


def test_adapter_outputs_match_peft_in_this_process(
    prompts_file: Path, adapter: Path, reference: list[str], tmp_path: Path
) -> None:
    from peft import PeftModel

    expected = one_at_a_time(
        PeftModel.from_pretrained(lm_models.load_model("tiny"), adapter).eval(), lm_models.load_tokenizer("tiny")
    )
    assert all(a != b for a, b in zip(expected, reference, strict=True))  # the adapter changes every output
    result = multigpu(
        "run",
        "-n",
        "2",
        "-m",
        "multigpu.recipes.generate",
        *cli_args(prompts_file, tmp_path / "out.jsonl", "--adapter", str(adapter)),
        *("--max-new-tokens", str(NEW_TOKENS), "--batch-size", "3"),
        timeout=180,
    )
    assert result.returncode == 0, result.stdout
    assert [r["output"] for r in read_outputs(tmp_path / "out.jsonl")] == expected


def test_the_device_map_loader_gives_the_same_outputs(tiny: Path, reference: list[str]) -> None:
    # Without GPUs accelerate's "auto" places everything on the CPU: this checks the loading path, not a split.
    model = load_split_model("tiny", None, "auto").eval()
    assert one_at_a_time(model, lm_models.load_tokenizer("tiny")) == reference


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "fine"}\n{"prompt": "cut\n', "line 2 is not valid JSON"),
        ('{"prompt": "fine"}\n\n["a list"]\n', "line 3 is not a JSON object"),
        ('{"prompt": "a", "messages": []}\n', 'line 1 needs exactly one of "prompt" and "messages"'),
        ('{"text": "a"}\n', 'line 1 needs exactly one of "prompt" and "messages"'),
        ('{"prompt": ""}\n', "line 1: prompt must be a non-empty string"),
        ('{"prompt": 3}\n', "line 1: prompt must be a non-empty string"),
        ('{"messages": [{"role": "user"}]}\n', 'every message needs a "role" and a "content"'),
        ('{"messages": []}\n', '"messages" must be a non-empty list'),
        ("\n\n", "has no records"),
        ('{"prompt": "fine"}\n{"prompt": "x\\ud800"}\n', r"line 2 holds \\ud800, half of a UTF-16 surrogate pair"),
        ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "line 1 nests lists or objects deeper than"),
    ],
)
def test_bad_prompt_lines_are_refused_by_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        read_prompts(path)


def test_a_bad_prompt_file_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    for extra in ([], ["--nproc", "2"]):  # refused before any worker starts
        result = run_command(
            [sys.executable, "-m", "multigpu.recipes.generate", *cli_args(bad, tmp_path / "out.jsonl", *extra)],
            timeout=60,
        )
        assert result.returncode == 2, result.stdout
        assert result.stdout.strip().splitlines() == [
            f"multigpu: error: {bad} line 2 is not valid JSON (Expecting value); fix that line."
        ]
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_files_are_refused(tmp_path: Path, tiny: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError, match="does not exist"):
        main(cli_args(tmp_path / "nowhere.jsonl", tmp_path / "out.jsonl"))
    with pytest.raises(UsageError, match=r"has no adapter_config\.json"):
        main(cli_args(good, tmp_path / "out.jsonl", "--adapter", str(tmp_path)))
    with pytest.raises(UsageError, match="is a directory"):
        main(cli_args(good, tmp_path))


def test_device_map_is_refused_with_several_processes(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as refused:
        GenerateConfig(prompts="p.jsonl", out="o.jsonl", nproc=2, device_map="auto")
    assert str(refused.value) == (
        "--device-map splits one model over this process's GPUs; run it with --nproc 1 (or drop --device-map "
        "to run one model copy per process)."
    )
    with pytest.raises(UsageError, match="--device-map splits one model"):
        main(["--prompts", "p.jsonl", "--out", "o.jsonl", "--device-map", "balanced", "--nproc", "4"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
def test_device_map_without_gpus_is_refused() -> None:
    with pytest.raises(UsageError, match="this machine has none; drop --device-map"):
        GenerateConfig(prompts="p.jsonl", out="o.jsonl", device_map="auto")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prompts": None}, "Pass the prompts as --prompts"),
        ({"out": None}, "Pass --out"),
        ({"max_new_tokens": 0}, "--max-new-tokens must be 1 or more"),
        ({"temperature": -0.5}, "--temperature must be 0"),
        ({"batch_size": 0}, "--batch-size must be 1 or more"),
        ({"nproc": 0}, "--nproc must be 1 or more"),
        ({"seed": -1}, r"seed must be from 0 to 2\*\*32 - 1"),
        ({"device_map": "everywhere"}, "Unknown device_map .everywhere.; choose one of"),
    ],
)
def test_config_refusals(options: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        GenerateConfig(**{"prompts": "p.jsonl", "out": "o.jsonl", **options})


def test_helpers() -> None:
    assert cut_at_eos([5, 6, 2, 7, 2], {2}) == [5, 6]
    assert cut_at_eos([5, 6], {2}) == [5, 6]
    assert cut_at_eos([9, 5], {2, 9}) == []
    # Distinct random streams: seed s, prompt i + 1 does not replay seed s + 1, prompt i.
    streams = {
        tuple(torch.rand(4, generator=torch.Generator().manual_seed(prompt_seed(seed, index))).tolist())
        for seed in range(4)
        for index in range(100)
    }
    assert len(streams) == 400


@pytest.mark.parametrize(
    ("flag", "kind", "message"),
    [
        ("--prompts", "directory", "is a directory, but a JSONL file of prompts is expected; pass the file's path."),
        ("--adapter", "file", "is a file, but a peft adapter directory is expected; pass the directory's path."),
        ("--model", "file", "is a file, but smollm2, tiny, tiny-deep, tiny-moe, tiny-moe-deep or a Hugging Face "),
    ],
)
def test_a_path_of_the_wrong_kind_is_named_as_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture, flag: str, kind: str, message: str
) -> None:
    from multigpu.cli import main as cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    wrong = tmp_path if kind == "directory" else prompts
    args = {"--prompts": str(prompts), "--out": str(tmp_path / "out.jsonl"), flag: str(wrong)}
    with pytest.raises(SystemExit) as exit_info:
        cli(["generate", *(part for pair in args.items() for part in pair)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(f"multigpu: error: {flag} {wrong} {message}")


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_an_out_that_exists_or_cannot_be_written_is_refused_before_generating(
    tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, nproc: str
) -> None:
    from multigpu.cli import main as cli

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(lm_models, "load_model", no_model)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    existing, under_a_file = tmp_path / "out.jsonl", tmp_path / "p.jsonl" / "out.jsonl"
    existing.write_text("the outputs of an earlier run\n")
    refusals = {
        existing: f"--out {existing} exists already; remove it, or choose another --out.",
        under_a_file: f"--out {under_a_file} cannot be created: {prompts} is a file; choose another --out.",
    }
    for out, message in refusals.items():
        with pytest.raises(SystemExit) as exit_info:  # --nproc 2: refused before any worker starts
            cli(["generate", *cli_args(prompts, out, "--nproc", nproc)])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines() == [f"multigpu: error: {message}"]
    assert existing.read_text() == "the outputs of an earlier run\n"


def test_the_time_reported_is_the_generations_to_three_digits(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A tiny model generates in hundredths of a second, which one decimal showed as "0.0 s"."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n')
    generate_here(prompts, tmp_path / "out.jsonl", max_new_tokens=2)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    found = re.fullmatch(
        r"wrote 1 outputs to .*: (\d+) tokens in ([\d.e+-]+) s of generation, ([\d.]+) tokens/s over 1 process\(es\); "
        r"([\d.e+-]+) s in all, with loading the model",
        line,
    )
    assert found, line
    tokens, seconds, rate, overall = int(found[1]), float(found[2]), float(found[3]), float(found[4])
    assert seconds > 0 and rate == pytest.approx(tokens / seconds, rel=0.01)  # the time shown is the one measured
    assert overall > seconds
