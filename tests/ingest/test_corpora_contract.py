"""The corpus readers line by line: exact outputs on hand-written inputs (issue 14, mutation testing).

Every expected value below is written by hand from the rule in ``ingest/corpora.py``'s docstrings;
hashes are computed here with hashlib on the bytes the test writes. The builtin readers are called
directly on tiny files (``_builtin_pairs`` is cached, so going through ``load_corpus`` would not
reach them twice); ``_read_hub`` runs against a fake ``datasets`` module, not the network.
"""

from __future__ import annotations

import bz2
import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ingest import corpora
from ingest.corpora import (
    CorpusError,
    Sample,
    _is_sentence,
    _lee_paragraphs,
    _round_robin,
    _tidy,
    _wiki_paragraphs,
    builtin_path,
    file_sha256,
    load_corpus,
    prose_pairs,
    split_sentences,
)
from tests.waiting import PATIENCE


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- specs and the Corpus record --------------------------------------------------------------


def test_to_json_and_limit_zero(tmp_path: Path) -> None:
    path = write(tmp_path / "a.txt", "One.\nTwo.\n")
    corpus = load_corpus(str(path))
    assert corpus.to_json() == {
        "name": "a.txt",
        "kind": "text",
        "source": str(path.resolve()),
        "sha256": hashlib.sha256(b"One.\nTwo.\n").hexdigest(),
    }
    assert list(corpus.samples(0)) == []
    assert list(corpus.samples(1)) == [Sample("One.")]


def test_builtin_and_hub_specs_name_the_corpus() -> None:
    lee = load_corpus(" builtin:lee ")
    assert (lee.name, lee.kind, lee.source) == ("lee", "builtin", "lee")
    assert lee.sha256 == hashlib.sha256(builtin_path("lee").read_bytes()).hexdigest()
    hub = load_corpus("hub:glue:mrpc:validation")
    assert hub.to_json() == {"name": "glue", "kind": "hub", "source": "glue:mrpc:validation", "sha256": None}


def test_spec_error_messages(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"builtins are lee, wiki$"):
        load_corpus("builtin:nope")
    with pytest.raises(CorpusError, match=r"is not hub:NAME\[:CONFIG\]\[:SPLIT\]"):
        load_corpus("hub:a:b:c:d")
    with pytest.raises(CorpusError, match=r"or a file ending in \.json, \.tsv, \.jsonl, \.txt$"):
        load_corpus(str(tmp_path / "x.csv"))
    missing = tmp_path / "missing.txt"
    with pytest.raises(CorpusError, match=f"corpus file {str(missing)!r} does not exist"):
        load_corpus(str(missing))


def test_file_sha256_across_blocks(tmp_path: Path) -> None:
    data = bytes(range(256)) * 5000 + b"tail"  # 1.28 MB: more than one 1 MiB block
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert file_sha256(empty) == hashlib.sha256(b"").hexdigest()


# --- GLUE .tsv --------------------------------------------------------------------------------


def test_glue_bom_blank_and_whitespace_rows(tmp_path: Path) -> None:
    # BOM before the sentence column's name; a whitespace-only row and an empty row mid-file are skipped.
    path = write(tmp_path / "d.tsv", "\ufeffsentence\tlabel\nFirst.\t1\n \t \n\nSecond.\t0\n")
    assert list(load_corpus(str(path)).samples()) == [Sample("First."), Sample("Second.")]


def test_glue_header_is_not_csv_quoted(tmp_path: Path) -> None:
    path = write(tmp_path / "q.tsv", '"note\tsentence1\tsentence2\nx\tA.\tB.\n')
    assert list(load_corpus(str(path)).samples()) == [Sample("A.", "B.")]


def test_glue_error_messages(tmp_path: Path) -> None:
    empty = write(tmp_path / "empty.tsv", "")
    with pytest.raises(CorpusError, match=r"empty\.tsv: the file is empty; a GLUE \.tsv starts with a header line"):
        load_corpus(str(empty))
    bad = write(tmp_path / "bad.tsv", "id\tlabel\n")
    with pytest.raises(CorpusError, match=r"\(expected text/text_pair; #1 String/#2 String; sentence1/sentence2;"):
        load_corpus(str(bad))
    short = write(tmp_path / "short.tsv", "sentence1\tsentence2\nonly one\n")
    with pytest.raises(CorpusError, match=r"short\.tsv: the corpus has no samples \(no well-formed line after the h"):
        load_corpus(str(short))
    with pytest.raises(CorpusError, match=r"short\.tsv: 1 malformed line\(s\), with not as many tab-separated fields "
                                          r"as the header: line\(s\) 2$"):  # fmt: skip
        load_corpus(str(short), refuse_malformed=True)


