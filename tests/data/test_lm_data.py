"""Finetune data: Shakespeare cut into blocks, records of every format with each assistant turn learnt, one shared
token cache keyed by contents and settings, packing, validation data, and the streamed windows.

The tokenizer comes from the shared model cache (~/.cache/multigpu, converted once per machine, about 30 s); the
token cache goes to a temporary directory through MULTIGPU_TOKEN_CACHE.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from multigpu.core.errors import UsageError
from multigpu.data import data_files, lm_data, lm_tokens
from multigpu.models.lm_models import load_tokenizer
from tests.data.test_data_files import one_sentence
from tests.dist import ROOT, run_in_processes

SEQ_LEN = 256
SYSTEM = {"role": "system", "content": "You answer in one word."}
TWO_TURNS = [
    SYSTEM,
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]
# One format a file: the first record shows which (data_files).
CHATS = [
    {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."}]},
    {"messages": TWO_TURNS},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi " * 20}]},
]
INSTRUCTIONS = [
    {"instruction": "Name a colour.", "output": "Blue, like the sky."},
    {"instruction": "Translate to English.", "input": "bonjour", "output": "hello"},
]
COUNT = " ".join(str(i) for i in range(100))  # about 300 tokens
LONG_ANSWER = {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": COUNT}]}
LONG_PROMPT = {"messages": [{"role": "user", "content": COUNT}, {"role": "assistant", "content": "Done."}]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("tiny")


@pytest.fixture(autouse=True)
def token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MULTIGPU_TOKEN_CACHE", str(tmp_path / "tokens"))
    return tmp_path / "tokens"


@pytest.fixture(scope="module")
def shakespeare(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> lm_data.LMData:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTIGPU_TOKEN_CACHE", str(tmp_path_factory.mktemp("tokens")))
        return lm_data.load(lm_data.DataSettings(seq_len=SEQ_LEN), tokenizer)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def load(path: Path, tokenizer: Any, **settings: Any) -> lm_data.LMData:
    return lm_data.load(lm_data.DataSettings(data=str(path), **settings), tokenizer)


def messages_of(record: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in record:
        return record["messages"]
    prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


def documents(dataset: Any) -> list[dict[str, torch.Tensor]]:
    """The documents of a packed (split where the positions restart) or unpacked dataset, in its order."""
    found = []
    for sample in dataset:
        starts = [0]
        if "position_ids" in sample:
            starts = (sample["position_ids"] == 0).nonzero().flatten().tolist()
        for start, stop in zip(starts, [*starts[1:], None], strict=True):
            found.append({key: sample[key][start:stop] for key in ("input_ids", "labels")})
    return found


def as_tuples(docs: list[dict[str, torch.Tensor]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(d["input_ids"].tolist()), tuple(d["labels"].tolist())) for d in docs]


def learnt_runs(labels: torch.Tensor) -> list[list[int]]:
    """The target tokens in runs of consecutive learnt positions: one run per learnt answer."""
    runs: list[list[int]] = []
    for position, label in enumerate(labels.tolist()):
        if label != -100:
            if position == 0 or labels[position - 1] == -100:
                runs.append([])
            runs[-1].append(label)
    return runs


def test_shakespeare_text_has_no_markup() -> None:
    records = lm_data.examples("shakespeare", lm_data.DataSettings())
    text = "\n".join(example for _, example in records.examples)
    assert records.kind == "text" and len(records.examples) == 38
    assert "To be, or not to be: that is the question:" in text
    assert "\nBERNARDO\nWho's there?\n" in text
    for markup in ("**", "_", "*", "\\", "\n#", "  \n"):
        assert markup not in text


def test_shakespeare_blocks(shakespeare: lm_data.LMData, tokenizer: Any) -> None:
    """Each play is cut into documents of SEQ_LEN + 1 tokens (the last of a play shorter, ending in EOS), every
    token but a document's first a target; validation is the last 2% of the documents."""
    train, validation = shakespeare.train.documents, shakespeare.validation.documents
    assert shakespeare.kind == "text" and shakespeare.packed and shakespeare.report == ""
    assert len(validation) == round(0.02 * (len(train) + len(validation)))
    assert validation.offsets[0] == train.offsets[-1]  # the tail of the same documents, after every training one
    assert shakespeare.tokens == sum(train.lengths())  # every next token is learnt
    play_ends = 0
    for dataset in (train, validation):
        for index in range(len(dataset)):
            sample = dataset[index]
            assert sample["input_ids"].dtype == torch.long and len(sample["input_ids"]) <= SEQ_LEN
            assert torch.equal(sample["labels"][:-1], sample["input_ids"][1:])  # labels: the next tokens
            full = len(sample["input_ids"]) == SEQ_LEN
            play_ends += int(sample["labels"][-1]) == tokenizer.eos_token_id
            assert full or int(sample["labels"][-1]) == tokenizer.eos_token_id  # only a play's last is short
    assert play_ends == 38
    assert tokenizer.decode(train[0]["input_ids"]).startswith("A Midsummer Night's Dream\n\nACT I\n")
    for sample in (shakespeare.train[0], shakespeare.train[len(shakespeare.train) - 1]):
        assert len(sample["input_ids"]) <= SEQ_LEN and sample["position_ids"][0] == 0


