"""Schemathesis over the orchestrator's own /openapi.json: no 5xx, no answer slower than its timeout.

A live orchestrator with one node serving the tiny random model (generation takes milliseconds, so the
examples stay fast). Every documented operation gets generated requests — valid and invalid bodies,
sampling parameters, stop strings, logit biases, unknown ids. ``POST /v1/leases`` is left out: a lease holds a
real chain slot until it is released or expires, so random leases would fill the swarm; leases are tested in
tests/test_runtime.py.
"""
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from server.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def api_url(tiny_model):
    with LocalSwarm(tiny_model) as swarm:
        swarm.add_orchestrator(expected_rate=4.0, max_length=64, expected_input_tokens=16, expected_output_tokens=8,
                               refresh_s=0.5, max_queue_per_client=32, queue_timeout_s=20.0)
        swarm.add_node(node_id="only", memory_gb=0.0024,
                       declared_profile={"prefill_s": 1e-5, "decode_s": 3e-4, "rtt_s": 0.002})
        swarm.wait_chains_ready()
        yield swarm.orchestrator.info["url"]


def test_no_server_errors_and_no_slow_answers(api_url):
    schema = schemathesis.openapi.from_url(f"{api_url}/openapi.json").exclude(path="/v1/leases", method="POST")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"} <= {op.label for op in operations}
    for operation in operations:
        @settings(max_examples=12, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case):
            started = time.monotonic()
            response = case.call(base_url=api_url, timeout=TIMEOUT_S)
            elapsed = time.monotonic() - started
            assert response.status_code < 500, (operation.label, case.body, response.status_code, response.text[:300])
            assert elapsed < TIMEOUT_S, (operation.label, elapsed)
            content_type = (response.headers.get("content-type") or [""])[0]
            if response.status_code >= 400 and content_type.startswith("application/json"):
                assert response.json()["error"]["message"]  # every refusal says why

        call()
