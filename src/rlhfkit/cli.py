"""The ``rlhfkit`` command.

    rlhfkit train {sft,reward,prm,ppo,grpo,rloo,dpo} --config FILE.yaml [--resume | --overwrite] [dotted.key=value ...]
    rlhfkit quickstart [--out DIR] [--preset tiny|small] [--overwrite] [--refresh-steps K]
    rlhfkit generate --model DIR --prompts FILE [--greedy | --temperature T] [--out FILE] [--reward-model DIR]
    rlhfkit label-pairs --policy DIR --out DIR [--pairs N] [--eval-pairs N] [--seed S] [--overwrite]
    rlhfkit report RUN_DIR [RUN_DIR ...] [--out FILE]

A user's mistake (a :class:`rlhfkit.errors.UserError`: bad configuration, bad data, an occupied output
folder) prints one line ``rlhfkit: error: <message>`` on stderr and exits with code 2. A run that stops on
purpose prints ``rlhfkit: stopped: <message>``: exit 3 when it diverged (a non-finite loss, gradient, reward
or value: :mod:`rlhfkit.engine.guards`), 130 / 143 after SIGINT / SIGTERM (:mod:`rlhfkit.engine.signals`).
A full disk gives one line and exit 1. Any other exception is a bug and keeps its traceback. :func:`main` takes ``argv`` and returns the exit code, so tests call it
in-process.

Each command runs a function named in :data:`TARGETS` (``module:function``), imported only when that
command runs, so a new trainer plugs in with one line here and ``rlhfkit --help`` stays fast.

One process: ``rlhfkit train ppo --config ppo.yaml``. Several (data parallel): ``torchrun --standalone
--nproc_per_node N -m rlhfkit.cli train ppo --config ppo.yaml`` (CPU or GPUs), or on GPUs ``accelerate launch
--multi_gpu --num_processes N -m rlhfkit.cli train ppo --config ppo.yaml``. Every process leaves the process
group at the end (:func:`rlhfkit.engine.accel.end_processes`).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rlhfkit import __version__
from rlhfkit.config import KINDS, config_help, load_config
from rlhfkit.errors import RunStopped, UserError

# Command -> "module:function". Trainers are called as train(cfg: RunConfig, resume: bool).
TARGETS: dict[str, str] = {
    "sft": "rlhfkit.trainers.sft:train",
    "reward": "rlhfkit.trainers.reward:train",
    "prm": "rlhfkit.trainers.prm:train_prm",
    "ppo": "rlhfkit.trainers.online:train",
    "grpo": "rlhfkit.trainers.online:train",
    "rloo": "rlhfkit.trainers.online:train",
    "dpo": "rlhfkit.trainers.dpo:train",
    "quickstart": "rlhfkit.pipeline:quickstart",  # quickstart(out_dir, preset, overwrite)
    "generate": "rlhfkit.rollout.generate_cli:generate",  # see _generate
    "report": "rlhfkit.report:write_reports",  # write_reports(run_dirs, out)
    "label-pairs": "rlhfkit.rollout.pairs:label_pairs",  # see _label_pairs
}
DEFAULT_TEMPERATURE = 0.7  # as online.temperature (Huang et al. 2024)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            if args.command != "train" or any(a.startswith("-") or "=" not in a for a in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides = [*args.overrides, *extra]  # overrides written before an option
    except SystemExit as e:  # --help, or a usage error that argparse has already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)

    ok = False
    try:
        code = args.run(args) or 0
        ok = True
        return code
    except UserError as e:
        message = " ".join(str(e).split("\n"))
        print(f"rlhfkit: error: {message}", file=sys.stderr)
        return 2
    except RunStopped as e:  # diverged (3), or a signal asked to stop (128 + signal)
        print(f"rlhfkit: stopped: {' '.join(str(e).split())}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"rlhfkit: error: {e.strerror} while writing {e.filename or 'a file'}", file=sys.stderr)
        return 1
    finally:
        _leave_process_group(wait=ok)
        if "rlhfkit.engine.folder" in sys.modules:  # the command is over: so is its hold on run folders
            sys.modules["rlhfkit.engine.folder"].release_locks()


class _Parser(argparse.ArgumentParser):
    """An argument parser whose epilog may be a function, called only when the help is printed: the
    configuration keys' help names the choices ``rlhfkit.algos`` declares, and importing it imports torch,
    which argument errors and the other commands need not wait for."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rlhfkit",
        description="Classic RLHF on Hugging Face language models: SFT, reward models, PPO "
        "(and GRPO / RLOO / REINFORCE++).",
    )
    parser.add_argument("--version", action="version", version=f"rlhfkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train one model from a YAML configuration",
        description="Train one model. Every configuration key can be set in the YAML file or overridden "
        "here as dotted.key=value (parsed as YAML: 1e-5, true, null, [a, b]).",
        epilog=lambda: "configuration keys:\n" + config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument(
        "kind",
        choices=KINDS,
        help="sft, reward (Bradley-Terry), prm (process reward), ppo, grpo, rloo, dpo (direct preference "
        "optimization)",
    )
    train.add_argument("--config", required=True, metavar="FILE", help="the run's YAML configuration")
    folder = train.add_mutually_exclusive_group()
    folder.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in output_dir from its newest complete checkpoint",
    )
    folder.add_argument("--overwrite", action="store_true", help="delete output_dir's run and start again")
    train.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="configuration overrides")
    train.set_defaults(run=_train)

    quick = commands.add_parser(
        "quickstart",
        help="the whole pipeline on the built-in task",
        description="SFT -> preference labelling -> reward model -> PPO, and DPO on the same pairs -> "
        "evaluation on the built-in offline task; writes summary.json and a report.",
    )
    quick.add_argument(
        "--out", default="runs/quickstart", metavar="DIR", help="output folder (default: %(default)s)"
    )
    quick.add_argument(
        "--preset",
        choices=("tiny", "small", "smoke"),
        default="tiny",
        help="model and run sizes: tiny (minutes on a laptop CPU), small (a GPU, or patience), "
        "smoke (every stage, seconds each: for tests)",
    )
    quick.add_argument("--seed", type=int, default=0, help="seeds the task, every model and every sample")
    quick.add_argument(
        "--task",
        choices=("reviews", "arithmetic"),
        default="reviews",
        help="built-in task: reviews (SFT, reward model, PPO) or arithmetic (checkable answers: SFT, PRM, "
        "GRPO on the exact-match reward, PPO on it with and without the PRM's step rewards, PPO on an ORM) "
        "(default: %(default)s)",
    )
    quick.add_argument("--overwrite", action="store_true", help="delete DIR's previous quickstart first")
    quick.add_argument(
        "--refresh-steps",
        type=int,
        default=0,
        metavar="K",
        help="refresh the reward model every K PPO rollouts on new pairs from the current policy, "
        "labelled by the task's annotators (default: 0, never)",
    )
    quick.set_defaults(run=_quickstart)

    gen = commands.add_parser(
        "generate",
        help="sample responses from a trained policy",
        description="Sample one response per prompt and write JSON Lines.",
    )
    gen.add_argument("--model", required=True, metavar="DIR", help="a policy folder (e.g. <run>/final)")
    gen.add_argument("--prompts", required=True, metavar="FILE", help='prompts file ({"prompt": ...} rows)')
    how = gen.add_mutually_exclusive_group()
    how.add_argument("--greedy", action="store_true", help="take the most likely token")
    how.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help=f"sampling temperature (default: {DEFAULT_TEMPERATURE})",
    )
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default: %(default)s")
    gen.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    gen.add_argument(
        "--out", metavar="FILE", help="write {prompt, response} JSON Lines here (default: stdout)"
    )
    gen.add_argument(
        "--reward-model",
        metavar="DIR",
        help="add each response's score from this reward model (a `train reward` run's final/)",
    )
    gen.set_defaults(run=_generate)

    lab = commands.add_parser(
        "label-pairs",
        help="sample response pairs from a policy and label them with a built-in task's annotators",
        description="Sample two responses per prompt from a policy (an SFT run's final/) on a built-in task's "
        "train and held-out prompts, label each pair with the task's simulated annotators "
        "(Bradley-Terry noise on the gold score), and write pairs_train.jsonl, pairs_eval.jsonl "
        "(with gold scores for evaluation) and labels.json (counts, Bayes ceiling) into --out.",
    )
    lab.add_argument(
        "--policy", required=True, metavar="DIR", help="the policy folder that samples the responses"
    )
    lab.add_argument("--out", required=True, metavar="DIR", help="output folder")
    lab.add_argument("--task", default="reviews", help="built-in task (default: %(default)s)")
    lab.add_argument(
        "--task-seed",
        type=int,
        default=0,
        metavar="S",
        help="the task's seed, i.e. its prompt split: the one the SFT data used (default: %(default)s)",
    )
    lab.add_argument(
        "--pairs", type=int, default=2000, metavar="N", help="training pairs (default: %(default)s)"
    )
    lab.add_argument(
        "--eval-pairs", type=int, default=500, metavar="N", help="held-out pairs (default: %(default)s)"
    )
    lab.add_argument("--seed", type=int, default=0, help="sampling and annotator seed (default: %(default)s)")
    lab.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="sampling temperature (default: %(default)s)",
    )
    lab.add_argument(
        "--annotator-temperature",
        type=float,
        metavar="T",
        help="the annotators' Bradley-Terry temperature (default: the task's)",
    )
    lab.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default: %(default)s")
    lab.add_argument(
        "--batch-size",
        type=int,
        default=512,
        metavar="N",
        help="responses per generate call (default: %(default)s)",
    )
    lab.add_argument("--overwrite", action="store_true", help="replace the files already in --out")
    lab.set_defaults(run=_label_pairs)

    rep = commands.add_parser(
        "report",
        help="a run's report page (report.html) and plots; several runs side by side",
        description="Write report.html (one self-contained page: summary, PPO health with warning signs, "
        "reward-model calibration, a sample browser), report.md and report/*.png into each RUN_DIR. "
        "With several run folders, also one page with their curves overlaid and their summaries in "
        "one table.",
    )
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    rep.add_argument(
        "--out",
        metavar="FILE",
        help="the side-by-side page of several runs (default: compare.html in their parent folder)",
    )
    rep.set_defaults(run=_report)
    return parser


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides, args.kind)
    _set_threads()
    from rlhfkit.engine.accel import launch_rank
    from rlhfkit.engine.run import prepare_output_dir  # imports torch
    from rlhfkit.engine.signals import graceful_stop

    train = resolve(TARGETS[args.kind])
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
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from rlhfkit.engine.run import prepare_output_dir

    _set_threads()
    quickstart = resolve(TARGETS["quickstart"])
    if args.refresh_steps < 0:
        raise UserError(
            f"--refresh-steps must be 0 (off) or a positive number of rollouts, got {args.refresh_steps}"
        )
    if args.task != "reviews":
        from rlhfkit.verifiable import VERIFIABLE_PRESETS, quickstart_verifiable

        if args.preset not in VERIFIABLE_PRESETS or args.refresh_steps:
            raise UserError(
                f"--task {args.task} runs the presets {sorted(VERIFIABLE_PRESETS)} and no reward-model refresh"
            )
        prepare_output_dir(args.out, overwrite=args.overwrite)
        quickstart_verifiable(args.out, args.task, args.preset, args.overwrite, seed=args.seed)
        return 0
    prepare_output_dir(args.out, overwrite=args.overwrite)
    quickstart(args.out, args.preset, args.overwrite, seed=args.seed, refresh_steps=args.refresh_steps)
    return 0


