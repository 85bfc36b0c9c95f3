"""The ingest writer stores what extraction computed, every head under its own ``(stack, layer, head)``.

Stored rows are read back by plain SQL and compared with the arrays the test holds: the result of
``extract_features`` called in the test with the request's settings (for the job), or arrays drawn
in the test and handed to ``store_feature_run`` (for the writer). Caught, among others: a head's
vector stored under its neighbour, a request setting not passed to the extraction, a scalar's NaN
stored as a number, a second run's heads made anew.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from ingest.types import SCALARS
from service.errors import Conflict, InvalidInput
from service.ingests.schemas import IngestCreate
from service.ingests.service import check_sources, store_feature_run
from service.jobs.runner import run_inline
from tests.service.conftest import ingest_request
from tests.service.synthetic import dirichlet, feature_result

SHAPES = {"encoder": (2, 4), "decoder": (2, 4), "cross": (2, 4)}


def stored_heads(session: Session, run_id: int) -> dict[tuple[str, int, int], dict[str, Any]]:
    rows = session.execute(
        text(
            "SELECT h.stack, h.layer, h.head, h.id AS head_id, f.* FROM head_features f"
            " JOIN heads h ON h.model_id = f.model_id AND h.id = f.head_id WHERE f.feature_run_id = :r"
        ),
        {"r": run_id},
    ).mappings()
    return {(r["stack"], r["layer"], r["head"]): dict(r) for r in rows}


def row(session: Session, table: str, row_id: int) -> dict[str, Any]:
    return dict(session.execute(text(f"SELECT * FROM {table} WHERE id = :i"), {"i": row_id}).mappings().one())


def test_an_ingest_job_stores_what_extraction_gives_for_its_request(
    sessions: sessionmaker[Session], tiny_bert_path: Path
) -> None:
    """Every setting of the request reaches the extraction (none a default here), and every head's
    vector, scalars and example map are stored under its own layer and head."""
    from ingest.corpora import load_corpus
    from ingest.features import FeatureConfig, extract_features
    from ingest.loading import load_model

    settings = {"samples": 6, "max_length": 24, "batch_size": 4, "num_windows": 8, "prepend_bos": False}
    job = run_inline(sessions, "ingest", ingest_request(tiny_bert_path, name="settings", **settings))
    assert job.status == "succeeded", job.error
    assert job.result is not None
    run_id = job.result["feature_run_id"]
    assert job.result == {"feature_run_id": run_id, "model": "settings"}
    assert (job.progress_done, job.progress_total) == (6, 6)

    loaded = load_model(str(tiny_bert_path), device="cpu")
    config = FeatureConfig(device="cpu", dtype="float32", **settings)  # type: ignore[arg-type]
    expected = extract_features(loaded.model, loaded.tokenizer, load_corpus("builtin:wiki").samples(6), config)
    part = expected.stacks["encoder"]
    with sessions() as session:
        heads = stored_heads(session, run_id)
        run = row(session, "feature_runs", run_id)
        model = row(session, "models", run["model_id"])
        corpus = row(session, "corpora", run["corpus_id"])
    assert sorted(heads) == [("encoder", layer, head) for layer in range(2) for head in range(4)]
    for (_, layer, head), stored in heads.items():
        np.testing.assert_allclose(stored["vector"], part.vectors[layer, head], rtol=1e-9, err_msg=f"{layer, head}")
        assert len(stored["vector"]) == 13
        for name in SCALARS:
            value = part.scalars[name][layer, head]
            assert stored[name] == (pytest.approx(value, rel=1e-9) if np.isfinite(value) else None), name
        np.testing.assert_allclose(stored["example_map"], part.example_maps[layer, head], rtol=1e-6)
    assert (run["status"], run["num_windows"], run["max_length"], run["samples_requested"]) == ("complete", 8, 24, 6)
    assert (run["num_samples"], run["num_tokens"]) == (expected.num_samples, expected.num_tokens)
    assert run["config"] == expected.config.to_json()
    assert run["special_tokens"] == {"ids": expected.special_token_ids, "tokens": expected.special_tokens}
    assert run["example_tokens"] == list(expected.example_tokens)
    assert (run["device"], run["dtype"]) == ("cpu", "float32")
    assert run["started_at"] <= run["finished_at"]
    assert abs(run["started_at"] - datetime.now(UTC)) < timedelta(minutes=10)  # an aware UTC time, not a local one
    assert (model["name"], model["source"], model["architecture"], model["task"]) == (
        "settings", loaded.source, "bert", "base",
    )  # fmt: skip
    assert (corpus["name"], corpus["kind"], corpus["source"]) == ("wiki", "builtin", "wiki")


def test_the_writer_stores_every_head_of_every_stack_under_its_own_id(
    sessions: sessionmaker[Session], bart_path: Path
) -> None:
    """Arrays drawn here, a NaN scalar among them, stored for an encoder-decoder; a second run of the same
    model reuses its heads and its corpus."""
    from ingest.corpora import load_corpus
    from ingest.loading import load_model

    rng = np.random.default_rng(0)
    vectors = {stack: dirichlet(rng, *shape) for stack, shape in SHAPES.items()}
    result = feature_result(vectors, seed=4)
    result.stacks["decoder"].scalars["sep_to_sep"][1, 2] = np.nan
    loaded = dataclasses.replace(load_model(str(bart_path), device="cpu"), revision="0123abcd")  # as from the hub
    corpus = load_corpus("builtin:wiki")
    started = datetime(2026, 11, 24, 8, 30, tzinfo=UTC)
    request = IngestCreate(model=str(bart_path), name="ed", samples=9, max_length=40, num_windows=16)
    with sessions() as session:
        session.execute(text("SET LOCAL TIME ZONE 'Asia/Tokyo'"))  # times are real times, whatever the zone
        run_id = store_feature_run(session, request, loaded, corpus, result, started)
        heads = stored_heads(session, run_id)
        run = row(session, "feature_runs", run_id)
        model = row(session, "models", run["model_id"])
        corpus_row = row(session, "corpora", run["corpus_id"])
        again = store_feature_run(
            session, request.model_copy(update={"add_run": True}), loaded, corpus, result, started
        )
        again_heads = stored_heads(session, again)
        corpus_ids = session.execute(text("SELECT corpus_id FROM feature_runs ORDER BY id")).scalars().all()
        head_count = session.execute(text("SELECT count(*) FROM heads")).scalar_one()
    assert sorted(heads) == sorted((s, la, h) for s, (layers, n) in SHAPES.items() for la in range(layers)
                                   for h in range(n))  # fmt: skip
    for (stack, layer, head), stored in heads.items():
        part = result.stacks[stack]
        assert stored["vector"] == part.vectors[layer, head].tolist(), (stack, layer, head)
        for name in SCALARS:
            value = part.scalars[name][layer, head]
            assert stored[name] == (float(value) if np.isfinite(value) else None), (stack, layer, head, name)
        np.testing.assert_array_equal(np.float32(stored["example_map"]), part.example_maps[layer, head])
    assert heads["decoder", 1, 2]["sep_to_sep"] is None
    assert {key: stored["head_id"] for key, stored in again_heads.items()} == {
        key: stored["head_id"] for key, stored in heads.items()
    }
    assert head_count == 24
    assert corpus_ids == [corpus_row["id"], corpus_row["id"]]
    assert (corpus_row["name"], corpus_row["kind"], corpus_row["source"], corpus_row["sha256"]) == (
        corpus.name, corpus.kind, corpus.source, corpus.sha256,
    )  # fmt: skip
    assert (model["name"], model["source"], model["revision"], model["architecture"], model["task"]) == (
        "ed", loaded.source, loaded.revision, "bart", "base",
    )  # fmt: skip
    assert (model["num_layers"], model["num_heads"], model["num_key_value_heads"]) == (2, 4, None)
    assert model["stacks"] == {stack: {"layers": 2, "heads": 4, "kv_heads": 4} for stack in SHAPES}
    assert (run["model_id"], run["status"], run["num_windows"], run["max_length"]) == (model["id"], "complete", 16, 40)
    assert (run["samples_requested"], run["num_samples"], run["num_tokens"]) == (9, 4, 40)
    assert (run["device"], run["dtype"], run["seconds"], run["example_tokens"]) == (
        "cpu", "float32", 0.1, ["[CLS]", "a", "[SEP]"],
    )  # fmt: skip
    assert run["special_tokens"] == {
        "ids": {"cls": [101], "sep": [102]},
        "tokens": {"cls": ["[CLS]"], "sep": ["[SEP]"]},
    }
    assert run["config"] == result.config.to_json()
    assert run["started_at"] == started
    assert abs(run["finished_at"] - datetime.now(UTC)) < timedelta(minutes=10)
    assert model["revision"] == "0123abcd"


@pytest.mark.parametrize(("kv_heads", "stored"), [(2, 2), (1, 1), (0, None), (4, None)])
def test_grouped_key_value_heads_are_stored_where_fewer_than_the_query_heads(
    sessions: sessionmaker[Session], tiny_bert_path: Path, kv_heads: int, stored: int | None
) -> None:
    from ingest.corpora import load_corpus
    from ingest.loading import load_model

    loaded = dataclasses.replace(load_model(str(tiny_bert_path), device="cpu"), num_key_value_heads=kv_heads)
    result = feature_result({"encoder": dirichlet(np.random.default_rng(1), 2, 4)})
    request = IngestCreate(model=str(tiny_bert_path), name="grouped", samples=4)
    with sessions() as session:
        run_id = store_feature_run(session, request, loaded, load_corpus("builtin:wiki"), result, datetime.now(UTC))
        model_id = row(session, "feature_runs", run_id)["model_id"]
        model = row(session, "models", model_id)
    assert model["num_key_value_heads"] == stored
    assert model["stacks"] == {"encoder": {"layers": 2, "heads": 4, "kv_heads": stored or 4}}


def test_a_taken_name_or_other_stacks_are_refused_in_full(sessions: sessionmaker[Session], bart_path: Path) -> None:
    from ingest.corpora import load_corpus
    from ingest.loading import load_model

    loaded = load_model(str(bart_path), device="cpu")
    corpus = load_corpus("builtin:wiki")
    rng = np.random.default_rng(2)
    request = IngestCreate(model=str(bart_path), name="ed", samples=4)
    with sessions() as session:
        store_feature_run(session, request, loaded, corpus, feature_result({"encoder": dirichlet(rng, 2, 4)}),
                          datetime.now(UTC))  # fmt: skip
        with pytest.raises(Conflict) as taken:
            store_feature_run(session, request, loaded, corpus, feature_result({"encoder": dirichlet(rng, 2, 4)}),
                              datetime.now(UTC))  # fmt: skip
        other = feature_result({"encoder": dirichlet(rng, 2, 4), "cross": dirichlet(rng, 1, 2)})
        with pytest.raises(Conflict) as stacks:
            store_feature_run(session, request.model_copy(update={"add_run": True}), loaded, corpus, other,
                              datetime.now(UTC))  # fmt: skip
    assert (taken.value.message, taken.value.field) == (
        f"name: a model named 'ed' is already in the catalog (source {loaded.source}); pass --add-run to add a "
        "feature run to it, or choose another name",
        "name",
    )
    assert (stacks.value.message, stacks.value.field) == (
        f"name: 'ed' has the stacks encoder 2 x 4 in the catalog, but {loaded.source} has encoder 2 x 4, cross 1 x 2",
        "name",
    )


def refusal(model: str, corpus: str = "builtin:wiki") -> tuple[str, str | None] | None:
    try:
        check_sources(IngestCreate(model=model, name="x", corpus=corpus))
    except InvalidInput as error:
        return error.message, error.field
    return None


def test_sources_are_checked_before_queueing(
    tiny_bert_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "no-config").mkdir()
    hint = "(a local model directory, or a hub id such as sentence-transformers/all-MiniLM-L6-v2)"
    assert refusal(str(tiny_bert_path)) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    assert refusal("some-org/some-model") is None  # a hub id: not looked for on disk
    assert refusal("some-model") is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub off: a hub id not in the cache cannot load; refused now
    offline = "is not in the local hub cache, and the hub is off (HF_HUB_OFFLINE)"
    assert refusal("some-org/some-model") == (f"model: some-org/some-model {offline}: download it once online, "
                                              "or give a local directory", "model")  # fmt: skip
    # names huggingface_hub refuses as repo ids (ending in "." or "-", "..", "--", past 96 characters) are paths
    refused = ("T2.", "org/name-", "org/na..me", "org--x/name", "x" * 97)
    for missing in ("./absent", "/absent/model", "~/absent-model", "\\absent", "two words", "org/name/extra", *refused):
        assert refusal(missing) == (f"model: {missing} does not exist {hint}", "model"), missing
    for name in ("x" * 96, "T2.1", "org/name_1"):  # at the bound, and a dot or an underscore inside: hub ids
        assert refusal(name) == (f"model: {name} {offline}: download it once online, or give a local directory",
                                 "model")  # fmt: skip
    for directory in ("no-config", str(tmp_path / "no-config")):  # a hub-like name that is a directory here
        assert refusal(directory) == (
            f"model: {directory} is not a transformers model directory (no config.json)",
            "model",
        )
    message, field = refusal(str(tiny_bert_path), corpus="/absent/corpus.jsonl") or ("", None)
    assert field == "corpus"
    assert message.startswith("corpus: ")
    assert "/absent/corpus.jsonl" in message


@pytest.mark.parametrize("broken", ["corpus", "model", "extraction"])
def test_a_job_refuses_a_bad_source_naming_its_field(
    sessions: sessionmaker[Session], tiny_bert_path: Path, tmp_path: Path, broken: str
) -> None:
    from ingest.corpora import load_corpus
    from ingest.loading import load_model

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    overrides = {
        "corpus": {"corpus": str(tmp_path / "absent.jsonl")},
        "model": {"model": str(tmp_path)},
        "extraction": {"corpus": str(empty)},
    }[broken]
    request = ingest_request(tiny_bert_path, name=f"bad-{broken}", **overrides)
    cause = ""
    try:  # what the loaders themselves say
        if broken == "corpus":
            load_corpus(overrides["corpus"])
        elif broken == "model":
            load_model(str(tmp_path), device="cpu")
    except ValueError as error:
        cause = str(error)
    with pytest.raises(InvalidInput) as refused:
        run_inline(sessions, "ingest", request)
    field = "model" if broken == "model" else "corpus"
    assert refused.value.field == field
    if broken != "extraction":
        assert cause
        assert refused.value.message == f"{field}: {cause}"
    else:
        assert refused.value.message.startswith("corpus: ")


def test_a_run_names_the_corpus_it_read_by_kind_path_and_content(
    sessions: sessionmaker[Session], tiny_bert_path: Path, tmp_path: Path
) -> None:
    """The same bytes at two paths are two corpora; a file changed between two runs is a new corpus; the
    same bytes at the same path are the same row, also after the file changed and changed back."""
    import hashlib

    from ingest.corpora import load_corpus
    from ingest.loading import load_model

    loaded = load_model(str(tiny_bert_path), device="cpu")
    first, copy = tmp_path / "a.txt", tmp_path / "b.txt"
    for path in (first, copy):
        path.write_text("One sentence here. Another one there.\n")
    request = IngestCreate(model=str(tiny_bert_path), name="corpora", samples=4)

    def store(path: Path) -> dict[str, Any]:
        result = feature_result({"encoder": dirichlet(np.random.default_rng(0), 2, 4)})
        with sessions() as session, session.begin():
            run_id = store_feature_run(session, request.model_copy(update={"add_run": True}), loaded,
                                       load_corpus(str(path)), result, datetime.now(UTC))  # fmt: skip
            return row(session, "corpora", row(session, "feature_runs", run_id)["corpus_id"])

    stored = [store(first), store(copy)]
    first.write_text("A changed sentence. And one more.\n")
    stored += [store(first), store(first)]
    assert [(c["kind"], c["source"], c["sha256"]) for c in stored] == [
        ("text", str(path), hashlib.sha256(text.encode()).hexdigest())
        for path, text in [
            (first, "One sentence here. Another one there.\n"),
            (copy, "One sentence here. Another one there.\n"),
            (first, "A changed sentence. And one more.\n"),
            (first, "A changed sentence. And one more.\n"),
        ]
    ]
    assert len({c["id"] for c in stored}) == 3
    assert stored[2]["id"] == stored[3]["id"]
    first.write_text("One sentence here. Another one there.\n")  # back as it was: its first row again
    assert store(first)["id"] == stored[0]["id"]


def test_an_ingest_job_loads_the_model_as_asked_and_stamps_it_in_utc(
    sessions: sessionmaker[Session], tiny_bert_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request's device, dtype and device map reach ``load_model``, the dtype the extraction too (its
    stored vectors are a bfloat16 model's); the run's start is UTC also in a process whose local zone is not."""
    import time

    from ingest import loading
    from ingest.corpora import load_corpus
    from ingest.features import FeatureConfig, extract_features

    calls: list[dict[str, Any]] = []
    real = loading.load_model

    def recording(source: str, **options: Any) -> Any:
        calls.append(options)
        return real(source, **options)

    monkeypatch.setattr(loading, "load_model", recording)
    monkeypatch.setenv("TZ", "Asia/Kathmandu")  # UTC+05:45: a naive local time would be stored 345 minutes off
    time.tzset()
    try:
        request = ingest_request(tiny_bert_path, name="as-asked", samples=4, device="cpu", dtype="bfloat16",
                                 device_map="sequential")  # fmt: skip
        job = run_inline(sessions, "ingest", request)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert job.status == "succeeded", job.error
    assert calls == [{"device": "cpu", "dtype": "bfloat16", "device_map": "sequential", "revision": None}]
    assert job.result is not None
    loaded = real(str(tiny_bert_path), device="cpu", dtype="bfloat16")
    config = FeatureConfig(samples=4, max_length=64, batch_size=16, device="cpu", dtype="bfloat16")
    expected = extract_features(loaded.model, loaded.tokenizer, load_corpus("builtin:wiki").samples(4), config)
    with sessions() as session:
        run = row(session, "feature_runs", job.result["feature_run_id"])
        heads = stored_heads(session, run["id"])
    assert run["dtype"] == "bfloat16"
    assert run["config"] == expected.config.to_json()  # the request's dtype recorded, as the model was loaded
    assert abs(run["started_at"] - datetime.now(UTC)) < timedelta(minutes=10)
    for (_, layer, head), stored in heads.items():
        np.testing.assert_allclose(stored["vector"], expected.stacks["encoder"].vectors[layer, head], rtol=1e-9)
