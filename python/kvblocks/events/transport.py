"""The ZeroMQ transport of KV cache events: vLLM's publisher protocol and its client.

:class:`ZmqEventPublisher` speaks vLLM's ``ZmqEventPublisher`` protocol (multipart
``(topic, 8-byte big-endian sequence number, msgpack batch)`` on a PUB socket, replay
of buffered batches on a ROUTER socket) and :class:`EventSubscriber` is the matching
client. The batches are the structs of :mod:`kvblocks.events.wire`.

Beyond vLLM, off by default so that the bytes stay vLLM's,
``ZmqEventPublisher(..., sequence_in_batch=True)`` publishes
:class:`~kvblocks.events.wire.SequencedKVEventBatch`, which carries the batch's
sequence number inside the payload (numbers are given out when a batch is published, so
a batch dropped before it reached the socket shows as a gap).

Importing this module needs ``msgspec``; creating a publisher or a subscriber also
needs ``pyzmq`` (``pip install kvblocks[events]``), imported then.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from types import TracebackType
from typing import TYPE_CHECKING

import msgspec

from kvblocks.events.wire import EventBatch, SequencedKVEventBatch

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)

__all__ = ["EventSubscriber", "ZmqEventPublisher", "offset_endpoint_port"]


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank ``data_parallel_rank`` (vLLM's convention).

    Rank 0 keeps the endpoint. Other ranks add the rank to a TCP port
    (``tcp://*:5557`` → ``tcp://*:5558`` for rank 1) or append ``_dp{rank}`` to an
    ``inproc``/``ipc`` name. A wildcard port (``tcp://127.0.0.1:*``) is kept: the
    system picks one per rank.

    Raises:
        ValueError: the endpoint is neither TCP, inproc nor IPC.
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"Invalid endpoint {endpoint!r}: must be tcp://, ipc:// or inproc://")


def _binds(endpoint: str) -> bool:
    """vLLM's heuristic: bind wildcard, IPC and inproc endpoints, connect to the others."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


_SEQ_BYTES = 8
_END_SEQ = (-1).to_bytes(_SEQ_BYTES, "big", signed=True)


class ZmqEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket, as vLLM's ``ZmqEventPublisher``.

    Each batch goes out as the multipart message ``(topic, seq, payload)``: the topic
    (UTF-8), the sequence number (8 bytes, big-endian; 0, 1, 2, ... per publisher) and
    ``msgspec.msgpack.encode(batch)``. The last ``buffer_steps`` messages are kept for
    replay: a client sends ``(b"", start_seq as 8 bytes)`` to the ROUTER socket at
    ``replay_endpoint`` (a DEALER, or vLLM's REQ client) and gets ``(b"", seq,
    payload)`` for every buffered batch from ``start_seq`` on, then ``(b"", -1 as 8
    signed bytes, b"")``.

    Memory stays bounded when nobody reads: the PUB and ROUTER sockets drop messages
    past their high-water mark ``hwm``, the replay buffer holds ``buffer_steps`` batches
    and, with a background thread, the queue in front of it ``max_queue_size``. Unlike
    vLLM, :meth:`publish` never blocks the caller on a full queue: it drops the batch,
    counts it in :attr:`num_dropped` and returns False. Its sequence number is not
    reused, so subscribers see the gap.

    Args:
        endpoint: PUB address. Wildcard (``tcp://*:5557``, ``tcp://127.0.0.1:*``),
            ``ipc://`` and ``inproc://`` endpoints are bound, others connected to.
        replay_endpoint: ROUTER address to bind for replay, or ``None`` for no replay.
        data_parallel_rank: This engine's data-parallel rank: fills a batch's
            ``data_parallel_rank`` when it is ``None`` and offsets both endpoints (see
            :func:`offset_endpoint_port`).
        topic: The topic frame.
        buffer_steps: Batches kept for replay.
        hwm: High-water mark of the sockets (messages per peer).
        max_queue_size: Batches the background thread may have waiting.
        background: Encode and send on a background thread (as vLLM). Without it,
            :meth:`publish` sends at once and replay requests are answered in
            :meth:`publish` and :meth:`serve_replay`.
        sequence_in_batch: Publish :class:`SequencedKVEventBatch` payloads carrying
            the sequence number (kvblocks only; off keeps vLLM's bytes).
        context: The ZeroMQ context (default: the process-wide instance).

    Raises:
        ValueError: a count is not positive, or an endpoint is invalid.
        zmq.ZMQError: a socket cannot bind or connect.
    """

    #: Seconds :meth:`shutdown` waits for the background thread to drain the queue.
    SHUTDOWN_TIMEOUT: float = 2.0

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        data_parallel_rank: int = 0,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        background: bool = True,
        sequence_in_batch: bool = False,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        import zmq  # noqa: PLC0415 (pyzmq is optional)

        for name, value in (
            ("buffer_steps", buffer_steps),
            ("hwm", hwm),
            ("max_queue_size", max_queue_size),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be non-negative, got {data_parallel_rank}")
        pub_endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        if not pub_endpoint:
            raise ValueError("endpoint must not be empty")
        self._data_parallel_rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._sequence_in_batch = sequence_in_batch
        self._encoder = msgspec.msgpack.Encoder()
        # Sequence numbers are given out under this lock in publish(), so they follow
        # the order in which batches were published, whichever thread sends them.
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._num_dropped = 0
        #: (seq, payload) of the last buffer_steps batches sent, oldest first.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)

        ctx = context if context is not None else zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        replay: zmq.Socket[bytes] | None = None
        try:
            pub.setsockopt(zmq.SNDHWM, hwm)
            pub.setsockopt(zmq.LINGER, 0)
            if _binds(pub_endpoint):
                pub.bind(pub_endpoint)
            else:
                pub.connect(pub_endpoint)
            replay_at = offset_endpoint_port(replay_endpoint, data_parallel_rank)
            if replay_at:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, hwm)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(replay_at)
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        self._pub = pub
        self._replay = replay
        self.endpoint: str = _last_endpoint(pub, pub_endpoint)
        """The PUB socket's address (with the port the system picked for a wildcard)."""
        self.replay_endpoint: str | None = (
            _last_endpoint(replay, replay_at or "") if replay is not None else None
        )
        """The replay ROUTER socket's bound address, or ``None``."""

        self._closed = False
        self._abort = threading.Event()
        self._queue: queue.Queue[tuple[int, EventBatch]] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max_queue_size)
            # The sockets were made on this thread; from here on only the publisher
            # thread uses them (thread start is the memory barrier ZeroMQ asks for),
            # until shutdown() has joined it.
            self._thread = threading.Thread(
                target=self._run, name="kvblocks-zmq-publisher", daemon=True
            )
            self._thread.start()

    # ------------------------------------------------------------------ publishing

    @property
    def data_parallel_rank(self) -> int:
        """The data-parallel rank stamped on batches that have none."""
        return self._data_parallel_rank

    @property
    def num_dropped(self) -> int:
        """Batches dropped because the background queue was full."""
        return self._num_dropped

    @property
    def next_seq(self) -> int:
        """The sequence number the next published batch gets."""
        return self._next_seq

    def publish(self, batch: EventBatch) -> bool:
        """Publishes one batch (a :class:`KVEventBatch`, typically).

        The batch's ``data_parallel_rank`` is set to the publisher's when it is
        ``None``. It gets the next sequence number now, whether it is sent at once, later
        by the background thread, or dropped. With a background thread the batch is
        encoded later: do not change it after publishing it. A batch that cannot be
        encoded there is logged and skipped (its sequence number shows as a gap).

        Returns:
            False when the background queue was full and the batch was dropped.

        Raises:
            RuntimeError: the publisher was shut down.
            msgspec.EncodeError: without a background thread, the batch cannot be
                encoded (its sequence number is spent).
        """
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._data_parallel_rank
        with self._seq_lock:
            if self._closed:
                raise RuntimeError("the publisher is shut down")
            seq = self._next_seq
            self._next_seq += 1
            if self._queue is None:
                self._send(seq, batch)
                self._serve_pending_replays()
                return True
            try:
                self._queue.put_nowait((seq, batch))
            except queue.Full:
                self._num_dropped += 1
                return False
            return True

    def serve_replay(self, timeout: float = 0.0) -> int:
        """Answers waiting replay requests (only without a background thread).

        Args:
            timeout: Seconds to wait for a first request.

        Returns:
            The number of requests answered.

        Raises:
            RuntimeError: the publisher has a background thread (which answers them)
                or is shut down.
        """
        if self._thread is not None or self._closed:
            raise RuntimeError("serve_replay() is for a publisher without background thread")
        with self._seq_lock:
            if self._replay is None or not self._replay.poll(int(timeout * 1000)):
                return 0
            return self._serve_pending_replays()

    def shutdown(self) -> None:
        """Sends what is queued (for up to :attr:`SHUTDOWN_TIMEOUT` seconds), stops the
        background thread and closes the sockets. Idempotent."""
        with self._seq_lock:
            if self._closed:
                return
            # Under the lock: no batch is queued after this.
            self._closed = True
        thread = self._thread
        if thread is not None:
            thread.join(timeout=self.SHUTDOWN_TIMEOUT)
            if thread.is_alive():
                # It did not drain in time: drop the rest.
                self._abort.set()
                thread.join(timeout=self.SHUTDOWN_TIMEOUT)
            if thread.is_alive():
                # Still stuck (in a send): the sockets stay with it, never closed under it.
                return
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals

    def _payload(self, seq: int, batch: EventBatch) -> bytes:
        if self._sequence_in_batch:
            batch = SequencedKVEventBatch(
                ts=batch.ts,
                events=batch.events,
                data_parallel_rank=batch.data_parallel_rank,
                seq=seq,
            )
        return self._encoder.encode(batch)

    def _send(self, seq: int, batch: EventBatch) -> None:
        """Encodes, sends (never blocking: PUB drops past the high-water mark), buffers."""
        payload = self._payload(seq, batch)
        self._pub.send_multipart((self._topic, seq.to_bytes(_SEQ_BYTES, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_pending_replays(self) -> int:
        """Answers every replay request already waiting; returns how many."""
        import zmq  # noqa: PLC0415 (pyzmq is optional)

        replay = self._replay
        if replay is None:
            return 0
        served = 0
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return served
            if len(frames) != 3 or len(frames[2]) != _SEQ_BYTES:
                # Not a replay request: ignore it, as vLLM does.
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    replay.send_multipart((client, b"", seq.to_bytes(_SEQ_BYTES, "big"), payload))
            replay.send_multipart((client, b"", _END_SEQ, b""))
            served += 1

    def _run(self) -> None:
        """The background thread: sends queued batches in order, answers replays, and
        returns once the publisher is shut down and the queue is empty."""
        import zmq  # noqa: PLC0415 (pyzmq is optional)

        work = self._queue
        if work is None:
            return
        while not self._abort.is_set():
            try:
                if self._replay is not None and self._replay.poll(0, zmq.POLLIN):
                    self._serve_pending_replays()
            except zmq.ZMQError:
                # Replay is best effort: a bad request must not stop publishing.
                logger.exception("kvblocks: answering a replay request failed")
            try:
                seq, batch = work.get(timeout=0.02)
            except queue.Empty:
                # Once closed nothing more is queued, so an empty queue stays empty.
                if self._closed and work.empty():
                    return
                continue
            try:
                self._send(seq, batch)
            except Exception:
                # Keep publishing; subscribers see this batch's number missing.
                logger.exception("kvblocks: publishing KV event batch %d failed", seq)


def _last_endpoint(sock: zmq.Socket[bytes], fallback: str) -> str:
    """The address a socket is bound to (the system-picked port included)."""
    import zmq  # noqa: PLC0415 (pyzmq is optional)

    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    if isinstance(last, bytes) and last:
        return last.decode("utf-8").rstrip("\x00")
    return fallback


# ---------------------------------------------------------------------- the subscriber


class EventSubscriber:
    """Receives a :class:`ZmqEventPublisher`'s batches (or vLLM's), for tests and tools.

    Every receive takes a timeout, so a caller never hangs on a silent publisher.
    Payloads are decoded as :class:`SequencedKVEventBatch`, which reads vLLM's
    three-element batches too (``seq`` is then ``None``).

    Args:
        endpoint: The publisher's PUB address (connected to).
        replay_endpoint: Its replay ROUTER address, if replay is wanted.
        topic: The topic to subscribe to (a prefix, as ZeroMQ matches it).
        context: The ZeroMQ context (default: the process-wide instance).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        import zmq  # noqa: PLC0415 (pyzmq is optional)

        ctx = context if context is not None else zmq.Context.instance()
        self._decoder = msgspec.msgpack.Decoder(type=SequencedKVEventBatch)
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)

    def decode(self, payload: bytes) -> SequencedKVEventBatch:
        """Decodes one payload."""
        return self._decoder.decode(payload)

    def recv(self, timeout: float) -> tuple[int, SequencedKVEventBatch] | None:
        """The next live batch as ``(seq, batch)``, or ``None`` after ``timeout`` seconds.

        Raises:
            ValueError: a message is not ``(topic, 8-byte seq, payload)``.
            msgspec.DecodeError: a payload is not a KV event batch.
        """
        if not self._sub.poll(max(int(timeout * 1000), 0)):
            return None
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
            raise ValueError(f"expected (topic, seq, payload), got {len(frames)} frames")
        return int.from_bytes(frames[1], "big"), self.decode(frames[2])

    def replay(self, start_seq: int, timeout: float) -> list[tuple[int, SequencedKVEventBatch]]:
        """Asks the replay socket for the buffered batches from ``start_seq`` on.

        Args:
            start_seq: The first sequence number wanted.
            timeout: Seconds to wait for each reply message.

        Returns:
            ``(seq, batch)`` pairs in order (those still buffered).

        Raises:
            RuntimeError: no replay endpoint was given.
            TimeoutError: the end marker did not arrive in time.
        """
        if self._replay is None:
            raise RuntimeError("this subscriber has no replay endpoint")
        self._replay.send_multipart((b"", start_seq.to_bytes(_SEQ_BYTES, "big")))
        out: list[tuple[int, SequencedKVEventBatch]] = []
        while True:
            if not self._replay.poll(max(int(timeout * 1000), 0)):
                raise TimeoutError("no replay answer in time")
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
                raise ValueError(f"expected (b'', seq, payload), got {len(frames)} frames")
            _, seq_bytes, payload = frames
            if seq_bytes == _END_SEQ:
                return out
            out.append((int.from_bytes(seq_bytes, "big"), self.decode(payload)))

    def close(self) -> None:
        """Closes the sockets. Idempotent."""
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
