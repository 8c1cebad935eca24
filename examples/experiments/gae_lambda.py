"""GAE's lambda trades bias for variance: advantages at several lambda against Monte-Carlo rollouts.

Generalized advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
Advantage Estimation", eq. 16) with the critic's values V:

    delta_t = r_t + gamma V(s_{t+1}) - V(s_t),     A^lambda_t = sum_l (gamma lambda)^l delta_{t+l}.

lambda = 1 gives the return minus V(s_t): E[A^1_t | s_t, a_t] = Q(s_t, a_t) - V(s_t) whatever the critic, which is
all the policy gradient needs (the GAE paper's "gamma-just": a baseline that depends on s_t only adds no bias to
the gradient), at the return's full variance. lambda = 0 trusts the critic: delta_t alone, with no randomness once
(s_t, a_t) is given (here the next state is the prefix with a_t appended), but biased by V's error at s_{t+1}.

Measured here for ONE fixed policy and critic, on the built-in task with the language-model MDP (a state is the
prompt and the tokens so far, an action the next token, the reward model's normalised score the only reward, at
the last token; gamma = 1; no KL penalty). For each of ``--prompts`` held-out prompts one response is sampled;
for every token a_t of it, ``--continuations`` K responses are sampled on from the prefix s_{t+1} = (s_t, a_t).
Half of them estimate Q(s_t, a_t) (the mean final reward); on the other half the advantage A^lambda_t of every
lambda is computed on each continued trajectory with the critic's values, read as the PPO trainer reads them
(:func:`rlhfkit.rollout.scoring.critic_values`: the critic's stored normalisation applied, the scale of the
normalised reward the returns are made of; :func:`rewards_and_values`). Per (s_t, a_t):

    bias_lambda = mean(A^lambda_t) - (Q(s_t, a_t) - V(s_t)),    variance_lambda = Var(A^lambda_t),

then both averaged over all (s_t, a_t) (bias as its mean square, less the sampling noise of the two means). The critic is ``--critic`` (default: the reward
model, as PPO's critic starts; Huang et al. 2024). Writes ``gae_lambda.json``, ``gae_lambda.md`` and
``gae_lambda.png`` into ``--out``.

    python examples/experiments/gae_lambda.py --out runs/exp-lambda --policy runs/qs/sft/final --reward-model runs/qs/reward/final

PPO learning curves per lambda: ``gae_lambda_ppo.py`` (``ppo_sweep.py --sweep lam``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

LAMBDAS = (0.0, 0.5, 0.9, 0.95, 1.0)


def rewards_and_values(
    reward_model, critic, prompt_rows: list[list[int]], responses: list[list[int]], pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The final reward and the critic's values of prompt + response rows, both read as PPO reads them.

    The reward is the reward model's normalised score (``gain * raw + bias``, :mod:`rlhfkit.rollout.scoring`);
    the values come from :func:`rlhfkit.rollout.scoring.critic_values`, the trainer's own read (the critic's
    stored normalisation applied), so that returns and values are on one scale.

    Returns:
        (final reward (B,) float64, values (B, R) float64 of the state before each response token, mask (B, R)
        bool), R the longest response.
    """
    from rlhfkit.data import pad_sequences
    from rlhfkit.models import sequence_scores
    from rlhfkit.rollout.scoring import critic_values, reward_normalization

    gain, bias = reward_normalization(reward_model)
    left, left_mask = pad_sequences(prompt_rows, pad, "left")
    right, right_mask = pad_sequences(responses, pad, "right")
    ids, mask = torch.cat([left, right], 1), torch.cat([left_mask, right_mask], 1)
    score = sequence_scores(reward_model, ids, mask).double() * gain + bias  # (B,)
    values = critic_values(critic, ids, mask, left.shape[1]).double()  # (B, R)
    return score, values, right_mask.bool()


