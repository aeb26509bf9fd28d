"""lr_schedule and warmup_steps: transformers' schedules over the run's steps, each step's rate in metrics.jsonl,
exact resume; the spec's constant rate has no scheduler at all. CPU, tiny local model, fake rewards."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import train_rlvr as T
from run_helpers import first_rollout_wins, main_args, one_line_error


@pytest.mark.parametrize("schedule, warmup, rates", [
    # step k (from 0) of 5, warmup W = 2: k / W first; then linear (5 - k) / 3, cosine 0.5 (1 + cos(pi (k - 2) / 3))
    ("linear", 2, [0.0, 0.5, 1.0, 2 / 3, 1 / 3]),
    ("cosine", 2, [0.0, 0.5, 1.0, 0.75, 0.25]),
    ("constant", 2, [0.0, 0.5, 1.0, 1.0, 1.0]),
    ("linear", 0, [1.0, 0.8, 0.6, 0.4, 0.2]),
])
def test_each_schedule_gives_get_schedulers_rate_at_each_step(schedule, warmup, rates):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = T.lr_scheduler(T.Config(lr_schedule=schedule, warmup_steps=warmup), optimizer, 5)
    got = []
    for _ in range(5):
        got.append(optimizer.param_groups[0]["lr"])
        T.next_learning_rate(scheduler)
    assert got == pytest.approx([1e-3 * r for r in rates], abs=1e-12)
    assert T.lr_scheduler(T.Config(), optimizer, 5) is None  # the spec's: no scheduler


def _metrics(out):
    return [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "timings")}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_takes_each_steps_rate_and_resumes_exactly(tiny_model_dir, tiny_data_file, tmp_path, capsys,
                                                         monkeypatch):
    """linear with warmup 2 over 5 steps at 1e-3: metrics.jsonl's rates 0, 5e-4, 1e-3, 6.67e-4, 3.33e-4; the first
    step at rate 0 moves nothing (AdamW's step and its weight decay are both times the rate). Resumed from the
    checkpoint of step 2, steps 3-5 take the same rates, and the metrics and final weights are the uninterrupted
    run's; a resume that changes num_problems (the schedule's length) is refused."""
    first_rollout_wins(monkeypatch)
    out = tmp_path / "run"
    args = main_args(tiny_model_dir, tiny_data_file, out, "num_problems=5", "save_every=2", "keep_last=3",
                     "learning_rate=1e-3", "lr_schedule=linear", "warmup_steps=2")
    assert T.main(args) == 0
    whole = _metrics(out)
    assert [m["learning_rate"] for m in whole] == pytest.approx([0.0, 5e-4, 1e-3, 2e-3 / 3, 1e-3 / 3], abs=1e-12)
    assert whole[0]["update_norm"] == 0.0 and whole[0]["grad_norm"] > 0 and whole[1]["update_norm"] > 0
    weights = load_file(out / "final" / "model.safetensors")
    again = tmp_path / "again"
    shutil.copytree(out, again)
    shutil.rmtree(again / "final")
    capsys.readouterr()
    assert T.main(main_args(tiny_model_dir, tiny_data_file, again, "num_problems=5", "save_every=2", "keep_last=3",
                            "learning_rate=1e-3", "lr_schedule=linear", "warmup_steps=2",
                            f"resume={again / 'checkpoints' / 'step-000002'}")) == 0
    assert _metrics(again) == whole
    resumed = load_file(again / "final" / "model.safetensors")
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)
    capsys.readouterr()
    assert T.main([*args, "resume=auto", "num_problems=6"]) == 2
    one_line_error(capsys, "change the math: num_problems")


def test_the_schedule_steps_once_a_training_step_over_the_runs_steps(tiny_model_dir, tiny_data_file, tmp_path,
                                                                     monkeypatch):
    """linear at 1e-3 over 4 problems: with ppo_epochs 2 every epoch of a step takes that step's rate (one scheduler
    step a training step, not an epoch: not 1e-3, 5e-4, 0, 0); with problems_per_step 2 the schedule spans the
    run's 2 steps (not its 4 problems: not 1e-3, 7.5e-4)."""
    first_rollout_wins(monkeypatch)
    for name, extra, rates in (("epochs", ["ppo_epochs=2"], [1e-3, 7.5e-4, 5e-4, 2.5e-4]),
                               ("p2", ["problems_per_step=2"], [1e-3, 5e-4])):
        assert T.main(main_args(tiny_model_dir, tiny_data_file, tmp_path / name, "num_problems=4", "learning_rate=1e-3",
                                "lr_schedule=linear", *extra)) == 0
        metrics = _metrics(tmp_path / name)
        assert [m["learning_rate"] for m in metrics] == pytest.approx(rates, abs=1e-12)
        if name == "epochs":
            assert all([e["learning_rate"] for e in m["epochs"]] == [m["learning_rate"]] * 2 for m in metrics)


def test_a_decaying_schedule_reaches_0_a_step_after_the_last_as_the_settings_page_says():
    """linear at 1e-3, 6 steps, 2 of warmup: the last step trains at 2.5e-4 (1 / (6 - 2) of the rate), not at 0."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = T.lr_scheduler(T.Config(lr_schedule="linear", warmup_steps=2), optimizer, 6)
    T.next_learning_rate(scheduler, 5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4, abs=1e-15)
    T.next_learning_rate(scheduler)
    assert optimizer.param_groups[0]["lr"] == 0.0  # the step after the last
    from conftest import ROOT
    page = " ".join((ROOT / "docs" / "settings.md").read_text().split())
    assert ("`linear` or `cosine` decay to 0 one step after the last (the last step trains at 1 / (steps - "
            "`warmup_steps`) of `learning_rate` with `linear`: 2.5e-4 of 1e-3 over 6 steps with 2 of warmup)") in page


@pytest.mark.parametrize("setting, message", [
    ("lr_schedule=step", "config key 'lr_schedule' must be one of constant, linear, cosine, got 'step'"),
    ("warmup_steps=-1", "config key 'warmup_steps' must be an integer >= 0 and below the run's 50 steps"),
    ("warmup_steps=50", "config key 'warmup_steps' must be an integer >= 0 and below the run's 50 steps"),
])
def test_a_bad_schedule_setting_is_one_line(setting, message, capsys):
    from conftest import ROOT
    assert T.main(["--config", str(ROOT / "config.yaml"), setting]) == 2
    one_line_error(capsys, message)
