"""Supervised fine-tuning: `cohort-grpo sft` (`sft_trainer`, `sft_config`), and the built-in tiny models' warm
starts (`sft_trainer.tiny_warm_start`, `sft_tools.tools_warm_start`), built and cached on first use by
`builtin`."""
