"""What each ``rlhfkit`` command does once :mod:`rlhfkit.cli` has parsed its arguments: check them (a mistake
is a UserError, reported before torch is imported), set the thread count, then call the function that does the
work, imported only then so that ``rlhfkit --help`` stays fast."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhfkit.config import RunConfig, load_config, nest_keys
from rlhfkit.errors import ConfigError, DataError, UserError

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
    else:  # ppo, grpo, rloo and distill: one online loop (rlhfkit.config.ONLINE_KINDS)
        from rlhfkit.trainers.online import train
    return train


def train_config(
    kind: str, path: str | None, overrides: list[str], layers: tuple[tuple[str, dict], ...] = ()
) -> RunConfig:
    """The configuration of ``rlhfkit train KIND``, checked as the run checks it (``rlhfkit config show``
    gives the same errors): :func:`rlhfkit.config.load_config`, and what the command line cannot provide.
    ``layers``: keys given from Python (:func:`train_from_python`)."""
    cfg: RunConfig = load_config(path, overrides, kind, layers=layers)
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
    run_training(args.kind, cfg, resume=args.resume, overwrite=args.overwrite)
    return 0


def run_training(
    kind: str,
    cfg: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    train_rows: Path | None = None,
) -> RunConfig:
    """Train ``kind`` with the checked ``cfg``: prepare the run folder (--resume / --overwrite), train, print
    the headline figures. ``train_rows``: an in-memory dataset's rows (:func:`train_from_python`), copied into
    the run folder (inputs/) once it is prepared and read from there, so that the run's ``config.yaml`` resumes it.
    Returns the configuration the run used."""
    set_threads()
    from rlhfkit.rollout.preflight import preflight

    # files, every data row, reward functions, tools, model folders: before anything is written
    preflight(cfg)
    from rlhfkit.engine.accel import launch_rank
    from rlhfkit.engine.folder import prepare_output_dir  # imports torch
    from rlhfkit.engine.signals import graceful_stop

    train = trainer(kind)
    if (
        launch_rank() == 0
    ):  # one process checks (and with --overwrite empties) the folder; the others wait for it
        prepare_output_dir(cfg.output_dir, resume=resume, overwrite=overwrite)
    if train_rows is not None:
        cfg = _with_rows_in_run_folder(cfg, train_rows)
    if resume:
        from rlhfkit.engine.folder import finished_run

        done = finished_run(cfg.output_dir, cfg.train.max_steps)
        if done is not None:  # its final/ and summary.json stay as they are
            if launch_rank() == 0:
                print(
                    f"rlhfkit: {cfg.output_dir} is a finished run (step {done}); nothing to resume. A larger "
                    "train.max_steps continues it",
                    file=sys.stderr,
                )
            return cfg
    with graceful_stop():  # SIGTERM / SIGINT: finish the step, checkpoint, exit 128 + signal
        train(cfg, resume=resume)
    if launch_rank() == 0:  # where the run is and its headline figures, on a terminal or in a job's log
        from rlhfkit.reporting.headline import end_of_run_lines

        print("\n".join(end_of_run_lines(cfg.output_dir)), flush=True)
    return cfg


def config_init_command(args: argparse.Namespace) -> int:
    from rlhfkit.config.describe import init_yaml

    sys.stdout.write(init_yaml(args.kind))
    return 0


def config_show_command(args: argparse.Namespace) -> int:
    """Print the resolved configuration of ``rlhfkit train KIND``, the keys KIND reads, as YAML that
    ``rlhfkit train KIND --config`` reads back, after the run's own pre-flight
    (:func:`rlhfkit.rollout.preflight.preflight`: files, every data row, reward functions, tools, model
    folders); loads no model and downloads nothing (a Hub dataset is named as not read)."""
    import yaml

    from rlhfkit.config import KIND_SECTIONS, config_to_dict
    from rlhfkit.rollout.preflight import preflight

    cfg = train_config(args.kind, args.config, args.overrides)
    checked = preflight(cfg, download=False)
    resolved = config_to_dict(cfg)
    shown = {"output_dir": resolved["output_dir"], "seed": resolved["seed"], "kind": resolved["kind"]}
    shown.update({name: resolved[name] for name in KIND_SECTIONS[args.kind]})
    rows = sum(len(r) for r in (checked.records, checked.heldout) if r is not None)
    print(
        f"# rlhfkit train {args.kind}: the resolved configuration, checked as the run checks it before "
        f"loading a model ({rows} data rows read)"
    )
    if checked.not_read:
        print(f"# not read (a Hub dataset: the run downloads it): {', '.join(checked.not_read)}")
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
    if args.teacher is not None and args.task != "distill":
        raise UserError(f"--teacher is for --task distill (the teacher to distil), not --task {args.task}")
    if args.task == "distill":
        from rlhfkit.quickstart.distillation import DISTILL_PRESETS, quickstart_distill

        if args.preset not in DISTILL_PRESETS or args.refresh_steps:
            raise UserError(
                f"--task distill runs the presets {sorted(DISTILL_PRESETS)} and no reward-model refresh"
            )
        if args.teacher is not None and not Path(args.teacher).is_dir():
            raise UserError(f"--teacher: folder not found: {args.teacher}")
        prepare_output_dir(args.out, overwrite=args.overwrite)
        quickstart_distill(args.out, args.preset, seed=args.seed, teacher=args.teacher)
        return 0
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


# ---------------------------------------------------------------------------------------------------------
# The Python entry point (rlhfkit.train)

TRAIN_DATASET = (
    "train_dataset"  # how errors name an in-memory dataset; its rows file in the run folder + .jsonl
)


def train_from_python(
    kind: str, config: Any, train_dataset: Any = None, *, resume: bool = False, overwrite: bool = False
) -> Path:
    """:func:`rlhfkit.train`: ``rlhfkit train KIND`` from Python, through the same checks and errors.

    ``config`` is a YAML file's path or a dict (nested sections and/or dotted keys, :func:`rlhfkit.config.nest_keys`).
    ``train_dataset`` (a ``datasets.Dataset`` or a list of dicts) takes the place of ``data.train_file``: its rows
    are written as JSON Lines and read by the data layer like a file, so every row is checked as a file's is, and
    an error names ``train_dataset``, the row (0-based) and the field.
    """
    if isinstance(config, str | Path):
        path, layers = str(config), ()
    elif isinstance(config, dict):
        path, layers = None, (("the config dict", nest_keys(config, "the config dict")),)
    else:
        raise ConfigError(
            f"config: expected a YAML file's path or a dict of keys, got {type(config).__name__}"
        )
    with tempfile.TemporaryDirectory(prefix="rlhfkit-") as tmp:
        rows = None
        if train_dataset is not None:
            _refuse_a_second_train_file(path, layers)
            rows = _write_rows(train_dataset, Path(tmp) / f"{TRAIN_DATASET}.jsonl")
            layers += ((TRAIN_DATASET, {"data": {"train_file": str(rows)}}),)
        names = [] if rows is None else [str(rows)]
        with _naming_the_dataset(names):
            cfg = train_config(kind, path, [], layers=layers)
            if rows is not None:
                names.append(str(_with_rows_in_run_folder(cfg, rows, copy=False).data.train_file))
            cfg = run_training(kind, cfg, resume=resume, overwrite=overwrite, train_rows=rows)
    return Path(cfg.output_dir)


def _refuse_a_second_train_file(path: str | None, layers: tuple[tuple[str, dict], ...]) -> None:
    if path is not None:
        import yaml

        try:
            values = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):  # load_config reports an unreadable file in its own words
            return
        where = path
    else:
        where, values = layers[0]
    data = values.get("data") if isinstance(values, dict) else None
    if isinstance(data, dict) and data.get("train_file") is not None:
        raise ConfigError(
            f"{where}: data.train_file is set and train_dataset is given; both name the training data, so "
            "remove one"
        )


def _write_rows(dataset: Any, path: Path) -> Path:
    """``dataset`` (a list of dicts, or a ``datasets.Dataset``: anything with ``to_list()``) as JSON Lines."""
    if hasattr(dataset, "keys") and not hasattr(dataset, "to_list"):  # a DatasetDict
        raise DataError(
            TRAIN_DATASET, f"expected one split, e.g. train_dataset['train'], got {list(dataset.keys())}"
        )
    rows = dataset.to_list() if hasattr(dataset, "to_list") else dataset
    if not isinstance(rows, list):
        raise DataError(
            TRAIN_DATASET, f"expected a datasets.Dataset or a list of dicts, got {type(dataset).__name__}"
        )
    if not rows:
        raise DataError(TRAIN_DATASET, "has no rows")
    lines = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(
                TRAIN_DATASET, f"expected a dict, got {type(row).__name__}", line=index, row_kind="row"
            )
        try:
            lines.append(json.dumps(row, ensure_ascii=False))
        except (TypeError, ValueError) as error:
            raise DataError(TRAIN_DATASET, f"not JSON data: {error}", line=index, row_kind="row") from None
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _with_rows_in_run_folder(cfg: RunConfig, rows: Path, copy: bool = True) -> RunConfig:
    """``cfg`` reading its training rows from a copy of ``rows`` in the run folder's inputs/."""
    from rlhfkit.engine.folder import INPUTS_DIR

    kept = Path(cfg.output_dir) / INPUTS_DIR / rows.name
    if copy:
        kept.parent.mkdir(exist_ok=True)
        shutil.copyfile(rows, kept)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_file=str(kept)))


@contextlib.contextmanager
def _naming_the_dataset(names: list[str]):
    """A user's error about the rows file (at any of ``names``: written, then copied into the run folder) names
    ``train_dataset`` and the row (0-based) instead of the file and its line (1-based): the rows the caller
    passed, not a file they never wrote."""
    try:
        yield
    except DataError as error:
        if str(error.source) not in names:
            raise
        line = error.line if error.line is None or error.row_kind == "row" else error.line - 1
        raise DataError(TRAIN_DATASET, error.message, line=line, field=error.field, row_kind="row") from None
    except UserError as error:
        text = str(error)
        for name in names:
            text = text.replace(name, TRAIN_DATASET)
        if text == str(error):
            raise
        raise type(error)(text) from None
