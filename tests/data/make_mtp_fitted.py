"""Fit a tiny MTP head to a tiny hybrid's own greedy continuations; saves the checkpoint to tests/data/mtp_fitted/.

    .venv/bin/python tests/data/make_mtp_fitted.py        (some minutes on 2 shared cores)
    .venv/bin/python tests/data/make_mtp_fitted.py --size bench --out DIR

`--size bench` makes the same kind of model at a size whose decode step is bound by its weights, as a real model's
is (bench/spec.py --method mtp builds it once and keeps it; ~110 MB, not committed): 12 layers of hidden 512 (9 Gated
DeltaNet, 3 attention), one head layer beside them. The committed tiny fixture's step (hidden 64, 0.2 ms) is
interpreter time, not arithmetic, so a head pass costs as much as a target step there, unlike on any served model.

A random tiny model's greedy continuations are chaotic: a head fitted to them (tried first: 176 continuations, 48
tokens each) reached 0.36 next-next accuracy on its training prompts and 0.02 on held-out ones (memorized, not
learnt). So the target here is a tiny Qwen3.5 hybrid (test_engine_support's config) first trained to continue text
by a fixed random successor table (after a random 16-token prefix, token t + 1 = SUCC[token t]): its greedy
continuations are then a function the head can learn, which is what a real model's MTP head meets on the
predictable stretches of real text. The target is trained with transformers' own Qwen3_5ForCausalLM; its greedy
continuations of random prompts (seeds >= 1000; tests hold out seeds below 1000) come from our engine with
speculation off, its hidden states after the final norm from transformers. The head is composed from transformers'
own Qwen3.5 classes (a full-attention decoder layer, zero-centred RMSNorms) and an fc, as vLLM composes Qwen3.5's
MTP head; embed_tokens and lm_head are the target's, frozen. Two losses: token t + 2 from (h_t, token t + 1), and
the same one step later from the head's own output (h'_{t-1}, token t + 1), which chained drafts read. Saved in
float16 (the engine loads it as float32): config.json, model.safetensors (the target and mtp.*), tokenizer.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent))

from test_engine_support import (HYBRID_VOCAB, _save_word_tokenizer, engine, make_hybrid_checkpoint,  # noqa: E402
                                 random_prompt, run_all, tokens_of)

from deltaserve.engine.request import SamplingParams  # noqa: E402

OUT = HERE / "mtp_fitted"
PROMPTS, PROMPT_LEN, NEW_TOKENS = 64, 16, 24
TRAIN_SEED0 = 1000
TARGET_BATCH = 16
SAVE_EVERY = 50  # the head so far is saved every this many steps (a run cut short still leaves one)


def bench_target(folder: Path):
    """The weight-bound size (module docstring), random, saved by transformers with the tiny one's tokenizer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(zlib.crc32(b"mtp-bench-hybrid"))
    config = Qwen3_5TextConfig(
        vocab_size=HYBRID_VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
        full_attention_interval=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        initializer_range=0.02, max_position_embeddings=32768,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[4, 2, 2], mrope_interleaved=True))
    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config).eval()
    model.save_pretrained(folder)
    _save_word_tokenizer(folder)
    return model


@dataclass(frozen=True)
class Size:
    make_target: object  # folder -> the random transformers model, saved there
    mtp_layer: int  # a full-attention index of its config (the transformers class takes the layer's kind from it)
    target_steps: int
    target_lr: float
    steps: int
    lr: float


SIZES = {"tiny": Size(make_hybrid_checkpoint, 3, 80, 1e-2, 100, 5e-3),
         "bench": Size(bench_target, 11, 80, 2e-3, 100, 2e-3)}


class Head(torch.nn.Module):
    def __init__(self, config, mtp_layer: int):
        from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                                  Qwen3_5TextRotaryEmbedding)

        super().__init__()
        h = config.hidden_size
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.layer = Qwen3_5DecoderLayer(config, mtp_layer)
        self.norm = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(config)

    def forward(self, embeds, hidden):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        cos_sin = self.rotary(x, positions[None].expand(3, -1, -1))
        return self.norm(self.layer(x, cos_sin, attention_mask=None, position_ids=positions))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"mtp.layers.0.{k}": v for k, v in self.layer.state_dict().items()}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "fc"):
            out[f"mtp.{name}.weight"] = getattr(self, name).weight
        return {k: v.detach().float().contiguous() for k, v in out.items()}


