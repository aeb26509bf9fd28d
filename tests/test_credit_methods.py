"""benchmarks/credit_methods.py's checks of what each mode reads (no training): a missing folder is one line on
stderr and exit status 2, and --summary needs --out's results.json alone."""

import json
import sys

import pytest

from conftest import ROOT
from run_helpers import one_line_error

sys.path.insert(0, str(ROOT / "benchmarks"))

import credit_methods  # noqa: E402


def _main(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["credit_methods.py", *argv])
    return credit_methods.main()


@pytest.mark.parametrize("mode, message", [
    ("--summary", "{out} holds no results.json (no finished run of this script there); pass --out the folder a run "
                  "of this script wrote (runs/credit by default)"),
    ("--add-sampled", "{out} holds no results.json (no finished run of this script there); pass --out the folder a "
                      "run of this script wrote (runs/credit by default)"),
    ("--pictures", "{out} does not exist; pass --out the folder a run of this script wrote (runs/credit by default)"),
    ("--siblings", "{out} does not exist; pass --out the folder a run of this script wrote (runs/credit by default)"),
])
def test_each_modes_missing_out_folder_is_one_line_and_exit_2(mode, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "model").mkdir()
    out = tmp_path / "none"
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--model", str(tmp_path / "model"), "--out", str(out), mode)
    assert e.value.code == 2
    assert one_line_error(capsys) == "error: " + message.format(out=out)


def test_a_missing_model_folder_is_exit_2_and_the_summary_needs_none(tmp_path, monkeypatch, capsys):
    model, out = tmp_path / "nomodel", tmp_path / "credit"
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--model", str(model), "--out", str(out))
    assert e.value.code == 2
    assert one_line_error(capsys) == (f"error: {model} has no sum3-train.json; run python examples/make_smollm2.py "
                                      f"{model} (--problems-only --task sum3 for the sum3 task)")
    out.mkdir()  # --add-sampled: the finished runs there, the model's --on set not
    grid = json.loads((ROOT / "benchmarks" / "credit_methods.json").read_text())
    (out / "results.json").write_text(json.dumps(grid[:1]))
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--model", str(model), "--out", str(out), "--add-sampled", "--on", "heldout")
    assert e.value.code == 2
    assert one_line_error(capsys).startswith(f"error: {model} has no sum3-heldout.json; ")
    # the grid's first record (sum3, tree, seed 0): greedy 57 -> 154 of 200 = +48.5 points over 8,576 tokens
    assert _main(monkeypatch, "--model", str(model), "--out", str(out), "--summary") == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[2] == ("| sum3 | tree | 0 | 57/200 -> 154/200 | +48.5 | 2.8e-23 | 24.5 % -> 61.5 % | 16/50 | 8,576 | "
                       "+5,655 | 1168 s |")
