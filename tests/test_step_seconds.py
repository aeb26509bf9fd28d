"""benchmarks/step_seconds.py's checks of its arguments (no run): a mistake is one line on stderr and exit status 2,
said before the first training run, not after every run is done."""

import json
import sys

import pytest

from conftest import ROOT
from run_helpers import one_line_error

sys.path.insert(0, str(ROOT / "benchmarks"))

import step_seconds  # noqa: E402


@pytest.fixture()
def model(tmp_path):
    """What --model's check looks for: a model's config and the training problems (no run reads them here)."""
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "train.json").write_text(json.dumps([{"problem": f"{a} + 10", "answer": str(a + 10)}
                                                   for a in range(10, 26)]))  # 16, --problems' default
    return folder


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "x"], "--sizes x: pass the P values as whole numbers of 1 or more, separated by commas (1,2,4,8)"),
    (["--sizes", "1,0"], "--sizes 1,0: pass the P values as whole numbers of 1 or more, separated by commas (1,2,4,8)"),
    (["--json", "{tmp}/nodir/x.json"], "--json {tmp}/nodir/x.json: no folder {tmp}/nodir to write it in; create the "
                                       "folder first, or pass a path in an existing one"),
    (["--json", "{tmp}"], "--json {tmp} is a folder; pass the path of a file to write the results to"),
    (["--problems", "0"], "--problems 0: pass how many problems each run trains, 1 or more (16 by default)"),
    (["--problems", "-2"], "--problems -2: pass how many problems each run trains, 1 or more (16 by default)"),
    (["--problems", "17"], "--problems 17: {model}/train.json holds 16 problems; pass --problems 16 or fewer"),
    # P = 8 would fail after the runs of P = 1, 2 and 4
    (["--problems", "4"], "--sizes 1,2,4,8: P = 8 is more than --problems 4, the problems of a run; pass P values of "
                          "at most 4, or --problems 8 or more"),
])
def test_a_mistake_is_one_line_and_exit_2_before_any_run(argv, message, model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(step_seconds, "run", lambda *a: pytest.fail("a training run before the check"))
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert step_seconds.main(["--model", str(model), *argv]) == 2
    assert one_line_error(capsys) == "error: " + message.format(tmp=tmp_path, model=model)


@pytest.mark.parametrize("text, why", [
    ('[{"problem": "10 + 10", ', "is not JSON (Expecting property name enclosed in double quotes: line 1 column 25 "
                                 "(char 24))"),
    ('{"problems": []}', "holds an object, not a list of problems"),
    ("[]", "holds no problem"),
    ('[{"problem": "10 + 10", "answer": "20"}, "11 + 10"]', "record 1 is not a problem (an object with problem and "
                                                            "answer)"),
])
def test_a_damaged_train_json_is_one_line_and_exit_2_before_any_run(text, why, model, monkeypatch, capsys):
    """train.json cut short, holding an object, no problem, or a record that is no problem: said before the first
    run (it failed each run in turn, exit 1, after starting it); --problems 2 reads the first two records alone."""
    monkeypatch.setattr(step_seconds, "run", lambda *a: pytest.fail("a training run before the check"))
    (model / "train.json").write_text(text)
    assert step_seconds.main(["--model", str(model), "--problems", "2", "--sizes", "1"]) == 2
    assert one_line_error(capsys) == (f"error: {model / 'train.json'} {why}; write it again: python "
                                      f"examples/make_smollm2.py {model} --problems-only")


def test_sizes_with_spaces_run_each_p_and_the_json_is_written(model, tmp_path, monkeypatch, capsys):
    """--sizes "1, 2": P = 1 then 2, each its own run; --json in an existing folder holds both results."""
    ran = []

    def fake_run(model_dir, p, problems, out):
        ran.append((p, problems))
        return {"P": p, "all": {"steps": 16 // p, "seconds_per_problem": 2.0 / p, "generation_tokens_per_s": 50.0},
                "after_first_step": None, "correct": p}
    monkeypatch.setattr(step_seconds, "run", fake_run)
    assert step_seconds.main(["--model", str(model), "--sizes", "1, 2", "--json", str(tmp_path / "r.json")]) == 0
    assert ran == [(1, 16), (2, 16)]
    assert [r["P"] for r in json.loads((tmp_path / "r.json").read_text())["results"]] == [1, 2]
    assert capsys.readouterr().out.splitlines()[1] == ("P = 2: 8 steps, 1.00 s per problem (1.00 after the first "
                                                       "step), generation 50.0 tokens/s, 2 correct")
