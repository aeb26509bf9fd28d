"""A damaged or inconsistent checkpoint is named, never loaded: every checkpoint carries a verified
manifest, resume=auto skips damaged ones for the newest intact one, the step counter, manifest and
logs must agree, and a checkpoint of another model is one line. CPU, tiny local model."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import train_rlvr as T
from run_helpers import (copy_run, first_rollout_wins, make_finished_run, one_line_error, run_args, table_rows,
                         truncate)


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory):
    return make_finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory)


def test_every_checkpoint_and_final_carry_a_verified_manifest(finished_run):
    out = finished_run[0]
    for ckpt in T.list_checkpoints(out):
        manifest = json.loads((ckpt / T.MANIFEST).read_text())
        assert set(manifest["files"]) == set(T.CHECKPOINT_FILES)
        assert manifest["files"]["model.safetensors"]["sha256"] == T.sha256_file(ckpt / "model.safetensors")
        assert T.verify_checkpoint(ckpt) is None
    assert "model.safetensors" in json.loads((out / "final" / T.MANIFEST).read_text())["files"]


@pytest.mark.parametrize("damage, named", [
    (lambda c: truncate(c / "model.safetensors"), "model.safetensors has"),
    (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    (lambda c: (c / "state.json").write_text("#" * (c / "state.json").stat().st_size),  # same size, garbage
     "state.json does not match the sha256"),
    (lambda c: (c / T.MANIFEST).unlink(), "manifest.json is missing"),
])
def test_a_damaged_checkpoint_is_named_and_resume_auto_takes_the_newest_intact_one(
        finished_run, tmp_path, capsys, tiny_model_dir, tiny_data_file, damage, named, monkeypatch):
    out = copy_run(finished_run, tmp_path)
    newest = T.list_checkpoints(out)[-1]
    damage(newest)
    shutil.rmtree(out / "final")
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, f"resume={newest}")) == 2
    one_line_error(capsys, f"cannot resume {newest}: {named}")
    first_rollout_wins(monkeypatch)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "resume=auto", "save_every=2", "keep_last=3")) == 0
    captured = capsys.readouterr()
    assert f"resume=auto: skipping damaged checkpoints: step-000003 ({named}" in captured.err
    assert "resumed from" in captured.err and "step-000002 after step 2" in captured.err
    assert table_rows(captured.out) == finished_run[1]  # step 3 redone: the same row
    a = load_file(out / "final" / "model.safetensors")
    b = load_file(finished_run[0] / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_step_counter_the_manifest_and_the_logs_must_agree(finished_run, tmp_path, capsys, tiny_model_dir,
                                                               tiny_data_file):
    out = copy_run(finished_run, tmp_path)
    ckpt = T.list_checkpoints(out)[-1]
    lines = (ckpt / "metrics.jsonl").read_text().splitlines()
    (ckpt / "metrics.jsonl").write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # a line lost
    (ckpt / T.MANIFEST).unlink()
    T.write_manifest(ckpt, 3)  # consistent hashes: only the contents disagree
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, f"resume={ckpt}")) == 2
    one_line_error(capsys, "its step counter (3), manifest (3) and metrics.jsonl (2 steps) disagree")


def test_a_checkpoint_of_another_model_is_one_line(finished_run, tmp_path, capsys, tiny_data_file):
    from tiny_models import build_tiny_qwen3, build_tiny_tokenizer

    other = tmp_path / "wider"
    other.mkdir()
    build_tiny_qwen3(other, vocab_size=len(build_tiny_tokenizer(other)), hidden_size=48, head_dim=12)
    out = copy_run(finished_run, tmp_path)
    ckpt = T.list_checkpoints(out)[0]
    config = ckpt / "config.yaml"
    config.write_text(config.read_text().replace(str(T.yaml.safe_load(config.read_text())["model"]), str(other)))
    (ckpt / T.MANIFEST).unlink()
    T.write_manifest(ckpt, 2)
    assert T.main(run_args(other, tiny_data_file, out, f"resume={ckpt}")) == 2
    one_line_error(capsys, "model.safetensors does not fit this model and optimizer")
