"""The critic of ``TreePPOTrainer``: what it is made of, which parameters it trains, how it is saved.

Three kinds (``TreePPOConfig.critic``), each a backbone and a scalar head read at the positions the
policy's log-probs are predicted from:

* ``"separate"``: a value model of its own (``AutoModelForTokenClassification`` with one label:
  a transformers backbone and its ``score`` head), initialised from the policy's checkpoint by
  default. Memory: a second model with its gradients and optimizer state.
* ``"shared"``: a linear value head on the policy's own trunk; one forward gives log-probs and
  values, and the value loss trains the trunk too. Memory: ``hidden_size + 1`` parameters.
* ``"adapter"``: under PEFT, a second adapter (``"critic"``) on the same frozen base plus a value
  head; the reference model is the base with adapters disabled, so one base model serves policy,
  reference and critic. Memory: one more adapter and its optimizer state.

The critic's parameters are never under DDP: the trainer adds them to the optimizer as a group
of their own and averages their gradients by hand (``grad_sync``) at each synchronising step.
Under FSDP2 a separate value model is sharded as Accelerate shards the policy and a critic adapter
is sharded with the policy it lives in; their gradients are reduced by FSDP2 itself, once per
optimizer step (``distributed/fsdp.py``). Only a head outside both (``"shared"``, ``"adapter"``:
``hidden_size + 1`` parameters) stays whole on every rank and is averaged by hand. Under DeepSpeed
every critic parameter is the policy's engine's (``in_engine``): it reduces and steps them.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel

from ...distributed.deepspeed import whole
from ...distributed.fsdp import copy_full_into, full_tensor

CRITIC_KINDS = ("separate", "shared", "adapter")
CRITIC_ADAPTER = "critic"
CRITIC_STATE_FILE = "critic.safetensors"
VALUE_MODEL_DIR = "value_model"


class ValueHead(torch.nn.Module):
    """``hidden [n, H] -> [n, 1]``: one linear layer, initialised as a token-classification head is
    (normal weights of the model's ``initializer_range``, zero bias)."""

    def __init__(self, hidden_size: int, initializer_range: float = 0.02):
        super().__init__()
        self.score = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.normal_(self.score.weight, std=initializer_range)
        torch.nn.init.zeros_(self.score.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden.to(self.score.weight.dtype))


class _DetachedInput(torch.nn.Module):
    """The head on hidden states cut from the trunk: during critic warm-up the shared trunk must not move."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden.detach())


class Critic:
    """One critic: ``kind``, its ``head`` and (``"separate"``) its ``model``."""

    def __init__(self, kind: str, head: torch.nn.Module, model: PreTrainedModel | None = None,
                 adapter_params: dict[str, torch.nn.Parameter] | None = None):
        self.kind = kind
        self.sharded = False  # FSDP2: the value model, or the policy holding the adapter, is sharded
        self.in_engine = False  # DeepSpeed: every critic parameter is held and reduced by the policy's engine
        self.head = head
        self.model = model
        self.adapter_params = adapter_params or {}

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, kind: str, policy: torch.nn.Module, value_model: str | PreTrainedModel | None,
              model_init_kwargs: dict, vocab_size: int, tokenizer=None) -> Critic:
        """The critic of ``kind`` for ``policy`` (unwrapped; a PEFT model for ``"adapter"``);
        ``tokenizer``: the policy's, compared with a separate value model's own where it has one."""
        if kind not in CRITIC_KINDS:
            raise ValueError(f"critic must be one of {CRITIC_KINDS}, got {kind!r}")
        config = _base_config(policy)
        device = next(policy.parameters()).device
        if kind != "separate" and value_model is not None:
            raise ValueError(f"a value_model was passed but critic={kind!r} reads values from the policy's trunk; "
                             "set critic='separate' to train a value model of its own")
        if kind == "separate":
            model = _load_value_model(value_model, policy, model_init_kwargs)
            _check_value_model(model, vocab_size)
            _warn_other_tokenizer(model, policy, value_model if isinstance(value_model, str) else None, tokenizer)
            if not any(p.is_meta for p in model.parameters()):  # FSDP2's low-memory loading: rank 0's come later
                model = model.to(device)
            return cls(kind, model.score, model=model)
        head = ValueHead(config.hidden_size, getattr(config, "initializer_range", 0.02)).to(device)
        if kind == "shared":
            return cls(kind, head)
        return cls(kind, head, adapter_params=_add_critic_adapter(policy))

    # ------------------------------------------------------------------ what trains
    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter the critic trains (the optimizer's critic group)."""
        if self.kind == "separate":
            return [p for p in self.model.parameters() if p.requires_grad]
        return list(self.adapter_params.values()) + list(self.head.parameters())

    def modules(self) -> dict[str, torch.nn.Module]:
        """The modules whose parameters the critic trains besides the policy's own (a critic adapter
        lives in the policy): what joins the policy's DeepSpeed engine."""
        if self.kind == "separate":
            return {"value_model": self.model}
        return {"value_head": self.head}

    def replicated_parameters(self) -> list[torch.nn.Parameter]:
        """The trained parameters every rank holds whole, which the trainer averages by hand: all of
        them, but where the critic is ``sharded`` (FSDP2) only a head outside the sharded models —
        told by kind, not by type: inside a gathered block a sharded model shows whole parameters —
        and none where the critic is ``in_engine`` (DeepSpeed)."""
        if self.in_engine:
            return []
        if not self.sharded:
            return [p for p in self.parameters() if p.requires_grad]
        if self.kind == "separate":
            return []
        return [p for p in self.head.parameters() if p.requires_grad]

    def refresh_adapter(self, policy: torch.nn.Module) -> None:
        """Read the critic adapter's parameters from ``policy`` again: sharding the policy (FSDP2)
        replaced every parameter object it held."""
        if self.kind == "adapter":
            names = set(self.adapter_params)
            self.adapter_params = {n: p for n, p in _peft_model(policy).named_parameters() if n in names}
            if set(self.adapter_params) != names:
                raise RuntimeError("the critic adapter's parameters were not found in the prepared policy: "
                                   f"{sorted(names - set(self.adapter_params))[:4]}")

    def named_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the critic (its trained tensors, by name)."""
        if self.kind == "separate":
            return {f"model.{k}": v for k, v in self.model.state_dict().items()}
        state = {f"head.{k}": v for k, v in self.head.state_dict().items()}
        state.update({f"adapter.{k}": p.data for k, p in self.adapter_params.items()})
        return state

    def _whole_state(self) -> dict[str, torch.Tensor]:
        """:meth:`named_state` whole on the CPU. A sharded value model (FSDP2) through
        ``torch.distributed.checkpoint``'s full state dict offloaded to the CPU, which leaves the whole
        tensors on the first rank alone (the one that writes); other tensors gathered one by one."""
        if self.kind == "separate" and self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return {f"model.{k}": v.contiguous() for k, v in state.items()}
        return {k: full_tensor(v.detach()).contiguous().cpu() for k, v in self.named_state().items()}

    def save(self, directory: str, write: bool = True) -> None:
        """Write the critic to ``directory``. Every rank calls it where the critic is sharded (FSDP2):
        the tensors are gathered whole (for a value model, on the first rank only), and only ``write``
        ranks — the first — write."""
        from safetensors.torch import save_file

        state = self._whole_state()
        if not write:
            return
        os.makedirs(directory, exist_ok=True)
        save_file(_untied(state), os.path.join(directory, CRITIC_STATE_FILE), metadata={"kind": self.kind})
        if self.kind == "separate":
            whole = {k[len("model."):]: v for k, v in state.items()}
            self.model.save_pretrained(os.path.join(directory, VALUE_MODEL_DIR), state_dict=whole)

    def load(self, directory: str) -> bool:
        """Restore the critic from a checkpoint directory; False where it holds none."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = os.path.join(directory, CRITIC_STATE_FILE)
        if not os.path.exists(path):
            return False
        with safe_open(path, "pt") as f:
            kind = (f.metadata() or {}).get("kind")
        if kind != self.kind:
            raise ValueError(f"{path} holds a critic of kind {kind!r}, this trainer's is {self.kind!r}")
        state = load_file(path)
        current = self.named_state()
        missing = sorted(set(current) - set(state))
        if missing:
            raise ValueError(f"{path} lacks critic tensors {missing[:4]}")
        for name, tensor in current.items():
            copy_full_into(tensor, state[name])
        return True

    # ------------------------------------------------------------------ running
    def backbone_model(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The model whose backbone computes the values: the value model, or the policy itself."""
        return self.model if self.kind == "separate" else policy

    def active(self, policy: torch.nn.Module):
        """Where the critic's forward (and its backward's recompute) runs: the critic adapter active."""
        if self.kind != "adapter":
            return contextlib.nullcontext()
        return critic_adapter_active(policy, self.adapter_params)


def _base_config(policy: torch.nn.Module):
    pretrained = next(m for m in policy.modules() if isinstance(m, PreTrainedModel))
    return pretrained.config.get_text_config()


def _load_value_model(value_model, policy: torch.nn.Module, model_init_kwargs: dict) -> PreTrainedModel:
    """The separate critic: a model object, a path, or (None) the policy's own checkpoint with a new
    one-value head; a policy built in memory (no path) gives its backbone's weights."""
    if isinstance(value_model, PreTrainedModel):
        return value_model
    if value_model is not None and not isinstance(value_model, str):
        raise TypeError(f"value_model must be a path or a transformers model, got {type(value_model).__name__}")
    pretrained = next(m for m in policy.modules() if isinstance(m, PreTrainedModel))
    kwargs = {k: v for k, v in (model_init_kwargs or {}).items() if k not in ("device_map",)}
    kwargs.setdefault("dtype", pretrained.dtype)
    kwargs.setdefault("attn_implementation", pretrained.config._attn_implementation)
    if value_model is not None:
        return AutoModelForTokenClassification.from_pretrained(value_model, num_labels=1, **kwargs)
    path = getattr(pretrained.config, "_name_or_path", "")
    if path and os.path.isdir(path):  # the policy's own checkpoint, with a fresh one-value head
        return AutoModelForTokenClassification.from_pretrained(path, num_labels=1, **kwargs)
    # built in memory: the same architecture, the policy's backbone weights, a fresh head
    config = pretrained.config.__class__.from_dict({**pretrained.config.to_dict(), "num_labels": 1})
    with torch.device(next(pretrained.parameters()).device):  # a large random init on the CPU takes minutes
        model = AutoModelForTokenClassification.from_config(config, attn_implementation=kwargs["attn_implementation"],
                                                            dtype=kwargs["dtype"])
    # under ZeRO-3 either may be partitioned (the value model is, built inside zero.Init): copied whole
    with whole(list(pretrained.base_model.parameters())), \
            whole(list(model.base_model.parameters()), modifier_rank=0):
        model.base_model.load_state_dict(pretrained.base_model.state_dict())
    return model


def _check_value_model(model: PreTrainedModel, vocab_size: int) -> None:
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ValueError(
            f"the value model ({type(model).__name__}) must have a one-value head named 'score' (e.g. "
            "AutoModelForTokenClassification with num_labels=1), got "
            f"{type(head).__name__ if head is not None else 'none'}"
            f"{f' with {head.out_features} outputs' if isinstance(head, torch.nn.Linear) else ''}"
        )
    hidden = model.config.get_text_config().hidden_size
    if head.in_features != hidden:
        raise ValueError(f"the value model's head reads {head.in_features} features but its hidden size is {hidden}")
    rows = model.get_input_embeddings().num_embeddings
    if rows < vocab_size:
        raise ValueError(
            f"the value model embeds {rows} token ids but the policy's tokenizer has {vocab_size}: the critic must "
            "share the policy's tokenizer (it reads the same token ids)"
        )


def _warn_other_tokenizer(model: PreTrainedModel, policy: torch.nn.Module, path: str | None, tokenizer) -> None:
    """Warn when the value model was made for another tokenizer than the policy's: it reads the
    policy's token ids, which then name other tokens to it — accepted (its vocabulary may be large
    enough), never silently. Compared: the value model's own tokenizer where its directory has one,
    else what its config says of its tokenizer (family, embedding rows, special token ids)."""
    theirs = None
    if path is not None and tokenizer is not None and hasattr(tokenizer, "get_vocab"):
        try:
            from transformers import AutoTokenizer

            theirs = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception:  # a directory without tokenizer files: compare the configs below
            theirs = None
    if theirs is not None:
        if theirs.get_vocab() == tokenizer.get_vocab():
            return
        why = f"its tokenizer ({len(theirs)} tokens) is not the policy's ({len(tokenizer)} tokens)"
    else:
        mine, other = _base_config(policy), model.config.get_text_config()
        differences = [f"{name} {getattr(other, name, None)!r} against the policy's {getattr(mine, name, None)!r}"
                       for name in ("model_type", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
                       if getattr(other, name, None) != getattr(mine, name, None)]
        if not differences:
            return
        why = "its config differs from the policy's: " + "; ".join(differences)
    warnings.warn(f"the value model ({type(model).__name__}) looks made for another tokenizer: {why}. It reads the "
                  "policy's token ids, which name other tokens to it; use a value model of the policy's family, "
                  "trained on its tokenizer", stacklevel=4)


def _add_critic_adapter(policy: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Add the ``"critic"`` adapter (the policy adapter's configuration) to the PEFT model; its
    parameters by name. The policy adapter stays the active one."""
    import copy

    peft_model = _peft_model(policy)
    if peft_model is None:
        raise ValueError("critic='adapter' trains a second adapter on the policy's frozen base; pass a peft_config "
                         "(or a PEFT model) — or choose critic='separate' or 'shared'")
    if CRITIC_ADAPTER in peft_model.peft_config:
        raise ValueError(f"the PEFT model already has an adapter named {CRITIC_ADAPTER!r}")
    active = peft_model.active_adapter
    peft_model.add_adapter(CRITIC_ADAPTER, copy.deepcopy(peft_model.peft_config[active]))
    peft_model.set_adapter(active)  # the policy's adapter active and trainable, as before
    params = {n: p for n, p in peft_model.named_parameters() if f".{CRITIC_ADAPTER}." in n}
    if not params:
        raise ValueError("the critic adapter added no parameters")
    for p in params.values():
        p.requires_grad_(True)
    return params


def _peft_model(policy: torch.nn.Module):
    return next((m for m in policy.modules() if hasattr(m, "peft_config") and hasattr(m, "add_adapter")), None)


@contextlib.contextmanager
def critic_adapter_active(policy: torch.nn.Module, params: dict[str, torch.nn.Parameter]):
    """Make the critic adapter the active one in every PEFT layer for the block, without PEFT's
    ``set_adapter`` side effect on ``requires_grad`` (the policy adapter keeps training); restore
    after. TRL's reference pass re-enables adapters through ``set_adapter``, which freezes the
    critic's parameters: they are made trainable again here."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in policy.modules() if isinstance(m, BaseTunerLayer)]
    saved = [m._active_adapter for m in layers]
    for p in params.values():
        p.requires_grad_(True)
    try:
        for m in layers:
            m._active_adapter = [CRITIC_ADAPTER]
        yield
    finally:
        for m, a in zip(layers, saved):
            m._active_adapter = a


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): copy the repeats."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out
