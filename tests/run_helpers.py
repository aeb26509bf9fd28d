"""Helpers of the tests that run train_rlvr.main() in process on the tiny local model: the command
lines, fake rewards that make every step train, the one-line error check, and one finished 3-step
run with checkpoints that several test files copy and damage. Nothing here is part of the product."""

import contextlib
import shutil
from io import StringIO

import pytest

import train_rlvr as T
from conftest import ROOT


def main_args(model_dir, data, out, *extra):
    """The command line of a small run on the CPU: groups of 4, 6 new tokens."""
    return ["--config", str(ROOT / "config.yaml"), f"model={model_dir}", f"dataset={data}", "device=cpu",
            f"output_dir={out}", "group_size=4", "max_new_tokens=6", *extra]


def run_args(model_dir, data, out, *extra):
    """main_args' run of 3 problems at learning rate 1e-3."""
    return main_args(model_dir, data, out, "num_problems=3", "learning_rate=1e-3", *extra)


def first_rollout_wins(monkeypatch):
    """Rollout 0 of every group scores 1, the others 0: every step has variance, so every step trains."""
    monkeypatch.setattr(T, "score_rollouts", lambda scorer, texts, gold: [
        T.Score(1.0, None, "correct") if i == 0 else T.Score(0.0, None, "wrong") for i in range(len(texts))])


def verdict(right):
    """A fake verifier's Score: (1.0, None, "correct") or (0.0, None, "wrong"), as the real one pairs them (the
    table's correct/G counts the verdicts)."""
    return T.Score(1.0, None, "correct") if right else T.Score(0.0, None, "wrong")


def one_line_error(capsys, *fragments):
    """stderr ends with one `error: ` line holding every fragment, and no traceback; returns that line."""
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err[-1], (fragment, err[-1])
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def table_rows(stdout):
    """The rows of the step table, without their last column (the seconds)."""
    return [line.rsplit(None, 1)[0] for line in stdout.splitlines() if line[:1].isdigit()]


def snapshot(folder):
    """Every file under folder with its bytes: what 'nothing was changed' compares."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != T.LOCK_FILE}


def make_finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory):
    """A finished 3-step run with checkpoints after steps 2 and 3 (every step trains), and its table."""
    out = tmp_path_factory.mktemp("finished") / "run"
    mp = pytest.MonkeyPatch()
    first_rollout_wins(mp)
    stdout = StringIO()
    with contextlib.redirect_stdout(stdout):
        assert T.main(run_args(tiny_model_dir, tiny_data_file, out, "save_every=2", "keep_last=3")) == 0
    mp.undo()
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000002", "step-000003"]
    return out, table_rows(stdout.getvalue())


def copy_run(finished_run, tmp_path):
    """A copy of the finished run to change: tmp_path/run."""
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    return out


def truncate(path):
    """Cut the file to half its bytes, as an interrupted copy leaves it."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def cut_network(monkeypatch):
    """No host name resolves: what a machine without network gives the hub and datasets clients."""
    import socket

    def no_network(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
