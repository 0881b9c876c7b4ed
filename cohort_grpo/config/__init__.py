"""The run's configuration, in one room: every option (`grpo_config.GRPOConfig`, TRL's flat names), the values
an option takes (`choices`), the configs refused and the one wording of a refused value (`rules`), the typed
settings a stage takes in place of a group of options (`settings`: `RewardModelSettings`), the sections the
options are shown in (`sections`), what a keyword accepts beyond its field (TRL's other names, `trl_names`;
the type its value must have, `types`; `num_train_epochs` turned into steps, `epochs`; the default
`output_dir`, `output_dir`), a curriculum's stages (`curriculum`), how an error message writes an option for a
Python caller (`spelling`), and the config read from the command line and YAML with its help texts
(`command_line`).

Nothing here knows a model or a device: `cohort_grpo.run.resolve` settles the `auto` values once those are known.
"""

from __future__ import annotations

from cohort_grpo.config.grpo_config import GRPOConfig

__all__ = ["GRPOConfig"]
