"""The ZeroMQ publisher with real sockets on 127.0.0.1 (ephemeral ports): vLLM's framing,
gap-free sequence numbers, the cached hashes rebuilt from the events alone, replay for a
late subscriber, data-parallel ranks, bounded memory and shutdown. Every receive has a
timeout, so a broken publisher fails the test instead of hanging it."""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import msgspec
import pytest
import zmq
from kvblocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSubscriber,
    ExternalBlockHash,
    KVEventBatch,
    SequencedKVEventBatch,
    ZmqEventPublisher,
    external_block_hash,
    offset_endpoint_port,
)

LOCAL = "tcp://127.0.0.1:*"
TIMEOUT = 5.0  # seconds any single receive may wait


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


class Workload:
    """A chat-like workload on a small pool: shared prefixes, decodes, frees, lazy
    evictions, explicit evictions and resets; ``step()`` returns the step's events."""

    def __init__(self, backend: ModuleType, seed: int) -> None:
        self.backend = backend
        self.rng = random.Random(seed)
        self.hasher = backend.BlockHasher(4, "sha256_cbor", "zmq")
        self.manager = backend.KVCacheManager(40, 4, enable_kv_cache_events=True)
        self.live: dict[str, Any] = {}
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(50) for _ in range(12)] for _ in range(3)]

    def step(self) -> list[Any]:
        rng, manager = self.rng, self.manager
        roll = rng.random()
        if roll < 0.45 or not self.live:
            prompt = rng.choice(self.prefixes) + [
                rng.randrange(50) for _ in range(rng.randrange(9))
            ]
            request = self.backend.Request(f"r{self.next_id}", prompt, block_hasher=self.hasher)
            self.next_id += 1
            hits, n = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, len(prompt) - n, n, hits) is not None:
                request.num_computed_tokens = len(prompt)
                self.live[request.request_id] = request
        elif roll < 0.75:
            request = self.live[rng.choice(sorted(self.live))]
            request.append_output_token_ids(rng.randrange(50))
            if manager.allocate_slots(request, 1) is not None:
                request.num_computed_tokens += 1
        elif roll < 0.95:
            manager.free(self.live.pop(rng.choice(sorted(self.live))))
        elif roll < 0.99:
            manager.evict_blocks({rng.randrange(40) for _ in range(3)})
        else:
            for request in self.live.values():
                manager.free(request)
            self.live.clear()
            assert manager.reset_prefix_cache()
        events: list[Any] = manager.take_events()
        return events

    def cached_hashes(self) -> collections.Counter[ExternalBlockHash]:
        """The pool's cached hashes (int form), one count per block."""
        pool = self.manager.block_pool
        return collections.Counter(
            external_block_hash(block.block_hash, True)
            for b in range(40)
            if (block := pool.get_block(b)).block_hash is not None
        )