def test_second_load_reads_the_cache_keyed_by_contents(
    tokenizer: Any, tmp_path: Path, token_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = tmp_path / "hamlet.txt"
    text.write_text(lm_data.shakespeare_plays()["tragedies/hamlet"])
    first = load(text, tokenizer, seq_len=64)
    assert not first.from_cache and [p.name for p in token_cache.glob("*.pt")] == [first.cache.name]
    mtime = first.cache.stat().st_mtime_ns

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("tokenised again instead of reading the cache")

    monkeypatch.setattr(type(tokenizer), "__call__", fail)
    monkeypatch.setattr(type(tokenizer), "apply_chat_template", fail)
    moved = tmp_path / "elsewhere" / "copy.txt"
    moved.parent.mkdir()
    shutil.copy(text, moved)
    for spec in (text, moved):  # the same contents at another path: the same cache
        second = load(spec, tokenizer, seq_len=64, packing=False)  # packing happens after the cache
        assert second.from_cache and second.cache == first.cache and second.cache.stat().st_mtime_ns == mtime
        assert torch.equal(first.train.documents.tokens, second.train.tokens) and first.tokens == second.tokens
    monkeypatch.undo()
    text.write_text(text.read_text() + "!")  # other contents, another key
    assert load(text, tokenizer, seq_len=64).cache != first.cache


def test_the_token_cache_key_follows_the_settings_the_tokens_depend_on(tokenizer: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)

    def key(**settings: Any) -> str:
        chosen = lm_data.DataSettings(data=str(path), **settings)
        return lm_tokens.cache_key(lm_data.source_identity(str(path), chosen), tokenizer, chosen)

    cutting = [{}, {"seq_len": 128}, {"learn_turns": "last"}, {"too_long": "drop"}, {"data_format": "chat"}]
    assert len({key(**settings) for settings in cutting}) == len(cutting)
    assert key() == key(packing=False) == key(val_fraction=0.5) == key(eval_data=str(path))  # cut after the cache


def test_chat_and_instruction_records_learn_every_answer_through_its_end(tokenizer: Any, tmp_path: Path) -> None:
    chats = load(write_jsonl(tmp_path / "chat.jsonl", CHATS), tokenizer, seq_len=128, packing=False)
    instructions = load(write_jsonl(tmp_path / "alpaca.jsonl", INSTRUCTIONS), tokenizer, seq_len=128, packing=False)
    assert chats.kind == instructions.kind == "chat" and not chats.packed
    assert (len(chats.train), len(chats.validation)) == (2, 1)  # validation: the last document (at least one)
    samples = [*chats.train, *chats.validation, *instructions.train, *instructions.validation]
    end = tokenizer.eos_token  # <|im_end|>, the end of the assistant's turn
    for record, sample in zip(CHATS + INSTRUCTIONS, samples, strict=True):
        messages = messages_of(record)
        answers = [m["content"] + end for m in messages if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in learnt_runs(sample["labels"])] == answers  # not the user's or system's
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        whole = tokenizer.decode([*sample["input_ids"], sample["labels"][-1]])
        assert rendered == whole + "\n"  # the template's text to the last end of turn, tokenised piece by piece
        asked = [m["role"] for m in messages].index("assistant")
        prompt = tokenizer.apply_chat_template(messages[:asked], tokenize=False, add_generation_prompt=True)
        first_answer = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert (sample["labels"][: first_answer - 1] == -100).all() and sample["labels"][first_answer - 1] != -100
    assert chats.tokens == sum(int((s["labels"] != -100).sum()) for s in chats.train) > 0

    batch = chats.collate_fn()(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (5, max(lengths))
    for row, (sample, n) in enumerate(zip(samples, lengths, strict=True)):
        assert torch.equal(batch["input_ids"][row, :n], sample["input_ids"])
        assert torch.equal(batch["labels"][row, :n], sample["labels"])
        assert (batch["input_ids"][row, n:] == chats.pad_id).all() and (batch["labels"][row, n:] == -100).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)


def test_learn_turns_last_learns_only_the_last_answer(tokenizer: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "two.jsonl", [{"messages": TWO_TURNS}] * 2)
    every, last = (load(path, tokenizer, seq_len=128, learn_turns=turns, packing=False) for turns in ("all", "last"))
    end = tokenizer.eos_token
    assert [tokenizer.decode(run) for run in learnt_runs(every.train[0]["labels"])] == ["Paris." + end, "Rome." + end]
    assert [tokenizer.decode(run) for run in learnt_runs(last.train[0]["labels"])] == ["Rome." + end]
    assert torch.equal(every.train[0]["input_ids"], last.train[0]["input_ids"])  # the same text, fewer targets
    assert every.cache != last.cache


def test_a_batch_pads_to_a_multiple_for_sequence_parallelism() -> None:
    """Under sequence parallelism every tp process takes an equal slice of the positions: finetune pads each
    batch to a multiple of tp, the padding masked out of attention (mask 0) and the loss (label -100)."""
    samples = [{"input_ids": torch.arange(1, n + 1), "labels": torch.arange(2, n + 2)} for n in (5, 3)]
    batch = lm_data.collate(samples, pad_id=0, multiple=4)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, 4, 5, 6] + [-100] * 3, [2, 3, 4] + [-100] * 5]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]
    assert lm_data.collate(samples, pad_id=0, multiple=5)["input_ids"].shape == (2, 5)  # a multiple already
    assert lm_data.collate(samples, pad_id=0)["input_ids"].shape == (2, 5)


