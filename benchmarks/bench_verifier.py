"""Benchmark of verifier.py: verifier calls per second on real-looking responses, and the
slowest hostile input.

    python benchmarks/bench_verifier.py [--n 200] [--repeat 5] [--json out.json] [--no-worker]

Responses are built from the real reference answers in ../shared/data (first 50 training
answers + MATH-500) when that folder exists, else from a built-in list of answers: some
reasoning text, then ``\\boxed{answer}`` (half of them) or a near miss (the last digit changed).
"""

import argparse
import json
import platform
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import verifier  # noqa: E402

DATA = ROOT.parent / "shared" / "data"

BUILTIN_ANSWERS = [
    "0", "98", "(3, -1)", "[0,3)", "\\$42409", "k = \\frac{-33}{2}", "2 \\text{ euros}",
    "10\\frac{1}{12}", "\\frac{1}{2}", "(0,5)", "\\frac{20}{3}", "\\sqrt{2}+1", "8.75",
    "2, 3, \\text{ and } 4", "-29x^5(7x^6-2)", "729", "-7", "1 \\pm \\sqrt{19}",
    "(-\\infty, 2) \\cup (3, \\infty)", "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}",
    "\\text{(C)}", "y = 2x + 3", "-2 + 7i", "11,\\! 111,\\! 111,\\! 100", "90^\\circ",
    "\\frac{3\\sqrt{3}}{4}", "204_5", "x^5 - x^4 + x^3 - x^2 + x - 1", "\\pi", "12\\pi",
]

REASONING = [
    "We start by writing the condition as an equation in $x$. ",
    "Substituting $x = 2$ gives $2^2 + 3 \\cdot 2 = 10$, which checks out. ",
    "By the quadratic formula, $x = \\frac{-b \\pm \\sqrt{b^2 - 4ac}}{2a}$. ",
    "Therefore the two cases give the same value, and we can simplify. ",
    "Note that $\\left(\\frac{a}{b}\\right)^2 = \\frac{a^2}{b^2}$ for $b \\neq 0$. ",
]

HOSTILE = {
    "python code in a box": "\\boxed{__import__('os').system('echo pwned')}",
    "tower 9^{9^{9^9}}": "\\boxed{9^{9^{9^9}}}",
    "100000!": "\\boxed{100000!}",
    "3000 nested parens": "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    "300 nested fracs": "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "5000 nested braces": "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    "20,000-digit number": "\\boxed{" + "9" * 20000 + "}",
    "1 MB response": "x" * 1_000_000 + " \\boxed{5}",
    "5000 unclosed boxes": "\\boxed{" * 5000,
    "integral": "\\boxed{\\int_0^1 x\\,dx}",
    "sum": "\\boxed{\\sum_{n=1}^{\\infty} \\frac{1}{n^2}}",
    "NUL bytes": "\x00" * 100_000 + "\\boxed{\x005}",
    "sin(10^100)": "\\boxed{\\sin(10^{100})}",
    "(3/2)^100000": "\\boxed{(\\frac{3}{2})^{100000}}",
    "whitespace flood": "\\boxed{1" + " " * 1990 + "x}",
    "100 variables": "\\boxed{" + "+".join(f"x_{{{i}}}" for i in range(100)) + "}",
}


def load_answers():
    if DATA.is_dir():
        answers = [r["answer"] for r in json.loads((DATA / "math_train_first50.json").read_text())]
        answers += [r["answer"] for r in json.loads((DATA / "math500_test.json").read_text())]
        return answers, "../shared/data (first 50 + MATH-500)"
    return list(BUILTIN_ANSWERS), "built-in list"


def near_miss(answer):
    digits = [m.start() for m in re.finditer(r"[0-9]", answer)]
    if not digits:
        return answer + "+1"
    i = digits[-1]
    return answer[:i] + str((int(answer[i]) + 1) % 10) + answer[i + 1:]


def build_responses(answers, n, seed=0):
    rng = random.Random(seed)
    out = []
    for k in range(n):
        gold = answers[k % len(answers)]
        text = "".join(rng.choice(REASONING) for _ in range(rng.randint(3, 12)))
        pred = gold if k % 2 == 0 else near_miss(gold)
        out.append((f"{text}\nThe final answer is\n\\boxed{{{pred}}}", gold))
    return out


def time_calls(fn, pairs, repeat, clear_cache):
    best = None
    statuses = {}
    for _ in range(repeat):
        if clear_cache:
            verifier._analyze_cached.cache_clear()
        t0 = time.perf_counter()
        for response, gold in pairs:
            s = fn(response, gold)
            statuses[s[2]] = statuses.get(s[2], 0) + 1
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return len(pairs) / best, {k: v // repeat for k, v in statuses.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="number of responses (default 200)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--no-worker", action="store_true", help="skip the TimedVerifier figure")
    args = ap.parse_args(argv)

    answers, source = load_answers()
    pairs = build_responses(answers, args.n)
    rows = []

    cold, st = time_calls(verifier.score, pairs, args.repeat, clear_cache=True)
    rows.append(("score(), cold parse cache", cold, st))
    warm, st = time_calls(verifier.score, pairs, args.repeat, clear_cache=False)
    rows.append(("score(), warm cache (8 rollouts share a gold)", warm, st))
    if not args.no_worker:
        with verifier.TimedVerifier(timeout_s=2.0) as tv:
            tv.score(*pairs[0])  # spawn cost paid once, outside the timing
            timed, st = time_calls(tv.score, pairs, max(1, args.repeat // 2), clear_cache=False)
            rows.append(("TimedVerifier.score() (worker + IPC)", timed, st))

    hostile = []
    for name, response in HOSTILE.items():
        worst = 0.0
        for _ in range(3):
            verifier._analyze_cached.cache_clear()
            t0 = time.perf_counter()
            r = verifier.reward(response, "1")
            worst = max(worst, time.perf_counter() - t0)
            assert r == 0.0, name
        hostile.append((name, worst))
    hostile.sort(key=lambda x: -x[1])

    print(f"verifier benchmark: {len(pairs)} responses from {source}; python "
          f"{platform.python_version()} on {platform.machine()}")
    print(f"{'path':48s} {'calls/s':>10s}  statuses")
    for name, rate, st in rows:
        print(f"{name:48s} {rate:10.0f}  {st}")
    print(f"\n{'hostile input (reward 0)':48s} {'worst ms':>10s}")
    for name, t in hostile:
        print(f"{name:48s} {t * 1000:10.3f}")
    print(f"\nslowest hostile case: {hostile[0][0]} ({hostile[0][1] * 1000:.3f} ms)")

    if args.json:
        Path(args.json).write_text(json.dumps({
            "responses": len(pairs), "source": source,
            "calls_per_second": {name: round(rate, 1) for name, rate, _ in rows},
            "statuses": rows[0][2],
            "hostile_seconds": {name: t for name, t in hostile},
            "slowest_hostile": {"name": hostile[0][0], "seconds": hostile[0][1]},
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
