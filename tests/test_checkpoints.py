"""Never lose a step: checkpoints, exact resume after SIGKILL, SIGINT/SIGTERM, bad numbers,
hostile verifiers, out-of-memory and bad records. CPU, tiny local model."""

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import train_rlvr as T
import verifier
import verifier_hostile_helpers
from conftest import ROOT
from run_helpers import one_line_error, verdict

DRIVER = ROOT / "tests" / "rlvr_driver.py"
STEPS = 5


def _args(model_dir, data, out, *extra):
    return ["--config", str(ROOT / "config.yaml"), f"model={model_dir}", f"dataset={data}", "device=cpu",
            f"output_dir={out}", "group_size=4", "max_new_tokens=6", f"num_problems={STEPS}", "save_every=2",
            "learning_rate=1e-3", *extra]


def _drive(model_dir, data, out, signals=(), *extra, kill_when=None):
    """Run the driver in a subprocess; with kill_when, SIGKILL it from here when that text shows on stderr."""
    env = dict(os.environ, RLVR_DRIVER=json.dumps({"fake_rewards": True, "signals": list(signals)}),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(DRIVER), *_args(model_dir, data, out, *extra)]
    if kill_when is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        return proc.returncode, proc.stdout, proc.stderr
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen = ""
    for line in proc.stderr:
        seen += line
        if kill_when in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    return proc.returncode, proc.stdout.read(), seen


def _outputs(out, stdout):
    """Everything a run produces except measured times."""
    rows = [l.rsplit(None, 1)[0] for l in stdout.splitlines() if l[:1].isdigit()]
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        del m["seconds"], m["timings"]
    weights = load_file(out / "final" / "model.safetensors")
    return rows, metrics, (out / "rollouts.jsonl").read_text(), weights


def _assert_same(a, b):
    assert a[0] == b[0] and len(a[0]) == STEPS
    assert a[1] == b[1]
    assert a[2] == b[2]
    assert a[3].keys() == b[3].keys() and all(torch.equal(a[3][k], b[3][k]) for k in a[3])


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tiny_data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    code, stdout, stderr = _drive(tiny_model_dir, tiny_data_file, out)
    assert code == 0, stderr
    outputs = _outputs(out, stdout)
    assert all(m["grad_norm"] > 0 for m in outputs[1])  # every step trains: a real test of resume
    return outputs


def _resume_and_compare(model_dir, data, out, uninterrupted):
    code, stdout, stderr = _drive(model_dir, data, out, (), "resume=auto")
    assert code == 0, stderr
    _assert_same(_outputs(out, stdout), uninterrupted)
    assert not list((out / "checkpoints").glob(".*"))  # leftovers of a broken write are cleaned up
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000004", "step-000005"]  # keep_last: 2
    return stderr


@pytest.mark.parametrize("signals, kill_when", [
    ((), "[step 3] rewards"),                 # SIGKILL from the test during step 3's backward
    ((), "[step 4] generating"),              # ... during step 4's generation
    ([[2, "files", "SIGKILL"]], None),        # inside the 2nd checkpoint write, weights written
    ([[1, "rename", "SIGKILL"]], None),       # inside the 1st checkpoint write, just before its rename
])
def test_sigkill_then_resume_gives_the_uninterrupted_run(tiny_model_dir, tiny_data_file, tmp_path, uninterrupted,
                                                         signals, kill_when):
    out = tmp_path / "run"
    code, _, stderr = _drive(tiny_model_dir, tiny_data_file, out, signals, kill_when=kill_when)
    assert code == -signal.SIGKILL, stderr
    left = T.list_checkpoints(out)
    assert all((c / "state.json").exists() for c in left)  # never a half checkpoint under a real name
    stderr = _resume_and_compare(tiny_model_dir, tiny_data_file, out, uninterrupted)
    assert (f"resumed from {left[-1]}" if left else "no checkpoint") in stderr


