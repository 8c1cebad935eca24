"""Scores for sampled responses: a frozen reward model and/or Python reward functions.

The score of a response is the sum of the reward model's normalised score and the value of every reward
function. The reward model's raw score is read at the response's last real token by
:func:`rlhfkit.models.sequence_scores` (whatever the padding side or pad id); the reward trainer stores a
gain and a bias in the model's ``config.json`` (``rlhfkit_reward_gain``, ``rlhfkit_reward_bias``) that map
its scores on training responses to mean 0 and std 1 (Huang et al. 2024, reward normalisation), and the
score used here is ``gain * raw + bias`` (gain 1 and bias 0 for a model without them).

Reward functions follow TRL's convention, so a function written for TRL's GRPOTrainer runs unchanged. One
is named in ``online.reward_functions`` as ``"pkg.module:fn"`` (an importable module) or
``"path/to/file.py:fn"`` (a Python file, relative to the working folder); loading it imports that module,
i.e. runs its code with your permissions, as ``python file.py`` would. It is called once per rollout with
keywords, one list entry per response::

    def fn(prompts, completions, **kwargs) -> list[float | None]:
        ...

- ``prompts``: each response's prompt as it is in the data (a string, or a list of chat messages); with
  ``online.group_size`` > 1 each prompt appears once per response;
- ``completions``: the text of each response, decoded without special tokens and cut at the stop token;
  for a conversational prompt, as TRL gives it: ``[{"role": "assistant", "content": text}]``;
- ``completion_ids``: the response's token ids (up to and including the stop token);
- every other column of the prompt dataset (e.g. ``answer``), under its own name (``None`` where a row
  holds null or lacks it). A row without a column that a function takes without a default is refused
  before training, naming the file, the row and the column (:mod:`rlhfkit.rollout.preflight`): write
  ``"answer": null`` in a row the function scores without one. TRL's ``trainer_state`` is not passed.

A function without ``**kwargs`` gets only the keywords it names; one that needs a keyword that is not
there (a column the data lacks) is refused before training. It returns one value per response (a list,
tuple, numpy array or 1-D tensor): a finite number, or ``None`` for "no opinion" (e.g. a maths checker
asked about a poem). A response that no part scores (every function said None and there is no reward
model) is left out of the loss and counted (``score/unscored``). A function that raises, or returns a
wrong count, NaN, inf or a non-number, stops the run with a :class:`RewardFunctionError` that names the
function and the response (docs/known-bugs.md, 9: NaN rewards must never train silently).

Shapes: ``B`` responses, ``L`` prompt + response length.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.errors import ConfigError, UserError
from rlhfkit.models import response_values, sequence_scores, unwrap_model
from rlhfkit.rollout.sandbox import BUILT_IN

RewardFunction = Callable[..., Sequence[float | None]]

# Keys of a reward model's config.json written by the reward trainer: normalised = gain * raw + bias.
GAIN_KEY, BIAS_KEY = "rlhfkit_reward_gain", "rlhfkit_reward_bias"


def reward_normalization(model: torch.nn.Module) -> tuple[float, float]:
    """(gain, bias) stored in a reward model's config; (1.0, 0.0) when it has none."""
    config = unwrap_model(model).config
    return float(getattr(config, GAIN_KEY, 1.0)), float(getattr(config, BIAS_KEY, 0.0))


def critic_values(
    critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: int
) -> torch.Tensor:
    """V(x, y_<t) for every response position as PPO reads it: the value head's output under the normalisation
    stored in the critic's config, ``gain * head + bias``, the scale the rewards are on (a critic made from a
    reward model then starts at the normalised scores; Huang et al. 2024 initialise the critic from the reward
    model). The one value read of the trainer (stages 1 and 5) and of ``examples/experiments/gae_lambda.py``.

    Args:
        input_ids, attention_mask: (B, L) = prompts (left padded) then responses (right padded).
        response_start: p0, the column of the first response token (>= 1).
    Returns:
        (B, R) float32; ``[:, t]`` is V(x, y_<t).
    """
    gain, bias = reward_normalization(critic)
    return response_values(critic, input_ids, attention_mask, response_start).float() * gain + bias  # (B, R)


# Names the online trainer logs as ``score/<name>`` itself: a reward function is never logged under one.
RESERVED_SCORE_NAMES = frozenset(
    {"mean", "raw_mean", "unscored", "penalised_frac", "process_mean", "process_steps", "reward_model"}
)


