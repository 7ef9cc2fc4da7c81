"""vLLM 0.33.0's real Scheduler, on the CPU, with kvblocks as its KV cache manager.

No GPU, no model weights, no tokenizer: the "model" is a directory holding only a tiny
``config.json``, and the model runner is faked (every decoding request emits one token per
step). What is real is vLLM's own scheduling loop -- ``schedule()`` and
``update_from_output()`` -- with the class named by ``scheduler_cls`` resolved the way vLLM's
engine does it, so the KV cache manager it drives is kvblocks'.

Run it from a venv that has vLLM and kvblocks (docs/vllm.md, "vLLM's scheduler on a CPU",
says how to make one)::

    python examples/vllm_scheduler.py
    python examples/vllm_scheduler.py --scheduler-cls vllm.v1.core.sched.scheduler.Scheduler

The second line runs vLLM's stock scheduler and manager, for comparison: the per-step lines
are the same, only the manager line differs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

# vLLM must be told it runs on the CPU before it is imported (its CUDA wheel cannot tell), and
# it must not try to reach the Hugging Face hub for the local model directory.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_MODEL_LEN = 1024


def build_scheduler(model_dir: str, scheduler_cls: str) -> Any:
    """vLLM's configs for a tiny model, then the Scheduler class vLLM resolves from them."""
    import torch  # noqa: PLC0415 (vLLM is imported after the env set-up above)
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: PLC0415 (vLLM is imported after the env set-up above)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: PLC0415 (vLLM is imported after the env set-up above)
    from vllm.v1.structured_output import StructuredOutputManager  # noqa: PLC0415 (vLLM is imported after the env set-up above)

    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            seed=0,
            max_model_len=MAX_MODEL_LEN,
        ),
        scheduler_config=SchedulerConfig(
            scheduler_cls=scheduler_cls,  # what `--scheduler-cls` sets
            max_num_seqs=8,
            max_num_batched_tokens=128,  # small, so long prompts are chunked
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            async_scheduling=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=4, head_size=16, dtype=torch.float32
                ),
            )
        ],
    )
    # The same call vLLM's engine core makes (vllm/v1/engine/core.py).
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        log_stats=True,
    )


def make_requests() -> list[Any]:
    """Four requests sharing a 64-token system prompt, so the later ones hit the prefix cache."""
    from vllm.sampling_params import SamplingParams  # noqa: PLC0415 (vLLM is imported after the env set-up above)
    from vllm.utils.hashing import sha256  # noqa: PLC0415 (vLLM is imported after the env set-up above)
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: PLC0415 (vLLM is imported after the env set-up above)
    from vllm.v1.request import Request  # noqa: PLC0415 (vLLM is imported after the env set-up above)

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    system = [(7 * i) % 1000 for i in range(64)]
    prompts = [system + [(13 * i + r) % 1000 for i in range(40 + 50 * r)] for r in range(4)]
    return [
        Request(
            request_id=f"req-{r}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=6 + 2 * r, ignore_eos=True),
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=hasher,
        )
        for r, prompt in enumerate(prompts)
    ]


def run(scheduler_cls: str) -> int:
    from vllm.v1.outputs import ModelRunnerOutput  # noqa: PLC0415 (vLLM is imported after the env set-up above)

    with tempfile.TemporaryDirectory() as model_dir:
        from kvblocks.vllm.cpu import write_config_only_model  # noqa: PLC0415 (kvblocks.vllm imports vLLM: after the env set-up)

        scheduler = build_scheduler(str(write_config_only_model(Path(model_dir))), scheduler_cls)

    manager = type(scheduler.kv_cache_manager)
    print(f"scheduler class: {type(scheduler).__module__}.{type(scheduler).__qualname__}")
    print(f"kv cache manager: {manager.__module__}.{manager.__qualname__}")

    requests = make_requests()
    # The first request arrives alone, the rest a step later, so they find its prefix cached.
    scheduler.add_request(requests[0])
    pending = requests[1:]
    finished: set[str] = set()
    step = 0
    while len(finished) < len(requests) and step < 100:
        step += 1
        if step == 2:
            for request in pending:
                scheduler.add_request(request)
            pending = []
        out = scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        hits = sum(new.num_computed_tokens for new in out.scheduled_new_reqs)
        # The fake model: a request still in its prompt samples nothing, the others one token.
        sampled = [
            []
            if scheduler.requests[rid].is_prefill_chunk
            else [zlib.crc32(f"{rid}:{step}".encode()) % 1000]
            for rid in req_ids
        ]
        model_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        engine_outputs = scheduler.update_from_output(out, model_output)
        done = sorted(
            o.request_id
            for outputs in engine_outputs.values()
            for o in outputs.outputs
            if o.finish_reason is not None
        )
        finished.update(done)
        usage = scheduler.kv_cache_manager.usage
        print(
            f"step {step:2d}: {len(req_ids)} running, {out.total_num_scheduled_tokens:3d} tokens,"
            f" {hits:3d} prefix-cache hit tokens, KV usage {usage:5.1%},"
            f" finished {done or '-'}"
        )
    print(f"all {len(requests)} requests finished in {step} steps: {sorted(finished)}")
    return 0 if len(finished) == len(requests) else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description="vLLM's Scheduler on the CPU, kvblocks as its manager"
    )
    parser.add_argument(
        "--scheduler-cls",
        default="kvblocks.vllm.KVBlocksScheduler",
        help="the class vLLM's SchedulerConfig.scheduler_cls names (default: %(default)s)",
    )
    return run(parser.parse_args().scheduler_cls)


if __name__ == "__main__":
    raise SystemExit(main())