def test_a_second_sigint_exits_at_once_and_the_last_good_checkpoint_survives(tiny_model_dir, tiny_data_file,
                                                                             tmp_path, uninterrupted):
    out = tmp_path / "run"
    signals = [[2, "files", "SIGINT"], [2, "rename", "SIGINT"]]  # both inside the write of step 4
    code, _, stderr = _drive(tiny_model_dir, tiny_data_file, out, signals)
    assert code == 130, stderr
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000002"]
    assert list((out / "checkpoints").glob(".tmp-step-000004-*"))  # the write was cut short
    _resume_and_compare(tiny_model_dir, tiny_data_file, out, uninterrupted)


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_one_signal_in_a_checkpoint_write_finishes_it_then_stops(tiny_model_dir, tiny_data_file, tmp_path,
                                                                 uninterrupted, name, code):
    out = tmp_path / "run"
    got, stdout, stderr = _drive(tiny_model_dir, tiny_data_file, out, [[1, "files", name]])
    assert got == code, stderr
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000002"]
    assert "To continue: python train_rlvr.py" in stderr and "resume=auto" in stderr
    assert len([l for l in stdout.splitlines() if l[:1].isdigit()]) == 2
    _resume_and_compare(tiny_model_dir, tiny_data_file, out, uninterrupted)


# ----------------------------------------------------------------------------------------------
# In-process: signals at the safe points of a step


def _first_rollout_wins(monkeypatch):
    monkeypatch.setattr(T, "score_rollouts",
                        lambda scorer, texts, gold: [verdict(i == 0) for i in range(len(texts))])


def _on_call(monkeypatch, name, at_call, action):
    """Wrap T.<name> so that action() runs just before its at_call-th call."""
    real, calls = getattr(T, name), {"n": 0}

    def wrapped(*a, **k):
        calls["n"] += 1
        if calls["n"] == at_call:
            action()
        return real(*a, **k)
    monkeypatch.setattr(T, name, wrapped)


@pytest.mark.parametrize("where, at_call, sig", [
    ("generate_rollouts", 3, signal.SIGINT),   # during step 3's generation
    ("token_log_probs", 11, signal.SIGINT),  # during step 3's backward (4 responses a step)
    ("token_log_probs", 6, signal.SIGTERM),
])
def test_signal_during_a_step_checkpoints_the_last_completed_step(tiny_model_dir, tiny_data_file, tmp_path,
                                                                  capsys, monkeypatch, uninterrupted,
                                                                  where, at_call, sig):
    _first_rollout_wins(monkeypatch)
    _on_call(monkeypatch, where, at_call, lambda: os.kill(os.getpid(), sig))
    out = tmp_path / "run"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # SIG_IGN under nohup or `&`
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "save_every=0")) == 128 + sig
    captured = capsys.readouterr()
    last_done = 2 if at_call in (3, 11) else 1
    assert [c.name for c in T.list_checkpoints(out)] == [f"step-{last_done:06d}"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == last_done
    assert f"checkpoint of step {last_done}" in captured.err and "resume=auto" in captured.err
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the handlers put back as they were
    monkeypatch.undo()
    _resume_and_compare(tiny_model_dir, tiny_data_file, out, uninterrupted)


# ----------------------------------------------------------------------------------------------
# Resume rules and the output directory


def test_changed_math_setting_is_refused_and_harmless_one_accepted(tiny_model_dir, tiny_data_file, tmp_path, capsys,
                                                                   monkeypatch):
    _first_rollout_wins(monkeypatch)
    out = tmp_path / "run"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "num_problems=2")) == 0
    capsys.readouterr()
    for bad in ("temperature=0.7", "group_size=3", "learning_rate=2e-3", "seed=5"):
        assert T.main(_args(tiny_model_dir, tiny_data_file, out, "resume=auto", bad)) == 2
        err = capsys.readouterr().err
        assert "cannot resume" in err and bad.split("=")[0] in err
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "resume=auto", "num_problems=3",
                                   "save_every=7", "verifier_timeout=5")) == 0
    stdout = capsys.readouterr().out
    assert [l.split()[0] for l in stdout.splitlines() if l[:1].isdigit()] == ["1", "2", "3"]


