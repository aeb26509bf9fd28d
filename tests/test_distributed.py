"""Several processes through torchrun on the CPU (gloo, 2 processes, the tiny model): the same run
as one process for replicate and fsdp sharding, checkpoints that resume with another number of
processes, a killed or hung rank, SIGTERM to the launcher, and the checks that need no launch."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import rlvr_driver
import train_rlvr as T
from conftest import ROOT
from test_checkpoints import weights_apart

DRIVER = ROOT / "tests" / "rlvr_driver.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")


def _args(model_dir, data, out, *extra):
    return ["--config", str(ROOT / "config.yaml"), f"model={model_dir}", f"dataset={data}", "device=cpu",
            f"output_dir={out}", "group_size=4", "max_new_tokens=6", "num_problems=3", "learning_rate=1e-3",
            "save_every=1", "keep_last=5", "eval_problems=4", f"eval_dataset={data}", "eval_max_new_tokens=4",
            "eval_batch_size=3", *extra]


def _torchrun(args, env_extra=None, timeout=240):
    env = dict(os.environ, RLVR_DRIVER=json.dumps({"fake_rewards": True, **(env_extra or {})}), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(DRIVER), *args]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t


def _in_process(args, monkeypatch, capsys):
    monkeypatch.setattr(T, "score_rollouts", rlvr_driver.first_rollout_wins)
    code = T.main(args)
    captured = capsys.readouterr()
    monkeypatch.undo()
    return code, captured.out, captured.err


def _rows(stdout):
    return [line.split() for line in stdout.splitlines() if line[:1].isdigit()]


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tiny_data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    mp = pytest.MonkeyPatch()
    mp.setattr(T, "score_rollouts", rlvr_driver.first_rollout_wins)
    from io import StringIO
    import contextlib

    stdout = StringIO()
    with contextlib.redirect_stdout(stdout):
        assert T.main(_args(tiny_model_dir, tiny_data_file, out)) == 0
    mp.undo()
    return out, stdout.getvalue()


def _assert_same_run(one, many_out, many_stdout, steps=3):
    out, stdout = one
    a, b = _jsonl(out / "rollouts.jsonl"), _jsonl(many_out / "rollouts.jsonl")
    assert [(r["step"], r["rollout"], r["response"], r["reward"], r["advantage"], r["tokens"]) for r in a] == \
           [(r["step"], r["rollout"], r["response"], r["reward"], r["advantage"], r["tokens"]) for r in b]
    # another summation order (the ranks' gradients summed by a collective): the bounds of tests/default_run.py
    rho = 320 * 2.0 ** -24  # the tiny vocabulary's logsumexp, the longest float32 sum of a figure
    assert all(_rel(x["sequence_log_prob"], y["sequence_log_prob"]) <= rho for x, y in zip(a, b))
    rows_a, rows_b = _rows(stdout), _rows(many_stdout)
    assert len(rows_a) == len(rows_b) == steps
    for x, y in zip(rows_a, rows_b):  # step, correct, mean, std, tokens equal; loss, grad norm, update norm close
        assert x[:5] == y[:5]
    ma, mb = _jsonl(out / "metrics.jsonl"), _jsonl(many_out / "metrics.jsonl")
    for x, y in zip(ma, mb):
        for key in ("grad_norm", "update_norm"):
            assert _rel(x[key], y[key]) <= rho, (key, x[key], y[key])
        # the loss against the size of its terms (every aggregation divides by G or more): the advantages
        # sum to 0, so it is a difference of much larger numbers
        terms = sum(abs(r["advantage"] * r["sequence_log_prob"]) for r in a
                    if r["step"] == x["step"] and r["sequence_log_prob"] is not None) / x["group_size"]
        assert abs(x["policy_loss"] - y["policy_loss"]) <= rho * terms, (x["policy_loss"], y["policy_loss"], terms)
    wa, wb = load_file(out / "final" / "model.safetensors"), load_file(many_out / "final" / "model.safetensors")
    start = load_file(out / "checkpoints" / "step-000001" / "model.safetensors")
    assert wa.keys() == wb.keys() and weights_apart(wb, wa, start) <= 1e-3
    assert _jsonl(out / "eval.jsonl") == _jsonl(many_out / "eval.jsonl")  # the evaluation, split over the ranks
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == \
           sorted(p.name for p in (many_out / "checkpoints").iterdir())
    for ckpt in T.list_checkpoints(many_out):
        assert T.verify_checkpoint(ckpt) is None
        assert sorted(json.loads((ckpt / T.MANIFEST).read_text())["files"]) == \
               sorted(json.loads((out / "checkpoints" / ckpt.name / T.MANIFEST).read_text())["files"])


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_two_processes_give_the_one_process_run(one_process, tiny_model_dir, tiny_data_file, tmp_path, sharding,
                                                monkeypatch, capsys):
    out = tmp_path / "two"
    code, stdout, stderr, _ = _torchrun(_args(tiny_model_dir, tiny_data_file, out, f"sharding={sharding}"))
    assert code == 0, stderr[-3000:]
    _assert_same_run(one_process, out, stdout)
    # one voice: the table once, the progress lines once
    assert stdout.count("correct rollouts") == 1 and stderr.count("[step 2] generating") == 1
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final") is not None  # the same final/ as one process writes
    if sharding == "fsdp":  # a checkpoint of 2 sharded processes, resumed by 1
        resumed = tmp_path / "resumed"
        shutil.copytree(out, resumed)
        shutil.rmtree(resumed / "final")
        shutil.rmtree(resumed / "checkpoints" / "step-000003")
        code, resumed_stdout, err = _in_process(_args(tiny_model_dir, tiny_data_file, resumed, "resume=auto"),
                                                monkeypatch, capsys)
        assert code == 0, err
        assert "step-000002 after step 2" in err
        _assert_same_run(one_process, resumed, resumed_stdout)


def test_two_problems_a_step_on_two_sharded_processes_give_the_one_process_run(tiny_model_dir, tiny_data_file,
                                                                                tmp_path, monkeypatch, capsys):
    """problems_per_step=2 over 3 problems (steps of problems 0, 1 and of 2): each rank samples its share of
    both groups in one batch; the run is the one process's."""
    one, two = tmp_path / "one", tmp_path / "two"
    code, stdout, err = _in_process(_args(tiny_model_dir, tiny_data_file, one, "problems_per_step=2"), monkeypatch,
                                    capsys)
    assert code == 0, err
    code, many_stdout, stderr, _ = _torchrun(_args(tiny_model_dir, tiny_data_file, two, "problems_per_step=2",
                                                   "sharding=fsdp"))
    assert code == 0, stderr[-3000:]
    assert "generating 2 x 4 rollouts (problems 0, 1)" in stderr
    _assert_same_run((one, stdout), two, many_stdout, steps=2)
    assert [m["problems"] for m in _jsonl(two / "metrics.jsonl")] == [[0, 1], [2]]


