"""benchmarks/credit_methods.py's checks of what each mode reads (no training): a missing folder is one line on
stderr and exit status 2, and --summary needs --out's results.json alone."""

import itertools
import json
import statistics
import sys

import pytest

import train_rlvr as T
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
    ("--add-lines", "{out} holds no results.json (no finished run of this script there); pass --out the folder a "
                    "run of this script wrote (runs/credit by default)"),
    ("--pictures", "{out} does not exist; pass --out the folder a run of this script wrote (runs/credit by default)"),
    ("--siblings", "{out} does not exist; pass --out the folder a run of this script wrote (runs/credit by default)"),
    ("--masks", "{out} does not exist; pass --out the folder a run of this script wrote (runs/credit by default)"),
    ("--operands", "{out} does not exist; pass --out the folder a run of this script wrote (runs/credit by default)"),
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


@pytest.mark.parametrize("mode", [[], ["--summary"], ["--add-sampled"], ["--pictures"], ["--errors"]])
@pytest.mark.parametrize("where", ["taken", "taken/credit"])
def test_an_out_that_is_or_lies_in_a_file_is_one_line_and_exit_2_in_every_mode(mode, where, tmp_path, monkeypatch,
                                                                              capsys):
    """--out naming a file (or a folder inside one): said before any run, not as mkdir's FileExistsError (or
    NotADirectoryError), and not as "does not exist"/"holds no results.json" in the modes that read --out."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "sum3-train.json").write_text("[]")
    (tmp_path / "taken").write_text("an earlier table")
    monkeypatch.setattr(credit_methods, "one_run", lambda *a: pytest.fail("a run before the check"))
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--model", str(model), "--out", str(tmp_path / where), *mode)
    assert e.value.code == 2
    assert one_line_error(capsys) == (f"error: --out {tmp_path / where}: {tmp_path / 'taken'} is a file; pass --out a "
                                      "folder (runs/credit by default)")
    assert (tmp_path / "taken").read_text() == "an earlier table"


@pytest.mark.parametrize("mode", ["--pictures", "--errors", "--siblings", "--masks", "--operands"])
def test_the_modes_that_read_runs_need_the_models_tokenizer(mode, tmp_path, monkeypatch, capsys):
    """A model folder of problems alone (make_smollm2.py --problems-only) has no tokenizer: one line and exit 2,
    not transformers' traceback; with the tokenizer's files there, the mode runs (no run folder: nothing said; but
    --operands, which says so)."""
    from tiny_models import build_tiny_tokenizer

    model, out = tmp_path / "model", tmp_path / "credit"
    model.mkdir()
    out.mkdir()
    (model / "sum3-train.json").write_text("[]")
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--model", str(model), "--out", str(out), mode)
    assert e.value.code == 2
    assert one_line_error(capsys) == (f"error: {model} holds no tokenizer (no tokenizer.json or tokenizer_config.json);"
                                      " pass --model the model folder the runs trained (runs/smollm2 by default, "
                                      f"written by python examples/make_smollm2.py {model})")
    build_tiny_tokenizer(model)
    if mode == "--operands":  # nothing to say is said: test_operands_on_a_folder_without_a_sum_run_...
        return
    assert _main(monkeypatch, "--model", str(model), "--out", str(out), mode) == 0
    assert capsys.readouterr().out == ""


FIX = ("restore it from a copy (benchmarks/credit_methods.json holds the committed grid's) or pass --out the folder a "
       "run of this script wrote")


@pytest.mark.parametrize("text, why", [
    ('[{"task": ', " is not JSON (Expecting value: line 1 column 11 (char 10))"),
    ('{"runs": []}', " holds no list of runs"),
    ("[1]", ": its entry 0 is not a run's record (no generated_tokens, greedy, method, nonzero_gradient_steps, on, "
            "paired, points_per_million_tokens, seed, step_seconds, steps, task)"),
    ("drop greedy", ": its entry 1 is not a run's record (no greedy)"),
])
def test_a_damaged_results_json_is_one_line_and_exit_2(text, why, tmp_path, monkeypatch, capsys):
    """--summary on a results.json cut short, holding an object, a number, or a run without its greedy figures (the
    grid's first two, the second's dropped): one line naming what is wrong, not a traceback from the tables."""
    out = tmp_path / "credit"
    out.mkdir()
    if text == "drop greedy":
        grid = json.loads((ROOT / "benchmarks" / "credit_methods.json").read_text())[:2]
        del grid[1]["greedy"]
        text = json.dumps(grid)
    (out / "results.json").write_text(text)
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--out", str(out), "--summary")
    assert e.value.code == 2
    assert one_line_error(capsys) == f"error: {out / 'results.json'}{why}; {FIX}"


@pytest.mark.parametrize("mode", [[], ["--add-sampled"]])
def test_a_damaged_results_json_is_said_before_any_run_is_added_to_it(mode, tmp_path, monkeypatch, capsys):
    """Training (and --add-sampled) read results.json to add their runs to it: a damaged one is said before the
    first run, not when the record is rewritten after the run's minutes (and the run's figures lost)."""
    model, out = tmp_path / "model", tmp_path / "credit"
    model.mkdir()
    out.mkdir()
    (model / "sum3-train.json").write_text("[]")
    (model / "sum3-dev.json").write_text("[]")
    (out / "results.json").write_text('{"runs": []}')
    monkeypatch.setattr(credit_methods, "one_run", lambda *a: pytest.fail("a run before the check"))
    monkeypatch.setattr(credit_methods, "sampled_pass1", lambda *a: pytest.fail("a run before the check"))
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--model", str(model), "--out", str(out), *mode)
    assert e.value.code == 2
    assert one_line_error(capsys) == f"error: {out / 'results.json'} holds no list of runs; {FIX}"


@pytest.mark.parametrize("task, hint", [
    ("sum4", " (--problems-only --task sum4 for the sum4 task)"),
    ("sum5", " (--problems-only --task sum5 for the sum5 task)"),
    ("addition", ""),  # its sets come with the model: make_smollm2.py without --problems-only
])
def test_a_missing_training_set_names_the_task_that_lacks_it(task, hint, tmp_path, monkeypatch, capsys):
    """The folder holds sum3's sets only; --tasks sum3 TASK: the hint names TASK's make_smollm2 command, not sum3's."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "sum3-train.json").write_text("[]")
    name = credit_methods.TASKS[task][1] + "train.json"
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--model", str(model), "--out", str(tmp_path / "credit"), "--tasks", "sum3", task)
    assert e.value.code == 2
    assert one_line_error(capsys) == f"error: {model} has no {name}; run python examples/make_smollm2.py {model}{hint}"


def test_the_sum4_heldout_table_in_the_docs_is_the_committed_record():
    """docs/variants.md's held-out rows of the spec's credit on sum4 are benchmarks/credit47_heldout.json's runs:
    seed, greedy before -> after, change, steps with a gradient, generated tokens and step seconds."""
    record = json.loads((ROOT / "benchmarks" / "credit47_heldout.json").read_text())
    docs = (ROOT / "docs" / "variants.md").read_text()
    runs = [r for r in record if credit_methods.variant(r) == "sequence"]  # not the equal-compute runs
    assert sorted(r["seed"] for r in runs) == list(range(6))
    for r in runs:
        before, after = r["greedy"]["before"]["correct"], r["greedy"]["after"]["correct"]
        row = (f"| {r['seed']} | {before}/200 -> {after}/200 | {100 * (after - before) / 200:+.1f} | "
               f"{r['paired']['mcnemar_p']:.1e} | {r['nonzero_gradient_steps']}/50 | {r['generated_tokens']:,} | "
               f"{r['step_seconds']:.0f} |")
        assert row in docs, row
    change = [(r["greedy"]["after"]["correct"] - r["greedy"]["before"]["correct"]) / 2 for r in runs]
    tokens = statistics.mean(r["generated_tokens"] for r in runs)
    assert f"Mean {statistics.mean(change):+.1f} points (sd {statistics.stdev(change):.1f}), {tokens:,.0f} generated" in docs


