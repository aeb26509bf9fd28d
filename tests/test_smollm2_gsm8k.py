"""The GSM8K set-up on SmolLM2 (no model, no training): examples/make_smollm2.py --task gsm8k on a tiny GSM8K-form
copy the tests write (the sets disjoint, no prompt record in any, held-out the first test records, the bad
arguments), examples/smollm2_gsm8k.yaml's four-shot prompt, and benchmarks/credit_methods.py's gsm8k task and
steps_grounded method."""

import gzip
import json
import sys

import pytest
import yaml

import train_rlvr as T
from conftest import ROOT, SHARED
from run_helpers import one_line_error

sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import credit_methods  # noqa: E402
import make_smollm2  # noqa: E402

TRAIN_RECORDS, TEST_RECORDS = 400, 30
PROMPT = sorted(make_smollm2.GSM8K_PROMPT)  # 0, 70, 188, 376


def _record(split, i):
    """A GSM8K-form record: a question, a worked solution with a calculator annotation, `#### N`; the train split's
    prompt records start as GSM8K's do."""
    start = make_smollm2.GSM8K_PROMPT.get(i, f"Ann has {i} pens") if split == "train" else f"Bo has {i} cups"
    return {"question": f"{start} and buys 2 more. How many now? ({split} {i})",
            "answer": f"She has {i} + 2 = <<{i}+2={i + 2}>>{i + 2} now.\n#### {i + 2}"}


def _gsm8k_dir(folder, train=TRAIN_RECORDS, test=TEST_RECORDS):
    """GSM8K as its authors publish it: gsm8k_train.jsonl.gz and gsm8k_test.jsonl, one record a line."""
    folder.mkdir()
    with gzip.open(folder / "gsm8k_train.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(_record("train", i)) + "\n" for i in range(train))
    (folder / "gsm8k_test.jsonl").write_text("".join(json.dumps(_record("test", i)) + "\n" for i in range(test)))
    return folder


def _make(out, data, *extra):
    return make_smollm2.main([str(out), "--problems-only", "--task", "gsm8k", "--gsm8k-dir", str(data), *extra])


def _sets(out):
    return {s: json.loads((out / f"gsm8k-{s}.json").read_text()) for s in ("train", "dev", "heldout")}


def test_the_gsm8k_sets_are_disjoint_hold_no_prompt_record_and_the_heldout_set_is_the_first_test_records(tmp_path):
    """400 train records less the prompt's 4 = 396 to draw from: dev 96 and train 300 take them all, so a prompt
    record let into the pool, or a record in both, is seen. Held-out: test records 0-19 in file order, as written."""
    data = _gsm8k_dir(tmp_path / "gsm8k")
    assert _make(tmp_path / "out", data, "--train-problems", "300", "--dev-problems", "96",
                 "--heldout-problems", "20") == 0
    sets = _sets(tmp_path / "out")
    assert {s: len(r) for s, r in sets.items()} == {"train": 300, "dev": 96, "heldout": 20}
    assert sets["heldout"] == [{**_record("test", i), "unique_id": f"gsm8k-test/{i}"} for i in range(20)]
    drawn = {s: [int(r["unique_id"].removeprefix("gsm8k-train/")) for r in sets[s]] for s in ("train", "dev")}
    for s, indices in drawn.items():  # each record GSM8K's train record of its unique_id, as written
        assert [r for r in sets[s]] == [{**_record("train", i), "unique_id": f"gsm8k-train/{i}"} for i in indices]
    assert not set(drawn["train"]) & set(drawn["dev"])
    assert sorted(drawn["train"] + drawn["dev"]) == [i for i in range(TRAIN_RECORDS) if i not in PROMPT]
    prompt_questions = {_record("train", i)["question"] for i in PROMPT}
    assert not prompt_questions & {r["question"] for rs in sets.values() for r in rs}
    assert drawn["dev"] != sorted(drawn["dev"])  # shuffled, not file order
    info = json.loads((tmp_path / "out" / "smollm2.json").read_text())
    assert info == {"gsm8k": {"seed": 0, "problems": {"train": 300, "dev": 96, "heldout": 20},
                              "prompt_records": PROMPT, "gsm8k_dir": str(data.resolve())}}


def test_the_gsm8k_sets_are_the_same_for_a_seed_and_another_seed_draws_others(tmp_path):
    """The defaults would need 700 train records: 100 and 50 here. --seed 0 twice: the same files (a plain .jsonl
    train file read as the .gz); --seed 1: other dev records, the same held-out ones."""
    data = _gsm8k_dir(tmp_path / "gsm8k")
    args = ("--train-problems", "100", "--dev-problems", "50", "--heldout-problems", "10")
    assert _make(tmp_path / "a", data, *args) == 0
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "gsm8k_train.jsonl").write_text(gzip.open(data / "gsm8k_train.jsonl.gz", "rt").read())
    (plain / "gsm8k_test.jsonl").write_text((data / "gsm8k_test.jsonl").read_text())
    assert _make(tmp_path / "b", plain, *args) == 0
    assert _sets(tmp_path / "a") == _sets(tmp_path / "b")
    assert _make(tmp_path / "c", data, *args, "--seed", "1") == 0
    a, c = _sets(tmp_path / "a"), _sets(tmp_path / "c")
    assert a["heldout"] == c["heldout"] and a["dev"] != c["dev"]
    assert json.loads((tmp_path / "c" / "smollm2.json").read_text())["gsm8k"]["seed"] == 1


