"""Can the π_ref log-prob pass hide under sampling? A measurement before building it.

Decoding 256 sequences leaves tensor cores idle for most of each step: attention and the thin
projections are bound by memory bandwidth. π_ref's pass over the same tokens is compute-bound and
causal, so it could run chunk by chunk behind the decoder (a chunk of C generated tokens is scored
as soon as it exists) on a second CUDA stream. Whether the GPU actually overlaps the two is not a
question arithmetic answers, so this times, on random-init Qwen2.5 shapes in bf16:

  1. the engine alone: 256 sequences (32 prompts × 8) × 512 new tokens;
  2. π_ref's chunked pass alone: a second copy of the weights scoring the same shape of work,
     [256 rows × C tokens] per forward through its own KV cache, then the selected-token log-prob;
  3. both at once: the pass from a host thread on a second stream while the engine decodes, with
     the decoder's stream at equal and at higher priority.

The hidden share is (1 + 2 − 3) / 2: 1.0 means the pass came for free, 0 means the two serialised.

    python bench/overlap_probe.py --models 1.5b,0.5b --chunks 16,64

Result (H100, 2026-11-26, docs/history/benchmarks-2026-11.md): at most ~23% of the pass hid (C = 64;
with C = 16 the two slowed each other down), and this chunked pass alone took twice the trainer's
packed, compiled one; the trainer keeps its separate π_ref pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rollout import build_models  # noqa: E402
from cohort_grpo.rollout import Engine# noqa: E402
from cohort_grpo.update.logprobs import selected_logprobs# noqa: E402
from cohort_grpo.models.cache import KVCache# noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams# noqa: E402


def chunked_reference_pass(model, cache: KVCache, tokens: torch.Tensor, prompt_len: int, chunk: int) -> torch.Tensor:
    """Score `tokens` [rows, prompt + new] chunk by chunk through `cache` (the prompt first, in one
    forward): what a reference pass behind the decoder would compute. Returns [rows, new] log-probs."""
    rows, total = tokens.shape
    out = []
    # Grad mode on with frozen weights: nothing is recorded, and the forward takes the plain path
    # (kernels.fused_path() is global state the engine's thread switches while it samples).
    with torch.enable_grad():
        start = 0
        for end in [prompt_len] + list(range(prompt_len + chunk, total, chunk)) + [total - 1]:
            if end <= start:
                continue
            positions = torch.arange(start, end, device=tokens.device).expand(rows, end - start)
            hidden = model(tokens[:, start:end], positions, kv_cache=cache, cache_len=end, return_hidden=True)
            keep = slice(max(0, prompt_len - 1 - start), None)  # positions whose next token is generated
            logits = model.lm_head(hidden[:, keep])
            out.append(selected_logprobs(logits, tokens[:, start + 1:end + 1][:, keep.start:])[0])
            start = end
    return torch.cat(out, dim=1)


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def probe(name: str, chunks: list[int], prompts: int, generations: int, prompt_len: int,
          new_tokens: int) -> list[dict]:
    _, model = build_models(name)
    reference = build_models(name)[1].requires_grad_(False)  # a second copy of the weights, as π_ref is
    torch.manual_seed(1)
    prompt_ids = torch.randint(0, model.config.vocab_size, (prompts, prompt_len)).tolist()
    engine = Engine(model, max_batch_size=prompts * generations)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=[], seed=0)
    engine.capture_graphs(prompts * generations, prompt_len + new_tokens, new_tokens)
    engine.generate(prompt_ids, generations, params)  # warm-up, and the tokens the pass scores
    rollout = engine.generate(prompt_ids, generations, params)
    tokens = torch.cat([torch.tensor([p for p in prompt_ids for _ in range(generations)]),
                        rollout.completion_ids], dim=1).cuda()
    cache = KVCache.for_model(reference, tokens.shape[0], tokens.shape[1])

    def sample():
        engine.generate(prompt_ids, generations, params)

    alone_sample = min(timed(sample) for _ in range(2))
    results = []
    for chunk in chunks:
        results.append(_overlap(name, chunk, sample, alone_sample,
                                lambda: chunked_reference_pass(reference, cache, tokens, prompt_len, chunk)))
    engine.release()
    return results


def _overlap(name: str, chunk: int, sample, alone_sample: float, score) -> dict:
    score()  # warm-up
    alone_score = min(timed(score) for _ in range(2))
    result = dict(model=name, chunk=chunk, sampling_s=alone_sample, reference_s=alone_score)
    for label, decoder_priority in (("equal", 0), ("decoder_first", -1)):
        side = torch.cuda.Stream(priority=0)
        main = torch.cuda.Stream(priority=decoder_priority)

        def score_on_side():
            with torch.cuda.stream(side):
                score()

        def both():
            thread = threading.Thread(target=score_on_side)
            with torch.cuda.stream(main):
                thread.start()
                sample()
                thread.join()

        both()  # warm-up of the streams
        together = min(timed(both) for _ in range(2))
        result[f"together_{label}_s"] = together
        result[f"hidden_{label}"] = (alone_sample + alone_score - together) / alone_score
    print(json.dumps(result), flush=True)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1.5b,0.5b")
    parser.add_argument("--chunks", default="16,64", help="generated tokens per reference forward (a list)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    chunks = [int(c) for c in args.chunks.split(",")]
    results = [row for name in args.models.split(",")
               for row in probe(name, chunks, args.prompts, args.generations, args.prompt_len, args.new_tokens)]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "overlap_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
