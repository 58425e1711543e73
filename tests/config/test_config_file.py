"""Config files read: `VERB --config FILE` (YAML or TOML, under the command line), each key checked as its flag
checks it (tests/config/test_config_writer.py: the files written)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from multigpu import cli
from multigpu.cli import build_parser, main
from multigpu.config import config_file
from multigpu.config.config_file import load_config, parse_args
from multigpu.core.errors import UsageError
from multigpu.recipes.train import TrainConfig

VERBS = sorted(set(config_file.verb_parsers(build_parser())) - {"config"})
# What a verb's required positionals are given on a command line, so that it parses without a file.
POSITIONALS = {"run": ["train.py"], "verify": ["train.py"], "export": ["ckpt", "model.safetensors"]}


def verb(name: str) -> argparse.ArgumentParser:
    return config_file.verb_parsers(build_parser())[name]


def parsed(*argv: str) -> dict:
    """The settings a command line parses to, --config file merged; what the handler would get."""
    return {k: v for k, v in vars(parse_args(build_parser(), list(argv))).items() if k not in ("handler", "config")}


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as refused:
        call(*args, **kwargs)
    return str(refused.value)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- reading ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "train.yaml",
            "batch_size: 8\nlr: 1e-4\nprecision: bf16-mixed\nmulti_gpu: ddp\nasync_save: true\ntp_size: null\n",
        ),
        ("train.yml", "batch_size: 8\nlr: 0.0001\nprecision: bf16-mixed\nmulti_gpu: ddp\nasync_save: yes\n"),
        ("train.toml", 'batch_size = 8\nlr = 1e-4\nprecision = "bf16-mixed"\nmulti_gpu = "ddp"\nasync_save = true\n'),
    ],
)
def test_a_file_sets_the_flags_and_the_command_line_overrides_it(tmp_path: Path, name: str, text: str) -> None:
    path = write(tmp_path / name, text)
    defaults = parsed("train")
    got = parsed("train", "--config", str(path), "--batch-size", "4", "--no-async-save")
    assert got == {
        **defaults,
        "batch_size": 4,  # the command line wins
        "lr": 1e-4,  # YAML 1.1 reads 1e-4 as a string; a float flag takes it as a number
        "precision": "bf16-mixed",
        "multi_gpu": "ddp",
        "async_save": False,
    }
    assert isinstance(got["lr"], float)
    # The dataclass still validates the merged values.
    assert cli.config_from_args(TrainConfig, argparse.Namespace(**got)).batch_size == 4


def test_the_config_dataclass_refuses_a_bad_value_from_the_file(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "train.yaml", "batch_size: 0\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "multigpu: error: --batch-size must be 1 or more (got 0); it is per device.\n"


def test_keys_may_be_spelled_as_the_flags_but_only_once(tmp_path: Path) -> None:
    assert load_config(write(tmp_path / "a.toml", "grad-accum-steps = 2\n"), verb("train")) == {"grad_accum_steps": 2}
    path = write(tmp_path / "b.yaml", "grad-accum-steps: 2\ngrad_accum_steps: 3\n")
    assert refusal(load_config, path, verb("train")) == (
        f"{path}: grad_accum_steps is given twice (as 'grad-accum-steps' and 'grad_accum_steps'); keep one of them."
    )


def test_an_unknown_key_is_refused_with_the_closest_one(tmp_path: Path) -> None:
    path = write(tmp_path / "finetune.yaml", "grad_acum_steps: 2\n")
    assert refusal(load_config, path, verb("finetune")) == (
        f"{path}: unknown key 'grad_acum_steps' for `multigpu finetune`; did you mean 'grad_accum_steps'?"
    )
    path = write(tmp_path / "env.toml", "colour = 1\n")
    assert refusal(load_config, path, verb("env")) == (
        f"{path}: unknown key 'colour' for `multigpu env`; see `multigpu env --help` for its flags."
    )
    path = write(tmp_path / "train.yaml", "config: other.yaml\n")  # --config is no setting
    assert "unknown key 'config'" in refusal(load_config, path, verb("train"))


def test_a_wrong_key_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "train.yaml", "epohcs: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(path)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert (
        captured.err == f"multigpu: error: {path}: unknown key 'epohcs' for `multigpu train`; did you mean 'epochs'?\n"
    )
    assert captured.out == ""


@pytest.mark.parametrize(
    ("line", "found", "expected"),
    [
        ("grad_accum_steps: two", '"two"', "an integer"),
        ("grad_accum_steps: 2.5", "2.5", "an integer"),
        ("grad_accum_steps: true", "true", "an integer"),
        ("grad_accum_steps: null", "null", "an integer"),  # null only where the default is None
        ("lr: abc", '"abc"', "a finite number"),
        ("lr: false", "false", "a finite number"),
        ("lr: .nan", "nan", "a finite number"),  # YAML's NaN and infinities, which float() would take
        ("timeout_s: .inf", "inf", "a finite number"),
        ("max_grad_norm: -.inf", "-inf", "a finite number or null"),
        ("warmup_epochs: 1e999", '"1e999"', "a finite number"),  # float("1e999") is inf
        ("async_save: 1", "1", "true or false"),
        ('async_save: "true"', '"true"', "true or false"),
        ("multi_gpu: fsdp3", '"fsdp3"', 'one of "auto", "single"'),
        ("precision: 8", "8", 'one of "32"'),
        ("zero_stage: 4", "4", "one of 1, 2, 3 or null"),
        ("save_dir: [a, b]", "a list", "a string"),
        ("save_dir: {a: 1}", "a mapping", "a string"),
        ("save_dir: 1.5", "1.5", "a string"),
        ("tp_size: 2.0", "2.0", "an integer or null"),
    ],
)
def test_a_wrong_value_is_refused_naming_the_file_key_value_and_what_the_flag_takes(
    tmp_path: Path, line: str, found: str, expected: str
) -> None:
    path = write(tmp_path / "train.yaml", line + "\n")
    key = line.split(":")[0]
    message = refusal(load_config, path, verb("train"))
    assert message.startswith(f"{path}: {key} is {found}, but {expected}"), message
    assert message.endswith("is expected; change the value or remove the key.")


def test_values_convert_as_the_command_line_would(tmp_path: Path) -> None:
    text = "tp_size: null\ngpu_ids: 0\nwarmup_epochs: 1\nzero_stage: 3\nresume: none\nlr: 1.5e3\n"
    values = load_config(write(tmp_path / "train.yaml", text), verb("train"))
    assert values == {
        "tp_size": None,
        "gpu_ids": "0",
        "warmup_epochs": 1.0,
        "zero_stage": 3,
        "resume": "none",
        "lr": 1500.0,
    }
    assert isinstance(values["warmup_epochs"], float)
    # A store_true flag takes a bool; a file cannot turn off what the command line turns on, nor the reverse.
    path = write(tmp_path / "plan.yaml", "json: true\n")
    assert parsed("plan", "--config", str(path), "--params", "1e9")["json"] is True


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("none.yaml", None, "--config {path} does not exist; write one with `multigpu config train`."),
        ("dir.yaml", "directory", "--config {path} is a directory, but a YAML or TOML file is expected"),
        ("train.json", "{}", "has neither a .yaml, .yml nor a .toml extension"),
        ("bad.yaml", "a: [1,\n", "--config {path} is not valid YAML ("),
        ("dup.yaml", "lr: 0.1\nlr: 0.2\n", "--config {path} is not valid YAML (found 'lr' twice at line 2, column 1)"),
        ("bad.toml", "a = \n", "--config {path} is not valid TOML (Invalid value (at line 1, column 5)); fix it."),
        ("list.yaml", "- 1\n- 2\n", "--config {path} holds a list at the top level, but a mapping of settings"),
        ("text.yaml", "epochs\n", '--config {path} holds "epochs" at the top level'),
        ("latin.yaml", b"data: caf\xe9\n", "--config {path} is not UTF-8 text"),
        # Lists in lists, in block style: flow style ([[[...) costs PyYAML's scanner seconds before it fails.
        ("deep.yaml", "a:\n" + "- " * 1500 + "x\n", "--config {path} nests lists or mappings deeper than"),
        ("deep.toml", "a = " + "[" * 1500 + "]" * 1500, "--config {path} nests lists or mappings deeper than"),
        ("x" * 300 + ".yaml", None, "cannot be looked up (File name too long); pass another path."),
    ],
)
def test_a_file_that_cannot_be_read_is_one_sentence(tmp_path: Path, name: str, content, message: str) -> None:
    path = tmp_path / name
    if content == "directory":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    got = refusal(parse_args, build_parser(), ["train", "--config", str(path)])
    assert message.format(path=path) in got
    assert got.count(". ") == 0 and got.endswith(".")  # one sentence


def alias_chain(name: str, levels: int, width: int = 9) -> str:
    """YAML lists of `width` aliases of the list before: the last one expands to width**levels strings."""
    lines = [f"{name}0: &{name}0 [{', '.join(['lol'] * width)}]"]
    lines += [f"{name}{i}: &{name}{i} [{', '.join([f'*{name}{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_keys_built_of_aliases_are_refused_at_once(tmp_path: Path) -> None:
    """Two equal keys built from separate chains of aliases: comparing them walks 9**8 strings (a minute or two,
    and the message's repr of the key as long again), though the file has fewer than 900 bytes."""
    text = alias_chain("a", 8) + alias_chain("b", 8) + "? [*a7]\n: 1\n? [*b7]\n: 2\n"
    path = write(tmp_path / "laughs.yaml", text)
    assert len(text.encode()) < 900
    start = time.perf_counter()
    got = refusal(parse_args, build_parser(), ["train", "--config", str(path)])
    assert time.perf_counter() - start < 2
    assert got == (
        f"--config {path} is not valid YAML (found a list or mapping as a key, where a name is expected at line 17, "
        "column 3); fix it."
    )


def test_an_empty_yaml_file_sets_nothing(tmp_path: Path) -> None:
    path = write(tmp_path / "train.yaml", "# all commented out\n")
    assert parsed("train", "--config", str(path)) == parsed("train")


def test_a_script_and_its_arguments_come_from_the_file_unless_the_command_line_names_one(tmp_path: Path) -> None:
    path = write(tmp_path / "run.yaml", "nproc: 2\nscript: train.py\nscript_args: [--epochs, 3, --lr, 0.5]\n")
    got = parsed("run", "--config", str(path), "-m")
    assert (got["script"], got["script_args"], got["nproc"], got["module"]) == (
        "train.py",
        ["--epochs", "3", "--lr", "0.5"],
        2,
        True,
    )
    # A script on the command line brings its own arguments (none here), and a --config after it is the script's.
    got = parsed("run", "--config", str(path), "other.py", "--config", "x.yaml")
    assert (got["script"], got["script_args"]) == ("other.py", ["--config", "x.yaml"])
    # bench's SCRIPT is optional; its arguments still follow the file's script.
    path = write(tmp_path / "bench.toml", 'script = "train.py"\nscript_args = ["--steps", "5"]\n')
    assert parsed("bench", "--config", str(path))["script_args"] == ["--steps", "5"]
    assert parsed("bench", "--config", str(path), "b.py")["script_args"] == []
    # export's two positionals: the command line gives the first, the file the second.
    path = write(tmp_path / "export.yaml", "out: model.safetensors\n")
    got = parsed("export", "--config", str(path), "ckpt")
    assert (got["checkpoint"], got["out"]) == ("ckpt", "model.safetensors")


def test_a_required_positional_from_neither_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "run.yaml", "nproc: 2\n")
    for argv in (["run"], ["run", "--config", str(path)]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err == "multigpu run: error: the following arguments are required: script; see `multigpu run --help`.\n"


def test_a_key_may_be_spelled_as_another_flag_of_the_setting(tmp_path: Path) -> None:
    """train's strategy is multi_gpu, and `strategy`, its flag on the other verbs, is one of its names too."""
    assert load_config(write(tmp_path / "a.yaml", "strategy: zero3\n"), verb("train")) == {"multi_gpu": "zero3"}
    assert load_config(write(tmp_path / "b.yaml", "multi-gpu: ddp\n"), verb("demo")) == {"strategy": "ddp"}
    path = write(tmp_path / "c.yaml", "strategy: ddp\nmulti_gpu: zero3\n")
    assert "multi_gpu is given twice (as 'strategy' and 'multi_gpu')" in refusal(load_config, path, verb("finetune"))
