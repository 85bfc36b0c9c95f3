"""Syntax runs: gold and silver parses stored per (head, relation, direction) with baselines, the best
head per relation served, bad parses and corpora refused with the line / field before anything is queued."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from ingest.syntax import SPACY_PIPELINE, SyntaxDataError, load_spacy
from service.errors import InvalidInput
from service.jobs.runner import run_inline
from service.orm import Job
from tests.service.conftest import TINY
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]

GOLD = """# text = The dog chased a cat.
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\tdog\tdog\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\tchased\tchase\tVERB\tVBD\t_\t0\troot\t_\t_
4\ta\ta\tDET\tDT\t_\t5\tdet\t_\t_
5\tcat\tcat\tNOUN\tNN\t_\t3\tobj\t_\t_
6\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_

# text = My sister reads books.
1\tMy\tmy\tPRON\tPRP$\t_\t2\tnmod:poss\t_\t_
2\tsister\tsister\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\treads\tread\tVERB\tVBZ\t_\t0\troot\t_\t_
4\tbooks\tbook\tNOUN\tNNS\t_\t3\tobj\t_\t_
5\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_
"""

needs_spacy = pytest.mark.skipif(
    importlib.util.find_spec(SPACY_PIPELINE) is None,
    reason='spaCy and its English pipeline are not installed (pip install "headcat[syntax]")',
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("syntax-data")
    lines = GOLD.splitlines()
    lines[9] = "2\tsister\tsister\tNOUN\tNN\t_\tthree\tnsubj\t_\t_"  # line 10: a head that is no number
    paths = {"gold": folder / "gold.conllu", "bad": folder / "bad.conllu", "empty": folder / "empty.txt",
             "late": folder / "late.txt"}  # fmt: skip
    paths["gold"].write_text(GOLD)
    paths["bad"].write_text("\n".join(lines) + "\n")
    paths["empty"].write_text("...\n!!\n-- --\n")
    paths["late"].write_text("...\n!!\nthe dog chased a cat\n")  # a sentence only in its third sample
    return paths


def jobs(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


def test_gold_parses_are_stored_per_head_relation_and_direction(
    sessions: sessionmaker[Session], tiny_ingested: int, client: TestClient, files: dict[str, Path]
) -> None:
    job = run_inline(sessions, "syntax", {"model": TINY, "parses": str(files["gold"]), "device": "cpu"})
    assert job.status == "succeeded", job.error
    assert job.result is not None
    assert job.result["sentences"] == 2
    assert job.progress_done == job.progress_total == 2

    served = client.get(f"/models/{TINY}/syntax").json()
    assert served["run"]["parses"] == "gold"
    baselines = {b["relation"]: b for b in served["run"]["baselines"]}
    assert baselines["det"] == {"relation": "det", "count": 2, "offset": 1, "accuracy": 1.0}
    assert baselines["obj"]["count"] == 2
    best = {row["relation"]: row for row in served["best"]}
    assert set(best) == {"det", "nsubj", "obj", "punct", "nmod:poss"}
    assert served["layers"] == 2
    assert served["heads"] == 4
    assert len(served["matrix"]["det"]) == 2
    assert max(max(row) for row in served["matrix"]["det"]) == best["det"]["accuracy"]
    assert client.get(f"/syntax-runs/{job.result['syntax_run_id']}").json()["num_sentences"] == 2

    with sessions() as session:
        count = session.scalar(text("SELECT count(*) FROM head_syntax WHERE model = :m"), {"m": TINY})
        assert count == 8 * 5 * 2  # heads x relations x directions
        top = session.execute(
            text(
                "SELECT layer, head, accuracy, baseline FROM head_syntax WHERE model = :m AND relation = 'det' "
                "ORDER BY accuracy DESC, layer, head, direction LIMIT 1"
            ),
            {"m": TINY},  # fmt: skip
        ).one()
        assert (top.layer, top.head, top.accuracy) == (
            best["det"]["layer"],
            best["det"]["head"],
            best["det"]["accuracy"],
        )
        view = session.execute(text("SELECT layer, head FROM syntax_best_heads WHERE model = :m AND relation = 'det'"),
                               {"m": TINY}).one()  # fmt: skip
        assert (view.layer, view.head) == (top.layer, top.head)


@needs_spacy
def test_silver_parses_from_a_corpus(sessions: sessionmaker[Session], tiny_ingested: int, client: TestClient) -> None:
    job = run_inline(sessions, "syntax", {"model": TINY, "corpus": "builtin:wiki", "samples": 12, "device": "cpu"})
    assert job.status == "succeeded", job.error
    served = client.get(f"/models/{TINY}/syntax", params={"min_count": 2}).json()
    assert served["run"]["parses"] == "silver"
    nlp = load_spacy()
    assert served["run"]["parser"] == f"spacy {version('spacy')}, {SPACY_PIPELINE} {nlp.meta['version']}"
    assert served["run"]["num_sentences"] == 12
    assert served["run"]["config"]["samples"] == 12
    assert {"det", "nsubj"} <= {row["relation"] for row in served["best"]}
    assert all(row["count"] >= 2 for row in served["best"])


@pytest.mark.parametrize(
    ("overrides", "status", "field", "says"),
    [
        ({"parses": "bad"}, 422, "parses", "bad.conllu:10:"),
        ({"corpus": "empty"}, 422, "corpus", "no parseable sentence"),
        ({"model": "nosuch"}, 404, "model", "nosuch"),
    ],
)
def test_bad_input_is_4xx_naming_the_field_and_queues_nothing(
    client: TestClient,
    sessions: sessionmaker[Session],
    tiny_ingested: int,
    files: dict[str, Path],
    overrides: dict[str, Any],
    status: int,
    field: str,
    says: str,
) -> None:
    if field == "corpus" and importlib.util.find_spec(SPACY_PIPELINE) is None:
        says = "[syntax]"  # without spaCy the corpus is refused for that first
    body = {"model": TINY, "device": "cpu", **{k: str(files.get(v, v)) for k, v in overrides.items()}}
    before = jobs(sessions)
    answer = client.post("/syntax-runs", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field
    assert says in answer.json()["detail"]
    assert jobs(sessions) == before


def test_the_cli_names_the_malformed_line_with_exit_2(
    committed_database_url: str, catalog_engine: Engine, files: dict[str, Path]
) -> None:
    env = {**os.environ, "DATABASE_URL": committed_database_url, "HEADCAT_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "service.cli", "syntax", TINY, "--parses", str(files["bad"]), "--device", "cpu"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)
    assert done.returncode == 2, done.stderr
    assert "bad.conllu:10:" in done.stderr.replace("\n", "")
    with Session(catalog_engine) as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.kind == "syntax")) == 0


def test_get_heads_finds_the_heads_of_a_relation(
    sessions: sessionmaker[Session], tiny_ingested: int, client: TestClient, files: dict[str, Path]
) -> None:
    """``GET /heads?relation=det&order=-syntax_accuracy``: each head's best direction for the
    relation in the latest run, checked against the stored rows."""
    assert run_inline(sessions, "syntax", {"model": TINY, "parses": str(files["gold"]), "device": "cpu"}).status == (
        "succeeded"
    )
    with sessions() as session:
        rows = session.execute(
            text("SELECT h.layer, h.head, max(s.accuracy) AS accuracy FROM head_syntax_scores s JOIN heads h "
                 "ON h.id = s.head_id WHERE s.relation = 'det' GROUP BY h.layer, h.head")
        ).all()  # fmt: skip
    best = {(r.layer, r.head): r.accuracy for r in rows}
    answer = client.get("/heads", params={"model": TINY, "relation": "det", "order": "-syntax_accuracy"})
    assert answer.status_code == 200, answer.text
    heads = answer.json()["items"]
    assert {(h["layer"], h["head"]): h["syntax_accuracy"] for h in heads} == best
    values = [h["syntax_accuracy"] for h in heads]
    assert values == sorted(values, reverse=True)
    above = client.get("/heads", params={"model": TINY, "relation": "det", "syntax_accuracy_gt": 0.5}).json()
    assert {(h["layer"], h["head"]) for h in above["items"]} == {key for key, value in best.items() if value > 0.5}
    assert "syntax_accuracy" not in client.get("/heads", params={"model": TINY}).json()["items"][0]
    refused = client.get("/heads", params={"model": TINY, "direction": "dep2head"})
    assert (refused.status_code, refused.json()["field"]) == (422, "direction")


def test_every_stored_row_is_the_functions_answer_direction_by_direction(
    sessions: sessionmaker[Session], tiny_ingested: int, tiny_bert_path: Path, files: dict[str, Path]
) -> None:
    """Each ``(head, relation, direction)`` row, each baseline and the run's counts, read back by plain SQL,
    equal ``syntax_accuracy`` called here on the same model and gold parses. The tiny model's two directions
    and its relations of equal count differ (checked first), so storing dep2head under head2dep, one relation
    under another or one head under its neighbour (the row counts and the best accuracy unchanged) fails."""
    from ingest.loading import load_model
    from ingest.syntax import SyntaxConfig, read_conllu, syntax_accuracy

    job = run_inline(sessions, "syntax", {"model": TINY, "parses": str(files["gold"]), "device": "cpu",
                                          "batch_size": 1, "max_length": 64})  # fmt: skip
    assert job.status == "succeeded", job.error
    assert job.result is not None
    run_id = job.result["syntax_run_id"]
    loaded = load_model(str(tiny_bert_path), device="cpu")
    config = SyntaxConfig(samples=500, max_length=64, batch_size=1, device="cpu", dtype="float32")
    expected = syntax_accuracy(loaded.model, loaded.tokenizer, read_conllu(files["gold"]), config)

    correct = expected.correct
    assert (correct[..., 0] != correct[..., 1]).any()  # a direction swap shows
    same_count = [r for r, n in enumerate(expected.counts) if n == expected.counts[0]]
    assert len(same_count) >= 2
    assert (correct[:, :, same_count[0]] != correct[:, :, same_count[1]]).any()  # so does a relation swap
    assert (correct.reshape(8, -1) != correct.reshape(8, -1)[[1, 0, 2, 3, 4, 5, 6, 7]]).any()  # and a head swap

    with sessions() as session:
        run = session.execute(text("SELECT * FROM syntax_runs WHERE id = :r"), {"r": run_id}).mappings().one()
        baselines = session.execute(
            text('SELECT relation, count, "offset", accuracy FROM syntax_baselines WHERE syntax_run_id = :r'),
            {"r": run_id},
        ).all()
        rows = session.execute(
            text(
                "SELECT h.stack, h.layer, h.head, s.relation, s.direction, s.correct, s.count, s.accuracy"
                " FROM head_syntax_scores s JOIN heads h ON h.model_id = s.model_id AND h.id = s.head_id"
                " WHERE s.syntax_run_id = :r"
            ),
            {"r": run_id},
        ).all()
    assert (run["status"], run["stack"], run["parses"], run["source"]) == (
        "complete", expected.stack, "gold", str(files["gold"]),
    )  # fmt: skip
    assert (run["num_sentences"], run["num_skipped"], run["num_words"]) == (
        expected.num_sentences, expected.num_skipped, expected.num_words,
    )  # fmt: skip
    assert run["config"] == config.to_json()
    assert (run["device"], run["dtype"]) == (expected.device, expected.dtype)
    assert run["sha256"] == hashlib.sha256(files["gold"].read_bytes()).hexdigest()
    assert run["parser"] is None  # gold parses: no parser ran
    assert run["started_at"] <= run["finished_at"] <= datetime.now(UTC)
    assert job.result == {"syntax_run_id": run_id, "model": TINY, "sentences": expected.num_sentences,
                          "relations": len(expected.relations), "seconds": round(run["seconds"], 3)}  # fmt: skip

    relations = expected.relations
    assert {b.relation: (b.count, b.offset, b.accuracy) for b in baselines} == {
        relation: (int(n), expected.baseline_offset[r], expected.baseline_correct[r] / n)
        for r, (relation, n) in enumerate(zip(relations, expected.counts, strict=True))
    }
    stored = {(row.stack, row.layer, row.head, row.relation, row.direction): row for row in rows}
    layers, heads = correct.shape[:2]
    directions = ("dep2head", "head2dep")  # the last axis of ``correct``, as the reducer counts them
    assert len(stored) == len(rows) == layers * heads * len(relations) * len(directions)
    for layer in range(layers):
        for head in range(heads):
            for r, relation in enumerate(relations):
                for d, direction in enumerate(directions):
                    where = (layer, head, relation, direction)
                    row = stored[(expected.stack, *where)]
                    want = int(correct[layer, head, r, d])
                    assert (row.correct, row.count) == (want, int(expected.counts[r])), where
                    assert row.accuracy == want / expected.counts[r], where


def test_a_catalog_missing_a_head_is_refused_naming_the_model_and_stores_nothing(
    sessions: sessionmaker[Session], tiny_ingested: int, files: dict[str, Path]
) -> None:
    """A model whose catalog lost one of its heads since the ingest: the scores cannot all be stored under
    their heads, so the run is refused in full (no run row, no partial rows), naming the model."""
    with sessions() as session, session.begin():
        session.execute(text("DELETE FROM heads WHERE model_id = (SELECT id FROM models WHERE name = :m) AND layer = 1"
                             " AND head = 3"), {"m": TINY})  # fmt: skip
    with pytest.raises(InvalidInput) as error:
        run_inline(sessions, "syntax", {"model": TINY, "parses": str(files["gold"]), "device": "cpu"})
    assert error.value.field == "model"
    assert error.value.message == f"model: {TINY!r} in the catalog lacks some of its encoder heads; ingest it again"
    with sessions() as session:
        assert session.scalar(text("SELECT count(*) FROM syntax_runs")) == 0
        assert session.scalar(text("SELECT count(*) FROM head_syntax_scores")) == 0


# --- what only the job can find, the request's settings, and the reads ---------------------------


def _fails(sessions: sessionmaker[Session], request: dict[str, Any]) -> InvalidInput:
    """Run the job, which must fail with :class:`InvalidInput`; its job row keeps the message, no run is stored."""
    with pytest.raises(InvalidInput) as caught:
        run_inline(sessions, "syntax", request)
    with sessions() as session:
        job = session.scalars(select(Job).where(Job.kind == "syntax").order_by(Job.id.desc())).first()
        assert job is not None
        assert (job.status, job.error) == ("failed", caught.value.message)
        assert session.scalar(text("SELECT count(*) FROM syntax_runs")) == 0
    return caught.value


def test_the_job_names_the_field_of_what_only_the_run_finds(
    sessions: sessionmaker[Session], tiny_ingested: int, files: dict[str, Path], tmp_path: Path
) -> None:
    """Requests that pass the API's checks but cannot run: every sentence longer than ``max_length``, a device
    this machine lacks. The job fails naming the field, and stores no run."""
    long = tmp_path / "long.conllu"
    words = "the dog that my sister saw yesterday chased a very small cat across the wide green garden".split()
    long.write_text("".join(f"{i}\t{w}\t{w}\tX\tX\t_\t{0 if i == 6 else 6}\t{'root' if i == 6 else 'dep'}\t_\t_\n"
                            for i, w in enumerate(words, 1)) + "\n")  # fmt: skip
    refused = _fails(sessions, {"model": TINY, "parses": str(long), "device": "cpu", "max_length": 8})
    assert refused.field == "max_length"
    assert refused.message == "max_length: every one of the 1 sentences is longer than 8 tokens"

    refused = _fails(sessions, {"model": TINY, "parses": str(files["gold"]), "device": "cuda:99"})
    assert refused.field == "device"
    assert refused.message.startswith("device: device 'cuda:99' ")

    gone = tmp_path / "gone"  # the model's files were removed after its ingest
    with sessions() as session, session.begin():
        session.execute(text("UPDATE models SET source = :s WHERE name = :m"), {"s": str(gone), "m": TINY})
    refused = _fails(sessions, {"model": TINY, "parses": str(files["gold"]), "device": "cpu"})
    assert (refused.field, refused.message) == ("model", f"model: model path '{gone}' does not exist")


@needs_spacy
def test_a_corpus_spacy_finds_no_sentence_in_is_refused_by_the_job_as_corpus(
    sessions: sessionmaker[Session], tiny_ingested: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spaCy's own parse is the job's (the API only looks for two words): its refusal is the corpus's, said once."""
    import ingest.syntax

    def none_found(*args: Any, **kwargs: Any) -> None:
        raise SyntaxDataError("corpus: no parseable sentence (none with two words and a dependency between them)")

    monkeypatch.setattr(ingest.syntax, "silver_parses", none_found)
    refused = _fails(sessions, {"model": TINY, "corpus": "builtin:wiki", "samples": 2, "device": "cpu"})
    assert refused.field == "corpus"
    assert refused.message == "corpus: no parseable sentence (none with two words and a dependency between them)"


