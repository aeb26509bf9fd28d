"""Faults while running end in a known state, never a traceback or a lost step: a non-finite update
undone with its AdamW state, NaN gradients and NaN scores stopping with a checkpoint, a full disk
mid-checkpoint, a group too large for memory refused before step 1, a faulty compiled decoder
replaced by eager decoding, and a refused torchrun start. CPU, tiny local model."""

import re
import shutil
import subprocess
import sys

import pytest
import torch

import train_rlvr as T
from conftest import ROOT
from run_helpers import first_rollout_wins, make_finished_run, one_line_error, run_args, table_rows


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory):
    return make_finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory)


# ----------------------------------------------------------------------------------------------
# Non-finite numbers


def _state(opt, params):
    return {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in params}


def test_a_step_that_makes_a_weight_non_finite_is_undone_with_its_adamw_state(tiny_model):
    """A finite step at 1e-3, one at 1e37 (weights near 1e37, still finite: taken, its state copied first), then
    another at 1e37, whose weight decay w (1 - lr wd) overflows float32: the weights and every AdamW state tensor
    are as they were before it."""
    model, _ = tiny_model
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    copies = T.StepCopies(T.update_norm_buffers(params, torch.device("cpu")))
    _, moved = T.optimizer_step(params, opt, 1.0, 0.0, copies)
    assert moved > 0 and copies.state == {}  # a step that cannot overflow copies no state
    opt.param_groups[0]["lr"] = 1e37
    for p in params:
        p.grad = torch.randn_like(p)
    _, moved = T.optimizer_step(params, opt, 1.0, 0.0, copies)
    assert 1e36 < copies.largest < 3.4e38 and moved > 0 and copies.state  # could overflow: checked, and it did not
    weights, state = [p.detach().clone() for p in params], _state(opt, params)
    for p in params:
        p.grad = torch.randn_like(p)
    grad_norm, moved = T.optimizer_step(params, opt, 1.0, 0.0, copies)
    assert moved is None and grad_norm > 0 and copies.state
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    after = _state(opt, params)
    assert after.keys() == state.keys()
    for key in state:
        assert state[key].keys() == after[key].keys()
        assert all(torch.equal(after[key][k], v) if torch.is_tensor(v) else after[key][k] == v
                   for k, v in state[key].items())
    fresh = torch.optim.AdamW(params, lr=1e37)  # the run's first step undone: no state at all
    assert T.optimizer_step(params, fresh, 1.0)[1] is None and len(fresh.state) == 0
    assert all(torch.equal(p, w) for p, w in zip(params, weights))


def test_a_huge_learning_rate_ends_the_run_with_a_checkpoint_and_no_traceback(tiny_model_dir, tiny_data_file,
                                                                               tmp_path, capsys, monkeypatch):
    """lr 1e30: the first update is real and finite (weights ~1e30), every later step's gradient is NaN
    and skipped, until max_bad_steps stops the run with a checkpoint. Never inf, never an IndexError."""
    first_rollout_wins(monkeypatch)
    out = tmp_path / "run"
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "learning_rate=1e30", "max_bad_steps=2")) == 1
    captured = capsys.readouterr()
    rows = [line.split() for line in captured.out.splitlines()[1:]]
    assert [r[7] for r in rows[1:]] == ["skipped", "skipped"] and float(rows[0][7]) > 1e30
    assert "inf" not in captured.out and "Traceback" not in captured.err
    assert "2 steps in a row had a non-finite loss, gradient norm or update (the last at step 3)" in captured.err
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000003"]


def test_nan_scores_in_generation_stop_with_a_checkpoint_never_an_out_of_range_token(
        tiny_model_dir, tiny_data_file, tmp_path, capsys, monkeypatch):
    first_rollout_wins(monkeypatch)
    real_scores, real_pass, real_group, at = T.next_token_scores, T.prompt_pass, T.sample_groups, {"step": 0}

    def group(step, *a, **k):
        at["step"] = step
        return real_group(step, *a, **k)

    def poisoned(real):  # from step 2 on, the weights give NaN scores (the prompt pass's too)
        return lambda *a, **k: real(*a, **k) * (float("nan") if at["step"] >= 2 else 1.0)
    monkeypatch.setattr(T, "sample_groups", group)
    monkeypatch.setattr(T, "next_token_scores", poisoned(real_scores))
    monkeypatch.setattr(T, "prompt_pass", poisoned(real_pass))
    out = tmp_path / "run"
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "max_new_tokens=6")) == 1
    captured = capsys.readouterr()
    assert "step 2: the model's next-token scores are NaN or infinite at new token 1" in captured.err
    assert "IndexError" not in captured.err and "Traceback" not in captured.err
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000001"]
    assert "checkpoint of step 1" in captured.err and "To continue" in captured.err


# ----------------------------------------------------------------------------------------------
# A full disk while writing a checkpoint


