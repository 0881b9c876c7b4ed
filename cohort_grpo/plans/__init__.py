"""Memory plans: what a step will allocate, computed from the config, the model's shape and the run's
`Placement` before any weight loads — the training rank's plan (`training_plan`), the sampling engine's split
and slots (`sampling_plan`, `training_slots`), and the refusal of a run that cannot fit (`capacity`). Each term
cites the code whose allocation it counts."""
