"""SFT data helpers: per-turn samples and a tree's root-to-leaf samples (``trl_tree.data.sft_data``)."""

from __future__ import annotations

import pytest

from trl_tree.data.sft_data import branch_samples, expand_turns, expand_turns_batched

CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"key": "alpha"}}}
CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You look things up."},
        {"role": "user", "content": "What is under alpha?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should look.", "tool_calls": [CALL]},
        {"role": "tool", "name": "lookup", "content": "417"},
        {"role": "assistant", "content": "It is 417.", "reasoning_content": "The tool said 417."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome."},
    ],
    "tools": ["lookup-schema"],
}


def test_each_assistant_turn_is_one_sample_with_its_history():
    samples = expand_turns(CONVERSATION)
    messages = CONVERSATION["messages"]
    assert [len(s["prompt"]) for s in samples] == [2, 4, 6]
    for sample, turn in zip(samples, (2, 4, 6)):
        assert sample["prompt"] == messages[:turn] and sample["completion"] == [messages[turn]]
        assert sample["tools"] == ["lookup-schema"]
    # every prompt extends the previous sample: prompt + completion (+ the messages between)
    for earlier, later in zip(samples, samples[1:]):
        whole = earlier["prompt"] + earlier["completion"]
        assert later["prompt"][: len(whole)] == whole


def test_dropped_reasoning_leaves_later_histories_but_not_the_turn_itself():
    samples = expand_turns(CONVERSATION, drop_reasoning=True)
    assert samples[0]["completion"][0]["reasoning_content"] == "I should look."
    assert "reasoning_content" not in samples[1]["prompt"][2]  # the first turn, in the second's history
    assert samples[1]["completion"][0]["reasoning_content"] == "The tool said 417."
    assert all("reasoning_content" not in m for m in samples[2]["prompt"])
    assert CONVERSATION["messages"][2]["reasoning_content"] == "I should look."  # the input is not changed


def test_bad_conversations_are_refused_plainly():
    with pytest.raises(ValueError, match="'messages' list"):
        expand_turns({"text": "hello"})
    with pytest.raises(ValueError, match="nothing before it"):
        expand_turns({"messages": [{"role": "assistant", "content": "hi"}]})
    with pytest.raises(ValueError, match="message 1 is not a chat message"):
        expand_turns({"messages": [{"role": "user", "content": "hi"}, "hello"]})


def test_a_dataset_expands_with_map():
    from datasets import Dataset

    dataset = Dataset.from_list([CONVERSATION, {**CONVERSATION, "messages": CONVERSATION["messages"][:3]}])
    expanded = dataset.map(expand_turns_batched, batched=True, remove_columns=dataset.column_names)
    assert expanded.num_rows == 3 + 1
    assert set(expanded.column_names) == {"prompt", "completion", "tools"}


TREE = {
    "tools": ["lookup-schema"],
    "messages": [{"role": "user", "content": "What is under alpha?"}, {"role": "assistant", "content": "Looking."}],
    "children": [
        {"messages": [{"role": "user", "content": "Go on."}],
         "children": [{"messages": [{"role": "assistant", "content": "417."}]},
                      {"messages": [{"role": "assistant", "content": "It is 417."}]}]},
        {"messages": [{"role": "user", "content": "Stop."}, {"role": "assistant", "content": "Stopped."}]},
    ],
}


def test_a_tree_gives_its_root_to_leaf_samples():
    samples = branch_samples(TREE)
    assert [len(s["messages"]) for s in samples] == [4, 4, 4]
    assert all(s["messages"][:2] == TREE["messages"] and s["tools"] == ["lookup-schema"] for s in samples)
    assert [s["messages"][-1]["content"] for s in samples] == ["417.", "It is 417.", "Stopped."]


def test_a_tree_per_turn_trains_each_turn_once():
    turns = branch_samples(TREE, per_turn=True)
    completions = [t["completion"][0]["content"] for t in turns]
    assert completions == ["Looking.", "417.", "It is 417.", "Stopped."]  # the shared first turn once
    with pytest.raises(ValueError, match="children"):
        branch_samples({"messages": [], "children": {"messages": []}})
