"""credit: steps: the verifier reads every line. The formula on hand-built groups (credit.py), the built-in
arithmetic checker, a user's checker's faults, and runs through main(): the table and metrics, problems_per_step 2,
resume after SIGKILL. Torchrun (replicate and fsdp): tests/test_distributed.py. The spec's run is unchanged by all
of it (tests/test_variants.py's fixture)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import credit as C
import rlvr_driver
import train_rlvr as T
import verifier
from conftest import ROOT
from run_helpers import main_args, one_line_error

CHECKERS = ROOT / "tests" / "step_checkers.py"
EPS = 1e-4


def _advantages(rewards):
    r = torch.tensor(rewards, dtype=torch.float32)
    return T.compute_advantages(r, EPS, zero_variance=T.equal_rewards(r))


# ----------------------------------------------------------------------------------------------
# The formula


def test_a_hand_built_group_of_four_gives_each_tokens_advantage():
    """Rewards 1, 0, 0, 0 (A_i = 0.75 / 0.5001 and -0.25 / 0.5001), step_weight 0.5. Line 0 has verdicts right,
    right, wrong, right (mean 0.75, sample std 0.5): z = +0.25 / 0.5001 or -0.75 / 0.5001. Line 1 is compared among
    responses 0, 1, 3 (response 2 went wrong at line 0): right, wrong, right (mean 2/3, sample std 0.57735). Line 2:
    response 1's right verdict comes after its wrong line 1 and the others are unknown: no term. Each token adds its
    line's term, half of it."""
    a = _advantages([1.0, 0.0, 0.0, 0.0])
    verdicts = [[True, True, None], [True, False, True], [False, None, None], [True, True, None]]
    token_line = [[0, 0, 1, 1, 2], [0, 1, 1, 2], [0, 0, 0], [0, 1, 2, 2]]
    got, terms = C.checked_step_advantages("add", a, token_line, verdicts, 0.5, EPS)
    s0, s1 = 0.5 + EPS, math.sqrt(1 / 3) + EPS
    right0, wrong0, right1, wrong1 = 0.25 / s0, -0.75 / s0, (1 / 3) / s1, -(2 / 3) / s1
    A, B = 0.75 / s0, -0.25 / s0
    want = [[A + right0 / 2] * 2 + [A + right1 / 2] * 2 + [A],
            [B + right0 / 2] + [B + wrong1 / 2] * 2 + [B],
            [B + wrong0 / 2] * 3,
            [B + right0 / 2, B + right1 / 2, B, B]]
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, abs=1e-6)
    assert terms[1] == pytest.approx([right0 / 2, wrong1 / 2, 0.0], abs=1e-6)  # the terms rollouts.jsonl records
    assert (round(right0, 5), round(wrong1, 5)) == (0.4999, -1.1545)


def test_an_all_wrong_group_that_differs_at_line_2_has_a_gradient_on_line_2_alone():
    """Every reward 0 (the spec's advantages all exactly 0, no gradient); lines 0 and 1 right everywhere (equal
    verdicts: 0); line 2 right, wrong, right, wrong: +-0.5 / (0.57735 + 1e-4) on the line-2 tokens, 0 elsewhere.
    Through assign_credit: each token's line from the tokenizer's pieces (id 10 is a newline, which belongs to the
    line it closes), the verdicts from the scorer's check_steps on each response's text."""
    pieces = {10: "\n", 0: "<eos>"}
    tok = SimpleNamespace(decode=lambda ids, **kw: "".join(pieces.get(i, f"<{i}>") for i in ids))
    responses = [torch.tensor(r) for r in ([5, 10, 6, 10, 7, 0], [5, 10, 6, 10, 8, 9, 0], [5, 10, 6, 10, 7, 0],
                                           [5, 10, 6, 10, 8, 0])]
    texts = [tok.decode(r.tolist()).replace("<eos>", "") for r in responses]
    line2 = {"<7>": True, "<8><9>": False, "<8>": False}
    checks = []

    def check_steps(lines, record, problem=""):
        checks.append((lines, record, problem))
        return [True, True, line2[lines[2]]], "ok"
    cfg = T.Config(group_size=4, credit="steps")
    t = SimpleNamespace(cfg=cfg, tokenizer=tok, device=torch.device("cpu"), precision="fp32", eos_id=0, model=None,
                        scorer=SimpleNamespace(check_steps=check_steps), warned=set(), credit_method=C.method(cfg))
    r = torch.zeros(4)
    group = T.Group(texts, [T.Score(0.0, None, "wrong")] * 4, [len(x) for x in responses], [False] * 4, r, True)
    adv = T.compute_advantages(r, EPS, zero_variance=True)
    got = T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"problem": "What is 3?", "answer": "1",
                                                                                 "record": {"id": 3}}, t)
    z = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert round(z, 5) == 0.86588
    assert got.token_advantages == [pytest.approx(x, abs=1e-6) for x in (
        [0, 0, 0, 0, z, z], [0, 0, 0, 0, -z, -z, -z], [0, 0, 0, 0, z, z], [0, 0, 0, 0, -z, -z])]
    assert got.verdicts == [[True, True, True], [True, True, False]] * 2 and not got.all_zero()
    assert got.segments[1] == [0, 2, 4] and checks[0] == (["<5>", "<6>", "<7>"], {"id": 3}, "What is 3?")


