"""The vocabulary check between models that share token ids: the policy's ids go to the reward model, the
critic, a process reward model and DPO's reference unchanged (no re-tokenisation), so their tokenizers must
number every token the same way."""

from __future__ import annotations

from rlhfkit.errors import ConfigError
from rlhfkit.models.loading import load_tokenizer


def check_same_vocabulary(
    tokenizer, other_path: str, key: str, trust_remote_code: bool = False, policy_path: str | None = None
) -> None:
    """ConfigError unless the tokenizer saved with ``other_path`` gives every policy token the same id.

    The policy's token ids are fed to the reward model and the critic unchanged (no re-tokenisation), so
    they must share the vocabulary. A reward model may have one extra pad token (``save_hf_folder`` adds it
    when the tokenizer pads with EOS).
    """
    try:
        other = load_tokenizer(other_path, trust_remote_code=trust_remote_code, missing_pad="eos")
    except Exception:  # a folder without tokenizer files: its embedding size is all there is to compare
        _check_vocabulary_size(tokenizer, other_path, key, trust_remote_code, policy_path)
        return
    mine, theirs = tokenizer.get_vocab(), other.get_vocab()
    differ = [
        tok
        for tok, i in mine.items()
        if theirs.get(tok) != i and tok != getattr(tokenizer, "pad_token", None)
    ]
    if differ:
        raise ConfigError(
            f"{key}: the tokenizer in {other_path} numbers {len(differ)} of the policy's tokens "
            f"differently (e.g. {differ[0]!r}); the reward model and critic must use the policy's "
            "tokenizer"
        )


def _check_vocabulary_size(
    tokenizer, other_path: str, key: str, trust_remote_code: bool, policy_path: str | None
) -> None:
    """ConfigError when a model folder without tokenizer files has another vocabulary size than the policy's
    tokenizer (+ 1 for an added pad token) and than the policy model's own (padded) embedding table: its
    embeddings would be grown with random rows or cut, and the ids could not mean the same."""
    from transformers import AutoConfig

    def vocab_size(path):
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception:  # not a model folder: the loader says so with its own message
            return None
        return getattr(config.get_text_config(), "vocab_size", None)

    size = vocab_size(other_path)
    allowed = {len(tokenizer), len(tokenizer) + 1}  # + 1: the pad token save_hf_folder may add
    if size is not None and size not in allowed and policy_path is not None:
        allowed.add(vocab_size(policy_path))
    if size is not None and size not in allowed:
        raise ConfigError(
            f"{key}: {other_path} has no tokenizer files and a vocabulary of {size} tokens, but the "
            f"policy's tokenizer has {len(tokenizer)}; it cannot be a model of the policy's tokens "
            "(save the policy's tokenizer into that folder if it is)"
        )
