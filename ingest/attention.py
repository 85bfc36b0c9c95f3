"""Per-layer access to attention probabilities inside the forward pass, exact for every architecture.

headcat never re-implements an architecture's attention. While an :class:`AttentionProbe` is
active, each attention module runs its **own** eager code, op for op (grouped key/value heads
repeated, sliding windows, relative position bias, soft-capping, scaling: theirs), and headcat
only watches the one ``softmax`` that turns the module's scores into probabilities:

- Modules that dispatch through ``transformers``' ``AttentionInterface`` are switched to
  ``"headcat"``, a registered attention function that looks up the eager function the module's
  forward would have used (``eager_attention_forward`` of the module's own ``modeling_*`` file) and
  calls it with every argument it was given. Its returned context ``(batch, q, head, d)`` is the
  per-head output handed to ``on_output``.
- DeBERTa-v2/v3 and MPNet compute attention inside their own modules (no ``AttentionInterface``):
  an adapter marks their self-attention modules with forward hooks, and a pre-hook on the linear
  layer their merged context feeds gives ``on_output`` its per-head view.

Inside a marked call, a context-guarded wrapper of ``torch.nn.functional.softmax`` (installed once;
a passthrough everywhere else) hands the softmax input (the scores, mask included) and output (the
probabilities, ``(batch, head, q, k)``) to the probe callback, which may return replacement
probabilities. A module whose softmax is not over ``(batch, head, q, k)`` (learned sinks add a
column), or that calls no such softmax, is refused with :class:`UnsupportedAttention`. A probe
with ``max_map_bytes`` runs each interface call a few samples at a time (the maps stay in cache).

    with AttentionProbe(model, callback):
        model(**batch)

``callback(call)`` receives an :class:`AttentionCall` and returns ``None`` (keep the
probabilities) or a tensor of the same shape to use instead. ``on_output(call)``, when given,
receives each layer's per-head context vectors (the attention output before the heads are
merged and projected) as an :class:`OutputCall` and may likewise return a replacement: that is
where a per-head gate (importance) or a gradient tap (attribution) lives.

Every attention module's ``(stack, layer)`` is decided once, when the probe is entered, from the
model's structure (:func:`attention_sites`): ``cross`` for cross-attention modules, ``encoder`` /
``decoder`` by the module path in an encoder-decoder, by ``is_causal`` otherwise; the layer is the
rank of the module's layer index (from its path) within its stack. Probabilities and outputs are
always per **query** head. No layer's probabilities outlive its call.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ingest.types import Stack

IMPLEMENTATION = "headcat"
# The fused implementation (a probe with ``fused``): the model's attention computed by a kernel that takes
# headcat's statistics in its own pass (ingest.fused); masks as transformers builds them for SDPA.
FUSED_IMPLEMENTATION = "headcat_fused"


class UnsupportedAttention(RuntimeError):
    """An attention module headcat cannot see exactly; the message names the architecture."""


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One attention layer's call, as seen by a probe callback."""

    layer: int  # 0-based within its stack
    probs: torch.Tensor  # (batch, head, q, k), rows sum to 1 over unmasked keys
    scores: torch.Tensor  # (batch, head, q, k), what the softmax saw: logits plus bias and mask
    module: nn.Module
    stack: Stack = "encoder"
    rows: int = 0  # the forward's batch row of probs[0]: a probe with max_map_bytes sees sub-batches


@dataclass(frozen=True, slots=True)
class OutputCall:
    """One attention layer's per-head context vectors ``z = A V``, before the output projection."""

    layer: int  # 0-based within its stack
    output: torch.Tensor  # (batch, q, head, head_dim)
    module: nn.Module
    stack: Stack = "encoder"