def test_paired_differences_against_sequence_per_seed_with_a_sign_test():
    """Six seeds from 17/200: sequence ends at 114, 112, 105, 117, 109, 105 (the held-out record's), the tree at
    120, 118, 100, 125, 109, 112: differences +3.0, +3.0, -2.5, +4.0, 0.0, +3.5 points, mean +1.8 (sd 2.5); 4 seeds
    above, 1 below, 1 tie dropped: sign test p = 2 * (1 + 5) / 2**5 = 0.375. A method without a sequence run at
    its seeds, and sequence itself, get no row; a seed sequence lacks is left out."""
    def run(method, seed, after, settings=(), on="heldout"):
        return {"task": "sum4", "on": on, "method": method, "settings": list(settings), "seed": seed,
                "greedy": {"before": {"accuracy": 17 / 200}, "after": {"accuracy": after / 200}}}
    results = [run("sequence", s, a) for s, a in enumerate([114, 112, 105, 117, 109, 105])]
    results += [run("tree", s, a, ["tree_branching=4,2"]) for s, a in enumerate([120, 118, 100, 125, 109, 112, 150])]
    results += [run("monte_carlo", 0, 130, on="dev")]
    rows = credit_methods.paired_differences(results).splitlines()
    assert rows[2:] == ["| sum4 | heldout | tree tree_branching=4,2 | 0, 1, 2, 3, 4, 5 | +3.0, +3.0, -2.5, +4.0, +0.0, +3.5 "
                        "| +1.8 (2.5) | 4 / 1 | 0.38 |"]


def test_the_summary_counts_problems_won_and_lost_and_the_sample_sd_of_the_changes(tmp_path):
    """4 problems, 1 right before (25 %). `sequence` ends right on {0, 1} at seeds 0 and 1 (+25 points each); the
    tree on {0, 1, 2} at seed 0 (+50: won problem 2, lost none: "1/0", McNemar p 1) and on {0, 3} at seed 1 (+25:
    won 3, lost 1: "1/1", p 1). The tree's change over the seeds: mean +37.5, sd 17.7 (the sample sd of +50 and
    +25; the population sd would be 12.5). Won/lost come from each run's eval.jsonl after the last step (its
    before records, problem 0 right alone, are not read)."""
    right = {("sequence", 0): {0, 1}, ("sequence", 1): {0, 1}, ("tree", 0): {0, 1, 2}, ("tree", 1): {0, 3}}
    results = []
    for (method, seed), after in right.items():
        folder = credit_methods.run_folder(tmp_path, "sum3", method, seed)
        folder.mkdir()
        evals = [{"phase": phase, "problem_index": i, "reward": float(i in ok)}
                 for phase, ok in (("before", {0}), ("after", after)) for i in range(4)]
        (folder / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
        results.append({"task": "sum3", "on": "heldout", "method": method, "settings": [], "seed": seed,
                        "greedy": {"before": {"correct": 1, "n": 4, "accuracy": 0.25},
                                   "after": {"correct": len(after), "n": 4, "accuracy": len(after) / 4}},
                        "paired": {"mcnemar_p": 1.0}, "steps": 50, "nonzero_gradient_steps": 10 + seed,
                        "generated_tokens": 1000 * (seed + 1), "points_per_million_tokens": 100.0 * (seed + 1),
                        "step_seconds": 60.0 + seed})
    rows = credit_methods.summary(results, tmp_path).splitlines()[2:]
    assert rows == ["| sum3 | sequence | 2 | 2, 2/4 (from 1) | +25.0 (0.0) | - | - | 10.5/50 | 1,500 | +150 | "
                    "60 / 61 s |",
                    "| sum3 | tree | 2 | 3, 2/4 (from 1) | +37.5 (17.7) | 1/0 (1); 1/1 (1) | - | 10.5/50 | 1,500 | "
                    "+150 | 60 / 61 s |"]


@pytest.mark.parametrize("method, heading, seeds, settings, readme", [
    ("tree", "Held-out, the tree", 6, ("learning_rate=3e-6", "tree_branching=4,2"),
     "the tree (4,2) ends {below:.1f} points below it (six seeds, sd {sd:.1f}, p = {p})"),
    ("entropy", "Held-out, the entropy mask", 3, None,  # its rate: the dev record's best (checked below)
     "the entropy mask {below:.1f} below (three seeds, sd {sd:.1f}, p = {p})"),
    ("monte_carlo", "Held-out, `monte_carlo`", 6, None,
     "`monte_carlo` {below:.1f} below (six seeds, sd {sd:.1f}, p = {p}) on 7.2x the tokens"),
])
def test_the_sum4_heldout_method_tables_in_the_docs_are_the_committed_record(method, heading, seeds, settings, readme):
    """docs/variants.md's held-out rows of a method on sum4 (under its heading): each seed's greedy before -> after,
    change, difference from sequence's change at the same seed, steps with a gradient, generated tokens and step
    seconds from benchmarks/credit47_heldout.json (the won/lost cell, the fourth, comes from the runs' eval files,
    not kept); then the mean and sd of the differences and the sign test over the seeds,
    there and in the README's paragraph. The entropy mask's and monte_carlo's rates are the ones that scored best
    on dev (benchmarks/credit47_dev.json): chosen on dev, never on held-out."""

    record = json.loads((ROOT / "benchmarks" / "credit47_heldout.json").read_text())
    if settings is None:
        dev = [r for r in json.loads((ROOT / "benchmarks" / "credit47_dev.json").read_text()) if r["method"] == method]
        settings = tuple(max(dev, key=lambda r: r["greedy"]["after"]["correct"])["settings"])
    sequence = {r["seed"]: r for r in record if credit_methods.variant(r) == "sequence"}
    runs = [r for r in record if r["method"] == method]
    assert sorted(r["seed"] for r in runs) == list(range(seeds))
    assert {tuple(r["settings"]) for r in runs} == {settings}
    text = (ROOT / "docs" / "variants.md").read_text().split(heading)[1]
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| "))  # the heading's table, not a later one
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in table if line.split("|")[1].strip().isdigit()}
    change = lambda r: (r["greedy"]["after"]["correct"] - r["greedy"]["before"]["correct"]) / 2  # noqa: E731
    diffs = []
    for r in runs:
        before, after = r["greedy"]["before"]["correct"], r["greedy"]["after"]["correct"]
        diffs.append(change(r) - change(sequence[r["seed"]]))
        cells = rows[str(r["seed"])]
        assert cells[:3] + cells[4:] == [str(r["seed"]), f"{before}/200 -> {after}/200", f"{change(r):+.1f}",
                                         f"{diffs[-1]:+.1f}", f"{r['nonzero_gradient_steps']}/{r['steps']}",
                                         f"{r['generated_tokens']:,}", f"{r['step_seconds']:.0f}"], r["seed"]
    above, below = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    docs = " ".join(text.split())
    p = f"{T.mcnemar_exact_p(above, below):.2g}"
    assert (f"mean difference {statistics.mean(diffs):+.1f} points (sd {statistics.stdev(diffs):.1f}), {above} seeds "
            f"above and {below} below: sign test p = {p}") in docs
    assert readme.format(below=-statistics.mean(diffs), sd=statistics.stdev(diffs), p=p) in \
        " ".join((ROOT / "README.md").read_text().split())


def test_the_sum4_dev_tables_in_the_docs_are_the_committed_record():
    """Every dev run on sum4 (benchmarks/credit47_dev.json) is a row of docs/variants.md's dev tables, keyed by the
    setting it tried (its branching, else its learning rate): dev greedy after, change, steps with a gradient and
    generated tokens, then (every method but the first table's sequence) the step seconds; the chosen row in bold."""
    record = json.loads((ROOT / "benchmarks" / "credit47_dev.json").read_text())
    docs = (ROOT / "docs" / "variants.md").read_text().split("### Before any training")[1].split("### Measured")[0]
    lines = [line.replace("**", "") for line in docs.splitlines()]
    assert len(record) >= 9
    for r in record:
        key = r["settings"][-1].split("=")[1]
        after = r["greedy"]["after"]["correct"]
        row = (f"| {key} | {after}/200 | {(after - r['greedy']['before']['correct']) / 2:+.1f} | "
               f"{r['nonzero_gradient_steps']}/50 | {r['generated_tokens']:,} |")
        seconds = f"{row} {r['step_seconds']:.0f} |"
        assert (row if r["method"] == "sequence" else seconds) in lines, (r["method"], r["settings"])


