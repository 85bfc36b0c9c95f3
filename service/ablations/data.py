"""What an ablation reads: the model's head (from its config, no weights) and the evaluation data.

SQuAD v1.1 JSON (optionally some articles), GLUE TSV and JSONL with ``text``/``text_pair``/
``label`` are read where they lie, whole, so that every label is checked against the model's
head before anything is queued; the drift task also takes any corpus (``builtin:wiki``, .txt).
``hub:NAME[:CONFIG][:SPLIT]`` reads a Hugging Face data set when ``datasets`` is installed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from service.ablations.schemas import AblationCreate, Task, parse_ints
from service.errors import InvalidInput

log = logging.getLogger(__name__)

HEAD_TASKS: dict[str, Task] = {"question-answering": "squad", "sequence-classification": "glue", "base": "drift"}


# --------------------------------------------------------------------------------------------
# The model's head, from its config (no weights loaded)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelHead:
    """What the model's config says about its head; enough to choose and check a task."""

    kind: str  # base | sequence-classification | question-answering
    architectures: tuple[str, ...]
    num_labels: int
    id2label: dict[int, str]
    label2id: dict[str, int]
    eval_articles: tuple[int, int] | None = None  # finetune.json's held-out SQuAD articles, half-open
    eval_data: str | None = None

    def config(self) -> SimpleNamespace:
        """A stand-in for ``model.config`` for :func:`ingest.tasks.check_labels` and the readers."""
        return SimpleNamespace(num_labels=self.num_labels, id2label=self.id2label, label2id=self.label2id)


def model_head(source: str, revision: str | None = None) -> ModelHead:
    """Read the head from ``config.json`` (a local directory) or the hub's config at ``revision`` (the commit the
    catalog's features came from), lazily, via transformers, without code from the checkpoint."""
    path = Path(source)
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise InvalidInput(f"model: cannot read {path / 'config.json'}: {error}", field="model") from error
    else:
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=False).to_dict()
        except Exception as error:  # the hub raises many types for a missing or unreachable id
            raise InvalidInput(f"model: cannot read the config of {source!r}: {error}", field="model") from error
    architectures = tuple(config.get("architectures") or ())
    kind = "base"
    if any(name.endswith("ForQuestionAnswering") for name in architectures):
        kind = "question-answering"
    elif any(name.endswith("ForSequenceClassification") for name in architectures):
        kind = "sequence-classification"
    id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    label2id = {str(k): int(v) for k, v in (config.get("label2id") or {}).items()}
    num_labels = len(id2label) or int(config.get("num_labels") or 2)
    eval_articles, eval_data = None, None
    finetune = path / "finetune.json"
    if path.is_dir() and finetune.is_file():
        try:
            record = json.loads(finetune.read_text(encoding="utf-8"))
            articles = (record.get("hyperparameters") or {}).get("eval_articles")
            if isinstance(articles, list) and len(articles) == 2:
                eval_articles = (int(articles[0]), int(articles[1]))
                eval_data = str(record.get("eval_data") or "")
        except (OSError, json.JSONDecodeError, TypeError, ValueError):
            log.warning("%s: unreadable finetune.json; no held-out split assumed", finetune)
    return ModelHead(kind, architectures, num_labels, id2label, label2id, eval_articles, eval_data)


def choose_task(requested: Task | None, head: ModelHead, name: str) -> Task:
    """The task asked for, or the one the head implies; a task the head cannot do is refused."""
    task = requested or HEAD_TASKS[head.kind]
    needs = {"squad": "question-answering", "glue": "sequence-classification"}
    if task in needs and head.kind != needs[task]:
        what = ", ".join(head.architectures) or "no task head"
        raise InvalidInput(
            f"task: {task} needs a {needs[task]} head, but {name!r} has {what} ({head.kind}); "
            f"use task {HEAD_TASKS[head.kind]} (or drift, which fits any model)",
            field="task",
        )
    return task


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSet:
    """The examples to evaluate, and what names them (stored with the run and keys the baseline)."""

    kind: str  # squad | glue | jsonl | text | builtin | hub
    source: str
    sha256: str | None
    subset: str | None
    size: int  # examples after the subset (articles), before the limit
    examples: list[Any] = field(repr=False, compare=False)

    @property
    def key(self) -> str:
        return f"sha256:{self.sha256}" if self.sha256 else f"hub:{self.source.removeprefix('hub:')}"


