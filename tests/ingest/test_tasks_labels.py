"""``check_labels``: which labels fit a model's head, and the message that names the bad ones (issue 14)."""

from __future__ import annotations

import functools
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
