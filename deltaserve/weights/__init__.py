"""Reading checkpoints: HF safetensors folders and GGUF files."""

from deltaserve.weights.errors import CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "TensorInfo", "load_checkpoint", "read_config", "read_tensor_index",
           "read_tokenizer"]


def __getattr__(name: str):
    # Lazy: text.tokenizer imports weights.errors, and checkpoint imports text.tokenizer.
    if name in __all__:
        from deltaserve.weights import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'deltaserve.weights' has no attribute {name!r}")
