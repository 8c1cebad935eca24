"""A run folder read once for the report, and readable names for the keys of its metrics and summary."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhfkit.config import read_run_info
from rlhfkit.engine.metrics_writer import flatten_dict, read_metrics
from rlhfkit.errors import UserError
from rlhfkit.reporting.sample_file import TEACHER_SAMPLES_FILE, SampleFile, read_samples, read_side_by_side
from rlhfkit.rollout.scoring import function_names

ONLINE_KINDS = ("ppo", "grpo", "rloo", "distill")
HELDOUT_SCORES = "heldout_scores.jsonl"  # written by the reward trainer: the final model's held-out scores

# Metric key -> the words a person reads. Keys not listed are shown as they are, '/' and '_' as spaces.
LABELS: dict[str, str] = {
    "score/mean": "trained score",
    "score/raw_mean": "score before the missing-EOS rule and clipping",
    "score/penalised_frac": "responses penalised for not ending (missing EOS)",
    "score/unscored": "responses that nothing scored",
    "gold/mean": "gold score",
    "eval/score/mean": "held-out score",
    "eval/gold/mean": "held-out gold score",
    "eval/kl/mean": "held-out KL (nats / response)",
    "eval/valid_rate": "held-out valid responses",
    "eval/response_length/mean": "held-out response length",
    "eval/response/ended_frac": "held-out responses that end",
    "kl/mean": "KL to the reference (nats / response)",
    "kl/per_token": "KL to the reference (nats / token)",
    "kl_coef": "KL coefficient",
    "distill/teacher_kl": "KL to the teacher (nats / token)",
    "eval/distill/teacher_kl": "held-out KL to the teacher (nats / token)",
    "entropy/mean": "entropy (nats / token)",
    "response_length/mean": "response length (tokens)",
    "response/ended_frac": "responses that end with a stop token",
    "response/trained_frac": "responses trained on",
    "clipfrac": "policy clip fraction",
    "approx_kl": "approx. KL between updates",
    "ratio/mean": "probability ratio",
    "value/clipfrac": "value clip fraction",
    "value/explained_variance": "value explained variance",
    "loss/policy": "policy loss",
    "loss/value": "value loss",
    "loss/entropy": "entropy term",
    "loss": "training loss",
    "eval/loss": "held-out loss",
    "accuracy": "accuracy (train)",
    "eval/accuracy": "held-out accuracy vs labels",
    "eval/gold_accuracy": "held-out accuracy vs gold",
    "grad_norm": "gradient norm",
    "grad_norm/actor": "gradient norm, actor",
    "grad_norm/critic": "gradient norm, critic",
    "learning_rate": "learning rate",
    "learning_rate/actor": "learning rate, actor",
    "learning_rate/critic": "learning rate, critic",
    "tools/calls_per_episode": "tool calls per episode",
    "tools/errors": "tool calls that failed (share of calls)",
    "turns/mean": "model turns per episode",
    "episodes/truncated": "episodes cut by the length budget",
    "episodes/max_turns": "episodes stopped at max_turns",
    "tokens_per_second": "response tokens / s",
    "time/step_seconds": "seconds per step",
    # summary.json keys (flattened with dots)
    "kl_mean": "KL to the reference (nats / response)",
    "score_mean": "mean score (reward model)",  # a reward model's summary; online runs: Run.label
    "score_raw_mean": "score before the missing-EOS rule and clipping",
    "score_penalised_frac": "responses penalised for not ending (missing EOS)",
    "response_ended_frac": "responses that end with a stop token",
    "gold_mean": "gold score",
    "proxy_mean": "proxy score (reward model)",
    "heldout_accuracy": "held-out accuracy",
    "heldout_gold_accuracy": "held-out accuracy vs gold",
    "win_rate_vs_sft": "win rate vs SFT (gold judge)",
    "win_rate_vs_sft_greedy": "win rate vs SFT, greedy",
    "wall_seconds": "wall time (s)",
}


def label(key: str) -> str:
    """Readable words for a metric or (dotted, flattened) summary key: ``eval.eval/gold/mean`` ->
    ``held-out gold score``; ``ppo.kl_mean`` -> ``ppo: KL to the reference (nats / response)``."""
    head, _, tail = key.rpartition(".")
    if head.endswith(".eval") or head == "eval":  # {"eval": {"eval/x": ..}} flattened repeats the prefix
        head = head[: -len("eval")].rstrip(".")
    words = LABELS.get(tail) or LABELS.get(tail.replace("_", "/")) or tail.replace("/", " ").replace("_", " ")
    if tail.startswith("tools/errors/"):
        words = f"tool calls that failed: {tail[len('tools/errors/') :].replace('_', ' ')} (share of calls)"
    elif tail.startswith("tools/calls/"):
        words = f"calls of {tail[len('tools/calls/') :]} per episode"
    if tail.startswith("eval/") and tail not in LABELS:
        words = "held-out " + tail[len("eval/") :].replace("/", " ").replace("_", " ")
    return f"{head.replace('.', ' ').replace('_', ' ')}: {words}" if head else words


def fmt(value: Any) -> str:
    """A number as 4 significant digits; None and non-finite as ``n/a``."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@dataclass