def _articles(request: AblationCreate, head: ModelHead, path: Path | None) -> tuple[int, int] | None:
    """The SQuAD articles to read (half-open), from the request or the model's held-out split."""
    text = (request.articles or "").strip()
    if text == "all":
        return None
    if text:
        values = parse_ints(text, "article")
        return values[0], values[-1] + 1
    if head.eval_articles and path is not None and head.eval_data and path.name in head.eval_data:
        log.info("Reading the model's held-out articles %d-%d of %s (its finetune.json); articles=all reads all",
                 head.eval_articles[0], head.eval_articles[1] - 1, path.name)  # fmt: skip
        return head.eval_articles
    return None


def _subset(examples: list[Any], request: AblationCreate, parts: list[str]) -> tuple[list[Any], int, str | None]:
    size = len(examples)
    if request.limit is not None and request.limit < size:
        if request.sample == "spread":
            step = size / request.limit
            examples = [examples[math.floor(i * step)] for i in range(request.limit)]
            parts.append("spread")
        else:
            examples = examples[: request.limit]
    return examples, size, "; ".join(parts) or None


def read_data(request: AblationCreate, task: Task, head: ModelHead, *, load_hub: bool = True) -> DataSet:
    """Read and check the data for ``task`` (labels against the head); raises InvalidInput naming ``data``.

    Files are always read whole (cheap, and the only way to check every label). A hub data set
    is only checked for its spec and the ``datasets`` package unless ``load_hub``: the API does
    not download data sets while answering a request; the job loads and checks it before any
    model runs.
    """
    from ingest.corpora import CorpusError, check_utf8, load_corpus
    from ingest.tasks import TaskDataError, read_classification, read_squad

    spec = request.data.strip()
    if spec.startswith("hub:"):
        return _read_hub(request, task, head, load=load_hub)
    is_builtin = spec.startswith("builtin:")
    path = None if is_builtin else Path(spec).expanduser().resolve()
    if path is not None and not path.is_file():
        raise InvalidInput(f"data: {spec!r} is not a file (nor builtin:NAME or hub:NAME)", field="data")
    suffix = "" if path is None else path.suffix.lower()
    if request.articles is not None and suffix != ".json":
        raise InvalidInput("articles: only SQuAD .json data has articles", field="articles")
    try:
        if path is not None:
            check_utf8(path)  # named by file and line, before any reader decodes it
        if task == "squad" or (task == "drift" and suffix == ".json"):
            if suffix != ".json":
                raise InvalidInput(f"data: the squad task reads a SQuAD v1.1 .json file, not {spec!r}", field="data")
            assert path is not None
            articles = _articles(request, head, path)
            examples: list[Any] = read_squad(path, articles=articles)
            if task == "drift":
                examples = [(example.question.lstrip(), example.context) for example in examples]
            parts = [] if articles is None else [f"articles {articles[0]}-{articles[1] - 1}"]
            kind = "squad"
        elif task == "glue":
            if suffix not in (".tsv", ".jsonl", ".json"):
                raise InvalidInput(f"data: the glue task reads a GLUE .tsv or a .jsonl file, not {spec!r}",
                                   field="data")  # fmt: skip
            assert path is not None
            examples = read_classification(path, config=head.config())
            parts, kind = [], "jsonl" if suffix in (".jsonl", ".json") else "glue"
        else:
            corpus = load_corpus(spec)
            examples = [sample.text if sample.text_pair is None else tuple(sample) for sample in corpus.samples()]
            parts, kind = [], corpus.kind
    except (TaskDataError, CorpusError) as error:
        raise InvalidInput(f"data: {error}", field="data") from error
    if not examples:
        raise InvalidInput(f"data: {spec!r} holds no examples", field="data")
    if task == "drift" and len({isinstance(example, tuple) for example in examples}) > 1:
        raise InvalidInput(f"data: {spec!r} mixes single texts and text pairs", field="data")
    examples, size, subset = _subset(examples, request, parts)
    if is_builtin:
        source, sha = spec, load_corpus(spec).sha256
    else:
        assert path is not None
        from ingest.corpora import file_sha256

        source, sha = str(path), file_sha256(path)
    return DataSet(kind, source, sha, subset, size, examples)