def rebuild(batches: Sequence[KVEventBatch]) -> collections.Counter[ExternalBlockHash]:
    """The cached hashes known from the events alone (one count per stored block)."""
    cached: collections.Counter[ExternalBlockHash] = collections.Counter()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cached.subtract(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                cached.clear()
    return +cached


def handshake(publisher: ZmqEventPublisher, subscriber: EventSubscriber) -> int:
    """Publishes empty batches until the subscription is live (PUB/SUB drops what is
    sent before it is); returns the sequence number of the first one received."""
    for _ in range(100):
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        got = subscriber.recv(0.05)
        if got is not None:
            return got[0]
    pytest.fail("the subscription never became live")


def receive_until(
    subscriber: EventSubscriber, last_seq: int
) -> list[tuple[int, SequencedKVEventBatch]]:
    """Live batches up to and including ``last_seq``; fails after a silent ``TIMEOUT``."""
    out: list[tuple[int, SequencedKVEventBatch]] = []
    while not out or out[-1][0] < last_seq:
        got = subscriber.recv(TIMEOUT)
        assert got is not None, f"nothing received after seq {out[-1][0] if out else None}"
        out.append(got)
    return out


@pytest.mark.parametrize("background", [True, False], ids=["thread", "inline"])
def test_live_subscriber_rebuilds_the_cache(
    backend: ModuleType, ctx: zmq.Context[zmq.Socket[bytes]], background: bool
) -> None:
    with ZmqEventPublisher(LOCAL, topic="kv", background=background, context=ctx) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        with EventSubscriber(pub.endpoint, topic="kv", context=ctx) as sub:
            first = handshake(pub, sub)
            workload = Workload(backend, seed=1)
            num_events = 0
            for _ in range(400):
                events = workload.step()
                num_events += len(events)
                pub.publish(KVEventBatch(ts=time.time(), events=events))
            received = receive_until(sub, pub.next_seq - 1)
    seqs = [seq for seq, _ in received]
    assert seqs == list(range(seqs[0], pub.next_seq)), "sequence numbers without gaps"
    assert seqs[0] <= first + 1 + 100
    batches = [batch for _, batch in received]
    assert all(batch.data_parallel_rank == 0 and batch.seq is None for batch in batches)
    assert sum(len(b.events) for b in batches) == num_events > 200
    assert rebuild(batches) == workload.cached_hashes()
    assert workload.cached_hashes(), "the workload ends with blocks cached"


def test_wire_frames_are_vllms(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Raw sockets, no helper: (topic, 8-byte big-endian seq, msgpack batch) on PUB;
    replay frames on the ROUTER, ended by seq -1."""
    with ZmqEventPublisher(LOCAL, replay_endpoint=LOCAL, topic="t", context=ctx) as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"t")
        sub.connect(pub.endpoint)
        batch = KVEventBatch(ts=1.5, events=[AllBlocksCleared()])
        frames = None
        for _ in range(100):
            pub.publish(KVEventBatch(ts=1.5, events=[AllBlocksCleared()]))
            if sub.poll(50):
                frames = sub.recv_multipart()
                break
        assert frames is not None
        topic, seq, payload = frames
        assert topic == b"t" and len(seq) == 8
        assert payload == msgspec.msgpack.encode(
            KVEventBatch(ts=1.5, events=batch.events, data_parallel_rank=0)
        )
        assert msgspec.msgpack.decode(payload, type=KVEventBatch).events == [AllBlocksCleared()]

        dealer = ctx.socket(zmq.DEALER)
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", seq])
        replies = []
        while True:
            assert dealer.poll(int(TIMEOUT * 1000)), "replay answered in time"
            reply = dealer.recv_multipart()
            replies.append(reply)
            if reply[1] == (-1).to_bytes(8, "big", signed=True):
                break
        assert replies[0] == [b"", seq, payload]
        assert replies[-1] == [b"", b"\xff" * 8, b""]
        assert [int.from_bytes(r[1], "big") for r in replies[:-1]] == list(
            range(int.from_bytes(seq, "big"), pub.next_seq)
        )
        sub.close(linger=0)
        dealer.close(linger=0)


def test_late_subscriber_catches_up_through_replay(
    backend: ModuleType, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    workload = Workload(backend, seed=2)
    with ZmqEventPublisher(
        LOCAL, replay_endpoint=LOCAL, data_parallel_rank=3, sequence_in_batch=True, context=ctx
    ) as pub:
        # Nobody listens to the first half.
        for _ in range(200):
            pub.publish(KVEventBatch(ts=time.time(), events=workload.step()))
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, context=ctx) as sub:
            first_live = handshake(pub, sub)
            replayed = sub.replay(0, TIMEOUT)
            assert replayed[0][0] == 0 and replayed[-1][0] >= first_live
            for _ in range(200):
                pub.publish(KVEventBatch(ts=time.time(), events=workload.step()))
            live = receive_until(sub, pub.next_seq - 1)
    by_seq = dict(replayed)
    by_seq.update(live)
    assert sorted(by_seq) == list(range(pub.next_seq)), "replay + live cover every batch"
    batches = [by_seq[seq] for seq in sorted(by_seq)]
    assert all(b.seq == seq for seq, b in zip(sorted(by_seq), batches, strict=True))
    assert all(b.data_parallel_rank == 3 for b in batches)
    assert rebuild(batches) == workload.cached_hashes()


def test_inline_publisher_serves_replay(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with ZmqEventPublisher(LOCAL, replay_endpoint=LOCAL, background=False, context=ctx) as pub:
        for i in range(5):
            assert pub.publish(KVEventBatch(ts=float(i), events=[]))
        with (
            EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, context=ctx) as sub,
            ThreadPoolExecutor(1) as pool,
        ):
            future = pool.submit(sub.replay, 2, TIMEOUT)
            served = 0
            deadline = time.monotonic() + TIMEOUT
            while served == 0 and time.monotonic() < deadline:
                served = pub.serve_replay(timeout=0.05)
            assert served == 1
            assert [(seq, b.ts) for seq, b in future.result(TIMEOUT)] == [
                (2, 2.0),
                (3, 3.0),
                (4, 4.0),
            ]
    with ZmqEventPublisher(LOCAL, context=ctx) as threaded, pytest.raises(RuntimeError):
        threaded.serve_replay()


def test_memory_is_bounded_when_nobody_reads(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """The replay buffer keeps the last ``buffer_steps`` batches; a full queue drops a
    batch (publish() returns False) without reusing its sequence number, so it shows as
    a gap; nothing blocks the caller."""
    with ZmqEventPublisher(
        LOCAL, replay_endpoint=LOCAL, buffer_steps=5000, max_queue_size=1, hwm=10, context=ctx
    ) as pub:
        started = time.monotonic()
        accepted = [pub.publish(KVEventBatch(ts=0.0, events=[])) for _ in range(3000)]
        assert time.monotonic() - started < TIMEOUT, "publish() never blocks"
        assert accepted.count(False) == pub.num_dropped
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, context=ctx) as sub:
            # Wait until the thread has sent everything it accepted.
            deadline = time.monotonic() + TIMEOUT
            while True:
                seqs = [seq for seq, _ in sub.replay(0, TIMEOUT)]
                if len(seqs) == accepted.count(True) or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        assert seqs == [i for i, ok in enumerate(accepted) if ok]

    with ZmqEventPublisher(LOCAL, replay_endpoint=LOCAL, buffer_steps=5, context=ctx) as small:
        for _ in range(50):
            small.publish(KVEventBatch(ts=0.0, events=[]))
        with EventSubscriber(
            small.endpoint, replay_endpoint=small.replay_endpoint, context=ctx
        ) as sub:
            deadline = time.monotonic() + TIMEOUT
            while (seqs := [s for s, _ in sub.replay(0, TIMEOUT)])[-1:] != [49]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert seqs == [45, 46, 47, 48, 49]


def test_shutdown_delivers_queued_batches_and_is_final(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    def publisher_threads() -> int:
        return sum(t.name == "kvblocks-zmq-publisher" for t in threading.enumerate())

    before = publisher_threads()
    pub = ZmqEventPublisher(LOCAL, context=ctx)
    assert publisher_threads() == before + 1
    with EventSubscriber(pub.endpoint, context=ctx) as sub:
        handshake(pub, sub)
        for i in range(300):
            pub.publish(KVEventBatch(ts=float(i), events=[]))
        last = pub.next_seq - 1
        pub.shutdown()
        assert publisher_threads() == before
        assert receive_until(sub, last)[-1][0] == last
    pub.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        pub.publish(KVEventBatch(ts=0.0, events=[]))


def test_data_parallel_rank_offsets_endpoints(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://127.0.0.1:*", 2) == "tcp://127.0.0.1:*"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port(None, 1) is None
    with pytest.raises(ValueError, match="Invalid endpoint"):
        offset_endpoint_port("udp://x:1", 1)
    # Two ranks side by side on one base endpoint; a batch's own rank is kept.
    with (
        ZmqEventPublisher("inproc://events", data_parallel_rank=0, context=ctx) as rank0,
        ZmqEventPublisher("inproc://events", data_parallel_rank=1, context=ctx) as rank1,
    ):
        assert (rank0.endpoint, rank1.endpoint) == ("inproc://events", "inproc://events_dp1")
        with EventSubscriber(rank1.endpoint, context=ctx) as sub:
            handshake(rank1, sub)
            rank1.publish(KVEventBatch(ts=0.0, events=[], data_parallel_rank=9))
            rank1.publish(KVEventBatch(ts=0.0, events=[]))
            got = receive_until(sub, rank1.next_seq - 1)
        assert [b.data_parallel_rank for _, b in got[-2:]] == [9, 1]
    with pytest.raises(ValueError, match="buffer_steps must be positive"):
        ZmqEventPublisher(LOCAL, buffer_steps=0, context=ctx)


def test_a_batch_that_cannot_be_encoded_is_skipped(
    ctx: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    bad = KVEventBatch(ts=0.0, events=[object()])  # type: ignore[list-item]
    with ZmqEventPublisher(LOCAL, replay_endpoint=LOCAL, context=ctx) as pub:
        for batch in (KVEventBatch(ts=0.0, events=[]), bad, KVEventBatch(ts=0.0, events=[])):
            assert pub.publish(batch)
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, context=ctx) as sub:
            deadline = time.monotonic() + TIMEOUT
            while (seqs := [s for s, _ in sub.replay(0, TIMEOUT)])[-1:] != [2]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    assert seqs == [0, 2], "the publisher kept going; the bad batch's number is a gap"
    assert "publishing KV event batch 1 failed" in caplog.text
    with ZmqEventPublisher(LOCAL, background=False, context=ctx) as inline:
        with pytest.raises(TypeError):
            inline.publish(bad)
        assert inline.next_seq == 1
