"""Grading answers (cohort_grpo/rewards/rules.py: `accuracy_reward`, `extract_answer`, `canonical_answer`)
against what a careful human grader awards.

Each row of TABLE is (completion, gold, verdict): verdict 1 when a careful grader marks the completion's
final answer right, 0 when wrong or when there is no final answer to mark. The reward must agree on
every row, and above all it must never pay a wrong answer (a false positive teaches the policy to game
the reward). KNOWN_MISSES lists the few right answers the reward leaves unpaid because reading them
would open a door to false positives; they are asserted so that a change to them is seen.
"""

import json
import time
from pathlib import Path

import pytest

from cohort_grpo.rewards.rules import accuracy_reward, canonical_answer, extract_answer
from cohort_grpo.tasks.gsm8k import GSM8KTask, gold_number

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def box(answer):
    return f"<think>\nworking\n</think>\nSo the final answer is $\\boxed{{{answer}}}$."


def tag(answer):
    return f"<think>\nworking\n</think>\n<answer>\n{answer}\n</answer>"


# (completion, gold, careful verdict)
TABLE = [
    # ------------------------------------------------------------------ fractions
    (box(r"\frac{3}{4}"), "0.75", 1),
    (box(r"\dfrac{3}{4}"), r"\frac{3}{4}", 1),
    (box(r"\tfrac{3}{4}"), "0.75", 1),
    (box(r"\frac34"), "3/4", 1),
    (box(r"\frac{6}{8}"), r"\frac{3}{4}", 1),
    (tag("3/4"), "0.75", 1),
    (tag("1 1/2"), "1.5", 1),
    (box(r"-\frac{1}{2}"), "-0.5", 1),
    (box(r"\frac{1}{2}"), "-0.5", 0),
    (box(r"\frac{1}{2}"), r"\frac{1}{3}", 0),
    (box(r"\frac{3}{4}"), "3", 0),  # a prefix of the answer is not the answer
    (box(r"\frac{3}{4}"), "4", 0),
    (tag("0.75"), r"\frac{3}{4}", 1),
    (box("0.333333"), r"\frac{1}{3}", 1),  # six significant digits stand for 1/3
    (box("0.33"), r"\frac{1}{3}", 0),  # two do not
    # ------------------------------------------------------------------ radicals and constants
    (box(r"\sqrt{8}"), r"2\sqrt{2}", 1),
    (box(r"2\sqrt{2}"), r"\sqrt{8}", 1),
    (box(r"2\sqrt{2}"), "2", 0),  # a bare parse reads "2"
    (box(r"\sqrt{2}"), "2", 0),
    (box(r"\sqrt2"), r"\sqrt{2}", 1),
    (box(r"\frac{\sqrt{3}}{2}"), r"\frac{\sqrt3}{2}", 1),
    (box(r"\sqrt{3}/2"), r"\frac{\sqrt{3}}{2}", 1),
    (box(r"\frac{\sqrt{3}}{2}"), "3", 0),
    (box(r"\sqrt[3]{8}"), "2", 1),
    (box("1.414214"), r"\sqrt{2}", 1),
    (box("1.41"), r"\sqrt{2}", 0),
    (box(r"2\pi"), r"2\pi", 1),
    (box(r"\pi"), "3.14", 0),
    (box(r"\infty"), r"\infty", 1),
    (box(r"-\infty"), r"\infty", 0),
    (box(r"\mathbf{7}"), "7", 1),
    (box(r"\textbf{7}"), "7", 1),
    # ------------------------------------------------------------------ expressions and equations
    (box("x^2+1"), "1+x^2", 1),
    (box("x^2+1"), "x^2-1", 0),
    (box(r"3 \times 4"), "12", 1),
    (box(r"3\cdot 4"), "12", 1),
    (box(r"3\cdot 4"), "4", 0),  # a bare parse reads "4"
    (box(r"3 \times 4"), "3", 0),
    (box("x = 5"), "5", 1),
    (box("x = 2 + 3 = 5"), "5", 1),
    (box("y = 2x + 3"), "y = 3 + 2x", 1),
    (box("x > 5"), "5", 0),
    (box("2x"), "2", 0),
    (box("2^{10}"), "1024", 1),
    (box("2^10"), "1024", 1),  # what the writer meant
    (box(r"2 \text{ or } 3"), "3", 0),  # a hedge is not an answer
    (box("5, 6"), "6", 0),
    (box(r"\pm 2"), "2", 0),
    (box("2 3"), "5", 0),  # math-verify reads "2 3" as 5
    (box("2 3"), "6", 0),
    (box(r"9 \cdot 2 = 18"), "18", 1),
    (box("18 = 19"), "19", 0),  # a false equation is no answer
    (box("x = 2 + 3 = 6"), "6", 0),
    (box("18!"), "18", 0),  # "!" is a factorial, not punctuation
    (box(r"\log_2 8"), "3", 1),
    (box(r"\{18\}"), "18", 1),
    (box("[17, 19]"), "18", 0),
    (box(r"\{17, 18, 19\}"), "18", 0),
    (box(r"18 \pm 1"), "18", 0),
    (box(r"\text{even}"), r"\text{even}", 1),
    (box(r"\text{odd}"), r"\text{even}", 0),
    # ------------------------------------------------------------------ units
    (tag("18 dollars"), "18", 1),
    (box(r"18 \text{ dollars}"), "18", 1),
    (box(r"5\text{ cm}"), "5", 1),
    (box(r"5\,\mathrm{cm}^2"), "5", 1),
    (box(r"5\text{ m}"), "5", 1),
    (box(r"12 \text{ apples}"), "12", 1),
    (box(r"\frac{1}{2} \text{ of the pie}"), "0.5", 1),
    (tag("3 hours"), "3", 1),
    (tag("1 1/2 hours"), "1.5", 1),
    (box(r"90^\circ"), "90", 1),
    (box(r"90^{\circ}"), "90", 1),
    (box(r"18 \text{ thousand}"), "18", 0),  # a word that changes the value
    (tag("18 thousand"), "18", 0),
    (tag("5 squared"), "5", 0),
    (box(r"18\text{ x}"), "18", 0),
    (box("5m"), "5", 0),  # 5·m, or 5 metres? ambiguous: not paid (see KNOWN_MISSES for "5 m")
    (tag("12 apples"), "12", 1),
    # ------------------------------------------------------------------ percentages
    (tag("50%"), "50", 1),
    (tag("50%"), "0.5", 1),
    (box(r"50\%"), "50", 1),
    (tag("50 percent"), "50", 1),
    (tag("12.5%"), "12.5", 1),
    (tag("50%"), "5", 0),
    (tag("50%"), r"50\%", 1),
    (tag("0.5"), "50%", 1),
    (tag("40%"), "50", 0),
    (box(r"150\%"), "1.5", 1),
    (box(r"100\%"), "1", 1),
    (box(r"1800\%"), "18", 0),  # a percentage is not a count
    # ------------------------------------------------------------------ money
    (tag("$18"), "18", 1),
    (box(r"\$18"), "18", 1),
    (tag("$18.00"), "18", 1),
    (tag("-$5"), "-5", 1),
    (tag("$-5"), "-5", 1),
    (box(r"\$1{,}000"), "1000", 1),
    (tag("$18.50"), "18", 0),
    (tag("$18"), "1", 0),
    (tag("18.5"), "18", 0),
    # ------------------------------------------------------------------ thousands separators
    (tag("1,000"), "1000", 1),
    (tag("1000"), "1,000", 1),
    (box("1{,}000"), "1000", 1),
    (box("1{,}000"), "1", 0),  # a bare parse reads "1"
    (box(r"1\,000"), "1000", 1),
    (box("1 000"), "1000", 1),
    (box("1 000"), "0", 0),
    (tag("1,000,000"), "1000000", 1),
    ("The total is 1 000 apples.", "1000", 1),
    ("The total is 1 000 apples.", "0", 0),
    (tag("1,001"), "1000", 0),
    (tag("1,000"), "1", 0),
    # ------------------------------------------------------------------ intervals, tuples, sets
    (box(r"\left(1,2\right)"), "(1,2)", 1),
    (box("(1, 2)"), "(1,2)", 1),
    (box("(2, 1)"), "(1,2)", 0),
    (box("[0, 1)"), "[0,1)", 1),
    (box("(0, 1]"), "[0,1)", 0),
    (box(r"(-\infty, 3]"), r"(-\infty,3]", 1),
    (box(r"(-\infty, 3)"), r"(-\infty,3]", 0),
    (box(r"\{1, 2\}"), r"\{2, 1\}", 1),
    (box(r"\{1, 2\}"), r"\{1, 3\}", 0),
    (box(r"\begin{pmatrix}1 \\ 2\end{pmatrix}"), r"\begin{pmatrix}1\\2\end{pmatrix}", 1),
    (box(r"\begin{pmatrix}2 \\ 1\end{pmatrix}"), r"\begin{pmatrix}1\\2\end{pmatrix}", 0),
    # ------------------------------------------------------------------ several boxes
    (r"First \boxed{5}. Wait, that is wrong: \boxed{6}.", "6", 1),  # the last box is the answer
    (r"First \boxed{5}. Wait, that is wrong: \boxed{6}.", "5", 0),
    (r"\boxed{\boxed{7}}", "7", 1),
    (r"The answer is \boxed{}.", "0", 0),
    # ------------------------------------------------------------------ truncations
    (r"So the answer is \boxed{12", "12", 0),
    (r"So the answer is \boxed{\frac{1}{2}", "0.5", 0),
    (r"I had \boxed{5} but now \boxed{1", "5", 0),  # cut off while replacing its answer
    ("<think>\nworking\n</think>\n<answer>\n12", "12", 0),
    ("<think>\n9 + 3 = 12, so the answer is 12", "12", 0),  # cut off while still thinking
    ("<think>\nworking\n</think>\nThe answer is 12.", "12", 1),
    # ------------------------------------------------------------------ negatives
    (tag("-7"), "-7", 1),
    (tag("\u22127"), "-7", 1),  # a Unicode minus
    (tag("-7"), "7", 0),
    (tag("7"), "-7", 0),
    (box("-3.5"), r"-\frac{7}{2}", 1),
    ("It falls by x-3 and ends at 4", "-3", 0),
    # ------------------------------------------------------------------ scientific notation
    (tag("1e-5"), "0.00001", 1),
    (tag("1e-5"), "1", 0),  # a bare parse reads "1"
    (tag("1e-5"), "-5", 0),
    (tag("1.2E3"), "1200", 1),
    (box(r"3.5 \times 10^{-5}"), "0.000035", 1),
    (box(r"3.5 \times 10^{-5}"), "3.5", 0),
    (box("10^-5"), "0.00001", 1),
    (box("0.0000001"), "0.0000003", 0),  # math-verify rounds both to 0
    (tag("1e-7"), "3e-7", 0),
    # ------------------------------------------------------------------ inline maths
    (r"The answer is $\frac{1}{2}$.", "0.5", 1),
    (r"The answer is $\frac{1}{2}$.", "2", 0),  # the last bare number would be 2
    (r"So \(x = 3\).", "3", 1),
    (r"Therefore \[\frac{7}{2}\]", "3.5", 1),
    (r"Therefore $$\sqrt{2}$$", r"\sqrt{2}", 1),
    ("We have $x=3$, so the total is 12.", "12", 1),  # the later of maths and number
    ("We have $x=3$, so the total is 12.", "3", 0),
    ("It costs $18 and then $5 more.", "5", 1),  # money is not maths
    ("He paid $20$ dollars.", "20", 1),
    (r"The answer is $2\sqrt{2}$.", "2", 0),
    ("The answer is $2$ or $3$.", "3", 0),  # a hedge between the last two values
    ("It is 2, or 3.", "3", 0),
    ("We tried 2 or 3 ways and got 5.", "5", 1),
    # ------------------------------------------------------------------ <answer> tags
    (tag("18"), "18", 1),
    (tag("The answer is 18."), "18", 1),
    (tag("Janet makes $18 every day."), "18", 1),
    (tag(r"$\frac{1}{2}$"), "0.5", 1),
    (tag(r"\boxed{5}"), "5", 1),
    (tag("2^{10}"), "2", 0),  # a bare parse reads "2"
    (tag("2^{10}"), "1024", 1),
    (tag("5 or 6"), "6", 0),
    (tag("not 18"), "18", 0),
    (tag("at least 18"), "18", 0),
    (tag("18 is wrong"), "18", 0),
    (tag("18 isn't right"), "18", 0),
    (tag("18 apples and 3 pears"), "3", 0),
    (tag("18 apples and 3 pears"), "18", 0),
    (tag(""), "18", 0),
    (tag("eighteen"), "18", 0),
    ("<answer>1</answer> no, <answer>3</answer>", "3", 1),
    ("<answer>1</answer> no, <answer>3</answer>", "1", 0),
    (tag("9 * 2 = 18"), "18", 1),
    # ------------------------------------------------------------------ GSM8K layout and plain text
    ("She makes 9 * 2 = $18.\n#### 18", "18", 1),
    ("She makes 9 * 2 = $18.\n#### 18", "2", 0),
    ("#### 1,000", "1000", 1),
    ("#### 72\nI checked it 3 times.", "72", 1),
    ("so she has 18 left", "18", 1),
    ("9 * 2 = 18, minus 1 is 17", "18", 0),
    ("I do not know", "18", 0),
    ("18", "18", 1),
    (r"2\sqrt{2}", r"\sqrt{8}", 1),  # a bare maths answer, read whole
    (r"2\sqrt{2}", "2", 0),
    ("5, 6", "6", 0),
    # ------------------------------------------------------------------ gold answers in other forms
    (box("5"), r"\boxed{5}", 1),
    (box(r"\frac{1}{2}"), r"$\frac{1}{2}$", 1),
    (box(r"\frac{1}{2}"), r"So $x = \frac{1}{2}$, and the answer is $\boxed{\frac12}$.", 1),
    (box("72"), "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 1),
    (box("72"), "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 71", 0),
]

# Right answers the reward does not pay, on purpose: reading them would pay wrong answers elsewhere.
KNOWN_MISSES = [
    (tag("5 m"), "5", "a one-letter word after a number may be a variable (5m = 5·m)"),
    (tag("approximately 18"), "18", "hedging words make the answer read as none"),
    (tag("x = 5 or x = -5"), r"\pm 5", "'or' reads as a hedge"),
]


@pytest.mark.parametrize("completion, gold, verdict", TABLE)
def test_grading_agrees_with_a_careful_grader(completion, gold, verdict):
    assert accuracy_reward(None, [completion], solution=[gold]) == [float(verdict)]
    chat = [{"role": "assistant", "content": completion}]
    assert accuracy_reward(completions=[chat], solution=[gold]) == [float(verdict)]


@pytest.mark.parametrize("completion, gold, why", KNOWN_MISSES)
def test_known_misses_stay_unpaid(completion, gold, why):
    assert accuracy_reward(None, [completion], solution=[gold]) == [0.0], why


def test_table_agreement_and_no_false_positive():
    """The whole table in one batch: every verdict agrees, so no wrong answer is paid."""
    completions, golds, verdicts = zip(*TABLE)
    rewards = accuracy_reward(None, list(completions), solution=list(golds))
    false_positives = [row for row, r in zip(TABLE, rewards) if r == 1.0 and row[2] == 0]
    disagreements = [(row, r) for row, r in zip(TABLE, rewards) if r != float(row[2])]
    assert false_positives == []
    assert disagreements == []
    assert len(TABLE) >= 150 and sum(v == 0 for v in verdicts) >= 70  # many traps, not only easy wins


def test_wrong_values_in_many_forms_are_never_paid():
    """Every pair of different numbers, each written in many forms and places, scores 0; equal ones 1."""
    values = [0, 1, 2, 3, 7, 12, 18, 100, 1000, 1234, 1000000, -5]

    def forms(n):
        s = f"{n:,}"
        return [str(n), s, s.replace(",", "{,}"), f"${s}", f"\\${n}", f"{n} apples", f"{n}\\text{{ cm}}",
                f"\\mathbf{{{n}}}", f"{n}.00", f"x = {n}", f"\\frac{{{2 * n}}}{{2}}", f"\\left({n}\\right)"]

    def places(answer):
        return [tag(answer), box(answer), f"The answer is ${answer}$.", f"#### {answer}"]

    wrong_paid, right_unpaid = [], []
    for a in values:
        completions = [c for form in forms(a) for c in places(form)]
        for b in values:
            for gold in (str(b), f"{b:,}", f"\\boxed{{{b}}}", f"${b}$"):
                rewards = accuracy_reward(None, completions, solution=[gold] * len(completions))
                if a != b:
                    wrong_paid += [(c, gold) for c, r in zip(completions, rewards) if r != 0.0]
                else:
                    right_unpaid += [(c, gold) for c, r in zip(completions, rewards) if r != 1.0]
    assert wrong_paid == []
    assert right_unpaid == []


@pytest.mark.parametrize("solution", ["no number at all", "", "   ", "<think>unfinished"])
def test_unreadable_gold_is_not_scored(solution):
    assert accuracy_reward(None, [box("5")], solution=[solution]) == [None]


@pytest.mark.parametrize("answer", [r"9^{9^{9^{9}}}", r"10^{10^{10}}", "100000!"])
def test_huge_numbers_read_as_no_value_without_hanging(answer):
    """A power tower cannot be compared in any time a step allows; outside the runner's per-sample time
    limit (evaluation calls the reward in-process) it must not hang, and it is no answer a grader accepts."""
    start = time.perf_counter()
    assert accuracy_reward(None, [box(answer)], solution=["5"]) == [0.0]
    assert time.perf_counter() - start < 10.0


# ------------------------------------------------------------------------------ extract / canonical

@pytest.mark.parametrize("text, expected", [
    (box(r"\frac{3}{4}"), r"\frac{3}{4}"),
    (r"\boxed{5} then \boxed{6}", "6"),
    (r"\boxed{5} then \boxed{6", None),
    ("<answer>7</answer> and \\boxed{9}", "7"),  # the answer block comes first
    ("<answer>\\boxed{8}</answer>", "8"),
    ("<think>a \\boxed{1}</think> so 2", "2"),  # only what follows the reasoning counts
    ("<think>unfinished 3", None),
    ("<answer>4", None),
    ("worked it out\n#### 1,234", "1,234"),
    (r"The answer is $\frac{1}{2}$.", r"\frac{1}{2}"),
    ("It costs $18 and then $5 more.", "5"),
    (r"x \(= 4\) and later 6", "6"),
    ("the answer is 50% of it", "50%"),
    ("no digits", None),
])
def test_extract_answer_order(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("forms, normal", [
    ([r"\dfrac{3}{4}", "0.75", "3/4", r"\frac{6}{8}"], "0.75"),
    ([r"1{,}000", "1,000", r"\$1000", "1 000", "1000 dollars"], "1000"),
    ([r"x = 5", "5", r"\mathbf{5}", r"5\text{ cm}"], "5"),
    (["1e-5", "0.00001", r"10^{-5}"], "1e-05"),
])
def test_canonical_answer_normal_forms(forms, normal):
    assert [canonical_answer(f"<answer>{form}</answer>") for form in forms] == [normal] * len(forms)


@pytest.mark.parametrize("text", [r"<answer>2 \text{ or } 3</answer>", r"\boxed{12", "<answer>not 5</answer>"])
def test_canonical_answer_is_none_without_one_value(text):
    assert canonical_answer(text) is None


# ------------------------------------------------------------------------------------ GSM8K data

def _gsm8k_rows(split):
    path = SHARED_GSM8K / f"{split}.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is not present (the shared GSM8K data lives next to the checkout)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("split", ["train", "test"])
def test_gsm8k_reference_solutions_are_graded_right(split):
    """Every reference solution, as written (worked steps, calculator notes, `#### N`) and in the task's
    <think>/<answer> layout, is right against its gold number; the same with the number off by one is wrong."""
    rows = _gsm8k_rows(split)
    task = GSM8KTask()
    golds = [gold_number(r["answer"]) for r in rows]
    as_written = [r["answer"] for r in rows]
    laid_out = [task.solved_completion({"answer": r["answer"], "solution": g}) for r, g in zip(rows, golds)]
    assert accuracy_reward(None, as_written, solution=golds) == [1.0] * len(rows)
    assert accuracy_reward(None, laid_out, solution=golds) == [1.0] * len(rows)
    # the gold as the dataset writes it ("1,200"), not only with its commas removed
    assert accuracy_reward(None, laid_out, solution=[r["answer"] for r in rows]) == [1.0] * len(rows)
    off_by_one = [f"<answer>{int(g) + 1}</answer>" if g.lstrip("-").isdigit() else f"<answer>{g}1</answer>"
                  for g in golds]
    assert accuracy_reward(None, off_by_one, solution=golds) == [0.0] * len(rows)


# ---------------------------------------------------------------------------------------- speed

def test_accuracy_reward_is_fast_enough_for_training():
    """1,000 varied completions (plain numbers, LaTeX boxes and surds, inline maths, intervals), every
    one a different text, so no cache helps: a few seconds on a 2-core CPU (the bound leaves room for a
    loaded machine); plain numbers alone take milliseconds."""
    forms = [lambda n: tag(n), lambda n: tag(f"${n}.00"), lambda n: box(rf"\frac{{{n}}}{{7}}"),
             lambda n: box(rf"{n}\sqrt{{2}}"), lambda n: rf"The answer is $\frac{{{n}}}{{3}}$.",
             lambda n: f"so she has {n} left", lambda n: box(rf"{n} \times 4"), lambda n: tag(f"{n} dollars"),
             lambda n: box(rf"\left({n}, 2\right)"), lambda n: f"#### {n}"]
    completions = [forms[i % len(forms)](i) for i in range(1000)]
    golds = [str(i) for i in range(1000)]
    start = time.perf_counter()
    rewards = accuracy_reward(None, completions, solution=golds)
    elapsed = time.perf_counter() - start
    assert len(rewards) == 1000 and all(r in (0.0, 1.0) for r in rewards)
    assert elapsed < 30.0, f"accuracy_reward took {elapsed:.1f}s for 1,000 completions"
