"""Unlabelled text corpora that feature runs read samples from.

A corpus spec names one of:

- ``builtin:wiki`` (or ``wiki``; the default): prose from the English Wikipedia dump that
  gensim ships for its tests, as pairs of consecutive sentences;
- ``builtin:lee``: the Lee news corpus gensim ships, as pairs of consecutive sentences;
- a ``.json`` file in SQuAD format: ``(question, context)`` pairs;
- a ``.tsv`` file in GLUE format: the sentence column(s), found by header name;
- a ``.jsonl`` file of ``{"text": ..., "text_pair": ...}`` records (also ``sentence1/sentence2``,
  ``premise/hypothesis``);
- a ``.txt`` file: one sample per non-empty line;
- ``hub:NAME[:CONFIG][:SPLIT]``: a Hugging Face dataset (needs ``datasets``).

Every corpus yields its samples in a fixed order, so the first ``limit`` samples of a run can
be named by the spec, the file's sha256 and the limit. Labels are not read here.
"""

from __future__ import annotations

import bz2
import csv
import functools
import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Literal, NamedTuple

logger = logging.getLogger(__name__)

CorpusKind = Literal["builtin", "squad", "glue", "jsonl", "text", "hub"]

DEFAULT_CORPUS = "builtin:wiki"

_GENSIM_TEST_DATA = ("test", "test_data")
BUILTIN_FILES: dict[str, str] = {
    "wiki": "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    "lee": "lee_background.cor",
}

# Column (or key) names of a sample's two texts, tried in this order. A one-name entry is a
# single-sentence task. ``text`` is SST-2's header in some copies (GLUE's own is ``sentence``).
PAIR_COLUMNS: tuple[tuple[str, ...], ...] = (
    ("text", "text_pair"),
    ("#1 String", "#2 String"),
    ("sentence1", "sentence2"),
    ("question", "sentence"),
    ("question", "context"),
    ("premise", "hypothesis"),
    ("question1", "question2"),
    ("sentence",),
    ("text",),
)

_SUFFIX_KINDS: dict[str, CorpusKind] = {
    ".json": "squad",
    ".tsv": "glue",
    ".jsonl": "jsonl",
    ".txt": "text",
}


class CorpusError(ValueError):
    """A corpus spec that names nothing readable, or a file with a malformed record."""


class Sample(NamedTuple):
    """One model input: a text, and the second segment of a pair task (``None`` for one text)."""

    text: str
    text_pair: str | None = None


@dataclass(frozen=True)
class Corpus:
    """A named, fingerprinted source of :class:`Sample`, read lazily in a fixed order."""

    name: str  # short: "wiki", "lee", the file name, or the hub dataset name
    kind: CorpusKind
    source: str  # absolute file path, the builtin's name, or the hub spec "NAME[:CONFIG][:SPLIT]"
    sha256: str | None  # of the file's bytes; None for hub datasets

    def samples(self, limit: int | None = None) -> Iterator[Sample]:
        """The first ``limit`` samples (all when ``None``), always in the same order."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, not {limit}")
        readers = {
            "builtin": _read_builtin,
            "squad": _read_squad,
            "glue": _read_glue,
            "jsonl": _read_jsonl,
            "text": _read_text,
            "hub": _read_hub,
        }
        return islice(readers[self.kind](self.source), limit)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "source": self.source, "sha256": self.sha256}


def load_corpus(spec: str = DEFAULT_CORPUS, *, refuse_malformed: bool = False) -> Corpus:
    """Resolve a corpus spec (see the module docstring) to a :class:`Corpus`.

    A file is read whole first, so that what would stop a run stops it before any model loads:
    bytes that are not UTF-8 (named by file and line), a record that cannot be read, no sample at
    all. GLUE lines whose number of tab-separated fields is not the header's are malformed: they
    are left out with a warning that counts and names them, or refused with ``refuse_malformed``.
    """
    spec = spec.strip()
    if spec in BUILTIN_FILES or spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_FILES:
            raise CorpusError(f"unknown builtin corpus {spec!r}; builtins are {', '.join(sorted(BUILTIN_FILES))}")
        return Corpus(name=name, kind="builtin", source=name, sha256=file_sha256(builtin_path(name)))
    if spec.startswith("hub:"):
        hub = spec.removeprefix("hub:")
        parts = hub.split(":")
        if not parts[0] or len(parts) > 3:
            raise CorpusError(f"hub corpus spec {spec!r} is not hub:NAME[:CONFIG][:SPLIT]")
        return Corpus(name=parts[0], kind="hub", source=hub, sha256=None)

    path = Path(spec).expanduser()
    kind = _SUFFIX_KINDS.get(path.suffix.lower())
    if kind is None:
        raise CorpusError(
            f"corpus {spec!r} is not a builtin (builtin:wiki, builtin:lee), a hub:NAME spec, "
            f"or a file ending in {', '.join(_SUFFIX_KINDS)}"
        )
    if not path.is_file():
        raise CorpusError(f"corpus file {str(path)!r} does not exist")
    path = path.resolve()
    check_utf8(path)
    if kind == "glue":
        _check_glue_lines(path, refuse_malformed)
    corpus = Corpus(name=path.name, kind=kind, source=str(path), sha256=file_sha256(path))
    if sum(1 for _ in corpus.samples()) == 0:  # every record read: a malformed one raises here, named
        raise CorpusError(f"{path}: the corpus has no samples" + (" (no well-formed line after the header)"
                                                                  if kind == "glue" else ""))  # fmt: skip
    return corpus


def check_utf8(path: Path) -> None:
    """Refuse a file that is not UTF-8, naming the first line (and column) that is not."""
    with path.open("rb") as file:
        for number, line in enumerate(file, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise CorpusError(
                    f"{path}, line {number}: not UTF-8 (byte 0x{line[error.start]:02x} at column {error.start + 1}); "
                    "save the file as UTF-8"
                ) from None


def _glue_malformed(path: Path) -> list[int]:
    """Line numbers of a GLUE file's rows that have not as many tab-separated fields as its header."""
    with path.open(encoding="utf-8-sig", newline="") as file:
        reader = csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE)
        width = len(next(reader, []))
        return [reader.line_num for row in reader if any(f.strip() for f in row) and len(row) != width]