def test_malformed_glue_lines_are_counted_named_and_left_out_or_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [
        "sentence\tlabel",
        "Good.\t1",
        "a\ttab\tinside\t0",
        "Fine.\t0",
        "no label",
        *[f"S{i}.\t1" for i in range(12)],
    ]
    path = write(tmp_path / "mixed.tsv", "\n".join([*rows, "x\ty\tz", ""]))
    with caplog.at_level("WARNING", logger="ingest.corpora"):
        corpus = load_corpus(str(path))
    assert [s.text for s in corpus.samples()] == ["Good.", "Fine.", *[f"S{i}." for i in range(12)]]
    assert "mixed.tsv: 3 malformed line(s), with not as many tab-separated fields as the header: line(s) 3, 5, 18;" in (
        caplog.text
    )
    with pytest.raises(CorpusError, match=r"3 malformed line\(s\).*line\(s\) 3, 5, 18$"):
        load_corpus(str(path), refuse_malformed=True)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".tsv", ".json"])
def test_a_file_that_is_not_utf8_is_refused_naming_file_and_line(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes("sentence\nfirst line\nna\u00efve caf\u00e9\n".encode("latin-1"))
    with pytest.raises(CorpusError, match=rf"latin1\{suffix}, line 3: not UTF-8 \(byte 0xef at column 3\)"):
        load_corpus(str(path))


@pytest.mark.parametrize(("name", "text"), [("e.txt", "\n  \n"), ("e.jsonl", "\n"), ("e.json", '{"data": []}')])
def test_a_corpus_without_samples_is_refused(tmp_path: Path, name: str, text: str) -> None:
    with pytest.raises(CorpusError, match=rf"{name}: the corpus has no samples$"):
        load_corpus(str(write(tmp_path / name, text)))


# --- JSON lines and SQuAD ---------------------------------------------------------------------


def test_jsonl_bom_and_blank_line_mid_file(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", '\ufeff{"text": " A. "}\n\n{"text": "B.", "text_pair": "C."}\n')
    assert list(load_corpus(str(path)).samples()) == [Sample("A."), Sample("B.", "C.")]


def test_jsonl_record_type_named(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", "[1]\n")
    with pytest.raises(CorpusError, match=r"line 1: a record must be a JSON object, not list$"):
        list(load_corpus(str(path)).samples())


def test_squad_bom(tmp_path: Path) -> None:
    document = {"data": [{"paragraphs": [{"context": "C.", "qas": [{"question": " Q? "}]}]}]}
    path = write(tmp_path / "d.json", "\ufeff" + json.dumps(document))
    assert list(load_corpus(str(path)).samples()) == [Sample("Q?", "C.")]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1], r"d\.json, record data\[0\]: no 'paragraphs' list$"),
        ([{"paragraphs": [1]}], r"d\.json, record data\[0\]\.paragraphs\[0\]: not an object$"),
        (
            [{"paragraphs": [{"context": "C.", "qas": [{"question": "Q?"}, 2]}]}],
            r"d\.json, record data\[0\]\.paragraphs\[0\]\.qas\[1\]: no 'question' string$",
        ),
    ],
)
def test_squad_structure_errors(tmp_path: Path, data: list[Any], message: str) -> None:
    path = write(tmp_path / "d.json", json.dumps({"data": data}))
    with pytest.raises(CorpusError, match=message):
        list(load_corpus(str(path)).samples())


# --- hub, through a fake datasets module ------------------------------------------------------


class FakeDataset:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.column_names = list(rows[0]) if rows else []

    def __iter__(self):
        return iter(self.rows)


@pytest.fixture
def fake_datasets(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"calls": [], "rows": [], "error": None}

    def load_dataset(*args: Any, **kwargs: Any) -> FakeDataset:
        state["calls"].append((args, kwargs))
        if state["error"] is not None:
            raise state["error"]
        return FakeDataset(state["rows"])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return state


