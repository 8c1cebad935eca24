"""The warning signs of an online (PPO-family) run, each one stated rule over ``metrics.jsonl``.

What to watch besides the reward (Zheng et al. 2023, "Secrets of RLHF in Large Language Models Part I",
section 5: KL, response length and perplexity; Huang et al. 2024, "The N+ Implementation Details of RLHF
with PPO": clip fraction, approx-KL and ratio as the health of the PPO update; Gao et al. 2022: the gold
score falling while the proxy still rises is reward-model overoptimization). The thresholds are rules of
thumb, named below, not laws: a flag says "look here", and the page prints the rule beside it.

Trend rules compare the mean of the last third of the logged points with the first third (``early`` /
``late``), so one noisy point does not flag a run; they need at least :data:`MIN_POINTS` points.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

MIN_POINTS = 6
KL_GROWTH = 2.0  # late KL > 2x the middle third's, and above KL_FLOOR nats per response: still running away
KL_FLOOR = 1.0
CLIPFRAC_HIGH = 0.2  # a clip fraction above ~0.1-0.2 means updates that the clip cuts short
APPROX_KL_HIGH = 0.02  # between the policy before and after an update; early stopping targets ~0.01-0.02
RATIO_BAND = 0.1  # mean probability ratio outside [0.9, 1.1]
ENTROPY_COLLAPSE = 0.25  # late entropy below a quarter of the early entropy
LENGTH_BLOWUP = 1.5  # late length above 1.5x the early length
ENDED_LOW = 0.5  # fewer than half the responses end with a stop token
GRAD_SPIKE = 10.0  # a gradient norm above 10x the run's median
STOPPING_SHARE = 0.5  # more than half of the trained score's gain is the missing-EOS rule's, not the reward's


@dataclass(frozen=True)
class HealthWarning:
    """One warning sign that fired: on which metric, the steps it covers, and what it means."""

    rule: str  # the rule's name (a key of RULES)
    metric: str  # the metrics.jsonl key whose plot gets the mark
    first_step: int
    last_step: int
    message: str  # what was seen, with the figures


Series = tuple[list[int], list[float]]


def _thirds(series: Series) -> tuple[list[float], list[float], list[float], list[int]]:
    xs, ys = series
    n = max(1, len(ys) // 3)
    return ys[:n], ys[n:-n] or ys[:n], ys[-n:], xs[-n:]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def kl_runaway(get: Callable[[str], Series]) -> list[HealthWarning]:
    for key in ("kl/mean", "eval/kl/mean"):
        s = get(key)
        if len(s[1]) >= MIN_POINTS:
            _, middle, late, steps = _thirds(s)
            if _mean(late) > KL_GROWTH * max(_mean(middle), 0.0) and _mean(late) > KL_FLOOR:
                return [
                    HealthWarning(
                        "kl_runaway",
                        key,
                        steps[0],
                        steps[-1],
                        f"KL still climbing: {_mean(late):.3g} nats/response over the last third, "
                        f"{_mean(middle):.3g} over the middle third",
                    )
                ]
            return []
    return []


def _above(
    rule: str, key: str, limit: float, words: str
) -> Callable[[Callable[[str], Series]], list[HealthWarning]]:
    def check(get: Callable[[str], Series]) -> list[HealthWarning]:
        s = get(key)
        if len(s[1]) < 3:
            return []
        _, _, late, steps = _thirds(s)
        if _mean(late) > limit:
            return [
                HealthWarning(
                    rule,
                    key,
                    steps[0],
                    steps[-1],
                    f"{words}: {_mean(late):.3g} over the last third (rule: above {limit:g})",
                )
            ]
        return []

    return check


def ratio_off(get: Callable[[str], Series]) -> list[HealthWarning]:
    s = get("ratio/mean")
    if len(s[1]) < 3:
        return []
    _, _, late, steps = _thirds(s)
    if abs(_mean(late) - 1.0) > RATIO_BAND:
        return [
            HealthWarning(
                "ratio_off",
                "ratio/mean",
                steps[0],
                steps[-1],
                f"mean probability ratio {_mean(late):.3g} over the last third (rule: outside "
                f"[{1 - RATIO_BAND:g}, {1 + RATIO_BAND:g}])",
            )
        ]
    return []


def entropy_collapse(get: Callable[[str], Series]) -> list[HealthWarning]:
    s = get("entropy/mean")
    if len(s[1]) < MIN_POINTS:
        return []
    early, _, late, steps = _thirds(s)
    if _mean(early) > 0 and _mean(late) < ENTROPY_COLLAPSE * _mean(early):
        return [
            HealthWarning(
                "entropy_collapse",
                "entropy/mean",
                steps[0],
                steps[-1],
                f"entropy fell from {_mean(early):.3g} to {_mean(late):.3g} nats/token "
                f"(rule: below {ENTROPY_COLLAPSE:g} of the first third)",
            )
        ]
    return []


def length_blowup(get: Callable[[str], Series]) -> list[HealthWarning]:
    out = []
    s = get("response_length/mean")
    if len(s[1]) >= MIN_POINTS:
        early, _, late, steps = _thirds(s)
        if _mean(early) > 0 and _mean(late) > LENGTH_BLOWUP * _mean(early):
            out.append(
                HealthWarning(
                    "length_blowup",
                    "response_length/mean",
                    steps[0],
                    steps[-1],
                    f"responses grew from {_mean(early):.3g} to {_mean(late):.3g} tokens "
                    f"(rule: above {LENGTH_BLOWUP:g}x the first third)",
                )
            )
    s = get("response/ended_frac")
    if len(s[1]) >= 3:
        _, _, late, steps = _thirds(s)
        if _mean(late) < ENDED_LOW:
            out.append(
                HealthWarning(
                    "length_blowup",
                    "response_length/mean",
                    steps[0],
                    steps[-1],
                    f"only {_mean(late):.0%} of responses end with a stop token over the last third "
                    f"(rule: below {ENDED_LOW:.0%}); the rest hit the length limit",
                )
            )
    return out


def critic_useless(get: Callable[[str], Series]) -> list[HealthWarning]:
    s = get("value/explained_variance")
    if len(s[1]) < 3:
        return []
    _, _, late, steps = _thirds(s)
    if _mean(late) < 0:
        return [
            HealthWarning(
                "critic_useless",
                "value/explained_variance",
                steps[0],
                steps[-1],
                f"value explained variance {_mean(late):.3g} over the last third: the critic predicts "
                "the returns worse than their mean would (rule: below 0)",
            )
        ]
    return []


def gradient_spikes(get: Callable[[str], Series]) -> list[HealthWarning]:
    out = []
    for key in ("grad_norm/actor", "grad_norm/critic", "grad_norm"):
        xs, ys = get(key)
        if len(ys) < MIN_POINTS:
            continue
        median = statistics.median(ys)
        spikes = [x for x, y in zip(xs, ys, strict=True) if median > 0 and y > GRAD_SPIKE * median]
        if spikes:
            out.append(
                HealthWarning(
                    "gradient_spike",
                    key,
                    spikes[0],
                    spikes[-1],
                    f"{len(spikes)} step(s) with a gradient norm above {GRAD_SPIKE:g}x the median "
                    f"{median:.3g} (first at step {spikes[0]})",
                )
            )
    return out


def overoptimization(get: Callable[[str], Series]) -> list[HealthWarning]:
    for gold_key, proxy_key in (("eval/gold/mean", "eval/score/mean"), ("gold/mean", "score/mean")):
        gx, gold = get(gold_key)
        px, proxy = get(proxy_key)
        if len(gold) < 3 or len(proxy) < 2:
            continue
        best = max(range(len(gold)), key=gold.__getitem__)
        if gold[-1] < gold[-2] < gold[-3] and proxy[-1] > proxy[0] and best < len(gold) - 2:
            return [
                HealthWarning(
                    "overoptimization",
                    gold_key,
                    gx[best],
                    gx[-1],
                    f"gold score fell on the last two evaluations ({gold[-3]:.3g} -> {gold[-1]:.3g}; best "
                    f"{gold[best]:.3g} at step {gx[best]}) while the proxy rose ({proxy[0]:.3g} -> "
                    f"{proxy[-1]:.3g})",
                )
            ]
        return []
    return []


def gain_from_stopping(get: Callable[[str], Series]) -> list[HealthWarning]:
    """The trained score (``score/mean``: missing-EOS penalty included) rises from the first third to the last,
    the score before the rule (``score/raw_mean``: the reward model's and functions' own) rises by less than
    half as much, and the share penalised for not ending falls: the policy learned to stop, not the reward."""
    trained, raw, penalised = get("score/mean"), get("score/raw_mean"), get("score/penalised_frac")
    if min(len(trained[1]), len(raw[1]), len(penalised[1])) < MIN_POINTS:
        return []
    t_early, _, t_late, steps = _thirds(trained)
    r_early, _, r_late, _ = _thirds(raw)
    p_early, _, p_late, _ = _thirds(penalised)
    gain, own = _mean(t_late) - _mean(t_early), _mean(r_late) - _mean(r_early)
    if gain > 0 and _mean(p_late) < _mean(p_early) and own < (1 - STOPPING_SHARE) * gain:
        return [
            HealthWarning(
                "gain_from_stopping",
                "score/mean",
                steps[0],
                steps[-1],
                f"the trained score rose by {gain:.3g} (first third to last), the score before the "
                f"missing-EOS rule by {own:.3g}, while the share penalised for not ending fell from "
                f"{_mean(p_early):.0%} to {_mean(p_late):.0%}: the gain is mostly the policy learning to stop",
            )
        ]
    return []


# rule name -> (the rule in words, the check)
RULES: dict[str, tuple[str, Callable[[Callable[[str], Series]], list[HealthWarning]]]] = {
    "overoptimization": (
        "Reward hacking: the gold score falls on two evaluations in a row, below its best, while "
        "the proxy (reward-model) score is above its first value.",
        overoptimization,
    ),
    "gain_from_stopping": (
        "Gain from stopping: the trained score rises from the first third of the run to the last, the score "
        f"before the missing-EOS rule (what the reward model and functions give) by less than "
        f"{1 - STOPPING_SHARE:.0%} of that, and the share of responses penalised for not ending falls.",
        gain_from_stopping,
    ),
    "kl_runaway": (
        f"KL running away: the mean KL to the reference over the last third of the run is more than "
        f"{KL_GROWTH:g}x that of the middle third, and above {KL_FLOOR:g} nat per response.",
        kl_runaway,
    ),
    "clipfrac_high": (
        f"Clip fraction high: the policy clip fraction averages above {CLIPFRAC_HIGH:g} over the last "
        "third: updates are too large for the clip range.",
        _above("clipfrac_high", "clipfrac", CLIPFRAC_HIGH, "policy clip fraction"),
    ),
    "approx_kl_high": (
        f"Updates too large: approx. KL between the policy before and after an update averages above "
        f"{APPROX_KL_HIGH:g} over the last third.",
        _above("approx_kl_high", "approx_kl", APPROX_KL_HIGH, "approx. KL between updates"),
    ),
    "ratio_off": (
        f"Ratio off: the mean probability ratio leaves [{1 - RATIO_BAND:g}, {1 + RATIO_BAND:g}] over the "
        "last third.",
        ratio_off,
    ),
    "entropy_collapse": (
        f"Entropy collapse: the policy entropy over the last third falls below {ENTROPY_COLLAPSE:g} "
        "of its value over the first third.",
        entropy_collapse,
    ),
    "length_blowup": (
        f"Length blow-up: the mean response length over the last third exceeds {LENGTH_BLOWUP:g}x "
        f"that of the first third, or fewer than {ENDED_LOW:.0%} of responses end with a stop "
        "token.",
        length_blowup,
    ),
    "critic_useless": (
        "Critic not learning: the value model's explained variance averages below 0 over the last third.",
        critic_useless,
    ),
    "gradient_spike": (
        f"Gradient spikes: a gradient norm above {GRAD_SPIKE:g}x the run's median.",
        gradient_spikes,
    ),
}


# Signs read from a run's configuration rather than its curves (rlhfkit.reporting.panels.sandbox_warnings):
# named here so that pages describe them as they describe the rules above.
CONFIG_SIGNS = {
    "sandbox_none": "Model-written code not isolated: online.sandbox=none ran it as a plain child process "
    "with limits only, so it could read the machine's files and reach its network.",
}


def describe(rule: str) -> str:
    """A warning sign's description (a rule of :data:`RULES` or a :data:`CONFIG_SIGNS` entry)."""
    return RULES[rule][0] if rule in RULES else CONFIG_SIGNS[rule]


