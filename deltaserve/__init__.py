"""deltaserve: every byte budgeted before it is allocated."""

__version__ = "0.1.0"

# name -> module; imported on first use so that `import deltaserve.config` stays free of torch.
_LAZY = {"LLM": "deltaserve.engine.engine", "Completion": "deltaserve.engine.engine",
         "SamplingParams": "deltaserve.engine.request"}

__all__ = ["Completion", "LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
