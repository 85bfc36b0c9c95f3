"""Schemathesis over ``/openapi.json``: every operation, a bounded number of generated requests,
without a key and with one, on a committed catalog holding the tiny model. No answer may be a
5xx, and every documented answer must match its schema. The number of cases is printed (CI log).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from service.app import create_app
from tests.conftest import grant_key

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = 25  # per operation and per key setting


def test_generated_requests_get_no_server_error_and_match_the_schema(
    catalog_engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance

    app = create_app(catalog_engine)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    key = grant_key(sessionmaker(bind=catalog_engine), "schemathesis")
    cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20

    checks = [not_a_server_error, response_schema_conformance]

    def fuzz(operation: Any, label: str, headers: dict[str, str]) -> None:
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            cases[label] += 1
            try:
                response = case.call(headers=headers)
            except Exception as error:  # the test client re-raises what the app did not handle: a 500
                statuses[500] += 1
                failures.append(f"{operation.label} ({label}): {type(error).__name__}: {str(error)[:300]}")
                return
            statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=checks)
            except AssertionError as error:  # schemathesis' failures are AssertionErrors
                failures.append(f"{operation.label} ({label}): {str(error)[:800]}")

        run()

    for operation in operations:
        fuzz(operation, "no key", {})
        fuzz(operation, "key", {"Authorization": f"Bearer {key}"})

    line = (
        f"schemathesis: {sum(cases.values())} cases over {len(operations)} operations "
        f"({cases['no key']} without a key, {cases['key']} with one); statuses {dict(sorted(statuses.items()))}; "
        f"{len(failures)} failures"
    )
    with capsys.disabled():  # shown in the CI log, captured or not
        print("\n" + line)  # noqa: T201
    assert not failures, "\n\n".join(failures[:10])
    assert not [s for s in statuses if s >= 500]
