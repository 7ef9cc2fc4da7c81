"""KV cache events in vLLM 0.33.0's wire format, and a ZeroMQ publisher for them.

Prefix-aware routers (llm-d's KV cache manager, NVIDIA Dynamo's KV router, ...) follow
every engine's KV cache events to decide where a request's prefix is cached. A
:class:`~kvblocks.KVCacheManager` created with ``enable_kv_cache_events=True`` records
them, both backends alike, and ``take_events()`` hands them over as vLLM's structs.

* :mod:`kvblocks.events.wire`: the event and batch structs, encoded byte for byte as
  vLLM encodes them, and the rules both backends build events with;
* :mod:`kvblocks.events.transport`: :class:`ZmqEventPublisher`, which publishes batches
  with vLLM's ZeroMQ framing and replay, and :class:`EventSubscriber`, its client.

Every name is importable from here. Importing this package needs ``msgspec``; the
publisher and subscriber also need ``pyzmq`` (``pip install kvblocks[events]``).
"""

from kvblocks.events.transport import EventSubscriber, ZmqEventPublisher, offset_endpoint_port
from kvblocks.events.wire import (
    FULL_ATTENTION,
    INT_BLOCK_HASHES_ENV,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    KVEventBatch,
    SequencedKVEventBatch,
    external_block_hash,
    use_int_block_hashes,
)

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
    "external_block_hash",
    "offset_endpoint_port",
    "use_int_block_hashes",
]