def test_one_process_checkpoint_of_the_previous_code_resumes_on_two_sharded_processes(tiny_model_dir, tiny_data_file,
                                                                                       tmp_path):
    """1 -> 2: rank 0 reads a checkpoint of the code before torch.distributed.checkpoint's API
    (lm_head.weight in the file) and sends each rank its shards; step 2 gives that code's weights."""
    from test_checkpoints import FIXTURE, OLD_RUN, old_checkpoint

    ckpt, out = old_checkpoint(tmp_path, tiny_model_dir, tiny_data_file), tmp_path / "out"
    code, _, stderr, _ = _torchrun([f"model={tiny_model_dir}", f"dataset={tiny_data_file}", "device=cpu",
                                    f"output_dir={out}", *OLD_RUN, f"resume={ckpt}", "sharding=fsdp"])
    assert code == 0, stderr[-3000:]
    assert "resumed from" in stderr and "after step 1" in stderr
    after, want = load_file(out / "final" / "model.safetensors"), load_file(FIXTURE / "step-000002-model.safetensors")
    after["lm_head.weight"] = after.get("lm_head.weight", after["model.embed_tokens.weight"])
    assert want.keys() <= after.keys()
    moved = load_file(ckpt / "model.safetensors")
    assert weights_apart(after, want, moved) <= 1e-3  # summation order and another CPU's rounding only
    assert max((after[k] - moved[k]).abs().max().item() for k in moved) > 1e-4  # step 2 did move the weights