@dataclass(frozen=True, slots=True)
class FusedCall:
    """One attention call a fused probe hands its ``fused`` callback: the inputs SDPA would get.

    The callback returns the attention output ``(batch, q, head, d)``: ``softmax(scale q k^T [capped], masked) v``
    with key/value head ``h // (head / kv_head)`` for query head ``h``."""

    layer: int
    module: nn.Module
    stack: Stack
    query: torch.Tensor  # (batch, head, q, d), rotary already applied
    key: torch.Tensor  # (batch, kv_head, k, d)
    value: torch.Tensor  # (batch, kv_head, k, d)
    mask: torch.Tensor | None  # (batch or 1, 1, q, k) bool, True where a query attends; None: every key (or causal)
    causal: bool  # no mask and key t > query s is not attended
    scale: float
    softcap: float | None


ProbeCallback = Callable[[AttentionCall], "torch.Tensor | None"]
FusedCallback = Callable[[FusedCall], torch.Tensor]
OutputCallback = Callable[[OutputCall], "torch.Tensor | None"]


# --- where the attention modules are ----------------------------------------------------------

# Path components that name a cross-attention module (BART/Whisper/Marian, T5, BERT-as-decoder).
_CROSS_NAMES = frozenset({"encoder_attn", "EncDecAttention", "crossattention", "cross_attention", "cross_attn"})


@dataclass(frozen=True)
class _Adapter:
    """How to probe an architecture whose attention does not go through ``AttentionInterface``."""

    output_linear: Callable[[Any, Any], nn.Module]  # (site, its parent) -> the linear fed the merged context
    num_heads: Callable[[Any], int]


# Own-attention classes, by class name, each verified against output_attentions=True in
# tests/ingest/test_architectures.py.
ADAPTERS: dict[str, _Adapter] = {
    # DebertaV2Attention: .self (DisentangledSelfAttention) -> .output.dense takes the merged context.
    "DisentangledSelfAttention": _Adapter(
        output_linear=lambda site, parent: parent.output.dense,
        num_heads=lambda site: int(site.num_attention_heads),
    ),
    # MPNetSelfAttention merges its heads and projects them with its own .o.
    "MPNetSelfAttention": _Adapter(
        output_linear=lambda site, parent: site.o,
        num_heads=lambda site: int(site.num_attention_heads),
    ),
}
# Module packages whose own-attention classes above are the ones verified (DeBERTa v1 is not).
_ADAPTER_MODULES = ("transformers.models.deberta_v2.", "transformers.models.mpnet.")


@dataclass(frozen=True)
class Site:
    """One attention module of a model: where it sits and how headcat sees it."""

    name: str  # module path, e.g. "decoder.block.1.layer.1.EncDecAttention"
    module: nn.Module
    stack: Stack
    layer: int  # 0-based within its stack; -1 where layers are numbered by call order (shared modules)
    adapter: _Adapter | None  # None: dispatches through AttentionInterface
    parent: nn.Module | None = None  # the module holding it (adapters find their output linear there)


def _own_forward(module: nn.Module) -> Any:
    """The class's own ``forward`` under any decorator (transformers 5.24 wraps some in ``deprecate_kwarg``): its
    code and the globals of its own file, not a wrapper's."""
    return inspect.unwrap(type(module).forward)


