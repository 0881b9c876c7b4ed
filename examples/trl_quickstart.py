"""TRL's GRPO quick start, ported to cohort by changing one import line.

The TRL version (https://huggingface.co/docs/trl/grpo_trainer) reads

    from trl import GRPOConfig, GRPOTrainer

and everything below that line is the same here. Run it as

    python examples/trl_quickstart.py [MODEL]

MODEL defaults to Qwen/Qwen2.5-0.5B-Instruct (a hub id, a local folder or a .gguf file; also settable
with COHORT_EXAMPLE_MODEL). COHORT_EXAMPLE_MAX_STEPS and COHORT_EXAMPLE_MAX_COMPLETION_LENGTH shorten
the run (the test uses them with a tiny model). The dataset is `trl-lib/tldr`-style conversational
prompts; TRL loads one with `datasets.load_dataset`, which is used here when `datasets` is installed
and COHORT_EXAMPLE_DATASET names a hub dataset, else a small inline list.
"""

import os
import re
import sys

from cohort import GRPOConfig, GRPOTrainer# the only change: TRL has `from trl import GRPOConfig, GRPOTrainer`

model_name = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("COHORT_EXAMPLE_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
max_steps = int(os.environ.get("COHORT_EXAMPLE_MAX_STEPS", "100"))
max_completion_length = int(os.environ.get("COHORT_EXAMPLE_MAX_COMPLETION_LENGTH", "256"))

SYSTEM_PROMPT = ("A conversation between User and Assistant. The assistant first thinks about the reasoning "
                 "process and then provides the answer, enclosed in <think> </think> and <answer> </answer> "
                 "tags: <think> reasoning here </think><answer> answer here </answer>")
QUESTIONS = ["What is 7 + 5?", "Name a prime number larger than 10.", "What is the capital of France?",
             "How many legs does a spider have?", "What is 12 divided by 4?", "Spell 'cat' backwards.",
             "What colour is the sky on a clear day?", "What is 3 squared?"]


def load_prompts():
    hub_dataset = os.environ.get("COHORT_EXAMPLE_DATASET")
    if hub_dataset:
        try:
            from datasets import load_dataset
        except ImportError:
            sys.exit("COHORT_EXAMPLE_DATASET needs the datasets package: pip install datasets")
        return load_dataset(hub_dataset, split="train")
    return [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]}
            for q in QUESTIONS]


def format_reward_func(completions, **kwargs):
    """1.0 when the completion is <think>…</think><answer>…</answer> (TRL docs' format reward)."""
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.DOTALL) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def main():
    training_args = GRPOConfig(
        output_dir=os.environ.get("COHORT_EXAMPLE_OUTPUT_DIR", "Qwen2.5-0.5B-GRPO"),
        learning_rate=1e-5,
        beta=0.02,
        max_completion_length=max_completion_length,
        num_generations=8,
        temperature=0.9,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        max_steps=max_steps,
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        model=model_name,
        reward_funcs=format_reward_func,
        train_dataset=load_prompts(),
        args=training_args,
    )
    trainer.train()


if __name__ == "__main__":
    main()
