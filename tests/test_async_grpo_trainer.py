"""TreeAsyncGRPOTrainer against TRL's AsyncGRPOTrainer: one update on the same sample stream, TRL's
batcher deciding the micro-batches (fp32, CPU).

Stock runs its packed row through a FlashAttention-3 kernel fetched from the hub, which cannot be
installed here: the tests put an exact stand-in under the function stock fetches it with
(``packing._flash_attn``) — PyTorch's SDPA per segment against its root path, causal aligned
bottom-right, as the varlen kernel computes. Rollouts come from a stub worker the test fills (no
vLLM server), weights go to a transfer that only reads them.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl.experimental.async_grpo")
from trl.experimental.async_grpo import AsyncGRPOConfig, packing
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from trl_tree.bench.async_grpo import NoTransfer, StreamWorker
from trl_tree.bench.common import bench_tokenizer
from trl_tree.data.tiny import tiny_model
from trl_tree.trainers.asynchronous.async_grpo import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer

VOCAB = 96


def exact_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=True,
                 window_size=(-1, -1), **_):
    """FlashAttention's varlen function, computed segment by segment with SDPA (bottom-right causal)."""
    assert causal and tuple(window_size) == (-1, -1)
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        n, m = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        qs = q[cq[s] : cq[s + 1]].transpose(0, 1)
        ks, vs = (x[ck[s] : ck[s + 1]].transpose(0, 1).repeat_interleave(groups, 0) for x in (k, v))
        mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
        out[cq[s] : cq[s + 1]] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                scale=softmax_scale).transpose(0, 1)
    return out


@pytest.fixture
def stand_in_kernel(monkeypatch):
    monkeypatch.setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(flash_attn_varlen_func=exact_varlen))
    # stock looks its peak FLOPs up by CUDA device name, which fails without CUDA (the tree trainer turns the
    # MFU metrics off there)
    from trl.experimental.async_grpo import async_grpo_trainer

    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)


class StubWorker(StreamWorker):
    """TRL's ``RolloutWorkerProtocol`` over a fixed list of samples, recording the versions it is told."""

    def __init__(self, samples):
        super().__init__(samples)
        self.versions: list[int] = []

    def update_model_version(self, version):
        self.versions.append(version)


class ReadingTransfer(NoTransfer):
    """TRL's ``WeightTransferProtocol`` that reads the weights and sends them nowhere."""

    def send_weights(self, iterator):
        for _ in iterator:
            pass


def forking_stream(seed: int = 0, groups: int = 12) -> list[RolloutSample]:
    """Groups of rollouts of a multi-turn conversation forking into rows: a shared system prompt and
    first turn, tool outputs (not trained), completions of free lengths."""
    rng = np.random.default_rng(seed)

    def tok(n):
        return rng.integers(2, VOCAB, n).tolist()

    samples = []
    system = tok(10)
    for g in range(groups):
        turn = tok(4)
        for r in range(3):
            tool, answer = tok(3), tok(int(rng.integers(2, 6)))
            ids = system + turn + tok(2) + tool + answer
            mask = np.zeros(len(ids), dtype=np.int64)
            mask[14:16] = 1  # the first completion
            mask[19:] = 1  # after the tool's output
            samples.append(RolloutSample(
                prompt=[], completion=[], input_ids=np.asarray(ids), completion_mask=mask,
                old_log_probs=rng.normal(-4.6, 0.3, len(ids)).astype(np.float32),
                advantage=float(rng.normal()), model_version=0, group_id=g, metrics={"reward": float(r)}))
    return samples


