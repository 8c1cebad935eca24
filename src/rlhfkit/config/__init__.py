"""Run configuration: one typed dataclass per component, every field documented once.

Each field is declared with :func:`option`, which stores its help text (and optional bounds) in the
dataclass field's ``metadata``; ``rlhfkit train KIND --help`` lists them from there (:func:`config_help`), as do ``rlhfkit config init``
and docs/configuration.md (:mod:`rlhfkit.config.reference`), so there is no second schema anywhere. A YAML file only sets values; the command line overrides any key with
``dotted.key=value`` (the value is parsed as a YAML scalar or flow list). Parsing and type conversion are
omegaconf structured configs, on a copy of the dataclasses with every ``Literal`` field typed ``str``
(:func:`rlhfkit.config.parse._omegaconf_schema`: omegaconf 2.3, which hydra-core 1.3 needs, has no ``Literal``); this module checks
the ``Literal`` choices itself, and adds the error messages that name the key and the file, the bounds and
the cross-field checks.

To add a field for a trainer: add one ``name: type = option(default, "help")`` line to the section's
dataclass (:mod:`rlhfkit.config.sections`, :mod:`rlhfkit.config.online`). Nothing else needs to change (loading, overrides, validation, ``--help`` and the saved
``config.yaml`` all follow the dataclasses).

Defaults follow Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO" (kl_coef 0.05,
gamma 1, lam 0.95, 4 epochs, clip 0.2, value clip 0.2, vf_coef 0.1, temperature 0.7, dropout off,
whitened advantages, a fixed score for responses without EOS), unless a field says otherwise.
"""

from rlhfkit.config.checks import STANDARD_COLUMNS, check_columns
from rlhfkit.config.describe import config_help
from rlhfkit.config.fields import option
from rlhfkit.config.online import OnlineConfig, RefreshConfig
from rlhfkit.config.parse import (
    RUN_INFO_PREFIX,
    config_from,
    config_to_dict,
    load_config,
    nest_keys,
    read_run_info,
    save_config,
)
from rlhfkit.config.run import (
    KIND_DEFAULTS,
    KIND_FORCED,
    KIND_SECTIONS,
    KINDS,
    ONLINE_KINDS,
    Kind,
    RunConfig,
)
from rlhfkit.config.sections import (
    DataConfig,
    DPOConfig,
    LoggingConfig,
    ModelConfig,
    RewardConfig,
    TrainConfig,
)

__all__ = [
    "KINDS",
    "KIND_DEFAULTS",
    "KIND_FORCED",
    "KIND_SECTIONS",
    "ONLINE_KINDS",
    "RUN_INFO_PREFIX",
    "STANDARD_COLUMNS",
    "DPOConfig",
    "DataConfig",
    "Kind",
    "LoggingConfig",
    "ModelConfig",
    "OnlineConfig",
    "RefreshConfig",
    "RewardConfig",
    "RunConfig",
    "TrainConfig",
    "check_columns",
    "config_from",
    "config_help",
    "config_to_dict",
    "load_config",
    "nest_keys",
    "option",
    "read_run_info",
    "save_config",
]
