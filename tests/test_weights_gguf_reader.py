"""GGUF metadata read in bulk (weights/gguf_reader.py) against gguf-py's own GGUFReader on the same files: every
field's types and contents equal (the tokenizer gets the same lists of tokens, scores, types and merges), arrays of
every scalar type and of strings, little- and big-endian; a string array cut short is refused in one line."""

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFEndian, GGUFValueType

from deltaserve.weights import CheckpointError
from deltaserve.weights.gguf import READ_AHEAD_BYTES, open_gguf
from deltaserve.weights.gguf_reader import PlainViewReader
from test_weights_gguf import smollm2_gguf

DATA = Path(__file__).parent / "data" / "gguf"
SCALAR_ARRAYS = {GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
                 GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
                 GGUFValueType.FLOAT32: np.float32, GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64,
                 GGUFValueType.FLOAT64: np.float64}


def assert_fields_equal(path: Path) -> None:
    ours, theirs = PlainViewReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, expected in theirs.fields.items():
        got = ours.fields[key]
        assert got.types == expected.types, key
        value, want = got.contents(), expected.contents()
        assert type(value) is type(want) and value == want, key
        if isinstance(want, list) and want:
            assert [type(v) for v in value] == [type(v) for v in want], key
            assert got.contents(-1) == expected.contents(-1), key
            assert got.contents(slice(1, 4)) == expected.contents(slice(1, 4)), key
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors]


@pytest.mark.parametrize("path", [smollm2_gguf(), *sorted(DATA.glob("*.gguf"))], ids=lambda p: p.name)
def test_fields_equal_gguf_py(path):
    assert_fields_equal(path)


def write_arrays(path: Path, endian: GGUFEndian) -> Path:
    """A GGUF of metadata only: an array of every scalar type, strings (empty, multi-byte, with a NUL), bools."""
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    for kind, dtype in SCALAR_ARRAYS.items():
        values = rng.integers(-100, 100, 7) if np.issubdtype(dtype, np.signedinteger) else rng.integers(0, 200, 7)
        values = (values * 1.37 if np.issubdtype(dtype, np.floating) else values).astype(dtype).tolist()
        writer.add_key_value(f"test.{kind.name.lower()}", values, GGUFValueType.ARRAY, sub_type=kind)
    writer.add_key_value("test.strings", ["", "a", "\u00e9t\u00e9", "\u4e2d\u6587 \U0001f600", "x\x00y", "Ġthe"],
                         GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    writer.add_key_value("test.bools", [True, False, True], GGUFValueType.ARRAY, sub_type=GGUFValueType.BOOL)
    writer.add_string("test.after", "the field after the arrays")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
def test_arrays_of_every_type_equal_gguf_py(tmp_path, endian):
    assert_fields_equal(write_arrays(tmp_path / "arrays.gguf", endian))


def test_string_array_cut_short_is_refused(tmp_path):
    path = write_arrays(tmp_path / "arrays.gguf", GGUFEndian.LITTLE)
    data = path.read_bytes()
    cut = data.index("\u4e2d".encode()) + 2  # inside the fourth string
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:cut])
    with pytest.raises(CheckpointError) as info:
        open_gguf(short)
    message = str(info.value)
    assert "\n" not in message and "truncated or corrupt" in message and "string 3 of an array of 6" in message


@pytest.mark.parametrize("ahead", [1 << 12, READ_AHEAD_BYTES])
def test_read_ahead_asks_for_every_tensor_before_it_is_read(monkeypatch, ahead):
    """load_gguf's read-ahead (MADV_WILLNEED in large calls): when a tensor is made, the file has been asked for
    through its last byte and, short of the file's end, at least half the read-ahead beyond; each call is large
    unless it reaches the end."""
    import deltaserve.weights.gguf as loader

    monkeypatch.setattr(loader, "READ_AHEAD_BYTES", ahead)
    path = DATA / "tiny-qwen35-q4_k.gguf"
    reader = PlainViewReader(path)
    size = path.stat().st_size
    asked = 0
    for tensor in reader.tensors:
        before = asked
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        asked = loader._read_ahead(reader, asked, end + ahead)
        assert asked >= min(end + ahead // 2, size), tensor.name
        assert asked == before or asked - before >= ahead // 2 or asked == size, tensor.name