def _dispatches_through_interface(module: nn.Module) -> bool:
    code = getattr(_own_forward(module), "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _adapter_of(module: nn.Module) -> _Adapter | None:
    cls = type(module)
    if cls.__module__.startswith(_ADAPTER_MODULES):
        return ADAPTERS.get(cls.__name__)
    return None


def _is_causal(module: nn.Module) -> bool:
    return bool(getattr(module, "is_causal", False) or getattr(module, "is_decoder", False))


def _configured_layers(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_hidden_layers", "n_layers", "n_layer", "num_layers"):
        value = getattr(text, key, None)
        if isinstance(value, int):
            return value
    return None


def attention_sites(model: nn.Module) -> list[Site]:
    """Every attention module of ``model`` with its ``(stack, layer)``, decided from the structure.

    Raises :class:`UnsupportedAttention` when the model has no attention module headcat can see.
    """
    config = getattr(model, "config", None)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    found: list[tuple[str, nn.Module, Stack, int, _Adapter | None]] = []
    parents: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        for child in module.children():
            parents.setdefault(id(child), module)
        adapter = _adapter_of(module)
        if adapter is None and not _dispatches_through_interface(module):
            continue
        parts = name.split(".")
        stack: Stack
        if getattr(module, "is_cross_attention", False) or any(part in _CROSS_NAMES for part in parts):
            stack = "cross"
        elif encoder_decoder and "decoder" in parts:
            stack = "decoder"
        elif encoder_decoder and "encoder" in parts:
            stack = "encoder"
        else:
            stack = "decoder" if _is_causal(module) else "encoder"
        index = next((int(part) for part in parts if part.isdigit()), -1)
        found.append((name, module, stack, index, adapter))
    if not found:
        kind = getattr(config, "model_type", type(model).__name__)
        raise UnsupportedAttention(
            f"architecture {kind!r}: no attention module dispatches through transformers' AttentionInterface "
            "and none has a headcat adapter, so headcat cannot see its attention probabilities"
        )
    sites: list[Site] = []
    configured = _configured_layers(model)
    for stack in ("encoder", "decoder", "cross"):
        members = [f for f in found if f[2] == stack]
        indexes = sorted({f[3] for f in members})
        by_call_order = (
            -1 in indexes
            or len(indexes) != len(members)
            or (not encoder_decoder and configured is not None and len(members) < configured)  # shared (ALBERT)
        )
        rank = {index: r for r, index in enumerate(indexes)}
        for name, module, _, index, adapter in members:
            layer = -1 if by_call_order else rank[index]
            sites.append(Site(name, module, stack, layer, adapter, parents.get(id(module))))
    if any(s.adapter is not None for s in sites) and any(s.adapter is None for s in sites):
        kind = getattr(config, "model_type", type(model).__name__)
        raise UnsupportedAttention(
            f"architecture {kind!r} mixes adapted and AttentionInterface attention modules: not supported"
        )
    return sites


# --- the probe --------------------------------------------------------------------------------


@dataclass
class _ProbeState:
    callback: ProbeCallback
    on_output: OutputCallback | None
    sites: dict[int, Site]  # id(module) -> site
    max_map_bytes: int | None = None  # run an interface call over sub-batches whose maps fit in this
    fused: FusedCallback | None = None  # set: interface calls go to it (headcat_fused_forward), no maps
    calls: dict[str, int] = field(default_factory=dict)  # stack -> calls in this forward pass
    layers: dict[int, int] = field(default_factory=dict)  # id(module) -> layer of its latest call

    def layer_of(self, site: Site) -> int:
        count = self.calls.get(site.stack, 0)
        self.calls[site.stack] = count + 1
        layer = count if site.layer < 0 else site.layer
        self.layers[id(site.module)] = layer
        return layer


@dataclass
class _Call:
    """The attention call being run: what its softmax must look like, and what was seen."""

    state: _ProbeState
    site: Site
    layer: int
    heads: int
    shape: tuple[int, ...] | None  # (batch, head, q, k) when known before the call
    rows: int = 0  # the forward's batch row of this call's first sample
    seen: int = 0
    problem: str | None = None


_active: contextvars.ContextVar[_ProbeState | None] = contextvars.ContextVar("headcat_attention_probe", default=None)
_current: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("headcat_attention_call", default=None)

_original_softmax = torch.nn.functional.softmax


def _probed_softmax(input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> Any:
    """``torch.nn.functional.softmax``, plus the probe inside a marked attention call."""
    output = _original_softmax(input, dim=dim, _stacklevel=_stacklevel + 1, dtype=dtype)  # + 1: this frame
    call = _current.get()
    if call is None:
        return output
    call.seen += 1
    if call.seen > 1:
        call.problem = "its attention calls softmax more than once"
        return output
    expected = call.shape
    last = dim is not None and dim in (-1, input.dim() - 1)
    if not last or input.dim() != 4 or input.shape[1] != call.heads or (expected and tuple(input.shape) != expected):
        want = "x".join(map(str, expected)) if expected else f"(batch, {call.heads}, q, k)"
        call.problem = (
            f"its attention softmax is over {tuple(input.shape)} (dim {dim}), not the (batch, head, q, k) = "
            f"{want} probabilities headcat reduces (learned sinks or another normaliser)"
        )
        return output
    token = _current.set(None)  # a callback's own softmax is not the model's
    try:
        replaced = call.state.callback(
            AttentionCall(
                layer=call.layer,
                probs=output,
                scores=input,
                module=call.site.module,
                stack=call.site.stack,
                rows=call.rows,
            )
        )
    finally:
        _current.reset(token)
    if replaced is not None:
        if replaced.shape != output.shape:
            raise ValueError(f"a probe callback returned shape {tuple(replaced.shape)}, not {tuple(output.shape)}")
        output = replaced.to(output.dtype)
    return output


torch.nn.functional.softmax = _probed_softmax  # type: ignore[assignment]


def _architecture(module: nn.Module) -> str:
    return type(module).__module__.removeprefix("transformers.models.").split(".")[0] or type(module).__name__


def _check_call(call: _Call) -> None:
    if call.problem is None and call.seen == 0:
        call.problem = "its attention computed no softmax that headcat could see"
    if call.problem is not None:
        raise UnsupportedAttention(
            f"architecture {_architecture(call.site.module)!r} ({type(call.site.module).__name__}) is not supported: "
            f"{call.problem}"
        )


def _eager_function(module: nn.Module) -> Callable[..., Any]:
    """The eager attention function ``module``'s own forward uses by default."""
    function = _own_forward(module).__globals__.get("eager_attention_forward")
    if function is None:
        import sys

        function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise UnsupportedAttention(
            f"architecture {_architecture(module)!r} ({type(module).__name__}) has no eager_attention_forward "
            "for headcat to follow"
        )
    return function  # type: ignore[no-any-return]


# Keyword arguments of eager attention functions, by what their first dimension is. A sub-batch
# call slices the batch-major ones (unless they broadcast over the batch) and passes the rest as
# they are; a call with any other tensor argument is never split.
_BATCH_MAJOR = frozenset({"position_bias", "position_ids"})  # T5's bias (batch or 1, head, q, k); (batch or 1, q)
_NOT_BATCH = frozenset({"sinks", "s_aux", "cache_position"})  # per head; per position


def _sub_batches(
    query: torch.Tensor, key: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int
) -> list[tuple[int, int]] | None:
    """The ``[start, stop)`` batch rows of each sub-call whose maps take at most ``limit`` bytes (at least one
    sample each), or None when the call is to run whole: its maps fit, or an argument's batch layout is unknown."""
    batch, heads, queries, keys = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    per_sample = heads * queries * keys * max(query.element_size(), 4)  # scores and maps, float32 or wider
    rows = max(1, limit // per_sample)
    if rows >= batch or any(isinstance(arg, torch.Tensor) for arg in args):
        return None
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and name not in _NOT_BATCH:
            if name not in _BATCH_MAJOR or value.shape[0] not in (1, batch):
                return None
    return [(start, min(start + rows, batch)) for start in range(0, batch, rows)]


def _rows(value: Any, start: int, stop: int, batch: int) -> Any:
    """``value[start:stop]`` for a batch-major tensor; anything else (broadcast, not a tensor) as it is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value[start:stop]
    return value


def _watched(
    eager: Callable[..., Any],
    state: _ProbeState,
    site: Site,
    layer: int,
    rows: int,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """One eager attention call with its softmax watched; ``rows``: the forward's batch row of ``query[0]``."""
    shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    call = _Call(state, site, layer, heads=query.shape[1], shape=shape, rows=rows)
    token = _current.set(call)
    try:
        output, _ = eager(module, query, key, *args, **kwargs)  # (batch, q, head, d)
    finally:
        _current.reset(token)
    _check_call(call)
    return output  # type: ignore[no-any-return]


def headcat_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (batch, head, q, d)
    key: torch.Tensor,  # (batch, kv_head, k, d)
    value: torch.Tensor,  # (batch, kv_head, k, d)
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The module's own eager attention, its softmax watched by the active probe.

    With the probe's ``max_map_bytes``, a call whose maps would take more is run a few samples at a
    time, each sub-call the same eager code on its rows (attention never mixes samples): the maps
    the callback reduces are then still in the CPU's cache, and the forward itself reads and writes
    far fewer bytes (the eager scores, mask, softmax and ``A V`` passes are each a full pass over
    the maps). Never returns the probabilities: holding them is what this module exists to avoid.
    """
    state = _active.get()
    if getattr(module, "reorder_and_upcast_attn", False):  # GPT-2's other eager path
        eager: Callable[..., Any] = lambda m, q, k, v, mask, *a, **kw: m._upcast_and_reordered_attn(q, k, v, mask)  # noqa: E731
    else:
        eager = _eager_function(module)
    if state is None:
        output, _ = eager(module, query, key, value, attention_mask, *args, **kwargs)
        return output, None
    site = state.sites.get(id(module))
    if site is None:
        raise RuntimeError(f"{type(module).__name__} is not an attention module of the model the probe was entered on")
    layer = state.layer_of(site)
    parts = _sub_batches(query, key, args, kwargs, state.max_map_bytes) if state.max_map_bytes else None
    if parts is None:
        output = _watched(eager, state, site, layer, 0, module, query, key, value, attention_mask, *args, **kwargs)
    else:
        batch, outputs = query.shape[0], []
        for start, stop in parts:
            q, k, v, mask = (_rows(x, start, stop, batch) for x in (query, key, value, attention_mask))
            options = {name: _rows(x, start, stop, batch) if name in _BATCH_MAJOR else x for name, x in kwargs.items()}
            outputs.append(_watched(eager, state, site, layer, start, module, q, k, v, mask, *args, **options))
        output = torch.cat(outputs)
    if state.on_output is not None:
        replaced = state.on_output(OutputCall(layer=layer, output=output, module=module, stack=site.stack))
        if replaced is not None:
            output = replaced
    return output, None


# Keyword arguments of an attention call that the fused kernel expresses or that carry nothing it computes
# (sliding windows are in the mask sdpa_mask builds; positions were applied to q and k before the call).
_FUSED_KWARGS = frozenset({"softcap", "sliding_window", "position_ids", "cache_position", "output_attentions",
                           "use_cache", "head_mask", "layer_head_mask"})  # fmt: skip


def headcat_fused_forward(
    module: nn.Module,
    query: torch.Tensor,  # (batch, head, q, d)
    key: torch.Tensor,  # (batch, kv_head, k, d)
    value: torch.Tensor,  # (batch, kv_head, k, d)
    attention_mask: torch.Tensor | None,  # as sdpa_mask builds it: bool (batch or 1, 1, q, k), or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The module's attention as SDPA would compute it, by the active probe's ``fused`` callback.

    Refuses (:class:`UnsupportedAttention`) whatever the kernel does not express: an argument it does not know
    (T5's position bias, learned sinks, ...), dropout in training, a float mask, a head mask."""
    state = _active.get()
    if state is None or state.fused is None:
        raise RuntimeError(f"{FUSED_IMPLEMENTATION} attention runs only inside a fused AttentionProbe")
    site = state.sites.get(id(module))
    if site is None:
        raise RuntimeError(f"{type(module).__name__} is not an attention module of the model the probe was entered on")
    unknown = sorted(name for name, value in kwargs.items() if name not in _FUSED_KWARGS and value is not None)
    problem = None
    if unknown:
        problem = f"its attention takes {', '.join(unknown)}, which the fused kernel does not express"
    elif (dropout and module.training) or any(
        kwargs.get(name) is not None for name in ("head_mask", "layer_head_mask")
    ):
        problem = "dropout or a head mask is on"
    elif attention_mask is not None and attention_mask.dtype != torch.bool:
        problem = f"its mask is {attention_mask.dtype}, not the boolean mask the fused kernel reads"
    if problem is not None:
        raise UnsupportedAttention(f"architecture {_architecture(module)!r} ({type(module).__name__}): {problem}")
    layer = state.layer_of(site)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = query.shape[2] > 1 and attention_mask is None and causal  # as transformers' sdpa_attention_forward
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    call = FusedCall(layer, module, site.stack, query, key, value, attention_mask, causal, scale, softcap)
    output = state.fused(call)
    if state.on_output is not None:
        replaced = state.on_output(OutputCall(layer=layer, output=output, module=module, stack=site.stack))
        if replaced is not None:
            output = replaced
    return output, None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, headcat_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, eager_mask)
    AttentionInterface.register(FUSED_IMPLEMENTATION, headcat_fused_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FUSED_IMPLEMENTATION, sdpa_mask)


_register()


class AttentionProbe:
    """Context manager: route ``model``'s attention through ``callback`` while active.

    Sites (stack, layer) are decided on entry (:func:`attention_sites`); the model's previous
    attention implementation is restored and every hook removed on exit. With ``max_map_bytes``,
    an ``AttentionInterface`` call whose maps would take more bytes runs over sub-batches (see
    :func:`headcat_attention_forward`): ``callback`` then sees each sub-batch's maps, with the
    forward's batch row of their first sample in :attr:`AttentionCall.rows`.
    """

    def __init__(
        self,
        model: nn.Module,
        callback: ProbeCallback,
        *,
        on_output: OutputCallback | None = None,
        max_map_bytes: int | None = None,
        fused: FusedCallback | None = None,
    ) -> None:
        if max_map_bytes is not None and max_map_bytes < 1:
            raise ValueError(f"max_map_bytes must be at least 1, not {max_map_bytes}")
        self.model: Any = model  # a transformers PreTrainedModel
        self.callback = callback
        self.on_output = on_output
        self.max_map_bytes = max_map_bytes
        self.fused = fused

    def __enter__(self) -> AttentionProbe:
        self.sites = attention_sites(self.model)
        sites = {id(s.module): s for s in self.sites}
        if self.fused is not None and any(s.adapter is not None for s in self.sites):
            raise UnsupportedAttention(
                f"architecture {getattr(self.model.config, 'model_type', type(self.model).__name__)!r} computes its "
                "attention in its own modules: no fused kernel can run it"
            )
        self._state = _ProbeState(
            self.callback, self.on_output, sites, max_map_bytes=self.max_map_bytes, fused=self.fused
        )
        self._hooks: list[Any] = [self.model.register_forward_pre_hook(self._new_pass)]
        self._interface = any(s.adapter is None for s in self.sites)
        if self._interface:
            self._previous = self.model.config._attn_implementation
            self.model.set_attn_implementation(FUSED_IMPLEMENTATION if self.fused is not None else IMPLEMENTATION)
        for site in self.sites:
            if site.adapter is not None:
                self._hook_adapter(site)
        self._token = _active.set(self._state)
        return self

    def _new_pass(self, *_: Any) -> None:
        self._state.calls.clear()

    def _hook_adapter(self, site: Site) -> None:
        assert site.adapter is not None
        state, adapter = self._state, site.adapter
        tokens: list[contextvars.Token[_Call | None]] = []

        def enter(module: nn.Module, args: Any) -> None:
            layer = state.layer_of(site)
            call = _Call(state, site, layer, heads=adapter.num_heads(module), shape=None)
            tokens.append(_current.set(call))

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            call = _current.get()
            _current.reset(tokens.pop())
            assert call is not None
            _check_call(call)

        self._hooks += [
            site.module.register_forward_pre_hook(enter),
            site.module.register_forward_hook(leave, always_call=True),
        ]
        if self.on_output is None:
            return
        on_output, heads = self.on_output, adapter.num_heads(site.module)
        linear = adapter.output_linear(site.module, site.parent)

        def tap(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            merged = args[0]  # (batch, q, head * d)
            per_head = merged.view(*merged.shape[:-1], heads, merged.shape[-1] // heads)
            layer = state.layers[id(site.module)]
            replaced = on_output(OutputCall(layer=layer, output=per_head, module=site.module, stack=site.stack))
            if replaced is None:
                return None
            return (replaced.reshape(merged.shape), *args[1:])

        self._hooks.append(linear.register_forward_pre_hook(tap))

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        _active.reset(self._token)
        if self._interface:
            self.model.set_attn_implementation(self._previous)
