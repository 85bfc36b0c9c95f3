"""Gradient attribution of every head to the input tokens (SPEC section 8; Pascual et al. 2021).

Attention is local: after the first layer, token ``t``'s vector already mixes the whole input,
so a head's attention row says little about which *input* tokens its context vector reads. The
attribution of head ``h`` (layer ``l``) at query ``s`` to input token ``t`` is

    G[s, t] = || d z_h(s) / d e_t ||_F

with ``z_h(s)`` the head's context vector (before the output projection, :class:`OutputCall`) and
``e_t`` the embedding layer's output at ``t``. It is estimated with ``K`` seeded Rademacher probes
``u`` (entries +-1): ``E_u ||d (u . z_h(s)) / d e_t||^2 = ||J||_F^2`` exactly, since ``E[u u^T] = I``.
Each row is then normalised over the sample's tokens to sum to 1, which makes it comparable with
the attention row ``A[s, .]``: the features of SPEC section 1 computed from attribution rows are
the head's **global** vector, and the mean total variation between the two rows is its
**discrepancy**.

How the probes are batched. One backward pass of a scalar gives one gradient with respect to the
embeddings; summing ``u . z`` over several (head, query, probe) triples of one input would mix
their gradients. Two schemes give every triple its own gradient, ``R`` triples per backward pass
(``rows_per_pass``), each with its whole attribution row over every key ``t``:

- ``"vjp"`` (the default): the sample runs forward **once**, with its embeddings as the autograd
  leaf and every head's context ``z`` kept in the graph; a chunk of ``R`` triples is then one
  *batched* vector-Jacobian product, ``torch.autograd.grad(..., is_grads_batched=True)`` (vmap
  over the cotangents): cotangent ``b`` is ``u_b`` at ``(s_b, h_b)`` of layer ``l_b``'s output and
  zero elsewhere, so gradient ``b`` is exactly triple ``b``'s. Cost per sample: one forward, and
  backward work of ``layers * heads * queries * probes`` rows, ``ceil(heads * queries * probes / R)``
  vectorised calls per layer (a chunk never spans two layers, so a triple of layer ``l`` only goes
  back through layers ``0..l``).
- ``"replicate"``: the sample copied ``R`` times along the batch, row ``b`` carrying triple ``b``,
  one forward and one backward of ``sum_b u_b . z_{h_b}(s_b)[row b]`` (rows never interact in the
  model, so row ``b``'s gradient is triple ``b``'s); the forward stops after the deepest layer of
  the chunk. Simpler, but it repeats the forward for every row.

``bench/attribution.py`` compares both with the naive way (one forward, then one backward per triple).

Everything of one sample is reduced on the spot: per head, the attention and attribution rows of
the chosen queries give the sample's features and discrepancy (:func:`row_features`); only the
first sample's rows are kept, downsampled, as the example maps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ingest.attention import AttentionCall, AttentionProbe, OutputCall
from ingest.corpora import Sample
from ingest.features import encode_samples, resolve_special_tokens
from ingest.loading import LoadedModel
from ingest.types import SCALARS, SPECIAL_GROUPS, Stack, feature_names

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
Scheme = Literal["vjp", "replicate"]
SCHEMES: tuple[Scheme, ...] = get_args(Scheme)


class AttributionError(ValueError):
    """A request headcat cannot compute attributions for (bad parameters, or a model it cannot
    take gradients through); raised before any compute."""


@dataclass(frozen=True)
class AttributionConfig:
    """One attribution run's parameters; stored with its results (:meth:`to_json`)."""

    samples: int = 32  # at most this many samples are read from the corpus
    max_length: int = 64  # tokens per sample after truncation, special tokens included
    queries: int = 16  # query positions per sample (seeded subsample; all when the sample is shorter)
    probes: int = 4  # K Rademacher probes per (head, query)
    rows_per_pass: int = 16  # R: triples per backward pass (the fastest measured on CPU; raise it on a GPU)
    scheme: Scheme = "vjp"  # how they share it: batched VJPs of one forward, or the sample replicated
    num_windows: int = 16
    map_size: int = 32  # keys of the downsampled example maps (rows: the example's chosen queries)
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("samples", "queries", "probes", "rows_per_pass", "num_windows", "map_size"):
            if getattr(self, name) < 1:
                raise AttributionError(f"{name}: must be >= 1, not {getattr(self, name)}")
        if self.max_length < 2:
            raise AttributionError(f"max_length: must be >= 2, not {self.max_length}")
        if self.seed < 0:
            raise AttributionError(f"seed: must be >= 0, not {self.seed}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def num_features(self) -> int:
        return self.num_windows + 1 + len(SPECIAL_GROUPS)


# --- features of rows ---------------------------------------------------------------------------


def row_features(
    rows: torch.Tensor,  # (..., Q, T): one row per chosen query, over the sample's T tokens (no padding)
    queries: torch.Tensor,  # (Q,) long: the query position of each row
    key_groups: torch.Tensor,  # (T,) long: SPECIAL_GROUPS index of each token, -1 if none
    num_windows: int,
) -> torch.Tensor:
    """The sample's SPEC section 1 features and scalars from some of its rows: ``(..., N + 10)`` float64.

    Each row is reduced exactly as one query row of :mod:`ingest.features`; the sample's value is
    the mean over the rows (features, entropy, mean distance), over the rows with a previous
    (next) token for ``prev_token`` (``next_token``), over the ``[SEP]`` query rows for
    ``sep_to_sep`` (NaN when there is none). With every query chosen this is
    :func:`ingest.features.extract_features` of the one sample, rows being attention rows.
    """
    n = num_windows
    rows = rows.double()
    length = rows.shape[-1]
    device = rows.device
    queries = queries.to(device)
    key_groups = key_groups.to(device)
    keys = torch.arange(length, device=device)
    distance = (keys[None, :] - queries[:, None]).abs()  # (Q, T)
    group = torch.where(distance == 0, n, torch.clamp(distance * n // length, max=n - 1))
    group = torch.where(key_groups[None, :] >= 0, n + 1 + key_groups[None, :], group)  # special beats self
    one_hot = F.one_hot(group, n + 5).double()  # (Q, T, N + 5)
    masses = torch.einsum("...qt,qtf->...qf", rows, one_hot)  # (..., Q, N + 5)

    entropy = torch.special.entr(rows).sum(-1)  # (..., Q)
    mean_distance = (rows * distance.double()).sum(-1)
    prev_index = (queries - 1).clamp(min=0)
    next_index = (queries + 1).clamp(max=length - 1)
    previous = rows.gather(-1, prev_index.expand(*rows.shape[:-1])[..., None])[..., 0]  # (..., Q)
    following = rows.gather(-1, next_index.expand(*rows.shape[:-1])[..., None])[..., 0]
    sep = SPECIAL_GROUPS.index("sep")
    is_sep = key_groups == sep  # (T,)
    sep_mass = (rows * is_sep.double()).sum(-1)  # (..., Q)

    def mean(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        weight = where.double()  # (Q,)
        count = weight.sum()
        if count == 0:
            return torch.full(values.shape[:-1], math.nan, dtype=torch.float64, device=device)
        return (values * weight).sum(-1) / count

    every = torch.ones_like(queries, dtype=torch.bool)
    scalars = torch.stack(
        [
            mean(entropy, every),
            mean(previous, queries >= 1),
            mean(following, queries <= length - 2),
            mean(mean_distance, every),
            mean(sep_mass, is_sep[queries]),
        ],
        dim=-1,
    )  # (..., 5)
    return torch.cat([masses.mean(-2), scalars], dim=-1)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``1/2 sum_t |a - b|`` over the last axis."""
    return 0.5 * (a.double() - b.double()).abs().sum(-1)


# --- the estimator ------------------------------------------------------------------------------


class _Stop(Exception):
    """Raised inside the forward pass once the deepest layer a pass needs has given its output."""


def embedding_module(model: nn.Module) -> nn.Module:
    """The module whose output is ``e`` (the embedding layer: token + position (+ type), normed).

    The base model's ``embeddings`` where it has one (BERT and its kin), else the input
    embeddings (decoders add positions later; the gradient with respect to the token embedding
    is then the same as with respect to the sum). Raises :class:`AttributionError` when neither exists.
    """
    base = getattr(model, "base_model", model)
    module = getattr(base, "embeddings", None)
    if isinstance(module, nn.Module) and not isinstance(module, nn.Embedding | nn.ModuleList):
        return module
    getter = getattr(model, "get_input_embeddings", None)
    try:
        module = getter() if callable(getter) else None
    except NotImplementedError:
        module = None
    if not isinstance(module, nn.Module):
        raise AttributionError(
            f"model: {type(model).__name__} has no embedding layer headcat can find, so it cannot take "
            "gradients with respect to the input tokens"
        )
    return module


def check_model(model: nn.Module) -> None:
    """Refuse, before any compute, a model headcat cannot take gradients through."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise AttributionError(
            f"model: {type(model).__name__} is an encoder-decoder; its heads read two embedding layers "
            "(source and target), and headcat attributes to one input only (encoder-only and decoder-only models)"
        )
    parameter = next(model.parameters(), None)
    if parameter is None or not parameter.dtype.is_floating_point:
        raise AttributionError(
            f"model: {type(model).__name__}'s weights are not floating point (quantized?), so headcat "
            "cannot take gradients through it"
        )
    embedding_module(model)


@dataclass(frozen=True)
class SampleAttribution:
    """One sample's attention and attribution rows at its chosen queries (every layer and head)."""

    stack: Stack
    queries: torch.Tensor  # (Q,) long, sorted
    attention: torch.Tensor  # (layers, heads, Q, T) float64: A[s, .]
    squares: torch.Tensor  # (layers, heads, Q, T) float64: estimated ||d z_h(s) / d e_t||^2
    passes: int  # forward/backward passes run
    triples: int  # (head, query, probe) triples estimated

    @property
    def attribution(self) -> torch.Tensor:
        """``(layers, heads, Q, T)``: G rows, each normalised to sum to 1 over the tokens."""
        norms = self.squares.clamp(min=0).sqrt()
        return norms / norms.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)


def rademacher(shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """Entries +-1 with equal probability, from ``generator`` (CPU)."""
    return torch.randint(0, 2, tuple(shape), generator=generator).double() * 2 - 1


def attribute_sample(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],  # one sample, (1, T) each, no padding, on the model's device
    queries: torch.Tensor,  # (Q,) long
    probes: torch.Tensor,  # (layers, heads, Q, K, d) or (K, d): the probe vectors u
    *,
    rows_per_pass: int = 16,
    scheme: Scheme = "vjp",
) -> SampleAttribution:
    """Attention rows and the probe estimate of ``G^2`` at ``queries`` for every head (see the module doc).

    ``probes`` may be any vectors: Rademacher ones give the seeded estimator, the ``2^d`` sign
    vectors of a small head give ``||J||_F^2`` exactly (``E[u u^T] = I`` over them). ``scheme``
    picks how ``rows_per_pass`` triples share a pass: ``"vjp"`` (one forward, batched
    vector-Jacobian products) or ``"replicate"`` (the sample copied along the batch).
    """
    if scheme not in SCHEMES:
        raise AttributionError(f"scheme: {scheme!r} is not one of {', '.join(SCHEMES)}")
    if rows_per_pass < 1:
        raise AttributionError(f"rows_per_pass: must be >= 1, not {rows_per_pass}")
    check_model(model)
    parameter = next(model.parameters())
    dtype, where = parameter.dtype, parameter.device
    length = int(inputs["input_ids"].shape[1])
    queries = queries.to(torch.long).cpu()

    # 1. One plain forward: each layer's attention rows at the chosen queries, and the embeddings.
    attention: dict[int, torch.Tensor] = {}
    stacks: set[Stack] = set()
    captured: dict[str, torch.Tensor] = {}
    head_dims: dict[int, int] = {}

    def keep_rows(call: AttentionCall) -> None:
        stacks.add(call.stack)
        attention[call.layer] = call.probs[0][:, queries.to(call.probs.device), :].double().cpu()  # (head, Q, T)

    def keep_dims(call: OutputCall) -> None:
        head_dims[call.layer] = int(call.output.shape[-1])

    def keep_embeddings(_module: nn.Module, _args: Any, output: Any) -> None:
        captured["e"] = output.detach()

    embedder = embedding_module(model)
    hook = embedder.register_forward_hook(keep_embeddings)
    try:
        with torch.inference_mode(), AttentionProbe(model, keep_rows, on_output=keep_dims):
            model(**inputs)
    finally:
        hook.remove()
    if not attention or "e" not in captured:
        raise AttributionError(
            f"model: {type(model).__name__} ran without calling headcat's attention probe or its embedding "
            "layer, so headcat cannot take gradients through it"
        )
    if len(stacks) != 1:
        raise AttributionError(f"model: attention in {len(stacks)} stacks ({', '.join(sorted(stacks))}); one only")
    layers = sorted(attention)
    if layers != list(range(len(layers))):
        raise RuntimeError(f"the probe saw layers {layers}; expected 0..{len(layers) - 1}")
    num_layers, num_heads = len(layers), int(attention[0].shape[0])
    head_dim = head_dims[0]
    num_queries = len(queries)
    if probes.dim() == 2:
        probes = probes.expand(num_layers, num_heads, num_queries, *probes.shape)
    if probes.shape[:3] != (num_layers, num_heads, num_queries) or probes.shape[-1] != head_dim:
        raise AttributionError(
            f"probes: shape {tuple(probes.shape)}, expected ({num_layers}, {num_heads}, {num_queries}, K, {head_dim})"
        )
    num_probes = int(probes.shape[3])
    embeddings = captured["e"].clone()  # (1, T, D), out of inference mode

    # 2. Triples (layer, head, query index, probe), sorted by layer; R of them per pass.
    grid = torch.cartesian_prod(
        torch.arange(num_layers), torch.arange(num_heads), torch.arange(num_queries), torch.arange(num_probes)
    )  # (triples, 4), layer-major
    squares = torch.zeros(num_layers, num_heads, num_queries, length, dtype=torch.float64)
    passes = 0
    graph = _VjpGraph(model, embedder, inputs, embeddings) if scheme == "vjp" else None
    per_layer = num_heads * num_queries * num_probes
    chunks = [  # never across layers: a row would go back through the chunk's deepest layer for nothing
        grid[start : min(start + rows_per_pass, (start // per_layer + 1) * per_layer)]
        for layer_start in range(0, len(grid), per_layer)
        for start in range(layer_start, layer_start + per_layer, rows_per_pass)
    ]
    for chunk in chunks:
        u = probes[chunk[:, 0], chunk[:, 1], chunk[:, 2], chunk[:, 3]].to(device=where, dtype=dtype)  # (R, d)
        if graph is not None:
            gradient = graph.gradients(chunk, queries, u)  # (R, T, D)
        else:
            gradient = _one_pass(model, embedder, inputs, embeddings, chunk, queries, u)  # (R, T, D)
        rows_squares = gradient.double().pow(2).sum(-1).cpu()  # (R, T)
        squares.index_put_((chunk[:, 0], chunk[:, 1], chunk[:, 2]), rows_squares, accumulate=True)
        passes += 1
    squares /= num_probes
    stack = next(iter(stacks))
    stacked = torch.stack([attention[layer] for layer in layers])  # (layers, heads, Q, T)
    return SampleAttribution(stack, queries, stacked, squares, passes, len(grid))


class _VjpGraph:
    """The ``"vjp"`` scheme: one forward pass of the sample with its embeddings as the leaf and every
    head's context kept in the graph; then each chunk of ``R`` triples is one batched backward
    (``torch.autograd.grad(..., is_grads_batched=True)``, vmap over the cotangents): cotangent ``b``
    is ``u_b`` at ``(s_b, h_b)`` of layer ``l_b``'s output and zero elsewhere, so gradient ``b`` is
    exactly triple ``b``'s. The forward runs once per sample, not once per row."""

    def __init__(
        self, model: nn.Module, embedder: nn.Module, inputs: dict[str, torch.Tensor], embeddings: torch.Tensor
    ) -> None:
        self.leaf = embeddings.clone().requires_grad_(True)  # (1, T, D)
        self.outputs: dict[int, torch.Tensor] = {}

        def keep(call: OutputCall) -> None:
            self.outputs[call.layer] = call.output  # (1, T, head, d), in the graph

        hook = embedder.register_forward_hook(lambda *_: self.leaf)
        try:
            with torch.enable_grad(), AttentionProbe(model, _ignore, on_output=keep):
                model(**inputs)
        finally:
            hook.remove()

    def gradients(self, chunk: torch.Tensor, queries: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``(R, T, D)``: row ``b`` the gradient of ``u_b . z_{h_b}(s_b)`` of layer ``l_b``."""
        layers = sorted({int(layer) for layer in chunk[:, 0]})
        where = self.leaf.device
        cotangents = []
        for layer in layers:
            output = self.outputs[layer]
            cotangent = output.new_zeros(len(chunk), *output.shape)  # (R, 1, T, head, d)
            rows = (chunk[:, 0] == layer).nonzero()[:, 0]
            cotangent[rows.to(where), 0, queries[chunk[rows, 2]].to(where), chunk[rows, 1].to(where), :] = u[
                rows.to(where)
            ]
            cotangents.append(cotangent)
        (gradient,) = torch.autograd.grad(
            [self.outputs[layer] for layer in layers],
            self.leaf,
            cotangents,
            retain_graph=True,
            is_grads_batched=True,
        )
        return gradient[:, 0]  # (R, T, D)


def _one_pass(
    model: nn.Module,
    embedder: nn.Module,
    inputs: dict[str, torch.Tensor],  # (1, T) each
    embeddings: torch.Tensor,  # (1, T, D): the sample's embedding layer output
    chunk: torch.Tensor,  # (R, 4) long: (layer, head, query index, probe) of each row
    queries: torch.Tensor,  # (Q,) long: query positions
    u: torch.Tensor,  # (R, d): each row's probe
) -> torch.Tensor:
    """``d (sum_b u_b . z_{h_b}(s_b)[b]) / d e``: ``(R, T, D)``, row ``b`` being triple ``b``'s gradient.

    The sample is replicated ``R`` times along the batch; the forward stops after the deepest
    layer of the chunk.
    """
    rows = len(chunk)
    where = embeddings.device
    deepest = int(chunk[:, 0].max())
    leaf = embeddings.expand(rows, -1, -1).clone().requires_grad_(True)  # (R, T, D)
    by_layer = {
        layer: (chunk[:, 0] == layer).nonzero()[:, 0].to(where) for layer in range(int(chunk[:, 0].min()), deepest + 1)
    }
    query_position = queries[chunk[:, 2]].to(where)  # (R,)
    head_index = chunk[:, 1].to(where)  # (R,)
    total: list[torch.Tensor] = []

    def tap(call: OutputCall) -> None:
        index = by_layer.get(call.layer)
        if index is not None and len(index):
            z = call.output[index, query_position[index], head_index[index], :]  # (n, d)
            total.append((z * u[index]).sum())
        if call.layer >= deepest:
            raise _Stop

    def replace_embeddings(_module: nn.Module, _args: Any, _output: Any) -> torch.Tensor:
        return leaf

    batch = {name: tensor.expand(rows, -1) for name, tensor in inputs.items()}
    hook = embedder.register_forward_hook(replace_embeddings)
    try:
        with torch.enable_grad(), AttentionProbe(model, _ignore, on_output=tap):
            try:
                model(**batch)
            except _Stop:
                pass
            if not total:
                raise RuntimeError(f"no head output reached layers {sorted(by_layer)} in this pass")
            (gradient,) = torch.autograd.grad(torch.stack(total).sum(), leaf)
    finally:
        hook.remove()
    return gradient


def _ignore(_call: AttentionCall) -> None:
    return None


# --- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttributionResult:
    """An attribution run's per-head arrays and what is needed to store and reproduce it."""

    stack: Stack
    global_vectors: np.ndarray  # (layers, heads, N + 5): section 1 features of attribution rows
    global_scalars: dict[str, np.ndarray]  # SCALARS name -> (layers, heads)
    local_vectors: np.ndarray  # (layers, heads, N + 5): the same, of attention rows at the same queries
    discrepancy: np.ndarray  # (layers, heads): mean over queries and samples of TV(A[s], G[s])
    example_attention: np.ndarray  # (layers, heads, Q0, m) float32: first sample's attention rows
    example_attribution: np.ndarray  # (layers, heads, Q0, m) float32: its attribution rows
    example_tokens: list[str]
    example_queries: list[int]
    num_samples: int
    num_tokens: int
    triples: int
    passes: int
    seconds: float
    device: str
    dtype: str
    config: AttributionConfig
    feature_names: list[str] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return int(self.discrepancy.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.discrepancy.shape[1])

    @property
    def triples_per_second(self) -> float:
        return self.triples / self.seconds if self.seconds > 0 else math.nan

    def layer_discrepancy(self) -> list[float]:
        """Mean discrepancy of each layer's heads (Pascual et al.'s question: does it grow with depth?)."""
        return [float(value) for value in self.discrepancy.mean(1)]

    def metadata(self) -> dict[str, Any]:
        return {
            "config": self.config.to_json(),
            "stack": self.stack,
            "feature_names": self.feature_names,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "triples": self.triples,
            "passes": self.passes,
            "seconds": self.seconds,
            "triples_per_second": self.triples_per_second,
            "layer_discrepancy": self.layer_discrepancy(),
            "example_tokens": self.example_tokens,
            "example_queries": self.example_queries,
            "device": self.device,
            "dtype": self.dtype,
        }


def choose_queries(length: int, count: int, seed: int, sample_index: int) -> torch.Tensor:
    """``min(count, length)`` distinct query positions of a sample, sorted; seeded per sample."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + sample_index)
    if count >= length:
        return torch.arange(length)
    return torch.randperm(length, generator=generator)[:count].sort().values


def attribute(
    model: LoadedModel | nn.Module,
    tokenizer: Any | None,
    samples: Iterable[Sample],
    config: AttributionConfig | None = None,
    *,
    progress: ProgressCallback | None = None,
) -> AttributionResult:
    """Attribution rows, global vectors and discrepancy of every head over the first ``config.samples`` samples.

    ``progress(done, total)`` counts (head, query, probe) triples, per sample.
    """
    config = config or AttributionConfig()
    if isinstance(model, LoadedModel):
        tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        module: nn.Module = model.model
    else:
        module = model
    if tokenizer is None:
        raise ValueError("attribute needs a tokenizer (or a LoadedModel, which has one)")
    check_model(module)
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and config.max_length > limit:
        raise AttributionError(f"max_length: {config.max_length} is more than the model's {limit} positions")
    parameter = next(module.parameters())
    device = parameter.device

    started = time.perf_counter()
    chosen = list(islice(samples, config.samples))
    if not chosen:
        raise AttributionError("corpus: the corpus yielded no samples: nothing to attribute")
    encoded = encode_samples(tokenizer, chosen, config.max_length)
    special = resolve_special_tokens(tokenizer)
    table = special.group_table(len(tokenizer))
    n = config.num_windows

    was_training = module.training
    module.eval()
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    example: SampleAttribution | None = None
    passes = triples = 0
    first = encoded[0]
    num_layers, num_heads, head_dim = _shape(module, torch.tensor([first.input_ids[:2]], device=device))
    per_sample = num_layers * num_heads * config.probes
    total_triples = sum(per_sample * min(config.queries, len(e.input_ids)) for e in encoded)
    try:
        for index, sample in enumerate(encoded):
            ids = torch.tensor([sample.input_ids], dtype=torch.long)  # (1, T)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if sample.token_type_ids is not None:
                inputs["token_type_ids"] = torch.tensor([sample.token_type_ids], dtype=torch.long)
            inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
            length = ids.shape[1]
            queries = choose_queries(length, config.queries, config.seed, index)
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
            probes = rademacher((num_layers, num_heads, len(queries), config.probes, head_dim), generator)
            result = attribute_sample(
                module, inputs, queries, probes, rows_per_pass=config.rows_per_pass, scheme=config.scheme
            )
            key_groups = table[ids[0]]  # (T,)
            local = row_features(result.attention, queries, key_groups, n)  # (layers, heads, F)
            glob = row_features(result.attribution, queries, key_groups, n)
            discrepancy = total_variation(result.attention, result.attribution).mean(-1)  # (layers, heads)
            for name, values in (("local", local), ("global", glob)):
                defined = ~torch.isnan(values)
                sums[name] = sums.get(name, 0) + torch.nan_to_num(values)  # type: ignore[operator]
                counts[name] = counts.get(name, 0) + defined.double()  # type: ignore[operator]
            sums["discrepancy"] = sums.get("discrepancy", 0) + discrepancy  # type: ignore[operator]
            if index == 0:
                example = result
            passes += result.passes
            triples += result.triples
            if progress is not None:
                progress(triples, total_triples)
    finally:
        module.train(was_training)
    assert example is not None

    def mean(name: str) -> np.ndarray:
        return (sums[name] / counts[name]).numpy()  # NaN where never defined

    local_mean, global_mean = mean("local"), mean("global")
    features = config.num_features
    side = min(config.map_size, int(example.attention.shape[-1]))

    def pooled(rows: torch.Tensor) -> np.ndarray:  # (layers, heads, Q, T) -> (layers, heads, Q, m)
        flat = rows.float().flatten(0, 2)[:, None, :]  # (L*H*Q, 1, T)
        return F.adaptive_avg_pool1d(flat, side).view(*rows.shape[:3], side).numpy()

    seconds = time.perf_counter() - started
    result_out = AttributionResult(
        stack=example.stack,
        global_vectors=global_mean[..., :features],
        global_scalars={name: global_mean[..., features + k] for k, name in enumerate(SCALARS)},
        local_vectors=local_mean[..., :features],
        discrepancy=(sums["discrepancy"] / len(encoded)).numpy(),
        example_attention=pooled(example.attention),
        example_attribution=pooled(example.attribution),
        example_tokens=list(tokenizer.convert_ids_to_tokens(encoded[0].input_ids)),
        example_queries=[int(q) for q in example.queries],
        num_samples=len(encoded),
        num_tokens=sum(len(e.input_ids) for e in encoded),
        triples=triples,
        passes=passes,
        seconds=seconds,
        device=str(device),
        dtype=str(parameter.dtype).removeprefix("torch."),
        config=config,
        feature_names=feature_names(n),
    )
    logger.info(
        "attributions of %d x %d heads from %d samples: %d triples in %d passes, %.1f s (%.0f triples/s)",
        result_out.num_layers, result_out.num_heads, result_out.num_samples, triples, passes, seconds,
        result_out.triples_per_second,
    )  # fmt: skip
    return result_out


def _shape(model: nn.Module, input_ids: torch.Tensor) -> tuple[int, int, int]:
    """``(layers, heads, head_dim)`` as the probe sees them, from one short forward."""
    seen: dict[int, tuple[int, int]] = {}

    def tap(call: OutputCall) -> None:
        seen[call.layer] = (int(call.output.shape[2]), int(call.output.shape[3]))

    with torch.inference_mode(), AttentionProbe(model, _ignore, on_output=tap):
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    if not seen:
        raise AttributionError(
            f"model: {type(model).__name__} ran without calling headcat's attention probe, so headcat cannot "
            "take gradients through its heads"
        )
    heads, dim = seen[0]
    return len(seen), heads, dim
