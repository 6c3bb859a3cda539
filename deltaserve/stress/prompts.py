"""Prompts of an exact token count for the target's tokenizer, different for every request.

A prompt is a fixed preamble followed by words drawn from a seeded RNG. Every word is chosen to be
exactly one token after a space for the target's tokenizer, and byte-level BPE and SentencePiece
tokenizers both split at spaces, so the request costs `overhead + words` tokens. The overhead (chat
template, BOS, preamble) and the single-token words are measured once: with a local tokenizer when
one is given, else with a few tiny probe requests reading the server's `usage.prompt_tokens`.
"""

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

PREAMBLE = "Words:"
MIN_WORDS = 16  # fewer distinct words than this and prompts start to repeat themselves
MAX_CALIBRATION_PROBES = 48  # group testing of the word list costs about log2(words) per multi-token word
CALIBRATION_GROUP_WORDS = 32  # words tested per probe at first: a probe costs the server a short prefill
SERVER_WORDS = 128  # enough distinct words that no two prompts share a prefix; more only costs probes
EXACT_FIT_ATTEMPTS = 8
# Common English words; most are one token after a space for GPT-2, Llama, Qwen, SmolLM and Mistral
# vocabularies. The ones that are not are found and dropped by calibration.
WORDS = tuple("""
the of and to in is was for on are with as his they be at one have this from or had by hot word but
what some we can out other were all there when up use your how said an each she which do their time
if will way about many then them write would like so these her long make thing see him two has look
more day could go come did number sound no most people my over know water than call first who may
down side been now find any new work part take get place made live where after back little only
round man year came show every good me give our under name very through just form sentence great
think say help low line differ turn cause much mean before move right boy old too same tell does set
three want air well also play small end put home read hand port large spell add even land here must
big high such follow act why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father head stand own page should country found
answer school grow study still learn plant cover food sun four between state keep eye never last let
thought city tree cross farm hard start might story saw far sea draw left late run while press close
night real life few north open seem together next white children begin got walk example ease paper
group always music those both mark often letter until mile river car feet care second book carry
took science eat room friend began idea fish mountain stop once base hear horse cut sure watch color
face wood main enough plain girl usual young ready above ever red list though feel talk bird soon
body dog family direct pose leave song measure door product black short class wind question
happen complete ship area half rock order fire south problem piece told knew pass since top whole king
space heard best hour better true during hundred five remember step early hold west ground interest
reach fast verb sing listen six table travel less morning ten simple several toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice voice
unit power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field
rest correct able pound done beauty drive stood contain front teach week final gave green quick
develop ocean warm free minute strong special mind behind clear tail produce fact street inch multiply
nothing course stay wheel full force blue object decide surface deep moon island foot system busy
test record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate miss brought heat snow tire bring yes distant fill east paint language among
""".split())


class PromptError(ValueError):
    """A prompt size that cannot be built for this tokenizer."""


@dataclass(frozen=True)
class PromptPlan:
    """How to build a prompt of N tokens: the fixed cost of a request and the words that cost one each."""

    overhead_tokens: int  # tokens of a request whose prompt is PREAMBLE alone
    words: tuple[str, ...]
    source: str  # "tokenizer <path>" or "server usage probes"

    def words_for(self, prompt_tokens: int) -> int:
        """How many words a prompt of `prompt_tokens` tokens holds; PromptError when it cannot be built."""
        words = prompt_tokens - self.overhead_tokens
        if words < 1:
            raise PromptError(f"a prompt of {prompt_tokens} tokens is not possible: a request with no words already "
                             f"costs {self.overhead_tokens} tokens (chat template, BOS, preamble); "
                             f"ask for at least {self.overhead_tokens + 1}")
        return words


def prompt_text(words: list[str]) -> str:
    """The prompt text of a request: the preamble, then the words, each after a space."""
    return PREAMBLE + "".join(" " + word for word in words)


def request_rng(seed: int, cell_label: str, index: int) -> random.Random:
    """The RNG of one request: the same run gives the same prompts, no two requests share one."""
    return random.Random(f"{seed}/{cell_label}/{index}")


def build_prompt(plan: PromptPlan, prompt_tokens: int, rng: random.Random,
                 count_tokens: Callable[[str], int] | None = None) -> str:
    """A prompt whose request costs `prompt_tokens` tokens; checked and corrected with `count_tokens` when given."""
    words = [rng.choice(plan.words) for _ in range(plan.words_for(prompt_tokens))]
    if count_tokens is None:
        return prompt_text(words)
    for _ in range(EXACT_FIT_ATTEMPTS):
        text = prompt_text(words)
        error = count_tokens(text) - prompt_tokens
        if error == 0:
            return text
        if error > 0:
            del words[max(1, len(words) - error):]
        else:
            words += [rng.choice(plan.words) for _ in range(-error)]
    raise PromptError(f"could not build a prompt of exactly {prompt_tokens} tokens: the tokenizer merges "
                     f"across words (off by {error} after {EXACT_FIT_ATTEMPTS} corrections)")


async def single_token_words(words: tuple[str, ...], overhead_tokens: int,
                             count_tokens: Callable[[str], Awaitable[int]], *, want: int | None = None,
                             max_probes: int = MAX_CALIBRATION_PROBES) -> tuple[tuple[str, ...], int]:
    """The words that cost exactly one token each after the preamble, by group testing; and probes used.

    A group of k words costs k tokens only when every word in it costs one, so one count clears a
    whole group; a group that costs more is halved until the bad words are isolated. Stops once
    `want` words are found (None: test them all).
    """
    good: list[str] = []
    groups = [list(words[i:i + CALIBRATION_GROUP_WORDS]) for i in range(0, len(words), CALIBRATION_GROUP_WORDS)]
    groups.reverse()
    probes = 0
    while groups and probes < max_probes and (want is None or len(good) < want):
        group = groups.pop()
        cost = await count_tokens(prompt_text(group)) - overhead_tokens
        probes += 1
        if cost == len(group):
            good += group
        elif len(group) > 1:
            groups += [group[len(group) // 2:], group[:len(group) // 2]]
    order = {word: i for i, word in enumerate(words)}
    return tuple(sorted(good, key=order.__getitem__)), probes


async def calibrate(count_tokens: Callable[[str], Awaitable[int]], source: str,
                    words: tuple[str, ...] = WORDS, want: int | None = None) -> PromptPlan:
    """Measure the overhead and (up to `want`) single-token words with `count_tokens` (local or via the server)."""
    overhead = await count_tokens(prompt_text([]))
    good, _ = await single_token_words(words, overhead, count_tokens, want=want)
    if len(good) < MIN_WORDS:
        raise PromptError(f"only {len(good)} of {len(words)} words are one token each for this tokenizer "
                         f"(need {MIN_WORDS}); give --tokenizer PATH with the model's tokenizer")
    return PromptPlan(overhead_tokens=overhead, words=good, source=source)


def local_token_counter(path: str | Path, endpoint: str) -> Callable[[str], int]:
    """prompt text -> tokens of the request, with the tokenizer of the checkpoint at `path` (folder or .gguf).

    Chat requests are counted through the model's chat template, completions with the model's BOS rule.
    """
    from deltaserve.weights import read_tokenizer

    tokenizer = read_tokenizer(path)
    if endpoint == "chat":
        return lambda text: len(tokenizer.encode_chat([{"role": "user", "content": text}]))
    return lambda text: len(tokenizer.encode(text))
