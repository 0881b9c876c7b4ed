"""What a `GRPOConfig` keyword accepts beyond its dataclass field: TRL's names for it (`trl_names`), the
type its value must have (`types`), and TRL's `num_train_epochs` turned into steps once the training
rows are known (`epochs`); how an error message writes an option for a Python caller (`spelling`);
the default `output_dir`, named after the script (`output_dir`); the config read from the command line
and YAML, and its help texts (`command_line`).
"""
