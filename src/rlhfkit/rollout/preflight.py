"""The pre-flight of a run: what ``rlhfkit train KIND`` checks before its first model load, in one function
(:func:`preflight`) that ``rlhfkit train`` and ``rlhfkit config show`` both call, so that ``config show`` stops
with the run's own error, in seconds, without loading a model.

In order, each failure a :class:`rlhfkit.errors.UserError` that names the key, the file, the row or the
function:

1. model folders (``model.name_or_path``; ``online.reward_model``, ``online.critic_model``,
   ``online.process_reward_model``, ``online.teacher_model``; ``dpo.reference_model``): a local-looking path
   that is not a folder is named at once, without asking the Hub (:func:`rlhfkit.models.loading.check_model_path`);
   a folder must hold ``config.json`` (or a LoRA adapter's ``adapter_config.json``); anything else must be a
   well-formed Hub name; a distillation teacher's vocabulary is the student's, token for token
   (:func:`rlhfkit.models.check_teacher_vocabulary`);
2. ``data.chat_template``: a file that exists, a template that compiles;
3. the data (``data.train_file``, ``data.eval_file`` / ``data.eval_split``): every row read and validated for
   the kind's shape (:func:`rlhfkit.data.read_run_records`);
4. ppo / grpo / rloo: every reward function, tool and environment imported, the tools' schemas read
   (:class:`rlhfkit.rollout.tools.Toolbox`), each function's signature checked against the data's columns
   (:func:`rlhfkit.rollout.scoring.check_signature`), and every row checked for each column that a reward
   function or the environment's ``reset`` takes without a default (:func:`check_rows`): a row without one
   is a data error naming the file, the row and the column, not a failure of the function mid-run.

The configuration's own values, sizes and limits are checked before, when it is read
(:func:`rlhfkit.config.load_config`). What needs the tokenizer (a prompt over ``data.max_prompt_length`` under
``truncation: error``, a conversation without a chat template, ``online.stop_token``) is checked by the
trainer when it tokenizes the data, still before any model loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from rlhfkit.config import ONLINE_KINDS, RunConfig
from rlhfkit.data import Records, is_hub_source, load_dataset_records, run_sources
from rlhfkit.errors import ConfigError, DataError, UserError
from rlhfkit.models import check_teacher_vocabulary
from rlhfkit.models.loading import check_model_path, read_chat_template
from rlhfkit.rollout.sandbox import uses_sandbox
from rlhfkit.rollout.scoring import (
    CALL_KEYWORDS,
    EPISODE_KEYWORDS,
    RewardFunction,
    Scorer,
    accepted_keywords,
    check_signature,
    data_columns,
)
from rlhfkit.rollout.tools import Toolbox

# The record shape each kind's data has (rlhfkit.data.records).
DATA_KINDS = {
    "sft": "sft",
    "reward": "preferences",
    "prm": "prm",
    "dpo": "preferences",
    **{kind: "prompts" for kind in ONLINE_KINDS},
}


@dataclass
class Checked:
    """What the pre-flight read: the training records (and the held-out ones, or None); for ppo / grpo / rloo
    the reward functions as :meth:`Scorer.load_functions` gives them and the tools (None without tools or an
    environment)."""

    records: Records | None
    heldout: Records | None = None
    functions: list[tuple[str, RewardFunction]] = field(default_factory=list)
    toolbox: Toolbox | None = None
    not_read: list[str] = field(default_factory=list)  # Hub datasets left unread (download=False)


def preflight(cfg: RunConfig, download: bool = True) -> Checked:
    """Every check of the module docstring, in its order; the first failure raises.

    ``download=False`` (``rlhfkit config show``, which downloads nothing): a Hub dataset is not read
    (:attr:`Checked.not_read` names it), and the reward functions and the environment are then checked
    against the rows that were read, if any."""
    check_model_folders(cfg)
    if cfg.kind in ONLINE_KINDS and cfg.online.teacher_model:
        check_teacher_vocabulary(
            str(cfg.model.name_or_path), str(cfg.online.teacher_model), cfg.model.trust_remote_code
        )
    if cfg.data.chat_template:
        read_chat_template(cfg.data.chat_template)
    read: list[Records | None] = []
    not_read = []
    for source in run_sources(cfg.data):
        if source is None or not download and is_hub_source(source["source"]):
            read.append(None)
            not_read += [source["source"]] if source is not None else []
            continue
        read.append(load_dataset_records(kind=DATA_KINDS[cfg.kind], columns=cfg.data.columns, **source))
    checked = Checked(read[0], read[1], not_read=list(dict.fromkeys(not_read)))
    if cfg.kind in ONLINE_KINDS:
        rows = [r for r in read if r is not None]
        checked.functions, checked.toolbox = check_scoring(cfg, rows, columns_known=not not_read)
    return checked


def model_folders(cfg: RunConfig) -> list[tuple[str, str]]:
    """``(key, path or Hub name)`` of every model the run loads."""
    keys = ["model.name_or_path"]
    if cfg.kind in ONLINE_KINDS:
        keys += [
            "online.reward_model",
            "online.critic_model",
            "online.process_reward_model",
            "online.teacher_model",
        ]
    if cfg.kind == "dpo":
        keys.append("dpo.reference_model")
    out = []
    for key in keys:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if value:
            out.append((key, str(value)))
    return out


def check_model_folders(cfg: RunConfig) -> None:
    """A ConfigError naming the key for a model path that cannot load (module docstring, 1)."""
    for key, path in model_folders(cfg):
        try:
            check_model_path(path)
        except UserError as error:
            raise ConfigError(f"{key}: {error}") from None
        folder = os.path.expanduser(path)
        if os.path.isdir(folder) and not any(
            os.path.isfile(os.path.join(folder, name)) for name in ("config.json", "adapter_config.json")
        ):
            raise ConfigError(
                f"{key}: {path} holds no config.json (nor a LoRA adapter's adapter_config.json): it is not a "
                "Hugging Face model folder"
            )


def check_scoring(
    cfg: RunConfig, records: Sequence[Records], columns_known: bool = True
) -> tuple[list[tuple[str, RewardFunction]], Toolbox | None]:
    """Load and check what scores and what acts in an online run, against the data ``records`` (training,
    then held-out): the reward functions, the tools and the environment (module docstring, 4).
    ``columns_known=False``: some data was not read, so a column no row read has may still be in it (the
    signatures are not checked against the columns; every row read still is)."""
    online = cfg.online
    functions = Scorer.load_functions(online.reward_functions)
    if uses_sandbox([*online.tools, *online.reward_functions]):  # bubblewrap there and working, or named
        from rlhfkit.rollout import sandbox

        sandbox.check(online.sandbox)
    toolbox = None
    if online.tools or online.environment:
        toolbox = Toolbox.load(
            online.tools, online.environment, timeout=online.tool_timeout, memory_mb=online.tool_memory_mb
        )
    columns = data_columns([row for rows in records for row in rows])
    if online.environment:
        columns = [*columns, *EPISODE_KEYWORDS]
        check_environment_scores(cfg, toolbox)
    for i, (name, fn) in enumerate(functions):
        where = f"online.reward_functions[{i}]"
        if columns_known:
            check_signature(name, fn, columns, where)
        check_rows(records, row_keywords(fn), f"reward function '{name}' ({where})")
    if toolbox is not None and toolbox.environment_factory is not None:
        reset = getattr(toolbox.environment_factory(), "reset", None)
        _, required = accepted_keywords(reset) if callable(reset) else (None, set())
        check_rows(records, required, "the environment's reset() (online.environment)")
    return functions, toolbox


def row_keywords(fn: Callable) -> set[str]:
    """The columns of a prompt row that reward function ``fn`` takes without a default: its required
    keywords but those every call passes itself."""
    _, required = accepted_keywords(fn)
    return required - set(CALL_KEYWORDS) - set(EPISODE_KEYWORDS)


def check_rows(records: Iterable[Sequence[dict]], columns: set[str], taker: str) -> None:
    """A DataError naming the file, the row and the column for the first row that lacks one of ``columns``
    (a key absent from the row: a row with the key set to null passes it as None, on purpose). ``records``:
    :class:`Records` (their file and lines are named), or plain lists of rows (their index is)."""
    if not columns:
        return
    for rows in records:
        for index, row in enumerate(rows):
            missing = sorted(columns - row.keys())
            if missing:
                column = missing[0]
                message = (
                    f"the row has no '{column}', which {taker} takes without a default, so every row needs "
                    f'it; add it to this row ("{column}": null for a row the function scores without one), '
                    f"or give the parameter a default ({column}=None)"
                )
                if isinstance(rows, Records):
                    raise rows.error(index, message, field=column)
                raise DataError("the prompt data", message, line=index, field=column, row_kind="row")


def check_environment_scores(cfg: RunConfig, toolbox: Toolbox) -> None:
    """A ConfigError when nothing would score the episodes: no reward model, no reward function and an
    environment without ``get_reward``."""
    online = cfg.online
    if (
        online.reward_model
        or online.reward_functions
        or online.teacher_model
        or online.process_reward_model
        or toolbox.environment_factory is None
    ):
        return
    if not toolbox.environment_scores:
        raise ConfigError(
            f"online.environment: {online.environment!r} has no get_reward() and there is no "
            "online.reward_model or online.reward_functions: nothing scores the episodes"
        )