def test_the_model_s_own_failure_is_the_model_s(
    sessions: sessionmaker[Session], tiny_ingested: int, files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``ValueError`` from scoring (a slow tokenizer, say) fails the job as the model's; a
    ``SyntaxDataError`` keeps the field its message names."""
    import ingest.syntax

    def slow(*args: Any, **kwargs: Any) -> None:
        raise ValueError("the tokenizer is not a fast tokenizer; word-level pooling needs its word ids")

    monkeypatch.setattr(ingest.syntax, "syntax_accuracy", slow)
    refused = _fails(sessions, {"model": TINY, "parses": str(files["gold"]), "device": "cpu"})
    assert (refused.field, refused.message) == (
        "model", "model: the tokenizer is not a fast tokenizer; word-level pooling needs its word ids",
    )  # fmt: skip

    def too_long(*args: Any, **kwargs: Any) -> None:
        raise SyntaxDataError("max_length: every one of the 2 sentences (gold.conllu: 2) is longer than 9 tokens")

    monkeypatch.setattr(ingest.syntax, "syntax_accuracy", too_long)
    refused = _fails(sessions, {"model": TINY, "parses": str(files["gold"]), "device": "cpu"})
    assert (refused.field, refused.message) == (
        "max_length", "max_length: every one of the 2 sentences (gold.conllu: 2) is longer than 9 tokens",
    )  # fmt: skip


def test_the_request_s_samples_and_dtype_are_the_run_s(
    sessions: sessionmaker[Session], tiny_ingested: int, tiny_bert_path: Path, files: dict[str, Path]
) -> None:
    """``samples`` and ``dtype`` that are not the defaults reach ``syntax_accuracy`` as the request gives them:
    one gold sentence of two, scored in bfloat16, and the stored counts are that call's."""
    from ingest.loading import load_model
    from ingest.syntax import SyntaxConfig, read_conllu, syntax_accuracy

    request = {"model": TINY, "parses": str(files["gold"]), "device": "cpu", "samples": 1, "dtype": "bfloat16"}
    job = run_inline(sessions, "syntax", request)
    assert job.result is not None
    config = SyntaxConfig(samples=1, device="cpu", dtype="bfloat16")
    loaded = load_model(str(tiny_bert_path), device="cpu", dtype="bfloat16")
    expected = syntax_accuracy(loaded.model, loaded.tokenizer, read_conllu(files["gold"]), config)
    with sessions() as session:
        run = session.execute(text("SELECT * FROM syntax_runs WHERE id = :r"),
                              {"r": job.result["syntax_run_id"]}).mappings().one()  # fmt: skip
        correct = session.scalar(text("SELECT sum(correct) FROM head_syntax_scores WHERE syntax_run_id = :r"),
                                 {"r": run["id"]})  # fmt: skip
    assert (run["num_sentences"], run["dtype"], run["config"]) == (1, "bfloat16", config.to_json())
    assert expected.num_sentences == 1
    assert correct == int(expected.correct.sum())


def test_the_api_checks_the_samples_the_job_will_parse(
    client: TestClient, sessions: sessionmaker[Session], tiny_ingested: int, files: dict[str, Path]
) -> None:
    """The API looks for a sentence in the first ``samples`` samples (at most 1,000), the ones the job parses:
    a corpus whose only sentence is in its third sample is refused for 2 samples and accepted for 3."""
    body = {"model": TINY, "corpus": str(files["late"]), "device": "cpu"}
    before = jobs(sessions)
    refused = client.post("/syntax-runs", json={**body, "samples": 2})
    if importlib.util.find_spec(SPACY_PIPELINE) is not None:
        assert (refused.status_code, refused.json()["field"]) == (422, "corpus"), refused.text
        assert "no parseable sentence" in refused.json()["detail"]
        assert jobs(sessions) == before
        assert client.post("/syntax-runs", json={**body, "samples": 3}).status_code == 202
    missing = client.post("/syntax-runs", json={**body, "corpus": str(files["late"].with_name("nosuch.txt"))})
    assert (missing.status_code, missing.json()["field"]) == (422, "corpus"), missing.text
    assert missing.json()["detail"].startswith("corpus: ")


def test_without_spacy_a_corpus_is_refused_and_gold_parses_are_not(
    client: TestClient,
    sessions: sessionmaker[Session],
    tiny_ingested: int,
    files: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ingest.extras

    monkeypatch.setattr(ingest.extras, "has_spacy", lambda: False)
    refused = client.post("/syntax-runs", json={"model": TINY, "corpus": "builtin:wiki", "device": "cpu"})
    assert (refused.status_code, refused.json()["field"]) == (422, "corpus"), refused.text
    assert refused.json()["detail"] == f"corpus: {ingest.extras.SPACY_MISSING}"
    gold = client.post("/syntax-runs", json={"model": TINY, "parses": str(files["gold"]), "device": "cpu"})
    assert gold.status_code == 202, gold.text


def test_reads_of_what_is_not_there_are_404_naming_the_field(
    client: TestClient, sessions: sessionmaker[Session], tiny_ingested: int, files: dict[str, Path]
) -> None:
    for path, field, says in [
        (f"/models/{TINY}/syntax", "name", f"name: {TINY!r} has no syntax run; run `headcat syntax {TINY}` first"),
        ("/models/nosuch/syntax", "name", "nosuch"),
        ("/syntax-runs/999999", "run_id", "run_id: no syntax run with id 999999"),
    ]:
        answer = client.get(path)
        assert (answer.status_code, answer.json()["field"]) == (404, field), (path, answer.text)
        assert says in answer.json()["detail"], path
    job = run_inline(sessions, "syntax", {"model": TINY, "parses": str(files["gold"]), "device": "cpu"})
    assert job.result is not None
    run_id = job.result["syntax_run_id"]
    with sessions() as session, session.begin():
        session.execute(text("UPDATE syntax_runs SET status = 'failed' WHERE id = :r"), {"r": run_id})
    answer = client.get(f"/syntax-runs/{run_id}")  # only complete runs are served
    assert (answer.status_code, answer.json()["field"]) == (404, "run_id"), answer.text


def test_a_model_stored_without_its_stacks_is_served_by_its_layers_and_heads(
    client: TestClient, sessions: sessionmaker[Session], tiny_ingested: int, files: dict[str, Path]
) -> None:
    """A catalog row with no ``stacks`` (the column's default) falls back to ``num_layers`` x ``num_heads``."""
    assert run_inline(sessions, "syntax", {"model": TINY, "parses": str(files["gold"]), "device": "cpu"}).result
    before = client.get(f"/models/{TINY}/syntax").json()
    with sessions() as session, session.begin():
        session.execute(text("UPDATE models SET stacks = '{}' WHERE name = :m"), {"m": TINY})
    after = client.get(f"/models/{TINY}/syntax").json()
    assert (after["layers"], after["heads"]) == (before["layers"], before["heads"]) == (2, 4)
    assert after["matrix"] == before["matrix"]
