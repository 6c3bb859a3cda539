"""Load generator: concurrency × prompt length × generation length against an OpenAI-compatible server."""
