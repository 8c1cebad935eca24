"""Keys of earlier rlhfkit versions that a configuration may still hold (e.g. a saved ``config.yaml``): read
into the field that replaced them, with one ``rlhfkit: warning:`` line each on stderr.

``online.norm_by_std`` (grpo's division by the group std) and ``online.whiten_advantages`` (the whitening of
gae and reinforce_pp) were two switches, each for some estimators; ``online.normalize_advantages`` is one
switch, and the estimator decides what it normalises. An old key is used only with the estimators it
applied to, so an old configuration trains as it did.
"""

from __future__ import annotations

import sys
from typing import Any

from rlhfkit.errors import ConfigError

NEW_KEY = "online.normalize_advantages"
# old key (in the online section) -> the estimators it applied to
REPLACED: dict[str, tuple[str, ...]] = {
    "norm_by_std": ("grpo",),
    "whiten_advantages": ("gae", "reinforce_pp"),
}


def pop_old_keys(values: dict, source: str) -> list[tuple[str, str, Any]]:
    """Take the old keys out of one layer's values (before the unknown-key check): ``(source, key, value)``."""
    online = values.get("online")
    if not isinstance(online, dict):
        return []
    return [(source, key, online.pop(key)) for key in REPLACED if key in online]


def apply_old_keys(run, found: list[tuple[str, str, Any]], set_by: dict[str, str]) -> None:
    """Put the old keys' values into ``online.normalize_advantages`` (the later layer wins, and the new key
    wins over an old one that agrees with it; a disagreement is a ConfigError), and say so once per key."""
    estimator = run.online.advantage_estimator
    for source, key, value in found:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: online.{key}: expected true or false, got {value!r}")
        applies = estimator in REPLACED[key]
        if applies and NEW_KEY in set_by:
            if value != run.online.normalize_advantages:
                raise ConfigError(
                    f"online.{key} (set in {source}) and {NEW_KEY} (set in {set_by[NEW_KEY]}) disagree; "
                    f"online.{key} is the old name of {NEW_KEY}: keep only {NEW_KEY}"
                )
        elif applies:
            run.online.normalize_advantages = value
        effect = (
            f"read as {NEW_KEY}={str(value).lower()}"
            if applies
            else f"ignored: it does nothing with advantage_estimator={estimator}"
        )
        print(
            f"rlhfkit: warning: online.{key} (set in {source}) is an old key, {effect}; use {NEW_KEY}",
            file=sys.stderr,
        )
