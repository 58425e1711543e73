"""The readers of user-given paths and JSON files: one sentence for each way they can be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from multigpu.cli import main
from multigpu.config.flags import check_path, json_value, read_json
from multigpu.core.errors import UsageError


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as refused:
        call(*args, **kwargs)
    return str(refused.value)


def test_check_path_says_what_the_path_is_and_what_was_expected(tmp_path: Path) -> None:
    file = tmp_path / "f.txt"
    file.write_text("x")
    assert check_path(file, "file", "--x") == file and check_path(str(tmp_path), "directory", "--x") == tmp_path
    assert refusal(check_path, tmp_path, "file", "--x", "a text file") == (
        f"--x {tmp_path} is a directory, but a text file is expected; pass the file's path."
    )
    assert refusal(check_path, file, "directory", "--x") == (
        f"--x {file} is a file, but a directory is expected; pass the directory's path."
    )
    assert refusal(check_path, tmp_path / "none", "file", "--x", advice="write it first") == (
        f"--x {tmp_path / 'none'} does not exist; write it first."
    )
    assert refusal(check_path, "/dev/null", "file", "--x").startswith("--x /dev/null is neither a file nor a directory")
    long = tmp_path / ("x" * 300)  # a name longer than any Linux file system takes (ENAMETOOLONG)
    assert refusal(check_path, long, "file", "--x") == (
        f"--x {str(long)[:60]}[...] ({len(str(long))} characters) cannot be looked up (File name too long); "
        "pass another path."
    )


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"a": [1, 2, {"b": NaN}]}', "a[2].b is NaN"),
        ('{"a": Infinity}', "a is Infinity"),
        ('{"a": {"b": [-Infinity]}}', "a.b[0] is -Infinity"),
        ('{"a": 1e999}', "a is Infinity"),  # too large for a float: Python reads it as infinity
        ("NaN", "the top level is NaN"),
    ],
)
def test_read_json_refuses_non_finite_numbers_by_their_key(tmp_path: Path, text: str, key: str) -> None:
    file = tmp_path / "in.json"
    file.write_text(text)
    assert refusal(read_json, file, "make it") == f"{file}: {key}, but a finite number is expected; write one."


def test_read_json_refuses_what_is_not_json_text(tmp_path: Path) -> None:
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    assert refusal(read_json, tmp_path / "binary.json", "make it", what="a bench.json").startswith(
        f"{tmp_path / 'binary.json'} is not UTF-8 text"
    )
    assert refusal(read_json, tmp_path, "make it", "--bench", "a bench.json") == (
        f"--bench {tmp_path} is a directory, but a bench.json is expected; pass the file's path."
    )
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    assert refusal(read_json, tmp_path / "deep.json", "make it", what="a bench.json") == (
        f"{tmp_path / 'deep.json'} nests lists or objects deeper than Python can follow; pass a bench.json."
    )
    (tmp_path / "ok.json").write_text('{"a": [1.5, null, true, "NaN"]}')
    assert read_json(tmp_path / "ok.json", "make it") == {"a": [1.5, None, True, "NaN"]}


DATA = {"n": 3, "x": 2.5, "on": True, "name": "ddp", "rows": [{"t": 1}], "none": None, "inner": {"m": 0.5}}


@pytest.mark.parametrize(
    ("key", "kind", "options", "message"),
    [
        ("missing", int, {}, "missing is missing, but an integer is expected"),
        ("on", int, {}, "on is true, but an integer is expected"),  # true is no number
        ("on", float, {}, "on is true, but a number is expected"),
        ("x", int, {}, "x is 2.5, but an integer is expected"),
        ("name", float, {}, 'name is "ddp", but a number is expected'),
        ("n", int, {"minimum": 4}, "n is 3, but an integer of 4 or more is expected"),
        ("n", int, {"minimum": 0, "maximum": 2}, "n is 3, but an integer from 0 to 2 is expected"),
        ("inner.m", float, {"minimum": 1}, "inner.m is 0.5, but a number of 1 or more is expected"),
        ("inner.z", float, {}, "inner.z is missing, but a number is expected"),
        ("name.z", float, {}, 'name is "ddp", but an object is expected'),
        ("rows", dict, {}, "rows is a list, but an object is expected"),
        ("inner", list, {}, "inner is an object, but a non-empty list is expected"),
        ("rows", list, {"items": str}, "rows[0] is an object, but a string is expected"),
        ("none", str, {}, "none is null, but a string is expected"),
        ("name", str, {"choices": ("zero1", "zero2")}, 'name is "ddp", but one of "zero1", "zero2" is expected'),
        ("name", (int, str), {"choices": ("auto",)}, 'name is "ddp", but an integer or "auto" is expected'),
        (None, list, {}, "the top level is an object, but a non-empty list is expected"),
    ],
)
def test_json_value_names_the_file_the_key_and_what_was_expected(key, kind, options: dict, message: str) -> None:
    got = refusal(json_value, DATA, key, kind, file="f.json", **options)
    assert got == f"f.json: {message}; fix the file."


def test_json_value_returns_what_it_checked() -> None:
    three = json_value(DATA, "n", float, file="f")
    assert three == 3.0 and isinstance(three, float)
    assert json_value(DATA, "inner.m", float, file="f", positive=True, maximum=1) == 0.5
    assert json_value(DATA, "rows", list, file="f", items=dict) == [{"t": 1}]
    assert json_value(DATA, "none", (dict, type(None)), file="f") is None
    assert json_value(DATA, "absent.deeper", int, file="f", optional=True) is None
    assert refusal(json_value, {"t": 0}, "t", int, "rows[0]", file="f", minimum=1, advice="rerun it").endswith(
        "f: rows[0].t is 0, but an integer of 1 or more is expected; rerun it."
    )


@pytest.mark.parametrize(
    ("verb", "flag", "kind", "message"),
    [
        ("train", "--data", "file", " is a file, but 'watch' or a UCI HAR directory is expected"),
        (
            "finetune",
            "--data",
            "directory",
            " is no data set multigpu reads (datasets' guess for it is its 'text' builder); pass a directory written "
            "by save_to_disk or holding .json, .jsonl, .parquet, .csv or .arrow files",
        ),
        (
            "finetune",
            "--model",
            "file",
            " is a file, but smollm2, tiny, tiny-deep, tiny-moe, tiny-moe-deep or a Hugging Face model directory is "
            "expected",
        ),
        ("plan", "--model", "directory", "/config.json does not exist; pass a built-in"),
    ],
)
def test_the_cli_names_a_path_of_the_wrong_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture, verb: str, flag: str, kind: str, message: str
) -> None:
    file = tmp_path / "data.txt"
    file.write_text("some text\n")
    wrong = file if kind == "file" else tmp_path
    others = ["--save-dir", str(tmp_path / "run")] if verb != "plan" else []
    if verb == "finetune" and flag == "--data":  # a model that is there, so that the data is what gets checked
        others += ["--model", "tiny"]
    with pytest.raises(SystemExit) as exit_info:
        main([verb, flag, str(wrong), *others])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(f"multigpu: error: {flag} {wrong}{message}")
    assert not (tmp_path / "run").exists()
