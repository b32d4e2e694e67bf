"""The SSD tier's I/O: reading a file into MLX arrays in checksummed chunks, staging
and views, reads ahead of a load on worker threads, the page cache, the disk's read
bandwidth, host copies for the writer, and the directory and inode helpers
(docs/DESIGN.md §8.4). Moves bytes only; the staging arrays and the writer's copies are
made on the engine thread (docs/DESIGN.md §2).

Every buffer made here is at most :data:`PIECE_BYTES`, whatever the entry's size: MLX
refuses arrays over 2^31 bytes, and one copy of a 32K-token session of an 8B model is
4.8 GB. A file is staged in pieces of that size (:func:`staging`), and the writer's copy
of an entry is a list of pieces (:func:`copy_pieces`), an array over the bound split along
its outer axes (a K/V slice ``(1, n_kv_heads, T, head_dim)`` by heads, then by tokens),
so the bytes on disk are those of the whole tensors in row order either way.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ...files import private_dirs
from .format import DTYPES, HCRC_AT, MAX_HEADER, CorruptEntry, Layout, parse_header

CHUNK = 1 << 20  # bytes read (and checksummed while in cache) at a time


def _piece_bytes() -> int:
    # test hook for subprocesses (tests/system/test_ssd_sessions.py); in-process tests set
    # PIECE_BYTES itself
    value = os.environ.get("TIERCHAT_TEST_SSD_PIECE_BYTES", "")
    return max(1, int(value)) if value.isdigit() else 256 << 20


# the largest MLX array the SSD tier makes to read or write a file (bytes): well under the
# 2^31 bytes MLX takes in one array
PIECE_BYTES = _piece_bytes()


class ReadBandwidth(NamedTuple):
    """One sequential read of a set of files (:func:`measure_read_bandwidth`): ``nbytes``
    in ``seconds``; ``gbps`` is ``nbytes / seconds / 1e9``; ``dropped`` says whether their
    page cache was dropped first (else the figure may be the page cache's, not the disk's).
    """

    files: int
    nbytes: int
    seconds: float
    gbps: float
    dropped: bool


def _open_regular(path: Path):
    """Open ``path`` for reading without following a link or blocking on a FIFO.

    Raises CorruptEntry unless it is a regular file; OSError as the system raises it.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptEntry("not a regular file")
    return open(fd, "rb", buffering=0), st  # noqa: SIM115 (closed by the caller)


