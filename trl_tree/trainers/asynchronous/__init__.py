"""TRL's asynchronous GRPO on the tree engine: rollouts streamed in, trie rows, the fused forward.

Imported only when asked for (``trl_tree.TreeAsyncGRPOTrainer``): it needs TRL's experimental module.
"""
