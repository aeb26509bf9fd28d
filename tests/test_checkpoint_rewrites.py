"""Writing a checkpoint again over an existing step-N: after resume=PATH from an older checkpoint
the later one is replaced entirely, and a rewrite cut between its two renames (a kill, a second
signal) keeps a usable checkpoint that the next start puts back. CPU, tiny local model."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_rlvr as T
from run_helpers import copy_run, first_rollout_wins, main_args, make_finished_run, run_args, table_rows, verdict


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory):
    return make_finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory)


class _NoWorker:
    """In place of TimedVerifier where score_rollouts is replaced: no worker process to start."""

    def __init__(self, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _first_rollout_wins_no_worker(monkeypatch):
    """first_rollout_wins without starting the verifier's worker process (nothing is scored)."""
    monkeypatch.setattr(T.verifier, "TimedVerifier", _NoWorker)
    monkeypatch.setattr(T, "score_rollouts",
                        lambda scorer, texts, gold: [verdict(i == 0) for i in range(len(texts))])


def _metrics(out):
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    for m in rows:
        del m["seconds"], m["timings"]
    return rows


def test_resume_from_an_older_checkpoint_rewrites_the_later_one(tiny_model_dir, tiny_data_file, tmp_path, capsys,
                                                               monkeypatch):
    """resume=PATH from step 2 when step 3 exists gives the uninterrupted run, and the
    step-3 checkpoint it writes again replaces the old one (marked stale here) entirely."""
    _first_rollout_wins_no_worker(monkeypatch)
    out = tmp_path / "run"
    args = main_args(tiny_model_dir, tiny_data_file, out, "num_problems=3", "save_every=2", "learning_rate=1e-3")
    assert T.main(args) == 0
    whole = capsys.readouterr().out
    whole_metrics, whole_rollouts = _metrics(out), (out / "rollouts.jsonl").read_text()
    whole_weights = load_file(out / "final" / "model.safetensors")
    step2, step3 = T.list_checkpoints(out)
    first_write = load_file(step3 / "model.safetensors")
    (step3 / "STALE").write_text("written by the first run")
    (step3 / "metrics.jsonl").write_text("stale\n")
    shutil.rmtree(out / "final")

    assert T.main(args + [f"resume={step2}"]) == 0
    captured = capsys.readouterr()
    assert f"resumed from {step2}" in captured.err
    assert table_rows(captured.out) == table_rows(whole) and len(table_rows(whole)) == 3
    assert _metrics(out) == whole_metrics and (out / "rollouts.jsonl").read_text() == whole_rollouts
    weights = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(weights[k], whole_weights[k]) for k in whole_weights)
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000002", "step-000003"]
    assert not (step3 / "STALE").exists()
    assert (step3 / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()
    rewritten = load_file(step3 / "model.safetensors")  # what the uninterrupted run wrote, written again
    assert rewritten.keys() == first_write.keys() and all(torch.equal(rewritten[k], first_write[k]) for k in rewritten)
    assert json.loads((step3 / "state.json").read_text())["step"] == 3
    assert not list((out / "checkpoints").glob(".*"))


# ----------------------------------------------------------------------------------------------
# A rewrite cut between its two renames


class _Died(Exception):
    """Stands for a process killed at that point (a second SIGINT exits with os._exit)."""


def test_a_rewrite_cut_between_its_two_renames_keeps_a_usable_checkpoint(tiny_model, tiny_model_dir, tiny_data_file,
                                                                        tmp_path, monkeypatch):
    model, _ = tiny_model
    out = tmp_path / "run"
    cfg = T.Config(model=str(tiny_model_dir), dataset=str(tiny_data_file), device="cpu", output_dir=str(out),
                   group_size=4, num_problems=3, resume="auto")
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "rollouts.jsonl").write_text("{}\n")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = T.save_checkpoint(out, 2, model, opt, cfg, next_record=2)
    saved = load_file(first / "model.safetensors")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-step-"):  # the rewrite's second rename: killed just before it
            raise _Died
        return real_rename(src, dst)
    monkeypatch.setattr(T.os, "rename", rename)
    with pytest.raises(_Died):
        T.save_checkpoint(out, 2, model, opt, cfg, next_record=2)
    monkeypatch.setattr(T.os, "rename", real_rename)
    root = out / "checkpoints"
    assert not first.exists() and {p.name.split("-step-")[0] for p in root.iterdir()} == {".old", ".tmp"}

    od = T.prepare_output_dir(cfg)  # the next start: resume=auto finds step 2 again
    try:
        assert od.resume_from == first
        T.begin_output(od, cfg)  # once everything has loaded: the leftovers go
    finally:
        T.release_output_dir(od)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]
    restored = load_file(first / "model.safetensors")
    assert all(torch.equal(restored[k], saved[k]) for k in saved)


def test_recover_checkpoint_rewrite_keeps_a_present_step_and_deletes_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step-000004", ".old-step-000004-11", ".tmp-step-000006-12", ".old-step-000002-13"):
        (root / name).mkdir(parents=True)
        (root / name / "who").write_text(name)
    T.recover_checkpoint_rewrite(root)
    assert sorted(p.name for p in root.iterdir()) == [".old-step-000004-11", ".tmp-step-000006-12", "step-000002",
                                                      "step-000004"]  # leftovers wait for begin_output
    assert (root / "step-000004" / "who").read_text() == "step-000004"      # the present one is kept
    assert (root / "step-000002" / "who").read_text() == ".old-step-000002-13"  # the missing one restored
    T.recover_checkpoint_rewrite(tmp_path / "nowhere")  # no checkpoints folder: nothing to do


def test_a_second_signal_between_the_renames_of_a_rewrite_loses_no_checkpoint(finished_run, tmp_path, capsys,
                                                                              tiny_model_dir, tiny_data_file,
                                                                              monkeypatch):
    out = copy_run(finished_run, tmp_path)
    root = out / "checkpoints"
    os.rename(root / "step-000003", root / ".old-step-000003-999")  # the first rename happened, then exit
    shutil.copytree(root / "step-000002", root / ".tmp-step-000003-999")
    shutil.rmtree(out / "final")
    first_rollout_wins(monkeypatch)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "resume=auto", "keep_last=3")) == 0
    assert "step-000003 after step 3" in capsys.readouterr().err  # put back, not deleted
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]