class Chars:
    """A tokenizer of one token per character (for --masks and --errors)."""
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_where_the_entropy_masks_kept_tokens_lie_by_kind(tmp_path):
    """--masks: each response re-tokenized (here one character a token) and each token sorted by the text of its
    own line before it. "23 + 4 = 27\\n27 + 5 = 32\\n\\\\boxed{32}." + EOS is 36 tokens: the numbers added 2, 3, 4 and
    2, 7, 5 (the second line's 27 is a number added, though the first line has an "="); the sums 2, 7 and 3, 2;
    2 line ends; the boxed 3, 2; EOS; 21 others (" + ", " = " twice each line, "\\\\boxed{", "}."). The mask keeps
    the "3" of 23, the first sum, the first line end, the "2" of the second line's 27 and the second sum's "3"; a
    second response cut at the limit ("5\\n", no EOS) keeps its "5"; a third whose mask is one token short is not
    counted; a run without masks gives None."""
    text = "23 + 4 = 27\n27 + 5 = 32\n\\boxed{32}."
    mask = [0] * 36
    for i in (1, 9, 10, 11, 12, 21):
        mask[i] = 1
    records = [{"response": text, "cut_at_limit": False, "entropy_mask": mask},
               {"response": "5\n", "cut_at_limit": True, "entropy_mask": [1, 0]},
               {"response": "7\n", "cut_at_limit": False, "entropy_mask": [1, 1]}]
    (tmp_path / "rollouts.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert credit_methods.mask_kinds(tmp_path, Chars()) == {
        "digit of a line's sum": (3, 4), "digit of a number added": (3, 7), "line end": (1, 3),
        "digit of the boxed answer": (0, 2), "other (+, =, words)": (0, 21), "EOS": (0, 1)}
    (tmp_path / "rollouts.jsonl").write_text(json.dumps({"response": text, "cut_at_limit": False}))
    assert credit_methods.mask_kinds(tmp_path, Chars()) is None


