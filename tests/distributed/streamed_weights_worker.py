"""The weights a sharded actor streams to its vLLM engine, on two processes (gloo, CPU): whole tensors.

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.streamed_weights_worker

The CPU twin of the two-process vLLM test: each process iterates :func:`rlhfkit.rollout.engine_weights.
plain_weights` of a sharded tiny Llama (a collective, in the same order everywhere) and every tensor must equal
the unsharded model's under the same name, whole (a process's own shard, ``to_local()``, is half of it).
"""

from __future__ import annotations

import torch

from rlhfkit.engine import sharded
from rlhfkit.rollout.engine_weights import engine_config, plain_weights
from tests.helpers import tiny_llama


def main() -> None:
    torch.distributed.init_process_group("gloo")
    reference = tiny_llama(seed=0).state_dict()
    model = sharded.shard_model(tiny_llama(seed=0), "full_shard")
    streamed = list(plain_weights(model))
    assert [name for name, _ in streamed] == list(reference), [name for name, _ in streamed][:3]
    for name, tensor in streamed:
        assert type(tensor) is torch.Tensor and tensor.shape == reference[name].shape, (name, tensor.shape)
        assert torch.equal(tensor, reference[name]), name
    assert engine_config(model).architectures == ["LlamaForCausalLM"]
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
