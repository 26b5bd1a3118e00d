"""Reading a checkpoint file so that a damaged one is refused with one clear error.

``torch.load`` on a truncated, garbled or foreign file fails with whatever its reader
trips over first, and a bit flipped inside a tensor's storage loads without complaint.
:func:`read_checkpoint` checks the file first (:func:`verify_archive`: each zip record
against the CRC-32 torch writes but never checks) and turns every such failure into a
:class:`CorruptCheckpointError`. What is refused and what loads unchecked:
docs/failure-semantics.md ("A damaged file", "A flipped bit inside a storage").
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["CorruptCheckpointError", "read_checkpoint", "verify_archive"]

#: How a file in torch's legacy (pre-1.6, non-zip) format begins: the pickled magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
_ZIP_MAGIC = b"PK\x03\x04"  # also the signature of every record's local header
_LOCAL_HEADER_SIZE = 30
#: What a ``RuntimeError`` of ``torch.load`` says when it comes from reading the archive.
_READER_ERROR_MARKERS = ("PytorchStreamReader", "zip archive", "miniz", "corrupt", "unexpected EOF")
#: Bytes mapped and checksummed at once: large enough to run at memory speed, small
#: enough that checking a checkpoint of any size keeps little of it resident.
_CHUNK = 64 << 20


class CorruptCheckpointError(ValueError):
    """A file that is not a complete checkpoint: truncated, damaged, empty or foreign.

    The message is "not a (complete) checkpoint: <path>: <what is wrong>"; ``path`` and
    ``reason`` hold the two parts (``rank``: the rank that wrote a host-state shard).
    """

    def __init__(self, path: str | Path, reason: str, rank: int | None = None) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        self.rank = rank
        where = self.path if rank is None else f"{self.path} (the host-state shard of rank {rank})"
        super().__init__(f"not a (complete) checkpoint: {where}: {reason}")


def _local_data_offset(f: BinaryIO, info: zipfile.ZipInfo) -> int:
    """Where record ``info``'s bytes begin: after its local header (30 bytes, then the
    name and an extra field -- torch pads the latter to align storages -- whose lengths
    sit at bytes 26 and 28 of the header, per the zip specification)."""
    start = info.header_offset
    f.seek(start)
    header = f.read(_LOCAL_HEADER_SIZE)
    if len(header) != _LOCAL_HEADER_SIZE or header[:4] != _ZIP_MAGIC:
        raise ValueError(f"record {info.filename!r} has no local header at byte {start}")
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    return start + _LOCAL_HEADER_SIZE + name_len + extra_len


def _crc32(f: BinaryIO, begin: int, end: int) -> int:
    """CRC-32 of bytes ``[begin, end)`` of ``f``, mapped one window at a time: no copy,
    and at most one window of the file resident in this process at once."""
    crc = 0
    for window_start in range(begin, end, _CHUNK):
        window_end = min(end, window_start + _CHUNK)
        offset = window_start - window_start % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(
            f.fileno(), window_end - offset, access=mmap.ACCESS_READ, offset=offset
        ) as mm:
            with memoryview(mm) as view:
                crc = zlib.crc32(view[window_start - offset :], crc)
    return crc


def verify_archive(path: str | Path) -> int:
    """Check every record of the ``torch.save`` zip archive at ``path`` against its
    CRC-32 (CRC field 0: skipped). Returns the number of records checked.

    Raises:
        CorruptCheckpointError: a record's bytes do not match its checksum, lie past the
            end of the file, or the archive's directory is unreadable.
    """
    target = os.fspath(path)
    try:
        with zipfile.ZipFile(target) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CorruptCheckpointError(target, f"its zip directory is unreadable ({exc})") from None
    size = os.path.getsize(target)
    checked = 0
    with open(target, "rb") as f:
        for info in infos:
            if info.CRC == 0 or info.file_size == 0:
                continue  # written without checksums (compute_crc32=False), or empty
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpointError(
                    target,
                    f"record {info.filename!r} is compressed; torch.save writes uncompressed "
                    "records (was the archive re-zipped?)",
                )
            try:
                begin = _local_data_offset(f, info)
            except ValueError as exc:
                raise CorruptCheckpointError(target, str(exc)) from None
            end = begin + info.file_size
            if end > size:
                raise CorruptCheckpointError(
                    target,
                    f"record {info.filename!r} ends at byte {end}, past the end of the "
                    f"{size}-byte file (truncated)",
                )
            crc = _crc32(f, begin, end)
            if crc != info.CRC:
                raise CorruptCheckpointError(
                    target,
                    f"record {info.filename!r} ({info.file_size} bytes) fails its CRC-32 check "
                    f"(stored {info.CRC:08x}, computed {crc:08x}): the file was damaged after it "
                    "was written; restore it from a copy or resume from another checkpoint",
                )
            checked += 1
    return checked


def _first_line(exc: BaseException) -> str:
    """The exception in one line, without torch's advice to retry with
    ``weights_only=False`` (unsafe, and no help for a damaged file)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    unpickler = [ln for ln in lines if ln.startswith("WeightsUnpickler error:")]
    safe = unpickler or [ln for ln in lines if "weights_only" not in ln]
    return f"{type(exc).__name__}: {safe[0]}" if safe else type(exc).__name__


def read_checkpoint(
    path: str | Path,
    map_location: Any = None,
    weights_only: bool = True,
    mmap: bool = True,
    verify: bool = True,
) -> Any:
    """``torch.load`` a checkpoint file, refusing a damaged one with a clear error.

    Args:
        path: a local file.
        map_location / weights_only: as for ``torch.load``.
        mmap: memory-map a zip-format file (legacy-format files are read normally).
        verify: check every tensor storage's CRC-32 first (:func:`verify_archive`).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        CorruptCheckpointError: an empty, truncated, damaged or foreign file.
        pickle.UnpicklingError: a complete file holding objects ``weights_only`` loading
            refuses (torch's own error: pass ``weights_only=False`` for a trusted file).
    """
    target = os.fspath(path)
    if not os.path.exists(target):
        raise FileNotFoundError(f"Checkpoint file not found: {target}")
    size = os.path.getsize(target)
    if size == 0:
        raise CorruptCheckpointError(target, "the file is empty (0 bytes)")
    with open(target, "rb") as f:
        head = f.read(len(_LEGACY_MAGIC))
    is_zip = zipfile.is_zipfile(target)
    if is_zip and verify:
        verify_archive(target)
    if not is_zip:
        if head.startswith(_ZIP_MAGIC):
            raise CorruptCheckpointError(
                target,
                f"a zip archive without its directory (which ends a complete file): "
                f"truncated at {size} bytes",
            )
        if not head.startswith(_LEGACY_MAGIC):
            raise CorruptCheckpointError(
                target,
                f"neither a torch.save zip archive nor a legacy torch file (it begins with {head[:8]!r})",
            )
    try:
        return torch.load(
            target, map_location=map_location, weights_only=weights_only, mmap=mmap and is_zip
        )
    except (
        EOFError,
        IndexError,
        KeyError,
        OSError,
        struct.error,
        UnicodeDecodeError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        RuntimeError,
    ) as exc:
        if isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in str(exc):
            raise  # refusing a type in a complete file: trust, not damage (torch says what to do)
        if isinstance(exc, RuntimeError) and not any(k in str(exc) for k in _READER_ERROR_MARKERS):
            raise  # not the file's fault (map_location names a missing device, ...)
        raise CorruptCheckpointError(
            target, f"torch.load could not read it ({_first_line(exc)})"
        ) from None
