"""The warm start of the built-in tiny tools model: supervised trajectories that call a calculator.

A trajectory is a whole conversation rendered by the model's chat template: the user's question, the
assistant's call turn, the tool's result, the assistant's answer. The model is trained on its own
turns only; the tool's result (and any text the template puts around it) is context it reads, not
text it writes, so the loss leaves it out, as GRPO's `tool_mask` does.

A first pass solves every problem with a call, until the model reproduces held-out call trajectories
(it learns to copy the question into the call and the result into the answer). A second, short pass
solves only a fraction of the problems (`spec["sft_tool_fraction"]`) with a call and answers the others
directly, which for an unseen 3-digit × 4-digit product the tiny model gets wrong. The warm policy thus
calls the tool now and then when sampled (never greedily), copies the result when it does, and is
mostly wrong: GRPO has a behaviour to reinforce and a long way to go.
"""

from __future__ import annotations

import random

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.tasks.calculator import CalculatorTask
from cohort_grpo.update.packing import pack_micro_batch
from cohort_grpo.sft.sft_trainer import SFTConfig, sft_train


def encode_trajectory(tokenizer, messages: list[dict],
                      template_kwargs: dict | None = None) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, loss mask) of a conversation through the tokenizer's chat template.

    The prompt is everything before the first assistant turn, with the generation prompt. Each later
    message adds the text its rendering appends: an assistant turn is the model's (mask 1); any other
    turn, with the generation prompt that follows it, is not (mask 0). Each piece is tokenized on its
    own, which is exact for a character-level tokenizer such as the tiny model's."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise CohortError("a tool trajectory needs at least one message before its first assistant turn, and one")

    def render(upto: int, opened: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=opened,
                                             **(template_kwargs or {}))

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    previous = render(first, True)
    prompt_ids, completion, loss_mask = ids(previous), [], []
    for k in range(first, len(messages)):
        is_model = messages[k].get("role") == "assistant"
        text = render(k + 1, not is_model)
        if not text.startswith(previous):
            raise CohortError("the chat template re-renders earlier turns differently when a turn is added; "
                              "a trajectory cannot be split into the model's and the tools' tokens")
        piece = ids(text[len(previous):])
        completion += piece
        loss_mask += [1 if is_model else 0] * len(piece)
        previous = text
    return prompt_ids, completion, loss_mask


def tool_trajectories(rows: list[dict], tool_fraction: float, seed: int) -> list[list[dict]]:
    """The solved conversations of `rows`: a random `tool_fraction` of them call the calculator, the
    rest answer directly."""
    rng = random.Random(seed)
    calls = set(rng.sample(range(len(rows)), round(tool_fraction * len(rows))))
    return [CalculatorTask.solved_messages(row, call_tool=i in calls) for i, row in enumerate(rows)]


@torch.no_grad()
def reproduced_fraction(model, tokenizer, encoded: list[tuple[list[int], list[int], list[int]]]) -> tuple[float, float]:
    """(fraction of trajectories whose every model token after the first is the model's greedy choice,
    mean probability of the first token) under teacher forcing.

    Every model token right means greedy decoding that starts the same way reproduces the whole
    trajectory (the tool's tokens are given): the call, its arguments, and the copied result. The first
    token is the decision to call; its probability is the sampled call rate."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(c) for _, c, _ in encoded)
    completion = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    scored = torch.zeros((len(encoded), width), dtype=torch.bool)
    for i, (_, c, m) in enumerate(encoded):
        completion[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = 1
        scored[i, 1: len(c)] = torch.tensor(m[1:], dtype=torch.bool)
    device = next(model.parameters()).device
    micro = pack_micro_batch([p for p, _, _ in encoded], completion, mask, list(range(len(encoded))), pad).to(device)
    out = model(input_ids=micro.input_ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    predicting = logits[micro.source_rows, micro.source_cols].float()  # [n tokens, vocab], row-major
    right = torch.zeros_like(scored)
    right[micro.token_rows, micro.token_cols] = predicting.argmax(-1).cpu() == completion[micro.token_rows.cpu(),
                                                                                          micro.token_cols.cpu()]
    exact = ((right | ~scored).all(dim=1)).float().mean().item()
    first = micro.token_cols == 0
    first_prob = predicting[first].softmax(-1).gather(1, micro.completion_ids[micro.token_rows[first], 0][:, None])
    return exact, first_prob.mean().item()


def tools_warm_start(model, tokenizer, spec: dict, log=print) -> list[float]:
    """Teach the tiny tools model (`cohort_grpo.sft.builtin.tiny_tools_model_dir` calls this once, before
    caching it) to call the calculator and copy its result into the answer, then to do so on only
    `spec["sft_tool_fraction"]` of the problems; `spec["sft_*"]` holds the settings. The caller's torch
    random state is left as it was. Returns the loss of every step.

    Two passes, because in a mixture the copy is not learnt in the time available: the direct answers'
    digits (a product the model tries to compute) drown the few answers it could copy.
    1. Every problem solved with a call, until greedy decoding reproduces `spec["sft_target_exact"]` of
       held-out call trajectories (checked from step `spec["sft_min_steps"]` on) or `spec["sft_steps"]`.
    2. `spec["sft_mix_steps"]` steps on the mixture: the call rate falls to about the fraction, while
       the calls stay right (the final check is logged)."""
    task = CalculatorTask()
    rows = task.load("train", size=4000, seed=spec["sft_seed"])
    validation = [encode_trajectory(tokenizer, task.solved_messages(r, call_tool=True))
                  for r in task.load("validation", size=64)]

    def encode(row):
        return encode_trajectory(tokenizer, row["messages"])

    first, second = "SFT pass 1 of 2 (every problem with a call)", "SFT pass 2 of 2 (the mixture)"

    def check(where: str) -> float:
        exact, call_probability = reproduced_fraction(model, tokenizer, validation)
        log(f"{where}: {100 * exact:.0f}% of held-out call trajectories reproduced; P(call) {call_probability:.2f}")
        return exact

    def learnt_the_calls(step: int) -> bool:
        return step >= spec["sft_min_steps"] and check(f"{first} step {step}") >= spec["sft_target_exact"]

    def pass_config(steps: int, seed: int) -> SFTConfig:
        return SFTConfig(learning_rate=spec["sft_learning_rate"], max_steps=steps, batch_size=spec["sft_batch_size"],
                         seed=seed, logging_steps=100)

    with torch.random.fork_rng():
        calls = [{"messages": m} for m in tool_trajectories(rows, 1.0, spec["sft_seed"])]
        losses = sft_train(model, tokenizer, calls, pass_config(spec["sft_steps"], spec["sft_seed"]), log=log,
                           should_stop=learnt_the_calls, encode=encode, label=first)
        mixture = [{"messages": m} for m in tool_trajectories(rows, spec["sft_tool_fraction"], spec["sft_seed"] + 1)]
        mixed = sft_train(model, tokenizer, mixture, pass_config(spec["sft_mix_steps"], spec["sft_seed"] + 1),
                          log=log, encode=encode, label=second)
        check(f"{second} done ({len(losses) + len(mixed)} steps in both passes)")
        losses += mixed
    return losses