def train_once(tmp_path, trainer_cls, model, mode: str | None, samples, peft_config=None, **extra):
    config = dict(output_dir=str(tmp_path / "out"), max_steps=1, learning_rate=0.5, optim="sgd",
                  per_device_train_batch_size=4, gradient_accumulation_steps=1, token_budget=64, report_to="none",
                  save_strategy="no", logging_steps=1, use_cpu=True, bf16=False, max_staleness=8,
                  disable_tqdm=True, max_grad_norm=0.0)  # no clipping: it would hide a uniform scale error
    config.update(extra)
    if mode is not None:
        config["tree_mode"] = mode
    from datasets import Dataset

    args = (TreeAsyncGRPOConfig if trainer_cls is TreeAsyncGRPOTrainer else AsyncGRPOConfig)(**config)
    trainer = trainer_cls(model, args=args, train_dataset=Dataset.from_dict({"prompt": ["p"] * 4}),
                          processing_class=bench_tokenizer(VOCAB), rollout_worker=StubWorker(samples),
                          weight_transfer=ReadingTransfer(), peft_config=peft_config)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}, logs


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    tiny_model("qwen2", vocab_size=VOCAB).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("mode", ["packed", "dfs", "budget"])
def test_one_update_equals_stock(stand_in_kernel, saved_model, tmp_path, mode):
    """packed, dfs, and packed cut into calls by tree_token_budget (the two-pass bridge)."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    samples = forking_stream()
    stock, stock_logs = train_once(tmp_path / "stock", AsyncGRPOTrainer, saved_model, None, list(samples))
    extra = {"tree_token_budget": 30} if mode == "budget" else {}
    tree, tree_logs = train_once(tmp_path / "tree", TreeAsyncGRPOTrainer, saved_model,
                                 "packed" if mode == "budget" else mode, list(samples), **extra)
    if mode == "budget":
        assert max(h["tree/calls"] for h in tree_logs) > 1  # the budget did cut the row
    from transformers import AutoModelForCausalLM

    before = dict(AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32).named_parameters())
    moved = 0.0
    for name, want in stock.items():
        got = tree[name]
        delta = (want - before[name].detach()).norm()
        moved = max(moved, float(delta))
        err = float((got - want).norm() / delta.clamp(min=1e-12))
        assert err < 1e-5 or float((got - want).abs().max()) < 1e-7, f"{name}: update differs by {err:.2e}"
    assert moved > 1e-4  # the step did move the weights
    assert tree_logs[-1]["loss"] == pytest.approx(stock_logs[-1]["loss"], rel=1e-5, abs=1e-7)
    assert tree_logs[-1]["tree/dedup_ratio"] > (1.0 if mode == "budget" else 1.5)


def test_a_model_object_is_accepted(stand_in_kernel, saved_model, tmp_path):
    from transformers import AutoModelForCausalLM

    samples = forking_stream(1)
    by_name, _ = train_once(tmp_path / "name", TreeAsyncGRPOTrainer, saved_model, "packed", list(samples))
    model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    by_object, _ = train_once(tmp_path / "object", TreeAsyncGRPOTrainer, model, "packed", list(samples))
    for name, want in by_name.items():
        torch.testing.assert_close(by_object[name], want, rtol=1e-6, atol=1e-7)


def test_tree_off_is_stock(stand_in_kernel, saved_model, tmp_path):
    """tree_mode='off' with a model object: stock's own packed pass (the object switched to stock's
    attention), stock's update bit for bit."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    samples = forking_stream(2)
    stock, _ = train_once(tmp_path / "stock", AsyncGRPOTrainer, saved_model, None, list(samples))
    model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    off, logs = train_once(tmp_path / "off", TreeAsyncGRPOTrainer, model, "off", list(samples))
    for name, want in stock.items():
        assert torch.equal(off[name], want), name
    assert "tree/dedup_ratio" not in logs[-1]


def test_refusals_are_named(stand_in_kernel, saved_model, tmp_path):
    import trl_tree

    assert trl_tree.TreeAsyncGRPOTrainer is TreeAsyncGRPOTrainer
    with pytest.raises(ValueError, match="tree_cuda_graphs"):
        train_once(tmp_path, TreeAsyncGRPOTrainer, saved_model, "packed", forking_stream(), tree_cuda_graphs=True)
    with pytest.raises(ValueError, match="tree_window='accumulation'"):
        TreeAsyncGRPOConfig(output_dir=str(tmp_path), tree_window="accumulation", use_cpu=True)
    with pytest.raises(ValueError, match="loss_normalization must be one of"):
        TreeAsyncGRPOConfig(output_dir=str(tmp_path), loss_normalization="sequence", use_cpu=True)
    with pytest.raises(ValueError, match="tree_batcher must be one of"):
        TreeAsyncGRPOConfig(output_dir=str(tmp_path), tree_batcher="groups", use_cpu=True)
    with pytest.raises(ValueError, match="token_budget=0"):
        TreeAsyncGRPOConfig(output_dir=str(tmp_path), tree_batcher="rollouts", token_budget=0, use_cpu=True)


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_lora_update_equals_stock(stand_in_kernel, saved_model, tmp_path, mode):
    """Under LoRA the tree scores the PEFT base's fused head with the adapters active: the adapters'
    update is stock's (clipped: the parameters are compared, to an absolute 1e-7)."""
    from peft import LoraConfig
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    samples = forking_stream(3)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    stock, _ = train_once(tmp_path / "stock", AsyncGRPOTrainer, saved_model, None, list(samples),
                          peft_config=LoraConfig(**lora), max_grad_norm=1.0)
    tree, logs = train_once(tmp_path / "tree", TreeAsyncGRPOTrainer, saved_model, mode, list(samples),
                            peft_config=LoraConfig(**lora), max_grad_norm=1.0)
    adapters = [name for name in stock if "lora_" in name]
    assert adapters and logs[-1]["tree/dedup_ratio"] > 1.5
    for name in adapters:
        torch.testing.assert_close(tree[name], stock[name], rtol=1e-5, atol=1e-7)
    assert any(float(stock[name].abs().max()) > 0 for name in adapters if "lora_B" in name)  # B moved off zero


