"""The engine objects (``trl_tree/distributed/strategy.py``) on one process: which one a launch gets, that a
micro-step's state is given back when its body raises (no reduction, no step, nothing left held), the
DeepSpeed settings its one reduction per step cannot run refused at construction, a DeepSpeed engine
told by type (subclasses too) and read again after a new ``train()``, ZeRO-3's start-of-forward hook
put back first, and the trainers free of per-engine branches."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch

from trl_tree.distributed import deepspeed as zero
from trl_tree.distributed import strategy as strategies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def accelerator(kind: str = "NO", processes: int = 1, fsdp2: bool = False, stage: int | None = None,
                config: dict | None = None, mixed_precision: str = "no", sync: bool = True):
    plugin = SimpleNamespace(zero_stage=stage, deepspeed_config=config or {}) if stage is not None else None
    return SimpleNamespace(distributed_type=SimpleNamespace(value=kind), num_processes=processes, is_fsdp2=fsdp2,
                           state=SimpleNamespace(deepspeed_plugin=plugin), mixed_precision=mixed_precision,
                           sync_gradients=sync, device=torch.device("cpu"))


def test_each_launch_gets_its_engine_object():
    assert isinstance(strategies.strategy_for(accelerator()), strategies.Replicated)
    ddp = strategies.strategy_for(accelerator("MULTI_GPU", 2))
    assert isinstance(ddp, strategies.Replicated) and ddp.name == "DDP" and ddp.averages_by_hand
    assert isinstance(strategies.strategy_for(accelerator("FSDP", 2)), strategies.FSDP1)
    fsdp2 = strategies.strategy_for(accelerator("FSDP", 2, fsdp2=True))
    assert isinstance(fsdp2, strategies.FSDP2) and fsdp2.fills_ranks and not fsdp2.averages_by_hand
    ds = strategies.strategy_for(accelerator("DEEPSPEED", 2, stage=3))
    assert isinstance(ds, strategies.DeepSpeedZeRO) and ds.name == "DeepSpeed ZeRO-3" and ds.collective_save


class _Recorder:
    """A DeepSpeed step reduction and a ZeRO-3 holder that record what was done to them."""

    def __init__(self, engine):
        self.engine, self.calls, self.held = engine, [], False

    def start(self):
        self.calls.append("start")

    def fill_missing(self):
        self.calls.append("fill")

    def finish(self):
        self.calls.append("finish")

    def abandon(self):
        self.calls.append("abandon")

    def hold(self):
        self.held = True

    def release(self):
        self.held = False
        self.calls.append("release")


def _deepspeed_strategy(monkeypatch, sync=True):
    engine = object()
    acc = accelerator("DEEPSPEED", 2, stage=3, sync=sync)
    acc.deepspeed_engine_wrapped = SimpleNamespace(engine=engine)
    monkeypatch.setattr(zero, "defer_steps", lambda accelerator: None)
    monkeypatch.setattr(zero, "StepReduction", _Recorder)
    strategy = strategies.DeepSpeedZeRO(acc, 3)
    holder = _Recorder(engine)
    strategy._whole[id(engine)] = holder
    return strategy, acc, holder


def test_a_micro_step_that_raises_gives_back_its_state_without_stepping(monkeypatch):
    strategy, acc, holder = _deepspeed_strategy(monkeypatch)
    with pytest.raises(FloatingPointError):
        with strategy.micro_step():
            holder.hold()
            raise FloatingPointError("non-finite loss")
    assert strategy._reduction.calls == ["start", "abandon"]  # the block closed, no reduction, no step
    assert not holder.held, "ZeRO-3's parameters were left gathered (and the engine's hooks removed)"
    # the next micro-step starts clean and closes the step as usual
    with strategy.micro_step():
        holder.hold()
    assert strategy._reduction.calls == ["start", "abandon", "start", "fill", "finish"] and not holder.held


def test_a_micro_step_inside_the_step_leaves_the_reduction_open(monkeypatch):
    strategy, acc, holder = _deepspeed_strategy(monkeypatch, sync=False)
    with strategy.micro_step():
        holder.hold()
    assert strategy._reduction.calls == ["start"] and holder.held  # held through the step's micro-steps


def test_a_new_engine_gets_a_new_reduction(monkeypatch):
    """A second ``train()`` builds a new DeepSpeed engine: the step's reduction follows it."""
    strategy, acc, _ = _deepspeed_strategy(monkeypatch, sync=False)
    strategy.begin_micro_step()
    first = strategy._reduction
    acc.deepspeed_engine_wrapped = SimpleNamespace(engine=object())
    strategy.begin_micro_step()
    assert strategy._reduction is not first and strategy._reduction.engine is acc.deepspeed_engine_wrapped.engine


