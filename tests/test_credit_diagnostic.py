"""benchmarks/credit_diagnostic.py without a model run: its table's figures from given responses, and a user's
mistake said in one line with exit status 2 before the model is loaded or a response sampled."""

import json
import sys
from types import SimpleNamespace

import pytest

import train_rlvr as T
from conftest import ROOT
from run_helpers import one_line_error

sys.path.insert(0, str(ROOT / "benchmarks"))

import credit_diagnostic  # noqa: E402


def test_the_figures_of_a_right_and_wrong_group_and_an_all_wrong_one_on_sum3():
    """Two sum3 problems, two samples each. 23 + 4 + 5: one right response, one whose first line is wrong (26);
    47 + 8 + 6: both wrong at the second line (62, 60), their first line right. Greedy right on the first problem
    only: 1/2; sampled 1 of 4 right. Of the 3 wrong responses, 2 have their first line right, none its first two;
    the second group is the one with every reward equal (1 of 2), and the one all wrong (1 of 2), and a response of
    it has a right first line (1 of 1). With the first group both right instead, both groups have equal rewards:
    zero-variance 2 of 2, the 2 wrong responses both right on their first line."""
    problems = [{"problem": "23 + 4 + 5", "answer": "32"}, {"problem": "47 + 8 + 6", "answer": "61"}]
    groups = [["23 + 4 = 27\n27 + 5 = 32\n\\boxed{32}.", "23 + 4 = 26\n26 + 5 = 31\n\\boxed{31}."],
              ["47 + 8 = 55\n55 + 6 = 62\n\\boxed{62}.", "47 + 8 = 55\n55 + 6 = 60\n\\boxed{60}."]]
    greedy = [groups[0][0], groups[1][0]]
    assert credit_diagnostic.figures(problems, greedy, groups) == {
        "problems": 2, "steps": 2, "greedy": 0.5, "sampled": 0.25, "wrong_responses": 3,
        "wrong_first_k_right": [0.6667, 0.0], "zero_variance_groups": 0.5, "all_wrong_groups": 0.5,
        "all_wrong_with_a_right_first_line": 1.0}
    # the first group both right: each group's rewards are all equal now (2 of 2), not those that vary
    groups[0][1] = groups[0][0]
    assert credit_diagnostic.figures(problems, greedy, groups) == {
        "problems": 2, "steps": 2, "greedy": 0.5, "sampled": 0.5, "wrong_responses": 2,
        "wrong_first_k_right": [1.0, 0.0], "zero_variance_groups": 1.0, "all_wrong_groups": 0.5,
        "all_wrong_with_a_right_first_line": 1.0}


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    """A make_smollm2 folder with the sum3 dev problems and a model's config.json; loading the model or sampling
    fails the test (a mistake must be said before either)."""
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "sum3-dev.json").write_text(json.dumps([{"problem": "23 + 4 + 5", "answer": "32"}]))
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(T, "load_model_and_tokenizer", lambda *a: pytest.fail("loaded the model before the check"))
    monkeypatch.setattr(credit_diagnostic, "sample", lambda *a: pytest.fail("sampled before the check"))
    return model


@pytest.mark.parametrize("argv, message", [
    (["--problems", "0"], "--problems 0: pass how many dev problems of each task to sample, 1 or more"),
    # a negative count sliced off the last problems: 200 - 198 = 2 of them sampled, silently
    (["--problems", "-198"], "--problems -198: pass how many dev problems of each task to sample, 1 or more"),
    (["--samples", "0"], "--samples 0: pass how many responses to sample per problem, 1 or more"),
    (["--out", "{tmp}/taken"], "--out {tmp}/taken: {tmp}/taken is a file; pass a folder to write diagnostic.json into"),
    (["--out", "{tmp}/taken/diagnostic"],
     "--out {tmp}/taken/diagnostic: {tmp}/taken is a file; pass a folder to write diagnostic.json into"),
])
def test_a_mistake_is_one_line_and_exit_2_before_the_model_is_loaded(argv, message, folder, tmp_path, capsys):
    (tmp_path / "taken").write_text("an earlier result")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert credit_diagnostic.main(["--model", str(folder), "--tasks", "sum3", *argv]) == 2
    assert one_line_error(capsys) == "error: " + message.format(tmp=tmp_path)
    assert (tmp_path / "taken").read_text() == "an earlier result"


def test_a_folder_of_problems_without_the_model_is_one_line_and_exit_2(folder, capsys):
    """make_smollm2.py --problems-only writes the problems alone: the folder has sum3-dev.json, no config.json."""
    (folder / "config.json").unlink()
    assert credit_diagnostic.main(["--model", str(folder), "--tasks", "sum3"]) == 2
    assert one_line_error(capsys) == (f"error: {folder} holds the problems but no model (no config.json); run python "
                                      f"examples/make_smollm2.py {folder} (without --problems-only) to write the "
                                      "model beside them")


