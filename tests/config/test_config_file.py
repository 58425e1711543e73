"""Config files: `VERB --config FILE` (YAML or TOML, under the command line), `multigpu config VERB` (a
commented file that reads back as the defaults), and the config.yaml a run leaves in its directory."""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import pytest
import yaml

from multigpu import cli
from multigpu.cli import build_parser, main
from multigpu.config import config_file
from multigpu.config.config_file import load_config, parse_args
from multigpu.core.errors import UsageError
from multigpu.recipes.train import TrainConfig
from tests.recipes.test_train import write_uci_har

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


# -- writing ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["yaml", "toml"])
@pytest.mark.parametrize("name", VERBS)
def test_the_written_file_reads_back_as_the_defaults_for_every_verb(
    tmp_path: Path, name: str, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{name}.{fmt}"
    assert main(["config", name, "--out", str(path), "--no-ask"]) == 0
    assert capsys.readouterr().out == f"wrote {path}; use it with `multigpu {name} --config {path}`\n"
    text = path.read_text()
    parser = verb(name)
    keys = config_file.settings(parser)
    for key, action in keys.items():
        if action.default is None:
            assert (f"# {key}: null" if fmt == "yaml" else f"# {key} = ...") in text.splitlines()
    loaded = load_config(path, parser)
    assert loaded == {key: value for key, value in config_file.defaults(parser).items() if value is not None}
    assert all(type(loaded[key]) is type(keys[key].default) for key in loaded if not isinstance(loaded[key], float))
    extra = POSITIONALS.get(name, [])
    assert parsed(name, "--config", str(path), *extra) == parsed(name, *extra)


def test_each_key_sits_under_its_help() -> None:
    lines = config_file.render(verb("finetune"), "yaml", {}, "ft.yaml").splitlines()
    assert lines[0].startswith("# Settings for `multigpu finetune --config ft.yaml`")
    at = lines.index("grad_accum_steps: 1")
    assert lines[at - 1] == "# micro-batches per optimizer step"
    at = lines.index("method: lora")
    assert lines[at - 1] == "# what trains; one of full, lora, qlora"
    toml = config_file.render(verb("finetune"), "toml", {"lr": 1e-4, "nproc": 4}, "ft.toml").splitlines()
    assert "lr = 0.0001" in toml and "nproc = 4" in toml
    assert toml[toml.index("lr = 0.0001") - 1] == "# peak learning rate (AdamW) (default: 0.0002)"


def test_config_refuses_to_overwrite_and_mismatched_formats(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["config", "demo", "--no-ask"]) == 0
    assert (tmp_path / "demo.yaml").is_file()  # the default: VERB.yaml here
    assert main(["config", "demo", "--format", "toml", "--no-ask"]) == 0
    assert (tmp_path / "demo.toml").is_file()
    capsys.readouterr()
    for argv, message in [
        (["config", "demo"], "demo.yaml exists already; pass --force to overwrite it, or choose another --out."),
        (["config", "demo", "--out", "d.toml", "--format", "yaml"], "--format yaml does not match --out d.toml"),
        (["config", "demo", "--out", "d.txt"], "--out d.txt has neither a .yaml, .yml nor a .toml extension"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--no-ask"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"multigpu: error: {message}") and len(err.splitlines()) == 1
    (tmp_path / "demo.yaml").write_text("old")
    assert main(["config", "demo", "--force", "--no-ask"]) == 0
    assert (tmp_path / "demo.yaml").read_text().startswith("# Settings for `multigpu demo")


def test_config_writes_to_stdout_and_takes_no_config_itself(tmp_path: Path, capsys) -> None:
    assert main(["config", "env", "--out", "-", "--format", "toml", "--no-ask"]) == 0
    out = capsys.readouterr().out
    assert "nproc = 2" in out and "size_mb = 64" in out and "wrote" not in out
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "env", "--config", "x.yaml"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --config x.yaml" in capsys.readouterr().err


# -- the questions ---------------------------------------------------------------------------------------------
def test_the_questions_take_answers_explain_bad_ones_and_keep_defaults(tmp_path: Path) -> None:
    parser = verb("finetune")
    answers = [
        "lorax",  # method: no such choice, asked again
        "full",
        "0",  # nproc: FinetuneConfig refuses it, asked again
        "2",
        "",  # multi_gpu: keeps auto
        "bf16-mixed",  # precision
        "x",  # batch_size: no integer, asked again
        "8",
        "",  # grad_accum_steps: keeps 1
        "  out/ft  ",  # save_dir
    ]
    stdin, stderr, stdout = io.StringIO("\n".join(answers) + "\n"), io.StringIO(), io.StringIO()
    path = tmp_path / "ft.yaml"
    check = cli.answer_check("finetune", parser)
    config_file.write_config(parser, str(path), None, False, True, check, stdin, stderr, stdout)
    asked = stderr.getvalue()
    assert "method: what trains; one of full, lora, qlora [lora]: " in asked
    assert (
        "nproc: processes per node, launched when not under a launcher (default: 1, or one per --gpu-ids) "
        "[not set]: " in asked
    )
    assert '\'lorax\' is not one of "full", "lora", "qlora"; type one of them.' in asked
    assert "--nproc must be 1 or more (got 0)." in asked
    assert "'x' is not an integer; type one." in asked
    assert stdout.getvalue() == f"wrote {path}; use it with `multigpu finetune --config {path}`\n"
    expected = {"method": "full", "nproc": 2, "precision": "bf16-mixed", "batch_size": 8, "save_dir": "out/ft"}
    assert parsed("finetune", "--config", str(path)) == {**parsed("finetune"), **expected}
    assert "# what trains; one of full, lora, qlora (default: lora)" in path.read_text()


def test_questions_the_input_ends_before_are_refused(tmp_path: Path) -> None:
    stdin = io.StringIO("2\n")  # nproc answered, then nothing
    message = refusal(config_file.ask, verb("verify"), config_file.defaults(verb("verify")), stdin, io.StringIO())
    assert message == "The input ended before strategy was answered; answer every question, or pass --no-ask."


def test_a_verb_with_booleans_and_incomplete_defaults_is_asked_too(tmp_path: Path) -> None:
    assert cli.answer_check("generate", verb("generate")) is None  # generate's defaults lack --prompts
    parser = argparse.ArgumentParser(prog="multigpu x")
    parser.add_argument("--precision", action=argparse.BooleanOptionalAction, default=False)
    stderr = io.StringIO()
    values = config_file.ask(parser, {"precision": False}, io.StringIO("maybe\nyes\n"), stderr)
    assert values == {"precision": True}
    assert "'maybe' is no answer to a yes-or-no question; type yes or no." in stderr.getvalue()


# -- a run's record --------------------------------------------------------------------------------------------
def test_a_run_saves_what_ran_and_that_file_runs_it_again(tmp_path: Path, capsys) -> None:
    """multigpu config train -> edit -> multigpu train --config FILE --epochs 1 -> <save_dir>/config.yaml."""
    har = write_uci_har(tmp_path / "har", {"train": 32, "test": 16}, {"train": [1, 3], "test": [2]})
    path, save_dir = tmp_path / "train.yaml", tmp_path / "run"
    assert main(["config", "train", "--out", str(path), "--no-ask"]) == 0
    text = path.read_text()
    for old, new in [
        ("data: watch", f"data: {har}"),
        ("save_dir: checkpoints/run", f"save_dir: {save_dir}"),
        ("mode: conv", "mode: flatten"),
        ("batch_size: 32", "batch_size: 8"),
        ("log_every: 100", "log_every: 0"),
    ]:
        assert old in text
        text = text.replace(old, new)
    path.write_text(text)
    assert main(["train", "--config", str(path), "--epochs", "1"]) == 0
    ran = yaml.safe_load((save_dir / "config.yaml").read_text())
    expected = {**config_file.defaults(verb("train")), **load_config(path, verb("train")), "epochs": 1}
    assert ran == expected
    assert (ran["data"], ran["epochs"], ran["batch_size"], ran["nproc"]) == (str(har), 1, 8, None)
    assert list(ran) == list(config_file.settings(verb("train")))  # every field, in order
    # The record runs the run again: it parses to exactly the settings that ran.
    assert parsed("train", "--config", str(save_dir / "config.yaml")) == parsed(
        "train", "--config", str(path), "--epochs", "1"
    )
    # A run refused once it has looked at the save dir (another model's checkpoint there) leaves the record alone.
    before = (save_dir / "config.yaml").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(save_dir / "config.yaml"), "--mode", "conv", "--epochs", "2"])
    assert exit_info.value.code == 2
    assert "holds a different model" in capsys.readouterr().err
    assert (save_dir / "config.yaml").read_text() == before


def test_bench_saves_its_settings_in_its_out_directory(tmp_path: Path, monkeypatch) -> None:
    ran = []
    from multigpu.tools import bench

    monkeypatch.setattr(bench, "run", lambda *args: ran.append(args))
    path = write(tmp_path / "bench.yaml", "nproc: 1,2,4\nsteps: 5\nscript: s.py\nscript_args: [--x, 1]\n")
    out = tmp_path / "b"
    assert main(["bench", "--config", str(path), "--out", str(out), "--strategies", "ddp,fsdp"]) == 0
    assert ran[0][1:] == ("s.py", ["--x", "1"], False)
    assert load_config(out / "config.yaml", verb("bench")) == {
        **config_file.defaults(verb("bench")),
        **load_config(path, verb("bench")),
        "out": str(out),
        "strategies": "ddp,fsdp",
    }


def test_a_key_may_be_spelled_as_another_flag_of_the_setting(tmp_path: Path) -> None:
    """train's strategy is multi_gpu, and `strategy`, its flag on the other verbs, is one of its names too."""
    assert load_config(write(tmp_path / "a.yaml", "strategy: zero3\n"), verb("train")) == {"multi_gpu": "zero3"}
    assert load_config(write(tmp_path / "b.yaml", "multi-gpu: ddp\n"), verb("demo")) == {"strategy": "ddp"}
    path = write(tmp_path / "c.yaml", "strategy: ddp\nmulti_gpu: zero3\n")
    assert "multi_gpu is given twice (as 'strategy' and 'multi_gpu')" in refusal(load_config, path, verb("finetune"))
