"""Hugging Face model I/O and read-outs: tokenizers, causal LMs, scalar (reward / value) models.

- loading: :func:`load_tokenizer`, :func:`load_causal_lm`, :func:`load_scalar_model`,
  :func:`disable_dropout`, :func:`init_score_head`;
- read-outs (padding independent, position ids from the attention mask):
  :func:`logprobs_from_logits`, :func:`response_logprobs`, :func:`response_values`,
  :func:`token_scores`, :func:`sequence_scores`;
- distillation: :func:`teacher_divergence` (a teacher's full-vocabulary divergence, chunked);
- sampling = scoring: :class:`Sampling`, :func:`sampling_for`, :func:`sampled_logprobs`;
- precision and update mode: :func:`autocast_forward`, :func:`set_update_mode`;
- saving: :func:`save_hf_folder` (a folder plain transformers loads);
- LoRA and gradient checkpointing: :func:`prepare_trained`, :class:`AdapterDisabled`
  (:mod:`rlhfkit.models.lora`).

transformers is imported lazily inside the loaders, so importing this package stays cheap.
"""

from rlhfkit.models.distill_readout import teacher_divergence
from rlhfkit.models.head_chunks import (
    Readout,
    can_share_prompts,
    chunked_readout,
    response_logprobs,
    response_readout,
)
from rlhfkit.models.loading import (
    PAD_TOKEN,
    disable_dropout,
    init_score_head,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    match_tokenizer,
    read_chat_template,
    resolve_dtype,
)
from rlhfkit.models.lora import AdapterDisabled, is_peft_model, prepare_trained
from rlhfkit.models.precision import autocast_forward, set_update_mode
from rlhfkit.models.readout import (
    causal_lm_logits,
    causal_lm_output,
    last_token_index,
    logprobs_from_logits,
    position_ids_from_mask,
    response_forward,
    response_logits,
    response_values,
    sampled_logprobs,
    sequence_scores,
    token_scores,
    unwrap_model,
)
from rlhfkit.models.sampling import Sampling, processed_logits, sampling_for
from rlhfkit.models.saving import is_scalar_model, save_hf_folder
from rlhfkit.models.vocabulary import check_same_vocabulary, check_teacher_vocabulary

__all__ = [
    "AdapterDisabled",
    "Readout",
    "chunked_readout",
    "response_readout",
    "can_share_prompts",
    "PAD_TOKEN",
    "Sampling",
    "autocast_forward",
    "causal_lm_output",
    "check_same_vocabulary",
    "check_teacher_vocabulary",
    "processed_logits",
    "read_chat_template",
    "response_forward",
    "sampled_logprobs",
    "sampling_for",
    "teacher_divergence",
    "set_update_mode",
    "causal_lm_logits",
    "disable_dropout",
    "init_score_head",
    "is_peft_model",
    "is_scalar_model",
    "last_token_index",
    "load_causal_lm",
    "load_scalar_model",
    "load_tokenizer",
    "logprobs_from_logits",
    "match_tokenizer",
    "position_ids_from_mask",
    "prepare_trained",
    "resolve_dtype",
    "response_logits",
    "response_logprobs",
    "response_values",
    "save_hf_folder",
    "sequence_scores",
    "token_scores",
    "unwrap_model",
]
