"""The ``rlhfkit`` command.

    rlhfkit train {sft,reward,prm,ppo,grpo,rloo,distill,dpo} --config FILE.yaml [--resume | --overwrite] [dotted.key=value ...]
    rlhfkit quickstart [--out DIR] [--preset tiny|small] [--overwrite] [--refresh-steps K]
    rlhfkit generate --model DIR --prompts FILE [--greedy | --temperature T] [--out FILE] [--reward-model DIR]
                     [--reward-function FILE.py:FN ...] [--backend hf|vllm]
    rlhfkit label-pairs --model DIR --out DIR [--pairs N] [--eval-pairs N] [--seed S] [--overwrite]
    rlhfkit report RUN_DIR [RUN_DIR ...] [--out FILE]
    rlhfkit config init KIND                                     # a commented YAML of KIND's keys and defaults
    rlhfkit config show KIND [--config FILE] [dotted.key=value ...]   # the run's checks, the resolved config
    rlhfkit config reference > docs/configuration.md             # every key, from the dataclasses

A user's mistake (a :class:`rlhfkit.errors.UserError`: bad configuration, bad data, an occupied output
folder) prints one line ``rlhfkit: error: <message>`` on stderr and exits with code 2. A run that stops on
purpose prints ``rlhfkit: stopped: <message>``: exit 3 when it diverged (a non-finite loss, gradient, reward
or value: :mod:`rlhfkit.engine.guards`), 130 / 143 after SIGINT / SIGTERM (:mod:`rlhfkit.engine.signals`),
5 in a process of a multi-process run whose collective failed because another process raised, was killed or
stopped answering for ``train.collective_timeout`` seconds (the failing process keeps its own traceback).
A full disk gives one line and exit 1. Any other exception is a bug and keeps its traceback. :func:`main` takes ``argv`` and returns the exit code, so tests call it
in-process.

Each command's arguments are parsed here and handed to its function in :mod:`rlhfkit.commands`, which imports
what does the work only when the command runs, so that ``rlhfkit --help`` stays fast; a new trainer plugs in
with one line in :func:`rlhfkit.commands.trainer`.

One process: ``rlhfkit train ppo --config ppo.yaml``. Several (data parallel): ``torchrun --standalone
--nproc_per_node N -m rlhfkit.cli train ppo --config ppo.yaml`` (CPU or GPUs), or on GPUs ``accelerate launch
--multi_gpu --num_processes N -m rlhfkit.cli train ppo --config ppo.yaml``. Every process leaves the process
group at the end (:func:`rlhfkit.engine.accel.end_processes`).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence

from rlhfkit import __version__
from rlhfkit.commands import (
    DEFAULT_TEMPERATURE,
    config_init_command,
    config_reference_command,
    config_show_command,
    generate_command,
    label_pairs_command,
    quickstart_command,
    report_command,
    train_command,
)
from rlhfkit.config import KINDS
from rlhfkit.errors import ProcessLost, RunStopped, UserError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            takes_overrides = args.command == "train" or getattr(args, "tool", None) == "show"
            if not takes_overrides or any(a.startswith("-") or "=" not in a for a in extra):
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
    except Exception as e:  # a collective failed: another process ended or stopped answering
        stop = _lost_process(e)
        if stop is None:
            raise
        print(f"rlhfkit: stopped: {stop}", file=sys.stderr, flush=True)
        return ProcessLost.exit_code
    finally:
        _leave_process_group(wait=ok)
        if "rlhfkit.engine.folder" in sys.modules:  # the command is over: so is its hold on run folders
            sys.modules["rlhfkit.engine.folder"].release_locks()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        "here as dotted.key=value (parsed as YAML: 1e-5, true, null, [a, b]). `rlhfkit train KIND --help` "
        "lists the keys KIND reads, with KIND's defaults; docs/configuration.md lists them all.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    train.add_argument(
        "-h", "--help", action=_KindHelp, nargs=0, help="show this help (after KIND: KIND's keys) and exit"
    )
    train.add_argument("kind", choices=KINDS, help=KIND_HELP)
    train.add_argument("--config", required=True, metavar="FILE", help="the run's YAML configuration")
    folder = train.add_mutually_exclusive_group()
    folder.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in output_dir from its newest complete checkpoint",
    )
    folder.add_argument("--overwrite", action="store_true", help="delete output_dir's run and start again")
    train.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="configuration overrides")
    train.set_defaults(run=train_command)

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
        choices=("reviews", "arithmetic", "tools", "distill"),
        default="reviews",
        help="built-in task: reviews (SFT, reward model, PPO), arithmetic (checkable answers: SFT, PRM and ORM, "
        "GRPO and PPO), tools (GRPO and PPO with a calculator tool) or distill (the reviews task's PPO policy "
        "of the small model distilled on-policy into a tiny SFT student) (default: %(default)s)",
    )
    quick.add_argument("--teacher", metavar="DIR", help="--task distill: distil this policy folder")
    quick.add_argument("--overwrite", action="store_true", help="delete DIR's previous quickstart first")
    quick.add_argument(
        "--refresh-steps",
        type=int,
        default=0,
        metavar="K",
        help="refresh the reward model every K PPO rollouts on new pairs from the current policy, "
        "labelled by the task's annotators (default: 0, never)",
    )
    quick.set_defaults(run=quickstart_command)

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
    gen.add_argument(
        "--reward-function",
        action="append",
        default=[],
        dest="reward_functions",
        metavar="FILE.py:FN",
        help="add each response's score from this reward function, named as in online.reward_functions "
        "(path/to/file.py:fn or pkg.module:fn; TRL's convention, called with the prompts file's other "
        'columns); repeat for several, each part\'s own score goes under "parts"',
    )
    gen.add_argument(
        "--backend",
        choices=("hf", "vllm"),
        default="hf",
        help="what samples: hf (Hugging Face generate) or vllm (a vLLM engine in this process, "
        '`pip install "rlhfkit[vllm]"`; docs/generation_backend.md) (default: %(default)s)',
    )
    gen.add_argument(
        "--hf-decode",
        choices=("dynamic", "static", "compiled"),
        default="dynamic",
        help="the hf backend's key / value cache, as online.hf_decode: dynamic, static (allocated once) or "
        "compiled (static, the decoding step compiled by torch.compile on the first batch) (default: %(default)s)",
    )
    gen.add_argument(
        "--sampler",
        choices=("exact", "multinomial"),
        default="exact",
        help="the hf backend's draw, as online.sampler: exact (rlhfkit's own, each prompt's own random stream) or "
        "multinomial (torch.multinomial, earlier versions' draw) (default: %(default)s)",
    )
    gen.set_defaults(run=generate_command)

    lab = commands.add_parser(
        "label-pairs",
        help="sample response pairs from a policy and label them with a built-in task's annotators",
        description="Sample two responses per prompt from a policy (an SFT run's final/) on a built-in task's "
        "train and held-out prompts, label each pair with the task's simulated annotators "
        "(Bradley-Terry noise on the gold score), and write pairs_train.jsonl, pairs_eval.jsonl "
        "(with gold scores for evaluation) and labels.json (counts, Bayes ceiling) into --out.",
    )
    lab.add_argument(
        "--model",
        "--policy",
        dest="model",
        required=True,
        metavar="DIR",
        action=_OldSpelling,
        help="the policy folder that samples the responses (e.g. <run>/final), as `generate --model`; "
        "--policy is its old spelling, still read (with a warning) in this release",
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
    lab.set_defaults(run=label_pairs_command)

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
    rep.set_defaults(run=report_command)
    _config_parser(commands)
    return parser


KIND_HELP = (
    "sft, reward (Bradley-Terry), prm (process reward), ppo, grpo, rloo, distill (on-policy distillation "
    "from online.teacher_model), dpo (direct preference optimization); REINFORCE++ is ppo with "
    "online.advantage_estimator=reinforce_pp (no critic)"
)


class _OldSpelling(argparse.Action):
    """Stores the value; an option given by its old spelling (every spelling after the first) also prints
    one warning naming the new one. Old spellings are read for one release, then removed."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None and option_string != self.option_strings[0]:
            print(
                f"rlhfkit: warning: {option_string} is now {self.option_strings[0]}; the old spelling goes in "
                "the next release",
                file=sys.stderr,
            )
        setattr(namespace, self.dest, values)