def test_hub_rows_become_samples(fake_datasets: dict[str, Any]) -> None:
    fake_datasets["rows"] = [
        {"idx": 0, "sentence1": " A. ", "sentence2": "B.", "label": 1},
        {"idx": 1, "sentence1": "C.", "sentence2": "D.", "label": 0},
    ]
    samples = list(load_corpus("hub:glue:mrpc:validation").samples())
    assert samples == [Sample("A.", "B."), Sample("C.", "D.")]
    assert fake_datasets["calls"] == [(("glue", "mrpc"), {"split": "validation"})]


@pytest.mark.parametrize(
    ("spec", "call"),
    [
        ("hub:imdb", (("imdb", None), {"split": "train"})),
        ("hub:imdb::test", (("imdb", None), {"split": "test"})),
        ("hub:glue:sst2", (("glue", "sst2"), {"split": "train"})),
    ],
)
def test_hub_defaults(fake_datasets: dict[str, Any], spec: str, call: tuple) -> None:
    fake_datasets["rows"] = [{"text": "One.", "label": 1}]
    assert list(load_corpus(spec).samples()) == [Sample("One.")]
    assert fake_datasets["calls"] == [call]


def test_hub_errors(fake_datasets: dict[str, Any]) -> None:
    fake_datasets["error"] = FileNotFoundError("no such dataset")
    with pytest.raises(CorpusError, match=r"hub dataset 'nope' could not be loaded: no such dataset$"):
        list(load_corpus("hub:nope").samples())
    fake_datasets["error"] = None
    fake_datasets["rows"] = [{"idx": 0, "label": 1}]
    with pytest.raises(CorpusError, match=r"hub dataset 'x': no text columns among \['idx', 'label'\]$"):
        list(load_corpus("hub:x").samples())
    fake_datasets["rows"] = [{"text": "Fine."}, {"text": 3}]
    samples = load_corpus("hub:y").samples()
    assert next(samples) == Sample("Fine.")
    with pytest.raises(CorpusError, match=r"^y, record 1: fields \['text'\] must be strings$"):
        next(samples)


# --- builtins: locating gensim's files, reading them ------------------------------------------


def test_builtin_path_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(corpora.BUILTIN_FILES, "ghost", "no-such-file.bz2")
    with pytest.raises(CorpusError, match=r"builtin corpus 'ghost': .*no-such-file\.bz2 is missing from the gensim"):
        builtin_path("ghost")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CorpusError, match=r"builtin corpus 'lee' comes with gensim, which is not installed$"):
        builtin_path("lee")


def test_round_robin() -> None:
    a, b, c, d, e, f = (Sample(x) for x in "abcdef")
    assert list(_round_robin([[a, b, c], [d], [], [e, f]])) == [a, d, e, b, f, c]
    assert list(_round_robin([])) == []


WIKI = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
<siteinfo><sitename>Test</sitename></siteinfo>
<page><title>Alpha</title><ns>0</ns><id>1</id><revision><id>11</id><text>First paragraph here.

