"""How a step checker's verdicts agree with GSM8K's worked solutions (issue 68): the reference lines are right.

    python benchmarks/step_checker_agreement.py --checker grounded --data ../shared/data/gsm8k_test.jsonl \\
        --out runs/grounded_test.jsonl [--record benchmarks/step_checker_agreement.json]

--checker is a built-in (arithmetic, grounded) or path/to/file.py:name. --data holds records in GSM8K's form, one
JSON object a line (.jsonl or .jsonl.gz): --problem-field (question) the problem, --answer-field (answer) a worked
solution whose lines carry calculator annotations <<48/2=24>> and end "#### N". Each solution is cut before ####,
its annotations dropped and its blank lines skipped; the checker gets those lines and a record holding the problem
alone, never the reference it judges (a built-in gets the problem's text as `problem` too). It runs in this process,
the very function the verifier's worker calls. --out gets one JSON line per solution line:
{"record": i, "line": k, "text": ..., "verdict": true|false|null}.

Printed, and with --record PATH written to PATH as JSON under the checker's name (PATH holds an object of them: an
entry of another checker already there is kept):
  annotated lines   the lines that carried a <<...>> annotation: right / wrong / unknown
  other lines       the rest (prose, or arithmetic the authors did not annotate)
  changed result    in each solution, one annotated line (drawn with --seed) whose annotation computes (an operator
                    before its last =; <<20=20>> restates a number, as in "x = 20") and whose stated result (the
                    number after the annotation) is changed to that result + 1 or x 2 (drawn too; + 1 for a 0): the
                    share judged wrong. The solution's other lines are as written.
  from nowhere      in each solution, one annotated line (drawn) whose annotation computes, with one operand of
                    it, found in the text before it, replaced by a number from nowhere (13 to 999, drawn; not a
                    number of the problem or of the solution up to that line, in digits or as a number word, nor a
                    unit constant) and its stated result made to agree (the annotation recomputed exactly; drawn
                    again until the result is a whole number or a decimal of up to 4 places): the share judged
                    right.
A solution with no line to change is left out of that figure (the count says how many were changed). Mistakes in
the arguments are one line and exit 2, before any line is checked.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import verifier  # noqa: E402

ANNOTATION = re.compile(r"<<([^<>]*)>>")
# a number as GSM8K writes it: thousands groups by commas, a decimal part
NUMBER = re.compile(r"(?<![0-9.,])(?:[1-9][0-9]{0,2}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?![0-9])")
STATED_RESULT = re.compile(r"(?:[1-9][0-9]{0,2}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?![0-9])")
NOWHERE = range(13, 1000)


class Mistake(Exception):
    """A mistake in the arguments: one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own mistakes (a missing --checker) are one line too
        raise Mistake(f"{message}; python benchmarks/step_checker_agreement.py --help says what each takes")


def error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def read_records(path: Path, problem_field: str, answer_field: str) -> list[dict]:
    """The data set's records, each checked to hold the two fields as strings."""
    if not path.is_file():
        raise Mistake(f"--data {path}: no such file; pass a GSM8K-form .jsonl or .jsonl.gz (e.g. "
                      "../shared/data/gsm8k_test.jsonl)")
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")) as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise Mistake(f"--data {path} cannot be read ({type(e).__name__}: {e}); pass a readable .jsonl or "
                      ".jsonl.gz file") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise Mistake(f"--data {path}: line {number} is not JSON ({e.msg}); each line must be one JSON object "
                          "(GSM8K's form)") from None
        if not isinstance(record, dict):
            raise Mistake(f"--data {path}: line {number} is a JSON {type(record).__name__}, not an object; each line "
                          "must be one JSON object (GSM8K's form)")
        for flag, field in (("--problem-field", problem_field), ("--answer-field", answer_field)):
            if not isinstance(record.get(field), str):
                raise Mistake(f"--data {path}: line {number} has no text field {field!r}; pass the field that holds "
                              f"it with {flag} (its fields: {', '.join(sorted(record)) or 'none'})")
        records.append(record)
    if not records:
        raise Mistake(f"--data {path} holds no records; pass a GSM8K-form .jsonl file")
    return records


def load_checker(spec: str):
    """(function, built_in) for --checker: the function the verifier's worker calls."""
    if spec in verifier.STEP_CHECKERS:
        return verifier.STEP_CHECKERS[spec], True
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise Mistake(f"--checker {spec}: pass a built-in ({', '.join(verifier.STEP_CHECKERS)}) or "
                      "path/to/file.py:function_name")
    if not Path(path).is_file():
        raise Mistake(f"--checker {spec}: {path} is not a file; pass an existing path/to/file.py:function_name")
    try:
        return verifier.load_step_checker(path, name), False
    except BaseException as e:  # the user's file, imported: any failure is its one line
        raise Mistake(f"--checker {spec} cannot be loaded: {verifier._failure(e)}") from None


