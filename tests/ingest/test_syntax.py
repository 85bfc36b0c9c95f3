"""Syntax heads (SPEC 9): parses, word-level pooling, forced attention scoring 100 %, the baseline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ingest.attention import AttentionCall
from ingest.loading import load_model
from ingest.syntax import (
    SPACY_PIPELINE,
    ParsedSentence,
    SyntaxConfig,
    SyntaxDataError,
    baselines,
    encode_sentences,
    read_conllu,
    silver_parses,
    syntax_accuracy,
    word_attention,
    word_matrices,
)

CONLLU = """# sent_id = 1
# text = The xylophonists played loudly.
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\txylophonists\txylophonist\tNOUN\tNNS\t_\t3\tnsubj\t_\t_
3\tplayed\tplay\tVERB\tVBD\t_\t0\troot\t_\t_
4\tloudly\tloudly\tADV\tRB\t_\t3\tadvmod\t_\t_
5\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_

1-2\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
1\tdo\tdo\tAUX\tVBP\t_\t3\taux\t_\t_
2\tn't\tnot\tPART\tRB\t_\t3\tadvmod\t_\t_
3\tgo\tgo\tVERB\tVB\t_\t0\troot\t_\t_
"""

needs_spacy = pytest.mark.skipif(
    importlib.util.find_spec(SPACY_PIPELINE) is None,
    reason='spaCy and its English pipeline are not installed (pip install "headcat[syntax]")',
)


def test_read_conllu(tmp_path: Path) -> None:
    path = tmp_path / "gold.conllu"
    path.write_text(CONLLU)
    first, second = read_conllu(path)
    assert first.words == ("The", "xylophonists", "played", "loudly", ".")
    assert first.heads == (1, 2, -1, 2, 2)
    assert first.pairs() == [(0, 1, "det"), (1, 2, "nsubj"), (3, 2, "advmod"), (4, 2, "punct")]
    assert second.words == ("do", "n't", "go")  # the multiword token line is skipped


@pytest.mark.parametrize(
    ("bad", "line", "message"),
    [
        ("3\tplayed\tplay\tVERB\tVBD\t_\tx\troot\t_\t_", 5, "head"),
        ("3\tplayed\tplay\tVERB", 5, "4 tab-separated columns"),
        ("3\tplayed\tplay\tVERB\tVBD\t_\t9\troot\t_\t_", 5, "head 9"),
        ("7\tplayed\tplay\tVERB\tVBD\t_\t0\troot\t_\t_", 5, "token id 7"),
    ],
)
def test_a_malformed_conllu_line_is_named(tmp_path: Path, bad: str, line: int, message: str) -> None:
    lines = CONLLU.splitlines()
    lines[line - 1] = bad
    path = tmp_path / "bad.conllu"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SyntaxDataError, match=rf"bad.conllu:{line}: .*{message}"):
        read_conllu(path)


def test_a_conllu_file_without_relations_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.conllu"
    path.write_text("# only a comment\n\n")
    with pytest.raises(SyntaxDataError, match="no sentence"):
        read_conllu(path)


def test_word_pooling_sums_to_a_word_and_averages_from_it() -> None:
    """SPEC 9 on a word of three tokens: to it = sum over its tokens, from it = mean over them."""
    word_ids = [None, 0, 1, 1, 1, 2, None]  # [CLS] w0 w1 w1 w1 w2 [SEP]
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(1, 2, 7, 7) * 3, dim=-1)  # (batch, head, T, T)
    to, mean_from = word_matrices([word_ids], [3], 7)
    found = word_attention(probs, to, mean_from)[0]  # (head, W, W)
    tokens = {w: [t for t, v in enumerate(word_ids) if v == w] for w in range(3)}
    for head in range(2):
        for i in range(3):
            for j in range(3):
                expected = sum(sum(float(probs[0, head, a, b]) for b in tokens[j]) for a in tokens[i]) / len(tokens[i])
                assert float(found[head, i, j]) == pytest.approx(expected, abs=1e-6)
    # the special tokens' attention is left out: a row of words sums to less than 1
    assert float(found.sum(-1).max()) < 1


@pytest.fixture(scope="module")
def tiny(tiny_bert_path: Path):  # type: ignore[no-untyped-def]
    return load_model(str(tiny_bert_path), device="cpu")


SENTENCE = ParsedSentence(
    words=("the", "xylophonists", "played", "loudly", "."),
    heads=(1, 2, -1, 2, 2),
    relations=("det", "nsubj", "root", "advmod", "punct"),
)


def forced(word_ids: list[int | None], sentence: ParsedSentence, distractor_weight: float = 0.3):  # type: ignore[no-untyped-def]
    """A probe edit: layer 0 head 0 of every word's tokens puts 0.6 on its syntactic head word, spread over
    that word's tokens, and 0.3 on one other single-token word (a distractor), the rest on [CLS]."""
    length = len(word_ids)
    tokens = {w: [t for t, v in enumerate(word_ids) if v == w] for w in range(len(sentence.words))}

    def edit(call: AttentionCall) -> torch.Tensor | None:
        if call.layer != 0:
            return None
        probs = call.probs.clone()
        row = torch.zeros(length, length)
        for word, head in enumerate(sentence.heads):
            target = head if head >= 0 else word
            distractor = next(w for w in range(len(sentence.words)) if w not in (word, target) and len(tokens[w]) == 1)
            for a in tokens[word]:
                for b in tokens[target]:
                    row[a, b] += 0.6 / len(tokens[target])
                row[a, tokens[distractor][0]] += distractor_weight
                row[a, 0] = 1 - row[a].sum()
        row[0, 0] = row[-1, -1] = 1
        probs[0, 0] = row
        return probs

    return edit


