"""Shaping SFT data so that samples share prefixes: conversations into per-turn samples, trees of
trajectories into their root-to-leaf samples.

Why: a multi-turn agent conversation trained as one sample trains every assistant turn once, but
its later turns see earlier turns as they were generated — with their reasoning — which is not
what the model sees at inference when a template drops old reasoning; and agent SFT sets are
commonly built turn by turn, one sample per assistant turn with its whole history. Those samples
share their histories, and a tree computes each shared history once. Likewise, several
continuations of one state (best-of-n, rejection-sampled, a tool call with several outcomes) are
one sample per leaf that share everything up to their branch point.

The samples are TRL's conversational formats — ``{"prompt": [...], "completion": [...]}`` and
``{"messages": [...]}`` — with a ``tools`` column passed through, so ``SFTTrainer`` (and the tree's
trainer) tokenises them as it tokenises any dataset.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

#: where chat templates put an assistant turn's reasoning (Qwen3, DeepSeek-R1 and gpt-oss templates)
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def expand_turns(example: Mapping[str, Any], drop_reasoning: bool = False,
                 reasoning_keys: Sequence[str] = REASONING_KEYS) -> list[dict[str, Any]]:
    """One prompt–completion sample per assistant turn of ``example["messages"]``: the history
    before the turn as the prompt, the turn itself as the completion, so each turn is trained
    exactly once and every sample's prompt is the previous sample's prompt and completion (plus the
    tool or user messages between them) — prefixes a tree shares.

    ``drop_reasoning=True``: an earlier assistant turn's reasoning (its ``reasoning_keys`` fields)
    is left out of the histories of later turns — what templates that drop past reasoning show the
    model at inference — while each turn keeps its own reasoning in its completion. The histories
    then branch off at each turn's reasoning (prime-rl's side branches). Other keys of ``example``
    (``tools``, ids) are copied into every sample."""
    messages = example.get("messages") if isinstance(example, Mapping) else None
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ValueError("expand_turns takes a conversational example with a 'messages' list, got "
                         f"{sorted(example) if isinstance(example, Mapping) else type(example).__name__}")
    rest = {key: value for key, value in example.items() if key != "messages"}
    samples = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not message.get("role"):  # missing, or None from a datasets column
            raise ValueError(f"message {i} is not a chat message with a 'role': {message!r}")
        if message["role"] != "assistant":
            continue
        history = [_without_reasoning(m, reasoning_keys) if drop_reasoning and m["role"] == "assistant" else dict(m)
                   for m in messages[:i]]
        if not history:
            raise ValueError(f"message {i} is an assistant turn with nothing before it: it has no prompt to train on")
        samples.append({**rest, "prompt": history, "completion": [dict(message)]})
    return samples


def expand_turns_batched(batch: Mapping[str, list], drop_reasoning: bool = False,
                         reasoning_keys: Sequence[str] = REASONING_KEYS) -> dict[str, list]:
    """:func:`expand_turns` for ``datasets.Dataset.map(..., batched=True, remove_columns=...)``:
    ``dataset.map(expand_turns_batched, batched=True, remove_columns=dataset.column_names)``."""
    return _expand_batch(batch, None, drop_reasoning, reasoning_keys)


def _expand_batch(batch: Mapping[str, list], indices: Sequence[int] | None, drop_reasoning: bool,
                  reasoning_keys: Sequence[str]) -> dict[str, list]:
    """The batch's rows expanded, column by column; ``indices``: the rows' places in the dataset, named
    in the error of a malformed conversation."""
    keys = list(batch)
    out: dict[str, list] = {}
    for row in range(len(batch[keys[0]]) if keys else 0):
        try:
            samples = expand_turns({key: batch[key][row] for key in keys}, drop_reasoning, reasoning_keys)
        except ValueError as e:
            if indices is None:
                raise
            raise ValueError(f"row {indices[row]}: {e}") from None
        for sample in samples:
            for key, value in sample.items():
                out.setdefault(key, []).append(value)
    return out


def expand_turns_dataset(dataset, drop_reasoning: bool = False, reasoning_keys: Sequence[str] = REASONING_KEYS):
    """:func:`expand_turns` over a ``datasets.Dataset`` (or ``IterableDataset``): one sample per
    assistant turn. A malformed conversation's error names its row; a dataset whose conversations
    hold no assistant turn at all is an error here, not an empty dataset that fails later."""

    expanded = dataset.map(_expand_batch, batched=True, with_indices=True, remove_columns=dataset.column_names,
                           fn_kwargs={"drop_reasoning": drop_reasoning, "reasoning_keys": reasoning_keys})
    if hasattr(expanded, "__len__") and len(expanded) == 0:
        raise ValueError(f"none of the {len(dataset)} conversations has an assistant turn after its first message: "
                         "one sample per assistant turn leaves nothing to train")
    return expanded


def branch_samples(tree: Mapping[str, Any], per_turn: bool = False) -> list[dict[str, Any]]:
    """The root-to-leaf samples of a conversation tree: ``{"messages": [...], "children": [tree, ...]}``,
    each node's messages following its parent's (best-of-n continuations, a tool call with several
    outcomes). Keys of the root besides ``messages`` and ``children`` (``tools``) are copied into
    every sample. ``per_turn=True``: each leaf's conversation expanded by :func:`expand_turns`, an
    assistant turn shared by several leaves kept once (the first leaf's), so every turn of the tree
    is trained exactly once."""
    if not isinstance(tree, Mapping) or not isinstance(tree.get("messages", []), Sequence):
        raise ValueError("branch_samples takes a tree {'messages': [...], 'children': [...]} ")
    rest = {key: value for key, value in tree.items() if key not in ("messages", "children")}
    samples = [{**rest, "messages": path} for path in _paths(tree, [])]
    if not per_turn:
        return samples
    seen, turns = set(), []
    for sample in samples:
        for turn in expand_turns(sample):
            key = repr((turn["prompt"], turn["completion"]))
            if key not in seen:
                seen.add(key)
                turns.append(turn)
    return turns


def _paths(node: Mapping[str, Any], prefix: list[dict]) -> Iterator[list[dict]]:
    messages = node.get("messages", [])
    path = prefix + [dict(m) for m in messages]
    children = node.get("children") or []
    if not isinstance(children, Sequence) or isinstance(children, (str, Mapping)):
        raise ValueError(f"a node's 'children' must be a list of nodes, got {type(children).__name__}")
    if not children:
        if not path:
            raise ValueError("a leaf of the tree has no messages on its path")
        yield path
        return
    for child in children:
        yield from _paths(child, path)


def _without_reasoning(message: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key not in keys}