def test_fsdp2_reduces_what_waits_once_and_drops_it_after_an_error(monkeypatch):
    reduced = []
    monkeypatch.setattr(strategies.fsdp, "fsdp_modules", lambda model: [model])
    monkeypatch.setattr(strategies.fsdp, "reduce_gradients", lambda model, device: reduced.append(model))
    strategy = strategies.FSDP2(accelerator("FSDP", 1, fsdp2=True))
    policy, value_model = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    with strategy.micro_step():  # one process: the separate critic is reduced too
        strategy.backward_done(policy)
        strategy.backward_done(value_model)
        strategy.backward_done(policy)
    assert reduced == [policy, value_model]
    with pytest.raises(RuntimeError):
        with strategy.micro_step():
            strategy.backward_done(policy)
            raise RuntimeError("boom")
    assert not strategy.pending and reduced == [policy, value_model]


def test_deepspeed_settings_without_a_reduction_block_are_refused_at_construction():
    pytest.importorskip("deepspeed")
    assert zero.missing_support(accelerator("DEEPSPEED", 2, stage=2)) is None
    assert "stage 0" in zero.missing_support(accelerator("DEEPSPEED", 2, stage=0))
    bf16_zero1 = accelerator("DEEPSPEED", 2, stage=1, mixed_precision="bf16",
                             config={"data_types": {"grad_accum_dtype": "fp32"}})
    assert "BF16_Optimizer" in zero.missing_support(bf16_zero1)
    assert zero.missing_support(accelerator("DEEPSPEED", 2, stage=2, mixed_precision="bf16",
                                            config={"data_types": {"grad_accum_dtype": "fp32"}})) is None
    for key in ("offload_optimizer", "offload_param"):  # ZeRO-Offload: refused, naming what to drop
        offloaded = accelerator("DEEPSPEED", 2, stage=3, config={"zero_optimization": {key: {"device": "cpu"}}})
        assert key in zero.missing_support(offloaded)
    kept = accelerator("DEEPSPEED", 2, stage=3, config={"zero_optimization": {"offload_param": {"device": "none"}}})
    assert zero.missing_support(kept) is None


def test_fsdp_cpu_offload_is_refused_at_construction():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from trl_tree.distributed import fsdp

    assert fsdp.offload_refusal(SimpleNamespace(cpu_offload=OffloadPolicy())) is None  # Accelerate's "no offload"
    assert fsdp.offload_refusal(None) is None
    assert "fsdp_offload_params" in fsdp.offload_refusal(SimpleNamespace(cpu_offload=CPUOffloadPolicy()))
    strategy = strategies.FSDP2(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(
        cpu_offload=CPUOffloadPolicy()))))
    assert "CPU offload" in strategy.refusal(SimpleNamespace(tree_gather="auto", tree_mode="packed"))


def test_a_deepspeed_engine_is_told_by_type_subclasses_too():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.engine import DeepSpeedEngine

    class MyEngine(DeepSpeedEngine):
        def __init__(self):  # not built: the type is what is asked
            pass

    assert zero.is_engine(MyEngine())
    assert not zero.is_engine(SimpleNamespace(module=torch.nn.Linear(1, 1)))


def test_zero3_start_hook_goes_back_first():
    """DeepSpeed registers its start-of-forward hook before the module's fetch hook; put back after TRL's
    ``add_hooks`` re-registered the fetch hook, it must run first again."""
    module = torch.nn.Linear(2, 2)
    order = []

    def start(mod, args):
        order.append("start")

    def fetch(mod, args):
        order.append("fetch")

    handle = module.register_forward_pre_hook(start)
    offload = SimpleNamespace(module=module, fwd_pre_hook=handle)
    engine = SimpleNamespace(optimizer=SimpleNamespace(parameter_offload=offload))
    taken = zero._take_start_hook(engine)
    module.register_forward_pre_hook(fetch)  # what add_hooks does
    zero._put_back_start_hook(taken)
    module(torch.ones(1, 2))
    assert order == ["start", "fetch"]


