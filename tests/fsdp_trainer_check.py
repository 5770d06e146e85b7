"""Run under ``accelerate launch`` with ``examples/accelerate/fsdp2.yaml`` and 2 CPU processes
(tests/test_fsdp.py does): the tree trainers with their model prepared by Accelerate's own FSDP2
code (``fully_shard`` per decoder layer and at the root, its mixed-precision policy, its
parameter upcast), on the fixed rollouts of ``ddp_check.main_windows``.

One part of Accelerate's preparation cannot run on a CPU: its state turns an FSDP launch into
``MULTI_CPU`` when no accelerator is visible, so the FSDP plugin is dropped. ``emulate_fsdp2_on_cpu``
reproduces that one step by hand — the distributed type becomes FSDP with the plugin built from
the launcher's environment and the run's mixed precision, exactly as ``AcceleratorState`` does on
a GPU — and everything after it (``Accelerator.prepare`` → ``fsdp2_prepare_model``, autocast,
the trainer) is Accelerate's and the trainer's own code.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import ddp_check  # noqa: E402

#: (algorithm, tree_mode, tree_window, extra config, tag): the tree modes docs/multi_gpu.md lists for FSDP2
RUNS = (
    ("grpo", "off", "auto", {}, ""),
    ("grpo", "packed", "micro_step", {}, ""),
    ("grpo", "packed", "micro_step", {"tree_token_budget": 30}, "budget"),
    ("grpo", "dfs", "micro_step", {}, ""),
    ("grpo", "packed", "accumulation", {}, ""),
    ("grpo", "dfs", "accumulation", {}, ""),
)
#: under Accelerate's ``mixed_precision: bf16``: stock (the bf16 rule's baseline) and the tree's paths
BF16_RUNS = (
    ("grpo", "off", "auto", {}, ""),
    ("grpo", "packed", "micro_step", {}, ""),
    ("grpo", "dfs", "accumulation", {}, ""),
    ("grpo", "packed", "accumulation", {"tree_token_budget": 64}, "budget"),
)


def emulate_fsdp2_on_cpu() -> None:
    """Make ``AcceleratorState`` take the FSDP branch it takes on a GPU (see the module docstring)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    original = AcceleratorState.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU and os.environ.get("ACCELERATE_USE_FSDP") == "true":
            plugin = kwargs.get("fsdp_plugin") or FullyShardedDataParallelPlugin()
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    AcceleratorState.__init__ = init


def main(checkpoint: str, out_dir: str) -> None:
    emulate_fsdp2_on_cpu()
    for algo, mode, window, extra, tag in RUNS:
        ddp_check.train_window_run(checkpoint, out_dir, algo, None, mode, window, tag=f"fsdp{'-' + tag if tag else ''}",
                                   **extra)
    for algo, mode, window, extra, tag in BF16_RUNS:
        ddp_check.train_window_run(checkpoint, out_dir, algo, None, mode, window,
                                   tag=f"fsdp-bf16{'-' + tag if tag else ''}", dtype=torch.float32, bf16=True, **extra)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort an orderly interpreter exit ("terminate called ..."); all is saved
