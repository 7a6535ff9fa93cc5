"""A JSON array of records, streamed: ShareGPT's usual file form (one array, often hundreds
of MB, sometimes cut off mid-record), read chunk by chunk, never loaded whole.

`ArrayReader(f, update, max_record_bytes)` yields, in file order,

    Record(obj, raw, offset)        each complete record: the parsed value, its UTF-8
                                    bytes, the byte offset where it starts
    Tail(code, message, head, size, offset)
                                    at most one, last: what cannot be read as records
                                    (a cut-off or invalid record, data after the array,
                                    bad UTF-8); the rest of the file is consumed (hashed)
                                    and counted, never parsed

and `update` sees every byte of the file once (the source's sha256); `size` is the bytes
read once it is exhausted. A trailing comma before ']' is tolerated (no record is lost).
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator

CHUNK = 1 << 20
WS = " \t\r\n"


@dataclass
class Record:
    obj: Any
    raw: bytes
    offset: int


@dataclass
class Tail:
    code: str
    message: str
    head: bytes
    size: int
    offset: int


class ArrayReader:
    def __init__(self, f, update: Callable[[bytes], Any] = lambda b: None,
                 max_record_bytes: int = 64 << 20, chunk: int = CHUNK):
        self.f, self.update, self.chunk, self.max_record_bytes = f, update, chunk, max_record_bytes
        self.decode = codecs.getincrementaldecoder("utf-8")().decode
        self.buf, self.i, self.at = "", 0, 0  # text not consumed, position in it, its byte offset
        self.size, self.eof, self.undecoded, self.started = 0, False, 0, False

    def __iter__(self) -> Iterator[Record | Tail]:
        return _walk(self, json.JSONDecoder().raw_decode, self.max_record_bytes)

    def more(self) -> bool:
        """Read the next chunk into the buffer (False at the end of the file)."""
        data = self.f.read(self.chunk)
        if not data:
            self.eof = True
            return False
        self.update(data)
        self.size += len(data)
        try:
            text = self.decode(data)
        except UnicodeDecodeError:
            self.undecoded = len(data)
            raise
        if not self.started and text[:1] == "\ufeff":
            text = text[1:]
            self.at += 3  # a BOM; `at` otherwise moves as text is consumed
        self.started = self.started or bool(text)
        self.buf, self.i = self.buf[self.i:] + text, 0
        return True

    def next_char(self) -> str | None:
        """The next non-whitespace character (not consumed), None at the end of the file."""
        while True:
            buf, i = self.buf, self.i
            while i < len(buf) and buf[i] in WS:
                i += 1
            self.at += i - self.i  # whitespace is ASCII: one byte a character
            self.i = i
            if i < len(buf):
                return buf[i]
            if not self.more():
                return None

    def tail(self, code: str, message: str) -> Tail:
        rest = self.buf[self.i:].encode("utf-8", errors="replace")
        total = len(rest) + self.undecoded
        while data := self.f.read(self.chunk):
            self.update(data)
            self.size += len(data)
            total += len(data)
        return Tail(code, message, rest[:4096], total, self.at)


def _walk(r: ArrayReader, scan, max_record_bytes: int) -> Iterator[Record | Tail]:
    try:
        c = r.next_char()
        if c != "[":
            yield r.tail("invalid_json", f"byte {r.at:,}: a JSON array source starts with '['")
            return
        r.i += 1
        r.at += 1
        n, first = 0, True
        while True:
            c = r.next_char()
            if c is None:
                yield r.tail("invalid_json", f"the JSON array ends early at byte {r.at:,} "
                                             f"(after record {n:,}, no closing ']')")
                return
            if c == "]" and first or c in ",]" and not first:
                r.i += 1
                r.at += 1
                if c == "]":
                    break
                first = True  # a value must follow
                continue
            if not first:
                yield r.tail("invalid_json", f"byte {r.at:,}: expected ',' or ']' after record {n:,}")
                return
            try:
                obj, end = scan(r.buf, r.i)
            except (ValueError, RecursionError) as e:
                if len(r.buf) - r.i <= max_record_bytes and r.more():
                    continue  # the record is cut by the chunk: read on
                what = "cut off (the file ends inside it)" if r.eof else "not valid JSON"
                why = ("JSON nested too deeply" if isinstance(e, RecursionError) else
                       getattr(e, "msg", str(e))[:200])  # positions in the buffer mean nothing
                yield r.tail("invalid_json", f"record {n + 1:,} at byte {r.at:,} is {what}: {why}")
                return
            raw = r.buf[r.i:end].encode("utf-8")
            n += 1
            yield Record(obj, raw, r.at)
            r.i, r.at, first = end, r.at + len(raw), False
        if r.next_char() is not None:
            yield r.tail("trailing_data", f"byte {r.at:,}: data after the end of the JSON array")
    except UnicodeDecodeError as e:
        yield r.tail("invalid_utf8", f"invalid UTF-8 after byte {r.at:,} ({e.reason}); the rest is not read")