def _char_group(texts, cut, rewards, check):
    """A group whose tokens are its texts' characters (EOS, id 0, after each finished one), a tokenizer that decodes
    them back, and a trainer whose scorer checks lines with `check`; assign_credit's arguments."""
    tok = SimpleNamespace(decode=lambda ids, **kw: "".join(chr(i) for i in ids if i))
    responses = [torch.tensor([ord(c) for c in x] + ([] if c else [0])) for x, c in zip(texts, cut)]
    calls = []

    def check_steps(lines, record, problem=""):
        calls.append(list(lines))
        return check(lines), "ok"
    cfg = T.Config(group_size=len(texts), credit="steps")
    t = SimpleNamespace(cfg=cfg, tokenizer=tok, device=torch.device("cpu"), precision="fp32", eos_id=0, model=None,
                        scorer=SimpleNamespace(check_steps=check_steps), warned=set(), credit_method=C.method(cfg))
    r = torch.tensor(rewards, dtype=torch.float32)
    group = T.Group(texts, [T.Score(float(x), None, "correct" if x else "wrong") for x in rewards],
                    [len(x) for x in responses], cut, r, T.equal_rewards(r))
    adv = T.compute_advantages(r, EPS, zero_variance=group.zero_variance)
    problem = {"problem": "23 + 4 + 7", "answer": "39", "record": {}}
    return (1, torch.tensor([1]), responses, group, adv, problem, t), calls


def test_a_last_line_cut_at_max_new_tokens_is_unknown_and_moves_no_other_term():
    """Second lines "27 + 7 = 34", "27 + 7 = 34", "27 + 7 = 35" and, cut mid-number at max_new_tokens, "27 + 7 = 3":
    the cut line is never checked (nothing was finished there) and is unknown, so line 1 is standardized over the
    three finished ones, right +(1/3) / (0.57735 + 1e-4) = +0.577 and wrong -1.155, and the cut response's line-1
    tokens get 0 (judged, it would have been False and -0.866, the others +-0.866)."""
    texts = ["23 + 4 = 27\n27 + 7 = 34\n", "23 + 4 = 27\n27 + 7 = 34\n", "23 + 4 = 27\n27 + 7 = 35\n",
             "23 + 4 = 27\n27 + 7 = 3"]
    args, calls = _char_group(texts, [False, False, False, True], [0.0] * 4, verifier.check_arithmetic)
    got = T.assign_credit(*args)
    assert got.verdicts == [[True, True, None]] * 2 + [[True, False, None], [True, None]]
    assert calls[3] == ["23 + 4 = 27"]  # the cut line is not sent to the checker
    right, wrong = (1 / 3) / (math.sqrt(1 / 3) + EPS), -(2 / 3) / (math.sqrt(1 / 3) + EPS)
    assert (round(right, 3), round(wrong, 3)) == (0.577, -1.155)
    assert got.values[0] == pytest.approx([0.0, right, 0.0], abs=1e-6)
    assert got.values[2] == pytest.approx([0.0, wrong, 0.0], abs=1e-6) and got.values[3] == [0.0, 0.0]
    assert set(got.token_advantages[3]) == {0.0}
    assert got.segments[3] == [0, 12] and got.segments[0] == [0, 12, 24]


def test_a_responses_lines_are_split_at_newlines_alone():
    """"1 + 1 = 2\u2028x\r" is one line (str.splitlines would make three, and a final newline would vanish), so the
    checker's verdicts stay one per token line."""
    args, calls = _char_group(["1 + 1 = 2\u2028x\r", "1 + 1 = 2\n"], [False, False], [0.0, 0.0],
                              lambda lines: [None] * len(lines))
    got = T.assign_credit(*args)
    assert calls == [["1 + 1 = 2\u2028x\r"], ["1 + 1 = 2", ""]]
    assert [len(v) for v in got.verdicts] == [1, 2] and got.segments == [[0], [0, 10]]


def test_unknown_lines_and_lines_after_the_first_wrong_one_add_nothing():
    """An unknown line is no verdict: it neither counts in its line's standardization nor stops a response's later
    lines from counting. A line after a response's first wrong one counts for nothing, even if right."""
    terms = C.step_terms([[None, True], [None, False], [True, True], [False, True]], EPS)
    z = 0.5 / (math.sqrt(1 / 3) + EPS)  # line 1 among responses 0, 1, 2 (response 3 went wrong at line 0): T F T
    assert terms[0] == pytest.approx([0.0, (1 / 3) / (math.sqrt(1 / 3) + EPS)], abs=1e-6)
    assert terms[1] == pytest.approx([0.0, -(2 / 3) / (math.sqrt(1 / 3) + EPS)], abs=1e-6)
    assert terms[2][0] == pytest.approx(0.5 / (math.sqrt(1 / 2) + EPS), abs=1e-6) and terms[3][1] == 0.0
    assert round(z, 3) == 0.866
    assert C.step_terms([[None, None], [None, None]], EPS) == [[0.0, 0.0], [0.0, 0.0]]  # nothing checked: the spec
    assert C.step_terms([[True], [False]] + [[None]] * 2, EPS)[0] == [pytest.approx(0.5 / (math.sqrt(1 / 2) + EPS))]