class _KindHelp(argparse.Action):
    """``rlhfkit train KIND --help``: the usage, then the keys KIND reads at KIND's defaults (or, before a
    KIND, the sections each kind reads). The keys' help names the choices ``rlhfkit.algos`` declares, and
    importing it imports torch, which argument errors and the other commands need not wait for: the list is
    built only here."""

    def __call__(self, parser, namespace, values, option_string=None):
        from rlhfkit.config import KIND_SECTIONS, ONLINE_KINDS, config_help

        kind = getattr(namespace, "kind", None)
        if kind in KINDS:
            parser.epilog = f"configuration keys of `train {kind}`:\n" + config_help(kind=kind)
            if kind in ONLINE_KINDS:
                parser.epilog += (
                    "\nrefresh.*: not listed: `rlhfkit train` has no labeller for the new pairs a reward-model "
                    "refresh needs (it runs in `rlhfkit quickstart --refresh-steps K`, or from Python with "
                    "OnlineHooks.refresh_reward_model); docs/configuration.md lists its keys"
                )
        else:
            parser.epilog = (
                "sections each kind reads (rlhfkit train KIND --help lists their keys):\n"
                + "\n".join(f"  {k}: {', '.join(KIND_SECTIONS[k])}" for k in KINDS)
            )
        parser.print_help()
        parser.exit()


