"""Reading jsonl corpora (plain, .gz, .zst, .bz2, .xz): open by content, iterate lines, pull the text out of each line.

One place decides what a bad line is, so ``preprocess`` and ``train-tokenizer`` report it the same way.

Compressed files are decompressed member by member (gzip members, zstd frames, bz2 and xz streams) up to the raw
file's true end, and a file that ends inside a member is an error: the stock readers (``zstandard``'s
stream_reader in particular) return what they have at EOF, so a download cut at a block boundary would otherwise
become a corpus holding only the first part of the documents.
"""

from __future__ import annotations

import bz2
import io
import json
import lzma
import zlib
from pathlib import Path
from typing import BinaryIO, Iterator

from llmjp_ds.errors import UserError, fail

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BZ2_MAGIC = b"BZh"
XZ_MAGIC = b"\xfd7zXZ\x00"
ZIP_MAGIC = b"PK\x03\x04"
UTF8_BOM = b"\xef\xbb\xbf"

# codec -> (magic, file name suffixes)
CODECS = {
    "gzip": (GZIP_MAGIC, (".gz", ".gzip")),
    "zstd": (ZSTD_MAGIC, (".zst", ".zstd")),
    "bzip2": (BZ2_MAGIC, (".bz2",)),
    "xz": (XZ_MAGIC, (".xz",)),
}
SUPPORTED = "jsonl, .jsonl.gz, .jsonl.zst, .jsonl.bz2 or .jsonl.xz"
_RAW_CHUNK = 1 << 16


class BadLine(Exception):
    """A line that is not a json object with a string under the text key. ``kind`` groups the skip counts."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _Truncated(Exception):
    pass


class _Corrupt(Exception):
    pass


class _ReadError(Exception):
    def __init__(self, exc: OSError):
        super().__init__(exc.strerror or str(exc))


def _new_decompressor(codec: str):
    if codec == "gzip":
        return zlib.decompressobj(wbits=16 + 15)  # gzip wrapper: the trailer's CRC-32 and size are checked
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj()
    if codec == "bzip2":
        return bz2.BZ2Decompressor()

    return lzma.LZMADecompressor(format=lzma.FORMAT_XZ)


class _MemberReader(io.RawIOBase):
    """The decompressed bytes of ``raw``, one member after another, to the raw file's end.

    Each decompressor says when its member is complete (``eof``) and hands back what follows (``unused_data``),
    which starts the next member. End of the raw file inside a member raises ``_Truncated``; data a decompressor
    rejects raises ``_Corrupt``. Zero bytes between or after members are padding (gzip and xz allow it).
    """

    def __init__(self, raw: BinaryIO, codec: str):
        self.raw, self.codec = raw, codec
        self._dec = None  # None between members
        self._pending = b""  # raw bytes not yet given to a decompressor
        self._out = b""
        self._pos = 0
        self._done = False
        self._padding = codec in ("gzip", "xz")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while len(self._out) == self._pos and not self._done:
            self._step()
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def _step(self) -> None:
        data, self._pending = self._pending, b""
        if not data:
            try:
                data = self.raw.read(_RAW_CHUNK)
            except OSError as exc:
                raise _ReadError(exc) from None
        if not data:
            if self._dec is not None:
                raise _Truncated()
            self._done = True
            return
        if self._dec is None:
            if self._padding:
                data = data.lstrip(b"\x00")
                if not data:
                    return
            self._dec = _new_decompressor(self.codec)
        try:
            out = self._dec.decompress(data)
        except Exception as exc:  # zlib.error, OSError, lzma.LZMAError, zstandard.ZstdError: no common base
            raise _Corrupt(str(exc) or type(exc).__name__) from None
        self._out, self._pos = out, 0
        if self._dec.eof:
            self._pending = self._dec.unused_data
            self._dec = None


def _codec_of(path: Path, head: bytes) -> str | None:
    """The codec of a file by its first bytes; a one-line error where name and content disagree or are unknown."""
    for codec, (magic, _) in CODECS.items():
        if head.startswith(magic):
            return codec
    if head.startswith(ZIP_MAGIC):
        fail(f"{path} is a zip archive, which preprocess does not read: extract it, or re-compress the jsonl "
             f"with gzip or zstd")
    named = next((c for c, (_, suffixes) in CODECS.items() if path.name.lower().endswith(suffixes)), None)
    if named is not None:
        magic = CODECS[named][0]
        if len(head) < len(magic) and magic.startswith(head):
            fail(f"{path} ends before its compressed stream does (truncated: {len(head)} bytes, not even a {named} "
                 f"header; an interrupted download or copy?): re-fetch it")
        fail(f"{path} is named as {named} but does not start with a {named} header (it starts {head[:8]!r}): the "
             f"file is corrupt or mis-named; re-fetch it, or rename it to what it holds")
    return None


def open_binary(path: Path) -> tuple[BinaryIO, BinaryIO, str | None]:
    """(decompressed stream, raw file, codec or None) for ``path``; the raw file's position measures progress."""
    try:
        raw = open(path, "rb")
        head = raw.read(8)
        raw.seek(0)
    except OSError as exc:
        fail(f"cannot read input {path} ({exc.strerror}): check its permissions and the disk, or copy it "
             f"somewhere readable")
    try:
        codec = _codec_of(path, head)
    except BaseException:
        raw.close()
        raise
    if codec is None:
        return raw, raw, None
    return io.BufferedReader(_MemberReader(raw, codec), buffer_size=1 << 20), raw, codec