def test_records_longer_than_seq_len_are_cut_or_left_out_and_counted(tokenizer: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "long.jsonl", [*CHATS, LONG_ANSWER, LONG_PROMPT])
    cut = load(path, tokenizer, seq_len=64, packing=False, val_fraction=0.25)
    assert cut.report == (
        f"{path} (split train): of 5 records, 1 cut to --seq-len 64 + 1 tokens (--too-long truncate); 1 left out with "
        "no answer token within --seq-len 64."
    )
    truncated = cut.validation[0]  # the 4th document, the long answer, is held out (the last quarter)
    learnt = truncated["labels"] != -100
    assert len(truncated["input_ids"]) == 64 and learnt[-1] and learnt.sum() < 64
    assert torch.equal(truncated["labels"][:-1][learnt[:-1]], truncated["input_ids"][1:][learnt[:-1]])
    dropped = load(path, tokenizer, seq_len=64, packing=False, too_long="drop", val_fraction=0.25)
    assert dropped.report.endswith("of 5 records, 2 longer than --seq-len 64 left out (--too-long drop).")
    assert (len(dropped.train), len(dropped.validation)) == (2, 1)
    assert as_tuples([*dropped.train, *dropped.validation]) == as_tuples([*cut.train][:3])
    assert load(write_jsonl(tmp_path / "short.jsonl", CHATS), tokenizer, seq_len=128).report == ""
    with pytest.raises(UsageError) as refused:
        load(write_jsonl(tmp_path / "prompts.jsonl", [LONG_PROMPT] * 2), tokenizer, seq_len=64)
    one_sentence(refused, "prompts.jsonl (split train) has no record with a token to learn within --seq-len")


def test_the_parallel_tokenisation_gives_what_the_serial_one_does(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lm_tokens, "PARALLEL_FROM", 4)  # datasets.map's worker processes on a dozen records
    path = write_jsonl(tmp_path / "many.jsonl", [*CHATS, LONG_ANSWER] * 3)
    settings = lm_data.DataSettings(data=str(path), seq_len=64)
    parallel = lm_tokens.tokenise_records(data_files.read(str(path)), tokenizer, settings)
    serial = lm_tokens.tokenise_records(data_files.read(str(path)), tokenizer, settings, parallel=False)
    assert parallel.keys() == serial.keys() and parallel["fates"].tolist() == [9, 3, 0, 0]
    for key, value in serial.items():
        assert torch.equal(parallel[key], value) if isinstance(value, torch.Tensor) else parallel[key] == value, key