def check_out(out: Path, flag: str = "--out", what: str = "the verdicts") -> None:
    if out.is_dir():
        raise Mistake(f"{flag} {out} is a folder; pass the path of a file to write {what} to")
    if not out.parent.is_dir():
        raise Mistake(f"{flag} {out}: no folder {out.parent} to write it in; create the folder first, or pass a "
                      "path in an existing one")


def read_record(path: Path, flag: str) -> dict:
    """--record's file as it is now: {} if absent, else the JSON object it holds."""
    check_out(path, "--record", "the summary")
    if not path.exists():
        return {}
    try:
        recorded = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Mistake(f"--record {flag} cannot be read as JSON ({type(e).__name__}); pass a new file or the record "
                      "this script wrote") from None
    if not isinstance(recorded, dict):
        raise Mistake(f"--record {flag} holds a JSON {type(recorded).__name__}, not the object of checkers this "
                      "script writes; pass a new file or the record this script wrote")
    return recorded


def solution_lines(answer: str) -> tuple[list[str], list[str]]:
    """(the lines as written, annotations kept; the lines the checker reads): the solution before ####, blank lines
    skipped."""
    raw = [line for line in answer.split("####")[0].splitlines() if line.strip()]
    return raw, [ANNOTATION.sub("", line) for line in raw]


def run_checker(checker, built_in: bool, lines: list[str], problem_field: str, problem: str) -> list:
    record = {problem_field: problem}  # the problem alone: never the reference solution it judges
    out = checker(list(lines), record, problem=problem) if built_in else checker(list(lines), record)
    return verifier.step_verdicts(out, len(lines))


def decimal_text(value: Fraction, places: int = 4) -> str | None:
    """A value as a whole number or a decimal of up to `places` places, exactly; None if it is neither."""
    scaled = value * 10 ** places
    if scaled.denominator != 1:
        return None
    whole, frac = divmod(abs(scaled.numerator), 10 ** places)
    text = str(whole) + (f".{frac:0{places}d}".rstrip("0") if frac else "")
    return "-" + text if value < 0 else text


