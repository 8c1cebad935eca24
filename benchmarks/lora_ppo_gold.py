"""LoRA PPO against full fine-tuning on the built-in task: gold gain in SFT standard deviations.

Takes a finished quickstart folder (its SFT policy, reward model, task files and the PPO stage's own
``config.yaml``) and reruns that PPO stage with the same budget (rollouts, batch, response length, KL
coefficient, seed) twice more: with full fine-tuning (the quickstart's settings, as a control that the rerun
reproduces the quickstart) and with LoRA adapters on the actor and the critic. Each is evaluated as the
quickstart evaluates PPO (:class:`rlhfkit.quickstart.pipeline.HackingMeter`: gold, proxy and KL on the held-out prompts
at the training temperature), and the table gives the gold gain in SFT standard deviations, KL, the win rate
over SFT and the seconds per rollout.

    rlhfkit quickstart --out runs/qs
    python benchmarks/lora_ppo_gold.py --quickstart runs/qs --out runs/lora --rank 8 --lr-scale 10

LoRA usually needs a higher learning rate than full fine-tuning (its update B A starts at zero and is scaled
by alpha / rank); ``--lr-scale`` multiplies the quickstart's PPO learning rate for the LoRA run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quickstart", required=True, help="a finished `rlhfkit quickstart --out DIR` folder"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--lr-scale", type=float, nargs="+", default=[10.0])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("RLHFKIT_NUM_THREADS", "1")))
    parser.add_argument("--skip-full", action="store_true", help="only the LoRA runs")
    args = parser.parse_args()
    os.environ["RLHFKIT_NUM_THREADS"] = str(args.threads)

    import torch

    torch.set_num_threads(args.threads)
    from rlhfkit.config import load_config
    from rlhfkit.quickstart.pipeline import PRESETS, HackingMeter
    from rlhfkit.tasks import get_task
    from rlhfkit.trainers import online

    qs = Path(args.quickstart)
    summary = json.loads((qs / "summary.json").read_text())
    preset, seed = PRESETS[summary["preset"]], int(summary["seed"])
    task = get_task("reviews", seed=seed)
    sft_dir, rm_dir = qs / "sft" / "final", qs / "reward" / "final"
    base_lr = float(load_config(str(qs / "ppo" / "config.yaml"), [], "ppo").train.learning_rate)

    variants = [] if args.skip_full else [("full", [])]
    for scale in args.lr_scale:
        variants.append(
            (
                f"lora r{args.rank} lr x{scale:g}",
                [
                    f"model.lora_rank={args.rank}",
                    f"model.lora_alpha={args.alpha}",
                    f"train.learning_rate={base_lr * scale}",
                    f"online.critic_learning_rate={base_lr * scale}",
                ],
            )
        )
    rows = []
    for name, overrides in variants:
        out = Path(args.out) / name.replace(" ", "_")
        cfg = load_config(
            str(qs / "ppo" / "config.yaml"),
            [f"output_dir={out}", "logging.progress_bar=false", *overrides],
            "ppo",
        )
        meter = HackingMeter(task, sft_dir, rm_dir, qs / "task" / "prompts_eval.jsonl", preset, seed)
        start = time.perf_counter()
        online.train(cfg, overwrite=True)
        wall = time.perf_counter() - start
        evaluation = meter.compare(out / "final")
        run_summary = json.loads((out / "summary.json").read_text())
        rows.append(
            {
                "variant": name,
                "learning_rate": cfg.train.learning_rate,
                "gold_gain_in_sft_std": evaluation["ppo"]["gold_gain_in_sft_std"],
                "gold_mean": evaluation["ppo"]["gold_mean"],
                "sft_gold_mean": evaluation["sft"]["gold_mean"],
                "kl_mean": evaluation["ppo"]["kl_mean"],
                "win_rate_vs_sft": evaluation["win_rate_vs_sft"],
                "seconds_per_rollout": run_summary["seconds_per_rollout"],
                "wall_seconds": wall,
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    print(
        f"\nquickstart {qs} (preset {summary['preset']}, seed {seed}), {args.threads} thread(s); "
        f"the quickstart's own PPO: gold gain {summary['ppo']['gold_gain_in_sft_std']:.2f} SFT std"
    )
    print("| variant | lr | gold gain (SFT std) | gold | KL | win rate vs SFT | s per rollout |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['learning_rate']:.2e} | {r['gold_gain_in_sft_std']:+.2f} | "
            f"{r['gold_mean']:.3f} | {r['kl_mean']:.2f} | {r['win_rate_vs_sft']:.2f} | "
            f"{r['seconds_per_rollout']:.1f} |"
        )


if __name__ == "__main__":
    main()
