"""Recurrent hybrids over the tree: gated DeltaNet (Qwen3-Next), Mamba-2 (Nemotron-H, Bamba, Granite-4
hybrid, Falcon-H1) and Mamba-1 (Jamba). Each node's scan starts from its parent's final state — in
the packed call level by level, in the depth-first walk from the state its pushed ancestor left on
the stack — so log-probs and gradients equal the untreed computation (fp32, CPU): deep and wide
forests, the walk's chunk sizes and group budgets, scan chunks that nodes start in the middle of,
checkpointing, LoRA and the GRPO, SFT and DPO trainers.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from sft_harness import QWEN3_NEXT_MOE
from test_short_conv import FORESTS, WALKS, check_exact

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from conftest import grads_of, weighted_loss  # noqa: E402

from trl_tree import tree_backward, tree_logprobs  # noqa: E402
from trl_tree.engine.mixers.deltanet import float64_kernels  # noqa: E402
from trl_tree.engine.reference import untreed_backward, untreed_logprobs  # noqa: E402
from trl_tree.engine.mixers.scan import ZERO, Segments, _parents  # noqa: E402
from trl_tree.data.tiny import tiny_model  # noqa: E402

#: the two mixer kinds, each through a family whose tests cover every path; the other Mamba-2 families
#: share the mixer's code and are checked on one forest
FAMILIES = ("qwen3_next", "nemotron_h")


@pytest.mark.parametrize("forest", sorted(FORESTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_tree(family, forest):
    check_exact(tiny_model(family), FORESTS[forest])


@pytest.mark.parametrize("family", ["bamba", "granite_hybrid", "falcon_h1", "jamba"])
def test_other_families(family):
    """Falcon-H1: attention and the mixer in the same layer (their stack slots and states apart);
    Jamba: Mamba-1's selective scan, a state per channel."""
    model = tiny_model(family)
    check_exact(model, FORESTS["deep"])
    check_exact(model, FORESTS["deep"], mode="dfs", chunk_size=4)


@pytest.mark.parametrize("walk", sorted(set(WALKS) - {"chunk_1"}))  # chunk_2 cuts every node into the smallest units
@pytest.mark.parametrize("family", FAMILIES)
def test_walk(family, walk):
    """A unit starts from the state its pushed ancestor left on the stack and hands that state's
    gradient back to it; a pushed node's final state collects its whole subtree's gradient."""
    check_exact(tiny_model(family), FORESTS["deep"], mode="dfs", **WALKS[walk])


@pytest.mark.parametrize("scan_chunk", [1, 3, 16])
def test_scan_chunks_across_nodes(scan_chunk):
    """Mamba-2's chunked scan with chunks shorter than, across and longer than the nodes."""
    model = tiny_model("nemotron_h", chunk_size=scan_chunk)
    check_exact(model, FORESTS["deep"])
    check_exact(model, FORESTS["wide"], mode="dfs", chunk_size=2)


@pytest.mark.parametrize("family,reentrant", [("qwen3_next", False), ("qwen3_next", True), ("jamba", False),
                                              ("qwen3_5", False)])
def test_checkpointing(family, reentrant):
    """HF's checkpointed recompute calls the mixer again in the backward: it finds the tree's metadata,
    the same segments and the same stack states, and hands each state's gradient on once — also
    where the decoder layer does not hand the call's keyword arguments to its mixer (Jamba) and
    transformers recomputes the layer class's own forward, not the engine's wrapper of it."""
    model = tiny_model(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    check_exact(model, FORESTS["deep"], mode="dfs", chunk_size=5)
    if not reentrant:
        check_exact(model, FORESTS["deep"])
        check_exact(model, [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6], [9, 9, 9, 9, 9]])  # the padded batch: the model's own


def test_a_layer_whose_class_is_swapped_after_the_first_call_is_still_checkpointed():
    """FSDP2's ``fully_shard`` swaps a decoder layer's class for a subclass of it (``FSDP<Layer>``), and
    transformers checkpoints a layer only in its class's outermost ``forward``. The engine's wrapper of
    a hybrid's layer must call the layer's forward as it is at each call: one taken before the swap ran
    every hybrid layer un-checkpointed under FSDP2 (the mixer called once per call instead of twice,
    its activations kept through the call). Exact still, and recomputed in the backward."""
    model = tiny_model("qwen3_5")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    check_exact(model, FORESTS["deep"])  # the first call installs the engine's wrappers
    for layer in model.model.layers:  # as fully_shard does
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    calls = []
    mixers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled())) for m in mixers]
    try:
        tree_backward(model, FORESTS["deep"], lambda logp, *_: logp)
    finally:
        for h in handles:
            h.remove()
    assert len(calls) == 2 * len(mixers), f"{len(calls)} mixer calls for {len(mixers)} mixers: not recomputed"
    check_exact(model, FORESTS["deep"])


