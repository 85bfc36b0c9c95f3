"""Migration 0005 keeps existing catalogs: heads stored before stacks get the right stack."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text

from service import db


def test_an_upgrade_from_0004_gives_encoder_and_decoder_heads(empty_database: str) -> None:
    db.upgrade(empty_database, "0004")
    engine = create_engine(empty_database)
    try:
        with engine.begin() as connection:
            for name, architecture, layers, heads in (("minilm", "bert", 2, 3), ("tiny-gpt2", "gpt2", 3, 2)):
                model_id = connection.scalar(
                    text(
                        "INSERT INTO models (name, source, architecture, num_layers, num_heads) "
                        "VALUES (:name, :source, :architecture, :layers, :heads) RETURNING id"
                    ),
                    {
                        "name": name,
                        "source": f"/models/{name}",
                        "architecture": architecture,
                        "layers": layers,
                        "heads": heads,
                    },
                )
                connection.execute(
                    text("INSERT INTO heads (model_id, layer, head) VALUES (:model_id, :layer, :head)"),
                    [{"model_id": model_id, "layer": la, "head": h} for la in range(layers) for h in range(heads)],
                )
        db.upgrade(empty_database, "0005")
        with engine.connect() as connection:
            stacks: dict[str, list[str]] = dict(
                connection.execute(
                    text(
                        "SELECT m.name, array_agg(DISTINCT h.stack) FROM heads h JOIN models m ON m.id = h.model_id "
                        "GROUP BY m.name"
                    )
                ).all()
            )
            assert stacks == {"minilm": ["encoder"], "tiny-gpt2": ["decoder"]}
            shapes: dict[str, dict[str, dict[str, int]]] = dict(
                connection.execute(text("SELECT name, stacks FROM models")).all()
            )
            assert shapes == {
                "minilm": {"encoder": {"layers": 2, "heads": 3, "kv_heads": 3}},
                "tiny-gpt2": {"decoder": {"layers": 3, "heads": 2, "kv_heads": 2}},
            }
            count = connection.scalar(text("SELECT count(*) FROM heads"))
            assert count == 2 * 3 + 3 * 2  # every head kept
            columns = connection.execute(text("SELECT * FROM current_head_types LIMIT 0")).keys()
            assert list(columns)[:2] == ["model", "stack"]
            with pytest.raises(Exception, match="uq_heads_model_id_stack_layer_head"):
                connection.execute(
                    text(
                        "INSERT INTO heads (model_id, stack, layer, head) "
                        "SELECT model_id, stack, layer, head FROM heads"
                    )
                )
    finally:
        engine.dispose()
