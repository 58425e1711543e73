"""Users' data files through `datasets`: every kind of file x every format, globs, save_to_disk and snapshot
directories, splits, streaming (and its skip) against in memory, each bad-data sentence, and chitchat.

Every file is written here with `datasets` or pandas, in tmp_path; nothing is downloaded.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import datasets
import pandas
import pytest

from multigpu.core.errors import UsageError
from multigpu.data import data_files

SYSTEM = {"role": "system", "content": "Answer briefly."}
RECORDS: dict[str, list[dict[str, Any]]] = {
    "text": [{"text": "The first document."}, {"text": "A second one,\non two lines."}],
    "chat": [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]},
        {
            "messages": [
                SYSTEM,
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "Of Italy?"},
                {"role": "assistant", "content": "Rome."},
            ]
        },
    ],
    "alpaca": [
        {"instruction": "Name a colour.", "input": "", "output": "Blue.", "system": None},
        {"instruction": "Translate.", "input": "bonjour", "output": "hello", "system": "Answer briefly."},
    ],
    "sharegpt": [
        {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]},
        {
            "conversations": [
                {"from": "system", "value": "Answer briefly."},
                {"from": "human", "value": "Capital of France?"},
                {"from": "gpt", "value": "Paris."},
            ]
        },
    ],
    "prompt-completion": [{"prompt": "Say yes.", "completion": "Yes."}, {"prompt": "Count: 1, 2,", "completion": " 3"}],
}


def expected(data_format: str, record: dict[str, Any]) -> Any:
    """The Example each record above should become, written out independently of the code under test."""
    if data_format == "text":
        return record["text"]
    if data_format == "chat":
        return record["messages"]
    if data_format == "sharegpt":
        roles = {"system": "system", "human": "user", "gpt": "assistant"}
        return [{"role": roles[turn["from"]], "content": turn["value"]} for turn in record["conversations"]]
    if data_format == "alpaca":
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")
        system = [{"role": "system", "content": record["system"]}] if record["system"] else []
        return [*system, {"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    """`records` in the file kind that path's suffix names: datasets' writers, or pandas' for .json and .arrow."""
    dataset = datasets.Dataset.from_list(records)
    if path.suffix == ".jsonl":
        dataset.to_json(path, lines=True)
    elif path.suffix == ".json":  # one JSON array of records, as Alpaca's own alpaca_data.json
        pandas.DataFrame(records).to_json(path, orient="records")
    elif path.suffix == ".parquet":
        dataset.to_parquet(path)
    elif path.suffix == ".csv":
        dataset.to_csv(path, index=False)
    else:  # .arrow: Arrow's IPC file format (Feather v2)
        dataset.to_pandas().to_feather(path)
    return path


def one_sentence(error: pytest.ExceptionInfo[UsageError], *parts: str) -> str:
    message = str(error.value)
    assert "\n" not in message and message.endswith(".") and not re.search(r"\.\s+[A-Z]", message), message
    for part in parts:
        assert part in message, (part, message)
    return message


def examples(spec: str | Path, **options: Any) -> list[tuple[str, Any]]:
    return list(data_files.read(str(spec), **options).examples)


# Every kind of file in every format, but chat and sharegpt in CSV: a CSV cell holds text, not a list of messages.
FILES_AND_FORMATS = [
    (suffix, data_format)
    for suffix in (".jsonl", ".json", ".parquet", ".csv", ".arrow")
    for data_format in RECORDS
    if suffix != ".csv" or data_format not in ("chat", "sharegpt")
]


@pytest.mark.parametrize(("suffix", "data_format"), FILES_AND_FORMATS)
def test_each_kind_of_file_in_each_format_reads_to_its_examples(tmp_path: Path, suffix: str, data_format: str) -> None:
    path = write(tmp_path / f"data{suffix}", RECORDS[data_format])
    records = data_files.read(str(path))  # the format detected from the columns
    assert records.data_format == data_format
    assert records.kind == ("text" if data_format == "text" else "chat")
    assert records.source == f"{path} (split train)"
    assert records.examples == [
        (f"{path} record {n}", expected(data_format, record)) for n, record in enumerate(RECORDS[data_format], 1)
    ]
    assert data_files.read(str(path), data_format=data_format).examples == records.examples


