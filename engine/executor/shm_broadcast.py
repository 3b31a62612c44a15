"""``MessageQueue``: a shared-memory ring buffer with one writer and many readers.

Mirrors vLLM's ``vllm/distributed/device_communicators/shm_broadcast.py``. The
``MultiprocExecutor`` broadcasts every ``SchedulerOutput`` (and every ``collective_rpc``
call) to all its workers through one of these, and each worker answers on its own queue
with a single reader (the engine core). Payloads are bytes: serialization is the caller's.

How it differs from vLLM's, on purpose:

- The ring lives in a file in the engine's run directory (mode 0700), mmap'd by every
  party, not in a named ``/dev/shm`` segment: removing the run directory removes it, and it
  never outlives the process tree. (Put the run directory on tmpfs, e.g.
  ``$XDG_RUNTIME_DIR``, so the kernel never writes the pages back to a disk.)
- Idle waits block on a named FIFO that the other side pokes, instead of spinning with
  ``sched_yield``: workers idle while the model forward needs the CPU cores.
- A message larger than one chunk streams through consecutive chunks (no ZMQ overflow
  socket), so the ring may even be smaller than the message.
- Every wait has a deadline (``GLASSBOX_MQ_TIMEOUT_S``, default 300 s) and its timeout
  names who was awaited ("Worker_DP0_PP0_TP1 (in stage worker.execute_model for 12.3 s)").

Left out: readers on another node (vLLM's TCP ``XPUB``), and the ``wait_until_ready``
handshake (a reader can open its end before or after the writer has published).
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import re
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine import envs
from tracing.waits import WaitCancelled, WaitTimeout, wait_for

_MAGIC = int.from_bytes(b"GBXMQv01", "little")
_WORD = 8  # bytes per metadata word (native unsigned 64-bit)
_PAGE = 4096

# Header words.
_H_MAGIC, _H_N_READERS, _H_MAX_CHUNKS, _H_CHUNK_BYTES, _H_CLOSED, _H_WRITER_WAITING = range(6)
_HEADER_WORDS = 8  # one 64-byte cache line
# Per-slot metadata words; then one read sequence number per reader.
_M_WRITTEN, _M_NBYTES, _M_MSG_LEN, _M_READ = range(4)

_SPIN_CHECKS = 16  # checks before blocking: a few µs, catches a chunk that is just landing
_CANCEL_SLICE_S = 0.05  # with a cancel event, a blocked reader looks at it this often
_WRITER_SLICE_S = 0.01  # a blocked writer re-checks this often (see "Waking up" below)
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,16}")


class MessageQueueTimeout(WaitTimeout):
    """A queue wait passed its deadline. ``waiting_for`` holds the names of the parties
    awaited (the lagging readers, or the writer); the message also carries what
    ``describe_reader`` / ``describe_writer`` said about them."""

    def __init__(self, what: str, timeout_s: float, waiting_for: tuple[str, ...]) -> None:
        super().__init__(what, timeout_s)
        self.waiting_for = waiting_for


class MessageQueueClosed(Exception):
    """The writer closed the queue and every message it published has been read."""


_fence_lock = threading.Lock()


def _fence() -> None:
    """Keep the loads and stores before this call ahead of those after it (see the protocol).

    Pure Python has no fence instruction; taking and releasing a lock runs atomic
    instructions with acquire and release ordering, the strongest ordering it can ask for.
    On x86-64 it is not needed at all (see ``MessageQueue``), and costs ~0.1 µs.
    """
    with _fence_lock:
        pass


@dataclass(frozen=True)
class MessageQueueHandle:
    """Everything a process needs to open one end of a queue; small and picklable.

    ``max_chunk_bytes`` and ``max_chunks`` are the ring's shape (bytes per chunk, chunks);
    ``reader_names[i]`` and ``writer_name`` are used in timeout messages.
    """

    dir_path: str
    name: str
    n_readers: int
    max_chunk_bytes: int
    max_chunks: int
    reader_names: tuple[str, ...]
    writer_name: str

    @property
    def buffer_path(self) -> str:
        return os.path.join(self.dir_path, f"{self.name}.mq")

    @property
    def writer_wakeup_path(self) -> str:
        return os.path.join(self.dir_path, f"{self.name}.w")

    def reader_wakeup_path(self, rank: int) -> str:
        return os.path.join(self.dir_path, f"{self.name}.r{rank}")

    def all_paths(self) -> list[str]:
        readers = [self.reader_wakeup_path(i) for i in range(self.n_readers)]
        return [self.buffer_path, self.writer_wakeup_path, *readers]


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class _Layout:
    """Word and byte offsets inside the buffer file."""

    n_readers: int
    max_chunks: int
    max_chunk_bytes: int

    @property
    def slot_words(self) -> int:
        # Rounded up to a 64-byte cache line so two slots never share one.
        return _round_up(_M_READ + self.n_readers, 8)

    @property
    def data_offset(self) -> int:  # bytes; page-aligned
        return _round_up((_HEADER_WORDS + self.max_chunks * self.slot_words) * _WORD, _PAGE)

    @property
    def file_size(self) -> int:  # bytes
        return self.data_offset + self.max_chunks * self.max_chunk_bytes

    def slot_word(self, slot: int) -> int:
        """Index (in words) of slot ``slot``'s first metadata word."""
        return _HEADER_WORDS + slot * self.slot_words


