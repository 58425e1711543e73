"""Rows of one data file through `datasets`' streaming readers, and a reader's failure as one sentence that names
the file and, for JSON and CSV, the line at fault (found by reading the file again, only once it failed)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import glob
import json
import mmap
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multigpu.core.errors import UsageError
from multigpu.data.data_formats import Convert, Record

BATCH = 1000  # rows read at a time: enough to amortise datasets' per-batch cost, little memory
READS_AS = {"json": "JSON", "parquet": "Parquet", "csv": "CSV", "arrow": "Arrow"}


_FLAG = contextvars.ContextVar("data_flag", default="--data")


def flag() -> str:
    """The flag whose data is being read, for the messages about it: --data, or --eval-data inside `reading`."""
    return _FLAG.get()


@contextlib.contextmanager
def reading(name: str) -> Iterator[None]:
    """Within it, messages about the data name the flag `name` (--eval-data: the same readers serve both)."""
    token = _FLAG.set(name)
    try:
        yield
    finally:
        _FLAG.reset(token)


@dataclass(frozen=True)
class Source:
    """Where the records of one --data and --data-split are."""

    spec: str
    split: str
    reader: str  # datasets' builder (json, parquet, csv, arrow); "saved" for save_to_disk; "chitchat"
    files: tuple[Path, ...]  # every file read, in reading order (for `saved`, the directory's files)
    directory: Path | None = None  # the save_to_disk directory of the split

    def __str__(self) -> str:
        count = f"{len(self.files)} files, " if glob.has_magic(self.spec) else ""
        return f"{self.spec} ({count}split {self.split})"


def offline_datasets() -> Any:
    """The `datasets` module, told never to reach the network: the data is local, and each load_dataset would
    otherwise tell the Hub it ran (a request that waits seconds for its timeout on a machine without network)."""
    import datasets  # about 1 s to import: only once data is read

    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    datasets.config.HF_HUB_OFFLINE = True
    return datasets


#: Lists or objects opened one inside the next (object keys between them allowed), more than pyarrow's JSON reader
#: follows: at about 20,000 levels it overflows its stack and kills the process, with no error to turn into a sentence.
TOO_DEEP = re.compile(rb'(?:[\[{]\s*(?:"[^"\\]{0,64}"\s*:\s*)?){5000}')


def file_rows(reader: str, path: Path) -> Iterator[Record]:
    """The rows of one file, as `datasets` reads it a batch at a time; CSV cells all as strings, as written
    (pandas would make "42" a number and "NA" or an empty cell a missing value)."""
    datasets = offline_datasets()
    if reader == "json":
        check_depth(path)
        check_surrogates(path)
    try:
        options = _csv_options(path) if reader == "csv" else {}
        dataset = datasets.load_dataset(reader, data_files=[str(path)], split="train", streaming=True, **options)
        batches = dataset.iter(batch_size=BATCH)
    except Exception as error:  # each reader raises its own kinds: all become one sentence
        raise unreadable(reader, path, error) from None
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as error:
            raise unreadable(reader, path, error) from None
        yield from rows_of(batch)


@functools.cache
def _checked_depth(path: Path, size: int, modified: int) -> None:
    """Refuses JSON nested deeper than pyarrow can read, naming the line: only a line of 10,000 bytes or more can
    nest 5,000 deep, and only such lines are searched (once per file and version in a process)."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start, line = 0, 1
        while start < size:
            end = data.find(b"\n", start)
            end = size if end < 0 else end
            if end - start >= 10_000 and TOO_DEEP.search(data, start, end) is not None:
                raise UsageError(
                    f"{flag()} {path} line {line} nests lists or objects more than 5,000 deep, deeper than the JSON "
                    "reader can follow; fix that line."
                )
            start, line = end + 1, line + 1


def check_depth(path: Path) -> None:
    stat = path.stat()
    if stat.st_size:  # an empty file has nothing to map; the reader says it is empty
        _checked_depth(path, stat.st_size, stat.st_mtime_ns)


#: A UTF-16 surrogate written as a JSON escape: a pair's half, or a lone one, which is no character.
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


@functools.cache
def _checked_surrogates(path: Path, size: int, modified: int) -> None:
    """Refuses a lone surrogate in a JSON file, naming the record: pyarrow refuses one in a line of .jsonl, but
    datasets reads a .json list with Python's json, which keeps it, to fail in the tokenizer or train on it. Only a
    file that holds such an escape is parsed (once per file and version in a process)."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if SURROGATE.search(data) is None:
            return
    try:
        document = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return  # not one JSON document (a .jsonl: its reader refuses a lone surrogate), or the reader says why
    for number, record in enumerate(document if isinstance(document, list) else [document], 1):
        if half := _lone_surrogate(record):
            raise UsageError(f"{flag()} {path} record {number} {half}")


def check_surrogates(path: Path) -> None:
    stat = path.stat()
    if stat.st_size:  # an empty file has nothing to map; the reader says it is empty
        _checked_surrogates(path, stat.st_size, stat.st_mtime_ns)


def rows_of(batch: dict[str, list[Any]]) -> Iterator[Record]:
    """A batch's rows: datasets yields batches as columns, 5 to 10 times faster than row by row."""
    return (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True))