def test_first_error_spares_a_wrong_responses_verified_prefix():
    """step_mode first_error (VPPO's split): rewards 1, 0, 0, 0. Response 1's lines before its first wrong line
    (line 2) get 0, not A_i < 0; response 2 has no wrong line: A_i everywhere; response 0 is right: A_i
    everywhere, though it has a wrong line; response 3 goes wrong at line 0: nothing spared."""
    a = _advantages([1.0, 0.0, 0.0, 0.0])
    verdicts = [[True, False], [True, None, False], [None, None], [False, True]]
    token_line = [[0, 1], [0, 1, 1, 2, 2], [0, 1], [0, 1]]
    got, terms = C.checked_step_advantages("first_error", a, token_line, verdicts, 1.0, EPS)
    A, B = 0.75 / 0.5001, -0.25 / 0.5001
    assert [g.tolist() for g in got] == [pytest.approx(x, abs=1e-6) for x in (
        [A, A], [0, 0, 0, B, B], [B, B], [B, B])]
    assert terms[1] == pytest.approx([-B, -B, 0.0], abs=1e-6)


def test_a_token_belongs_to_the_line_its_first_character_is_in():
    """A newline closes the line it ends: "\\n" and ".\\n" are in the line before; "\\nSo" too (its first
    character); the EOS is in the last line."""
    assert C.token_lines(["2", " +", " 2", " =", " 4", "\n", "4", ".\n", "\nSo", " 4", "<eos>"]) == \
        [0, 0, 0, 0, 0, 0, 1, 1, 2, 3, 3]
    assert C.line_starts([0, 0, 1, 1, 3, 3], 4) == [0, 2, 4, 4]


def test_a_token_that_closes_two_lines_leaves_one_line_without_a_token_and_a_segment_per_line():
    """"\n\n" closes line 0 and line 1 (an empty line): "3" is in line 2, not 1. The segments rollouts.jsonl
    records are one per line, as its values and verdicts: the empty line starts where the next one does, and a last
    line after a final newline at the response's end."""
    assert C.token_lines(["1+1=2", "\n\n", "3"]) == [0, 0, 2]
    assert C.line_starts([0, 0, 2], 3) == [0, 2, 2]
    assert C.line_starts([0, 0, 1], 3) == [0, 2, 3]
    got = C.assign_steps("add", torch.zeros(2), [[0, 0, 2], [0, 0, 1]], [[True, None, True], [False, None, None]],
                         1.0, EPS, None, 1.0, 6)
    assert got.segments == [[0, 2, 2], [0, 2, 3]]
    assert [len(s) for s in got.segments] == [len(v) for v in got.values] == [len(v) for v in got.verdicts]


def test_a_line_counts_where_some_responses_have_ended():
    """Line 1 exists in responses 0 and 1 only (response 2 has one line): right and wrong there, +-0.5 / (sample std
    0.70711 + 1e-4) = +-0.70700681, however short the shortest response is."""
    terms = C.step_terms([[True, True], [True, False], [True]], EPS)
    assert [round(t, 8) for t in (terms[0][1], terms[1][1])] == [0.70700681, -0.70700681]
    assert terms[0][0] == terms[1][0] == terms[2][0] == 0.0


# ----------------------------------------------------------------------------------------------
# The built-in arithmetic checker


@pytest.mark.parametrize("line, verdict", [
    ("23 + 4 = 27", True), ("27 + 7 = 35", False), ("34 + 5 = 39.", True), ("  7 = 7  ", True),
    ("-3 + 1 = -2", True), ("1.5 + 1.5 = 3", True), ("3/4 = 0.75", True), ("0.1 + 0.2 = 0.3", True),
    ("(1 + 2) * 3 = 9", True), ("2 * (3 - 5) = -4", True), ("1 - 2 - 3 = -4", True), ("6 / 4 = 1.5", True),
    ("3 \\times 4 = 12", True), ("2 \\cdot 3 = 7", False), ("12 \\div 4 = 3", True), ("\\frac{1}{2} + 0.5 = 1", True),
    ("\\frac{2}{3} = \\frac{4}{6}", True), ("1 + 1 = \\frac{4}{2}.", True), ("3! = 6", None), ("\\pi = 3", None), ("$9 - 2 = 7$", True), ("\\(1 + 1 = 3\\)", False), ("10 / 3 = 3.33", False),
    ("So the answer is \\boxed{39}.", None), ("x + 1 = 2", None), ("The sum is 27", None), ("23 + 4", None),
    ("1 + 1 = 2 = 2", None), ("= 5", None), ("1 + 1 =", None), ("2^3 = 8", None), ("\\sqrt{4} = 2", None),
    ("1 / 0 = 1", None), ("23 + 4 = 27 apples", None), ("1 + 1 = 1 + 1", None), ("1,000 + 1 = 1,001", None),
])
def test_the_arithmetic_checker_reads_a_line_as_exact_rational_arithmetic(line, verdict):
    assert verifier.arithmetic_verdict(line) is verdict


