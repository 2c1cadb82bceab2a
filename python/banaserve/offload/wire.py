"""One offload message in a byte buffer: a msgpack header, then raw tensors.

Layout: ``u32`` header length, the header (a msgpack map, with ``"t"``: each tensor's dtype
name and shape), then each tensor's bytes at a 64-byte aligned offset. Tensors are CPU,
contiguous, of the dtypes in :data:`DTYPES`. Decoding views the buffer (no copy): the views
are valid only as long as the buffer holds this message.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64}  # fmt: skip
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_LEN = struct.Struct("<I")
ALIGN = 64


class WireError(ValueError):
    """A message that does not decode, or does not fit its buffer."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def encoded_size(header: dict[str, Any], tensors: Sequence[torch.Tensor]) -> int:
    """Bytes :func:`encode` needs for this message (an upper bound within one alignment)."""
    meta = msgpack.packb({**header, "t": [[0, list(t.shape)] for t in tensors]})
    return _aligned(_LEN.size + len(meta) + 32) + sum(
        _aligned(t.numel() * t.element_size()) for t in tensors
    )


def encode(buffer: memoryview, header: dict[str, Any], tensors: Sequence[torch.Tensor]) -> int:
    """Write the message into ``buffer``; the bytes used. :class:`WireError` if it does not
    fit or a tensor is not a CPU tensor of a known dtype."""
    specs = []
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in _NAMES:
            raise WireError(f"cannot send a {t.dtype} tensor on {t.device}")
        specs.append([_NAMES[t.dtype], list(t.shape)])
    meta = msgpack.packb({**header, "t": specs})
    offset = _aligned(_LEN.size + len(meta))
    end = offset + sum(_aligned(t.numel() * t.element_size()) for t in tensors)
    if end > len(buffer):
        raise WireError(f"a message of {end} bytes does not fit a {len(buffer)}-byte buffer")
    _LEN.pack_into(buffer, 0, len(meta))
    buffer[_LEN.size : _LEN.size + len(meta)] = meta
    for t in tensors:
        n = t.numel() * t.element_size()
        dest = torch.frombuffer(buffer, dtype=t.dtype, count=t.numel(), offset=offset)
        dest.copy_(t.contiguous().reshape(-1))
        offset += _aligned(n)
    return end


def decode(buffer: memoryview) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``(header, tensors)`` of the message at the start of ``buffer``; the tensors view it."""
    try:
        (size,) = _LEN.unpack_from(buffer, 0)
        header = msgpack.unpackb(buffer[_LEN.size : _LEN.size + size])
        specs = header.pop("t")
        offset = _aligned(_LEN.size + size)
        tensors = []
        for name, shape in specs:
            dtype = DTYPES[name]
            count = 1
            for d in shape:
                count *= d
            item = torch.empty((), dtype=dtype).element_size()
            if offset + count * item > len(buffer):
                raise WireError("a tensor runs past the end of the buffer")
            view = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset) if count \
                else torch.empty(0, dtype=dtype)  # fmt: skip
            tensors.append(view.reshape(shape))
            offset += _aligned(count * item)
    except (struct.error, ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"not an offload message: {exc}") from exc
    return header, tensors