def test_a_killed_rank_ends_the_run_naming_it_and_resume_auto_continues(one_process, tiny_model_dir, tiny_data_file,
                                                                        tmp_path, monkeypatch, capsys):
    out = tmp_path / "killed"
    code, stdout, stderr, seconds = _torchrun(_args(tiny_model_dir, tiny_data_file, out, "dist_timeout=5"),
                                              {"die_at": [1, 2]})
    assert code != 0 and seconds < 120
    assert "rank 0: " in stderr and "rank 1 stopped (no heartbeat)" in stderr, stderr[-3000:]
    assert "rank 1 at step 2: generation" in stderr
    assert "The checkpoint of step 1" in stderr and "resume=auto" in stderr
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000001"]
    assert T.verify_checkpoint(out / "checkpoints" / "step-000001") is None
    code, resumed_stdout, err = _in_process(_args(tiny_model_dir, tiny_data_file, out, "resume=auto"), monkeypatch,
                                            capsys)  # with another number of processes
    assert code == 0, err
    _assert_same_run(one_process, out, resumed_stdout)


def test_a_hung_rank_ends_the_run_within_dist_timeout(tiny_model_dir, tiny_data_file, tmp_path):
    out = tmp_path / "hung"
    code, _, stderr, seconds = _torchrun(_args(tiny_model_dir, tiny_data_file, out, "dist_timeout=4"),
                                         {"hang_at": [1, 2]})
    assert code != 0 and seconds < 120
    assert "rank 0: waiting for the other ranks failed" in stderr and "rank 1 hangs" in stderr, stderr[-3000:]
    assert T.verify_checkpoint(out / "checkpoints" / "step-000001") is None