# The settings that change no number of the steps a checkpoint has taken: a resume may change them. The test's
# own list, not T.RESUME_MAY_DIFFER: a setting moved there by mistake is still tried below, and refused.
MAY_DIFFER = {"output_dir", "save_every", "keep_last", "resume", "overwrite", "verifier_timeout", "num_problems",
              "max_bad_steps", "eval_batch_size", "sharding", "dist_timeout", "report_to"}
# A value other than the checkpoint run's for each other setting, valid beside the run's other settings.
# A new setting that is in neither fails the test below: give it a value here.
OTHER_VALUE = {
    "model": "someorg/another-model", "revision": "main", "dataset": "someorg/another-set", "dataset_split": "test",
    "problem_field": "question", "answer_field": "solution", "dataset_config": "main", "answer_format": "plain",
    "start_index": 1, "prompt_template": "Solve {problem}", "group_size": 2, "temperature": 0.7, "top_p": 0.5,
    "max_new_tokens": 7, "eos_token": "</s>", "learning_rate": 2e-3, "lr_schedule": "cosine",
    "warmup_steps": 1, "weight_decay": 0.1, "max_grad_norm": 2.0, "problems_per_step": 2,
    "std_eps": 1e-3, "advantage_std": "none", "loss_aggregation": "token_mean", "zero_variance": "skip",
    "resample_limit": 4, "format_reward": 0.1, "reward_function": "REWARDS:other", "reward_weights": "1,0.5",
    "kl_coef": 0.1, "ppo_epochs": 2, "clip_eps": 0.3, "clip_eps_high": 0.28, "mask_truncated_completions": True,
    "credit": "monte_carlo", "credit_segment_tokens": 4, "credit_samples": 2, "credit_scale": "raw",
    "tree_branching": "4", "tree_weighting": "once", "step_checker": "checker.py:check", "step_weight": 2.0,
    "step_mode": "first_error",
    "top_entropy_quantile": 0.5, "token_report": True, "seed": 1, "device": "cuda", "precision": "bf16",
    "compile": "false", "logprob_batch_size": 2, "prompt_pass": "shared", "bad_records": "skip",
    "eval_dataset": "someorg/another-test",
    "eval_split": "validation", "eval_dataset_config": "main", "eval_answer_format": "plain", "eval_problems": 2,
    "eval_max_new_tokens": 8, "eval_samples": 2, "eval_temperature": 0.5, "eval_top_p": 0.5, "eval_every": 1,
}


@pytest.fixture(scope="module")
def one_step_run(tiny_model_dir, tiny_data_file, tmp_path_factory):
    """A 1-step run with a checkpoint, and a reward_function (so reward_weights may be set alone)."""
    folder = tmp_path_factory.mktemp("resume-keys")
    rewards = folder / "rewards.py"
    rewards.write_text("def score(response, answer, record):\n    return 0.0\n\n\n"
                       "def other(response, answer, record):\n    return 1.0\n")
    args = _args(tiny_model_dir, tiny_data_file, folder / "run", "num_problems=1", "save_every=1",
                 f"reward_function={rewards}:score")
    assert T.main(args) == 0
    return args, rewards


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(T.Config) if f.name not in MAY_DIFFER])
def test_a_resume_that_changes_any_setting_outside_resume_may_differ_is_refused(key, one_step_run, capsys,
                                                                                monkeypatch):
    args, rewards = one_step_run
    if key not in OTHER_VALUE:
        pytest.fail(f"new setting {key}: add it to MAY_DIFFER (and RESUME_MAY_DIFFER) or give it a value in "
                    "OTHER_VALUE")
    value = OTHER_VALUE[key]
    value = f"{rewards}:other" if key == "reward_function" else str(value).lower() if isinstance(value, bool) else value
    # device=cuda on a machine without one stops at resolve_device, before output_dir is looked at
    monkeypatch.setattr(T, "resolve_device", lambda cfg: torch.device("cpu"))
    out = next(a.split("=", 1)[1] for a in args if a.startswith("output_dir="))
    capsys.readouterr()
    # a warmup needs steps after it (num_problems may differ on resume)
    longer = ["num_problems=3"] if key in ("warmup_steps", "problems_per_step") else []
    assert T.main([*args, "resume=auto", f"{key}={value}", *longer]) == 2
    line = one_line_error(capsys, "cannot resume")
    assert line == (f"error: cannot resume {out}/checkpoints/step-000001: these settings differ from the checkpoint's "
                    f"and change the math: {key}; set them back or start a new run in another output_dir")