def test_a_full_disk_keeps_the_steps_names_the_space_and_resumes(tiny_model_dir, tiny_data_file, tmp_path, capsys,
                                                                  monkeypatch, finished_run):
    first_rollout_wins(monkeypatch)
    out = tmp_path / "run"
    real_save, calls = T.torch.save, {"n": 0}

    def save(obj, path, *a, **k):
        if str(path).endswith("optimizer.pt"):
            calls["n"] += 1
            if calls["n"] == 2:  # the second checkpoint: the disk fills up mid-write
                monkeypatch.setattr(T.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
                raise RuntimeError("unexpected pos 5952 vs 5844")
        return real_save(obj, path, *a, **k)
    monkeypatch.setattr(T.torch, "save", save)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "save_every=1", "keep_last=3")) == 1
    err = capsys.readouterr().err
    assert re.search(r"no space left in \S+checkpoints: a checkpoint needs about [0-9.]+ kB and 4\.1 kB are free", err)
    assert "the last checkpoint is step 1; metrics.jsonl and rollouts.jsonl keep steps 1-2" in err
    assert "To continue: python train_rlvr.py" in err and "resume=auto" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]  # no temporary folder left
    assert T.verify_checkpoint(out / "checkpoints" / "step-000001") is None
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    monkeypatch.undo()
    first_rollout_wins(monkeypatch)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "save_every=1", "keep_last=3", "resume=auto")) == 0
    assert table_rows(capsys.readouterr().out) == finished_run[1]


def test_too_little_free_space_is_found_before_writing(tiny_model, tmp_path):
    model, _ = tiny_model
    opt = torch.optim.AdamW(model.parameters())
    out = tmp_path
    for name in T.LOG_FILES:
        (out / name).write_text("")
    import unittest.mock as mock

    with mock.patch.object(T.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6, 1000)):
        with pytest.raises(T.StopRun, match=r"no space left in .*a checkpoint needs about [0-9.]+ kB and 1\.0 kB are free"):
            T.save_checkpoint(out, 1, model, opt, T.Config(), None)
    assert not any((out / "checkpoints").iterdir())


# ----------------------------------------------------------------------------------------------
# Memory, the compiled decoder and torchrun


def test_a_group_that_cannot_be_allocated_is_refused_before_step_1(tmp_path, capsys, tiny_model_dir,
                                                                    tiny_data_file, monkeypatch):
    monkeypatch.setattr(T, "available_memory", lambda device: 10**6)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, tmp_path / "o", "group_size=512")) == 2
    one_line_error(capsys, "group_size 512 with max_new_tokens 6 needs at least", "GB are available; lower group_size")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fault", ["nan", "offset"])
def test_a_faulty_compiled_decoder_falls_back_to_eager_with_the_difference(tiny_model, monkeypatch, capsys, fault,
                                                                           inductor):
    """A compiled step off by 0.5 or giving NaN (NaN is no difference within the tolerance, `not worst
    <= tol`) is thrown away at the check, and the rollouts are eager's; an honest compile then passes."""
    model, _ = tiny_model
    cfg = T.Config(group_size=2, max_new_tokens=6, temperature=1.0, top_p=0.9, device="cpu", compile="false")
    prompt = torch.tensor([5, 17, 33, 100, 7])

    def rollouts(decoders=None):
        responses, _ = T.generate_rollouts(model, prompt, cfg, -1, T.rollout_streams(0, 1, range(2), "cpu"),
                                           T.nullcontext(), decoders)
        return [r.tolist() for r in responses]
    eager = rollouts()
    cfg.compile = "true"
    decoders = T.Decoders()
    decoder = decoders.get(model, T.nullcontext())
    compiled = decoder.compiled_step
    faulty = {"nan": lambda ids: decoder._forward(ids) * float("nan"), "offset": lambda ids: compiled(ids) + 0.5}
    monkeypatch.setattr(decoder, "compiled_step", faulty[fault])  # the injected fault
    assert rollouts(decoders) == eager
    err = capsys.readouterr().err
    difference = "nan" if fault == "nan" else r"0\.5\d* \(tolerance [0-9.e-]+ for logits up to [0-9.]+\)"
    assert re.search(r"compiled decoding failed \(RuntimeError: its logits differ from eager decoding by "
                     + difference + r".*; decoding eagerly", err), err
    assert decoders.failed and not decoders.static  # the faulty decoder is thrown away
    healthy_decoders = T.Decoders()
    healthy = healthy_decoders.get(model, T.nullcontext())
    assert rollouts(healthy_decoders) == eager  # an honest compile passes
    assert healthy.checked and healthy_decoders.failed is None


