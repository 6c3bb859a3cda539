"""Grammar-constrained decoding with llguidance: one matcher per constrained request, masks only for its rows.

llguidance was measured against xgrammar (bench/grammar_mask.py): xgrammar computes a mask faster, but its
wheel pulls triton, which this CPU-first project does not install; llguidance is a self-contained CPU wheel.
A grammar is compiled when the request is submitted (a bad schema is refused then, never inside a step), and
the rows of unconstrained requests batched beside it are never touched.
"""

from __future__ import annotations

import threading

import llguidance
import torch

from deltaserve.text.tokenizer import Tokenizer

BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A grammar (or JSON schema) llguidance cannot compile; the message says why."""


class Grammars:
    """Matchers for one engine's tokenizer; the llguidance tokenizer is built on first use (not at load)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._lltokenizer = None
        self._lock = threading.Lock()
        self._executor = None

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher of `grammar` (llguidance's JSON or Lark text); GrammarError when it does not compile."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=max(self.vocab_size, self.tokenizer.vocab_size),
                    eos_token=self.eos_token_ids or None)
                self._executor = llguidance.LLExecutor()
        matcher = llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]) -> None:
        """Set to -inf, in place, every token the grammar forbids, in the given rows of `logits` only."""
        # One row of 32-token words per matcher, filled by llguidance's executor: what llguidance.torch's helpers
        # do, without importing that module, whose torch.compile at import pulls in dynamo and inductor (+1.7 s
        # to every start and +116 MB resident on this CPU, for a kernel we never call).
        words = (logits.shape[1] + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, j) for j, m in enumerate(matchers)], bitmask.data_ptr(),
                                               words * 4, len(rows))
        allowed = ((bitmask.unsqueeze(-1) >> BITS) & 1).bool().view(len(rows), -1)[:, :logits.shape[1]]
        index = torch.tensor(rows, device=logits.device)
        picked = logits.index_select(0, index).masked_fill_(~allowed.to(logits.device), float("-inf"))
        logits.index_copy_(0, index, picked)


def advance(matchers: list[llguidance.LLMatcher], tokens: list[int]) -> None:
    """Feed each constrained row's sampled token to its matcher."""
    for matcher, token in zip(matchers, tokens):
        matcher.consume_token(token)