@pytest.mark.parametrize("line, verdict", [
    ("2(3) = 6", None),                           # a number beside a bracket: a product not written as one
    ("6/2(3) = 9", None), ("6/2(3) = 1", None),   # and so never read either way
    ("(1)(2) = 2", None), ("3 \\frac{1}{2} = 3.5", None),  # brackets side by side; a mixed number
    ("1e3 = 1000", None), ("2e+3 = 2003", None),  # scientific notation: 2e+3 may be 2e + 3
    ("[1 + 2] = 3", None), ("{1+2}*3 = 9", None),  # square brackets; bare braces (LaTeX shows 1+2*3)
    ("\\frac12 = 0.5", None),                      # \frac without its braces
    ("\\left(1+2\\right)\\times 3 = 9", True),     # \left( \right) are round brackets
    ("\\frac{\\frac{1}{2}}{2} = 0.25", True),
    ("0.\\overline{3} = 1/3", True),               # a repeating decimal is a number, exactly
    ("- 23 + 4 = 27", True), ("- 5 + 10 = 5", False), ("* 23 + 4 = 27", True),  # markdown bullets
    ("1. 23 + 4 = 27", True), ("2) 5 + 5 = 10", True), ("  \u2022 2 + 2 = 5", False),  # numbered items
    ("-3 + 1 = -2", True), ("- 3 + 1 = -2", False),  # a minus against its number is a sign, a spaced one a bullet
    ("3 = (1 + 2)/1", None),                      # the right side is a number as written
    ("2^3 + 1 = 9", None), ("1 + 2^3 = 9", None),  # every part of the left side is checked
    ("1/3 = 0.33333333333333331", False),         # exact: as floats the two are equal
])
def test_the_arithmetic_checker_reads_these_lines_as_its_page_says(line, verdict):
    assert verifier.arithmetic_verdict(line) is verdict


def test_the_arithmetic_checker_reads_lines_of_up_to_300_characters():
    """A 300-character sum of 74 ones is right; the same with 5 spaces more (305 characters) is unknown."""
    line = " + ".join(["1"] * 74) + "   = 74"
    assert len(line) == 300 and verifier.arithmetic_verdict(line) is True
    longer = line.replace("   = ", "        = ")
    assert len(longer) == 305 and verifier.arithmetic_verdict(longer) is None
    assert float(verifier.Fraction(1, 3)) == float("0.33333333333333331")  # why the exact comparison matters


@pytest.mark.parametrize("line, verdict", [
    ("9" * 1_000_000 + " = 1", None),                   # a million-digit number: over the line's size, at once
    ("2**2**2**30 = 1", None),                          # a tower: ** is no operator here
    ("(" * 100 + "1" + ")" * 100 + " = 1", None),       # nesting past the parser's depth
    ("9" * 290 + " * " + "9" * 3 + " = 1", False),      # within the size: exact, still fast
    (" * ".join(["9" * 40] * 6) + " = 1", False),      # a product of 240 digits
    ("1" + " + 1" * 70 + " = 71", True),                # many terms
])
def test_hostile_lines_are_unknown_or_exact_and_never_slow(line, verdict):
    start = time.perf_counter()
    assert verifier.arithmetic_verdict(line) is verdict
    assert time.perf_counter() - start < 0.5


# ----------------------------------------------------------------------------------------------
# A user's checker: at the start, and during the run


@pytest.mark.parametrize("name, why", [
    ("raises", "failed: ValueError: no verdict today (a trial call on dataset record 0)"),
    ("hangs", "did not return within verifier_timeout 0.5 s (a trial call on dataset record 0)"),
    ("one_short", "failed: ValueError: it returned 1 verdicts for 2 lines (a trial call on dataset record 0)"),
    ("absent", "failed: AttributeError: " + str(CHECKERS) + " has no function 'absent' (importing it)"),
])
def test_a_step_checker_that_cannot_serve_is_one_line_before_step_1(name, why, tiny_model_dir, tiny_data_file,
                                                                     tmp_path, capsys):
    out = tmp_path / "out"
    assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=2", "credit=steps",
                            f"step_checker={CHECKERS}:{name}", "verifier_timeout=0.5")) == 2
    assert one_line_error(capsys) == (
        f"error: step_checker {CHECKERS}:{name} {why}; fix it: it is called as name(lines: list[str], record: dict) "
        "and returns a list with a verdict per line (True, False or None)")
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("setting, message", [
    ("step_checker=checker.py", "config key 'step_checker' must be arithmetic or grounded (built in) or "
                                "path/to/file.py:function_name"),
    ("step_checker=/no/such/file.py:check", "config key 'step_checker' must be an existing file: /no/such/file.py is "
                                            "not one"),
    ("step_weight=-1", "config key 'step_weight' must be a number in [0, 1e6] (0: the spec's credit), got -1.0"),
    ("step_weight=nan", "config key 'step_weight' must be a finite number, got nan"),
    ("step_weight=1e7", "config key 'step_weight' must be a number in [0, 1e6] (0: the spec's credit), got 10000000.0"),
    ("step_mode=min", "config key 'step_mode' must be one of add, first_error, got 'min'"),
])
def test_bad_step_settings_are_one_line(setting, message, tiny_model_dir, tiny_data_file, tmp_path, capsys):
    assert T.main(main_args(tiny_model_dir, tiny_data_file, tmp_path / "o", "credit=steps", setting)) == 2
    one_line_error(capsys, message)
    assert not (tmp_path / "o").exists()


