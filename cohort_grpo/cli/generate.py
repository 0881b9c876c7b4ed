"""`cohort-grpo generate`: every prompt of a .txt / .jsonl file through the batched engine
(`cohort_grpo.rollout.make_sampler`), one JSONL row per completion: `{"index", "prompt", "completion", "finish_reason", "num_tokens"}`. A .txt
line is a prompt with its newline, as the arithmetic task's prompts (and `chat --raw` lines) end: the
built-in model answers after the newline, and a file of the task's questions gets the task's completions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cohort_grpo.errors import CohortError
from cohort_grpo.cli.chat import (context_length, default_model_spec, encode, load_for_inference, stderr_log,
                                  stop_token_ids)
from cohort_grpo.cli.chat_flags import generate_parser, parsed

PROMPT_BATCH = 256  # prompts per engine call in `generate` (bounds memory; rows go out as they finish)


# ---- batch generation ----------------------------------------------------------------------------
def read_prompts(path: str | Path) -> list:
    """A .txt file (one prompt per non-empty line, each kept with its newline: the line as a training
    prompt ends, e.g. the arithmetic task's "12+7=? Reply <answer>N</answer>\n") or JSONL rows with a
    `prompt` column (a string, completed exactly as written, or a list of chat messages)."""
    path = Path(path)
    if not path.is_file():
        raise CohortError(f"--prompts {path}: no such file; pass a .txt (one prompt a line) or a .jsonl file")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix not in (".jsonl", ".json"):
        prompts = [line + "\n" for line in lines if line.strip()]
    else:
        prompts = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise CohortError(f"{path} line {number} is not valid JSON; fix or delete that line") from None
            prompt = row.get("prompt") if isinstance(row, dict) else None
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt))):
                raise CohortError(f"{path} line {number} has no 'prompt' string or message list; "
                                  "each row needs a 'prompt' column")
            prompts.append(prompt)
    if not prompts:
        raise CohortError(f"{path} holds no prompts; write one prompt per line (.txt) or JSONL rows with 'prompt'")
    return prompts


def generate_rows(model, tokenizer, prompts: list, *, model_spec: str | None = None, num_generations: int = 1,
                  max_new_tokens: int = 256, temperature: float = 0.7, top_p: float = 1.0, seed: int = 0,
                  system: str | None = None, as_chat: bool = False):
    """Yield `{"index", "prompt", "completion", "finish_reason", "num_tokens"}` for each completion,
    prompt by prompt (G rows each); `num_tokens` counts the generated tokens, EOS included.
    Message-list prompts (and, with `as_chat`, string prompts as one user message, without a trailing
    newline) are rendered as in training and evaluation (`cohort_grpo.tasks.prompt_text`: the chat template,
    or the contents one per line without one); other strings are completed exactly as they are."""
    from cohort_grpo.rollout import make_sampler
    from cohort_grpo.rollout.sampler import SamplingParams
    from cohort_grpo.tasks import prompt_text

    sampler = make_sampler(model, tokenizer)
    eos_ids = stop_token_ids(tokenizer, model_spec)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    limit = context_length(model)
    for start in range(0, len(prompts), PROMPT_BATCH):
        chunk = prompts[start : start + PROMPT_BATCH]
        texts = []
        for prompt in chunk:
            if isinstance(prompt, str) and as_chat:
                prompt = [{"role": "user", "content": prompt.removesuffix("\n")}]
            if isinstance(prompt, list) and system:
                prompt = [{"role": "system", "content": system}] + prompt
            texts.append(prompt_text(tokenizer, prompt))
        ids = [encode(tokenizer, text) for text in texts]
        for offset, prompt_ids in enumerate(ids):
            if not prompt_ids or len(prompt_ids) >= limit:
                raise CohortError(f"prompt {start + offset} has {len(prompt_ids)} tokens; it needs 1 to {limit - 1} "
                                  "(the model's context); shorten or drop it")
        params = SamplingParams(
            max_new_tokens=min(max_new_tokens, limit - max(len(p) for p in ids)), temperature=temperature,
            top_p=top_p, eos_token_ids=eos_ids, pad_token_id=pad_id, seed=seed + start,
        )
        rollout = sampler.generate(ids, num_generations, params)
        for row, (completion, mask) in enumerate(zip(rollout.completion_ids, rollout.completion_mask)):
            text = tokenizer.decode(completion[mask.bool()], skip_special_tokens=True)
            index = start + row // num_generations
            yield {"index": index, "prompt": prompts[index], "completion": text,
                   "finish_reason": rollout.finish_reasons[row], "num_tokens": int(mask.sum())}


def generate_main(argv: list[str]) -> int:
    """`cohort-grpo generate [MODEL_DIR] --prompts FILE [--output out.jsonl] [options]`."""
    args = parsed(generate_parser(), argv)
    if args.num_generations < 1:
        raise CohortError(f"--num_generations={args.num_generations}: it must be at least 1")
    prompts = read_prompts(args.prompts)
    spec = args.model if args.model is not None else default_model_spec(stderr_log)
    model, tokenizer, _ = load_for_inference(spec, args.device, args.dtype, log=stderr_log, impl=args.model_impl)
    rows = generate_rows(model, tokenizer, prompts, model_spec=spec, num_generations=args.num_generations,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                         seed=args.seed if args.seed is not None else 0, system=args.system, as_chat=args.chat)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    count = 0
    try:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
        out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
    if args.output:
        stderr_log(f"cohort: wrote {count} completions to {args.output}")
    return 0