@pytest.mark.parametrize("family,targets", [("qwen3_next", ["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj"]),
                                            ("qwen3_5", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                         "out_proj", "q_proj"]),
                                            ("nemotron_h", ["in_proj", "q_proj"])])
def test_lora_on_the_mixers(family, targets):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(family), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                          lora_dropout=0.0, init_lora_weights=False))
    check_exact(model, FORESTS["wide"])
    check_exact(model, FORESTS["deep"], mode="dfs", chunk_size=5)


#: trainer checkpoints: Qwen3-Next as released, hybrid and MoE with its load-balancing loss (CPU experts
#: take no float64: compared in fp32, the whole update); Qwen3.5 dense and Nemotron-H's Mamba-2, attention and
#: MLP blocks in float64
TRAINED = {
    "qwen3_next": (dict(QWEN3_NEXT_MOE, router_aux_loss_coef=0.5), torch.float32),
    "qwen3_5": ({}, torch.float64),
    "nemotron_h": (dict(layers_block_type=["mamba", "attention", "mlp", "mamba"]), torch.float64),
}


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_grpo_update_matches_stock(tmp_path, family):
    from test_stock_parity import ONE_UPDATE, compare
    from trainer_harness import save_tiny_checkpoint

    fields, dtype = TRAINED[family]
    with float64_kernels(tiny_model(family)) if dtype == torch.float64 else contextlib.nullcontext():
        compare(save_tiny_checkpoint(tmp_path / family, family, **fields), ("packed", "dfs"), **ONE_UPDATE, dtype=dtype)


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_sft_and_dpo_updates_match_stock(tmp_path, family):
    """Stock SFT and DPO updates; a float64 model's delta rule in float64 too (its kernel otherwise
    computes in fp32, whose rounding moves with the chunks' boundaries: see the float64 test below)."""
    from sft_harness import save_sft_checkpoint

    fields, dtype = TRAINED[family]
    whole = dtype == torch.float32
    checkpoint = save_sft_checkpoint(tmp_path / family, family=family, **fields)
    with float64_kernels(tiny_model(family)) if dtype == torch.float64 else contextlib.nullcontext():
        _sft_and_dpo(checkpoint, dtype, whole)


def _sft_and_dpo(checkpoint, dtype, whole):
    from sft_harness import assert_same_update, dataset, run
    from test_dpo_trainer import compare as dpo_compare
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from trl_tree import TreeSFTConfig, TreeSFTTrainer

    start = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=dtype).named_parameters()}
    stock, _ = run(SFTTrainer, SFTConfig, checkpoint, dataset("turns"), dtype=dtype)
    for mode in ("packed", "dfs"):
        tree, log = run(TreeSFTTrainer, TreeSFTConfig, checkpoint, dataset("turns"), dtype=dtype, tree_mode=mode)
        assert_same_update(stock, tree, start, whole=whole)
        assert log[0]["tree/dedup_ratio"] > 1.0
    dpo_compare(checkpoint, tree={"tree_mode": "dfs"}, dtype=dtype, whole=whole)


def test_a_node_off_the_middle_of_another_is_refused():
    """Segments hang off their parent's last row; anything else is not a radix tree of sequences."""
    cu_q, cu_k = np.array([0, 4, 6]), np.array([0, 4, 8])  # node 1 (rows 4, 5) on the path 0, 1, 4, 5
    with pytest.raises(ValueError, match="hangs off the middle"):
        _parents(cu_q, cu_k, np.array([0, 1, 2, 3, 0, 1, 4, 5]), ZERO)
    parent = _parents(cu_q, np.array([0, 4, 10]), np.array([0, 1, 2, 3, 0, 1, 2, 3, 4, 5]), ZERO)
    assert parent.tolist() == [ZERO, 0]
    seg = Segments.build(cu_q[:-1], np.diff(cu_q), parent, torch.device("cpu"))
    assert [tuple(r.shape) for r in seg.rows] == [(1, 4), (1, 2)]


#: models whose mixers the tree does not run (attention-free Mamba and Mamba-2, whose layers never see the
#: call's keyword arguments): tiny configs
REFUSED_HYBRIDS = {
    "Mamba2Config": dict(num_heads=4, head_dim=16, expand=2, n_groups=1, state_size=8, chunk_size=8),
    "MambaConfig": dict(state_size=8),
}