def test_a_checker_failing_during_the_run_is_counted_and_said_once(tiny_model_dir, tiny_data_file, tmp_path,
                                                                   monkeypatch, capsys):
    """fails_on_3 raises on "What is 3 + 3?" (problem 3, step 4) for each of its 4 responses: its lines are unknown,
    the step counts 4 failures, the warning is said once, the summary counts them; the other steps find every line
    right."""
    monkeypatch.setattr(T, "score_rollouts", rlvr_driver.by_text)
    out = tmp_path / "out"
    assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=5", "credit=steps",
                            f"step_checker={CHECKERS}:fails_on_3")) == 0
    captured = capsys.readouterr()
    said = [line for line in captured.err.splitlines() if "step_checker" in line]
    assert said == [f"warning: step 4: step_checker {CHECKERS}:fails_on_3 failed on rollout 0: ValueError: three "
                    "(its lines count as unknown; said once a run, each failure is counted: metrics.jsonl's "
                    "step_checker_failures)"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step_checker_failures"] for m in metrics] == [0, 0, 0, 4, 0]
    assert metrics[3]["lines_checked"] == 0 and metrics[3]["responses_unchecked"] == 1.0
    # every line right, but the unfinished last line of a response cut at max_new_tokens is unknown
    assert all(m["lines_unknown"] == m["cut_at_limit"] and m["lines_wrong"] == 0 for m in metrics[:3] + metrics[4:])
    assert sum(m["lines_right"] for m in metrics) > 0 and sum(m["cut_at_limit"] for m in metrics[:3]) > 0
    assert ("verifier overruns       0 rollouts scored 0 after a timeout or a crash; 4 step checks failed the same "
            "way (their lines unknown)") in captured.out.splitlines()


# ----------------------------------------------------------------------------------------------
# Runs: the table and metrics, two problems a step, resume after SIGKILL


def test_two_problems_a_step_count_every_groups_lines(tiny_model_dir, tiny_data_file, tmp_path, monkeypatch,
                                                      capsys):
    """problems_per_step 2 with the length checker: each step's line figures are its two groups' rollouts.jsonl
    verdicts counted, the table's lines column shows them, and some all-wrong group still trains."""
    monkeypatch.setattr(T, "score_rollouts", lambda scorer, texts, gold: [T.Score(0.0, None, "wrong")] * len(texts))
    monkeypatch.setattr(T, "sample_next_token", rlvr_driver.writes_lines())  # finished lines to check
    out = tmp_path / "out"
    assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=4", "problems_per_step=2",
                            "max_new_tokens=12", "learning_rate=1e-3", "credit=steps",
                            f"step_checker={CHECKERS}:by_length")) == 0
    table = capsys.readouterr().out
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert "lines r/w/?" in table.splitlines()[0] and "generated" not in table.splitlines()[0]
    for m in metrics:
        verdicts = [v for r in rollouts if r["step"] == m["step"] for v in r["line_verdicts"]]
        assert len({r["problem_index"] for r in rollouts if r["step"] == m["step"]}) == 2
        assert (m["lines_right"], m["lines_wrong"], m["lines_unknown"]) == (
            verdicts.count(True), verdicts.count(False), verdicts.count(None))
        assert m["lines_checked"] == m["lines_right"] + m["lines_wrong"]
        group = [r["line_verdicts"] for r in rollouts if r["step"] == m["step"]]
        assert m["responses_unchecked"] == sum(set(v) == {None} for v in group) / 8
        row = next(line for line in table.splitlines() if line.split()[:1] == [str(m["step"])])
        assert f"{m['lines_right']}/{m['lines_wrong']}/{m['lines_unknown']}" in row.split()
    assert all(m["reward_std"] == 0 for m in metrics) and any(m["grad_norm"] > 0 for m in metrics)



def _drive(model_dir, data, out, *extra, kill_when=None):
    """The driver in its own process (rewards by the text); with kill_when, SIGKILLed when that text shows."""
    env = dict(os.environ, RLVR_DRIVER=json.dumps({"text_rewards": True, "writes_lines": True}), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(ROOT / "tests" / "rlvr_driver.py"),
           *main_args(model_dir, data, out, "num_problems=4", "save_every=1", "learning_rate=1e-3", "credit=steps",
                      f"step_checker={CHECKERS}:by_length", "prompt_pass=shared", *extra)]
    if kill_when is None:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300).returncode
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if kill_when in line:
            proc.send_signal(signal.SIGKILL)
            break
    return proc.wait(timeout=60)