def test_sigterm_to_the_launcher_checkpoints_the_last_step_and_stops(one_process, tiny_model_dir, tiny_data_file,
                                                                      tmp_path, monkeypatch, capsys):
    out = tmp_path / "term"
    # pause_at: step 2 waits 3 s as it starts generating, so the signal lands inside it (on a fast idle machine
    # the tiny model's step 2 could otherwise finish before torchrun forwards the signal: then step 2 is the last
    # completed one, and CI saw that once)
    env = dict(os.environ, RLVR_DRIVER=json.dumps({"fake_rewards": True, "pause_at": [2, 3]}), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(DRIVER),
           *_args(tiny_model_dir, tiny_data_file, out, "save_every=0", "sharding=fsdp")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen = ""
    for line in proc.stderr:
        seen += line
        if "[step 2] generating" in line:
            proc.send_signal(signal.SIGTERM)
            break
    seen += proc.stderr.read()
    proc.wait(timeout=120)
    assert "stopped by SIGTERM" in seen, seen[-3000:]
    done = T.list_checkpoints(out)
    # the last completed step (1: the signal came inside step 2), written on the way out
    assert [d.name for d in done] == ["step-000001"] and T.verify_checkpoint(done[0]) is None
    assert "checkpoint of step 1" in seen
    code, resumed_stdout, err = _in_process(_args(tiny_model_dir, tiny_data_file, out, "resume=auto"), monkeypatch,
                                            capsys)
    assert code == 0, err
    _assert_same_run(one_process, out, resumed_stdout)


def test_a_group_that_does_not_split_over_the_processes_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert T.main(["--config", str(ROOT / "config.yaml"), "device=cpu", f"output_dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: group_size 8 does not split over 3 processes; choose a group_size divisible by the "
                   "number of processes (nproc_per_node x nnodes)")
    monkeypatch.setenv("RANK", "1")  # the other ranks stay silent about an error every rank sees
    assert T.main(["--config", str(ROOT / "config.yaml"), "device=cpu", f"output_dir={tmp_path / 'o'}"]) == 2
    assert capsys.readouterr().err == ""


def test_replicas_that_drift_apart_by_one_bit_stop_the_run(tiny_model, monkeypatch):
    model, _ = tiny_model
    params = list(model.parameters())
    mine = T.fingerprint(params)
    with torch.no_grad():
        w = params[2].view(-1)
        w[5] = torch.nextafter(w[5], torch.tensor(float("inf")))  # one ulp
    drifted = T.fingerprint(params)
    assert drifted != mine
    monkeypatch.setattr(T, "RANKS", T.Ranks(rank=0, world=2, sharding="replicate"))
    monkeypatch.setattr(T, "gather_objects", lambda obj: [mine, drifted])
    with pytest.raises(T.StopRun, match="the weights of rank 1 differ from rank 0's"):
        T.check_replicas(params)
    monkeypatch.setattr(T, "gather_objects", lambda obj: [mine, mine])
    T.check_replicas(params)


def test_the_variants_give_the_one_process_run_on_two_sharded_processes(tiny_model_dir, tiny_data_file, tmp_path,
                                                                        monkeypatch, capsys):
    """token_mean's sum_j L_j and format_reward's cut flags come from the whole group (gathered in
    score_group), so two fsdp processes take the one-process run's steps."""
    variants = ["loss_aggregation=token_mean", "advantage_std=none", "format_reward=0.5", "zero_variance=skip"]
    one = tmp_path / "one"
    code, one_stdout, err = _in_process(_args(tiny_model_dir, tiny_data_file, one, *variants), monkeypatch, capsys)
    assert code == 0, err
    rewards = [r["reward"] for r in _jsonl(one / "rollouts.jsonl")]
    assert set(rewards) <= {1.5, 1.0, 0.5, 0.0} and any(r % 1 == 0.5 for r in rewards), rewards  # bonus paid
    out = tmp_path / "two"
    code, stdout, stderr, _ = _torchrun(_args(tiny_model_dir, tiny_data_file, out, "sharding=fsdp", *variants))
    assert code == 0, stderr[-3000:]
    _assert_same_run((one, one_stdout), out, stdout)


def test_kl_ppo_resample_and_token_report_give_the_one_process_run_on_two_processes(
        tiny_model_dir, tiny_data_file, tmp_path, monkeypatch, capsys):
    """The reference is sharded like the model, the epochs' ratios and the KL are per rank's tokens
    and summed, the groups set aside are the same on every rank (the rewards are gathered first). fsdp only:
    replicate's reference is a whole copy on each rank and its sums are the plain run's (the first test;
    one torchrun launch is ~15 s of the suite's budget)."""
    variants = ["kl_coef=0.2", "ppo_epochs=2", "zero_variance=resample", "resample_limit=2", "token_report=true",
                "eval_problems=0"]
    one = tmp_path / "one"
    monkeypatch.setattr(T, "score_rollouts", rlvr_driver.flat_for({"2"}))  # problem 1 is set aside
    code = T.main(_args(tiny_model_dir, tiny_data_file, one, *variants))
    capsys.readouterr()
    monkeypatch.undo()
    assert code == 0
    out = tmp_path / "two"
    code, stdout, stderr, _ = _torchrun(_args(tiny_model_dir, tiny_data_file, out, "sharding=fsdp", *variants),
                                        {"flat_answers": ["2"]})
    assert code == 0, stderr[-3000:]
    keys = ("step", "problem_index", "rollout", "response", "reward", "advantage", "tokens", "set_aside")
    a, b = _jsonl(one / "rollouts.jsonl"), _jsonl(out / "rollouts.jsonl")
    assert [tuple(r.get(k) for k in keys) for r in a] == [tuple(r.get(k) for k in keys) for r in b]
    assert sum(bool(r.get("set_aside")) for r in a) == 4  # one group of 4
    ma, mb = _jsonl(one / "metrics.jsonl"), _jsonl(out / "metrics.jsonl")
    assert [m["problems_drawn"] for m in ma] == [m["problems_drawn"] for m in mb] == [1, 2, 1]
    for x, y in zip(ma, mb):
        assert len(x["epochs"]) == len(y["epochs"]) == 2
        for ex, ey in zip(x["epochs"], y["epochs"]):
            for key in ("policy_loss", "grad_norm", "update_norm", "kl", "clipped_fraction"):
                assert abs(ex[key] - ey[key]) <= 1e-5 * max(1.0, abs(ex[key])), (key, ex[key], ey[key])
    ta, tb = _jsonl(one / "tokens.jsonl"), _jsonl(out / "tokens.jsonl")
    assert [(r["step"], r["rollout"], r["token_ids"]) for r in ta] == [(r["step"], r["rollout"], r["token_ids"])
                                                                      for r in tb]
    assert max(abs(u - v) for x, y in zip(ta, tb) for k in ("before", "after") for u, v in zip(x[k], y[k])) <= 1e-5
    wa, wb = load_file(one / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5


CREDITS = {"monte_carlo": ["credit=monte_carlo", "credit_segment_tokens=2", "credit_samples=2",
                           "top_entropy_quantile=0.5"],
           "tree": ["credit=tree", "tree_branching=2,2", "credit_segment_tokens=3", "top_entropy_quantile=0.5"],
           # each line's verdict from its length (tests/step_checkers.py): the same whichever rank checks it;
           # with the prompt's forward once per group (prompt_pass: shared), on both shardings
           "steps": ["credit=steps", f"step_checker={ROOT / 'tests' / 'step_checkers.py'}:by_length",
                     "max_new_tokens=12", "prompt_pass=shared"]}


@pytest.fixture(scope="module")
def credit_one_process(tiny_model_dir, tiny_data_file, tmp_path_factory):
    mp, runs = pytest.MonkeyPatch(), {}
    mp.setattr(T, "score_rollouts", rlvr_driver.by_text)
    for name, extra in CREDITS.items():
        runs[name] = tmp_path_factory.mktemp(name) / "run"
        with pytest.MonkeyPatch.context() as lines:
            if name == "steps":  # finished lines to check (a cut last line is not checked)
                lines.setattr(T, "sample_next_token", rlvr_driver.writes_lines())
            assert T.main(_args(tiny_model_dir, tiny_data_file, runs[name], "num_problems=2", "eval_problems=0",
                                *extra)) == 0
    mp.undo()
    return runs


@pytest.mark.parametrize("credit, sharding", [("monte_carlo", "replicate"), ("tree", "fsdp"), ("steps", "replicate"),
                                              ("steps", "fsdp")])
def test_each_credit_gives_the_one_process_run_on_two_processes(credit_one_process, tiny_model_dir, tiny_data_file,
                                                                tmp_path, credit, sharding):
    """Continuations and branches draw from streams keyed by (seed, draw, rollout, cut, sample) or the node's
    path, the tree is rank 0's on every rank, values and entropies are gathered: two processes take the
    one-process run's rollouts, credit and steps (rewards by the text, whichever rank scores it). Each method on
    one sharding: what differs between the shardings (the gradient's sum) is the same code for every credit and
    is compared by the first test on both."""
    out = tmp_path / "two"
    code, stdout, stderr, _ = _torchrun(_args(tiny_model_dir, tiny_data_file, out, "num_problems=2",
                                              "eval_problems=0", f"sharding={sharding}", *CREDITS[credit]),
                                        {"text_rewards": True, "writes_lines": credit == "steps"})
    assert code == 0, stderr[-3000:]
    a, b = _jsonl(credit_one_process[credit] / "rollouts.jsonl"), _jsonl(out / "rollouts.jsonl")
    keys = ("step", "rollout", "response", "reward", "advantage", "tokens", "segments", "values", "entropy_mask",
            "line_verdicts")
    assert [tuple(r.get(k) for k in keys) for r in a] == [tuple(r.get(k) for k in keys) for r in b]
    assert max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x["token_advantages"], y["token_advantages"])) <= 1e-6
    assert any(x != r["advantage"] for r in a for x in r["token_advantages"])  # some credit of its own to compare
    for x, y in zip(_jsonl(credit_one_process[credit] / "metrics.jsonl"), _jsonl(out / "metrics.jsonl")):
        assert x.get("generated_tokens") == y.get("generated_tokens") and x.get("lines_right") == y.get("lines_right")
        for key in ("policy_loss", "grad_norm", "update_norm"):
            assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, x[key], y[key])
