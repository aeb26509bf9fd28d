"""The output folder never loses a run: nothing is deleted before the data and model have loaded,
final/ or foreign files count as a run and foreign files are never deleted, a resume path into
another run is refused, one run at a time holds its lock (also on a full disk), a failed start
leaves nothing behind, and the user's own config.yaml in it is never replaced. CPU, tiny local model."""

import fcntl
import json
import os
import re
import shutil

import pytest
import yaml

import train_rlvr as T
from run_helpers import (copy_run, first_rollout_wins, make_finished_run, one_line_error, run_args, snapshot,
                         table_rows)


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory):
    return make_finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory)


# ----------------------------------------------------------------------------------------------
# Replacing a run: overwrite, final/ and foreign files, a resume path into another run


def test_overwrite_deletes_nothing_before_the_data_and_model_have_loaded(finished_run, tmp_path, capsys,
                                                                         tiny_model_dir, tiny_data_file):
    out = copy_run(finished_run, tmp_path)
    before = snapshot(out)
    assert T.main(run_args(tiny_model_dir, tmp_path / "typo.json", out, "overwrite=true")) == 2
    one_line_error(capsys, "typo.json not found")
    assert T.main(run_args(tmp_path / "no-model", tiny_data_file, out, "overwrite=true")) == 2
    one_line_error(capsys, f"model {tmp_path / 'no-model'}: no such folder")
    assert snapshot(out) == before


def test_final_or_foreign_files_count_as_a_run_and_foreign_files_are_never_deleted(
        finished_run, tmp_path, capsys, tiny_model_dir, tiny_data_file):
    out = tmp_path / "only-final"
    shutil.copytree(finished_run[0] / "final", out / "final")
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out)) == 2
    one_line_error(capsys, "already holds a run (final/)")
    (out / "final" / "my-notes.txt").write_text("mine")
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "overwrite=true")) == 2
    one_line_error(capsys, "holds files rlvr did not write", "my-notes.txt")
    (out / "final" / "my-notes.txt").unlink()
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "README.txt").write_text("do not delete")
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "num_problems=1")) == 2
    assert "already holds a run (checkpoints/, final/)" in capsys.readouterr().err
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "num_problems=1", "overwrite=true")) == 0
    assert (out / "checkpoints" / "README.txt").read_text() == "do not delete"
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000001"]


def test_resume_path_into_another_run_is_refused_unless_overwrite(finished_run, tmp_path, capsys, tiny_model_dir,
                                                                  tiny_data_file, monkeypatch):
    other = copy_run(finished_run, tmp_path / "b")
    before = snapshot(other)
    foreign = finished_run[0] / "checkpoints" / "step-000002"
    assert T.main(run_args(tiny_model_dir, tiny_data_file, other, f"resume={foreign}")) == 2
    one_line_error(capsys, "is not a checkpoint of output_dir", "holds another run")
    assert snapshot(other) == before
    fresh = tmp_path / "fresh"  # an empty output_dir may continue any checkpoint
    first_rollout_wins(monkeypatch)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, fresh, f"resume={foreign}")) == 0
    assert table_rows(capsys.readouterr().out) == finished_run[1]


def test_a_users_config_yaml_in_output_dir_is_never_replaced_nor_deleted(tmp_path, capsys, tiny_model_dir,
                                                                        tiny_data_file):
    out = tmp_path / "exp1"
    out.mkdir()
    mine = (f"# my experiment: keep these comments\nmodel: {tiny_model_dir}  # the tiny one\n"
            f"dataset: {tiny_data_file}\ndevice: cpu\noutput_dir: {out}\ngroup_size: 4\nmax_new_tokens: 6\n"
            "num_problems: 1\n")
    (out / "config.yaml").write_text(mine)
    assert T.main(["--config", str(out / "config.yaml")]) == 0
    assert (out / "config.yaml").read_text() == mine
    saved = (out / "run_config.yaml").read_text()
    assert saved.startswith(T.RUN_CONFIG_MARK) and yaml.safe_load(saved)["group_size"] == 4
    assert T.main(["--config", str(out / "config.yaml"), "overwrite=true", "max_new_tokens=5"]) == 0  # replaces the run
    assert (out / "config.yaml").read_text() == mine
    assert yaml.safe_load((out / "run_config.yaml").read_text())["max_new_tokens"] == 5
    (out / "run_config.yaml").write_text("my own notes\n")  # a run_config.yaml rlvr did not write is not replaced
    capsys.readouterr()
    assert T.main(["--config", str(out / "config.yaml"), "overwrite=true"]) == 2
    one_line_error(capsys, f"output_dir {out} holds a run_config.yaml that rlvr did not write")
    assert (out / "run_config.yaml").read_text() == "my own notes\n" and (out / "config.yaml").read_text() == mine


