"""Toy tasks with a tiny policy built in code: what the demo and the examples train offline.

The policy is a randomly initialised Qwen2-shaped model over :func:`trl_tree.data.tiny.tiny_tokenizer`'s
characters, saved to a local directory so TRL can load it (and build a reference model from it)
like any checkpoint. The task: long shared prompts (so a GRPO group has a real prefix to share)
and a reward for writing the letter ``a`` — learnable by a random model within tens of steps, so
the reward visibly rises on a CPU. For SFT: a small chat template in the same characters (with
TRL's generation markers) and generated agentic conversations — a long system prompt, a tool, and
turns that look a key up and answer with its value — whose per-turn samples share their histories.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .tiny import tiny_model, tiny_tokenizer

INSTRUCTION = (
    "you are a careful assistant. read the whole story below, then answer with one word only. "
    "the answer is the first letter of the alphabet, written as often as you can. "
)


#: TreePPOTrainer settings under which the toy task learns within minutes on a CPU, and why each:
#: the critic starts untrained (a random value head on a random trunk), so ``lam=1.0`` makes each
#: token's advantage its Monte-Carlo return minus V(s_t), unbiased whatever V is, where GAE's
#: ``lam < 1`` feeds the critic's errors at the next state into the advantage — with a random critic
#: that biases the one token that matters (the policy learned to avoid the rewarded letter;
#: docs/quickstart.md); ``critic_warmup_steps=2`` lets the critic fit the reward's scale before the policy
#: moves; one PPO epoch per generation, so the few steps of a demo all see fresh rollouts; a small
#: KL penalty, since the reward (a share of letters) is small next to a per-token KL sum; and
#: ``vf_coef=0.1``: a value head on the policy's own trunk (``critic="shared"``) otherwise sends the
#: untrained critic's large errors through the trunk the policy learns with (docs/quickstart.md);
#: a critic with parameters of its own is trained by Adam,
#: which a loss scale does not change.
TOY_PPO: dict = {"num_ppo_epochs": 1, "lam": 1.0, "critic_warmup_steps": 2, "kl_coef": 0.01, "vf_coef": 0.1}


#: a chat template in ``tiny_tokenizer``'s characters: the tools' names first, one letter per role,
#: an assistant turn inside TRL's generation markers (``assistant_only_loss``) and ended by eos. An
#: assistant turn's tool calls follow its text, each as ``<tool_call>{"name": ..., "arguments": ...}
#: </tool_call>`` (arguments given as a JSON string are written as they are), inside the markers, so
#: they train; a tool's answer is a ``t:`` turn like any other message. Nothing a conversation
#: carries is dropped (``trainers.template_check`` warns where a template does drop something).
CHAT_TEMPLATE = (
    "{% if tools %}{{ 'tools:' }}{% for t in tools %}"
    "{{ (t['function']['name'] if t['function'] is defined else t['name']) + ';' }}{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'a:' }}{% generation %}"
    "{{ m['content'] if m['content'] else '' }}"
    "{% for call in m['tool_calls'] or [] %}{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) }}{{ '}</tool_call>' }}"
    "{% endfor %}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['role'][0] + ':' + (m['content'] if m['content'] else '') + ';' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'a:' }}{% endif %}"
)

AGENT_SYSTEM = (
    "you are an agent with a key value store. to answer a question about a key, first call the tool lookup "
    "with the key, then answer with the value it returns, in one short sentence. "
)
AGENT_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "the value stored under a key",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
AGENT_KEYS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")


def chat_tokenizer(every_character: bool = True):
    """``tiny_tokenizer`` with :data:`CHAT_TEMPLATE`, and the ``response_template`` that parses an
    assistant turn back into a message — its text and its ``<tool_call>`` JSON into ``tool_calls``
    (TRL's rollout loop reads its generations that way). ``every_character``: see ``tiny_tokenizer``
    (a tool call's JSON needs it)."""
    tok = tiny_tokenizer(every_character)
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = {"defaults": {"role": "assistant"}, "start_anchor": "a:", "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<tool_call>|" + re.escape(tok.eos_token) + r"|$", "content": "text"}}}
    return tok


