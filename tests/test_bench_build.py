"""The benchmarks' random model built on the main process only (``bench.common.build_random_model``,
the path a 30B model takes under FSDP2): the other processes' model must reach Accelerate's FSDP2
preparation with its own storage per parameter (Accelerate maps the optimizer's parameters to the
shards by storage address — on the meta device every parameter shares one, and one shard got every
update) and the same non-persistent buffers as the main process's (they are not broadcast)."""

import torch

from trl_tree.bench.common import build_random_model, rank0_builds
from trl_tree.data.tiny import shaped_config, tiny_config


def test_the_other_processes_model_has_distinct_storage_and_the_main_process_buffers(monkeypatch):
    for config in (tiny_config("qwen2"), shaped_config("30b-a3b", num_hidden_layers=1, num_experts=4, vocab_size=64)):
        monkeypatch.setenv("RANK", "0")
        torch.manual_seed(0)
        main = build_random_model(config, torch.bfloat16, torch.device("cpu"), main_only=True)
        monkeypatch.setenv("RANK", "1")
        other = build_random_model(config, torch.bfloat16, torch.device("cpu"), main_only=True)
        params = list(other.parameters())
        assert len({p.data_ptr() for p in params}) == len(params) and not any(p.is_meta for p in params)
        # fp32: Accelerate's upcast for mixed precision then copies nothing (the pages are never touched)
        assert {p.dtype for p in params} == {torch.float32} and {p.dtype for p in main.parameters()} == {torch.bfloat16}
        buffers = dict(main.named_buffers())
        assert buffers and all(torch.equal(b, buffers[n]) for n, b in other.named_buffers())
        assert [n for n, _ in other.named_parameters()] == [n for n, _ in main.named_parameters()]


def test_only_fsdp2_launches_with_cpu_efficient_loading_build_on_the_main_process_alone(monkeypatch):
    config = tiny_config("qwen2")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not rank0_builds(config, "on")  # not an FSDP launch: every process builds its own
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    assert rank0_builds(config, "on") and not rank0_builds(config, "off")
    assert not rank0_builds(config, "auto")  # no GPU here: nothing to run out of
