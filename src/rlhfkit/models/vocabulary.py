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


def check_teacher_vocabulary(student_path: str, teacher_path: str, trust_remote_code: bool = False) -> None:
    """ConfigError unless the teacher's tokenizer (``online.teacher_model``) and the student's
    (``model.name_or_path``) have the same vocabulary, token for token: the teacher scores the student's own
    token ids, and the full-vocabulary losses compare the two distributions entry by entry. A pad token that
    one of them added at the end of its vocabulary (``save_hf_folder`` adds one when a tokenizer pads with EOS)
    is the only difference allowed. The error names both vocabularies (folder and size) and the first id
    where they differ."""
    student = load_tokenizer(student_path, trust_remote_code=trust_remote_code, missing_pad="eos")
    try:
        teacher = load_tokenizer(teacher_path, trust_remote_code=trust_remote_code, missing_pad="eos")
    except Exception as error:  # noqa: BLE001 - named below; a folder without tokenizer files is refused
        raise ConfigError(
            f"online.teacher_model: {teacher_path} has no tokenizer that loads ({type(error).__name__}); the "
            "teacher's vocabulary must be checked against the student's, token for token"
        ) from None
    mine, theirs = _by_id(student), _by_id(teacher)
    pads = {getattr(t, "pad_token", None) for t in (student, teacher)} - {None}
    for i in range(max(len(mine), len(theirs))):
        a, b = mine.get(i), theirs.get(i)
        if a == b or (a is None and b in pads) or (b is None and a in pads):
            continue
        raise ConfigError(
            f"online.teacher_model: the teacher's vocabulary ({teacher_path}, {len(theirs)} tokens) differs "
            f"from the student's ({student_path}, {len(mine)} tokens); first at id {i}: {a!r} in the "
            f"student's, {b!r} in the teacher's. On-policy distillation needs the same vocabulary token for "
            "token (the teacher scores the student's token ids)"
        )


def _by_id(tokenizer) -> dict[int, str]:
    """id -> token of every entry of ``tokenizer``'s vocabulary, added tokens included."""
    return {i: token for token, i in tokenizer.get_vocab().items()}
