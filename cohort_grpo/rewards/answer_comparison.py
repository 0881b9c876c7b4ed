"""Comparing two answer values (`same_value`): two numbers exactly (a decimal written to 6 or more
significant digits may stand for a fraction or a surd, a number written with % for n/100), an equation
by its right-hand side when the other value is none, everything else by `math_verify.verify` with its
own time limit off (`cohort_grpo.rewards.sample_workers` limits each sample's time instead, see
`answer_reading`). Nothing here imports torch.
"""

from __future__ import annotations

from fractions import Fraction

from cohort_grpo.rewards.answer_reading import AnswerValue


def _relations(expr) -> list:
    """The relations of `expr` in written order: [expr] for one, the chain for `a = b = c`, else []."""
    import sympy

    if isinstance(expr, sympy.core.relational.Relational):
        return [expr]
    if isinstance(expr, sympy.And):
        parts = list(getattr(expr, "_unsorted_args", expr.args))
        if parts and all(isinstance(p, sympy.core.relational.Relational) for p in parts):
            return parts
    return []


def as_answer(expr, other):
    """`x = 5` (or `x = 2 + 3 = 5`) answers with its last right-hand side when `other` is no equation,
    math-verify's rule, applied before we compare numbers ourselves. A link between two numbers must
    hold: `9 * 2 = 18` answers 18, `18 = 19` answers nothing (None)."""
    import sympy

    chain = _relations(expr)
    if chain and all(isinstance(r, sympy.Eq) for r in chain) and not _relations(other):
        for relation in chain:
            lhs, rhs = as_number(relation.lhs), as_number(relation.rhs)
            if lhs is not None and rhs is not None and not _numbers_equal(lhs, rhs):
                return None
        return chain[-1].rhs
    return expr


def as_number(expr):
    """A sympy number (finite or ±∞) from `expr`, or None when it is not one."""
    import sympy

    if isinstance(expr, Fraction):
        return sympy.Rational(expr.numerator, expr.denominator)
    if isinstance(expr, sympy.Expr) and not isinstance(expr, sympy.MatrixBase) and expr.is_number:
        if expr.has(sympy.zoo, sympy.nan):
            return None
        return expr
    return None


def _numbers_equal(a, b) -> bool:
    import sympy

    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    a, b = as_number(a), as_number(b)
    if a is None or b is None:
        return False
    if a.is_infinite or b.is_infinite:
        return a == b
    if a.is_Rational and b.is_Rational:
        return a == b
    tolerance = 1e-12 if (a.has(sympy.Float) or b.has(sympy.Float)) else 1e-25
    try:
        difference = abs((a - b).evalf(40))
        scale = max(abs(a.evalf(40)), abs(b.evalf(40)))
        return bool(difference == 0 or difference <= tolerance * scale)
    except (TypeError, ValueError, ArithmeticError):
        return False


def _terminates(x) -> bool:
    """Whether `x` is a terminating decimal (so a decimal answer must equal it exactly)."""
    import sympy

    if isinstance(x, Fraction):
        x = sympy.Rational(x.numerator, x.denominator)
    if isinstance(x, sympy.Float) or x.is_infinite:
        return True
    if not x.is_Rational:
        return False
    q = int(x.q)
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


def _approximates(decimal: AnswerValue, exact) -> bool:
    """A decimal written to ≥ 6 significant digits stands for a non-terminating exact value (1/3,
    √2, π) that it matches to its last written digit: 0.333333 for 1/3, 1.414214 for √2; 0.33 does not."""
    if decimal.decimals is None or decimal.significant < 6 or decimal.percent:
        return False
    exact = as_number(exact)
    if exact is None or _terminates(exact):
        return False
    try:
        return bool(abs((exact - as_number(decimal.number)).evalf(40)) < Fraction(1, 10 ** max(decimal.decimals, 0)))
    except (TypeError, ValueError, ArithmeticError):
        return False


def _is_proportion(x) -> bool:
    """A value that "n%" may stand for as n/100: a fraction, or a whole number no larger than 1 in size."""
    x = as_number(x)
    return x is not None and x.is_finite and (not x.is_integer or abs(x) <= 1)


def _numeric_match(gold: AnswerValue, gold_number, pred: AnswerValue, pred_number) -> bool:
    """Two numbers. One written with % may be read as n, or as n/100 where the other is a proportion:
    "50%" answers 50 and 0.5, "150%" answers 1.5; "1800%" does not answer 18."""
    golds = [gold_number] + ([gold_number / 100] if gold.percent and not pred.percent
                             and _is_proportion(pred_number) else [])
    preds = [pred_number] + ([pred_number / 100] if pred.percent and not gold.percent
                             and _is_proportion(gold_number) else [])
    if any(_numbers_equal(g, p) for g in golds for p in preds):
        return True
    return _approximates(pred, gold_number) or _approximates(gold, pred_number)


def same_value(gold: AnswerValue, pred: AnswerValue) -> bool:
    if gold.number is not None and pred.number is not None:  # the fast path: two plain numbers, exact
        return _numeric_match(gold, gold.number, pred, pred.number)
    from math_verify import verify

    g = gold.number if gold.number is not None else gold.expr
    p = pred.number if pred.number is not None else pred.expr
    if gold.expr is not None:
        g = as_answer(gold.expr, p)
    if pred.expr is not None:
        p = as_answer(pred.expr, g)
    if g is None or p is None:  # an equation between two different numbers
        return False
    g_number = g if isinstance(g, Fraction) else as_number(g)
    p_number = p if isinstance(p, Fraction) else as_number(p)
    if g_number is not None and p_number is not None:
        return _numeric_match(gold, g_number, pred, p_number)
    g, p = (as_number(x) if isinstance(x, Fraction) else x for x in (g, p))
    return bool(verify([g], [p], timeout_seconds=None))
