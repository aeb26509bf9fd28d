"""The data sets and rewards users bring: the reference read from a worked solution (GSM8K's '####',
MATH's last \\boxed{}), a hub set's configuration name, a local copy of a hub set in its folder layout,
and a reward function of the user's own (worked numbers, a hang, an exception, a string). The data are
local stand-ins in each set's exact schema, written here; nothing is downloaded. CPU, tiny local model."""

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import train_rlvr as T
import verifier
from conftest import ROOT
from run_helpers import main_args, one_line_error

# GSM8K's schema: `question`, and `answer` a worked solution ending "#### N" (the first of these two also
# holds an earlier "####": the reference is the text after the LAST one)
GSM8K = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
          "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n#### 3 tries\n48+24 = <<48+24=72>>72\n#### 72"},
         {"question": "Weng earns $12 an hour. How much for 50 minutes?",
          "answer": "12/60 = $<<12/60=0.2>>0.2 per minute.\n0.2 x 50 = $<<0.2*50=10>>10\n#### 10"},
         {"question": "A third problem", "answer": "#### 5"}]
# MATH's original schema: `problem`, `level`, `type`, and `solution` whose last \boxed{} is the answer
MATH = [{"problem": "What is $\\frac12 + \\frac12$?", "level": "Level 1", "type": "Algebra",
         "solution": "We have $\\boxed{\\frac12}$ twice, so the sum is $\\boxed{1}$."},
        {"problem": "What is 3 + 4?", "level": "Level 1", "type": "Prealgebra",
         "solution": "Adding, $3 + 4 = \\boxed{7}$."}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ----------------------------------------------------------------------------------------------
# The reference answer as the set writes it


def test_reference_answer_reads_each_form():
    gsm = GSM8K[0]["answer"]
    assert T.reference_answer(gsm, "gsm8k") == ("72", "gsm8k")  # the LAST '####', not "3 tries"
    assert T.reference_answer(gsm, "auto") == ("72", "gsm8k")
    assert T.reference_answer("#### 1,000 \n", "gsm8k") == ("1,000", "gsm8k")
    assert T.reference_answer(MATH[0]["solution"], "boxed") == ("1", "boxed")  # the last box
    assert T.reference_answer(MATH[0]["solution"], "auto") == ("1", "boxed")
    assert T.reference_answer("so the sum is $\\fbox{12}$.", "auto") == ("12", "boxed")  # \fbox is a box too
    assert T.reference_answer("\\frac{3}{4}", "auto") == ("\\frac{3}{4}", "plain")  # a short answer, as today
    assert T.reference_answer(72, "auto") == ("72", "plain")
    assert T.reference_answer(gsm, "plain") == (gsm, "plain")
    for value, form in [("72", "gsm8k"), ("x ####  ", "gsm8k"), ("72", "boxed"), ("\\boxed{}", "boxed")]:
        assert T.reference_answer(value, form)[0] is None, (value, form)
    # the verifier scores a boxed 72 against what the set's answer field holds only once it is read
    assert verifier.reward("so \\boxed{72}", gsm) == 0.0
    assert verifier.reward("so \\boxed{72}", T.reference_answer(gsm, "auto")[0]) == 1.0


# ----------------------------------------------------------------------------------------------
# Runs on each schema: the decode loop runs, the sampled tokens are replaced by a script, so that the real
# verifier (and the reward function) sees known responses: rollout 0 boxes the reference, rollout 1 a wrong
# number, rollouts 2 and 3 have no box.


@pytest.fixture()
def scripted(monkeypatch, tiny_model_dir):
    """Make each group's 4 responses the script's for that step's reference (in the order they are drawn)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    references = []

    def texts(reference):
        return [f"\\boxed{{{reference}}}", "\\boxed{9}", "no", "none"]

    def sampling_pick(streams, temperature, top_p, device):
        script = [tok(x, add_special_tokens=False)["input_ids"] + [0] for x in texts(references.pop(0))]
        at = {"t": 0}

        def pick(logits, rows=None):
            t, at["t"] = at["t"], at["t"] + 1
            rows = range(len(script)) if rows is None else rows
            return torch.tensor([script[r][t] if t < len(script[r]) else 0 for r in rows])
        return pick
    monkeypatch.setattr(T, "sampling_pick", sampling_pick)
    return references


def run(args, capsys=None):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = T.main(args)
    return code, out.getvalue(), err.getvalue()


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("schema", ["gsm8k", "math"])
def test_two_steps_on_each_schema_score_the_reference(schema, scripted, tmp_path, tiny_model_dir):
    if schema == "gsm8k":
        data, fields = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), ["problem_field=question"]
        references = ["72", "10"]
        settings, said = ["answer_format=gsm8k"], "dataset answers (answer_format gsm8k): text after the last '####'"
    else:
        data, fields, references = write_jsonl(tmp_path / "math.jsonl", MATH), ["answer_field=solution"], ["1", "7"]
        settings, said = [], "dataset answers (answer_format auto): last \\boxed{}"
    scripted.extend(references)
    code, _, err = run(main_args(tiny_model_dir, data, tmp_path / "out", "num_problems=2", "max_new_tokens=16",
                                 "save_every=0", *fields, *settings))
    assert code == 0, err
    assert f"{said} in 2 of 2 records" in err
    rollouts = read_lines(tmp_path / "out" / "rollouts.jsonl")
    assert [r["reward"] for r in rollouts] == [1.0, 0.0, 0.0, 0.0] * 2
    assert [r["status"] for r in rollouts] == ["correct", "wrong", "no_answer", "no_answer"] * 2
    assert [r["reference"] for r in rollouts] == [references[0]] * 4 + [references[1]] * 4
    assert all(m["grad_norm"] > 0 for m in read_lines(tmp_path / "out" / "metrics.jsonl"))


def test_the_evaluation_reads_its_own_answer_format(tmp_path, tiny_model_dir, tiny_data_file):
    data = write_jsonl(tmp_path / "gsm8k-test.jsonl", GSM8K)
    code, _, err = run(main_args(tiny_model_dir, tiny_data_file, tmp_path / "out", "num_problems=0",
                                 f"eval_dataset={data}", "eval_problems=3", "eval_max_new_tokens=4",
                                 "problem_field=question", "eval_answer_format=gsm8k"))
    assert code == 0, err
    assert "eval_dataset answers (eval_answer_format gsm8k): text after the last '####' in 3 of 3 records" in err
    assert [r["reference"] for r in read_lines(tmp_path / "out" / "eval.jsonl")] == ["72", "10", "5"]


def test_a_reference_that_cannot_be_read_follows_bad_records(tmp_path, capsys, tiny_model_dir):
    data = write_jsonl(tmp_path / "mixed.jsonl", [GSM8K[0], {"question": "q", "answer": "no marker here"}, GSM8K[1]])
    args = main_args(tiny_model_dir, data, tmp_path / "out", "num_problems=2", "problem_field=question",
                     "answer_format=gsm8k", "save_every=0")
    assert T.main(args) == 2
    one_line_error(capsys, "dataset record 1: 'answer' has no text after the last '####' to read the reference from "
                           "(answer_format gsm8k: 'no marker here'); fix the data, move start_index, or set "
                           "bad_records: skip")
    code, _, err = run([*args, "bad_records=skip"])
    assert code == 0, err
    assert "skipping dataset record 1" in err
    assert "text after the last '####' in 1 of 1 records" in err


# ----------------------------------------------------------------------------------------------
# A hub set's configuration


def write_configured_copy(folder):
    """A local copy of a hub set with two configurations, in the hub's layout: parquet files per config and a
    README.md whose metadata names them (as openai/gsm8k's does: main and socratic)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for config, records in (("main", GSM8K), ("socratic", GSM8K[:1])):
        (folder / config).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(records), folder / config / "train-00000-of-00001.parquet")
    (folder / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n" for c in ("main", "socratic"))
        + "---\n")
    return folder


def test_a_configured_copy_loads_by_its_config_name(tmp_path, capsys, scripted, tiny_model_dir):
    copy = write_configured_copy(tmp_path / "gsm8k-copy")
    args = main_args(tiny_model_dir, copy, tmp_path / "out", "num_problems=1", "max_new_tokens=16",
                     "problem_field=question", "save_every=0")
    assert T.main(args) == 2
    one_line_error(capsys, f"dataset {copy} has several configurations, ['main', 'socratic'], and no default; "
                           "set dataset_config to one of them")
    assert T.main([*args, "dataset_config=mian"]) == 2
    one_line_error(capsys, "and none is called 'mian'; set dataset_config to one of them")
    scripted.append("72")
    code, _, err = run([*args, "dataset_config=main"])
    assert code == 0, err
    assert [r["reward"] for r in read_lines(tmp_path / "out" / "rollouts.jsonl")] == [1.0, 0.0, 0.0, 0.0]
    assert T.main([*args, f"dataset={tmp_path / 'out' / 'rollouts.jsonl'}", "dataset_config=main",
                   f"output_dir={tmp_path / 'other'}"]) == 2
    one_line_error(capsys, "dataset_config 'main' names a configuration of a hub set, and dataset "
                           f"{tmp_path / 'out' / 'rollouts.jsonl'} is a file, which has none; "
                           "set dataset_config to empty")


def test_the_config_name_reaches_load_dataset(monkeypatch):
    import datasets

    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(GSM8K)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    fields = {"problem_field": "question", "answer_field": "answer"}
    records = T.load_records("someorg/gsm8k-like", "train", fields, 0, 2, config="main")
    assert calls == [("someorg/gsm8k-like", "main", "train")]
    assert [r["answer"] for r in records] == [GSM8K[0]["answer"], GSM8K[1]["answer"]]
    T.load_records("someorg/gsm8k-like", "test", fields, 0, 1, setting="eval_dataset")
    assert calls[-1] == ("someorg/gsm8k-like", None, "test")


def test_the_eval_config_name_reaches_load_dataset(monkeypatch):
    """examples/gsm8k.yaml evaluates on openai/gsm8k's `main`: without its name the hub refuses the set."""
    import datasets

    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(GSM8K)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = T.Config(eval_dataset="someorg/gsm8k-like", eval_split="test", eval_dataset_config="main",
                   eval_problems=2, problem_field="question", answer_field="answer")
    problems = T.load_eval_problems(cfg)
    assert calls == [("someorg/gsm8k-like", "main", "test")]
    assert [p["answer"] for p in problems] == [GSM8K[0]["answer"], GSM8K[1]["answer"]]


# ----------------------------------------------------------------------------------------------
# A reward function of the user's own

REWARDS = """
import time

def worked(response, answer, record):
    return 0.5 if answer in response else record["weight"]

def hangs_on_none(response, answer, record):
    while response == "none":
        time.sleep(0.01)
    return 1.0 if response == "no" else 0.0

def raises_on_none(response, answer, record):
    if response == "none":
        raise KeyError("none")
    return 1.0 if response == "no" else 0.0

def hangs(response, answer, record):
    while True:
        time.sleep(0.01)

def raises(response, answer, record):
    return record["missing"]

def text(response, answer, record):
    return "one"

def one_argument(response):
    return 1.0

def huge(response, answer, record):
    return 1e39 if answer in response else 0.0

def nan_on_none(response, answer, record):
    return float("nan") if response == "none" else 1.0 if answer in response else 0.0

calls = [0]

def fails_after_trial(response, answer, record):
    calls[0] += 1
    if calls[0] > 1:
        raise KeyError("later")
    return 1.0
"""


@pytest.fixture()
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def math_run(tmp_path, tiny_model_dir, *extra):
    records = [dict(r, weight=0.25) for r in MATH]
    return main_args(tiny_model_dir, write_jsonl(tmp_path / "math.jsonl", records), tmp_path / "out",
                     "num_problems=2", "max_new_tokens=16", "answer_field=solution", "save_every=0",
                     "overwrite=true", *extra)


def test_a_reward_function_with_weights_gives_its_worked_rewards(tmp_path, scripted, tiny_model_dir, rewards_file):
    # rollout 0 boxes the reference (verifier 1, the function 0.5); the others score the record's weight 0.25:
    # "1,2" gives 1 + 2 * 0.5 = 2.0 and 0 + 2 * 0.25 = 0.5; mean 0.875, sample std 0.75,
    # A_0 = 1.125 / (0.75 + 1e-4) = 1.49980, the others -0.375 / 0.7501 = -0.49993
    scripted.extend(["1", "7"])
    code, out, err = run(math_run(tmp_path, tiny_model_dir, f"reward_function={rewards_file}:worked",
                                  "reward_weights=1,2"))
    assert code == 0, err
    rollouts = read_lines(tmp_path / "out" / "rollouts.jsonl")
    assert [r["reward"] for r in rollouts] == [2.0, 0.5, 0.5, 0.5] * 2
    assert [r["status"] for r in rollouts] == ["correct", "wrong", "no_answer", "no_answer"] * 2  # the verifier's
    assert [r["advantage"] for r in rollouts[:4]] == pytest.approx([1.49980, -0.49993, -0.49993, -0.49993], abs=1e-5)
    # correct/4 counts the verifier's verdicts (rollout 0's), whatever the weighed reward (2.0) is
    assert [m["correct"] for m in read_lines(tmp_path / "out" / "metrics.jsonl")] == [1, 1]
    assert "correct rollouts        2/8 (mean reward 0.2500)" in out
    # without weights: the function alone
    scripted.extend(["1", "7"])
    code, _, err = run(math_run(tmp_path, tiny_model_dir, f"reward_function={rewards_file}:worked"))
    assert code == 0, err
    assert [r["reward"] for r in read_lines(tmp_path / "out" / "rollouts.jsonl")] == [0.5, 0.25, 0.25, 0.25] * 2


@pytest.mark.parametrize("name, status, counted, why", [
    ("hangs_on_none", "timeout", "verifier_timeouts", "no result within 0.5 s"),
    ("raises_on_none", "crash", "verifier_crashes", "KeyError: 'none'"),
    ("nan_on_none", "crash", "verifier_crashes", "ValueError: it returned nan, not a finite number"),
])
def test_a_hang_or_failure_during_the_run_scores_0_and_is_counted(name, status, counted, why, tmp_path, scripted,
                                                                  tiny_model_dir, rewards_file):
    """The failure's reason is said once a run (stderr) and kept with each failed rollout; a NaN is a failure
    (reward 0), never a NaN advantage."""
    scripted.extend(["1", "7"])
    code, _, err = run(math_run(tmp_path, tiny_model_dir, f"reward_function={rewards_file}:{name}",
                                "verifier_timeout=0.5"))
    assert code == 0, err
    rollouts = read_lines(tmp_path / "out" / "rollouts.jsonl")
    right = 1.0 if name == "nan_on_none" else 0.0  # nan_on_none gives the reference's box 1, the others 0
    assert [(r["reward"], r["status"]) for r in rollouts] == [
        (right, "correct"), (0.0, "wrong"), (1.0 - right, "no_answer"), (0.0, status)] * 2
    assert [r.get("error") for r in rollouts] == [None, None, None, why] * 2
    assert all(math.isfinite(r["advantage"]) for r in rollouts)
    metrics = read_lines(tmp_path / "out" / "metrics.jsonl")
    assert [m[counted] for m in metrics] == [1, 1]
    said = [line for line in err.splitlines() if "failed on rollout" in line]
    assert said == [f"warning: step 1: reward_function {rewards_file}:{name} failed on rollout 3: {why} (scored 0; "
                    "said once a run, each failure is counted: metrics.jsonl's verifier_crashes and "
                    "verifier_timeouts, the summary's verifier overruns, rollouts.jsonl's error)"]


def test_a_reward_function_that_fails_on_every_rollout_of_a_step_stops_the_run(tmp_path, capsys, scripted,
                                                                                tiny_model_dir, rewards_file):
    """It passed the trial call and raises on every rollout after: with bad_records stop the run stops at step 1
    with the error's text, exit 2; with skip it trains on (every reward 0) and says so at each such step."""
    scripted.extend(["1", "7"])
    args = math_run(tmp_path, tiny_model_dir, f"reward_function={rewards_file}:fails_after_trial")
    assert T.main(args) == 2
    err = capsys.readouterr().err
    assert (f"step 1: reward_function {rewards_file}:fails_after_trial failed on all 4 rollouts (the first: "
            "KeyError: 'later'); fix it, or set bad_records: skip to train on with their rewards 0; no step "
            "completed. To continue:") in err
    assert "Traceback" not in err and read_lines(tmp_path / "out" / "metrics.jsonl") == []
    scripted[:] = ["1", "7"]
    code, _, err = run([*args, "bad_records=skip"])
    assert code == 0, err
    assert [r["error"] for r in read_lines(tmp_path / "out" / "rollouts.jsonl")] == ["KeyError: 'later'"] * 8
    assert err.count("failed on rollout 0: KeyError: 'later'") == 1
    assert err.count("failed on all 4 rollouts (bad_records: skip): their rewards are 0") == 2


@pytest.mark.parametrize("name, weights, value, source", [
    ("huge", "", "1e+39", "reward_function {file}:huge"),
    ("worked", "1e300,1", "1e+300", "reward_function {file}:worked with reward_weights '1e300,1'"),
])
def test_a_reward_too_large_for_float32_stops_the_run_naming_it(name, weights, value, source, tmp_path, capsys,
                                                                scripted, tiny_model_dir, rewards_file):
    """1e39 (finite, so the trial call takes it) becomes inf in the group's float32 rewards, and 1e300 * the
    verifier's 1: no inf or nan row, and no blame on the learning rate: the step stops, exit 2."""
    scripted.extend(["1", "7"])
    args = math_run(tmp_path, tiny_model_dir, f"reward_function={rewards_file}:{name}", f"reward_weights={weights}")
    assert T.main(args) == 2
    out, err = capsys.readouterr()
    assert (f"step 1: rollout 0's reward {value} ({source.format(file=rewards_file)}) is too large for the "
            "group's float32 mean and sample std") in err
    assert "inf" not in out and "nan" not in out and "Traceback" not in err
    assert read_lines(tmp_path / "out" / "metrics.jsonl") == []


def test_rewards_whose_sample_std_overflows_float32_stop_the_step():
    """+-3e38 are float32 numbers and their mean is 0, but their sample std (3.46e38) is not one: the step stops
    naming the largest reward, before an inf could reach the advantages."""
    values = [3e38, -3e38, 3e38, -3e38]
    rewards = torch.tensor(values)
    assert torch.isfinite(rewards).all() and rewards.mean() == 0 and rewards.std() == float("inf")
    t = SimpleNamespace(cfg=T.Config(reward_function="r.py:score"), warned=set())
    with pytest.raises(T.StopRun, match=r"step 3: rollout 0's reward 3e\+38 \(reward_function r.py:score\) is too "
                                        r"large for the group's float32 mean and sample std"):
        T.check_rewards(3, values, rewards, [T.Score(v, None, "wrong") for v in values], t)
    held = [3e38, -3e38, 0.0, 0.0]  # sample std 2.45e38: float32 holds it
    T.check_rewards(3, held, torch.tensor(held), [T.Score(v, None, "wrong") for v in held], t)


@pytest.mark.parametrize("name, why", [
    ("hangs", "did not return within verifier_timeout 0.5 s (a trial call on dataset record 0)"),
    ("raises", "failed: KeyError: 'missing' (a trial call on dataset record 0)"),
    ("text", "failed: TypeError: it returned str 'one', not a number"),
    ("one_argument", "failed: TypeError: one_argument(response) cannot be called as one_argument(response, answer, "
                     "record)"),
    ("absent", "has no function 'absent'"),
])
def test_a_reward_function_that_cannot_serve_is_one_line_before_step_1(name, why, tmp_path, capsys, tiny_model_dir,
                                                                        rewards_file):
    args = math_run(tmp_path, tiny_model_dir, f"reward_function={rewards_file}:{name}", "verifier_timeout=0.5")
    assert T.main(args) == 2
    one_line_error(capsys, f"reward_function {rewards_file}:{name} {why}" if name != "absent" else why,
                   "it is called as name(response: str, answer: str, record: dict) and returns a number")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # nothing written before the trial


@pytest.mark.parametrize("setting, message", [
    ("reward_function=rewards.py", "'reward_function' must be path/to/file.py:function_name"),
    ("reward_function={missing}:worked", "'reward_function' must be an existing file: {missing} is not one"),
    ("reward_weights=1,2", "'reward_weights' must be empty without a reward_function"),
    ("reward_function={file}:worked reward_weights=1", "'reward_weights' must be empty (the function alone) or two "
                                                      "finite numbers 'v,f'"),
    ("reward_function={file}:worked reward_weights=a,b", "'reward_weights' must be empty (the function alone)"),
    ("reward_function={file}:worked reward_weights=0,0", "'reward_weights' must be empty (the function alone) or two "
                                                        "finite numbers 'v,f', not both 0"),
    ("answer_format=json", "'answer_format' must be one of auto, plain, gsm8k, boxed, got 'json'"),
    ("eval_answer_format=hash", "'eval_answer_format' must be one of auto, plain, gsm8k, boxed"),
])
def test_bad_settings_are_one_line(setting, message, tmp_path, capsys, rewards_file):
    missing = tmp_path / "nope.py"
    fill = {"missing": missing, "file": rewards_file}
    assert T.main(["--config", str(ROOT / "config.yaml"), *setting.format(**fill).split()]) == 2
    one_line_error(capsys, message.format(**fill))


# ----------------------------------------------------------------------------------------------
# The presets, with local stand-ins of their sets (the same schemas) in place of the hub's


@pytest.mark.parametrize("preset", ["gsm8k", "math_solutions"])
def test_each_preset_runs_two_steps_on_its_schema(preset, scripted, tmp_path, tiny_model_dir):
    if preset == "gsm8k":
        train = test = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
        references, evaluated = ["72", "10"], ["72", "10"]
    else:
        train = write_jsonl(tmp_path / "math.jsonl", MATH)
        test = write_jsonl(tmp_path / "math500.jsonl", [dict(r, answer="x") for r in MATH])  # MATH-500 has both
        references, evaluated = ["1", "7"], ["1", "7"]
    scripted.extend(references)
    code, _, err = run(["--config", str(ROOT / "examples" / f"{preset}.yaml"), f"model={tiny_model_dir}",
                        f"dataset={train}", "dataset_config=", f"eval_dataset={test}", "eval_dataset_config=",
                        "eval_problems=2", "eval_max_new_tokens=4", "device=cpu", "group_size=4", "num_problems=2",
                        "max_new_tokens=16", "save_every=0", f"output_dir={tmp_path / 'out'}"])
    assert code == 0, err
    assert [r["reward"] for r in read_lines(tmp_path / "out" / "rollouts.jsonl")] == [1.0, 0.0, 0.0, 0.0] * 2
    assert [r["reference"] for r in read_lines(tmp_path / "out" / "eval.jsonl")] == evaluated * 2  # before, after


@pytest.mark.parametrize("module, why", [
    ("import os\nos._exit(0)\n", "the worker exited while importing {file} (an exit or a crash at module level)"),
    ("while True:\n    pass\n", "{file} did not finish importing within 0.5 s (the verifier's time limit; work done "
                                  "at module level counts)"),
    ("import sys\nsys.exit(3)\n", "failed: SystemExit: 3 (importing it)"),
])
def test_a_reward_file_that_fails_while_it_is_imported_is_one_line(module, why, tmp_path, capsys, tiny_model_dir):
    """An exit at module level, a loop there, a SystemExit: one line naming the file, exit 2, within the verifier's
    limit (not the worker's 120 s start-up wait), before anything is written."""
    path = tmp_path / "bad_rewards.py"
    path.write_text(module + "def score(response, answer, record):\n    return 1.0\n")
    began = time.perf_counter()
    assert T.main(math_run(tmp_path, tiny_model_dir, f"reward_function={path}:score", "verifier_timeout=0.5")) == 2
    assert time.perf_counter() - began < 60
    one_line_error(capsys, f"reward_function {path}:score ", why.format(file=path),
                   "it is called as name(response: str, answer: str, record: dict)")
    assert not (tmp_path / "out").exists()


def test_a_reward_file_imports_a_module_beside_it_and_its_prints_go_to_stderr(tmp_path, capfd):
    """As `python my_rewards.py` would, the file's folder is on the worker's import path; what the function
    prints reaches stderr, never stdout (the step table's)."""
    (tmp_path / "rlvr_test_bonus.py").write_text("BONUS = 0.75\n")
    path = tmp_path / "rewards_beside.py"
    path.write_text("import os\nfrom rlvr_test_bonus import BONUS\n\ndef score(response, answer, record):\n"
                    "    print('printed by the reward')\n    os.write(1, b'written to fd 1\\n')\n    return BONUS\n")
    with verifier.TimedVerifier(timeout_s=30.0, reward_function=(str(path), "score")) as scorer:
        assert scorer.score("\\boxed{3}", "3", {}) == (1.0, "3", "correct", 0.75)
    out, err = capfd.readouterr()
    assert "printed by the reward" in err and "written to fd 1" in err
    assert "printed by" not in out and "written to" not in out


def test_the_worker_dies_with_its_parent_while_a_reward_function_hangs(tmp_path):
    """The trainer SIGKILLed while its worker is inside a hanging reward function: the worker exits too."""
    path = tmp_path / "hang.py"
    path.write_text("import time\n\ndef score(response, answer, record):\n    while True:\n"
                    "        time.sleep(0.01)\n")
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import verifier; "
            "v = verifier.TimedVerifier(timeout_s=3600, reward_function=(sys.argv[2], 'score')); v.__enter__(); "
            "print(v._proc.pid, flush=True); v.score('x', '1', {})")
    parent = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(path)], stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    time.sleep(0.5)  # inside the function now
    parent.kill()
    parent.wait()
    for _ in range(100):
        if not _alive(worker):
            break
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_one_ctrl_c_stops_a_run_within_one_verifier_timeout_while_a_reward_function_hangs(tmp_path, capsys,
                                                                                          tiny_model_dir, monkeypatch):
    """The function answers the trial call and hangs on every rollout: a SIGINT sent while it hangs stops the run
    after that call's limit (3 s), not after the group's 4 calls (12 s and more); exit 130, nothing lost."""
    monkeypatch.setitem(T.STOP, "signal", None)  # the signal noted here leaves with the test
    path, hanging = tmp_path / "hang_later.py", tmp_path / "hanging"
    path.write_text(f"import time\n\ndef score(response, answer, record):\n    if response == '\\\\boxed{{' + answer + "
                    f"'}}':\n        return 1.0\n    open({str(hanging)!r}, 'w').close()\n    while True:\n"
                    "        time.sleep(0.01)\n")
    sent = {}

    def interrupt():
        while not hanging.exists():
            time.sleep(0.05)
        sent["at"] = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    assert T.main(math_run(tmp_path, tiny_model_dir, f"reward_function={path}:score", "verifier_timeout=3")) == 130
    assert time.perf_counter() - sent["at"] < 3 + 4
    assert "stopped by SIGINT during step 1; no step completed" in capsys.readouterr().err