class MessageQueue:
    """One end (the writer, or reader ``rank``) of a one-writer, many-reader ring buffer.

    **File layout** (``<dir>/<name>.mq``; every metadata word is a native unsigned 64-bit
    integer, 8-byte aligned, so each store and load of one is a single instruction)::

        header    8 words: magic, n_readers, max_chunks, max_chunk_bytes,
                           closed (writer sets 1 on close), writer_waiting (0/1), 2 spare
        slots     max_chunks records of round_up(3 + n_readers, 8) words:
                    written_seq   sequence number of the chunk in this slot (0: never used)
                    nbytes        payload bytes in this chunk (<= max_chunk_bytes)
                    msg_len       length in bytes of the whole message the chunk belongs to
                    read_seq[i]   per reader i: the last sequence number it read from here
        data      page-aligned; max_chunks chunks of max_chunk_bytes

    Chunks are numbered 1, 2, 3, … for the life of the queue; chunk ``n`` goes to slot
    ``(n - 1) % max_chunks``. A sequence number instead of vLLM's boolean flags makes
    wrap-around unambiguous: a slot holding chunk ``n`` can never be mistaken for one
    holding chunk ``n - max_chunks``, and nobody has to clear flags. Each word has exactly
    one party that stores to it (``read_seq[i]`` reader ``i``; all others the writer), so
    no lock is needed.

    **Writing chunk n** (the writer only):

    1. wait until the slot is free: ``read_seq[i] == written_seq`` for every reader (all
       have read the old chunk ``n - max_chunks``), or ``written_seq == 0``;
    2. copy the payload, store ``nbytes`` and ``msg_len``;
    3. store ``written_seq = n`` **last**: this publishes the chunk;
    4. poke each reader's wake-up FIFO.

    **Reading chunk n** (reader ``i``):

    1. wait until ``written_seq == n`` (it cannot have moved past ``n``: the writer needs
       this reader's ``read_seq`` before it reuses the slot);
    2. copy ``nbytes`` bytes of payload out;
    3. store ``read_seq[i] = n`` **after** the copy: this hands the slot back; poke the
       writer's FIFO if ``writer_waiting`` is set.

    A message of ``msg_len`` bytes takes ``max(1, ceil(msg_len / max_chunk_bytes))``
    consecutive chunks; the reader gathers chunks until it has ``msg_len`` bytes. The writer
    reuses slots as soon as the readers release them, so a message may be larger than the
    whole ring. A reader whose wait times out mid-message keeps the part it has and goes on
    with it at its next ``dequeue``. A *writer* that times out mid-message cannot take the
    half-sent message back: it closes the queue (readers get ``MessageQueueClosed``).

    **Why plain stores are enough.** Python's writes to an mmap are ordinary stores and its
    reads ordinary loads, with no atomics. The protocol needs four orderings: the payload
    stores before the ``written_seq`` store (writer); the ``written_seq`` load before the
    payload loads (reader); the payload loads before the ``read_seq`` store (reader); the
    ``read_seq`` loads before the payload stores that reuse the slot (writer). x86-64 (TSO)
    keeps stores in program order, loads in program order and loads ahead of later stores:
    all four hold as written. ARM64 may reorder all of them, so ``_fence()`` sits at each of
    those four points (a lock acquire/release: the closest thing to a fence pure Python has).
    Torn values cannot occur: every word is aligned and stored whole.

    **Waking up.** A waiting party first re-checks a few times (a few µs), then blocks in
    ``poll`` on its own FIFO (``<name>.r<i>`` for reader ``i``, ``<name>.w`` for the
    writer), so an idle queue costs no CPU. It empties the FIFO *before* each re-check, so a
    poke sent after the re-check is still in the FIFO when it polls: no lost wake-up. The
    writer pokes every reader after every chunk (and on ``close``, after setting
    ``closed``). Readers poke the writer only when ``writer_waiting`` is set; that flag and
    ``read_seq`` are a store-then-load pair on each side, which even x86-64 may reorder, so a
    poke can be missed — the writer therefore also re-checks every 10 ms while it waits.
    Every party opens the FIFOs read-write and non-blocking (Linux), so an open never blocks,
    a poke to a FIFO nobody reads yet is not an error, and a full FIFO (already poked) is
    ignored.

    **Deadlines.** Each wait raises ``MessageQueueTimeout`` (a ``TimeoutError``) naming the
    lagging readers or the writer; ``timeout=None`` means ``GLASSBOX_MQ_TIMEOUT_S``. A
    caller that must wait indefinitely loops over bounded waits and checks the other side's
    liveness in between.
    """

    def __init__(
        self,
        handle: MessageQueueHandle,
        rank: int | None,
        describe_peer: Callable[[int], str] | None,
    ) -> None:
        # Use open_writer / open_reader.
        self.handle = handle
        self.rank = rank  # None: the writer
        self._describe_peer = describe_peer
        self._layout = layout = _Layout(handle.n_readers, handle.max_chunks, handle.max_chunk_bytes)
        # Offsets computed once: the hot path only indexes this list. Per slot: (its first
        # metadata word, in words; its chunk's first byte, in bytes).
        self._slots = [
            (layout.slot_word(s), layout.data_offset + s * handle.max_chunk_bytes)
            for s in range(handle.max_chunks)
        ]
        fd = os.open(handle.buffer_path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, self._layout.file_size)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        self._view = memoryview(self._mm)
        self._words = self._view[: self._layout.data_offset].cast("Q")
        if self._words[_H_MAGIC] != _MAGIC or list(self._words[_H_N_READERS : _H_CHUNK_BYTES + 1]) != [
            handle.n_readers,
            handle.max_chunks,
            handle.max_chunk_bytes,
        ]:
            self._release_mapping()
            raise ValueError(f"{handle.buffer_path} does not match its handle (not a queue of this shape)")
        flags = os.O_RDWR | os.O_NONBLOCK
        own_path = handle.writer_wakeup_path if rank is None else handle.reader_wakeup_path(rank)
        peer_paths = (
            [handle.reader_wakeup_path(i) for i in range(handle.n_readers)]
            if rank is None
            else [handle.writer_wakeup_path]
        )
        opened: list[int] = []
        try:
            for path in [own_path, *peer_paths]:
                opened.append(os.open(path, flags))
        except BaseException:
            for fd in opened:
                os.close(fd)
            self._release_mapping()
            raise
        self._wakeup_fd, self._peer_fds = opened[0], opened[1:]
        # Go on from where this end left off (1 for a fresh queue): the writer after the
        # newest chunk written, a reader after the newest chunk it read.
        seq_word = _M_WRITTEN if rank is None else _M_READ + rank
        self._next_seq = max(self._words[base + seq_word] for base, _ in self._slots) + 1
        self._poller = select.poll()
        self._poller.register(self._wakeup_fd, select.POLLIN)
        self._parts: list[bytes] = []  # reader: chunks of a message gathered so far
        self._closed = False
        # A reader's waits are named once (tracing.wait_for's events); who is awaited and
        # what it is doing are looked up only when a wait passes its deadline.
        self._awaited = (
            None
            if rank is None
            else f"{handle.writer_name} to publish on shared-memory queue {handle.name!r} "
            f"(reader {handle.reader_names[rank]})"
        )

    # ---- opening and closing ----

    @staticmethod
    def create(
        dir_path: str | os.PathLike,
        name: str,
        n_readers: int,
        *,
        max_chunk_bytes: int = 1 << 20,
        max_chunks: int = 8,
        reader_names: list[str] | None = None,
        writer_name: str = "writer",
    ) -> MessageQueueHandle:
        """Create the buffer file ``<dir>/<name>.mq`` and the wake-up FIFOs ``<name>.w``,
        ``<name>.r0`` … (all mode 0600) and return the handle every party opens.

        ``name`` is short (at most 16 of ``[A-Za-z0-9_-]``) because the run directory's
        path is long already. The file takes ``max_chunks * max_chunk_bytes`` bytes plus a
        page or two of metadata. ``reader_names`` defaults to ``reader0``, ``reader1``, ….

        Raises:
            ValueError: a bad name, count, size or reader_names length.
            FileExistsError: a queue of that name already exists in ``dir_path``.
        """
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"queue name {name!r}: expected 1-16 characters of [A-Za-z0-9_-]")
        if n_readers < 1:
            raise ValueError(f"n_readers must be >= 1, got {n_readers}")
        if max_chunk_bytes < 1 or max_chunks < 1:
            raise ValueError(
                f"max_chunk_bytes and max_chunks must be >= 1, got {max_chunk_bytes}, {max_chunks}"
            )
        names = (
            tuple(reader_names) if reader_names is not None else tuple(f"reader{i}" for i in range(n_readers))
        )
        if len(names) != n_readers:
            raise ValueError(f"reader_names has {len(names)} names for {n_readers} readers")
        handle = MessageQueueHandle(
            str(Path(dir_path)), name, n_readers, max_chunk_bytes, max_chunks, names, writer_name
        )
        layout = _Layout(n_readers, max_chunks, max_chunk_bytes)
        fd = os.open(handle.buffer_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, layout.file_size)  # zero-filled: every slot starts unused
            with mmap.mmap(fd, layout.data_offset) as mm:
                header = memoryview(mm)[: _HEADER_WORDS * _WORD].cast("Q")
                header[_H_N_READERS] = n_readers
                header[_H_MAX_CHUNKS] = max_chunks
                header[_H_CHUNK_BYTES] = max_chunk_bytes
                header[_H_MAGIC] = _MAGIC  # last: a half-made file is never taken for a queue
                header.release()
            for path in handle.all_paths()[1:]:
                os.mkfifo(path, 0o600)
        except BaseException:
            _remove(handle.all_paths())
            raise
        finally:
            os.close(fd)
        return handle

    @classmethod
    def open_writer(
        cls, handle: MessageQueueHandle, *, describe_reader: Callable[[int], str] | None = None
    ) -> MessageQueue:
        """Open the writing end. ``describe_reader(rank)`` adds a few words about a lagging
        reader to timeout messages (e.g. its current stage, read from its status file).

        Raises:
            FileNotFoundError: the queue's files are gone (or were never created).
            ValueError: the file does not match the handle.
        """
        return cls(handle, None, describe_reader)

    @classmethod
    def open_reader(
        cls, handle: MessageQueueHandle, rank: int, *, describe_writer: Callable[[int], str] | None = None
    ) -> MessageQueue:
        """Open reader ``rank``'s end (0 <= rank < n_readers). It receives every message
        from the first one on, whenever it opens. ``describe_writer(0)`` works like
        ``open_writer``'s ``describe_reader``.

        Raises:
            ValueError: ``rank`` out of range, or the file does not match the handle.
            FileNotFoundError: the queue's files are gone.
        """
        if not 0 <= rank < handle.n_readers:
            raise ValueError(f"reader rank {rank} out of range for {handle.n_readers} readers")
        return cls(handle, rank, describe_writer)

    def close(self) -> None:
        """Release this end. The writer first marks the queue closed and wakes every
        reader, which then gets ``MessageQueueClosed`` once it has read all that was
        published. Idempotent; the files stay until ``unlink``."""
        if self._closed:
            return
        if self.rank is None:
            self._words[_H_CLOSED] = 1
            self._poke_all()
        self._closed = True
        for fd in (self._wakeup_fd, *self._peer_fds):
            os.close(fd)
        self._release_mapping()

    def unlink(self) -> None:
        """Remove the queue's files (buffer and FIFOs). Ends that are open keep working on
        their mapping. Idempotent."""
        _remove(self.handle.all_paths())

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release_mapping(self) -> None:
        self._words.release()
        self._view.release()
        self._mm.close()

    # ---- the writer ----

    def enqueue(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Publish one message (any length, 0 included) to every reader.

        ``timeout`` (s) bounds the whole call; None means ``GLASSBOX_MQ_TIMEOUT_S``.

        Raises:
            MessageQueueTimeout: a slot stayed unread by some reader(s) until the deadline;
                the message names them. If part of the message had been published, the
                queue is closed (it cannot be taken back).
            MessageQueueClosed: the queue was closed (by ``close`` or a cut-off message).
            RuntimeError: called on a reader's end.
        """
        if self.rank is not None:
            raise RuntimeError("enqueue() called on a reader's end of the queue")
        if self._closed or self._words[_H_CLOSED]:
            raise MessageQueueClosed(f"shared-memory queue {self.handle.name!r} is closed")
        payload = memoryview(data).cast("B")  # (msg_len,) bytes
        msg_len = payload.nbytes
        timeout_s = envs.GLASSBOX_MQ_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout_s
        words = self._words
        # One chunk per turn (an empty message takes one too), numbered on from the last one.
        for seq, start in enumerate(range(0, msg_len or 1, self._layout.max_chunk_bytes), self._next_seq):
            base, offset = self._slots[(seq - 1) % self._layout.max_chunks]
            if not self._slot_free(base):
                self._wait_slot_free(base, seq, deadline, timeout_s, mid_message=start > 0)
            _fence()  # the readers' copies are done before the payload is overwritten
            n = min(self._layout.max_chunk_bytes, msg_len - start)
            self._mm[offset : offset + n] = payload[start : start + n]
            words[base + _M_NBYTES] = n
            words[base + _M_MSG_LEN] = msg_len
            _fence()
            words[base + _M_WRITTEN] = seq  # publish
            self._next_seq = seq + 1
            self._poke_all()

    def positions(self) -> tuple[int, list[int]] | None:
        """``(chunks written, [chunks read by reader i])`` since the queue was created: the
        writer's lead over the slowest reader is the queue's lag (live telemetry reads this
        from another thread; a torn read is off by one at most). None once the queue is
        closed — shutdown may close it while the telemetry thread is reading."""
        if self._closed:
            return None
        words, n = self._words, self._layout.n_readers
        try:
            written = max(words[base + _M_WRITTEN] for base, _ in self._slots)
            read = [max(words[base + _M_READ + r] for base, _ in self._slots) for r in range(n)]
        except ValueError:  # "operation forbidden on released memoryview": closed meanwhile
            return None
        return written, read

    def _slot_free(self, base: int) -> bool:
        """Every reader has read the chunk in the slot at ``base`` (or the slot was never used)."""
        old = self._words[base + _M_WRITTEN]
        read_seqs = self._words[base + _M_READ : base + _M_READ + self._layout.n_readers]
        return old == 0 or read_seqs.tolist().count(old) == self._layout.n_readers

    def _wait_slot_free(
        self, base: int, seq: int, deadline: float, timeout_s: float, mid_message: bool
    ) -> None:
        """Block until the slot at ``base`` is free (its readers are slow: the rare case).

        Raises:
            MessageQueueTimeout: not by ``deadline``; names the lagging readers. With
                ``mid_message`` (readers hold part of this message) the queue is closed.
        """
        where = f"to read chunk {seq - self._layout.max_chunks} of shared-memory queue {self.handle.name!r}"
        names = [self.handle.reader_names[i] for i in self._lagging_readers(base)]
        awaited = f"{', '.join(names) or 'the readers'} {where}"  # (none: freed in the last instant)
        self._words[_H_WRITER_WAITING] = 1
        try:
            free = self._wait(lambda: self._slot_free(base), deadline, awaited, _WRITER_SLICE_S, None)
        finally:
            self._words[_H_WRITER_WAITING] = 0
        if free:
            return
        lagging = self._lagging_readers(base)
        described = ", ".join(self._describe(i, self.handle.reader_names[i]) for i in lagging)
        names = [self.handle.reader_names[i] for i in lagging]
        if mid_message:  # readers hold a partial message: nothing can follow it
            self.close()
        raise MessageQueueTimeout(f"{described or 'the readers'} {where}", timeout_s, tuple(names))

    def _lagging_readers(self, base: int) -> list[int]:
        """Ranks of the readers that have not read the chunk in the slot at ``base`` yet."""
        old = self._words[base + _M_WRITTEN]
        read_seqs = self._words[base + _M_READ : base + _M_READ + self._layout.n_readers].tolist()
        return [] if old == 0 else [i for i, r in enumerate(read_seqs) if r != old]

    def _poke_all(self) -> None:
        for fd in self._peer_fds:
            _poke(fd)

    # ---- a reader ----

    def dequeue(
        self, timeout: float | None = None, cancel: threading.Event | None = None, what: str | None = None
    ) -> bytes:
        """The next message, whole, as bytes.

        ``timeout`` (s) bounds the call; None means ``GLASSBOX_MQ_TIMEOUT_S``. With
        ``cancel``, a blocked call looks at the event every 50 ms. ``what`` names the wait
        (``tracing.wait_for``'s events, e.g. "execute_model from Worker_DP0_PP0_TP0"; default:
        the writer and this queue).

        Raises:
            MessageQueueTimeout: no (complete) message by the deadline; names the writer.
                A part already received is kept for the next call.
            MessageQueueClosed: the writer closed the queue and nothing is left to read.
            WaitCancelled: ``cancel`` was set (and the message was not published by then).
            RuntimeError: called on the writer's end.
        """
        if self.rank is None:
            raise RuntimeError("dequeue() called on the writer's end of the queue")
        if self._closed:
            raise MessageQueueClosed(f"this reader's end of queue {self.handle.name!r} was closed")
        timeout_s = envs.GLASSBOX_MQ_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout_s
        words = self._words
        while True:  # one chunk per turn, until the message is whole
            seq = self._next_seq
            base, offset = self._slots[(seq - 1) % self._layout.max_chunks]
            if words[base + _M_WRITTEN] != seq:
                self._wait_published(base, seq, deadline, timeout_s, cancel, what or self._awaited)
            _fence()  # the payload is read only after the chunk was seen published
            msg_len = words[base + _M_MSG_LEN]
            self._parts.append(self._mm[offset : offset + words[base + _M_NBYTES]])  # a copy
            _fence()  # the copy is done before the slot is handed back
            words[base + _M_READ + self.rank] = seq
            self._next_seq = seq + 1
            if words[_H_WRITER_WAITING]:
                _poke(self._peer_fds[0])
            if sum(map(len, self._parts)) >= msg_len:
                # (bytes.join of a single chunk returns that chunk: no second copy.)
                message, self._parts = b"".join(self._parts), []
                return message

    def _wait_published(
        self,
        base: int,
        seq: int,
        deadline: float,
        timeout_s: float,
        cancel: threading.Event | None,
        what: str,
    ) -> None:
        """Block until chunk ``seq`` is in the slot at ``base`` (the wait named ``what``).

        Raises:
            MessageQueueTimeout: not by ``deadline`` (``_reader_timeout``).
            MessageQueueClosed: the writer closed the queue without publishing it.
            WaitCancelled: ``cancel`` was set.
        """
        slice_s = _CANCEL_SLICE_S if cancel is not None else math.inf
        if not self._wait(lambda: self._published(base, seq), deadline, what, slice_s, cancel):
            raise self._reader_timeout(timeout_s)

    def _published(self, base: int, seq: int) -> bool:
        """Chunk ``seq`` is in the slot at ``base``.

        Raises:
            MessageQueueClosed: it is not, and never will be: the queue was closed.
        """
        # Read `closed` first: the writer sets it after its last publish, so once it is
        # seen, a chunk still missing below will never come.
        closed = self._words[_H_CLOSED]
        published = self._words[base + _M_WRITTEN] == seq
        if closed and not published:
            raise self._closed_by_writer()
        return published

    def _closed_by_writer(self) -> MessageQueueClosed:
        """The error of a reader that waits for a chunk the writer will never publish."""
        return MessageQueueClosed(
            f"shared-memory queue {self.handle.name!r} was closed by {self.handle.writer_name}"
        )

    def _reader_timeout(self, timeout_s: float) -> MessageQueueTimeout:
        """The error of a reader's wait that passed its deadline: it names the writer and
        what the describe hook says about it, and whether part of a message is held."""
        writer = self.handle.writer_name
        state = "the rest of a message" if self._parts else "the next message"
        return MessageQueueTimeout(
            f"{self._describe(0, writer)} to publish {state} on shared-memory queue "
            f"{self.handle.name!r} (reader {self.handle.reader_names[self.rank]})",
            timeout_s,
            (writer,),
        )

    # ---- waiting ----

    def _describe(self, index: int, name: str) -> str:
        """``name`` (of reader ``index`` on the writer's end, of the writer on a reader's)
        with what the describe hook says about it, for a timeout message."""
        if self._describe_peer is None:
            return name
        try:
            return f"{name} ({self._describe_peer(index)})"
        except Exception as e:  # a broken hook must not hide the timeout itself
            return f"{name} (describe hook failed: {type(e).__name__}: {e})"

    def _wait(
        self,
        ready: Callable[[], bool],
        deadline: float,
        awaited: str,
        slice_s: float,
        cancel: threading.Event | None,
    ) -> bool:
        """Wait until ``ready()`` (True) or ``deadline`` (False, ``time.monotonic()`` s).

        A few re-checks first (a few µs: catches a chunk that is just landing), then sleeps
        on this end's FIFO, each at most ``slice_s`` s, woken by the other end's poke.
        ``awaited`` names the wait (``tracing.wait_for``'s events).

        Raises:
            WaitCancelled: ``cancel`` was set.
        """
        if any(ready() for _ in range(_SPIN_CHECKS)):
            return True
        ready_else_sleep = functools.partial(self._ready_else_sleep, ready, deadline, slice_s)
        try:
            # tracing.waits: the deadline, the cancel event and the wait events; the sleeping
            # is this queue's own (on its FIFO, woken by the other end's poke).
            return wait_for(awaited, ready_else_sleep, timeout_s=max(deadline - time.monotonic(), 0.0),
                            poll_interval_s=0, cancel=cancel)  # fmt: skip
        except WaitTimeout:
            return False
        except WaitCancelled:
            # What the other end published before the cancel came beats it: a worker that
            # answered with an error, then exited, is noticed by the supervisor (the cancel)
            # while this end slept; its answer says why (a refused setting), its exit does not.
            with contextlib.suppress(MessageQueueClosed):
                if ready():
                    return True
            raise

    def _ready_else_sleep(self, ready: Callable[[], bool], deadline: float, slice_s: float) -> bool:
        """One turn of ``_wait``: ``ready()``, else sleep on this end's FIFO (at most
        ``slice_s`` s, and not past ``deadline``) until the other end pokes it."""
        _drain(self._wakeup_fd)  # before the check: a later poke stays in the FIFO
        if ready():
            return True
        sleep_s = min(deadline - time.monotonic(), slice_s)
        self._poller.poll(max(math.ceil(sleep_s * 1000), 0))  # ms, rounded up (0: past the deadline)
        return False


def _poke(fd: int) -> None:
    # A full FIFO (BlockingIOError) means its reader has plenty of pokes waiting already.
    with contextlib.suppress(BlockingIOError):
        os.write(fd, b"\0")


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # empty
        os.read(fd, 4096)  # more pokes than this just make the next poll return at once


def _remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