def test_csv_cells_stay_text_as_written(tmp_path: Path) -> None:
    path = tmp_path / "qa.csv"
    path.write_text('instruction,input,output\nAdd 40 and 2.,,42\nSay NA.,None,"NA"\n')
    got = [example for _, example in examples(path)]
    assert [messages[-1]["content"] for messages in got] == ["42", "NA"]  # not the number 42, not a missing value
    assert got[1][0]["content"] == "Say NA.\n\nNone"


def test_the_conversational_prompt_completion_and_sharegpt_roles_user_assistant(tmp_path: Path) -> None:
    user, answer = {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}
    path = write(tmp_path / "pc.jsonl", [{"prompt": [SYSTEM, user], "completion": [answer]}])
    assert examples(path) == [(f"{path} record 1", [SYSTEM, user, answer])]
    turns = [{"from": "user", "value": "Hi?"}, {"from": "assistant", "value": "Hello."}]
    path = write(tmp_path / "sharegpt.jsonl", [{"conversations": turns, "system": "Answer briefly."}])
    assert examples(path) == [(f"{path} record 1", [SYSTEM, user, answer])]


def test_data_column_picks_the_column_and_shows_its_format(tmp_path: Path) -> None:
    path = write(tmp_path / "qa.parquet", [{"question": "Why?", "answer": "Because.", "id": 1}])
    with pytest.raises(UsageError) as error:
        data_files.read(str(path))
    one_sentence(error, str(path), "question, answer, id", "--data-format", "--data-column")
    assert examples(path, column="answer") == [(f"{path} record 1", "Because.")]
    chats = [{"dialogue": RECORDS["chat"][0]["messages"], "turns": RECORDS["sharegpt"][0]["conversations"]}]
    path = write(tmp_path / "two.jsonl", chats)
    assert data_files.read(str(path), column="dialogue").data_format == "chat"
    assert data_files.read(str(path), column="turns").data_format == "sharegpt"
    assert examples(path, column="turns") == [(f"{path} record 1", expected("sharegpt", RECORDS["sharegpt"][0]))]


def test_a_glob_reads_its_files_in_order_numbering_records_per_file(tmp_path: Path) -> None:
    first = write(tmp_path / "part-1.parquet", RECORDS["chat"])
    second = write(tmp_path / "part-2.parquet", RECORDS["chat"][:1])
    records = data_files.read(str(tmp_path / "part-*.parquet"))
    assert records.source == f"{tmp_path}/part-*.parquet (2 files, split train)"
    assert [where for where, _ in records.examples] == [
        f"{first} record 1",
        f"{first} record 2",
        f"{second} record 1",
    ]


def test_save_to_disk_directories_and_their_splits(tmp_path: Path) -> None:
    train, test = datasets.Dataset.from_list(RECORDS["alpaca"]), datasets.Dataset.from_list(RECORDS["alpaca"][:1])
    train.save_to_disk(tmp_path / "one")
    assert examples(tmp_path / "one") == [
        (f"{tmp_path / 'one'} record {n}", expected("alpaca", r)) for n, r in enumerate(RECORDS["alpaca"], 1)
    ]
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(tmp_path / "both")
    assert len(examples(tmp_path / "both")) == 2
    assert examples(tmp_path / "both", split="test") == [
        (f"{tmp_path / 'both' / 'test'} record 1", expected("alpaca", RECORDS["alpaca"][0]))
    ]
    with pytest.raises(UsageError) as error:
        data_files.read(str(tmp_path / "both"), split="validation")
    one_sentence(error, str(tmp_path / "both"), "no split validation", "train, test")
    datasets.DatasetDict({"dev": test, "test": test}).save_to_disk(tmp_path / "no-train")
    with pytest.raises(UsageError) as error:
        data_files.read(str(tmp_path / "no-train"))
    one_sentence(error, "dev, test", "--data-split")
    datasets.DatasetDict({"dev": test}).save_to_disk(tmp_path / "only")
    assert data_files.read(str(tmp_path / "only")).source == f"{tmp_path / 'only'} (split dev)"