def _generate(args: argparse.Namespace) -> int:
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
    _set_threads()
    generate = resolve(TARGETS["generate"])
    # temperature 0 means greedy decoding.
    generate(
        args.model,
        args.prompts,
        out=args.out,
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        reward_model=args.reward_model,
    )
    return 0


def _label_pairs(args: argparse.Namespace) -> int:
    for flag, value, least in (
        ("--pairs", args.pairs, 1),
        ("--eval-pairs", args.eval_pairs, 0),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--batch-size", args.batch_size, 2),
    ):
        if value < least:
            raise UserError(f"{flag} must be >= {least}, got {value}")
    if not Path(args.policy).is_dir():
        raise UserError(f"policy folder not found: {args.policy}")
    _set_threads()
    summary = resolve(TARGETS["label-pairs"])(
        args.policy,
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


def _report(args: argparse.Namespace) -> int:
    for run_dir in args.run_dirs:
        if not Path(run_dir).is_dir():
            raise UserError(f"run folder not found: {run_dir}")
    if args.out is not None and len(args.run_dirs) == 1:
        raise UserError(
            "--out names the side-by-side page of several runs; one run's page is RUN_DIR/report.html"
        )
    _set_threads()
    for path in resolve(TARGETS["report"])(args.run_dirs, args.out):
        print(f"wrote {path}")
    return 0


def _set_threads() -> None:
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


def _leave_process_group(wait: bool) -> None:
    """Every command ends by leaving the process group of a multi-process launch (none: nothing to do);
    only when torch is already imported, so that ``--help`` and argument errors stay fast."""
    if "torch" in sys.modules:
        from rlhfkit.engine.accel import end_processes

        end_processes(wait)


def resolve(target: str) -> Callable:
    """Import ``"module:function"`` and return the function (an import error is a bug and propagates)."""
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def console() -> None:
    """The ``rlhfkit`` program (also ``python -m rlhfkit`` and ``python -m rlhfkit.cli``): :func:`main`, then exit.

    A process of a multi-process launch (``WORLD_SIZE`` > 1: torchrun, accelerate) ends with ``os._exit``
    once :func:`main` has returned, that is after it left the process group and every run file was closed,
    and after stdout and stderr are flushed. Without it the interpreter's own finalisation may destroy gloo's
    process group while its worker threads are still joinable, and the process aborts in C++ ("terminate
    called without an active exception", SIGABRT) after the run has finished: seen in 2 of 25 two-process
    `train prm` launches here (pytorch/pytorch#96017: destroy_process_group drops only c10d's references),
    and torchrun then reports the finished run as failed. ``os._exit`` skips that finalisation (and atexit
    hooks: rlhfkit closes what it opened before :func:`main` returns, W&B included). One process exits as
    usual. In-process callers use :func:`main`, which never exits.
    """
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