def test_the_trainers_hold_no_per_engine_branches():
    """Where the model lives is the strategy's business: no trainer asks which engine runs it."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "trl_tree", "trainers")):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                found += [f"{name}: {m}" for m in re.findall(r"_fsdp2\(\)|_zero_stage\(\)|_fsdp1\(\)|_sharded\(\)", text)]
    assert not found, found


def test_fsdp2_support_is_checked_at_construction():
    """This torch's FSDP2 has what the tree's calls use (the public setters and the few private
    names, each in distributed/fsdp.py), or the trainer refuses naming the version to install."""
    from trl_tree.distributed import fsdp

    assert fsdp.missing_support() is None
    from torch.distributed.fsdp import FSDPModule

    saved = FSDPModule.set_reshard_after_forward
    try:
        del FSDPModule.set_reshard_after_forward
        why = fsdp.missing_support()
    finally:
        FSDPModule.set_reshard_after_forward = saved
    assert "set_reshard_after_forward" in why and f"torch>={fsdp.TORCH_FLOOR}" in why


def test_ppo_refuses_a_trainer_without_the_hooks_its_critic_needs(monkeypatch):
    """TreePPOTrainer overrides three private Trainer methods; a transformers without one is refused at
    construction instead of training an unclipped or unsaved critic."""
    import transformers

    from trl_tree.trainers.online import ppo

    ppo._check_trainer_hooks()
    monkeypatch.delattr(transformers.Trainer, "_clip_grad_norm")
    with pytest.raises(ValueError, match="_clip_grad_norm"):
        ppo._check_trainer_hooks()


def test_the_gathering_is_chosen_forced_or_refused():
    """``tree_gather``: forced either way; 'auto' holds the model whole where no free-memory reading
    exists (a CPU); a wrong value, and 'block' under ZeRO-3 (block by block is FSDP2's) or with a walk
    that keeps its pushes' graphs, refused naming why."""
    from trl_tree.distributed import gathering

    cpu = torch.device("cpu")
    assert gathering.choose("block", 10, 0, cpu).block
    assert not gathering.choose("whole", 10, 0, cpu).block
    auto = gathering.choose("auto", 1 << 30, 0, cpu)
    assert not auto.block and "1.00 GiB" in auto.reason and "tree_gather='block'" in auto.reason
    with pytest.raises(ValueError, match="tree_gather must be one of"):
        gathering.choose("layers", 10, 0, cpu)
    args = SimpleNamespace(tree_gather="block", tree_mode="dfs", tree_keep_graph=True)
    pytest.importorskip("deepspeed")
    zero3 = strategies.DeepSpeedZeRO(accelerator("DEEPSPEED", 2, stage=3), 3)
    assert "FSDP2" in zero3.refusal(args)
    assert strategies.DeepSpeedZeRO(accelerator("DEEPSPEED", 2, stage=2), 2).refusal(args) is None
    fsdp2 = strategies.FSDP2(accelerator("FSDP", 2, fsdp2=True), "block")
    assert fsdp2.refusal(SimpleNamespace(tree_gather="auto", tree_mode="dfs", tree_keep_graph=True)) is None
    assert "tree_keep_graph" in fsdp2.refusal(args)


def test_a_gate_sees_each_call_once_and_closes_the_walks_calls():
    """The engine announces every model call to the installed gates, once per gate however many
    nested blocks installed it; inside, a walk must not keep a push's graph across calls."""
    from trl_tree.engine import call_gate

    seen = []

    class Gate:
        def before_call(self, module, grad):
            seen.append((module, grad))

        def sync_point(self):
            seen.append("sync")

    gate, module = Gate(), torch.nn.Linear(1, 1)
    assert not call_gate.calls_close()
    with call_gate.gated(gate), call_gate.gated(gate):
        assert call_gate.calls_close()
        call_gate.before_model_call(module)
        with torch.no_grad():
            call_gate.before_model_call(module)
        call_gate.sync_point()
    call_gate.before_model_call(module)  # no gate any more
    assert seen == [(module, True), (module, False), "sync"]


def test_fsdp2_wraps_only_the_layer_classes_a_model_holds():
    """Qwen3.5's text model lists its vision block among the classes to keep whole (transformers 5.24 shares
    the list with the vision-language model); Accelerate's FSDP2 wrap policy raised for it, stock TRL's
    path included. The FSDP2 strategy narrows the instance's list, and Accelerate's policy then builds."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from trl_tree.data.tiny import tiny_model
    from trl_tree.distributed import fsdp

    model = tiny_model("qwen3_5")
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = SimpleNamespace(auto_wrap_policy=transformer_auto_wrap_policy, transformer_cls_names_to_wrap=None,
                             min_num_params=None)
    if "Qwen3_5VisionBlock" in type(model)._no_split_modules:  # this transformers lists it: Accelerate refuses
        with pytest.raises(ValueError, match="Qwen3_5VisionBlock"):
            fsdp2_prepare_auto_wrap_policy(plugin, model)
    strategy = strategies.FSDP2(SimpleNamespace(device=torch.device("cpu")))
    strategy.prepare_model(model)
    assert model._no_split_modules == ["Qwen3_5DecoderLayer"]
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)  # builds now
    wrapped = [type(m).__name__ for m in model.modules() if policy(m)]  # (Accelerate < 1.12: read from the plugin)
    assert set(wrapped) <= {"Qwen3_5DecoderLayer"}
    assert fsdp.wrap_only_present_layers(model) is None  # nothing more to drop
    dense = tiny_model("qwen2")
    listed = list(dense._no_split_modules)
    assert fsdp.wrap_only_present_layers(dense) is None and list(dense._no_split_modules) == listed


def test_zero3_warns_where_holding_the_model_whole_would_not_fit(monkeypatch):
    """Under ZeRO-3 the tree holds the model whole through a step's calls; where the whole parameters and their
    gradients take more than tree_gather's share of the free GPU memory, it says so (naming FSDP2's block by
    block) before the step runs out of memory, and not where they fit."""
    import warnings

    module = torch.nn.Linear(1024, 1024)  # 4 MiB of fp32 weights, 4 MiB of gradients
    engine = SimpleNamespace(module=module)
    strategy = strategies.DeepSpeedZeRO(SimpleNamespace(device=torch.device("cuda", 0)), stage=3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 << 20, 80 << 30))  # 10 MiB free
    with pytest.warns(UserWarning, match="may run out of memory.*FSDP2"):
        chosen = strategy._held_whole(engine)
    assert not chosen.block and "would not fit" in chosen.reason
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 << 30, 80 << 30))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = strategy._held_whole(engine)
    assert not chosen.block and "held whole" in chosen.reason