# ----------------------------------------------------------------------------------------------
# The lock: one run at a time, nothing left behind by a failed start


def test_a_second_run_in_the_same_output_dir_is_refused_with_the_holders_pid(tmp_path, capsys, tiny_model_dir,
                                                                              tiny_data_file):
    out = tmp_path / "busy"
    out.mkdir()
    fd = os.open(out / T.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"4242\n")
    try:
        assert T.main(run_args(tiny_model_dir, tiny_data_file, out)) == 2
        one_line_error(capsys, f"output_dir {out} is in use by another run (pid 4242)")
    finally:
        os.close(fd)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "num_problems=1")) == 0  # released: free again


def test_the_output_dir_lock_is_exclusive_when_the_product_takes_it_twice(tmp_path):
    out = tmp_path / "run"
    fd, created = T.lock_output_dir(out)
    try:
        assert created
        with pytest.raises(T.UserError, match=rf"output_dir {re.escape(str(out))} is in use by another run "
                                              rf"\(pid {os.getpid()}\)"):
            T.lock_output_dir(out)  # the same lock again, on its own open file (as another process would): refused
        assert (out / T.LOCK_FILE).read_text() == f"{os.getpid()}\n"  # the refused second take changed nothing
    finally:
        os.close(fd)
    fd, created = T.lock_output_dir(out)  # released: free again
    os.close(fd)
    assert not created


@pytest.mark.parametrize("exists", [False, True])
def test_a_full_disk_at_the_lock_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, tiny_model_dir,
                                                                 tiny_data_file, exists):
    import errno

    out = tmp_path / "full" / "run"
    if exists:
        out.mkdir(parents=True)

    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "pwrite", no_space)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    weights = (tiny_model_dir / "model.safetensors").stat().st_size  # the need of this run's model, not Qwen3's
    assert err == [f"error: no space left in output_dir {out} (not even for its lock file .rlvr.lock): a run of "
                   f"{tiny_model_dir} needs about {10 * weights / 1e6:.1f} MB (checkpoints of {3 * weights / 1e3:.1f} kB, "
                   "keep_last + 1 = 3 of them while one is written, and final/); free some space or choose another "
                   "output_dir"]
    assert out.exists() == exists and (not exists or list(out.iterdir()) == [])
    assert (tmp_path / "full").exists() == exists  # every folder this start made is taken back, none other


def test_a_failed_start_leaves_nothing_that_blocks_the_same_command(tmp_path, capsys, tiny_model_dir,
                                                                     tiny_data_file, monkeypatch):
    out = tmp_path / "run"
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert T.main(run_args(tiny_model_dir, bad, out)) == 2                      # bad data
    assert T.main(run_args(tmp_path / "missing-model", tiny_data_file, out)) == 2  # missing model
    assert not out.exists()
    real = T.load_model_and_tokenizer
    monkeypatch.setattr(T, "load_model_and_tokenizer", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out)) == 130          # Ctrl-C while loading
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted while loading; output_dir was not changed"
    monkeypatch.setattr(T, "load_model_and_tokenizer", real)
    existing = tmp_path / "kept"
    (existing / "checkpoints").mkdir(parents=True)
    (existing / "checkpoints" / "mine.txt").write_text("x")
    assert T.main(run_args(tmp_path / "missing-model", tiny_data_file, existing, "overwrite=true")) == 2
    assert (existing / "checkpoints" / "mine.txt").exists()
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "num_problems=1")) == 0  # the same command runs


# ----------------------------------------------------------------------------------------------
# Every file a run appends to: cut back on resume, cleared on overwrite


def _top_files(out):
    return sorted(p.name for p in out.iterdir() if p.is_file() and p.name != T.LOCK_FILE)


