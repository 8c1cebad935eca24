"""vLLM as the generation engine of the online trainers (``online.generation_backend=vllm``).

The engine runs in the trainer's own process (colocated, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; each process of
a data-parallel or sharded run has its own engine) on a copy of the actor written once at start-up (sharded, or
under a launcher of several processes: the config alone, on placeholder weights, ``load_format="dummy"``, the
actor's loaded at once), and the actor's current weights are loaded into it in place before every generation
(:meth:`VLLMEngine.load_weights`, the model runner's ``reload_weights``; LoRA: merged layer by layer as they are
taken, :mod:`rlhfkit.rollout.engine_weights`). Only token ids are taken from it: the responses
are cut at the stop token by :func:`rlhfkit.rollout.generation.truncate_at_stop`, as with ``hf`` (and masked
by the tokens the engine produced: :func:`engine_responses`), and every
log-prob, value and mask the update reads is recomputed by rlhfkit's own models. The engine's log-prob of each
sampled token (``logprobs_mode=processed_logprobs``: after the suppressed ids, the temperature and top-k /
top-p, the processing of :class:`rlhfkit.models.Sampling`) comes back beside the ids, for the stale-weights
guard and truncated importance sampling. docs/generation_backend.md has the design and what was measured.

Multi-turn episodes with tools (:mod:`rlhfkit.rollout.episodes`) call :meth:`VLLMEngine.generate` once per turn
(:func:`engine_generate`), each row's ids as they stand (prompt, sampled turns, the template's tool-result ids)
sent as its token-id prompt: the engine continues exactly the row that is trained, never a re-tokenized text,
and stops at EOS or the tool-call end marker (the stop ids it is given).

Beside a sharded actor (``train.sharding``, FSDP2) the engine gets the actor's weights by
:func:`rlhfkit.rollout.engine_weights.streamed_weights`: one parameter all-gathered at a time as vLLM's loader
takes it, never a whole copy. Under a launcher of several processes (torchrun) each process's engine runs in
vLLM's external-launcher mode beside the launcher's process group, which outlives the engine
(docs/distributed.md, "vLLM with sharding").

Sampling: each request carries its own seed (``SamplingParams.seed``), so a response depends on its seed and
the weights, not on the other requests of the batch, as far as the engine's kernels are deterministic.

Shapes: ``B`` prompts, ``P`` padded prompt length, ``R`` response length (``max_new_tokens``).
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rlhfkit.errors import ConfigError, GenerationEngineError
from rlhfkit.models.lora import is_peft_model, merged_copy
from rlhfkit.models.sampling import Sampling
from rlhfkit.rollout.engine_weights import (
    check_tied_head,
    engine_config,
    is_sharded,
    launched_processes,
    plain_weights,
)
from rlhfkit.rollout.generation import Responses, truncate_at_stop

# The head sizes vLLM 0.32's CPU attention runs (measured: head_dim=16 fails at engine start with
# "Unsupported CPU attention configuration"); on a GPU its kernels take these and more.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(frozen=True)
class EngineSettings:
    """How the engine is sized (``online.vllm_*``, docs in :class:`rlhfkit.config.OnlineConfig`).

    Attributes:
        dtype: the engine's weights and compute, ``"float32"`` or ``"bfloat16"`` (the actor's precision).
        kv_cache_gib: KV-cache memory in whole GiB (CPU: ``VLLM_CPU_KVCACHE_SPACE``); on a GPU, the share of
            the device's memory it is (weights included).
        kv_cache_dtype: vLLM's ``kv_cache_dtype`` (``"auto"`` = ``dtype``).
        max_model_len: the longest prompt + response, in tokens.
        seed: the engine's own seed (each request also carries one).
    """

    dtype: str
    kv_cache_gib: int
    kv_cache_dtype: str
    max_model_len: int
    seed: int = 0


def head_size(config) -> int:
    """The attention head size of a Hugging Face model config (``head_dim``, else hidden / heads)."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else int(config.hidden_size // config.num_attention_heads)


def check_engine_can_run(config, where: str, on_cpu: bool) -> None:
    """Refuse, before anything is loaded into vLLM, a model whose head size its CPU attention lacks.

    Raises:
        ConfigError: naming ``where`` (the model), its head size and the sizes that run.
    """
    size = head_size(config)
    if on_cpu and size not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"online.generation_backend=vllm: {where} has attention head size {size}, which vLLM's CPU "
            f"attention does not run (it runs {', '.join(map(str, CPU_HEAD_SIZES))}); use "
            "online.generation_backend=hf for this model"
        )


