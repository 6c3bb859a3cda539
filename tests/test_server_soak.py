"""A small soak through a real server on the tiny hybrid (bench/soak.py runs the 2,000-request one): clients that
stay, clients that leave at random moments and malformed ones (wrong types, not JSON, oversize prompt and body, a
wrong or missing key, a text/plain post), mixed and seeded. Every client that stays gets exactly its prompt's answer
alone, nothing gets a 5xx, every malformed one a 4xx, and the pools are full again at the end.
"""

from __future__ import annotations

import asyncio

import pytest

import traffic
from server_util import running_server
from test_engine_support import HYBRID_VOCAB, make_hybrid_checkpoint

KEY = "soak-key"
REQUESTS = 200
MAX_BODY_BYTES = 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("soak-hybrid")
    make_hybrid_checkpoint(folder)
    with running_server(folder, "--model", str(folder), "--api-key", KEY, "--max-total-tokens", "16384",
                        "--prefill-chunk-tokens", "64", "--max-body-bytes", str(MAX_BODY_BYTES),
                        headers={"Authorization": f"Bearer {KEY}"}) as s:
        yield s


def test_soak_of_normal_leaving_and_malformed_clients(server):
    result = asyncio.run(traffic.soak(server.url, KEY, REQUESTS, seed=16, max_body_bytes=MAX_BODY_BYTES,
                                      vocab=HYBRID_VOCAB))
    assert result.by_kind.keys() == {"normal", "leaver", "malformed"}, result
    assert not result.normal_failures, result.normal_failures[:3]
    assert not result.malformed_failures, result.malformed_failures[:3]
    assert result.client_5xx == 0 and result.server_5xx == 0, result.by_status
    assert result.pools_full and result.disconnects > 0, result
    assert "internal error" not in server.log.read_text(errors="replace")
