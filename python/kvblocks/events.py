"""KV cache events in vLLM 0.33.0's wire format, and a ZeroMQ publisher for them.

Prefix-aware routers (llm-d's KV cache manager, NVIDIA Dynamo's KV router, ...) follow
every engine's KV cache events to decide where a request's prefix is cached. A
:class:`~kvblocks.KVCacheManager` created with ``enable_kv_cache_events=True`` records
them, both backends alike, and ``take_events()`` hands them over as the structs below.
They are ``msgspec`` structs declared exactly as in vLLM's
``vllm/distributed/kv_events.py`` (same names, field order, defaults, tags and options),
so ``msgspec.msgpack.encode`` produces the bytes vLLM publishes and consumers written
for vLLM decode them unchanged:

* events are tagged maps (``{"type": "BlockStored", ...}``) whose fields still at their
  default are omitted;
* an :class:`EventBatch` is an array, ``[ts, events, data_parallel_rank]``.

What a manager records (vLLM 0.33.0, one full-attention group ``0``):

* :class:`BlockStored` once per call that caches full blocks: their hashes, the parent
  hash (the request's hash just before them, else ``None``), the request's token ids
  for those blocks, ``block_size``, the LoRA id and name, ``medium="GPU"``, one
  ``extra_keys`` entry per block (untagged, see :func:`to_event_extra_keys`),
  ``group_idx=0`` and ``kv_cache_spec_kind="full_attention"``;
* :class:`BlockRemoved` with one hash per removed prefix-cache entry: a cached block
  reallocated (lazy eviction) or passed to ``evict_blocks``;
* :class:`AllBlocksCleared` after a successful ``reset_prefix_cache()``.

Block hashes are ints (the low 8 bytes of the hash, big-endian) unless the environment
variable ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is ``0``, in which case they are the
hash bytes, as in vLLM. kvblocks reads the variable once, when the manager is created.

Beyond vLLM, off by default so that the stream stays byte-identical to vLLM's:

* ``KVCacheManager(..., kv_events_last_copy_removal=True)`` emits ``BlockRemoved`` for
  a hash only when the last block caching it goes (vLLM emits one per block, also while
  a duplicate block still serves the hash), so a consumer can keep a plain set;
* ``ZmqEventPublisher(..., sequence_in_batch=True)`` publishes
  :class:`SequencedKVEventBatch`, which carries the batch's sequence number inside the
  payload (numbers are given out when a batch is published, so a batch dropped before
  it reached the socket shows as a gap); vLLM decoders ignore the extra field.

:class:`ZmqEventPublisher` speaks vLLM's ``ZmqEventPublisher`` protocol (multipart
``(topic, 8-byte big-endian sequence number, msgpack batch)`` on a PUB socket, replay
of buffered batches on a ROUTER socket) and :class:`EventSubscriber` is the matching
client. Importing this module needs ``msgspec``; the publisher and subscriber also
need ``pyzmq`` (``pip install kvblocks[events]``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)

__all__ = [
    "FULL_ATTENTION",
    "INT_BLOCK_HASHES_ENV",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventSubscriber",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "SequencedKVEventBatch",
    "ZmqEventPublisher",
    "block_stored_request_fields",
    "external_block_hash",
    "offset_endpoint_port",
    "to_event_extra_keys",
    "use_int_block_hashes",
]

#: A block hash as events carry it: the low 8 bytes as an int, or the bytes.
ExternalBlockHash = bytes | int

#: The storage medium of every event kvblocks records.
MEDIUM_GPU = "GPU"

#: The environment variable choosing int (``1``, the default) or bytes (``0``) hashes.
INT_BLOCK_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"

#: ``kv_cache_spec_kind`` of the one group a kvblocks manager has.
FULL_ATTENTION = "full_attention"

_LOW_64_BITS = (1 << 64) - 1


# ---------------------------------------------------------------------- the wire structs
# Declared field by field as vLLM 0.33.0 declares them: msgpack writes a struct's
# fields in declaration order, so the order is part of the wire format.


class EventBatch(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
):
    """A batch of events, encoded as the array ``[ts, events, data_parallel_rank]``.

    ``array_like`` structs keep every field, so ``data_parallel_rank`` is written even
    when it is ``None`` (``omit_defaults`` only drops map entries).
    """

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Base class of the KV cache events: tagged maps, defaults omitted."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache (one event per caching call)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    #: Deprecated in vLLM in favour of ``lora_name``; kept for compatibility.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    #: One entry per block of ``block_hashes``: its extra keys, untagged, or ``None``.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    #: vLLM 0.33.0 fields kvblocks never sets. ``locality`` and ``ownership`` are typed
    #: loosely so that any vLLM payload carrying them decodes.
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None

    def __hash__(self) -> int:
        return hash(
            (
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
                tuple(self.extra_keys) if self.extra_keys else None,
                self.group_idx,
                self.kv_cache_spec_kind,
                self.kv_cache_spec_sliding_window,
            )
        )


class BlockRemoved(KVCacheEvent):
    """Prefix-cache entries went away (kvblocks, like vLLM, puts one hash in each)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium, self.group_idx))


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped (``reset_prefix_cache()``)."""


class KVEventBatch(EventBatch):
    """The batch vLLM publishes: ``[ts, [events...], data_parallel_rank]``."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class SequencedKVEventBatch(KVEventBatch):
    """A :class:`KVEventBatch` with its sequence number appended (kvblocks only).

    Encoded as ``[ts, events, data_parallel_rank, seq]``. A decoder expecting vLLM's
    :class:`KVEventBatch` ignores the trailing element, and decoding a plain
    three-element batch as this type gives ``seq=None``.
    """

    seq: int | None = None


