"""schemathesis over the server's own OpenAPI document: a few hundred generated requests, valid and invalid, against a
real `deltaserve serve`; none may get a 5xx, nor a stream that ends in a server error.

The server caps every generation at 2 new tokens (--max-new-tokens-cap), so whatever max_tokens a case asks for,
each case costs at most a few engine steps.
"""

import json

import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from server_util import running_server

EXAMPLES = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server_fuzz"), "--max-new-tokens-cap", "2", "--max-total-tokens",
                        "4096", "--max-running-requests", "4") as s:
        yield s


def _server_errors(text: str) -> list[dict]:
    """The `server_error` bodies in a JSON answer or in the events of a stream."""
    bodies = []
    for chunk in [text] + [line[6:] for line in text.splitlines() if line.startswith("data: {")]:
        try:
            body = json.loads(chunk)
        except ValueError:
            continue
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            bodies.append(body["error"])
        if isinstance(body, dict) and body.get("type") == "response.failed":  # the Responses stream's failure
            bodies.append({"type": "server_error", **body["response"]["error"]})
    return [b for b in bodies if b.get("type") == "server_error"]


def test_generated_requests_never_get_a_5xx(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    posts = [schema[path]["POST"] for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")]
    gets = [schema[path]["GET"] for path in ("/v1/models", "/v1/budget", "/health", "/metrics")]
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    cases = st.one_of([op.as_strategy(mode) for op in posts for mode in modes] + [op.as_strategy() for op in gets])
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases)
    def check(case):
        response = case.call(base_url=server.url, timeout=120)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.body, response.status_code, response.text[:1000])
        assert not _server_errors(response.text), (case.body, response.text[-1000:])

    check()
    assert statuses.get(200, 0) >= EXAMPLES // 10 and statuses.get(400, 0) > 0, statuses  # valid and invalid ran
    assert server.get("/health").status_code == 200
