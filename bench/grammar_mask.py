"""Per-token grammar mask cost of xgrammar vs llguidance on this CPU, batch 16, one run, ratios printed.

Each of 16 rows is constrained by the JSON schema of a forced tool call (tool_choice "required") and walks the
same valid answer token by token: per step every row computes its next-token mask and consumes its token.
Run: python bench/grammar_mask.py [--model PATH] (xgrammar must be importable; it is not a dependency).
"""

import argparse
import json
import time

import torch

import results as bench_results
from deltaserve.budget import default_model_path
from deltaserve.weights import read_tokenizer

BATCH = 16
SCHEMA = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["name", "arguments"], "additionalProperties": False, "properties": {
        "name": {"const": "read_file"}, "arguments": {"type": "object", "required": ["path"], "properties": {
            "path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}}}}},
    {"type": "object", "required": ["name", "arguments"], "additionalProperties": False, "properties": {
        "name": {"const": "run"}, "arguments": {"type": "object", "required": ["command"], "properties": {
            "command": {"type": "string"}, "timeout_s": {"type": "integer"}}}}}]}}
ANSWER = json.dumps([{"name": "run", "arguments": {"command": "grep -rn 'def main' src/ | head -20",
                                                   "timeout_s": 30}},
                     {"name": "read_file", "arguments": {"path": "src/deltaserve/engine/sampler.py", "offset": 1}}], separators=(",", ":"))


def bench_llguidance(tok, ids):
    import llguidance
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    setup_s = time.perf_counter() - t0
    executor = llguidance.LLExecutor()
    bitmask = llguidance.torch.allocate_token_bitmask(BATCH, tok.vocab_size)
    t0 = time.perf_counter()
    for token in ids:
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        for m in matchers:
            assert m.consume_token(token), m.get_error()
    return setup_s, (time.perf_counter() - t0) / len(ids), bitmask


def bench_xgrammar(tok, ids):
    import xgrammar

    t0 = time.perf_counter()
    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=tok.vocab_size,
                                  stop_token_ids=tok.eos_token_ids)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                  separators=(",", ":"))
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(BATCH)]
    setup_s = time.perf_counter() - t0
    batch = xgrammar.BatchGrammarMatcher()
    bitmask = xgrammar.allocate_token_bitmask(BATCH, tok.vocab_size)
    t0 = time.perf_counter()
    for token in ids:
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        for m in matchers:
            assert m.accept_token(token)
    return setup_s, (time.perf_counter() - t0) / len(ids), bitmask


def apply_cost_s(vocab_size: int, bitmask: torch.Tensor) -> float:
    """Unpacking a [16, V/32] bitmask and masking [16, V] float32 logits, as the sampler does."""
    logits = torch.randn(BATCH, vocab_size)
    bits = torch.arange(32, dtype=torch.int32)
    t0 = time.perf_counter()
    for _ in range(50):
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(BATCH, -1)[:, :vocab_size]
        logits.masked_fill_(~allowed, float("-inf"))
    return (time.perf_counter() - t0) / 50


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    record = bench_results.Run("grammar_mask", "Grammar mask cost per step: llguidance vs xgrammar")
    tok = read_tokenizer(args.model or default_model_path())
    ids = tok.encode(ANSWER, add_special_tokens=False)
    print(f"vocab {tok.vocab_size}, answer {len(ids)} tokens, batch {BATCH}, torch threads {torch.get_num_threads()}")
    results = {}
    for name, run in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        setup_s, step_s, bitmask = run(tok, ids)
        results[name] = step_s
        print(f"{name:10s} setup {setup_s * 1e3:8.1f} ms   mask step (16 rows) {step_s * 1e6:8.1f} us   "
              f"per row-token {step_s / BATCH * 1e6:6.1f} us")
    print(f"apply mask to [16, {tok.vocab_size}] logits: {apply_cost_s(tok.vocab_size, bitmask) * 1e6:.1f} us")
    print(f"ratio xgrammar / llguidance per step: {results['xgrammar'] / results['llguidance']:.2f}")
    record.table(f"batch {BATCH}, vocab {tok.vocab_size}, {torch.get_num_threads()} threads",
                 ["library", "mask step (16 rows), us"], [[name, round(s * 1e6, 1)] for name, s in results.items()])
    record.save()


if __name__ == "__main__":
    main()