def toy_conversations(n: int = 64, questions: int = 2, seed: int = 0) -> list[dict]:
    """``n`` agentic conversations (``{"messages", "tools"}``): the system prompt, then per question
    a user turn, the assistant's tool call (``tool_calls``, as TRL's datasets carry them), the tool's
    answer and the assistant's reply."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": AGENT_SYSTEM}]
        for _ in range(questions):
            key = AGENT_KEYS[int(torch.randint(len(AGENT_KEYS), (1,), generator=g))]
            value = int(torch.randint(100, (1,), generator=g))
            messages += [
                {"role": "user", "content": f"what is stored under {key}?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}]},
                {"role": "tool", "content": f"{key} = {value}"},
                {"role": "assistant", "content": f"the value of {key} is {value}."},
            ]
        out.append({"messages": messages, "tools": AGENT_TOOLS})
    return out


def toy_preferences(n: int = 128, pairs_per_prompt: int = 1, seed: int = 0) -> list[dict]:
    """``n`` preference pairs (``{"prompt", "chosen", "rejected"}``, TRL's format): the agent's
    system prompt and a tool's answer, then the right reply (chosen) against one with a wrong value
    (rejected: an evasive reply or a wrong value); ``pairs_per_prompt`` pairs share each prompt
    (several rejected answers)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < n:
        key = AGENT_KEYS[int(torch.randint(len(AGENT_KEYS), (1,), generator=g))]
        value = int(torch.randint(100, (1,), generator=g))
        prompt = f"{AGENT_SYSTEM}u:what is stored under {key}?;t:{key} = {value};a:"
        for _ in range(pairs_per_prompt):
            wrong = (value + int(torch.randint(1, 100, (1,), generator=g))) % 100
            bad = ["i do not know.", "the store is empty.", f"the value of {key} is unknown.",
                   f"the value of {key} is {wrong}."]
            out.append({"prompt": prompt, "chosen": f"the value of {key} is {value}.",
                        "rejected": bad[int(torch.randint(len(bad), (1,), generator=g))]})
    return out[:n]


def build_tiny_policy(path: str | Path, hidden_size: int = 128, num_layers: int = 4, seed: int = 0,
                      chat: bool = False, every_character: bool | None = None) -> str:
    """Save a tiny Qwen2-shaped causal LM and its tokenizer (``chat``: with :data:`CHAT_TEMPLATE`)
    to ``path``; return the path. ``every_character`` (``tiny_tokenizer``; default: ``chat``):
    conversations — a user's own included — keep every character; the letter task's prompts need
    only its alphabet, which a random policy learns from fastest."""
    every_character = chat if every_character is None else every_character
    tok = chat_tokenizer(every_character) if chat else tiny_tokenizer(every_character)
    model = tiny_model(
        "qwen2", seed=seed, vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=2048, initializer_range=0.05,
    )
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    save_quietly(model, tok, path)
    return str(path)


def save_quietly(model, tokenizer, path: str | Path) -> None:
    """Save a model and its tokenizer without transformers' shard-writing progress bar (ours, not
    the training's: it would be the first thing a demo prints); the bar's setting is restored."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def toy_prompts(n: int = 256, story_len: int = 320, seed: int = 0) -> list[str]:
    """``n`` prompts: a shared instruction plus a random 'story' of ``story_len`` characters each."""
    g = torch.Generator().manual_seed(seed)
    letters = "bcdefghijklmnopqrstuvwxyz    "
    prompts = []
    for _ in range(n):
        idx = torch.randint(len(letters), (story_len,), generator=g).tolist()
        prompts.append(INSTRUCTION + "".join(letters[i] for i in idx) + " answer:")
    return prompts


def quarter_means(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last quarter (at least one value each) of a run's logged rewards:
    how the examples and their tests tell that a run learned, whatever the noise of single steps."""
    if not values:
        raise ValueError("no logged rewards")
    q = max(1, len(values) // 4)
    return sum(values[:q]) / q, sum(values[-q:]) / q


def learning_line(values: list[float], what: str = "reward") -> str:
    """``reward 0.031 -> 0.846 (first -> last quarter of 16 logged steps)`` (``what``: "loss" for SFT)."""
    first, last = quarter_means(values)
    return f"{what} {first:.3f} -> {last:.3f} (first -> last quarter of {len(values)} logged steps)"


def reward_letter_a(completions, **kwargs) -> list[float]:
    """Share of the letter 'a' in each completion (0 for an empty one)."""
    return [c.count("a") / max(len(c), 1) for c in completions]
