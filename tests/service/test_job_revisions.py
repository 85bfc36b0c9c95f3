"""Every job that loads a catalog model again loads the checkpoint its features came from: the stored revision.

A model ingested with ``--revision step1000`` is stored with the hub commit that revision resolved to; an
ablation, importance run or pruning curve that loaded the hub's default branch instead would score another
checkpoint under the same name, silently. Each job is run with a spy in place of the loader that records what it
was asked for and refuses (so nothing is computed), and the config read that chooses the model's head is checked
to ask for the same commit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from service.errors import InvalidInput
from service.jobs.runner import run_inline
from tests.service.conftest import TINY

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a hub commit as ingest stores it


@pytest.fixture
def at_a_revision(sessions: sessionmaker[Session], tiny_clustered: int) -> str:
    """``tiny``, ingested and clustered, as if it had come from the hub at :data:`COMMIT`."""
    with sessions() as session, session.begin():
        session.execute(
            text("UPDATE models SET revision = :commit WHERE name = :name"), {"commit": COMMIT, "name": TINY}
        )
    return TINY


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    path = tmp_path / "texts.jsonl"
    lines = ["The cat sat on the mat.", "Paris is the capital of France.", "A storm is coming tonight."]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines), encoding="utf-8")
    return path


class Refused(ValueError):
    """What the spy raises once it has recorded a load: the jobs turn a loader's ValueError into a refusal."""


@pytest.mark.parametrize(
    ("kind", "request_"),
    [
        ("ablation", {"task": "drift", "plan": [{"prune": "0:0"}], "limit": 3, "batch_size": 4}),
        ("importance", {"loss": "sensitivity", "batch_size": 4}),
        ("pruning", {"loss": "sensitivity", "rankings": "importance,random", "steps": 2, "batch_size": 4}),
    ],
)
def test_the_job_loads_the_stored_revision(
    kind: str, request_: dict[str, Any], at_a_revision: str, texts: Path, sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import ingest.loading

    asked: list[tuple[str, str | None]] = []

    def spy(source: str, **options: Any) -> Any:
        asked.append((source, options.get("revision")))
        raise Refused(f"{source}: not loaded (the test's spy)")

    monkeypatch.setattr(ingest.loading, "load_model", spy)
    with pytest.raises(InvalidInput, match="the test's spy"):
        run_inline(sessions, kind, {"model": at_a_revision, "data": str(texts), "device": "cpu", **request_})
    assert len(asked) == 1
    assert asked[0][1] == COMMIT


def test_the_head_is_read_from_the_config_at_the_stored_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from service.ablations.data import model_head

    asked: list[dict[str, Any]] = []

    def config(source: str, **options: Any) -> Any:
        asked.append({"source": source, **options})
        return transformers.BertConfig(architectures=["BertForSequenceClassification"], num_labels=3)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", config)
    head = model_head("some-org/some-model", COMMIT)
    assert asked == [{"source": "some-org/some-model", "revision": COMMIT, "trust_remote_code": False}]
    assert (head.kind, head.num_labels) == ("sequence-classification", 3)
    model_head("some-org/some-model")
    assert asked[-1]["revision"] is None  # a model stored without one: the hub's default, as ingest loaded it
