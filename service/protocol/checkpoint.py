"""A checkpoint directory's files and its content digest, as every engine reports it.

``update_weights`` names a Hugging Face directory of ``*.safetensors``. Every engine confirms
the digest of what it read, and the coordinator acknowledges only when they all agree, so a
volume mounted differently on one pod is caught. A trainer can compute the same digest over
the directory it wrote (:func:`checkpoint_digest`) and compare it with the ``Ack``.

The digest is XXH3-128 over each ``*.safetensors`` file in name order (its name, its size in
bytes, then its bytes): a fingerprint of the bytes, fast enough to be a small part of an
update (it reads the files from the page cache the load just filled), not a signature.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path

import xxhash

from service.protocol.errors import ErrorCode, WireError

DIGEST_PREFIX = "xxh3-128:"
DIGEST_CHUNK = 64 * 1024 * 1024  # bytes hashed between two progress reports


def checkpoint_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint directory, in name order; WireError 400 when
    it is not a readable directory or holds none."""
    directory = Path(path)
    if not directory.is_dir():
        raise WireError(ErrorCode.MALFORMED, f"checkpoint {path} is not a directory this engine can read")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WireError(ErrorCode.MALFORMED, f"checkpoint {path} has no *.safetensors files")
    return files


def checkpoint_digest(files: list[Path], on_bytes: Callable[[int], None] | None = None) -> str:
    """``xxh3-128:<hex>`` over the files as described above; ``on_bytes`` hears each chunk of
    :data:`DIGEST_CHUNK` bytes read (progress)."""
    digest = xxhash.xxh3_128()
    for path in files:
        with path.open("rb") as handle:
            size = path.stat().st_size
            digest.update(path.name.encode())
            digest.update(struct.pack("<Q", size))
            if size:
                with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
                    for start in range(0, size, DIGEST_CHUNK):
                        chunk = view[start : start + DIGEST_CHUNK]
                        digest.update(chunk)
                        chunk.release()
                        if on_bytes is not None:
                            on_bytes(min(DIGEST_CHUNK, size - start))
    return DIGEST_PREFIX + digest.hexdigest()
