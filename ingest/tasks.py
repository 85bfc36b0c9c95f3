"""Readers for labelled evaluation data: SQuAD v1.1 JSON, GLUE TSV and JSONL.

The files are read where they lie (``shared/data`` is never copied). Every reader returns plain
frozen records; a malformed file raises :class:`TaskDataError` naming the file and the line (or
the JSON path), and classification labels are checked against the model's head
(:func:`check_labels`) so that a mismatch fails before any compute.

Layouts understood (first match wins; override with the ``*_column`` / ``*_field`` arguments):

======================  =====================  ===================  ================
text                    text pair              label                seen in
======================  =====================  ===================  ================
``#1 String``           ``#2 String``          ``Quality``          GLUE MRPC TSV
``sentence1``           ``sentence2``          ``label``            GLUE STS-B/RTE/WNLI
``premise``             ``hypothesis``         ``label``            SuperGLUE RTE, MNLI JSONL
``question``            ``sentence``           ``label``            GLUE QNLI
``question1``           ``question2``          ``label``            GLUE QQP
``text_a``              ``text_b``             ``label``            generic
``text``                ``text_pair``          ``label``            generic JSONL
``sentence`` / ``text`` (none)                 ``label``            GLUE SST-2 / CoLA
======================  =====================  ===================  ================

``gold_label`` is accepted for ``label`` (MultiNLI's own files).
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class TaskDataError(ValueError):
    """Evaluation data that cannot be read, or whose labels do not fit the model."""


# --------------------------------------------------------------------------------------------
# SQuAD v1.1
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QAExample:
    """One SQuAD question with every gold answer (text and character start in ``context``)."""

    id: str
    question: str
    context: str
    answers: tuple[str, ...]
    answer_starts: tuple[int, ...]
    title: str
    article: int  # index of the article in the file, 0-based


def read_squad(path: str | Path, *, articles: range | tuple[int, int] | None = None) -> list[QAExample]:
    """Read a SQuAD v1.1 JSON file into questions, in file order.

    ``articles`` keeps only the articles whose 0-based index is in the range; a tuple is
    half-open ``(start, stop)``. The held-out split of ``minilm-squad`` is ``range(24, 48)``
    (articles 24-47, 4,874 questions).
    """
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as handle:
            document = json.load(handle)
    except FileNotFoundError:
        raise TaskDataError(f"{path}: no such file") from None
    except json.JSONDecodeError as error:
        raise TaskDataError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
    if isinstance(articles, tuple):
        articles = range(*articles)
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise TaskDataError(f"{path}: expected a SQuAD object with a 'data' list of articles")
    if articles is not None and (articles.start < 0 or articles.stop > len(data)):
        raise TaskDataError(
            f"{path}: articles {articles.start}-{articles.stop - 1} asked for, the file has {len(data)}"
        )
    out: list[QAExample] = []
    for a, article in enumerate(data):
        if articles is not None and a not in articles:
            continue
        where = f"data[{a}]"
        try:
            title = str(article.get("title", ""))
            for p, paragraph in enumerate(article["paragraphs"]):
                where = f"data[{a}].paragraphs[{p}]"
                context = paragraph["context"]
                for q, qa in enumerate(paragraph["qas"]):
                    where = f"data[{a}].paragraphs[{p}].qas[{q}]"
                    answers = qa["answers"]
                    if not answers:
                        raise TaskDataError(f"{path}: {where}: no gold answer (SQuAD v1.1 always has one)")
                    out.append(
                        QAExample(
                            id=str(qa["id"]),
                            question=qa["question"],
                            context=context,
                            answers=tuple(answer["text"] for answer in answers),
                            answer_starts=tuple(int(answer["answer_start"]) for answer in answers),
                            title=title,
                            article=a,
                        )
                    )
        except (KeyError, TypeError, AttributeError) as error:
            raise TaskDataError(f"{path}: {where}: malformed SQuAD entry ({error!r})") from None
    return out


# --------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------


class ClassificationExample(NamedTuple):
    """``(text, text_pair, label)``; ``text_pair`` is None for single sentences."""

    text: str
    text_pair: str | None
    label: int


LAYOUTS: tuple[tuple[str, str | None], ...] = (
    ("#1 String", "#2 String"),
    ("sentence1", "sentence2"),
    ("premise", "hypothesis"),
    ("question", "sentence"),
    ("question1", "question2"),
    ("text_a", "text_b"),
    ("text", "text_pair"),
    ("sentence", None),
    ("text", None),
)
LABEL_NAMES: tuple[str, ...] = ("label", "Quality", "gold_label")


def _pick_layout(
    names: Sequence[str],
    text: str | None,
    pair: str | None,
    label: str | None,
    where: str,
) -> tuple[str, str | None, str]:
    present = set(names)
    if text is None:
        for text_name, pair_name in LAYOUTS:
            if text_name in present and (pair_name is None or pair_name in present):
                text, pair = text_name, pair_name if pair is None else pair
                break
        else:
            raise TaskDataError(f"{where}: no known text column among {list(names)}; pass text_column= / text_field=")
    if label is None:
        label = next((name for name in LABEL_NAMES if name in present), None)
        if label is None:
            raise TaskDataError(f"{where}: no label column among {list(names)} (an unlabelled split?)")
    for name in (text, pair, label):
        if name is not None and name not in present:
            raise TaskDataError(f"{where}: no column {name!r}; columns are {list(names)}")
    return text, pair, label


def _label_id(raw: Any, label2id: Mapping[str, int] | None, where: str) -> int:
    if isinstance(raw, bool):
        raise TaskDataError(f"{where}: label {raw!r} is not a class id or name")
    if isinstance(raw, int):
        return raw
    text = str(raw).strip()
    try:
        return int(text)
    except ValueError:
        pass
    if label2id is None:
        raise TaskDataError(f"{where}: label {text!r} is a name but no label2id was given (pass the model's config)")
    if text not in label2id:
        raise TaskDataError(f"{where}: label {text!r} is not one of the model's labels {sorted(label2id)}")
    return int(label2id[text])


def _config_labels(config: Any | None, label2id: Mapping[str, int] | None) -> Mapping[str, int] | None:
    if label2id is not None or config is None:
        return label2id
    mapping = getattr(config, "label2id", None)
    return dict(mapping) if mapping else None


def read_glue_tsv(
    path: str | Path,
    *,
    config: Any | None = None,
    label2id: Mapping[str, int] | None = None,
    text_column: str | None = None,
    pair_column: str | None = None,
    label_column: str | None = None,
) -> list[ClassificationExample]:
    """Read a GLUE-style TSV with a header row (quotes are literal text, as in GLUE).

    String labels are mapped through ``label2id`` (default: ``config.label2id``); when
    ``config`` is given the labels are also checked against the model (:func:`check_labels`).
    """
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8-sig", newline="")
    except FileNotFoundError:
        raise TaskDataError(f"{path}: no such file") from None
    mapping = _config_labels(config, label2id)
    out: list[ClassificationExample] = []
    with handle:
        reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None:
            raise TaskDataError(f"{path}: empty file")
        header = [name.strip() for name in header]
        text, pair, label = _pick_layout(header, text_column, pair_column, label_column, f"{path}:1")
        columns = {name: i for i, name in enumerate(header)}
        for line, row in enumerate(reader, start=2):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            where = f"{path}:{line}"
            if len(row) != len(header):
                raise TaskDataError(f"{where}: {len(row)} columns, the header has {len(header)}")
            out.append(
                ClassificationExample(
                    row[columns[text]],
                    None if pair is None else row[columns[pair]],
                    _label_id(row[columns[label]], mapping, where),
                )
            )
    if config is not None:
        check_labels(out, config, source=str(path))
    return out


def read_jsonl(
    path: str | Path,
    *,
    config: Any | None = None,
    label2id: Mapping[str, int] | None = None,
    text_field: str | None = None,
    pair_field: str | None = None,
    label_field: str | None = None,
) -> list[ClassificationExample]:
    """Read one JSON object per line (``text``/``text_pair``/``label``, RTE and MNLI names too)."""
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8")
    except FileNotFoundError:
        raise TaskDataError(f"{path}: no such file") from None
    mapping = _config_labels(config, label2id)
    out: list[ClassificationExample] = []
    layout: tuple[str, str | None, str] | None = None
    with handle:
        for line, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line}"
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as error:
                raise TaskDataError(f"{where}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise TaskDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if layout is None:
                layout = _pick_layout(list(record), text_field, pair_field, label_field, where)
            text, pair, label = layout
            missing = [name for name in (text, pair, label) if name is not None and name not in record]
            if missing:
                raise TaskDataError(f"{where}: no field(s) {', '.join(map(repr, missing))}")
            out.append(
                ClassificationExample(
                    str(record[text]),
                    None if pair is None else str(record[pair]),
                    _label_id(record[label], mapping, where),
                )
            )
    if config is not None:
        check_labels(out, config, source=str(path))
    return out


def read_classification(path: str | Path, **kwargs: Any) -> list[ClassificationExample]:
    """:func:`read_jsonl` for ``.jsonl``/``.json`` files, else :func:`read_glue_tsv`."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        renamed = {k.replace("_column", "_field"): v for k, v in kwargs.items()}
        return read_jsonl(path, **renamed)
    return read_glue_tsv(path, **kwargs)


def check_labels(examples: Sequence[ClassificationExample], config: Any, *, source: str = "data") -> None:
    """Raise :class:`TaskDataError` unless every label is a class of the model's head."""
    num_labels = int(getattr(config, "num_labels", 0) or 0)
    if num_labels < 1:
        raise TaskDataError(f"{source}: the model has no classification head (num_labels={num_labels})")
    bad = sorted({example.label for example in examples if not 0 <= example.label < num_labels})
    if bad:
        names = getattr(config, "id2label", None) or {}
        raise TaskDataError(
            f"{source}: label id(s) {bad} do not fit the model's head of {num_labels} labels "
            f"({', '.join(f'{i}={names.get(i, i)}' for i in range(num_labels))})"
        )