def test_a_snapshot_directory_as_on_the_hub(tmp_path: Path) -> None:
    (tmp_path / "snapshot" / "data").mkdir(parents=True)
    train = write(tmp_path / "snapshot" / "data" / "train-00000-of-00001.parquet", RECORDS["sharegpt"])
    valid = write(tmp_path / "snapshot" / "data" / "validation-00000-of-00001.parquet", RECORDS["sharegpt"][1:])
    (tmp_path / "snapshot" / "README.md").write_text("# A data set\n")
    assert [where for where, _ in examples(tmp_path / "snapshot")] == [f"{train} record 1", f"{train} record 2"]
    assert examples(tmp_path / "snapshot", split="validation") == [
        (f"{valid} record 1", expected("sharegpt", RECORDS["sharegpt"][1]))
    ]
    with pytest.raises(UsageError) as error:
        data_files.read(str(tmp_path / "snapshot"), split="test")
    one_sentence(error, "no split test", "train, validation")


def test_a_single_file_has_the_one_split_train(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", RECORDS["text"])
    assert len(examples(path, split="train")) == 2
    with pytest.raises(UsageError) as error:
        data_files.read(str(path), split="test")
    one_sentence(error, str(path), "no split test", "train")


def test_streaming_yields_the_examples_in_memory_gives_from_any_skip(tmp_path: Path) -> None:
    for n in range(3):  # 2 + 2 + 2 records: whole parquet files are skipped from their metadata
        write(tmp_path / f"part-{n}.parquet", RECORDS["chat"])
        write(tmp_path / f"part-{n}.jsonl", RECORDS["chat"])
    datasets.Dataset.from_list(RECORDS["chat"] * 3).save_to_disk(tmp_path / "saved")
    for spec in (tmp_path / "part-*.parquet", tmp_path / "part-*.jsonl", tmp_path / "saved"):
        whole = examples(spec)
        assert len(whole) == 6
        for skip in (0, 1, 2, 3, 5, 6, 7):
            streamed = data_files.read(str(spec), streaming=True, skip=skip)
            assert not isinstance(streamed.examples, list)
            assert list(streamed.examples) == whole[skip:], (spec, skip)
            assert examples(spec, skip=skip) == whole[skip:]


def test_streaming_checks_each_record_as_it_is_read(tmp_path: Path) -> None:
    bad = [*RECORDS["alpaca"], {"instruction": "No answer.", "input": "", "output": None, "system": None}]
    path = write(tmp_path / "bad.jsonl", bad)
    streamed = iter(data_files.read(str(path), streaming=True).examples)
    assert [next(streamed), next(streamed)] == [
        (f"{path} record {n}", expected("alpaca", r)) for n, r in enumerate(RECORDS["alpaca"], 1)
    ]
    with pytest.raises(UsageError) as error:
        next(streamed)
    one_sentence(error, f"{path} record 3", '"output"')


def bad_record(tmp_path: Path, record: dict[str, Any], **options: Any) -> str:
    """The sentence for a file whose second record is `record` (the first one fits)."""
    first = next(records[0] for records in RECORDS.values() if set(records[0]) & set(record))  # a fitting one
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UsageError) as error:
        data_files.read(str(path), **options)
    return one_sentence(error, f"{path} record 2")


