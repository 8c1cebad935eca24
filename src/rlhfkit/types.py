"""The batches that flow between layers: plain dataclasses of tensors, every shape in the docstring.

Shapes: ``B`` sequences (or pairs), ``P`` padded prompt length, ``T`` response length, ``L`` padded
full length. Masks are bool or 0/1; ``mask`` is 1 on real response tokens. Optional fields are None
until the stage that fills them has run (a rollout is scored, then shaped, then given advantages).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch


class _TensorBatch:
    """Row selection and device moves shared by the batch dataclasses: every tensor field has B rows."""

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @property
    def batch_size(self) -> int:
        """B, the number of rows."""
        return next(len(x) for x in self._tensors().values() if x is not None)

    def _check_rows(self) -> None:
        sizes = {name: len(x) for name, x in self._tensors().items() if x is not None}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"{type(self).__name__}: fields disagree on the batch size: {sizes}")

    def select(self, index: torch.Tensor | slice | list[int]):
        """The rows ``index`` (a slice, a list or a ``(b,)`` long/bool tensor) of every tensor field."""
        return dataclasses.replace(
            self,  # type: ignore[arg-type]
            **{name: None if x is None else x[index] for name, x in self._tensors().items()},
        )

    def to(self, device: torch.device | str):
        """The same batch with every tensor on ``device``."""
        return dataclasses.replace(
            self,  # type: ignore[arg-type]
            **{name: None if x is None else x.to(device) for name, x in self._tensors().items()},
        )


@dataclass
class Rollout(_TensorBatch):
    """One PPO / GRPO / RLOO / REINFORCE++ rollout: sampled responses and everything computed on them.

    Attributes:
        query_ids: ``(B, P)`` long, the prompts, left padded.
        query_mask: ``(B, P)`` 1 on real prompt tokens.
        response_ids: ``(B, T)`` long, the sampled responses, right padded (pad id after the stop token).
        mask: ``(B, T)`` bool, True on response tokens up to and including the first stop token.
        logprobs: ``(B, T)`` log pi_old(y_t | ...) at the sampling temperature, read when sampling
            (the ``old_logprobs`` of the PPO ratio).
        ref_logprobs: ``(B, T)`` log pi_ref(y_t | ...), the frozen reference policy, same temperature.
        scores: ``(B,)`` one score per sequence (reward model and/or reward functions), or ``(B, T)``
            dense scores from a process reward model.
        values: ``(B, T)`` the critic's V_t at sampling time (the ``old_values``); None without a critic.
        rewards: ``(B, T)`` per-token rewards: -kl_coef * kl_t plus the score (``shape_rewards``).
        kl: ``(B, T)`` per-token KL estimate that was put into ``rewards``.
        advantages: ``(B, T)``; 0 at masked positions.
        returns: ``(B, T)`` value targets; 0 at masked positions.
        group_ids: ``(B,)`` long, the prompt each response answers (responses of one prompt share an id).
        ended: ``(B,)`` bool, True where the response contains a stop token.
        response_mask: ``(B, T)`` bool, the response up to and including its first stop token, also where
            ``mask`` leaves it out of the loss (``online.missing_eos=mask``, or nothing scored it): what the
            reward model reads and the samples show. None until sampled.
        entropy: ``(B, T)`` the actor's entropy at each position of ``mask`` at sampling time (0 elsewhere).
        engine_logprobs: ``(B, T)`` log pi_engine(y_t) under the sampling processing, as the generation engine
            sampled (``online.generation_backend=vllm``; 0 at masked positions); None with ``hf``.
        teacher_logprobs: ``(B, T)`` log pi_teacher(y_t | ...) of a distillation teacher
            (``online.teacher_model``), same processing as ``logprobs``; None without one.
    """

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    scores: torch.Tensor | None = None
    values: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    ended: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    engine_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._check_rows()
        T = self.response_ids.shape[-1]
        for name in (
            "mask",
            "logprobs",
            "ref_logprobs",
            "values",
            "rewards",
            "kl",
            "advantages",
            "returns",
            "response_mask",
            "entropy",
            "engine_logprobs",
            "teacher_logprobs",
        ):
            x = getattr(self, name)
            if x is not None and x.shape[-1] != T:
                raise ValueError(f"Rollout.{name} has {x.shape[-1]} response positions, response_ids {T}")


@dataclass
class PreferenceBatch(_TensorBatch):
    """Pairs for a Bradley-Terry reward model or DPO: prompt + chosen and prompt + rejected.

    Attributes:
        chosen_input_ids: ``(B, L)`` long, prompt followed by the preferred response.
        chosen_attention_mask: ``(B, L)`` 1 on real tokens.
        rejected_input_ids: ``(B, L)`` long, the same prompt followed by the other response.
        rejected_attention_mask: ``(B, L)``.
        margin: ``(B,)`` optional preference strength (e.g. a rating gap), subtracted inside the loss.
    """

    chosen_input_ids: torch.Tensor
    chosen_attention_mask: torch.Tensor
    rejected_input_ids: torch.Tensor
    rejected_attention_mask: torch.Tensor
    margin: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._check_rows()

    @classmethod
    def from_dict(cls, batch: dict[str, torch.Tensor]) -> PreferenceBatch:
        """From a collator's dict (keys as the field names; other keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in batch.items() if k in names})