@torch.no_grad()
def measure(
    policy_dir: str,
    reward_dir: str,
    critic_dir: str,
    *,
    prompts: int,
    continuations: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    lambdas=LAMBDAS,
) -> dict:
    """The per-lambda figures of one seed (module docstring)."""
    from rlhfkit.algos import compute_gae
    from rlhfkit.data import PromptCollator, TokenLimits, tokenize_prompt
    from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer, sampling_for
    from rlhfkit.rollout.generation import generate_responses
    from rlhfkit.tasks import get_task

    tokenizer = load_tokenizer(policy_dir)
    policy = load_causal_lm(policy_dir, tokenizer=tokenizer, frozen=True).eval()
    reward_model = load_scalar_model(reward_dir, tokenizer=tokenizer, frozen=True).eval()
    critic = (
        reward_model
        if critic_dir == reward_dir
        else load_scalar_model(critic_dir, tokenizer=tokenizer).eval()
    )
    stops, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    sampling = sampling_for(pad, stops, temperature)
    collate = PromptCollator(pad)
    records = [{"prompt": p} for p in get_task("reviews", seed=seed).prompts("eval")[:prompts]]
    prompt_ids = [tokenize_prompt(r, tokenizer, TokenLimits(32, None, "left"))["prompt_ids"] for r in records]

    def sample(prefixes: list[list[int]], budget: int) -> list[list[int]]:
        """One continuation (token list, stop token included when reached) per prefix."""
        batch = collate([{"prompt_ids": p} for p in prefixes])
        r = generate_responses(
            policy,
            batch["input_ids"],
            batch["attention_mask"],
            max_new_tokens=budget,
            stop_token_ids=stops,
            pad_token_id=pad,
            sampling=sampling,
        )
        return [ids[m].tolist() for ids, m in zip(r.response_ids, r.mask, strict=True)]

    torch.manual_seed(seed)
    responses = sample(prompt_ids, max_new_tokens)
    half = continuations // 2
    # One row per (prompt i, action t) with its K continued responses (the action a_t a stop token: the response
    # is over, K copies of it).
    squared_bias = {lam: [] for lam in lambdas}
    variance = {lam: [] for lam in lambdas}
    returns_var = []
    for t in range(max(len(r) for r in responses)):
        rows = [i for i, r in enumerate(responses) if len(r) > t]
        open_rows = [i for i in rows if responses[i][t] not in stops and t + 1 < max_new_tokens]
        continued: dict[int, list[list[int]]] = {i: [responses[i]] * continuations for i in rows}
        if open_rows:
            prefixes = [
                prompt_ids[i] + responses[i][: t + 1] for i in open_rows for _ in range(continuations)
            ]
            tails = sample(prefixes, max_new_tokens - t - 1)
            for k, i in enumerate(open_rows):
                continued[i] = [
                    responses[i][: t + 1] + tail
                    for tail in tails[k * continuations : (k + 1) * continuations]
                ]
        flat = [(i, seq) for i in rows for seq in continued[i]]
        score, values, mask = rewards_and_values(
            reward_model, critic, [prompt_ids[i] for i, _ in flat], [seq for _, seq in flat], pad
        )
        last = mask.long().sum(1) - 1  # (B,)
        rewards = torch.zeros_like(values).scatter_(1, last[:, None], score[:, None])  # (B, R)
        shape = (len(rows), continuations)
        score_k = score.view(shape)
        q_hat = score_k[:, :half].mean(1)  # (rows,) Q(s_t, a_t) from the first half
        v_t = values[:, t].view(shape)[:, 0]  # (rows,) V(s_t): the same state in every continuation
        returns_var += score_k[:, half:].var(1, unbiased=True).tolist()
        for lam in lambdas:
            advantages, _ = compute_gae(rewards, values, mask, gamma=1.0, lam=lam)  # (B, R)
            a_t = advantages[:, t].view(shape)[:, half:]  # (rows, K - half) the other half
            var_a = a_t.var(1, unbiased=True)  # (rows,)
            # E[(mean A - (Q_hat - V))^2] = bias^2 + Var(R)/h + Var(A)/h: subtract the two sampling terms
            noise = (score_k[:, :half].var(1, unbiased=True) + var_a) / half
            squared_bias[lam] += ((a_t.mean(1) - (q_hat - v_t)) ** 2 - noise).tolist()
            variance[lam] += var_a.tolist()
    out = {"seed": seed, "pairs": len(returns_var), "return_variance": sum(returns_var) / len(returns_var)}
    for lam in lambdas:
        out[f"bias2_{lam:g}"] = sum(squared_bias[lam]) / len(squared_bias[lam])
        out[f"variance_{lam:g}"] = sum(variance[lam]) / len(variance[lam])
    return out