@pytest.mark.parametrize("config", sorted(REFUSED_HYBRIDS))
def test_other_hybrids_are_refused_naming_their_layers(config):
    """Never a wrong number: a model whose mixer the tree does not run is refused before any call,
    naming the layer."""
    import transformers
    from transformers import AutoModelForCausalLM

    if not hasattr(transformers, config):
        pytest.skip(f"transformers {transformers.__version__} has no {config}")
    cfg = getattr(transformers, config)(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        **REFUSED_HYBRIDS[config])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    refusal = (r"cannot run exactly \(layer 0 \(linear_attention\): \w+Mixer"
               r"|0 of its \d+ attention layers and mixers ran")  # the last: a version without layer types
    with pytest.raises(ValueError, match=refusal):
        tree_logprobs(model, FORESTS["short"])


def fancy_scan(x):
    """A kernel the engine does not know, decorated as transformers decorates the kernels it routes."""
    return x


fancy_scan.__wrapped__ = lambda x: x


def test_a_layer_calling_a_kernel_the_engine_does_not_know_is_refused_naming_both():
    """Mixers are found by the kernels their forward calls; a layer declared a mixer layer that calls
    a sequence kernel the engine does not run is refused when the model is validated (a trainer's
    construction), naming the layer, its class and the kernel — never run with the kernel unaware."""
    from trl_tree.engine.model_parts import model_parts

    model = tiny_model("nemotron_h")
    mixer = model.model.layers[0].mixer
    fancy = type("FancyMixer", (torch.nn.Module,), {"forward": lambda self, h, **kw: fancy_scan(h),
                                                    "__module__": __name__})
    model.model.layers[0].mixer = fancy()
    with pytest.raises(ValueError, match=r"layer 0 \(\w+\): FancyMixer calls fancy_scan"):
        model_parts(model)
    del mixer


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear", "lfm3", "zamba2"])
def test_hybrids_run_by_their_kernels(family):
    """No form of their own: Qwen3.5's DeltaNet (its projections split), OLMo-hybrid's, Kimi Delta
    Attention (a decay per key channel; its latent attention's V narrower than K in the walk's stack),
    LFM3's convolution and Zamba2's Mamba-2 (beside an attention block shared across layers) run
    because their layers call the kernels the tree knows."""
    model = tiny_model(family)
    check_exact(model, FORESTS["deep"])
    check_exact(model, FORESTS["wide"], mode="dfs", chunk_size=3)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_the_delta_rule_in_float64_leaves_only_the_heads_rounding(family):
    """What the 1e-5-level differences of the delta-rule hybrids are: transformers' delta-rule kernels
    compute in fp32 whatever the model's dtype, and their rounding moves with where chunks begin (a
    tree's node starts chunks of its own). With those kernels in float64 (``float64_kernels``) a
    float64 model's tree equals the untreed model to the fp32 log-prob head's last bits, packed and dfs."""
    model = tiny_model(family, initializer_range=0.2).double()  # the sharper weights that amplify fp32 rounding
    seqs = FORESTS["deep"]
    with float64_kernels(model):
        ref = untreed_logprobs(model, seqs)
        model.zero_grad(set_to_none=True)
        untreed_backward(model, seqs, weighted_loss)
        ref_grads = grads_of(model)
        for kwargs in ({}, {"mode": "dfs", "chunk_size": 4}):
            got = tree_logprobs(model, seqs, **kwargs)
            assert max(float((a - b).abs().max()) for a, b in zip(got, ref)) <= 2e-6
            model.zero_grad(set_to_none=True)
            tree_backward(model, seqs, weighted_loss, **kwargs)
            grads = grads_of(model)
            num = sum(float((grads[n] - g).pow(2).sum()) for n, g in ref_grads.items())
            assert (num / sum(float(g.pow(2).sum()) for g in ref_grads.values())) ** 0.5 <= 1e-6


def test_a_block_shared_by_several_layers_is_exact_packed_and_refused_by_the_walk():
    """Zamba2's hybrid layers reuse one attention block, numbered by the block: two layers calling it
    would share the walk's per-layer stack, so dfs is refused (it read 1e-3 off before); packed is exact."""
    model = tiny_model("zamba2", layers_block_type=["mamba", "hybrid", "hybrid"], hybrid_layer_ids=[1, 2],
                       num_hidden_layers=3)
    check_exact(model, FORESTS["short"])
    with pytest.raises(ValueError, match=r"from several decoder layers \(Zamba2\w+\).*mode='packed'"):
        tree_logprobs(model, FORESTS["short"], mode="dfs")
