"""Gradient attribution of every head to the input tokens (SPEC section 8; Pascual et al. 2021).

Attention is local: after the first layer, token ``t``'s vector already mixes the whole input,
so a head's attention row says little about which *input* tokens its context vector reads. The
attribution of head ``h`` (layer ``l``) at query ``s`` to input token ``t`` is

    G[s, t] = || d z_h(s) / d e_t ||_F

with ``z_h(s)`` the head's context vector (before the output projection, :class:`OutputCall`) and
``e_t`` the embedding layer's output at ``t``. Each row is normalised over the sample's tokens to
sum to 1, which makes it comparable with the attention row ``A[s, .]``: the features of SPEC
section 1 computed from attribution rows are the head's **global** vector, and the mean total
variation between the two rows is its **discrepancy**.

How ``G`` is computed: forward mode, tangents on one input position. A tangent ``v`` (``D``
numbers, the hidden size) placed at position ``t`` and zero elsewhere, pushed forward through
the model by ``torch.func.jvp``, gives ``(d z / d e_t) v`` for **every layer, head and query at
once**. Two schemes (:data:`SCHEMES`):

- ``"forward"`` (the default): ``P`` seeded Rademacher tangents per position (entries +-1), and
  ``mean_v ||(d z_h(s) / d e_t) v||^2``, an unbiased estimate of ``G[s, t]^2`` since
  ``E[v v^T] = I`` (variance ``2 sum_{i != j} (J^T J)_{ij}^2`` per tangent, ``J = d z_h(s) / d e_t``).
  Cost per sample: ``T * P`` passes, whatever the number of heads and queries.
- ``"exact"``: the ``D`` unit vectors as tangents at each position, and the sum:
  ``sum_i ||J e_i||^2 = ||J||_F^2`` exactly. Cost: ``T * D`` passes per sample.

A "pass" is one tangent. Tangents run in batches (``torch.vmap`` over ``jvp``: the model's own
forward is computed once per batch, the tangents' parts for all of them together), as many per
batch as keep its live activations under a byte budget (:func:`tangents_per_batch`; the feature
path bounds its attention maps the same way). The head outputs are read with the project's
:class:`~ingest.attention.AttentionProbe` (its ``on_output`` tap), which runs under the
transforms unchanged; the forward stops after the last layer's heads.

Everything of one sample is reduced on the spot: per head, the attention and attribution rows of
its queries (every query unless a seeded subsample is asked for) give the sample's features and
discrepancy (:func:`row_features`); only the first sample's rows are kept, downsampled, as the
example maps.
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
Scheme = Literal["forward", "exact"]
SCHEMES: tuple[Scheme, ...] = get_args(Scheme)

CPU_BATCH_BYTES = 128 << 20  # live activations of one batch of tangents on the CPU
DEVICE_BATCH_BYTES = 4 << 30  # ... on an accelerator


class AttributionError(ValueError):
    """A request headcat cannot compute attributions for (bad parameters, or a model it cannot
    take gradients through); raised before any compute."""


@dataclass(frozen=True)
class AttributionConfig:
    """One attribution run's parameters; stored with its results (:meth:`to_json`)."""

    samples: int = 32  # at most this many samples are read from the corpus
    max_length: int = 64  # tokens per sample after truncation, special tokens included
    queries: int | None = None  # None: every query; N: a seeded subsample of N query positions per sample
    probes: int = 4  # P Rademacher tangents per input position ("forward"; "exact" runs the hidden size)
    scheme: Scheme = "forward"
    batch_bytes: int | None = None  # live activations of one batch of tangents; None: 128 MiB on CPU, 4 GiB else
    num_windows: int = 16
    map_size: int = 32  # keys of the downsampled example maps (rows: the example's queries)
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("samples", "queries", "probes", "batch_bytes", "num_windows", "map_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise AttributionError(f"{name}: must be >= 1, not {value}")
        if self.max_length < 2:
            raise AttributionError(f"max_length: must be >= 2, not {self.max_length}")
        if self.seed < 0:
            raise AttributionError(f"seed: must be >= 0, not {self.seed}")
        if self.scheme not in SCHEMES:
            raise AttributionError(f"scheme: {self.scheme!r} is not one of {', '.join(SCHEMES)}")

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
    """Raised inside the forward pass once the last layer's heads have given their output."""


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
    """One sample's attention and attribution rows at its queries (every layer and head)."""

    stack: Stack
    queries: torch.Tensor  # (Q,) long, sorted
    attention: torch.Tensor  # (layers, heads, Q, T) float64: A[s, .]
    squares: torch.Tensor  # (layers, heads, Q, T) float64: G[s, t]^2, estimated ("forward") or exact
    passes: int  # tangents pushed forward (one pass each)
    batches: int  # vectorised calls they ran in

    @property
    def attribution(self) -> torch.Tensor:
        """``(layers, heads, Q, T)``: G rows, each normalised to sum to 1 over the tokens."""
        norms = self.squares.clamp(min=0).sqrt()
        return norms / norms.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)


