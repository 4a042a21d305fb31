"""A checkpoint's manifest: each file's size and a fast checksum (xxh3-64), so a resume can tell an intact tag
from one a crash, a full disk or a lost write left short.

The rank that writes a file hashes the bytes as they go out (:func:`save_hashed`, DeepSpeed's writer here) and
fsyncs it, so a marker never outlives the data it describes; rank 0 hashes whatever DeepSpeed wrote another way.
:func:`verify` reads the files back; its callers split a tag's files over the ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import xxhash

CHUNK = 16 << 20


class _HashingFile:
    """A write-only file that hashes what passes through (torch.save writes through ``write``)."""

    def __init__(self, f):
        self.f, self.hash, self.size = f, xxhash.xxh3_64(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.size += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def save_hashed(obj, path) -> dict:
    """``torch.save(obj, path)``, fsynced; returns ``{"size", "xxh3"}`` of the bytes written."""
    with open(path, "wb") as f:
        out = _HashingFile(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return {"size": out.size, "xxh3": out.hash.hexdigest()}


def digest(path) -> dict:
    """``{"size", "xxh3"}`` of the file at ``path``."""
    h, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "xxh3": h.hexdigest()}


def tag_files(tag_dir, exclude: tuple[str, ...] = ()) -> list[str]:
    """Every regular file under ``tag_dir`` (relative POSIX paths, sorted), but ``exclude``."""
    tag_dir = Path(tag_dir)
    return sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")
                  if p.is_file() and p.relative_to(tag_dir).as_posix() not in exclude)


def check_sizes(tag_dir, files: dict) -> str | None:
    """Why the files of ``tag_dir`` cannot be those the manifest ``files`` lists (missing, a link, another size),
    without reading them; None if their sizes match."""
    tag_dir = Path(tag_dir)
    for name, meta in files.items():
        path = tag_dir / name
        if path.is_symlink():
            return f"{name} is a symbolic link"
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != meta["size"]:
            return f"{name} is {size} bytes, the manifest says {meta['size']}"
    return None


def verify(tag_dir, files: dict, names) -> str | None:
    """Why one of ``names`` (a share of the manifest ``files``) does not match it; None if all do."""
    tag_dir = Path(tag_dir)
    share = {n: files[n] for n in names}
    reason = check_sizes(tag_dir, share)
    if reason:
        return reason
    for name, meta in share.items():
        if digest(tag_dir / name)["xxh3"] != meta["xxh3"]:
            return f"{name} does not match its checksum"
    return None