# The rules that compare thirds of the run, and the series each reads (what a short run has too few of).
TREND_SERIES = (
    "kl/mean",
    "entropy/mean",
    "response_length/mean",
    "score/mean",
    "grad_norm/actor",
    "grad_norm",
)


def too_short(get: Callable[[str], Series]) -> str | None:
    """Words for a run too short for the trend rules (fewer than :data:`MIN_POINTS` logged points on every
    series they read): which rules could not fire; None when the run is long enough."""
    points = max(len(get(key)[1]) for key in TREND_SERIES)
    if points >= MIN_POINTS:
        return None
    unchecked = (
        "none of the rules could fire"
        if points < 3
        else (
            "the trend rules (KL running away, entropy collapse, length blow-up, gradient spikes, gain from "
            "stopping) could not fire"
        )
    )
    return (
        f"the run logged only {points} point{'s' if points != 1 else ''}: {unchecked} (they need at least "
        f"{MIN_POINTS} logged points, the rules on the last third 3), so no sign here says little"
    )


def check_health(get: Callable[[str], Series]) -> list[HealthWarning]:
    """Every rule of :data:`RULES` over the series ``get(key) -> (steps, values)``; the warnings that fire."""
    out: list[HealthWarning] = []
    for _, check in RULES.values():
        out.extend(check(get))
    return out


def negative_kl_note(value: float | None, estimator: str | None) -> str | None:
    """Why a logged KL can be negative: the k1 estimator -log(pi_ref/pi) is unbiased but a sample mean of it
    can fall below 0 when the policy is close to the reference (Schulman, "Approximating KL divergence")."""
    if value is None or value >= 0:
        return None
    if estimator in (None, "k1"):
        return (
            "negative: the k1 estimator (log pi - log pi_ref per token) is unbiased but not always positive; "
            "a sample mean below 0 means the policy is still close to the reference"
        )
    return "negative, which this estimator should not give: check the log-probabilities"