def _csv_options(path: Path) -> dict[str, Any]:
    import pandas

    datasets = offline_datasets()
    columns = pandas.read_csv(path, nrows=0).columns
    features = datasets.Features({str(name): datasets.Value("string") for name in columns})
    return {"features": features, "na_filter": False}


def saved_rows(source: Source, skip: int) -> Iterator[tuple[str, Record]]:
    """(where, row) of a save_to_disk directory's rows after the first `skip`, memory-mapped, not loaded."""
    datasets = offline_datasets()
    try:
        dataset = datasets.load_from_disk(str(source.directory))
    except Exception as error:
        raise UsageError(
            f"{flag()} {source.directory} cannot be read by datasets.load_from_disk ({first_line(error)}); write it "
            "again with save_to_disk."
        ) from None
    if len(dataset) == 0:
        raise UsageError(f"{flag()} {source.directory} has no records; pass data with records in it.")
    if skip >= len(dataset):
        return
    rest = dataset.select(range(skip, len(dataset))) if skip else dataset  # a contiguous range: a slice, no copy
    rows = (row for batch in rest.iter(batch_size=BATCH) for row in rows_of(batch))
    for number, row in enumerate(rows, skip + 1):
        yield f"{source.directory} record {number}", row


def whole_file_skip(reader: str, path: Path, skip: int) -> tuple[bool, int]:
    """(whether all of the file is skipped, the skip left after it): a Parquet file's rows are counted from its
    metadata, so a resumed stream passes over its read files unread; other kinds are read to be skipped."""
    if reader != "parquet" or skip == 0:
        return False, skip
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.ParquetFile(path).metadata.num_rows
    except Exception as error:
        raise unreadable(reader, path, error) from None
    return (True, skip - rows) if 0 < rows <= skip else (False, skip)


def first_unfit_json_record(path: Path, convert: Convert) -> None:
    """Raises the sentence for the first record that `convert` refuses, each read with Python's json as written.

    Where a column holds values of several types, datasets stores it as JSON text and decodes every value, so
    that a string such as "4." comes back as the number 4.0 and a record that fits looks as if it did not.
    Called only once a record was refused, to name the one that is at fault."""
    text = path.read_text("utf-8")
    try:
        document = json.loads(text)
        records = document if isinstance(document, list) else [document]
    except json.JSONDecodeError:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    for number, record in enumerate(records, 1):
        convert(record, f"{path} record {number}")


def unreadable(reader: str, path: Path, error: BaseException) -> UsageError:
    """A reader's failure as one sentence: the line at fault where one is found, else the reader's own words."""
    problem = _line_at_fault(path, reader)
    if problem:
        return UsageError(f"{flag()} {path} {problem}")
    return UsageError(
        f"{flag()} {path} cannot be read as {READS_AS.get(reader, reader)} ({first_line(error)}); fix the file or "
        "convert it."
    )


def _line_at_fault(path: Path, reader: str) -> str | None:
    """What is wrong and where, in words that follow the file's name; None if nothing is found."""
    with open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return f"line {number} is not UTF-8 ({error.reason} at byte {error.start}); convert the file to UTF-8."
    return _json_at_fault(path) if reader == "json" else None


def _json_at_fault(path: Path) -> str | None:
    text = path.read_text("utf-8")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as whole:
        lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not lines or not _is_object(lines[0][1]):  # one JSON document (a list of records), not a line each
            return f"line {whole.lineno} is not valid JSON ({whole.msg}); fix that line."
        for number, line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                return f"line {number} is not valid JSON ({error.msg}); fix that line."
            if not isinstance(record, dict):
                return f"line {number} is not a JSON object; write one record, an object, a line."
            if half := _lone_surrogate(record):
                return f"line {number} {half}"
        return None
    except RecursionError:
        return "nests lists or objects deeper than Python's JSON reader can follow; flatten the records."
    records = document if isinstance(document, list) else [document]
    for number, record in enumerate(records, 1):  # pyarrow refuses a lone surrogate, which Python's json reads
        if half := _lone_surrogate(record):
            return f"record {number} {half}"
    if isinstance(document, list):
        for number, record in enumerate(document, 1):
            if not isinstance(record, dict):
                return f"record {number} is not a JSON object; write the records as a list of objects."
        return None
    return "holds one JSON object, where a list of records or one record a line is expected; write the records so."


def _lone_surrogate(value: Any) -> str | None:
    """What to say of the first half of a UTF-16 surrogate pair without its other half in `value` (JSON writes one
    as \\ud800), or None: it is no character, and no UTF-8 text (the tokenizer's input) can hold it."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(error.object[error.start])
        return (
            f"holds \\u{code:04x}, half of a UTF-16 surrogate pair without its other half, which is no character; "
            "write the character itself instead."
        )
    return None


def _is_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return line.lstrip().startswith("{") and not line.rstrip().endswith(("{", "[", ","))


def first_line(error: BaseException) -> str:
    """An exception's message, its first line only, cut to 200 characters (or its type, when it has none)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