def iter_lines(path: Path) -> Iterator[tuple[int, bytes, int]]:
    """(1-based line number, line bytes, compressed bytes read so far) for every line of a jsonl file.

    A UTF-8 byte-order mark at the start of the file is dropped (Windows tools write one; it is not text)."""
    stream, raw, codec = open_binary(path)
    try:
        lineno = 0
        while True:
            try:
                line = stream.readline()
            except (_Truncated, _Corrupt, _ReadError, OSError) as exc:
                _stream_fail(path, codec, exc, f" after line {lineno}", raw)
            if not line:
                return
            lineno += 1
            if lineno == 1 and line.startswith(UTF8_BOM):
                line = line[len(UTF8_BOM):]
            yield lineno, line, raw.tell()
    finally:
        stream.close()
        raw.close()


VERIFY_BYTES = 1 << 30


def stream_error(path: Path, limit: int = VERIFY_BYTES) -> str | None:
    """The one-line message of a compressed ``path`` that is truncated or corrupt within its first ``limit`` raw
    bytes, else None. Corrupt data decompresses to garbage before a check fails (gzip's CRC sits at the end of the
    member), so a line that looks bad in a compressed file is first blamed on the stream if the stream is bad."""
    stream, raw, codec = open_binary(path)
    try:
        if codec is None:
            return None
        while raw.tell() < limit:
            try:
                if not stream.read(1 << 20):
                    return None
            except (_Truncated, _Corrupt, _ReadError, OSError) as exc:
                try:
                    _stream_fail(path, codec, exc, "", raw)
                except UserError as err:
                    return str(err)
        return None
    finally:
        stream.close()
        raw.close()


def _stream_fail(path: Path, codec: str | None, exc: Exception, after: str, raw) -> None:
    """One line for a stream that cannot be read on; ``after`` is like `` after line 12`` or empty."""
    if isinstance(exc, _Truncated):
        fail(f"{path} ends before its compressed stream does (truncated{after}: an interrupted download or copy?): "
             f"re-fetch it")
    if isinstance(exc, _Corrupt):
        where = f"{after.strip()}, " if after else ""
        fail(f"{path}: the {codec} data is corrupt ({where}near byte {raw.tell():,} of the file: {exc}): re-fetch "
             f"it, or re-compress it from the source")
    why = exc.strerror if isinstance(exc, OSError) else exc
    fail(f"cannot read {path}{after} ({why}): check the disk, or copy the file again")


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def text_of_line(line: bytes, text_key: str) -> str | None:
    """The document text of one jsonl line; ``None`` for a blank line; ``BadLine`` for anything else."""
    line = line.rstrip(b"\r\n")
    if not line.strip():
        return None
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine("invalid UTF-8", f"invalid UTF-8 at byte {exc.start}; re-encode the file as UTF-8") from None
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as exc:
        raise BadLine("invalid JSON", f"invalid JSON ({exc.msg}, column {exc.colno}); fix or remove the line") \
            from None
    except RecursionError:
        raise BadLine("invalid JSON", "invalid JSON (nested too deeply to parse); fix or remove the line") from None
    if not isinstance(record, dict):
        raise BadLine("not an object", f"line is a JSON {_JSON_TYPES.get(type(record), 'value')}, not an object "
                                       f"with a {text_key!r} key; write one object per line")
    if text_key not in record:
        keys = ", ".join(list(map(str, record))[:6]) or "none"
        raise BadLine(f"no {text_key!r} key", f"no {text_key!r} key (keys: {keys}); pick the key with --text-key")
    text = record[text_key]
    if not isinstance(text, str):
        raise BadLine(f"non-string {text_key!r}", f"{text_key!r} is a JSON {_JSON_TYPES.get(type(text), 'value')}, "
                                                   f"not a string; store the document text as one string")
    # the bytes were valid UTF-8, so only a \u escape can spell a lone surrogate (half a UTF-16 pair), which
    # is not text: no tokenizer can encode it
    if b"\\u" in line:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadLine("lone surrogate", f"{text_key!r} holds a lone surrogate escape \\u{ord(text[exc.start]):04x} "
                                            f"at character {exc.start} (half of a UTF-16 pair, not text); fix the "
                                            f"writer of the file or remove the line") from None
    return text
