"""TreeAsyncGRPOTrainer with ``rollout_worker='local'``: TRL's async GRPO trained on one CPU, no vLLM
server — stock's rollout loop (scoring, group advantages, staleness tags) in a thread, generating
with transformers from a copy of the policy that the in-process weight transfer keeps current."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("trl.experimental.async_grpo")

from trl_tree.data.toy import build_tiny_policy
from trl_tree.trainers.asynchronous.async_grpo import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer


def short_answers(completions, **_):
    """A reward the tiny model can move: shorter answers score higher."""
    return [-len(c[-1]["content"]) / 10 for c in completions]


def test_local_worker_trains_and_keeps_its_copy_current(tmp_path):
    from datasets import Dataset

    path = build_tiny_policy(tmp_path / "policy", hidden_size=32, num_layers=2, chat=True)
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {w}"}] for w in
                                            ("yes", "no", "up", "down", "left", "right")]})
    args = TreeAsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=3, learning_rate=1e-2,
                               per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                               token_budget=96, report_to="none", save_strategy="no", logging_steps=1,
                               use_cpu=True, bf16=False, max_staleness=2, disable_tqdm=True, seed=0)
    trainer = TreeAsyncGRPOTrainer(path, short_answers, args, train_dataset=prompts, rollout_worker="local")
    worker = trainer.rollout_worker
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert logs[-1]["tree/dedup_ratio"] > 1.0  # a group's generations share their prompt
    assert worker.weight_transfer.syncs == 4  # the cold sync, then one per optimizer step
    assert worker.model_version == 4
    policy = dict(trainer.model.named_parameters())
    for name, p in worker.generator.model.named_parameters():
        assert torch.equal(p, policy[name].detach()), name  # the copy holds the trained weights
    assert all(h.get("sample/staleness_max", 0) <= 2 for h in logs)


def test_local_worker_needs_a_token_budget(tmp_path):
    path = build_tiny_policy(tmp_path / "policy", hidden_size=32, num_layers=2, chat=True)
    args = TreeAsyncGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="needs token_budget"):
        TreeAsyncGRPOTrainer(path, short_answers, args, rollout_worker="local")


def test_staleness_occurs_bounded_and_old_log_probs_are_the_generating_policys(tmp_path):
    """A stepped worker makes samples only when the test allows it: a lead of groups made before
    training, more at each optimizer step's end (after its weight sync). Samples made by older weights
    then reach the trainer: stock tags them with their version, drops those more than max_staleness
    behind, trains the rest with the generating policy's log-probs as the importance ratio's base."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from trl_tree.trainers.asynchronous.local_rollout import LocalRolloutWorker

    path = build_tiny_policy(tmp_path / "policy", hidden_size=32, num_layers=2, chat=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {w}"}] for w in
                                            ("yes", "no", "up", "down", "left", "right")]})
    generations, lead, per_step = 4, 4, 2
    worker = LocalRolloutWorker(model, tok, prompts, [short_answers], eos_token_ids=[tok.eos_token_id],
                                num_generations=generations, max_tokens=6, max_inflight_tasks=generations,
                                stepped=True)
    waits = []

    def produce(groups: int) -> None:
        expected = worker.rollout_buffer.qsize() + groups * generations
        worker.allow(groups * generations)
        deadline = time.monotonic() + 60
        while worker.rollout_buffer.qsize() < expected:
            assert time.monotonic() < deadline, "the stepped worker did not make its samples"
            time.sleep(0.01)
        waits.append(groups)
        # made with the weights loaded now: the generating policy's log-probs, teacher-forced
        for prompt, tokens, logps, _ in worker.generator.turns[-groups * generations:]:
            ids = torch.tensor([prompt + tokens])
            with torch.no_grad():
                logits = worker.generator.model(ids).logits[0, len(prompt) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(logps), want, atol=1e-5, rtol=0)

    class Schedule(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            produce(lead)

        def on_step_end(self, *args, **kwargs):
            produce(per_step)

    max_staleness = 1
    args = TreeAsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=4, learning_rate=5e-2,
                               per_device_train_batch_size=4, num_generations=generations, max_completion_length=6,
                               token_budget=40, report_to="none", save_strategy="no", logging_steps=1, use_cpu=True,
                               bf16=False, max_staleness=max_staleness, disable_tqdm=True, seed=0)
    trainer = TreeAsyncGRPOTrainer(model, short_answers, args, train_dataset=prompts, processing_class=tok,
                                   rollout_worker=worker, weight_transfer=worker.weight_transfer)
    calls = []

    def give_up_after_a_minute(stale_after_s):  # called every 5 s the queue stays empty
        calls.append(1)
        assert len(calls) < 12, "the trainer waited a minute for samples"

    worker.check_health = give_up_after_a_minute
    trainer.add_callback(Schedule())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4
    staleness = [h["sample/staleness_max"] for h in logs if h.get("sample/staleness_max") is not None]
    assert max(staleness) == max_staleness  # stale samples did arrive and were trained, within the bound
    assert sum(h.get("sample/dropped_stale_total") or 0 for h in logs) > 0  # beyond it, dropped
    # the weights each turn was sampled with: every sync's, the later samples with newer ones
    versions = [loads for *_, loads in worker.generator.turns]
    assert versions == sorted(versions) and len(set(versions)) > 2


