"""Attention outputs kept for the checkpointed recompute (``attention/kept.py``): the packed
FlashAttention path under HF gradient checkpointing runs its attention kernels once per layer, not
twice, and the gradients are bit for bit those of the recompute (fp32, CPU; the math kernels of
``attention/partial.py`` stand in for FlashAttention and cuDNN, as in ``test_root_split``)."""

from __future__ import annotations

import pytest
import torch
from test_exactness import WORKLOADS, check_exact
from test_root_split import _math_backend

from trl_tree.engine import packed
from trl_tree import tree_backward, tree_logprobs
from trl_tree.engine.attention import backends, kept
from trl_tree.engine.attention.kept import KeptAttention
from trl_tree.engine.cost_model import ActivationModel, estimate_bytes
from trl_tree.engine.layout import LAYOUT, layout_choices
from trl_tree.data.tiny import grpo_group, random_tree, tiny_model

VOCAB = 96
SEQS = grpo_group(10, 5, 4, VOCAB, num_prompts=2, seed=3)


@pytest.fixture(params=[False, True], ids=["varlen", "dense"])
def flash_path_on_cpu(request, monkeypatch):
    _math_backend(monkeypatch, request.param)


@pytest.fixture
def attention_runs(monkeypatch) -> list[int]:
    """One entry per run of the packed function's kernels (``backends._attend``)."""
    runs: list[int] = []
    attend = backends._attend

    def counting(q, *args):
        runs.append(q.shape[0])
        return attend(q, *args)

    monkeypatch.setattr(backends, "_attend", counting)
    return runs


@pytest.fixture
def kept_stores(monkeypatch) -> list[KeptAttention]:
    """Every ``KeptAttention`` the engine creates, to look inside after the step."""
    made: list[KeptAttention] = []

    class Recording(KeptAttention):
        def __init__(self, layers: int) -> None:
            super().__init__(layers)
            made.append(self)

    monkeypatch.setattr(packed, "KeptAttention", Recording)
    return made


