"""Examples into token documents: the ids a model reads and which of them it learns to predict.

A text example is its tokens and EOS, cut into documents of at most seq_len + 1 tokens: every token but a
document's first is a target. A conversation goes through the tokenizer's chat template and is cut into pieces,
each either learnt (an assistant's answer, through its end-of-turn token) or not (everything else); every
assistant turn is learnt, or only the last (`learn_turns`). Pieces are tokenised apart, so each answer starts
exactly where generation from its prompt starts. A conversation longer than seq_len + 1 tokens loses its end
(`too_long` truncate; what lies beyond is never rendered) or is left out (drop); either way it is counted, as is
one with no answer token left.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from multigpu.core.cache import cache_root
from multigpu.core.child_processes import children_leave_stops_to_parent
from multigpu.core.errors import UsageError
from multigpu.data import data_readers

FORMAT_VERSION = 2  # bump when the cached layout or the tokenisation changes, so old files are not read
PARALLEL_FROM = 2_000  # records: below this, starting worker processes costs more than it saves

#: What became of a record, in the order the counts are reported.
KEPT, TRUNCATED, DROPPED_LONG, DROPPED_NO_ANSWER = range(4)


def tokenise_batch(
    batch: dict[str, list[Any]], tokenizer: Any, seq_len: int, learn_turns: str, too_long: str
) -> dict[str, list[Any]]:
    """`datasets.map(batched=True)`'s function: columns where + text (or messages) in; documents out, each with
    its ids, its target mask (1: learnt) and the record's fate."""
    if "text" in batch:
        return _text_documents(batch["text"], tokenizer, seq_len)
    out: dict[str, list[Any]] = {"ids": [], "mask": [], "fate": []}
    for messages, where in zip(batch["messages"], batch["where"], strict=True):
        tokens, mask = [], []
        for text, learnt in chat_pieces(messages, tokenizer, learn_turns, where):
            piece = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            tokens += piece
            mask += [int(learnt)] * len(piece)
            if len(tokens) > seq_len + 1:  # the rest would be cut: not rendered (long chats render slowly)
                break
        fate = _fate(tokens, mask, seq_len, too_long)
        kept = fate in (KEPT, TRUNCATED)
        out["ids"].append(tokens[: seq_len + 1] if kept else [])
        out["mask"].append([0, *mask[1 : seq_len + 1]] if kept else [])  # a first token has nothing to predict it
        out["fate"].append(fate)
    return out


def _fate(tokens: list[int], mask: list[int], seq_len: int, too_long: str) -> int:
    """What becomes of a record of len(tokens) tokens when seq_len + 1 fit."""
    if len(tokens) > seq_len + 1 and too_long == "drop":
        return DROPPED_LONG
    if not any(mask[1 : seq_len + 1]):
        return DROPPED_NO_ANSWER
    return TRUNCATED if len(tokens) > seq_len + 1 else KEPT


def _text_documents(texts: Sequence[str], tokenizer: Any, seq_len: int) -> dict[str, list[Any]]:
    ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]  # verbose: length warning
    out: dict[str, list[Any]] = {"ids": [], "mask": [], "fate": []}
    for doc in ids:
        doc = [*doc, tokenizer.eos_token_id]
        for start in range(0, len(doc) - 1, seq_len + 1):  # a last piece of one token would teach nothing
            piece = doc[start : start + seq_len + 1]
            out["ids"].append(piece)
            out["mask"].append([0] + [1] * (len(piece) - 1))
            out["fate"].append(KEPT)
    return out


def chat_pieces(
    messages: list[dict[str, str]], tokenizer: Any, learn_turns: str, where: str
) -> Iterator[tuple[str, bool]]:
    """The rendered conversation as (text, learnt) pieces, end to end, rendered as they are asked for."""
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers or answers[0] == 0:
        raise UsageError(f"{where}: a conversation needs a prompt before the assistant's first answer; add one.")
    done, eos = "", tokenizer.eos_token
    for i in answers if learn_turns == "all" else answers[-1:]:
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise UsageError(
                f"The chat template does not render {where} as prompt then answer, turn by turn; use another model "
                "or --learn-turns last."
            )
        answer = full[len(prompt) :]
        if eos and eos in answer:  # after the end-of-turn token comes a newline, which teaches nothing
            answer = answer[: answer.rindex(eos) + len(eos)]
        if len(prompt) > len(done):
            yield prompt[len(done) :], False
        if answer:
            yield answer, True
        done = prompt + answer


def cached_tokens(
    identity: bytes, tokenizer: Any, settings: Any, read: Callable[[], Any]
) -> tuple[dict[str, Any], Path, bool]:
    """(payload, its cache file, whether it was read from the cache): `read()`'s records tokenised, by one process
    while any others wait, keyed by the data's identity, the tokenizer and the settings the tokens depend on."""
    path = token_cache_dir() / f"{cache_key(identity, tokenizer, settings)}.pt"
    payload, from_cache = _cached(path, lambda: _learnable(tokenise_records(read(), tokenizer, settings)))
    return payload, path, from_cache