def _check_glue_lines(path: Path, refuse: bool) -> None:
    _glue_columns(path)  # fail now, naming the header, rather than mid-run
    malformed = _glue_malformed(path)
    if not malformed:
        return
    shown = ", ".join(str(n) for n in malformed[:10]) + (", ..." if len(malformed) > 10 else "")
    what = (f"{path}: {len(malformed)} malformed line(s), with not as many tab-separated fields as the header: "
            f"line(s) {shown}")  # fmt: skip
    if refuse:
        raise CorpusError(what)
    logger.warning("%s; they are left out (--refuse-malformed refuses such a file instead)", what)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pick_columns(names: Iterable[str]) -> tuple[str, ...] | None:
    present = set(names)
    for columns in PAIR_COLUMNS:
        if all(column in present for column in columns):
            return columns
    return None


def _clean(value: str) -> str:
    return value.strip()


# --- files ------------------------------------------------------------------------------------


def _read_text(source: str) -> Iterator[Sample]:
    with open(source, encoding="utf-8-sig") as file:
        for line in file:
            if line.strip():
                yield Sample(_clean(line))


def _glue_columns(path: Path) -> tuple[int, ...]:
    with path.open(encoding="utf-8-sig", newline="") as file:
        header = next(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE), None)
    if header is None:
        raise CorpusError(f"{path}: the file is empty; a GLUE .tsv starts with a header line")
    header = [name.strip() for name in header]
    columns = _pick_columns(header)
    if columns is None:
        expected = "; ".join("/".join(pair) for pair in PAIR_COLUMNS)
        raise CorpusError(f"{path}, line 1: no sentence columns in header {header} (expected {expected})")
    return tuple(header.index(column) for column in columns)


def _read_glue(source: str) -> Iterator[Sample]:
    path = Path(source)
    indexes = _glue_columns(path)
    # GLUE files are not CSV-quoted: a field may start with an unbalanced '"' (MRPC does).
    with path.open(encoding="utf-8-sig", newline="") as file:
        reader = csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE)
        width = len(next(reader))
        for row in reader:
            if not row or not any(field.strip() for field in row):
                continue
            if len(row) != width:  # malformed: counted and named by load_corpus, left out here
                continue
            texts = [_clean(row[index]) for index in indexes]
            yield Sample(texts[0], texts[1] if len(texts) > 1 else None)


