"""What the offline trainers (SFT, DPO) check in a user's dataset at construction, before stock's
constructor reads it: errors that say what is wrong and what to do, where stock would end in a
bare ``StopIteration`` or train on something else than the data holds.

* a dataset with no rows (an empty file; conversations without an assistant turn, which
  ``expand_turns`` turns into no sample at all) — stock's ``next(iter(dataset))`` raises a bare
  ``StopIteration``;
* ``tree_shuffle='groups'`` with a streaming (``IterableDataset``) dataset — the grouped sampler
  orders the whole dataset before each epoch;
* a chat template (or tokenizer) that drops what the conversations carry — a tool call the
  template never renders is never trained, while the loss still falls: said once, as a warning
  (the template is the user's choice, and stock trains on it too).
"""

from __future__ import annotations

import inspect
import itertools
import unicodedata
import warnings
from collections.abc import Mapping

#: rows a template is checked on (the check renders each: cheap, and enough to catch a template
#: that never renders a kind of content)
TEMPLATE_CHECK_ROWS = 16


def bound_argument(init, name: str, args: tuple, kwargs: dict, skip: int = 1):
    """The value of ``init``'s argument ``name`` in a call ``init(self, *args, **kwargs)`` (None
    where it is not given)."""
    try:
        bound = inspect.signature(init).bind_partial(*([None] * skip), *args, **kwargs)
    except TypeError:  # stock's constructor will say what is wrong with the call
        return None
    return bound.arguments.get(name)


def checked_train_dataset(trainer_name: str, init, call_args: tuple, kwargs: dict, args):
    """The ``train_dataset`` of a call of stock's constructor ``init``, refused here where it has no
    rows or, with the tree on, where it is streamed under ``tree_shuffle='groups'``."""
    dataset = bound_argument(init, "train_dataset", call_args, kwargs)
    refuse_empty(trainer_name, dataset)
    if args.tree_mode != "off":
        refuse_streaming_groups(trainer_name, dataset, args.tree_shuffle)
    return dataset


def refuse_empty(trainer_name: str, dataset, what: str = "train_dataset") -> None:
    """A dataset with no rows gets an error that says so (and the likely cause), not stock's bare
    ``StopIteration``."""
    if dataset is None or isinstance(dataset, Mapping):
        return
    try:
        empty = len(dataset) == 0
    except TypeError:  # a streaming dataset: its first row, as stock reads it anyway
        empty = next(iter(dataset), None) is None
    if empty:
        raise ValueError(
            f"{trainer_name}: {what} has no rows: nothing to train. If it was built by expanding conversations "
            "(trl_tree.data.sft_data.expand_turns: one sample per assistant turn), none of them has an assistant turn after "
            "its first message; check the file's 'messages' (roles 'user', 'assistant', ...)")


def refuse_streaming_groups(trainer_name: str, dataset, tree_shuffle: str) -> None:
    """``tree_shuffle='groups'`` needs the whole dataset; a streaming one trains in TRL's order."""
    if tree_shuffle == "groups" and dataset is not None and not hasattr(dataset, "__len__"):
        raise ValueError(
            f"{trainer_name}: tree_shuffle='groups' orders the whole dataset by shared prefixes before each epoch, "
            "which a streaming dataset (IterableDataset) cannot give; use tree_shuffle='rows' (TRL's order: the tree "
            "shares what meets in a micro-batch) or load the dataset without streaming")


def warn_dropped_content(trainer_name: str, dataset, tokenizer) -> str | None:
    """Warn once when the chat template drops what the first conversations carry (a message's
    text, a tool call's name or arguments) or the tokenizer does not keep the rendered text (a
    character outside its vocabulary). Returns the warning, or None."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    if dataset is None or isinstance(dataset, Mapping) or getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        rows = list(itertools.islice(iter(dataset), TEMPLATE_CHECK_ROWS))
    except Exception:  # stock's constructor reads the dataset and says what is wrong with it
        return None
    for index, row in enumerate(rows):
        messages = _conversation(row)
        if messages is None:
            continue
        try:
            text = tokenizer.apply_chat_template(messages, tools=row.get("tools"), tokenize=False)
        except Exception:  # a template that cannot render the row: stock raises it, with its own message
            return None
        missing = _missing_content(messages, text)
        why = None
        if missing is not None:
            why = (f"the chat template drops content the conversations carry: row {index}, {missing} is not in the "
                   "rendered text, so it is never trained (the loss still falls on what is rendered). Use a template "
                   "that renders it (the model's own chat template; trl_tree.data.toy.CHAT_TEMPLATE renders tool calls)")
        elif not _round_trips(tokenizer, text):
            why = (f"the tokenizer does not keep the rendered text of row {index} (characters outside its vocabulary "
                   "become unknown tokens), so what they say is never trained. Use a tokenizer that covers the data "
                   "(trl_tree.data.toy.chat_tokenizer keeps every character)")
        if why is not None:
            message = f"{trainer_name}: {why}"
            warnings.warn(message, stacklevel=3)
            return message
    return None


def _conversation(row) -> list | None:
    """A row's messages (``messages``, or a conversational ``prompt`` + ``completion`` — DPO's
    ``prompt`` + ``chosen``), or None."""
    if not isinstance(row, Mapping):
        return None
    if isinstance(row.get("messages"), list):
        return row["messages"]
    for answer in ("completion", "chosen"):
        if isinstance(row.get("prompt"), list) and isinstance(row.get(answer), list):
            return row["prompt"] + row[answer]
    return None


def _missing_content(messages: list, text: str) -> str | None:
    """The first piece of a message (its text, a tool call's name or argument value) that ``text``
    does not hold where it belongs: each piece is looked for after the previous message's, so a
    name the system prompt or a question also mentions does not hide a dropped tool call."""
    flat, start = _normal(text), 0
    for j, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        role = message.get("role", "?")
        content = message.get("content")
        if isinstance(content, str) and content.strip():
            found = flat.find(_normal(content), start)
            if found < 0:
                return f"message {j} ({role})'s text {content.strip()[:40]!r}"
            start = found + len(_normal(content))
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, Mapping) else {}
            function = function if isinstance(function, Mapping) else {}
            name = function.get("name")
            if isinstance(name, str) and name:
                found = flat.find(_normal(name), start)
                if found < 0:
                    return f"message {j} ({role})'s tool call {name!r}"
                start = found + len(_normal(name))
            end = start
            for value in _leaves(function.get("arguments")):  # in any order after the name (templates sort keys)
                found = flat.find(_normal(str(value)), start)
                if found < 0:
                    return f"message {j} ({role})'s tool call {name!r} argument {str(value)[:40]!r}"
                end = max(end, found + len(_normal(str(value))))
            start = end
    return None


def _leaves(value):
    """The scalar values of a tool call's arguments (a dict, a list, or a JSON string kept whole)."""
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value).strip():
        yield value


def _round_trips(tokenizer, text: str) -> bool:
    """Whether decoding the text's tokens gives the text back (whitespace and Unicode normalisation aside)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and unknown in ids and getattr(tokenizer, "unk_token", None) not in text:
        return False
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return _normal(decoded) == _normal(text)


def _normal(text: str) -> str:
    return "".join(unicodedata.normalize("NFKC", text).split())
