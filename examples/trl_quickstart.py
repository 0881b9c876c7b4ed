"""A GRPO script written for TRL, run by cohort: the import is its only cohort line.

With `from trl import GRPOConfig, GRPOTrainer` in place of that line the same file runs under TRL 1.16
(on a GPU: TRL's default `bf16=True` refuses a CPU). It is not TRL's own quick start, which downloads
a hub dataset: it trains on eight chat prompts written below, with a format reward of the kind TRL's
GRPO documentation shows, so it needs no network once the model is there. Run it as

    python examples/trl_quickstart.py [MODEL]

MODEL defaults to Qwen/Qwen2.5-0.5B-Instruct (a hub id, a local folder or a .gguf file; also settable
with COHORT_EXAMPLE_MODEL). What a plain TRL script would not have: COHORT_EXAMPLE_MAX_STEPS,
COHORT_EXAMPLE_MAX_COMPLETION_LENGTH and COHORT_EXAMPLE_OUTPUT_DIR shorten the run and choose its
folder (tests/test_trl_example.py runs it so on a tiny model), and the prompts are a list of dicts
where `datasets` is not installed (TRL wants a `datasets.Dataset`; cohort takes either).
"""

import os
import re
import sys

from cohort_grpo import GRPOConfig, GRPOTrainer  # under TRL: from trl import GRPOConfig, GRPOTrainer

SYSTEM_PROMPT = ("A conversation between User and Assistant. The assistant first thinks about the reasoning "
                 "process and then provides the answer, enclosed in <think> </think> and <answer> </answer> "
                 "tags: <think> reasoning here </think><answer> answer here </answer>")
QUESTIONS = ["What is 7 + 5?", "Name a prime number larger than 10.", "What is the capital of France?",
             "How many legs does a spider have?", "What is 12 divided by 4?", "Spell 'cat' backwards.",
             "What colour is the sky on a clear day?", "What is 3 squared?"]


def load_prompts():
    rows = [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]}
            for q in QUESTIONS]
    try:
        from datasets import Dataset
    except ImportError:  # cohort's own dependencies do not include datasets; TRL's do
        return rows
    return Dataset.from_list(rows)


def format_reward_func(completions, **kwargs):
    """1.0 when the completion is <think>…</think><answer>…</answer>, else 0.0."""
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.DOTALL) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def main():
    model_name = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("COHORT_EXAMPLE_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    training_args = GRPOConfig(
        output_dir=os.environ.get("COHORT_EXAMPLE_OUTPUT_DIR", "Qwen2.5-0.5B-GRPO"),
        learning_rate=1e-5,
        beta=0.02,
        max_completion_length=int(os.environ.get("COHORT_EXAMPLE_MAX_COMPLETION_LENGTH", "256")),
        num_generations=8,
        temperature=0.9,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        max_steps=int(os.environ.get("COHORT_EXAMPLE_MAX_STEPS", "100")),
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