def _record_sample(record: Any, where: str) -> Sample:
    if not isinstance(record, Mapping):
        raise CorpusError(f"{where}: a record must be a JSON object, not {type(record).__name__}")
    columns = _pick_columns(key for key, value in record.items() if value is not None)
    if columns is None:
        raise CorpusError(
            f"{where}: no text field (expected 'text' with optional 'text_pair', "
            f"'sentence1'/'sentence2' or 'premise'/'hypothesis'); keys are {sorted(record)}"
        )
    texts = [record[column] for column in columns]
    if not all(isinstance(text, str) for text in texts):
        raise CorpusError(f"{where}: fields {list(columns)} must be strings")
    return Sample(_clean(texts[0]), _clean(texts[1]) if len(texts) > 1 else None)


def _read_jsonl(source: str) -> Iterator[Sample]:
    with open(source, encoding="utf-8-sig") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusError(f"{source}, line {number}: not JSON ({error.msg})") from error
            yield _record_sample(record, f"{source}, line {number}")


def _read_squad(source: str) -> Iterator[Sample]:
    try:
        with open(source, encoding="utf-8-sig") as file:
            document = json.load(file)
    except json.JSONDecodeError as error:
        raise CorpusError(f"{source}, line {error.lineno}: not JSON ({error.msg})") from error
    articles = document.get("data") if isinstance(document, dict) else None
    if not isinstance(articles, list):
        raise CorpusError(f"{source}: not SQuAD format (no top-level 'data' list of articles)")
    for a, article in enumerate(articles):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise CorpusError(f"{source}, record data[{a}]: no 'paragraphs' list")
        for p, paragraph in enumerate(paragraphs):
            where = f"{source}, record data[{a}].paragraphs[{p}]"
            if not isinstance(paragraph, dict):
                raise CorpusError(f"{where}: not an object")
            context, questions = paragraph.get("context"), paragraph.get("qas")
            if not isinstance(context, str) or not isinstance(questions, list):
                raise CorpusError(f"{where}: needs a 'context' string and a 'qas' list")
            for q, qa in enumerate(questions):
                question = qa.get("question") if isinstance(qa, dict) else None
                if not isinstance(question, str):
                    raise CorpusError(f"{where}.qas[{q}]: no 'question' string")
                yield Sample(_clean(question), context)


def _read_hub(source: str) -> Iterator[Sample]:
    try:
        import datasets
    except ImportError:
        raise CorpusError(
            f"hub corpus {source!r} needs the 'datasets' package: pip install datasets (or pip install 'headcat[hub]')"
        ) from None
    name, config, split, *_ = [*source.split(":"), None, None]
    try:
        dataset = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as error:  # datasets raises many unrelated types for a missing dataset
        raise CorpusError(f"hub dataset {source!r} could not be loaded: {error}") from error
    columns = _pick_columns(dataset.column_names)
    if columns is None:
        raise CorpusError(f"hub dataset {source!r}: no text columns among {dataset.column_names}")
    for index, record in enumerate(dataset):
        yield _record_sample({column: record[column] for column in columns}, f"{source}, record {index}")


# --- builtin prose ----------------------------------------------------------------------------


def builtin_path(name: str) -> Path:
    """The file gensim ships for builtin corpus ``name`` (gensim itself is not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"builtin corpus {name!r} comes with gensim, which is not installed")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*_GENSIM_TEST_DATA, BUILTIN_FILES[name])
    if not path.is_file():
        raise CorpusError(f"builtin corpus {name!r}: {path} is missing from the gensim install")
    return path


def _read_builtin(name: str) -> Iterator[Sample]:
    yield from _builtin_pairs(name)


@functools.cache
def _builtin_pairs(name: str) -> tuple[Sample, ...]:
    path = builtin_path(name)
    documents = _wiki_paragraphs(path) if name == "wiki" else _lee_paragraphs(path)
    per_document = [[pair for paragraph in paragraphs for pair in prose_pairs(paragraph)] for paragraphs in documents]
    pairs = tuple(dict.fromkeys(_round_robin(per_document)))  # a story repeated in the file counts once
    logger.info("builtin corpus %s: %d sentence pairs from %d documents", name, len(pairs), len(documents))
    return pairs


def _round_robin(groups: Sequence[Sequence[Sample]]) -> Iterator[Sample]:
    """Pair 0 of every document, then pair 1 of every document, ...: any prefix spans many topics."""
    for index in range(max((len(group) for group in groups), default=0)):
        for group in groups:
            if index < len(group):
                yield group[index]


_END_SECTIONS = re.compile(
    r"^=+\s*(references|see also|external links|further reading|notes|bibliography|sources|"
    r"footnotes|citations|notes and references|works cited)\s*=+\s*$",
    re.IGNORECASE,
)
_JUNK_LINE_START = tuple("=*#:;|!{}<")


def _wiki_paragraphs(path: Path) -> list[list[str]]:
    """Each article's prose paragraphs: markup stripped, no headings, lists, tables or references."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    articles = []
    with bz2.open(path) as file:
        for _title, text, _page_id in extract_pages(file, filter_namespaces=("0",)):
            if text.lstrip().lower().startswith("#redirect"):
                continue
            paragraphs = []
            for line in filter_wiki(text).splitlines():
                if _END_SECTIONS.match(line.strip()):
                    break
                line = line.strip()
                if not line or line.startswith(_JUNK_LINE_START):
                    continue
                paragraphs.append(_tidy(line))
            articles.append(paragraphs)
    return articles


