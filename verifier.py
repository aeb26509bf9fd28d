"""Final-answer verifier for RLVR: reward 1.0 when the last boxed answer of a response is
mathematically equivalent to the reference answer, else 0.0.

Model text is never executed: answers go through a hand-written tokenizer and recursive-descent
parser (a LaTeX subset) into a small tree of tuples, which is then computed with exact rationals
(fractions.Fraction) and, for irrational values only, 60-digit mpmath arithmetic in a private
context. No Python code is ever generated from the input, and sympy is not used.

Extraction
    The last ``\\boxed{...}``, ``\\boxed x`` or ``\\fbox{...}`` of the response (only the last
    32768 characters of a response are read). Braces are matched, escaped braces ``\\{ \\}`` do
    not count; nested boxes are unwrapped; surrounding ``$``/``$$``, ``\\[ \\]``, ``\\( \\)`` and
    a trailing period are removed. Empty, unbalanced or missing box: no answer (reward 0, status
    "no_answer", kept apart from "wrong").
    Several final boxes (``score`` and ``reward`` only; ``is_equivalent`` compares one answer):
    when the last box alone is not equal and the reference is a list of k >= 2 parts (k is the
    reference's, never the response's: a labelled tuple's parts, a list's distinct parts), the
    last k boxes, each holding one part and each closing before the next opens, are taken
    together as one list: ``\\boxed{(2,2)} \\text{ and } \\boxed{(6,2)}`` answers ``(2,2), (6,2)``.
    For an unlabelled list they must equal its set exactly (no extra part, none missing, a
    duplicate box is not another part), for a labelled tuple its parts in order. A tuple
    reference ``(3, 4)`` is one part, never such a list: ``\\boxed{a=3} \\boxed{b=4}``, like
    ``\\boxed{3} \\boxed{4}``, is not ``(3, 4)`` (a tuple, labelled or not, is one box). Boxing many
    candidates cannot win: only two readings exist, the last box (which must hold all k parts)
    and the last k boxes (one part each), and a response satisfies at most one of them, so it
    still states one answer; the boxes before the last k are not read at all, and boxing more
    candidates at the end only puts wrong parts among the last k.

Equivalence policy
  * Numbers compare exactly as rationals: integers, ``\\frac12``, ``\\frac{-1}{2}``, ``\\dfrac``,
    ``\\tfrac``, ``1/2``; decimals are exact fractions (``0.75`` == 3/4, ``0.333`` != 1/3,
    ``6.67`` != 20/3); repeating decimals (``0.\\overline{3}``); scientific notation
    (``1.5\\times10^{-5}``, ``1.5e-5``); thousands separators in groups of three (``1,000``,
    ``1{,}000``, ``1\\,000``, ``1 000``, ``42,\\!409``; a comma followed by a space, groups
    that are not three digits, or a first group that starts with 0 make a list instead:
    ``0,111`` is the list 0, 111, never 111; a typographic ``{,}`` or ``,\\!`` is never a list
    separator, so where it is not grouping (``0{,}111``, the decimal comma ``1{,}5``) the answer
    is refused); a decimal comma, decided by the reference: against a reference that is a
    plain decimal (``2.74``, ``0.111``), an answer that is one number whose single comma
    (``,`` or ``{,}``) cannot group thousands reads it as the decimal point (``2,74``,
    ``1000,99``, ``0,111``, ``1{,}5``, a currency sign or unit around it too), while ``2,740``
    still groups thousands (!= 2.74) and against any other reference a comma keeps the meaning
    above (``1,5`` != ``\\frac32``: a list); mixed numbers (``10\\frac{1}{12}`` and
    ``10 \\frac{1}{12}`` are 121/12, but ``10\\cdot\\frac1{12}`` is 10/12, and an improper
    ``2\\frac{3}{2}`` is the product 3); leading ``+``, ``-0``,
    ``.5``, ``12.0``.
  * Irrational values (radicals, roots of any index up to 64, ``\\pi``, ``e``, trig/log functions) compare
    exactly where an exact form exists (perfect powers) or by 60-digit arithmetic with a RELATIVE
    tolerance of 1e-30 (absolute only when both sides are below 1e-50): ``2\\sqrt2`` == ``\\sqrt8``,
    ``2.414`` != ``1+\\sqrt2``, ``10^{-21}`` != ``10^{-20}``. (So only a decimal written to
    30+ correct significant digits could pass for an irrational value.)
  * Expressions with variables compare by value at four fixed, deterministic points; both sides
    must use exactly the same variable names: ``(x+1)^2`` == ``x^2+2x+1``, ``p-q`` != ``q-p``.
    ``e`` is Euler's number and ``i`` the imaginary unit; ``\\log`` without a base is natural.
  * Presentation is ignored: ``\\left``/``\\right``, spacing commands, ``\\displaystyle``,
    ``\\text{}``/``\\mathrm{}``/``\\mbox{}`` around a number or a unit word after it
    (``2 \\text{ euros}``, ``10\\text{ cm}^2``), ``^\\circ`` and the degree sign, ``\\$``, ``\\%``
    (a percent answers the number written: ``10\\%`` == ``10``, never ``0.1``, both ways, since a
    reference often drops the sign and cannot say which reading it means, and ``0.28`` for
    "what percent" is the unconverted slip a policy should not be paid for), the square or
    cubic metre written with a superscript sign right after a number (``1,000.99m²``,
    ``5 m³``: the one single letter read as a unit, as the sign is unit typography; ``m^2`` stays
    a variable squared, and any other ``²``/``³`` is a power: ``x²`` == ``x^2``),
    and a list of bare spelled-out units and percent words (``125 miles``, ``12 centimeters``,
    ``4 square feet``, ``60 miles per hour``, ``28 percent``, ``5 pct``, ``5 percentage points``)
    right after a quantity (a number, a closing bracket, ``\\pi`` or a one-letter variable:
    ``2x+6 cm``) at the end of the answer or of a list item (``3 cm, 4 cm``). A bare single
    letter is always a variable, never a unit: ``2c`` != ``2``, ``5 g`` != ``5``, ``a+c`` !=
    ``a+d``; other words are not units (``5 apples`` != ``5``), and a word that follows no
    quantity stays (the text answer ``percentage points``).
  * ``x = 5`` answers ``5``: a label that names the quantity is presentation. Labels are a single
    variable with a constant right side, a function like ``f(x)`` or ``f(2)``, a tuple of
    variables, a segment, angle or figure name with one constant right side (``AB = 4``,
    ``\\overline{AB}``, ``\\angle ABC``, ``m\\angle A``; 2 to 4 capitals, ``BA`` the same as ``AB``;
    ``xy = 4`` and ``AB = 2x`` stay equations), or a ``\\text{}`` word (``\\text{Area} = 12``);
    also, with a constant right side, a length ``|AB|`` (``|x| = 1`` stays an equation: x is 1 or
    -1), a fraction of two figure names or lengths (``\\frac{NO}{BO} = \\frac{1}{\\sqrt6}`` or
    ``NO/BO``, the ratio NO:BO; ``\\frac{x}{y} = 2`` stays an equation) and a ratio of names, each a
    variable (subscripted too) or a figure name or length (``A:B = 1``, ``V_{1}:V_{2} = 11:21``,
    ``S_{MBCN}:S = 7:32``, ``PA:AB = 3:1``; the right side one value or a ratio of as many terms:
    ``A:B = 1:2:3`` refuses; ``2A:B``, ``ab:c`` are no names). A
    single answer drops its label (``y = 5`` == ``5``).
    A list whose parts all carry distinct labels (``x = 5, y = 5``, ``AB = 4, CD = 5``, any of the
    label kinds above, and an equation ``y_1 = 2x + 1`` whose left side is a lone variable) is one
    labelled tuple of (label, value): it equals the same labels with equal values in any order
    (``y = 5, x = 5``, ``(x, y) = (5, 5)``), or a written list or a tuple of as many values in the
    reference's order (``5, 5``, ``(5, 5)``, ``3, y = 4`` for ``x = 3, y = 4``). It never equals
    fewer parts (``5``, ``x = 5``), the values reordered (``4, 3`` != ``x = 3, y = 4``), a
    duplicate dropped, a set ``\\{3, 4\\}`` or a ``\\pm``: a reward for part of a labelled answer
    is what a policy learns to write. The rule holds both ways: a labelled answer against an
    unlabelled reference tuple drops its labels and must have as many parts with equal values in
    the order written (``a = 3, b = 4`` == ``(3, 4)``, ``u = 5, v = 1`` == ``(5, 1)``), never
    fewer or more (``a = 3``, ``3``, ``a = 3, b = 4, c = 5`` != ``(3, 4)``), the values
    reordered (``a = 4, b = 3`` != ``(3, 4)``; ``b = 4, a = 3`` reads (4, 3), so != ``(3, 4)``),
    a duplicate dropped (``a = 3`` != ``(3, 3)``), a set, a ``\\pm`` or another bracket
    (``[3, 4]``). Only a labelled tuple is read so: a list with an unlabelled part (``a = 3, 4``)
    is a written list, and a written list never answers a tuple (``3, 4`` != ``(3, 4)``). A
    labelled answer against an unlabelled reference list drops its labels (``AB = 4, CD = 5`` ==
    ``4, 5``, unordered like the list), never against one value (``x = 5, y = 5`` != ``5``);
    ``(x, y) = (5, 5)`` is the tuple ``(5, 5)``, its labels counting against a labelled tuple.
    Where the labels repeat (``x = 1, x = 2``, solutions of one variable) or a value is a list
    (``x = \\pm 2, y = 3``), the list is unordered and where both parts carry a label the labels
    must agree (``x = 1, y = 2`` !=
    ``x = 2, y = 1``, ``AB = 4, CD = 5`` != ``AB = 5, CD = 4``). Two labels that name ratios must
    agree even alone, a reversed ratio being the usual slip: ``A:B = 2:3`` != ``B:A = 2:3``,
    ``\\frac{NO}{BO} = \\frac12`` != ``\\frac{BO}{NO} = \\frac12``. ``k = -\\frac{33}{2} = -16.5`` is
    accepted because all parts agree; a chain whose parts disagree (``5=3``, ``x=5=3``) is a
    false statement and wrong.
  * An exact value followed by an approximation (``\\frac{\\sqrt3}{3} \\approx 0.577``,
    ``x = 2\\sqrt{30} \\approx 11``, the sign too) answers its exact part, provided the plain
    decimal is a correct rounding of it: the exact value rounded to the decimal's own number of
    digits after the point, either direction only at an exact tie (``\\frac18 \\approx 0.12`` and
    ``0.13``); ``0.58`` rounds 0.57735 correctly, ``0.57`` and ``0.5773`` (truncations) and
    ``0.578`` do not. A wrong rounding makes the whole answer wrong. Checked up to 30 digits
    after the point and values below 10^15, else refused. ``x \\approx 11`` alone, or the decimal
    alone, against an exact reference stays wrong.
  * A ratio ``7:32`` (``a:b:c``, ``\\!:\\!`` too) is ordered and compared term by term, never as a
    number: ``7:32`` != ``14:64``, ``7:32`` != ``\\frac{7}{32}``, since ``9:24`` may be a time (so
    ``05:00`` == ``5:00``, ``9:24`` != ``3:8``); a ratio is never a tuple. A word after a ratio
    is no unit (``8:34 \\text{ a.m.}`` != ``8\\!:\\!34 \\text{ p.m.}`` != ``8:34``): such an answer
    refuses, and as a reference compares as a string.
  * Tuples and points are ordered; intervals compare both endpoints AND bracket types
    (``[0,3)`` != ``[0,3]`` != ``(0,3)``); ``(a,b)`` is both the point and the open interval;
    unions of intervals compare as unordered sets of pieces; single-variable inequalities become
    intervals (``-793 < a < 10`` == ``(-793,10)``, ``x \\ge 5`` == ``[5,\\infty)``), and so does
    a linear ``\\ne`` (``\\neq``, ``!=``, the sign): ``x \\ne 3`` ==
    ``(-\\infty,3)\\cup(3,\\infty)``, never ``3`` or ``x = 3``; ``x \\in S`` answers ``S``.
  * Comma (or semicolon) lists and ``\\{...\\}`` sets are unordered and must match exactly (no
    subset, no superset; duplicates collapse; a one-element set equals its element; a list of
    distinct labels is the labelled tuple above):
    ``2, 3, \\text{ and } 4`` is the list 2, 3, 4; ``a \\pm b`` is the list a+b, a-b (so
    ``\\pm 2`` is wrong for ``2``). A tuple is never equal to a set. A semicolon separates like a
    comma, at the top level and inside brackets (``1; 2`` == ``1, 2``, ``(1; 2)`` == ``(1, 2)``,
    ``[0; 3)`` == ``[0,3)``), but where semicolons separate, a comma may be a decimal mark: no
    comma groups thousands then, and a level that mixes the two separators is refused
    (``1,5; 2``, ``(1,5; 2)``, ``1,000; 2``), except solutions written as groups of labelled
    values: ``p=5,q=2;p=7,q=2`` is the list of tuples ``(5,2), (7,2)``, each group the tuple of
    its values in the order written, as ``(p,q) = (5,2)`` is; every value a constant, the same
    single-variable labels in the same order in every group (``p=5,q=2;q=2,p=7`` refuses).
  * Matrices (``pmatrix``, ``bmatrix``, ``matrix``, ``array``) compare entry by entry; a single
    row or column matrix also equals the tuple of its entries.
  * Numbers with a base subscript (``204_5``) equal only the same value in the same base.
  * Text answers (``\\text{Evelyn}``, ``\\text{(C)}``) compare case-insensitively after
    unwrapping ``\\text``, spaces and a pair of parentheses: ``\\text{(C)}`` == ``C``.
  * Equations with variables (``y=2x+3``, ``5x-7y+11z+4=0``) compare as equations: same
    variables and left-minus-right sides proportional by a non-zero constant. An equation whose
    left side is a lone variable that its right side does not use names that expression, so it
    answers the bare expression and the other way round (``y = x^2+2x+1`` == ``(x+1)^2``);
    ``x = 2x + 3``, ``2y = 4x + 6`` or ``x^2+2x+1 = y`` against ``2x+3`` / ``x^2+2x+1`` stay wrong.
  * A reference answer that cannot be parsed falls back to exact equality of normalized strings
    (whitespace, ``$``, ``\\left``/``\\right`` and spacing removed); it never rewards anything else.

Safety (bounded by construction)
    Caps: response 32768 chars (tail kept), answer 2000 chars, 600 tokens, nesting depth 40,
    1500 tree nodes, 300-digit literals, exact results up to 12000 bits, integer exponents whose
    result would exceed that are refused (never computed), factorials up to 1000!, irrational
    magnitudes within 10^±4000, trig arguments up to 10^6, 16 variables, 64 list items (and 64
    terms of a ratio, and the last 64 boxes at most for several final boxes).
    Anything beyond a cap, any unknown command (``\\int``, ``\\sum``, ``\\lim``, ...) and any
    control character is refused: the answer scores 0. No randomness and no dependence on hash
    order: same input, same output in every process. ``TimedVerifier`` adds a hard wall-clock
    limit by scoring in a persistent spawned worker process that is killed and restarted on
    overrun.

Step checkers (credit: steps)
    A verdict per line of a response (True, False or None), by the same tokenizer, parser and
    bounds: ``arithmetic`` reads a line that is ``expression = number`` and nothing else
    (arithmetic_verdict); ``grounded`` reads the arithmetic statements inside lines of prose and
    holds their inputs to the problem's numbers (grounded_verdicts). docs/verifier.md, "Step
    checkers", says what each reads; ``TimedVerifier(step_checker=...).check_steps(lines, record,
    problem)`` runs one in the worker.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from fractions import Fraction

from mpmath.ctx_mp import MPContext

__all__ = ["extract_final_answer", "is_equivalent", "reward", "score", "TimedVerifier"]

# ----------------------------------------------------------------------------------------------
# limits
MAX_RESPONSE_CHARS = 32768
MAX_ANSWER_CHARS = 2000
MAX_TOKENS = 600
MAX_DEPTH = 40
MAX_NODES = 1500
MAX_LITERAL_DIGITS = 300
MAX_BITS = 12000
MAX_EXPONENT = 100000
MAX_FACTORIAL = 1000
MAX_BINOM_N = 2000
MAX_ROOT_INDEX = 64
MAX_MP_MAG_BITS = 13300  # about 10^4000
MAX_TRIG_ARG = 10 ** 6
MAX_EXP_ARG = 9000
MAX_VARS = 16
MAX_ITEMS = 64
MAX_PM_EXPANSION = 16
MAX_APPROX_PLACES = 30  # digits after the point of a checked approximation
MAX_APPROX_MAG = 10 ** 15  # 60-digit values decide roundings exactly below this

_CTX = MPContext()
_CTX.dps = 60
_REL_TOL = _CTX.mpf(10) ** -30
_TINY = _CTX.mpf(10) ** -50


class _Refuse(Exception):
    """The text is outside the supported, bounded subset."""


class _Undefined(Exception):
    """A value is undefined (division by zero, log of zero, ...)."""


class _Inf:
    __slots__ = ("sign",)

    def __init__(self, sign):
        self.sign = sign


# ----------------------------------------------------------------------------------------------
# extraction
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_RE = re.compile(r"\\.|[{}]", re.S)
_CTRL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _skip_space(s, i):
    """Index of the first character at or after i that is not a space, tab or newline."""
    n = len(s)
    while i < n and s[i] in " \t\n\r":
        i += 1
    return i


def _match_group(s, i):
    """s[i] == '{'; index just after the matching '}', or -1 when unbalanced."""
    depth = 0
    for m in _BRACE_RE.finditer(s, i):
        t = m.group()
        if t == "{":
            depth += 1
        elif t == "}":
            depth -= 1
            if depth == 0:
                return m.end()
    return -1


def _strip_wrappers(s):
    for _ in range(12):
        old = s
        s = s.strip()
        if s.endswith("."):
            s = s[:-1].rstrip()
        if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
            s = s.strip("$")
        elif s.startswith("\\[") and s.endswith("\\]"):
            s = s[2:-2]
        elif s.startswith("\\(") and s.endswith("\\)"):
            s = s[2:-2]
        else:
            m = _BOX_RE.match(s)
            if m:
                k = _skip_space(s, m.end())
                if k < len(s) and s[k] == "{" and _match_group(s, k) == len(s):
                    s = s[k + 1:-1]
        if s == old:
            break
    return s.strip()


def extract_final_answer(text):
    """Content of the last \\boxed{...} / \\boxed x / \\fbox{...} of ``text``, or None."""
    try:
        return _extract(text)
    except Exception:  # never raise for any input
        return None


def _extract(text):
    if not isinstance(text, str):
        return None
    if len(text) > MAX_RESPONSE_CHARS:
        text = text[-MAX_RESPONSE_CHARS:]
    last = None
    for last in _BOX_RE.finditer(text):
        pass
    if last is None:
        return None
    return _box_content(text, last)[0]


def _box_content(text, box):
    """(content, end) of the box whose command ``box`` (a match of _BOX_RE) starts, or
    (None, end) when it is empty or unbalanced."""
    n = len(text)
    k = _skip_space(text, box.end())
    if k < n and text[k] == "{":
        e = _match_group(text, k)
        if e < 0:
            return None, n
        content = text[k + 1:e - 1]
    else:
        m = re.match(r"[^\s$]+", text[k:k + 200])
        if not m:
            return None, k
        content = m.group().rstrip(".,;")
        e = k + m.end()
    content = _strip_wrappers(content)
    if not content or _CTRL_RE.search(content):
        return None, e
    return content, e


# ----------------------------------------------------------------------------------------------
# string normalization
_UNICODE = [
    ("\u2212", "-"), ("\u2013", "-"), ("\u00d7", "\\times "), ("\u22c5", "\\cdot "),
    ("\u00b7", "\\cdot "), ("\u00f7", "\\div "), ("\u2264", "\\le "), ("\u2265", "\\ge "),
    ("\u2260", "\\ne "), ("\u2248", "\\approx "),
    ("\u221e", "\\infty "), ("\u03c0", "\\pi "), ("\u221a", "\\sqrt "),
    ("\u222a", "\\cup "), ("\u00b1", "\\pm "), ("\u00b0", ""), ("\u20ac", ""), ("\u00a3", ""),
    ("\u00b2", "^2"), ("\u00b3", "^3"),
]
# The square or cubic metre written with a superscript sign right after a number (1,000.99m²,
# 5 m³), at the end of the answer or of a list item, is a unit: the one single letter read as a
# unit, since that sign is unit typography (m^2 stays a variable squared, and so does x²)
_METRE_POWER_RE = re.compile(
    "(?<=[0-9}]) ?m[\u00b2\u00b3](?![A-Za-z0-9])(?=\\s*(?:$|[,;)\\]]|\\\\\\}))")
_LEFTRIGHT_RE = re.compile(
    r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg)"
    r"(?![A-Za-z])\s*(\\[{}|]|\\[lr](?:brace|vert|angle|floor|ceil)|[()\[\]|.])")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|\\degree(?![A-Za-z])")
_TEXT_AND_RE = re.compile(
    r"\\(?:text|textnormal|textrm|mbox|mathrm)\s*\{\s*(?:and|or)\s*\}", re.I)
_BARE_AND_RE = re.compile(r"(?<![A-Za-z\\])(?:and|or)(?![A-Za-z])")
_SPACING_RE = re.compile(
    r"\\\\|\\(?:[,;: !]|q?quad(?![A-Za-z])|enspace(?![A-Za-z])|thinspace(?![A-Za-z]))|~")
_COMMAS_RE = re.compile(r",(?:\s*,)+")
_SEMIS_RE = re.compile(r";(?:\s*;)+")
# A typographic comma ({,} or ",\!") is number punctuation, never a list separator; _clean marks
# it with a control character (refused in any input, so it cannot be forged) until the thousands
# pass has used it. One left over is not grouping (``0{,}5`` is a decimal comma) and refuses.
_TYPO_COMMA = "\x01"
# The first group of a thousands grouping never starts with 0: ``0,111`` and ``012,345`` are
# lists (like ``1,2``), never 111 or 12345.
_THOU_RE = re.compile(r"(?<![0-9.,\x01])[1-9][0-9]{0,2}(?:[,\x01][0-9]{3})+(?![0-9])")
_SPACE_THOU_RE = re.compile(r"(?<![0-9.])[1-9][0-9]{0,2}(?: [0-9]{3})+(?![0-9])")
# Spelled-out units and percent words, read only right after a number. Never a single letter
# (2c, 2m, 5 g stay products with a variable); words that are not units (apples) stay letters.
_UNIT_WORDS = (
    r"percentage\s+points?|percentages?|percent|per\s*cent|pct|points?|pts|"
    r"degrees?|deg|radians?|rad|dollars?|cents?|euros?|yuan|yen|pounds?|rupees?|"
    r"units?|people|persons?|students|ways|"
    r"miles?|inches|inch|feet|foot|ft|yards?|yds?|meters?|metres?|centimeters?|centimetres?|"
    r"cm|millimeters?|millimetres?|mm|kilometers?|kilometres?|km|"
    r"kilograms?|kg|grams?|milligrams?|mg|ounces?|oz|lbs?|tons?|tonnes?|"
    r"liters?|litres?|milliliters?|millilitres?|ml|gallons?|quarts?|pints?|cups?|acres?|"
    r"hectares?|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|years?|yrs?|"
    r"mph|kph")
# After a digit, }, ), ], !, \pi or a one-letter variable and a space (2x+6 cm), never after a
# longer word (the text answer 'percentage points' keeps both words) nor a backslash (\sec,
# \min are commands), and before the end of the answer or of a list item or bracket, so only the
# unit of a quantity is dropped ('125 miles', '3 cm, 4 cm', '(2 ft, 3 ft)', '5 miles per hour').
# Each candidate start is anchored by the look-behind, so the scan stays linear.
_UNIT_RE = re.compile(
    r"(?:(?<=[0-9})\]!])|(?<=\\pi)|(?<=(?<![A-Za-z\\])[A-Za-z] ))\s*"
    r"(?:(?:square|sq\.?|cubic)\s+)?(?:" + _UNIT_WORDS + r")"
    r"(?:\s+per\s+(?:" + _UNIT_WORDS + r"))?(?![A-Za-z])(?:\s*\^\s*\{?\s*[23]\s*\}?)?"
    r"(?=\s*(?:$|[,;)\]]|\\\}))", re.I)


def _join_thousands(s):
    if "," not in s and _TYPO_COMMA not in s:
        return s
    if ";" in s:
        # semicolons separate items where the comma is the decimal mark (1,5; 2): no comma
        # groups thousands then, and one left over refuses (separators of two kinds)
        return s
    depth = [0] * (len(s) + 1)
    d = 0
    i = 0
    while i < len(s):
        c = s[i]
        depth[i] = d
        if c == "\\" and i + 1 < len(s):
            if s[i + 1] == "{":
                d += 1
            elif s[i + 1] == "}":
                d -= 1
            depth[i + 1] = d
            i += 2
            continue
        if c in "([":
            d += 1
        elif c in ")]":
            d -= 1
        i += 1

    def repl(m):
        # plain commas group only at the top level (inside brackets they separate entries);
        # typographic ones group everywhere
        g = m.group()
        if depth[m.start()] == 0 or "," not in g:
            return g.replace(",", "").replace(_TYPO_COMMA, "")
        return g

    return _THOU_RE.sub(repl, s)


def _clean(s):
    """Presentation-level normalization of one answer string (raises _Refuse)."""
    if not isinstance(s, str) or len(s) > MAX_ANSWER_CHARS or _CTRL_RE.search(s):
        raise _Refuse
    s = _strip_wrappers(re.sub(r"\s+", " ", s))
    if "m\u00b2" in s or "m\u00b3" in s:
        s = _METRE_POWER_RE.sub("", s)
    for a, b in _UNICODE:
        if a in s:
            s = s.replace(a, b)
    s = _LEFTRIGHT_RE.sub(lambda m: "" if m.group(1) == "." else m.group(1), s)
    s = re.sub(r"\\(?:displaystyle|textstyle|limits|nolimits|hline)(?![A-Za-z])", " ", s)
    s = re.sub(r"\\(?:dfrac|tfrac|cfrac)(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\(?:dbinom|tbinom)(?![A-Za-z])", r"\\binom", s)
    s = re.sub(r"\\(?:hspace|vspace|phantom|hphantom)\*?\s*\{[^{}]*\}", " ", s)
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.replace("{,}", _TYPO_COMMA)
    s = re.sub(r",\s*\\!\s*", _TYPO_COMMA, s)
    s = _SPACING_RE.sub(lambda m: m.group() if m.group() == "\\\\" else
                        ("" if m.group() == "\\!" else " "), s)
    # "and" joins items with the answer's own separator, so 1; 2 and 3 stays one kind of list
    sep = ";" if ";" in s else ","
    s = _TEXT_AND_RE.sub(sep, s)
    s = _BARE_AND_RE.sub(sep, s)
    s = _COMMAS_RE.sub(",", s)
    s = _SEMIS_RE.sub(";", s)
    s = _join_thousands(s)
    s = _SPACE_THOU_RE.sub(lambda m: m.group().replace(" ", ""), s)
    s = _UNIT_RE.sub("", s)
    s = s.strip()
    if s.endswith("."):
        s = s[:-1].strip()
    return s


_TEXTCMD_NAME_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|texttt|textnormal|textup|mbox|hbox|mathrm|"
    r"mathbf|mathit|mathsf|emph|operatorname)(?![A-Za-z])")


def _text_key(s):
    if not isinstance(s, str) or len(s) > MAX_ANSWER_CHARS:
        return None
    s = _strip_wrappers(s)
    s = _TEXTCMD_NAME_RE.sub("", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])|\\[,;:! ]|~", "", s)
    s = re.sub(r"[\s{}$]", "", s).lower()
    s = s.rstrip(".")
    while len(s) >= 2 and s[0] == "(" and s[-1] == ")" and "," not in s:
        s = s[1:-1]
    return s


def _norm_string(s):
    try:
        t = _clean(s)
    except _Refuse:
        t = s if isinstance(s, str) else ""
    return re.sub(r"\s+", "", t)


# ----------------------------------------------------------------------------------------------
# tokenizer: tokens are (kind, value)
_TEXT_CMDS = {"text", "textbf", "textit", "textrm", "textsf", "texttt", "textnormal", "textup",
              "mbox", "hbox", "mathrm", "emph", "operatorname"}
_TRANSPARENT_CMDS = {"mathbf", "mathit", "boldsymbol", "bm", "mathsf", "displaystyle",
                     "textstyle", "limits", "nolimits", "hline", "left", "right"}
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
          "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau",
          "upsilon", "phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta",
          "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega", "ell"}
_FUNCS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh",
          "cosh", "tanh", "ln", "log", "exp"}
_REL_CMDS = {"le": "le", "leq": "le", "leqslant": "le", "ge": "ge", "geq": "ge",
             "geqslant": "ge", "lt": "lt", "gt": "gt", "ne": "ne", "neq": "ne", "in": "in",
             "approx": "approx", "sim": "bad", "equiv": "bad", "to": "bad", "rightarrow": "bad",
             "Rightarrow": "bad", "implies": "bad", "subset": "bad", "subseteq": "bad"}
_MATRIX_ENVS = {"pmatrix", "bmatrix", "Bmatrix", "matrix", "smallmatrix", "array"}
_NUM_RE = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_OVERLINE_RE = re.compile(r"\s*\\overline\s*\{\s*([0-9]+)\s*\}")
_SCI_RE = re.compile(r"[eE]([+-]?[0-9]{1,6})(?![A-Za-z0-9])")
_NUMERIC_TEXT_RE = re.compile(r"[0-9.,\s+\-]+")
_CMD_RE = re.compile(r"[A-Za-z]+")


def _tokenize(s, toks=None):
    if toks is None:
        toks = []
    i = 0
    n = len(s)
    while i < n:
        if len(toks) > MAX_TOKENS:
            raise _Refuse
        c = s[i]
        if c in " \t\n\r":
            i += 1
            continue
        if "0" <= c <= "9" or (c == "." and i + 1 < n and "0" <= s[i + 1] <= "9"):
            m = _NUM_RE.match(s, i)
            t = m.group()
            i = m.end()
            if len(t) > MAX_LITERAL_DIGITS:
                raise _Refuse
            rep = None
            sci = None
            if "." in t:
                m2 = _OVERLINE_RE.match(s, i)
                if m2:
                    rep = m2.group(1)
                    if len(rep) > MAX_LITERAL_DIGITS:
                        raise _Refuse
                    i = m2.end()
            if rep is None:
                m3 = _SCI_RE.match(s, i)
                if m3:
                    sci = int(m3.group(1))
                    i = m3.end()
            toks.append(("num", (t, rep, sci)))
            continue
        if ("a" <= c <= "z") or ("A" <= c <= "Z"):
            toks.append(("let", c))
            i += 1
            continue
        if c == "\\":
            if i + 1 >= n:
                raise _Refuse
            m = _CMD_RE.match(s, i + 1)
            if m:
                name = m.group()
                i = m.end()
            else:
                name = s[i + 1]
                i += 2
            if name in _TEXT_CMDS:
                i = _skip_space(s, i)
                if i < n and s[i] == "{":
                    e = _match_group(s, i)
                    if e < 0:
                        raise _Refuse
                    content = s[i + 1:e - 1]
                    i = e
                else:
                    raise _Refuse
                c2 = content.strip()
                if not c2:
                    continue
                if _NUMERIC_TEXT_RE.fullmatch(c2) and re.search(r"[0-9]", c2):
                    _tokenize(c2, toks)
                elif c2.lower() in ("and", "or"):
                    toks.append(("op", ","))
                else:
                    toks.append(("text", c2))
                continue
            if name in ("begin", "end"):
                m = re.compile(r"\s*\{\s*([A-Za-z]+\*?)\s*\}").match(s, i)
                if not m:
                    raise _Refuse
                env = m.group(1)
                i = m.end()
                if name == "begin" and env == "array":
                    i = _skip_space(s, i)
                    if i < n and s[i] == "{":
                        e = _match_group(s, i)
                        if e < 0:
                            raise _Refuse
                        i = e
                toks.append((name, env))
                continue
            if name in _TRANSPARENT_CMDS:
                continue
            if name == "\\":
                toks.append(("row", None))
            elif name in ("{", "lbrace"):
                toks.append(("lset", None))
            elif name in ("}", "rbrace"):
                toks.append(("rset", None))
            elif name in ("langle",):
                toks.append(("op", "("))
            elif name in ("rangle",):
                toks.append(("op", ")"))
            elif name in ("cdot", "times", "ast"):
                toks.append(("op", "*"))
            elif name == "div":
                toks.append(("op", "/"))
            elif name in ("pm", "mp"):
                toks.append(("pm", name))
            elif name == "cup":
                toks.append(("cup", None))
            elif name in ("vert", "lvert", "rvert", "|", "mid"):
                toks.append(("op", "|"))
            elif name in _REL_CMDS:
                toks.append(("rel", _REL_CMDS[name]))
            elif name in (",", ";", ":", " ", "!", "quad", "qquad"):
                continue
            else:
                toks.append(("cmd", name))
            continue
        if c in "<>!" and i + 1 < n and s[i + 1] == "=":
            toks.append(("rel", {"<": "le", ">": "ge", "!": "ne"}[c]))
            i += 2
            continue
        if c == "=":
            toks.append(("rel", "eq"))
        elif c == "<":
            toks.append(("rel", "lt"))
        elif c == ">":
            toks.append(("rel", "gt"))
        elif c in "+-*/^_()[]{},;:|!&":
            toks.append(("op", c))
        else:
            toks.append(("bad", c))
        i += 1
    if len(toks) > MAX_TOKENS:
        raise _Refuse
    return toks


def _num_value(val):
    t, rep, sci = val
    if "." in t:
        ip, fp = t.split(".")
        ip = ip or "0"
        if rep:
            v = Fraction(int(ip + fp + rep) - int(ip + fp), 10 ** len(fp) * (10 ** len(rep) - 1))
        else:
            v = Fraction(int(ip + fp), 10 ** len(fp))
    else:
        v = Fraction(int(t))
    if sci is not None:
        if abs(sci) > 3000:
            raise _Refuse
        v = v * Fraction(10) ** sci
    return v


# ----------------------------------------------------------------------------------------------
# parser: nodes are tuples
#   ('n', Fraction) ('k', value) ('v', name) ('c', 'pi'|'e'|'i'|'inf')
#   ('+', (nodes)) ('*', (nodes)) ('neg', a) ('/', a, b) ('^', a, b) ('sqrt', a) ('root', a, idx)
#   ('!', a) ('abs', a) ('floor', a) ('ceil', a) ('binom', a, b) ('f', name, arg, base)
#   ('pm', a_or_None, b, 'pm'|'mp') ('seq', lb, rb, items) ('set', items) ('mat', rows)
#   ('based', base, value)
_SEPARATORS = (("op", ","), ("op", ";"))
_COLON = ("op", ":")
_OPENERS = {("op", "("), ("op", "["), ("op", "{"), ("lset", None)}
_CLOSERS = {("op", ")"), ("op", "]"), ("op", "}"), ("rset", None)}


class _Parser:
    def __init__(self, toks):
        self.t = list(toks)
        self.i = 0
        self.depth = 0
        self.nodes = 0
        self.abs_depth = 0
        self.fn_arg = 0

    # helpers
    def peek(self, k=0):
        j = self.i + k
        return self.t[j] if j < len(self.t) else ("eof", None)

    def take(self):
        tok = self.peek()
        if tok[0] == "eof":
            raise _Refuse
        self.i += 1
        return tok

    def expect(self, tok):
        if self.take() != tok:
            raise _Refuse

    def mk(self, node):
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _Refuse
        return node

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Refuse

    def leave(self):
        self.depth -= 1

    def at_end(self):
        return self.i >= len(self.t)

    # grammar
    def expression(self):
        self.enter()
        terms = []
        node = None
        tok = self.peek()
        if tok == ("op", "+"):
            self.take()
        if self.peek()[0] == "pm":
            kind = self.take()[1]
            node = self.mk(("pm", None, self.term(), kind))
        else:
            terms.append(self.term())
        while True:
            tok = self.peek()
            if tok == ("op", "+"):
                self.take()
                terms.append(self.term())
            elif tok == ("op", "-"):
                self.take()
                terms.append(self.mk(("neg", self.term())))
            elif tok[0] == "pm":
                self.take()
                left = self._sum(node, terms)
                terms = []
                node = self.mk(("pm", left, self.term(), tok[1]))
            else:
                break
        self.leave()
        return self._sum(node, terms)

    def _sum(self, node, terms):
        parts = ([node] if node is not None else []) + terms
        if len(parts) == 1:
            return parts[0]
        return self.mk(("+", tuple(parts)))

    def term(self):
        self.enter()
        node = self.unary()
        while True:
            tok = self.peek()
            if tok == ("op", "*"):
                self.take()
                node = self.mk(("*", (node, self.unary())))
            elif tok == ("op", "/"):
                self.take()
                node = self.mk(("/", node, self.unary()))
            else:
                break
        self.leave()
        return node

    def unary(self):
        tok = self.peek()
        if tok == ("op", "-"):
            self.enter()
            self.take()
            node = self.mk(("neg", self.unary()))
            self.leave()
            return node
        if tok == ("op", "+"):
            self.enter()
            self.take()
            node = self.unary()
            self.leave()
            return node
        return self.implicit()

    def can_start_factor(self, tok):
        k, v = tok
        if k == "let" or k == "num":
            return True
        if k == "cmd":
            if self.fn_arg and v in _FUNCS:
                return False
            return v in _FUNCS or v in _GREEK or v in ("pi", "frac", "sqrt", "binom", "lfloor",
                                                       "lceil")
        if k == "op":
            if v in "({":
                return True
            if v == "|":
                return self.abs_depth == 0
        return False

    def implicit(self):
        self.enter()
        first = self.peek()
        node = self.power()
        int_lit = (first[0] == "num" and first[1][1] is None and first[1][2] is None
                   and "." not in first[1][0] and node[0] == "n")
        factors = [node]
        while self.can_start_factor(self.peek()):
            if self.peek()[0] == "num":
                raise _Refuse  # two numbers side by side: ambiguous
            g = self.power()
            if (len(factors) == 1 and int_lit and g[0] == "/" and g[1][0] == "n"
                    and g[2][0] == "n" and g[1][1].denominator == 1
                    and g[2][1].denominator == 1 and 0 < g[1][1] < g[2][1]):
                factors[0] = self.mk(("n", factors[0][1] + g[1][1] / g[2][1]))
                int_lit = False
                continue
            int_lit = False
            factors.append(g)
        self.leave()
        if len(factors) == 1:
            return factors[0]
        return self.mk(("*", tuple(factors)))

    def power(self):
        self.enter()
        base = self.postfix()
        if self.peek() == ("op", "^"):
            self.take()
            exp = self.arg(exponent=True)
            base = self.mk(("^", base, exp))
            if self.peek() == ("op", "^"):
                raise _Refuse
            while self.peek() == ("op", "!"):
                self.take()
                base = self.mk(("!", base))
        self.leave()
        return base

    def postfix(self):
        node = self.primary()
        while self.peek() == ("op", "!"):
            self.take()
            node = self.mk(("!", node))
        return node

    def arg(self, exponent=False):
        """A TeX macro argument: {group}, one digit (or a whole number in an exponent), a
        letter, or a command."""
        self.enter()
        tok = self.peek()
        if tok == ("op", "{"):
            self.take()
            node = self.expression()
            self.expect(("op", "}"))
        elif tok[0] == "num":
            t, rep, sci = tok[1]
            if exponent or len(t) == 1 or not t.isdigit() or rep or sci is not None:
                self.take()
                node = self.mk(("n", _num_value(tok[1])))
            else:
                self.t[self.i] = ("num", (t[1:], None, None))
                node = self.mk(("n", Fraction(int(t[0]))))
        elif tok[0] == "let":
            self.take()
            node = self.mk(self._letter(tok[1], None))
        elif tok[0] == "cmd":
            node = self.primary()
        elif exponent and tok == ("op", "-"):
            self.take()
            node = self.mk(("neg", self.arg(exponent=True)))
        else:
            raise _Refuse
        self.leave()
        return node

    def _letter(self, c, sub):
        if sub is None:
            if c == "e":
                return ("c", "e")
            if c == "i":
                return ("c", "i")
            return ("v", c)
        return ("v", c + "_" + sub)

    def _subscript(self):
        tok = self.take()
        if tok[0] == "num" and tok[1][0].isdigit():
            return tok[1][0]
        if tok[0] == "let":
            return tok[1]
        if tok == ("op", "{"):
            parts = []
            while self.peek() != ("op", "}"):
                t = self.take()
                if t[0] == "num" and t[1][0].isdigit():
                    parts.append(t[1][0])
                elif t[0] == "let":
                    parts.append(t[1])
                else:
                    raise _Refuse
                if len(parts) > 8:
                    raise _Refuse
            self.take()
            if not parts:
                raise _Refuse
            return "".join(parts)
        raise _Refuse

    def primary(self):
        self.enter()
        tok = self.take()
        k, v = tok
        if k == "num":
            if self.peek() == ("op", "_"):
                self.take()
                base = self._subscript()
                if not (v[0].isdigit() and base.isdigit()):
                    raise _Refuse
                b = int(base)
                if not 2 <= b <= 36:
                    raise _Refuse
                try:
                    value = int(v[0], b)
                except ValueError:
                    raise _Refuse
                node = self.mk(("based", b, value))
            else:
                node = self.mk(("n", _num_value(v)))
        elif k == "let":
            sub = None
            if self.peek() == ("op", "_"):
                self.take()
                sub = self._subscript()
            node = self.mk(self._letter(v, sub))
        elif k == "cmd":
            node = self._command(v)
        elif k == "op" and v in "([":
            node = self._bracketed(v)
        elif k == "op" and v == "{":
            items, close = self._items({("op", "}")})
            node = items[0] if len(items) == 1 else self.mk(("set", tuple(items)))
        elif k == "lset":
            if self.peek() == ("rset", None):
                self.take()
                node = self.mk(("set", ()))
            else:
                items, close = self._items({("rset", None)})
                node = self.mk(("set", tuple(items)))
        elif k == "op" and v == "|":
            self.abs_depth += 1
            inner = self.expression()
            self.abs_depth -= 1
            self.expect(("op", "|"))
            node = self.mk(("abs", inner))
        elif k == "begin":
            node = self._matrix(v)
        else:
            raise _Refuse
        self.leave()
        return node

    def _items(self, closers):
        items = []
        saved = self.abs_depth
        self.abs_depth = 0
        sep = None
        while True:
            items.append(self.expression())
            tok = self.take()
            if tok in _SEPARATORS:
                if sep is not None and tok != sep:
                    raise _Refuse  # (1,5; 2): a decimal comma, not a third entry
                sep = tok
                if len(items) >= MAX_ITEMS:
                    raise _Refuse
                continue
            if tok in closers:
                self.abs_depth = saved
                return items, tok
            raise _Refuse

    def _bracketed(self, open_):
        items, close = self._items({("op", ")"), ("op", "]")})
        if len(items) == 1:
            if (open_, close[1]) in (("(", ")"), ("[", "]")):
                return items[0]
            raise _Refuse
        return self.mk(("seq", open_, close[1], tuple(items)))

    def _matrix(self, env):
        if env not in _MATRIX_ENVS:
            raise _Refuse
        rows = []
        row = []
        while True:
            if self.peek()[0] == "end":
                break
            row.append(self.expression())
            tok = self.take()
            if tok == ("op", "&"):
                continue
            if tok[0] == "row":
                rows.append(tuple(row))
                row = []
                continue
            if tok[0] == "end":
                self.i -= 1
                rows.append(tuple(row))
                row = []
                break
            raise _Refuse
        if row:
            rows.append(tuple(row))
        end = self.take()
        if end != ("end", env):
            raise _Refuse
        if not rows or any(len(r) != len(rows[0]) for r in rows) or not rows[0]:
            raise _Refuse
        return self.mk(("mat", tuple(rows)))

    def _command(self, name):
        if name == "pi":
            return self.mk(("c", "pi"))
        if name == "infty":
            return self.mk(("c", "inf"))
        if name in ("emptyset", "varnothing"):
            return self.mk(("set", ()))
        if name in _GREEK:
            sub = None
            if self.peek() == ("op", "_"):
                self.take()
                sub = self._subscript()
            return self.mk(("v", name if sub is None else name + "_" + sub))
        if name == "frac":
            a = self.arg()
            b = self.arg()
            return self.mk(("/", a, b))
        if name == "binom":
            a = self.arg()
            b = self.arg()
            return self.mk(("binom", a, b))
        if name == "sqrt":
            if self.peek() == ("op", "["):
                self.take()
                idx = self.expression()
                self.expect(("op", "]"))
                return self.mk(("root", self.arg(), idx))
            return self.mk(("sqrt", self.arg()))
        if name in ("lfloor", "lceil"):
            inner = self.expression()
            self.expect(("cmd", "rfloor" if name == "lfloor" else "rceil"))
            return self.mk(("floor" if name == "lfloor" else "ceil", inner))
        if name in _FUNCS:
            base = None
            if name == "log" and self.peek() == ("op", "_"):
                self.take()
                base = self.arg(exponent=True)
            power = None
            if self.peek() == ("op", "^"):
                self.take()
                power = self.arg(exponent=True)
            tok = self.peek()
            if tok == ("op", "("):
                self.take()
                a = self.expression()
                self.expect(("op", ")"))
            elif tok == ("op", "{"):
                self.take()
                a = self.expression()
                self.expect(("op", "}"))
            else:
                self.fn_arg += 1
                a = self.implicit()
                self.fn_arg -= 1
            node = self.mk(("f", name, a, base))
            if power is not None:
                node = self.mk(("^", node, power))
            return node
        raise _Refuse


def _parse(toks):
    if not toks:
        raise _Refuse
    p = _Parser(toks)
    node = p.expression()
    if not p.at_end():
        raise _Refuse
    return node


# ----------------------------------------------------------------------------------------------
# tree walking helpers
def _children(node):
    k = node[0]
    if k in ("+", "*"):
        return node[1]
    if k in ("neg", "sqrt", "!", "abs", "floor", "ceil"):
        return (node[1],)
    if k in ("/", "^", "binom", "root"):
        return (node[1], node[2])
    if k == "f":
        return (node[2],) if node[3] is None else (node[2], node[3])
    if k == "pm":
        return (node[2],) if node[1] is None else (node[1], node[2])
    if k == "seq":
        return node[3]
    if k == "set":
        return node[1]
    if k == "mat":
        return tuple(c for r in node[1] for c in r)
    return ()


def _walk(node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(_children(n))


def _vars(node):
    return frozenset(n[1] for n in _walk(node) if n[0] == "v")


def _has_kind(node, kind):
    return any(n[0] == kind for n in _walk(node))


def _rebuild(node, kids):
    k = node[0]
    if k in ("+", "*"):
        return (k, tuple(kids))
    if k in ("neg", "sqrt", "!", "abs", "floor", "ceil"):
        return (k, kids[0])
    if k in ("/", "^", "binom", "root"):
        return (k, kids[0], kids[1])
    if k == "f":
        return ("f", node[1], kids[0], kids[1] if len(kids) > 1 else None)
    return node


def _expand(node):
    """Expand \\pm / \\mp into the list of plain expressions."""
    k = node[0]
    if k == "pm":
        bs = _expand(node[2])
        as_ = _expand(node[1]) if node[1] is not None else [None]
        out = []
        for a in as_:
            for b in bs:
                if a is None:
                    out += [b, ("neg", b)]
                else:
                    out += [("+", (a, b)), ("+", (a, ("neg", b)))]
                if len(out) > MAX_PM_EXPANSION:
                    raise _Refuse
        return out
    kids = _children(node)
    if not kids or k in ("seq", "set", "mat"):
        return [node]
    combos = [[]]
    for c in kids:
        ex = _expand(c)
        combos = [prev + [e] for prev in combos for e in ex]
        if len(combos) > MAX_PM_EXPANSION:
            raise _Refuse
    return [_rebuild(node, kids2) for kids2 in combos]


# ----------------------------------------------------------------------------------------------
# evaluation
def _mp(x):
    if isinstance(x, Fraction):
        return _CTX.mpf(x.numerator) / x.denominator
    if isinstance(x, _Inf):
        raise _Refuse
    return x


def _chk(x):
    if isinstance(x, Fraction):
        if x.numerator.bit_length() > MAX_BITS or x.denominator.bit_length() > MAX_BITS:
            raise _Refuse
        return x
    if _CTX.isnan(x) or _CTX.isinf(x):
        raise _Undefined
    if x != 0 and abs(_CTX.mag(x)) > MAX_MP_MAG_BITS:
        raise _Refuse
    return x


def _is_zero(x):
    return x == 0


def _iroot(n, k):
    """Floor of the k-th root of the integer n >= 0."""
    if n < 2:
        return n
    x = 1 << ((n.bit_length() + k - 1) // k)
    while True:
        y = ((k - 1) * x + n // x ** (k - 1)) // k
        if y >= x:
            return x
        x = y


def _exact_root(a, k):
    """k-th root of the Fraction a >= 0 when it is rational, else None."""
    p, q = a.numerator, a.denominator
    rp, rq = _iroot(p, k), _iroot(q, k)
    if rp ** k == p and rq ** k == q:
        return Fraction(rp, rq)
    return None


def _int_pow(a, n):
    """Fraction a to the integer n, refused before computing when the result is too big."""
    if a == 0:
        if n < 0:
            raise _Undefined
        return Fraction(0) if n > 0 else Fraction(1)
    if a == 1 or n == 0:
        return Fraction(1)
    if a == -1:
        return Fraction(1) if n % 2 == 0 else Fraction(-1)
    if abs(n) > MAX_EXPONENT:
        raise _Refuse
    size = max(a.numerator.bit_length(), a.denominator.bit_length())
    if abs(n) * size > MAX_BITS + 64:
        raise _Refuse
    return _chk(a ** n)


def _pow(a, b):
    if isinstance(a, _Inf) or isinstance(b, _Inf):
        raise _Refuse
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if b.denominator == 1:
            return _int_pow(a, b.numerator)
        q, p = b.denominator, b.numerator
        if q <= MAX_ROOT_INDEX and abs(p) <= 10000 and (a >= 0 or q % 2 == 1):
            r = _exact_root(abs(a), q)
            if r is not None:
                return _int_pow(-r if a < 0 else r, p)
        if a < 0 and q % 2 == 1:  # real odd root of a negative number
            mag = _pow(-a, b)
            return -mag if p % 2 else mag
    A = _mp(a)
    B = _mp(b)
    if abs(B) > 10000:
        raise _Refuse
    if A == 0:
        if _CTX.re(B) > 0:
            return Fraction(0)
        raise _Undefined
    if abs(B) * abs(_CTX.log(abs(A))) > MAX_MP_MAG_BITS * 0.69:
        raise _Refuse
    if isinstance(b, Fraction) and b.denominator == 1:
        return _chk(A ** int(b.numerator))
    return _chk(_CTX.power(A, B))


def _func(name, x, base):
    if isinstance(x, _Inf):
        raise _Refuse
    X = _mp(x)
    if name in ("sin", "cos", "tan", "cot", "sec", "csc", "sinh", "cosh", "tanh"):
        if abs(X) > MAX_TRIG_ARG:
            raise _Refuse
    if name in ("sinh", "cosh", "tanh", "exp") and abs(X) > MAX_EXP_ARG:
        raise _Refuse
    plain = {"sin": _CTX.sin, "cos": _CTX.cos, "arcsin": _CTX.asin, "arccos": _CTX.acos, "arctan": _CTX.atan,
             "sinh": _CTX.sinh, "cosh": _CTX.cosh, "tanh": _CTX.tanh, "exp": _CTX.exp}
    if name in plain:
        return _chk(plain[name](X))
    if name in ("tan", "cot", "sec", "csc"):
        s, c = _CTX.sin(X), _CTX.cos(X)
        num, den = {"tan": (s, c), "cot": (c, s), "sec": (1, c), "csc": (1, s)}[name]
        if abs(den) < _TINY:
            raise _Undefined
        return _chk(num / den)
    if X == 0:
        raise _Undefined
    if name == "ln" or (name == "log" and base is None):
        return _chk(_CTX.log(X))
    if name == "log":
        if isinstance(base, _Inf):
            raise _Refuse
        lb = _CTX.log(_mp(base))
        if lb == 0:
            raise _Undefined
        return _chk(_CTX.log(X) / lb)
    raise _Refuse


def _as_int(x):
    if isinstance(x, Fraction) and x.denominator == 1:
        return x.numerator
    raise _Refuse


def _value(node, env):
    """Value of an expression node: a Fraction when exact, else an mpmath number."""
    k = node[0]
    if k == "n" or k == "k":
        return node[1]
    if k == "v":
        try:
            return env[node[1]]
        except (KeyError, TypeError):
            raise _Refuse
    if k == "c":
        v = node[1]
        if v == "pi":
            return _CTX.pi + 0
        if v == "e":
            return _CTX.e + 0
        if v == "i":
            return _CTX.mpc(0, 1)
        return _Inf(1)
    if k == "+":
        vals = [_value(c, env) for c in node[1]]
        if any(isinstance(v, _Inf) for v in vals):
            raise _Refuse
        if all(isinstance(v, Fraction) for v in vals):
            return _chk(sum(vals, Fraction(0)))
        total = _CTX.mpf(0)
        for v in vals:
            total = total + _mp(v)
        return _chk(total)
    if k == "*":
        vals = [_value(c, env) for c in node[1]]
        if any(isinstance(v, _Inf) for v in vals):
            raise _Refuse
        if all(isinstance(v, Fraction) for v in vals):
            acc = Fraction(1)
            for v in vals:
                acc = _chk(acc * v)
            return acc
        acc = _CTX.mpf(1)
        for v in vals:
            acc = _chk(acc * _mp(v))
        return acc
    if k == "neg":
        v = _value(node[1], env)
        if isinstance(v, _Inf):
            return _Inf(-v.sign)
        return -v
    if k == "/":
        a = _value(node[1], env)
        b = _value(node[2], env)
        if isinstance(a, _Inf) or isinstance(b, _Inf):
            raise _Refuse
        if _is_zero(b):
            raise _Undefined
        if isinstance(a, Fraction) and isinstance(b, Fraction):
            return _chk(a / b)
        return _chk(_mp(a) / _mp(b))
    if k == "^":
        return _pow(_value(node[1], env), _value(node[2], env))
    if k == "sqrt":
        a = _value(node[1], env)
        if isinstance(a, Fraction) and a >= 0:
            r = _exact_root(a, 2)
            if r is not None:
                return r
        return _chk(_CTX.sqrt(_mp(a)))
    if k == "root":
        idx = _as_int(_value(node[2], env))
        if not 1 <= idx <= MAX_ROOT_INDEX:
            raise _Refuse
        return _pow(_value(node[1], env), Fraction(1, idx))
    if k == "!":
        n = _as_int(_value(node[1], env))
        if not 0 <= n <= MAX_FACTORIAL:
            raise _Refuse
        return Fraction(math.factorial(n))
    if k == "binom":
        n = _as_int(_value(node[1], env))
        r = _as_int(_value(node[2], env))
        if not 0 <= n <= MAX_BINOM_N:
            raise _Refuse
        return Fraction(math.comb(n, r)) if 0 <= r else Fraction(0)
    if k == "abs":
        a = _value(node[1], env)
        if isinstance(a, Fraction):
            return abs(a)
        return _chk(abs(_mp(a)))
    if k in ("floor", "ceil"):
        a = _value(node[1], env)
        if isinstance(a, Fraction):
            return Fraction(math.floor(a) if k == "floor" else math.ceil(a))
        A = _mp(a)
        if _CTX.im(A) != 0:
            raise _Refuse
        return Fraction(int(_CTX.floor(A) if k == "floor" else _CTX.ceil(A)))
    if k == "f":
        base = _value(node[3], env) if node[3] is not None else None
        return _func(node[1], _value(node[2], env), base)
    raise _Refuse  # seq / set / matrix / based number / pm inside arithmetic


def _val_equal(a, b):
    if isinstance(a, _Inf) or isinstance(b, _Inf):
        return isinstance(a, _Inf) and isinstance(b, _Inf) and a.sign == b.sign
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    A, B = _mp(a), _mp(b)
    m = max(abs(A), abs(B))
    if m <= _TINY:
        return True
    return abs(A - B) <= _REL_TOL * m


_POINTS = {}


def _point_value(j, k):
    key = (j, k)
    if key not in _POINTS:
        v = _CTX.sqrt(_CTX.mpf(2 + 3 * j + 5 * k)) / 2 + _CTX.mpf(k + 1) / (j + 3)
        _POINTS[key] = -v if k == 2 else v
    return _POINTS[key]


_N_POINTS = 4


def _envs(names):
    names = sorted(names)
    if len(names) > MAX_VARS:
        raise _Refuse
    return [{n: _point_value(j, k) for j, n in enumerate(names)} for k in range(_N_POINTS)]


def _safe_value(node, env):
    try:
        return _value(node, env)
    except _Undefined:
        return None
    except (ZeroDivisionError, ValueError, OverflowError):
        return None


def _expr_equal(g, p):
    if g[0] == "n" and p[0] == "n":  # two rationals: the common case of list parts, exactly
        return g[1] == p[1]
    vg, vp = _vars(g), _vars(p)
    if vg != vp:
        return False
    if not vg:
        a, b = _safe_value(g, {}), _safe_value(p, {})
        if a is None or b is None:
            return False
        return _val_equal(a, b)
    compared = 0
    for env in _envs(vg):
        a, b = _safe_value(g, env), _safe_value(p, env)
        if a is None and b is None:
            continue
        if a is None or b is None:
            return False
        if isinstance(a, _Inf) or isinstance(b, _Inf):
            return False
        if not _val_equal(a, b):
            return False
        compared += 1
    return compared >= 2


def _eq_equal(g, p):
    fg = ("+", (g[1], ("neg", g[2])))
    fp = ("+", (p[1], ("neg", p[2])))
    vg, vp = _vars(fg), _vars(fp)
    if vg != vp or not vg:
        return False
    ratios = []
    for env in _envs(vg):
        a, b = _safe_value(fg, env), _safe_value(fp, env)
        if a is None and b is None:
            continue
        if a is None or b is None or isinstance(a, _Inf) or isinstance(b, _Inf):
            return False
        za, zb = abs(_mp(a)) <= _TINY, abs(_mp(b)) <= _TINY
        if za and zb:
            continue
        if za or zb:
            return False
        ratios.append(_mp(a) / _mp(b))
    if len(ratios) < 2:
        return False
    return all(_val_equal(r, ratios[0]) for r in ratios[1:])


# ----------------------------------------------------------------------------------------------
# answer structure
def _canon(node):
    k = node[0]
    if k == "seq":
        return ("seq", node[1], node[2], tuple(_canon(i) for i in node[3]))
    if k == "set":
        items = []
        for it in node[1]:
            c = _canon(it)
            if c[0] == "uset":
                items.extend(c[1])
            else:
                items.append(c)
        return ("uset", tuple(items))
    if k == "mat":
        rows = []
        for r in node[1]:
            row = []
            for cell in r:
                c = _canon(cell)
                if c[0] != "expr":
                    raise _Refuse
                row.append(c)
            rows.append(tuple(row))
        return ("mat", tuple(rows))
    if k == "based":
        return node
    if _has_kind(node, "pm"):
        ex = _expand(node)
        if len(ex) == 1:
            return ("expr", ex[0])
        return ("uset", tuple(("expr", e) for e in ex))
    return ("expr", node)


def _canon_vars(c):
    k = c[0]
    if k == "expr":
        return _vars(c[1])
    if k == "lab":
        return _canon_vars(c[2])
    if k in ("uset", "union", "ratio"):
        out = frozenset()
        for it in c[1]:
            out |= _canon_vars(it)
        return out
    if k == "seq":
        out = frozenset()
        for it in c[3]:
            out |= _canon_vars(it)
        return out
    if k == "mat":
        out = frozenset()
        for r in c[1]:
            for it in r:
                out |= _canon_vars(it)
        return out
    if k == "eq":
        return _vars(c[1]) | _vars(c[2])
    return frozenset()


def _split_top(toks, is_sep):
    parts = [[]]
    seps = []
    depth = 0
    for tok in toks:
        if tok in _OPENERS or tok[0] == "begin":
            depth += 1
        elif tok in _CLOSERS or tok[0] == "end":
            depth -= 1
            if depth < 0:
                raise _Refuse
        if depth == 0 and is_sep(tok):
            parts.append([])
            seps.append(tok)
        else:
            parts[-1].append(tok)
    if depth != 0:
        raise _Refuse
    return parts, seps


def _simple_lhs(toks):
    """'var' for x, x_1, \\alpha; 'func' for f(x), f(x, y), f(2); 'tuple' for (p, q); else None."""
    n = len(toks)
    if n == 0:
        return None
    if n == 1 and (toks[0][0] == "let" and toks[0][1] not in "ei" or
                   toks[0][0] == "cmd" and toks[0][1] in _GREEK):
        return "var"
    if n >= 3 and toks[0][0] == "let" and toks[1] == ("op", "_"):
        try:
            p = _Parser(toks)
            node = p.primary()
            if p.at_end() and node[0] == "v":
                return "var"
        except _Refuse:
            return None
        return None

    def var_list(ts, numbers=False):
        if not ts or len(ts) % 2 == 0:
            return False
        for j, t in enumerate(ts):
            if j % 2 == 0 and not (t[0] == "let" or (t[0] == "cmd" and t[1] in _GREEK)
                                   or numbers and t[0] == "num" and t[1][0].isdigit()
                                   and t[1][1:] == (None, None)):
                return False
            if j % 2 == 1 and t != ("op", ","):
                return False
        return True

    # f(x), and f(2) = 5 too: the value of f at 2 is the quantity named
    if n >= 4 and toks[0][0] == "let" and toks[1] == ("op", "(") and toks[-1] == ("op", ")"):
        if var_list(toks[2:-1], numbers=True):
            return "func"
    if n >= 5 and toks[0] == ("op", "(") and toks[-1] == ("op", ")") and var_list(toks[1:-1]):
        return "tuple"
    return None


def _union_or_expr(toks):
    if _COLON in toks:
        # 7:32 is a ratio, compared term by term like a tuple and never a number: 9:24 may
        # be a time, so 14:64 != 7:32 and \frac{7}{32} != 7:32
        terms, _ = _split_top(toks, lambda t: t == _COLON)
        if len(terms) > 1:
            if len(terms) > MAX_ITEMS:
                raise _Refuse
            cs = tuple(_canon(_parse(t)) for t in terms)
            if any(c[0] != "expr" for c in cs):
                raise _Refuse
            return ("ratio", cs)
    pieces, _ = _split_top(toks, lambda t: t[0] == "cup")
    if len(pieces) > 1:
        cs = []
        for p in pieces:
            c = _canon(_parse(p))
            if c[0] not in ("seq", "uset"):
                raise _Refuse
            cs.append(c)
        return ("union", tuple(cs))
    return _canon(_parse(toks))


def _interval(lb, lo, hi, rb):
    return ("seq", lb, rb, (("expr", lo), ("expr", hi)))


_NEG_INF = ("neg", ("c", "inf"))
_POS_INF = ("c", "inf")


def _inequality(parts, rels):
    if len(parts) == 2:
        left, right = _parse(parts[0]), _parse(parts[1])
        f = ("+", (left, ("neg", right)))
        names = _vars(f)
        if len(names) != 1 or _has_kind(f, "pm"):
            raise _Refuse
        (v,) = names
        f0 = _value(f, {v: Fraction(0)})
        f1 = _value(f, {v: Fraction(1)})
        f2 = _value(f, {v: Fraction(2)})
        if not all(isinstance(x, Fraction) for x in (f0, f1, f2)):
            f0, f1, f2 = _mp(f0), _mp(f1), _mp(f2)
        if not _val_equal(f2 - 2 * f1 + f0, Fraction(0)):
            raise _Refuse  # not linear in the variable
        slope = f1 - f0
        if not isinstance(slope, Fraction):
            if _CTX.im(slope) != 0 or _CTX.im(f0) != 0:
                raise _Refuse
            slope, f0 = _CTX.re(slope), _CTX.re(f0)
        if slope == 0:
            raise _Refuse
        bound = _chk(-f0 / slope)
        rel = rels[0]
        b = ("k", bound)
        if rel == "ne":  # the line without one point: the same set whichever way round
            return ("union", (_interval("(", _NEG_INF, b, ")"), _interval("(", b, _POS_INF, ")")))
        if slope < 0:
            rel = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}[rel]
        if rel == "lt":
            return _interval("(", _NEG_INF, b, ")")
        if rel == "le":
            return _interval("(", _NEG_INF, b, "]")
        if rel == "gt":
            return _interval("(", b, _POS_INF, ")")
        return _interval("[", b, _POS_INF, ")")
    if len(parts) == 3:
        if _simple_lhs(parts[1]) not in ("var", "func"):
            raise _Refuse
        lo, hi = _parse(parts[0]), _parse(parts[2])
        if _vars(lo) or _vars(hi) or _has_kind(lo, "pm") or _has_kind(hi, "pm"):
            raise _Refuse
        r1, r2 = rels
        if r1 in ("lt", "le") and r2 in ("lt", "le"):
            return _interval("(" if r1 == "lt" else "[", lo, hi, ")" if r2 == "lt" else "]")
        if r1 in ("gt", "ge") and r2 in ("gt", "ge"):
            return _interval("(" if r2 == "gt" else "[", hi, lo, ")" if r1 == "gt" else "]")
    raise _Refuse


def _approx_decimal(toks):
    """(value, digits after the point) of a plain decimal such as 0.577, -1.41 or 11."""
    neg = bool(toks) and toks[0] == ("op", "-")
    if neg:
        toks = toks[1:]
    if len(toks) != 1 or toks[0][0] != "num" or toks[0][1][1:] != (None, None):
        raise _Refuse  # no repeating or scientific decimals
    t = toks[0][1][0]
    places = len(t.split(".")[1]) if "." in t else 0
    if places > MAX_APPROX_PLACES:
        raise _Refuse
    v = _num_value(toks[0][1])
    return (-v if neg else v), places


def _approximated(parts, rels):
    """``exact \\approx decimal`` (the exact part may be a labelled or agreeing = chain): the
    exact part, provided the decimal is a correct rounding of it, i.e. within half a unit of its
    last digit (so either direction at an exact tie). A wrong rounding is a false statement and
    refuses, like 5=3; an approximation alone (x \\approx 11) has no exact part and refuses."""
    if len(parts) < 2 or any(r != "eq" for r in rels[:-1]):
        raise _Refuse
    exact = parts[:-1]
    c = _equality(exact) if len(exact) > 1 else _union_or_expr(exact[0])
    inner = c[2] if c[0] == "lab" else c
    node = inner[1] if inner[0] == "expr" else None
    if node is None or _vars(node) or _has_kind(node, "pm"):
        raise _Refuse
    v = _value(node, {})
    d, places = _approx_decimal(parts[-1])
    half = Fraction(1, 2 * 10 ** places)
    if isinstance(v, Fraction):
        ok = abs(v) < MAX_APPROX_MAG and abs(v - d) <= half
    else:
        if isinstance(v, _Inf) or _CTX.im(v) != 0 or not abs(v) < MAX_APPROX_MAG:
            raise _Refuse
        # 60 digits below 10^15 err by under 1e-42; the 1e-40 slack only lets a value that is
        # really a tie (sin(pi/6) = 0.5 computed in floating point) round either way
        ok = abs(_CTX.re(v) - _mp(d)) <= _mp(half) + _CTX.mpf(10) ** -40
    if not ok:
        raise _Refuse
    return c


def _item(toks):
    parts, seps = _split_top(toks, lambda t: t[0] == "rel")
    if any(not p for p in parts):
        raise _Refuse
    if not seps:
        return _union_or_expr(toks)
    rels = [t[1] for t in seps]
    if rels[-1] == "approx":
        return _approximated(parts, rels)
    if all(r == "eq" for r in rels):
        return _equality(parts)
    if all(r in ("lt", "le", "gt", "ge") for r in rels) or rels == ["ne"]:
        return _inequality(parts, rels)
    if rels == ["in"] and _simple_lhs(parts[0]) == "var":
        return _union_or_expr(parts[1])
    raise _Refuse


def _figure_name(toks):
    """Key of a segment, angle or figure name used as a label: 'AB' for AB or \\overline{AB},
    'angle ABC' for \\angle ABC or m\\angle ABC (also \\angle A); None for anything else. A
    name read backwards is the same segment, angle or polygon (BA, CBA)."""
    prefix, least = "", 2
    if toks[:2] == [("let", "m"), ("cmd", "angle")]:
        toks = toks[1:]
    if toks[:1] == [("cmd", "angle")]:
        prefix, least, toks = "angle ", 1, toks[1:]
    elif toks[:2] == [("cmd", "overline"), ("op", "{")] and toks[-1:] == [("op", "}")]:
        toks = toks[2:-1]
    if not least <= len(toks) <= 4 or any(t[0] != "let" or not "A" <= t[1] <= "Z" for t in toks):
        return None
    name = "".join(t[1] for t in toks)
    return prefix + min(name, name[::-1])


def _length_name(toks):
    """Key of a segment or figure name, bare (AB, \\overline{AB}, \\angle A) or between bars: |AB|
    is the length of AB. Never a single letter between bars: |x| = 1 says x = 1 or x = -1."""
    if len(toks) >= 3 and toks[0] == ("op", "|") and toks[-1] == ("op", "|"):
        name = _figure_name(toks[1:-1])
        return None if name is None or name.startswith("angle") else name
    return _figure_name(toks)


def _brace_groups(toks, i):
    """The token lists of the {...} groups from toks[i] to the end, or None."""
    groups = []
    while i < len(toks):
        if toks[i] != ("op", "{"):
            return None
        depth, j = 0, i
        while True:
            if toks[j] == ("op", "{"):
                depth += 1
            elif toks[j] == ("op", "}"):
                depth -= 1
                if depth == 0:
                    break
            j += 1
            if j == len(toks):
                return None
        groups.append(toks[i + 1:j])
        i = j + 1
    return groups


def _quantity_name(toks):
    """(key, terms) of a label that names a quantity other than by one variable, or None: a
    figure name or length (AB, |AB|, \\angle ABC; 1 term), a fraction of two of them
    (\\frac{NO}{BO} or NO/BO, the ratio NO:BO; 1 term), or a ratio of names, each a variable
    (x, V_{1}, S_{MBCN}, \\alpha) or a figure name or length (A:B, PA:AB; one term per name).
    A ratio's key is the tuple ('ratio', names), apart from every other label's string."""
    if _COLON in toks:
        terms, _ = _split_top(toks, lambda t: t == _COLON)
        if len(terms) > MAX_ITEMS:
            raise _Refuse
        keys = []
        for t in terms:
            keys.append(_parse(t)[1] if _simple_lhs(t) == "var" else _length_name(t))
            if keys[-1] is None:
                return None
        return ("ratio", tuple(keys)), len(terms)
    name = _length_name(toks)
    if name is not None:
        return name, 1
    if toks[:1] == [("cmd", "frac")]:
        pair = _brace_groups(toks, 1)
    else:
        pair, _ = _split_top(toks, lambda t: t == ("op", "/"))
    if pair is None or len(pair) != 2:
        return None
    keys = [_length_name(t) for t in pair]
    if None in keys:
        return None  # \frac{x}{y} = 2 stays an equation: x = 2y
    return ("ratio", tuple(keys)), 1


def _label_value(c, terms):
    """A label's constant right side: one value, or a ratio of as many terms as the label's."""
    if _canon_vars(c):
        return False
    return c[0] == "expr" or c[0] == "ratio" and terms > 1 and len(c[1]) == terms


def _label_key(toks, kind):
    if kind == "var":
        return _parse(toks)[1]
    return "".join(str(v) for _, v in toks)  # f(x), (p,q): as written


def _agreeing(cs):
    """The last of a chain of constant parts that must all agree, else refuse (5=3)."""
    if any(_canon_vars(c) for c in cs):
        raise _Refuse
    for c in cs[1:]:
        if not _same(cs[0], c):
            raise _Refuse  # a false statement such as 5=3
    return cs[-1]


def _equality(parts):
    lhs_kind = _simple_lhs(parts[0])
    if lhs_kind is None:
        # AB = 4 names a length, not the product A*B, when what it equals is one constant; with
        # variables on the right it stays an equation (AB = 2x), and a set or tuple refuses. So
        # do |AB|, \frac{NO}{BO} and a ratio of names (S_{MBCN}:S = 7:32, A:B = 1)
        named = _quantity_name(parts[0])
        if named is not None:
            cs = [_union_or_expr(v) for v in parts[1:]]
            if all(_label_value(c, named[1]) for c in cs):
                return ("lab", named[0], _agreeing(cs))
    vals = parts[1:] if lhs_kind else parts
    if lhs_kind and len(vals) == 1:
        c = _union_or_expr(vals[0])
        if lhs_kind == "var" and _canon_vars(c):
            if c[0] != "expr":
                raise _Refuse
            return ("eq", _parse(parts[0]), c[1])
        return ("lab", _label_key(parts[0], lhs_kind), c)
    cs = [_union_or_expr(v) for v in vals]
    if not lhs_kind and len(cs) == 2 and (_canon_vars(cs[0]) or _canon_vars(cs[1])):
        if cs[0][0] != "expr" or cs[1][0] != "expr":
            raise _Refuse
        return ("eq", cs[0][1], cs[1][1])
    c = _agreeing(cs)
    return ("lab", _label_key(parts[0], lhs_kind), c) if lhs_kind else c


def _is_text_only(toks):
    has_text = False
    for t in toks:
        if t[0] == "text":
            has_text = True
        elif t not in (("op", "("), ("op", ")")):
            return False
    return has_text


def _drop_units(toks):
    out = []
    i = 0
    n = len(toks)
    while i < n:
        t = toks[i]
        if t[0] == "text":
            i += 1
            if i < n and toks[i] == ("op", "^"):
                if i + 1 < n and toks[i + 1][0] == "num":
                    i += 2
                elif (i + 3 < n and toks[i + 1] == ("op", "{") and toks[i + 2][0] == "num"
                      and toks[i + 3] == ("op", "}")):
                    i += 4
            continue
        out.append(t)
        i += 1
    return out


def _solution_groups(toks):
    """p = 5, q = 2; p = 7, q = 2: semicolons separate solutions, commas the labelled values of
    one, each solution the tuple of its values in the order written, as (p,q) = (5,2) is: the
    list (5,2), (7,2). Every value a constant with a variable's label, the same labels in the same
    order in every group; anything else mixes two separators (1,5; 2) and refuses."""
    names, out = None, []
    for group in _split_top(toks, lambda t: t == ("op", ";"))[0]:
        labels, values = [], []
        for it in _split_top(group, lambda t: t == ("op", ","))[0]:
            parts, seps = _split_top(it, lambda t: t[0] == "rel")
            if seps != [("rel", "eq")] or _simple_lhs(parts[0]) != "var":
                raise _Refuse
            labels.append(_parse(parts[0])[1])
            c = _union_or_expr(_drop_units(parts[1]))
            if c[0] != "expr" or _canon_vars(c):
                raise _Refuse
            values.append(c)
        if len(labels) < 2 or len(set(labels)) < len(labels) or names not in (None, labels):
            raise _Refuse
        names = labels
        out.append(("lab", "(" + ",".join(labels) + ")", ("seq", "(", ")", tuple(values))))
    return ("uset", tuple(out))


def _analyze(s):
    c = _clean(s)
    if not c:
        raise _Refuse
    toks = _tokenize(c)
    if _is_text_only(toks):
        key = _text_key(s)
        if not key:
            raise _Refuse
        return ("text", key)
    if any(t[0] == "bad" for t in toks):
        raise _Refuse
    items, seps = _split_top(toks, lambda t: t in _SEPARATORS)
    if len(items) > MAX_ITEMS:
        raise _Refuse
    if len(set(seps)) > 1:
        return _solution_groups(toks)
    canons = []
    for it in items:
        # \text{area} = 12: a word naming the quantity is a label, like x in x = 12
        label = None
        if len(it) > 2 and it[0][0] == "text" and it[1] == ("rel", "eq"):
            label = " ".join(it[0][1].lower().split())
            it = it[2:]
        if _COLON not in it:
            # a word after a ratio stays and refuses: 8:34 \text{ a.m.} is not 8:34 p.m.
            it = _drop_units(it)
        if not it:
            raise _Refuse
        c = _item(it)
        canons.append(c if label is None else ("lab", label, c))
    return _combine(canons)


def _part_label(c):
    """The label of one part of a list, or None: x in x = 5 (any label naming one value), y in the
    equation y = 2x + 3 (a lone variable that its right side does not use)."""
    if c[0] == "lab" and c[2][0] != "uset":
        return c[1]
    if c[0] == "eq" and c[1][0] == "v" and c[1][1] not in _vars(c[2]):
        return c[1][1]
    return None


def _combine(canons):
    """The answer made of the parts of a top-level list. Parts that all carry distinct labels
    (x = 5, y = 5) make a labelled tuple ('ltup', labels, parts): ordered, duplicates kept. Any
    other list is unordered ('uset', parts, 'list'); the mark tells a written list from a set or a
    \\pm, since only a written list (or a tuple) may answer a labelled tuple in its order."""
    if len(canons) == 1:
        return canons[0]
    keys = [_part_label(c) for c in canons]
    if None not in keys and len(set(keys)) == len(keys):
        return ("ltup", tuple(keys), tuple(canons))
    flat = []
    for c in canons:
        if c[0] == "uset":
            flat.extend(c[1])
        else:
            flat.append(c)
    return ("uset", tuple(flat), "list")


@functools.lru_cache(maxsize=4096)
def _analyze_cached(s):
    try:
        return _analyze(s)
    except Exception:  # _Refuse, _Undefined, arithmetic or recursion errors: not parseable
        return None


# ----------------------------------------------------------------------------------------------
# structural comparison
def _dedup(items, same=None):
    same = same or _same
    out = []
    for it in items:
        if not any(same(it, o) for o in out):
            out.append(it)
    return out


def _match_unordered(a, b, same=None):
    same = same or _same
    a, b = _dedup(a, same), _dedup(b, same)
    if len(a) != len(b):
        return False
    used = [False] * len(b)
    for x in a:
        for j, y in enumerate(b):
            if not used[j] and same(x, y):
                used[j] = True
                break
        else:
            return False
    return True


def _unlabelled(items):
    """List items without their labels, a labelled list (x = \\pm 2) spread out."""
    out = []
    for it in items:
        if it[0] == "lab":
            it = it[2]
        out.extend(it[1] if it[0] == "uset" else (it,))
    return out


def _parts(items):
    """List items with their labels, a labelled list spread out (x = \\pm 2: x = 2, x = -2)."""
    out = []
    for it in items:
        if it[0] == "lab" and it[2][0] == "uset":
            out.extend(("lab", it[1], v) for v in it[2][1])
        elif it[0] == "uset":
            out.extend(it[1])
        else:
            out.append(it)
    return out


def _same_part(a, b):
    if a[0] == "lab" and b[0] == "lab" and a[1] != b[1]:
        return False
    return _same(a, b)


def _ratio_label(c):
    return isinstance(c[1], tuple)


def _tuple_parts(c):
    """(labels, parts) of a labelled tuple: x = 5, y = 5, or (x, y) = (5, 5); else None."""
    if c[0] == "ltup":
        return c[1], c[2]
    if (c[0] == "lab" and isinstance(c[1], str) and c[1][:1] == "(" and c[2][0] == "seq"
            and c[2][1:3] == ("(", ")")):
        names = tuple(c[1][1:-1].split(","))
        if len(names) == len(c[2][3]) and len(set(names)) == len(names):
            return names, c[2][3]
    return None


def _same_ltup(a, b):
    """A labelled tuple against another answer (a is the reference). Labels on both sides: the
    same labels with equal values, in any order. A labelled reference against a written list or
    a tuple: the same number of parts, in the reference's order (a part's own label, if any,
    must agree), never fewer parts and never a duplicate dropped. The mirror, a labelled answer
    against an unlabelled reference tuple ``(3, 4)``: its labels dropped, the same number of
    parts with equal values in the order written (``b = 4, a = 3`` is (4, 3)). A labelled answer
    against an unlabelled reference list: that list's rule (unordered, where both carry labels
    they agree). Anything else (one value, a set, \\pm, any other bracket) is not equal."""
    ta, tb = _tuple_parts(a), _tuple_parts(b)
    if ta is not None and tb is not None:
        if len(ta[0]) != len(tb[0]) or set(ta[0]) != set(tb[0]):
            return False
        other = dict(zip(*tb))
        return all(_same(x, other[k]) for k, x in zip(*ta))
    if b[0] == "ltup" and a[0] == "seq" and a[1:3] == ("(", ")"):
        return len(a[3]) == len(b[2]) and all(_same_part(x, y) for x, y in zip(a[3], b[2]))
    if a[0] == "ltup":
        if b[0] == "uset" and b[2:] == ("list",):
            items = b[1]
        elif b[0] == "seq" and b[1:3] == ("(", ")"):
            items = b[3]
        else:
            return False
        return len(items) == len(a[2]) and all(_same_part(x, y) for x, y in zip(a[2], items))
    if a[0] == "uset":
        return _match_unordered(_parts(a[1]), _parts(b[2]), _same_part)
    return False


def _same(a, b):
    ka, kb = a[0], b[0]
    if ka == "ltup" or kb == "ltup":
        return _same_ltup(a, b)
    # A label names the quantity: alone it is presentation (x = 5 == y = 5 == 5). In lists,
    # labels pair values with quantities: where both parts carry one, the labels must agree
    # (x = 1, y = 2 != x = 2, y = 1; AB = 4, CD = 5 == 4, 5). A greedy match under this rule
    # can miss a pairing (a false negative) but never accepts a wrong one.
    if ka == "lab" and kb == "lab" and a[1] != b[1] and _ratio_label(a) and _ratio_label(b):
        return False  # A:B = 2:3 != B:A = 2:3: two ratio labels must agree even alone
    if ka == "lab":
        return _same(a[2], b)
    if kb == "lab":
        return _same(a, b[2])
    if ka == "uset" and kb == "uset":
        return _match_unordered(_parts(a[1]), _parts(b[1]), _same_part)
    if ka == "union" or kb == "union":
        pa = a[1] if ka == "union" else (a,)
        pb = b[1] if kb == "union" else (b,)
        return _match_unordered(pa, pb)
    if ka == "uset" or kb == "uset":  # a one-element set equals its element: {5} == 5
        u, o = (a, b) if ka == "uset" else (b, a)
        items = _dedup(_unlabelled(u[1]))
        return len(items) == 1 and _same(items[0], o)
    if ka == "ratio" and kb == "ratio":
        return len(a[1]) == len(b[1]) and all(_same(x, y) for x, y in zip(a[1], b[1]))
    if ka == "seq" and kb == "seq":
        return (a[1] == b[1] and a[2] == b[2] and len(a[3]) == len(b[3])
                and all(_same(x, y) for x, y in zip(a[3], b[3])))
    if ka == "mat" and kb == "mat":
        ra, rb = a[1], b[1]
        return (len(ra) == len(rb) and all(len(x) == len(y) for x, y in zip(ra, rb))
                and all(_same(p, q) for x, y in zip(ra, rb) for p, q in zip(x, y)))
    if {ka, kb} == {"mat", "seq"}:
        m, s = (a, b) if ka == "mat" else (b, a)
        rows = m[1]
        if s[1] != "(" or s[2] != ")":
            return False
        if len(rows) == 1:
            flat = rows[0]
        elif all(len(r) == 1 for r in rows):
            flat = tuple(r[0] for r in rows)
        else:
            return False
        return len(flat) == len(s[3]) and all(_same(p, q) for p, q in zip(flat, s[3]))
    if ka == "expr" and kb == "expr":
        return _expr_equal(a[1], b[1])
    if ka == "eq" and kb == "eq":
        return _eq_equal(a, b)
    if {ka, kb} == {"eq", "expr"}:
        # y = x^2 + 2x + 1 answers x^2 + 2x + 1 (either way round): a lone variable on the left
        # that the right side does not use names the expression; x = 2x + 3 stays an equation
        e, x = (a, b) if ka == "eq" else (b, a)
        if e[1][0] == "v" and e[1][1] not in _vars(e[2]):
            return _expr_equal(e[2], x[1])
        return False
    if ka == "based" and kb == "based":
        return a[1] == b[1] and a[2] == b[2]
    if ka == "text" and kb == "text":
        return a[1] == b[1]
    return False


# ----------------------------------------------------------------------------------------------
# public API
_INT_RE = re.compile(r"\s*[+-]?[0-9]{1,300}\s*")


def is_equivalent(pred, gold):
    """True when the answer string ``pred`` is equivalent to the reference ``gold``."""
    try:
        return _is_equivalent(pred, gold)
    except Exception:  # never raise
        return False


_DECIMAL_GOLD_RE = re.compile(r"[+-]?[0-9]*\.[0-9]+")
# one comma (plain or {,}) between digits, an optional \$ before, and no digit, comma or
# semicolon after it (a unit may follow)
_DECIMAL_COMMA_RE = re.compile(r"(\\\$\s*)?([+-]?)([0-9]+)(?:,|\{,\})([0-9]+)([^0-9,;]*)")
_THOUSANDS_HEAD_RE = re.compile(r"[1-9][0-9]{0,2}")


def _decimal_comma(pred, gold):
    """``pred`` rewritten with a decimal point, when ``gold`` is a plain decimal (``2.74``) and
    ``pred`` one number whose single comma cannot group thousands (``2,74``, ``1000,99``,
    ``0,111``, ``1{,}5``; not ``2,740``, which is 2740); else None."""
    try:
        g = _clean(gold)
    except _Refuse:
        return None
    if not _DECIMAL_GOLD_RE.fullmatch(g):
        return None
    m = _DECIMAL_COMMA_RE.fullmatch(_strip_wrappers(re.sub(r"\s+", " ", pred)))
    if m is None:
        return None
    cur, sign, head, tail, rest = m.groups()
    if _THOUSANDS_HEAD_RE.fullmatch(head) and len(tail) == 3:
        return None  # 2,740 groups thousands
    return (cur or "") + sign + head + "." + tail + rest


def _is_equivalent(pred, gold):
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    if len(pred) > MAX_ANSWER_CHARS or _CTRL_RE.search(pred):
        return False
    if _INT_RE.fullmatch(pred) and _INT_RE.fullmatch(gold):
        return int(pred) == int(gold)
    g = _analyze_cached(gold)
    if g is None:
        ng = _norm_string(gold)
        return bool(ng) and _norm_string(pred) == ng
    if g[0] == "text":
        return _text_key(pred) == g[1]
    p = _analyze_cached(pred)
    if p is not None and p[0] == "text":
        return _text_key(gold) == p[1]
    if p is not None and _same(g, p):
        return True
    if "," in pred:
        # a decimal comma, decided by the reference: only a plain decimal reference reads one
        dec = _decimal_comma(pred, gold)
        p = _analyze_cached(dec) if dec is not None else None
        return p is not None and p[0] == "expr" and bool(_same(g, p))
    return False


def _gold_parts(g):
    """How many parts a reference list has (a labelled tuple's parts, a list's distinct parts),
    or 0 when the reference is not a list of at least two parts."""
    if g is None:
        return 0
    if g[0] == "ltup":
        return len(g[2])
    if g[0] == "uset":
        return len(_dedup(_parts(g[1])))
    return 0


def _last_boxes(text, k):
    """The contents of the last k boxes of the response (each read as extract_final_answer reads
    the last one), or None when there are fewer, one is empty or unbalanced, or one holds the
    next (``\\boxed{\\boxed{5}}`` is one box)."""
    if len(text) > MAX_RESPONSE_CHARS:
        text = text[-MAX_RESPONSE_CHARS:]
    starts = deque(_BOX_RE.finditer(text), maxlen=k)
    if len(starts) < k:
        return None
    out = []
    for j, m in enumerate(starts):
        content, end = _box_content(text, m)
        if content is None or (j + 1 < k and end > starts[j + 1].start()):
            return None
        out.append(content)
    return out


def _several_boxes(text, gold):
    """For a reference list of k parts whose last box alone was not equal: the last k boxes
    taken together, each one part, as one list (``\\boxed{(2,2)}`` and ``\\boxed{(6,2)}`` for
    ``(2,2), (6,2)``); the joined answer when it equals the reference, else None."""
    if not isinstance(gold, str) or _INT_RE.fullmatch(gold) or not _last_boxes(text, 2):
        return None  # the common cases, decided without parsing: one integer, one box
    k = _gold_parts(_analyze_cached(gold))
    if not 2 <= k <= MAX_ITEMS:
        return None
    boxes = _last_boxes(text, k)
    if boxes is None:
        return None
    canons = []
    for b in boxes:
        if len(b) > MAX_ANSWER_CHARS or _CTRL_RE.search(b):
            return None
        c = _analyze_cached(b)
        if c is None or c[0] in ("uset", "ltup") or c[0] == "lab" and c[2][0] == "uset":
            return None  # a box of several parts: the boxes would not be k parts
        canons.append(c)
    if not _same(_analyze_cached(gold), _combine(canons)):
        return None
    return ", ".join(boxes)


def score(response, gold):
    """(reward, extracted answer or None, status) with status correct / wrong / no_answer."""
    try:
        ans = extract_final_answer(response)
        if ans is None:
            return (0.0, None, "no_answer")
        ok = is_equivalent(ans, gold)
        if not ok:
            joined = _several_boxes(response, gold)
            if joined is not None:
                return (1.0, joined, "correct")
        return (1.0 if ok else 0.0, ans, "correct" if ok else "wrong")
    except Exception:  # never raise
        return (0.0, None, "no_answer")


def reward(response, gold):
    """1.0 when the last boxed answer of ``response`` is equivalent to ``gold``, else 0.0."""
    try:
        return score(response, gold)[0]
    except Exception:  # never raise
        return 0.0


# ----------------------------------------------------------------------------------------------
# step checkers (credit: steps): a verdict per line of a response, True, False or None (unknown)
# ----------------------------------------------------------------------------------------------

MAX_STEP_LINE_CHARS = 300  # a longer line is unknown at once: no number in it is read
# A list marker at the start of a line: a markdown bullet (-, *, +, •) or a number with . or ) (1. 2)), each followed
# by a space. Anchored at the start, each part bounded: linear.
_LIST_MARKER_RE = re.compile(r"\s*(?:[-*+\u2022]|[0-9]{1,3}[.)])\s+")
_FRACS = {"frac", "dfrac", "tfrac"}


def check_arithmetic(lines, record=None, problem=""):
    """The built-in step checker `arithmetic`: a verdict per line (arithmetic_verdict). record and problem are unused
    (a user's checker gets the data set's record; `grounded` reads the problem's text)."""
    return [arithmetic_verdict(line) for line in lines]


def arithmetic_verdict(line):
    """A line that states `expression = number` is True when exact rational arithmetic agrees and False when it does
    not; any other line is None: unknown. Read as written, and nothing else:
      * numbers: integers, decimals (``.5`` too) and repeating decimals (``0.\\overline{3}``), a sign before them;
      * operators + - * / and \\times, \\cdot, \\div; round brackets, ``\\left( \\right)`` too; ``\\frac{a}{b}``
        (``\\dfrac``, ``\\tfrac``) with both arguments in braces;
      * the right side one number, or a fraction of two, as written (``1 + 1 = 1 + 1`` is unknown);
      * dropped around it: a list marker at its start (a bullet ``-``, ``*``, ``+``, ``•`` or ``1.``, ``2)``, each
        followed by a space: ``- 5 + 10 = 5`` is False, while ``-3 + 1 = -2`` keeps its minus), ``$ $``, ``\\( \\)``,
        ``\\boxed{}`` and a period after it.
    Unknown, since a model's arithmetic is not written so or its reading is in doubt: a number beside a number or a
    bracket with no operator (``2(3) = 6``, ``6/2(3) = 1``, the mixed number ``3\\frac12``: products or not), square
    brackets and bare braces (``{1+2}*3`` shows as 1+2*3), scientific notation (``2e+3`` may be 2e + 3), thousands
    commas, powers, roots, words, variables, no `=` or more than one, a division by zero, and a line of more than
    MAX_STEP_LINE_CHARS characters. The answers' tokenizer and parser, with their bounds (MAX_TOKENS, MAX_NODES,
    MAX_DEPTH, MAX_LITERAL_DIGITS, MAX_BITS): no text is run as code and no line can take long."""
    if not isinstance(line, str) or len(line) > MAX_STEP_LINE_CHARS or _CTRL_RE.search(line):
        return None
    marker = _LIST_MARKER_RE.match(line)
    # $ $, \( \), a \boxed{} around it and a period after it dropped
    sides = _strip_wrappers(line[marker.end():] if marker else line).split("=")
    if len(sides) != 2 or not all(side.strip() for side in sides):
        return None
    try:
        left, right = (_written_arithmetic(_tokenize(side)) for side in sides)
        if left is None or right is None or not _a_number(right):
            return None
        a, b = _value(left, {}), _value(right, {})
    except (_Refuse, _Undefined, ArithmeticError, RecursionError, ValueError):
        return None
    return a == b if isinstance(a, Fraction) and isinstance(b, Fraction) else None


def _written_arithmetic(toks):
    """The tree of an expression written with numbers, + - * /, round brackets and \\frac{a}{b} only, an operator
    between every two operands; else None. \\frac's braces become brackets, (a)/(b), and any other brace refuses."""
    out, braces = [], []  # braces: for each open brace, what its close writes
    expect_frac_arg = None  # after \frac (and after its numerator): the brace that must come next
    for kind, val in toks:
        if expect_frac_arg is not None:
            if (kind, val) != ("op", "{"):
                return None  # \frac12: the unbraced form is not read
            out.append(("op", "("))
            braces.append(expect_frac_arg)
            expect_frac_arg = None
        elif kind == "cmd" and val in _FRACS:
            out.append(("op", "("))  # (  (a) / (b)  )
            expect_frac_arg = "numerator"
        elif (kind, val) == ("op", "}"):
            if not braces:
                return None
            closing = braces.pop()
            out.append(("op", ")"))
            if closing == "numerator":
                out.append(("op", "/"))
                expect_frac_arg = "denominator"
            else:
                out.append(("op", ")"))
        elif kind == "num" and val[2] is None or kind == "op" and val in "+-*/()":
            out.append((kind, val))
        else:
            return None  # a word, a variable, another bracket or command, scientific notation
    if braces or expect_frac_arg is not None or not _operator_between_operands(out):
        return None
    return _parse(out)


def _operator_between_operands(toks):
    """Every operand (a number or a bracket) follows an operator or an opening bracket, every binary operator an
    operand, and the expression ends with an operand: no juxtaposition, nothing dangling. + and - may open a term."""
    want_operand = True
    for kind, val in toks:
        if want_operand:
            if kind == "num":
                want_operand = False
            elif val not in "(+-":
                return False
        elif kind == "num" or val == "(":
            return False  # 2(3), (1)(2), 2 3: a product not written as one
        elif val != ")":
            want_operand = True
    return not want_operand


def _a_number(node):
    """A number as written: an integer or decimal, a fraction of two (a/b, \\frac{a}{b}), with a sign or none."""
    if node[0] == "neg":
        node = node[1]
    if node[0] == "/":
        return node[1][0] == "n" and node[2][0] == "n"
    return node[0] == "n"


# The built-in step checker `grounded`: the arithmetic statements inside a line of prose, judged by exact rationals
# and held to the problem's numbers (GSM8K's worked solutions are its model: "Tim has 68-30 = 38 apples.").

MAX_PROSE_LINE_CHARS = 400  # grounded: GSM8K train's longest reference line is 350 characters; a longer one is unknown
MAX_PROBLEM_CHARS = 20000  # grounded: the problem's text read for its numbers (GSM8K's longest question: 985)
MAX_UNIT_WORDS = 10  # words read as a unit between a number and its operator ("52 weeks in a year - 2 weeks")

# The numbers a problem may state in words, each with the values it grounds (and that a line may write as digits).
# The cardinals (one to ninety) are numbers in a line too ("48 times two equals 96"); the others only ground, and
# "twenty-five" grounds 20, 5 and 25.
_CARDINALS = {
    "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
    "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
    "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
    "eighty": 80, "ninety": 90,
}
NUMBER_WORDS = {
    **{word: (value,) for word, value in _CARDINALS.items()}, "hundred": (100,), "thousand": (1000,),
    "million": (1000000,),
    "half": (2, Fraction(1, 2)), "twice": (2,), "double": (2,), "triple": (3,), "thrice": (3,), "dozen": (12,),
    "percent": (100,), "quarter": (4, Fraction(1, 4)),
}
# Numbers a solution may use without the problem stating them, each a unit of measure or counting: 1 (the whole:
# 1 - 1/4), 2 (halving, doubling, a pair), 4 (weeks a month, quarters a dollar), 7 (days a week), 10, 12 (months,
# inches, a dozen), 24 (hours), 30 (days a month), 52 (weeks a year), 60 (minutes, seconds), 100 (percent, cents),
# 365 (days a year), 1000 (grams, metres, a thousand).
UNIT_CONSTANTS = (1, 2, 4, 7, 10, 12, 24, 30, 52, 60, 100, 365, 1000)

_CURRENCY = "$\u20ac\u00a3\u00a2"  # $ € £ ¢: dropped, "$1,200" is the number 1200
_MINUS = "-\u2212\u2013"  # -, the minus sign, the en dash
_TIMES = "*\u00d7\u00b7"  # *, ×, ·
_PROSE_OPS = {"\u00f7": "/", "/": "/", "+": "+", "(": "(", ")": ")"}
_LATEX_OPS = {"times": "*", "cdot": "*", "ast": "*", "div": "/"}
# LaTeX commands that write nothing of their own (spacing, sizing, a box, text around a word): skipped, their braces
# too; \$ is the sign, \% a percent after a number.
_LATEX_SILENT = _TEXT_CMDS | _TRANSPARENT_CMDS | {"boxed", "fbox", ",", ";", ":", "!", " ", "quad", "qquad", "(",
                                                  ")", "[", "]", "$"}
_SPACE_GROUP_END = frozenset("0123456789-abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Operators written as words, between two operands: "48 times two equals 96", "70 divided by 7".
_WORD_OPS = {"plus": "+", "minus": "-", "times": "*", "equals": "=", "divided": "/", "multiplied": "*"}
# Words that start a clause: part of a unit only before the = ("$74 - $23 that he spent = $51"), never before an
# operator ("X = 9 because - 18/-2 = 9" holds no "9 because - 18"), nor between an operator and its number.
_CLAUSE_WORDS = frozenset(
    "because so then thus therefore hence since which that who is are was were be been will would could has have "
    "had but or if when while he she it they we you i".split())
# Single letters read as a unit right after a number (400 m, 2000 L; glued: 130g, $280k) in a line where the letter
# stands nowhere else: "m + 55" makes m a variable in its line.
_UNIT_LETTERS = frozenset("mgLk")
_GLUED_UNIT_LETTERS = frozenset("gk")  # 130g, $280k; 10m and 2L stay variables (10m - 7 = 93 is algebra)
_ORDINAL_ENDS = ("st", "nd", "rd", "th")


def check_grounded(lines, record=None, problem=""):
    """The built-in step checker `grounded`: a verdict per line (grounded_verdicts). record is unused."""
    return grounded_verdicts(lines, problem)


def grounded_verdicts(lines, problem=""):
    """A verdict per line: every arithmetic statement inside a line of prose (``Tim has 68-30 = 38 apples.``,
    ``$50/hour * 8 hours = $400``, ``4 * 60 / 5 = 4 * 12 = 48``) judged by exact rationals. A line is False when a
    statement in it is false, True when every statement in it is true and grounded and none is in doubt, and None
    (unknown) otherwise: no statement, one in doubt (a variable, an operand outside it, a running total), or a true
    one whose inputs come from nowhere. docs/verifier.md, "Step checkers", says how a statement is read.

    Grounded: each number of a statement's first side (the computation's inputs) is a number of the problem's text
    (as written there; see _problem_numbers), a side of a true grounded statement earlier in the response (an earlier
    line, or earlier in this line), or one of UNIT_CONSTANTS; a later side's numbers may also come from the earlier
    sides of its chain (one of their numbers, or two combined by + - * /: 12 in ``4 * 60 / 5 = 4 * 12 = 48``). A
    last side that is one number is the result and needs no grounding. So true arithmetic on numbers from nowhere
    (``13 * 7 = 91`` in a problem without 13 and 7) is unknown, and only a true grounded statement's results ground
    later ones.

    Bounded: a line over MAX_PROSE_LINE_CHARS characters is None at once, the problem is read up to
    MAX_PROBLEM_CHARS characters, each side goes through the answers' tokenizer and parser with their bounds, and
    every scan is linear in the line."""
    pool = _problem_numbers(problem)
    out = []
    for line in lines:
        verdict, results = _grounded_line(line, pool)
        out.append(verdict)
        pool |= results
    return out


def _grounded_line(line, pool):
    """(verdict, the values this line grounds for the lines after it)."""
    if not isinstance(line, str) or len(line) > MAX_PROSE_LINE_CHARS or _CTRL_RE.search(line):
        return None, set()
    verdict, results, local = True, set(), set(pool)
    try:
        statements = _statements(_prose_tokens(line, skip_marker=True))
        for sides in statements:
            judged = _judge(sides, local) if sides is not None else None
            if judged is False:
                return False, set()
            if judged is None:
                verdict = None
            else:  # a true grounded statement's sides ground the statements after it
                results |= judged
                local |= judged
    except (_Refuse, _Undefined, ArithmeticError, RecursionError, ValueError):
        return None, set()
    return (verdict if statements else None), results


def _judge(sides, pool):
    """A statement's sides (each a list of tokens): False when two adjacent sides differ; the values of its sides
    when all are equal and its inputs grounded; None when it cannot be read, is true but not grounded, or a link is in
    doubt: a running total (``5 * 60 = 300 + 58 = 358``: the next side starts with the one before), a decimal that
    rounds the value (``600 / 270 = 2.22``), two lone numbers (``100 cents = $1``: a unit changed), percents that
    hold only read as their numbers (``$7500/75% = $100``). A lone result may be written as a percent of a value
    computed in hundredths (``100 - 5 = 95%``) or in cents of one computed in dollars (``$2.50 - $2.24 = 26 cents``)."""
    values = _side_values(sides, hundredths=True)
    if values is None:
        return None
    doubt = False
    for k in range(len(sides) - 1):
        a, b, nxt = values[k], values[k + 1], sides[k + 1]
        result = _lone_number(nxt)
        if a == b or k + 1 == len(sides) - 1 and result and a in result[2]:
            continue
        if _quantity(nxt) and _quantity(sides[k]) or result and _rounds_to(a, result) \
                or nxt[0][0] == "num" and nxt[0][1] == a and not result:
            doubt = True
            continue
        as_numbers = _side_values(sides, hundredths=False) if any(_is_percent(t) for s in sides for t in s) else None
        if as_numbers and (as_numbers[k] == as_numbers[k + 1] or result and _rounds_to(as_numbers[k], result, True)):
            doubt = True  # 1/3 * 100% = 33.333%: true only with its percents read as their numbers
            continue
        return False
    if doubt:
        return None
    known = set(pool)
    for k, side in enumerate(sides):
        if k == len(sides) - 1 and k > 0 and _lone_number(side):
            break  # the result
        for tok in side:
            if tok[0] == "num" and not (_grounded_number(tok, known) or k and _combined(tok[1], sides[:k])):
                return None
    return set(values)


def _side_values(sides, hundredths):
    """Each side's exact value (percents as hundredths, or as the numbers written), or None if one is not read."""
    values = []
    for side in sides:
        text = " ".join((f"({t[2][0]})" if not hundredths and _is_percent(t) else _number_text(t)) if t[0] == "num"
                        else t[1] for t in side)
        tree = _written_arithmetic(_tokenize(text))
        value = _value(tree, {}) if tree is not None else None
        if not isinstance(value, Fraction):
            return None
        values.append(value)
    return values


def _number_text(tok):
    """A number token as the parser reads it: its digits (a percent, fraction or mixed number in brackets), or the
    value of a number word."""
    return str(tok[1]) if tok[4].isalpha() else tok[4]


def _chain_holds(values):
    return all(a == b for a, b in zip(values, values[1:]))


def _rounds_to(value, tok, as_written=False):
    """Whether a number written with decimals (2.22; 33.333%) is value rounded to its places (either way at a tie);
    as_written: a percent by its number."""
    digits = tok[4][1:-5] if _is_percent(tok) else tok[4]
    places = len(digits.partition(".")[2]) if digits.replace(".", "").isdigit() else 0
    written = tok[2][0] if as_written and _is_percent(tok) else tok[1]
    return places > 0 and abs(value - written) * 2 * 10 ** places <= 1


def _grounded_number(tok, known):
    """A number is grounded by its value, another reading of it (a percent's number, cents as dollars), or all of its
    parts (a fraction 2/5: 2 and 5; a mixed number 1 1/2: 1, 1 and 2)."""
    return tok[1] in known or any(v in known for v in tok[2]) or bool(tok[5]) and all(v in known for v in tok[5])


def _combined(value, sides):
    """Whether value is a number of the earlier sides of its chain, or two of them combined by + - * /."""
    nums = [tok[1] for side in sides for tok in side if tok[0] == "num"][:32]
    if value in nums:
        return True
    for i, a in enumerate(nums):
        for b in nums[i + 1:]:
            if value in (a + b, a - b, b - a, a * b) or b and value == a / b or a and value == b / a:
                return True
    return False


def _quantity(side):
    """A side that is one number stated as a quantity, not computed: a whole or decimal number, a mixed number, or a
    fraction with a word after it (1/2 a cup); 40/160 alone is a division."""
    tok = _lone_number(side)
    return tok is not None and (len(tok[5]) != 2 or tok[6])


def _lone_number(side):
    """The number token of a side that is one number, in brackets or not; else None."""
    inner = [t for t in side if t[:2] not in (("op", "("), ("op", ")"))]
    return inner[0] if len(inner) == 1 and inner[0][0] == "num" else None


def _problem_numbers(problem):
    """The values the problem's text grounds, with UNIT_CONSTANTS: each number as written ("$1,200", "2.5", the
    cardinal words of NUMBER_WORDS too); for a percent p (20%, 20 percent) p, p/100, 1 + p/100, 1 - p/100, 100 + p and
    100 - p (a 20% rise is x 1.2, a 20% discount x 0.8 or 80%); for n cents n/100 (dollars); a fraction a/b and a
    mixed number w a/b, and each of their numbers; the other NUMBER_WORDS' values."""
    pool = {Fraction(c) for c in UNIT_CONSTANTS}
    text = problem[:MAX_PROBLEM_CHARS] if isinstance(problem, str) else ""
    toks = _prose_tokens(text, refuse=False)
    for k, tok in enumerate(toks):
        if tok[0] == "num":
            pool |= {tok[1], *tok[2], *tok[5]}  # its value, other readings (cents as dollars), a fraction's parts
            if _is_percent(tok):
                p = tok[2][0]
                pool |= {1 + p / 100, 1 - p / 100, 100 + p, 100 - p}
        elif tok[0] == "unit" and isinstance(tok[1], Fraction):
            pool.add(tok[1])  # a number word read inside a unit (the first two groups)
        elif tok[0] in ("word", "unit") and isinstance(tok[1], str):
            parts = tok[1].split("-")
            for part in parts:
                pool |= {Fraction(v) for v in NUMBER_WORDS.get(part, ())}
            if len(parts) == 2 and _CARDINALS.get(parts[0], 0) in range(20, 100, 10) and parts[1] in _CARDINALS:
                pool.add(Fraction(_CARDINALS[parts[0]] + _CARDINALS[parts[1]]))
    return pool


def _prose_tokens(text, skip_marker=False, refuse=True):
    """A line of prose as tokens (kind, value, as_written, space_before, text): kinds num (value a Fraction, a percent
    applied; as_written the number before that; text the digits for the parser), op (+ - * / ( )), eq, word (lower
    case), var (a single letter other than a, A, I; an unknown LaTeX command), brk (anything else), and unit (a word
    or per-slash read as a unit: _mark_units). Currency signs are dropped; ×, ÷, the minus sign, the en dash and
    LaTeX's \\times \\cdot \\div are operators; \\frac{a}{b} is (a)/(b); other braces and spacing, sizing and text
    commands are silent. skip_marker: a list marker at the start is dropped. A number of more than
    MAX_LITERAL_DIGITS digits refuses (refuse=False: it is skipped). One pass: linear."""
    toks = []
    i, n = 0, len(text)
    marker = _LIST_MARKER_RE.match(text) if skip_marker else None
    if marker:
        i = marker.end()
    space, braces, frac_arg = True, [], None  # braces: what each open brace's close writes
    while i < n:
        c = text[i]
        if c.isspace():
            space, i = True, i + 1
            continue
        if frac_arg is not None and c != "{":
            toks.append(("var", "\\frac", None, space, "\\frac"))  # \frac12: the unbraced form is not read
            frac_arg = None
        if c in _CURRENCY:
            i += 1
            continue
        if "0" <= c <= "9" or c == "." and i + 1 < n and "0" <= text[i + 1] <= "9":
            i = _prose_number(text, i, toks, space, refuse)
        elif c.isalpha():
            j = i + 1
            while j < n and (text[j].isalpha() or text[j] in "\u00b2\u00b3"
                             or text[j] in "'\u2019-&" and j + 1 < n and text[j + 1].isalpha()):
                j += 1
            if j < n and text[j] in "'\u2019" and text[j - 1] == "s":
                j += 1  # couples' rooms
            word = text[i:j]
            if word.lower() in _CARDINALS:
                value = Fraction(_CARDINALS[word.lower()])
                toks.append(("num", value, (), space, word, ()))  # the parser reads str(value): _number_text
            elif len(word) == 1 and (word not in "aAI" or not space and toks and toks[-1][0] == "num"):
                toks.append(("var", word, None, space, word))  # x; 3A, 2L: a letter against a number too
            else:
                toks.append(("word", word.lower(), None, space, word))
            i = j
        elif c == "\\":
            m = _CMD_RE.match(text, i + 1)
            name = m.group() if m else text[i + 1:i + 2]
            i += 1 + len(name)
            if name in _LATEX_OPS:
                toks.append(("op", _LATEX_OPS[name], None, space, name))
            elif name in _FRACS:
                toks.append(("op", "(", None, space, name))
                frac_arg = "numerator"
            elif name == "%" and toks and toks[-1][0] == "num" and not space:
                _percent(toks)
            elif name not in _LATEX_SILENT:
                toks.append(("var" if m else "brk", name, None, space, name))
        elif c == "{":
            braces.append(frac_arg or "")
            if frac_arg:
                toks.append(("op", "(", None, space, c))
            frac_arg = None
            i += 1
        elif c == "}":
            close = braces.pop() if braces else None
            if close == "numerator":
                toks += [("op", ")", None, space, c), ("op", "/", None, False, c)]
                frac_arg = "denominator"
            elif close == "denominator":
                toks += [("op", ")", None, space, c), ("op", ")", None, False, c)]
            elif close is None:
                toks.append(("brk", c, None, space, c))
            i += 1
        elif c == "=":
            toks.append(("eq", c, None, space, c))
            i += 2 if text.startswith("==", i) else 1
        elif c == "*" and text.startswith("**", i):
            toks.append(("brk", "**", None, space, "**"))  # markdown's bold (or Python's power): no operator
            i += 2
        elif c in _MINUS:
            hyphen = c == "-" and not space and toks and i + 1 < n and text[i + 1].isalpha()
            toks.append(("brk" if hyphen else "op", "-", None, space, c))  # 3-day is no subtraction
            i += 1
        elif c in _TIMES or c in _PROSE_OPS:
            toks.append(("op", "*" if c in _TIMES else _PROSE_OPS[c], None, space, c))
            i += 1
        else:
            toks.append(("brk", c, None, space, c))
            i += 1
        space = False
    toks = _merge_numbers(toks)
    _mark_units(toks)
    return toks


def _prose_number(text, i, toks, space, refuse):
    """Reads the number at i into toks and returns the index after it: thousands groups of three digits after a first
    group of one to three (not starting with 0), by commas or single spaces (a space group is followed by no letter
    or hyphen: "12 200-kilobyte" is two numbers); a decimal part; a percent after it (%, \\%, the word percent)."""
    n = len(text)
    j = i
    while j < n and "0" <= text[j] <= "9":
        j += 1
    digits = text[i:j]
    if 1 <= len(digits) <= 3 and digits[0] != "0":
        for sep, end in ((",", "0123456789"), (" ", _SPACE_GROUP_END)):
            k = j
            while (k + 4 <= n and text[k] == sep and text[k + 1:k + 4].isdigit()
                   and (k + 4 == n or text[k + 4] not in end) and len(digits) <= MAX_LITERAL_DIGITS):
                digits += text[k + 1:k + 4]
                k += 4
            if k > j:
                j = k
                break
    if j + 1 < n and text[j] == "." and "0" <= text[j + 1] <= "9":
        k = j + 1
        while k < n and "0" <= text[k] <= "9":
            k += 1
        digits += text[j:k]
        j = k
    if len(digits) > MAX_LITERAL_DIGITS:
        if refuse:
            raise _Refuse
        toks.append(("brk", "digits", None, space, ""))
        return j
    whole = digits.partition(".")[0]
    if j + 1 < n and text[j] == ":" and "0" <= text[j + 1] <= "9" or len(whole) > 1 and whole[0] == "0" \
            or text.startswith("...", j) or text.startswith("\u2026", j):
        while j < n and (text[j] in "0123456789:." or text[j] == "\u2026"):
            j += 1
        toks.append(("var", "~", None, space, "~"))  # a time (7:50), a code (0730), a value cut short (10.33...)
        return j
    value = _num_value((digits, None, None))
    if text[j:j + 2] in _ORDINAL_ENDS and not text[j + 2:j + 3].isalpha():
        toks.append(("ord", value, (), space, digits, ()))  # 1st, 13th: a word, but a result after = (5 + 8 = 13th)
        return j + 2
    toks.append(("num", value, (), space, digits, ()))
    k = j + 1 if text.startswith(" ", j) else j
    if text.startswith("\\%", j):
        _percent(toks)
        return j + 2
    if text.startswith("%", k):
        _percent(toks)
        return k + 1
    if text.startswith("percent", k) and not text[k + 7:k + 8].isalpha():
        _percent(toks)
        return k + 7
    return j


def _percent(toks):
    """The last number is a percent: its value a hundredth of it, its other reading the number itself."""
    kind, value, _, space, digits, parts = toks[-1]
    toks[-1] = (kind, value / 100, (value,), space, f"({digits}/100)", parts)


def _is_percent(tok):
    return tok[0] == "num" and bool(tok[2]) and tok[4].endswith("/100)")


def _merge_numbers(toks):
    """One number token for a mixed number (1 1/2, 5 and 2/3: w + a/b) and for a proper fraction written tight
    (1/2, not 1 / 2 nor 1/2/3 nor 48/2), which binds before the operators around it: 50/ 1/2 is 50 / (1/2) = 100,
    as its spacing says. n cents gets the reading n/100 (dollars) too."""
    out = []
    n, k = len(toks), 0
    while k < n:
        tok = toks[k]
        if _tight_fraction(toks, k):
            a, b = toks[k], toks[k + 2]
            whole = None
            if out and out[-1][0] == "num" and out[-1][1].denominator == 1 and not out[-1][2] and a[3]:
                whole = out.pop()
            elif len(out) > 1 and out[-1][:2] == ("word", "and") and out[-2][0] == "num" \
                    and out[-2][1].denominator == 1 and not out[-2][2]:
                out.pop()
                whole = out.pop()
            if whole is None:
                out.append(("num", a[1] / b[1], (), a[3], f"({a[4]}/{b[4]})", (a[1], b[1])))
            else:
                out.append(("num", whole[1] + a[1] / b[1], (), whole[3], f"({whole[4]}+{a[4]}/{b[4]})",
                            (whole[1], a[1], b[1])))
            k += 3
            continue
        if tok[0] == "word" and tok[1] in ("cents", "cent") and out and out[-1][0] == "num" and not out[-1][2]:
            last = out[-1]
            out[-1] = last[:2] + ((last[1] / 100,),) + last[3:]
        out.append(tok)
        k += 1
    return out


def _tight_fraction(toks, k):
    """Whether toks[k:k + 3] is a proper fraction written tight: two whole numbers, the first the smaller, a /
    between, no space, and no / glued on either side."""
    if k + 2 >= len(toks) or toks[k][0] != "num" or toks[k + 1][:2] != ("op", "/") or toks[k + 2][0] != "num":
        return False
    a, slash, b = toks[k:k + 3]
    if slash[3] or b[3] or a[2] or b[2] or not a[4].isdigit() or not b[4].isdigit() or not 0 < a[1] < b[1]:
        return False  # 48/2 = 24 stays a division
    before = toks[k - 1] if k else None
    after = toks[k + 3] if k + 3 < len(toks) else None
    per = k + 4 < len(toks) and toks[k + 4][0] in ("word", "var") and not toks[k + 4][3]  # 1/12/day: a per-slash
    return not (before and before[:2] == ("op", "/") and not a[3]
                or after and after[:2] == ("op", "/") and not after[3] and not per)


def _word_op(toks, j):
    """(operator, tokens it takes) when toks[j] is an operator written as a word (plus, minus, times, equals, divided
    by, multiplied by) with an operand after it; else None."""
    tok = toks[j]
    if tok[0] != "word" or tok[1] not in _WORD_OPS:
        return None
    size = 2 if tok[1] in ("divided", "multiplied") else 1
    if size == 2 and not (j + 1 < len(toks) and toks[j + 1][:2] == ("word", "by")):
        return None
    return (_WORD_OPS[tok[1]], size) if _operand_at(toks, j + size) else None


def _operand_at(toks, j):
    return j < len(toks) and (toks[j][0] == "num" or toks[j][:2] == ("op", "("))


def _mark_units(toks):
    """Words read as units become kind unit (the statements skip them):
      * a per-slash with the word after it ($50/hour, 4 tickets/ride, 1000 ml/L);
      * a letter right after a number, in a line where it stands nowhere else: one of _UNIT_LETTERS (400 m, 130g),
        or any but x at the end of a run (= 4m, = 4582 L of water);
      * the words between a number and the operator, = or ) after it (20 sheep + 160 sheep, 5 lemon sours* 32,
        3 lbs. coffee * 40, 8 friends + 1 (Samuel) + 1 (Cathy)): up to MAX_UNIT_WORDS, a bracket of words only among
        them, a clause word only before an = ($74 - $23 that he spent = $51), a number in words only before =, + or -
        (25 minutes in the next five floors + 80; but two weeks seven times 2 is 14), a number word not before + or -
        (6 dozen * 12 eggs/dozen, but 2 dozen + 5 is 29);
      * up to 3 words between an operator and its number (2 * the 10 marbles, + Cynthia's 8 gallons), neither clause
        nor number words nor capitalized but for an owner's name (Week 1 + Week 2: a label's word).
    An x or X between a number (or its unit) and an operand is a times sign (0.2 x 50, $300/month x 12 months), and
    so are the operators written as words there (48 times two equals 96). Each token is looked at a bounded number
    of times (a unit's scan is bounded): linear."""
    n = len(toks)
    for k, tok in enumerate(toks):  # whether a word follows the number (5 hours, 1/2 a cup): a quantity, see _quantity
        if tok[0] in ("num", "ord"):
            toks[k] = tok + (k + 1 < n and toks[k + 1][0] == "word",)
    for k in range(n - 1):
        after = toks[k + 1]
        if toks[k][:2] == ("op", "/") and (after[0] == "word" or after[0] == "var" and not after[3] and not toks[k][3]
                                           and k and toks[k - 1][0] in ("word", "unit")):
            toks[k], toks[k + 1] = ("unit",) + toks[k][1:], ("unit",) + after[1:]
        elif toks[k][:2] == ("op", ")") and after[:2] in (("var", "x"), ("var", "X")) and _operand_at(toks, k + 2):
            toks[k + 1] = ("op", "*") + after[2:]  # (24/12) x $4
    after_numbers = {}  # each letter: whether it stands only right after numbers in this line
    for k, tok in enumerate(toks):
        if tok[0] == "var":
            after_numbers[tok[1]] = after_numbers.get(tok[1], True) and k > 0 and toks[k - 1][0] == "num"
    for k, tok in enumerate(toks):
        if tok[0] == "var" and after_numbers.get(tok[1]):
            last = k + 1 == n or toks[k + 1][0] not in ("num", "op", "eq", "var")
            if tok[1] in _UNIT_LETTERS and (tok[3] or tok[1] in _GLUED_UNIT_LETTERS) or last and tok[1] not in "xX":
                toks[k] = ("word",) + tok[1:]
    k = 0
    while k < n:
        if toks[k][0] != "num":
            k += 1
            continue
        j, words, clause, spoken, number_word, steps = k + 1, 0, False, False, False, 0
        while j < n and steps < 4 * MAX_UNIT_WORDS:
            tok, steps = toks[j], steps + 1
            if tok[0] == "unit" or tok[:2] == ("brk", ".") and not tok[3] and toks[j - 1][0] in ("word", "unit"):
                j += 1  # a per-slash; an abbreviation's period (lbs.)
            elif (tok[0] in ("word", "ord") or tok[0] == "num" and tok[4].isalpha()) and words < MAX_UNIT_WORDS \
                    and not _word_op(toks, j):
                clause = clause or tok[1] in _CLAUSE_WORDS
                spoken = spoken or tok[0] == "num"
                number_word = number_word or tok[1] in NUMBER_WORDS
                j, words = j + 1, words + 1
            elif tok[:2] == ("op", "(") and words < MAX_UNIT_WORDS:
                m = j + 1
                while m < n and m - j <= MAX_UNIT_WORDS and toks[m][0] == "word":
                    m += 1
                if m == j + 1 or m >= n or toks[m][:2] != ("op", ")"):
                    break
                j, words = m + 1, words + 1
            else:
                break
        if j >= n:
            break
        end, word_op = toks[j], _word_op(toks, j)
        times = end[:2] in (("var", "x"), ("var", "X")) and _operand_at(toks, j + 1)
        equals = end[0] == "eq" or word_op and word_op[0] == "="
        adds = end[0] == "op" and end[1] in "+-" or word_op and word_op[0] in "+-"
        if (times or word_op or equals or end[0] == "op" and end[1] != "(") and (equals or not clause) \
                and not (number_word and adds) and (equals or not spoken or end[0] == "op" and end[1] in "+-"):
            for m in range(k + 1, j):
                toks[m] = ("unit",) + toks[m][1:]
            if times:
                toks[j] = ("op", "*") + end[2:]
            elif word_op:
                toks[j] = ("eq" if word_op[0] == "=" else "op", word_op[0]) + end[2:]
                if word_op[1] == 2:
                    toks[j + 1] = ("unit",) + toks[j + 1][1:]
            k = j
        else:
            k += 1  # not a unit: the next number (a number word among these words) starts its own
    for k in range(n - 1):
        if toks[k][0] == "op" and toks[k][1] in "+-*/":
            m = k + 1
            while m < n and m - k <= 3 and toks[m][0] == "word" and toks[m][1] not in _CLAUSE_WORDS \
                    and toks[m][1] not in NUMBER_WORDS and not _word_op(toks, m) \
                    and not (toks[m][4][0].isupper() and toks[m][4][-2:] not in ("'s", "\u2019s")):
                m += 1
            if k + 1 < m < n and toks[m][0] == "num":
                for w in range(k + 1, m):
                    toks[w] = ("unit",) + toks[w][1:]


def _statements(toks):
    """The statements of a line: each run of numbers, operators, = and variables (units skipped) that holds an =
    gives its sides (lists of tokens), or None when it is in doubt (_statement). A number right after a number ends a
    run ("24000/6=4000 6 megabyte pictures"); "= =" is one =; an ordinal right after = is the result (5 + 8 = 13th
    floor). A run that comes after one ending with an operator, words between and no clause word ("7 adults + Shonda
    (1) + 2 = 10"), has its left operand outside it: in doubt unless its first side is a label."""
    out, run, dangling = [], [], False
    for tok in toks + [("brk", "", None, True, "")]:
        if tok[0] == "unit":
            continue
        if tok[0] == "ord" and run and run[-1][0] == "eq":
            run.append(("num",) + tok[1:])  # 5 + 8 = 13th floor: the ordinal is the result, and ends the run
        if tok[0] == "num" and run and run[-1][0] == "num" or tok[0] not in ("num", "op", "eq", "var"):
            if any(t[0] == "eq" for t in run):
                sides = _statement(run, dangling)
                if sides != ():
                    out.append(sides)
            ends_with_operator = bool(run) and run[-1][0] == "op" and run[-1][1] in "+-*/"
            dangling = (dangling and not run or ends_with_operator) and tok[0] == "word" \
                and tok[1] not in _CLAUSE_WORDS
            run = []
            if tok[0] != "num":
                continue
        if not (tok[0] == "eq" and run and run[-1][0] == "eq"):
            run.append(tok)
    return out


def _statement(run, dangling=False):
    """A run's sides; None when in doubt: a variable or an unknown command in it, an empty side, an operator whose
    left operand is outside the run (Tim's age - 5 = 10; D+5 = 23; dangling: the run before it ended with an
    operator). Dropped: a first side that is empty, one variable or one number, a label (the total = ..., x = 60/2 =
    30, 14 hours = 14 * 60 = 840 minutes); a bracket opened before the run or closed after it. A number glued to a
    bracket is a product (22(2), 40(.50)) in a side that does not divide (6/2(3) stays unread). () when it is no
    statement: one side left."""
    sides = [[]]
    for tok in run:
        if tok[0] == "eq":
            sides.append([])
        else:
            sides[-1].append(tok)
    label = not sides[0] or len(sides[0]) == 1 and sides[0][0][0] == "var"
    if label:
        sides = sides[1:]
    if len(sides) < 2:
        return ()
    if not all(sides) or any(tok[0] == "var" for side in sides for tok in side):
        return None
    head = sides[0][0]
    if head[0] == "op" and (head[1] in "+*/)" or head[1] == "-" and len(sides[0]) > 1 and sides[0][1][3]):
        return None
    depth = sum((t[1] == "(") - (t[1] == ")") for t in sides[0] if t[0] == "op")
    while depth > 0 and sides[0][0][:2] == ("op", "("):
        sides[0], depth = sides[0][1:], depth - 1
    depth = sum((t[1] == "(") - (t[1] == ")") for t in sides[-1] if t[0] == "op")
    while depth < 0 and sides[-1][-1][:2] == ("op", ")"):
        sides[-1], depth = sides[-1][:-1], depth + 1
    if not all(sides):
        return None
    if _quantity(sides[0]):
        sides, label = sides[1:], True
        if len(sides) < 2:
            return ()
    if dangling and not label:
        return None
    return [_glued_products(side) for side in sides]


def _glued_products(side):
    """A side with a times sign between a number or ) and a ( glued to it (22(2) + 7(2)), unless it divides."""
    if any(t[:2] == ("op", "/") for t in side):
        return side
    out = []
    for tok in side:
        if out and tok[:2] == ("op", "(") and not tok[3] and (out[-1][0] == "num" or out[-1][:2] == ("op", ")")):
            out.append(("op", "*", None, False, "*"))
        out.append(tok)
    return out


def _side_tree(side):
    """A side's tree through the answers' tokenizer and parser (their bounds), or None when it is not arithmetic."""
    return _written_arithmetic(_tokenize(" ".join(t[4] if t[0] == "num" else t[1] for t in side)))


# The built-in step checkers by their config name, called as name(lines, record, problem=problem's text); a user's
# checker is called as name(lines, record).
STEP_CHECKERS = {"arithmetic": check_arithmetic, "grounded": check_grounded}


def load_step_checker(path, name):
    """The function ``name`` of the Python file ``path`` (a user's step checker, run in the worker only), checked
    to take (lines, record). Raises with a one-line reason."""
    return _load_user_function(path, name, ("lines", {}), "(lines, record)", "rlvr_step_checker")


def step_verdicts(value, n):
    """A step checker's result as a list of n verdicts (True, False or None), else TypeError/ValueError (one line)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"it returned {type(value).__name__}, not a list of verdicts")
    if len(value) != n:
        raise ValueError(f"it returned {len(value)} verdicts for {n} lines")
    value = [bool(v) if _numpy_bool(v) else v for v in value]
    bad = next((v for v in value if v is not None and not isinstance(v, bool)), None)
    if bad is not None:  # an int (1, 0) is no verdict: a count or an index returned by mistake would pass as one
        raise TypeError(f"it returned {type(bad).__name__} {str(bad)[:40]!r} as a verdict, not True, False or None")
    return value


def _numpy_bool(v):
    """numpy's boolean scalar (numpy.bool_, whose type numpy 2 names 'bool'), told without importing numpy: a checker
    that compares numpy arrays returns these, and they are booleans."""
    return type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_")


# ----------------------------------------------------------------------------------------------
# hard wall-clock safety net
# ----------------------------------------------------------------------------------------------
def load_reward_function(path, name):
    """The function ``name`` of the Python file ``path`` (a user's own reward, run in the worker only),
    checked to take (response, answer, record). Raises with a one-line reason."""
    return _load_user_function(path, name, ("response", "answer", {}), "(response, answer, record)",
                               "rlvr_reward_function")


def _load_user_function(path, name, example, call, module_name):
    """The function ``name`` of the Python file ``path``, checked to take the arguments of `example`."""
    import importlib.util
    import inspect

    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python file")
    # as `python path` would: the file's folder first on the import path, so a module beside it imports
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise AttributeError(f"{path} has no function {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{path}: {name!r} is {_a_type(fn)}, not a function")
    try:
        inspect.signature(fn).bind(*example)
    except (TypeError, ValueError):
        raise TypeError(f"{name}{inspect.signature(fn)} cannot be called as {name}{call}") from None
    return fn


def _a_type(value):
    """'an int', 'a str': the type of a value with its article."""
    kind = type(value).__name__
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


def reward_value(value):
    """A reward function's result as a float: a finite real number (not a bool), else TypeError/ValueError."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"it returned {type(value).__name__} {str(value)[:40]!r}, not a number")
    if not math.isfinite(float(value)):
        raise ValueError(f"it returned {float(value)}, not a finite number")
    return float(value)


def _worker_main(conn, score_fn, reward_function=None, step_checker=None):
    # Ctrl-C in a terminal reaches the whole process group; the parent decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent's stdout is its table (for reading and for parsers): what a reward function prints goes to stderr.
    os.dup2(2, 1)
    _die_with_parent(os.getppid())
    try:
        conn.send(("ready", None))
    except Exception:
        return
    user, checker = None, STEP_CHECKERS.get(step_checker) if isinstance(step_checker, str) else None
    if _user_files(reward_function, step_checker):  # loaded once, within the parent's time limit ("loaded")
        which = None
        try:
            # which file is loading is set before its load, so a failure is blamed on its own file
            if reward_function is not None:
                which = "reward_function"
                user = load_reward_function(*reward_function)
            if isinstance(step_checker, tuple):
                which = "step_checker"
                checker = load_step_checker(*step_checker)
            conn.send(("loaded", None))
        except BaseException as exc:
            try:
                conn.send(("loaded", (which, _failure(exc))))
            except Exception:
                pass
            return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        try:
            if isinstance(msg, dict):  # a response's lines for the step checker (check_steps)
                # the checker gets a copy, so one that appends to its lines is still held to the lines sent
                lines = msg["lines"]
                if isinstance(step_checker, str):  # a built-in reads the problem's text too
                    out = checker(list(lines), msg["record"], problem=msg["problem"])
                else:
                    out = checker(list(lines), msg["record"])
                out = step_verdicts(out, len(lines))
            else:
                out = score_fn(msg[0], msg[1])
                if len(msg) > 2:  # with a record: the user's reward function too, within the same time limit
                    out = (*out, reward_value(user(msg[0], msg[1], msg[2])))
            conn.send(("ok", out))
        except BaseException as exc:  # report any failure of score_fn as a crash
            try:
                conn.send(("err", _failure(exc)))
            except Exception:
                return


def _user_files(reward_function, step_checker):
    """The user's files the worker imports at its start: a reward function's, a step checker's."""
    return [f for f in (reward_function, step_checker) if isinstance(f, tuple)]


def _die_with_parent(parent_pid):
    """A worker whose parent is gone (SIGKILL: no chance to stop it) exits, even while a reward function hangs:
    a daemon thread polls the parent's pid (the GIL lets it run beside any Python loop)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="rlvr-parent-watch").start()


class RewardFunctionError(Exception):
    """A user's file could not be loaded in the worker (raised by TimedVerifier's start): one line. which: the
    reward_function's or the step_checker's (None: the import hung or exited, whichever file it was in)."""

    def __init__(self, message, which=None):
        super().__init__(message)
        self.which = which


def _failure(exc):
    """One line: the exception's type and the first line of its text."""
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}".rstrip(": ")


class TimedVerifier:
    """Scores in a persistent worker process (multiprocessing "spawn" context, never fork) with
    a hard wall-clock limit per call. Overrun: the worker is killed, the result is
    (0.0, None, "timeout") and a new worker is started on the next call. A worker that dies or
    whose score_fn raises gives (0.0, None, "crash"). ``score_fn`` must be a picklable
    module-level callable. Counters: n_calls, n_timeouts, n_crashes, n_starts; last_error: the last
    crash's or timeout's reason (one line). The worker's stdout is this process's stderr, and it exits
    when this process dies.

    ``reward_function``: (path, name) of a user's reward function, loaded once in the worker (never in
    this process); ``score(response, gold, record)`` with a record also calls name(response, gold,
    record) under the same time limit and returns its number as a fourth item. A hang, an exception, a
    result that is not a finite number: (0.0, None, "timeout" / "crash"), counted, as for the verifier.
    The file is imported when the worker starts, within timeout_s too: an import that raises, hangs or
    exits makes the start raise RewardFunctionError (one line), and a score() that had to start one a crash.

    ``step_checker``: a built-in, "arithmetic" (check_arithmetic) or "grounded" (check_grounded), or (path, name) of a
    user's step checker, loaded in the worker as a reward function is; ``check_steps(lines, record, problem)`` returns
    its verdicts under the same time limit (a built-in is called with the problem's text too, a user's checker as
    name(lines, record))."""

    def __init__(self, timeout_s: float = 2.0, score_fn=score, startup_timeout_s: float = 120.0,
                 reward_function: tuple[str, str] | None = None, step_checker: str | tuple[str, str] | None = None):
        self.timeout_s = float(timeout_s)
        self.score_fn = score_fn
        self.reward_function = reward_function
        self.step_checker = step_checker
        self.last_error = None
        self.startup_timeout_s = float(startup_timeout_s)
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self._conn = None
        self._lock = threading.Lock()
        self.n_calls = 0
        self.n_timeouts = 0
        self.n_crashes = 0
        self.n_starts = 0

    def _start(self):
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child, self.score_fn, self.reward_function,
                                                            self.step_checker),
                                 daemon=True, name="rlvr-verifier-worker")
        proc.start()
        child.close()
        self.n_starts += 1
        try:
            if not parent.poll(self.startup_timeout_s):
                raise RuntimeError("verifier worker did not start")
            if parent.recv() != ("ready", None):
                raise RuntimeError("verifier worker sent an unexpected message")
            if _user_files(self.reward_function, self.step_checker):
                self._wait_loaded(parent)
        except BaseException:
            self._proc, self._conn = proc, parent
            self._stop()
            raise
        self._proc, self._conn = proc, parent

    def _wait_loaded(self, conn):
        """The user's files (reward function, step checker) imported and their functions found within timeout_s, else
        RewardFunctionError: an exception, a hang or an exit (os._exit, a crash) at import is one line, not a stuck
        start."""
        path = " and ".join(f[0] for f in _user_files(self.reward_function, self.step_checker))
        if not conn.poll(self.timeout_s):
            raise RewardFunctionError(f"{path} did not finish importing within {self.timeout_s:g} s (the verifier's "
                                      "time limit; work done at module level counts)")
        try:
            kind, error = conn.recv()
        except (EOFError, OSError):
            raise RewardFunctionError(f"the worker exited while importing {path} (an exit or a crash at module "
                                      "level)") from None
        if error is not None:
            raise RewardFunctionError(error[1], error[0])

    def _stop(self):
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def _request(self, msg):
        """One call in the worker under the time limit: ("ok", its result), or ("timeout" / "crash", None) with
        last_error set and counted (a worker that hung is killed; the next call starts a new one)."""
        with self._lock:
            self.n_calls += 1
            try:
                if self._proc is None or not self._proc.is_alive():
                    if self._proc is not None:
                        self._stop()
                    self._start()
                self._conn.send(msg)
            except Exception as exc:
                self._stop()
                self.n_crashes += 1
                self.last_error = str(exc) if isinstance(exc, RewardFunctionError) else _failure(exc)
                return "crash", None
            if not self._conn.poll(self.timeout_s):
                self._stop()
                self.n_timeouts += 1
                self.last_error = f"no result within {self.timeout_s:g} s"
                return "timeout", None
            try:
                kind, out = self._conn.recv()
            except Exception:
                self._stop()
                self.n_crashes += 1
                self.last_error = "the worker stopped"
                return "crash", None
            if kind != "ok":
                self.n_crashes += 1
                self.last_error = str(out)
                return "crash", None
            return "ok", out

    def check_steps(self, lines, record=None, problem=""):
        """The step checker's verdicts for a response's lines (True, False or None each): (verdicts, "ok"), or
        (None, "timeout" / "crash") with last_error, counted like the verifier's: a hang, an exception, a result
        that is not a list of len(lines) verdicts. problem: the problem's text, which a built-in checker reads
        (grounded: the numbers a line may use); a user's checker gets lines and record only."""
        lines = [line if isinstance(line, str) else str(line) for line in lines]
        problem = problem if isinstance(problem, str) else ""
        status, out = self._request({"lines": lines, "record": record, "problem": problem})
        return (out, "ok") if status == "ok" else (None, status)

    def score(self, response, gold, record=None):
        user = record is not None and self.reward_function is not None
        if not isinstance(response, str) or not isinstance(gold, str):
            return score(response, gold) + ((0.0,) if user else ())  # trivially bounded; no odd objects pickled
        kind, out = self._request((response, gold, record) if user else (response, gold))
        if kind != "ok":
            return (0.0, None, kind)
        with self._lock:
            try:
                r, ans, status, *value = out
                r = 1.0 if float(r) == 1.0 else 0.0
                if ans is not None and not isinstance(ans, str):
                    ans = str(ans)
                return (r, ans, str(status), *(float(v) for v in value))
            except Exception:
                self.n_crashes += 1
                self.last_error = "the worker's answer could not be read"
                return (0.0, None, "crash")

    def reward(self, response, gold):
        return self.score(response, gold)[0]

    def close(self):
        with self._lock:
            conn, proc = self._conn, self._proc
            if conn is not None and proc is not None and proc.is_alive():
                try:
                    conn.send(None)
                    proc.join(1)
                except Exception:
                    pass
            self._stop()

    def __enter__(self):
        # Start the worker now, so its start-up is not charged to the first scored response.
        with self._lock:
            if self._proc is None:
                self._start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
