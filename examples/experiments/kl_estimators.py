"""k1, k2, k3 and k3 with the ratio reversed, against the exact KL(pi || ref).

Schulman's "Approximating KL Divergence" (2020) estimates KL(pi || ref) from samples x ~ pi with r = ref(x) / pi(x):

    k1 = -log r,    k2 = (log r)^2 / 2,    k3 = (r - 1) - log r.

E_pi[k1] = E_pi[k3] = KL(pi || ref) (E_pi[r] = 1), k3 >= 0 for every sample, and k2 is biased (it is KL to second
order). With the ratio taken the other way round, r' = pi(x) / ref(x), still sampling from pi,

    k3_rev = (r' - 1) - log r',   E_pi[k3_rev] = chi^2(pi || ref) - KL(pi || ref),

since E_pi[pi / ref] = 1 + chi^2(pi || ref). That agrees with KL near pi = ref (chi^2 = 2 KL + O(d^3)) and leaves it
as they part: it is another quantity, non-negative too, and its samples have a heavy tail (pi / ref is
unbounded). This script measures all four:

1. **categorical**: ref = softmax(z), pi = softmax(z + d * u) over V categories (z, u standard normal), for
   several distances d; N samples from pi, repeated over seeds: the sample mean of each estimator against its
   exact target (KL, or chi^2 - KL for k3_rev), its standard deviation per sample, and the share of negative k1.
2. **the policy's own samples** (``--policy DIR --reference DIR``, e.g. a quickstart's ``ppo/final`` and
   ``sft/final``): responses sampled from the policy; at every response token the exact per-token
   KL(pi(.|prefix) || ref(.|prefix)) and chi^2 from the full distributions, and the four estimators at the sampled
   token; per response, sums over its tokens.

Writes ``kl_estimators.json``, ``kl_estimators.md`` (the tables) and ``kl_estimators.png`` into ``--out``.

    python examples/experiments/kl_estimators.py --out runs/exp-kl
    python examples/experiments/kl_estimators.py --out runs/exp-kl --policy runs/qs/ppo/final --reference runs/qs/sft/final
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rlhfkit.algos import kl_k1, kl_k2, kl_k3

ESTIMATORS = ("k1", "k2", "k3", "k3_rev")


def estimators(logp: torch.Tensor, ref_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """The four estimators at sampled points from their log-probs under pi and ref (any shape)."""
    return {
        "k1": kl_k1(logp, ref_logp),
        "k2": kl_k2(logp, ref_logp),
        "k3": kl_k3(logp, ref_logp),
        "k3_rev": kl_k3(ref_logp, logp),  # the ratio taken the wrong way round: r' = pi / ref
    }


def exact_targets(logp: torch.Tensor, ref_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL(pi || ref), chi^2(pi || ref) and the target of each estimator, from full log-distributions (..., V)."""
    p = logp.exp()
    kl = (p * (logp - ref_logp)).sum(-1)
    chi2 = (p * (logp - ref_logp).exp()).sum(-1) - 1.0
    return {"kl": kl, "chi2": chi2, "k1": kl, "k2": kl, "k3": kl, "k3_rev": chi2 - kl}


def categorical(vocab: int, distances: list[float], samples: int, seeds: list[int]) -> list[dict[str, float]]:
    """Part 1: one row per (distance, seed): exact KL and chi^2, each estimator's sample mean, its std per
    sample, and its bias (mean - exact KL)."""
    rows = []
    for d in distances:
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            z = torch.randn(vocab, generator=g, dtype=torch.float64)
            u = torch.randn(vocab, generator=g, dtype=torch.float64)
            ref_logp = torch.log_softmax(z, -1)
            logp = torch.log_softmax(z + d * u, -1)
            x = torch.multinomial(logp.exp(), samples, replacement=True, generator=g)  # (N,) from pi
            values = estimators(logp[x], ref_logp[x])
            exact = exact_targets(logp, ref_logp)
            row = {"distance": d, "seed": seed, "kl": float(exact["kl"]), "chi2": float(exact["chi2"])}
            for name, v in values.items():
                row[f"{name}_mean"] = float(v.mean())
                row[f"{name}_std"] = float(v.std())
                row[f"{name}_bias"] = float(v.mean() - exact["kl"])
            row["k1_negative_share"] = float((values["k1"] < 0).double().mean())
            rows.append(row)
    return rows