def test_resume_may_differ_is_the_tests_list():
    assert T.RESUME_MAY_DIFFER == MAY_DIFFER  # a setting moved in or out: say here why it changes no step


def test_existing_output_dir_without_resume_is_refused(tiny_model_dir, tiny_data_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "num_problems=1")) == 0
    capsys.readouterr()
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "num_problems=1")) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "resume=nowhere")) == 2
    assert "is not a checkpoint folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Bad numbers


def _poison(monkeypatch, steps):
    """NaN gradient and loss at the given steps (counting calls of accumulate_policy_gradient)."""
    real, calls = T.accumulate_policy_gradient, {"n": 0}

    def poisoned(model, params, *a, **k):
        calls["n"] += 1
        done = real(model, params, *a, **k)
        if calls["n"] in steps:
            params[0].grad.fill_(float("nan"))
            done.loss = float("nan")
        return done
    monkeypatch.setattr(T, "accumulate_policy_gradient", poisoned)


def test_a_nan_step_is_skipped_and_training_goes_on(tiny_model_dir, tiny_data_file, tmp_path, capsys, monkeypatch):
    _first_rollout_wins(monkeypatch)
    _poison(monkeypatch, {2})
    seen = []
    real_step = T.optimizer_step

    def watching_step(params, optimizer, *a):
        before = [p.detach().clone() for p in params]
        state_before = [int(optimizer.state[p]["step"]) if p in optimizer.state else 0 for p in params]
        result = real_step(params, optimizer, *a)
        seen.append((all(torch.equal(p, b) for p, b in zip(params, before)),
                     state_before == [int(optimizer.state[p]["step"]) if p in optimizer.state else 0 for p in params]))
        return result
    monkeypatch.setattr(T, "optimizer_step", watching_step)
    out = tmp_path / "run"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "num_problems=4")) == 0
    stdout = capsys.readouterr().out
    rows = [l.split() for l in stdout.splitlines() if l[:1].isdigit()]
    assert rows[1][5:8] == ["nan", "nan", "skipped"]
    assert [r[7] != "skipped" for r in rows] == [True, False, True, True]
    assert seen[1] == (True, True) and seen[0] == (False, False) and seen[2] == (False, False)
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[1]["skipped"] is True and metrics[1]["grad_norm"] == "nan" and metrics[1]["update_norm"] is None
    assert "skipped (non-finite)    1 steps: 2" in stdout


