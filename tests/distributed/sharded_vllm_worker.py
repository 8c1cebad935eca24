"""One process of a torchrun launch that checks the vLLM engine beside a sharded (FSDP2) actor.

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.sharded_vllm_worker OUT_DIR MODE

Every process shards the same tiny actor (``MODE``: full_shard or shard_grad_op) and starts its own engine in
vLLM's external-launcher mode on it (the weights streamed shard by shard, no whole copy); then, on prompts of
its own (its share of a rollout), it writes to ``OUT_DIR/rank-R.json`` what
tests/distributed/test_sharded_vllm.py compares: the engine's greedy tokens and Hugging Face ``generate``'s on
a gathered copy, before and after a few AdamW steps of the sharded actor (each followed by a sync), the
engine's log-probs of sampled tokens beside the trainer's (the sharded actor's forward), the tokens of one
seeded request alone and inside the batch, and how many parameters the stream had gathered when the loader
took its first tensor.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlhfkit.engine import sharded
from rlhfkit.engine.threads import set_num_threads
from rlhfkit.models import response_logits, sampled_logprobs
from rlhfkit.rollout import generate_responses
from rlhfkit.rollout.engine_weights import streamed_weights
from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine
from tests.rollout.test_vllm_engine import engine_model, generation, prompts, update


def trained(model: torch.nn.Module, rank: int) -> None:
    """A few AdamW steps of the sharded actor on random text of this process (FSDP averages the gradients),
    then what the backward left gathered freed, as the trainer does."""
    update(model, seed=10 + rank)
    for unit in model.modules():
        if sharded.is_sharded(unit):
            unit.reshard()


def greedy_pair(engine: VLLMEngine, actor: torch.nn.Module, ids, mask) -> dict:
    """The engine's greedy responses and ``generate``'s on a gathered copy of the sharded actor (a
    collective)."""
    whole = sharded.unshard(actor).eval()
    hf = generate_responses(whole, ids, mask, **generation(True))
    del whole
    out = engine.generate(ids, mask, seeds=list(range(ids.shape[0])), **generation(True))
    return {
        "engine": out.response_ids.tolist(),
        "engine_mask": out.mask.long().tolist(),
        "hf": hf.response_ids.tolist(),
        "hf_mask": hf.mask.long().tolist(),
    }


def first_of_stream(actor: torch.nn.Module) -> dict:
    """The name of the stream's first tensor and how many parameters had been gathered (all-gathers of a
    DTensor) when it came: the stream is lazy, one tensor gathered per tensor taken."""
    from torch.distributed.tensor import DTensor

    real, calls = DTensor.full_tensor, []

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    stream = streamed_weights(actor)
    DTensor.full_tensor = counted
    try:
        name, _ = next(stream)
        gathered = len(calls)
    finally:
        DTensor.full_tensor = real
        stream.close()
    return {"first_name": name, "gathered_at_first": gathered, "parameters": len(actor.state_dict())}


def main(out_dir: str, mode: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    set_num_threads()  # two processes on two cores: one thread each (before vLLM fixes the count)
    actor = sharded.shard_model(engine_model(), mode)
    lazy = first_of_stream(actor)
    engine = VLLMEngine(actor, EngineSettings("float32", 1, "auto", 160, seed=0))
    ids, mask = prompts(rows=3, length=140, seed=rank)  # this process's own prompts
    result = {"rank": rank, "threads": torch.get_num_threads(), "lazy": lazy}
    result["before"] = greedy_pair(engine, actor, ids, mask)
    trained(actor, rank)
    engine.load_weights(actor)
    result["after"] = greedy_pair(engine, actor, ids, mask)

    sampled = engine.generate(ids, mask, seeds=[7, 8, 9], **generation(False))
    with torch.no_grad():  # the trainer's log-probs of the engine's tokens, through the sharded actor
        logits = response_logits(actor, sampled.input_ids, sampled.attention_mask, sampled.response_start)
        trainer = sampled_logprobs(logits, sampled.response_ids, generation(False)["sampling"])
    gap = ((sampled.sampled_logprobs - trainer).abs() * sampled.mask).sum() / sampled.mask.sum()
    alone = engine.generate(ids[1:2], mask[1:2], seeds=[8], **generation(False))
    result["sampled"] = {
        "logprob_gap_mean": float(gap),
        "tokens_in_batch": sampled.response_ids[1].tolist(),
        "tokens_alone": alone.response_ids[0].tolist(),
        "tokens_other_seed": engine.generate(ids[1:2], mask[1:2], seeds=[9], **generation(False))
        .response_ids[0]
        .tolist(),
    }
    engine.close()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