def _checkpointed(family: str = "qwen2", reentrant: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_model(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    return model


def _grads(model, seqs, keep: bool, root_split: bool | None = None) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with layout_choices(root_split=root_split, keep_attention=keep):
        loss = tree_backward(model, seqs, lambda lp, s, p: -lp * (1 + s), attn_backend="math")
    return loss, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("root_split", [False, True, None], ids=["whole-paths", "split", "auto"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_kept_outputs_give_the_recompute_gradients_bit_for_bit(flash_path_on_cpu, attention_runs, kept_stores,
                                                              root_split, reentrant):
    model = _checkpointed(reentrant=reentrant)
    layers = model.config.num_hidden_layers
    loss_recomputed, recomputed = _grads(model, SEQS, keep=False, root_split=root_split)
    assert len(attention_runs) == 2 * layers and not kept_stores
    attention_runs.clear()
    loss_kept, with_kept = _grads(model, SEQS, keep=True, root_split=root_split)
    assert len(attention_runs) == layers  # the recompute ran no attention kernel
    assert loss_kept == loss_recomputed
    assert len(with_kept) == len(recomputed)
    for a, b in zip(with_kept, recomputed):
        assert torch.equal(a, b)
    assert len(kept_stores) == 1 and len(kept_stores[0]) == 0  # every kept output handed back


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_exact_against_untreed_with_kept_outputs(flash_path_on_cpu, workload):
    check_exact(_checkpointed("llama"), WORKLOADS[workload], "math")


def test_deep_tree_and_entropy_graph(flash_path_on_cpu, attention_runs):
    """A deep random forest and ``tree_logprobs`` with a graph (what the trainers backpropagate):
    still exact, attention once per layer."""
    seqs = random_tree(16, VOCAB, max_len=24, seed=11)
    model = _checkpointed()
    check_exact(model, seqs, "math")
    attention_runs.clear()
    with torch.enable_grad():
        logps, ents = tree_logprobs(model, seqs, attn_backend="math", return_entropy=True)
        loss = sum((lp.sum() + e.sum()) for lp, e in zip(logps, ents))
    loss.backward()
    assert len(attention_runs) == model.config.num_hidden_layers


@pytest.mark.parametrize("case", ["no-checkpointing", "eval", "no-grad", "switched-off"])
def test_nothing_kept_where_nothing_is_recomputed(flash_path_on_cpu, kept_stores, case):
    model = tiny_model("qwen2") if case == "no-checkpointing" else _checkpointed()
    if case == "eval":
        model.eval()  # HF recomputes only in training mode
    if case == "no-grad":
        with torch.no_grad():
            tree_logprobs(model, SEQS, attn_backend="math")
    else:
        with layout_choices(keep_attention=case != "switched-off"):
            tree_backward(model, SEQS, lambda lp, s, p: -lp, attn_backend="math")
    assert kept_stores == []


def test_reference_backends_keep_nothing(kept_stores):
    """Only the partial-kernel path can hand outputs back; sdpa/eager recompute as before."""
    model = _checkpointed()
    check_exact(model, SEQS, "sdpa")
    assert kept_stores == []


def test_kept_attention_hands_back_last_in_first_out_per_module():
    store = KeptAttention(layers=2)
    a, b = object(), object()
    assert not store.recomputing(2) and store.recomputing(3)
    store.keep(a, "a1")
    store.keep(b, "b1")
    store.keep(a, "a2")  # a module called twice in one forward
    assert len(store) == 3
    assert store.take(a) == "a2" and store.take(b) == "b1" and store.take(a) == "a1"
    assert store.take(a) is None and len(store) == 0  # nothing kept: the caller computes again
    assert kept.KeptAttention is KeptAttention


def test_cost_model_counts_the_kept_outputs():
    config = tiny_model("qwen2").config
    plain = ActivationModel.of(config, gradient_checkpointing=True)
    keeping = ActivationModel.of(config, gradient_checkpointing=True, keep_attention=True)
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * heads * (head_dim * 2 + 4)
    assert keeping.kept_per_token - plain.kept_per_token == per_token
    assert (estimate_bytes(config, 100, True, keep_attention=True) - estimate_bytes(config, 100, True)
            == 100 * per_token)
    # without checkpointing every layer keeps its activations anyway: nothing extra
    assert ActivationModel.of(config, False, keep_attention=True) == ActivationModel.of(config, False)


def test_keep_attention_argument_overrides_the_engine_default(flash_path_on_cpu, kept_stores, monkeypatch):
    """``keep_attention=`` on the entry points wins over ``LAYOUT.keep_attention`` both ways."""
    model = _checkpointed()
    monkeypatch.setattr(LAYOUT, "keep_attention", False)
    tree_backward(model, SEQS, lambda lp, s, p: -lp, attn_backend="math", keep_attention=True)
    assert len(kept_stores) == 1
    monkeypatch.setattr(LAYOUT, "keep_attention", True)
    tree_backward(model, SEQS, lambda lp, s, p: -lp, attn_backend="math", keep_attention=False)
    with torch.enable_grad():
        tree_logprobs(model, SEQS, attn_backend="math", keep_attention=False)
    assert len(kept_stores) == 1
    with pytest.raises(TypeError, match="keep_attention must be True, False or None"):
        tree_logprobs(model, SEQS, attn_backend="math", keep_attention="yes")


def test_trainer_config_passes_keep_attention():
    """``tree_keep_attention`` reaches every engine call of the trainers (through ``_mode_kwargs``)."""
    from trl_tree.trainers import TreeGRPOConfig
    from trl_tree.trainers.online.mixin import TreeTrainerMixin

    cpu = dict(output_dir="/tmp/unused", use_cpu=True, bf16=False)
    assert TreeGRPOConfig(**cpu).tree_keep_attention is True
    config = TreeGRPOConfig(**cpu, tree_keep_attention=False)
    trainer = TreeTrainerMixin()  # the mixin's own method, on a stand-in trainer's fields
    trainer.args, trainer.temperature = config, 1.0
    kwargs = trainer._mode_kwargs()
    assert kwargs["options"].keep_attention is False
    with pytest.raises(ValueError, match="tree_keep_attention must be True or False"):
        TreeGRPOConfig(**cpu, tree_keep_attention=None)
