"""A hand-run of the ablation surgery (SPEC section 4), for tests: BERT self-attention recomputed from
its own query/key/value projections, the chosen heads' probabilities edited, nothing of headcat used.

It is the independent reference the ablation tests compare headcat's numbers with. It runs one
sample at a time (no padding), so ``1/L`` and the segments are those of the sample itself.
"""

from __future__ import annotations

from typing import Any

import torch

Ops = dict[tuple[int, int], str]  # (layer, head) -> prune | uniform | drop_intra | drop_inter


def edit(probs: torch.Tensor, op: str, same_segment: torch.Tensor) -> torch.Tensor:
    """One head's ``(L, L)`` probabilities after ``op`` (no renormalisation)."""
    if op == "prune":
        return torch.zeros_like(probs)
    if op == "uniform":
        return torch.full_like(probs, 1.0 / probs.shape[-1])
    if op == "drop_intra":
        return probs.masked_fill(same_segment, 0.0)
    if op == "drop_inter":
        return probs.masked_fill(~same_segment, 0.0)
    raise ValueError(op)


def hand_run(model: Any, encoder_layers: Any, inputs: dict[str, torch.Tensor], ops: Ops) -> Any:
    """``model(**inputs)`` for ONE unpadded sample with the heads in ``ops`` edited.

    ``encoder_layers`` is the model's list of ``BertLayer`` (``model.encoder.layer`` for a bare
    ``BertModel``, ``model.bert.encoder.layer`` for a task model). A segment is a run of equal
    ``token_type_ids``, as for BERT pairs.
    """
    assert inputs["input_ids"].shape[0] == 1, "one sample at a time"
    types = inputs["token_type_ids"][0]
    same_segment = types[:, None] == types[None, :]  # (L, L)

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]  # (1, L, hidden)
        heads, size = module.config.num_attention_heads, module.attention_head_size

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(1, -1, heads, size).transpose(1, 2)[0]  # (heads, L, size)

        q, k, v = split(module.query(hidden)), split(module.key(hidden)), split(module.value(hidden))
        probs = torch.softmax(q @ k.transpose(-1, -2) / size**0.5, dim=-1)  # (heads, L, L)
        layer = module.layer_idx
        probs = torch.stack(
            [edit(probs[h], ops[layer, h], same_segment) if (layer, h) in ops else probs[h] for h in range(heads)]
        )
        context = (probs @ v).transpose(0, 1).reshape(1, -1, heads * size)  # (1, L, hidden)
        return (context, *output[1:])

    handles = [
        encoder_layers[layer].attention.self.register_forward_hook(hook, with_kwargs=True)
        for layer in sorted({layer for layer, _ in ops})
    ]
    try:
        with torch.no_grad():
            return model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
