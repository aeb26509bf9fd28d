"""What rlvr reads and what it needs on disk: data files read only as far as a run needs (a huge
file or one huge line costs neither time nor memory), a run's own logs read back after a crash cut
them (--plot, resume), the disk a run's checkpoints need checked before step 1, the lock file."""

import gzip
import json
import os
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

import train_rlvr as T  # noqa: E402

FIELDS = {"problem_field": "problem", "answer_field": "answer"}
RECORDS = [{"problem": f"p{i} caf\u00e9 \\frac{{1}}{{2}}", "answer": str(i), "level": i % 3} for i in range(40)]


def _args(model_dir, data, out, *extra):
    return [f"model={model_dir}", f"dataset={data}", "device=cpu", f"output_dir={out}", "group_size=2",
            "max_new_tokens=4", "num_problems=2", "save_every=0", *extra]


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and "Traceback" not in "\n".join(err), err
    return err[-1]


# ----------------------------------------------------------------------------------------------
# Data files


def _write(path: Path, text: str) -> Path:
    data = text.encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


@pytest.mark.parametrize("name, text", [
    ("list.json", json.dumps(RECORDS)),
    ("pretty.json", json.dumps(RECORDS, indent=2, ensure_ascii=False)),
    ("lines.jsonl", "\n".join(json.dumps(r, ensure_ascii=False) for r in RECORDS) + "\n"),
    ("lines.jsonl.gz", "\n".join(json.dumps(r) for r in RECORDS)),
    ("list.json.gz", json.dumps(RECORDS, ensure_ascii=False)),
    ("one.json", json.dumps(RECORDS[0], indent=1)),
])
def test_the_reader_gives_what_datasets_gives(tmp_path, name, text):
    """The same records, fields and order as datasets.load_dataset reads from the whole file."""
    import datasets

    path = _write(tmp_path / name, text)
    count = 1 if name == "one.json" else 30
    want = datasets.load_dataset("json", data_files=str(path), split="train")
    got = T.load_records(str(path), "train", FIELDS, 0, count)
    assert got == [dict(want[i], index=i) for i in range(count)]
    assert got[-1]["problem"] == RECORDS[count - 1]["problem"]


@pytest.mark.skipif(not (SHARED / "data").is_dir(), reason="../shared/data not present (fresh clone): the real "
                                                              "files' check is skipped")
def test_the_real_data_files_read_as_datasets_reads_them():
    import datasets

    for name, start, count in (("math500_test.json", 490, 10), ("math_train_first50.json", 0, 50),
                               ("math_train.jsonl.gz", 11990, 10)):
        path = SHARED / "data" / name
        want = datasets.load_dataset("json", data_files=str(path), split="train")
        assert T.load_records(str(path), "train", FIELDS, start, count) == \
            [dict(want[i], index=i) for i in range(start, start + count)]


def test_a_character_split_between_two_reads_is_whole(tmp_path, monkeypatch):
    """The array reader decodes UTF-8 incrementally: a 2-byte character across a read boundary is no error."""
    monkeypatch.setattr(T, "READ_CHUNK", 7)
    path = _write(tmp_path / "d.json", json.dumps(RECORDS[:3], ensure_ascii=False))
    assert [r["problem"] for r in T.read_json_records(path, "dataset", 3)] == [r["problem"] for r in RECORDS[:3]]


def test_only_the_records_a_run_needs_are_read(tmp_path):
    """What lies after them (a broken line, a 2 GB line) is never read."""
    lines = tmp_path / "d.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in RECORDS[:3]) + '\n{"problem": "broken\n')
    assert [r["answer"] for r in T.load_records(str(lines), "train", FIELDS, 1, 2)] == ["1", "2"]
    array = tmp_path / "d.json"
    array.write_text(json.dumps(RECORDS[:3])[:-1] + ', {"problem": nonsense')
    assert [r["answer"] for r in T.load_records(str(array), "train", FIELDS, 0, 3)] == ["0", "1", "2"]
    with pytest.raises(T.UserError, match=r"d.json is not valid JSON: Expecting value at line 1, column \d+"):
        T.load_records(str(array), "train", FIELDS, 0, 4)