def _bad(tmp_path, data):
    """Each wrong input, with the error line it must give (data: a good copy to damage)."""
    train, test = data / "gsm8k_train.jsonl.gz", data / "gsm8k_test.jsonl"
    fix = "fetch the file again"
    files = "gsm8k_train.jsonl.gz or gsm8k_train.jsonl, and gsm8k_test.jsonl"
    return {
        "no dir": (lambda: None, ["--task", "gsm8k"],
                   f"--task gsm8k needs --gsm8k-dir DIR, the folder holding GSM8K as its authors publish it ({files})"),
        "dir missing": (lambda: None, ["--task", "gsm8k", "--gsm8k-dir", str(tmp_path / "none")],
                        f"--gsm8k-dir {tmp_path / 'none'} is not a folder; pass the folder holding GSM8K ({files})"),
        "dir for a sum": (lambda: None, ["--task", "sum4", "--gsm8k-dir", str(data)],
                          "--gsm8k-dir is read by --task gsm8k alone (this is --task sum4)"),
        "no train": (lambda: train.unlink(), None,
                     f"--gsm8k-dir {data} has no gsm8k_train.jsonl.gz or gsm8k_train.jsonl; pass the folder holding "
                     f"GSM8K as its authors publish it ({files})"),
        "no test": (lambda: test.unlink(), None,
                    f"--gsm8k-dir {data} has no gsm8k_test.jsonl or gsm8k_test.jsonl.gz; pass the folder holding "
                    f"GSM8K as its authors publish it ({files})"),
        "not gzip": (lambda: train.write_bytes(b'{"question": "x"}\n'), None,
                     f"{train} cannot be read (BadGzipFile: Not a gzipped file (b'{{\"')); {fix}"),
        "not json": (lambda: test.write_text(test.read_text() + '{"question": "cut\n'), None,
                     f"{test} line 31 is not JSON (Unterminated string starting at: line 1 column 14 (char 13)); "
                     f"{fix}"),
        "no answer": (lambda: test.write_text('{"question": "q", "answer": ""}\n'), None,
                      f"{test} line 1 is not a GSM8K record (an object with a non-empty question and answer); {fix}"),
        "no ####": (lambda: test.write_text('{"question": "q", "answer": "It is 4."}\n'), None,
                    f"{test} line 1: its answer does not end in '#### N' (GSM8K's final answer); {fix}"),
        "other order": (lambda: _rewrite_train(train, lambda rs: rs[1:] + rs[:1]), None,
                        f"{train} is not GSM8K's train split in its published order: record 0 starts 'Ann has 1 pens "
                        "and buys 2 more. How many', not the prompt's example 'Natalia sold clips to 48 of her "
                        "friends'"),
        "too short": (lambda: _rewrite_train(train, lambda rs: rs[:300]), None,
                      f"{train} is not GSM8K's train split in its published order: it holds 300 records, no record "
                      "376, not the prompt's example 'Suraya picked 12 apples more than Caleb'"),
        "heldout count": (lambda: None, ["--heldout-problems", "31"],
                          f"--heldout-problems 31: {test} holds 30 records"),
        "train count": (lambda: None, ["--heldout-problems", "5", "--dev-problems", "97", "--train-problems", "300"],
                        f"--dev-problems 97 and --train-problems 300: together at most 396 ({train}'s 400 records "
                        "less the prompt's 4)"),
        "negative": (lambda: None, ["--dev-problems", "-1"], "the problem counts must be >= 0"),
    }


def _rewrite_train(path, change):
    records = gzip.open(path, "rt").read().splitlines()
    with gzip.open(path, "wt") as f:
        f.writelines(line + "\n" for line in change(records))


@pytest.mark.parametrize("case", ["no dir", "dir missing", "dir for a sum", "no train", "no test", "not gzip",
                                  "not json", "no answer", "no ####", "other order", "too short", "heldout count",
                                  "train count", "negative"])