@torch.no_grad()
def policy_samples(
    policy_dir: str, reference_dir: str, prompts: int, max_new_tokens: int, temperature: float, seed: int
) -> dict[str, float]:
    """Part 2 on the built-in task's held-out prompts: per response, the sums over its tokens of the exact
    per-token KL and chi^2 - KL and of each estimator; their means over the responses and the estimators' std."""
    from rlhfkit.data import PromptCollator, TokenLimits, tokenize_prompt
    from rlhfkit.models import load_causal_lm, load_tokenizer, processed_logits, response_logits, sampling_for
    from rlhfkit.rollout.generation import generate_responses
    from rlhfkit.tasks import get_task

    tokenizer = load_tokenizer(policy_dir)
    policy = load_causal_lm(policy_dir, tokenizer=tokenizer, frozen=True).eval()
    reference = load_causal_lm(reference_dir, tokenizer=tokenizer, frozen=True).eval()
    records = [{"prompt": p} for p in get_task("reviews", seed=seed).prompts("eval")[:prompts]]
    examples = [tokenize_prompt(r, tokenizer, TokenLimits(32, None, "left")) for r in records]
    batch = PromptCollator(tokenizer.pad_token_id)(examples)
    stops = [tokenizer.eos_token_id]
    sampling = sampling_for(tokenizer.pad_token_id, stops, temperature)
    torch.manual_seed(seed)
    r = generate_responses(
        policy,
        batch["input_ids"],
        batch["attention_mask"],
        max_new_tokens=max_new_tokens,
        stop_token_ids=stops,
        pad_token_id=tokenizer.pad_token_id,
        sampling=sampling,
    )
    tokens = r.input_ids[:, r.response_start :]  # (B, R)
    full = {}
    for name, model in (("pi", policy), ("ref", reference)):
        logits = response_logits(model, r.input_ids, r.attention_mask, r.response_start)  # (B, R, V)
        full[name] = torch.log_softmax(processed_logits(logits, sampling).double(), -1)  # (B, R, V)
    mask = r.mask.double()  # (B, R)
    full = {k: v.clamp(min=-1e4) for k, v in full.items()}  # a suppressed token: probability 0, finite log
    picked = {k: v.gather(-1, tokens[..., None]).squeeze(-1) for k, v in full.items()}  # (B, R)
    values = {k: torch.where(r.mask, v, 0.0) for k, v in estimators(picked["pi"], picked["ref"]).items()}
    exact = {k: torch.where(r.mask, v, 0.0) for k, v in exact_targets(full["pi"], full["ref"]).items()}
    out = {"responses": int(mask.shape[0]), "tokens": int(mask.sum()), "temperature": temperature}
    out["kl_exact_mean"] = float((exact["kl"] * mask).sum(1).mean())
    out["chi2_minus_kl_exact_mean"] = float((exact["k3_rev"] * mask).sum(1).mean())
    n = mask.sum()
    for name, v in values.items():
        per_response = (v * mask).sum(1)  # (B,)
        out[f"{name}_mean"] = float(per_response.mean())
        out[f"{name}_std"] = float(per_response.std())
        # per token, the estimator minus its exact expectation given the prefix: mean and standard error
        error = (v - exact[name])[r.mask]
        out[f"{name}_token_error"] = float(error.sum() / n)
        out[f"{name}_token_error_se"] = float(error.std() / n.sqrt())
    out["k1_negative_token_share"] = float(((values["k1"] < 0) & r.mask).double().sum() / mask.sum())
    return out


