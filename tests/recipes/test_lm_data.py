"""Finetune data: Shakespeare packed into blocks, chat records with the loss on the answer, one shared token cache.

The tokenizer comes from the shared model cache (~/.cache/multigpu, converted once per machine, about 30 s); the
token cache goes to a temporary directory through MULTIGPU_TOKEN_CACHE.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from multigpu.core.errors import UsageError
from multigpu.recipes import lm_data
from multigpu.recipes.lm_models import load_tokenizer
from tests.dist import run_in_processes

SEQ_LEN = 256
RECORDS = [
    {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."}]},
    {"instruction": "Name a colour.", "output": "Blue, like the sky."},
    {"instruction": "Translate to English.", "input": "bonjour", "output": "hello"},
    {
        "messages": [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
            {"role": "assistant", "content": "Rome."},
        ]
    },
]


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
        return lm_data.load("shakespeare", tokenizer, SEQ_LEN)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def messages_of(record: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in record:
        return record["messages"]
    prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


def test_shakespeare_text_has_no_markup() -> None:
    corpus = lm_data.load_corpus("shakespeare")
    text = "\n".join(corpus.items)
    assert corpus.kind == "packed" and len(corpus.items) == 38
    assert "To be, or not to be: that is the question:" in text
    assert "\nBERNARDO\nWho's there?\n" in text
    for markup in ("**", "_", "*", "\\", "\n#", "  \n"):
        assert markup not in text


def test_shakespeare_blocks(shakespeare: lm_data.LMData, tokenizer: Any) -> None:
    train, validation = shakespeare.train, shakespeare.validation
    assert shakespeare.kind == "packed" and len(validation) == round(0.02 * (len(train) + len(validation)))
    assert shakespeare.tokens == len(train) * SEQ_LEN
    for dataset in (train, validation):
        for index in (0, len(dataset) // 2, len(dataset) - 1):
            sample = dataset[index]
            assert sample["input_ids"].shape == sample["labels"].shape == (SEQ_LEN,)
            assert sample["input_ids"].dtype == torch.long
            assert torch.equal(sample["labels"][:-1], sample["input_ids"][1:])  # labels: the next tokens
    # Validation is the tail of the same stream, after every training block.
    assert validation.offsets[0] == train.offsets[-1] == len(train) * (SEQ_LEN + 1)
    train_blocks = {tuple(train[i]["input_ids"].tolist()) for i in range(len(train))}
    assert not any(tuple(validation[i]["input_ids"].tolist()) in train_blocks for i in range(len(validation)))
    assert tokenizer.decode(train[0]["input_ids"]).startswith("A Midsummer Night's Dream\n\nACT I\n")


def test_second_load_reads_the_cache(
    tokenizer: Any, tmp_path: Path, token_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = tmp_path / "hamlet.txt"
    text.write_text(lm_data.shakespeare_plays()["tragedies/hamlet"])
    first = lm_data.load(str(text), tokenizer, 64)
    assert not first.from_cache and [p.name for p in token_cache.glob("*.pt")] == [first.cache.name]
    mtime = first.cache.stat().st_mtime_ns

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("tokenised again instead of reading the cache")

    monkeypatch.setattr(type(tokenizer), "__call__", fail)
    monkeypatch.setattr(type(tokenizer), "apply_chat_template", fail)
    second = lm_data.load(str(text), tokenizer, 64)
    assert second.from_cache and second.cache.stat().st_mtime_ns == mtime
    assert torch.equal(first.train.tokens, second.train.tokens) and first.tokens == second.tokens
    assert lm_data.cache_key(str(text), tokenizer, 65) != lm_data.cache_key(str(text), tokenizer, 64)
    text.write_text(text.read_text() + "!")  # other contents, another key
    assert lm_data.cache_key(str(text), tokenizer, 64) != second.cache.stem


def test_chat_and_instruction_records(tokenizer: Any, tmp_path: Path) -> None:
    data = lm_data.load(str(write_jsonl(tmp_path / "chat.jsonl", RECORDS)), tokenizer, 128, validation_fraction=0.25)
    assert data.kind == "chat" and (len(data.train), len(data.validation)) == (3, 1)
    samples = [*data.train, *data.validation]
    counted = 0
    for record, sample in zip(RECORDS, samples, strict=True):
        messages = messages_of(record)
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        prompt_length = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        labels = sample["labels"]
        assert (labels[: prompt_length - 1] == -100).all() and (labels[prompt_length - 1 :] != -100).all()
        assert tokenizer.decode(labels[prompt_length - 1 :]) == messages[-1]["content"] + tokenizer.eos_token
        assert tokenizer.decode(sample["input_ids"][:prompt_length]) == prompt
        counted += int((labels != -100).sum())
    assert data.tokens == counted - int((data.validation[0]["labels"] != -100).sum()) > 0

    batch = data.collate_fn()(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (4, max(lengths))
    for row, (sample, n) in enumerate(zip(samples, lengths, strict=True)):
        assert torch.equal(batch["input_ids"][row, :n], sample["input_ids"])
        assert torch.equal(batch["labels"][row, :n], sample["labels"])
        assert (batch["input_ids"][row, n:] == data.pad_id).all() and (batch["labels"][row, n:] == -100).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)


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


def test_long_answer_is_truncated_to_seq_len(tokenizer: Any, tmp_path: Path) -> None:
    long = {"instruction": "Count.", "output": " ".join(str(i) for i in range(200))}
    data = lm_data.load(str(write_jsonl(tmp_path / "long.jsonl", [long, long])), tokenizer, 64, 0.5)
    sample = data.train[0]
    learnt = sample["labels"][:-1] != -100
    assert len(sample["input_ids"]) == 64 and learnt.any()
    assert torch.equal(sample["labels"][:-1][learnt], sample["input_ids"][1:][learnt])
    assert 0 < data.tokens < 64


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([RECORDS[0], "{not json", RECORDS[1]], "line 2 is not valid JSON"),
        ([RECORDS[0], {"instruction": "no output"}], "line 2 needs"),
        ([RECORDS[0], ["a", "list"]], "line 2 is not a JSON object"),
        ([{"messages": [{"role": "user", "content": "Hi"}]}], "line 1: a conversation must end"),
        ([{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}], "line 1: every message needs"),
        ([RECORDS[0], {"instruction": "word " * 300, "output": "x"}], "line 2: its prompt fills --seq-len 128"),
        ([RECORDS[0]], "too few to validate"),
        (["", "  "], "has no records"),
        # Half of a surrogate pair: json reads it into a string that the tokenizer refuses with a TypeError.
        ([RECORDS[0], '{"instruction": "a\\ud800b", "output": "x"}'], r"line 2 holds \\ud800, half of a UTF-16"),
        ([RECORDS[0], '{"instruction": "a", "output": "\\udfff"}'], r"line 2 holds \\udfff, half of a UTF-16"),
        ([RECORDS[0], '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"], "line 2 nests lists or objects deeper than"),
    ],
)
def test_bad_records(tokenizer: Any, tmp_path: Path, lines: list[Any], message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(UsageError, match=message):
        lm_data.load(str(path), tokenizer, 128)


def test_a_whole_surrogate_pair_is_one_character(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "emoji.jsonl", ['{"instruction": "smile \\ud83d\\ude00", "output": "\\u00e9"}'])
    assert lm_data.load_corpus(str(path)).items[0][1][0]["content"] == "smile \U0001f600"


def test_bad_sources(tokenizer: Any, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        lm_data.load(str(tmp_path / "missing.txt"), tokenizer, 128)
    with pytest.raises(UsageError, match=r"is not shakespeare, a \.txt file or a \.jsonl file"):
        lm_data.load("shakespear", tokenizer, 128)
    (tmp_path / "latin1.txt").write_bytes("tea\ncaf\xe9 au lait".encode("latin-1"))
    with pytest.raises(UsageError, match=r"latin1\.txt line 2 is not UTF-8 \(invalid continuation byte at byte 7\)"):
        lm_data.load(str(tmp_path / "latin1.txt"), tokenizer, 128)
    (tmp_path / "short.txt").write_text("Too short for two blocks.")
    with pytest.raises(UsageError, match="too few to validate"):
        lm_data.load(str(tmp_path / "short.txt"), tokenizer, 128)


def load_in_process(spec: str, cache: str, ready: str, processes: int) -> dict[str, Any]:
    """Runs in each rank: waits until every process has its tokenizer, so that all call load at the same moment."""
    os.environ["MULTIGPU_TOKEN_CACHE"] = cache
    tokenizer = load_tokenizer("tiny")
    Path(ready, str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(ready)) < processes and time.monotonic() < deadline:
        time.sleep(0.01)
    data = lm_data.load(spec, tokenizer, 64)
    digest = hashlib.sha256(data.train.tokens.numpy().tobytes() + data.validation.offsets.numpy().tobytes())
    return {"from_cache": data.from_cache, "digest": digest.hexdigest(), "blocks": len(data.train)}


def test_concurrent_processes_tokenise_once(tmp_path: Path) -> None:
    """Two ranks start together on an empty cache: one tokenises, the other waits on the lock and reads."""
    text = tmp_path / "hamlet.txt"
    text.write_text(lm_data.shakespeare_plays()["tragedies/hamlet"])
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    target = "tests.recipes.test_lm_data:load_in_process"
    results = run_in_processes(target, 2, timeout=180, spec=str(text), cache=str(cache), ready=str(ready), processes=2)
    assert sorted(r["from_cache"] for r in results) == [False, True]
    assert results[0]["digest"] == results[1]["digest"] and results[0]["blocks"] > 100
    assert [p.suffix for p in sorted(cache.iterdir())] == [".lock", ".pt"]  # no partial file left behind


def test_a_directory_is_not_taken_for_a_data_file(tmp_path: Path) -> None:
    (tmp_path / "corpus.jsonl").mkdir()
    for directory in (tmp_path, tmp_path / "corpus.jsonl"):
        with pytest.raises(UsageError) as refused:
            lm_data.check(str(directory))
        assert str(refused.value) == (
            f"--data {directory} is a directory, but shakespeare, a .txt file or a .jsonl file is expected; pass the "
            "file's path."
        )
