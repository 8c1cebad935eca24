"""What each ``rlhfkit`` command does once :mod:`rlhfkit.cli` has parsed its arguments: check them (a mistake
is a UserError, reported before torch is imported), set the thread count, then call the function that does the
work, imported only then so that ``rlhfkit --help`` stays fast."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhfkit.config import RunConfig, load_config
from rlhfkit.errors import ConfigError, UserError

DEFAULT_TEMPERATURE = 0.7  # as online.temperature (Huang et al. 2024)


def trainer(kind: str) -> Callable[..., dict[str, Any]]:
    """The function that trains ``kind``: ``train(cfg: RunConfig, resume: bool) -> summary``."""
    if kind == "sft":
        from rlhfkit.trainers.sft import train
    elif kind == "reward":
        from rlhfkit.trainers.reward import train
    elif kind == "prm":
        from rlhfkit.trainers.prm import train
    elif kind == "dpo":
        from rlhfkit.trainers.dpo import train
    else:  # ppo, grpo and rloo: one online loop (rlhfkit.config.ONLINE_KINDS)
        from rlhfkit.trainers.online import train
    return train


def train_config(kind: str, path: str | None, overrides: list[str]) -> RunConfig:
    """The configuration of ``rlhfkit train KIND``, checked as the run checks it (``rlhfkit config show``
    gives the same errors): :func:`rlhfkit.config.load_config`, and what the command line cannot provide."""
    cfg: RunConfig = load_config(path, overrides, kind)
    if cfg.refresh.every:
        raise ConfigError(
            f"refresh.every={cfg.refresh.every}: `rlhfkit train` has no labeller for the new pairs a refresh "
            "needs; a refresh runs in `rlhfkit quickstart --refresh-steps K` (the built-in task's annotators) "
            "or from Python with OnlineHooks.refresh_reward_model (docs/configuration.md, refresh); set "
            "refresh.every=0"
        )
    return cfg


def train_command(args: argparse.Namespace) -> int:
    cfg = train_config(args.kind, args.config, args.overrides)
    set_threads()
    from rlhfkit.engine.accel import launch_rank
    from rlhfkit.engine.folder import prepare_output_dir  # imports torch
    from rlhfkit.engine.signals import graceful_stop

    train = trainer(args.kind)
    if (
        launch_rank() == 0
    ):  # one process checks (and with --overwrite empties) the folder; the others wait for it
        prepare_output_dir(cfg.output_dir, resume=args.resume, overwrite=args.overwrite)
    if args.resume:
        from rlhfkit.engine.folder import finished_run

        done = finished_run(cfg.output_dir, cfg.train.max_steps)
        if done is not None:  # its final/ and summary.json stay as they are
            if launch_rank() == 0:
                print(
                    f"rlhfkit: {cfg.output_dir} is a finished run (step {done}); nothing to resume. A larger "
                    "train.max_steps continues it",
                    file=sys.stderr,
                )
            return 0
    with graceful_stop():  # SIGTERM / SIGINT: finish the step, checkpoint, exit 128 + signal
        train(cfg, resume=args.resume)
    if launch_rank() == 0:  # where the run is and its headline figures, on a terminal or in a job's log
        from rlhfkit.reporting.headline import end_of_run_lines

        print("\n".join(end_of_run_lines(cfg.output_dir)), flush=True)
    return 0


def config_init_command(args: argparse.Namespace) -> int:
    from rlhfkit.config.describe import init_yaml

    sys.stdout.write(init_yaml(args.kind))
    return 0


def config_show_command(args: argparse.Namespace) -> int:
    """Print the resolved configuration of ``rlhfkit train KIND``, the keys KIND reads, as YAML that
    ``rlhfkit train KIND --config`` reads back; loads no model, imports no torch beyond the choices'."""
    import yaml

    from rlhfkit.config import KIND_SECTIONS, config_to_dict

    cfg = train_config(args.kind, args.config, args.overrides)
    resolved = config_to_dict(cfg)
    shown = {"output_dir": resolved["output_dir"], "seed": resolved["seed"], "kind": resolved["kind"]}
    shown.update({name: resolved[name] for name in KIND_SECTIONS[args.kind]})
    print(f"# rlhfkit train {args.kind}: the resolved configuration (valid)")
    sys.stdout.write(yaml.safe_dump(shown, sort_keys=False, allow_unicode=True))
    return 0


def config_reference_command(args: argparse.Namespace) -> int:
    from rlhfkit.config.reference import reference_markdown

    sys.stdout.write(reference_markdown())
    return 0