def test_packing_holds_the_same_documents_and_targets(tokenizer: Any, tmp_path: Path) -> None:
    records = [*CHATS, {"messages": TWO_TURNS[1:]}] * 3
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    unpacked = load(path, tokenizer, seq_len=SEQ_LEN, packing=False)
    packed = load(path, tokenizer, seq_len=SEQ_LEN)
    assert packed.from_cache and packed.packed and packed.tokens == unpacked.tokens
    for split in ("train", "validation"):
        plain, bins = getattr(unpacked, split), getattr(packed, split)
        assert sorted(as_tuples(documents(bins))) == sorted(as_tuples(documents(plain)))
    assert len(packed.train) < len(unpacked.train)
    sample = max(packed.train, key=lambda s: int((s["position_ids"] == 0).sum()))
    starts = (sample["position_ids"] == 0).nonzero().flatten().tolist()
    assert len(starts) >= 3 and len(sample["input_ids"]) <= SEQ_LEN
    for start, stop in zip(starts, [*starts[1:], len(sample["input_ids"])], strict=True):
        assert sample["position_ids"][start:stop].tolist() == list(range(stop - start))
    batch = packed.collate_fn(multiple=8)([packed.train[0], sample])
    assert batch.keys() == {"input_ids", "labels", "position_ids"}  # no attention_mask: the positions say it
    assert batch["input_ids"].shape[1] % 8 == 0
    assert unpacked.collate_fn()([unpacked.train[0]]).keys() == {"input_ids", "labels", "attention_mask"}


def test_validation_is_eval_data_or_a_fraction(tokenizer: Any, tmp_path: Path) -> None:
    train_path = write_jsonl(tmp_path / "train.jsonl", CHATS * 2)
    eval_path = write_jsonl(tmp_path / "eval.jsonl", INSTRUCTIONS)
    data = load(train_path, tokenizer, seq_len=128, packing=False, eval_data=str(eval_path))
    alone = load(eval_path, tokenizer, seq_len=128, packing=False, val_fraction=0.5)
    assert (len(data.train), len(data.validation)) == (6, 2)  # nothing of --data held out
    assert as_tuples([*data.validation]) == as_tuples([*alone.train, *alone.validation])
    halves = load(train_path, tokenizer, seq_len=128, packing=False, val_fraction=0.5)
    assert (len(halves.train), len(halves.validation)) == (3, 3)
    assert as_tuples([*halves.validation]) == as_tuples([*data.train][3:])  # the tail, whatever the world size


@pytest.mark.parametrize(
    ("settings", "sentence"),
    [
        (
            {"eval_data": "eval.jsonl", "val_fraction": 0.1},
            "--eval-data and --val-fraction both choose the validation data; pass one of them.",
        ),
        (
            {"data": "train.jsonl", "data_streaming": True, "val_fraction": 0.1},
            "--data-streaming holds nothing out of a stream; validate on --eval-data instead of --val-fraction.",
        ),
        (
            {"data_streaming": True},
            "--data-streaming reads files of records; shakespeare is read whole, so drop --data-streaming.",
        ),
        (
            {"data": "notes.txt", "data_streaming": True},
            "--data-streaming reads files of records; notes.txt is read whole, so drop --data-streaming.",
        ),
        ({"val_fraction": 1.0}, "--val-fraction must be between 0 and 1 (got 1.0)."),
    ],
)
def test_data_settings_refuse_what_cannot_go_together(settings: dict[str, Any], sentence: str) -> None:
    with pytest.raises(UsageError) as refused:
        lm_data.DataSettings(**settings)
    assert str(refused.value) == sentence