def test_a_sigkilled_steps_run_resumes_to_the_same_bytes(tiny_model_dir, tiny_data_file, tmp_path):
    """Killed in step 3's backward, resumed from step 2's checkpoint: rollouts.jsonl (with every line's verdict and
    token advantage) and the final weights are the uninterrupted run's, byte for byte. With prompt_pass: shared (the
    GSM8K yaml's pass): one run covers both settings' resume, the spec's pass is test_checkpoints'."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert _drive(tiny_model_dir, tiny_data_file, whole) == 0
    assert _drive(tiny_model_dir, tiny_data_file, cut, kill_when="[step 3] rewards") == -signal.SIGKILL
    assert _drive(tiny_model_dir, tiny_data_file, cut, "resume=auto") == 0
    for name in ("rollouts.jsonl", "final/model.safetensors"):
        assert (cut / name).read_bytes() == (whole / name).read_bytes(), name
    rollouts = [json.loads(line) for line in (whole / "rollouts.jsonl").read_text().splitlines()]
    assert any(a != r["advantage"] for r in rollouts for a in r["token_advantages"])  # the steps' own credit


def test_a_step_setting_that_does_nothing_is_said_once(capsys):
    """step_checker and step_mode act only with credit=steps, step_weight only with step_mode add; and the segment
    settings are monte_carlo's and the tree's, not steps'."""
    config = ["--config", str(ROOT / "config.yaml")]
    T.load_config([*config, "step_checker=x.py:f", "step_weight=2", "step_mode=first_error"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: step_checker=x.py:f is ignored: it acts only with credit=steps",
        "warning: step_mode=first_error is ignored: it acts only with credit=steps",
        "warning: step_weight=2.0 is ignored: it acts only with credit=steps, step_mode=add"]
    T.load_config([*config, "credit=steps", "step_weight=2", "step_mode=first_error", "credit_segment_tokens=4"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: credit_segment_tokens=4 is ignored: it acts only with credit=monte_carlo or credit=tree",
        "warning: step_weight=2.0 is ignored: it acts only with credit=steps, step_mode=add"]
    T.load_config([*config, "credit=steps", "step_weight=2"])
    assert capsys.readouterr().err == ""


def test_the_sum_tasks_chain_checker_and_the_built_in_one_in_the_worker():
    """examples/sum_steps.py:chain on "23 + 4 + 7 + 5": each line adds the next number to the last line's sum; a line
    in another form is wrong (an arithmetically right "23 + 4 + 7 = 34" too), the lines after the chain unknown. The
    built-in checker, called in the verifier's worker, reads the same lines as arithmetic alone."""
    sys.path.insert(0, str(ROOT / "examples"))
    import sum_steps

    lines = ["23 + 4 = 27", "27 + 7 = 35", "35 + 5 = 40", "So the answer is \\boxed{40}."]
    assert sum_steps.chain(lines, {"problem": "23 + 4 + 7 + 5"}) == [True, False, False, None]
    assert sum_steps.chain(["23 + 4 + 7 = 34", "34 + 5 = 39"], {"problem": "23 + 4 + 7 + 5"}) == [False, False]
    assert sum_steps.chain(["23 + 5 = 28", "27 + 7 = 34."], {"problem": "23 + 4 + 7 + 5"}) == [False, True]
    with verifier.TimedVerifier(timeout_s=10.0, step_checker="arithmetic") as scorer:
        assert scorer.check_steps(lines, {}) == ([True, False, True, None], "ok")
        assert scorer.check_steps(["23 + 4 + 7 = 34", "23 + 5 = 28"], {}) == ([True, True], "ok")


def test_the_chain_checker_checks_the_running_sum_and_reads_a_markdown_bullet():
    """On "23 + 4 + 7 + 5" line 0 must be 23 + 4 = 27: "20 + 4 = 27" adds the right number to the wrong running sum
    (a checker reading only the number added and the result would call it right). A chain written as a markdown list
    is read line by line: "- 23 + 4 = 27", "* 27 + 7 = 34", "+ 34 + 5 = 39" all right; "- 27 + 7 = 35" wrong; a mark
    with no space after it ("-23 + 4 = 27": a minus sign) and a numbered item ("1. 23 + 4 = 27") are no chain line."""
    sys.path.insert(0, str(ROOT / "examples"))
    import sum_steps

    problem = {"problem": "23 + 4 + 7 + 5"}
    assert sum_steps.chain(["20 + 4 = 27"], problem) == [False]
    assert sum_steps.chain(["23 + 4 = 27", "20 + 7 = 34"], problem) == [True, False]
    assert sum_steps.chain(["- 23 + 4 = 27", "* 27 + 7 = 34", "+ 34 + 5 = 39", "- \\boxed{39}"], problem) == [
        True, True, True, None]
    assert sum_steps.chain(["  -  23 + 4 = 27", "- 27 + 7 = 35"], problem) == [True, False]
    assert sum_steps.chain(["-23 + 4 = 27", "1. 27 + 7 = 34"], problem) == [False, False]


def test_a_step_checker_whose_import_raises_is_blamed_on_its_own_file(tmp_path):
    """With a reward function that loads and a step checker whose import raises, the start names the step checker
    (the worker says which file was loading, set before each load)."""
    rewards, broken = tmp_path / "rewards.py", tmp_path / "broken.py"
    rewards.write_text("def score(response, answer, record):\n    return 1.0\n")
    broken.write_text("raise ValueError('the checker cannot load')\n")
    scorer = verifier.TimedVerifier(timeout_s=10.0, reward_function=(str(rewards), "score"),
                                    step_checker=(str(broken), "check"))
    with pytest.raises(verifier.RewardFunctionError) as caught:
        scorer.__enter__()
    assert caught.value.which == "step_checker" and str(caught.value) == "ValueError: the checker cannot load"
    scorer.close()


def test_a_checker_is_held_to_the_lines_it_was_sent_and_numpy_booleans_are_verdicts():
    """appends adds a line to its list after its verdicts: 2 verdicts for the 2 lines sent, not a refusal for 3.
    numpy_verdicts returns numpy.bool_ (its type prints as bool): Python's True and False come back."""
    with verifier.TimedVerifier(timeout_s=10.0, step_checker=(str(CHECKERS), "appends")) as scorer:
        assert scorer.check_steps(["ab", "abc"], {}) == ([True, False], "ok")
    with verifier.TimedVerifier(timeout_s=10.0, step_checker=(str(CHECKERS), "numpy_verdicts")) as scorer:
        verdicts, status = scorer.check_steps(["1 + 1 = 2", "1 + 1 = 3"], {})
        assert (verdicts, status) == ([True, False], "ok") and [type(v) for v in verdicts] == [bool, bool]


def test_step_verdicts_takes_numpy_booleans_and_refuses_ints():
    numpy = pytest.importorskip("numpy")
    got = verifier.step_verdicts([numpy.True_, numpy.False_, None], 3)
    assert got == [True, False, None] and [type(v) for v in got[:2]] == [bool, bool]
    with pytest.raises(TypeError) as caught:
        verifier.step_verdicts([1, 0], 2)
    assert str(caught.value) == "it returned int '1' as a verdict, not True, False or None"
    with pytest.raises(TypeError) as caught:
        verifier.step_verdicts([True, numpy.int64(0)], 2)
    assert str(caught.value) == "it returned int64 '0' as a verdict, not True, False or None"


def test_a_name_that_is_no_function_is_said_apart_from_a_missing_one():
    with pytest.raises(TypeError) as caught:
        verifier.load_step_checker(str(CHECKERS), "not_a_function")
    assert str(caught.value) == f"{CHECKERS}: 'not_a_function' is an int, not a function"
    with pytest.raises(AttributeError) as caught:
        verifier.load_step_checker(str(CHECKERS), "absent")
    assert str(caught.value) == f"{CHECKERS} has no function 'absent'"


def test_the_line_figures_of_a_step_with_two_groups():
    """Verdicts of two groups: 3 right, 2 wrong, 5 unknown lines; a response with an unknown line beside a checked
    one is checked, one with none checked is not (2 of 5 responses); one check failed."""
    credits = [SimpleNamespace(verdicts=[[None, True], [None, None], [False, True]], failed=0),
               SimpleNamespace(verdicts=[[True, None, False], [None]], failed=1)]
    assert C.line_figures(credits) == dict(lines_checked=5, lines_right=3, lines_wrong=2, lines_unknown=5,
                                           responses_unchecked=0.4, step_checker_failures=1)


def test_resample_keeps_an_all_wrong_group_whose_lines_give_a_signal(tiny_model_dir, tiny_data_file, tmp_path,
                                                                     monkeypatch, capsys):
    """zero_variance=resample decides after the credit: every group is all wrong (reward std 0), yet step 1's lines
    differ (length checker), so its group is trained (grad norm > 0), not set aside as a zero-variance group would
    be; a group whose lines give nothing either (problem 1, every A_it 0) is set aside and carries its verdicts."""
    monkeypatch.setattr(T, "score_rollouts", lambda scorer, texts, gold: [T.Score(0.0, None, "wrong")] * len(texts))
    monkeypatch.setattr(T, "sample_next_token", rlvr_driver.writes_lines())
    out = tmp_path / "out"
    assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=4", "max_new_tokens=12",
                            "learning_rate=1e-3", "credit=steps", f"step_checker={CHECKERS}:by_length",
                            "zero_variance=resample")) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert all(m["reward_std"] == 0 for m in metrics) and all(m["grad_norm"] > 0 for m in metrics)
    assert [[g["problem_index"] for g in m["set_aside"]] for m in metrics] == [[], [1], [], [4]]
    aside = [r for r in rollouts if r.get("set_aside")]
    assert [r["problem_index"] for r in aside] == [1] * 4 + [4] * 4
    assert all(set(r["token_advantages"]) == {0.0} and "line_verdicts" in r for r in aside)
    trained = [r for r in rollouts if not r.get("set_aside") and r["step"] == 1]
    assert any(a != 0 for r in trained for a in r["token_advantages"])
    assert "problems drawn          6 for 4 optimizer steps; 2 zero-variance groups set aside" in capsys.readouterr().out


