"""A real model learns to use a calculator: SmolLM2-135M-Instruct (GGUF), GRPO with and without the tool.

Task: arithmetic word problems whose answer is a product or sum of multi-digit numbers, made from seeded
templates ("A shop sells 347 boxes of 28 pencils each. How many pencils does it sell?" → 9716), answered
as <answer>N</answer>; reward 1 when the last assistant message's answer is exact, else 0. Training and
held-out problems come from disjoint random streams.

Tool: `cohort_grpo.tasks.calculator.calculator(expression: str) -> str` when that module exists, else the
typed, documented calculator defined below. SmolLM2's own chat template renders no tools, so the
tokenizer gets a ChatML template in Qwen2.5's layout: the tool's JSON schema in the system turn, Hermes
calls (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`) in the assistant turn, and the
result as `<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n` (SmolLM2's vocabulary
has the ChatML tokens).

1. Warm start (SFT, in rounds): conversations rendered with the tool in the system prompt, on the
   training problems; a fraction (--tool_fraction, 0.3) solved by a call (the call, the tool's result,
   the answer copied from it) and the others answered directly (the right number, which the model cannot
   compute: it learns the format, not the products). The tool's tokens are out of the loss. Rounds stop
   once sampled completions call the tool sometimes and, when they do, mostly answer right — so the
   greedy policy still answers directly (held-out accuracy before GRPO stays low: reported).
2. Two GRPO runs through `cohort_grpo.GRPOTrainer` from that same warm start, same steps, settings and seed:
   `tools=[calculator]` (the engine runs the calls between turns), and no tools (the same model, the
   prompt without the tool, nothing executed). Each: held-out greedy accuracy before and after (the
   trainer's `accuracy_before/after`: with tools, the judged answer is the last turn), the call
   frequency at the first and last step (`tools/call_frequency`: calls executed per completion; and
   the fraction of completions that wrote a <tool_call>, for both runs), steps, seconds.

Prints the per-step curve, a markdown table and a JSON line (card, date, command); writes
OUT_DIR/results.json.

    python bench/tools_smollm2.py prepare     # here: checks the GGUF halves, bundles the gguf wheel; prints the device calls
    python bench/tools_smollm2.py --model /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/tools_run  # GPU, ≈ 2.5 min on an H200
    python bench/tools_smollm2.py --smoke     # CPU: the tiny tools tokenizer, a tiny random model, a few steps
    python bench/tools_smollm2.py --smoke --model FILE.gguf   # CPU: SmolLM2 itself, one step of each stage (minutes)
"""

from __future__ import annotations

import argparse
import ast
import datetime
import gc
import hashlib
import json
import math
import random
import shutil
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from gsm8k_smollm2 import GGUF_NAME, GGUF_SHA256  # noqa: E402 - the same file, checked the same way (bench/ is on sys.path)
HALVES = [ROOT / ".models1" / "part", ROOT / ".models2" / "part"]  # the GGUF in two halves (git-ignored)
BUNDLE = ROOT / ".bench" / "tools_smollm2"  # git-ignored; carried to the GPU machine
WHEEL = "gguf==0.19.0"  # cohort's GGUF reader needs it; not on the GPU image (../shared/notes/device.md)

SYSTEM = "You are a helpful assistant. Solve the problem and give the final answer as <answer>N</answer>."

# ChatML in Qwen2.5's tool layout (its template with another default system prompt).
CHATML_TOOLS_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

# ------------------------------------------------------------------------------------------------ the tool

try:  # the project's calculator (cohort_grpo/tasks/calculator.py), when it is there
    from cohort_grpo.tasks.calculator import calculator
