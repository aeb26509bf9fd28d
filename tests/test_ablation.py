"""benchmarks/ablation.py's measuring and aggregation on hand-made records (no training)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ablation  # noqa: E402


def rec(step, correct, tokens, seconds, **extra):
    return {"step": step, "correct": correct, "response_tokens": tokens, "seconds": seconds, **extra}


SUMMARY = {"phases": {
    "before": {"groups": [{"group": "overall", "correct": 26, "n": 60}, {"group": "Algebra", "correct": 0, "n": 20}]},
    "after": {"groups": [{"group": "Algebra", "correct": 20, "n": 20}, {"group": "overall", "correct": 57, "n": 60}]}}}


def test_measure_counts_steps_by_their_step_field_and_finds_the_first_8_of_8():
    metrics = [rec(1, 2, 107, 1.5), rec(2, 7, 80, 2.0), rec(3, 8, 90, 0.5, epochs=[1, 2]), rec(4, 8, 80, 1.0)]
    m = ablation.measure(metrics, SUMMARY)
    assert m == {"before": [26, 60], "after": [57, 60], "first_all_correct": 3, "steps": 4,
                 "generated_tokens": 107 + 80 + 90 + 80, "problems_drawn": 4, "train_seconds": 5.0}
    # zero_variance=resample: the groups set aside count among the generated tokens and the problems drawn
    metrics[1] = dict(metrics[1], problems_drawn=3, set_aside=[{"response_tokens": 64}, {"response_tokens": 70}])
    m = ablation.measure(metrics, SUMMARY)
    assert (m["generated_tokens"], m["problems_drawn"]) == (107 + 80 + 90 + 80 + 64 + 70, 6)
    # a step printed twice (e.g. one row per epoch) counts once: its last record
    m = ablation.measure([rec(1, 3, 100, 1.0), rec(1, 8, 60, 2.0), rec(2, 5, 40, 1.0)], SUMMARY)
    assert (m["first_all_correct"], m["steps"], m["generated_tokens"], m["train_seconds"]) == (1, 2, 100, 3.0)


def test_never_when_no_group_is_all_correct():
    assert ablation.first_all_correct([rec(1, 7, 10, 1), rec(2, 0, 10, 1)]) == "never"
    assert ablation.first_all_correct([]) == "never"


def entry(variant, seed, after, first, tokens, seconds, wall=10.0):
    return {"variant": variant, "seed": seed, "before": [26, 60], "after": [after, 60], "first_all_correct": first,
            "generated_tokens": tokens, "train_seconds": seconds, "wall_seconds": wall}


def test_aggregate_means_over_seeds_and_keeps_failures_apart():
    entries = [entry("spec", 1, 57, 4, 4000, 30.0), entry("spec", 0, 60, 9, 5000, 20.0),
               entry("spec", 2, 54, "never", 6000, 40.0),
               {"variant": "kl_coef=0.04", "seed": 0, "error": "exit 2: rlvr: unknown setting kl_coef"}]
    rows = ablation.aggregate(entries, ["spec", "kl_coef=0.04"])
    spec, kl = rows
    assert spec["seeds"] == [0, 1, 2] and spec["after"] == [60, 57, 54] and spec["after_mean"] == 57.0
    assert spec["first_all_correct"] == [9, 4, "never"] and spec["before"] == [26] and spec["n"] == 60
    assert spec["tokens_mean"] == 5000.0 and spec["seconds_mean"] == 30.0
    assert kl["seeds"] == [] and kl["failed"] == {0: "exit 2: rlvr: unknown setting kl_coef"}
    text = ablation.table(rows)
    assert "| spec | 0,1,2 | 26/60 | 57.0/60; 60, 57, 54 | 9, 4, never | 5000 | 30.0 | 10.0 |" in text
    assert "| kl_coef=0.04 | - | failed: seed 0: exit 2: rlvr: unknown setting kl_coef" in text


def test_all_correct_uses_the_records_group_size():
    assert ablation.first_all_correct([rec(1, 4, 10, 1, group_size=4), rec(2, 8, 10, 1, group_size=16)]) == 1
    assert ablation.first_all_correct([rec(1, 4, 10, 1, group_size=8), rec(2, 8, 10, 1, group_size=16)]) == "never"