@pytest.mark.parametrize("convert", [False, True])
def test_a_wrong_gsm8k_input_is_one_line_and_exit_2_before_anything_is_written(case, convert, tmp_path, monkeypatch,
                                                                               capsys):
    """Missing or damaged files, a train split in another order (the prompt's records elsewhere), counts beyond
    the files: one `error:` line and exit 2, no problem file, no record, and (without --problems-only) no
    conversion started."""
    data = _gsm8k_dir(tmp_path / "gsm8k")
    damage, argv, message = _bad(tmp_path, data)[case]
    damage()
    out = tmp_path / "out"
    monkeypatch.setattr(make_smollm2, "convert", lambda gguf, out: pytest.fail("converted before the check"))
    monkeypatch.setattr(make_smollm2, "find_gguf", lambda path: pytest.fail("looked for the model before the check"))
    if not argv or argv[0] != "--task":  # the good command, with the case's counts after it
        argv = ["--task", "gsm8k", "--gsm8k-dir", str(data), "--heldout-problems", "20", "--dev-problems", "50",
                "--train-problems", "100", *(argv or [])]
    with pytest.raises(SystemExit) as e:
        make_smollm2.main([str(out), *(["--problems-only"] if not convert else []), *argv])
    assert e.value.code == 2
    assert one_line_error(capsys) == "error: " + message
    assert not out.exists()


def test_gsm8k_prompt_drops_the_annotations_and_boxes_the_final_answer():
    records = [{"question": "Q one?", "answer": "A 48/2 = <<48/2=24>>24 b.\nC 24+1 = <<24+1=25>>25\n#### 25"},
               {"question": "Q two?", "answer": "It is 1,000 + 2 = <<1000+2=1002>>1,002.\n#### 1,002"}]
    assert make_smollm2.gsm8k_prompt(records) == (
        "Question: Q one?\nAnswer:\nA 48/2 = 24 b.\nC 24+1 = 25\nSo the answer is \\boxed{25}.<|im_end|>\n"
        "Question: Q two?\nAnswer:\nIt is 1,000 + 2 = 1,002.\nSo the answer is \\boxed{1,002}.<|im_end|>\n"
        "Question: {problem}\nAnswer:\n")


YAML = ROOT / "examples" / "smollm2_gsm8k.yaml"


def test_the_gsm8k_yaml_is_smollm2_on_the_gsm8k_files_with_four_worked_train_examples():
    """It parses and passes the trainer's checks; its template holds four worked examples (each a question, its
    lines without annotations, the boxed answer and the EOS) whose questions are the prompt records make_smollm2
    keeps out of dev and train, and ends with the question slot; the files are make_smollm2's."""
    cfg = T.load_config(["--config", str(YAML)])
    T.validate_config(cfg)
    assert (cfg.model, cfg.dataset, cfg.eval_dataset) == ("runs/smollm2", "runs/smollm2/gsm8k-train.json",
                                                          "runs/smollm2/gsm8k-heldout.json")
    assert (cfg.problem_field, cfg.answer_field, cfg.answer_format, cfg.eval_answer_format) == (
        "question", "answer", "gsm8k", "gsm8k")
    assert (cfg.num_problems, cfg.eval_problems, cfg.device, cfg.save_every, cfg.eos_token) == (
        50, 200, "cpu", 0, "<|im_end|>")
    assert cfg.max_new_tokens == cfg.eval_max_new_tokens == 200 and cfg.learning_rate == 3e-6
    template = cfg.prompt_template
    assert "<<" not in template and ">>" not in template
    assert template.endswith("<|im_end|>\nQuestion: {problem}\nAnswer:\n") and template.count("{problem}") == 1
    shots = template.split("<|im_end|>\n")[:-1]
    assert len(shots) == 4 and template.count("<|im_end|>") == 4 and template.count("Question: ") == 5
    for shot, index in zip(shots, PROMPT):
        question, solution = shot.removeprefix("Question: ").split("\nAnswer:\n")
        assert question.startswith(make_smollm2.GSM8K_PROMPT[index])
        *lines, last = solution.split("\n")
        assert len(lines) >= 2 and all("=" in line for line in lines)
        assert last.startswith("So the answer is \\boxed{") and last.endswith("}.")


@pytest.mark.skipif(not (SHARED / "data" / "gsm8k_train.jsonl.gz").is_file(),
                    reason="../shared/data/gsm8k_train.jsonl.gz not present (fresh clone)")