# ---------------------------------------------------------------------- conversions


def use_int_block_hashes() -> bool:
    """Whether events carry int block hashes, read from ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.

    As in vLLM, the variable is parsed as an int and its truth taken; unset means ``1``.

    Raises:
        ValueError: the variable is set to something that is not an int.
    """
    raw = os.environ.get(INT_BLOCK_HASHES_ENV, "1")
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"{INT_BLOCK_HASHES_ENV} must be an integer, got {raw!r}") from None


def external_block_hash(block_hash: bytes, as_int: bool) -> ExternalBlockHash:
    """A block hash as events carry it (vLLM's ``maybe_convert_block_hash``).

    Args:
        block_hash: The hash bytes.
        as_int: Whether to convert: the low 8 bytes read as a big-endian unsigned int.
    """
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


def to_event_extra_keys(extra_keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One block's tagged hash extra keys in the untagged form events publish.

    ``("mm", identifier, offset)`` becomes ``(identifier, offset)``; every other key
    (``("lora", name, path)``, ``("cache_salt", salt)``, ``("prompt_embeds", digest)``)
    becomes its second element.
    """
    if not extra_keys:
        return None
    return tuple((key[1], key[2]) if key[0] == "mm" else key[1] for key in extra_keys)


def block_stored_request_fields(
    request: object, first_block: int, num_blocks: int, block_size: int
) -> tuple[int | None, str | None, list[tuple[Any, ...] | None]] | None:
    """The request-dependent fields of a ``BlockStored``: LoRA id and name, extra keys.

    Both backends call this when they record a ``BlockStored``, so they agree on it.

    Args:
        request: The request whose blocks were cached (reads ``lora_request``,
            ``cache_salt`` and ``mm_features`` when present).
        first_block: Index of the first cached block in the request.
        num_blocks: How many blocks were cached.
        block_size: Tokens per block.

    Returns:
        ``None`` for a request without LoRA, multimodal items or cache salt on these
        blocks (no LoRA fields and ``extra_keys == [None] * num_blocks``); otherwise
        ``(lora_id, lora_name, extra_keys)``.
    """
    lora_request: Any = getattr(request, "lora_request", None)
    salted = first_block == 0 and bool(getattr(request, "cache_salt", None))
    if not lora_request and not salted and not getattr(request, "mm_features", None):
        return None
    # Imported here: the hashing module is only needed for requests with extra keys.
    from kvblocks.reference.hashing import generate_block_hash_extra_keys

    extra_keys: list[tuple[Any, ...] | None] = []
    # Starting the multimodal walk at item 0 for every block finds every item that
    # overlaps it, wherever the range starts.
    for block in range(first_block, first_block + num_blocks):
        start = block * block_size
        keys, _ = generate_block_hash_extra_keys(request, start, start + block_size, 0)
        extra_keys.append(to_event_extra_keys(keys))
    if not lora_request:
        return None, None, extra_keys
    lora_id = getattr(lora_request, "adapter_id", getattr(lora_request, "lora_int_id", None))
    return lora_id, lora_request.lora_name, extra_keys


# ---------------------------------------------------------------------- the publisher


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
        import zmq

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
        import zmq

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
        import zmq

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
    import zmq

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
        import zmq

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