def _lee_paragraphs(path: Path) -> list[list[str]]:
    """One paragraph per line: each line of the Lee corpus is one news story."""
    with path.open(encoding="utf-8", errors="replace") as file:
        return [[_tidy(line)] for line in file if line.strip()]


def _tidy(text: str) -> str:
    text = text.replace("\xa0", " ").replace("'''", "").replace("''", "")
    text = re.sub(r"\(\s*[,;](?:\s*[,;])*\s*", "(", text)  # "(;, Akhilleus" left by pronunciations
    text = re.sub(r"\s*[,;]\s*\)", ")", text)
    text = re.sub(r"\(\s*\)", "", text)  # "( )" left where templates were
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"\s+([,.;:!?)])", r"\1", text)  # "ASD , a" left where references were
    return text.strip()


# Words after which a period does not end a sentence.
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr gen brig maj adm cmdr col lt sgt capt cpt gov sen rep pres rev hon "
    "fig figs no nos vol vols vs etc e.g i.e cf al approx ca c inc ltd co corp bros dept est "
    "jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k u.n mt ft op ed eds pp p".split()
)
_SENTENCE_END = re.compile(r"""[.!?]["')\]]*\s+(?=["'(\[]?[A-Z0-9])""")
_MARKUP = re.compile(r"[|{}\[\]<>=_]|https?:|\.\s*\.\s*\.")


def split_sentences(paragraph: str) -> list[str]:
    """Split prose into sentences.

    A sentence ends at ``.``, ``!`` or ``?`` (and any closing quotes or brackets) followed by
    space and a capital letter, digit or opening quote, except after a known abbreviation or a
    single-letter initial.
    """
    pieces, start = [], 0
    for match in _SENTENCE_END.finditer(paragraph):
        before = paragraph[start : match.start() + 1].split()
        last_word = before[-1].rstrip(".!?\"')]").lower() if before else ""
        if match.group().startswith(".") and (
            last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha())
        ):
            continue
        pieces.append(paragraph[start : match.end()].strip())
        start = match.end()
    pieces.append(paragraph[start:].strip())
    return [piece for piece in pieces if piece]


def prose_pairs(paragraph: str) -> list[Sample]:
    """Pairs of consecutive good sentences of one paragraph, each sentence used once.

    A sentence that does not read as ordinary prose (see :func:`_is_sentence`) breaks the run:
    no pair straddles it.
    """
    pairs: list[Sample] = []
    run: list[str] = []
    for sentence in [*split_sentences(paragraph), ""]:
        if _is_sentence(sentence):
            run.append(sentence)
            continue
        pairs.extend(Sample(run[i], run[i + 1]) for i in range(0, len(run) - 1, 2))
        run = []
    return pairs


def _is_sentence(text: str) -> bool:
    """5 to 80 words, starts with a capital letter, digit or quote, ends with sentence
    punctuation, mostly letters, and no leftover markup (tables, links, templates, ellipses)."""
    words = text.split()
    if not 5 <= len(words) <= 80 or len(text) > 600:
        return False
    if not (text[0].isupper() or text[0].isdigit() or text[0] in "\"'"):
        return False
    if not text.rstrip("\"')]").endswith((".", "!", "?")):
        return False
    if _MARKUP.search(text):
        return False
    letters = sum(character.isalpha() for character in text)
    return letters >= 0.6 * len(text)