def function_names(specs: Sequence[str]) -> list[str]:
    """The name of each reward function in ``specs``, as its score part (``score/<name>`` in metrics.jsonl,
    ``parts`` in samples): the function's own name (``fn`` of ``"pkg.module:fn"``), with ``_<index>`` when two
    share a name or the name is one the trainer logs itself (:data:`RESERVED_SCORE_NAMES`)."""
    short = [spec.rpartition(":")[2] for spec in specs]
    return [
        name if short.count(name) == 1 and name not in RESERVED_SCORE_NAMES else f"{name}_{i}"
        for i, name in enumerate(short)
    ]


class RewardFunctionError(UserError):
    """A reward function returned something that is not one finite number per response."""


def load_reward_function(spec: str, where: str = "online.reward_functions") -> RewardFunction:
    """Import the function named by ``"pkg.module:fn"`` or ``"path/to/file.py:fn"`` (or a :data:`BUILT_IN`
    short name such as ``"rlhfkit:python"``).

    Args:
        spec: the name, as in the configuration.
        where: the configuration key, for error messages.
    Raises:
        ConfigError: a malformed name, a missing file or module, a module that fails to import, or a
            name that is missing or not callable; the message names ``where`` and ``spec``.
    """
    spec = BUILT_IN.get(spec, spec)
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ConfigError(f"{where}: '{spec}' is not 'pkg.module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _import_file(target, spec, where)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(f"{where}: cannot import module '{target}' for '{spec}': {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"{where}: '{target}' has no attribute '{name}' (from '{spec}')")
    if not callable(fn):
        raise ConfigError(f"{where}: '{spec}' is a {type(fn).__name__}, not a function")
    return fn


def _import_file(path: str, spec: str, where: str):
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ConfigError(f"{where}: file not found: {path} (from '{spec}')")
    # A unique module name per file, so two files called rewards.py do not replace each other.
    stem = os.path.splitext(os.path.basename(full))[0]
    module_name = f"rlhfkit_reward_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling inside the file look it up
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ConfigError(
            f"{where}: importing {path} (from '{spec}') failed: {type(e).__name__}: {e}"
        ) from None
    return module


def accepted_keywords(fn: Callable) -> tuple[set[str] | None, set[str]]:
    """(the keywords ``fn`` takes, None when it has ``**kwargs``; the ones it requires)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return None, set()
    accepted, required, open_ended = set(), set(), False
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            open_ended = True
        elif param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            accepted.add(param.name)
            if param.default is param.empty:
                required.add(param.name)
        elif param.kind is param.POSITIONAL_ONLY and param.default is param.empty:
            required.add(param.name)  # never passed (keywords only), so always missing
    return (None if open_ended else accepted), required


# Keywords every call has; the prompt dataset's columns are passed besides them.
CALL_KEYWORDS = ("prompts", "completions", "completion_ids")
EPISODE_KEYWORDS = ("environments",)  # also passed in runs with online.environment (multi-turn episodes)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_signature(
    name: str, fn: Callable, columns: Sequence[str], where: str = "online.reward_functions"
) -> None:
    """A ConfigError, before any model loads, when ``fn`` requires a keyword that no call will have."""
    _, required = accepted_keywords(fn)
    missing = sorted(required - set(CALL_KEYWORDS) - set(columns))
    if missing:
        shown = ", ".join(columns) or "none"
        raise ConfigError(
            f"{where}: reward function '{name}' requires {', '.join(repr(m) for m in missing)}, but it is called with "
            f"keywords prompts=, completions=, completion_ids= and the prompt data's other columns ({shown}), "
            "TRL's convention: def fn(prompts, completions, **kwargs) -> list[float | None]"
        )


def check_function_scores(
    values: Any, count: int, name: str, prompts: list, responses: list[str]
) -> torch.Tensor:
    """``values`` returned by reward function ``name`` as a ``(B,)`` float32 tensor with NaN where it returned
    None (no opinion), or a RewardFunctionError."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist() if values.dim() <= 1 else values
    elif hasattr(values, "tolist") and getattr(values, "ndim", 1) <= 1:  # numpy
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise RewardFunctionError(
            f"reward function '{name}' returned {type(values).__name__}; expected one number "
            f"(or None) per response: a list of {count}"
        )
    if len(values) != count:
        raise RewardFunctionError(
            f"reward function '{name}' returned {len(values)} values for {count} responses"
        )
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        # Finite in float32, where scores are kept: 1e300 is finite in Python but inf in float32.
        ok = (
            isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and abs(v) <= FLOAT32_MAX
        )
        if not ok:
            raise RewardFunctionError(
                f"reward function '{name}' returned {v!r} for response {i} (prompt {_short(prompts[i])}, "
                f"response {_short(responses[i])}); every value must be a finite number (at most "
                f"{FLOAT32_MAX:.3g} in magnitude, a float32), or None for no opinion"
            )
        out.append(float(v))
    return torch.tensor(out, dtype=torch.float32)


def _short(text: Any, limit: int = 60) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _raised_at(error: BaseException) -> str:
    """``file:line`` of the innermost frame of ``error``'s traceback (where the user's code raised)."""
    frames = traceback.extract_tb(error.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


@dataclass
class Scorer:
    """Scores responses with a reward model and/or reward functions (see the module docstring).

    Attributes:
        reward_model: a frozen scalar model (``load_scalar_model``), or None; its stored normalisation is
            applied (see the module docstring).
        functions: ``(name, function)`` pairs, in the order of the configuration.
        batch_size: rows per reward-model forward (None = all at once).
    """

    reward_model: torch.nn.Module | None = None
    functions: list[tuple[str, RewardFunction]] = field(default_factory=list)
    batch_size: int | None = None

    # True when the caller adds a part of its own (an environment's get_reward, rlhfkit.rollout.episodes;
    # a distillation teacher's per-token term, rlhfkit.trainers.online.shaping):
    # a scorer with neither a model nor functions is then allowed, and gives no parts.
    extra_parts: bool = False
    # One weight per function (online.reward_weights, TRL's reward_weights); None = all 1.
    weights: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if self.reward_model is None and not self.functions and not self.extra_parts:
            raise ConfigError(
                "nothing scores the responses: set online.reward_model and/or online.reward_functions"
            )
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ConfigError(
                f"online.reward_weights: {len(self.weights)} weight(s) for {len(self.functions)} reward "
                "function(s); give one weight per function, in their order"
            )

    @property
    def part_weights(self) -> dict[str, float]:
        """Each function's weight by its part name (:func:`combine_parts`); parts not named weigh 1."""
        if self.weights is None:
            return {}
        return {name: float(w) for (name, _), w in zip(self.functions, self.weights, strict=True)}

    @staticmethod
    def load_functions(
        specs: Sequence[str], where: str = "online.reward_functions"
    ) -> list[tuple[str, RewardFunction]]:
        """The functions named in ``specs`` (``online.reward_functions``), each under its
        :func:`function_names` name; ``where`` names the setting in error messages."""
        return [
            (name, load_reward_function(spec, f"{where}[{i}]"))
            for i, (spec, name) in enumerate(zip(specs, function_names(specs), strict=True))
        ]

    @classmethod
    def from_specs(
        cls, reward_model: torch.nn.Module | None, specs: Sequence[str], batch_size: int | None = None
    ) -> Scorer:
        """A scorer with the functions named in ``specs`` (see :meth:`load_functions`)."""
        return cls(reward_model, cls.load_functions(specs), batch_size)

    @property
    def needs_text(self) -> bool:
        """Whether :meth:`__call__` needs the prompts, response texts and records."""
        return bool(self.functions)

    def check_columns(self, columns: Sequence[str], where: str = "online.reward_functions") -> None:
        """Refuse, before training, a function that requires a keyword no call will have
        (:func:`check_signature`); ``where`` names the setting in error messages."""
        for i, (name, fn) in enumerate(self.functions):
            check_signature(name, fn, columns, f"{where}[{i}]")

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompts: list | None = None,
        responses: list[str] | None = None,
        records: list[dict] | None = None,
        completion_ids: list[list[int]] | None = None,
        episodes: dict[str, list] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Score B responses.

        Args:
            input_ids, attention_mask: (B, L) prompt followed by response (any padding; the reward model's
                score is read at each row's last real token).
            prompts, responses, records: B each, for the reward functions: the prompt, the response text and
                the data row (its columns become keywords); see the module docstring.
            completion_ids: B token-id lists (default: none passed, an empty list each).
            episodes: multi-turn episodes' keywords (:mod:`rlhfkit.rollout.episodes`): ``completions`` (each
                episode's messages after its prompt, replacing the one-message completions) and
                ``environments`` (each episode's environment); None for single-turn responses.
        Returns:
            (scores (B,) float32 on ``input_ids``' device: the sum of the parts that have an opinion, 0 where
            none has; parts: name -> (B,), ``"reward_model"`` for the model and each function's configured name,
            NaN where a function returned None; scored (B,) bool: some part has an opinion).
        """
        batch = input_ids.shape[0]
        parts: dict[str, torch.Tensor] = {}
        if self.reward_model is not None:
            size = self.batch_size or batch
            gain, bias = reward_normalization(self.reward_model)
            raw = torch.cat(
                [
                    sequence_scores(self.reward_model, input_ids[i : i + size], attention_mask[i : i + size])
                    for i in range(0, batch, size)
                ]
            )  # (B,)
            parts["reward_model"] = raw.float() * gain + bias
        if self.functions:
            if prompts is None or responses is None or records is None:
                raise ValueError("reward functions need prompts, responses and records")
            parts.update(
                self.function_parts(prompts, responses, records, completion_ids, input_ids.device, episodes)
            )
        scores, scored = combine_parts(parts, self.part_weights)
        return scores, parts, scored

    def function_parts(
        self,
        prompts: list,
        responses: list[str],
        records: list[dict],
        completion_ids: list[list[int]] | None = None,
        device: torch.device | str = "cpu",
        episodes: dict[str, list] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Each reward function's scores of B responses: name -> (B,) float32 on ``device``, NaN where it
        returned None (arguments as :meth:`__call__`'s)."""
        keywords = {**self.keywords(prompts, responses, records, completion_ids), **(episodes or {})}
        parts = {}
        for name, fn in self.functions:
            accepted, _ = accepted_keywords(fn)
            given = keywords if accepted is None else {k: v for k, v in keywords.items() if k in accepted}
            try:
                values = fn(**{k: list(v) for k, v in given.items()})
            except Exception as e:  # the user's code: any error stops the run, named
                raise RewardFunctionError(
                    f"reward function '{name}' raised {type(e).__name__}: {e}{_raised_at(e)}"
                ) from e
            parts[name] = check_function_scores(values, len(responses), name, prompts, responses).to(device)
        return parts

    @staticmethod
    def keywords(
        prompts: list,
        responses: list[str],
        records: list[dict],
        completion_ids: list[list[int]] | None = None,
    ) -> dict[str, list]:
        """The keyword arguments of a reward-function call (TRL's convention; module docstring)."""
        completions = [
            [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
            for prompt, text in zip(prompts, responses, strict=True)
        ]
        out = {
            "prompts": list(prompts),
            "completions": completions,
            "completion_ids": completion_ids if completion_ids is not None else [[] for _ in responses],
        }
        for column in data_columns(records):
            out[column] = [record.get(column) for record in records]
        return out


def combine_parts(
    parts: dict[str, torch.Tensor], weights: dict[str, float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (B,): the weighted sum of the parts that have an opinion, 0 where none has; scored (B,) bool:
    some part has an opinion) of score parts name -> (B,), NaN for no opinion. ``weights``: part name -> its
    weight (``online.reward_weights``, as TRL's ``(rewards_per_func * reward_weights).nansum(dim=1)``); a part
    not named weighs 1."""
    weights = weights or {}
    stacked = torch.stack(list(parts.values()))  # (K, B)
    scale = torch.tensor(
        [weights.get(name, 1.0) for name in parts], dtype=stacked.dtype, device=stacked.device
    )
    scored = ~stacked.isnan().all(0)  # (B,)
    return (stacked.nan_to_num(0.0) * scale[:, None]).sum(0), scored  # NaN (no opinion) adds nothing


def data_columns(records: Sequence[dict]) -> list[str]:
    """The columns of prompt records passed to reward functions as keywords: all but the prompt (which is
    ``prompts``) and the names the call uses itself, in first-seen order."""
    seen: dict[str, None] = {}
    for record in records:
        for key in record:
            if key not in ("prompt", "completion", *CALL_KEYWORDS, *EPISODE_KEYWORDS):
                seen.setdefault(key, None)
    return list(seen)