def _fill(f, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CorruptEntry("file shrank while read")
        got += n


def _read_head(f, size: int) -> bytes:
    if size < HCRC_AT + 8:
        raise CorruptEntry("short file")
    first = bytearray(8)
    _fill(f, memoryview(first))
    (n,) = struct.unpack("<Q", first)
    if n > MAX_HEADER or 8 + n > size:
        raise CorruptEntry("bad header length")
    head = bytearray(8 + n)
    head[:8] = first
    _fill(f, memoryview(head)[8:])
    return bytes(head)


def _spans(pieces: list[memoryview], begin: int, end: int, most: int):
    """Views of ``pieces`` (one buffer cut in consecutive pieces) covering the buffer's
    bytes ``[begin, end)`` in order, each at most ``most`` bytes and inside one piece."""
    at, base = begin, 0
    for piece in pieces:
        top = base + len(piece)
        while base <= at < min(top, end):
            n = min(most, min(top, end) - at)
            yield piece[at - base : at - base + n]
            at += n
        base = top


def read_file(
    path: Path, keep: bool = True, into: list[memoryview] | None = None
) -> tuple[Layout, bytearray | list[memoryview] | None, int]:
    """Read and verify a whole entry file: ``(layout, file bytes or None, inode)``.

    Reads in :data:`CHUNK` pieces, checksumming each while it is in cache, into ``into``
    when given (the memory of the :func:`staging` arrays of the file's size, as indexed,
    filled in order; plain file I/O, no MLX call, so a reader thread may do it), else into
    a new ``bytearray``. With ``keep=False`` only verifies (one reused buffer).

    Raises:
        CorruptEntry: not a regular file, not the size of ``into``, or any check of
            :func:`parse_header` or the data CRC fails.
        OSError: the file cannot be opened or read.
    """
    f, st = _open_regular(path)
    with f:
        if into is not None and st.st_size != sum(len(v) for v in into):
            raise CorruptEntry("file size changed since indexed")
        if hasattr(os, "posix_fadvise"):  # the kernel reads ahead while we check
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        head = _read_head(f, st.st_size)
        layout = parse_header(head, st.st_size)
        n = st.st_size - len(head)
        if keep:
            buf = into if into is not None else bytearray(st.st_size)
            pieces = buf if into is not None else [memoryview(buf)]
            at = 0
            for view in _spans(pieces, 0, len(head), len(head)):
                view[:] = head[at : at + len(view)]
                at += len(view)
            views = _spans(pieces, len(head), st.st_size, CHUNK)
        else:
            buf, scratch = None, memoryview(bytearray(min(CHUNK, max(n, 1))))
            views = (scratch[: min(CHUNK, n - o)] for o in range(0, n, CHUNK))
        crc = 0
        for view in views:
            _fill(f, view)
            crc = zlib.crc32(view, crc)
    if crc != layout.dcrc:
        raise CorruptEntry("data checksum mismatch")
    return layout, buf, st.st_ino


def staging(size: int) -> list[mx.array]:
    """New evaluated ``uint8`` arrays of ``size`` bytes in all, in pieces of
    :data:`PIECE_BYTES` (the last one shorter), in host-written memory, for
    :func:`read_file` to read into (engine thread). Made on the CPU stream: on CUDA, MLX
    gives an array made without a GPU stream managed memory, here first touched by MLX's
    CPU thread while the GIL is free, so readers write into resident pages and no copy
    follows."""
    step = PIECE_BYTES
    stages = [
        mx.zeros((min(step, size - at),), dtype=mx.uint8, stream=mx.cpu)
        for at in range(0, max(size, 1), step)
    ]
    mx.eval(stages)
    return stages


def loads_by_path() -> bool:
    """Whether the SSD tier loads a verified file with ``mx.load(path)`` (CUDA) rather than
    viewing the staging arrays it was read into (CPU, Metal).

    On CUDA, memory an array gets without a GPU stream is managed memory: the copy of a
    staged file into the restored cache's GPU buffers migrates it page by page on the
    GPU's faults. ``mx.load`` reads a file into host memory and copies it to device memory
    with one ``cudaMemcpyAsync`` a tensor (MLX ``backend/cuda/load.cpp``): on an H200,
    3.3-4.2 GB/s of 37.7 MB files in the page cache against 1.9-2.4 GB/s staged
    (docs/BENCHMARKS.md). On the CPU and Metal the staging arrays are the tensors' memory
    (no copy), so they stay."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.gpu and cuda is not None and cuda.is_available()


def load_verified(path: Path, layout: Layout, ino: int, nbytes: int) -> dict[str, mx.array]:
    """The tensors of ``path``, verified by :func:`read_file` (``keep=False``) as
    ``layout`` in inode ``ino`` of ``nbytes`` bytes, read again by ``mx.load`` (from the
    page cache the verifying read filled) into new evaluated arrays. Engine thread only.

    The bytes are checked once, by the verifying read; the load reads the same inode,
    which the SSD tier never changes in place (a file is written beside and renamed), and
    the file is compared after the load with what was verified (inode, size, not a link).
    Every tensor must be under MLX's 2^31-byte array bound (the caller checks
    :func:`fits_one_load`).

    Raises:
        CorruptEntry: the file is no longer the one verified, or its tensors are not
            ``layout``'s.
        OSError, RuntimeError: as ``os.stat`` or ``mx.load`` raise them.
    """
    arrays = mx.load(str(path), format="safetensors")
    mx.eval(list(arrays.values()))
    st = os.stat(path, follow_symlinks=False)
    if st.st_ino != ino or not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
        raise CorruptEntry("file changed since verified")
    if set(arrays) != {name for name, *_ in layout.tensors}:
        raise CorruptEntry("tensors changed since verified")
    for name, dtype, shape, _, _ in layout.tensors:
        a = arrays[name]
        if a.dtype != DTYPES[dtype][0] or tuple(a.shape) != tuple(shape):
            raise CorruptEntry(f"tensor {name} changed since verified")
    return arrays


def fits_one_load(layout: Layout) -> bool:
    """Whether every tensor of ``layout`` is at most :data:`PIECE_BYTES` (one array
    ``mx.load`` can make); else the file is read into staging pieces."""
    return all(end - begin <= PIECE_BYTES for *_, begin, end in layout.tensors)


def views_of(stages: list[mx.array]) -> list[memoryview]:
    """The memory of :func:`staging` arrays, for :func:`read_file` (engine thread)."""
    return [memoryview(s).cast("B") for s in stages]


def arrays_in(layout: Layout, stages: list[mx.array]) -> dict[str, mx.array]:
    """The tensors of a verified file read into ``stages`` (:func:`staging`,
    :func:`read_file`), as views of them (no copy); a tensor that straddles two pieces is
    one concatenate of its parts, and one whose offset is not a multiple of its item size
    is copied out. Evaluated. Engine thread only."""
    step = stages[0].size  # every piece but the last; one piece: the whole file
    arrays = {}
    for name, dtype, shape, begin, end in layout.tensors:
        mxd, npd = DTYPES[dtype]
        lo, hi = layout.data_start + begin, layout.data_start + end
        k = lo // step
        if hi == lo:
            arrays[name] = mx.zeros(shape, dtype=mxd)
        elif (hi - 1) // step != k:  # across pieces: its parts, joined
            parts = [
                stages[i][max(lo - i * step, 0) : min(hi - i * step, step)]
                for i in range(k, (hi - 1) // step + 1)
            ]
            arrays[name] = mx.concatenate(parts).view(mxd).reshape(shape)
        elif lo % mxd.size == 0:
            arrays[name] = stages[k][lo - k * step : hi - k * step].view(mxd).reshape(shape)
        else:
            piece = memoryview(stages[k]).cast("B")[lo - k * step : hi - k * step]
            bits = np.frombuffer(piece, npd).reshape(shape)
            arrays[name] = mx.array(bits).view(mxd) if dtype == "BF16" else mx.array(bits)
    mx.eval(list(arrays.values()))
    return arrays


class ReadAhead:
    """Files read and verified ahead of their load on ``workers`` threads (plain file I/O
    and CRC-32, which release the GIL; no MLX), each straight into a :func:`staging`
    array made by the caller (the engine thread), or only verified (CUDA: the load reads
    the file again, :func:`load_verified`), keyed by entry id."""

    def __init__(self, workers: int = 4) -> None:
        self._reads: dict[str, tuple[list[mx.array] | None, Future]] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierchat-ssd-read")

    def __contains__(self, key: str) -> bool:
        return key in self._reads

    def start(self, key: str, path: Path, nbytes: int, verify_only: bool = False) -> None:
        """Stage ``nbytes`` and start reading ``path`` (the whole file) into them; with
        ``verify_only``, start reading and checking it only (no staging: its load reads it
        again, :func:`load_verified`)."""
        if verify_only:
            self._reads[key] = (None, self._pool.submit(read_file, path, keep=False))
            return
        stages = staging(nbytes)
        self._reads[key] = (stages, self._pool.submit(read_file, path, into=views_of(stages)))

    def take(self, key: str) -> tuple[list[mx.array] | None, Future] | None:
        """The staging arrays (None for a read that only verifies) and the read's future
        (:func:`read_file`'s result, or its error when the future is asked), or None when
        ``key`` was not read ahead."""
        return self._reads.pop(key, None)

    def drop(self) -> None:
        """Forget the reads no load took (those not started yet are cancelled)."""
        reads, self._reads = self._reads, {}
        for _, read in reads.values():
            read.cancel()

    def close(self) -> None:
        self.drop()
        self._pool.shutdown(wait=True)


def advise_willneed(paths) -> None:
    """Ask the kernel to start reading these files now (``POSIX_FADV_WILLNEED``,
    asynchronous; a no-op where unsupported). A file that cannot be opened is skipped:
    its load will find out and count it."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            f, _ = _open_regular(path)
            with f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        except (OSError, CorruptEntry):
            pass


def drop_page_cache(paths) -> int:
    """Ask the kernel to forget cached pages of ``paths`` (``fsync``, then
    ``posix_fadvise(POSIX_FADV_DONTNEED)``), so the next read comes from the disk.

    Returns how many files it was done for: 0 where ``posix_fadvise`` does not exist
    (macOS). DONTNEED is advice: Linux drops clean pages not mapped elsewhere.
    """
    if not hasattr(os, "posix_fadvise"):
        return 0
    done = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return done


def measure_read_bandwidth(
    paths, drop_cache: bool = True, buffer_bytes: int = 8 << 20
) -> ReadBandwidth:
    """Sequential read bandwidth of ``paths``, read whole one after another in
    ``buffer_bytes`` pieces into one reused buffer: the disk's speed as the SSD tier sees
    it when ``drop_cache`` empties the page cache first. The yardstick for SSD restores
    (docs/DESIGN.md §8.5). The page cache is left holding the files afterwards."""
    paths = list(paths)
    dropped = drop_cache and bool(paths) and drop_page_cache(paths) == len(paths)
    buf = memoryview(bytearray(buffer_bytes))
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    dt = max(time.perf_counter() - t0, 1e-9)
    return ReadBandwidth(len(paths), total, dt, total / dt / 1e9, dropped)


def _raw_bytes(a) -> np.ndarray:
    """The bytes of an evaluated, row-contiguous MLX array (any dtype, bf16 included) as
    uint8, through the buffer protocol: no MLX graph is built (writer thread)."""
    try:
        return np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8)
    except (TypeError, ValueError, BufferError):  # not contiguous: numpy copies it
        return np.ascontiguousarray(np.asarray(a)).view(np.uint8).reshape(-1)