def rademacher(shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """Entries +-1 with equal probability, from ``generator`` (CPU)."""
    return torch.randint(0, 2, tuple(shape), generator=generator).double() * 2 - 1


def tangents_per_batch(
    length: int, hidden: int, intermediate: int, heads: int, layers: int, element_size: int, budget: int
) -> int:
    """How many tangents one vectorised pass takes so that their live activations fit in ``budget`` bytes.

    Per tangent, a layer's forward-mode pass holds the tangents of the hidden states, queries,
    keys, values, context and output (``6 T D``), of the feed-forward's inner activations
    (``2 T I``) and of the scores and probabilities (``4 H T^2``); the head outputs of every layer
    wait for the end (``L T D``). The model's own activations are shared by the batch.
    """
    per_tangent = element_size * length * (6 * hidden + 2 * intermediate + 4 * heads * length + layers * hidden)
    return max(1, budget // per_tangent)


class Tangents:
    """The tangents of one sample, position-major: pass ``p`` is position ``p // K``, tangent ``p % K``.

    ``vectors``: ``(T, K, D)`` or ``(K, D)`` (the same at every position), each weighted ``1 / K``
    (the Rademacher mean); None: the ``D`` unit vectors at every position, each weighted 1 (the exact sum).
    """

    def __init__(self, length: int, hidden: int, vectors: torch.Tensor | None) -> None:
        self.length, self.hidden = length, hidden
        if vectors is not None:
            if vectors.dim() == 2:
                vectors = vectors.expand(length, *vectors.shape)
            if vectors.dim() != 3 or vectors.shape[0] != length or vectors.shape[2] != hidden:
                raise AttributionError(
                    f"tangents: shape {tuple(vectors.shape)}, expected ({length}, K, {hidden}) or (K, {hidden})"
                )
        self.vectors = vectors
        self.per_position = hidden if vectors is None else int(vectors.shape[1])
        self.weight = 1.0 if vectors is None else 1.0 / self.per_position

    def __len__(self) -> int:
        return self.length * self.per_position

    def batch(
        self, start: int, stop: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Passes ``[start, stop)``: their positions ``(B,)`` and tangents ``(B, 1, T, D)``, zero off the position."""
        index = torch.arange(start, stop)
        positions, which = index // self.per_position, index % self.per_position
        tangents = torch.zeros(stop - start, 1, self.length, self.hidden, dtype=dtype, device=device)
        rows = torch.arange(stop - start, device=device)
        if self.vectors is None:
            tangents[rows, 0, positions.to(device), which.to(device)] = 1
        else:
            tangents[rows, 0, positions.to(device)] = self.vectors[positions, which].to(device=device, dtype=dtype)
        return positions, tangents


def attribute_sample(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],  # one sample, (1, T) each, no padding, on the model's device
    queries: torch.Tensor | None = None,  # (Q,) long; None: every position
    tangents: torch.Tensor | None = None,  # (T, K, D) or (K, D): the tangents at each position; None: exact
    *,
    batch_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> SampleAttribution:
    """Attention rows and ``G^2`` at ``queries`` for every head, by forward mode (see the module doc).

    ``tangents`` may be any vectors: Rademacher ones give the seeded estimator (the mean over
    them), None gives the unit vectors and ``||J||_F^2`` exactly (the sum). ``progress(passes)``
    is called after each batch with the passes done so far.
    """
    check_model(model)
    parameter = next(model.parameters())
    dtype, where = parameter.dtype, parameter.device
    length = int(inputs["input_ids"].shape[1])
    queries = torch.arange(length) if queries is None else queries.to(torch.long).cpu()

    # 1. One plain forward: each layer's attention rows at the queries, the embeddings, the shapes.
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
    embeddings = captured["e"].clone()  # (1, T, D), out of inference mode
    hidden = int(embeddings.shape[-1])
    plan = Tangents(length, hidden, tangents)

    # 2. Forward mode: each batch of tangents is one vmap over jvp of the head outputs.
    config = getattr(model, "config", None)
    intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    budget = batch_bytes or (CPU_BATCH_BYTES if where.type == "cpu" else DEVICE_BATCH_BYTES)
    size = tangents_per_batch(length, hidden, intermediate, num_heads, num_layers, parameter.element_size(), budget)
    squares = torch.zeros(num_layers, num_heads, length, length, dtype=torch.float64)  # (layers, heads, s, t)
    heads_out = _HeadOutputs(model, embedder, inputs, num_layers)
    batches = 0
    with torch.no_grad(), heads_out:
        for start in range(0, len(plan), size):
            stop = min(start + size, len(plan))
            positions, batch = plan.batch(start, stop, dtype, where)
            found = heads_out.squared_tangents(embeddings, batch)  # (B, layers, T, heads)
            squares.index_add_(3, positions, found.permute(1, 3, 2, 0).to("cpu", torch.float64))
            batches += 1
            if progress is not None:
                progress(stop)
    squares = squares[:, :, queries] * plan.weight  # (layers, heads, Q, T)
    stack = next(iter(stacks))
    stacked = torch.stack([attention[layer] for layer in layers])  # (layers, heads, Q, T)
    return SampleAttribution(stack, queries, stacked, squares, len(plan), batches)


class _HeadOutputs:
    """Every head's context vectors as a function of the embeddings, ``e -> (layers, T, heads, d)``,
    with its tangents' squared norms batched: ``vmap`` over ``jvp``. Entered once per sample (the
    probe and the embedding hook stay on for all its batches)."""

    def __init__(self, model: nn.Module, embedder: nn.Module, inputs: dict[str, torch.Tensor], layers: int) -> None:
        self.model, self.embedder, self.inputs, self.layers = model, embedder, inputs, layers
        self.current: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def __enter__(self) -> _HeadOutputs:
        self.hook = self.embedder.register_forward_hook(lambda *_: self.current)
        self.probe = AttentionProbe(self.model, _ignore, on_output=self._keep)
        try:
            self.probe.__enter__()
        except BaseException:
            self.hook.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.probe.__exit__(*exc)
        finally:
            self.hook.remove()

    def _keep(self, call: OutputCall) -> None:
        self.outputs[call.layer] = call.output
        if call.layer == self.layers - 1:
            raise _Stop

    def contexts(self, e: torch.Tensor) -> torch.Tensor:
        """``(layers, T, heads, d)``: the heads' context vectors with the embedding layer's output replaced by ``e``."""
        self.current, self.outputs = e, {}
        try:
            self.model(**self.inputs)
        except _Stop:
            pass
        finally:
            self.current = None
        missing = [layer for layer in range(self.layers) if layer not in self.outputs]
        if missing:
            raise RuntimeError(f"no head output reached layers {missing} in the forward-mode pass")
        found = torch.stack([self.outputs[layer][0] for layer in range(self.layers)])
        self.outputs = {}
        return found

    def squared_tangents(self, e: torch.Tensor, tangents: torch.Tensor) -> torch.Tensor:
        """``(B, layers, T, heads)``: ``||(d z_h(s) / d e) v_b||^2`` for each tangent ``v_b`` of ``(B, 1, T, D)``."""

        def one(tangent: torch.Tensor) -> torch.Tensor:
            pushed = torch.func.jvp(self.contexts, (e,), (tangent,))[1]
            return pushed.to(torch.promote_types(pushed.dtype, torch.float32)).pow(2).sum(-1)

        return torch.vmap(one)(tangents)  # type: ignore[no-any-return]


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
    rows: int  # attribution rows: (layer, head, query) of every sample
    triples: int  # (layer, head, query, tangent) estimates: rows x tangents per position
    passes: int  # tangents pushed forward
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

    @property
    def tangents_per_position(self) -> int:
        """``P`` (forward) or the hidden size (exact): the tangents each row's estimate is made of."""
        return self.triples // self.rows if self.rows else 0

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else math.nan

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
            "rows": self.rows,
            "triples": self.triples,
            "passes": self.passes,
            "seconds": self.seconds,
            "rows_per_second": self.rows_per_second,
            "triples_per_second": self.triples_per_second,
            "layer_discrepancy": self.layer_discrepancy(),
            "example_tokens": self.example_tokens,
            "example_queries": self.example_queries,
            "device": self.device,
            "dtype": self.dtype,
        }


def choose_queries(length: int, count: int | None, seed: int, sample_index: int) -> torch.Tensor:
    """``min(count, length)`` distinct query positions of a sample, sorted; seeded per sample. None: every one."""
    if count is None or count >= length:
        return torch.arange(length)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + sample_index)
    return torch.randperm(length, generator=generator)[:count].sort().values