def assert_per_sequence_update(tree: dict, saved_model: str, samples: list[dict], lr: float) -> None:
    """``tree``'s parameters after one SGD step equal the plain per-sequence reference: each sample's
    clipped policy loss summed over its trained tokens, divided by all of their trained tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    terms, total = [], 0
    for sample in samples:
        ids = torch.as_tensor(sample["input_ids"]).long()
        mask = torch.as_tensor(sample["completion_mask"]).bool()
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].float(), -1).gather(
            1, ids[1:, None])[:, 0]
        trained = mask[1:]
        ratio = torch.exp(logp[trained] - torch.as_tensor(sample["old_log_probs"]).float()[1:][trained])
        advantage = float(sample["advantage"])
        terms.append(-torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage))
        total += int(trained.sum())
    (torch.cat(terms).sum() / total).backward()
    for name, p in model.named_parameters():
        want = p.detach() - lr * p.grad
        delta = (lr * p.grad).norm()
        err = float((tree[name] - want).norm() / delta.clamp(min=1e-12))
        assert err < 1e-5 or float((tree[name] - want).abs().max()) < 1e-7, f"{name}: {err:.2e}"


def recorded_micro_batches(monkeypatch) -> list[list[dict]]:
    """The samples of each micro-batch, recorded where TRL's collator receives them (filled as it trains)."""
    from trl.experimental.async_grpo import async_grpo_trainer

    collated = []
    original = async_grpo_trainer.DataCollatorForRollout.torch_call

    def recording(self, examples):
        collated.append([dict(s) for row in examples[0] for s in row.samples])
        return original(self, examples)

    monkeypatch.setattr(async_grpo_trainer.DataCollatorForRollout, "torch_call", recording)
    return collated


def test_window_normalization_equals_a_per_sequence_reference(stand_in_kernel, saved_model, tmp_path, monkeypatch):
    """loss_normalization='window': every trained token of the optimizer step weighs the same — the
    update equals the plain per-sequence loss over the step's samples divided by their trained tokens
    (two accumulated micro-batches of different sizes; the samples of each recorded where TRL's
    collator receives them)."""
    collated = recorded_micro_batches(monkeypatch)
    lr = 0.5
    tree, _ = train_once(tmp_path, TreeAsyncGRPOTrainer, saved_model, "packed", forking_stream(11),
                            gradient_accumulation_steps=2, loss_normalization="window", token_budget=48,
                            max_grad_norm=0.0)  # the reference below takes the plain SGD step
    window = collated[:2]  # the step's micro-batches, in the order trained (later ones were prefetched)
    trained = [sum(int(s["completion_mask"][1:].sum()) for s in batch) for batch in window]
    assert len(window) == 2 and trained[0] != trained[1]  # where stock's per-micro-batch weighting differs

    assert_per_sequence_update(tree, saved_model, [s for batch in window for s in batch], lr)


def test_rollouts_batcher_trains_an_oversize_sample_exactly(stand_in_kernel, saved_model, tmp_path, monkeypatch):
    """tree_batcher='rollouts' with dfs: a sample longer than token_budget (which stock drops) trains
    in a row of its own; with the window normalisation the step equals the per-sequence reference
    over every sample it trained, the long one among them."""
    rng = np.random.default_rng(5)
    samples = forking_stream(11)
    ids = samples[0].input_ids.tolist() + rng.integers(2, VOCAB, 40).tolist()  # 60+ tokens, budget 48
    mask = np.zeros(len(ids), dtype=np.int64)
    mask[20:] = 1
    long = RolloutSample(prompt=[], completion=[], input_ids=np.asarray(ids), completion_mask=mask,
                         old_log_probs=rng.normal(-4.6, 0.3, len(ids)).astype(np.float32), advantage=0.7,
                         model_version=0, group_id=0, metrics={"reward": 1.0})
    samples.insert(3, long)
    collated = recorded_micro_batches(monkeypatch)
    tree, logs = train_once(tmp_path, TreeAsyncGRPOTrainer, saved_model, "dfs", samples, gradient_accumulation_steps=2,
                            loss_normalization="window", token_budget=48, tree_batcher="rollouts", max_grad_norm=0.0)
    window = [s for batch in collated[:2] for s in batch]
    assert any(len(s["input_ids"]) == len(ids) for s in window)
    assert not logs[-1].get("batch/dropped_oversize_total")
    assert_per_sequence_update(tree, saved_model, window, 0.5)