def _learnable(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload, unless no record has a token to learn: such data is refused before it is cached. (A streamed
    window may hold none, where its few records were left out: the stream goes on with the next.)"""
    if len(payload["offsets"]) == 1:
        raise UsageError(f"{payload['source']} has no record with a token to learn within --seq-len; raise --seq-len.")
    return payload


def tokenise_records(records: Any, tokenizer: Any, settings: Any, parallel: bool = True) -> dict[str, Any]:
    """The cache payload: every document's ids end to end, where each starts, which tokens are targets, and what
    became of each record. A parallel `datasets.map` on many records (the chat template is rendered in Python)."""
    datasets = data_readers.offline_datasets()

    column = "text" if records.kind == "text" else "messages"
    items = list(records.examples)
    if not items:
        raise UsageError(f"{records.source} has no records; pass data with at least one.")
    columns = {"where": [where for where, _ in items], column: [example for _, example in items]}
    cutting = {"tokenizer": tokenizer, "seq_len": settings.seq_len, "learn_turns": settings.learn_turns,
               "too_long": settings.too_long}  # fmt: skip
    if not parallel or len(items) < PARALLEL_FROM:
        return payload_of(datasets.Dataset.from_dict(tokenise_batch(columns, **cutting)), records)
    table = datasets.Dataset.from_dict(columns)
    with children_leave_stops_to_parent():  # Ctrl-C: one line from this process, none from its pool
        documents = table.map(
            tokenise_batch,
            batched=True,
            num_proc=min(os.cpu_count() or 1, 8),
            remove_columns=table.column_names,
            fn_kwargs=cutting,
            desc=f"tokenising {records.source}",
            keep_in_memory=True,
        )
    return payload_of(documents, records)


def payload_of(documents: Any, records: Any) -> dict[str, Any]:
    ids, mask = (documents.data.column(name).combine_chunks() for name in ("ids", "mask"))
    lengths = torch.from_numpy(ids.value_lengths().to_numpy(zero_copy_only=False).astype("int64"))
    lengths = lengths[lengths > 0]  # a record left out holds no tokens, and flatten skips it
    fates = torch.bincount(torch.tensor(documents["fate"], dtype=torch.long), minlength=4)
    # Records all left out (a streamed window may be so) make lists of no type, whose values numpy must copy.
    tokens, targets = (column.flatten().to_numpy(zero_copy_only=False) for column in (ids, mask))
    return {
        "format": FORMAT_VERSION,
        "kind": records.kind,
        "source": records.source,
        "tokens": torch.from_numpy(tokens.astype("int32")),  # half of int64; any vocabulary fits
        "mask": torch.from_numpy(targets.astype("bool")),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "fates": fates,
    }


def token_cache_dir() -> Path:
    return Path(os.environ.get("MULTIGPU_TOKEN_CACHE") or cache_root() / "tokens")


def cache_key(identity: bytes, tokenizer: Any, settings: Any) -> str:
    """sha256 of what the tokens depend on: the data's identity, the tokenizer's contents (not its path), the
    settings that cut and mask the tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else tokenizer.name_or_path
    vocab = vocab[max(vocab.find('"added_tokens"'), 0) :]  # skips padding/truncation state, which calls change
    cut = f"{settings.seq_len} {settings.learn_turns} {settings.too_long}"
    digest = hashlib.sha256()
    for part in (f"lm_tokens {FORMAT_VERSION} {cut} {tokenizer.eos_token}", tokenizer.chat_template, vocab):
        digest.update(hashlib.sha256(str(part).encode()).digest())
    digest.update(hashlib.sha256(identity).digest())
    return digest.hexdigest()


def _cached(path: Path, build: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """Reads the cache, or builds it under an exclusive flock so that concurrent processes tokenise only once.

    Waiting on a file lock, unlike on a collective, has no timeout, and any processes share it whatever their
    world size. The kernel drops the lock when its holder dies, so a crash leaves no stale lock.
    """
    payload = _read(path)
    if payload is not None:
        return payload, True
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        payload = _read(path)  # built by another process while this one waited
        if payload is not None:
            return payload, True
        payload = build()
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        try:
            torch.save(payload, partial)
            os.replace(partial, path)  # so readers that skip the lock see the whole file or none
        finally:
            partial.unlink(missing_ok=True)
    return payload, False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Within it, this process holds the exclusive flock of the file `path`, which it removes on the way out (a stop
    or an error included), so that no lock file stays behind.

    The file is removed before the lock is released: a process that waited on it then holds a lock on a file no
    longer at `path`, sees that, and locks the file there now instead.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            here = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # removed by the holder this process waited for
            here = False
        except BaseException:
            os.close(fd)
            raise
        if here:
            break
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)  # releases the lock


def _read(path: Path) -> dict[str, Any] | None:
    try:
        payload = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):  # absent or unreadable: (re)build it
        return None
    return payload if payload.get("format") == FORMAT_VERSION else None