def test_a_stream_is_the_in_memory_documents_a_window_at_a_time(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lm_data.TokenStream, "WINDOW", 3)
    path = write_jsonl(tmp_path / "chat.jsonl", [*CHATS, LONG_ANSWER] * 3)  # 12 records
    for packed in (False, True):
        whole = load(path, tokenizer, seq_len=64, packing=packed, eval_data=str(path))  # all of it trained on
        stream = load(path, tokenizer, seq_len=64, packing=packed, data_streaming=True)
        assert isinstance(stream.train, lm_data.TokenStream) and stream.validation is None and stream.kind == "chat"
        windows = list(stream.train.windows(0, 0))
        assert len(windows) == 4
        assert [as_tuples(w) for w in windows] == [as_tuples(w) for w in stream.train.windows(1, 0)]  # each epoch
        assert as_tuples(next(stream.train.windows(0, 2))) == as_tuples(windows[2])  # a resume's first window
        assert stream.train.report() == whole.report != ""  # each record counted once, however often read
        streamed = [document for window in windows for document in as_tuples(documents(window))]
        expected = as_tuples(documents(whole.train))
        if packed:  # packed within each window of 3 records
            assert sorted(streamed) == sorted(expected)
        else:
            assert streamed == expected


def test_a_stream_window_with_nothing_to_learn_is_empty(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last window may hold a record or two: all of them left out is no reason to stop a long run."""
    monkeypatch.setattr(lm_data.TokenStream, "WINDOW", 3)
    path = write_jsonl(tmp_path / "chat.jsonl", [*CHATS, LONG_PROMPT])
    stream = load(path, tokenizer, seq_len=64, packing=False, data_streaming=True, too_long="drop").train
    assert [len(window) for window in stream.windows(0, 0)] == [3, 0]
    assert stream.report().endswith("of 4 records, 1 longer than --seq-len 64 left out (--too-long drop).")


def test_bad_records_name_the_file_and_the_record(tokenizer: Any, tmp_path: Path) -> None:
    """A few cases through finetune's loading; data_files' tests hold the rest."""
    cases = [
        ([CHATS[0], "{not json", CHATS[1]], "line 2 is not valid JSON"),
        ([INSTRUCTIONS[0], {"instruction": "no output"}], 'record 2 has nothing in "output"'),
        ([CHATS[0], {"messages": [{"role": "user", "content": "Hi"}]}], "record 2 does not end with the assistant"),
        ([INSTRUCTIONS[0], '{"instruction": "a\\ud800b", "output": "x"}'], r"line 2 holds \ud800, half of a UTF-16"),
        (['{"instruction": "a", "output": "\\udfff"}'], r"record 1 holds \udfff, half of a UTF-16"),
    ]
    for number, (lines, message) in enumerate(cases):
        path = write_jsonl(tmp_path / f"bad{number}.jsonl", lines)
        with pytest.raises(UsageError) as refused:
            load(path, tokenizer, seq_len=128)
        one_sentence(refused, str(path), message)
    # A .json list is read by Python's json, which keeps a lone surrogate: refused alike, in memory and streamed.
    array = tmp_path / "bad.json"
    array.write_text('[{"instruction": "a", "output": "b"}, {"instruction": "a\\ud800b", "output": "x"}]')
    for streaming in (False, True):
        with pytest.raises(UsageError) as refused:
            load(array, tokenizer, seq_len=128, data_streaming=streaming)
        one_sentence(refused, str(array), r"record 2 holds \ud800, half of a UTF-16")
    pair = write_jsonl(tmp_path / "emoji.jsonl", ['{"instruction": "smile \\ud83d\\ude00", "output": "\\u00e9"}'])
    assert data_files.read(str(pair)).examples[0][1][0]["content"] == "smile \U0001f600"  # a whole pair: one character


def test_bad_sources(tokenizer: Any, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load(tmp_path / "missing.txt", tokenizer)
    with pytest.raises(UsageError, match="--data shakespear does not exist"):
        lm_data.load(lm_data.DataSettings(data="shakespear"), tokenizer)
    # Validation data is read by the same readers, and its messages name its own flag, checked or loaded.
    for call in (lm_data.check, lambda settings: lm_data.load(settings, tokenizer)):
        with pytest.raises(UsageError, match=r"^--eval-data shakespear does not exist"):
            call(lm_data.DataSettings(data="shakespeare", eval_data="shakespear"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UsageError, match=r"^--eval-data \S+empty\.jsonl is empty"):
        lm_data.check(lm_data.DataSettings(data="shakespeare", eval_data=str(tmp_path / "empty.jsonl")))
    (tmp_path / "latin1.txt").write_bytes("tea\ncaf\xe9 au lait".encode("latin-1"))
    with pytest.raises(UsageError, match=r"latin1\.txt line 2 is not UTF-8 \(invalid continuation byte at byte 7\)"):
        load(tmp_path / "latin1.txt", tokenizer)
    (tmp_path / "short.txt").write_text("Too short for two blocks.")
    with pytest.raises(UsageError, match="too few to validate"):
        load(tmp_path / "short.txt", tokenizer)
    with pytest.raises(UsageError, match="too few to validate"):
        load(write_jsonl(tmp_path / "one.jsonl", CHATS[:1]), tokenizer)


def test_a_directory_without_data_is_refused(tmp_path: Path) -> None:
    (tmp_path / "corpus.jsonl").mkdir()
    for directory in (tmp_path, tmp_path / "corpus.jsonl"):
        with pytest.raises(UsageError) as refused:
            lm_data.check(lm_data.DataSettings(data=str(directory)))
        one_sentence(refused, f"--data {directory} is a directory that datasets cannot read", "save_to_disk")


def load_in_process(spec: str, cache: str, ready: str, processes: int) -> dict[str, Any]:
    """Runs in each rank: waits until every process has its tokenizer, so that all call load at the same moment."""
    os.environ["MULTIGPU_TOKEN_CACHE"] = cache
    tokenizer = load_tokenizer("tiny")
    Path(ready, str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(ready)) < processes and time.monotonic() < deadline:
        time.sleep(0.01)
    data = lm_data.load(lm_data.DataSettings(data=spec, seq_len=64), tokenizer)
    train, validation = data.train.documents, data.validation.documents
    digest = hashlib.sha256(train.tokens.numpy().tobytes() + validation.offsets.numpy().tobytes())
    return {"from_cache": data.from_cache, "digest": digest.hexdigest(), "blocks": len(train)}


def test_concurrent_processes_tokenise_once(tmp_path: Path) -> None:
    """Two ranks start together on an empty cache: one tokenises, the other waits on the lock and reads."""
    text = tmp_path / "hamlet.txt"
    text.write_text(lm_data.shakespeare_plays()["tragedies/hamlet"])
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    target = "tests.data.test_lm_data:load_in_process"
    results = run_in_processes(target, 2, timeout=180, spec=str(text), cache=str(cache), ready=str(ready), processes=2)
    assert sorted(r["from_cache"] for r in results) == [False, True]
    assert results[0]["digest"] == results[1]["digest"] and results[0]["blocks"] > 100
    assert [p.suffix for p in sorted(cache.iterdir())] == [".pt"]  # no partial file, no lock left behind


def test_ctrl_c_while_tokenising_is_one_line_and_leaves_no_lock(tmp_path: Path) -> None:
    """Ctrl-C reaches every process of the terminal's group, the tokenising pool's workers too: only the run's own
    line is printed, and the cache holds neither a lock nor a partial file, so the next run starts cleanly."""
    data = tmp_path / "many.jsonl"
    turns = ({"messages": [{"role": "user", "content": f"{i}+{i}?"}, {"role": "assistant", "content": f"{2 * i}."}]}
             for i in range(4 * lm_tokens.PARALLEL_FROM))  # fmt: skip
    data.write_text("".join(json.dumps(turn) + "\n" for turn in turns))
    cache, output = tmp_path / "cache", tmp_path / "output.txt"
    env = {**os.environ, "MULTIGPU_TOKEN_CACHE": str(cache), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    argv = [sys.executable, "-m", "multigpu", "finetune", "--model", "tiny", "--data", str(data), "--seq-len", "32"]
    with output.open("w") as log:
        run = subprocess.Popen([*argv, "--save-dir", str(tmp_path / "run")], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "tokenising" not in output.read_text() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the pool's workers are at work
        os.killpg(run.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to every process of the group
        run.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    printed = output.read_text()
    assert run.returncode == 130, printed
    assert "Traceback" not in printed and "ForkPoolWorker" not in printed, printed
    # The tokenising bar's refreshes (with \r, or a line each) are one line on screen; how many came before the
    # Ctrl-C depends on timing, so the lines counted are the run's own.
    lines = [line for line in printed.split("\n") if line.strip() and not line.startswith("tokenising ")]
    assert len(lines) <= 2 and lines[-1].startswith("multigpu: stopped by SIGINT; "), printed
    assert list(cache.iterdir()) == [], printed