def markdown(rows: list[dict], lambdas=LAMBDAS) -> str:
    lines = [
        "Per (s_t, a_t), averaged over the sampled responses' tokens, then over seeds (std over seeds in brackets). "
        "Squared bias against Q(s_t, a_t) - V(s_t), with the Monte-Carlo noise of both sample means subtracted "
        "(an unbiased estimate of the squared bias: near 0, it can come out slightly negative).",
        "",
        "| lambda | squared bias | variance | bias^2 + variance |",
        "|---|---|---|---|",
    ]

    def stat(key):
        values = [r[key] for r in rows]
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5
        return mean, std

    for lam in lambdas:
        (b, bs), (v, vs) = stat(f"bias2_{lam:g}"), stat(f"variance_{lam:g}")
        lines.append(f"| {lam:g} | {b:.4f} ({bs:.4f}) | {v:.4f} ({vs:.4f}) | {b + v:.4f} |")
    lines.append("")
    lines.append(
        f"Variance of the final reward given (s_t, a_t), for scale: {stat('return_variance')[0]:.4f}; "
        f"(s_t, a_t) pairs per seed: {', '.join(str(r['pairs']) for r in rows)}."
    )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str, lambdas=LAMBDAS) -> None:
    """Squared bias, variance and their sum (the mean squared error of one advantage, what the conclusion rests
    on) against lambda, means over seeds with the sd over seeds as error bars; ``title`` names the policy and
    the critic, so that the two runs' figures differ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))

    def stat(key):
        per_lam = [[r[f"{key}_{lam:g}"] for r in rows] for lam in lambdas]
        means = [sum(v) / len(v) for v in per_lam]
        sds = [
            (sum((x - m) ** 2 for x in v) / (len(v) - 1)) ** 0.5 if len(v) > 1 else 0.0
            for v, m in zip(per_lam, means, strict=True)
        ]
        return means, sds

    for key, label, marker in (("bias2", "squared bias", "o"), ("variance", "variance", "s")):
        means, sds = stat(key)
        ax.errorbar(lambdas, means, sds, marker=marker, capsize=3, label=label)
    errors = [[r[f"bias2_{lam:g}"] + r[f"variance_{lam:g}"] for r in rows] for lam in lambdas]
    ax.plot(lambdas, [sum(e) / len(e) for e in errors], "k^--", label="squared bias + variance (MSE)")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("GAE lambda")
    ax.set_ylabel("per (s_t, a_t), (normalised reward)^2")
    ax.set_title(f"GAE bias and variance against lambda: {title}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--policy", required=True, help="the policy folder (e.g. runs/qs/sft/final)")
    parser.add_argument(
        "--reward-model", required=True, help="the reward model folder (runs/qs/reward/final)"
    )
    parser.add_argument("--critic", help="the critic (a scalar model folder); default: the reward model")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts, one response each")
    parser.add_argument("--continuations", type=int, default=16, help="K rollouts from every prefix (even)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    if args.continuations < 4 or args.continuations % 2:
        parser.error("--continuations must be even and at least 4 (two halves, a variance in each)")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        measure(
            args.policy,
            args.reward_model,
            args.critic or args.reward_model,
            prompts=args.prompts,
            continuations=args.continuations,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=seed,
        )
        for seed in args.seeds
    ]
    (out / "gae_lambda.json").write_text(json.dumps(rows, indent=1))
    (out / "gae_lambda.md").write_text(markdown(rows))
    critic = "the reward model as critic" if args.critic is None else f"critic {Path(args.critic).name}"
    plot(
        rows,
        out / "gae_lambda.png",
        f"policy {Path(args.policy).parent.name}/{Path(args.policy).name}, {critic}",
    )
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