def test_where_a_runs_credit_went_against_its_lines_correctness(tmp_path):
    """--errors on the problem 23 + 4 + 5 (the training set's second: problem_index 1), one token a character,
    the EOS last. A right response on A_i = +1.5: its 36 tokens up, |A| 54. A wrong one whose second line is wrong
    ("27 + 5 = 33"), token advantages +0.5 on its first line's 12 tokens (the line end closes a line), -1.0 on the
    second's 12, 0 on the answer line and EOS: before the error (12 up, 6.0), the error line (12 down, 12.0),
    after it (12 at 0). A wrong first line on A_i = -0.25 under an entropy mask that keeps 6 tokens of that line
    and 2 of the next: 6 down (1.5) and 6 at 0 on the error line, 2 down (0.5) and 22 at 0 after it. A wrong
    answer after two right lines on A_i = -0.5: 36 down, 18.0. A record one token short is not counted."""
    def record(response, reward, advantage=0.0, **extra):
        return {"problem_index": 1, "response": response, "reward": reward, "advantage": advantage, "tokens": 36,
                "cut_at_limit": False, **extra}

    mask = [1] * 6 + [0] * 6 + [1] * 2 + [0] * 22
    records = [record("23 + 4 = 27\n27 + 5 = 32\n\\boxed{32}.", 1.0, 1.5),
               record("23 + 4 = 27\n27 + 5 = 33\n\\boxed{33}.", 0.0,
                      token_advantages=[0.5] * 12 + [-1.0] * 12 + [0.0] * 12),
               record("23 + 4 = 26\n26 + 5 = 31\n\\boxed{31}.", 0.0, -0.25, entropy_mask=mask),
               record("23 + 4 = 27\n27 + 5 = 32\n\\boxed{33}.", 0.0, -0.5),
               record("23 + 4 = 27\n27 + 5 = 32\n\\boxed{32}.", 1.0, token_advantages=[100.0] * 35)]
    (tmp_path / "rollouts.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    problems = [{"problem": "1 + 2 + 3"}, {"problem": "23 + 4 + 5"}]
    assert credit_methods.error_credit(tmp_path, Chars(), problems) == {
        "right response": (36, 0, 0, 54.0), "before the error": (12, 0, 0, 6.0), "the error line": (0, 18, 6, 13.5),
        "after the error": (0, 2, 34, 0.5), "wrong, every line right": (0, 36, 0, 18.0)}


def test_a_run_is_recorded_from_its_files_and_its_checkpoints_dropped(tmp_path, monkeypatch):
    """one_run with train_rlvr.py's run stubbed by one that writes a finished run's files: greedy 1 -> 3 of 4 (+50
    points) over 300 + 200 generated tokens = +100,000 points per million tokens; 10 + 8 step seconds, so +10,000
    points an hour; the phases summed over the steps; the run's checkpoints/ deleted, final/ kept. The summary row
    gives the steps with a gradient out of the run's own steps (1 of 2), not out of 50."""
    calls = []

    def fake_run(args, log):
        calls.append(args)
        folder = tmp_path / next(a for a in args if a.startswith("output_dir="))[len("output_dir="):]
        (folder / "checkpoints" / "step-2").mkdir(parents=True)
        (folder / "checkpoints" / "step-2" / "model.safetensors").write_text("weights")
        (folder / "final").mkdir()
        (folder / "final" / "model.safetensors").write_text("weights")
        evals = [{"phase": phase, "reward": float(i < right), "cut_at_limit": False, "status": "boxed", "tokens": 10}
                 for phase, right in (("before", 1), ("after", 3)) for i in range(4)]
        (folder / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
        (folder / "eval_summary.json").write_text(json.dumps({"comparison": {"paired": {"mcnemar_p": 0.5}}}))
        steps = [{"grad_norm": 0.0, "generated_tokens": 300, "response_tokens": 100, "seconds": 10.0,
                  "timings": {"generation": 6.0, "credit": 2.0}},
                 {"grad_norm": 1.5, "generated_tokens": 200, "response_tokens": 90, "seconds": 8.0,
                  "timings": {"generation": 5.0, "optimizer": 1.0}}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
        return 42.0

    monkeypatch.setattr(credit_methods, "run", fake_run)
    res = credit_methods.one_run(tmp_path / "model", "sum4", "monte_carlo", 3, "dev", tmp_path, False,
                                 ["learning_rate=3e-6"])
    folder = tmp_path / "sum4-monte_carlo-seed3-learning_rate3e-6"
    assert calls[0][:2] == ["--config", "examples/smollm2_sum4.yaml"]
    assert {f"output_dir={folder}", "seed=3", "credit=monte_carlo", "learning_rate=3e-6",
            f"eval_dataset={tmp_path / 'model' / 'sum4-dev.json'}"} <= set(calls[0])
    assert (res["greedy"]["before"]["correct"], res["greedy"]["after"]["correct"]) == (1, 3)
    assert (res["steps"], res["nonzero_gradient_steps"], res["generated_tokens"]) == (2, 1, 500)
    assert res["points_per_million_tokens"] == pytest.approx(100_000)
    assert (res["step_seconds"], res["points_per_hour"], res["run_seconds"]) == (18.0, pytest.approx(10_000), 42.0)
    assert res["phase_seconds"] == {"generation": 11.0, "rewards": 0.0, "credit": 2.0, "logprob_backward": 0.0,
                                    "optimizer": 1.0}
    assert not (folder / "checkpoints").exists() and (folder / "final" / "model.safetensors").is_file()
    row = credit_methods.summary([res], tmp_path).splitlines()[2]
    assert "| 1.0/2 | 500 | +100,000 | 18 s |" in row, row
    # a credit=steps run's record carries its line figures (read from its folder); another credit's has none
    assert "lines" not in res
    monkeypatch.setattr(credit_methods, "line_figures", lambda folder: {"read": folder.name})
    res = credit_methods.one_run(tmp_path / "model", "sum4", "steps", 3, "dev", tmp_path, False)
    assert res["lines"] == {"read": "sum4-steps-seed3"}


def test_the_sum4_equal_compute_table_in_the_docs_is_the_committed_record():
    """The spec's credit given monte_carlo's seconds: num_problems N = 50 x monte_carlo's mean step seconds over its
    six held-out seeds / the spec's credit's at the same seeds (1631 / 595 s: 137). docs/variants.md's rows are
    benchmarks/credit47_heldout.json's runs: seed, greedy before -> after, change, difference from `monte_carlo` and
    from `sequence` (50 steps) at the same seed, steps with a gradient of N, generated tokens, step seconds; then
    the mean differences, there and in the README's paragraph, and each difference's sd and sign test over the seeds."""
    record = [r for r in json.loads((ROOT / "benchmarks" / "credit47_heldout.json").read_text()) if r["on"] == "heldout"]
    sequence = {r["seed"]: r for r in record if credit_methods.variant(r) == "sequence"}
    mc = {r["seed"]: r for r in record if r["method"] == "monte_carlo"}
    assert sorted(mc) == list(range(6))
    n = round(50 * statistics.mean(r["step_seconds"] for r in mc.values())
              / statistics.mean(sequence[s]["step_seconds"] for s in mc))
    runs = [r for r in record if r["method"] == "sequence" and r["settings"]]
    assert n == 137 and all(credit_methods.variant(r) == f"sequence num_problems={n}" and r["steps"] == n
                            for r in runs)
    assert sorted(r["seed"] for r in runs) == list(range(6))  # the issue's six seeds, each once
    text = (ROOT / "docs" / "variants.md").read_text().split("Held-out, the spec's credit given `monte_carlo`'s seconds")[1]
    change = lambda r: (r["greedy"]["after"]["correct"] - r["greedy"]["before"]["correct"]) / 2  # noqa: E731
    for r in runs:
        s = r["seed"]
        row = (f"| {s} | 17/200 -> {r['greedy']['after']['correct']}/200 | {change(r):+.1f} | "
               f"{change(r) - change(mc[s]):+.1f} | {change(r) - change(sequence[s]):+.1f} | "
               f"{r['nonzero_gradient_steps']}/{n} | {r['generated_tokens']:,} | {r['step_seconds']:.0f} |")
        assert r["greedy"]["before"]["correct"] == 17 and row in text, row
    diffs = {name: [change(r) - change(other[r["seed"]]) for r in runs]
             for other, name in ((mc, "`monte_carlo`"), (sequence, "its own 50 steps"))}
    vs_mc, vs_seq = map(statistics.mean, diffs.values())
    docs = " ".join(text.split())
    assert f"{vs_mc:+.1f} points against `monte_carlo` and {vs_seq:+.1f} against its own 50 steps" in docs
    p = {}
    for name, d in diffs.items():  # each difference's sd and sign test over the seeds
        above, below = sum(x > 0 for x in d), sum(x < 0 for x in d)
        p[name] = f"{T.mcnemar_exact_p(above, below):.2g}"
        assert f"against {name}: sd {statistics.stdev(d):.1f}, {above} above and {below} below, sign test p = {p[name]}" \
            in docs, name
    assert (f"the spec's credit given its seconds (137 problems) ends {vs_mc:.1f} points above it "
            f"(seeds 0-5, sign test p = {p['`monte_carlo`']})") in " ".join((ROOT / "README.md").read_text().split())


def test_the_sum4_sampled_pass1_table_in_the_docs_is_the_committed_record():
    """docs/variants.md's sampled pass@1 table on held-out sum4 is benchmarks/credit47_heldout.json's `sampled`:
    the start model's per seed (every run of a seed shares it), then each method's final/ per seed, in %, and
    their mean; every held-out run has its figure."""
    record = [r for r in json.loads((ROOT / "benchmarks" / "credit47_heldout.json").read_text()) if r["on"] == "heldout"]
    assert all("sampled" in r for r in record)
    docs = (ROOT / "docs" / "variants.md").read_text().split("| method | seeds | sampled pass@1, per seed (%) | mean |")[1]
    rows = set(docs.splitlines())
    start = {}
    for r in record:
        assert start.setdefault(r["seed"], r["sampled"]["before"]) == r["sampled"]["before"], r["seed"]
    row = lambda name, xs: (f"| {name} | {', '.join(str(s) for s, _ in xs)} | "  # noqa: E731
                            f"{', '.join(f'{100 * x:.1f}' for _, x in xs)} | {100 * statistics.mean(x for _, x in xs):.1f} |")
    assert row("start model", sorted(start.items())) in rows
    # the spec's credit at more steps (num_problems=N: as many seconds as monte_carlo) is its own row
    name = lambda r: f"sequence, {r['steps']} steps" if r["method"] == "sequence" and r["settings"] else r["method"]  # noqa: E731
    names = dict.fromkeys(map(name, record))
    assert {"sequence", "tree", "entropy", "monte_carlo"} <= names.keys()
    after = {method: sorted((r["seed"], r["sampled"]["after"]) for r in record if name(r) == method) for method in names}
    for method, xs in after.items():
        assert (len(xs) >= 3 or method.endswith(" steps")) and row(method, xs) in rows, method
    # the sentence under the table: the spec's credit at 137 steps against itself at 50 and monte_carlo, same seeds
    long = dict(after["sequence, 137 steps"])
    mean = lambda method: f"{100 * statistics.mean(dict(after[method])[s] for s in long):.1f} %"  # noqa: E731
    assert (f"samples {mean('sequence, 137 steps')} at seeds 0-{max(long)}, against {mean('sequence')} at 50 steps "
            f"and `monte_carlo`'s {mean('monte_carlo')}") in " ".join(docs.split())


def _response(step, problem, rollout, text, verdicts, terms=None, reward=0.0, advantage=0.0, cut=False, **extra):
    """A credit=steps rollouts.jsonl record as the trainer writes it, a token a character: a segment a line (its first
    token), each line's verdict (a last line cut at max_new_tokens is unknown: None), each token's advantage A_i plus
    its line's term (terms: one a line, 0 by default); the EOS, where the response ended, has its last line's."""
    lines = text.split("\n")
    terms = terms or [0.0] * len(lines)
    assert len(verdicts) == len(terms) == len(lines) and not (cut and verdicts[-1] is not None)
    segments = [sum(len(x) + 1 for x in lines[:k]) for k in range(len(lines))]
    per_token = [advantage + terms[k] for k, line in enumerate(lines) for _ in line + "\n"][:len(text)]
    per_token += [] if cut else [advantage + terms[-1]]
    return {"step": step, "problem_index": problem, "rollout": rollout, "response": text, "reward": reward,
            "advantage": advantage, "tokens": len(per_token), "cut_at_limit": cut, "segments": segments,
            "line_verdicts": verdicts, "token_advantages": per_token, **extra}


def _steps_run(folder, steps, p=1):
    """A credit=steps run's metrics.jsonl and rollouts.jsonl. steps: each step's dict of grad (its grad norm), groups
    (a list of groups, each its responses' records, _response's) and, if any, failed (step checks failed) and aside
    (the records of a group set aside, zero_variance=resample: written before the step's groups). A step's record
    is the trainer's: a group's correct its rewards of 1, the step's their sum; the line figures from the verdicts
    (train_rlvr.line_figures); with p > 1 the step's problems and groups (a short last step: fewer)."""
    from types import SimpleNamespace

    folder.mkdir(parents=True, exist_ok=True)
    metrics, rollouts = [], []
    for n, step in enumerate(steps, 1):
        groups = step["groups"]
        correct = [sum(r["reward"] == 1.0 for r in g) for g in groups]
        credits = [SimpleNamespace(verdicts=[r["line_verdicts"] for r in g], failed=0) for g in groups]
        credits[0].failed = step.get("failed", 0)
        m = {"step": n, "problem_index": groups[0][0]["problem_index"], "group_size": len(groups[0]),
             "correct": sum(correct), "grad_norm": step["grad"], **T.credit.line_figures(credits)}
        if p > 1:
            m["problems"] = [g[0]["problem_index"] for g in groups]
            m["groups"] = [{"problem_index": g[0]["problem_index"], "group_size": len(g), "correct": c}
                           for g, c in zip(groups, correct)]
        metrics.append(m)
        rollouts += step.get("aside", []) + [r for g in groups for r in g]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (folder / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))


def _three_steps():
    """Three steps of one group of two (P = 1), sum3 chains. Step 1 (problem 0) all wrong with a gradient: line 1 of
    one response right, of the other wrong (terms +-0.7); 4 lines checked, 1 right, 2 unknown (the boxed lines), two
    distinct responses. Step 2 (problem 1) all wrong, no gradient: one response checked (2 lines, both wrong), the
    other's check failed (its lines unknown): 3 unknown, half the responses unchecked, two distinct. Step 3
    (problem 2) all right, both the same response with no checked line: 4 unknown, every response unchecked."""
    return [
        {"grad": 0.5, "groups": [[
            _response(1, 0, 0, "23 + 4 = 27\n27 + 5 = 33\n\\boxed{33}", [True, False, None], [0.7, -0.7, 0.0]),
            _response(1, 0, 1, "23 + 4 = 28\n28 + 5 = 34\n\\boxed{34}", [False, False, None], [-0.7, 0.7, 0.0])]]},
        {"grad": 0.0, "failed": 1, "groups": [[
            _response(2, 1, 0, "10 + 5 = 16\n16 + 1 = 18\n\\boxed{18}", [False, False, None]),
            _response(2, 1, 1, "It is 18.\n\\boxed{18}", [None, None])]]},
        {"grad": 0.0, "groups": [[_response(3, 2, k, "The sum is 40.\n\\boxed{40}", [None, None], reward=1.0)
                                  for k in range(2)]]}]


def test_a_steps_runs_line_figures_over_its_first_and_last_steps(tmp_path):
    """_three_steps, edge 2. First two steps: 6 checked lines over 4 responses (1.5), 5 unknown (1.25), right 1/6,
    unchecked (0 x 2 + 0.5 x 2) / 4 = 0.25, distinct (2 + 2) / 2 = 2; last two: 2 checked (0.5), 7 unknown (1.75),
    right 0/2, unchecked (0.5 x 2 + 1.0 x 2) / 4 = 0.75, distinct (2 + 1) / 2 = 1.5. Two all-wrong groups, one with
    a gradient (a token advantage not 0); at most every response (1.0) unchecked at one step; one check failed. A
    run of another credit (no line figures in its metrics) has none."""
    _steps_run(tmp_path / "steps", _three_steps())
    assert credit_methods.line_figures(tmp_path / "steps", edge=2) == {
        "all_wrong_groups": 2, "all_wrong_groups_with_gradient": 1, "step_checker_failures": 1,
        "responses_unchecked_most": 1.0,
        "first": {"checked_per_response": 1.5, "unknown_per_response": 1.25, "right_share": pytest.approx(1 / 6),
                  "responses_unchecked": 0.25, "distinct_per_group": 2.0},
        "last": {"checked_per_response": 0.5, "unknown_per_response": 1.75, "right_share": 0.0,
                 "responses_unchecked": 0.75, "distinct_per_group": 1.5}}
    (tmp_path / "sequence").mkdir()
    (tmp_path / "sequence" / "metrics.jsonl").write_text(json.dumps({"step": 1, "correct": 1, "grad_norm": 1.0,
                                                                     "group_size": 2}) + "\n")
    assert credit_methods.line_figures(tmp_path / "sequence") is None


def test_the_line_figures_at_two_problems_a_step_count_groups_and_weigh_each_step_by_its_responses(tmp_path):
    """problems_per_step 2, groups of 2, three steps, the last short (one group), edge 2; a group set aside at step 1
    (zero_variance=resample: not trained on, not read). Step 1: problem 0 all wrong with a gradient (line terms
    +-0.7), problem 1 all wrong, no gradient, its two responses one text with no checked line: 4 checked, 2 right, 6
    unknown, half the 4 responses unchecked. Step 2: problem 2 all wrong with a gradient, problem 3 one right: 8
    checked, 4 right, 4 unknown, none unchecked. Step 3: problem 4 all wrong, its two responses one text cut at
    max_new_tokens, no line checked (the cut last line unknown): 4 unknown, both unchecked.
    All-wrong groups: problems 0, 1, 2 and 4 = 4 (steps with no right response: 2), with a gradient 0 and 2 = 2.
    First two steps, 8 responses (P x G = 4 each, not G = 2): 12 checked (1.5 a response), 10 unknown (1.25), right
    6/12, unchecked (0.5 x 4 + 0 x 4) / 8 = 0.25, distinct per (step, problem) (2 + 1 + 2 + 2) / 4 = 1.75 (per step:
    (3 + 4) / 2 = 3.5; with the set-aside group's two: 9 / 5 = 1.8). Last two, 4 + 2 = 6 responses: 8 checked
    (1.333), 8 unknown (1.333), right 4/8, unchecked (0 x 4 + 1.0 x 2) / 6 = 0.333 (the mean over the steps would say
    0.5), distinct (2 + 2 + 1) / 3 = 1.667."""
    steps = [
        {"grad": 0.4, "aside": [_response(1, 9, k, text, [None, None], set_aside=True)
                                for k, text in enumerate(["Twelve.\n\\boxed{12}", "12\n\\boxed{12}"])],
         "groups": [[_response(1, 0, 0, "23 + 4 = 27\n27 + 5 = 33\n\\boxed{33}", [True, False, None],
                               [0.7, -0.7, 0.0]),
                     _response(1, 0, 1, "23 + 4 = 28\n28 + 5 = 33\n\\boxed{33}", [False, True, None],
                               [-0.7, 0.7, 0.0])],
                    [_response(1, 1, k, "It is 17.\n\\boxed{17}", [None, None]) for k in range(2)]]},
        {"grad": 0.9, "groups": [[_response(2, 2, 0, "47 + 8 = 55\n55 + 6 = 62\n\\boxed{62}", [True, False, None],
                                            [0.7, 0.0, 0.0]),
                                  _response(2, 2, 1, "47 + 8 = 54\n54 + 6 = 60\n\\boxed{60}", [False, False, None],
                                            [-0.7, 0.0, 0.0])],
                                 [_response(2, 3, 0, "31 + 2 = 33\n33 + 9 = 42\n\\boxed{42}", [True, True, None],
                                            reward=1.0, advantage=0.7),
                                  _response(2, 3, 1, "31 + 2 = 33\n33 + 9 = 41\n\\boxed{41}", [True, False, None],
                                            advantage=-0.7)]]},
        {"grad": 0.0, "groups": [[_response(3, 4, k, "Adding 60 and 3\nand 2 gi", [None, None], cut=True)
                                  for k in range(2)]]}]
    _steps_run(tmp_path, steps, p=2)
    assert credit_methods.line_figures(tmp_path, edge=2) == {
        "all_wrong_groups": 4, "all_wrong_groups_with_gradient": 2, "step_checker_failures": 0,
        "responses_unchecked_most": 1.0,
        "first": {"checked_per_response": 1.5, "unknown_per_response": 1.25, "right_share": 0.5,
                  "responses_unchecked": 0.25, "distinct_per_group": 1.75},
        "last": {"checked_per_response": pytest.approx(8 / 6), "unknown_per_response": pytest.approx(8 / 6),
                 "right_share": 0.5, "responses_unchecked": pytest.approx(1 / 3),
                 "distinct_per_group": pytest.approx(5 / 3)}}


def test_add_lines_adds_the_figures_to_the_steps_runs_alone(tmp_path, monkeypatch, capsys):
    """--add-lines: the credit=steps run in results.json gets its line figures from its folder (_three_steps: 2
    all-wrong groups, 1 with a gradient) and says so; the spec's credit's run (no line figures), a run whose folder
    is gone, and a steps run whose record has its figures already (kept as they are, its folder not read: here
    one that would give others) are left as they were; nothing is trained."""
    out = tmp_path / "credit"
    grid = json.loads((ROOT / "benchmarks" / "credit_methods.json").read_text())[:4]
    for r, method in zip(grid, ["steps", "sequence", "steps", "steps"]):
        r.update(method=method, settings=[], seed=0, task="sum4")
    grid[2]["seed"] = 1  # no folder
    grid[3].update(seed=2, lines={"all_wrong_steps": 7, "all_wrong_with_gradient": 3})  # recorded before
    _steps_run(credit_methods.run_folder(out, "sum4", "steps", 0), _three_steps())
    _steps_run(credit_methods.run_folder(out, "sum4", "steps", 2), _three_steps())
    sequence = credit_methods.run_folder(out, "sum4", "sequence", 0)
    sequence.mkdir()
    (sequence / "metrics.jsonl").write_text(json.dumps({"step": 1, "correct": 1, "grad_norm": 1.0, "group_size": 2}))
    (out / "results.json").write_text(json.dumps(grid))
    monkeypatch.setattr(credit_methods, "one_run", lambda *a: pytest.fail("a run"))
    assert _main(monkeypatch, "--out", str(out), "--add-lines") == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved[0]["lines"] == credit_methods.line_figures(credit_methods.run_folder(out, "sum4", "steps", 0))
    assert (saved[0]["lines"]["all_wrong_groups"], saved[0]["lines"]["all_wrong_groups_with_gradient"]) == (2, 1)
    assert saved[1:] == grid[1:]
    assert saved[3]["lines"] == {"all_wrong_steps": 7, "all_wrong_with_gradient": 3}
    assert capsys.readouterr().out.splitlines() == [f"sum4 steps seed 0: {json.dumps(saved[0]['lines'])}"]


def test_a_steps_runs_picture_is_its_first_group_where_the_lines_alone_gave_a_gradient(tmp_path, monkeypatch):
    """group_picture on a credit=steps run: step 1 has reward variance, step 2 is all wrong with no token moved,
    step 3 all wrong with line 1's tokens moved by the verdicts: step 3 is drawn, each response's characters with
    its token_advantages. A run of the spec's credit (no line_verdicts) is drawn at its first step with variance."""
    drawn = []
    monkeypatch.setattr(T, "save_picture", lambda fig, out: drawn.append(fig))
    monkeypatch.setattr(T, "credit_figure", lambda records: [(r["step"], r["tokens"], r["token_advantages"])
                                                             for r in records])

    def record(step, text, advantage, credit, **extra):
        return {"step": step, "response": text, "advantage": advantage, "cut_at_limit": True, "tokens": len(text),
                "token_advantages": credit, **extra}
    records = [record(1, "ab", 0.7, [0.7, 0.7]), record(1, "cd", -0.7, [-0.7, -0.7]),
               record(2, "ef", 0.0, [0.0, 0.0]), record(2, "gh", 0.0, [0.0, 0.0]),
               record(3, "ij", 0.0, [0.7, 0.0]), record(3, "kl", 0.0, [-0.7, 0.0])]
    for r in records:
        r["line_verdicts"] = [None]
    (tmp_path / "rollouts.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert credit_methods.group_picture(tmp_path, Chars(), "<eos>", tmp_path / "p.png") == tmp_path / "p.png"
    assert drawn[-1] == [(3, ["i", "j"], [0.7, 0.0]), (3, ["k", "l"], [-0.7, 0.0])]
    for r in records:
        del r["line_verdicts"]
    (tmp_path / "rollouts.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    credit_methods.group_picture(tmp_path, Chars(), "<eos>", tmp_path / "p.png")
    assert drawn[-1] == [(1, ["a", "b"], [0.7, 0.7]), (1, ["c", "d"], [-0.7, -0.7])]


def test_operands_counts_right_sums_of_the_problems_numbers_and_of_others(tmp_path, monkeypatch, capsys):
    """--operands on a sum run: "23 + 4 + 7" answered "23 + 4 = 27 / 27 + 7 = 34" before (2 chain lines, both right
    by arithmetic and by the chain) and "23 + 4 = 27 / 28 + 7 = 35" after (the second line a right sum of 28, not
    27: arithmetic right, chain wrong); "10 + 5 + 1" after: "10 + 5 = 16" (wrong both ways), "16 + 1 = 17" (a right
    sum of the wrong number). The boxed line is no chain line. A run on problems that are not sums says nothing."""
    problems = tmp_path / "sum3-dev.json"
    problems.write_text(json.dumps([{"problem": "23 + 4 + 7", "answer": "34"}, {"problem": "10 + 5 + 1"}]))
    out = tmp_path / "credit"
    run = out / "sum3-steps-seed0"
    run.mkdir(parents=True)
    (run / "run_config.yaml").write_text(f"eval_dataset: {problems}\n")
    answers = [("before", 0, "23 + 4 = 27\n27 + 7 = 34\n\\boxed{34}"),
               ("after", 0, "23 + 4 = 27\n28 + 7 = 35\n\\boxed{35}"),
               ("after", 1, "10 + 5 = 16\n16 + 1 = 17\n\\boxed{17}")]
    (run / "eval.jsonl").write_text("".join(json.dumps({"phase": ph, "problem_index": i, "response": text}) + "\n"
                                            for ph, i, text in answers))
    assert credit_methods.operand_lines(run) == {
        "before": {"chain_lines": 2, "arithmetic_right": 2, "chain_right": 2, "right_sum_wrong_numbers": 0},
        "after": {"chain_lines": 4, "arithmetic_right": 3, "chain_right": 1, "right_sum_wrong_numbers": 2}}
    from tiny_models import build_tiny_tokenizer

    (tmp_path / "model").mkdir()
    build_tiny_tokenizer(tmp_path / "model")
    assert _main(monkeypatch, "--model", str(tmp_path / "model"), "--out", str(out), "--operands") == 0
    assert capsys.readouterr().out == ("sum3-steps-seed0: before 2 chain lines, arithmetic right 2, chain right 2, "
                                       "right sums of wrong numbers 0; after 4 chain lines, arithmetic right 3, "
                                       "chain right 1, right sums of wrong numbers 2\n")
    problems.write_text(json.dumps([{"problem": "What is 2 times 3?"}, {"problem": "x"}]))
    assert credit_methods.operand_lines(run) is None


def _lines_cells(r):
    """A steps run's all-wrong groups with a gradient and its distinct responses per group, as the docs' tables
    give them ("-" for the spec's credit, which has no line figures)."""
    lines = r.get("lines")
    if not lines:
        return "- | -"
    return (f"{lines['all_wrong_groups_with_gradient']}/{lines['all_wrong_groups']} | "
            f"{lines['first']['distinct_per_group']:.1f} -> {lines['last']['distinct_per_group']:.1f}")


def test_the_steps_tables_in_the_docs_are_the_committed_record():
    """docs/variants.md's section on credit: steps is benchmarks/credit62_dev.json and credit62_heldout.json: every
    dev run a row (with the spec's credit's three dev rates from credit47_dev.json), the held-out method the dev
    runs' best; each held-out sum4 seed's row with its difference from the spec's credit at the same seed
    (credit47_heldout.json), the mean, sd and sign test there and in the README, and the sampled pass@1 rows."""
    dev = json.loads((ROOT / "benchmarks" / "credit62_dev.json").read_text())
    held = [r for r in json.loads((ROOT / "benchmarks" / "credit62_heldout.json").read_text()) if r["task"] == "sum4"]
    spec = json.loads((ROOT / "benchmarks" / "credit47_heldout.json").read_text())
    sequence = {r["seed"]: r for r in spec if credit_methods.variant(r) == "sequence"}
    text = (ROOT / "docs" / "variants.md").read_text().split("### Measured: credit from checked steps")[1]
    text = text.split("\n### ")[0]
    rows = set(text.splitlines())
    change = lambda r: (r["greedy"]["after"]["correct"] - r["greedy"]["before"]["correct"]) / 2  # noqa: E731
    seq_dev = [r for r in json.loads((ROOT / "benchmarks" / "credit47_dev.json").read_text())
               if r["method"] == "sequence"]
    assert len(dev) == 7 and len(seq_dev) == 3
    for r in seq_dev + dev:
        row = (f"| {r['method']} | {' '.join(r['settings'])} | {r['greedy']['after']['correct']}/200 | "
               f"{change(r):+.1f} | {r['nonzero_gradient_steps']}/50 | {_lines_cells(r)} | {r['generated_tokens']:,} | "
               f"{r['step_seconds']:.0f} |")
        assert row in rows, row
    best = max(dev, key=lambda r: r["greedy"]["after"]["correct"])
    assert {credit_methods.variant(r) for r in held} == {credit_methods.variant(best)}  # chosen on dev
    assert sorted(r["seed"] for r in held) == list(range(6))
    diffs = []
    for r in held:
        diffs.append(change(r) - change(sequence[r["seed"]]))
        row = (f"| {r['seed']} | {r['greedy']['before']['correct']}/200 -> {r['greedy']['after']['correct']}/200 | "
               f"{change(r):+.1f} | {diffs[-1]:+.1f} | {r['nonzero_gradient_steps']}/{r['steps']} | "
               f"{_lines_cells(r)} | {r['generated_tokens']:,} | {r['step_seconds']:.0f} |")
        assert row in rows, row
    above, below = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    p = f"{T.mcnemar_exact_p(above, below):.2g}"
    docs = " ".join(text.split())
    assert (f"mean difference {statistics.mean(diffs):+.1f} points (sd {statistics.stdev(diffs):.1f}); above it at "
            f"{above} seed{'s' * (above != 1)}, below at {below}: sign test p = {p}") in docs
    assert (f"ends {-statistics.mean(diffs):.1f} points below it (six seeds, sd {statistics.stdev(diffs):.1f}, "
            f"p = {p})") in " ".join((ROOT / "README.md").read_text().split())
    def sampled(rs):
        after = [100 * r["sampled"]["after"] for r in rs]
        return (f"{', '.join(str(r['seed']) for r in rs)} | {', '.join(f'{x:.1f}' for x in after)} | "
                f"{statistics.mean(after):.1f} |")
    assert f"| steps_chain | {sampled(held)}" in rows
    assert f"| sequence | {sampled([sequence[s] for s in range(6)])}" in rows
    assert all(r["sampled"]["before"] == sequence[r["seed"]]["sampled"]["before"] for r in held)


def test_the_sum5_table_in_the_docs_is_the_committed_record():
    """docs/variants.md's sum5 rows (the spec's credit and the chosen steps credit at three seeds each, the spec's
    credit at 97 problems, steps_chain's seconds, at seeds 0 and 1) are benchmarks/credit62_heldout.json's: greedy before ->
    after, change, McNemar p, sampled pass@1, steps with a gradient, the line figures, tokens and step seconds; the
    mean changes in the sentence under them; and 97 = 50 x steps_chain's mean step seconds / the spec's credit's."""
    record = [r for r in json.loads((ROOT / "benchmarks" / "credit62_heldout.json").read_text()) if r["task"] == "sum5"]
    text = (ROOT / "docs" / "variants.md").read_text().split("### Measured: credit from checked steps")[1]
    rows = set(text.split("\n### ")[0].splitlines())
    runs = {}
    for r in record:
        runs.setdefault(credit_methods.variant(r), []).append(r)
        b, a, s = r["greedy"]["before"], r["greedy"]["after"], r.get("sampled")
        sampled = f"{100 * s['before']:.1f} % -> {100 * s['after']:.1f} %" if s else "-"
        row = (f"| {credit_methods.variant(r)} | {r['seed']} | {b['correct']}/200 -> {a['correct']}/200 | "
               f"{100 * (a['accuracy'] - b['accuracy']):+.1f} | {r['paired']['mcnemar_p']:.2g} | {sampled} | "
               f"{r['nonzero_gradient_steps']}/{r['steps']} | {_lines_cells(r)} | {r['generated_tokens']:,} | "
               f"{r['step_seconds']:.0f} |")
        assert row in rows, row
    steps, spec = runs["steps_chain learning_rate=1e-5"], runs["sequence"]
    assert sorted(runs) == ["sequence", "sequence num_problems=97", "steps_chain learning_rate=1e-5"]
    assert [sorted(r["seed"] for r in rs) for rs in (spec, steps)] == [[0, 1, 2], [0, 1, 2]]
    n = round(50 * statistics.mean(r["step_seconds"] for r in steps) / statistics.mean(r["step_seconds"] for r in spec))
    assert n == 97 and [(r["seed"], r["steps"]) for r in runs["sequence num_problems=97"]] == [(0, 97), (1, 97)]
    mean = {name: statistics.mean(credit_methods.points(r) for r in rs)
            for name, rs in (("spec", spec), ("steps", steps))}
    assert (f"the spec's credit {mean['spec']:+.1f} points on average, `steps_chain` "
            f"{mean['steps']:+.1f}") in " ".join(text.split())


@pytest.mark.parametrize("modes", [["--summary", "--add-lines"], ["--summary", "--pictures"],
                                   ["--add-lines", "--operands"], ["--masks", "--add-sampled", "--errors"]])
def test_two_modes_in_one_call_are_one_line_and_exit_2(modes, tmp_path, monkeypatch, capsys):
    """Each mode does its one thing and stops: two given together (the second was ignored, exit 0) are refused
    before anything is read or written, naming the first two in the order of MODES."""
    out = tmp_path / "credit"
    out.mkdir()
    (out / "results.json").write_text("[]")
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--out", str(out), *modes)
    assert e.value.code == 2
    first, second = sorted(modes, key=lambda m: credit_methods.MODES.index(m[2:].replace("-", "_")))[:2]
    assert one_line_error(capsys) == (f"error: {first} and {second} are two modes, and each does its one thing and "
                                      "stops; pass one, and the other in a call of its own")
    assert (out / "results.json").read_text() == "[]"


@pytest.mark.parametrize("damage, why", [
    ("no metrics", "{run} has no metrics.jsonl (a finished run has one)"),
    ("empty metrics", "{run}/metrics.jsonl holds no record: the file is damaged"),
    ("cut metrics", "{run}/metrics.jsonl line 3 is not a JSON record (Unterminated string starting at, column 158): "
                    "the file is damaged"),
    ("no lines_right", "{run}/metrics.jsonl line 2 is not a record rlvr writes (it lacks lines_right): the file is "
                       "damaged"),
    ("no group's correct", "{run}/metrics.jsonl line 1 is not a record rlvr writes (a group without its problem_index "
                           "or correct): the file is damaged"),
    ("no rollouts", "{run} has no rollouts.jsonl (a finished run has one)"),
    ("rollouts not objects", "{run}/rollouts.jsonl line 1 is not a record rlvr writes (not an object): the file is "
                             "damaged"),
])
def test_add_lines_on_a_run_with_a_missing_or_damaged_file_is_one_line_and_exit_2(damage, why, tmp_path, monkeypatch,
                                                                                 capsys):
    """--add-lines reads each run's metrics.jsonl and rollouts.jsonl (_three_steps'): one missing, empty, cut short,
    or without a figure it reads is one line naming the file and the line, and exit 2 (a traceback before), said
    before results.json is rewritten or a line printed: the first run, whole, is not added or said either."""
    out = tmp_path / "credit"
    grid = json.loads((ROOT / "benchmarks" / "credit_methods.json").read_text())[:2]
    for r, seed in zip(grid, [0, 1]):
        r.update(method="steps", settings=[], seed=seed, task="sum4")
    _steps_run(credit_methods.run_folder(out, "sum4", "steps", 0), _three_steps())
    run = credit_methods.run_folder(out, "sum4", "steps", 1)
    _steps_run(run, _three_steps())
    metrics, rollouts = run / "metrics.jsonl", run / "rollouts.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    if damage == "no metrics":
        metrics.unlink()
    elif damage == "empty metrics":
        metrics.write_text("")
    elif damage == "cut metrics":  # a write cut short
        metrics.write_text(metrics.read_text()[:-40])
    elif damage == "no lines_right":
        del records[1]["lines_right"]
    elif damage == "no group's correct":  # a P = 2 record's group without its correct
        records[0]["groups"] = [{"problem_index": 0, "group_size": 2}]
    elif damage == "no rollouts":
        rollouts.unlink()
    else:
        rollouts.write_text("[1]\n")
    if damage in ("no lines_right", "no group's correct"):
        metrics.write_text("".join(json.dumps(m) + "\n" for m in records))
    (out / "results.json").write_text(json.dumps(grid))
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--out", str(out), "--add-lines")
    assert e.value.code == 2
    said = capsys.readouterr()
    assert (said.out, said.err) == ("", f"error: {why.format(run=run)}; run it again, or move {run} out of --out\n")
    assert json.loads((out / "results.json").read_text()) == grid


def _sum_run(out, problems, answers, name="sum3-steps-seed0"):
    """A finished sum run's folder: run_config.yaml naming problems (a file), and eval.jsonl's answers (phase,
    problem_index, response)."""
    run = out / name
    run.mkdir(parents=True)
    (run / "run_config.yaml").write_text(f"eval_dataset: {problems}\n")
    (run / "eval.jsonl").write_text("".join(json.dumps({"phase": ph, "problem_index": i, "response": text}) + "\n"
                                            for ph, i, text in answers))
    return run


def _tokenizer_model(tmp_path):
    from tiny_models import build_tiny_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    build_tiny_tokenizer(model)
    return model


def test_operands_counts_a_line_the_arithmetic_checker_cannot_read_as_no_right_sum(tmp_path):
    """"23 + 4 + 7" answered "23 plus 4 is 27 / 27 + 7 = 34": the first chain line the arithmetic checker cannot read
    (unknown, None) and the chain checker calls wrong: no right sum, and no right sum of wrong numbers; the second
    right both ways. 2 chain lines, arithmetic right 1, chain right 1, right sums of wrong numbers 0."""
    problems = tmp_path / "sum3-dev.json"
    problems.write_text(json.dumps([{"problem": "23 + 4 + 7", "answer": "34"}]))
    run = _sum_run(tmp_path / "credit", problems, [("after", 0, "23 plus 4 is 27\n27 + 7 = 34\n\\boxed{34}")])
    assert credit_methods.operand_lines(run) == {
        "after": {"chain_lines": 2, "arithmetic_right": 1, "chain_right": 1, "right_sum_wrong_numbers": 0}}


def test_operands_on_a_folder_without_a_sum_run_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """--operands on an empty folder, then on one whose only run answered problems that are not sums (one holding
    " + " among words: read as no sum, not as a traceback from the chain checker's int()), said in one line, exit 2
    (it printed nothing and exited 0)."""
    model, out = _tokenizer_model(tmp_path), tmp_path / "credit"
    out.mkdir()
    message = (f"error: {out} holds no finished sum run (a folder with eval.jsonl and run_config.yaml whose "
               "eval_dataset holds sums); pass --out the folder a run of this script wrote (runs/credit by default)")
    for run in (None, "math-sequence-seed0"):
        if run:
            problems = tmp_path / "math.json"
            problems.write_text(json.dumps([{"problem": "What is $2 + 3$ times 4?", "answer": "20"}]))
            _sum_run(out, problems, [("after", 0, "2 + 3 = 5\n5 * 4 = 20\n\\boxed{20}")], name=run)
            assert credit_methods.operand_lines(out / run) is None
        with pytest.raises(SystemExit) as e:
            _main(monkeypatch, "--model", str(model), "--out", str(out), "--operands")
        assert e.value.code == 2
        assert one_line_error(capsys) == message


@pytest.mark.parametrize("damage, why", [
    ("yaml", "{run}/run_config.yaml is not YAML (expected the node content, but found '<stream end>', line 2): the "
             "file is damaged; run it again, or move {run} out of --out"),
    ("no eval_dataset", "{run}/run_config.yaml names no eval_dataset (the problems of its answers); run it again, or "
                        "move {run} out of --out"),
    ("no problem file", "sum3-steps-seed0's eval_dataset {tmp}/gone.json is no file here; put the problems the run "
                        "evaluated there (python examples/make_smollm2.py writes them), or move {run} out of --out"),
    ("index", "{run}/eval.jsonl line 2: problem_index 2 is not one of the 2 problems of {tmp}/sum3-dev.json, its "
              "eval_dataset; put the problems the run evaluated there, or move {run} out of --out"),
    ("eval.jsonl", "{run}/eval.jsonl line 1 is not a record rlvr writes (it lacks response): the file is damaged; run "
                   "it again, or move {run} out of --out"),
])
def test_operands_on_a_damaged_run_is_one_line_and_exit_2_before_a_line_is_printed(damage, why, tmp_path,
                                                                                   monkeypatch, capsys):
    """Two sum runs, the second damaged: its run_config.yaml cut short, naming no eval_dataset or a file not there,
    an answer counting past its problems, an answer without its response. One line naming the file, exit 2 (a
    traceback before), and the first run's line is not printed either: every run is read first."""
    model, out = _tokenizer_model(tmp_path), tmp_path / "credit"
    problems = tmp_path / "sum3-dev.json"
    problems.write_text(json.dumps([{"problem": "23 + 4 + 7", "answer": "34"}, {"problem": "10 + 5 + 1"}]))
    answers = [("after", 0, "23 + 4 = 27\n27 + 7 = 34\n\\boxed{34}"), ("after", 1, "10 + 5 = 15\n\\boxed{15}")]
    _sum_run(out, problems, answers, name="sum3-sequence-seed0")
    run = _sum_run(out, problems, answers)
    if damage == "yaml":
        (run / "run_config.yaml").write_text(f"eval_dataset: {problems}\nsettings: {{seed: 0,")
    elif damage == "no eval_dataset":
        (run / "run_config.yaml").write_text("seed: 0\n")
    elif damage == "no problem file":
        (run / "run_config.yaml").write_text(f"eval_dataset: {tmp_path / 'gone.json'}\n")
    elif damage == "index":
        text = (run / "eval.jsonl").read_text()
        (run / "eval.jsonl").write_text(text.replace('"problem_index": 1', '"problem_index": 2'))
    else:
        (run / "eval.jsonl").write_text((run / "eval.jsonl").read_text().replace('"response"', '"answer"'))
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--model", str(model), "--out", str(out), "--operands")
    assert e.value.code == 2
    said = capsys.readouterr()
    assert (said.out, said.err) == ("", "error: " + why.format(run=run, tmp=tmp_path) + "\n")


@pytest.mark.parametrize("mode", ["--pictures", "--errors", "--masks", "--siblings"])
@pytest.mark.parametrize("text, why", [
    ('{"step": 1, "problem_index": 0, "rollout": 0, "response": "23 + 4', "line 2 is not a JSON record (Unterminated "
                                                                          "string starting at, column 59)"),
    ('{"step": 2}', "line 2 is not a record rlvr writes (it lacks problem_index)"),
])
def test_the_modes_that_read_rollouts_say_a_damaged_one_in_one_line_before_the_first_run_is_read(
        mode, text, why, tmp_path, monkeypatch, capsys):
    """Two runs, the second's rollouts.jsonl cut short at its second line or holding a record without its fields:
    one line naming the file and the line, exit 2 (a traceback before), before the tokenizer loads or the first run
    is drawn or counted."""
    model, out = _tokenizer_model(tmp_path), tmp_path / "credit"
    (model / "sum3-train.json").write_text(json.dumps([{"problem": "23 + 4 + 5", "answer": "32"}]))
    _steps_run(out / "sum3-steps-seed0", _three_steps())
    _steps_run(out / "sum3-steps-seed1", _three_steps())
    rollouts = out / "sum3-steps-seed1" / "rollouts.jsonl"
    rollouts.write_text(rollouts.read_text().splitlines()[0] + "\n" + text + "\n")
    for name in ("group_picture", "error_credit", "mask_kinds", "tree_siblings"):
        monkeypatch.setattr(credit_methods, name, lambda *a: pytest.fail("a run read before the check"))
    import transformers
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a: pytest.fail("loaded before"))
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--model", str(model), "--out", str(out), mode)
    assert e.value.code == 2
    assert one_line_error(capsys) == (f"error: {rollouts} {why}: the file is damaged; run it again, or move "
                                      f"{rollouts.parent} out of --out")


def test_the_gsm8k_dev_table_in_the_docs_is_the_committed_record():
    """docs/variants.md's GSM8K section is benchmarks/gsm8k_dev.json: each dev run a row (greedy before -> after on
    100 dev problems, change, McNemar p with the improved / regressed problems, steps with a gradient, the steps
    run's all-wrong groups with a gradient, tokens, step seconds) and the steps run's line figures in the text."""
    record = json.loads((ROOT / "benchmarks" / "gsm8k_dev.json").read_text())["runs"]
    text = (ROOT / "docs" / "variants.md").read_text().split("### Measured: checked steps on GSM8K")[1]
    text = text.split("\n### ")[0]
    rows = set(text.splitlines())
    assert sorted((r["method"], r["settings"][0]) for r in record) == [
        ("sequence", "learning_rate=1e-5"), ("sequence", "learning_rate=3e-6"), ("steps_grounded", "learning_rate=3e-6")]
    for r in record:
        b, a, p, lines = r["greedy"]["before"], r["greedy"]["after"], r["paired"], r.get("lines")
        assert (lines is None) is (r["method"] == "sequence") and b["n"] == a["n"] == 100
        groups = "-" if lines is None else f"{lines['all_wrong_groups_with_gradient']}/{lines['all_wrong_groups']}"
        row = (f"| {r['method']} | {r['settings'][0]} | {b['correct']}/100 -> {a['correct']}/100 | "
               f"{100 * (a['accuracy'] - b['accuracy']):+.1f} | {p['mcnemar_p']:.2g} ({p['improved']} / "
               f"{p['regressed']}) | {r['nonzero_gradient_steps']}/{r['steps']} | "
               f"{groups} | "
               f"{r['generated_tokens']:,} | {r['step_seconds']:.0f} |")
        assert row in rows, row
    lines = next(r["lines"] for r in record if r.get("lines"))
    first, last = lines["first"], lines["last"]
    assert (f"rose from {100 * first['right_share']:.1f} % over the first 10 steps to {100 * last['right_share']:.1f} "
            f"% over the last 10, and the checked lines per response from {first['checked_per_response']:.2f} to "
            f"{last['checked_per_response']:.2f}; the responses with no checked line fell from "
            f"{100 * first['responses_unchecked']:.1f} % to {100 * last['responses_unchecked']:.1f} %") in " ".join(
        text.split())
