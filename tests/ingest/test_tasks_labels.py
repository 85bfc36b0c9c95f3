"""``check_labels``: which labels fit a model's head, and the message that names the bad ones (issue 14)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from ingest.tasks import ClassificationExample, TaskDataError, check_labels


def _error(call: Callable[[], object]) -> str:
    """The message of the TaskDataError that ``call`` raises."""
    with pytest.raises(TaskDataError) as err:
        call()
    return str(err.value)


def _examples(*labels: int) -> list[ClassificationExample]:
    return [ClassificationExample(f"text {i}", None, label) for i, label in enumerate(labels)]


def test_labels_inside_the_head_pass() -> None:
    check_labels(_examples(0, 1, 1), SimpleNamespace(num_labels=2))
    check_labels(_examples(0, 0), SimpleNamespace(num_labels=1))  # a one-output head takes label 0


def test_a_model_without_a_head_is_named() -> None:
    for config in (SimpleNamespace(), SimpleNamespace(num_labels=None), SimpleNamespace(num_labels=0)):
        assert (
            _error(functools.partial(check_labels, _examples(0), config))
            == "data: the model has no classification head (num_labels=0)"
        )
    assert (
        _error(lambda: check_labels(_examples(0), SimpleNamespace(), source="mrpc.tsv"))
        == "mrpc.tsv: the model has no classification head (num_labels=0)"
    )


def test_bad_labels_are_listed_with_the_head_names() -> None:
    config = SimpleNamespace(num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"})
    assert _error(lambda: check_labels(_examples(0, 3, -1, 3, 2), config)) == (
        "data: label id(s) [-1, 3] do not fit the model's head of 3 labels (0=neg, 1=neu, 2=pos)"
    )
    partial = SimpleNamespace(num_labels=2, id2label={1: "yes"})  # unnamed ids show as themselves
    assert (
        _error(lambda: check_labels(_examples(2), partial, source="x"))
        == "x: label id(s) [2] do not fit the model's head of 2 labels (0=0, 1=yes)"
    )
    for unnamed in (SimpleNamespace(num_labels=2), SimpleNamespace(num_labels=2, id2label=None)):
        assert (
            _error(functools.partial(check_labels, _examples(5), unnamed))
            == "data: label id(s) [5] do not fit the model's head of 2 labels (0=0, 1=1)"
        )


# --------------------------------------------------------------------------------------------
# The readers on hand-written files
# --------------------------------------------------------------------------------------------


def test_glue_tsv_reader_on_a_hand_written_file(tmp_path) -> None:
    from ingest.tasks import read_glue_tsv

    path = tmp_path / "dev.tsv"
    rows = [
        "\ufeffa\tb\ty",  # a byte-order mark, custom column names
        "\"quoted\tit's\tyes",  # quotes are literal text
        "",  # blank lines are skipped, and reading goes on
        "   ",
        "\tonly pair\tno",  # an empty first column is a real row
        "plain\tpair\t1",
    ]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    got = read_glue_tsv(path, label2id={"yes": 1, "no": 0}, text_column="a", pair_column="b", label_column="y")
    assert got == [
        ClassificationExample('"quoted', "it's", 1),
        ClassificationExample("", "only pair", 0),
        ClassificationExample("plain", "pair", 1),
    ]
    assert (
        _error(lambda: read_glue_tsv(path, label2id={"yes": 1, "no": 0}, text_column="zzz", label_column="y"))
        == f"{path}:1: no column 'zzz'; columns are ['a', 'b', 'y']"
    )
    with pytest.raises(TaskDataError) as err:
        read_glue_tsv(
            path,
            text_column="a",
            pair_column="b",
            label_column="y",
            config=SimpleNamespace(num_labels=1, label2id={"yes": 1, "no": 0}),
        )
    assert str(err.value).startswith(f"{path}: label id(s) [1] do not fit the model's head of 1 labels")
    one_column = tmp_path / "one.tsv"
    one_column.write_text("sentence\tlabel\nlonely\n", encoding="utf-8")
    assert _error(lambda: read_glue_tsv(one_column)) == f"{one_column}:2: 1 columns, the header has 2"
    empty = tmp_path / "empty.tsv"
    empty.write_text("", encoding="utf-8")
    assert _error(lambda: read_glue_tsv(empty)) == f"{empty}: empty file"
    assert _error(lambda: read_glue_tsv(tmp_path / "missing.tsv")) == f"{tmp_path / 'missing.tsv'}: no such file"


def test_jsonl_reader_on_a_hand_written_file(tmp_path) -> None:
    from ingest.tasks import read_jsonl

    path = tmp_path / "dev.jsonl"
    lines = ['{"q": "a?", "c": "b.", "gold": 1}', "", '{"q": "c?", "c": "d.", "gold": "0"}']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    got = read_jsonl(path, text_field="q", pair_field="c", label_field="gold")
    assert got == [ClassificationExample("a?", "b.", 1), ClassificationExample("c?", "d.", 0)]
    assert (
        _error(
            lambda: read_jsonl(
                path, text_field="q", pair_field="c", label_field="gold", config=SimpleNamespace(num_labels=1)
            )
        )
        == f"{path}: label id(s) [1] do not fit the model's head of 1 labels (0=0)"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "label": 0}\n[1, 2]\n', encoding="utf-8")
    assert _error(lambda: read_jsonl(bad)) == f"{bad}:2: expected a JSON object, got list"
    holes = tmp_path / "holes.jsonl"
    holes.write_text('{"text": "x", "text_pair": "y", "label": 0}\n{"other": 1}\n', encoding="utf-8")
    assert _error(lambda: read_jsonl(holes)) == f"{holes}:2: no field(s) 'text', 'text_pair', 'label'"
    assert _error(lambda: read_jsonl(tmp_path / "missing.jsonl")) == f"{tmp_path / 'missing.jsonl'}: no such file"


def test_read_classification_picks_the_reader_by_suffix(tmp_path) -> None:
    from ingest.tasks import read_classification

    record = '{"q": "a?", "gold": 1}\n'
    for name in ("dev.json", "DEV.JSONL"):
        path = tmp_path / name
        path.write_text(record, encoding="utf-8")
        got = read_classification(path, text_column="q", label_column="gold")  # *_column works for JSON too
        assert got == [ClassificationExample("a?", None, 1)]
    tsv = tmp_path / "dev.txt"
    tsv.write_text("q\tgold\na?\t1\n", encoding="utf-8")
    assert read_classification(tsv, text_column="q", label_column="gold") == [ClassificationExample("a?", None, 1)]


def test_label_and_layout_messages(tmp_path) -> None:
    from ingest.tasks import read_glue_tsv, read_jsonl

    path = tmp_path / "dev.tsv"
    path.write_text("sentence\tlabel\nfine\tyes\n", encoding="utf-8")
    # an explicit label2id wins over the config's
    config = SimpleNamespace(num_labels=2, label2id={"yes": 1, "no": 0})
    assert read_glue_tsv(path, label2id={"yes": 0, "no": 1}, config=config) == [ClassificationExample("fine", None, 0)]
    assert (
        _error(lambda: read_glue_tsv(path))
        == f"{path}:2: label 'yes' is a name but no label2id was given (pass the model's config)"
    )
    odd = tmp_path / "odd.tsv"
    odd.write_text("words\tlabel\nx\t0\n", encoding="utf-8")
    assert _error(lambda: read_glue_tsv(odd)) == (
        f"{odd}:1: no known text column among ['words', 'label']; pass text_column= / text_field="
    )
    flag = tmp_path / "flag.jsonl"
    flag.write_text('{"text": "x", "label": true}\n', encoding="utf-8")
    assert _error(lambda: read_jsonl(flag)) == f"{flag}:1: label True is not a class id or name"


def test_an_explicit_pair_column_beside_an_automatic_text_column(tmp_path) -> None:
    """``pair_column=`` alone: the text column is still found by the layouts, the pair is the one asked for."""
    from ingest.tasks import read_glue_tsv, read_jsonl

    path = tmp_path / "dev.tsv"
    path.write_text("sentence1\tsentence2\tnotes\tlabel\nA\tB\tC\t1\n", encoding="utf-8")
    assert read_glue_tsv(path, pair_column="notes") == [ClassificationExample("A", "C", 1)]
    assert read_glue_tsv(path) == [ClassificationExample("A", "B", 1)]
    single = tmp_path / "single.tsv"
    single.write_text("sentence\tcontext\tlabel\nA\tB\t0\n", encoding="utf-8")
    assert read_glue_tsv(single, pair_column="context") == [ClassificationExample("A", "B", 0)]
    assert read_glue_tsv(single) == [ClassificationExample("A", None, 0)]
    jsonl = tmp_path / "dev.jsonl"
    jsonl.write_text('{"premise": "P", "hypothesis": "H", "extra": "E", "label": 0}\n', encoding="utf-8")
    assert read_jsonl(jsonl, pair_field="extra") == [ClassificationExample("P", "E", 0)]
    assert _error(lambda: read_glue_tsv(single, pair_column="nope")) == (
        f"{single}:1: no column 'nope'; columns are ['sentence', 'context', 'label']"
    )


def test_the_readers_read_utf8_whatever_the_locale(tmp_path) -> None:
    """Under the C locale (no UTF-8 coercion) Python's default text encoding is ASCII: the readers name theirs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import ingest.tasks
    from ingest.tasks import QAExample, read_glue_tsv, read_jsonl, read_squad

    text = "caf\u00e9 \u2013 na\u00efve"
    jsonl = tmp_path / "dev.jsonl"
    jsonl.write_text(json.dumps({"text": text, "label": 0}, ensure_ascii=False) + "\n", encoding="utf-8")
    tsv = tmp_path / "dev.tsv"
    tsv.write_text(f"sentence\tlabel\n{text}\t1\n", encoding="utf-8")
    squad = tmp_path / "squad.json"
    qa = {"id": "q", "question": text, "answers": [{"text": "na\u00efve", "answer_start": 7}]}
    document = {"data": [{"title": text, "paragraphs": [{"context": text, "qas": [qa]}]}]}
    squad.write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")
    expected = [
        [ClassificationExample(text, None, 0)],
        [ClassificationExample(text, None, 1)],
        [QAExample("q", text, text, ("na\u00efve",), (7,), text, 0)],
    ]
    assert [read_jsonl(jsonl), read_glue_tsv(tsv), read_squad(squad)] == expected  # here, and under C:
    root = Path(ingest.tasks.__file__).resolve().parents[1]
    code = (
        "import sys\nfrom ingest.tasks import read_glue_tsv, read_jsonl, read_squad\n"
        "print(ascii([read_jsonl(sys.argv[1]), read_glue_tsv(sys.argv[2]), read_squad(sys.argv[3])]))"
    )
    env = os.environ | {"LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    env["PYTHONPATH"] = str(root)
    run = subprocess.run([sys.executable, "-c", code, str(jsonl), str(tsv), str(squad)], cwd=root, env=env,
                         capture_output=True, text=True, encoding="ascii", check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ascii(expected)


def _squad_document() -> dict:
    """Two articles (the second untitled), two paragraphs, a question with two gold answers."""
    return {
        "version": "1.1",
        "data": [
            {
                "title": "First",
                "paragraphs": [
                    {
                        "context": "Paris is in France.",
                        "qas": [
                            {"id": "a", "question": "Where?", "answers": [{"text": "France", "answer_start": 12}]},
                            {
                                "id": 7,
                                "question": "What?",
                                "answers": [
                                    {"text": "Paris", "answer_start": 0},
                                    {"text": "Paris", "answer_start": "0"},
                                ],
                            },
                        ],
                    },
                    {
                        "context": "Rome.",
                        "qas": [{"id": "c", "question": "Which?", "answers": [{"text": "Rome", "answer_start": 0}]}],
                    },
                ],
            },
            {
                "paragraphs": [
                    {
                        "context": "Oslo.",
                        "qas": [{"id": "d", "question": "?", "answers": [{"text": "Oslo", "answer_start": 0}]}],
                    }
                ]
            },
        ],
    }


def test_read_squad_records_and_every_message_in_full(tmp_path) -> None:
    from ingest.tasks import QAExample, read_squad

    path = tmp_path / "squad.json"
    document = _squad_document()
    path.write_text(json.dumps(document), encoding="utf-8")
    first = [
        QAExample("a", "Where?", "Paris is in France.", ("France",), (12,), "First", 0),
        QAExample("7", "What?", "Paris is in France.", ("Paris", "Paris"), (0, 0), "First", 0),
        QAExample("c", "Which?", "Rome.", ("Rome",), (0,), "First", 0),
    ]
    second = [QAExample("d", "?", "Oslo.", ("Oslo",), (0,), "", 1)]  # no title: ""
    assert read_squad(path) == first + second
    assert read_squad(str(path), articles=(0, 2)) == first + second  # a stop at the file's length is allowed
    assert read_squad(path, articles=range(1, 2)) == second
    assert read_squad(path, articles=(0, 0)) == []

    def error(articles: object = None) -> str:
        return _error(lambda: read_squad(path, articles=articles))  # type: ignore[arg-type]

    assert error((0, 3)) == f"{path}: articles 0-2 asked for, the file has 2"
    assert error(range(-1, 1)) == f"{path}: articles -1-0 asked for, the file has 2"

    def broken(edit: Callable[[dict], None]) -> str:
        changed = _squad_document()
        edit(changed)
        path.write_text(json.dumps(changed), encoding="utf-8")
        return error()

    assert broken(lambda d: d["data"][1].pop("paragraphs")) == (
        f"{path}: data[1]: malformed SQuAD entry (KeyError('paragraphs'))"
    )
    assert broken(lambda d: d["data"][0]["paragraphs"][1].pop("context")) == (
        f"{path}: data[0].paragraphs[1]: malformed SQuAD entry (KeyError('context'))"
    )
    assert broken(lambda d: d["data"][0]["paragraphs"][0]["qas"][1]["answers"][1].pop("text")) == (
        f"{path}: data[0].paragraphs[0].qas[1]: malformed SQuAD entry (KeyError('text'))"
    )
    assert broken(lambda d: d["data"][0]["paragraphs"][0]["qas"][0].update(answers=[])) == (
        f"{path}: data[0].paragraphs[0].qas[0]: no gold answer (SQuAD v1.1 always has one)"
    )
    assert broken(lambda d: d["data"].__setitem__(1, "text")) == (
        f"{path}: data[1]: malformed SQuAD entry (AttributeError(\"'str' object has no attribute 'get'\"))"
    )
    for document_text in ('{"version": "1.1"}', '[{"data": []}]', '{"data": {}}'):
        path.write_text(document_text, encoding="utf-8")
        assert error() == f"{path}: expected a SQuAD object with a 'data' list of articles"
    path.write_text('{"data": [\n\n  {"title": }]}', encoding="utf-8")
    assert error() == f"{path}:3: not valid JSON (Expecting value)"
    assert _error(lambda: read_squad(tmp_path / "none.json")) == f"{tmp_path / 'none.json'}: no such file"


def test_jsonl_layout_messages_name_the_file_and_line(tmp_path) -> None:
    from ingest.tasks import read_jsonl

    path = tmp_path / "dev.jsonl"
    path.write_text('\n{"words": "x", "label": 0}\n', encoding="utf-8")  # the first record is on line 2
    assert _error(lambda: read_jsonl(path)) == (
        f"{path}:2: no known text column among ['words', 'label']; pass text_column= / text_field="
    )
    path.write_text('{"text": "x"}\n', encoding="utf-8")
    assert _error(lambda: read_jsonl(path)) == f"{path}:1: no label column among ['text'] (an unlabelled split?)"
    assert _error(lambda: read_jsonl(path, label_field="y")) == f"{path}:1: no column 'y'; columns are ['text']"
