"""`GroupSampler`: Algorithm 1's "sample G outputs for each question from π_old" as a stage.

Prompt rows in, a `Batch` out: each prompt rendered as training, evaluation and SFT render it
(`tasks.prompt_text`), its G completions sampled by the `Sampler` (the engine, or Hugging Face
`generate`), and decoded back to text, or to an assistant message for chat prompts.
"""

from __future__ import annotations

from ..errors import CohortError
from ..tasks import prompt_text
from .batch import Batch
from .sampler import Sampler, SamplingParams


class GroupSampler:
    def __init__(self, sampler: Sampler, tokenizer, args, pad_id: int):
        self.sampler, self.tokenizer, self.args, self.pad_id = sampler, tokenizer, args, pad_id

    def __call__(self, rows: list[dict], seed: int, sequence_offset: int = 0) -> Batch:
        """G completions for each of `rows`. `seed` keys the sampling noise; `sequence_offset` is the
        global index of this rank's first completion (several ranks draw what one would)."""
        args, G = self.args, self.args.num_generations
        prompt_ids = [self.encode_prompt(r["prompt"]) for r in rows]
        params = SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, eos_token_ids=[self.tokenizer.eos_token_id],
            pad_token_id=self.pad_id, seed=seed, sequence_offset=sequence_offset)
        rollout = self.sampler.generate(prompt_ids, G, params)
        texts = [self.tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
                 for ids, m in zip(rollout.completion_ids, rollout.completion_mask)]
        chat = isinstance(rows[0]["prompt"], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        return Batch(rows=[r for r in rows for _ in range(G)], prompt_ids=[p for p in prompt_ids for _ in range(G)],
                     rollout=rollout, completions=completions)

    def encode_prompt(self, prompt) -> list[int]:
        text = prompt_text(self.tokenizer, prompt)  # the same rendering as evaluation and SFT
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.args.max_prompt_length:
            raise CohortError(
                f"a prompt has {len(ids)} tokens, more than max_prompt_length={self.args.max_prompt_length}; "
                "raise --max_prompt_length or filter long prompts")
        return ids