* a list item
Second   paragraph  , there.
== See also ==
After the end.</text></revision></page>
<page><title>Beta</title><ns>0</ns><id>2</id><revision><id>12</id><text>  #REDIRECT [[Alpha]]</text></revision></page>
<page><title>Talk:Alpha</title><ns>1</ns><id>3</id><revision><id>13</id><text>Talk text.</text></revision></page>
<page><title>Gamma</title><ns>0</ns><id>4</id><revision><id>14</id><text>Gamma prose.</text></revision></page>
</mediawiki>
"""


def test_wiki_paragraphs(tmp_path: Path) -> None:
    path = tmp_path / "wiki.xml.bz2"
    path.write_bytes(bz2.compress(WIKI.encode()))
    # Alpha: prose up to "See also", no list line, tidied; Beta: a redirect, skipped; Talk:Alpha: not
    # in namespace 0, so an empty article; Gamma: one paragraph.
    assert _wiki_paragraphs(path) == [["First paragraph here.", "Second paragraph, there."], [], ["Gamma prose."]]


def test_lee_paragraphs(tmp_path: Path) -> None:
    path = tmp_path / "lee.cor"
    path.write_bytes(b"First  story here .\n\n  \nBad \xff byte.\n")
    assert _lee_paragraphs(path) == [["First story here."], ["Bad \ufffd byte."]]


@pytest.mark.parametrize(
    ("raw", "tidy"),
    [
        ("'''Achilles''' (;, Akhilleus) was a ''hero''.", "Achilles (Akhilleus) was a hero."),
        ("A word (Greek; ) here.", "A word (Greek) here."),
        ("Born ( ) in Troy , the city ; here .", "Born in Troy, the city; here."),
        ("a\xa0b", "a b"),
        ("  spaced\n\tout  ", "spaced out"),
    ],
)
def test_tidy(raw: str, tidy: str) -> None:
    assert _tidy(raw) == tidy


# --- sentences --------------------------------------------------------------------------------


def test_split_sentences_single_capital_initial() -> None:
    assert split_sentences("He met Malcolm X. Then he left.") == ["He met Malcolm X. Then he left."]


def test_prose_pairs_use_each_sentence_once() -> None:
    s = [f"This is good sentence number {n}." for n in range(5)]
    assert prose_pairs(" ".join(s[:4])) == [Sample(s[0], s[1]), Sample(s[2], s[3])]
    assert prose_pairs(" ".join(s[:3])) == [Sample(s[0], s[1])]
    assert prose_pairs(" ".join(s)) == [Sample(s[0], s[1]), Sample(s[2], s[3])]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("One two three four five.", True),
        ("One two three four.", False),
        ("Word " * 79 + "end.", True),  # 80 words
        ("Word " * 80 + "end.", False),  # 81 words
        ("A" + "b" * 590 + " c d e f.", True),  # 600 characters
        ("A" + "b" * 591 + " c d e f.", False),  # 601 characters
        ("5 men walked into town.", True),
        ('"Yes, he said to them."', True),
        ("'Yes, he said to them.'", True),
        ("the cat sat on mats.", False),
        ("Where did all of them go?", True),
        ("Stop all of them right now!", True),
        ("He said to them all (quietly.)", True),
        ('He said it to them all."', True),
        ("He said it to them all", False),
        ("This is version number 10.X", False),
        ("See the [[link]] for more.", False),
        ("Text in here .. and there ... too.", False),
        ("A 1 2 3 bcdef.", False),  # 6 letters of 14 characters: under 60 %
        ("Abcd e f g h i.", True),  # 9 letters of 15 characters: exactly 60 %, the bound is inclusive
    ],
)
def test_is_sentence(text: str, ok: bool) -> None:
    assert _is_sentence(text) is ok


# --- the files are UTF-8 whatever the locale --------------------------------------------------

_READ_UNDER_C_LOCALE = """
import json, locale, sys
from pathlib import Path
from ingest.corpora import _lee_paragraphs, load_corpus
glue, lee = sys.argv[1:3]
print(json.dumps({
    "encoding": locale.getpreferredencoding(False),
    "glue": [list(sample) for sample in load_corpus(glue).samples()],
    "lee": _lee_paragraphs(Path(lee)),
}))
"""


def test_files_are_read_as_utf8_under_a_c_locale(tmp_path: Path) -> None:
    import os
    import subprocess

    glue = write(tmp_path / "d.tsv", "sentence1\tsentence2\nCafé crème.\tNaïve “quotes”.\n")
    lee = tmp_path / "lee.cor"
    lee.write_bytes("Zürich  story .\n".encode())
    expected = {"glue": [["Café crème.", "Naïve “quotes”."]], "lee": [["Zürich story."]]}
    # in this process too, so that mutmut's per-test selection sees which functions the test reaches
    assert [list(s) for s in load_corpus(str(glue)).samples()] == expected["glue"]
    assert _lee_paragraphs(lee) == expected["lee"]
    root = Path(corpora.__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONIOENCODING": "utf-8", "PYTHONPATH": path}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", _READ_UNDER_C_LOCALE, str(glue), str(lee)],
        env=env, capture_output=True, text=True, encoding="utf-8", check=True, timeout=PATIENCE,
    )  # fmt: skip
    output = json.loads(result.stdout)
    if output.pop("encoding").lower().replace("-", "") == "utf8":
        pytest.skip("the C locale is UTF-8 on this platform: nothing to tell apart")
    assert output == expected