def test_local_worker_runs_the_tool_loop(tmp_path):
    """TRL's tool loop through the local worker: a turn that calls a tool gets the tool's answer back
    as a message, the conversation goes on, and the samples train the generated turns, not the
    tool's output (a generator scripted to call the tool first, then answer). The toy chat template
    renders the tool-call turn back as it was generated (``<tool_call>`` JSON), so the history
    need not fork; where a template changes it, stock's reconciler forks (``fork_threshold_tokens=0``)
    and the call trains in the row it forked from — the assertions hold either way."""
    from accelerate import PartialState
    from datasets import Dataset

    from trl_tree.data.tiny import tiny_model
    from trl_tree.data.toy import chat_tokenizer
    from trl_tree.trainers.asynchronous.local_rollout import LocalRolloutWorker

    tok = chat_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    looked_up = []

    def lookup(key: str) -> str:
        """The value stored under a key.

        Args:
            key: the key
        """
        looked_up.append(key)
        return f"value of {key}"

    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"what is {w}?"}] for w in ("alpha", "beta")]})
    generations = 2
    worker = LocalRolloutWorker(model, tok, prompts, [short_answers], eos_token_ids=[tok.eos_token_id],
                                num_generations=generations, max_tokens=80, max_inflight_tasks=generations,
                                tools=[lookup], fork_threshold_tokens=0)
    call = tok.encode('<tool_call>{"name": "lookup", "arguments": {"key": "alpha"}}</tool_call>',
                      add_special_tokens=False)
    answer = tok.encode("it is alpha.", add_special_tokens=False)

    def scripted(prompt_ids):  # call the tool until its answer is in the conversation, then answer
        text = tok.decode(prompt_ids)
        tokens = (answer if "value of" in text else call) + [tok.eos_token_id]
        return tokens, [-1.0] * len(tokens)

    worker.generator.sample = scripted
    PartialState(cpu=True)  # stock's loop logs through Accelerate (the trainer would have made it)
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while worker.rollout_buffer.qsize() < generations:
            assert time.monotonic() < deadline, "the local worker made no samples"
            worker.check_health(60)
            time.sleep(0.01)
    finally:
        worker.stop()
    assert looked_up and set(looked_up) == {"alpha"}
    samples = []
    while not worker.rollout_buffer.empty():
        samples.append(worker.rollout_buffer.get_nowait())
    # the tool-call turn is trained too, in the row the re-rendered history forked from
    assert any(_contains([int(t) for i, t in enumerate(s.input_ids) if s.completion_mask[i]], call) for s in samples)
    samples = [s for s in samples if _contains([int(t) for t in s.input_ids], answer)]
    assert len(samples) >= generations
    for sample in samples:
        ids = [int(t) for t in sample.input_ids]
        trained = {i for i, m in enumerate(sample.completion_mask) if m}
        found = tok.encode("value of alpha", add_special_tokens=False)
        starts = [i for i in range(len(ids)) if ids[i : i + len(found)] == found]
        assert starts  # the tool's answer went back into the conversation
        tool_output = set(range(starts[0], starts[0] + len(found)))
        assert not tool_output & trained  # the tool's output is not trained
        assert {i for i in range(len(ids) - len(answer) - 1, len(ids))} <= trained  # the final answer is


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))
