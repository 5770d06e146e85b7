"""Configs of the tree trainers: TRL's own configs plus the tree fields of DESIGN.md.

The fields live in one mixin dataclass so ``TreeGRPOConfig`` and ``TreeRLOOConfig`` cannot drift
apart; each config is ``(TRL config, TreeArguments)`` and accepts every argument TRL's does.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from trl import DPOConfig, GRPOConfig, RLOOConfig, SFTConfig

from ..distributed.gathering import GATHERINGS
from ..engine.options import TreeOptions

TREE_MODES = ("packed", "dfs", "off")
#: the CPU default of ``_default_to_cpu`` was announced (once per process)
_CPU_DEFAULT_SAID = False
TREE_SHUFFLES = ("auto", "groups", "rows")
TREE_WINDOWS = ("auto", "accumulation", "micro_step")
ATTN_BACKENDS = ("auto", "flash", "torch_flash", "flex", "sdpa", "eager")


@dataclass
class TreeArguments:
    """Where and how the policy's log-probs go through the prefix tree."""

    tree_mode: str = field(
        default="packed",
        metadata={
            "help": "'packed': one forward+backward over each micro-batch's unique tokens (fastest; activations ~ "
            "unique tokens). 'dfs': a depth-first walk with a K/V stack, memory bounded by the longest "
            "sequence (the engine runs the backward; see docs/trainers.md). 'off': exactly TRL's trainer."
        },
    )
    tree_shuffle: str = field(
        default="auto",
        metadata={
            "help": "How a generation batch is cut into micro-batches. 'auto' (default): stock TRL's update in every "
            "configuration — the prompt groups are kept whole in a micro-batch only where that cannot change it "
            "(one optimizer step per generation batch and a loss that sums over micro-batches whatever rows meet: "
            "not 'bnpo', the entropy bonus or mask, the MoE auxiliary loss, or PPO's value loss), else TRL's own "
            "row shuffle. 'groups' (opt-in, changes the update where 'auto' would not regroup; logged): the prompt "
            "groups are always kept whole, for the sharing. 'rows': always TRL's own row shuffle. All three draw "
            "TRL's random permutation, so later rollouts are stock's (see docs/trainers.md)."
        },
    )
    tree_window: str = field(
        default="auto",
        metadata={
            "help": f"Which rows one set of trees covers, one of {TREE_WINDOWS}. 'micro_step': each micro-batch's "
            "rows, on the rank that holds them. 'accumulation': every row of one gradient-accumulation window (the "
            "micro-steps that share parameters) on all processes, cut into whole trees, each computed on one rank "
            "balanced by cost; per-token log-probs and loss gradients move between ranks, the backward runs once at "
            "the window's last micro-step (trl_tree.distributed.window). 'auto': 'accumulation' where the cost model "
            "says it costs the busiest rank less (it counts the extra forward of the two-pass backward)."
        },
    )
    tree_attn_backend: str = field(
        default="auto",
        metadata={"help": f"Tree attention kernel, one of {ATTN_BACKENDS}. 'auto': on GPU FlashAttention-4 "
                  "(flash-attn-4) where it was measured faster — calls replaying CUDA graphs, and eager calls of "
                  "models at least 1536 wide (packed) or 3584 (dfs) — else PyTorch's FlashAttention varlen (cuDNN "
                  "for dense blocks), else flex; sdpa on CPU. 'flash': flash-attn (FA4 on every tree path; FA2 "
                  "packed only)."},
    )
    tree_token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Largest number of unique tokens one tree call may hold. Set, it (1) spreads prompt groups over "
            "the micro-batches by unique-token cost and (2) cuts a heavier micro-batch into several calls whose "
            "backward runs one after another, so peak memory follows the budget. None: one call per micro-batch."
        },
    )
    tree_chunk_size: int | None = field(
        default=None,
        metadata={"help": "dfs mode: most tokens one step of the walk runs (long nodes are cut into chunks, small "
                  "sibling subtrees grouped up to it). None: whole nodes, and sibling subtrees grouped as far as a call "
                  "stays within one forward+backward of the longest sequence (trl_tree.engine.cost_model.GroupBudget)."},
    )
    tree_memory_budget: int | None = field(
        default=None,
        metadata={"help": "dfs mode without tree_chunk_size: activation bytes one call of the walk may use when "
                  "sibling subtrees are grouped. None: one forward+backward of the longest sequence (the DFS "
                  "memory bound), or 5% of the GPU's memory where that is larger (cost_model.walk_unit_floor). "
                  "Larger: fewer, faster calls (the walk is launch-bound on small models)."},
    )
    tree_keep_graph: bool | None = field(
        default=None,
        metadata={"help": "dfs mode: keep each node's graph on the way down instead of recomputing it on the way "
                  "up (one forward less per inner node; memory of the whole path). None: keep it when the model "
                  "uses gradient checkpointing (the kept graph is then only each layer's input)."},
    )

    tree_keep_attention: bool = field(
        default=True,
        metadata={"help": "under gradient checkpointing: keep each layer's attention output and "
                  "log-sum-exp from the forward so the recompute skips the attention kernels (the same gradients, a "
                  "little faster, more on deep trees) for one hidden-sized tensor per unique token and "
                  "layer; in packed mode every call, in dfs mode the walk's units where the memory model says "
                  "they still fit with them. False: recompute the attention, as TRL does."},
    )
    tree_compile_layers: bool = field(
        default=False,
        metadata={"help": "torch.compile every decoder layer's attention module, MLP and norms "
                  "(trl_tree.compile_layers; the tree attention stays eager between the graphs; with tree_mode='off', "
                  "TRL's own step on compiled layers). Pays where the GPU is the bottleneck (large models); little or "
                  "nothing on small models whose tree steps wait on the host (docs/benchmarks/README.md). The first "
                  "steps compile."},
    )
    tree_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "Replay CUDA graphs of the packed training forward and backward (trl_tree.engine.graphs) for "
                  "micro-batch layouts seen before (captured at the second sighting; the loss stays eager); in dfs "
                  "mode, of every unit of the walk whose shape was seen before (trl_tree/engine/dfs/graphs.py: one process, "
                  "tree_keep_graph not True). Pays "
                  "where the host is the bottleneck (small models; docs/benchmarks/README.md, CUDA graphs) and only "
                  "when layouts repeat (num_iterations > 1, fixed-length rollouts). Under DDP the call "
                  "runs outside the wrapper and the gradients are averaged by hand (not FSDP/DeepSpeed). Costs one "
                  "gradient-sized buffer and the graphs' activation pool."},
    )
    tree_overlap_reduction: bool = field(
        default=True,
        metadata={"help": "Several processes under DDP, where the tree's own backward (dfs, tree_token_budget, "
                  "accumulation windows, PPO's critic) averages the gradients by hand: start each bucket's "
                  "all-reduce as soon as the step's last backward has made its gradients final, as DDP's reducer "
                  "does, instead of after the whole backward (distributed/grad_sync.py). The same update either way; "
                  "False is for comparing the two."},
    )
    tree_gather: str = field(
        default="auto",
        metadata={"help": f"Under FSDP2, how the sharded model is gathered for the tree's calls, one of {GATHERINGS}. "
                  "'whole': once per step and kept whole through the step's calls (no collective inside them; the "
                  "fastest where the whole model's weights fit beside the training state). 'block': one block at a "
                  "time inside each call by FSDP2's own per-block hooks, as stock FSDP2 does (the ranks' calls are "
                  "lined up, a rank with fewer calls making one-token "
                  "stand-in calls): the memory of stock's, every call paying its gathers. 'auto': 'whole' where the "
                  "whole model with the state the step still allocates takes at most 60% of the free accelerator "
                  "memory, else 'block' (logged once per model; trl_tree/distributed/gathering.py). The same update "
                  "either way. DeepSpeed ZeRO-3 holds the model whole ('block' is refused there); ignored "
                  "without a sharded engine."},
    )
    tree_one_pass: bool = field(
        default=True,
        metadata={"help": "GRPO, PPO and RLOO: where the policy loss is a sum of per-token terms (GRPO's with "
                  "token-level importance sampling; not VESPO, the off-policy or entropy mask, the entropy bonus or "
                  "the MoE auxiliary loss) or of per-sequence terms (RLOO's), the tree's own backward (dfs, "
                  "tree_token_budget, accumulation windows) computes each term's gradient as it scores the tokens: "
                  "one forward and one backward, instead of a forward first and then TRL's loss gradient walked "
                  "back (trainers/online/separable_loss.py). The same update; False is for comparing the two. Logged as "
                  "tree/passes."},
    )
    tree_cuda_graph_buckets: bool = field(
        default=False,
        metadata={"help": "With tree_cuda_graphs: micro-batch layouts that do not repeat (free-length completions) "
                  "replay the graphs of their layout padded to buckets (up to 12.5% more tokens, keys and "
                  "predictions; trl_tree/engine/attention/buckets.py); in dfs mode, the walk's units padded to buckets "
                  "(trl_tree/engine/dfs/buckets.py). Pays where the host is the bound (small models with "
                  "free-length completions); on larger models the padding costs more than it saves "
                  "(docs/benchmarks/README.md, CUDA graphs)."},
    )

    def tree_options(self) -> TreeOptions:
        """The engine's ``TreeOptions`` these fields map to (the knobs of every tree call)."""
        return TreeOptions(
            attn_backend=self.tree_attn_backend,
            chunk_size=self.tree_chunk_size,
            memory_budget=self.tree_memory_budget,
            keep_graph=self.tree_keep_graph,
            keep_attention=self.tree_keep_attention,
            cuda_graphs=("buckets" if self.tree_cuda_graph_buckets else True) if self.tree_cuda_graphs else False,
        )

    def _default_to_cpu(self) -> None:
        """On a machine with no accelerator, train on the CPU in fp32 unless told otherwise. TRL's
        configs default to bf16, which transformers refuses there until ``use_cpu=True`` is set;
        only an explicit ``bf16=True`` keeps CPU autocast. Said once (a warning in the log), since it
        changes a setting the user did not pass."""
        import torch

        if self.use_cpu or torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()) \
                or torch.backends.mps.is_available():
            return
        self.use_cpu = True
        if self.bf16 is None and not self.fp16:
            self.bf16 = False
        global _CPU_DEFAULT_SAID
        if not _CPU_DEFAULT_SAID:  # a setting changed for the user: said once per process, visibly
            _CPU_DEFAULT_SAID = True
            logging.getLogger(__name__).warning(
                "%s: no GPU found, so use_cpu=True and fp32 (TRL's default bf16 does not run on the CPU); pass "
                "use_cpu=True to choose this yourself, or bf16=True for CPU autocast", type(self).__name__)

    def _check_tree_fields(self) -> None:
        if self.tree_mode == "auto":
            raise ValueError(
                "tree_mode must be one of ('packed', 'dfs', 'off'), got 'auto'. The engine's mode='auto' "
                "(tree_logprobs/tree_backward) chooses per call by memory; a trainer cannot, because its backward "
                "path is fixed per mode (packed: one autograd pass; dfs: the engine's own walk). Run "
                "'trl-tree inspect' on your rollouts to see each mode's predicted memory, then pick one: 'packed' "
                "(fastest; with tree_token_budget to bound memory) or 'dfs' (memory of the longest sequence)"
            )
        if self.tree_mode not in TREE_MODES:
            raise ValueError(f"tree_mode must be one of {TREE_MODES}, got {self.tree_mode!r}")
        if self.tree_shuffle not in TREE_SHUFFLES:
            raise ValueError(f"tree_shuffle must be one of {TREE_SHUFFLES}, got {self.tree_shuffle!r}")
        if self.tree_window not in TREE_WINDOWS:
            raise ValueError(f"tree_window must be one of {TREE_WINDOWS}, got {self.tree_window!r}")
        if self.tree_gather not in GATHERINGS:
            raise ValueError(f"tree_gather must be one of {GATHERINGS}, got {self.tree_gather!r}")
        if self.tree_attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"tree_attn_backend must be one of {ATTN_BACKENDS}, got {self.tree_attn_backend!r}")
        for name in ("tree_token_budget", "tree_chunk_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        budget = self.tree_memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"tree_memory_budget must be a non-negative int (bytes) or None, got {budget!r}")
        if self.tree_keep_graph not in (None, True, False):
            raise ValueError(f"tree_keep_graph must be True, False or None, got {self.tree_keep_graph!r}")
        if self.tree_keep_graph and self.tree_cuda_graphs and self.tree_mode == "dfs":
            raise ValueError("tree_keep_graph=True keeps a pushed node's graph across its subtree, which the walk's "
                             "replayed units cannot (tree_cuda_graphs=True); leave tree_keep_graph at None")
        for name in ("tree_keep_attention", "tree_compile_layers", "tree_cuda_graphs", "tree_cuda_graph_buckets",
                     "tree_overlap_reduction", "tree_one_pass"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


@dataclass
class TreeGRPOConfig(GRPOConfig, TreeArguments):
    """``trl.GRPOConfig`` plus the tree fields of :class:`TreeArguments` (``tree_mode``, ``tree_shuffle``,
    ``tree_window``, ``tree_attn_backend``, ``tree_token_budget``, ``tree_chunk_size``, ``tree_memory_budget``,
    ``tree_keep_graph``, ``tree_keep_attention``, ``tree_compile_layers``, ``tree_cuda_graphs``,
    ``tree_cuda_graph_buckets``)."""

    def __post_init__(self):
        self._check_tree_fields()
        self._default_to_cpu()
        super().__post_init__()


@dataclass
class TreeRLOOConfig(RLOOConfig, TreeArguments):
    """``trl.RLOOConfig`` plus the tree fields of :class:`TreeArguments` (``tree_mode``, ``tree_shuffle``,
    ``tree_window``, ``tree_attn_backend``, ``tree_token_budget``, ``tree_chunk_size``, ``tree_memory_budget``,
    ``tree_keep_graph``, ``tree_keep_attention``, ``tree_compile_layers``, ``tree_cuda_graphs``,
    ``tree_cuda_graph_buckets``)."""

    def __post_init__(self):
        self._check_tree_fields()
        self._default_to_cpu()
        super().__post_init__()


SFT_SHUFFLES = ("rows", "groups", "auto")


@dataclass
class TreeSFTConfig(SFTConfig, TreeArguments):
    """``trl.SFTConfig`` plus the tree fields of :class:`TreeArguments`. In SFT the gain comes from
    which samples meet in a micro-batch, so ``tree_shuffle`` chooses the order of the samples:
    'rows' (default) TRL's own, 'groups' the prefix-aware sampler (``trl_tree.trainers.offline.sft_sampler``).
    ``tree_window`` does not apply (one micro-batch is one set of trees)."""

    tree_shuffle: str = field(
        default="rows",
        metadata={
            "help": "Which samples meet in a micro-batch. 'rows' (default; 'auto' is the same): TRL's own order, "
            "the update bit-for-bit stock's. 'groups' (opt-in: it changes which samples share a step, never a "
            "token's weight): samples that share prefixes are put in the same micro-batch, each seen once per "
            "epoch, reshuffled every epoch, resumable; the trainer logs at construction what it buys on this "
            "dataset (T/U in TRL's order and with groups)."
        },
    )

    def __post_init__(self):
        self._check_tree_fields()
        if self.tree_shuffle not in SFT_SHUFFLES:
            raise ValueError(f"tree_shuffle must be one of {SFT_SHUFFLES} for SFT, got {self.tree_shuffle!r}")
        if self.tree_shuffle == "groups" and self.packing:
            raise ValueError("tree_shuffle='groups' chooses which samples meet, but packing=True fixed the rows before "
                             "any sampler runs; use packing=False (the tree removes the padding's cost where samples "
                             "share prefixes) or tree_shuffle='rows'")
        if self.tree_shuffle == "groups" and getattr(self, "train_sampling_strategy", None) == "group_by_length":
            raise ValueError("tree_shuffle='groups' and train_sampling_strategy='group_by_length' both choose which "
                             "samples meet in a micro-batch; keep one: tree_shuffle='rows' (TRL's sampler, by length) "
                             "or train_sampling_strategy='random' (the tree's grouping by shared prefixes)")
        if self.tree_window == "accumulation":
            raise ValueError("tree_window='accumulation' places an RL generation batch's trees on ranks; SFT's "
                             "micro-batch is its own set of trees. Use tree_shuffle='groups' to bring shared "
                             "prefixes together, and leave tree_window at 'auto'")
        self._default_to_cpu()
        super().__post_init__()


@dataclass
class TreeDPOConfig(DPOConfig, TreeArguments):
    """``trl.DPOConfig`` plus the tree fields of :class:`TreeArguments`. A pair's chosen and rejected
    rows share their prompt in one forest whatever the order; ``tree_shuffle='groups'`` also brings
    the pairs of one prompt into one micro-batch."""

    tree_shuffle: str = field(
        default="rows",
        metadata={"help": "Which pairs meet in a micro-batch. 'rows' (default; 'auto' is the same): TRL's own order, "
                  "the update stock's. 'groups' (opt-in: it changes which pairs share a step, and so the numbers of "
                  "per-micro-batch terms such as 'aot''s sorting): pairs sharing prompts in one micro-batch, each "
                  "once per epoch (the SFT trainer's sampler); the trainer logs what it buys at construction."},
    )

    def __post_init__(self):
        self._check_tree_fields()
        if self.tree_window == "accumulation":
            raise ValueError("tree_window='accumulation' places an RL generation batch's trees on ranks; leave it at "
                             "'auto' for DPO")
        self._default_to_cpu()
        super().__post_init__()


#: TRL 1.12 PPOConfig names -> the GRPOConfig fields they set (``num_mini_batches`` sets
#: ``steps_per_generation = num_mini_batches * gradient_accumulation_steps``)
PPO_ALIASES = {"cliprange": "epsilon", "num_ppo_epochs": "num_iterations", "response_length": "max_completion_length",
               "num_mini_batches": "steps_per_generation"}


@dataclass
class TreePPOConfig(GRPOConfig, TreeArguments):
    """``trl.GRPOConfig`` plus the tree fields and PPO's own: a learned critic, token-level rewards
    with a KL penalty, GAE. TRL 1.12's PPOConfig names are accepted (``cliprange``, ``num_ppo_epochs``,
    ``num_mini_batches``, ``response_length``) and set the GRPOConfig fields they correspond to
    (docs/ppo.md). Defaults follow TRL 1.12's PPO: KL in the reward (``kl_coef``), none in the loss
    (``beta=0``), a token-level loss averaged over each micro-batch (``loss_type="bnpo"``)."""

    loss_type: str = field(
        default="bnpo",
        metadata={"help": "The policy loss's aggregation (GRPOConfig.loss_type); 'bnpo', a mean over the "
                  "micro-batch's tokens, is TRL 1.12 PPO's."},
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "GRPO's KL-to-reference term in the loss; PPO puts its KL in the reward (kl_coef). "
                  "Both may be used."},
    )
    critic: str = field(
        default="separate",
        metadata={"help": "The critic: 'separate' (a value model of its own, a token-classification head on a "
                  "transformers backbone, from the policy's checkpoint unless value_model_path or the trainer's "
                  "value_model says otherwise), 'shared' (a value head on the policy's trunk), 'adapter' (PEFT: a "
                  "second adapter plus a value head on the policy's frozen base). See docs/ppo.md for their cost."},
    )
    value_model_path: str | None = field(
        default=None,
        metadata={"help": "critic='separate': checkpoint of the value model (loaded with "
                  "AutoModelForTokenClassification, num_labels=1). None: the policy's checkpoint."},
    )
    kl_coef: float = field(default=0.05, metadata={"help": "Per-token KL penalty in the reward (TRL 1.12 PPO)."})
    kl_estimator: str = field(
        default="k1",
        metadata={"help": "KL estimator of the reward penalty: 'k1' (log p - log p_ref) or 'k3' (non-negative, "
                  "lower variance)."},
    )
    cliprange: float | None = field(
        default=None, metadata={"help": "TRL 1.12 name of epsilon, the policy ratio's clip range."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value loss around old values."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss in the total loss."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE."})
    lam: float = field(default=0.95, metadata={"help": "GAE's lambda for the policy's advantages."})
    critic_lam: float | None = field(
        default=None, metadata={"help": "GAE's lambda for the critic's returns; None: lam."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the token rewards (mean kept)."})
    whiten_advantages: bool = field(
        default=True, metadata={"help": "Whiten the advantages over the generation batch (TRL 1.12 PPO always did)."})
    num_ppo_epochs: int | None = field(
        default=None, metadata={"help": "TRL 1.12 name of num_iterations: passes over each rollout batch."})
    num_mini_batches: int | None = field(
        default=None,
        metadata={"help": "TRL 1.12 name: optimizer steps per pass over a rollout batch; sets steps_per_generation "
                  "= num_mini_batches * gradient_accumulation_steps."},
    )
    response_length: int | None = field(
        default=None, metadata={"help": "TRL 1.12 name of max_completion_length."})
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtracted from the score of a completion without an EOS token."})
    critic_warmup_steps: int = field(
        default=0,
        metadata={"help": "Optimizer steps at the start in which only the critic trains (the policy is not updated; "
                  "with critic='shared' only the value head trains)."},
    )
    critic_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the critic's parameter group; None: learning_rate."})

    def __post_init__(self):
        self._check_tree_fields()
        self._default_to_cpu()
        self._check_ppo_fields()
        self._apply_ppo_aliases()
        one_generation = self.num_generations == 1
        try:
            super().__post_init__()
        except ValueError as err:  # GRPO needs groups for its advantages; PPO's critic does not
            if not (one_generation and "at least 2 generations" in str(err)):
                raise

    def _check_ppo_fields(self) -> None:
        from .online.advantages import KL_ESTIMATORS
        from .online.critic import CRITIC_KINDS

        if self.critic not in CRITIC_KINDS:
            raise ValueError(f"critic must be one of {CRITIC_KINDS}, got {self.critic!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        for name in ("gamma", "lam") + (("critic_lam",) if self.critic_lam is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        for name in ("vf_coef", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.cliprange_value <= 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value}")
        if not isinstance(self.critic_warmup_steps, int) or self.critic_warmup_steps < 0:
            raise ValueError(f"critic_warmup_steps must be a non-negative int, got {self.critic_warmup_steps!r}")
        if self.num_generations is not None and self.num_generations < 1:
            raise ValueError(f"num_generations must be at least 1, got {self.num_generations}")
        if self.critic_learning_rate is not None and self.critic_learning_rate <= 0:
            raise ValueError(f"critic_learning_rate must be > 0, got {self.critic_learning_rate}")

    def _apply_ppo_aliases(self) -> None:
        """Set the GRPOConfig fields from TRL 1.12's names; refuse the two names set to different values."""
        defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        for old, new in PPO_ALIASES.items():
            value = getattr(self, old)
            if value is None:
                continue
            if old == "num_mini_batches":
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"num_mini_batches must be a positive int, got {value!r}")
                if self.generation_batch_size is not None:
                    raise ValueError("set num_mini_batches or generation_batch_size, not both")
                value = value * self.gradient_accumulation_steps
            current = getattr(self, new)
            if current != defaults[new] and current != value:
                raise ValueError(f"{old}={getattr(self, old)!r} (TRL 1.12's name) and {new}={current!r} disagree; "
                                 f"set one of them")
            setattr(self, new, value)


def as_tree_config(args, config_cls, model, suffix: str):
    """A tree config from ``args`` (None, TRL's config or already a tree config)."""
    if isinstance(args, config_cls):
        return args
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return config_cls(output_dir=f"{name.split('/')[-1]}-Tree{suffix}")
    # TRL's config is already validated and derived (__post_init__ ran); copy it as it stands and
    # add the tree fields' defaults rather than re-running the checks on derived values
    tree = config_cls.__new__(config_cls)
    tree.__dict__.update(args.__dict__)
    for f in dataclasses.fields(config_cls):  # the tree's (and PPO's) own fields, at their defaults
        if f.name not in tree.__dict__:
            setattr(tree, f.name, f.default_factory() if f.default is dataclasses.MISSING else f.default)
    tree._check_tree_fields()
    if isinstance(tree, TreePPOConfig):
        tree._check_ppo_fields()
    return tree
