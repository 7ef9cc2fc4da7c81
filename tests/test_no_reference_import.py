"""The native backend runs without the pure-Python reference.

With the native backend selected, nothing a user touches (the pool, hasher, request,
manager and rollback, the KV cache events and their ZeroMQ publisher, the simulator)
may import ``kvblocks.reference``: the events, the simulator and the benchmarks take
what both backends share from the neutral modules (:mod:`kvblocks.constants`,
:mod:`kvblocks.extra_keys`, :mod:`kvblocks.events`). Each run is a fresh interpreter,
as ``sys.modules`` of the test process holds the reference already.

The constants are checked against both backends: each accepts exactly these names.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import ModuleType

import pytest
from kvblocks import _native, reference
from kvblocks.constants import HASH_ALGORITHMS, LOAD_FAILURE_POLICIES, ROLLBACK_MODES
from kvblocks.reference.hashing import HASH_FUNCTIONS

BACKENDS = [pytest.param(reference, id="python"), pytest.param(_native, id="rust")]

#: Run in a child interpreter; prints a JSON report on its last line.
CHILD = r"""
import json
import sys
from types import SimpleNamespace

import kvblocks
from kvblocks.constants import HASH_ALGORITHMS, LOAD_FAILURE_POLICIES, ROLLBACK_MODES, cdiv
from kvblocks.extra_keys import Lora, MmItem, MmPosition, RequestExtras, block_extra_keys

assert kvblocks.BACKEND == "rust", kvblocks.BACKEND
done = []

# The pool.
pool = kvblocks.BlockPool(16, block_size=4)
ids = pool.get_new_blocks(3)
pool.cache_full_blocks(ids, [b"a" * 32, b"b" * 32, b"c" * 32], 0, 3)
pool.free_blocks(reversed(ids))
assert pool.find_longest_cache_hit([b"a" * 32, b"b" * 32]) == ids[:2]
pool.check_invariants()
done.append("pool")

# The hasher, with every algorithm, and the extra keys of the neutral module.
lora = SimpleNamespace(lora_name="adapter", lora_path="/lora", adapter_id=7)
image = SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=2, length=5))
for algo in HASH_ALGORITHMS:
    hasher = kvblocks.BlockHasher(4, algo, "seed")
    request = kvblocks.Request(
        f"h-{algo}", range(13), lora_request=lora, cache_salt="salt", mm_features=[image]
    )
    extras = RequestExtras(
        lora=Lora(lora.lora_name, lora.lora_path),
        mm_items=[MmItem(MmPosition(2, 5), image.identifier, has_identifier=True)],
        cache_salt=request.cache_salt,
    )
    keys = block_extra_keys(extras, 0, cdiv(12, 4), 4)
    assert hasher(request) == hasher.hash_blocks(range(12), extra_keys=keys), algo
done.append("hasher")

# The request and the manager, with events on: stored (LoRA, salt and multimodal
# fields), removed and cleared.
hasher = kvblocks.BlockHasher(4, "sha256", "seed")
manager = kvblocks.KVCacheManager(8, 4, enable_kv_cache_events=True, log_stats=True)
request = kvblocks.Request(
    "r", range(13), block_hasher=hasher, lora_request=lora, cache_salt="salt",
    mm_features=[image],
)
request.append_output_token_ids([99, 100, 101])
assert len(request.block_hashes) == 4
blocks, hit = manager.get_computed_blocks(request)
assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None
(stored,) = manager.take_events()
assert type(stored).__name__ == "BlockStored" and stored.lora_id == 7, stored
assert stored.extra_keys[0] == ("adapter", ("img", 2), "salt"), stored.extra_keys
table = manager.get_block_ids("r")[0]
manager.free(request)
manager.evict_blocks([table[0]])
assert manager.reset_prefix_cache()
kinds = [type(e).__name__ for e in manager.take_events()]
assert kinds == ["BlockRemoved", "AllBlocksCleared"], kinds
done += ["request", "manager"]

