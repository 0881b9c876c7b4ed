"""The algorithm: DeepSeekMath Algorithm 1's loop (`trainer.py`), its mathematics as pure functions
(`objectives.py`), the prompt stream (`prompts.py`), and the variants that change a step: DAPO's
dynamic sampling, curricula, PPO with a critic, and SFT (the warm start)."""