def test_attention_forced_onto_the_syntactic_head_scores_100_percent(tiny) -> None:  # type: ignore[no-untyped-def]
    (encoded,), skipped = encode_sentences(tiny.tokenizer, [SENTENCE], 64)
    assert skipped == 0
    split = [w for w in set(encoded.word_ids) if w is not None and encoded.word_ids.count(w) >= 3]
    assert split == [1]  # "xylophonists" is several tokens: to-pooling must sum them to beat the distractor
    result = syntax_accuracy(tiny.model, tiny.tokenizer, [SENTENCE], edit=forced(encoded.word_ids, SENTENCE))
    assert result.relations == ["advmod", "det", "nsubj", "punct"]
    accuracy = result.accuracy  # (layers, heads, relations, 2)
    assert (accuracy[0, 0, :, 0] == 1).all()  # dependent -> head: every relation 100 %
    assert not (accuracy[1, :, :, 0] == 1).all()  # the unforced layer does not
    assert result.counts.tolist() == [1, 1, 1, 1]
    best = {row["relation"]: row for row in result.best()}
    assert best["det"]["accuracy"] == 1
    assert best["det"]["layer"] == 0


def test_the_forced_test_would_catch_mean_pooling_of_keys(tiny) -> None:  # type: ignore[no-untyped-def]
    """Sensitivity of the test above: pooling *to* a word by the mean would send 'the' to the distractor."""
    (encoded,), _ = encode_sentences(tiny.tokenizer, [SENTENCE], 64)
    length = len(encoded.word_ids)
    call = AttentionCall(layer=0, probs=torch.zeros(1, 4, length, length), scores=torch.zeros(1), module=None)  # type: ignore[arg-type]
    probs = forced(encoded.word_ids, SENTENCE)(call)
    assert probs is not None
    to, mean_from = word_matrices([encoded.word_ids], [len(SENTENCE.words)], length)
    summed = word_attention(probs, to, mean_from)[0, 0].fill_diagonal_(-1).argmax(-1)
    averaged = word_attention(probs, mean_from, mean_from)[0, 0].fill_diagonal_(-1).argmax(-1)
    assert summed[0] == 1  # the -> xylophonists
    assert averaged[0] != 1


def test_the_baseline_is_the_most_common_offset() -> None:
    sentences = [SENTENCE, ParsedSentence(("a", "dog", "barked"), (1, 2, -1), ("det", "nsubj", "root"))]
    offsets, correct = baselines(sentences, ["det", "nsubj", "advmod"])
    assert offsets == [1, 1, -1]
    assert correct == [2, 2, 1]


def test_sentences_too_long_are_left_out(tiny) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SyntaxDataError, match="max_length: every one of the"):
        syntax_accuracy(tiny.model, tiny.tokenizer, [SENTENCE], SyntaxConfig(max_length=4))


@needs_spacy
def test_silver_parses() -> None:
    (sentence,) = silver_parses(["The cat saw a dog."])
    relations = dict(zip(sentence.words, sentence.relations, strict=True))
    assert relations["The"] == "det"
    assert relations["cat"] == "nsubj"
    assert relations["dog"] == "dobj"
    with pytest.raises(SyntaxDataError, match="no parseable sentence"):
        silver_parses(["...", "!!", ""])