def test_a_damaged_model_is_the_trainers_one_line_and_exit_2(folder, capsys, monkeypatch):
    """A config.json cut short (and no tokenizer): the trainer's loader says why in one line, and nothing is
    sampled."""
    monkeypatch.undo()  # the real loader
    monkeypatch.setattr(credit_diagnostic, "sample", lambda *a: pytest.fail("sampled after a failed load"))
    (folder / "config.json").write_text('{"model_type": ')
    assert credit_diagnostic.main(["--model", str(folder), "--tasks", "sum3"]) == 2
    line = one_line_error(capsys)
    assert line.startswith(f"error: could not load model '{folder}' at revision ")
    assert line.endswith("; set model: to a hub id or a local folder")


def test_lines_right_reads_a_markdown_bullet_and_checks_the_running_sum():
    """A chain written as a markdown list is read as examples/sum_steps.py's chain reads it: on 23 + 4 + 7,
    "- 23 + 4 = 27" and "* 27 + 7 = 34" are both right; "+ 27 + 7 = 35" is wrong at its sum, "20 + 4 = 27" at its
    running sum (23, not 20); "-23 + 4 = 27" (a minus sign, no space) is no chain line."""
    right = credit_diagnostic.lines_right
    assert right("23 + 4 + 7", "- 23 + 4 = 27\n* 27 + 7 = 34\n\\boxed{34}") == [True, True]
    assert right("23 + 4 + 7", "- 23 + 4 = 27\n+ 27 + 7 = 35\n\\boxed{35}") == [True, False]
    assert right("23 + 4 + 7", "20 + 4 = 27\n27 + 7 = 34") == [False, True]
    assert right("23 + 4 + 7", "-23 + 4 = 27") == [False, False]


@pytest.mark.parametrize("text, why", [
    ('[{"problem": ', "is not JSON (Expecting value: line 1 column 14 (char 13));"),
    ('{"problem": "23 + 4 + 5", "answer": "32"}', "holds an object, not a list of problems;"),
    ("[]", "holds no problem;"),
    ('[{"problem": "23 + 4 + 5", "answer": "32"}, ["23 + 4 + 5"]]', "record 1 is not an object (a problem and its "
                                                                      "answer);"),
    ('[{"problem": "What is 2 times 3?", "answer": "6"}]',
     "record 0's problem 'What is 2 times 3?' is not a sum of whole numbers (23 + 4 + 5);"),
    ('[{"problem": "23 + 4 + 5", "answer": "32"}, {"answer": "7"}]',
     "record 1's problem None is not a sum of whole numbers (23 + 4 + 5);"),
    ('[{"problem": "23 + 4 + 5", "answer": "32"}, {"problem": "23 + 4", "answer": "27"}]',
     "record 1's problem '23 + 4' is a sum of 2 numbers, record 0's of 3; a task's sums have one length:"),
    ('[{"problem": "23 + 4 + 5", "answer": "33"}]', "record 0's answer '33' is not its sum 32 (23 + 4 + 5);"),
])
def test_a_dev_set_that_is_not_a_list_of_sums_is_one_line_and_exit_2_before_the_model_is_loaded(text, why, folder,
                                                                                                 capsys):
    """The figures read every problem as a sum after the sampling (minutes a task): a dev.json cut short, holding an
    object, no problem, a problem that is not a sum, sums of two lengths or a wrong answer is said first, in one
    line, the model not loaded (the fixture fails the test on a load)."""
    dev = folder / "sum3-dev.json"
    dev.write_text(text)
    assert credit_diagnostic.main(["--model", str(folder), "--tasks", "sum3"]) == 2
    assert one_line_error(capsys) == (f"error: {dev} {why} write the task's problems again: python "
                                      f"examples/make_smollm2.py {folder} --problems-only --task sum3")


def test_only_the_problems_sampled_are_read_as_sums(folder, monkeypatch):
    """--problems 1 of a dev set whose second record is no sum: the first alone is checked and sampled."""
    (folder / "sum3-dev.json").write_text(json.dumps([{"problem": "23 + 4 + 5", "answer": "32"}, {"problem": "x"}]))
    seen = []
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=2048))
    monkeypatch.setattr(T, "load_model_and_tokenizer", lambda *a: (model, None, None))
    monkeypatch.setattr(T, "check_problems", lambda records, *a: seen.append(records) or pytest.fail("checked"))
    with pytest.raises(pytest.fail.Exception):
        credit_diagnostic.main(["--model", str(folder), "--tasks", "sum3", "--problems", "1"])
    assert seen == [[{"problem": "23 + 4 + 5", "answer": "32", "index": 0}]]
