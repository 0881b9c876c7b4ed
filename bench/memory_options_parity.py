"""Do the update's memory options change what is learned? (`--lend_kv_cache`, `--offload_ref_model`)

Trains the built-in tiny model for a few steps three times on the same seed: twice with the
defaults (on a GPU both options are on), once with both off. Prints whether the final weights and
each step's reward are bit for bit equal: run 1 against run 2 (is the GPU deterministic here at
all?) and run 1 against run 3 (do the options change anything?). The CPU test of the same property
(tests/test_lending.py) forces the offload on by hand; this script is its check on a real GPU,
where the trainer turns both options on by itself. π_ref is reset and checkpoints are written
mid-run, while its weights are offloaded.

    python bench/memory_options_parity.py            # on the GPU (exit status 1 if anything differs)
    python bench/memory_options_parity.py --steps 2  # fewer steps; on a CPU it checks the script
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.models.tiny import build_model, build_tokenizer

PROMPTS = [{"prompt": f"{a}+{b}="} for a in range(1, 9) for b in range(1, 4)]


def distinct_characters(completions, **kwargs):
    """A reward that varies between completions, so every update has a gradient."""
    return [len(set(c)) / 10 for c in completions]


def train(model_dir: str, steps: int, **options) -> tuple[list[torch.Tensor], list[float]]:
    config = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                  max_completion_length=8, max_steps=steps, learning_rate=3e-3, output_dir=tempfile.mkdtemp(),
                  quiet=True, seed=0, beta=0.04, ref_reset_steps=2, save_steps=2)
    trainer = GRPOTrainer(model_dir, distinct_characters, PROMPTS, args=GRPOConfig(**config, **options))
    trainer.train()
    return [p.detach().float().cpu() for p in trainer.model.parameters()], [r["reward"] for r in trainer.history]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model_dir = tempfile.mkdtemp(prefix="tiny-")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; {args.steps} steps each", flush=True)
    first = train(model_dir, args.steps)
    again = train(model_dir, args.steps)
    without = train(model_dir, args.steps, lend_kv_cache=False, offload_ref_model=False)
    ok = True
    for name, (weights, rewards) in (("same options again", again), ("--lend_kv_cache/--offload_ref_model off", without)):
        same_weights = all(torch.equal(a, b) for a, b in zip(first[0], weights))
        largest = max(float((a - b).abs().max()) for a, b in zip(first[0], weights))
        print(f"{name}: weights equal {same_weights} (largest difference {largest:.3g}), "
              f"rewards equal {rewards == first[1]}", flush=True)
        ok = ok and same_weights and rewards == first[1]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