@pytest.mark.parametrize("form", ["jsonl", "json"])
def test_a_huge_record_is_refused_at_the_record_limit_without_being_read(tmp_path, capsys, form):
    """A 2 GB file of one line (sparse: no disk used): one line naming the file and the limit, having read
    about the limit and no more."""
    path = tmp_path / f"big.{form}"
    with open(path, "wb") as f:
        f.write(b'[{"problem": "' if form == "json" else b'{"problem": "')
        f.truncate(2 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(T.UserError) as e:
            T.load_records(str(path), "train", FIELDS, 0, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    where = "line 1" if form == "jsonl" else "record 0"
    assert str(e.value).startswith(f"dataset file {path}: {where} is over 4 MiB, the most one record may take")
    assert peak < 4 * T.MAX_RECORD_BYTES, peak  # the window and its copies, not the file
    assert T.main(_args("unused-model", path, tmp_path / "o")) == 2
    assert f"{path}: {where} is over 4 MiB" in _error(capsys)


@pytest.mark.parametrize("content, fragment", [
    ('[{"problem": "a", "answer": "1"},\n {"problem": "b" "answer": "2"}]'.encode(),
     "is not valid JSON: Expecting ',' delimiter at line 2, column 17"),
    ('[{"problem": "a", "answer": "1"},\n {"problem": "caf\xe9", "answer": "2"}]'.encode("latin-1"),
     "is not UTF-8 text (byte 0xe9 on line 2)"),
    (b'[{"problem": "a", "answer": "1"}, 5]', "record 1 is a JSON int, not an object of fields"),
    (b'  \n ', "holds no records"),
])
def test_a_damaged_json_list_names_the_place(tmp_path, content, fragment):
    path = tmp_path / "d.json"
    path.write_bytes(content)
    with pytest.raises(T.UserError) as e:
        T.load_records(str(path), "train", FIELDS, 0, 2)
    assert str(e.value).startswith(f"dataset file {path}") and fragment in str(e.value), str(e.value)


@pytest.mark.parametrize("form", ["json", "jsonl", "parquet"])
def test_a_data_file_of_no_records_says_so_for_training_and_evaluation(tmp_path, capsys, tiny_model_dir,
                                                                      tiny_data_file, form):
    """`[]` (or a Parquet file of 0 rows) has no field either: the message names what is wrong, not a field."""
    empty = tmp_path / f"empty.{form}"
    if form == "parquet":
        import datasets
        datasets.Dataset.from_dict({"problem": [], "answer": []}).to_parquet(str(empty))
    else:
        empty.write_text("[]" if form == "json" else "\n\n")
    message = f"error: {{}} file {empty} holds no records; point {{}} at a data set with problems in it"
    for extra, setting in (([f"dataset={empty}"], "dataset"),
                           ([f"eval_dataset={empty}", "eval_problems=2"], "eval_dataset"),
                           ([f"eval_dataset={empty}", "eval_problems=2", "num_problems=0"], "eval_dataset")):
        assert T.main(_args(tiny_model_dir, tiny_data_file, tmp_path / "o", *extra)) == 2
        assert _error(capsys) == message.format(setting, setting)
        assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------
# A run's own logs, as a crash leaves them


def _metrics(step: int) -> dict:
    return {"step": step, "group_size": 2, "correct": 1, "reward_mean": 0.5, "reward_std": 0.7, "response_tokens": 8,
            "policy_loss": 0.1, "grad_norm": 1.0, "update_norm": 0.01, "skipped": False, "seconds": 1.0,
            "verifier_timeouts": 0, "verifier_crashes": 0, "timings": {"generation": 0.5}}


def _run_folder(tmp_path, tail: bytes = b"") -> Path:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_bytes(b"".join(json.dumps(_metrics(k)).encode() + b"\n" for k in (1, 2, 3)) + tail)
    return out


@pytest.mark.parametrize("tail", [b'{"step": 4, "group_si', '{"step": 4, "x": "\u00e9'.encode()[:-1]])
def test_plot_leaves_out_a_last_line_cut_by_a_crash(tmp_path, capsys, tail):
    """A write cut short, inside a character too: that line is left out with a note, the picture drawn."""
    pytest.importorskip("matplotlib")
    out = _run_folder(tmp_path, tail)
    assert T.main(["--plot", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{out / 'metrics.jsonl'}: its last line (4) was cut short by an interrupted write; left out" in err
    assert (out / "run.png").stat().st_size > 0
    assert len(T.read_jsonl(out / "metrics.jsonl")) == 3


@pytest.mark.parametrize("damage, fragment", [
    (b'{"step": 4, "caf\xe9": 1}\n', "line 4 is not UTF-8 text (byte 0xe9)"),
    (b'{"step": 4,\n', "line 4 is not a JSON record (Expecting property name enclosed in double quotes, column 12)"),
    (b'[1, 2]\n', "line 4 is not a record rlvr writes (it lacks an object)"),
    (b'{"step": 4}\n', "line 4 is not a record rlvr writes (it lacks correct)"),
])
def test_plot_names_the_file_and_line_of_any_other_damage(tmp_path, capsys, damage, fragment):
    pytest.importorskip("matplotlib")
    out = _run_folder(tmp_path, damage + json.dumps(_metrics(5)).encode() + b"\n")
    assert T.main(["--plot", str(out)]) == 2
    line = _error(capsys)
    assert f"{out / 'metrics.jsonl'} {fragment}" in line and "checkpoints/step-*/ keep a copy" in line, line


def _token_line(step: int) -> bytes:
    return json.dumps({"step": step, "problem_index": 0, "rollout": 0, "reward": 1.0, "advantage": 0.7,
                       "token_ids": [5, 6], "tokens": [" a", "b"], "before": [-1.0, -2.0],
                       "after": [-0.5, -2.5]}).encode() + b"\n"


@pytest.mark.parametrize("picture", ["run.png", "tokens.png"])
def test_plot_says_in_one_line_when_a_picture_is_a_folder(tmp_path, capsys, picture):
    pytest.importorskip("matplotlib")
    out = _run_folder(tmp_path)
    (out / "tokens.jsonl").write_bytes(_token_line(3))
    (out / picture).mkdir()
    assert T.main(["--plot", str(out)]) == 2
    assert _error(capsys) == (f"error: cannot write {out / picture} (Is a directory); move what is there away and "
                              f"draw it again with python train_rlvr.py --plot {out}")
    (out / picture).rmdir()
    assert T.main(["--plot", str(out)]) == 0
    assert (out / "run.png").is_file() and (out / "tokens.png").is_file()


@pytest.mark.parametrize("extra", [["extra=1"], ["--config", "config.yaml"]])
def test_plot_takes_no_settings(tmp_path, capsys, extra):
    out = _run_folder(tmp_path)
    assert T.main(["--plot", str(out), *extra]) == 2
    line = _error(capsys)
    assert "--plot draws a finished run's pictures from its logs and takes no settings (got " in line, line
    assert not (out / "run.png").exists()


def test_a_resume_reads_its_logs_from_the_checkpoint_whatever_a_crash_left_in_output_dir(
        tiny_model_dir, tiny_data_file, tmp_path, capsys):
    """metrics.jsonl cut in the middle of a line and eval.jsonl garbled: the checkpoint's copies are
    verified (sha256) and replace them."""
    out = tmp_path / "o"
    args = _args(tiny_model_dir, tiny_data_file, out, "num_problems=3", "save_every=1", "eval_problems=2",
                 f"eval_dataset={tiny_data_file}", "eval_max_new_tokens=3")
    assert T.main(args) == 0
    capsys.readouterr()
    want = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_bytes((out / "metrics.jsonl").read_bytes()[:-40])
    (out / "eval.jsonl").write_bytes(b"\xff\xfe garbage\n")
    T.remove_own_files(out / "checkpoints" / "step-000003")
    T.remove_own_files(out / "final")
    assert T.main([*args, "resume=auto"]) == 0, capsys.readouterr().err
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert [json.loads(x)["correct"] for x in want] == \
        [json.loads(x)["correct"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert T.read_jsonl(out / "eval.jsonl", ("step", "phase"))


# ----------------------------------------------------------------------------------------------
# Disk


def _params(model_dir) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).parameters())


def test_a_runs_disk_need_is_its_checkpoints_at_the_most_and_final(tiny_model_dir, tmp_path):
    """float32: a checkpoint is 4 + 8 bytes a parameter (weights, AdamW's two moments); up to keep_last + 1
    of them at once while one is written; final/ 4 bytes a parameter more."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    n = _params(tiny_model_dir)
    out = tmp_path / "o"
    out.mkdir()
    cfg = T.Config(save_every=10, keep_last=2)
    assert T.run_disk_need(cfg, model, out, 0, 50) == (3 * 12 * n + 4 * n, 12 * n)   # 5 writes, 3 at once
    assert T.run_disk_need(cfg, model, out, 0, 10) == (12 * n + 4 * n, 12 * n)       # one checkpoint only
    assert T.run_disk_need(T.Config(save_every=0, keep_last=5), model, out, 0, 50)[0] == 16 * n  # the last only
    for k in (10, 20):
        (out / "checkpoints" / f"step-{k:06d}").mkdir(parents=True)
    assert T.run_disk_need(cfg, model, out, 20, 50)[0] == 12 * n + 4 * n  # resumed: 2 held, 1 more at once


def test_a_disk_too_small_for_the_checkpoints_is_refused_before_step_1(tiny_model_dir, tiny_data_file, tmp_path,
                                                                      capsys, monkeypatch):
    n = _params(tiny_model_dir)
    real = T.shutil.disk_usage
    monkeypatch.setattr(T.shutil, "disk_usage", lambda p: real(p)._replace(free=16 * n - 1))
    called = []
    monkeypatch.setattr(T, "train_step", lambda *a, **k: called.append(a))
    out = tmp_path / "o"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out)) == 2
    line = _error(capsys)
    assert f"not enough space in output_dir {out}: this run's checkpoints ({12 * n / 1e3:.1f} kB each" in line
    assert 16 * n < 1e6 and f"need {16 * n / 1e3:.1f} kB and {(16 * n - 1) / 1e3:.1f} kB are free" in line, line
    assert called == [] and not out.exists()


def test_the_full_disk_message_states_the_need_of_the_model_being_run(tiny_model_dir):
    weights = (tiny_model_dir / "model.safetensors").stat().st_size
    line = T.no_room_message(Path("o"), T.Config(model=str(tiny_model_dir), keep_last=2))
    assert f"a run of {tiny_model_dir} needs about {10 * weights / 1e6:.1f} MB (checkpoints of " \
           f"{3 * weights / 1e3:.1f} kB, keep_last + 1 = 3 of them" in line
    assert "Qwen3-0.6B: about 24 GB" in T.no_room_message(Path("o"), T.Config())


# ----------------------------------------------------------------------------------------------
# The lock file


def test_the_lock_file_goes_with_the_run_and_a_removed_one_is_not_trusted(tiny_model_dir, tiny_data_file, tmp_path):
    out = tmp_path / "o"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out)) == 0
    assert not (out / T.LOCK_FILE).exists() and (out / "final").is_dir()
    fd, _ = T.lock_output_dir(out)
    try:
        assert T.same_file(fd, out / T.LOCK_FILE)
        os.unlink(out / T.LOCK_FILE)  # what the run holding it does as it ends, while we had it open
        assert not T.same_file(fd, out / T.LOCK_FILE)
        (out / T.LOCK_FILE).write_text("")
        assert not T.same_file(fd, out / T.LOCK_FILE)
    finally:
        os.close(fd)


def test_the_summary_says_which_time_covers_what():
    metrics = [dict(_metrics(k), seconds=float(k), response_tokens=10) for k in (1, 2, 3, 4)]
    line = T.format_summary(metrics, 12.5, first_step=3).splitlines()[-1]
    assert line == ("total time              10.0 s in the 4 steps (3.0 s of them before the resume); this process "
                    "12.5 s for steps 3-4 with evaluation and checkpoints; generation 40 tokens at 20.0 tokens/s")
    assert T.format_summary(metrics, 12.5).splitlines()[-1].startswith(
        "total time              10.0 s in the 4 steps, 12.5 s with evaluation and checkpoints; generation")