def test_a_checkpoint_after_only_skipped_steps_resumes_with_no_optimizer_state(tiny_model_dir, tiny_data_file,
                                                                            tmp_path, capsys, monkeypatch):
    """Step 1 skipped: its checkpoint holds no AdamW state, and the resumed step 2 is AdamW's first
    (step count 1, as in the uninterrupted run), not its second."""
    _first_rollout_wins(monkeypatch)
    _poison(monkeypatch, {1})
    whole = tmp_path / "whole"
    assert T.main(_args(tiny_model_dir, tiny_data_file, whole, "num_problems=2", "save_every=1")) == 0
    assert torch.load(whole / "checkpoints" / "step-000001" / "optimizer.pt", weights_only=True)["state"] == {}
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-000002")
    assert T.main(_args(tiny_model_dir, tiny_data_file, resumed, "num_problems=2", "save_every=1", "resume=auto")) == 0
    assert "after step 1" in capsys.readouterr().err
    steps = [torch.load(out / "checkpoints" / "step-000002" / "optimizer.pt", weights_only=True)["state"]
             ["model.norm.weight"]["step"] for out in (whole, resumed)]
    assert steps == [1.0, 1.0]
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_state_of_an_optimizer_that_has_not_stepped_is_written_empty(tiny_model_dir):
    """(resumed from such a checkpoint, an evaluation may write one before any step)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert all(p.grad is None for p in model.parameters())
    _, state = T.full_states(model, optimizer)
    assert state["state"] == {} and len(optimizer.state) == 0
    assert state["param_groups"][0]["params"][:2] == ["model.embed_tokens.weight",
                                                      "model.layers.0.self_attn.q_proj.weight"]


def test_too_many_bad_steps_in_a_row_stop_with_a_checkpoint(tiny_model_dir, tiny_data_file, tmp_path, capsys,
                                                            monkeypatch):
    _first_rollout_wins(monkeypatch)
    _poison(monkeypatch, {2, 3})
    out = tmp_path / "run"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "max_bad_steps=2", "save_every=0")) == 1
    err = capsys.readouterr().err
    assert "2 steps in a row had a non-finite loss, gradient norm or update (the last at step 3)" in err
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000003"]


# ----------------------------------------------------------------------------------------------
# Hostile verifier, out of memory, bad records


@pytest.mark.parametrize("score_fn, status", [(verifier_hostile_helpers.sleep_forever, "timeout"),
                                              (verifier_hostile_helpers.misbehaving_score, "crash")])
def test_a_hanging_or_crashing_verifier_scores_0_and_training_goes_on(tiny_model_dir, tiny_data_file, tmp_path,
                                                                       capsys, monkeypatch, score_fn, status):
    if status == "crash":
        # misbehaving_score kills its worker on the response "EXIT"
        monkeypatch.setattr(T, "score_rollouts", lambda scorer, texts, gold: [T.Score(*scorer.score("EXIT", gold)) for _ in texts])
    monkeypatch.setattr(T.verifier, "TimedVerifier", functools.partial(verifier.TimedVerifier, score_fn=score_fn))
    out = tmp_path / "run"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "num_problems=2", "group_size=2",
                                   "verifier_timeout=0.5")) == 0
    stdout = capsys.readouterr().out
    rollouts = [json.loads(l) for l in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4 and all(r["reward"] == 0.0 and r["status"] == status for r in rollouts)
    assert "verifier overruns       4 rollouts" in stdout


def test_bad_records_stop_before_training_or_are_skipped(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "d.json"
    records = [{"problem": "What is 1 + 1?", "answer": "2"}, {"problem": "x " * 3000, "answer": "1"},
               {"problem": 7, "answer": "3"}, {"problem": "What is 2 + 2?", "answer": "4"}]
    data.write_text(json.dumps(records))
    args = _args(tiny_model_dir, data, tmp_path / "a", "num_problems=4")
    assert T.main(args) == 2
    err = capsys.readouterr().err
    assert "dataset record 1: its prompt has" in err and "exceeds the model's context of 2048" in err
    assert "(and 1 more)" in err and "bad_records: skip" in err
    assert not (tmp_path / "a").exists()  # nothing trained, nothing left behind: the folder it made is gone
    assert T.main(_args(tiny_model_dir, data, tmp_path / "b", "num_problems=4", "bad_records=skip")) == 0
    captured = capsys.readouterr()
    assert "skipping dataset record 2: 'problem' is not a non-empty text" in captured.err
    metrics = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["problem_index"] for m in metrics] == [0, 3]


def _out_of_memory():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("where, at_call, message, last_done", [
    ("token_log_probs", 9, "CUDA out of memory at step 3 in the backward pass of a response of up to 6 tokens", 2),
    ("generate_rollouts", 4, "CUDA out of memory at step 4 while generating 4 rollouts of up to 6 tokens", 3),
])
def test_out_of_memory_stops_with_a_checkpoint_of_the_last_completed_step(tiny_model_dir, tiny_data_file, tmp_path,
                                                                          capsys, monkeypatch, where, at_call,
                                                                          message, last_done):
    _first_rollout_wins(monkeypatch)
    _on_call(monkeypatch, where, at_call, _out_of_memory)
    out = tmp_path / "run"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "save_every=0")) == 1
    err = capsys.readouterr().err
    assert message in err and "lower max_new_tokens" in err and "resume=auto" in err
    assert [c.name for c in T.list_checkpoints(out)] == [f"step-{last_done:06d}"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == last_done


def test_resume_refuses_data_that_changed_under_the_checkpoint(tiny_model_dir, tmp_path, capsys, monkeypatch):
    _first_rollout_wins(monkeypatch)
    data = tmp_path / "d.json"
    records = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    data.write_text(json.dumps(records))
    out = tmp_path / "run"
    args = _args(tiny_model_dir, data, out, "num_problems=4", "save_every=2", "bad_records=skip")
    assert T.main(args) == 0
    state = json.loads((T.list_checkpoints(out)[0] / "state.json").read_text())
    assert state == {"step": 2, "next_record": 2}
    capsys.readouterr()
    records[1]["answer"] = ""  # record 1 is now skipped: the problems after it shift by one
    data.write_text(json.dumps(records))
    shutil.rmtree(T.list_checkpoints(out)[-1])  # resume from step 2
    assert T.main(args + ["resume=auto"]) == 2
    err = capsys.readouterr().err
    assert "its next problem is dataset record 2, but the data now give record 3" in err


FIXTURE = ROOT / "tests" / "fixtures" / "old-checkpoint-format"  # written before the state-dict API, see its README


def _fingerprint(t):
    bits = t.reshape(-1).float().contiguous().view(torch.int32).to(torch.int64)
    return [int(bits.sum()), int((bits * bits).sum())]


def old_checkpoint(tmp_path, model_dir, data):
    """The fixture's step-000001 in tmp_path, its config naming this session's tiny model and data."""
    ckpt = tmp_path / "step-000001"
    shutil.copytree(FIXTURE / "step-000001", ckpt)
    config = (ckpt / "config.yaml").read_text().replace("/tmp/ckpt-meas/old/model", str(model_dir))
    (ckpt / "config.yaml").write_text(config.replace("/tmp/ckpt-meas/old/problems.json", str(data)))
    T.write_manifest(ckpt, 1)
    return ckpt


OLD_RUN = ["group_size=2", "max_new_tokens=4", "num_problems=2", "learning_rate=1e-3", "save_every=1", "keep_last=2"]


def test_a_checkpoint_of_the_previous_code_resumes_to_the_same_weights_and_optimizer_state(
        tiny_model_dir, tiny_data_file, tmp_path, monkeypatch, capsys):
    """step-000001 of a 2-step run written by the code before torch.distributed.checkpoint's API (one
    process: lm_head.weight in the file, optimizer state by name): loaded exactly; step 2 from it gives
    the weights and AdamW state of step 2 from the same state written by today's code, bit for bit
    (both computed here), and the old code's step 2 within another CPU's rounding."""
    import rlvr_driver
    from transformers import AutoModelForCausalLM

    ckpt = old_checkpoint(tmp_path, tiny_model_dir, tiny_data_file)
    weights = load_file(ckpt / "model.safetensors")
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert "lm_head.weight" in weights and "model.embed_tokens.weight" not in weights  # the old layout

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    problems = [{"index": i} for i in range(2)]
    assert len(T.load_checkpoint(ckpt, model, optimizer, problems)[0]) == 1
    assert torch.equal(model.model.embed_tokens.weight, weights["lm_head.weight"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    state, names = optimizer.state_dict()["state"], [n for n, _ in model.named_parameters()]
    assert len(state) == len(saved["state"]) == len(names) == 24
    assert all(torch.equal(state[i][k], saved["state"][n][k]) for i, n in enumerate(names) for k in state[i])

    monkeypatch.setattr(T, "score_rollouts", rlvr_driver.first_rollout_wins)  # the fake rewards that run had
    out = tmp_path / "out"
    code = T.main([f"model={tiny_model_dir}", f"dataset={tiny_data_file}", "device=cpu", f"output_dir={out}",
                   *OLD_RUN, f"resume={ckpt}"])
    assert code == 0, capsys.readouterr().err
    # this machine's step 2 from the same state written by today's code: the same bits (both computed here)
    today = tmp_path / "today"
    (today / "checkpoints").mkdir(parents=True)
    for name in T.LOG_FILES:
        shutil.copyfile(ckpt / name, today / name)
    args = [f"model={tiny_model_dir}", f"dataset={tiny_data_file}", "device=cpu", f"output_dir={today}", *OLD_RUN]
    T.save_checkpoint(today, 1, model, optimizer, T.load_config(args), 1)
    assert T.main([*args, "resume=auto"]) == 0, capsys.readouterr().err
    after, again = load_file(out / "final" / "model.safetensors"), load_file(today / "final" / "model.safetensors")
    assert after.keys() == again.keys() and all(torch.equal(after[k], v) for k, v in again.items())
    written = torch.load(out / "checkpoints" / "step-000002" / "optimizer.pt", weights_only=True)
    again = torch.load(today / "checkpoints" / "step-000002" / "optimizer.pt", weights_only=True)
    assert written["param_groups"] == again["param_groups"]
    assert all(torch.equal(v, again["state"][n][k]) for n, st in written["state"].items() for k, v in st.items())
    # and the old code's step 2 (recorded on another machine): AdamW's state carried on (step 2, not a fresh
    # step 1), the weights as close as another CPU's rounding leaves them (tests/default_run.py)
    fingerprints = json.loads((FIXTURE / "step-000002-optimizer-fingerprint.json").read_text())
    assert json.loads(json.dumps(written["param_groups"])) == fingerprints["param_groups"]
    assert {float(st["step"]) for st in written["state"].values()} == {2.0}
    after["lm_head.weight"] = after.get("lm_head.weight", after["model.embed_tokens.weight"])
    assert weights_apart(after, load_file(FIXTURE / "step-000002-model.safetensors"), weights) <= 1e-3


def weights_apart(got: dict, want: dict, start: dict) -> float:
    """How far got is from want, as a share of how far want moved from start (over want's tensors; a
    tied head found under either name)."""
    tied = {"lm_head.weight": "model.embed_tokens.weight", "model.embed_tokens.weight": "lm_head.weight"}
    flat = lambda d: torch.cat([d.get(k, d.get(tied.get(k))).double().flatten() for k in sorted(want)])  # noqa: E731
    return float((flat(got) - flat(want)).norm() / (flat(want) - flat(start)).norm())


def test_a_checkpoint_without_a_weight_of_the_model_is_refused(tiny_model_dir, tiny_data_file, tmp_path, capsys):
    """set_model_state_dict would keep the model's own weight for one missing from the file."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ckpt = old_checkpoint(tmp_path, tiny_model_dir, tiny_data_file)
    weights = load_file(ckpt / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "model.norm.weight"}, str(ckpt / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(T.UserError, match=r"model.safetensors does not fit .*missing weights \['model.norm.weight'\]"):
        T.load_checkpoint(ckpt, model, optimizer, [{"index": i} for i in range(2)])
