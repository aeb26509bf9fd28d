"""From responses to figures: the real verifier scores each response's text alone (never the
prompt), and the step table and the summary print the right numbers. One scripted run of main()
(scripted_run.py), CPU, tiny local model."""

import re

import pytest

from scripted_run import CUT_TEXT, SCRIPT, STATUSES, run_scripted


@pytest.fixture(scope="module")
def scripted(tiny_model_dir, tiny_data_file, tmp_path_factory):
    return run_scripted(tiny_model_dir, tiny_data_file, tmp_path_factory)


def test_the_real_verifier_scores_the_response_text_alone(scripted):
    """Reward 1 from the real verifier end to end, and the verifier never sees the
    prompt (whose \\boxed{ANSWER} would turn every response without a box into 'wrong')."""
    scored = scripted["scored"]
    assert [gold for _, gold in scored] == ["0", "2", "4"]
    for step, (texts, _) in enumerate(scored, start=1):
        assert texts == [CUT_TEXT if t is None else t for t in SCRIPT[step]]
    by_step = {s: [r for r in scripted["rollouts"] if r["step"] == s] for s in (1, 2, 3)}
    for s, rows in by_step.items():
        assert [r["status"] for r in rows] == STATUSES[s]
        assert [r["reward"] for r in rows] == [1.0 if st == "correct" else 0.0 for st in STATUSES[s]]
        assert [r["response"] for r in rows] == scored[s - 1][0]
    assert [r["answer"] for r in by_step[1]] == ["0", "1", None, None]
    assert [r["cut_at_limit"] for r in by_step[1]] == [False, False, False, True]


def test_the_table_and_the_summary_print_the_right_figures(scripted):
    """The figures, not only the labels: sample std is the unbiased one (0.5 for
    1,0,0,0; the biased one is 0.433013) and the summary counts what happened."""
    lines = scripted["stdout"].splitlines()
    rows = [l.split() for l in lines[1:4]]
    tokens = [sum(len(r) for r in scripted["script"][s]) for s in (1, 2, 3)]
    assert [r[:5] for r in rows] == [["1", "1", "0.250", "0.500000", str(tokens[0])],
                                     ["2", "0", "0.000", "0.000000", str(tokens[1])],
                                     ["3", "4", "1.000", "0.000000", str(tokens[2])]]
    m = scripted["metrics"]
    assert rows[0][5:7] == [f"{m[0]['policy_loss']:.6f}", f"{m[0]['grad_norm']:.3f}"] and float(rows[0][6]) > 0
    assert [r[5:7] for r in rows[1:]] == [["0.000000", "0.000"]] * 2
    assert m[0]["reward_std"] == pytest.approx(0.5, abs=1e-7)
    assert lines[4] == ""
    assert lines[5:11] == [
        "correct rollouts        5/12 (mean reward 0.4167)",
        "zero-variance groups    2/3",
        "non-zero gradient       1 steps: 1",
        "weights changed         3 steps: 1, 2, 3",
        "skipped (non-finite)    0 steps",
        "verifier overruns       0 rollouts scored 0 after a timeout or a crash",
    ]
    assert re.fullmatch(rf"total time .* generation {sum(tokens)} tokens at [0-9.]+ tokens/s", lines[11])
