"""Shard files as a sequence of safetensors segments: byte-sized shards, one commit per write.

    shards/shard-W-S.safetensors = segment @ 0 | segment @ b1 | segment @ b2 | ...
    segment = one whole safetensors file's bytes: u64 header length n, n bytes of JSON
              header, then the tensors (aux, final, input_ids, loss_mask[, scales]) of one
              write's samples, concatenated along T

A writer appends one segment per write to its current shard file and commits the write's
index part (store/writer.py); it starts a new file once the current one has reached
`storage.shard_bytes`. An index row names its shard, the segment's byte offset
(`shard_offset`) and its token rows in the segment (`offset`, `num_tokens`). A shard written
by a store of one write per shard is a single segment at byte 0: the same file as before.

Bytes past the end of the last committed segment belong to a write that never reached its
commit (a kill between append and commit): they are never read, `store verify` reports them
as an interrupted write, and the next exclusive writer truncates them (`sweep_interrupted`).

Reads are `pread`s of exactly the bytes asked for (a sample's rows of each tensor), so a
file that grows while it is open reads fine and nothing is mapped.
"""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from eagle_ray.store.format import StoreDamagedError

# safetensors dtype names -> (torch dtype name, bytes per element)
_DTYPES = {"BF16": ("bfloat16", 2), "F16": ("float16", 2), "F32": ("float32", 4),
           "F64": ("float64", 8), "F8_E4M3": ("float8_e4m3fn", 1), "I8": ("int8", 1),
           "U8": ("uint8", 1), "I16": ("int16", 2), "I32": ("int32", 4), "I64": ("int64", 8),
           "BOOL": ("bool", 1)}
MAX_HEADER = 100_000_000  # the safetensors limit; a larger length is damage, not a header
HEAD_READ = 4096  # bytes read at a segment's start: its length field and (usually) header


@dataclass(frozen=True)
class TensorInfo:
    dtype: str            # safetensors name
    shape: tuple[int, ...]
    start: int            # absolute byte offset in the file
    end: int

    @property
    def row_bytes(self) -> int:
        n = _DTYPES[self.dtype][1]
        for d in self.shape[1:]:
            n *= d
        return n


@dataclass(frozen=True, eq=False)
class Header:
    """A segment header, parsed: tensor byte ranges relative to the segment's data (the
    bytes after the header). Segments of equal headers share one (`read_header`)."""

    length: int                     # the header's JSON bytes
    tensors: dict[str, TensorInfo]  # start/end relative to the data
    metadata: dict
    data_bytes: int                 # where the last tensor ends, relative to the data


_HEADERS: dict[bytes, Header] = {}  # header bytes -> parsed (writes of one size share one)
_HEADERS_MAX = 4096


def _parse_header(raw: bytes, path: Path, offset: int) -> Header:
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreDamagedError(f"{path}: segment header at byte {offset} is not JSON ({e})") from None
    try:
        metadata = header.pop("__metadata__", {}) or {}
        tensors: dict[str, TensorInfo] = {}
        end = 0
        for k, v in header.items():
            a, b = v["data_offsets"]
            info = TensorInfo(v["dtype"], tuple(v["shape"]), a, b)
            n_el = 1
            for d in info.shape:
                n_el *= d
            if info.dtype not in _DTYPES or b - a != n_el * _DTYPES[info.dtype][1]:
                raise ValueError(f"tensor {k}: {info.dtype} {list(info.shape)} does not fit "
                                 f"{b - a} bytes")
            tensors[k] = info
            end = max(end, b)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StoreDamagedError(f"{path}: segment at byte {offset} has a bad header ({e})") from None
    return Header(len(raw), tensors, metadata, end)


def read_header(fd: int, path: Path, offset: int, file_size: int) -> tuple[Header, int]:
    """The header of the segment at `offset` and where its data starts (absolute); one
    pread, one parse per distinct header. Damage (a length past the file, not JSON, a
    tensor that does not fit its bytes, data past the file's end) raises StoreDamagedError."""
    head = os.pread(fd, HEAD_READ, offset)  # one read holds a typical header whole
    if len(head) < 8:
        raise StoreDamagedError(f"{path}: no segment header at byte {offset} (file has "
                                f"{file_size} bytes)")
    (n,) = struct.unpack_from("<Q", head)
    if n > MAX_HEADER or offset + 8 + n > file_size:
        raise StoreDamagedError(f"{path}: segment at byte {offset} has a header length of {n} "
                                f"bytes, past the file's {file_size} bytes")
    raw = head[8:8 + n] if 8 + n <= len(head) else os.pread(fd, n, offset + 8)
    hdr = _HEADERS.get(raw)
    if hdr is None:
        hdr = _parse_header(raw, path, offset)
        if len(_HEADERS) >= _HEADERS_MAX:
            _HEADERS.clear()
        _HEADERS[raw] = hdr
    data = offset + 8 + n
    if data + hdr.data_bytes > file_size:
        raise StoreDamagedError(f"{path}: segment at byte {offset} ends at byte "
                                f"{data + hdr.data_bytes}, past the file's {file_size} bytes "
                                "(truncated)")
    return hdr, data


class Segment:
    """One write's tensors inside a shard file."""

    def __init__(self, fd: int, path: Path, offset: int, file_size: int):
        self.path, self.offset = path, offset
        hdr, data = read_header(fd, path, offset, file_size)
        self.metadata = hdr.metadata
        self.tensors: dict[str, TensorInfo] = {
            k: TensorInfo(t.dtype, t.shape, data + t.start, data + t.end) for k, t in hdr.tensors.items()}
        self.end = data + hdr.data_bytes
        self._fd = fd

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].shape

    def rows(self, key: str, a: int, b: int):
        """Rows [a, b) of a tensor (a new torch tensor in the stored dtype)."""
        import torch

        t = self.tensors[key]
        a, b = max(0, a), min(b, t.shape[0])
        rb = t.row_bytes
        buf = bytearray(os.pread(self._fd, (b - a) * rb, t.start + a * rb)) if b > a else bytearray()
        if len(buf) != max(0, b - a) * rb:
            raise StoreDamagedError(f"{self.path}: short read of {key} rows [{a}, {b})")
        flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, _DTYPES[t.dtype][0])).reshape(max(0, b - a), *t.shape[1:])


class ShardFiles:
    """Open shard files (an LRU of descriptors) and their parsed segments."""

    def __init__(self, shards_dir: Path, max_open: int = 64):
        self.dir = Path(shards_dir)
        self._open: OrderedDict[str, tuple[int, dict[int, Segment]]] = OrderedDict()
        self._max_open = max_open

    def _file(self, name: str) -> tuple[int, dict[int, Segment]]:
        f = self._open.get(name)
        if f is not None:
            self._open.move_to_end(name)
            return f
        path = self.dir / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise StoreDamagedError(f"shard {path} referenced by the index is missing") from None
        f = self._open[name] = (fd, {})
        if len(self._open) > self._max_open:
            os.close(self._open.popitem(last=False)[1][0])
        return f

    def segment(self, name: str, offset: int = 0) -> Segment:
        fd, segments = self._file(name)
        seg = segments.get(int(offset))
        if seg is None:
            seg = segments[int(offset)] = Segment(fd, self.dir / name, int(offset),
                                                  os.fstat(fd).st_size)
        return seg

    def close(self) -> None:
        for fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
