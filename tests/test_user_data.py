"""What a user's own data and adapters meet: one-line errors that name the file, line or row and
the fix; the tiny chat model renders tool calls and keeps every character (or the SFT trainer says
what a template drops); a streaming dataset trains as stock's; PEFT prompt-learning adapters are
refused at construction by every trainer; the offline trainers log ``tree/fwd_bwd_time`` (stock's
path too, with T/U 1.0)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from datasets import Dataset
from sft_harness import assert_same_update, dataset, run, save_sft_checkpoint, sft_tokenizer
from trainer_harness import PROMPTS, reward_a, save_tiny_checkpoint
from trl import SFTConfig, SFTTrainer

from trl_tree import TreeDPOConfig, TreeDPOTrainer, TreeSFTConfig, TreeSFTTrainer
from trl_tree.data.data_files import DataError, load_local_dataset, read_rows
from trl_tree.data.tiny import TINY_CHARS, tiny_tokenizer
from trl_tree.data.toy import chat_tokenizer, toy_conversations, toy_preferences
from trl_tree.trainers.offline.data_checks import warn_dropped_content


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_sft_checkpoint(tmp_path_factory.mktemp("user_data") / "tiny")


# ---------------------------------------------------------------------- the tiny chat model
def test_tiny_tokenizer_keeps_every_character_and_its_ids():
    compact, whole = tiny_tokenizer(), tiny_tokenizer(every_character=True)
    for ch in TINY_CHARS:  # the toy tasks' ids do not move
        assert whole.convert_tokens_to_ids(ch) == compact.convert_tokens_to_ids(ch)
    text = 'Call lookup({"Key": "ALPHA"}) — café ☕ 日本\n\ttabs & <tags> [x] ~_^'
    ids = whole(text, add_special_tokens=False)["input_ids"]
    assert whole.decode(ids) == text and whole.pad_token_id not in ids
    # the letter task's alphabet: other characters become <pad>
    assert compact.pad_token_id in compact("Capitals", add_special_tokens=False)["input_ids"]


def test_chat_template_renders_tool_calls_and_tool_messages():
    tok = chat_tokenizer()
    conversation = toy_conversations(1)[0]
    text = tok.apply_chat_template(conversation["messages"], tools=conversation["tools"], tokenize=False)
    call = conversation["messages"][2]["tool_calls"][0]["function"]
    assert f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{call["arguments"]["key"]}"}}}}</tool_call>' in text
    assert "t:" + conversation["messages"][3]["content"] + ";" in text
    as_string = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": '{"key": "b"}'}}]}]
    assert '"arguments": {"key": "b"}}' in tok.apply_chat_template(as_string, tokenize=False)
    # the call is inside the generation markers: assistant_only_loss trains it
    out = tok.apply_chat_template(conversation["messages"], tools=conversation["tools"], return_dict=True,
                                  return_assistant_tokens_mask=True)
    trained = tok.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert "<tool_call>" in trained and conversation["messages"][3]["content"] not in trained
    # and TRL's rollout loop parses a generated call back into tool_calls
    prompt = tok.apply_chat_template(conversation["messages"][:2], tokenize=False, add_generation_prompt=True)
    parsed = tok.parse_response('<tool_call>{"name": "lookup", "arguments": {"key": "Beta"}}</tool_call><eos>',
                                prefix=prompt)
    assert parsed["tool_calls"][0]["function"] == {"name": "lookup", "arguments": {"key": "Beta"}}


def test_dropped_template_content_and_lost_characters_are_warned_once(checkpoint):
    data = Dataset.from_list(toy_conversations(4))
    plain = tiny_tokenizer(every_character=True)
    plain.chat_template = "{% for m in messages %}{{ m['role'] + ':' + (m['content'] or '') + ';' }}{% endfor %}"
    message = warn_dropped_content("T", data, plain)  # 'lookup' is in the system prompt: still found missing
    assert message and "message 2 (assistant)'s tool call 'lookup'" in message
    assert warn_dropped_content("T", data, chat_tokenizer()) is None
    assert "does not keep the rendered text" in warn_dropped_content("T", data, chat_tokenizer(every_character=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TreeSFTTrainer(model=checkpoint, args=TreeSFTConfig(output_dir="/tmp/x", report_to="none", max_steps=1),
                       train_dataset=data, processing_class=plain)
    dropped = [w for w in caught if "drops content" in str(w.message)]
    assert len(dropped) == 1


# ---------------------------------------------------------------------- files and rows
def test_files_name_the_bad_line_and_an_empty_file(tmp_path):
    rows = [json.dumps(c) for c in toy_conversations(8)]
    rows[5] = rows[5].replace('"role": "user"', '"role" "user"', 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    for read in (read_rows, load_local_dataset):
        with pytest.raises(DataError, match=r"bad.jsonl, line 6: not valid JSON \(Expecting ':' delimiter"):
            read(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl has no rows: nothing to train on"):
        load_local_dataset(str(empty))
    with pytest.raises(DataError, match="line 1: a JSON list, not an object"):
        (tmp_path / "list.jsonl").write_text("[1, 2]\n")
        read_rows(str(tmp_path / "list.jsonl"))


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_a_dataset_with_nothing_to_train_is_one_clear_error(checkpoint, trainer):
    from trl_tree.data.sft_data import expand_turns

    no_assistant = [{"messages": [m for m in c["messages"] if m["role"] != "assistant"]} for c in toy_conversations(4)]
    samples = [s for row in no_assistant for s in expand_turns(row)]
    assert samples == []
    empty = Dataset.from_list([{"prompt": [], "completion": []}]).select([])
    cls, config = (TreeSFTTrainer, TreeSFTConfig) if trainer == "sft" else (TreeDPOTrainer, TreeDPOConfig)
    with pytest.raises(ValueError, match="train_dataset has no rows: nothing to train.*assistant turn"):
        cls(model=checkpoint, args=config(output_dir="/tmp/x", report_to="none"), train_dataset=empty,
            processing_class=sft_tokenizer())


def test_group_by_length_with_groups_points_to_tree_shuffle_rows():
    with pytest.raises(ValueError, match="tree_shuffle='rows'"):
        TreeSFTConfig(output_dir="/tmp/x", tree_shuffle="groups", train_sampling_strategy="group_by_length")


# ---------------------------------------------------------------------- streaming
def test_a_streaming_dataset_trains_as_stock(checkpoint):
    data = dataset("turns").to_iterable_dataset()
    stock, stock_log = run(SFTTrainer, SFTConfig, checkpoint, data, dtype=torch.float64)
    tree, tree_log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, data, dtype=torch.float64)
    assert_same_update(stock, tree)
    assert tree_log[0]["loss"] == pytest.approx(stock_log[0]["loss"], rel=1e-7)
    assert tree_log[0]["tree/dedup_ratio"] > 1.0
    with pytest.raises(ValueError, match="streaming dataset .* tree_shuffle='rows'"):
        run(TreeSFTTrainer, TreeSFTConfig, checkpoint, data, tree_shuffle="groups")


# ---------------------------------------------------------------------- the step's time
@pytest.mark.parametrize("mode", ["packed", "off"])
@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_offline_trainers_log_the_step_time(checkpoint, trainer, mode):
    cls, config = (TreeSFTTrainer, TreeSFTConfig) if trainer == "sft" else (TreeDPOTrainer, TreeDPOConfig)
    data = dataset("turns") if trainer == "sft" else Dataset.from_list(toy_preferences(8, pairs_per_prompt=2))
    _, log = run(cls, config, checkpoint, data, tree_mode=mode, max_steps=2, gradient_accumulation_steps=2,
                 per_device_train_batch_size=2)
    steps = [h for h in log if "loss" in h]
    assert len(steps) == 2 and all(h["tree/fwd_bwd_time"] > 0 for h in steps)
    if mode == "off":
        assert all(h["tree/dedup_ratio"] == 1.0 for h in steps)


# ---------------------------------------------------------------------- PEFT prompt learning
def _prompt_learning(kind: str):
    from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig

    cls = {"prompt_tuning": PromptTuningConfig, "prompt_encoder": PromptEncoderConfig,
           "prefix_tuning": PrefixTuningConfig}[kind]
    return cls(task_type="CAUSAL_LM", num_virtual_tokens=4)


@pytest.fixture(scope="module")
def rl_checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("rl") / "tiny")


def _construct(trainer: str, checkpoint: str, rl_checkpoint: str, peft_config, mode: str = "packed"):
    from trl_tree import (
        TreeGRPOConfig,
        TreeGRPOTrainer,
        TreePPOConfig,
        TreePPOTrainer,
        TreeRLOOConfig,
        TreeRLOOTrainer,
    )
    from trl_tree.trainers.asynchronous.async_grpo import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer

    common = dict(output_dir="/tmp/prompt_learning", report_to="none", use_cpu=True, bf16=False, tree_mode=mode)
    if trainer in ("sft", "dpo"):
        cls, config = (TreeSFTTrainer, TreeSFTConfig) if trainer == "sft" else (TreeDPOTrainer, TreeDPOConfig)
        data = dataset("turns") if trainer == "sft" else Dataset.from_list(toy_preferences(8))
        return cls(model=checkpoint, args=config(**common), train_dataset=data, processing_class=sft_tokenizer(),
                   peft_config=peft_config)
    prompts = Dataset.from_dict({"prompt": PROMPTS})
    rl = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, **common)
    if trainer == "async":
        return TreeAsyncGRPOTrainer(checkpoint, args=TreeAsyncGRPOConfig(token_budget=256, **common),
                                    train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}]
                                                                                for p in PROMPTS]}),
                                    processing_class=sft_tokenizer(), rollout_worker="local", reward_funcs=reward_a,
                                    peft_config=peft_config)
    cls, config = {"grpo": (TreeGRPOTrainer, TreeGRPOConfig), "rloo": (TreeRLOOTrainer, TreeRLOOConfig),
                   "ppo": (TreePPOTrainer, TreePPOConfig)}[trainer]
    return cls(model=rl_checkpoint, reward_funcs=reward_a, args=config(**rl), train_dataset=prompts,
               peft_config=peft_config)


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "ppo", "sft", "dpo", "async"])
@pytest.mark.parametrize("kind", ["prompt_tuning", "prompt_encoder", "prefix_tuning"])
def test_prompt_learning_adapters_are_refused_at_construction(checkpoint, rl_checkpoint, trainer, kind):
    with pytest.raises(ValueError, match="PEFT prompt-learning adapters .*tree_mode='off'"):
        _construct(trainer, checkpoint, rl_checkpoint, _prompt_learning(kind))


def test_prompt_learning_takes_stocks_path_with_tree_mode_off(checkpoint, rl_checkpoint):
    trainer = _construct("sft", checkpoint, rl_checkpoint, _prompt_learning("prompt_tuning"), mode="off")
    assert trainer.model.peft_config["default"].is_prompt_learning


def test_expanding_conversations_names_the_row_and_refuses_nothing_to_train():
    from trl_tree.data.sft_data import expand_turns_dataset

    rows = toy_conversations(6)
    assert len(expand_turns_dataset(Dataset.from_list(rows))) == 6 * 4
    broken = [dict(r, messages=[dict(m) for m in r["messages"]]) for r in rows]
    del broken[4]["messages"][1]["role"]
    with pytest.raises(ValueError, match="row 4: message 1 is not a chat message with a 'role'"):
        expand_turns_dataset(Dataset.from_list([{"messages": r["messages"]} for r in broken]))
    silent = [{"messages": [m for m in r["messages"] if m["role"] != "assistant"]} for r in rows]
    with pytest.raises(ValueError, match="none of the 6 conversations has an assistant turn"):
        expand_turns_dataset(Dataset.from_list(silent))


def test_fa4_compiles_are_counted_and_taken(monkeypatch):
    """What FlashAttention-4 spends compiling a kernel variant is counted (the calls that grew its
    JIT caches) and handed to the step's log once; its disk cache is turned on unless a user said no."""
    import types

    from trl_tree.engine.attention import fa4

    calls = []

    def fwd(*args, **kwargs):  # compiles on its first call only, like FA4's cache
        calls.append(1)
        if not fwd.compile_cache.cache:
            fwd.compile_cache.cache["key"] = object()
        return "out", "lse"

    fwd.compile_cache = types.SimpleNamespace(cache={})
    fake = types.SimpleNamespace(_flash_attn_fwd=fwd)
    monkeypatch.setattr(fa4, "_interface", lambda: fake)
    fa4._jit_caches.cache_clear()
    fa4.take_compile_time()
    for _ in range(3):
        assert fa4._counting_compiles(fwd, 1, x=2) == ("out", "lse")
    kernels, seconds = fa4.take_compile_time()
    assert kernels == 1 and seconds >= 0.0 and len(calls) == 3
    assert fa4.take_compile_time() == (0, 0.0)
    fa4._jit_caches.cache_clear()


