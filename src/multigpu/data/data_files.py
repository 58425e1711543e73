"""Users' data files read through Hugging Face `datasets`, each record turned into an Example (data_formats.py).

--data is a .json / .jsonl / .parquet / .csv / .arrow file; a glob of files of one kind; a directory written by
`Dataset.save_to_disk` or `DatasetDict.save_to_disk`; a dataset snapshot directory laid out as on the Hub
(`data/train-00000-of-00001.parquet`, ...); or `chitchat`, the 7,168 conversations that ship in the PyPI package
chitchat-dataset (4,018 with a reply, the ones read). Files are read one at a time with datasets' streaming
readers, so that a bad record is named by its file and its 1-based number in that file, and a streamed read
holds one batch of rows at a time; a save_to_disk directory is memory-mapped by `load_from_disk`. Reading into
memory is the streamed read collected, so both give the same examples.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multigpu.core.errors import UsageError, shown_path
from multigpu.data import chitchat, data_readers
from multigpu.data.data_formats import (
    FORMATS,
    Convert,
    Example,
    Messages,
    Record,
    Resolved,
    check_options,
    converter,
    resolve,
)
from multigpu.data.data_readers import Source, flag

__all__ = ["FORMATS", "Example", "Messages", "Records", "Source", "check", "fingerprint", "locate", "read"]

READERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
KINDS = ".json, .jsonl, .parquet, .csv or .arrow"
FINGERPRINT_VERSION = 1  # bump when what a record becomes changes, so that cached tokens are rebuilt
# datasets logs a reader's failure before raising it; the error is said once, rephrased, by data_readers.
logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)


@dataclass
class Records:
    kind: str  # "text" or "chat" (chat covers chat, alpaca, sharegpt and prompt-completion: all become Messages)
    data_format: str  # the resolved format, never "auto"
    source: str  # what to print: the path, glob or directory, and the split
    examples: Iterable[tuple[str, Example]]  # (where: "FILE record N", example); a list, or a one-pass iterator


def check(spec: str, split: str | None, data_format: str, column: str | None) -> None:
    """Cheap, before any process starts: the data is there and of a supported kind, the split exists, and the
    first record's columns fit --data-format and --data-column."""
    check_options(data_format, column)
    source = locate(spec, split)
    if source.reader == "chitchat":
        chitchat.check_options(data_format, column)
    else:
        _resolve(source, data_format, column)


def read(
    spec: str,
    split: str | None = None,
    data_format: str = "auto",
    column: str | None = None,
    streaming: bool = False,
    skip: int = 0,
) -> Records:
    """The records of `spec` as Examples, from the one after the first `skip` on. In memory, examples is a list
    (every record read and checked here); streaming, a one-pass iterator that reads and checks as it goes.
    Bad data raises UsageError: one sentence naming the file, the record and what was expected."""
    check_options(data_format, column)
    if skip < 0:
        raise UsageError(f"Records to skip must be >= 0, not {skip}.")
    source = locate(spec, split)
    if source.reader == "chitchat":
        chitchat.check_options(data_format, column)
        conversations, shown = chitchat.conversations()
        return Records("chat", "chat", shown, _from(conversations, skip, streaming))
    resolved = _resolve(source, data_format, column)
    examples = _examples(source, data_format, column, resolved, skip)
    return Records("text" if resolved[0] == "text" else "chat", resolved[0], str(source), _from(examples, 0, streaming))


def _from(examples: Iterable[tuple[str, Example]], skip: int, streaming: bool) -> Iterable[tuple[str, Example]]:
    """A list, or (streaming) a one-pass iterator, of the examples after the first `skip`."""
    rest = itertools.islice(examples, skip, None)
    return rest if streaming else list(rest)


def fingerprint(spec: str, split: str | None, data_format: str, column: str | None) -> bytes:
    """What the token cache is keyed on: the settings, and the name kind and contents of every file read (not
    its path, so that a moved copy keys alike)."""
    source = locate(spec, split)
    digest = hashlib.sha256(f"data_files {FINGERPRINT_VERSION} {source.split} {data_format} {column}".encode())
    for path in source.files:
        digest.update(path.suffix.encode() + b"\0" + _file_digest(path))
    return digest.digest()


def locate(spec: str, split: str | None = None) -> Source:
    """The files behind --data and --data-split, from their names and metadata alone (no record is read)."""
    if spec == "chitchat":
        return Source(spec, _pick(["train"], split, spec), "chitchat", (chitchat.path(),))
    if glob.has_magic(spec):
        return _globbed(spec, split)
    path = Path(spec)
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError as error:  # a name longer than the file system takes, a loop of links, ...
        shown = shown_path(spec)
        raise UsageError(f"{flag()} {shown} cannot be looked up ({error.strerror}); pass another path.") from None
    if is_dir:
        return _directory(path, split)
    if not is_file:
        raise UsageError(f"{flag()} {spec} does not exist; pass a {KINDS} file, a glob or a data set's directory.")
    return Source(spec, _pick(["train"], split, spec), _reader(path), (_nonempty(path),))