def sample_tangents(config: AttributionConfig, length: int, hidden: int, sample_index: int) -> torch.Tensor | None:
    """The seeded Rademacher tangents of sample ``sample_index``: ``(T, P, D)``; None for the exact scheme."""
    if config.scheme == "exact":
        return None
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + sample_index)
    return rademacher((length, config.probes, hidden), generator)


def attribute(
    model: LoadedModel | nn.Module,
    tokenizer: Any | None,
    samples: Iterable[Sample],
    config: AttributionConfig | None = None,
    *,
    progress: ProgressCallback | None = None,
) -> AttributionResult:
    """Attribution rows, global vectors and discrepancy of every head over the first ``config.samples`` samples.

    ``progress(done, total)`` counts forward-mode passes (tangents), after each batch; ``(0, total)``
    first, once the samples are tokenized.
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
    passes = rows = 0
    first = encoded[0]
    num_layers, num_heads, hidden = _shape(module, torch.tensor([first.input_ids[:2]], device=device))
    per_position = hidden if config.scheme == "exact" else config.probes
    total = sum(per_position * len(e.input_ids) for e in encoded)
    if progress is not None:
        progress(0, total)
    try:
        for index, sample in enumerate(encoded):
            ids = torch.tensor([sample.input_ids], dtype=torch.long)  # (1, T)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if sample.token_type_ids is not None:
                inputs["token_type_ids"] = torch.tensor([sample.token_type_ids], dtype=torch.long)
            inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
            length = ids.shape[1]
            queries = choose_queries(length, config.queries, config.seed, index)
            done = passes
            report = None if progress is None else (lambda count, done=done: progress(done + count, total))
            result = attribute_sample(
                module, inputs, queries, sample_tangents(config, length, hidden, index),
                batch_bytes=config.batch_bytes, progress=report,
            )  # fmt: skip
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
            rows += num_layers * num_heads * len(queries)
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
        rows=rows,
        triples=rows * per_position,
        passes=passes,
        seconds=seconds,
        device=str(device),
        dtype=str(parameter.dtype).removeprefix("torch."),
        config=config,
        feature_names=feature_names(n),
    )
    logger.info(
        "attributions (%s) of %d x %d heads from %d samples: %d rows from %d passes, %.1f s (%.0f rows/s)",
        config.scheme, result_out.num_layers, result_out.num_heads, result_out.num_samples, rows, passes, seconds,
        result_out.rows_per_second,
    )  # fmt: skip
    return result_out


def _shape(model: nn.Module, input_ids: torch.Tensor) -> tuple[int, int, int]:
    """``(layers, heads, hidden size)`` as the probe and the embedding layer see them, from one short forward."""
    seen: dict[int, int] = {}
    hidden: list[int] = []

    def tap(call: OutputCall) -> None:
        seen[call.layer] = int(call.output.shape[2])

    embedder = embedding_module(model)
    hook = embedder.register_forward_hook(lambda _m, _a, output: hidden.append(int(output.shape[-1])))
    try:
        with torch.inference_mode(), AttentionProbe(model, _ignore, on_output=tap):
            model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    finally:
        hook.remove()
    if not seen or not hidden:
        raise AttributionError(
            f"model: {type(model).__name__} ran without calling headcat's attention probe, so headcat cannot "
            "take gradients through its heads"
        )
    return len(seen), seen[0], hidden[0]
