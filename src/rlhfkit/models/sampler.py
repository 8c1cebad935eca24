"""Which draw picks each sampled token of the hf backend (``online.sampler``), and the rows' random streams.

- ``exact`` (the default): rlhfkit's own draw (:func:`rlhfkit.algos.draw.inverse_cdf_draw`, exact in
  distribution, a few milliseconds per step) on a uniform that is a hash of (seed, prompt index, sample index,
  position) (:func:`rlhfkit.algos.draw.stream_uniforms`): a row's tokens do not depend on the batch it is
  generated in, on ``rollout_batch_size``, on micro-batching or on the number of processes (up to the logits'
  own rounding under another batch shape). ``generate`` runs greedy over what :class:`ExactDraw` returns:
  the processing of :mod:`rlhfkit.models.sampling` (suppressed ids, temperature, top-k, top-p: the same
  functions the scoring applies), the draw, then every entry -inf but the drawn token's.
- ``multinomial``: ``generate``'s own ``torch.multinomial`` on torch's global generator (the draw of earlier
  rlhfkit versions, kept to reproduce their records; one exponential variate per vocabulary entry and row,
  tens of milliseconds per step on a CPU).

:func:`set_sampler` makes one of them every sampler's of a model (rollouts, episodes, evaluation, the refresh,
``rlhfkit generate``), as :func:`rlhfkit.models.static_decode.set_decode` does for the cache.

Shapes: ``B`` rows, ``P`` prompt columns, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.algos.draw import inverse_cdf_draw, stream_uniforms
from rlhfkit.models.readout import hf_model
from rlhfkit.models.sampling import Sampling, _keep_mask_block

SAMPLERS = ("exact", "multinomial")
DEFAULT_SAMPLER = "exact"
_ATTRIBUTE = "rlhfkit_sampler"


def set_sampler(model: torch.nn.Module, sampler: str) -> torch.nn.Module:
    """Make ``sampler`` the draw of every sampling from ``model`` (:func:`rlhfkit.rollout.generate_responses`
    called without ``sampler``). Returns ``model``."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    setattr(hf_model(model), _ATTRIBUTE, sampler)
    return model


def sampler_of(model: torch.nn.Module) -> str:
    """The sampler :func:`set_sampler` gave ``model``, else :data:`DEFAULT_SAMPLER`."""
    return getattr(hf_model(model), _ATTRIBUTE, DEFAULT_SAMPLER)


@dataclass(frozen=True)
class RowStreams:
    """Which random stream each row of a generation call draws from.

    Attributes:
        seed: the stream's seed (a rollout's: derived from the run's seed and the rollout step).
        prompt_index: (B,) long, each row's prompt (its place in the whole rollout, all processes together).
        sample_index: (B,) long, each row's sample of its prompt (0 .. group_size - 1).

    The third number of a draw's stream is the drawn token's position in its whole row (the prompt's real
    tokens before it, a multi-turn episode's earlier turns included), so a row's turns draw apart.
    """

    seed: int
    prompt_index: torch.Tensor
    sample_index: torch.Tensor

    def __getitem__(self, rows: slice | torch.Tensor) -> RowStreams:
        """The streams of ``rows`` (a slice or an index tensor of this call's rows)."""
        return RowStreams(self.seed, self.prompt_index[rows], self.sample_index[rows])

    @classmethod
    def of_rows(cls, rows: int, device: torch.device | str = "cpu") -> RowStreams:
        """Streams for a caller that knows no row identity: prompt index = the row, one seed drawn from torch's
        global generator (so a seeded caller gets the same tokens again)."""
        seed = int(torch.randint(2**62, (1,)))
        index = torch.arange(rows, device=device)
        return cls(seed, index, torch.zeros_like(index))


class ExactDraw:
    """A ``generate`` logits processor that draws each row's token with rlhfkit's exact sampler and returns
    scores whose argmax is that token (``generate`` runs greedy; module docstring).

    Args:
        sampling: the processing (suppressed ids, temperature, top-k, top-p).
        streams: the rows' random streams.
        prompt_mask: (B, P) the left-padded prompts' mask: a row's first generated token has position
            ``prompt_mask[row].sum()``.
        keep_logprobs: record the processed log-prob of each drawn token (:attr:`logprobs`).
    """

    def __init__(
        self, sampling: Sampling, streams: RowStreams, prompt_mask: torch.Tensor, keep_logprobs: bool = False
    ):
        self.sampling, self.streams = sampling, streams
        self.prompt_columns = prompt_mask.shape[1]
        self.first_position = prompt_mask.sum(1).to(streams.prompt_index.device)  # (B,)
        self.keep_logprobs = keep_logprobs
        self.logprobs: list[torch.Tensor] = []  # per step, (B,) float32
        self._suppress: torch.Tensor | None = None

    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """The processed logits of one step, in place on ``generate``'s float32 copy ``scores`` (B, V): the
        values of :func:`rlhfkit.models.processed_logits` (suppressed ids -inf, ``/ temperature``, top-k, top-p
        in transformers' order and rules)."""
        sampling = self.sampling
        if sampling.suppress_ids:
            if self._suppress is None or self._suppress.device != scores.device:
                self._suppress = torch.as_tensor(
                    sampling.suppress_ids, dtype=torch.long, device=scores.device
                )
            scores.index_fill_(-1, self._suppress, float("-inf"))
        if sampling.temperature != 1.0:
            scores.div_(sampling.temperature)
        if sampling.truncates:
            keep = _keep_mask_block(scores[:, None], sampling)[:, 0]  # (B, V)
            scores.masked_fill_(~keep, float("-inf"))
        return scores

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = self.process(scores)  # (B, V)
        probs = torch.softmax(scores, dim=-1)  # (B, V): what torch.multinomial is given under `multinomial`
        streams = self.streams
        position = self.first_position + (input_ids.shape[1] - self.prompt_columns)  # (B,)
        uniforms = stream_uniforms(streams.seed, streams.prompt_index, streams.sample_index, position)
        tokens = inverse_cdf_draw(probs, uniforms.to(probs.device))  # (B,)
        if self.keep_logprobs:
            self.logprobs.append(torch.log_softmax(scores, -1).gather(1, tokens[:, None]).squeeze(1))
        return scores.fill_(float("-inf")).scatter_(1, tokens[:, None], 0.0)  # argmax = the drawn token
