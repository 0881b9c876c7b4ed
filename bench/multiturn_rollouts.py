"""Multi-turn tool rollouts: cohort's `Engine` against a Hugging Face `generate` loop (what TRL does without vLLM).

Workload (defaults): 32 prompts × G = 8 = 256 sequences; each sequence makes 2–4 tool calls (drawn per
sequence with a fixed seed); each call sleeps 10–50 ms (drawn per call: a `time.sleep` tool) and returns
10–30 words (plus the tool turn's wrapper tokens); the completion budget is 1024 tokens (tool results
count toward it, as in TRL). Random weights of a Qwen2.5-0.5B-shaped model in bf16 on CUDA: cohort's
own `CausalLM` for the engine and a transformers `Qwen2ForCausalLM` for the baseline, built on the
very same tensors (as bench/rollout.py does).

How turns end, the same way on both sides. A random model never writes a tool call, and the engine's
only per-turn stop is the sampled end-of-turn token (`SamplingParams.eos_token_ids`; there is no
per-turn length cap), so the turn's end is put into the weights: one hidden channel of the shared
tensors is made constant (its row in every o_proj / down_proj zeroed, its column of the embedding set
to a constant), and the end-of-turn token `<|im_end|>`'s logit is raised through that channel and the
final norm's weight, calibrated so that the model samples `<|im_end|>` with probability
1 / --turn_tokens per token (`shape_turn_ends`). So a model turn is as long as the model makes it: a
geometric length of mean ≈ --turn_tokens (100), sampled by each side from the same distribution; a
turn also ends at the completion budget. After a turn ends with `<|im_end|>` the sequence's tool runs
while calls remain (2–4 per sequence); then its next turn ends the completion. Each sequence thus has
(its calls + 1) model turns, unless the budget cuts it first.

- engine: `Engine.generate(prompt_ids, G, params, turns=handler)`; the handler (a
  `cohort_grpo.rollout.turns.TurnHandler`) returns a Future from a thread pool that sleeps the call's time
  and returns the tool turn's token ids, so the engine keeps decoding the other sequences meanwhile.
- baseline (TRL's GRPOTrainer tool loop without vLLM): `model.generate` over the batch of sequences
  still going (left-padded, sampling at T = 1 with the same end-of-turn id, `max_new_tokens` = the
  largest budget left), then for each finished turn: decode its text, run its tool — one after the
  other, as TRL 1.16 runs sync tools (`--baseline_tools pool`: all of a round's calls at once on a
  thread pool) — append the assistant and tool messages, and build the next prompt by re-rendering and
  RE-TOKENISING the whole conversation text (prompt + every turn + every tool result: what TRL did
  before 1.x; TRL 1.16 concatenates token ids instead, which costs the same generate calls); then
  generate again on the continuing ones, until all are done.

The tokenizer is a word-level `tokenizers` tokenizer built here (vocabulary = the model's 151,936 ids,
ChatML tokens, a Qwen2.5-style tool turn `<|im_start|>user <tool_response> … </tool_response>
<|im_end|>`): nothing to download, and text ↔ ids round-trips exactly, so both sides see the same
tokens. Both run in this process on the same card, each after a warm-up (the engine: the whole
workload once with other seeds, which captures its CUDA graphs; the baseline: a short generate).

Prints a markdown table and a JSON line (card, date, command); writes $OUT/multiturn_rollouts.json
when OUT is set.

    python bench/multiturn_rollouts.py                          # GPU (≈ 5 min on an H100, estimated)
    python bench/multiturn_rollouts.py --baseline_tools both    # also the thread-pool baseline (+≈ 3 min)
    python bench/multiturn_rollouts.py --smoke                  # CPU, tiny model, checks turns per sequence match
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from cohort_grpo.rollout import Engine  # noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams  # noqa: E402

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=2000, max_position_embeddings=1024, tie_word_embeddings=True)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, turn start, end of turn (EOS)
STRUCTURE = ["system", "user", "assistant", "<tool_response>", "</tool_response>"]
FIRST_WORD = 16  # ids below are special or structural; prompts and tool results use words from here on
# ChatML with Qwen2.5's tool turn (a tool result is a user turn wrapped in <tool_response> tags).
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
CHANNEL_VALUE = 0.05  # the constant channel's embedding value (the other entries are ~N(0, 0.02))
CHANNEL_HIDDEN = 4.0  # its median value after the final norm, set through the norm's weight


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--num_generations", type=int, default=8, help="G: sequences per prompt")
    p.add_argument("--calls", default="2,4", help="tool calls per sequence: min,max (uniform, per sequence)")
    p.add_argument("--tool_ms", default="10,50", help="milliseconds per call: min,max (uniform, per call)")
    p.add_argument("--result_words", default="10,30", help="words in a tool result: min,max (per call)")
    p.add_argument("--prompt_words", default="80,160", help="words in a prompt's user turn: min,max")
    p.add_argument("--turn_tokens", type=float, default=100.0, help="mean model-turn length (1 / P(<|im_end|>))")
    p.add_argument("--max_new_tokens", type=int, default=1024, help="completion budget (tool results included)")
    p.add_argument("--baseline_tools", choices=["sequential", "pool", "both"], default="sequential",
                   help="how the generate loop runs a round's tool calls (sequential: as TRL does)")
    p.add_argument("--check_interval", type=int, default=16, help="the engine's decode steps between host syncs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny workload: checks the script")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.prompts, args.num_generations = "cpu", 4, 2
        args.tool_ms, args.result_words, args.prompt_words = "1,5", "3,6", "8,16"
        args.turn_tokens, args.max_new_tokens = 8.0, 256
        args.baseline_tools = "both"
    for name in ("calls", "tool_ms", "result_words", "prompt_words"):
        low, high = (int(x) for x in getattr(args, name).split(","))
        setattr(args, name, (low, high))
    return args


# ------------------------------------------------------------------------------------------- the setup

def build_tokenizer(vocab_size: int):
    """A word-level fast tokenizer over exactly `vocab_size` ids (ChatML specials, the tool-turn words,
    then w<id>), with the ChatML + tool-turn template. Whitespace separates words, so decode → encode
    gives the same ids back."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + STRUCTURE)}
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def build_models(shape: dict, device: str, dtype: torch.dtype, seed: int):
    """(transformers Qwen2ForCausalLM, cohort CausalLM) on the same tensors (the cohort model is built
    on the transformers model's state dict), after `shape_turn_ends` has edited them."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape)
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in place, in the benchmark's dtype: no fp32 copy on the GPU
    try:
        with torch.device(device):
            hf_model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return hf_model.to(device=device, dtype=dtype).eval(), config


def cohort_model(hf_model, config, device: str, dtype: torch.dtype):
    from cohort_grpo.models import ModelConfig
    from cohort_grpo.models.loading import build_model

    return build_model(ModelConfig.from_hf_dict(config.to_dict()), dict(hf_model.state_dict()), dtype,
                       torch.device(device), "qwen2.5-0.5b-shape").eval()


@torch.no_grad()
def shape_turn_ends(hf_model, eos_id: int, mean_turn_tokens: float, device: str, seed: int) -> dict:
    """Make the random model end its turns: P(sample <|im_end|>) ≈ 1 / mean_turn_tokens at every position.

    Channel d (the last hidden dimension) carries a constant: no layer writes to it (its row of every
    o_proj and down_proj is zero) and every token's embedding holds CHANNEL_VALUE there, so after the
    final norm it is CHANNEL_VALUE / rms(x) × the norm's weight, always positive. The tied LM head adds
    h_d × E[t, d] to token t's logit: the same for every token (no effect) except `eos_id`, whose E[eos, d]
    is raised by δ. δ is found by bisection so that the mean probability of `eos_id` over the positions
    of random contexts is the target. Done in place, before the cohort model is built on the tensors."""
    model = hf_model.model
    hidden = hf_model.config.hidden_size
    d = hidden - 1
    for layer in model.layers:
        layer.self_attn.o_proj.weight[d].zero_()
        layer.mlp.down_proj.weight[d].zero_()
    embedding = model.embed_tokens.weight  # tied: the LM head too
    embedding[:, d] = CHANNEL_VALUE
    vocab = embedding.shape[0]
    rows, length = (4, 1024) if device == "cuda" else (4, 64)  # positions as deep as the rollouts reach
    generator = torch.Generator().manual_seed(seed + 7)
    contexts = torch.randint(FIRST_WORD, vocab, (rows, length), generator=generator).to(device)
    h = model(input_ids=contexts).last_hidden_state.float().reshape(-1, hidden)  # after the final norm (weight 1)
    scale = CHANNEL_HIDDEN / h[:, d].median().item()
    h[:, d] *= scale
    table = embedding.float()
    lse_others, base = [], h @ table[eos_id]
    for chunk in h.split(256):
        logits = chunk @ table.T
        logits[:, eos_id] = float("-inf")
        lse_others.append(torch.logsumexp(logits, dim=-1))
    lse_others = torch.cat(lse_others)
    target = 1.0 / mean_turn_tokens

    def hazard(delta: float) -> float:
        return torch.sigmoid(base + h[:, d] * delta - lse_others).mean().item()

    low, high = 0.0, 1.0
    while hazard(high) < target:
        high *= 2
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if hazard(middle) < target else (low, middle)
    delta = (low + high) / 2
    embedding[eos_id, d] = CHANNEL_VALUE + delta
    model.norm.weight[d] = model.norm.weight[d] * scale
    # The result in the model's own dtype: the mean probability of <|im_end|> on the same contexts.
    states = model(input_ids=contexts).last_hidden_state.reshape(-1, hidden)
    measured = torch.cat([hf_model.lm_head(chunk).float().softmax(-1)[:, eos_id] for chunk in states.split(256)])
    measured = measured.mean().item()
    return dict(channel=d, norm_weight=round(scale, 3), eos_delta=round(delta, 4), target_eos_probability=target,
                measured_eos_probability=measured)


@dataclass
class Plan:
    """The workload, drawn once from the seed: prompts, and per sequence its calls, each call's time and result."""
    prompt_messages: list[list[dict]]
    calls: list[int]  # per sequence (row i*G + g)
    sleep_s: list[list[float]]  # per sequence, per call
    results: list[list[str]]  # per sequence, per call: the tool's text