class Run:
    """What the report reads from one run folder."""

    path: Path
    name: str
    kind: str  # sft, reward, prm, ppo, grpo, rloo, or "run" when unknown
    rows: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    samples: SampleFile = field(default_factory=lambda: SampleFile([]))
    side_by_side: list[dict[str, Any]] = field(default_factory=list)  # a teacher's run: teacher_samples.jsonl
    heldout_scores: list[dict[str, Any]] = field(default_factory=list)
    run_info: dict[str, Any] = field(default_factory=dict)  # config.yaml's run line (how it was launched)

    @property
    def online(self) -> bool:
        return self.kind in ONLINE_KINDS

    @property
    def step_label(self) -> str:
        """The x axis words: what one step of this run is."""
        if self.online:
            return "rollout"
        if self.kind in ("sft", "reward", "prm", "dpo"):
            return "optimizer step"
        return "step"

    @property
    def kl_estimator(self) -> str | None:
        """The KL estimator the run trained with (``online.kl_estimator``), None when unknown."""
        online = self.config.get("online")
        return online.get("kl_estimator") if isinstance(online, dict) else None

    @property
    def reward_parts(self) -> list[str]:
        """The names the run's score parts are logged under (``score/<name>``): ``reward_model`` for
        ``online.reward_model``, then each of ``online.reward_functions`` (:func:`function_names`)."""
        online = self.config.get("online")
        if not self.online or not isinstance(online, dict):
            return []
        specs = online.get("reward_functions") or []
        names = ["reward_model"] if online.get("reward_model") else []
        return names + function_names([str(spec) for spec in specs])

    @property
    def reward_source(self) -> str | None:
        """What scored the responses, in words (``reward model``, ``reward function accuracy``, ``reward
        model + reward functions a, b``); None when the configuration does not say."""
        parts = self.reward_parts
        functions = [p for p in parts if p != "reward_model"]
        words = ["reward model"] if "reward_model" in parts else []
        if functions:
            words.append(f"reward function{'s' if len(functions) > 1 else ''} {', '.join(functions)}")
        return " + ".join(words) or None

    @property
    def scored(self) -> bool:
        """Whether anything besides a distillation teacher scored the responses (a reward model, reward
        functions, an environment or the missing-EOS penalty): `train distill` alone logs a score of 0
        throughout."""
        online = self.config.get("online")
        if not isinstance(online, dict) or not online.get("teacher_model"):
            return True
        return bool(self.reward_parts or online.get("environment") or self.penalised)

    @property
    def penalised(self) -> bool:
        """Whether the trained score replaces a response's score when it does not end
        (``online.missing_eos=penalty``, the default)."""
        online = self.config.get("online")
        return self.online and (
            not isinstance(online, dict) or online.get("missing_eos", "penalty") == "penalty"
        )

    def label(self, key: str) -> str:
        """:func:`label`, with the scores of an online run named after what scored them: ``trained score
        (reward function accuracy + missing-EOS penalty)``, ``accuracy: reward function's own score``."""
        head, _, tail = key.rpartition(".")
        metric = (
            tail if "/" in tail else "score/" + tail[len("score_") :] if tail.startswith("score_") else ""
        )
        if not self.online or not metric:
            return label(key)
        words = self._score_words(metric)
        if words is None:  # the summary's score_x is the metric score/x
            return label(f"{head}.{metric}" if head else metric)
        head = "" if head in ("", "eval") else head
        return f"{head.replace('.', ' ').replace('_', ' ')}: {words}" if head else words

    def _score_words(self, metric: str) -> str | None:
        source = self.reward_source
        if source is None:
            return None
        online = self.config.get("online") or {}
        if metric == "score/mean":
            rules = (" + missing-EOS penalty" if self.penalised else "") + (
                ", clipped" if online.get("score_clip") is not None else ""
            )
            return f"trained score ({source}{rules})"
        if metric == "score/raw_mean":
            return f"score before the missing-EOS rule and clipping ({source})"
        if metric == "eval/score/mean":
            return f"held-out score ({source}, before the missing-EOS rule)"
        part = metric[len("score/") :] if metric.startswith("score/") else None
        if part == "reward_model" and part in self.reward_parts:
            return "reward model: its own score"
        if part in self.reward_parts:
            return f"{part}: reward function's own score"
        return None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the rows that logged it as a finite number."""
        xs, ys = [], []
        for row in self.rows:
            value = row.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                xs.append(row["step"])
                ys.append(float(value))
        return xs, ys

    def keys_under(self, prefix: str) -> list[str]:
        """The metric keys of the run that start with ``prefix``, sorted (e.g. each tool's ``tools/calls/<name>``)."""
        return sorted({key for row in self.rows for key in row if key.startswith(prefix)})

    @property
    def setup(self) -> str | None:
        """The model, LoRA and precision of the run in words (``config.yaml`` and its run line), e.g.
        ``model runs/sft/final; LoRA rank 16, alpha 32 on all-linear; precision bfloat16 (model.dtype auto)``;
        None without a configuration."""
        model = self.config.get("model")
        if not isinstance(model, dict) or not model.get("name_or_path"):
            return None
        rank = model.get("lora_rank") or 0
        lora = (
            f"LoRA rank {rank}, alpha {fmt(model.get('lora_alpha'))} on {model.get('lora_target_modules')}"
            if rank
            else "no LoRA (full fine-tuning)"
        )
        dtype, resolved = model.get("dtype", "auto"), self.run_info.get("precision")
        if dtype != "auto":
            precision = str(dtype)
        elif resolved:
            precision = f"{resolved} (model.dtype auto)"
        else:
            precision = "model.dtype auto (float32 on CPU, bfloat16 on a GPU that supports it)"
        return f"model {model['name_or_path']}; {lora}; precision {precision}"

    def flat_summary(self) -> dict[str, Any]:
        return flatten_dict(self.summary)


def load_run(run_dir: str | Path, name: str | None = None) -> Run:
    """Read a run folder; a :class:`UserError` when it has no metrics."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path}: no metrics.jsonl; is this an rlhfkit run folder?")
    rows = read_metrics(metrics)
    if not rows:
        raise UserError(f"{metrics}: no metrics logged yet")
    summary = _json(path / "summary.json")
    config = _yaml(path / "config.yaml")
    run_info = _run_info(path / "config.yaml")
    kind = str(config.get("kind") or summary.get("kind") or _guess_kind(rows))
    return Run(
        path=path,
        name=name or path.resolve().name,
        kind=kind,
        rows=rows,
        summary=summary,
        config=config,
        samples=read_samples(path / "samples.jsonl"),
        side_by_side=read_side_by_side(path / TEACHER_SAMPLES_FILE),
        heldout_scores=_jsonl(path / HELDOUT_SCORES),
        run_info=run_info,
    )


def _run_info(path: Path) -> dict[str, Any]:
    """The run line of ``config.yaml`` (:func:`rlhfkit.config.read_run_info`), {} without one."""
    if not path.is_file():
        return {}
    try:
        info = read_run_info(path)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _guess_kind(rows: list[dict[str, Any]]) -> str:
    keys = set().union(*rows)
    if "kl/mean" in keys:
        return "ppo"
    if "accuracy" in keys or "eval/accuracy" in keys:
        return "reward"
    return "run"


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return {}  # the configuration only names the run's kind here; the metrics still make a report
    return data if isinstance(data, dict) else {}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out