def _globbed(spec: str, split: str | None) -> Source:
    files = sorted(Path(name) for name in glob.glob(spec, recursive=True) if Path(name).is_file())
    if not files:
        raise UsageError(f"{flag()} {spec} matches no file; check the pattern (quote it, so that the shell leaves it).")
    kinds = sorted({path.suffix for path in files})
    if len(kinds) > 1:
        raise UsageError(
            f"{flag()} {spec} matches files of {len(kinds)} kinds ({', '.join(kinds)}); narrow the pattern to one kind."
        )
    reader = _reader(files[0])
    return Source(spec, _pick(["train"], split, spec), reader, tuple(_nonempty(path) for path in files))


def _directory(path: Path, split: str | None) -> Source:
    if (path / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: a save_to_disk directory per split
        splits = read_json_object(path / "dataset_dict.json").get("splits") or []
        chosen = _pick(splits, split, str(path))
        return _saved(path / chosen, str(path), chosen)
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():  # Dataset.save_to_disk
        named = read_json_object(path / "state.json").get("_split") or "train"
        return _saved(path, str(path), _pick([named], split, str(path)))
    try:
        builder = data_readers.offline_datasets().load_dataset_builder(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(
            f"{flag()} {path} is a directory that datasets cannot read ({data_readers.first_line(error)}); pass one "
            f"written by save_to_disk or holding {KINDS} files."
        ) from None
    if builder.name not in READERS.values():
        raise UsageError(
            f"{flag()} {path} is no data set multigpu reads (datasets' guess for it is its {builder.name!r} builder); "
            f"pass a directory written by save_to_disk or holding {KINDS} files."
        )
    splits = builder.config.data_files or {}
    chosen = _pick(list(splits), split, str(path))
    return Source(str(path), chosen, builder.name, tuple(_nonempty(Path(name)) for name in splits[chosen]))


def _saved(directory: Path, spec: str, split: str) -> Source:
    if not read_json_object(directory / "state.json").get("_data_files"):  # an empty Dataset saves no .arrow file
        raise UsageError(f"{flag()} {directory} has no records; pass data with records in it.")
    files = tuple(sorted(file for file in directory.rglob("*") if file.is_file()))
    return Source(spec, split, "saved", files, directory)


def _pick(splits: list[str], split: str | None, spec: str) -> str:
    """--data-split, or "train", or the only split."""
    if split is not None and split not in splits:
        raise UsageError(f"{flag()} {spec} has no split {split} (it has {', '.join(splits)}); pass one of those.")
    if split is None and "train" not in splits and len(splits) != 1:
        raise UsageError(f"{flag()} {spec} has the splits {', '.join(splits)} and none is train; pass --data-split.")
    return split if split is not None else "train" if "train" in splits else splits[0]


def _reader(path: Path) -> str:
    if path.suffix not in READERS:
        raise UsageError(f"{flag()} {path} is a {path.suffix or 'suffix-less'} file; pass a {KINDS} file.")
    return READERS[path.suffix]


def _nonempty(path: Path) -> Path:
    if path.stat().st_size == 0:
        raise UsageError(f"{flag()} {path} is empty; pass a file with records in it.")
    return path


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"{path} is not valid JSON ({data_readers.first_line(error)}); write it again.") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} is not a JSON object; write it again with save_to_disk.")
    return data


def _resolve(source: Source, data_format: str, column: str | None) -> Resolved:
    """(format, column) from the first record."""
    if source.reader == "saved":
        where, first = next(iter(data_readers.saved_rows(source, 0)), (str(source.directory), None))
    else:
        where, first = str(source.files[0]), next(iter(data_readers.file_rows(source.reader, source.files[0])), None)
    if first is None:
        raise UsageError(f"{flag()} {where} has no records; pass data with records in it.")
    return resolve(first, data_format, column, where.rsplit(" record ", 1)[0])


def _examples(
    source: Source, data_format: str, column: str | None, resolved: Resolved, skip: int
) -> Iterator[tuple[str, Example]]:
    """(where, example) of every record from the one after the first `skip` on."""
    convert = converter(*resolved)
    if source.reader == "saved":
        for where, record in data_readers.saved_rows(source, skip):
            yield where, convert(record, where)
        return
    for path in source.files:
        skipped, skip = data_readers.whole_file_skip(source.reader, path, skip)
        if skipped:
            continue
        count = 0
        for count, record in enumerate(data_readers.file_rows(source.reader, path), 1):
            if count == 1 and path != source.files[0]:
                _check_same_format(source, path, resolve(record, data_format, column, str(path)), resolved)
            if count > skip:
                yield _converted(source.reader, path, count, record, convert)
        if count == 0:
            raise UsageError(f"{flag()} {path} has no records; pass a file with records in it.")
        skip = max(0, skip - count)


def _converted(reader: str, path: Path, number: int, record: Record, convert: Convert) -> tuple[str, Example]:
    where = f"{path} record {number}"
    try:
        return where, convert(record, where)
    except UsageError:
        if reader == "json":  # a column of mixed types garbles the strings that look like JSON: find the true culprit
            data_readers.first_unfit_json_record(path, convert)
        raise


def _check_same_format(source: Source, path: Path, found: Resolved, first: Resolved) -> None:
    if found != first:
        shown = [f"{name} in column {column}" if column else name for name, column in (found, first)]
        raise UsageError(
            f"{flag()} {path} holds {shown[0]} records, unlike {source.files[0]} ({shown[1]}); read files of one "
            "format together."
        )


def _file_digest(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.digest()
