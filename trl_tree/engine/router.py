"""The MoE load-balancing loss over a prefix tree, equal to the one over the untreed batch.

TRL adds ``router_aux_loss_coef · aux`` to the loss of a Mixture-of-Experts policy, where ``aux``
is transformers' ``load_balancing_loss_func`` over every real token of the padded batch and every
layer: ``num_experts · Σ_e f_e · P_e``, with ``f_e`` the share of (token, layer) top-k
assignments that went to expert ``e`` and ``P_e`` the mean router probability of ``e``. Both are
means over tokens, so a token that ``m`` sequences contain counts ``m`` times. The tree computes
each unique token's router logits once; weighting each by its multiplicity ``m`` (the number of
sequences through it) gives the same two means — that function takes such weights as its
``attention_mask``.

In one differentiable call (packed mode) the loss is built directly from the recorded logits. The
depth-first walk and calls under a token budget run their backward piece by piece, so the loss
is taken apart: ``f_e`` comes from top-k choices, which carry no gradient, so once every piece's
logits are known (the forward-only pass) ``aux`` is linear in the router probabilities,
``Σ_{token, layer} m · Σ_e c_e · softmax(z)_e`` with ``c_e = num_experts · f_e / Σ m``, and each
piece adds its own tokens' share of that sum, times the loss's gradient with respect to ``aux``,
to its backward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def router_recorder(backbone: torch.nn.Module):
    """transformers' ``OutputRecorder`` for the backbone's router logits, or None (not an MoE)."""
    spec = getattr(type(backbone), "_can_record_outputs", None) or {}
    return spec.get("router_logits")


@contextmanager
def record_router_logits(backbone: torch.nn.Module, sink: list | None):
    """Append every router's logits ``[tokens, experts]`` (layer order) to ``sink`` during a forward:
    hooks on the modules transformers itself records them from (its ``OutputRecorder``)."""
    if sink is None:
        yield
        return
    spec = router_recorder(backbone)
    if spec is None:
        raise ValueError(f"{type(backbone).__name__} records no router logits; it is not a Mixture-of-Experts model")
    handles = []

    def hook(_module, _args, output):
        sink.append(output[spec.index] if isinstance(output, (tuple, list)) else output)

    for name, module in backbone.named_modules():
        if spec.layer_name is not None and not name.endswith(spec.layer_name):
            continue
        if (spec.target_class is not None and isinstance(module, spec.target_class)) or (
                spec.class_name is not None and type(module).__name__.endswith(spec.class_name)):
            handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class RouterAux:
    """Router logits of one step's tree calls, with each unique token's multiplicity.

    ``collect`` is called by the engine after each forward (every layer's ``[n, E]`` logits of the
    call's ``n`` unique tokens and their multiplicities ``[n]``); :meth:`loss` is the load-balancing
    loss over everything collected. For a backward run piece by piece, :meth:`set_backward` fixes
    the linear coefficients (from what the forward-only pass collected) and the upstream gradient;
    the engine then adds :meth:`term` of each piece to that piece's loss.
    """

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.layers: list[list[torch.Tensor]] = []  # per call: per-layer logits
        self.weights: list[torch.Tensor] = []  # per call: multiplicities
        self.backward_coef: torch.Tensor | None = None  # [E]: d loss / d (Σ m · softmax(z)_e)
        self._pending: torch.Tensor | None = None  # the last piece's term, until its loss takes it

    def on_forward(self, logits: list[torch.Tensor], weights: torch.Tensor | None) -> None:
        """After one model call of the engine: collect (forward passes), or, in a piecewise backward,
        keep the piece's :meth:`term` for its loss (calls that build a graph only: a depth-first
        push without one is run again, with one, before its backward)."""
        if weights is None:
            raise RuntimeError("a tree call recorded router logits without the multiplicities of its tokens")
        if self.backward_coef is None:
            self.collect(logits, weights)
        elif torch.is_grad_enabled():
            self._pending = self.term(logits, weights)

    def take_term(self) -> torch.Tensor | None:
        """The term kept by the last call that built a graph (None outside a piecewise backward)."""
        term, self._pending = self._pending, None
        return term

    def collect(self, logits: list[torch.Tensor], weights: torch.Tensor) -> None:
        if not logits:
            raise ValueError("the MoE model recorded no router logits in a tree call")
        rows = weights.shape[0]
        if any(z.shape[0] != rows for z in logits):
            raise ValueError(f"router logits of {[tuple(z.shape) for z in logits]} for {rows} unique tokens")
        self.layers.append(logits)
        self.weights.append(weights)

    def _joined(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        layers = tuple(torch.cat([call[i] for call in self.layers]) for i in range(len(self.layers[0])))
        return layers, torch.cat(self.weights).float()

    def loss(self) -> torch.Tensor:
        """transformers' ``load_balancing_loss_func`` with the multiplicities as the mask."""
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        layers, weights = self._joined()
        return load_balancing_loss_func(layers, self.num_experts, self.top_k, weights.unsqueeze(0))

    def coefficients(self) -> torch.Tensor:
        """``c_e = num_experts · f_e / Σ m``: with them ``loss = Σ m · Σ_e c_e · softmax(z)_e``."""
        layers, weights = self._joined()
        with torch.no_grad():
            counts = torch.zeros(self.num_experts, dtype=torch.float32, device=weights.device)
            for z in layers:
                chosen = torch.topk(torch.softmax(z, dim=-1), self.top_k, dim=-1).indices  # as transformers ranks
                counts.scatter_add_(0, chosen.reshape(-1), weights.repeat_interleave(self.top_k))
            total = weights.sum() * len(layers)
            return self.num_experts * counts / total / total

    def set_backward(self, grad: torch.Tensor) -> None:
        """Before a piecewise backward: the loss's gradient with respect to :meth:`loss` (a scalar)."""
        self.backward_coef = self.coefficients() * grad.float()
        self.layers, self.weights = [], []

    def term(self, logits: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
        """One piece's share of the loss (times its upstream gradient), to back-propagate with it."""
        total = logits[0].new_zeros((), dtype=torch.float32)
        for z in logits:
            total = total + (torch.softmax(z, dim=-1).float() * self.backward_coef).sum(-1).mul(weights).sum()
        return total