def summarise(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Means over seeds per distance."""
    out = []
    for d in sorted({r["distance"] for r in rows}):
        group = [r for r in rows if r["distance"] == d]
        keys = [k for k in group[0] if k not in ("distance", "seed")]
        out.append(
            {"distance": d, "seeds": len(group), **{k: sum(r[k] for r in group) / len(group) for k in keys}}
        )
    return out


def markdown(summary: list[dict[str, float]], samples: int, policy: dict | None) -> str:
    lines = [
        f"Categorical pairs (means over seeds; {samples} samples from pi each): sample mean of each estimator, "
        "the exact KL(pi || ref) and chi^2 - KL (the target of k3_rev).",
        "",
        "| d | KL exact | k1 | k2 | k3 | k3_rev | chi^2 - KL | std k1 | std k3 | std k3_rev | k1 < 0 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['distance']:g} | {s['kl']:.4f} | {s['k1_mean']:.4f} | {s['k2_mean']:.4f} | {s['k3_mean']:.4f} "
            f"| {s['k3_rev_mean']:.4f} | {s['chi2'] - s['kl']:.4f} | {s['k1_std']:.3f} | {s['k3_std']:.3f} "
            f"| {s['k3_rev_std']:.3f} | {s['k1_negative_share']:.2f} |"
        )
    if policy:
        lines += [
            "",
            f"The policy's own samples ({policy['responses']} responses, {policy['tokens']} tokens, temperature "
            f"{policy['temperature']:g}): per response, the sum over its tokens.",
            "",
            "| figure | mean | std over responses | per token: mean of (estimate - its exact target) +- s.e. |",
            "|---|---|---|---|",
            f"| exact KL (sum of per-token KL) | {policy['kl_exact_mean']:.4f} | | |",
            f"| exact chi^2 - KL | {policy['chi2_minus_kl_exact_mean']:.4f} | | |",
        ]
        for name in ESTIMATORS:
            lines.append(
                f"| {name} | {policy[f'{name}_mean']:.4f} | {policy[f'{name}_std']:.4f} "
                f"| {policy[f'{name}_token_error']:+.4f} +- {policy[f'{name}_token_error_se']:.4f} |"
            )
        lines.append(f"| share of tokens with k1 < 0 | {policy['k1_negative_token_share']:.3f} | | |")
    return "\n".join(lines) + "\n"


def plot(summary: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kl = [s["kl"] for s in summary]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(kl, kl, color="black", lw=1, label="exact KL(pi || ref)")
    ax.plot(kl, [s["chi2"] - s["kl"] for s in summary], color="grey", ls="--", lw=1, label="chi^2 - KL")
    for name, marker in zip(ESTIMATORS, "osD^", strict=True):
        ax.plot(kl, [s[f"{name}_mean"] for s in summary], marker=marker, ls="", label=f"{name} (sample mean)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("exact KL(pi || ref), nats")
    ax.set_ylabel("estimate, nats")
    ax.set_title("KL estimators on categorical pairs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--vocab", type=int, default=64, help="categories of the categorical pairs")
    parser.add_argument("--distances", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--samples", type=int, default=200_000, help="samples from pi per pair")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--policy", help="a policy folder (e.g. runs/qs/ppo/final) for part 2")
    parser.add_argument("--reference", help="its reference (e.g. runs/qs/sft/final)")
    parser.add_argument("--prompts", type=int, default=256, help="held-out prompts for part 2")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    if (args.policy is None) != (args.reference is None):
        parser.error("--policy and --reference go together")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = categorical(args.vocab, args.distances, args.samples, args.seeds)
    summary = summarise(rows)
    policy = None
    if args.policy:
        policy = policy_samples(
            args.policy, args.reference, args.prompts, args.max_new_tokens, args.temperature, args.seeds[0]
        )
    result = {"categorical": rows, "categorical_summary": summary, "policy_samples": policy}
    (out / "kl_estimators.json").write_text(json.dumps(result, indent=1))
    (out / "kl_estimators.md").write_text(markdown(summary, args.samples, policy))
    plot(summary, out / "kl_estimators.png")
    print(markdown(summary, args.samples, policy))
    return result


if __name__ == "__main__":
    main()