# The tokens a CPU engine schedules in one step (vLLM's own default there), at least a whole row.
CPU_STEP_TOKENS = 4096


def row_seeds(base: int, rows: int) -> list[int]:
    """``rows`` request seeds, a stateless function of (``base``, row): 63-bit, from SHA-256."""
    return [
        int.from_bytes(hashlib.sha256(f"rlhfkit-vllm-{base}-{row}".encode()).digest()[:8], "little") >> 1
        for row in range(rows)
    ]


class _CurrentStdout:
    """``sys.stdout`` as it is at each write: the stream of vLLM's log handler (``VLLM_LOGGING_STREAM``).

    vLLM's default, ``ext://sys.stdout``, is resolved once, when vLLM configures its logging: the handler keeps
    the object ``sys.stdout`` was then. A caller that replaces ``sys.stdout`` for a while (pytest's output
    capture, ``contextlib.redirect_stdout``, a notebook cell) and closes it leaves vLLM writing to a closed
    stream, and every later vLLM warning prints a "--- Logging error ---" traceback instead of itself."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()

    def __getattr__(self, name: str):
        return getattr(sys.stdout, name)


CURRENT_STDOUT = _CurrentStdout()


def _first_line(error: BaseException) -> str:
    """The exception's name and the first lines of its message that say something (vLLM's can be long)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {' '.join(lines[:2])}".strip()


def _destroy_vllm_world() -> None:
    """Destroy vLLM's world group (the groups it made inside a launcher's), leaving torch's default group."""
    from vllm.distributed import parallel_state

    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
    parallel_state._WORLD = None