def test_fa4_disk_cache_is_on_unless_the_user_said_no(monkeypatch):
    import importlib

    from trl_tree.engine.attention import fa4

    def absent(name):
        raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", absent)
    monkeypatch.delenv(fa4.PERSISTENT_CACHE_VARIABLE, raising=False)
    assert fa4._interface.__wrapped__() is None
    assert fa4.os.environ[fa4.PERSISTENT_CACHE_VARIABLE] == "1"
    monkeypatch.setenv(fa4.PERSISTENT_CACHE_VARIABLE, "0")
    fa4._interface.__wrapped__()
    assert fa4.os.environ[fa4.PERSISTENT_CACHE_VARIABLE] == "0"


def test_the_construction_line_quoted_in_the_sft_docs_is_what_the_trainer_prints():
    import inspect
    import re

    from trl_tree.trainers.offline import sft_sampler

    source = inspect.getsource(sft_sampler.announce_grouping)
    template = re.search(r'"(%s: T/U %\.2f in TRL\'s order[^"]*)"\s*"([^"]*)"', source)
    assert template, "the trainer's line in TRL's order is not where the test looks"
    pattern = re.escape(template.group(1) + template.group(2)).replace(re.escape("%.2f"), r"\d+\.\d\d")
    pattern = pattern.replace(re.escape("%s"), "TreeSFTTrainer")
    with open("docs/sft.md") as f:
        quoted = [line for line in f if line.startswith("TreeSFTTrainer: T/U")]
    assert quoted and all(re.fullmatch(pattern, line.strip()) for line in quoted), quoted
