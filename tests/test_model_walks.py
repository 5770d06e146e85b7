"""The engine's own walks over a model's modules (``model_parts``): the same answers as PyTorch's
and transformers' (``parameters()``, ``is_activation_checkpointing``), at less host time per call."""

from __future__ import annotations

import pytest

from trl_tree.engine.model_parts import activation_checkpointing, trainable_parameters
from trl_tree.data.tiny import tiny_model


def _models():
    tied = tiny_model("qwen2", num_hidden_layers=3, tie_word_embeddings=True)
    frozen = tiny_model("llama", num_hidden_layers=3)
    frozen.model.layers[1].mlp.requires_grad_(False)
    frozen.model.embed_tokens.weight.requires_grad_(False)
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tiny_model("qwen2", num_hidden_layers=2), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    return {"tied": tied, "frozen": frozen, "lora": lora}


@pytest.mark.parametrize("name", ["tied", "frozen", "lora"])
def test_trainable_parameters_are_parameters_that_require_grad(name):
    model = _models()[name]
    expected = [p for p in model.parameters() if p.requires_grad]
    got = trainable_parameters(model)
    assert [id(p) for p in got] == [id(p) for p in expected]  # same order, tied weights once


@pytest.mark.parametrize("name", ["tied", "lora"])
def test_activation_checkpointing_follows_the_model_s_switch(name):
    model = _models()[name]
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
    disable = getattr(hf, "activation_checkpointing_disable", None) or hf.gradient_checkpointing_disable
    assert activation_checkpointing(model) is False and hf.is_activation_checkpointing is False
    enable()
    assert activation_checkpointing(model) is True and hf.is_activation_checkpointing is True
    disable()
    assert activation_checkpointing(model) is False and hf.is_activation_checkpointing is False
