"""lm-evaluation-harness (`local-completions`, pinned in the test extras) against a real server on a small
multiple-choice task from a local YAML and JSONL (no hub): its log-likelihood requests are /v1/completions with
`echo` and `logprobs` (prompt log-probabilities), and its accuracy equals the one from transformers' log-probs on the
same weights and items."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from server_util import running_server
from test_engine_support import HYBRID_VOCAB, make_dense_checkpoint

ITEMS = 12
CHOICES = 3
EXACT = ("--dtype", "float32", "--kv-dtype", "float32", "--activation-dtype", "float32",
         "--max-total-tokens", "4096", "--max-running-requests", "4")


def words(count: int, seed: int) -> list[int]:
    return [1 + (i * 37 + seed * 11 + i * i * seed) % (HYBRID_VOCAB - 1) for i in range(count)]


def text(ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in ids)


def oracle_loglik(model, context: list[int], continuation: list[int]) -> float:
    with torch.no_grad():
        logprobs = model(torch.tensor([context + continuation])).logits[0].float().log_softmax(-1)
    return sum(float(logprobs[len(context) - 1 + j, t]) for j, t in enumerate(continuation))


def test_lm_eval_accuracy_equals_transformers(tmp_path, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    import lm_eval  # imported once the offline switches are set
    from lm_eval.tasks import TaskManager

    folder = tmp_path / "model"
    folder.mkdir()
    oracle = make_dense_checkpoint(folder)
    items, hits = [], 0
    for i in range(ITEMS):
        context = words(8 + i % 5, i + 1)
        choices = [words(2 + c % 2, 40 + i * CHOICES + c) for c in range(CHOICES)]
        label = i % CHOICES
        scores = [oracle_loglik(oracle, context, c) for c in choices]
        ranked = sorted(scores)
        assert ranked[-1] - ranked[-2] > 1e-3  # no near-tie: the float32 paths cannot pick differently
        hits += max(range(CHOICES), key=scores.__getitem__) == label
        items.append({"context": text(context), "choices": [text(c) for c in choices], "label": label})
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_choice.yaml").write_text(
        "task: tiny_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n")
    with running_server(tmp_path, "--model", str(folder), *EXACT) as server:
        served = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": server.url + "/v1/completions", "model": served, "tokenizer": str(folder),
                        "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1},
            tasks=["tiny_choice"], task_manager=TaskManager(include_path=str(tasks)))
    assert 0 < hits < ITEMS  # an accuracy a wrong log-prob can move either way
    assert results["results"]["tiny_choice"]["acc,none"] == pytest.approx(hits / ITEMS)
