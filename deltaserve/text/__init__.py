"""Text around the model: tokenizer, chat templates, and the reasoning / tool-call parsers (a leaf package)."""