def make_plan(args, vocab: int) -> Plan:
    rng = random.Random(args.seed)

    def words(low_high):
        return " ".join(f"w{rng.randrange(FIRST_WORD, vocab)}" for _ in range(rng.randint(*low_high)))

    prompts = [[{"role": "system", "content": "You are a helpful assistant with tools."},
                {"role": "user", "content": words(args.prompt_words)}] for _ in range(args.prompts)]
    rows = args.prompts * args.num_generations
    calls = [rng.randint(*args.calls) for _ in range(rows)]
    sleep_s = [[rng.uniform(*args.tool_ms) / 1000 for _ in range(n)] for n in calls]
    results = [[words(args.result_words) for _ in range(n)] for n in calls]
    return Plan(prompts, calls, sleep_s, results)


class ToolClock:
    """The tool itself: sleeps the call's planned time; sums the seconds it actually slept."""

    def __init__(self, plan: Plan):
        self.plan, self.seconds, self.lock = plan, 0.0, threading.Lock()

    def call(self, row: int, k: int) -> str:
        started = time.perf_counter()
        time.sleep(self.plan.sleep_s[row][k])
        with self.lock:
            self.seconds += time.perf_counter() - started
        return self.plan.results[row][k]


class SleepToolTurns:
    """The engine's `TurnHandler`: after each turn that ended with <|im_end|>, while the sequence has calls
    left, a Future (thread pool) that runs its tool and returns the tool turn's token ids — the text the
    template writes after the assistant turn: the tool turn and the next assistant turn's opening."""

    def __init__(self, plan: Plan, tokenizer, workers: int):
        self.plan, self.tokenizer = plan, tokenizer
        self.clock = ToolClock(plan)
        self.done = [0] * len(plan.calls)
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.encoding = threading.Lock()  # one tokenizer shared by the pool's threads: one call at a time
        self.closed = False

    def end_of_turn(self, index: int, completion: list[int], turn_start: int):
        k = self.done[index]
        if k >= self.plan.calls[index]:
            return None
        self.done[index] += 1
        return self.pool.submit(self.run, index, k)

    def run(self, index: int, k: int) -> list[int]:
        result = self.clock.call(index, k)
        with self.encoding:
            text = self.tokenizer.apply_chat_template([{"role": "tool", "content": result}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.closed = True


# ---------------------------------------------------------------------------------------- the two sides

def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def turn_segments(sampled: list[int]) -> list[int]:
    """Lengths of the runs of model-sampled tokens (1s) of a completion's tool mask: its model turns."""
    lengths, run = [], 0
    for s in sampled:
        if s:
            run += 1
        elif run:
            lengths.append(run)
            run = 0
    if run:
        lengths.append(run)
    return lengths


def run_engine(engine: Engine, plan: Plan, tokenizer, args, seed: int) -> dict:
    prompt_ids = [tokenizer(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"] for m in plan.prompt_messages]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, eos_token_ids=[tokenizer.eos_token_id],
                            pad_token_id=tokenizer.pad_token_id, seed=seed)
    handler = SleepToolTurns(plan, tokenizer, workers=len(plan.calls))
    synchronize(args.device)
    started = time.perf_counter()
    rollout = engine.generate(prompt_ids, args.num_generations, params, turns=handler)
    synchronize(args.device)
    seconds = time.perf_counter() - started
    assert handler.closed
    turns, reasons = [], rollout.finish_reasons
    for ids, mask, sampled in zip(rollout.completion_ids, rollout.completion_mask, rollout.tool_mask):
        turns.append(turn_segments(sampled[mask.bool()].tolist()))
    return dict(seconds=seconds, turns=turns, calls=sum(handler.done), tool_seconds=handler.clock.seconds,
                tool_wall_seconds=None, model_tokens=int(rollout.loss_mask.sum()),
                all_tokens=int(rollout.completion_mask.sum()), length_stops=sum(r == "length" for r in reasons),
                stats={k: (round(v, 3) if isinstance(v, float) else v) for k, v in engine.stats.items()})


@torch.no_grad()
def run_generate_loop(hf_model, plan: Plan, tokenizer, args, seed: int, tools: str) -> dict:
    """TRL's loop without vLLM: generate over the continuing sequences, decode each finished turn, run its
    tool (`tools`: "sequential" or "pool"), re-render and re-tokenise the whole conversation, repeat."""
    from transformers import GenerationConfig

    device, G, budget, eos, pad = args.device, args.num_generations, args.max_new_tokens, tokenizer.eos_token_id, \
        tokenizer.pad_token_id
    clock = ToolClock(plan)
    pool = ThreadPoolExecutor(max_workers=len(plan.calls)) if tools == "pool" else None

    def encode(messages) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rows = len(plan.calls)
    conversations = [list(plan.prompt_messages[i // G]) for i in range(rows)]
    prompt_ids = [encode(c) for c in conversations]
    context = [list(p) for p in prompt_ids]  # what the next generate call sees for each row
    turns = [[] for _ in range(rows)]
    done_calls, length_stops = [0] * rows, 0
    active = list(range(rows))
    rounds = decode_steps = prefill_tokens = 0
    tool_wall = 0.0
    synchronize(device)
    started = time.perf_counter()
    while active:
        width = max(len(context[i]) for i in active)
        input_ids = torch.full((len(active), width), pad, dtype=torch.long)
        attention = torch.zeros((len(active), width), dtype=torch.long)
        for row, i in enumerate(active):
            input_ids[row, width - len(context[i]):] = torch.tensor(context[i])
            attention[row, width - len(context[i]):] = 1
        room = {i: budget - (len(context[i]) - len(prompt_ids[i])) for i in active}
        torch.manual_seed(seed + rounds)
        config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(room.values()),
                                  eos_token_id=eos, pad_token_id=pad)
        out = hf_model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                generation_config=config)
        new = out[:, width:].cpu()
        rounds += 1
        decode_steps += new.shape[1]
        prefill_tokens += input_ids.numel()
        finished, tool_calls = [], []
        for row, i in enumerate(active):
            ids = new[row].tolist()
            stop = ids.index(eos) + 1 if eos in ids else len(ids)
            ended = eos in ids[:stop]
            if stop > room[i]:  # past this row's own budget: cut, the completion ends here
                stop, ended = room[i], False
            ids = ids[:stop]
            turns[i].append(len(ids))
            conversations[i].append({"role": "assistant",
                                     "content": tokenizer.decode(ids, skip_special_tokens=True)})
            if ended and done_calls[i] < plan.calls[i] and len(ids) < room[i]:  # the engine's rule too
                tool_calls.append((i, done_calls[i]))
                done_calls[i] += 1
            else:
                length_stops += not ended
                context[i] = context[i] + ids
                finished.append(i)
        tool_started = time.perf_counter()
        if pool is None:
            results = [clock.call(i, k) for i, k in tool_calls]  # one after the other, as TRL runs sync tools
        else:
            results = list(pool.map(lambda call: clock.call(*call), tool_calls))
        tool_wall += time.perf_counter() - tool_started
        for (i, _), result in zip(tool_calls, results):
            conversations[i].append({"role": "tool", "content": result})
            context[i] = encode(conversations[i])  # the whole conversation, re-tokenised
            if len(context[i]) - len(prompt_ids[i]) >= budget:  # no room for another turn
                context[i] = context[i][: len(prompt_ids[i]) + budget]
                length_stops += 1
                finished.append(i)
        active = [i for i in active if i not in set(finished)]
    synchronize(device)
    seconds = time.perf_counter() - started
    if pool is not None:
        pool.shutdown()
    all_tokens = sum(len(context[i]) - len(prompt_ids[i]) for i in range(rows))
    return dict(seconds=seconds, turns=turns, calls=sum(done_calls), tool_seconds=clock.seconds,
                tool_wall_seconds=tool_wall, model_tokens=sum(sum(t) for t in turns), all_tokens=all_tokens,
                length_stops=length_stops, stats=dict(generate_calls=rounds, decode_steps=decode_steps,
                                                      prefill_tokens=prefill_tokens))


# ---------------------------------------------------------------------------------------------- report

def summary(name: str, r: dict) -> dict:
    lengths = [n for row in r["turns"] for n in row]
    return dict(sampler=name, sequences=len(r["turns"]), model_turns=len(lengths), tool_calls=r["calls"],
                model_tokens=r["model_tokens"], all_tokens=r["all_tokens"], wall_s=round(r["seconds"], 3),
                tool_s=round(r["tool_seconds"], 3),
                tool_wall_s=None if r["tool_wall_seconds"] is None else round(r["tool_wall_seconds"], 3),
                model_tok_s=round(r["model_tokens"] / r["seconds"], 1), all_tok_s=round(r["all_tokens"] / r["seconds"], 1),
                turn_tokens_mean=round(statistics.mean(lengths), 1), turn_tokens_median=statistics.median(lengths),
                turn_tokens_max=max(lengths), budget_stops=r["length_stops"], stats=r["stats"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on a CPU")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.smoke:
        torch.set_num_threads(1)  # a shared CPU: more threads only wait on each other
    shape = TINY if args.smoke else QWEN_05B
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')}  {card}  torch {torch.__version__}", flush=True)

    tokenizer = build_tokenizer(shape["vocab_size"])
    hf_model, config = build_models(shape, device, dtype, args.seed)
    calibration = shape_turn_ends(hf_model, tokenizer.eos_token_id, args.turn_tokens, device, args.seed)
    print("turn ends:", json.dumps(calibration), flush=True)
    model = cohort_model(hf_model, config, device, dtype)
    plan = make_plan(args, shape["vocab_size"])
    print(f"workload: {len(plan.calls)} sequences ({args.prompts} prompts × G={args.num_generations}), "
          f"{sum(plan.calls)} tool calls planned ({statistics.mean(plan.calls):.2f} per sequence), "
          f"{sum(map(sum, plan.sleep_s)):.2f} s of tool time in all, budget {args.max_new_tokens} tokens", flush=True)

    engine = Engine(model, tokenizer, max_batch_size=len(plan.calls), check_interval=args.check_interval)
    t = time.perf_counter()
    run_engine(engine, plan, tokenizer, args, seed=args.seed + 1000)  # warm-up: graphs, compiled kernels
    print(f"engine warm-up {time.perf_counter() - t:.1f}s", flush=True)
    engine_result = run_engine(engine, plan, tokenizer, args, seed=args.seed)
    print("engine:", json.dumps(summary("engine", engine_result)), flush=True)
    engine.release()
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()

    warm = torch.full((8, 16), FIRST_WORD, dtype=torch.long, device=device)  # the baseline's warm-up
    hf_model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=16, do_sample=True,
                      top_k=0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    baselines, errors = {}, {}
    for tools in (["sequential", "pool"] if args.baseline_tools == "both" else [args.baseline_tools]):
        try:
            result = run_generate_loop(hf_model, plan, tokenizer, args, seed=args.seed, tools=tools)
        except Exception as error:  # noqa: BLE001 - keep the engine's figures; say what failed
            if args.smoke:
                raise
            errors[tools] = f"{type(error).__name__}: {error}"[:400]
            print(f"generate loop ({tools} tools) failed: {errors[tools]}", flush=True)
            continue
        baselines[tools] = result
        print(f"generate loop ({tools} tools):", json.dumps(summary(f"generate loop, {tools} tools", result)), flush=True)

    # Structure: each sequence's model turns, per side (the same unless a budget cut differs).
    engine_turns = [len(t) for t in engine_result["turns"]]
    expected = [n + 1 for n in plan.calls]
    mismatches = {name: sum(a != b for a, b in zip(engine_turns, [len(t) for t in r["turns"]]))
                  for name, r in baselines.items()}
    rows = [summary("engine (cohort)", engine_result)] + [summary(f"HF generate loop, {k} tools", r)
                                                          for k, r in baselines.items()]
    ratios = {k: dict(model_tok_s=round(engine_result["model_tokens"] / engine_result["seconds"]
                                        / (r["model_tokens"] / r["seconds"]), 2),
                      wall=round(r["seconds"] / engine_result["seconds"], 2)) for k, r in baselines.items()}
    command = "python " + " ".join([sys.argv[0]] + sys.argv[1:]) if argv is None else "main(" + repr(argv) + ")"
    print(f"\n{datetime.date.today().isoformat()}, {card}, `{command}`: {len(plan.calls)} sequences "
          f"({args.prompts} prompts × G={args.num_generations}), {args.calls[0]}–{args.calls[1]} calls per sequence, "
          f"{args.tool_ms[0]}–{args.tool_ms[1]} ms per call, {args.result_words[0]}–{args.result_words[1]}-word results, "
          f"model turns ending at <|im_end|> (P = 1/{args.turn_tokens:g} per token), budget {args.max_new_tokens}\n")
    print("| sampler | model turns | tool calls | model tokens | all tokens | wall s | tool s (sum of calls) "
          "| model tok/s | all tok/s | turn tokens mean / median / max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['sampler']} | {r['model_turns']} | {r['tool_calls']} | {r['model_tokens']:,} | {r['all_tokens']:,} "
              f"| {r['wall_s']:.2f} | {r['tool_s']:.2f} | {r['model_tok_s']:,.0f} | {r['all_tok_s']:,.0f} "
              f"| {r['turn_tokens_mean']} / {r['turn_tokens_median']} / {r['turn_tokens_max']} |")
    for k, ratio in ratios.items():
        print(f"| **engine / generate loop ({k} tools)** | | | | | generate ÷ engine: {ratio['wall']}× | | "
              f"**{ratio['model_tok_s']}×** | | |")
    print(f"\nsequences whose number of model turns differs between engine and generate loop: {mismatches} "
          f"(of {len(plan.calls)}); engine sequences with calls + 1 turns: "
          f"{sum(a == b for a, b in zip(engine_turns, expected))}")
    result = dict(bench="multiturn_rollouts", date=datetime.date.today().isoformat(), card=card, command=command,
                  torch=torch.__version__, dtype=str(dtype).replace("torch.", ""),
                  model="qwen2.5-0.5b-shape (random)" if not args.smoke else "tiny qwen2 (random)",
                  workload=dict(sequences=len(plan.calls), prompts=args.prompts, G=args.num_generations,
                                calls=args.calls, tool_ms=args.tool_ms, result_words=args.result_words,
                                prompt_words=args.prompt_words, turn_tokens=args.turn_tokens,
                                max_new_tokens=args.max_new_tokens, planned_calls=sum(plan.calls)),
                  turn_ends=calibration, rows=rows, ratio_engine_over_generate=ratios, turn_mismatches=mismatches,
                  baseline_errors=errors)
    print(json.dumps(result), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "multiturn_rollouts.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.smoke:  # the structure check: both sides make each sequence's calls, then end it
        for name, r in baselines.items():
            theirs = [len(t) for t in r["turns"]]
            assert theirs == engine_turns == expected, (name, theirs, engine_turns, expected)
            assert r["calls"] == engine_result["calls"] == sum(plan.calls)
        print("smoke: OK — every sequence made the same number of model turns (calls + 1) on both sides")
    return result


if __name__ == "__main__":
    main()
