"""``check_labels``: which labels fit a model's head, and the message that names the bad ones (issue 14)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ingest.tasks import ClassificationExample, TaskDataError, check_labels


def _examples(*labels: int) -> list[ClassificationExample]:
    return [ClassificationExample(f"text {i}", None, label) for i, label in enumerate(labels)]


def test_labels_inside_the_head_pass() -> None:
    check_labels(_examples(0, 1, 1), SimpleNamespace(num_labels=2))
    check_labels(_examples(0, 0), SimpleNamespace(num_labels=1))  # a one-output head takes label 0


def test_a_model_without_a_head_is_named() -> None:
    for config in (SimpleNamespace(), SimpleNamespace(num_labels=None), SimpleNamespace(num_labels=0)):
        with pytest.raises(TaskDataError) as err:
            check_labels(_examples(0), config)
        assert str(err.value) == "data: the model has no classification head (num_labels=0)"
    with pytest.raises(TaskDataError) as err:
        check_labels(_examples(0), SimpleNamespace(), source="mrpc.tsv")
    assert str(err.value) == "mrpc.tsv: the model has no classification head (num_labels=0)"


def test_bad_labels_are_listed_with_the_head_names() -> None:
    config = SimpleNamespace(num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"})
    with pytest.raises(TaskDataError) as err:
        check_labels(_examples(0, 3, -1, 3, 2), config)
    assert str(err.value) == ("data: label id(s) [-1, 3] do not fit the model's head of 3 labels (0=neg, 1=neu, 2=pos)")
    partial = SimpleNamespace(num_labels=2, id2label={1: "yes"})  # unnamed ids show as themselves
    with pytest.raises(TaskDataError) as err:
        check_labels(_examples(2), partial, source="x")
    assert str(err.value) == "x: label id(s) [2] do not fit the model's head of 2 labels (0=0, 1=yes)"
    for unnamed in (SimpleNamespace(num_labels=2), SimpleNamespace(num_labels=2, id2label=None)):
        with pytest.raises(TaskDataError) as err:
            check_labels(_examples(5), unnamed)
        assert str(err.value) == "data: label id(s) [5] do not fit the model's head of 2 labels (0=0, 1=1)"
