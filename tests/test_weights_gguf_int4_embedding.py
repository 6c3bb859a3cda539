"""An untied 4-bit GGUF token_embd (Q4_K, IQ4_XS: the field's 27B holds 5,120 x 248,320 of them, ~5 GB as floats)
held packed (models/layers.Int4Embedding): a lookup widens only the rows it reads, and the ledger prices the table
as held.

The fixtures are llama-quantize's own files of the tiny Qwen3.5 hybrid (tests/data/gguf, untied: output.weight and
token_embd both of the file's type); the oracle is gguf-py's `dequantize` of the same bytes. A tied variant (the
output matrix dropped by gguf-py's writer) keeps its embedding as floats, as before.
"""

from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from deltaserve.engine.loader import load_model
from deltaserve.kernels.int4 import PackedTable
from deltaserve.models.layers import Int4Embedding
from deltaserve.weights.gguf import load_gguf
from test_weights_compressed_tensors import resident_bytes
from test_weights_gguf_kquant8 import rewrite

DATA = Path(__file__).parent / "data" / "gguf"
TYPES = {"q4_k": Q.Q4_K, "iq4_xs": Q.IQ4_XS}


@pytest.fixture(scope="module", params=list(TYPES))
def path(request):
    return DATA / f"tiny-qwen35-{request.param}.gguf"


def stored_table(path: Path) -> torch.Tensor:
    """gguf-py's dequantization of the file's token_embd [vocab, hidden]."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0])))


def test_looked_up_rows_equal_gguf_py_dequantization(path):
    """Any ids (repeated, the first and last row, a [batch, seq] shape) widen to gguf-py's rows bit for bit: the
    products are the ones it computes in float32."""
    _, tensors, _, _, _ = load_gguf(path, torch.float32, (), keep_int4=True)
    table = tensors["model.embed_tokens.weight"]
    assert isinstance(table, PackedTable)
    expected = stored_table(path)
    vocab = expected.shape[0]
    ids = torch.tensor([[0, vocab - 1, 7, 7], [vocab // 2, 1, vocab - 2, 0]])
    got = Int4Embedding(table)(ids)
    assert got.shape == (2, 4, expected.shape[1])
    assert torch.equal(got, expected[ids])


def test_loaded_model_holds_the_table_packed_at_the_ledgers_price(path):
    """The model keeps the embedding as an Int4Embedding, and the ledger's embedding group equals its bytes exactly
    (half a byte a weight, a float32 scale (and Q4_K's offset) per 32, IQ4_XS's 16 levels)."""
    from deltaserve.budget import spec_from_checkpoint

    model = load_model(path, dequantize=False).model
    embedding = model.model.embed_tokens
    assert type(embedding) is Int4Embedding
    group = next(g for g in spec_from_checkpoint(path).weight_groups if g.name == "embedding")
    assert group.float_params == 0 and group.quantized_bytes == resident_bytes(embedding)
    assert group.quantized_bytes < group.params  # under a byte a weight: not widened anywhere


def test_a_tied_embedding_stays_float(tmp_path):
    """Tied (no output matrix), the 4-bit table is held as floats, shared with the vocabulary projection: the loader
    and the ledger both say so."""
    from deltaserve.budget import spec_from_checkpoint

    tied = rewrite(tmp_path / "tied.gguf", {}, drop=("output.weight",))
    model = load_model(tied, dequantize=False).model
    assert type(model.model.embed_tokens) is nn.Embedding
    group = next(g for g in spec_from_checkpoint(tied).weight_groups if g.name == "embedding")
    assert group.float_params == group.params
