"""The verifier's documented bounds, each pinned just inside and just outside its limit, and the
hostile answers refused by the bound that the docstring names, before anything big is computed,
in milliseconds. reward == 0 alone cannot tell a refusal from a swallowed crash, so these tests
evaluate the parsed answer themselves and look at the check that raised the refusal."""

import linecache
import time

import mpmath
import pytest

import verifier
from verifier import is_equivalent

# ----------------------------------------------------------------------------------------------
# helpers


def _refusal(answer):
    """Evaluate `answer` as the verifier does; it must be refused (verifier._Refuse, no other
    exception). Returns (the source line of the check that refused it, its function, seconds)."""
    tree = verifier._analyze(answer)
    assert tree[0] == "expr", tree
    t0 = time.perf_counter()
    with pytest.raises(verifier._Refuse) as info:
        verifier._value(tree[1], {})
    seconds = time.perf_counter() - t0
    tb = info.tb
    while tb.tb_next is not None:
        tb = tb.tb_next
    line = tb.tb_lineno
    raised = linecache.getline(verifier.__file__, line).strip()
    check = linecache.getline(verifier.__file__, line - 1).strip() if raised == "raise _Refuse" else raised
    return check, tb.tb_frame.f_code.co_name, seconds


def _fastest(fn, answer, repeats=3):
    """The best of a few runs: a loaded machine must not make a millisecond refusal look slow."""
    results = [fn(answer) for _ in range(repeats)]
    return results[0][:2], min(r[2] for r in results)


def _decimal(x, digits=45):
    return mpmath.nstr(x, digits, strip_zeros=False)


# ----------------------------------------------------------------------------------------------
# relative tolerance of irrational values: 1e-30


@pytest.mark.parametrize("gold, value", [("\\sqrt{2}", lambda: mpmath.sqrt(2)),
                                         ("\\pi", lambda: mpmath.pi),
                                         ("1+\\sqrt{3}", lambda: 1 + mpmath.sqrt(3))])
def test_irrational_tolerance_is_1e_30_relative(gold, value):
    with mpmath.workdps(80):
        exact = value()
        inside = _decimal(exact * (1 + mpmath.mpf("0.5e-30")))   # relative error 5e-31
        outside = _decimal(exact * (1 + mpmath.mpf("2e-30")))    # relative error 2e-30
        below = _decimal(exact * (1 - mpmath.mpf("2e-30")))
        double = _decimal(exact, 17)                              # all a float64 holds: ~1e-17
    assert is_equivalent(inside, gold), inside
    assert not is_equivalent(outside, gold), outside
    assert not is_equivalent(below, gold), below
    assert not is_equivalent(double, gold), double
    for answer in (inside, outside, double):
        assert verifier._analyze_cached(answer) is not None  # compared as numbers, not as strings


# ----------------------------------------------------------------------------------------------
# factorials up to 1000!


def test_factorial_cap_is_1000(monkeypatch):
    assert is_equivalent("1000!", "1000\\cdot 999!")
    assert not is_equivalent("1001!", "1001\\cdot 1000!")
    assert verifier._analyze_cached("1001\\cdot 1000!") is not None  # the reference parses: the answer is refused
    computed = []
    real = verifier.math.factorial
    monkeypatch.setattr(verifier.math, "factorial", lambda n: computed.append(n) or real(n))
    (check, where), _ = _fastest(_refusal, "1001!", repeats=1)
    assert "MAX_FACTORIAL" in check and where == "_value" and computed == []


@pytest.mark.parametrize("answer", ["100000!", "(10^{10})!", "((20)!)!"])
def test_huge_factorials_are_refused_by_the_cap_in_milliseconds(answer, monkeypatch):
    computed = []
    real = verifier.math.factorial
    monkeypatch.setattr(verifier.math, "factorial", lambda n: computed.append(n) or real(n))
    (check, where), seconds = _fastest(_refusal, answer)
    assert "MAX_FACTORIAL" in check and where == "_value", check
    assert all(n <= 1000 for n in computed)  # never a factorial beyond the cap
    assert seconds < 0.05, f"{answer}: {seconds:.3f}s"


# ----------------------------------------------------------------------------------------------
# integer powers: exponents up to 100000, results up to 12000 bits, refused before computing

BASE = 2 ** 100 - 1  # a 100-bit base: bit_length * exponent is the result's size to within a bit


def test_exponent_bit_size_pre_check_refuses_before_computing(monkeypatch):
    assert is_equivalent(f"{BASE}^{{120}}", f"({BASE}^{{60}})^{{2}}")  # 12000 bits: inside
    assert verifier._analyze_cached(f"{BASE}^{{120}}") is not None
    assert not is_equivalent(f"{BASE}^{{121}}", f"{BASE}\\cdot({BASE}^{{60}})^{{2}}")  # 12100 bits: refused
    checked = []
    real = verifier._chk
    monkeypatch.setattr(verifier, "_chk", lambda x: checked.append(x) or real(x))
    (check, where), _ = _fastest(_refusal, f"{BASE}^{{121}}", repeats=1)
    assert "MAX_BITS" in check and "*" in check and where == "_int_pow", check  # the pre-check, not _chk
    assert all(not hasattr(x, "numerator") or x.numerator.bit_length() <= 12000 for x in checked)


@pytest.mark.parametrize("answer, bound", [
    ("(\\frac{3}{2})^{100000}", "MAX_BITS"),
    ("(10^{300})^{5000}", "MAX_BITS"),        # 5 million bits: about half a second to compute
    ("2^{100001}", "MAX_EXPONENT"),
    ("9^{9^{9^{9}}}", "MAX_EXPONENT"),
    ("10^{10^{10}}", "MAX_EXPONENT"),
])
def test_huge_powers_are_refused_before_computing_in_milliseconds(answer, bound, monkeypatch):
    checked = []
    real = verifier._chk
    monkeypatch.setattr(verifier, "_chk", lambda x: checked.append(x) or real(x))
    (check, where), seconds = _fastest(_refusal, answer)
    assert bound in check and where == "_int_pow", check
    assert all(not hasattr(x, "numerator") or x.numerator.bit_length() <= 12000 for x in checked)
    assert seconds < 0.05, f"{answer}: {seconds:.3f}s"


# ----------------------------------------------------------------------------------------------
# ratios: up to 64 terms, a ratio label's names too


def test_ratio_terms_cap_is_64():
    inside, outside = ":".join(["1"] * 64), ":".join(["1"] * 65)
    assert verifier._analyze(inside) == ("ratio", (("expr", ("n", 1)),) * 64)
    assert is_equivalent(inside, inside)
    with pytest.raises(verifier._Refuse):
        verifier._analyze(outside)
    assert not is_equivalent(outside, inside) and not is_equivalent(inside, outside)
    names64 = ":".join(f"A_{{{i}}}" for i in range(64))
    names65 = ":".join(f"A_{{{i}}}" for i in range(65))
    assert is_equivalent(names64 + " = 7", "7")
    assert verifier._analyze(names64 + " = 7")[1] == ("ratio", tuple(f"A_{i}" for i in range(64)))
    with pytest.raises(verifier._Refuse):
        verifier._analyze(names65 + " = 7")
    assert not is_equivalent(names65 + " = 7", "7")