def successor_sequences(n: int, seed: int) -> torch.Tensor:
    """[n, PROMPT_LEN + NEW_TOKENS]: a random prefix, then the successor chain from its last token."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randperm(HYBRID_VOCAB, generator=torch.Generator().manual_seed(12345))
    seqs = torch.randint(0, HYBRID_VOCAB, (n, PROMPT_LEN + NEW_TOKENS), generator=g)
    for t in range(PROMPT_LEN, seqs.shape[1]):
        seqs[:, t] = succ[seqs[:, t - 1]]
    return seqs


def train_target(target, size: Size, started: float) -> None:
    """Teach the tiny model the successor table (loss on the chain part only)."""
    target.train().requires_grad_(True)
    opt = torch.optim.AdamW(target.parameters(), lr=size.target_lr, weight_decay=0.0)
    for step in range(size.target_steps + 1):
        seqs = successor_sequences(TARGET_BATCH, step)
        logits = target(seqs).logits[:, PROMPT_LEN - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, HYBRID_VOCAB), seqs[:, PROMPT_LEN:].reshape(-1))
        if step % 10 == 0 or step == size.target_steps:
            acc = (logits.argmax(-1) == seqs[:, PROMPT_LEN:]).float().mean()
            print(f"target step {step}: loss {loss.item():.3f}, accuracy {acc:.3f}, {time.time() - started:.0f} s",
                  flush=True)
        if step == size.target_steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    target.eval().requires_grad_(False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", type=Path, default=OUT, help="the checkpoint's folder [tests/data/mtp_fitted]")
    args = parser.parse_args(argv)
    fit(SIZES[args.size], args.out)


def fit(size: Size, out: Path) -> None:
    torch.set_num_threads(2)
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        target = size.make_target(Path(tmp))
        train_target(target, size, started)
        target.config.mtp_num_hidden_layers = 1
        target.half().save_pretrained(out)
        target.float()
        for name in ("tokenizer.json",):
            (out / name).write_bytes((Path(tmp) / name).read_bytes())
        tmp = str(out)
        eng = engine(tmp, max_running_requests=16, max_queue=256)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        prompts = [random_prompt(PROMPT_LEN, TRAIN_SEED0 + i, HYBRID_VOCAB) for i in range(PROMPTS)]
        outs = run_all(eng, [(p, params) for p in prompts])
        seqs = torch.tensor([p + tokens_of(o) for p, o in zip(prompts, outs)])  # [N, T]
        config = target.config
    print(f"data: {seqs.shape[0]} sequences of {seqs.shape[1]} tokens, {time.time() - started:.0f} s", flush=True)
    target.eval().requires_grad_(False)
    with torch.no_grad():
        hidden = target.model(seqs).last_hidden_state  # [N, T, H], after the final norm
    embed, lm_head = target.model.embed_tokens, target.lm_head
    torch.manual_seed(0)
    head = Head(config, size.mtp_layer)
    with torch.no_grad():  # start from the target's own last full-attention layer: a better prior than noise
        head.layer.load_state_dict(target.model.layers[size.mtp_layer].state_dict())
        head.fc.weight.zero_()
        head.fc.weight[:, config.hidden_size:].copy_(torch.eye(config.hidden_size))
    opt = torch.optim.AdamW(head.parameters(), lr=size.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, size.steps)
    n_train = seqs.shape[0] - 8  # the last 8 sequences: a validation split
    first = PROMPT_LEN - 1  # predictions from the last prompt position on (the generated part is what drafts meet)
    for step in range(size.steps + 1):
        batch = torch.arange(n_train) if step < size.steps else torch.arange(n_train, seqs.shape[0])
        ids, h = seqs[batch], hidden[batch]
        emb = embed(ids[:, 1:-1])  # token t + 1 for t = 0 .. T - 3
        out1 = head(emb, h[:, :-2])  # predicts token t + 2
        logits1 = lm_head(out1)[:, first:]
        loss1 = torch.nn.functional.cross_entropy(logits1.reshape(-1, HYBRID_VOCAB), ids[:, first + 2:].reshape(-1))
        # one chained step: (h'_{t-1}, token t + 1) -> token t + 2, for t >= 1
        out2 = head(emb[:, 1:], out1[:, :-1])
        logits2 = lm_head(out2)[:, first:]
        loss2 = torch.nn.functional.cross_entropy(logits2.reshape(-1, HYBRID_VOCAB),
                                                  ids[:, first + 3:].reshape(-1))
        if step == size.steps or step % SAVE_EVERY == 0:
            with torch.no_grad():
                acc1 = (logits1.argmax(-1) == ids[:, first + 2:]).float().mean()
                acc2 = (logits2.argmax(-1) == ids[:, first + 3:]).float().mean()
            split = "validation" if step == size.steps else "train"
            print(f"step {step} ({split}): loss {loss1.item():.3f} / {loss2.item():.3f}, next-next accuracy "
                  f"{acc1:.3f}, chained {acc2:.3f}, {time.time() - started:.0f} s", flush=True)
            save(head, out)
            if step == size.steps:
                break
        opt.zero_grad()
        (loss1 + loss2).backward()
        opt.step()
        sched.step()
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()):,} bytes)")


def save(head: Head, out: Path) -> None:
    """The target's tensors (as saved, float16) and the head's, in one model.safetensors."""
    path = out / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith("mtp.")}
    tensors.update({k: v.half() for k, v in head.checkpoint_tensors().items()})
    save_file(tensors, path, metadata={"format": "pt", "made_by": "tests/data/make_mtp_fitted.py"})


if __name__ == "__main__":
    main()
