"""Corpus specs and readers: every format on small files, the builtins, and the real shared data."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

from ingest.corpora import CorpusError, Sample, load_corpus, prose_pairs, split_sentences


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_text(text, encoding=encoding)
    return path


def test_text_file_one_sample_per_line(tmp_path: Path) -> None:
    path = write(tmp_path / "lines.txt", "\ufeffFirst line.\n\n  \nSecond line.\r\nThird\n")
    corpus = load_corpus(str(path))
    assert (corpus.kind, corpus.name, corpus.source) == ("text", "lines.txt", str(path.resolve()))
    assert corpus.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert list(corpus.samples()) == [Sample("First line."), Sample("Second line."), Sample("Third")]
    assert list(corpus.samples(2)) == list(corpus.samples(None))[:2]
    assert corpus.to_json()["kind"] == "text"


@pytest.mark.parametrize(
    ("header", "row", "expected"),
    [
        (
            "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
            '1\t1\t2\t"Unbalanced quote.\tB.',
            ('"Unbalanced quote.', "B."),
        ),
        ("sentence\tlabel", "it 's a charming journey . \t1", ("it 's a charming journey .", None)),
        ("index\tsentence1\tsentence2\tlabel", "0\tA man.\tA person.\tentailment", ("A man.", "A person.")),
        ("index\tquestion\tsentence\tlabel", "0\tWho?\tHe did.\tentailment", ("Who?", "He did.")),
        ("premise\thypothesis", "P.\tH.", ("P.", "H.")),
        ("text\tlabel", "SST-2 as renamed here.\t0", ("SST-2 as renamed here.", None)),
    ],
)
def test_glue_tsv_columns_found_by_header(
    tmp_path: Path, header: str, row: str, expected: tuple[str, str | None]
) -> None:
    path = write(tmp_path / "dev.tsv", f"{header}\n{row}\n\n")
    corpus = load_corpus(str(path))
    assert corpus.kind == "glue"
    assert list(corpus.samples()) == [Sample(*expected)]


def test_glue_tsv_errors_name_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.tsv", "id\tlabel\n1\t0\n")
    with pytest.raises(CorpusError, match=r"bad\.tsv, line 1: no sentence columns"):
        load_corpus(str(path))
    path = write(tmp_path / "short.tsv", "sentence1\tsentence2\nA.\tB.\nonly one field\n")
    with pytest.raises(CorpusError, match=r"short\.tsv: 1 malformed line\(s\), .*: line\(s\) 3$"):
        load_corpus(str(path), refuse_malformed=True)


def test_jsonl_records(tmp_path: Path) -> None:
    records = [
        {"text": "One.", "text_pair": "Two."},
        {"text": "Alone.", "text_pair": None},
        {"text": "Also alone."},
        {"sentence1": "S1.", "sentence2": "S2.", "label": 1},
        {"premise": "P.", "hypothesis": "H.", "label": "entailment", "idx": 3},
    ]
    path = write(tmp_path / "data.jsonl", "\n".join(json.dumps(r) for r in records) + "\n\n")
    assert list(load_corpus(str(path)).samples()) == [
        Sample("One.", "Two."),
        Sample("Alone."),
        Sample("Also alone."),
        Sample("S1.", "S2."),
        Sample("P.", "H."),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"data\.jsonl, line 2: not JSON"),
        ('{"label": 1}', r"data\.jsonl, line 2: no text field"),
        ('["text"]', r"data\.jsonl, line 2: a record must be a JSON object"),
        ('{"text": 3}', r"data\.jsonl, line 2: fields \['text'\] must be strings"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    """Found when the corpus is loaded (every record is read then), before any model loads."""
    path = write(tmp_path / "data.jsonl", '{"text": "fine"}\n' + line + "\n")
    with pytest.raises(CorpusError, match=message):
        load_corpus(str(path))


def squad(paragraphs: list[dict]) -> dict:
    return {"version": "1.1", "data": [{"title": "T", "paragraphs": paragraphs}]}


def test_squad_json_question_context_pairs(tmp_path: Path) -> None:
    document = squad(
        [
            {"context": "C one.", "qas": [{"question": "Q1?", "id": "a", "answers": []}, {"question": "Q2?"}]},
            {"context": "C two.", "qas": [{"question": "Q3?"}]},
        ]
    )
    path = write(tmp_path / "dev.json", json.dumps(document))
    corpus = load_corpus(str(path))
    assert corpus.kind == "squad"
    assert list(corpus.samples()) == [Sample("Q1?", "C one."), Sample("Q2?", "C one."), Sample("Q3?", "C two.")]


def test_squad_errors_name_the_record(tmp_path: Path) -> None:
    path = write(tmp_path / "dev.json", json.dumps(squad([{"context": "C."}])))
    with pytest.raises(CorpusError, match=r"dev\.json, record data\[0\]\.paragraphs\[0\]: needs"):
        list(load_corpus(str(path)).samples())
    path = write(tmp_path / "broken.json", '{"data": [\n  1,\n  oops]}')
    with pytest.raises(CorpusError, match=r"broken\.json, line 3: not JSON"):
        list(load_corpus(str(path)).samples())
    path = write(tmp_path / "other.json", "[]")
    with pytest.raises(CorpusError, match="not SQuAD format"):
        list(load_corpus(str(path)).samples())


def test_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(str(tmp_path / "missing.tsv"))
    with pytest.raises(CorpusError, match="not a builtin"):
        load_corpus(str(write(tmp_path / "data.csv", "a,b\n")))
    with pytest.raises(CorpusError, match="unknown builtin corpus 'builtin:nope'"):
        load_corpus("builtin:nope")
    with pytest.raises(CorpusError, match="hub:NAME"):
        load_corpus("hub:")
    with pytest.raises(ValueError, match="limit"):
        load_corpus(str(write(tmp_path / "x.txt", "a\n"))).samples(-1)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hub_without_datasets_says_what_to_install() -> None:
    corpus = load_corpus("hub:glue:mrpc:validation")
    assert (corpus.kind, corpus.name, corpus.sha256) == ("hub", "glue", None)
    with pytest.raises(CorpusError, match="pip install datasets"):
        next(corpus.samples(1))


def test_sentence_splitting() -> None:
    text = 'Dr. Smith met J. R. R. Tolkien in the U.S. in 1950. They talked. Did they? "Yes," he said.'
    assert split_sentences(text) == [
        "Dr. Smith met J. R. R. Tolkien in the U.S. in 1950.",
        "They talked.",
        "Did they?",
        '"Yes," he said.',
    ]
    # A sentence that is not prose breaks the run: no pair straddles it.
    paragraph = "This is the first good sentence. This is the second good sentence. Bad {{markup}} here. " * 2
    assert (
        prose_pairs(paragraph) == [Sample("This is the first good sentence.", "This is the second good sentence.")] * 2
    )


SENTENCE = re.compile(r"""^["'(A-Z0-9].*[.!?]["')]*$""")


@pytest.mark.parametrize(("spec", "at_least"), [("wiki", 5000), ("builtin:lee", 1000)])
def test_builtin_prose_pairs(spec: str, at_least: int) -> None:
    corpus = load_corpus(spec)
    assert corpus.kind == "builtin"
    assert len(corpus.sha256 or "") == 64
    samples = list(corpus.samples())
    assert len(samples) >= at_least
    assert len(set(samples)) > 0.99 * len(samples)
    for sample in samples:
        assert sample.text_pair is not None
        for sentence in (sample.text, sample.text_pair):
            assert SENTENCE.match(sentence), sentence
            assert not re.search(r"[|{}\[\]<>=]|'''", sentence), sentence
    assert list(corpus.samples(5)) == samples[:5]


def test_default_corpus_starts_with_wikipedia_prose() -> None:
    first = next(load_corpus("builtin:wiki").samples(1))
    assert first.text.startswith("Anarchism is a political philosophy")
    # Round robin over articles: the first samples come from different articles.
    assert [s.text.split()[0] for s in load_corpus("wiki").samples(3)] == ["Anarchism", "Autism", "It"]


# --- the real files under shared/data --------------------------------------------------------


@pytest.mark.parametrize(
    ("relative", "kind", "count", "paired"),
    [
        ("glue-mrpc/dev.tsv", "glue", 408, True),
        ("glue-mrpc/test.tsv", "glue", 1725, True),
        ("glue-sst2/dev.tsv", "glue", 872, False),
        ("glue-rte/val.jsonl", "jsonl", 277, True),
        ("glue-rte/test.jsonl", "jsonl", 3000, True),
        ("glue-mnli/dev_matched.jsonl", "jsonl", 9815, True),
        ("squad-v1.1/dev-v1.1.json", "squad", 10570, True),
    ],
)
def test_shared_data_files(shared_dir: Path, relative: str, kind: str, count: int, paired: bool) -> None:
    path = shared_dir / "data" / relative
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    corpus = load_corpus(str(path))
    assert corpus.kind == kind
    samples = list(corpus.samples())
    assert len(samples) == count
    assert all(sample.text for sample in samples)
    assert all((sample.text_pair is not None) == paired for sample in samples)


def test_shared_mrpc_keeps_quotes(shared_dir: Path) -> None:
    path = shared_dir / "data" / "glue-mrpc" / "dev.tsv"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    first = next(load_corpus(str(path)).samples())
    assert first.text.startswith("He said the foodservice pie business")
    assert first.text_pair == '"The foodservice pie business does not fit our long-term growth strategy.'
