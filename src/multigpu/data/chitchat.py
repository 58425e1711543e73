"""`--data chitchat`: the 7,168 conversations of the Chit Chat Challenge, which ship as one JSON file in the PyPI
package chitchat-dataset (read as a file, never imported). 3,150 of them are one speaker's unanswered opening;
the other 4,018 become Messages: the first speaker is the user, the other the assistant, a turn's messages are
joined by newlines, and a last, unanswered user turn is dropped, so that each ends with the assistant's turn.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

from multigpu.core.errors import UsageError
from multigpu.data.data_formats import Messages


def path() -> Path:
    """chitchat-dataset's dataset.json: {conversation id: {"messages": [[{"sender", "text", ...}, ...], ...]}}."""
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "--data chitchat ships in the chitchat-dataset package: run `pip install --no-deps chitchat-dataset`."
        )
    found = Path(next(iter(spec.submodule_search_locations))) / "dataset.json"
    if not found.is_file():
        raise UsageError(f"{found} is missing; reinstall chitchat-dataset (pip install --no-deps --force-reinstall).")
    return found


def check_options(data_format: str, column: str | None) -> None:
    if data_format not in ("auto", "chat") or column is not None:
        raise UsageError(
            "--data chitchat is conversations (--data-format chat); leave --data-format and --data-column out."
        )


def conversations() -> tuple[list[tuple[str, Messages]], str]:
    """((where, messages) of each conversation with a reply, a description to print). "where" numbers the record
    among all of the file's conversations, from 1."""
    file = path()
    records = json.loads(file.read_text("utf-8")).values()
    found = [(f"{file} record {number}", messages_of(record["messages"])) for number, record in enumerate(records, 1)]
    kept = [(where, messages) for where, messages in found if messages]
    version = importlib.metadata.version("chitchat-dataset")
    shown = f"chitchat (chitchat-dataset {version}: the {len(kept):,} of its {len(found):,} conversations with a reply)"
    return kept, shown


def messages_of(turns: list[list[dict[str, Any]]]) -> Messages:
    """One conversation's turns (each a list of one speaker's messages) as Messages; [] if no one replied."""
    messages: Messages = []
    first = turns[0][0]["sender"] if turns and turns[0] else None
    for turn in turns:
        if not turn:
            continue
        role = "user" if turn[0]["sender"] == first else "assistant"
        text = "\n".join(message["text"] for message in turn)
        if messages and messages[-1]["role"] == role:  # one speaker's turns in a row are one turn
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": role, "content": text})
    if messages and messages[-1]["role"] == "user":
        messages.pop()
    return messages if len(messages) >= 2 else []