class VLLMEngine:
    """One vLLM engine in this process, serving the actor's current weights.

    Args:
        model: the actor (unwrapped; a peft model is merged; a sharded one streamed); written to a temporary
            folder, which is what vLLM starts from (sharded or launched: its config alone, the weights loaded
            at once).
        settings: :class:`EngineSettings`.
        where: how a message names the model (e.g. ``model.name_or_path=...``).
    Raises:
        ConfigError: a model the engine cannot run (:func:`check_engine_can_run`).
        GenerationEngineError: the engine failed to start (the message says why, in one line).
    """

    def __init__(self, model: torch.nn.Module, settings: EngineSettings, where: str = "the actor") -> None:
        device = next(model.parameters()).device
        on_cpu = device.type == "cpu"
        check_tied_head(model, where)
        config = engine_config(model)
        check_engine_can_run(config, where, on_cpu)
        self.vocab_size = int(config.vocab_size)
        self.settings = settings
        self._folder = tempfile.TemporaryDirectory(prefix="rlhfkit-vllm-")
        # A sharded actor, or any actor under a launcher of several processes: the config alone, the engine
        # starts on placeholder weights (load_format="dummy") and the actor's are loaded right after, as every
        # sync loads them. A whole copy is never gathered, and transformers' save_pretrained writes on rank 0
        # only once torch.distributed is initialized (the other processes' folders would stay empty).
        from_config = is_sharded(model) or launched_processes() > 1
        if from_config:
            config.save_pretrained(self._folder.name)
        else:  # one process: the actor as it is (LoRA: merged, on a copy)
            plain = merged_copy(model) if is_peft_model(model) else model
            plain.save_pretrained(self._folder.name, safe_serialization=True)
            del plain
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
            "0"  # in this process: reload_weights reaches the model
        )
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # vLLM logs to stdout as it is when it writes, not as it was when vLLM was imported (_CurrentStdout)
        os.environ.setdefault("VLLM_LOGGING_STREAM", f"ext://{__name__}.CURRENT_STDOUT")
        if on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
        try:
            from vllm import LLM
        except ImportError as error:
            raise ConfigError(
                'online.generation_backend=vllm: vLLM is not installed (`pip install "rlhfkit[vllm]"` or '
                f"`./setup.sh vllm`): {_first_line(error)}"
            ) from None
        extra = {}
        if not on_cpu:  # a GPU engine is sized by its share of the device's memory
            total = torch.cuda.get_device_properties(device).total_memory / 2**30
            extra["gpu_memory_utilization"] = min(0.9, settings.kv_cache_gib / total)
        else:
            # A prompt whose prefill vLLM splits across steps (a call's prompts beyond the step's 4,096 tokens)
            # has its sampled token discarded and its seeded generator rewound by an offset, which a CPU
            # generator does not have ("CPU Generator does not use offset"). Unsplit prefills: a prompt that
            # does not fit a step waits for the next one.
            extra["enable_chunked_prefill"] = False
            extra["max_num_batched_tokens"] = max(CPU_STEP_TOKENS, settings.max_model_len)
        # vLLM makes a one-process torch.distributed world here unless one exists (a launcher's): it is then
        # vLLM's to destroy in close(), which a later engine of this process needs.
        self._owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        if not self._owns_group and launched_processes() > 1:
            # Beside a launcher's group of several processes (torchrun, accelerate): vLLM's external-launcher
            # mode, as verl's hybrid engine uses it. Each process's engine is a whole model (tensor-parallel
            # size 1) that generates alone; vLLM lays its groups out as "external data parallel x TP", so with
            # TP 1 no collective runs inside generate, and it places the engine on the process's LOCAL_RANK
            # device (the default one-process executor would put every engine on device 0 of a GPU machine).
            extra["distributed_executor_backend"] = "external_launcher"
        try:
            self.llm = LLM(
                model=self._folder.name,
                skip_tokenizer_init=True,  # token ids in, token ids out
                dtype=settings.dtype,
                kv_cache_dtype=settings.kv_cache_dtype,
                max_model_len=settings.max_model_len,
                seed=settings.seed,
                logprobs_mode="processed_logprobs",
                enforce_eager=True,
                load_format="dummy" if from_config else "auto",
                **extra,
            )
        except Exception as error:  # vLLM raises many kinds; the run stops with one line naming it
            raise GenerationEngineError(f"the vLLM engine failed to start: {_first_line(error)}") from error
        if from_config:
            self.load_weights(model)

    def close(self) -> None:
        """Shut the engine down and drop vLLM's process groups (so that another engine can start in this
        process, e.g. a resumed run); a launcher's own group is left as it is."""
        from vllm.distributed import parallel_state

        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                # vLLM's shutdown ends with destroy_distributed_environment, which destroys torch's default
                # process group too: a launcher's group outlives the engine (the run gathers its final weights
                # and leaves the group after), so only vLLM's own groups go then.
                real = parallel_state.destroy_distributed_environment
                if not self._owns_group:
                    parallel_state.destroy_distributed_environment = _destroy_vllm_world
                try:
                    core.shutdown()
                finally:
                    parallel_state.destroy_distributed_environment = real
            del llm
        parallel_state.destroy_model_parallel()
        if self._owns_group:
            parallel_state.destroy_distributed_environment()
        else:
            _destroy_vllm_world()
        gc.collect()

    def load_weights(self, model: torch.nn.Module) -> None:
        """Load the actor's current weights into the engine in place (the model runner's ``reload_weights``).

        Raises:
            GenerationEngineError: the engine refused them or died.
        """
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": plain_weights(model)})
            # Cached prompt blocks hold keys and values of the old weights; a prompt seen before would reuse them.
            self.llm.reset_prefix_cache()
        except Exception as error:
            raise GenerationEngineError(
                f"the vLLM engine failed to load the actor's weights: {_first_line(error)}"
            ) from error

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        sampling: Sampling,
        seeds: Sequence[int],
        greedy: bool = False,
    ) -> Responses:
        """One response per prompt row, as :func:`rlhfkit.rollout.generate_responses` gives them.

        Args:
            prompt_ids, prompt_mask: (B, P) left-padded prompts (only the real tokens are sent).
            max_new_tokens: R.
            stop_token_ids: the ids that end a response (the engine stops on exactly these).
            pad_token_id: filler after the stop token, and after the last token of a completion the engine
                cut at its ``max_model_len`` (outside the mask; :func:`engine_responses`).
            sampling: the processing of the logits (temperature, top-k / top-p, suppressed ids).
            seeds: B per-request seeds.
            greedy: argmax decoding of the suppressed logits.
        Returns:
            :class:`Responses` with ``sampled_logprobs`` (B, R): the engine's log-prob of each sampled token
            under the processing (0 after the stop token; meaningless under ``greedy``).
        Raises:
            ConfigError: a prompt that fills the engine's ``max_model_len`` (an episode's row so far can).
            GenerationEngineError: the engine died or ran out of memory.
        """
        from vllm import SamplingParams

        if len(seeds) != prompt_ids.shape[0]:
            raise ValueError(f"{len(seeds)} seeds for {prompt_ids.shape[0]} prompts")
        allowed = None
        if sampling.suppress_ids:  # exactly -inf, as the hf side's suppress_tokens
            banned = set(sampling.suppress_ids)
            allowed = [i for i in range(self.vocab_size) if i not in banned]
        requests = [
            {"prompt_token_ids": row[m.bool()].tolist()}
            for row, m in zip(prompt_ids, prompt_mask, strict=True)
        ]
        longest = max((len(r["prompt_token_ids"]) for r in requests), default=0)
        if longest >= self.settings.max_model_len:  # vLLM would refuse it, or leave no room for one token
            raise ConfigError(
                f"online.vllm_max_model_len: a prompt of {longest} tokens leaves no room to generate in the "
                f"engine's {self.settings.max_model_len} (with tools: the prompt as rendered with the tools, "
                "plus the episode's turns so far); raise online.vllm_max_model_len"
            )
        params = [
            SamplingParams(
                n=1,
                max_tokens=max_new_tokens,
                min_tokens=0,
                temperature=0.0 if greedy else sampling.temperature,
                top_k=0 if greedy or sampling.top_k == 0 else sampling.top_k,
                top_p=1.0 if greedy else sampling.top_p,
                seed=int(seed),
                stop_token_ids=list(stop_token_ids),
                ignore_eos=True,  # the model's own EOS only where it is one of stop_token_ids
                logprobs=0,  # the sampled token's own log-prob
                allowed_token_ids=allowed,
                detokenize=False,
            )
            for seed in seeds
        ]
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        except Exception as error:
            raise GenerationEngineError(
                f"the vLLM engine failed while generating: {_first_line(error)}"
            ) from error
        return engine_responses(
            prompt_ids,
            prompt_mask,
            [out.outputs[0] for out in outputs],
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            pad_token_id=pad_token_id,
        )


