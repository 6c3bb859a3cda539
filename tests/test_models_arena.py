"""models/arena.py: a loaded model's weights moved into one buffer of 2 MB pages give the same logits bit for bit,
every moved tensor a view of that buffer (a shared tensor one view), the decode step's cached kernel arguments rebuilt
from the views, and an embedding table only a lookup reads left where the loader put it."""

import copy

import pytest
import torch
from test_decode_fused import SLOTS_PER_SEQ, decode_batch, steps_both_ways, tiny_dense
from tolerance import logits_rtol
from torch import nn

from deltaserve.kernels import decode_cpu, int4_int8
from deltaserve.models import arena
from deltaserve.models.batch import allocate_caches, single_sequence_batch
from deltaserve.models.int8_activations import use_int8_activations
from deltaserve.models.decode_stack_path import DecodeStackPath, step_logits

pytestmark = pytest.mark.skipif(not arena.huge_pages_available(), reason="no madvise(MADV_HUGEPAGE) on this platform")


def tensors_of(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return {name: t for name, t in out.items() if t is not None}


@torch.inference_mode()
def run(model, prompt: list[int], steps: int) -> torch.Tensor:
    """Logits of a prefill and `steps` greedy decode steps (the one-call path) on fresh caches, stacked."""
    caches = allocate_caches(model.geometry, SLOTS_PER_SEQ, 1, torch.float32, state_dtype=torch.float32)
    logits = [step_logits(model, single_sequence_batch(prompt, 0, torch.arange(SLOTS_PER_SEQ)), caches)[-1]]
    tokens, n = [int(logits[-1].argmax())], len(prompt)
    for _ in range(steps):
        logits.append(step_logits(model, decode_batch(tokens, [n]), caches)[0])
        tokens, n = [int(logits[-1].argmax())], n + 1
    return torch.stack(logits)


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_packed_weights_give_the_same_logits_and_lie_in_one_buffer(weights):
    assert decode_cpu.load() is not None
    model = tiny_dense("llama", weights)
    if weights == "int4":
        assert int4_int8.load() is not None
        use_int8_activations(model)  # the CPU default's panels (int8 activations) where the kernel is built
    prompt = list(range(3, 40))
    before = run(model, prompt, steps=4)
    held = tensors_of(model)
    moved_bytes = arena.pack_weights(model)
    after = tensors_of(model)
    assert torch.equal(run(model, prompt, steps=4), before)
    # every tensor but the embedding table (read a row a token) is a view of one buffer, none overlapping another
    table = model.model.embed_tokens.weight
    assert table.data_ptr() == held["model.embed_tokens.weight"].data_ptr()
    moved = {name: t for name, t in after.items() if t is not table}
    assert all(t.data_ptr() != held[name].data_ptr() and torch.equal(t, held[name]) for name, t in moved.items())
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in
                   {t.data_ptr(): t for t in moved.values()}.values())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] - spans[0][0] <= moved_bytes == sum(end - start + (-(end - start)) % arena.ALIGN
                                                            for start, end in spans)
    assert spans[0][0] % arena.HUGE_PAGE == 0  # the buffer starts on a 2 MB boundary
    # the one-call decode step's cached arguments were rebuilt from the views
    assert DecodeStackPath.of(model).stack._args is not None
    for layer in model.model.layers:
        (attn, _), (mlp, _) = layer.fused.parts  # each block's weight tensors (the stack adds the caches)
        assert {t.data_ptr() for t in attn + mlp if t.numel()} <= {t.data_ptr() for t in moved.values()}
    assert all(isinstance(p, nn.Parameter) for name, p in model.named_parameters() if name in moved)


def test_a_shared_tensor_stays_one_view_and_a_tied_table_moves():
    """Two modules holding one tensor hold one view after the move; an embedding table a vocabulary projection reads
    too (a tied head) moves with it, one that only a lookup reads stays."""
    shared = torch.randn(64, 32)
    model = nn.Module()
    model.embed = nn.Embedding(64, 32)
    model.embed.weight = nn.Parameter(shared, requires_grad=False)
    model.head = nn.Linear(32, 64, bias=False)
    model.head.weight = nn.Parameter(shared, requires_grad=False)  # tied
    model.lonely = nn.Embedding(10, 32)
    model.a, model.b = nn.Module(), nn.Module()
    common = torch.randn(128)
    model.a.register_buffer("t", common)
    model.b.register_buffer("t", common)
    lonely = model.lonely.weight
    copies = copy.deepcopy(model)
    assert arena.pack_weights(model) > 0
    assert model.embed.weight.data_ptr() == model.head.weight.data_ptr() != shared.data_ptr()
    assert model.a.t.data_ptr() == model.b.t.data_ptr() != common.data_ptr()
    assert model.lonely.weight is lonely
    for name, t in tensors_of(copies).items():
        assert torch.equal(tensors_of(model)[name], t), name


def test_steps_after_the_move_equal_the_per_op_path():
    """The decode steps' one native call on the moved weights against the per-op path (test_decode_fused's check)."""
    model = tiny_dense("qwen3", "int4")
    arena.pack_weights(model)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    fused, plain, _, _, row_argmax = steps_both_ways(model, prompts, torch.float32, steps=3)
    assert row_argmax == {True} and torch.equal(fused.argmax(-1), plain.argmax(-1))
    tol = logits_rtol(3, max(model.config["hidden_size"], model.config["intermediate_size"], 48))
    assert (fused - plain).abs().max().item() <= tol * plain.abs().max().item()