def _config_parser(commands) -> None:
    """``rlhfkit config init|show|reference``: a configuration written, checked or described without a run."""
    conf = commands.add_parser(
        "config",
        help="write, check or describe a configuration without training",
        description="Configuration tools: `init` writes a commented YAML of a kind's keys and defaults, `show` "
        "checks a configuration as a run does before loading a model and prints it resolved (exit 2 with the "
        "error a run would give), "
        "`reference` writes the Markdown reference of every key (docs/configuration.md). None loads a model.",
    )
    tools = conf.add_subparsers(dest="tool", required=True, metavar="TOOL")
    init = tools.add_parser(
        "init",
        help="print a commented YAML of KIND's keys at KIND's defaults",
        description="Print every key `rlhfkit train KIND` reads, at KIND's defaults, with its help as a "
        "comment: `rlhfkit config init grpo > grpo.yaml`, then fill in the required keys.",
    )
    init.add_argument("kind", choices=KINDS, help=KIND_HELP)
    init.set_defaults(run=config_init_command)
    show = tools.add_parser(
        "show",
        help="validate a configuration and print it resolved",
        description="Resolve the configuration exactly as `rlhfkit train KIND` would (defaults < KIND's "
        "defaults < FILE < dotted.key=value), run the run's own pre-flight (data files and every row, reward "
        "functions, tools and environment against the data, model folders), and print the keys KIND reads; "
        "a mistake exits 2 with the error a run would give. No model is loaded and nothing is downloaded (a "
        "Hub dataset is named as not read).",
    )
    show.add_argument("kind", choices=KINDS, help=KIND_HELP)
    show.add_argument("--config", metavar="FILE", help="the run's YAML configuration")
    show.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="configuration overrides")
    show.set_defaults(run=config_show_command)
    ref = tools.add_parser(
        "reference",
        help="print the Markdown reference of every configuration key",
        description="Print docs/configuration.md (every key's type, default per kind and help, from the "
        "configuration dataclasses): `rlhfkit config reference > docs/configuration.md`.",
    )
    ref.set_defaults(run=config_reference_command)


def _lost_process(exc: BaseException) -> str | None:
    """The one line for a process whose collective failed because another process of its run ended or stopped
    answering (:func:`rlhfkit.engine.accel.lost_process`), naming the newest complete checkpoint of the run
    folder it holds (the main process); None for any other exception."""
    if "torch" not in sys.modules:
        return None
    from rlhfkit.engine.accel import lost_process
    from rlhfkit.engine.checkpoint import complete_checkpoints
    from rlhfkit.engine.folder import held_folders

    cause = lost_process(exc)
    if cause is None:
        return None
    newest = [
        found[-1] for folder in held_folders() if (found := complete_checkpoints(folder / "checkpoints"))
    ]
    where = (
        f"the newest complete checkpoint is {newest[-1]}; run the same command with --resume to continue"
        if newest
        else "run the same command with --resume to continue from the newest complete checkpoint, if any"
    )
    return f"{cause}; the run stops here; {where}"


def _leave_process_group(wait: bool) -> None:
    """Every command ends by leaving the process group of a multi-process launch (none: nothing to do);
    only when torch is already imported, so that ``--help`` and argument errors stay fast."""
    if "torch" in sys.modules:
        from rlhfkit.engine.accel import end_processes

        end_processes(wait)


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