def _read_hub(request: AblationCreate, task: Task, head: ModelHead, *, load: bool) -> DataSet:
    """A Hugging Face data set ``hub:NAME[:CONFIG][:SPLIT]`` (split default: validation)."""
    spec = request.data.strip().removeprefix("hub:")
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3:
        raise InvalidInput(f"data: {request.data!r} is not hub:NAME[:CONFIG][:SPLIT]", field="data")
    if request.articles is not None:
        raise InvalidInput("articles: only SQuAD .json files have articles", field="articles")
    if importlib.util.find_spec("datasets") is None:
        raise InvalidInput(
            "data: hub data sets need the 'datasets' package (pip install 'headcat[hub]'); "
            "or give a local SQuAD .json, GLUE .tsv or .jsonl file",
            field="data",
        )
    if not load:
        return DataSet("hub", f"hub:{spec}", None, None, 0, [])
    examples = _hub_examples(parts, task, head)
    if not examples:
        raise InvalidInput(f"data: {request.data!r} holds no examples", field="data")
    examples, size, subset = _subset(examples, request, [])
    return DataSet("hub", f"hub:{spec}", None, subset, size, examples)


def _hub_examples(parts: list[str], task: Task, head: ModelHead) -> list[Any]:
    import datasets

    from ingest.tasks import LABEL_NAMES, LAYOUTS, ClassificationExample, QAExample, TaskDataError, check_labels

    name, config, split = (parts + ["", ""])[:3]
    try:
        dataset = datasets.load_dataset(name, config or None, split=split or "validation")
    except Exception as error:  # datasets raises many unrelated types for a missing set
        raise InvalidInput(f"data: hub data set {':'.join(parts)!r} could not be loaded: {error}",
                           field="data") from error  # fmt: skip
    columns = set(dataset.column_names)
    if task == "squad":
        if not {"id", "question", "context", "answers"} <= columns:
            raise InvalidInput(f"data: hub set {name!r} is not SQuAD-like (columns {sorted(columns)})", field="data")
        return [
            QAExample(
                id=str(row["id"]),
                question=row["question"],
                context=row["context"],
                answers=tuple(row["answers"]["text"]),
                answer_starts=tuple(row["answers"]["answer_start"]),
                title=str(row.get("title", "")),
                article=-1,
            )  # fmt: skip
            for row in dataset
            if row["answers"]["text"]
        ]
    layout = next(((t, p) for t, p in LAYOUTS if t in columns and (p is None or p in columns)), None)
    if layout is None:
        raise InvalidInput(f"data: no known text column in hub set {name!r} ({sorted(columns)})", field="data")
    text, pair = layout
    if task == "drift":
        return [row[text] if pair is None else (row[text], row[pair]) for row in dataset]
    label = next((column for column in LABEL_NAMES if column in columns), None)
    if label is None:
        raise InvalidInput(f"data: hub set {name!r} has no label column ({sorted(columns)})", field="data")
    examples = []
    for row in dataset:
        value = row[label]
        if isinstance(value, str):
            if value not in head.label2id:
                raise InvalidInput(f"data: label {value!r} is not one of the model's {sorted(head.label2id)}",
                                   field="data")  # fmt: skip
            value = head.label2id[value]
        examples.append(ClassificationExample(row[text], None if pair is None else row[pair], int(value)))
    try:
        check_labels(examples, head.config(), source=f"hub:{name}")
    except TaskDataError as error:
        raise InvalidInput(f"data: {error}", field="data") from error
    return examples