def _records(path):
    """A log's records without the measured seconds (two runs take different times)."""
    drop = ("seconds", "timings")
    return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def every_output_run(tiny_model_dir, tiny_data_file, tmp_path_factory):
    """3 steps with every output on (token_report, evaluation before and after), checkpoints after 2 and 3."""
    out = tmp_path_factory.mktemp("every-output") / "run"
    mp = pytest.MonkeyPatch()
    first_rollout_wins(mp)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "save_every=2", "keep_last=3", "token_report=true",
                           f"eval_dataset={tiny_data_file}", "eval_problems=2", "eval_max_new_tokens=6")) == 0
    mp.undo()
    return out


def test_every_file_a_run_appends_to_is_one_that_resume_cuts_back_and_overwrite_clears(every_output_run):
    files = _top_files(every_output_run)
    # a new file at the top: list it in RUN_FILES (overwrite clears it); credit.png needs a credit setting
    assert files == sorted(set(T.RUN_FILES) - {"credit.png"})
    appended = [f for f in files if f.endswith(".jsonl")]
    assert sorted(appended) == sorted(T.APPENDED_FILES)  # a new log: list it in APPENDED_FILES (resume cuts it)
    for name in appended:  # the checkpoint keeps a copy of each, as it was after its step
        assert (every_output_run / "checkpoints" / "step-000003" / name).read_bytes() == \
            (every_output_run / name).read_bytes()


def test_a_run_killed_after_logging_a_step_resumes_to_the_same_logs(every_output_run, tmp_path, tiny_model_dir,
                                                                    tiny_data_file, monkeypatch):
    """Killed after step 3 was logged, before its checkpoint: resume=auto redoes step 3 from step 2's
    checkpoint, and every log (tokens.jsonl too) holds each step once, as the uninterrupted run's."""
    out = tmp_path / "run"
    shutil.copytree(every_output_run, out)
    shutil.rmtree(out / "checkpoints" / "step-000003")
    (out / "final").rename(tmp_path / "final-aside")  # a kill before the last checkpoint leaves no final/
    first_rollout_wins(monkeypatch)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "save_every=2", "keep_last=3", "token_report=true",
                           f"eval_dataset={tiny_data_file}", "eval_problems=2", "eval_max_new_tokens=6",
                           "resume=auto")) == 0
    tokens = _records(out / "tokens.jsonl")
    assert [r["step"] for r in tokens] == [1] * 4 + [2] * 4 + [3] * 4
    for name in T.APPENDED_FILES:
        assert _records(out / name) == _records(every_output_run / name), name


def test_overwrite_leaves_nothing_of_the_earlier_runs_token_report(every_output_run, tmp_path, tiny_model_dir,
                                                                  tiny_data_file, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(every_output_run, out)
    first_rollout_wins(monkeypatch)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "num_problems=2", "overwrite=true",
                           "token_report=true")) == 0
    assert [r["step"] for r in _records(out / "tokens.jsonl")] == [1] * 4 + [2] * 4
    assert not (out / "eval.jsonl").exists() and not (out / "eval_summary.json").exists()
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "num_problems=2", "overwrite=true")) == 0
    assert not (out / "tokens.jsonl").exists() and not (out / "tokens.png").exists()
    assert _top_files(out) == sorted([*T.LOG_FILES, T.RUN_CONFIG, "run.png"])


def test_overwrite_leaves_nothing_of_the_earlier_runs_credit_picture(tmp_path, tiny_model_dir, tiny_data_file,
                                                                    monkeypatch):
    """credit.png comes only from a credit other than the spec's: a spec run over such a run writes none, so
    overwrite=true must remove the earlier one, or the folder shows another run's token advantages."""
    out = tmp_path / "run"
    first_rollout_wins(monkeypatch)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "num_problems=1", "save_every=0", "token_report=true",
                           "credit=tree", "tree_branching=2,2")) == 0
    assert _top_files(out) == sorted([*T.LOG_FILES, T.RUN_CONFIG, "credit.png", "run.png", "tokens.jsonl",
                                      "tokens.png"])
    assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "num_problems=1", "save_every=0",
                           "overwrite=true")) == 0
    assert _top_files(out) == sorted([*T.LOG_FILES, T.RUN_CONFIG, "run.png"])


def test_every_file_of_a_run_has_the_mode_the_umask_gives(finished_run):
    """safetensors writes its files 0600; a run's weights are as readable as its other files (0644 here)."""
    out = finished_run[0]
    mask = os.umask(0)
    os.umask(mask)
    modes = {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in out.rglob("*") if p.is_file()}
    assert "final/model.safetensors" in modes and "checkpoints/step-000003/model.safetensors" in modes
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes
