"""Tests of verifier.py: extraction, the equivalence policy category by category (equal AND
not-equal pairs), the real reference answers, the Math-Verify peer cases, hostile inputs and the
time-limited worker."""

import json
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import verifier  # noqa: E402
from verifier import (  # noqa: E402
    TimedVerifier,
    extract_final_answer,
    is_equivalent,
    reward,
    score,
)

DATA = ROOT.parent / "shared" / "data"
NO_DATA = "../shared/data not present (fresh clone): real-answer checks skipped"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=NO_DATA)


def _ids(pairs):
    return [f"{p!r}~{g!r}"[:80] for p, g in pairs]


def check_pairs(equal, not_equal):
    for pred, gold in equal:
        if pred == gold:  # true by the string fallback alone unless the answer parses
            assert verifier._analyze_cached(gold) is not None, f"identical pair not parsed: {gold!r}"
        assert is_equivalent(pred, gold), f"expected EQUAL: pred={pred!r} gold={gold!r}"
        assert reward(f"Reasoning... so the answer is $\\boxed{{{pred}}}$.", gold) == 1.0, pred
    for pred, gold in not_equal:
        assert not is_equivalent(pred, gold), f"expected NOT equal: pred={pred!r} gold={gold!r}"
        assert reward(f"Thus \\boxed{{{pred}}}", gold) == 0.0, pred


# ---------------------------------------------------------------------------------------------
# extraction
EXTRACT_CASES = [
    ("The answer is \\boxed{5}.", "5"),
    ("first \\boxed{3}, then corrected: \\boxed{5}", "5"),
    ("so \\boxed 5", "5"),
    ("so \\boxed 5.", "5"),
    ("so $\\boxed 42$ done", "42"),
    ("\\fbox{5}", "5"),
    ("\\boxed{\\boxed{5}}", "5"),
    ("\\boxed{\\fbox{7}}", "7"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\}}", "\\}"),
    ("$\\boxed{5}$", "5"),
    ("\\boxed{$5$}", "5"),
    ("\\boxed{$$5$$}", "5"),
    ("\\boxed{\\[ 5 \\]}", "5"),
    ("\\boxed{\\( x+1 \\)}", "x+1"),
    ("\\boxed{5.}", "5"),
    ("\\boxed{ 12 }", "12"),
    ("\\[\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}\\]",
     "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("\\boxed{a}\n\\boxed{\\text{b}}", "\\text{b}"),
    ("x" * 100_000 + "\\boxed{9}", "9"),
]
EXTRACT_NONE = [
    "\\boxed{}",
    "\\boxed{   }",
    "\\boxed{$ $}",
    "\\boxed{5",
    "\\boxed{1} and later \\boxed{2",
    "no box here, the answer is 5",
    "",
    "\\boxed{\\}",
    "\\boxed",
    "\\boxed{5\x00}",
]


@pytest.mark.parametrize("text,expected", EXTRACT_CASES, ids=[e for _, e in EXTRACT_CASES])
def test_extraction(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize("text", EXTRACT_NONE)
def test_extraction_none(text):
    assert extract_final_answer(text) is None
    assert score(text, "5") == (0.0, None, "no_answer")


@pytest.mark.parametrize("bad", [None, b"\\boxed{1}", 1, 1.5, ["\\boxed{1}"], object()])
def test_extraction_non_str(bad):
    assert extract_final_answer(bad) is None
    assert reward(bad, "1") == 0.0
    assert reward("\\boxed{1}", bad) == 0.0
    assert is_equivalent(bad, "1") is False
    assert is_equivalent("1", bad) is False


def test_score_statuses():
    assert score("so \\boxed{42}", "42") == (1.0, "42", "correct")
    assert score("so \\boxed{41}", "42") == (0.0, "41", "wrong")
    assert score("so 42", "42") == (0.0, None, "no_answer")
    assert reward("so \\boxed{42}", "42") == 1.0
    assert isinstance(reward("so \\boxed{42}", "42"), float)


# ---------------------------------------------------------------------------------------------
# categories: (equal pairs, not-equal pairs) as (pred, gold)
CATEGORIES = {
    "integers": (
        [("42", "42"), ("+42", "42"), ("042", "42"), ("-0", "0"), ("42.0", "42"),
         ("\\text{42}", "42"), ("{42}", "42"), ("\\mathbf{42}", "42"),
         ("123456789012345678", "123456789012345678")],
        [("42", "43"), ("-42", "42"), ("4 2", "42"), ("2c", "2"), ("42.5", "42"),
         ("123456789012345679", "123456789012345678"), ("4", "-4")],
    ),
    "fractions": (
        [("\\frac12", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"), ("\\dfrac{1}{2}", "\\frac12"),
         ("\\tfrac{1}{2}", "0.5"), ("\\frac{-1}{2}", "-\\frac12"), ("-1/2", "\\frac{-1}{2}"),
         ("\\frac{2}{4}", "\\frac12"), ("\\frac9{19}", "\\frac{9}{19}"),
         ("\\frac{270}7", "\\frac{270}{7}"), ("\\frac 34", "0.75"), ("\\frac3{3}", "1"),
         ("\\left( \\frac{1}{3} \\right)", "1/3"), ("\\frac{1}{2}", "\\frac{1}{2}")],
        [("\\frac12", "\\frac13"), ("\\frac{1}{2}", "2"), ("\\frac{19}{9}", "\\frac9{19}"),
         ("\\frac{1}{2}", "-\\frac12"), ("28/100", "28"), ("\\frac{34}{3}", "\\frac 34")],
    ),
    "mixed_numbers": (
        [("\\frac{121}{12}", "10\\frac{1}{12}"), ("10 \\frac{1}{12}", "10\\frac{1}{12}"),
         ("10\\frac1{12}", "\\frac{121}{12}"), ("-2\\frac12", "-2.5"), ("137.5", "137 \\frac{1}{2}"),
         ("1.8", "1\\frac{4}{5}")],
        [("10\\cdot\\frac1{12}", "10\\frac{1}{12}"), ("\\frac{10}{12}", "10\\frac{1}{12}"),
         ("10\\frac{1}{12}", "10\\cdot\\frac1{12}"), ("2.5", "-2\\frac12"),
         ("10\\frac{1}{13}", "10\\frac{1}{12}")],
    ),
    "decimals_vs_exact": (
        [("0.75", "\\frac34"), (".5", "\\frac12"), ("12.0", "12"), ("8.75", "\\frac{35}{4}"),
         ("8.7500", "8.75"), ("0.\\overline{3}", "\\frac13"), ("0.1\\overline{6}", "\\frac16"),
         ("1000.0", "1000"), ("0.0000672", ".0000672"), ("6.\\overline{6}", "\\frac{20}{3}")],
        [("6.67", "\\frac{20}{3}"), ("0.333", "\\frac13"), ("0.3333333333", "\\frac13"),
         ("8.76", "8.75"), ("8.7", "8.75"), ("0.0833333333333333", "\\frac{1}{12}"),
         ("1.41421356", "\\sqrt2")],
    ),
    "scientific_notation": (
        [("1.5\\times10^{-5}", "0.000015"), ("1.5e-5", "1.5 \\times 10^{-5}"),
         ("6.02\\cdot 10^{23}", "602000000000000000000000"), ("10^{-21}", "0.000000000000000000001"),
         ("2.5 \\times 10^3", "2500"), ("1E3", "1000")],
        [("10^{-21}", "10^{-20}"), ("1.5e-5", "1.5e-6"), ("6.02\\times10^{23}", "6.02\\times10^{22}"),
         ("2.5\\times10^3", "250")],
    ),
    "extreme_magnitudes": (
        [("10^{100}", "1" + "0" * 100), ("2^{100}", "1267650600228229401496703205376"),
         ("10^{-300}", "\\frac{1}{10^{300}}"), ("9^{9}", "387420489"), ("20!", "2432902008176640000")],
        [("10^{100}+1", "10^{100}"), ("10^{-300}", "0"), ("2^{100}", "2^{101}"),
         ("999999999999999999", "1000000000000000000"), ("10^{-21}", "0"),
         ("1267650600228229401496703205377", "2^{100}")],
    ),
    "radicals": (
        [("2\\sqrt2", "\\sqrt8"), ("\\sqrt{12}", "2\\sqrt{3}"), ("\\frac{1}{\\sqrt3}", "\\frac{\\sqrt{3}}{3}"),
         ("\\sqrt[3]{8}", "2"), ("2\\sqrt[3]{2}", "\\sqrt[3]{16}"), ("8^{1/3}", "2"), ("\\sqrt{4}", "2"),
         ("1+\\sqrt2", "\\sqrt{2}+1"), ("\\sqrt 2+\\sqrt 5", "\\sqrt{2}+\\sqrt{5}"), ("\\sqrt3", "\\sqrt{3}"),
         ("\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{2\\sqrt{33}+15}",
          "\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{15+2\\sqrt{33}}"), ("11\\sqrt2", "\\sqrt{242}")],
        [("2.414", "1+\\sqrt2"), ("2.41421356237", "\\sqrt{2}+1"), ("\\sqrt3", "\\sqrt2"),
         ("4\\sqrt{2}", "4"), ("\\frac{1+\\sqrt{5}}{2}", "2"), ("1", "1\\sqrt{19}"),
         ("\\sqrt[3]{2}", "\\sqrt{2}"), ("\\frac{34}{16}+\\frac{\\sqrt{1358}}{16}", "4")],
    ),
    "pi_e": (
        [("\\frac{9\\pi}{4}", "\\frac94\\pi"), ("2\\pi", "\\pi+\\pi"), ("e^2", "e\\cdot e"),
         ("e^{i\\pi}", "-1"), ("\\frac{\\pi}{2}", "\\frac{1}{2}\\pi"), ("288 \\pi", "288\\pi"),
         ("\\frac{20000}{\\pi}", "20000/\\pi"), ("\\ln(e^3)", "3"), ("\\sin\\frac{\\pi}{6}", "\\frac12")],
        [("3.14", "\\pi"), ("3.14159265358979", "\\pi"), ("2.718", "e"), ("\\pi^2", "2\\pi"),
         ("\\frac{\\pi}{3}", "\\frac{\\pi}{6}"), ("-\\frac{\\pi}{6}", "\\frac{\\pi}{6}")],
    ),
    "units_degrees_percent_currency": (
        [("2", "2 \\text{ euros}"), ("2 \\text{ euros}", "2"), ("2\\text{euros}", "2 \\text{ euros}"),
         ("2 euros", "2"), ("10", "10\\text{ cm}^2"), ("15", "15\\mbox{ cm}^2"), ("90", "90^\\circ"),
         ("90^{\\circ}", "90"), ("90°", "90^\\circ"), ("18.90", "\\$18.90"), ("\\$18.9", "18.90"),
         ("28", "28\\%"), ("28 %", "28\\%"), ("28 percent", "28\\%"), ("5.4", "5.4 \\text{ cents}"),
         ("125\\textnormal{ miles}", "125"), ("\\frac{270}7", "\\frac{270}7\\text{ degrees}"),
         ("42409", "\\$42409"), ("\\$42,\\!409", "\\$42409")],
        [("3", "2 \\text{ euros}"), ("2c", "2"), ("2m", "2"), ("\\frac{\\pi}{2}", "90^\\circ"),
         ("28", "0.28"), ("0.28", "28\\%"), ("42408", "\\$42409"), ("a+c", "a+d")],
    ),
    "assignments_and_false_equations": (
        [("x=5", "5"), ("5", "x=5"), ("k=1", "1"), ("x = 11", "11"), ("-16.5", "k = \\frac{-33}{2}"),
         ("-\\frac{33}{2}", "k = \\frac{-33}{2}"), ("k = -\\frac{33}{2} = -16.5", "k = \\frac{-33}{2}"),
         ("f(x)=x^2+1", "x^2+1"), ("p(x) = x^3+3x-6", "x^3+3x-6"), ("(p,q)=(3,2)", "(3,2)"),
         ("x_1 = 4", "4"), ("\\alpha = 2", "2")],
        [("5=3", "3"), ("5=3", "5"), ("x=5=3", "5"), ("x=5=3", "3"), ("x=6", "5"),
         ("3=3=4", "4"), ("a+3z=0", "0"), ("2x+z=1", "1"), ("x=", "5"),
         ("=5", "5")],
    ),
    "tuples": (
        [("(3,-1)", "(3, -1)"), ("\\left(3,-1\\right)", "(3, -1)"), ("(1,4.5)", "(1,\\frac{9}{2})"),
         ("(6,31,-1)", "(6,31,-1)"), ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac\\pi2)"),
         ("(0,5)", "(0,5)")],
        [("(-1,3)", "(3, -1)"), ("(3,-1,0)", "(3, -1)"), ("\\{3,-1\\}", "(3, -1)"), ("3,-1", "(3, -1)"),
         ("(5,0)", "(0,5)"), ("(4,4)", "(4,5)"), ("(3,1)", "\\{1,3\\}"), ("[3,-1]", "(3,-1)")],
    ),
    "intervals_and_unions": (
        [("[0,3)", "[0,3)"), ("[0, 3)", "[0,3)"), ("\\left[0,3\\right)", "[0,3)"),
         ("(-\\infty,0]", "(-\\infty, 0]"), ("(-\\infty,1)\\cup(2,\\infty)", "(2,\\infty)\\cup(-\\infty,1)"),
         ("x\\in[-2,7]", "[-2,7]"), ("[-2,7]", "x \\in [-2,7]"), ("[5,\\infty)", "x\\ge 5"),
         ("x \\geq 5", "x >= 5"), ("(-793,10)", "-793 < a < 10"), ("(-\\infty,1)", "x<1"),
         ("-x>-1", "x<1"), ("(0,1)", "0<f(x)<1"), ("\\{-1\\} \\cup [0,7)", "\\{-1\\}\\cup[0,7)"),
         ("\\left(\\frac{3}{5},\\frac{8}{3}\\right]", "(0.6, \\frac83]")],
        [("[0,3]", "[0,3)"), ("(0,3)", "[0,3)"), ("(0,3]", "[0,3)"), ("[0,1)", "[0,9)"),
         ("(-\\infty,0)", "(-\\infty,0]"), ("(-\\infty,1]\\cup(2,\\infty)", "(-\\infty,1)\\cup(2,\\infty)"),
         ("(-\\infty,1)", "(-\\infty,1)\\cup(2,\\infty)"), ("x>5", "x<5"), ("x>-1", "x<1"),
         ("(5,\\infty)", "x\\ge 5"), ("(2,\\infty)", "(-\\infty,2)")],
    ),
    "unordered_lists_and_sets": (
        [("2,3,4", "2, 3, \\text{ and } 4"), ("4, 3, 2", "2, 3, \\text{ and } 4"),
         ("\\{2,3,4\\}", "2, 3, \\text{ and } 4"), ("2, 3 and 4", "2,3,4"), ("1,-2", "-2,1"),
         ("\\{1,2\\}", "1,2"), ("3, 5, 7", "7,5,3"), ("2,2,3", "2,3"), ("{-2021, 2021}", "\\pm 2021")],
        [("2,3", "2, 3, \\text{ and } 4"), ("2,3,4,5", "2, 3, \\text{ and } 4"),
         ("2,3,5", "2, 3, \\text{ and } 4"), ("1", "1,2"), ("1,2", "1"), ("32, 349", "32349"),
         ("(1,2)", "\\{1,2\\}")],
    ),
    "plus_minus": (
        [("-2,2", "\\pm 2"), ("\\pm2", "\\pm 2"), ("2, -2", "\\pm2"),
         ("1+\\sqrt{19}, 1-\\sqrt{19}", "1 \\pm \\sqrt{19}"), ("3\\mp2\\sqrt2", "3 \\pm 2 \\sqrt{2}"),
         ("\\{1\\pm\\sqrt{5},-2\\}", "\\{1\\pm\\sqrt{5},-2\\}"), ("-2, 1+\\sqrt5, 1-\\sqrt5", "\\{1\\pm\\sqrt{5},-2\\}")],
        [("2", "\\pm 2"), ("\\pm 2021", "2021"), ("2021", "\\pm 2021"), ("1+\\sqrt{19}", "1 \\pm \\sqrt{19}"),
         ("3\\pm\\sqrt2", "3 \\pm 2 \\sqrt{2}"), ("\\pm 3", "\\pm 2")],
    ),
    "matrices": (
        [("\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}", "\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}"),
         ("\\left[\\begin{array}{cc}1 & 2 \\\\3 & 4\\end{array}\\right]", "\\begin{pmatrix}1 & 2 \\\\3 & 4\\end{pmatrix}"),
         ("\\begin{pmatrix} -\\frac13 \\\\ \\frac23 \\\\ \\frac53 \\end{pmatrix}",
          "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}"),
         ("(-7,16,5)", "\\begin{pmatrix} -7 \\\\ 16 \\\\ 5 \\end{pmatrix}"),
         ("\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}", "\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}")],
        [("\\begin{pmatrix}1 & 2 \\\\ 3 & 5\\end{pmatrix}", "\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}"),
         ("\\begin{pmatrix}1 & 3 \\\\ 2 & 4\\end{pmatrix}", "\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}"),
         ("\\begin{pmatrix}1 & 2 & 3 & 4\\end{pmatrix}", "\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}"),
         ("(-7,16,6)", "\\begin{pmatrix} -7 \\\\ 16 \\\\ 5 \\end{pmatrix}"),
         ("\\{-7,16,5\\}", "\\begin{pmatrix} -7 \\\\ 16 \\\\ 5 \\end{pmatrix}")],
    ),
    "polynomials": (
        [("-203x^{11}+58x^5", "-29x^5(7x^6-2)"), ("x^2+2x+1", "(x+1)^2"), ("2(k+1)", "2k+2"),
         ("\\frac{x^9-1}{x-1}", "x^8 + x^7 + x^6 + x^5 + x^4 + x^3 + x^2 + x + 1"),
         ("(a+5)(b+2)", "ab+2a+5b+10"), ("6r^2-4r-24", "2(3r^2-2r-12)"), ("\\frac{11}{20}+\\frac{9a}{20}", "\\frac{11+9a}{20}"),
         ("R^2 \\cdot 3", "3R^2"), ("\\frac{\\cos x}{\\sin x}", "\\cot x")],
        [("-203x^{11}-58x^5", "-29x^5(7x^6-2)"), ("(y+1)^2", "(x+1)^2"), ("q-p", "p - q"),
         ("x^2+2x", "(x+1)^2"), ("(+5)(b+2)", "(a+5)(b+2)"), ("2k", "2k+2"), ("\\tan x", "\\cot x")],
    ),
    "complex_numbers": (
        [("7i-2", "-2 + 7i"), ("-2+7i", "-2 + 7i"), ("5+5i", "(1+2i)(3-i)"), ("i^2", "-1"),
         ("1 - 12i", "1-12i"), ("\\frac{2+2i}{2}", "1+i")],
        [("-2-7i", "-2 + 7i"), ("7-2i", "-2 + 7i"), ("1+2j", "1+2i"), ("-2", "-2+7i"), ("7i", "-2+7i")],
    ),
    "text": (
        [("\\text{Evelyn}", "\\text{Evelyn}"), ("Evelyn", "\\text{Evelyn}"), ("\\text{evelyn}", "\\text{Evelyn}"),
         ("C", "\\text{(C)}"), ("(C)", "\\text{(C)}"), ("\\textbf{(C)}", "\\text{(C)}"), ("\\text{C}", "\\text{(C)}"),
         ("E", "\\text{E}"), ("\\text{E}", "E"), ("\\text{ east }", "\\text{east}")],
        [("\\text{Navin}", "\\text{Evelyn}"), ("D", "\\text{(C)}"), ("d", "\\text{E}"),
         ("\\text{odd}", "\\text{even}"), ("5", "\\text{(C)}")],
    ),
    # an equation whose left side is a lone variable that its right side does not use names the
    # expression: y = x^2+2x+1 answers x^2+2x+1 and the other way round; anything else stays an
    # equation (x = 2x + 3, 2y = 4x + 6, x^2 + 2x + 1 = y against the bare expression)
    "lone_variable_equations": (
        [("y = x^2+2x+1", "x^2+2x+1"), ("x^2+2x+1", "y = x^2+2x+1"), ("y = x^2+2x+1", "2x+ 1+x^2"),
         ("2x+ 1+x^2", "y = x^2+2x+1"), ("y=2x+3", "2x+3"), ("2x+3", "y = 2x + 3"), ("(x+1)^2", "y = x^2+2x+1"),
         ("f = 2x+3", "2x+3"), ("y_1 = 2x+3", "3+2x"), ("r = 2\\cos\\theta", "2\\cos\\theta")],
        [("y = x^2+2x+1", "x^2+2x"), ("x^2+2x", "y = x^2+2x+1"), ("y = x^3+2x+1", "x^2+2x+1"),
         ("y = 2x+3", "2y+3"), ("x = 2x+3", "2x+3"), ("2x+3", "x = 2x + 3"), ("2y = 4x+6", "2x+3"),
         ("2x+3", "2y = 4x + 6"), ("x^2+2x+1 = y", "x^2+2x+1"), ("y = 2x+3", "2z+3"), ("y = 2x + 3", "y")],
    ),
    "equations": (
        [("y = 2x + 3", "y=2x+3"), ("2x-y+3=0", "y = 2x + 3"), ("y-2x=3", "y = 2x + 3"),
         ("-5x+7y-11z-4=0", "5x - 7y + 11z + 4 = 0"), ("y=-\\frac{1}{2}x+\\frac{3}{4}", "2x+4y-3=0"),
         ("x^2/16 + y^2/12 = 1/4", "x^2/4 + y^2/3 = 1"), ("y=-2x", "y = -2x")],
        [("y=2x-3", "y = 2x + 3"), ("y=3x+2", "y = 2x + 3"),
         ("5x - 7y + 11z - 4 = 0", "5x - 7y + 11z + 4 = 0"), ("y=2x", "y = -2x"), ("x^2+y^2=1", "x^2+y^2=4")],
    ),
    "bases": (
        [("204_5", "204_5"), ("204_{5}", "204_5"), ("4210_{5}", "4210_5")],
        [("204", "204_5"), ("54", "204_5"), ("204_6", "204_5"), ("205_5", "204_5")],
    ),
    "thousands_separators": (
        [("1,000", "1000"), ("1{,}000", "1000"), ("1\\,000", "1000"), ("1 000", "1000"),
         ("42,\\!409", "42409"), ("7,425,000", "7425000"), ("1,000.0", "1000.0"), ("\\$1,000.99", "1000.99"),
         ("11,\\! 111,\\! 111,\\! 100", "11111111100"), ("10,\\!080", "10080"), ("58,500", "58500")],
        [("1,2", "12"), ("32, 349", "32349"), ("1,000", "1"), ("1,0000", "10000")],
    ),
    # a group starting with 0 is never thousands grouping: a plain comma makes a list (like 1,2),
    # a typographic {,} or ,\! (number punctuation, never a separator) makes nothing
    "thousands_leading_zero": (
        [("0,111", "0, 111"), ("0,111", "\\{111, 0\\}"), ("012,345", "345, 12"), ("10,111", "10111"),
         ("100,111", "100111"), ("(1{,}000, 2)", "(1000, 2)"), ("0, 111", "0,111")],
        [("0,111", "111"), ("111", "0,111"), ("0,111", "0"), ("-0,111", "-111"),
         ("\\$0,111", "111"), ("0{,}111", "111"), ("0{,}111", "0, 111"),
         ("0,\\!111", "111"), ("0\\,111", "111"), ("0 111", "111"), ("012,345", "12345"),
         ("1{,}5", "1, 5")],
    ),
    # a decimal comma, decided by the reference: against a plain decimal reference, one number
    # whose single comma cannot group thousands reads as a decimal point (2,74 1000,99 0,111
    # 1{,}5); 2,740 still groups thousands, and against any other reference a comma keeps its
    # meaning (a list, thousands, or refused)
    "decimal_comma_by_reference": (
        [("2,74", "2.74"), ("1000,99", "1000.99"), ("0,111", "0.111"), ("0{,}111", "0.111"), ("1{,}5", "1.5"),
         ("-1,5", "-1.5"), ("1,50", "1.5"), ("\\$2,74", "2.74"), ("2,74 \\text{ euros}", "2.74"), ("2,74\u20ac", "2.74"),
         ("3,14", "3.14"), ("0,5", ".5"), ("2,740", "2740")],
        [("2,740", "2.74"), ("1,500", "1.5"), ("0,111", "0.11"), ("0,111", "0.1111"), ("2,74", "2.75"),
         ("-1,5", "1.5"), ("1,5", "15"), ("1,5", "\\frac32"), ("1,5", "1.5 \\text{ cm}"), ("12,345,67", "12345.67"),
         ("1,5x", "1.5"), ("1,5, 2", "1.5"), ("1,5; 2", "1.5"), ("1,5", "1.5, 2"), ("(1,5)", "1.5"),
         ("1,\\!5", "1.5"), ("1\\,5", "1.5"), ("2,74", "2")],
    ),
    # the square or cubic metre written with a superscript sign right after a number is a unit
    # (1,000.99m² is 1000.99); any other ² or ³ is a power (x², 2² = 4) and m^2 a variable squared
    "superscript_units": (
        [("1,000.99m\u00b2", "1000.99"), ("1,000.99 m\u00b2", "1000.99"), ("5 m\u00b3", "5"), ("5 cm\u00b3", "5"),
         ("5cm\u00b2", "5"), ("5 km\u00b2", "5"), ("3 m\u00b2, 4 m\u00b2", "3, 4"), ("x\u00b2+1", "x^2+1"),
         ("2\u00b2", "4"), ("12 \\text{ cm}^2", "12"), ("(x+1)\u00b2", "x^2+2x+1")],
        [("1,000.99m\u00b2", "1000.9"), ("5 m\u00b2", "6"), ("5 cm\u00b3", "6"), ("5m^2", "5"), ("5 m\u00b2 + 1", "6"),
         ("x\u00b2", "x^3"), ("x\u00b2", "x"), ("2\u00b2", "2"), ("5 g\u00b2", "5"), ("3 m\u00b2, 4 g\u00b2", "3, 4"), ("5 cm\u00b2", "25")],
    ),
    # a percent sign is presentation: p% answers p, as references drop the sign (28 for 28%), and
    # never p/100: the reference cannot say which reading it means, and 0.28 for "what percent"
    # is the unconverted slip a policy should not be paid for
    "percent_is_the_number_written": (
        [("10\\%", "10"), ("10%", "10"), ("10", "10\\%"), ("10 percent", "10"), ("0.1\\%", "0.1\\%")],
        [("10\\%", "0.1"), ("10%", "0.1"), ("0.1", "10\\%"), ("\\frac{1}{10}", "10\\%"), ("1000\\%", "10"),
         ("10 percent", "0.1"), ("0.1", "10%"), ("10\\%", "\\frac{1}{10}")],
    ),
    # x != c is the line without the point c, like the other inequalities a set: the letter
    # is not compared, the excluded point and the kind of relation are
    "not_equal_relation": (
        [("x \\neq 3", "x \\ne 3"), ("x \\ne 3", "x \\neq 3"), ("x != 3", "x \\neq 3"),
         ("x \u2260 3", "x \\ne 3"), ("3 \\neq x", "x \\ne 3"), ("2x \\neq 6", "x \\neq 3"),
         ("x \\neq 3", "(-\\infty,3)\\cup(3,\\infty)"), ("(3,\\infty)\\cup(-\\infty,3)", "x \\ne 3"),
         ("x \\in (-\\infty,3)\\cup(3,\\infty)", "x\\neq 3"), ("x \\neq \\frac12", "x \\ne 0.5"),
         ("a \\neq 3", "x \\neq 3"), ("x \\ne 3, x \\ne 5", "x \\neq 5, x \\neq 3")],
        [("x \\neq 3", "3"), ("3", "x \\neq 3"), ("x = 3", "x \\neq 3"), ("x \\neq 3", "x = 3"),
         ("x \\neq -3", "x \\neq 3"), ("x \\neq 3", "x < 3"), ("x \\ne 3", "x > 3"),
         ("x \\neq 3", "(-\\infty,3]\\cup[3,\\infty)"), ("x \\neq 3", "x \\neq 3, x \\neq 5"),
         ("1 \\ne x \\ne 3", "x \\ne 3"), ("x \\neq 0.333", "x \\neq \\frac13"),
         ("x^2 \\neq 4", "x \\neq 2"), ("x \\neq \\pm 2", "x \\neq 2"), ("x \\neq 3", "\\{3\\}"),
         ("x != 4", "x \\neq 3")],
    ),
    # exact \approx decimal: the exact part is the answer; the decimal must be the exact value
    # rounded to the decimal's own number of digits (either way at a tie), else the whole answer
    # is a false statement; the approximation alone, or instead of the exact part, stays wrong
    "exact_then_approximation": (
        [("\\frac{\\sqrt3}{3} \\approx 0.577", "\\frac{\\sqrt3}{3}"),
         ("\\frac{\\sqrt{3}}{3}", "\\frac{\\sqrt3}{3} \\approx 0.577"),
         ("x = 2\\sqrt{30} \\approx 11", "2\\sqrt{30}"), ("\\frac{\\sqrt3}{3} \\approx 0.58", "\\frac{1}{\\sqrt3}"),
         ("\\frac{\\sqrt3}{3} \\approx 0.5774", "\\frac{\\sqrt3}{3}"), ("\\frac{\\sqrt3}{3} \\approx 0.6", "\\frac{\\sqrt3}{3}"),
         ("\\frac{\\sqrt3}{3} \u2248 0.577", "\\frac{\\sqrt3}{3}"), ("\\frac{2}{3} \\approx 0.67", "\\frac23"),
         ("\\frac23", "\\$\\dfrac23 \\approx \\$0.67"), ("\\frac18 \\approx 0.13", "\\frac18"),
         ("\\frac18 \\approx 0.12", "\\frac18"), ("\\frac{\\sin\\frac{\\pi}{6}}{2} \\approx 0.2", "\\frac14"),
         ("-\\sqrt2 \\approx -1.414", "-\\sqrt2"), ("\\pi \\approx 3.1416", "\\pi"),
         ("x = \\frac{32}{3} \\approx 10.67", "\\frac{32}{3}"), ("\\frac13 \\approx 0.333", "\\frac{1}{3}"),
         ("\\frac{\\sqrt3}3 = \\frac{1}{\\sqrt3} \\approx 0.577", "\\frac{\\sqrt3}{3}"),
         ("\\sqrt2 \\approx 1.41, \\sqrt3 \\approx 1.73", "\\sqrt3, \\sqrt2"),
         ("2\\sqrt{30} \\approx 10.95 \\text{ cm}", "2\\sqrt{30}")],
        [("\\frac{\\sqrt3}{3} \\approx 0.578", "\\frac{\\sqrt3}{3}"), ("\\frac{\\sqrt3}{3} \\approx 0.57", "\\frac{\\sqrt3}{3}"),
         ("\\frac{\\sqrt3}{3} \\approx 0.5773", "\\frac{\\sqrt3}{3}"), ("\\frac{\\sqrt3}{3} \\approx 0.5770", "\\frac{\\sqrt3}{3}"),
         ("\\frac{\\sqrt3}{3} \\approx 0.5", "\\frac{\\sqrt3}{3}"), ("x \\approx 0.577", "\\frac{\\sqrt3}{3}"),
         ("\\approx 0.577", "\\frac{\\sqrt3}{3}"), ("0.577", "\\frac{\\sqrt3}{3} \\approx 0.577"),
         ("\\frac{\\sqrt3}{3} \\approx 0.577", "0.577"), ("x \\approx 11", "2\\sqrt{30}"),
         ("x = 2\\sqrt{30} \\approx 10", "2\\sqrt{30}"), ("x = 2\\sqrt{30} \\approx 11", "11"),
         ("11", "x = 2\\sqrt{30} \\approx 11"), ("2\\sqrt{30} \\approx 11", "\\sqrt{30}"),
         ("-\\sqrt2 \\approx 1.414", "-\\sqrt2"), ("\\frac18 \\approx 0.14", "\\frac18"),
         ("\\frac{\\sin\\frac{\\pi}{6}}{2} \\approx 0.4", "\\frac14"), ("\\pi \\approx 3.1415", "\\pi"),
         ("\\sqrt2 \\approx 1.41, \\sqrt3 \\approx 1.74", "\\sqrt2, \\sqrt3"),
         ("\\sqrt2 \\approx 1.41 \\approx 1.4", "\\sqrt2"), ("\\sqrt2 \\approx 1.41 = 1.41", "\\sqrt2"),
         ("\\frac{\\sqrt3}3 = \\frac{1}{\\sqrt2} \\approx 0.577", "\\frac{\\sqrt3}{3}"),
         ("\\frac13 \\approx 3.33e-1", "\\frac13"), ("x+1 \\approx 2", "x+1"),
         ("1\\pm\\sqrt2 \\approx 2.41", "1\\pm\\sqrt2"),
         ("\\sqrt2 \\approx 1.4142135623730950488016887242097", "\\sqrt2")],
    ),
    # spelled-out units and percent words right after a quantity are presentation, as \% is;
    # single letters stay variables, other words stay letters, a text answer keeps its words
    "unit_and_percent_words": (
        [("5 pct", "5\\%"), ("5 percentage", "5\\%"), ("5 percentage points", "5"), ("5 per cent", "5\\%"),
         ("12 centimeters", "12"), ("12 cm", "12\\text{ cm}"), ("3 kilograms", "3"), ("2.5 liters", "\\frac52"),
         ("4 square feet", "4"), ("10 sq units", "10"), ("27 cubic inches", "27"), ("60 miles per hour", "60"),
         ("60 mph", "60"), ("3 cm, 4 cm", "3, 4"), ("(2 ft, 3 ft)", "(2,3)"), ("2\\pi meters", "2\\pi"),
         ("\\frac{1}{2} hours", "\\frac12"), ("30 MINUTES", "30"), ("\\frac{\\pi}{2} rad", "\\frac\\pi2"),
         ("2x+6 cm", "2x+6"), ("[0,1] cm", "[0,1]"), ("7 pts", "7"),
         ("percentage points", "\\text{percentage points}")],
        [("2c", "2"), ("2m", "2"), ("5 g", "5"), ("5 s", "5"), ("5 h", "5"), ("5 apples", "5"),
         ("5 pct", "0.05"), ("5 percent", "0.05"), ("5 pct", "6"), ("5 pctx", "5"), ("5 cm + 3", "8"),
         ("5 cm + 3", "5"), ("2xcm", "2x"), ("2 sec x", "2"), ("2\\sec", "2"), ("2\\min", "2"),
         ("5 km/h", "5"), ("3 cm, 4", "3, 5"), ("12 centimeters", "1.2"), ("\\text{percentage points}", "5"),
         ("percentage points", "percentage"), ("\\text{percent}", "\\text{percentage points}")],
    ),
    # semicolons separate like commas (unordered lists; ordered entries inside brackets), one
    # kind of separator per level: where ; separates, a comma may be a decimal mark and refuses
    "semicolon_lists": (
        [("1; 2", "1, 2"), ("1;2", "2, 1"), ("1; 2; 3", "\\{1,2,3\\}"), ("2; 1", "1; 2"),
         ("1; 2 and 3", "3, 2, 1"), ("x = 1; x = 2", "1, 2"), ("1 000; 2 000", "1000, 2000"),
         ("(1; 2)", "(1, 2)"), ("\\left(1; 2\\right)", "(1,2)"), ("[0; 3)", "[0,3)"),
         ("(-\\infty; 1) \\cup (2; \\infty)", "(-\\infty,1)\\cup(2,\\infty)"), ("\\{1; 2\\}", "\\{1,2\\}"),
         ("(-4, 27);(2, 15)", "(2,15), (-4,27)"), ("(-4; 27); (2; 15)", "(-4, 27);(2, 15)")],
        [("1; 2", "1"), ("1", "1; 2"), ("1; 2", "12"), ("12; 3", "1, 23"), ("1; 2", "1; 3"),
         ("1; 2", "1; 2; 3"), ("1; 2", "(1, 2)"), ("(1; 2)", "(2, 1)"), ("(1; 2)", "\\{1, 2\\}"),
         ("[0; 3)", "[0, 3]"), ("[0; 3)", "(0, 3)"), ("1; 2;", "1, 2"), ("; 1", "1"),
         ("1,5; 2", "1.5, 2"), ("1,5; 2", "1, 5, 2"), ("1, 2; 3", "1, 2, 3"), ("(1,5; 2)", "(1, 5, 2)"),
         ("(1,5; 2)", "(1.5, 2)"), ("1,000; 2", "1000, 2"), ("1{,}000; 2", "1000, 2")],
    ),
    # a label naming the quantity (segment, angle, f(2), a word) is presentation like x in x = 5;
    # in lists labels pair values with quantities: where both parts carry one they must agree
    "labelled_parts": (
        [("AB = 4, CD = 5", "4, 5"), ("4, 5", "AB = 4, CD = 5"), ("CD = 5, AB = 4", "AB = 4, CD = 5"),
         ("BA = 4, DC = 5", "AB = 4, CD = 5"), ("\\overline{AB} = 4, \\overline{CD} = 5", "AB = 4, CD = 5"),
         ("AB = 4; CD = 5", "4, 5"), ("9, 4", "AB=9, CD=4"), ("12+12\\sqrt3", "AB=12+12\\sqrt{3}"),
         ("AB = 4 = 4.0", "4"), ("\\angle ABC = 30^\\circ", "30"), ("m\\angle ABC = 30", "\\angle CBA = 30"),
         ("\\angle A = 45", "45"), ("\\text{Area} = 12", "12"), ("\\text{area} = 12", "\\text{Area}=12"),
         ("\\text{Area} = 6\\sqrt3 \\approx 10.39", "6\\sqrt3"), ("f(2) = 5", "5"),
         ("x = 1, y = 2", "y = 2, x = 1"), ("x = 1, y = 2", "1, 2"), ("x = \\pm 2, y = 3", "2, -2, 3"),
         ("x_1 = 4, x_{2} = 5", "x_2 = 5, x_1 = 4"), ("x = 1, x = 2", "x = 2, x = 1"),
         ("x = \\pm 2, y = 3", "x = 2, x = -2, y = 3"), ("2, y = 3", "x = 2, y = 3"),
         ("AB = 4, CD = 5", "(4, 5)")],
        [("AB = 4, CD = 5", "4, 6"), ("AB = 4, CD = 5", "AB = 5, CD = 4"), ("CD = 4, AB = 5", "AB = 4, CD = 5"),
         ("AB = 4, CD = 5", "4"), ("AB = 4, CD = 5", "(5, 4)"), ("AB = 4, CD = 5", "AB = 4, EF = 5"),
         ("AB = 4, CD = 5", "AB = 4, CD = 5, EF = 6"), ("AB = 9, CD = 4", "AB=4, CD=9"), ("AB = 4", "5"),
         ("AB = 4 = 5", "4"), ("AB = 2x", "2x"), ("AB = \\sqrt{x}", "\\sqrt x"), ("AB = (1,2)", "(1,2)"),
         ("xy = 4", "4"), ("4", "xy = 4"), ("ab = 4", "4"), ("2AB = 4", "4"), ("ABCDE = 4", "4"),
         ("\\text{Area} = 12", "13"), ("\\text{area} = 12, \\text{perimeter} = 14", "\\text{area} = 14, \\text{perimeter} = 12"),
         ("f(1) = 3, f(2) = 5", "f(2) = 3, f(1) = 5"), ("x = 1, y = 2", "x = 2, y = 1"),
         ("x = 1, y = 2", "x = 1, z = 2"), ("x = 1, x = 2", "x = 1, y = 2"), ("AB = 4, 5", "AB = 5, CD = 4"),
         ("x = 2, 1", "x = 1, y = 2"), ("x = \\pm 2, y = 3", "y = \\pm 2, x = 3")],
    ),
    # labels naming the quantity other than by one variable: a ratio of names (A:B,
    # S_{MBCN}:S, V_{1}:V_{2}, PA:AB), a length |AB|, a fraction of segment names \frac{NO}{BO};
    # a ratio is compared term by term, never as a number (9:24 may be a time); two ratio labels
    # must agree even alone; |x| = 1 and \frac{x}{y} = 2 stay equations. Semicolon-separated
    # groups of labelled values are solution tuples in the order written, as (p,q) = (5,2) is
    "labelled_names": (
        [("S_{MBCN}:S = 7:32", "7:32"), ("7:32", "S_{MBCN}:S = 7:32"), ("7 : 32", "7:32"),
         ("V_{1}:V_{2} = 11:21", "11:21"), ("V_1:V_2 = 11:21", "V_{1}:V_{2} = 11:21"),
         ("PA:AB = 3:1", "3:1"), ("AP:BA = 3:1", "PA:AB = 3:1"), ("x:y = 2:3", "2:3"),
         ("A:B:C = 1:2:3", "1:2:3"), ("|AB|:|CD| = 1:2", "1:2"), ("\\angle A:\\angle B = 1:2", "1:2"),
         ("A:B = 2:3", "r = 2:3"), ("A:B = 1, C:D = 2", "C:D = 2, A:B = 1"), ("A:B = 1, C:D = 2", "1, 2"),
         ("05\\!:\\!00", "5:00"), ("8:34 \\text{ p.m.}", "8\\!:\\!34 \\text{ p.m.}"),
         ("|AB| = 1", "1"), ("1", "|AB| = 1"), ("|BA| = 1", "AB = 1"), ("|\\overline{AB}| = 1", "1"),
         ("|AB| = 4, |CD| = 5", "CD = 5, AB = 4"), ("A:B = 1", "1"), ("A:B = 0.5", "\\frac12"),
         ("\\frac{NO}{BO} = \\frac{1}{\\sqrt6}", "\\frac{1}{\\sqrt6}"),
         ("\\frac{NO}{BO} = \\frac{1}{\\sqrt6}", "\\frac{\\sqrt6}{6}"), ("NO/BO = \\frac12", "\\frac12"),
         ("\\frac{ON}{OB} = 0.5", "\\frac{NO}{BO} = \\frac12"), ("\\frac{|AB|}{|CD|} = 2", "2"),
         ("p=5,q=2;p=7,q=2", "(5,2),(7,2)"), ("(5,2),(7,2)", "p=5,q=2;p=7,q=2"),
         ("p = 7, q = 2; p = 5, q = 2", "(5,2), (7,2)"), ("p=5,q=2;p=7,q=2", "\\{(7,2),(5,2)\\}"),
         ("p=5,q=2;p=7,q=2", "(p,q) = (5,2), (p,q) = (7,2)"), ("x=1,y=2,z=3;x=4,y=5,z=6", "(4,5,6),(1,2,3)"),
         ("x_1 = 1, x_2 = 2; x_1 = 3, x_2 = 4", "(1,2),(3,4)"), ("q=2,p=5;q=2,p=7", "(2,5),(2,7)"),
         ("x = 1, y = 2", "(1, 2)")],
        [("S_{MBCN}:S = 7:32", "32:7"), ("S_{MBCN}:S = 7:32", "7"), ("S_{MBCN}:S = 7:32", "\\frac{7}{32}"),
         ("7:32", "\\frac{7}{32}"), ("\\frac{7}{32}", "7:32"), ("7:32", "14:64"), ("9:24", "3:8"), ("7:32", "(7,32)"),
         ("V_{1}:V_{2} = 11:21", "21:11"), ("V_{1}:V_{2} = 11:21", "11:21:1"), ("A:B = 2:3", "B:A = 2:3"),
         ("\\frac{NO}{BO} = \\frac12", "\\frac{BO}{NO} = \\frac12"), ("A:B = 1, C:D = 2", "A:B = 2, C:D = 1"),
         ("A:B = 1", "2"), ("A:B = 2:3", "2"), ("A:B = 2:3", "\\frac23"), ("A:B = 1", "1:1"),
         ("A:B = 1:2:3", "1:2:3"), ("A:B = x:3", "x:3"), ("2A:B = 1", "1"), ("ab:c = 1", "1"),
         ("A:B = 2:3 = 4:5", "2:3"), ("1:2", "1:3"), ("1:2", "1"), ("8:34 \\text{ a.m.}", "8\\!:\\!34 \\text{ p.m.}"),
         ("8:34 \\text{ a.m.}", "8:34"), ("8:34 pm", "8:34 am"),
         ("|AB| = 1", "2"), ("|AB| = 1", "-1"), ("|x| = 1", "1"), ("|A| = 1", "1"), ("|AB| = x", "x"),
         ("|AB| = 4, |CD| = 5", "AB = 5, CD = 4"),
         ("\\frac{NO}{BO} = \\frac{1}{\\sqrt6}", "\\frac{1}{\\sqrt5}"), ("\\frac{NO}{BO} = \\frac12", "2"),
         ("\\frac{x}{y} = 2", "2"), ("\\frac{A}{B} = 2", "2"), ("x/y = 2", "2"), ("\\frac{NO}{BO} = 2x", "2x"),
         ("\\frac{NO}{BO}{CD} = 2", "2"), ("\\frac{NO}{BO} = 1:2", "1:2"),
         ("p=5,q=2;p=7,q=2", "(2,5),(7,2)"), ("p=5,q=2;p=7,q=2", "(5,2)"), ("p=5,q=2;p=7,q=2", "(5,2),(7,2),(3,3)"),
         ("p=5,q=2;q=2,p=7", "(5,2),(7,2)"), ("p=5,q=2;p=7,r=2", "(5,2),(7,2)"), ("p=5,q=2;p=7,q=2", "5,2,7,2"),
         ("p=5,q=2;p=7,q=2", "(q,p) = (5,2), (q,p) = (7,2)"), ("p=5,q=2;p=7", "(5,2),(7)"),
         ("p=5,p=2;p=7,p=2", "(5,2),(7,2)"), ("p=5,q=2x;p=7,q=2", "(5,2x),(7,2)"), ("x=1,5;x=2", "1.5, 2"),
         ("p=5,q=2;p=7,q=2", "p=5,q=2"), ("y = 2, x = 1", "(1, 2)"), ("q=2,p=5;q=2,p=7", "(5,2),(7,2)")],
    ),
}


@pytest.mark.parametrize("category", sorted(CATEGORIES))
def test_category(category):
    equal, not_equal = CATEGORIES[category]
    assert equal and not_equal
    check_pairs(equal, not_equal)


# A list whose parts all carry distinct labels is one labelled tuple: equal to the same labels with
# equal values in any order, or to a written list or tuple of as many values in the reference's
# order; never to fewer parts (one value, one of its labels), never with a duplicate dropped,
# never to the values reordered. One form per label kind the policy accepts, each with its near
# misses. (reference, answers that score 1, answers that score 0)
LABELLED_FORMS = {
    "variable_single": ("x = 5", ["5", "x=5.0", "y = 5", "\\frac{10}{2}"], ["6", "x = 6", "x = 5, y = 5", "(5, 5)", "5, 6"]),
    "figure_name_single": ("AB = 4", ["4", "BA = 4", "\\overline{AB} = 4"], ["5", "AB = 5", "AB = 4, CD = 4", "2x"]),
    "angle_single": ("\\angle ABC = 30", ["30", "m\\angle CBA = 30", "30^\\circ"], ["60", "\\angle ABC = 60", "30, 60"]),
    "text_single": ("\\text{Area} = 12", ["12", "\\text{area} = 12"], ["13", "\\text{Area} = 13", "12, 14"]),
    "function_single": ("f(2) = 5", ["5", "f(2)=5"], ["2", "f(2) = 6", "5, 6"]),
    "single_variables_equal_values": (
        "x=5, y=5",
        ["5, 5", "(5,5)", "y = 5, x = 5", "(x, y) = (5, 5)", "x = 5; y = 5", "5, y = 5"],
        ["5", "x=5", "y=5", "x = 5, x = 5", "5, 5, 5", "x=5, y=5, z=5", "x = 5, z = 5", "\\{5\\}",
         "\\{5, 5\\}", "5, 6", "x = 5, y = 6"]),
    "single_variables_one_value_twice": (
        "x=2, y=2", ["2, 2", "(2, 2)", "y=2, x=2"], ["2", "x = 2", "y = 2", "(2)", "2, 2, 2", "2, -2", "\\pm 2"]),
    "single_variables_order": (
        "x=3, y=4",
        ["3, 4", "(3, 4)", "y = 4, x = 3", "(x, y) = (3, 4)", "(y, x) = (4, 3)", "3, y = 4", "x = 3, 4"],
        ["4, 3", "(4, 3)", "x = 4, y = 3", "y = 3, x = 4", "3", "4", "x = 3", "\\{3, 4\\}", "\\{4, 3\\}",
         "4, x = 3", "y = 4, 3", "[3, 4]", "(x, y) = (4, 3)", "3, 4, 5"]),
    "tuple_label": (
        "(x, y) = (5, 5)", ["(5, 5)", "x = 5, y = 5", "y = 5, x = 5", "(x,y) = (5,5)"],
        ["5", "x = 5", "(5, 6)", "x = 5, y = 6", "x = 5, z = 5"]),
    "figure_names": (
        "AB = 4, CD = 4", ["4, 4", "CD = 4, AB = 4", "BA = 4, DC = 4", "\\overline{AB} = 4, \\overline{CD} = 4"],
        ["4", "AB = 4", "CD = 4", "AB = 4, EF = 4", "4, 5", "AB = 4, CD = 5", "4, 4, 4"]),
    "figure_names_order": (
        "AB = 4, CD = 5", ["4, 5", "CD = 5, AB = 4", "(4, 5)"], ["5, 4", "AB = 5, CD = 4", "4", "5", "(5, 4)"]),
    "angles": (
        "\\angle A = 30, \\angle B = 30", ["30, 30", "\\angle B = 30, \\angle A = 30"],
        ["30", "\\angle A = 30", "\\angle A = 30, \\angle C = 30", "30, 60"]),
    "text_labels": (
        "\\text{Area} = 12, \\text{Perimeter} = 14", ["12, 14", "\\text{perimeter} = 14, \\text{area} = 12"],
        ["12", "14", "14, 12", "\\text{Area} = 12", "\\text{Area} = 14, \\text{Perimeter} = 12"]),
    "function_values": (
        "f(1) = 3, f(2) = 3", ["3, 3", "f(2) = 3, f(1) = 3"], ["3", "f(1) = 3", "f(1) = 3, f(3) = 3", "3, 4"]),
    "ratio_single": (
        "S_{MBCN}:S = 7:32", ["7:32", "S_{MBCN}:S = 7:32", "7 : 32"],
        ["32:7", "7", "32", "\\frac{7}{32}", "14:64", "S:S_{MBCN} = 7:32", "7:32:1"]),
    "ratio_list": (
        "S_{1}:S = 7:32, S_{2}:S = 1:4", ["7:32, 1:4", "S_2:S = 1:4, S_1:S = 7:32"],
        ["7:32", "1:4", "1:4, 7:32", "S_1:S = 1:4, S_2:S = 7:32", "S_{1}:S = 7:32", "7:32, 1:4, 1:4"]),
    "length_single": ("|AB| = 1", ["1", "AB = 1", "|BA| = 1"], ["-1", "2", "|AB| = 2", "1, 2"]),
    "length_list": (
        "|AB| = 1, |CD| = 1", ["1, 1", "|CD| = 1, |AB| = 1", "AB = 1, CD = 1"],
        ["1", "|AB| = 1", "AB = 1", "1, -1", "|AB| = 1, |EF| = 1"]),
    "segment_fraction_single": (
        "\\frac{NO}{BO} = \\frac{1}{2}", ["\\frac12", "0.5", "NO/BO = \\frac12"],
        ["2", "\\frac{BO}{NO} = \\frac12", "\\frac13", "1:2"]),
    "segment_fraction_list": (
        "\\frac{NO}{BO} = \\frac{1}{2}, \\frac{AB}{CD} = 2", ["\\frac12, 2", "\\frac{AB}{CD} = 2, \\frac{NO}{BO} = \\frac12"],
        ["\\frac12", "2", "2, \\frac12", "\\frac{NO}{BO} = 2, \\frac{AB}{CD} = \\frac12"]),
    "lone_variable_equations": (
        "y_1 = 2x+1, y_2 = 3x", ["2x+1, 3x", "y_2 = 3x, y_1 = 1+2x", "1 + 2x, y_2 = 3x"],
        ["2x+1", "3x", "3x, 2x+1", "y_1 = 3x, y_2 = 2x+1", "y_1 = 2x+1"]),
}


@pytest.mark.parametrize("form", sorted(LABELLED_FORMS))
def test_labelled_forms_equal_and_near_misses(form):
    gold, equal, not_equal = LABELLED_FORMS[form]
    assert verifier._analyze_cached(gold) is not None, gold
    check_pairs([(p, gold) for p in equal + [gold]], [(p, gold) for p in not_equal])


def test_labelled_list_is_never_answered_by_fewer_parts():
    # a reward of 1 for part of a labelled answer is what a policy would learn to write
    for gold, part in [("x=5, y=5", "5"), ("x=5, y=5", "x=5"), ("x=5, y=5", "y = 5"), ("x=2, y=2", "2"),
                       ("AB = 4, CD = 4", "4"), ("|AB| = 1, |CD| = 1", "1"), ("f(1) = 3, f(2) = 3", "3"),
                       ("x = 1, y = 1, z = 1", "1, 1"), ("x = 1, y = 1, z = 1", "x = 1, y = 1")]:
        assert reward(f"\\boxed{{{part}}}", gold) == 0.0, (part, gold)
    # nor does a labelled answer answer one value: its extra parts are a different answer
    for gold, pred in [("5", "x=5, y=5"), ("2", "x = 2, y = 2"), ("4", "AB = 4, CD = 4")]:
        assert reward(f"\\boxed{{{pred}}}", gold) == 0.0, (pred, gold)


def test_labelled_list_keeps_the_reference_order_and_its_duplicates():
    assert reward("\\boxed{4, 3}", "x=3, y=4") == 0.0
    assert reward("\\boxed{3, 4}", "x=3, y=4") == 1.0
    assert reward("\\boxed{5, 5}", "x=5, y=5") == 1.0
    assert reward("\\boxed{(5,5)}", "x=5, y=5") == 1.0
    assert reward("\\boxed{5, 5, 5}", "x=5, y=5") == 0.0


# The mirror of the rule above: a labelled tuple answer (distinct labels) against an unlabelled
# reference TUPLE drops its labels and needs as many parts with equal values in the order written;
# every near miss scores 0. (answer, reference) pairs.
LABELLED_ANSWER_FOR_TUPLE_EQUAL = [
    ("a=3, b=4", "(3,4)"),
    ("u=5,v=1", "(5,1)"),
    ("u = 5, v = 1", "(5,1)"),
    ("(a, b) = (3, 4)", "(3,4)"),
    ("x = 3, y = 4", "(3, 4)"),
    ("a = 3, b = 3", "(3, 3)"),                      # a value twice, both parts kept
    ("AB = 4, CD = 5", "(4, 5)"),
    ("a = 3; b = 4", "(3, 4)"),
    ("y_1 = 2x+1, y_2 = 3x", "(2x+1, 3x)"),          # lone-variable equations label their values
]
LABELLED_ANSWER_FOR_TUPLE_NOT_EQUAL = [
    ("a=3", "(3,4)"),                                # fewer parts
    ("3", "(3,4)"),
    ("b=4", "(3,4)"),
    ("a=3, b=4, c=5", "(3,4)"),                      # more parts
    ("a=4, b=3", "(3,4)"),                           # the values in another order
    ("b=4, a=3", "(3,4)"),                           # read as written: (4, 3)
    ("(a, b) = (4, 3)", "(3,4)"),
    ("(b, a) = (4, 3)", "(3,4)"),
    ("a = 3", "(3, 3)"),                             # a duplicate dropped
    ("\\{3, 4\\}", "(3,4)"),                         # a set
    ("a = \\pm 3, b = 4", "(3,4)"),                  # a \pm
    ("\\pm 3", "(3,-3)"),
    ("a = 3, a = 4", "(3,4)"),                       # repeated labels: an unordered list
    ("a = 3, 4", "(3,4)"),                           # an unlabelled part: a written list
    ("3, b = 4", "(3,4)"),
    ("3, 4", "(3,4)"),                               # a written list never answers a tuple
    ("a = 3, b = 5", "(3,4)"),
    ("a = 3, b = 4", "[3,4]"),                       # another bracket
    ("a = 3, b = 4", "(3,4]"),
    ("a = 3, b = 4", "(3,4),(5,6)"),
]


def test_labelled_answer_answers_an_unlabelled_tuple_in_the_order_written():
    check_pairs(LABELLED_ANSWER_FOR_TUPLE_EQUAL, LABELLED_ANSWER_FOR_TUPLE_NOT_EQUAL)
    assert reward("\\boxed{a=3, b=4}", "(3,4)") == 1.0
    assert reward("\\boxed{u=5,v=1}", "(5,1)") == 1.0
    assert reward("\\boxed{(a, b) = (3, 4)}", "(3,4)") == 1.0
    assert reward("\\boxed{b=4, a=3}", "(3,4)") == 0.0
    assert reward("\\boxed{a=4, b=3}", "(3,4)") == 0.0
    assert reward("\\boxed{a=3}", "(3,4)") == 0.0
    assert reward("\\boxed{3}", "(3,4)") == 0.0


def test_labelled_rule_holds_both_ways():
    # the existing direction: a written list of as many values, in the reference's order
    assert reward("\\boxed{5, 5}", "x=5, y=5") == 1.0
    assert reward("\\boxed{4, 3}", "x = 3, y = 4") == 0.0
    assert reward("\\boxed{(3, 4)}", "x = 3, y = 4") == 1.0
    assert reward("\\boxed{(4, 3)}", "x = 3, y = 4") == 0.0
    # its mirror: a labelled answer against an unlabelled tuple, in the order written
    assert reward("\\boxed{x = 3, y = 4}", "(3, 4)") == 1.0
    assert reward("\\boxed{y = 4, x = 3}", "(3, 4)") == 0.0
    # against an unlabelled reference LIST a labelled answer drops its labels, unordered
    assert reward("\\boxed{a=3, b=4}", "3, 4") == 1.0
    assert reward("\\boxed{a=4, b=3}", "3, 4") == 1.0
    assert reward("\\boxed{a=3}", "3, 4") == 0.0
    assert reward("\\boxed{a=3, b=5}", "3, 4") == 0.0
    # labels count against a labelled reference tuple, whichever side writes them
    assert reward("\\boxed{a=3, b=4}", "(x, y) = (3, 4)") == 0.0
    assert reward("\\boxed{(a, b) = (3, 4)}", "x = 3, y = 4") == 0.0


def test_several_boxes_do_not_answer_a_tuple_reference():
    # a tuple reference is one part, never a list of parts: its answer is one box, labelled or not
    assert reward("\\boxed{a=3} \\boxed{b=4}", "(3,4)") == 0.0
    assert reward("\\boxed{3} \\boxed{4}", "(3,4)") == 0.0
    assert score("\\boxed{a=3} and \\boxed{b=4}", "(3,4)") == (0.0, "b=4", "wrong")
    # against a reference list the boxes are its parts
    assert reward("\\boxed{a=3} \\boxed{b=4}", "3, 4") == 1.0
    assert reward("\\boxed{3} \\boxed{4}", "3, 4") == 1.0
    assert reward("\\boxed{x=3} \\boxed{y=4}", "x = 3, y = 4") == 1.0


# Several final boxes for a reference list of k parts: when the last box alone is not equal, the
# last k boxes, each one part, taken together as one list (so, for an unlabelled list, as a set:
# no box too many among them, none missing; for a labelled tuple in its order).
SEVERAL_BOXES_EQUAL = [
    ("\\boxed{(2,2)} \\quad\\text{and}\\quad \\boxed{(6,2)}", "(2,2),(6,2)"),
    ("$\\boxed{(6, 2)}$ and $\\boxed{(2, 2)}$.", "(2,2),(6,2)"),
    ("\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}", "(3, 3), (1, 1)"),
    ("\\boxed{1} and \\boxed{2} and \\boxed{3}", "\\{1,2,3\\}"),
    ("\\boxed{1},\\boxed{2},\\boxed{3}", "1, 2, 3"),
    ("\\boxed{-2} \\quad \\text{and} \\quad \\boxed{1}.", "1, -2"),
    ("\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 2}", "k = 45, n = 2"),
    ("\\boxed{n = 2} \\quad \\text{and} \\quad \\boxed{k = 45}", "k = 45, n = 2"),
    ("$y_1 = \\boxed{-2(x - 1)^2 + 5}$ and $y_2 = \\boxed{3(x + 2)^2 - 2}$",
     "y_{1}=-2 x^{2}+4 x+3, y_{2}=3 x^{2}+12 x+10"),
    ("\\boxed{3} and \\boxed{4}", "x = 3, y = 4"),
    ("\\boxed{5} and \\boxed{5}", "x = 5, y = 5"),
    ("first \\boxed{7} (wrong), then the two roots \\boxed{2} and \\boxed{5}", "2, 5"),
    ("\\boxed{\\boxed{2}} and \\boxed{5}", "2, 5"),
    ("\\boxed{(7,2)} \\boxed{(5,2)}", "p=5,q=2;p=7,q=2"),
]
SEVERAL_BOXES_NOT_EQUAL = [
    ("\\boxed{(2,2)}", "(2,2),(6,2)"),                                    # one missing
    ("\\boxed{(2,2)} and \\boxed{(6,2)} and \\boxed{(1,1)}", "(2,2),(6,2)"),  # one too many last
    ("\\boxed{(2,2)} and \\boxed{(2,2)}", "(2,2),(6,2)"),                 # a duplicate is not the other
    ("\\boxed{(2,2)} and \\boxed{(6,3)}", "(2,2),(6,2)"),
    ("\\boxed{1}\\boxed{2}\\boxed{3}\\boxed{4}\\boxed{5}", "2, 5"),       # boxing candidates
    ("\\boxed{5}\\boxed{2}\\boxed{9}", "2, 5"),
    ("\\boxed{1, 2} and \\boxed{3}", "1, 2, 3"),                          # a box of two parts
    ("\\boxed{1} and \\boxed{2, 3}", "1, 2, 3"),
    ("\\boxed{1} and \\boxed{2}", "1, 2, 3"),
    ("\\boxed{4} and \\boxed{3}", "x = 3, y = 4"),                        # a labelled tuple's order
    ("\\boxed{5}", "x = 5, y = 5"),
    ("\\boxed{x = 5}", "x = 5, y = 5"),
    ("\\boxed{k = 45} and \\boxed{n = 3}", "k = 45, n = 2"),
    ("\\boxed{k = 45} and \\boxed{m = 2}", "k = 45, n = 2"),
    ("\\boxed{5} and \\boxed{6}", "5"),                                   # one value: the last box only
    ("\\boxed{5} and \\boxed{6}", "5, 6, 7"),
    ("\\boxed{\\boxed{2} and 5}", "2, 5"),                                # one box holding another
    ("\\boxed{\\boxed{2}}", "x = 2, y = 2"),                              # one value, boxed twice over
    ("\\boxed{\\boxed{(2,2)}} \\boxed{(6,2)}", "(2,2), (6,2), (1,1)"),
    ("\\boxed{1} \\boxed{1, 2} \\boxed{3}", "1, 2, 3"),                   # a box of two parts among k
    ("\\boxed{1, 2} \\boxed{2}", "1, 2"),
    ("\\boxed{2} and \\boxed{5", "2, 5"),                                 # the last box unbalanced
    ("\\boxed{2} and \\boxed{}", "2, 5"),
    ("\\boxed{2} \\boxed{x = \\pm 5}", "2, 5, -5"),
]


def test_several_boxes_answer_a_list_reference():
    for response, gold in SEVERAL_BOXES_EQUAL:
        assert reward(response, gold) == 1.0, (response, gold)
        r, ans, status = score(response, gold)
        assert (r, status) == (1.0, "correct") and ans, (response, gold)
    for response, gold in SEVERAL_BOXES_NOT_EQUAL:
        assert reward(response, gold) == 0.0, (response, gold)
    assert score("\\boxed{(2,2)} \\quad\\text{and}\\quad \\boxed{(6,2)}", "(2,2),(6,2)") == (
        1.0, "(2,2), (6,2)", "correct")
    assert score("\\boxed{(2,2)} and \\boxed{(6,3)}", "(2,2),(6,2)") == (0.0, "(6,3)", "wrong")
    assert score("\\boxed{2} and \\boxed{5", "2, 5") == (0.0, None, "no_answer")


def test_several_boxes_are_read_by_score_not_by_is_equivalent():
    # is_equivalent compares one answer with one reference; only a response has several boxes
    assert not is_equivalent("\\boxed{1},\\boxed{2}", "1, 2")
    assert extract_final_answer("\\boxed{1},\\boxed{2}") == "2"


def test_unparseable_gold_falls_back_to_normalized_string():
    gold = "\\mathbb{R}"
    assert verifier._analyze_cached(gold) is None  # really unparseable
    assert is_equivalent("\\mathbb{R}", gold)
    assert is_equivalent(" \\mathbb{ R } ", gold)
    assert is_equivalent("$\\mathbb{R}$", gold)
    assert not is_equivalent("\\mathbb{Q}", gold)
    assert not is_equivalent("R", gold)
    assert not is_equivalent("", gold)
    gold2 = "x \\approx 3"
    assert is_equivalent("x\\approx 3", gold2)
    assert not is_equivalent("3", gold2)
    assert not is_equivalent("x \\approx 4", gold2)


def test_deterministic_and_no_global_mpmath_side_effect():
    import mpmath

    before = mpmath.mp.dps
    pairs = [("\\sqrt8", "2\\sqrt2"), ("(x+1)^2", "x^2+2x+1"), ("2.414", "1+\\sqrt2")]
    first = [is_equivalent(p, g) for p, g in pairs]
    verifier._analyze_cached.cache_clear()
    assert [is_equivalent(p, g) for p, g in pairs] == first == [True, True, False]
    assert mpmath.mp.dps == before


def test_no_eval_in_verifier_source():
    src = (ROOT / "verifier.py").read_text()
    assert not re.search(r"\b(eval|exec|sympify|parse_expr|parse_latex)\s*\(", src)
    assert not re.search(r"\b(compile)\s*\(", src.replace("re.compile(", ""))
    assert "import sympy" not in src and "from sympy" not in src
    assert "__import__" not in src


def test_module_docstring_states_policy():
    doc = verifier.__doc__
    for word in ("Equivalence policy", "RELATIVE", "tuple", "interval", "unordered", "\\pm",
                 "text", "falls back", "bounded"):
        assert word.lower() in doc.lower(), word


# ---------------------------------------------------------------------------------------------
# real answers
def _load(name):
    return json.loads((DATA / name).read_text())


# rewritings (equal) and near misses (not equal) for the non-integer answers of the first 50
FIRST50_SPECIAL = {
    "(3, -1)": (["(3,-1)", "\\left(3, -1\\right)", "(3,\\ -1)"], ["(-1, 3)", "(3,1)", "\\{3,-1\\}"]),
    "[0,3)": (["[0, 3)", "\\left[0,3\\right)", "x \\in [0,3)", "0 \\le x < 3"], ["[0,3]", "(0,3)", "(0,3]"]),
    "\\$42409": (["42409", "42,409", "\\$42,\\!409", "42{,}409", "\\$ 42409"], ["42408", "42410", "4240.9"]),
    "k = \\frac{-33}{2}": (["-\\frac{33}{2}", "-16.5", "\\frac{-33}{2}", "k=-16.5", "-33/2", "-16\\frac12"],
                           ["\\frac{33}{2}", "-16", "k = -\\frac{33}{2} = 16.5", "-16.4"]),
    "2 \\text{ euros}": (["2", "2\\text{ euros}", "2 euros", "\\text{2 }", "2.0"], ["3", "2c", "1"]),
    "10\\frac{1}{12}": (["\\frac{121}{12}", "10 \\frac{1}{12}", "10\\tfrac1{12}"],
                        ["\\frac{10}{12}", "10\\cdot\\frac1{12}", "10.083", "\\frac{120}{12}"]),
    "\\frac{1}{2}": (["0.5", "1/2", "\\dfrac12", ".5"], ["2", "0.51", "-\\frac12"]),
    "(0,5)": (["(0, 5)", "\\left(0,5\\right)"], ["(5,0)", "[0,5]", "(0,6)"]),
    "\\frac{20}{3}": (["6\\frac23", "6.\\overline{6}", "20/3"], ["6.67", "6.666", "\\frac{20}{9}"]),
    "\\sqrt{2}+1": (["1+\\sqrt2", "\\sqrt2+1", "\\frac{1}{\\sqrt2-1}"], ["2.414", "\\sqrt{2}-1", "\\sqrt3+1"]),
    "8.75": (["\\frac{35}{4}", "8\\frac34", "8.750"], ["8.7", "8.76", "\\frac{35}{3}"]),
    "2, 3, \\text{ and } 4": (["2,3,4", "4,3,2", "\\{2,3,4\\}", "2, 3 and 4", "3, 2, \\text{and } 4"],
                              ["2,3", "2,3,4,5", "(2,3,4)", "2,3,5"]),
    "(4,4)": (["(4, 4)"], ["(4,5)", "4", "\\{4\\}"]),
    "-29x^5(7x^6-2)": (["-203x^{11}+58x^5", "58x^5-203x^{11}", "-29x^5 \\cdot (7x^6 - 2)"],
                       ["-203x^{11}-58x^5", "-203y^{11}+58y^5", "203x^{11}-58x^5"]),
}


def _int_rewrites(a):
    n = int(a)
    return [f"{n}.0", f"+{n}" if n >= 0 else f"-{-n}", f"\\text{{{n}}}", f"{n}"], [str(n + 1), str(n - 1), f"{n}.5"]


@needs_data
def test_first50_answers_self_rewritings_and_near_misses():
    answers = [r["answer"] for r in _load("math_train_first50.json")]
    assert len(answers) == 50
    checked = 0
    for a in answers:
        assert verifier._analyze_cached(a) is not None, a  # so equal to itself by the math, not as a string
        assert reward(f"Let me think. The result follows.\n\\boxed{{{a}}}", a) == 1.0, a
        if re.fullmatch(r"-?\d+", a):
            eq, neq = _int_rewrites(a)
        else:
            eq, neq = FIRST50_SPECIAL[a]
        for p in eq:
            assert is_equivalent(p, a), (p, a)
            assert reward(f"... so $\\boxed{{{p}}}$.", a) == 1.0, (p, a)
        for p in neq:
            assert not is_equivalent(p, a), (p, a)
            assert reward(f"... so $\\boxed{{{p}}}$.", a) == 0.0, (p, a)
        checked += 1
    assert checked == 50


@needs_data
def test_math500_self_equality_and_parse_report(capsys):
    rows = _load("math500_test.json")
    assert len(rows) == 500
    fallback = []
    for r in rows:
        a = r["answer"]
        assert reward(f"Solution sketch.\n\nFinal answer: $\\boxed{{{a}}}$", a) == 1.0, a
        if verifier._analyze_cached(a) is None:  # equal to itself by the string fallback alone
            fallback.append(a)
        else:
            assert is_equivalent(a, a)
        if re.fullmatch(r"-?\d+", a):
            assert not is_equivalent(str(int(a) + 1), a), a
    parsed = len(rows) - len(fallback)
    with capsys.disabled():
        print(f"\nMATH-500 answers: {parsed} parsed, {len(fallback)} string fallback {fallback}")
    assert len(fallback) <= 10


# ---------------------------------------------------------------------------------------------
# peer cases (Math-Verify 0.9.0 labels). Conflicts with our documented policy, kept deliberate:
PEER_CONFLICTS = {
    ("1000.99", "the number is not 10 which is 1,000.99\u20ac"):
        "free text without \\boxed: we read only boxed answers / whole answer strings",
    ("$\\frac{1}{12}$", "$0.0833333333333333$"):
        "decimals are exact rationals; Math-Verify rounds floats to 6 digits",
    ("$9$", "Answer \\[ \n 9 \n \\]"):
        "free text without \\boxed: no last-LaTeX-block extraction",
    ("$10/9$", "Answer $ \\frac{1}{2} \\$ = \\frac{10}{9} $"):
        "free text without \\boxed: no last-LaTeX-block extraction",
    ("$(1,3)$", "${1,3}$"):
        "a tuple is ordered, a set is not: never equal",
    ("$\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}$",
     "The identity matrix is $ \\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix} $."):
        "free text without \\boxed: no last-LaTeX-block extraction",
    ("$\\begin{pmatrix}1 & 2 \\\\3 & 4\\end{pmatrix}$",
     "Special matrix: $ \\left[\\begin{array}{cc}1 & 2 \\\\3 & 4\\end{array}\\right] $"):
        "free text without \\boxed: no last-LaTeX-block extraction",
    ("$x >= 5$", "Therefore $x \\geq 5$ is the solution."):
        "free text without \\boxed: no last-LaTeX-block extraction",
    ("$\\boxed{1}\\boxed{2}$", "$\\boxed{1,2}$"):
        "a reference is one answer: of a reference with several boxes only the last is read",
    ("\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).", "$\\boxed{-2,1}$."):
        "a reference is one answer: of a reference with several boxes only the last is read",
    ("\\boxed{1} papers and \\boxed{2} bins", "$\\boxed{1,2}$"):
        "a reference is one answer: of a reference with several boxes only the last is read",
}

# For the free-text conflicts: the same math, boxed, agrees with the peer label.
PEER_FREE_TEXT_BOXED = [
    ("1,000.99\u20ac", "1000.99"), ("9", "$9$"), ("\\frac{10}{9}", "$10/9$"),
    ("\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}", "$\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}$"),
    ("\\left[\\begin{array}{cc}1 & 2 \\\\3 & 4\\end{array}\\right]", "$\\begin{pmatrix}1 & 2 \\\\3 & 4\\end{pmatrix}$"),
    ("x \\geq 5", "$x >= 5$"),
]


def _peer_answer(s):
    return extract_final_answer(s) if ("\\boxed" in s or "\\fbox" in s) else s


@needs_data
def test_peer_cases_math_verify():
    cases = _load("peer_cases_math_verify.json")
    assert len(cases) == 80
    keys = {(c["gold"], c["pred"]) for c in cases}
    assert set(PEER_CONFLICTS) <= keys, "a listed conflict is not in the peer file"
    agree = 0
    for c in cases:
        # the prediction is scored as a response (boxed unless it has a box: several final boxes
        # may answer a list), the reference is one answer
        pred = c["pred"] if ("\\boxed" in c["pred"] or "\\fbox" in c["pred"]) else f"\\boxed{{{c['pred']}}}"
        ours = reward(pred, _peer_answer(c["gold"])) == 1.0
        key = (c["gold"], c["pred"])
        if key in PEER_CONFLICTS:
            assert ours == (not c["equal"]), f"listed conflict no longer differs: {key}"
        else:
            assert ours == c["equal"], f"unlisted disagreement with peer label: {key}"
            agree += 1
    assert agree == 80 - len(PEER_CONFLICTS)


def test_peer_free_text_conflicts_are_only_about_extraction():
    for pred, gold in PEER_FREE_TEXT_BOXED:
        assert reward(f"We get $\\boxed{{{pred}}}$.", gold) == 1.0, pred


# ---------------------------------------------------------------------------------------------
# hostile inputs: all score 0, each well under a second, no side effect
PWNED = "/tmp/pwned_rlvr"
HOSTILE = {
    "python_code": ("\\boxed{__import__('os').system('touch " + PWNED + "')}", "0"),
    "python_code_gold_too": ("\\boxed{__import__('os').system('touch " + PWNED + "')}",
                             "__import__('os').system('touch " + PWNED + "x')"),
    "dunder_walk": ("\\boxed{().__class__.__bases__[0].__subclasses__()}", "0"),
    "tower_9999": ("\\boxed{9^{9^{9^9}}}", "1"),
    "tower_2s": ("\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "1"),
    "tower_10": ("\\boxed{10^{10^{10}}}", "1"),
    "irrational_tower": ("\\boxed{\\sqrt{2}^{\\sqrt{2}^{\\sqrt{2}^{10000}}}}", "1"),
    "huge_rational_power": ("\\boxed{(\\frac{3}{2})^{100000}}", "1"),
    "factorial_100000": ("\\boxed{100000!}", "1"),
    "factorial_of_power": ("\\boxed{(10^{10})!}", "1"),
    "factorial_factorial": ("\\boxed{((20)!)!}", "1"),
    "binomial": ("\\boxed{\\binom{100000}{50000}}", "1"),
    "nested_parens_3000": ("\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}", "1"),
    "nested_parens_400": ("\\boxed{" + "(" * 400 + "1" + ")" * 400 + "}", "1"),
    "nested_fracs_300": ("\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}", "2"),
    "nested_fracs_3000": ("\\boxed{" + "\\frac{1}{" * 3000 + "2" + "}" * 3000 + "}", "2"),
    "nested_sqrt": ("\\boxed{" + "\\sqrt{" * 200 + "2" + "}" * 200 + "}", "2"),
    "nested_braces": ("\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}", "1"),
    "digits_20000": ("\\boxed{" + "9" * 20000 + "}", "9" * 20000),
    "digits_4400": ("\\boxed{" + "7" * 4400 + "}", "7"),
    "sci_huge": ("\\boxed{1e999999}", "1"),
    "one_megabyte": ("x" * 1_000_000 + " \\boxed{5}", "6"),
    "one_megabyte_of_boxes": ("\\boxed{1}" * 120_000, "2"),
    "unclosed_boxes": ("\\boxed{" * 5000, "1"),
    "unclosed_after_good": ("\\boxed{1} " + "\\boxed{" * 5000 + "1", "1"),
    "integral": ("\\boxed{\\int_0^1 x\\,dx}", "\\frac12"),
    "sum": ("\\boxed{\\sum_{n=1}^{\\infty} \\frac{1}{n^2}}", "\\frac{\\pi^2}{6}"),
    "limit": ("\\boxed{\\lim_{x\\to 0} \\frac{\\sin x}{x}}", "1"),
    "nul_in_box": ("\\boxed{5\x00}", "5"),
    "nul_flood": ("\x00" * 100_000 + "\\boxed{\x005}", "5"),
    "sin_huge": ("\\boxed{\\sin(10^{100})}", "0"),
    "exp_huge": ("\\boxed{e^{10^{10}}}", "1"),
    "many_vars": ("\\boxed{" + "+".join(f"x_{{{i}}}" for i in range(100)) + "}", "1"),
    "many_pm": ("\\boxed{" + "+".join(["1\\pm 1"] * 40) + "}", "1"),
    "many_items": ("\\boxed{" + ",".join(["1"] * 1000) + "}", "1"),
    "huge_root_index": ("\\boxed{\\sqrt[10000]{2}}", "1"),
    "division_by_zero": ("\\boxed{\\frac{1}{0}}", "1"),
    "log_zero": ("\\boxed{\\log 0}", "1"),
    "long_overline": ("\\boxed{0.\\overline{" + "3" * 1000 + "}}", "\\frac13"),
    "whitespace_flood": ("\\boxed{1" + " " * 1990 + "x}", "1"),
    "regex_unit_tail": ("\\boxed{1" + " " * 1000 + "miles" * 190 + "}", "1"),
    "unit_word_flood": ("\\boxed{1" + " cm" * 600 + "}", "1"),
    "unit_words_after_digits": ("\\boxed{" + "1 cm," * 390 + "}", "1"),
    "leading_zero_groups": ("\\boxed{0," + ",".join(["111"] * 480) + "}", "111"),
    "typographic_commas": ("\\boxed{1" + "{,}000" * 300 + "}", "1"),
    "many_semicolons": ("\\boxed{" + ";".join(["1"] * 1000) + "}", "1"),
    "semicolons_in_brackets": ("\\boxed{(" + ";".join(["1"] * 500) + ")}", "1"),
    "ne_chain": ("\\boxed{" + "x \\ne " * 300 + "1}", "1"),
    "ne_tower": ("\\boxed{x \\ne 9^{9^{9^9}}}", "x \\ne 1"),
    "approx_tower": ("\\boxed{9^{9^{9^9}} \\approx 1}", "1"),
    "approx_huge_value": ("\\boxed{\\sqrt{10^{100}} \\approx 1}", "10^{50}"),
    "approx_300_digits": ("\\boxed{\\sqrt2 \\approx 1." + "4" * 290 + "}", "\\sqrt2"),
    "approx_chain": ("\\boxed{\\sqrt2 " + "\\approx 1.41 " * 200 + "}", "\\sqrt2"),
    "many_labels": ("\\boxed{" + ", ".join(f"AB = {i}" for i in range(200)) + "}", "1"),
    "labelled_64": ("\\boxed{" + ", ".join(f"x_{{{i}}} = {i}" for i in range(64)) + "}",
                    ", ".join(f"x_{{{i}}} = {i + 1}" for i in range(64))),
    "colon_chain": ("\\boxed{" + ":".join(["1"] * 290) + "}", "1"),
    "colon_label_chain": ("\\boxed{" + ":".join(f"A_{{{i}}}" for i in range(60)) + " = " + ":".join(["1"] * 60) + "}",
                          ":".join(["2"] * 60)),
    "colon_tower": ("\\boxed{A:B = 9^{9^{9^9}}:1}", "1:1"),
    "nested_abs_names": ("\\boxed{" + "|" * 250 + "AB" + "|" * 250 + " = 1}", "1"),
    "huge_subscript": ("\\boxed{S_{" + "A" * 1900 + "}:S = 7:32}", "7:32"),
    "long_subscripts_ratio": ("\\boxed{" + ":".join(["S_{ABCDEFGH}"] * 40) + " = 1}", "2"),
    "nested_frac_names": ("\\boxed{" + "\\frac{AB}{" * 150 + "CD" + "}" * 150 + " = 2}", "2"),
    "many_groups": ("\\boxed{" + "; ".join("x = 1, y = 2" for _ in range(32)) + "}", "(1,3)"),
    "many_boxes_list_gold": ("\\boxed{1}" * 120_000, ", ".join(str(i) for i in range(64))),
    "boxes_of_tuples_list_gold": ("".join(f"\\boxed{{({i},{i})}}" for i in range(64)) * 50,
                                  ", ".join(f"({i},{i + 1})" for i in range(64))),
    "boxes_of_towers_list_gold": ("\\boxed{9^{9^{9^9}}} \\boxed{100000!} " * 40, "1, 2"),
    "decimal_comma_long": ("\\boxed{1," + "9" * 1990 + "}", "1.5"),
    "decimal_comma_digits_cap": ("\\boxed{1," + "9" * 400 + "}", "1." + "9" * 400),
    "decimal_comma_unit_flood": ("\\boxed{1,5" + " cm" * 600 + "}", "1.5"),
    "metre_power_flood": ("\\boxed{1" + " m\u00b2" * 600 + "}", "1"),
    "superscript_flood": ("\\boxed{x" + "\u00b2" * 1500 + "}", "x"),
    "wide_groups": ("\\boxed{" + ", ".join(f"x_{{{i}}} = 1" for i in range(40)) + "; 2}", "(1,2)"),
    "none": (None, "1"),
    "bytes": (b"\\boxed{1}", "1"),
    "int": (1, "1"),
    "gold_none": ("\\boxed{1}", None),
    "gold_list": ("\\boxed{1}", ["1"]),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_inputs_score_zero_fast(name):
    response, gold = HOSTILE[name]
    if os.path.exists(PWNED):
        os.remove(PWNED)
    t0 = time.perf_counter()
    r = reward(response, gold)
    s = score(response, gold)
    elapsed = time.perf_counter() - t0
    assert r == 0.0
    assert s[0] == 0.0 and s[2] in ("wrong", "no_answer")
    assert elapsed < 1.0, f"{name} took {elapsed:.3f}s"
    assert not os.path.exists(PWNED)
    assert not os.path.exists(PWNED + "x")


def test_hostile_answers_used_as_reference_are_fast_and_safe():
    for name, (response, _gold) in HOSTILE.items():
        ans = extract_final_answer(response)
        if ans is None:
            continue
        t0 = time.perf_counter()
        is_equivalent("1", ans)
        is_equivalent(ans, ans)
        assert time.perf_counter() - t0 < 1.0, name
        assert not os.path.exists(PWNED)
    code = extract_final_answer(HOSTILE["python_code"][0])
    assert not is_equivalent("0", code)
    assert not is_equivalent("", code)


# ---------------------------------------------------------------------------------------------
# TimedVerifier
import verifier_hostile_helpers as helpers  # noqa: E402


def test_timed_verifier_default_scoring_and_persistent_worker():
    with TimedVerifier(timeout_s=10.0) as tv:
        assert tv._ctx.get_start_method() == "spawn"
        assert tv.score("so \\boxed{\\frac12}", "0.5") == (1.0, "\\frac12", "correct")
        assert tv.score("so \\boxed{3}", "4") == (0.0, "3", "wrong")
        assert tv.score("no box", "4") == (0.0, None, "no_answer")
        assert tv.score(None, "4")[0] == 0.0
        assert tv.score("\\boxed{9^{9^{9^9}}}", "1")[0] == 0.0
        assert tv.n_starts == 1  # one persistent worker, spawned once
        pid = tv._proc.pid
        assert tv.score("\\boxed{1}", "1")[0] == 1.0
        assert tv._proc.pid == pid
    assert tv._proc is None


def test_timed_verifier_timeout_crash_and_recovery():
    tv = TimedVerifier(timeout_s=0.5, score_fn=helpers.misbehaving_score)
    try:
        assert tv.score("\\boxed{2}", "2") == (1.0, "2", "correct")
        pid1 = tv.score("PID", "x")[1]

        t0 = time.perf_counter()
        assert tv.score("SLEEP", "1") == (0.0, None, "timeout")
        assert time.perf_counter() - t0 < 5.0
        assert tv.n_timeouts == 1
        assert tv.score("\\boxed{2}", "2") == (1.0, "2", "correct")  # restarted, works again
        pid2 = tv.score("PID", "x")[1]
        assert pid2 != pid1

        assert tv.score("EXIT", "1") == (0.0, None, "crash")
        assert tv.score("\\boxed{3}", "3") == (1.0, "3", "correct")
        pid3 = tv.score("PID", "x")[1]
        assert pid3 != pid2

        assert tv.score("RAISE", "1") == (0.0, None, "crash")
        assert tv.score("\\boxed{4}", "4") == (1.0, "4", "correct")
        assert tv.score("PID", "x")[1] == pid3  # a raising score_fn does not cost a restart
        assert tv.n_crashes == 2
        assert tv.n_starts == 3
    finally:
        tv.close()


def test_timed_verifier_sleeping_score_fn_every_call():
    with TimedVerifier(timeout_s=0.5, score_fn=helpers.sleep_forever) as tv:
        for _ in range(2):
            t0 = time.perf_counter()
            assert tv.score("\\boxed{1}", "1") == (0.0, None, "timeout")
            assert time.perf_counter() - t0 < 5.0
        assert tv.n_timeouts == 2


def test_spawn_context_available():
    assert "spawn" in multiprocessing.get_all_start_methods()


def test_same_results_in_other_processes_with_other_hash_seeds():
    import subprocess

    pairs = [(p, g) for cat in sorted(CATEGORIES) for pairs_ in CATEGORIES[cat] for p, g in pairs_]
    here = [is_equivalent(p, g) for p, g in pairs]
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import verifier; "
        "pairs = json.loads(sys.stdin.read()); "
        "print(json.dumps([verifier.is_equivalent(p, g) for p, g in pairs]))"
    )
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code, str(ROOT)], input=json.dumps(pairs),
                             capture_output=True, text=True, env=env, timeout=120, check=True)
        assert json.loads(out.stdout) == here
