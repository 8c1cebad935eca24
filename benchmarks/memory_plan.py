"""Memory of sharded PPO with the vLLM engine, per GPU, on paper: each part's bytes per parameter (or per
token) times what one GPU holds of it (docs/performance.md, "Memory at scale").

The parts, for ``train.sharding=full_shard`` + ``online.generation_backend=vllm`` on G GPUs, one process each:

- trained models (actor, critic): 16 B per parameter, sharded (1/G each): float32 weights 4 + gradients 4 +
  AdamW's two moments 8 (rlhfkit keeps trained weights in float32 also under ``model.dtype=bfloat16``, which
  is autocast);
- frozen models (reference, reward model): 2 B per parameter in bfloat16 (4 in float32), 1/G each under
  ``train.frozen_models=shard``, whole under ``replicate``;
- engine weights: the actor's, whole on every GPU (one engine per process, tensor-parallel size 1), in the
  engine's dtype (the actor's: 2 B in bfloat16);
- KV cache: 2 (key and value) x layers x key-value heads x head size x dtype bytes per token of the cache;
- activations of the update: micro-batch rows x sequence x bytes per token of the actor and of the critic
  together (one loss, one backward: ``rlhfkit.trainers.online.ppo_update``), each from
  :func:`activation_bytes_per_token`, Korthikanti et al.'s 16-bit estimate with the float32 logits (the critic
  without its logits term: a scalar head); with ``attention_scores=False`` less the
  estimate's attention scores (5 x heads x sequence a layer), which a fused attention kernel does not store;
- gathered units (FSDP2, during the update): the roots of actor and critic (embeddings, final norm, head; a
  trained root stays gathered from forward to backward, :func:`rlhfkit.engine.sharded.shard_model`) and two
  decoder layers (the one computing and the one prefetched), float32, each with its unsharded gradient until
  the reduce-scatter.

Parameter counts come from the model's config (a Llama shape). Nothing here is measured;
the bytes per parameter are the ones that benchmarks/sharded_memory.py's figures imply on SmolLM2-135M.
"""

from __future__ import annotations

import dataclasses

GIB = 2**30

# The bytes of one parameter of each part (see the module docstring).
TRAINED_BYTES = 4 + 4 + 8  # float32 weights, gradients, AdamW's exp_avg and exp_avg_sq
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

# Llama-3.1-8B's shape (its config.json), the 8B of the plan.
LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """One sharded PPO run's settings, as the memory formula reads them.

    Attributes:
        gpus: processes (GPUs) the trained and frozen models are sharded over.
        dtype: ``model.dtype``: bfloat16 (frozen models and engine in bf16) or float32.
        frozen_sharded: ``train.frozen_models=shard`` (True) or ``replicate``.
        kv_cache_tokens: the tokens the engine's KV cache holds (prompt + response of every sequence it runs
            at once).
        micro_batch_rows: rows of one forward / backward of the update (``train.micro_batch_size``).
        sequence: tokens of a row (``data.max_prompt_length`` + ``online.response_length``).
        attention_scores: the update's attention stores its scores (eager attention, as the estimate
            counts); False for a fused kernel that does not.
        capacity_gib: memory of one GPU.
    """

    gpus: int = 8
    dtype: str = "bfloat16"
    frozen_sharded: bool = True
    kv_cache_tokens: int = 65536
    micro_batch_rows: int = 1
    sequence: int = 1024
    attention_scores: bool = True
    capacity_gib: float = 80.0


def llama_config(shape: dict | None = None):
    """A transformers LlamaConfig of ``shape`` (default :data:`LLAMA_8B`)."""
    from transformers import LlamaConfig

    return LlamaConfig(**(shape or LLAMA_8B))


def parameter_counts(config) -> dict[str, int]:
    """Parameters of a Llama-shaped config (no biases): the causal LM (actor, reference), the scalar model
    (critic, reward model: the backbone and a 1-output head), the causal LM's root (embeddings, final norm,
    output head) and one decoder layer. ``tests/benchmarks/test_memory_plan.py`` checks them against the
    models transformers builds."""
    hidden, vocab, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    attention = 2 * hidden * config.num_attention_heads * head_dim + 2 * hidden * kv_heads * head_dim
    layer = attention + 3 * hidden * config.intermediate_size + 2 * hidden  # q, o, k, v; MLP; two norms
    embeddings = vocab * hidden + hidden  # and the final norm
    root = embeddings + (0 if config.tie_word_embeddings else vocab * hidden)
    return {
        "causal": root + layers * layer,
        "scalar": embeddings + layers * layer + hidden,
        "root": root,
        "layer": layer,
    }


def kv_bytes_per_token(config, dtype: str) -> int:
    """Bytes of KV cache per token: 2 (key, value) x layers x key-value heads x head size x dtype bytes."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def activation_bytes_per_token(config, sequence: int, logits: bool = True) -> int:
    """Estimated bytes one token of a training forward holds for its backward: per layer 34 h + 5 a s (16-bit
    activations, no recomputation: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", eq. 1, divided by s b), plus, with ``logits``, the float32 logits, their log-softmax
    and its gradient (12 V). The default micro-batch used it before it was fitted to peaks measured on a CPU
    (:func:`rlhfkit.trainers.online.layout.update_peak_bytes`); the plans keep it, unmeasured on a GPU."""
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    read_out = 12 * int(config.vocab_size) if logits else 0
    return layers * (34 * hidden + 5 * heads * sequence) + read_out


def per_gpu_gib(plan: Plan, config, counts: dict[str, int] | None = None) -> dict[str, float]:
    """GiB of each part on one GPU under ``plan`` (the module docstring lists the parts), their ``total`` and
    the ``margin`` left of ``plan.capacity_gib``."""
    counts = counts or parameter_counts(config)
    weight = DTYPE_BYTES[plan.dtype]
    trained = counts["causal"] + counts["scalar"]  # actor + critic
    frozen = counts["causal"] + counts["scalar"]  # reference + reward model
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    critic_root = counts["scalar"] - layers * counts["layer"]
    gathered_params = counts["root"] + critic_root + 2 * counts["layer"]
    actor_token = activation_bytes_per_token(config, plan.sequence)
    critic_token = activation_bytes_per_token(config, plan.sequence, logits=False)  # a scalar head
    scores = 0 if plan.attention_scores else layers * 5 * heads * plan.sequence  # per model, per token
    parts = {
        "trained": trained * TRAINED_BYTES / plan.gpus,
        "frozen": frozen * weight / (plan.gpus if plan.frozen_sharded else 1),
        "engine_weights": counts["causal"] * weight,
        "kv_cache": plan.kv_cache_tokens * kv_bytes_per_token(config, plan.dtype),
        "activations": plan.micro_batch_rows * plan.sequence * (actor_token + critic_token - 2 * scores),
        "gathered": gathered_params * (4 + 4),  # float32 weights + their unsharded gradients
    }
    out = {name: value / GIB for name, value in parts.items()}
    out["total"] = sum(out.values())
    out["margin"] = plan.capacity_gib - out["total"]
    return out