def test_a_torchrun_refusal_is_rlvrs_line_once_then_torchruns_summary_of_exit_2(tmp_path):
    """torchrun (the parent) turns any failed worker into its own ChildFailedError and exit status 1;
    the README's torchrun section says so. rlvr's line comes once (rank 0), and both workers exit 2."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "train_rlvr.py"), "--config", str(ROOT / "config.yaml"), "device=cpu", "group_size=3",
           f"output_dir={tmp_path / 'o'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    line = ("error: group_size 3 does not split over 2 processes; choose a group_size divisible by the number of "
            "processes (nproc_per_node x nnodes)")
    assert proc.returncode == 1 and proc.stderr.count(line) == 1, proc.stderr
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in proc.stderr
    root_cause = proc.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: 2 ", root_cause), proc.stderr  # rank 0 said it
    others = re.findall(r"rank\s+: 1 \(local_rank: 1\)\n\s+exitcode\s+: (\S+)", proc.stderr)
    assert others in (["2"], ["-15"]), proc.stderr  # rank 1: exit 2 too, or torchrun's SIGTERM while it waited
    torchrun = (ROOT / "docs" / "torchrun.md").read_text()
    assert "exitcode  : 2" in torchrun and "ChildFailedError" in torchrun and "exits with status 1" in torchrun
    assert not (tmp_path / "o").exists()


def test_adamws_step_never_exceeds_the_bound_that_spares_the_state_copy():
    """step_could_overflow's bound on |m_hat| / (sqrt(v_hat) + eps), the most a weight moves per unit of learning
    rate: 1 at step 1 and 7.2702 in the limit for PyTorch's betas (0.1 sqrt(1000) / sqrt(1 - 0.81 / 0.999)).
    The gradients that reach it (Cauchy-Schwarz's equality: g_k proportional to (b1 / b2)^(t-k)) move a weight
    by at most the bound, and within 0.1 % of it, through torch's own AdamW."""
    def bound(t):
        copies = T.StepCopies([], largest=0.0)
        opt = torch.optim.AdamW([torch.zeros(1)], lr=1.0, weight_decay=0.0)
        opt.state[opt.param_groups[0]["params"][0]] = {"step": torch.tensor(float(t - 1))}
        T.step_could_overflow(opt, copies, [])
        return copies.largest / 1.001
    assert bound(1) == pytest.approx(1.0, rel=1e-12) and bound(100_000) == pytest.approx(7.2702, abs=1e-4)
    for t in (1, 2, 10, 200):
        w = torch.zeros(1, requires_grad=True)
        opt = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.0, eps=1e-30)
        for k in range(1, t + 1):
            with torch.no_grad():
                before = w.clone()
            w.grad = torch.tensor([(0.9 / 0.999) ** -k], dtype=torch.float32) * 1e-3
            opt.step()
        moved = float((w.detach() - before).abs()) / 1e-3
        assert moved <= bound(t) * (1 + 1e-5) and moved == pytest.approx(bound(t), rel=1e-3), (t, moved, bound(t))


def test_a_step_the_bound_proves_finite_copies_no_state_and_the_next_one_is_checked(tiny_model):
    """lr 1e36: before the first step the largest |weight| is 1 (the norms'), so |w'| <= 1 (1e34 - 1) + 1e36 x 1.001,
    under 1e37: no copy of AdamW's state and no check, and the bound (1.011e36) is kept; the second step's bound
    (1e36 x 1e34) could overflow, and does (w (1 - lr wd)): checked, undone, the state restored from its copy."""
    model, _ = tiny_model
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e36)
    copies = T.StepCopies(T.update_norm_buffers(params, torch.device("cpu")))
    for p in params:
        p.grad = torch.randn_like(p)
    _, moved = T.optimizer_step(params, opt, 1.0, 0.0, copies)
    assert moved > 0 and copies.state == {} and copies.largest == pytest.approx(1.011e36, rel=1e-6)
    assert max(float(p.detach().abs().max()) for p in params) <= copies.largest
    weights, state = [p.detach().clone() for p in params], _state(opt, params)
    for p in params:
        p.grad = torch.randn_like(p)
    assert T.optimizer_step(params, opt, 1.0, 0.0, copies)[1] is None and copies.state
    assert all(torch.equal(p, w) for p, w in zip(params, weights)) and _state(opt, params).keys() == state.keys()


def test_another_optimizer_is_always_checked(tiny_model):
    """The bound is AdamW's: with SGD every step is checked (its largest |weight| measured after it): lr 1e37 with
    a gradient clipped to norm 1 moves the weights by a norm of 1e37 and leaves them finite (the largest 2.6e35)."""
    model, _ = tiny_model
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e37)
    copies = T.StepCopies(T.update_norm_buffers(params, torch.device("cpu")))
    for p in params:
        p.grad = torch.randn_like(p)
    assert T.step_could_overflow(opt, copies, [p.detach() for p in params]) and copies.largest is None
    _, moved = T.optimizer_step(params, opt, 1.0, 0.0, copies)
    assert moved == pytest.approx(1e37, rel=1e-5) and 1e35 < copies.largest < 1e37
    assert copies.largest == max(float(p.detach().abs().max()) for p in params)