def test_a_record_that_does_not_fit_its_format_gets_one_sentence(tmp_path: Path) -> None:
    user, answer = {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}
    assert '"output"' in bad_record(tmp_path, {"instruction": "No answer."})
    assert '"instruction"' in bad_record(tmp_path, {"instruction": 7, "output": "x"})
    assert "a non-empty list" in bad_record(tmp_path, {"messages": []})
    assert "a non-empty list" in bad_record(tmp_path, {"messages": "Hi?"})
    assert 'message 2 has a number as "content"' in bad_record(tmp_path, {"messages": [user, {**answer, "content": 4}]})
    assert 'message 1 has nothing as "role"' in bad_record(tmp_path, {"messages": [{"content": "Hi?"}, answer]})
    assert "message 2 is a string" in bad_record(tmp_path, {"messages": [user, "Hello."]})
    assert "does not end with the assistant" in bad_record(tmp_path, {"messages": [user, answer, user]})
    assert "does not end with the assistant" in bad_record(tmp_path, {"messages": [user, {**answer, "content": " "}]})
    assert "does not open with a user" in bad_record(tmp_path, {"messages": [answer]})
    assert "'tool'" in bad_record(tmp_path, {"messages": [user, {"role": "tool", "content": "{}"}, answer]})
    assert "system" in bad_record(tmp_path, {"messages": [user, SYSTEM, answer]})
    turns = [{"from": "human", "value": "Hi?"}, {"from": "bot", "value": "Hello."}]
    assert "'bot'" in bad_record(tmp_path, {"conversations": turns}, data_format="sharegpt")
    assert '"prompt"' in bad_record(tmp_path, {"prompt": None, "completion": "x"}, data_format="prompt-completion")
    assert '"text"' in bad_record(tmp_path, {"text": ["a", "list"]}, data_format="text")


def test_unreadable_files_name_the_line(tmp_path: Path) -> None:
    cases = {
        "broken.jsonl": b'{"text": "fine"}\n{"text": "fine"}\n{"text": oops}\n',
        "latin1.jsonl": b'{"text": "fine"}\n{"text": "caf\xe9"}\n',
        "latin1.csv": b"text\nfine\ncaf\xe9\n",
        "array.json": b'[{"text": "fine"},\n {"text": "fine"},\n {"text": }]\n',
        "scalar.jsonl": b'{"text": "fine"}\n"just a string"\n',
        # pyarrow's reader would die of a stack overflow here (exit 139), with no error to turn into a sentence.
        "deep.jsonl": b'{"text": "fine"}\n{"a": ' + b'{"b": [' * 20_000 + b"]}" * 20_000 + b"}\n",
    }
    lines = {"broken.jsonl": 3, "latin1.jsonl": 2, "latin1.csv": 3, "array.json": 3, "scalar.jsonl": 2, "deep.jsonl": 2}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UsageError) as error:
            data_files.read(str(tmp_path / name))
        one_sentence(error, str(tmp_path / name), f"line {lines[name]}")
    with pytest.raises(UsageError) as error:
        data_files.read(str(tmp_path / "latin1.csv"))
    one_sentence(error, "is not UTF-8", "convert the file to UTF-8")


def test_empty_data_gets_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "header.csv").write_text("instruction,output\n")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS["text"]).select([])}).save_to_disk(
        tmp_path / "saved"
    )
    for spec, shown in (("empty.jsonl", "empty.jsonl is empty"), ("header.csv", "header.csv has no records")):
        with pytest.raises(UsageError) as error:
            data_files.read(str(tmp_path / spec))
        one_sentence(error, shown)
    with pytest.raises(UsageError) as error:
        data_files.read(str(tmp_path / "saved"))
    one_sentence(error, f"{tmp_path / 'saved' / 'train'} has no records")


