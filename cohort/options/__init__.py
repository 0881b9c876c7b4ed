"""What a `GRPOConfig` keyword accepts beyond its dataclass field: TRL's names for it (`trl_names`), the
type its value must have (`types`), and how an error spells an option for whoever passed it (`spelling`:
`name=value` from Python, `--name value` from `cohort train`)."""
