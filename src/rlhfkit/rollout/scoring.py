"""Scores for sampled responses: a frozen reward model and/or Python reward functions.

The score of a response is the sum of the reward model's normalised score and the value of every reward
function. The reward model's raw score is read at the response's last real token by
:func:`rlhfkit.models.sequence_scores` (whatever the padding side or pad id); the reward trainer stores a
gain and a bias in the model's ``config.json`` (``rlhfkit_reward_gain``, ``rlhfkit_reward_bias``) that map
its scores on training responses to mean 0 and std 1 (Huang et al. 2024, reward normalisation), and the
score used here is ``gain * raw + bias`` (gain 1 and bias 0 for a model without them). A reward function is named in ``online.reward_functions`` as ``"pkg.module:fn"`` (an
importable module) or ``"path/to/file.py:fn"`` (a Python file, relative to the working folder), and is
called once per rollout with the whole batch::

    def fn(prompts: list, responses: list[str], records: list[dict]) -> Sequence[float]:
        ...

- ``prompts``: the prompt of each response as it is in the data (a string, or a list of chat messages);
  with ``online.group_size`` > 1 each prompt appears once per response;
- ``responses``: the text of each response, decoded without special tokens (no EOS, no pad) and cut at
  the stop token;
- ``records``: the data row of each prompt (extra fields, such as a reference answer, are there).

It returns one finite number per response (a list, tuple, numpy array or 1-D tensor). A wrong count,
``None``, NaN, inf or a non-number stops the run with a :class:`RewardFunctionError` that names the
function and the response (REFERENCES.md, bug 9: NaN rewards must never train silently).

Shapes: ``B`` responses, ``L`` prompt + response length.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.errors import ConfigError, UserError
from rlhfkit.models import sequence_scores, unwrap_model

RewardFunction = Callable[[list, list[str], list[dict]], Sequence[float]]

# Keys of a reward model's config.json written by the reward trainer: normalised = gain * raw + bias.
GAIN_KEY, BIAS_KEY = "rlhfkit_reward_gain", "rlhfkit_reward_bias"


def reward_normalization(model: torch.nn.Module) -> tuple[float, float]:
    """(gain, bias) stored in a reward model's config; (1.0, 0.0) when it has none."""
    config = unwrap_model(model).config
    return float(getattr(config, GAIN_KEY, 1.0)), float(getattr(config, BIAS_KEY, 0.0))


class RewardFunctionError(UserError):
    """A reward function returned something that is not one finite number per response."""


def load_reward_function(spec: str, where: str = "online.reward_functions") -> RewardFunction:
    """Import the function named by ``"pkg.module:fn"`` or ``"path/to/file.py:fn"``.

    Args:
        spec: the name, as in the configuration.
        where: the configuration key, for error messages.
    Raises:
        ConfigError: a malformed name, a missing file or module, a module that fails to import, or a
            name that is missing or not callable; the message names ``where`` and ``spec``.
    """
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
        raise ConfigError(f"{where}: importing {path} (from '{spec}') failed: {type(e).__name__}: {e}") from None
    return module


def check_function_scores(values: Any, count: int, name: str, prompts: list, responses: list[str]) -> torch.Tensor:
    """``values`` returned by reward function ``name`` as a ``(B,)`` float32 tensor, or a RewardFunctionError."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist() if values.dim() <= 1 else values
    elif hasattr(values, "tolist") and getattr(values, "ndim", 1) <= 1:  # numpy
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise RewardFunctionError(f"reward function '{name}' returned {type(values).__name__}; expected one number "
                                  f"per response (a list of {count} floats)")
    if len(values) != count:
        raise RewardFunctionError(f"reward function '{name}' returned {len(values)} values for {count} responses")
    out = []
    for i, v in enumerate(values):
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if not ok:
            shown = "None" if v is None else repr(v)
            raise RewardFunctionError(
                f"reward function '{name}' returned {shown} for response {i} (prompt {_short(prompts[i])}, "
                f"response {_short(responses[i])}); every value must be a finite number")
        out.append(float(v))
    return torch.tensor(out, dtype=torch.float32)


def _short(text: Any, limit: int = 60) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


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

    def __post_init__(self) -> None:
        if self.reward_model is None and not self.functions:
            raise ConfigError("nothing scores the responses: set online.reward_model and/or online.reward_functions")

    @classmethod
    def from_specs(cls, reward_model: torch.nn.Module | None, specs: Sequence[str],
                   batch_size: int | None = None) -> Scorer:
        """A scorer with the functions named in ``specs`` (``online.reward_functions``); each part is named
        after its function (``fn`` of ``"pkg.module:fn"``), with ``_<index>`` when two share a name."""
        short = [spec.rpartition(":")[2] for spec in specs]
        functions = [(name if short.count(name) == 1 else f"{name}_{i}",
                      load_reward_function(spec, f"online.reward_functions[{i}]"))
                     for i, (spec, name) in enumerate(zip(specs, short, strict=True))]
        return cls(reward_model, functions, batch_size)

    @property
    def needs_text(self) -> bool:
        """Whether :meth:`__call__` needs the prompts, response texts and records."""
        return bool(self.functions)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompts: list | None = None,
                 responses: list[str] | None = None, records: list[dict] | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score B responses.

        Args:
            input_ids, attention_mask: (B, L) prompt followed by response (any padding; the reward model's
                score is read at each row's last real token).
            prompts, responses, records: B each, for the reward functions (see the module docstring).
        Returns:
            (scores (B,) float32 on ``input_ids``' device: the sum of all parts; parts: name -> (B,), with
            ``"reward_model"`` for the model and each function's configured name).
        """
        batch = input_ids.shape[0]
        parts: dict[str, torch.Tensor] = {}
        if self.reward_model is not None:
            size = self.batch_size or batch
            gain, bias = reward_normalization(self.reward_model)
            raw = torch.cat([sequence_scores(self.reward_model, input_ids[i : i + size], attention_mask[i : i + size])
                             for i in range(0, batch, size)])  # (B,)
            parts["reward_model"] = raw.float() * gain + bias
        if self.functions:
            if prompts is None or responses is None or records is None:
                raise ValueError("reward functions need prompts, responses and records")
            for name, fn in self.functions:
                values = fn(list(prompts), list(responses), list(records))
                parts[name] = check_function_scores(values, batch, name, prompts, responses).to(input_ids.device)
        scores = torch.stack(list(parts.values())).sum(0)  # (B,)
        return scores, parts