def test_the_gsm8k_yaml_prompt_is_built_from_gsm8ks_train_records():
    """The yaml's template is exactly make_smollm2.gsm8k_prompt of GSM8K's train records 0, 70, 188 and 376."""
    with gzip.open(SHARED / "data" / "gsm8k_train.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    template = yaml.safe_load(YAML.read_text())["prompt_template"]
    assert template == make_smollm2.gsm8k_prompt([records[i] for i in PROMPT])


def test_credit_methods_knows_the_gsm8k_task_and_the_grounded_steps_method(tmp_path, monkeypatch):
    """--tasks gsm8k --methods steps_grounded: one run of examples/smollm2_gsm8k.yaml on the folder's gsm8k-train.json,
    evaluated on gsm8k-dev.json, with credit=steps and the built-in grounded checker."""
    assert credit_methods.TASKS["gsm8k"] == ("examples/smollm2_gsm8k.yaml", "gsm8k-")
    assert credit_methods.METHODS["steps_grounded"] == ["credit=steps", "step_checker=grounded"]
    model, out = tmp_path / "model", tmp_path / "credit"
    model.mkdir()
    (model / "gsm8k-train.json").write_text("[]")
    calls = []

    def run(args, log):
        calls.append(args)
        raise SystemExit(0)
    monkeypatch.setattr(credit_methods, "run", run)
    monkeypatch.setattr(sys, "argv", ["credit_methods.py", "--model", str(model), "--out", str(out), "--tasks",
                                      "gsm8k", "--methods", "steps_grounded"])
    with pytest.raises(SystemExit):
        credit_methods.main()
    folder = out / "gsm8k-steps_grounded-seed0"
    assert calls == [["--config", "examples/smollm2_gsm8k.yaml", f"dataset={model / 'gsm8k-train.json'}",
                      f"output_dir={folder}", f"model={model}", f"eval_dataset={model / 'gsm8k-dev.json'}", "seed=0",
                      "overwrite=true", "credit=steps", "step_checker=grounded"]]


def test_credit_methods_without_the_gsm8k_sets_names_the_command_that_writes_them(tmp_path, monkeypatch, capsys):
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setattr(sys, "argv", ["credit_methods.py", "--model", str(model), "--out", str(tmp_path / "c"),
                                      "--tasks", "gsm8k"])
    with pytest.raises(SystemExit) as e:
        credit_methods.main()
    assert e.value.code == 2
    assert one_line_error(capsys) == (f"error: {model} has no gsm8k-train.json; run python examples/make_smollm2.py "
                                      f"{model} --problems-only --task gsm8k --gsm8k-dir DIR (DIR: GSM8K's files, "
                                      "e.g. ../shared/data)")


def test_the_sum_modes_say_a_gsm8k_run_is_not_read(tmp_path, monkeypatch, capsys):
    """A finished gsm8k run beside a sum run: --errors says the gsm8k run is not read (its problems have no sum for
    credit_diagnostic.lines_right: a KeyError before) and goes on to the sum run; --operands reads the sum run and
    passes over the gsm8k one (operand_lines: None, its problems are not sums), as it did before: refusing the
    folder (exit 2) would lose the sum runs' lines where --out holds both."""
    from tiny_models import build_tiny_tokenizer

    model, out = tmp_path / "model", tmp_path / "credit"
    model.mkdir()
    build_tiny_tokenizer(model)
    (model / "gsm8k-train.json").write_text(json.dumps([_record("train", 1)]))
    (model / "gsm8k-dev.json").write_text(json.dumps([_record("train", 1)]))
    sums = [{"problem": "23 + 4 + 7", "answer": "34"}]
    (model / "sum3-train.json").write_text(json.dumps(sums))
    (model / "sum3-dev.json").write_text(json.dumps(sums))
    for name, text in (("gsm8k-steps_grounded-seed0", "She has 1 + 2 = 3 now."),
                       ("sum3-sequence-seed0", "23 + 4 = 27\n27 + 7 = 34")):
        record = {"step": 1, "problem_index": 0, "rollout": 0, "reward": 0.0, "advantage": 0.0, "cut_at_limit": True,
                  "tokens": 1, "response": text, "phase": "after"}
        (out / name).mkdir(parents=True)
        (out / name / "rollouts.jsonl").write_text(json.dumps(record) + "\n")
        (out / name / "eval.jsonl").write_text(json.dumps(record) + "\n")
        (out / name / "run_config.yaml").write_text(f"eval_dataset: {model / (name.split('-')[0] + '-dev.json')}\n")
    monkeypatch.setattr(sys, "argv", ["credit_methods.py", "--model", str(model), "--out", str(out), "--errors"])
    assert credit_methods.main() == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0] == ("gsm8k-steps_grounded-seed0: not read (--errors checks the lines of a sum task's responses; "
                       "gsm8k's problems are not sums)")
    assert said[1].startswith("sum3-sequence-seed0: right response 0 up") and len(said) == 2
    monkeypatch.setattr(sys, "argv", ["credit_methods.py", "--model", str(model), "--out", str(out), "--operands"])
    assert credit_methods.main() == 0
    assert capsys.readouterr().out == ("sum3-sequence-seed0: after 2 chain lines, arithmetic right 2, chain right 2, "
                                       "right sums of wrong numbers 0\n")
