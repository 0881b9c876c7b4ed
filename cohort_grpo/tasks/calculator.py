"""The built-in tool-use task: products too hard to do in the head, and a calculator to do them with.

Each problem multiplies a 3-digit by a 4-digit number (`347*2891=?`). The tiny built-in tools model
(`cohort_grpo.models.tiny`, name `TINY_TOOLS_MODEL`) cannot multiply such numbers itself, but it can call
`calculator` and copy the result into `<answer>N</answer>`. Its warm start
(`cohort_grpo.sft.sft_tools`) calls the tool on only a fraction of the problems and answers the rest
directly (and so wrongly on unseen ones): GRPO has to learn that calling the tool is what pays.

A rollout is multi-turn: the call turn, the tool's result (appended by the rollout, not sampled), the
answer turn. Its completion reaches the reward as TRL's conversational list of messages; only the
last assistant message counts, so an answer the tool wrote is never the model's answer.
"""

from __future__ import annotations

import ast
import random
import re
from fractions import Fraction

from cohort_grpo.errors import CohortError
from cohort_grpo.tasks.arithmetic import split_random

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
TOOL_RESPONSE_END = "</tool_response>"
MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 100  # products of many long numbers: refuse rather than print a wall of digits
FACTOR_DIGITS = (3, 4)  # a 3-digit times a 4-digit number ...
PRODUCT_DIGITS = 7  # ... whose product has 7 digits (83% of such pairs: 6.7 million problems)


# ---------------------------------------------------------------------------------------------- the tool

def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression on integers with + - * / and parentheses.

    Args:
        expression: The expression to evaluate, for example "347*2891" or "(12+30)/7".
    """
    if not isinstance(expression, str):
        raise TypeError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters long; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r}: write integers with + - * / and parentheses") from None
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return repr(value.numerator / value.denominator)


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _evaluate(node: ast.AST) -> Fraction:
    """The exact value of an expression tree made only of integers, + - * / and unary signs."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, int) and not isinstance(node.value, bool):
            return Fraction(node.value)
        raise ValueError(f"only integers are allowed, got {node.value!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Div)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ValueError("division by zero")
            value = left / right
        else:
            value = _BINARY[type(node.op)](left, right)
        if max(abs(value.numerator), value.denominator).bit_length() > MAX_RESULT_DIGITS * 3.33:
            raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits")
        return value
    if isinstance(node, ast.BinOp):
        raise ValueError(f"operator {type(node.op).__name__} is not supported; use + - * / and parentheses")
    raise ValueError(f"{type(node).__name__.lower()} {ast.unparse(node)!r} is not allowed; "
                     "use integers with + - * / and parentheses")


# ----------------------------------------------------------------------------------------- the answer

def final_text(completion) -> str:
    """The model's last turn: the content of the last assistant message of a conversational completion;
    for a plain string (a whole trajectory as text), what follows the last tool response."""
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
                content = message.get("content")
                if isinstance(content, list):  # [{"type": "text", "text": ...}] parts
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                return content if isinstance(content, str) else ""
        return ""
    text = "" if completion is None else str(completion)
    return text.rsplit(TOOL_RESPONSE_END, 1)[-1]


def extract_answer(completion) -> str | None:
    """The text inside the first <answer>…</answer> of the model's last turn, stripped; None without tags."""
    match = ANSWER_RE.search(final_text(completion))
    return match.group(1).strip() if match else None


def answer_reward(prompts, completions, completion_ids=None, *, solution, **_) -> list[float]:
    """1.0 when the last assistant message's <answer> equals the exact product, else 0.0."""
    return [1.0 if extract_answer(c) == str(gold) else 0.0 for c, gold in zip(completions, solution)]


# ------------------------------------------------------------------------------------------- the task

def make_problem(rng: random.Random) -> tuple[str, int]:
    """(question "a*b", a × b): a of FACTOR_DIGITS[0] digits, b of FACTOR_DIGITS[1] digits, and a product
    of PRODUCT_DIGITS digits. One length of result keeps the copy from the tool's result to the answer
    at a fixed distance, which a 3-layer model learns in a short warm start."""
    while True:
        a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in FACTOR_DIGITS)
        if len(str(a * b)) == PRODUCT_DIGITS:
            return f"{a}*{b}", a * b


def user_message(question: str) -> list[dict]:
    return [{"role": "user", "content": f"{question}=?"}]


class CalculatorTask:
    name = "calculator"
    # `cohort-grpo train --task calculator`: the tiny tools model (its warm start calls the tool on ~30% of
    # sampled completions and never greedily, so it starts near 0% held-out), trained until it calls the
    # tool on nearly every completion (≥0.9 from step ~20 at this learning rate; 60 steps leave a margin).
    # A rollout is the call turn (66 tokens), the tool's result (10, not the model's) and the answer (10):
    # 86 of the 96 allowed. beta=0: no reference model to run, and nothing here to hold the policy near.
    default_config = dict(
        model="cohort:tiny-tools",  # models/tiny.py's TINY_TOOLS_MODEL (its warm start imports this task)
        num_generations=8, per_device_train_batch_size=64,
        gradient_accumulation_steps=1, max_completion_length=96, max_prompt_length=32,
        max_tool_calling_iterations=1, learning_rate=1e-4, beta=0.0, max_steps=60, temperature=1.0,
        eval_limit=200, output_dir="runs/calculator", seed=0, logging_steps=5, log_completions_steps=20,
    )
    reads_data = False  # it generates its problems: --data_files / --dataset_name do not apply
    system_prompt = None
    reward_funcs = [answer_reward]
    reward_weights = [1.0]
    tools = [calculator]
    extract_answer = staticmethod(extract_answer)

    def load(self, split: str = "train", *, size: int = 2000, seed: int = 0, **_) -> list[dict]:
        """Rows {prompt (chat messages), solution, question}. Train and test draw from disjoint random
        streams, test problems are removed from train, and the test split does not depend on the seed."""
        rng = split_random("calculator", split, seed)
        if not isinstance(size, int) or size < 1:
            raise CohortError(f"calculator: size must be a positive number of problems, got {size!r}")
        held_out = set() if split == "test" else {r["question"] for r in self.load("test", size=1000)}
        rows, seen = [], set()
        for _ in range(20 * size):  # 6.7 million distinct problems: only an absurd size runs out
            if len(rows) == size:
                break
            question, value = make_problem(rng)
            if question in held_out or question in seen:
                continue
            seen.add(question)
            rows.append({"prompt": user_message(question), "solution": str(value), "question": question})
        return rows

    def is_correct(self, completion, row: dict) -> bool:
        return answer_reward(None, [completion], solution=[row["solution"]])[0] == 1.0

    @staticmethod
    def solved_messages(row: dict, call_tool: bool = True) -> list[dict]:
        """The reference trajectory the warm start imitates: the call, the tool's result, the answer
        (or, with `call_tool=False`, the answer alone)."""
        answer = {"role": "assistant", "content": f"<answer>{row['solution']}</answer>"}
        if not call_tool:
            return [*row["prompt"], answer]
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": row["question"]}}}]}
        result = {"role": "tool", "name": "calculator", "content": calculator(row["question"])}
        return [*row["prompt"], call, result, answer]
