"""The loops: DeepSeekMath's Algorithm 1 (`grpo_trainer.GRPOTrainer`), PPO's variant of a step with a critic
(`ppo_trainer.PPOTrainer`), and DAPO's dynamic sampling (`dynamic_sampling`). They call the stages; the maths
they run is in `cohort_grpo.algorithm`."""
