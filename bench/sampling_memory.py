"""Does the engine give back all its GPU memory when released? (`--free_sampling_memory`)

Builds bench/grpo_step.py's random-init Qwen2.5 shape and its 32 prompts × 8 generations, then
samples and releases the engine `--rounds` times. After each release it prints the memory still
allocated and the live CUDA tensors (found through the garbage collector) that were not there
after the previous round, grouped by shape: what a leak keeps alive, if it is a tensor Python holds.

    python bench/sampling_memory.py --model 0.5b [--no-cuda-graphs]
    python bench/sampling_memory.py --smoke      # CPU, tiny shape: checks the script
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step_worker import diagnosis_setup, make_prompts  # noqa: E402


def live_tensors(device_type: str) -> Counter:
    """(shape, dtype) → count of the tensors the garbage collector can reach on `device_type`."""
    found = Counter()
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.device.type == device_type:
                found[(tuple(obj.shape), str(obj.dtype).replace("torch.", ""))] += 1
        except Exception:  # noqa: BLE001 - objects that fail on attribute access
            continue
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="0.5b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly: is a leak the graphs'?")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    from cohort_grpo.rollout import make_sampler
    from cohort_grpo.rollout.sampler import SamplingParams

    setup = diagnosis_setup(args.model, args.smoke)
    device, tokenizer, gens, completion = setup.device, setup.tokenizer, setup.generations, setup.completion_len
    sampler = make_sampler(setup.model.eval(), tokenizer, **({"use_cuda_graph": False} if args.no_cuda_graphs else {}))
    prompt_ids = [tokenizer(r["prompt"])["input_ids"]
                  for r in make_prompts(setup.shape["vocab_size"], setup.prompts, setup.prompt_len)]
    allocated = (lambda: torch.cuda.memory_allocated() / 2**30) if device == "cuda" else (lambda: 0.0)
    gc.collect()
    print(f"model only: {allocated():.3f} GiB allocated")
    before = live_tensors(device)
    for round_ in range(1, args.rounds + 1):
        params = SamplingParams(max_new_tokens=completion, eos_token_ids=[tokenizer.eos_token_id],
                                pad_token_id=tokenizer.pad_token_id, seed=round_)
        with torch.no_grad():
            sampler.generate(prompt_ids, gens, params)
        sampled = allocated()
        sampler.release()
        gc.collect()
        if device == "cuda":
            torch.cuda.synchronize()
        now = live_tensors(device)
        new = now - before
        print(f"round {round_}: {sampled:.3f} GiB allocated after sampling, {allocated():.3f} GiB after release; "
              f"{sum(now.values())} live tensors ({sum(new.values())} not there after the previous round)")
        for (shape_, dtype), count in new.most_common(8):
            print(f"    +{count} × {dtype} {list(shape_)}")
        before = now


if __name__ == "__main__":
    main()