def test_the_test_samplers_newline_is_the_tiny_tokenizers(tiny_model):
    _, tok = tiny_model
    assert tok.decode([rlvr_driver.NEWLINE_ID]) == "\n" and tok.convert_tokens_to_ids(T.Config().eos_token) == 0


def test_a_step_checkers_file_is_found_from_the_folder_the_run_starts_in(tmp_path, monkeypatch):
    """The worker loads the checker by an absolute path (it may start elsewhere); a resumed run that names the same
    file by another path (./ck.py, its absolute path) names the same checker, another file does not."""
    (tmp_path / "ck.py").write_text("def f(lines, record):\n    return [None] * len(lines)\n")
    monkeypatch.chdir(tmp_path)
    assert T.user_function("ck.py:f") == (str(tmp_path / "ck.py"), "f") and T.user_function("arithmetic") == "arithmetic"
    assert C.method(T.Config(credit="steps"), T.user_function("ck.py:f")).checker == (str(tmp_path / "ck.py"), "f")
    assert T.same_setting("step_checker", "./ck.py:f", f"{tmp_path}/ck.py:f")
    assert not T.same_setting("step_checker", "ck.py:f", "ck.py:g") and not T.same_setting("step_checker", "a.py:f",
                                                                                             "ck.py:f")
    assert T.same_setting("reward_function", "./ck.py:f", "ck.py:f") and not T.same_setting("seed", 1, 2)