def number_value(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def exact(expression: str) -> Fraction | None:
    """An annotation's expression computed by the verifier's parser (never eval): a Fraction or None."""
    try:
        value = verifier._value(verifier._parse(verifier._tokenize(expression)), {})
    except Exception:
        return None
    return value if isinstance(value, Fraction) else None


def changed_result(raw: list[str], rng: random.Random) -> tuple[int, str] | None:
    """(line index, its text with the stated result of its first annotation changed), or None: a line drawn among the
    annotated lines whose annotation is followed by its result as a number."""
    candidates = []
    for k, line in enumerate(raw):
        m = ANNOTATION.search(line)
        stated = m and STATED_RESULT.match(line, m.end())
        if m and stated and computes(m[1]) and exact(m[1].rsplit("=", 1)[1]) == number_value(stated[0]):
            candidates.append((k, m, stated))
    if not candidates:
        return None
    k, m, stated = rng.choice(candidates)
    value = number_value(stated[0])
    new = value * 2 if rng.random() < 0.5 and value != 0 else value + 1
    line = raw[k]
    text = line[:stated.start()] + decimal_text(new) + line[stated.end():]
    return k, ANNOTATION.sub("", text)


def computes(annotation: str) -> bool:
    """Whether an annotation computes something: an operator before its last = (<<48/2=24>>; <<20=20>> restates)."""
    return "=" in annotation and any(op in annotation.rsplit("=", 1)[0] for op in "+-*/")


def known_numbers(text: str) -> set[Fraction]:
    """The numbers a text states, in digits or as number words (the set a number from nowhere stays out of)."""
    known = {number_value(x) for x in NUMBER.findall(text)}
    for word in re.findall(r"[a-z]+", text.lower()):
        known |= {Fraction(v) for v in verifier.NUMBER_WORDS.get(word, ())}
    return known


def operand_from_nowhere(problem: str, raw: list[str], rng: random.Random) -> tuple[int, str] | None:
    """(line index, its text with one operand of its first annotation replaced by a number from nowhere and the
    stated result recomputed), or None when no annotated line has an operand written before its annotation."""
    candidates = []
    for k, line in enumerate(raw):
        m = ANNOTATION.search(line)
        if not m or not computes(m[1]):
            continue
        expression = m[1].rsplit("=", 1)[0]
        stated = STATED_RESULT.match(line, m.end())
        if not stated or exact(expression) != number_value(stated[0]):
            continue
        before = [x for x in NUMBER.finditer(line, 0, m.start())]
        operands = [x for x in NUMBER.finditer(expression)]
        usable = [(o, w) for o in operands
                  for w in [next((w for w in reversed(before) if number_value(w[0]) == number_value(o[0])), None)]
                  if w is not None]
        if usable:
            candidates.append((k, m, stated, expression, usable))
    if not candidates:
        return None
    k, m, stated, expression, usable = rng.choice(candidates)
    operand, written = rng.choice(usable)
    known = known_numbers(problem) | known_numbers("\n".join(ANNOTATION.sub("", x) for x in raw[:k + 1]))
    known |= {Fraction(c) for c in verifier.UNIT_CONSTANTS}
    choices = [x for x in NOWHERE if Fraction(x) not in known]
    for _ in range(20):
        new = rng.choice(choices)
        value = exact(expression[:operand.start()] + str(new) + expression[operand.end():])
        result = decimal_text(value) if value is not None else None
        if result is not None:
            break
    else:
        return None
    line = raw[k]
    text = (line[:written.start()] + str(new) + line[written.end():stated.start()] + result
            + line[stated.end():])
    return k, ANNOTATION.sub("", text)


def share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "-"


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--checker", required=True, help="arithmetic, grounded, or path/to/file.py:name")
    ap.add_argument("--data", required=True, help="GSM8K-form records, .jsonl or .jsonl.gz")
    ap.add_argument("--out", required=True, help="the verdicts, one JSON line per solution line")
    ap.add_argument("--problem-field", default="question")
    ap.add_argument("--answer-field", default="answer")
    ap.add_argument("--seed", type=int, default=0, help="draws the changed lines and numbers")
    ap.add_argument("--record", help="also write the summary into this JSON file, under the checker's name")
    try:
        args = ap.parse_args(argv)
        # every mistake is said here, before any line is checked
        check_out(Path(args.out))
        recorded = read_record(Path(args.record), args.record) if args.record else None
        checker, built_in = load_checker(args.checker)
        records = read_records(Path(args.data), args.problem_field, args.answer_field)
    except Mistake as e:
        return error(str(e))
    counts = {kind: {"right": 0, "wrong": 0, "unknown": 0} for kind in ("annotated", "other")}
    changed = {"lines": 0, "wrong": 0}
    nowhere = {"lines": 0, "right": 0}
    name = {True: "right", False: "wrong", None: "unknown"}
    with open(args.out, "w", encoding="utf-8") as out:
        for i, record in enumerate(records):
            problem = record[args.problem_field]
            raw, lines = solution_lines(record[args.answer_field])
            verdicts = run_checker(checker, built_in, lines, args.problem_field, problem)
            for k, (line, text, verdict) in enumerate(zip(raw, lines, verdicts)):
                counts["annotated" if ANNOTATION.search(line) else "other"][name[verdict]] += 1
                out.write(json.dumps({"record": i, "line": k, "text": text, "verdict": verdict}) + "\n")
            rng = random.Random(args.seed * 1_000_003 + i)
            for perturb, tally, counted in ((changed_result, changed, False), (operand_from_nowhere, nowhere, True)):
                got = perturb(raw, rng) if perturb is changed_result else perturb(problem, raw, rng)
                if got is None:
                    continue
                k, text = got
                tally["lines"] += 1
                verdict = run_checker(checker, built_in, lines[:k] + [text] + lines[k + 1:], args.problem_field,
                                      problem)[k]
                tally["wrong" if perturb is changed_result else "right"] += verdict is counted
    summary = {"checker": args.checker, "data": Path(args.data).name, "records": len(records), "seed": args.seed,
               **{f"{kind}_lines": dict(c, lines=sum(c.values())) for kind, c in counts.items()},
               "changed_result": changed, "operand_from_nowhere": nowhere}
    print(f"{summary['data']}: {len(records)} records; checker {args.checker}")
    for kind in ("annotated", "other"):
        c = summary[f"{kind}_lines"]
        print(f"{kind} lines: {c['lines']}: right {c['right']} ({share(c['right'], c['lines'])}), wrong {c['wrong']} "
              f"({share(c['wrong'], c['lines'])}), unknown {c['unknown']} ({share(c['unknown'], c['lines'])})")
    print(f"a changed result (one annotated line a solution, + 1 or x 2, seed {args.seed}): {changed['lines']} lines, "
          f"judged wrong {changed['wrong']} ({share(changed['wrong'], changed['lines'])})")
    print(f"an operand from nowhere, the result made to agree (seed {args.seed}): {nowhere['lines']} lines, judged "
          f"right {nowhere['right']} ({share(nowhere['right'], nowhere['lines'])})")
    print(f"verdicts: {args.out}")
    if args.record:
        recorded[args.checker] = summary
        Path(args.record).write_text(json.dumps(recorded, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