except ImportError:
    _OPERATIONS = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y,
                   ast.Div: lambda x, y: x / y}

    def _value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            return -_value(node.operand) if isinstance(node.op, ast.USub) else _value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
            return _OPERATIONS[type(node.op)](_value(node.left), _value(node.right))
        raise ValueError("use integers with + - * / and parentheses")

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression on integers with + - * / and parentheses.

        Args:
            expression: The expression to evaluate, for example "347*28" or "(12+30)/7".
        """
        value = _value(ast.parse(str(expression).strip(), mode="eval").body)  # ZeroDivisionError: a failed call
        return str(value.numerator) if value.denominator == 1 else repr(value.numerator / value.denominator)


# ------------------------------------------------------------------------------------------------ the task

# (question, the expression a calculator call should pass, its value); a, c: 3 digits, b: 2, d: 4
TEMPLATES = [
    ("A shop sells {a} boxes of {b} pencils each. How many pencils does it sell?",
     "{a}*{b}", lambda a, b, c, d: a * b),
    ("A farmer plants {a} rows of {b} apple trees. How many apple trees are there?",
     "{a}*{b}", lambda a, b, c, d: a * b),
    ("A library has {a} shelves with {b} books on each shelf and {c} more books on a cart. How many books does "
     "it have?", "{a}*{b}+{c}", lambda a, b, c, d: a * b + c),
    ("A school buys {d} pens, {a} pencils and {c} erasers. How many items does it buy?",
     "{d}+{a}+{c}", lambda a, b, c, d: d + a + c),
    ("A truck carries {a} crates of {b} bottles. {c} bottles break. How many bottles are left?",
     "{a}*{b}-{c}", lambda a, b, c, d: a * b - c),
    ("A theatre has {b} rows of {a} seats and a balcony of {d} seats. How many seats are there?",
     "{b}*{a}+{d}", lambda a, b, c, d: b * a + d),
]


def make_problem(rng: random.Random) -> dict:
    question, expression, value = rng.choice(TEMPLATES)
    numbers = dict(a=rng.randint(100, 999), b=rng.randint(12, 99), c=rng.randint(100, 999), d=rng.randint(1000, 9999))
    return {"question": question.format(**numbers), "expression": expression.format(**numbers),
            "solution": str(value(**numbers))}


def load_problems(split: str, size: int, exclude: set | None = None) -> list[dict]:
    """`size` distinct problems of a split (train and test: disjoint random streams; test never in train)."""
    rng = random.Random({"train": 11, "test": 22}[split])
    rows, seen = [], set(exclude or ())
    while len(rows) < size:
        problem = make_problem(rng)
        if problem["question"] in seen:
            continue
        seen.add(problem["question"])
        rows.append(problem)
    return rows


def with_prompts(problems: list[dict], system: bool) -> list[dict]:
    return [{**p, "prompt": ([{"role": "system", "content": SYSTEM}] if system else [])
             + [{"role": "user", "content": p["question"]}]} for p in problems]


def last_answer(completion) -> str | None:
    """The <answer> of the model's last turn (the last assistant message of a conversation, or the text)."""
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        mine = [m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
        completion = mine[-1].get("content") or "" if mine else ""
    start, end = completion.find("<answer>"), completion.find("</answer>")
    return completion[start + 8: end].strip() if 0 <= start < end else None


def answer_reward(prompts, completions, completion_ids=None, *, solution, **_) -> list[float]:
    """1.0 when the last assistant message's <answer> is the exact result, else 0.0."""
    return [1.0 if last_answer(c) == str(s) else 0.0 for c, s in zip(completions, solution)]


def wrote_call_rate(tokenizer, rollout) -> float:
    """Fraction of completions whose own tokens (tool results left out) write a <tool_call>, well formed or
    not, whether a tool ran it (with tools) or not (without)."""
    own = rollout.loss_mask.bool()
    return sum("<tool_call>" in tokenizer.decode(ids[m], skip_special_tokens=False)
               for ids, m in zip(rollout.completion_ids, own)) / len(own)


class WordProblems:
    """The trainer's task: its verifier for held-out accuracy (no `tools` attribute: tools are the run's)."""

    name = "word_problems"
    reward_funcs = [answer_reward]
    reward_weights = [1.0]

    @staticmethod
    def extract_answer(text) -> str | None:
        return last_answer(text)

    def is_correct(self, completion, row: dict) -> bool:
        return last_answer(completion) == row["solution"]


def solved_messages(row: dict, call: bool) -> list[dict]:
    """The warm start's conversation: the call, the tool's result and the copied answer, or the answer alone."""
    answer = {"role": "assistant", "content": f"<answer>{row['solution']}</answer>"}
    if not call:
        return [*row["prompt"], answer]
    tool_call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": row["expression"]}}}
    return [*row["prompt"], {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "name": "calculator", "content": calculator(row["expression"])}, answer]


def encode_conversation(tokenizer, messages: list[dict], tools: list[dict] | None):
    """(prompt ids, completion ids, loss mask): each message adds the text its rendering appends, tokenised
    on its own (as the rollout appends a tool turn); the assistant's pieces up to their EOS are the model's
    (mask 1), the rest (the newline after EOS, a tool turn and the next assistant opening) are not."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")

    def render(upto: int, opened: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False, add_generation_prompt=opened)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    previous = render(first, True)
    prompt, completion, mask = ids(previous), [], []
    for k in range(first, len(messages)):
        mine = messages[k]["role"] == "assistant"
        text = render(k + 1, not mine)
        assert text.startswith(previous), "the chat template re-renders earlier turns"
        piece = ids(text[len(previous):])
        own = len(piece)
        if mine and tokenizer.eos_token_id in piece:  # what the template writes after EOS is not sampled
            own = piece.index(tokenizer.eos_token_id) + 1
        completion += piece
        mask += [1 if mine else 0] * own + [0] * (len(piece) - own)
        previous = text
    return prompt, completion, mask


# ------------------------------------------------------------------------------------------------ options

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["run", "prepare"])
    p.add_argument("--model", help=f"the {GGUF_NAME} file (default: .models1/part + .models2/part joined in /tmp)")
    p.add_argument("--out", default="runs/bench_tools_smollm2", help="folder for the runs and results.json")
    p.add_argument("--train_problems", type=int, default=2000)
    p.add_argument("--eval_problems", type=int, default=200)
    p.add_argument("--tool_fraction", type=float, default=0.3, help="warm-start conversations solved with a call")
    p.add_argument("--sft_round", type=int, default=5,
                   help="SFT steps per warm-start round (40 overshoots: the greedy policy then already calls)")
    p.add_argument("--sft_max_steps", type=int, default=240)
    p.add_argument("--sft_batch_size", type=int, default=16)
    p.add_argument("--sft_learning_rate", type=float, default=5e-5)
    p.add_argument("--sft_until_calls", type=float, default=0.15, help="stop once sampled call rate ≥ this ...")
    p.add_argument("--sft_until_call_accuracy", type=float, default=0.5, help="... and calls answer right this often")
    p.add_argument("--probe_problems", type=int, default=64, help="training problems sampled (×2) after each round")
    p.add_argument("--prompts_per_step", type=int, default=16)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_steps", type=int, default=60, help="GRPO steps per run (both runs)")
    p.add_argument("--learning_rate", type=float, default=3e-5)
    p.add_argument("--max_completion_length", type=int, default=128)
    p.add_argument("--time_budget", type=float, default=170.0, help="GRPO seconds per run at most (a safety stop)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny random model, a few steps: checks the script")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.train_problems, args.eval_problems, args.probe_problems = "cpu", 32, 4, 4
        args.sft_round, args.sft_max_steps, args.sft_batch_size, args.sft_learning_rate = 40, 80, 8, 3e-3
        args.sft_until_calls = args.sft_until_call_accuracy = 1.01  # run every round, to exercise them
        args.prompts_per_step, args.num_generations, args.max_steps = 2, 2, 2
        args.max_completion_length, args.time_budget = 128, 600.0
        args.tool_fraction = 0.9  # the tiny model then calls in the GRPO steps too: the tool path is exercised
        if args.model:  # the real model on the CPU: the smallest settings that still run every stage
            args.train_problems, args.eval_problems, args.probe_problems = 8, 2, 1
            args.sft_round, args.sft_max_steps, args.sft_batch_size, args.sft_learning_rate = 1, 1, 2, 3e-5
            args.max_steps, args.max_completion_length, args.tool_fraction = 1, 64, 0.3
    return args


# ------------------------------------------------------------------------------------------------ prepare

def prepare() -> None:
    """Check the GGUF halves (.models1/part, .models2/part: each under the 64 MiB a device call carries) and
    bundle the gguf wheel into .bench/tools_smollm2/whl; print the two device calls."""
    if not all(h.is_file() for h in HALVES):
        gguf = Path.home() / ".cache" / "cohort" / "smollm2-135m-instruct" / GGUF_NAME
        if not gguf.is_file():
            script = ROOT.parent / "shared" / "models" / "smollm2-135m-instruct" / "get.sh"
            subprocess.run(["bash", str(script), str(gguf.parent)], check=True, stdout=subprocess.DEVNULL)
        data = gguf.read_bytes()
        for half, part in zip(HALVES, (data[: len(data) // 2], data[len(data) // 2:])):
            half.parent.mkdir(exist_ok=True)
            half.write_bytes(part)
    digest = hashlib.sha256(HALVES[0].read_bytes() + HALVES[1].read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        raise SystemExit(f"the halves join to sha256 {digest}, not {GGUF_SHA256}: remove .models1/.models2 and rerun")
    wheels = BUNDLE / "whl"
    wheels.mkdir(parents=True, exist_ok=True)
    local = sorted((ROOT / ".whl").glob("gguf-0.19.0-*.whl"))
    if local:
        shutil.copy(local[0], wheels / local[0].name)
    else:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "any",
                        "-d", str(wheels), WHEEL], check=True)
    b = BUNDLE.relative_to(ROOT)
    print(f"ready: {HALVES[0].relative_to(ROOT)}, {HALVES[1].relative_to(ROOT)} (sha256 ok), {b}/whl\n\n"
          f"device call 1 (carry [\".models1\"]):\n"
          f"  mkdir -p /tmp/smol && cp .models1/part /tmp/smol/part0 && ls -l /tmp/smol\n\n"
          f"device call 2, right after, same warm machine (carry [\".models2\", \"{b}\"]):\n"
          f"  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
          f"{b}/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; "
          f"cat /tmp/smol/part0 .models2/part > /tmp/smol/{GGUF_NAME} && "
          f"echo \"{GGUF_SHA256}  /tmp/smol/{GGUF_NAME}\" | sha256sum -c || exit; nvidia-smi -L; "
          f"python3 bench/tools_smollm2.py --model /tmp/smol/{GGUF_NAME} --out /tmp/tools_run 2>&1 | tee $OUT/log.txt; "
          f"cp /tmp/tools_run/results.json $OUT/")


# ------------------------------------------------------------------------------------------------ the run

def load_start(args):
    """(model, tokenizer, source): SmolLM2 from the GGUF with the ChatML-tools template; with --smoke, a tiny
    random Llama on the built-in tools tokenizer (characters, tool tags as tokens, its own Hermes template)."""
    from cohort_grpo.run.policy import load_policy

    if args.smoke and not args.model:
        from cohort_grpo.models.tiny import build_model, build_tools_tokenizer

        tokenizer = build_tools_tokenizer()
        spec = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512)
        folder = Path(args.out) / "tiny-random"
        build_model(tokenizer, seed=args.seed, spec=spec).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        model, tokenizer = load_policy(str(folder), tokenizer, device=args.device, dtype="float32")
        return model, tokenizer, "tiny random Llama (tools tokenizer)"
    gguf = Path(args.model) if args.model else None
    if gguf is None:
        gguf = Path("/tmp/smol") / GGUF_NAME
        if not gguf.is_file():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            gguf.write_bytes(HALVES[0].read_bytes() + HALVES[1].read_bytes())
    from cohort_grpo.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(gguf))
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    model, tokenizer = load_policy(str(gguf), tokenizer, device=args.device, dtype="float32")
    return model, tokenizer, gguf.name


def probe(sampler, tokenizer, rows: list[dict], args, toolbox) -> dict:
    """Sample 2 completions (T = 1) per row with the tool available: how often a tool turn followed (failed
    calls included), how often the answer was right overall and when a tool turn followed."""
    from cohort_grpo.eval.evaluate import ToolRollout
    from cohort_grpo.rollout.sampler import SamplingParams
    from cohort_grpo.tasks import prompt_text

    encode = lambda prompt, tools=None: tokenizer(prompt_text(tokenizer, prompt, tools),  # noqa: E731
                                                  add_special_tokens=False)["input_ids"]
    rollout = ToolRollout(sampler, tokenizer, encode, toolbox)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rollout.generate(rows, 2, SamplingParams(max_new_tokens=args.max_completion_length, temperature=1.0,
                                             eos_token_ids=[tokenizer.eos_token_id], pad_token_id=pad, seed=args.seed))
    conversations = rollout.conversations
    solutions = [r["solution"] for r in rows for _ in range(2)]
    right = answer_reward(None, conversations, solution=solutions)
    called = [any(m.get("role") == "tool" for m in c) for c in conversations]
    n_called = sum(called)
    return dict(call_rate=n_called / len(called), accuracy=sum(right) / len(right),
                call_accuracy=sum(r for r, c in zip(right, called) if c) / n_called if n_called else 0.0,
                example=conversations[called.index(True) if n_called else 0])


def warm_start(model, tokenizer, train_rows: list[dict], args, log) -> dict:
    """SFT in rounds on tool and direct conversations (tool in the system prompt) until sampled completions
    call sometimes and answer right when they do, or the step bound."""
    from cohort_grpo.sft.sft_trainer import SFTConfig, sft_train
    from cohort_grpo.rollout import make_sampler
    from cohort_grpo.tools.schema import tool_schema
    from cohort_grpo.tools.toolbox import Toolbox

    toolbox = Toolbox(tools=[calculator], max_iterations=2, timeout_s=10.0)
    schemas = [tool_schema(calculator)]
    rng = random.Random(args.seed)
    calls = set(rng.sample(range(len(train_rows)), round(args.tool_fraction * len(train_rows))))
    rows = [{"messages": solved_messages(r, call=i in calls)} for i, r in enumerate(train_rows)]
    encode = lambda row: encode_conversation(tokenizer, row["messages"], schemas)  # noqa: E731
    sample = train_rows[: args.probe_problems]
    sampler = make_sampler(model, tokenizer)  # samples the weights in place: it sees every SFT round
    state = probe(sampler, tokenizer, sample, args, toolbox)
    rounds = [dict(steps=0, **{k: v for k, v in state.items() if k != "example"})]
    log(f"base model, sampled with the tool: calls {state['call_rate']:.2f}, accuracy {state['accuracy']:.2f}")
    steps, started = 0, time.perf_counter()
    while steps < args.sft_max_steps and not (state["call_rate"] >= args.sft_until_calls
                                              and state["call_accuracy"] >= args.sft_until_call_accuracy):
        n = min(args.sft_round, args.sft_max_steps - steps)
        sft_train(model, tokenizer, rows, SFTConfig(learning_rate=args.sft_learning_rate, max_steps=n, warmup_steps=0,
                                                    batch_size=args.sft_batch_size, seed=args.seed + steps,
                                                    logging_steps=0), log=log, encode=encode)
        steps += n
        state = probe(sampler, tokenizer, sample, args, toolbox)
        rounds.append(dict(steps=steps, **{k: v for k, v in state.items() if k != "example"}))
        log(f"warm start: {steps} SFT steps; sampled with the tool: calls {state['call_rate']:.2f}, accuracy "
            f"{state['accuracy']:.2f}, accuracy when calling {state['call_accuracy']:.2f}")
    log("a sampled completion after the warm start: " + json.dumps(state["example"])[:600])
    return dict(steps=steps, seconds=round(time.perf_counter() - started, 1), rounds=rounds)


def grpo(folder: str, tokenizer, train_rows, test_rows, args, with_tools: bool, log) -> dict:
    """One GRPO run from the warm start: the trainer's held-out accuracy before/after, the per-step curve."""
    from cohort_grpo import GRPOConfig, GRPOTrainer

    name = "tools" if with_tools else "no_tools"
    P, G = args.prompts_per_step, args.num_generations
    config = GRPOConfig(
        num_generations=G, per_device_train_batch_size=min(64, P * G), gradient_accumulation_steps=max(1, P * G // 64),
        max_steps=args.max_steps, max_completion_length=args.max_completion_length, max_prompt_length=512,
        learning_rate=args.learning_rate, beta=0.0, temperature=1.0, seed=args.seed, device=args.device,
        output_dir=str(Path(args.out) / name), logging_steps=1, log_completions_steps=10, quiet=True,
        overwrite_output_dir=True, max_tool_calling_iterations=2 if with_tools else None, tool_timeout=10.0)
    curve: list[dict] = []
    clock = {}

    class Trainer(GRPOTrainer):
        def log_step(self, batch, losses, seconds):
            record = super().log_step(batch, losses, seconds)
            r = self.history[-1]
            point = dict(step=r["step"], reward=r.get("reward"), calls=r.get("tools/call_frequency"),
                         wrote_call=wrote_call_rate(self.tokenizer, batch.rollout),
                         failures=r.get("tools/failure_frequency"), length=r.get("completions/mean_length"),
                         seconds=round(r.get("step_time", seconds), 2))
            curve.append(point)
            log(f"[{name}] step {point['step']:3d}  reward {point['reward']:.3f}  calls/completion "
                f"{_num(point['calls']):.2f}  wrote <tool_call> {point['wrote_call']:.2f}  "
                f"length {_num(point['length']):.0f}  {point['seconds']:.1f}s")
            if time.perf_counter() - clock["started"] > args.time_budget:
                self.callback_handler.control.should_training_stop = True
                clock["stopped"] = f"time budget {args.time_budget:g}s"
            return record

    trainer = Trainer(folder, [answer_reward], train_rows, args=config, processing_class=tokenizer,
                      eval_dataset=test_rows, task=WordProblems(), log=log, tools=[calculator] if with_tools else None)
    clock["started"] = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - clock["started"]
    trainer.rewards.close()
    return dict(run=name, accuracy_before=trainer.accuracy_before, accuracy_after=trainer.accuracy_after,
                steps=len(curve), seconds=round(seconds, 1), stop=clock.get("stopped", f"max_steps {args.max_steps}"),
                calls_first=curve[0]["calls"] if curve else None, calls_last=curve[-1]["calls"] if curve else None,
                wrote_call_first=curve[0]["wrote_call"] if curve else None,
                wrote_call_last=curve[-1]["wrote_call"] if curve else None,
                reward_first=curve[0]["reward"] if curve else None, reward_last=curve[-1]["reward"] if curve else None,
                curve=curve)


def run(args) -> dict:
    import torch

    from cohort_grpo.models.policy import save_policy

    started = time.perf_counter()
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        torch.set_num_threads(1)  # a shared CPU: more threads only wait on each other
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    log(f"{datetime.datetime.now().isoformat(timespec='seconds')}  {card}  calculator from {calculator.__module__}")
    test = load_problems("test", args.eval_problems)
    train = load_problems("train", args.train_problems, exclude={p["question"] for p in test})
    system = not (args.smoke and not args.model)  # the tiny template renders no system turn worth its tokens
    train_rows, test_rows = with_prompts(train, system), with_prompts(test, system)

    model, tokenizer, source = load_start(args)
    log(f"model {source}; {len(train_rows)} training problems, {len(test_rows)} held-out; e.g. "
        f"{test_rows[0]['question']!r} → {test_rows[0]['expression']} = {test_rows[0]['solution']}")
    sft = warm_start(model, tokenizer, train_rows, args, log)
    folder = Path(args.out) / "warm_start"
    save_policy(model, tokenizer, folder)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()

    runs = []
    for with_tools in (True, False):
        runs.append(grpo(str(folder), tokenizer, train_rows, test_rows, args, with_tools, log))
        gc.collect()  # the finished trainer's model, optimizer and engine, before the next one is built
        if args.device == "cuda":
            torch.cuda.empty_cache()
    command = "python " + " ".join(sys.argv)
    results = dict(bench="tools_smollm2", date=datetime.date.today().isoformat(), card=card, command=command,
                   model=source, calculator=f"{calculator.__module__}:calculator", train_problems=len(train_rows),
                   eval_problems=len(test_rows), warm_start=sft,
                   grpo=dict(prompts_per_step=args.prompts_per_step, num_generations=args.num_generations,
                             max_steps=args.max_steps, learning_rate=args.learning_rate,
                             max_completion_length=args.max_completion_length, seed=args.seed),
                   runs=runs, total_seconds=round(time.perf_counter() - started, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    warm = sft["rounds"][-1]
    log(f"\n{results['date']}, {card}, `{command}`: {source}; warm start {sft['steps']} SFT steps "
        f"({100 * args.tool_fraction:.0f}% of its conversations call the tool; then, sampled at T = 1 with the "
        f"tool: a call in {100 * warm['call_rate']:.0f}% of completions, right answers {100 * warm['accuracy']:.0f}% "
        f"overall and {100 * warm['call_accuracy']:.0f}% after a call); GRPO {args.prompts_per_step} prompts × "
        f"G={args.num_generations}, lr {args.learning_rate:g}, {args.max_steps} steps at most; "
        f"{len(test_rows)} held-out problems (greedy)\n")
    log("| run | held-out accuracy before → after | calls per completion, first → last step | wrote <tool_call>, "
        "first → last | reward first → last | steps | s (GRPO + 2 evals) |")
    log("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        log(f"| {'GRPO with calculator' if r['run'] == 'tools' else 'GRPO without tools'} | "
            f"{_pct(r['accuracy_before'])} → {_pct(r['accuracy_after'])} | "
            f"{_fmt(r['calls_first'])} → {_fmt(r['calls_last'])} | {_fmt(r['wrote_call_first'])} → "
            f"{_fmt(r['wrote_call_last'])} | {_fmt(r['reward_first'])} → {_fmt(r['reward_last'])} | {r['steps']} "
            f"| {r['seconds']:.0f} |")
    log(f"\ntotal {results['total_seconds']:.0f} s (warm start {sft['seconds']:.0f} s)")
    log(json.dumps({k: v for k, v in results.items() if k != "runs"}
                   | {"runs": [{k: v for k, v in r.items() if k != "curve"} for r in runs]}))
    return results


def _num(value) -> float:
    return math.nan if value is None else float(value)


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.mode == "prepare":
        prepare()
    else:
        run(parsed)