def _split(a: mx.array, most: int):
    """Parts of ``a`` whose bytes, one after the other, are ``a``'s in row order, each at
    most ``most`` bytes where a row of its last axis allows: runs of whole rows of the
    outermost axis, an axis at a time inwards (K/V ``(1, n_kv_heads, T, head_dim)``: the
    heads, then runs of tokens of one head)."""
    if a.nbytes <= most or a.ndim <= 1:
        yield a
        return
    row = a.nbytes // a.shape[0]
    if row > most:
        for i in range(a.shape[0]):
            yield from _split(a[i], most)
        return
    n = max(1, most // row)
    for i in range(0, a.shape[0], n):
        yield a[i : i + n]


def copy_pieces(arrays: list[mx.array], most: int | None = None) -> list[mx.array]:
    """New flat ``uint8`` arrays of ``arrays``' bytes, one after the other, each in row
    order (bf16 bits included), each at most ``most`` bytes (default
    :data:`PIECE_BYTES`): small arrays share a piece, one over the bound is split
    (:func:`_split`). Lazy: one concatenate per piece. Never a view of an input: the SSD
    writer reads them from the host, and on CUDA MLX moves a buffer the host reads to
    managed memory for good (``allocator::Buffer::raw_ptr``), where later GPU reads of it
    fault pages back. The hot tier's arrays so stay in device memory."""
    most = PIECE_BYTES if most is None else most
    groups: list[list[mx.array]] = [[]]
    size = 0
    for a in arrays:
        for part in _split(a, most):
            if size + part.nbytes > most and groups[-1]:
                groups.append([])
                size = 0
            groups[-1].append(part.reshape(-1).view(mx.uint8))
            size += part.nbytes
    # concatenate returns a lone input as it is: an empty last one makes it copy
    empty = mx.zeros((0,), dtype=mx.uint8)
    return [mx.concatenate([*g, empty]) for g in groups if g]


def _inode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


def _real_dir(path: Path) -> None:
    """Make ``path`` a real 0700 directory: a symbolic link there is removed, never
    followed."""
    if path.is_symlink():
        path.unlink()
    path.mkdir(exist_ok=True, mode=0o700)


def writable_dir(path: Path) -> None:
    """Make ``path`` (the tier's entry folder) a 0700 directory and prove it writable with
    a probe file. Raises OSError: ``ELOOP`` when it is a symbolic link, or whatever making
    it or the probe raised."""
    if path.is_symlink():
        raise OSError(errno.ELOOP, "is a symbolic link")
    private_dirs(path)
    probe = path / f".probe.{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