def test_columns_that_are_missing_or_fit_no_format(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", RECORDS["alpaca"])
    for options, words in (
        ({"column": "nope"}, ["no column nope", "instruction, input, output, system", "--data-column"]),
        ({"data_format": "chat"}, ["no column messages", "--data-column"]),
        ({"data_format": "prompt-completion"}, ["no column prompt or completion"]),
        ({"data_format": "text"}, ["no column text", "3 columns of strings (instruction, input, output)"]),
        ({"data_format": "alpaca", "column": "output"}, ["leave --data-column out"]),
        ({"data_format": "yaml"}, ["--data-format yaml", "auto, text, chat"]),
    ):
        with pytest.raises(UsageError) as error:
            data_files.read(str(path), **options)
        one_sentence(error, *words)
        with pytest.raises(UsageError):  # check() finds it before any process starts
            data_files.check(str(path), None, options.get("data_format", "auto"), options.get("column"))


def test_globs_that_match_nothing_or_mix_formats(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as error:
        data_files.read(str(tmp_path / "*.parquet"))
    one_sentence(error, "*.parquet matches no file")
    write(tmp_path / "a.jsonl", RECORDS["alpaca"])
    write(tmp_path / "b.parquet", RECORDS["alpaca"])
    with pytest.raises(UsageError) as error:
        data_files.read(str(tmp_path / "*"))
    one_sentence(error, "2 kinds", ".jsonl, .parquet")
    chat = write(tmp_path / "c.jsonl", RECORDS["chat"])
    with pytest.raises(UsageError) as error:
        examples(tmp_path / "*.jsonl")
    one_sentence(error, str(chat), "chat in column messages", "alpaca", str(tmp_path / "a.jsonl"))


def test_check_refuses_what_cannot_be_read(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("plain text\n")
    (tmp_path / "nothing").mkdir()
    for spec, words in (
        (tmp_path / "absent.jsonl", ["does not exist"]),
        (tmp_path / "notes.txt", ["a .txt file", ".json, .jsonl, .parquet, .csv or .arrow"]),
        (tmp_path, ["is no data set multigpu reads", "'text' builder", "holding .json, .jsonl"]),
        (tmp_path / "nothing", ["datasets cannot read", "save_to_disk"]),
    ):
        with pytest.raises(UsageError) as error:
            data_files.check(str(spec), None, "auto", None)
        one_sentence(error, str(spec), *words)
    data_files.check(str(write(tmp_path / "fine.csv", RECORDS["text"])), None, "auto", None)


def test_fingerprint_follows_contents_and_settings_not_the_path(tmp_path: Path) -> None:
    first = write(tmp_path / "a.jsonl", RECORDS["text"])
    copy = tmp_path / "elsewhere" / "b.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    key = data_files.fingerprint(str(first), None, "auto", None)
    assert data_files.fingerprint(str(copy), None, "auto", None) == key
    assert data_files.fingerprint(str(first), None, "text", None) != key
    assert data_files.fingerprint(str(first), None, "auto", "text") != key
    copy.write_text(copy.read_text().replace("first", "1st"))
    assert data_files.fingerprint(str(copy), None, "auto", None) != key


def test_chitchat_reads_its_conversations_with_a_reply() -> None:
    records = data_files.read("chitchat")
    assert (records.kind, records.data_format) == ("chat", "chat")
    assert "4,018 of its 7,168 conversations" in records.source
    assert len(records.examples) == 4018
    where, first = records.examples[0]
    assert where.endswith("chitchat_dataset/dataset.json record 1")
    assert first[:2] == [
        {"role": "user", "content": "Hello\nHow are you doing today?"},
        {"role": "assistant", "content": "whats up MD\nim doing good\nhow are you doing?"},
    ]
    for _, messages in records.examples:
        assert messages[0]["role"] == "user" and messages[-1]["role"] == "assistant"
        assert all(a["role"] != b["role"] for a, b in itertools.pairwise(messages))
    assert list(data_files.read("chitchat", streaming=True, skip=4000).examples) == records.examples[4000:]
    with pytest.raises(UsageError) as error:
        data_files.read("chitchat", data_format="alpaca")
    one_sentence(error, "leave --data-format and --data-column out")
