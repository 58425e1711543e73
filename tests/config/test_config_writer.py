"""Config files written: `multigpu config VERB` (a commented file that reads back as the defaults, and its
questions), and the config.yaml a run leaves in its directory, which runs the run again."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest
import yaml

from multigpu import cli
from multigpu.cli import main
from multigpu.config import config_file, config_writer
from multigpu.config.config_file import load_config
from tests.config.test_config_file import POSITIONALS, VERBS, parsed, refusal, verb, write
from tests.recipes.test_train import write_uci_har


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
    lines = config_writer.render(verb("finetune"), "yaml", {}, "ft.yaml").splitlines()
    assert lines[0].startswith("# Settings for `multigpu finetune --config ft.yaml`")
    at = lines.index("grad_accum_steps: 1")
    assert lines[at - 1] == "# micro-batches per optimizer step"
    at = lines.index("method: lora")
    assert lines[at - 1] == "# what trains; one of full, lora, qlora"
    toml = config_writer.render(verb("finetune"), "toml", {"lr": 1e-4, "nproc": 4}, "ft.toml").splitlines()
    assert "lr = 0.0001" in toml and "nproc = 4" in toml
    assert toml[toml.index("lr = 0.0001") - 1] == "# peak learning rate (default: 0.0002)"


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
    config_writer.write_config(parser, str(path), None, False, True, check, stdin, stderr, stdout)
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
    message = refusal(config_writer.ask, verb("verify"), config_file.defaults(verb("verify")), stdin, io.StringIO())
    assert message == "The input ended before strategy was answered; answer every question, or pass --no-ask."


def test_a_verb_with_booleans_and_incomplete_defaults_is_asked_too(tmp_path: Path) -> None:
    assert cli.answer_check("generate", verb("generate")) is None  # generate's defaults lack --prompts
    parser = argparse.ArgumentParser(prog="multigpu x")
    parser.add_argument("--precision", action=argparse.BooleanOptionalAction, default=False)
    stderr = io.StringIO()
    values = config_writer.ask(parser, {"precision": False}, io.StringIO("maybe\nyes\n"), stderr)
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
    assert "--mode conv differs from flatten" in capsys.readouterr().err
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