def engine_responses(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completions: Sequence,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
) -> Responses:
    """The engine's completions as :class:`Responses`, masked by what the engine produced.

    A completion may hold fewer than ``max_new_tokens`` tokens without a stop token: the engine stops a request
    whose prompt + response reaches its ``max_model_len``. The columns it did not produce are filler (the pad
    id) outside the mask, and such a row is not ``ended`` (``online.missing_eos`` applies to it), also when the
    pad token is the EOS token: ``ended`` comes only from a stop token the engine generated.

    Args:
        prompt_ids, prompt_mask: (B, P) the prompts the completions answer.
        completions: B of vLLM's ``CompletionOutput`` (``token_ids``; ``logprobs``: per token, a dict from
            the sampled id to an entry with ``.logprob``, or None).
    Returns:
        :class:`Responses` with R = ``max_new_tokens`` columns and ``sampled_logprobs`` (0 outside the mask).
    """
    rows = len(completions)
    generated = prompt_ids.new_full((rows, max_new_tokens), pad_token_id)  # (B, R)
    lengths = torch.zeros(rows, dtype=torch.long)  # (B,) tokens the engine produced
    engine_logprobs = torch.zeros(rows, max_new_tokens)  # (B, R)
    for i, completion in enumerate(completions):
        ids = list(completion.token_ids)[:max_new_tokens]
        lengths[i] = len(ids)
        generated[i, : len(ids)] = torch.as_tensor(ids, dtype=generated.dtype)
        for t, (token, entry) in enumerate(zip(ids, completion.logprobs or [], strict=False)):
            engine_logprobs[i, t] = float(entry[token].logprob)
    response_ids, mask, ended = truncate_at_stop(generated, list(stop_token_ids), pad_token_id, lengths)
    engine_logprobs = torch.where(mask, engine_logprobs, 0.0).to(prompt_ids.device)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask.to(prompt_mask.dtype)], dim=1)
    return Responses(
        input_ids, attention_mask, response_ids, mask, ended, prompt_ids.shape[1], engine_logprobs
    )


def engine_generate(engine: VLLMEngine) -> Callable[..., Responses]:
    """A function with :func:`rlhfkit.rollout.generate_responses`'s signature that samples from ``engine``: what
    the held-out samplers take as ``generate`` (``rlhfkit generate --backend vllm``, the reward-model
    refresh's pairs). The caller has loaded the policy's weights into the engine; the ``model`` argument is
    not read. Each call draws one base seed from the global torch generator, which these callers seed, and
    row ``i`` of the call gets the request seed :func:`row_seeds` ``(base, i)``."""

    def generate(
        model, prompt_ids, prompt_mask, *, greedy: bool = False, streams=None, **kwargs
    ) -> Responses:
        del model, streams  # the engine serves the weights it was given, with its own per-request seeds
        base = int(torch.randint(2**62, (1,)))
        seeds = row_seeds(base, prompt_ids.shape[0])
        return engine.generate(prompt_ids, prompt_mask, seeds=seeds, greedy=greedy, **kwargs)

    return generate
