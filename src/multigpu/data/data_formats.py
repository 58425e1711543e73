"""The formats of finetuning records: which one a data set is in, and each record turned into an Example.

An Example is a text document (format text) or a conversation, Messages ending with the assistant's answer
(formats chat, alpaca, sharegpt and prompt-completion, all turned into Messages). A record is one row as
`datasets` yields it: a dict from column to value, None where a row lacks a column the others have.

    chat               {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}
    sharegpt           {"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...]}
                       (roles user/assistant and role/content keys too; an optional "system" column)
    alpaca             {"instruction": str, "input": str (optional), "output": str, "system": str (optional)}
    prompt-completion  {"prompt": str, "completion": str}, or both as lists of messages (the conversational form)
    text               {"text": str}, or any one string column
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from multigpu.core.errors import UsageError

Messages = list[dict[str, str]]
Example = str | Messages
Record = Mapping[str, Any]
Convert = Callable[[Record, str], Example]  # (record, where it is: "FILE record N") -> its Example
Resolved = tuple[str, str | None]  # (format, the column its text or messages are in; None where fixed columns)

FORMATS = ("auto", "text", "chat", "alpaca", "sharegpt", "prompt-completion")
COLUMN_FORMATS = ("text", "chat", "sharegpt")  # the formats whose records live in one column, which --data-column names
DEFAULT_COLUMN = {"chat": "messages", "sharegpt": "conversations"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
ROLES = ("system", "user", "assistant")


def check_options(data_format: str, column: str | None) -> None:
    """That --data-format is one of FORMATS and --data-column goes with a format that reads one column."""
    if data_format not in FORMATS:
        raise UsageError(f"--data-format {data_format} is not one of {', '.join(FORMATS)}; pass one of them.")
    if column is not None and data_format not in ("auto", *COLUMN_FORMATS):
        raise UsageError(
            f"--data-column names the column of the {', '.join(COLUMN_FORMATS)} formats, but --data-format "
            f"{data_format} reads fixed columns; leave --data-column out."
        )
    if column == "":
        raise UsageError("--data-column is empty; pass the name of the column that holds the text or the messages.")


def resolve(first: Record, data_format: str, column: str | None, source: str) -> Resolved:
    """(format, column) for records like `first` (the first record of `source`): the format that --data-format
    names or that the columns show, and the column the text or messages are in (None for alpaca and
    prompt-completion, whose columns are fixed)."""
    check_options(data_format, column)
    columns = list(first)
    if column is not None and column not in first:
        raise UsageError(
            f"{source} has no column {column} (it has {_names(columns)}); pass one of those to --data-column."
        )
    if data_format == "auto":
        data_format = _detect(first, column, source)
    if data_format in ("alpaca", "prompt-completion"):
        needed = ("instruction", "output") if data_format == "alpaca" else ("prompt", "completion")
        missing = [name for name in needed if name not in first]
        if missing:
            raise UsageError(
                f"{source} has no column {' or '.join(missing)}, which --data-format {data_format} reads (it has "
                f"{_names(columns)}); pass the format these columns are in."
            )
        return data_format, None
    if column is None:
        column = DEFAULT_COLUMN.get(data_format) or _text_column(first, source)
        if column not in first:
            raise UsageError(
                f"{source} has no column {column}, which --data-format {data_format} reads (it has {_names(columns)}); "
                "pass the one that holds the conversations to --data-column."
            )
    return data_format, column


def _detect(first: Record, column: str | None, source: str) -> str:
    if column is not None:  # the column's value shows the format
        value = first[column]
        if isinstance(value, str):
            return "text"
        if isinstance(value, list) and value and isinstance(value[0], Mapping):
            return "sharegpt" if "from" in value[0] else "chat"
        raise UsageError(
            f"{source} column {column} holds neither text nor a list of messages; pass --data-format and the column "
            "that holds the text or the messages."
        )
    if "messages" in first:
        return "chat"
    if "conversations" in first:
        return "sharegpt"
    if "instruction" in first and "output" in first:
        return "alpaca"
    if "prompt" in first and "completion" in first:
        return "prompt-completion"
    strings = [name for name, value in first.items() if isinstance(value, str)]
    if "text" in first or len(strings) == 1:
        return "text"
    raise UsageError(
        f"{source} has columns {_names(list(first))}, which fit no format known by their names; pass --data-format "
        f"({', '.join(FORMATS[1:])}) and --data-column for the column that holds the text or the messages."
    )


def _text_column(first: Record, source: str) -> str:
    if "text" in first:
        return "text"
    strings = [name for name, value in first.items() if isinstance(value, str)]
    if len(strings) != 1:
        raise UsageError(
            f"{source} has no column text and {len(strings)} columns of strings ({_names(strings)}); pass the one "
            "that holds the text to --data-column."
        )
    return strings[0]


def converter(data_format: str, column: str | None) -> Convert:
    """The function that turns a record of a resolved format into its Example, or says why it cannot."""
    if data_format == "text":
        return lambda record, where: _text(record, column or "text", where)
    if data_format == "chat":
        name = column or "messages"
        return lambda record, where: conversation(record.get(name), where, f'"{name}"')
    if data_format == "sharegpt":
        return lambda record, where: _sharegpt(record, column or "conversations", where)
    if data_format == "alpaca":
        return _alpaca
    if data_format == "prompt-completion":
        return _prompt_completion
    raise UsageError(f"--data-format {data_format} is not one of {', '.join(FORMATS[1:])}; pass one of them.")


def _text(record: Record, column: str, where: str) -> str:
    value = record.get(column)
    if not isinstance(value, str):
        raise UsageError(f'{where} has {_found(value)} in "{column}", where the text format expects a string; fix it.')
    return value


def conversation(value: Any, where: str, what: str = '"messages"') -> Messages:
    """`value` as Messages: a list of {"role", "content"} dicts with known roles, a system message first if any,
    then a user's, and the assistant's (non-empty) answer last."""
    if not isinstance(value, list) or not value:
        raise UsageError(
            f'{where} has {_found(value)} in {what}, where a non-empty list of {{"role", "content"}} messages is '
            "expected; fix it."
        )
    messages = []
    for number, message in enumerate(value, 1):
        if not isinstance(message, Mapping):
            raise UsageError(
                f'{where} message {number} is {_found(message)}, where a {{"role", "content"}} object belongs; fix it.'
            )
        role, content = message.get("role"), message.get("content")
        for key, found in (("role", role), ("content", content)):
            if not isinstance(found, str):
                raise UsageError(
                    f'{where} message {number} has {_found(found)} as "{key}", where a string belongs; fix it.'
                )
        if role not in ROLES:
            raise UsageError(f"{where} message {number} has the role {role!r}; use one of {', '.join(ROLES)}.")
        if role == "system" and number > 1:
            raise UsageError(f"{where} message {number} is a system message, which only the first can be; move it.")
        messages.append({"role": role, "content": content})
    _check_turns(messages, where)
    return messages


def _check_turns(messages: Messages, where: str) -> None:
    asked = messages[1:] if messages[0]["role"] == "system" else messages
    if not asked or asked[0]["role"] != "user":
        raise UsageError(f"{where} does not open with a user's message (after the system's, if any); add one.")
    if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
        raise UsageError(f"{where} does not end with the assistant's answer, which is what is learnt; add one.")


def _sharegpt(record: Record, column: str, where: str) -> Messages:
    value = record.get(column)
    if not isinstance(value, list) or not value:
        raise UsageError(
            f'{where} has {_found(value)} in "{column}", where a non-empty list of {{"from", "value"}} turns is '
            "expected; fix it."
        )
    messages = []
    for number, turn in enumerate(value, 1):
        if not isinstance(turn, Mapping):
            raise UsageError(
                f'{where} turn {number} is {_found(turn)}, where a {{"from", "value"}} object belongs; fix it.'
            )
        speaker, text = turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))
        if speaker not in SHAREGPT_ROLES or not isinstance(text, str):
            raise UsageError(
                f'{where} turn {number} has "from" {speaker!r} and {_found(text)} as "value", where "from" is one of '
                f'{", ".join(SHAREGPT_ROLES)} and "value" a string; fix it.'
            )
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": text})
    return conversation(_with_system(messages, record.get("system"), where), where, f'"{column}"')


def _alpaca(record: Record, where: str) -> Messages:
    instruction, extra, output = (record.get(name) for name in ("instruction", "input", "output"))
    for name, value in (("instruction", instruction), ("output", output)):
        if not isinstance(value, str) or not value.strip():
            raise UsageError(f'{where} has {_found(value)} in "{name}", where the alpaca format expects text; fix it.')
    if extra is not None and not isinstance(extra, str):
        raise UsageError(f'{where} has {_found(extra)} in "input", where alpaca expects a string or none; fix it.')
    prompt = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    user = [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return _with_system(user, record.get("system"), where)


def _prompt_completion(record: Record, where: str) -> Messages:
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):  # the conversational form: lists of messages
        return conversation([*prompt, *completion], where, '"prompt" and "completion"')
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str) or not value.strip():
            raise UsageError(
                f'{where} has {_found(value)} in "{name}", where the prompt-completion format expects text (or both '
                "prompt and completion as lists of messages); fix it."
            )
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def _with_system(messages: Messages, system: Any, where: str) -> Messages:
    """A "system" column's prompt put first, unless empty or the conversation opens with its own."""
    if system is None or system == "":
        return messages
    if not isinstance(system, str):
        raise UsageError(f'{where} has {_found(system)} in "system", where a string or none is expected; fix it.')
    if messages and messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}, *messages]


def _found(value: Any) -> str:
    """What a message says was found: none, an empty text or list, or the value's type."""
    if value is None:
        return "nothing"
    if isinstance(value, str | list) and not (value.strip() if isinstance(value, str) else value):
        return f"an empty {'text' if isinstance(value, str) else 'list'}"
    names = {str: "a string", list: "a list", dict: "an object", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), f"a {type(value).__name__}")


def _names(columns: list[str]) -> str:
    return ", ".join(columns) if columns else "no columns"