# The rollback, with every mode and policy.
for mode in ROLLBACK_MODES:
    result = kvblocks.rollback_invalid_blocks([[1, 2, 3]], [12], [4], {2}, 4, mode=mode)
    assert result.num_computed_tokens == [4], (mode, result)
    for policy in LOAD_FAILURE_POLICIES:
        manager = kvblocks.KVCacheManager(8, 4)
        request = kvblocks.Request("x", range(12), block_hasher=hasher)
        manager.allocate_slots(request, 12)
        request.num_computed_tokens = 12
        bad = manager.get_block_ids("x")[0][1]
        outcome = kvblocks.handle_invalid_blocks(
            manager, {bad}, {"x": 4}, running=[request], policy=policy, mode=mode
        )
        assert request.num_computed_tokens == 4, (mode, policy, outcome)
        kvblocks.handle_failed_recving(["y"], [], policy=policy)
done.append("rollback")

# The events' wire format, and the publisher when pyzmq is there.
import msgspec
from kvblocks.events import BlockStored, KVEventBatch

batch = KVEventBatch(ts=1.0, events=[stored])
payload = msgspec.msgpack.encode(batch)
decoded = msgspec.msgpack.decode(payload, type=KVEventBatch)
assert msgspec.msgpack.encode(decoded) == payload
assert isinstance(stored, BlockStored)
done.append("events")
try:
    import zmq
except ImportError:
    pass
else:
    from kvblocks.events import EventSubscriber, ZmqEventPublisher

    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"
    ) as publisher:
        assert publisher.publish(batch)
        with EventSubscriber(
            publisher.endpoint, replay_endpoint=publisher.replay_endpoint
        ) as subscriber:
            ((seq, got),) = subscriber.replay(0, timeout=10.0)
    assert seq == 0 and msgspec.msgpack.encode(got.events) == msgspec.msgpack.encode([stored])
    done.append("zmq")

# The simulator, on the native backend.
from kvblocks.sim import SimConfig, run

config = SimConfig(num_requests=20, num_blocks=400, max_model_len=2048, failure_rate=0.2)
sim = run(config, backend=kvblocks._native)
assert sim.ok, sim.failure
import kvblocks.bench.workloads

done.append("sim")

loaded = sorted(
    m for m in sys.modules if m == "kvblocks.reference" or m.startswith("kvblocks.reference.")
)
print(json.dumps({"done": done, "reference_modules": loaded}))
"""


@pytest.mark.parametrize("selected", [None, "rust"], ids=["default", "KVBLOCKS_BACKEND=rust"])
def test_native_backend_never_imports_the_reference(selected: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVBLOCKS_BACKEND"}
    if selected is not None:
        env["KVBLOCKS_BACKEND"] = selected
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    expected = ["pool", "hasher", "request", "manager", "rollback", "events"]
    if importlib.util.find_spec("zmq") is not None:
        expected.append("zmq")
    assert report["done"] == [*expected, "sim"]
    assert report["reference_modules"] == []


def test_the_reference_has_a_hash_function_per_algorithm() -> None:
    assert tuple(HASH_FUNCTIONS) == HASH_ALGORITHMS


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_takes_exactly_the_hash_algorithms(backend: ModuleType) -> None:
    for algo in HASH_ALGORITHMS:
        assert backend.BlockHasher(16, algo, "seed").algo == algo
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        backend.BlockHasher(16, "md5", "seed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_takes_exactly_the_modes_and_policies(backend: ModuleType) -> None:
    manager = backend.KVCacheManager(8, 4)
    for mode in ROLLBACK_MODES:
        for policy in LOAD_FAILURE_POLICIES:
            backend.handle_invalid_blocks(manager, set(), {}, running=[], policy=policy, mode=mode)
    with pytest.raises(ValueError, match="mode"):
        backend.handle_invalid_blocks(manager, set(), {}, running=[], mode="lenient")
    with pytest.raises(ValueError, match="policy"):
        backend.handle_invalid_blocks(manager, set(), {}, running=[], policy="ignore")
    with pytest.raises(ValueError, match="policy"):
        backend.handle_failed_recving([], [], policy="ignore")