def quickstart_command(args: argparse.Namespace) -> int:
    from rlhfkit.engine.folder import prepare_output_dir

    set_threads()
    if args.refresh_steps < 0:
        raise UserError(
            f"--refresh-steps must be 0 (off) or a positive number of rollouts, got {args.refresh_steps}"
        )
    if args.task == "tools":
        from rlhfkit.quickstart.tool_use import TOOLS_PRESETS, quickstart_tools

        if args.preset not in TOOLS_PRESETS or args.refresh_steps:
            raise UserError(
                f"--task tools runs the presets {sorted(TOOLS_PRESETS)} and no reward-model refresh"
            )
        prepare_output_dir(args.out, overwrite=args.overwrite)
        quickstart_tools(args.out, args.preset, args.overwrite, seed=args.seed)
        return 0
    if args.task != "reviews":
        from rlhfkit.quickstart.verifiable import VERIFIABLE_PRESETS, quickstart_verifiable

        if args.preset not in VERIFIABLE_PRESETS or args.refresh_steps:
            raise UserError(
                f"--task {args.task} runs the presets {sorted(VERIFIABLE_PRESETS)} and no reward-model refresh"
            )
        prepare_output_dir(args.out, overwrite=args.overwrite)
        quickstart_verifiable(args.out, args.task, args.preset, args.overwrite, seed=args.seed)
        return 0
    from rlhfkit.quickstart.pipeline import quickstart

    prepare_output_dir(args.out, overwrite=args.overwrite)
    quickstart(args.out, args.preset, args.overwrite, seed=args.seed, refresh_steps=args.refresh_steps)
    return 0


def generate_command(args: argparse.Namespace) -> int:
    if not Path(args.prompts).is_file():
        raise UserError(f"prompts file not found: {args.prompts}")
    temperature = (
        0.0 if args.greedy else DEFAULT_TEMPERATURE if args.temperature is None else args.temperature
    )
    if temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {temperature}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.out is not None and not Path(args.out).absolute().parent.is_dir():
        raise UserError(f"--out {args.out}: its folder {Path(args.out).absolute().parent} does not exist")
    if args.reward_model is not None and not Path(args.reward_model).is_dir():
        raise UserError(f"--reward-model: folder not found: {args.reward_model}")
    set_threads()
    from rlhfkit.rollout.generate_cli import generate

    # temperature 0 means greedy decoding.
    generate(
        args.model,
        args.prompts,
        out=args.out,
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        reward_model=args.reward_model,
        hf_decode=getattr(args, "hf_decode", "dynamic"),
        sampler=getattr(args, "sampler", "exact"),
        backend=args.backend,
        reward_functions=args.reward_functions,
    )
    return 0


def label_pairs_command(args: argparse.Namespace) -> int:
    for flag, value, least in (
        ("--pairs", args.pairs, 1),
        ("--eval-pairs", args.eval_pairs, 0),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--batch-size", args.batch_size, 2),
    ):
        if value < least:
            raise UserError(f"{flag} must be >= {least}, got {value}")
    if not Path(args.model).is_dir():
        raise UserError(f"--model: policy folder not found: {args.model}")
    set_threads()
    from rlhfkit.rollout.pairs import label_pairs

    summary = label_pairs(
        args.model,
        args.out,
        task=args.task,
        task_seed=args.task_seed,
        num_pairs=args.pairs,
        num_eval_pairs=args.eval_pairs,
        seed=args.seed,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        annotator_temperature=args.annotator_temperature,
        overwrite=args.overwrite,
    )
    train, held = summary["train"], summary["eval"]
    ceiling = held["bayes_ceiling"] if held["bayes_ceiling"] is not None else train["bayes_ceiling"]
    print(
        f"{train['pairs']} training pairs -> {train['file']}; {held['pairs']} held-out pairs -> {held['file']}; "
        f"annotators' Bayes ceiling {'n/a' if ceiling is None else f'{ceiling:.3f}'}; "
        f"{summary['seconds']['total']:.1f} s"
    )
    return 0


def report_command(args: argparse.Namespace) -> int:
    for run_dir in args.run_dirs:
        if not Path(run_dir).is_dir():
            raise UserError(f"run folder not found: {run_dir}")
    if args.out is not None and len(args.run_dirs) == 1:
        raise UserError(
            "--out names the side-by-side page of several runs; one run's page is RUN_DIR/report.html"
        )
    set_threads()
    from rlhfkit.reporting.report import write_reports

    for path in write_reports(args.run_dirs, args.out):
        print(f"wrote {path}")
    return 0


def set_threads() -> None:
    """Every command sets torch's thread count before any work (docs/design.md, "Threads"); after the
    checks of its arguments, so that a mistake is reported without waiting for torch to import."""
    from rlhfkit.engine import threads

    threads.set_num_threads()
    # transformers' per-load "Loading weights" bars add nothing to rlhfkit's own progress display.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # Its load reports (e.g. "score.weight MISSING" when a reward model is built on a causal LM) are
    # expected here; rlhfkit's own checks raise clear errors for what is really wrong.
    hf_logging.set_verbosity_error()
