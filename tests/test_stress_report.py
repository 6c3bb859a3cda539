"""deltaserve stress: statistics (against numpy), counts that add up, the markdown table, JSON and PNG."""

import json

import matplotlib.image
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.stress.client import RequestResult
from deltaserve.stress.health import HealthSample
from deltaserve.stress.matrix import Cell
from deltaserve.stress.report import markdown_table, percentile, summarize, write_chart, write_json
from deltaserve.stress.runner import CellRun


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=50),
       st.floats(min_value=0, max_value=100))
def test_percentile_is_numpys_linear_percentile(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_percentile_of_nothing_is_none():
    assert percentile([], 50) is None


def ok(index, ttft, last, e2e, prompt=64, completion=16):
    return RequestResult(index=index, kind="ok", ttft_s=ttft, last_token_s=last, e2e_s=e2e, prompt_tokens=prompt,
                         completion_tokens=completion, text_chunks=completion, finish_reason="length")


def sample_run() -> CellRun:
    cell = Cell(concurrency=3, prompt_tokens=64, gen_tokens=16, requests=8)
    results = [ok(0, 0.5, 2.0, 2.1), ok(1, 1.0, 3.0, 3.2), ok(2, 2.0, 3.5, 3.6, prompt=65),
               RequestResult(index=3, kind="refused", status=429, error="queue full (1 waiting)"),
               RequestResult(index=4, kind="refused", status=429, error="queue full (1 waiting)"),
               RequestResult(index=5, kind="http", status=500, error="engine crashed"),
               RequestResult(index=6, kind="transport", error="server closed the connection mid-response", sent_at=0.5,
                             e2e_s=2.0)]
    health = [HealthSample(at=0.0, answering=True, latency_s=0.01, queued=2.0),
              HealthSample(at=1.0, answering=False, latency_s=0.001, down=True, error="connection refused")]
    return CellRun(cell=cell, results=results, health=health, wall_s=4.0)


def test_summary_counts_add_up_and_stats_follow_their_definitions():
    run = sample_run()
    s = summarize(run)
    assert s["planned"] == 8 and s["sent"] == 7 and s["not_sent"] == 1
    assert s["succeeded"] + s["refused_429"] + s["failed"] == s["sent"]
    assert (s["succeeded"], s["refused_429"], s["failed"]) == (3, 2, 2)
    assert sum(s["failures"].values()) == s["refused_429"] + s["failed"]
    assert s["failures"]["HTTP 429 (queue full): queue full (1 waiting)"] == 2
    assert s["failures"]["HTTP 500: engine crashed"] == 1
    assert s["ttft_s"]["p50"] == pytest.approx(np.percentile([0.5, 1.0, 2.0], 50))
    assert s["ttft_s"]["p95"] == pytest.approx(np.percentile([0.5, 1.0, 2.0], 95))
    assert s["e2e_s"]["p95"] == pytest.approx(np.percentile([2.1, 3.2, 3.6], 95))
    assert s["prefill_tok_s"]["p50"] == pytest.approx(np.median([64 / 0.5, 64 / 1.0, 65 / 2.0]))
    assert s["decode_tok_s"]["per_request_p50"] == pytest.approx(np.median([15 / 1.5, 15 / 2.0, 15 / 1.5]))
    assert s["decode_tok_s"]["total"] == pytest.approx(48 / 4.0)
    assert s["prompt_tokens_reported"] == {"min": 64, "max": 65, "matching": 2, "reported": 3}
    assert s["server"]["stopped_answering"] and s["server"]["max_queued"] == 2.0
    assert s["server"]["stopped_at_s"] == 1.0
    assert s["verdict"] == "server stopped answering at +1.0 s"
    run.back_after_s = 4.2
    assert summarize(run)["verdict"] == "server stopped answering at +1.0 s, answering again 4 s after the cell"


def test_verdicts_tell_refusals_from_crashes_and_restarts():
    run = sample_run()
    run.results = run.results[:5]
    run.health = run.health[:1]
    assert summarize(run)["verdict"] == "queued/refused (429), no crash"
    run.results.append(RequestResult(index=5, kind="http", status=500, error="boom"))
    assert summarize(run)["verdict"] == "errors"
    run.health = [HealthSample(at=0, answering=True, latency_s=0.01, start_time=1000.0),
                  HealthSample(at=1, answering=True, latency_s=0.01, start_time=1050.0)]
    assert summarize(run)["verdict"] == "server restarted"
    skipped = CellRun(cell=run.cell, not_run_reason="server stopped answering (connection refused)",
                      health=[HealthSample(at=5.0, answering=False, latency_s=0.0, down=True)])
    s = summarize(skipped)
    assert s["sent"] == 0 and s["not_sent"] == 8 and s["verdict"].startswith("not run")
    assert s["server"]["stopped_at_s"] is None


def test_markdown_json_and_png_carry_every_cell(tmp_path):
    runs = [sample_run(), CellRun(cell=Cell(1, 256, 8, 1), results=[ok(0, 0.2, 0.9, 1.0, prompt=256, completion=8)],
                                  wall_s=1.0)]
    summaries = [summarize(r) for r in runs]
    table = markdown_table(summaries)
    rows = [line for line in table.splitlines()[2:] if line.startswith("| c")]
    assert len(rows) == 2 and rows[1].count("|") == table.splitlines()[0].count("|")
    assert "HTTP 500: engine crashed" in table and "1/1 = 256" in rows[1]
    write_json(tmp_path / "s.json", summaries, {"url": "http://127.0.0.1:1"})
    data = json.loads((tmp_path / "s.json").read_text())
    assert [c["cell"] for c in data["cells"]] == ["c3 p64 g16", "c1 p256 g8"]
    write_chart(tmp_path / "s.png", summaries)
    image = matplotlib.image.imread(tmp_path / "s.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_speculative_acceptance_is_summed_over_requests_and_reported():
    """A speculating server's usage.speculative counts add up per cell; a server without them reports none."""
    from deltaserve.stress.client import _take_chunk

    run = sample_run()
    assert summarize(run)["speculative"] is None and "speculative decoding" not in markdown_table([summarize(run)])
    for r, (drafted, accepted) in zip(run.results[:3], [(12, 9), (6, 1), (0, 0)]):
        _take_chunk(r, {"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 16,
                                                 "speculative": {"drafted": drafted, "accepted": accepted}}})
    s = summarize(run)
    assert s["speculative"] == {"requests": 3, "drafted": 18, "accepted": 10, "acceptance": pytest.approx(10 / 18)}
    assert "accepted 10 of 18 draft tokens (55.6%) over 3 requests" in markdown_table([s])
    assert json.loads(json.dumps(s))["speculative"]["drafted"] == 18