def test_a_run_resumes_with_its_checker_named_by_another_path(tiny_model_dir, tiny_data_file, tmp_path, monkeypatch,
                                                              capsys):
    (tmp_path / "ck.py").write_text("def f(lines, record):\n    return [len(x) % 2 == 0 for x in lines]\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=1", "credit=steps",
                            "step_checker=./ck.py:f")) == 0
    assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=2", "credit=steps",
                            f"step_checker={tmp_path / 'ck.py'}:f", "resume=auto")) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    (tmp_path / "ck2.py").write_text((tmp_path / "ck.py").read_text())
    assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=3", "credit=steps",
                            "step_checker=ck2.py:f", "resume=auto")) == 2
    one_line_error(capsys, "these settings differ from the checkpoint's and change the math: step_checker")


def test_the_lines_column_is_on_a_steps_first_epoch_row_alone():
    """ppo_epochs 2: one row per epoch; the step's line counts (its group's, checked once) on the first."""
    e = dict(policy_loss=0.5, grad_norm=1.0, update_norm=0.01, clipped_fraction=0.0)
    m = dict(step=3, group_size=4, correct=0, reward_mean=0.0, reward_std=0.0, response_tokens=40, seconds=1.5,
             lines_right=3, lines_wrong=1, lines_unknown=2, epochs=[dict(e, epoch=1), dict(e, epoch=2)])
    extras = T.table_extras(T.Config(ppo_epochs=2, credit="steps"))
    assert [c.name for c in extras] == ["epoch", "clipped", "lines r/w/?"]
    first, second = T.format_row(m, extras).splitlines()
    assert first.split()[-2:] == ["3/1/2", "1.5"] and second.split()[-3:] == ["1.000e-02", "2", "0.000"]


def test_a_grounded_steps_run_trains_an_all_wrong_group_on_its_right_line_only(tiny_model_dir, tmp_path, monkeypatch):
    """step_checker grounded through a run on the tiny model, its sampler scripted: four responses to "Tom has 17
    apples and buys 25 more", every answer wrong (rewards 0: the spec's credit has no gradient). Line 0 is "17 + 25 =
    42" (right, grounded in the problem's text: neither number is a unit constant) in response 0 and "= 43" (wrong)
    in the others: z = +0.75 / (0.5 + 1e-4) = +1.4997 and -0.25 / (0.5 + 1e-4) = -0.4999 on line 0's tokens; the
    boxed line and a farmed "13 * 7 = 91" (right arithmetic, numbers from nowhere) are unknown and get 0. So the
    group's gradient is its lines' alone, and no token of a later line moves."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = tmp_path / "tom.json"
    data.write_text(json.dumps([{"problem": "Tom has 17 apples and buys 25 more. How many apples does he have?",
                                 "answer": "42"}]))
    texts = ["He has 17 + 25 = 42 apples.\nSo the answer is \\boxed{41}.",
             "He has 17 + 25 = 43 apples.\nSo the answer is \\boxed{43}.",
             "He has 17 + 25 = 43 apples.\nSo the answer is \\boxed{43}.",
             "He has 17 + 25 = 43 apples.\nThen 13 * 7 = 91.\nSo the answer is \\boxed{43}."]
    script = [tok(x, add_special_tokens=False)["input_ids"] + [0] for x in texts]
    at = {"t": 0}
    real = T.sample_next_token

    def scripted(logits, temperature, top_p, u):
        real(logits, temperature, top_p, u)
        at["t"] += 1
        return torch.tensor([r[at["t"] - 1] if at["t"] <= len(r) else 0 for r in script])
    monkeypatch.setattr(T, "sample_next_token", scripted)
    out = tmp_path / "out"
    assert T.main(main_args(tiny_model_dir, data, out, "num_problems=1", "max_new_tokens=80", "learning_rate=1e-3",
                            "credit=steps", "step_checker=grounded")) == 0
    (m,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["response"] for r in rollouts] == texts and m["reward_std"] == 0 and m["grad_norm"] > 0
    assert [r["line_verdicts"] for r in rollouts] == [[True, None], [False, None], [False, None],
                                                      [False, None, None]]
    right, wrong = 0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS)
    assert (round(right, 4), round(wrong, 4)) == (1.4997, -0.4999)
    for r, z in zip(rollouts, (right, wrong, wrong, wrong)):
        first = r["segments"][1]  # line 0's tokens (its closing newline among them), then the later lines'
        assert r["token_advantages"][:first] == [pytest.approx(z, abs=1e-5)] * first
        assert set(r["token_advantages"][first:]) == {0.0}
    assert (m["lines_right"], m["lines_wrong"], m["lines_unknown"]) == (1, 3, 5)
