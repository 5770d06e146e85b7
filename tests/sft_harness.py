"""Run TRL's ``SFTTrainer`` and ``TreeSFTTrainer`` on the same samples from one tiny checkpoint.

Plain SGD (the update is linear in the gradient), fp32 on the CPU, TRL's own order
(``tree_shuffle='rows'``, the default) and the same seed, so both see the same micro-batches; the
comparison is the parameters after the update and the logged metrics.
"""

from __future__ import annotations

import copy

import torch
from datasets import Dataset, disable_progress_bars
from trainer_harness import save_tiny_checkpoint

from trl_tree.data.sft_data import expand_turns
from trl_tree.data.toy import chat_tokenizer

disable_progress_bars()

SYSTEM = "you answer with the word count of the question, then a tool call when asked"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                           "parameters": {"type": "object", "properties": {}}}}]


def sft_tokenizer():
    """The toy chat tokenizer over the letter alphabet (the harness's conversations use nothing else):
    its small vocabulary keeps the fp32 rounding of TRL's fused LM head, which grows with the
    vocabulary, below the float64 comparisons' tolerance (with every character, 356 tokens, two
    processes' packed update differed from stock's by 8e-9 on lm_head entries of 1e-3)."""
    return chat_tokenizer(every_character=False)


def save_sft_checkpoint(path, family: str = "qwen2", **overrides) -> str:
    return save_tiny_checkpoint(path, family, tokenizer=sft_tokenizer(), **{"max_position_embeddings": 1024,
                                                                          **overrides})


#: Qwen3-Next's tiny family as released: its hybrid layers with experts instead of dense MLPs
QWEN3_NEXT_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16, mlp_only_layers=[])


def save_moe_checkpoint(path, family: str) -> str:
    """A tiny MoE model of ``family`` (qwen3_moe, gpt_oss) with its load-balancing loss on; GPT-OSS
    in eager attention (its sinks have no SDPA implementation)."""
    extra = {"attn_implementation": "eager"} if family == "gpt_oss" else {}
    return save_sft_checkpoint(path, family=family, router_aux_loss_coef=0.5, **extra)


def conversations(n: int = 4, turns: int = 3, tools: bool = False) -> list[dict]:
    out = []
    for c in range(n):
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"q{c} turn {t} how many"})
            messages.append({"role": "assistant", "content": f"{(c + t) % 7} words {'x' * (t + c % 3)}"})
        out.append({"messages": messages, **({"tools": TOOLS} if tools else {})})
    return out


def dataset(kind: str, n: int = 4, turns: int = 3) -> Dataset:
    """The data shapes SFTTrainer takes: 'text', 'prompt_completion' (plain text), 'messages'
    (conversational language modelling), 'turns' (conversational prompt-completion, one sample per
    assistant turn — histories shared), 'tools' (the same with a tools column)."""
    if kind == "text":
        return Dataset.from_list([{"text": f"{SYSTEM} q{i} " + "ab " * (i % 4)} for i in range(2 * n)])
    if kind == "prompt_completion":
        return Dataset.from_list([{"prompt": f"{SYSTEM} q{i // 2}", "completion": f" a{i} " + "c" * (i % 5)}
                                  for i in range(2 * n)])
    if kind == "messages":
        return Dataset.from_list(conversations(n, turns))
    if kind in ("turns", "tools"):
        rows = [s for conv in conversations(n, turns, tools=kind == "tools") for s in expand_turns(conv)]
        return Dataset.from_list(rows)
    raise ValueError(kind)


BASE = dict(per_device_train_batch_size=4, learning_rate=0.5, optim="sgd", max_steps=1, logging_steps=1,
            report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0, disable_tqdm=True,
            gradient_checkpointing=False, dataloader_drop_last=False)


def run(trainer_cls, config_cls, checkpoint: str, data: Dataset, *, eval_data: Dataset | None = None,
        peft_config=None, dtype=torch.float32, resume_from_checkpoint: str | None = None,
        **config) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Train from ``checkpoint`` on ``data``; the trainable parameters after it and the log."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    config = {"output_dir": str(checkpoint) + "-out", **BASE, **config}
    args = config_cls(**config)
    trainer = trainer_cls(model=model, args=args, train_dataset=copy.deepcopy(data), eval_dataset=eval_data,
                          processing_class=sft_tokenizer(), peft_config=peft_config)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return params, trainer.state.log_history


def assert_same_update(stock: dict, tree: dict, start: dict | None = None, tol: float = 1e-5,
                       whole: bool = False) -> None:
    """Each parameter's update within ``tol`` (relative); ``whole``: the update of all parameters
    together instead (an fp32 MoE model: its top-k routing and grouped products leave parameters
    with small updates relatively noisier than float64 would)."""
    assert stock.keys() == tree.keys()
    diff = norm = 0.0
    for name in stock:
        a, b = stock[name].double(), tree[name].double()
        if start is not None:  # compare the updates, not the (equal) starting points
            a, b = a - start[name].double(), b - start[name].double()
        if whole:
            diff, norm = diff + float(((a - b) ** 2).sum()), norm + float((a**2).sum())
            continue
        scale = a.norm().clamp(min=1e-12)
        assert (a - b).norm() / scale < tol, f"{name}: relative difference {float((a - b).norm() / scale):.2e}"
    if whole:
        assert (diff / max(norm, 1e-24)) ** 0.5 < tol, f"relative update difference {(diff / norm) ** 0.5:.2e}"
