"""Fuzz every operation of the router's OpenAPI schema with schemathesis.

A live router (real uvicorn on loopback, admin token set) in front of two fake workers gets
bodies, parameters and headers generated from its own ``/openapi.json``, valid and not. Every
answer must be no 5xx, carry a documented status and content type, and conform to the
declared schema (``ErrorBody`` for refusals, ``ExplainAnswer``, ``HealthAnswer`` and the rest,
per SSE event for streams). Bounded: derandomized, 40 examples per operation, schema-valid
and schema-violating mixed.
"""

from __future__ import annotations

from collections.abc import Iterator

import hypothesis.strategies as st
import pytest
import schemathesis
from fake_worker import FakeWorker
from hypothesis import HealthCheck, given, settings
from router_harness import ADMIN_TOKEN, RouterServer, service_settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzzed_router() -> Iterator[RouterServer]:
    pool = (FakeWorker("a").start(), FakeWorker("b").start())
    router = RouterServer(
        service_settings(
            worker_urls=[w.url for w in pool],
            admin_token=ADMIN_TOKEN,
            max_body_bytes=64 * 1024,
            health_interval_s=0.5,
        )
    ).start()
    yield router
    router.stop()
    for worker in pool:
        worker.stop()


@pytest.fixture(scope="module")
def router_schema(fuzzed_router: RouterServer) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(fuzzed_router.url + "/openapi.json")


# Every operation of the schema; test_every_operation_is_fuzzed keeps this list complete.
OPERATIONS = [
    ("POST", "/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("POST", "/explain"),
    ("GET", "/explain/{decision_id}"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/workers"),
    ("POST", "/workers"),
    ("DELETE", "/workers"),
    ("GET", "/policy"),
    ("PUT", "/policy"),
    ("GET", "/models"),
    ("PUT", "/models"),
    ("GET", "/models/challenger"),
    ("POST", "/models/challenger"),
    ("DELETE", "/models/challenger"),
    ("POST", "/models/promote"),
]


@pytest.mark.slow
def test_every_operation_is_fuzzed(router_schema: schemathesis.BaseSchema) -> None:
    listed = {
        (result.ok().method.upper(), result.ok().path)
        for result in router_schema.get_all_operations()
    }
    assert listed == set(OPERATIONS)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_every_answer_conforms_to_the_openapi_schema(
    router_schema: schemathesis.BaseSchema,
    fuzzed_router: RouterServer,
    method: str,
    path: str,
) -> None:
    operation = router_schema[path][method]
    # The control plane and /metrics answer on the control listener only.
    control = path.startswith(("/workers", "/policy", "/models", "/metrics"))
    base_url = fuzzed_router.control_url if control else fuzzed_router.url

    # Schema-valid cases and schema-violating ones (wrong types, missing fields, bad JSON).
    cases = st.one_of(operation.as_strategy(), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=base_url, headers=AUTH, checks=CHECKS)

    fuzz()
