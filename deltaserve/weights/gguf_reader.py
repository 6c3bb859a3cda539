"""gguf-py's GGUFReader with its metadata arrays read in bulk.

gguf-py parses an array field element by element, a numpy view and a ReaderField part per element: a 248,320-token
vocabulary with its merges and types is ~800,000 parts and took ~7 s of a 2B model's load. Here an array of scalars
is one typed view of the mapped bytes, and an array of strings one pass over them (each length read, each string
decoded once); `contents()` gives the same lists gguf-py's does. Nested arrays keep gguf-py's own parsing.
"""

import sys
from typing import Any, NamedTuple

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField


class ArrayField(ReaderField):
    """A metadata array read whole: parts[-1] holds its scalars (one typed array) or its strings (an object array,
    decoded at parse); `contents()` as gguf-py's ReaderField.contents."""

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        values = self.parts[-1]
        if isinstance(index_or_slice, int):
            value = values[index_or_slice]
            return value if self.types[-1] == GGUFValueType.STRING else value.item()
        return values[index_or_slice].tolist()


class _Parsed(NamedTuple):
    size: int  # bytes the field's value takes in the file
    parts: list
    data: list[int]
    types: list[GGUFValueType]


class PlainViewReader(GGUFReader):
    """GGUFReader slicing a plain ndarray view of its memmap (np.memmap's per-slice hooks made parsing a vocabulary
    three times slower), its metadata arrays read in bulk (module docstring)."""

    def _plain_bytes(self) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        array = self._plain_bytes()[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_fields(self, offs: int, count: int) -> int:
        """The key/value fields from `offs` on (gguf-py's loop, arrays of scalars and strings read in bulk)."""
        for _ in range(count):
            start = offs
            key_length, key = self._get_str(offs)
            offs += int(key_length.nbytes + key.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            parsed = self._bulk_array(offs) if raw_type[0] == GGUFValueType.ARRAY else None
            if parsed is None:
                parsed = _Parsed(*self._get_field_parts(offs, raw_type[0]))
                kind = ReaderField
            else:
                kind = ArrayField
            head = [key_length, key, raw_type]
            self._push_field(kind(start, str(bytes(key), encoding="utf-8"), head + list(parsed.parts),
                                  [i + len(head) for i in parsed.data], parsed.types), skip_sum=True)
            offs += parsed.size
        return offs

    def _bulk_array(self, offs: int) -> _Parsed | None:
        """The array at `offs` as one part (scalars: a typed view; strings: decoded), None for an array of arrays."""
        item_type = self._get(offs, np.uint32)
        length = self._get(offs + 4, np.uint64)
        gtype = GGUFValueType(int(item_type[0]))
        start, count = offs + 12, int(length[0])
        if gtype == GGUFValueType.STRING:
            values, end = self._strings(start, count)
        elif gtype in self.gguf_scalar_to_np:
            values = self._get(start, self.gguf_scalar_to_np[gtype], count)
            end = start + int(values.nbytes)
        else:
            return None
        return _Parsed(end - offs, [item_type, length, values], [2], [GGUFValueType.ARRAY, gtype])

    def _strings(self, offs: int, count: int) -> tuple[np.ndarray, int]:
        """`count` GGUF strings (a uint64 length, then UTF-8 bytes) from `offs`: (an object array of str, end)."""
        data = memoryview(self._plain_bytes())
        order = sys.byteorder if self.byte_order == "I" else ("big" if sys.byteorder == "little" else "little")
        values = np.empty(count, dtype=object)
        size = len(data)
        for i in range(count):
            length = int.from_bytes(data[offs:offs + 8], order)
            offs += 8
            if offs + length > size:
                raise ValueError(f"string {i} of an array of {count} runs past the end of the file "
                                 f"({length} bytes at byte {offs}, the file has {size})")
            values[i] = str(data[offs:offs + length], "utf-8")
            offs += length
        return values, offs
