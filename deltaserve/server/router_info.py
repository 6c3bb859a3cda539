"""What a router asks a worker before it routes to it: SGLang's worker metadata endpoints, answered for deltaserve.

sglang-router (its model gateway) registers a worker by GET /server_info (falling back to /get_server_info) and
/model_info (/get_model_info), and labels the worker with the `served_model_name` it finds there: that label is the
model name it routes by. /get_load reports the queue for its load-aware policies. Plain JSON, no wire format of
OpenAI's: the routes are in admin.py.
"""

from __future__ import annotations

import importlib.metadata

from deltaserve.engine.door import EngineInfo
from deltaserve.engine.engine import EngineStats


def server_info(info: EngineInfo, served_name: str) -> dict:
    """The fields sglang-router reads from /server_info (the rest of SGLang's are optional there)."""
    budget = info.budget
    return {
        "model_path": info.model_path,
        "served_model_name": served_name,
        "tp_size": 1,
        "dp_size": 1,
        "max_total_tokens": budget.kv_tokens,
        "max_prefill_tokens": info.max_prefill_tokens,
        "max_running_requests": budget.max_running_requests,
        "context_length": info.context_length,
        "version": _version(),
        "engine": "deltaserve",
    }


def model_info(info: EngineInfo) -> dict:
    """The fields sglang-router reads from /model_info."""
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.model_path,
        "is_generation": True,
        "model_type": info.model_type,
        "architectures": list(info.architectures),
    }


def load(stats: EngineStats, info: EngineInfo) -> dict:
    """Running and waiting requests and KV tokens in use: what SGLang's /get_load reports per data-parallel rank."""
    page = info.budget.page_size
    return {"dp_rank": 0, "num_reqs": stats.running + stats.waiting, "num_waiting_reqs": stats.waiting,
            "num_tokens": stats.kv_pages_used * page}


def _version() -> str:
    try:
        return importlib.metadata.version("deltaserve")
    except importlib.metadata.PackageNotFoundError:
        return "0"
