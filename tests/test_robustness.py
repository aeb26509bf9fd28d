"""A fresh machine runs the default job, and no mistake, fault or corrupt file loses a run: declared
dependencies, the output folder (never replaced before everything loaded, never foreign files, a
lock), checkpoint manifests and fallback, non-finite steps, a full disk, one-line user errors, and
the compiled-decoding check. CPU, tiny local model, in-process runs."""

import ast
import fcntl
import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

import train_rlvr as T
from conftest import ROOT, SHARED


def _args(model_dir, data, out, *extra):
    return ["--config", str(ROOT / "config.yaml"), f"model={model_dir}", f"dataset={data}", "device=cpu",
            f"output_dir={out}", "group_size=4", "max_new_tokens=6", "num_problems=3", "learning_rate=1e-3", *extra]


def _first_rollout_wins(monkeypatch):
    monkeypatch.setattr(T, "score_rollouts", lambda scorer, texts, gold: [
        (1.0 if i == 0 else 0.0, None, "wrong") for i in range(len(texts))])


def _one_line_error(capsys, *fragments):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err[-1], (fragment, err[-1])
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def _rows(stdout):
    return [line.rsplit(None, 1)[0] for line in stdout.splitlines() if line[:1].isdigit()]


def _snapshot(folder):
    """Every file under folder with its bytes: what 'nothing was changed' compares."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != T.LOCK_FILE}


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tiny_data_file, tmp_path_factory):
    """A finished 3-step run with checkpoints after steps 2 and 3 (every step trains), and its table."""
    out = tmp_path_factory.mktemp("finished") / "run"
    mp = pytest.MonkeyPatch()
    _first_rollout_wins(mp)
    from io import StringIO
    import contextlib

    stdout = StringIO()
    with contextlib.redirect_stdout(stdout):
        assert T.main(_args(tiny_model_dir, tiny_data_file, out, "save_every=2", "keep_last=3")) == 0
    mp.undo()
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000002", "step-000003"]
    return out, _rows(stdout.getvalue())


def _copy_run(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    return out


# ----------------------------------------------------------------------------------------------
# 1. Every direct import is declared; the default job gets as far as the network


def _requirements(name="requirements.txt"):
    from packaging.requirements import Requirement

    lines = [l.split("#")[0].strip() for l in (ROOT / name).read_text().splitlines()]
    return [Requirement(l) for l in lines if l]


def _canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_direct_import_of_the_product_is_a_declared_requirement():
    """A module-level import is in requirements.txt; an optional package (report_to's trackers, matplotlib for
    run.png), imported inside the function that needs it, is in requirements-test.txt instead."""
    from importlib.metadata import packages_distributions

    declared = {_canonical(r.name) for r in _requirements()}
    optional = {_canonical(r.name) for r in _requirements("requirements-test.txt")} - {"pytest"}
    owners = packages_distributions()
    for source in ("train_rlvr.py", "verifier.py", "tests/tiny_models.py"):
        tree = ast.parse((ROOT / source).read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("verifier", "train_rlvr", "tiny_models", "__future__"):
                    continue
                assert top in owners, f"{source} imports {top}, which no installed distribution provides"
                dists = {_canonical(d) for d in owners[top]}
                if dists & optional:
                    assert node not in tree.body, f"{source} imports the optional {top} at module level"
                    continue
                assert dists & declared, \
                    f"{source} imports {top} ({owners[top]}) but requirements.txt does not declare it"


def _closure(requirements):
    """The distributions requirements.txt brings in, with all they require (markers evaluated)."""
    from importlib.metadata import PackageNotFoundError, distribution
    from packaging.requirements import Requirement

    seen, todo = set(), list(requirements)
    while todo:
        req = todo.pop()
        name = _canonical(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in distribution(req.name).requires or []]
        except PackageNotFoundError:
            pass
    return seen


DEFAULT_JOB = r"""
import json, socket, sys
sys.path.insert(0, sys.argv[1])
before = set(sys.modules)
def no_network(*a, **k):
    raise socket.gaierror(-2, "Name or service not known")
socket.getaddrinfo = no_network
import train_rlvr
code = train_rlvr.main(["device=cpu", "output_dir=" + sys.argv[2]])
from importlib.metadata import packages_distributions
owners = packages_distributions()
used = sorted({d for m in set(sys.modules) - before for d in owners.get(m.split(".")[0], [])})
print(json.dumps({"code": code, "distributions": used}))
"""


def test_the_default_job_reaches_the_network_with_only_the_declared_requirements(tmp_path):
    """CI builds its environment from requirements.txt (after the CPU torch wheel) and requirements-test.txt: here
    the default command, with the network cut, must stop at a one-line network error (not an
    ImportError), and every distribution it imported must come from requirements.txt's closure."""
    proc = subprocess.run([sys.executable, "-c", DEFAULT_JOB, str(ROOT), str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    err = proc.stderr.strip().splitlines()[-1]
    assert result["code"] == 2 and "Traceback" not in proc.stderr, proc.stderr
    copy = ", e.g. dataset=../shared/data/math_train.jsonl.gz" if (SHARED / "data" / "math_train.jsonl.gz").is_file() \
        else ""  # the offline copy beside the checkout, where there is one
    assert err == (f"error: could not load dataset {T.MATH_TRAIN_URL!r}: no network: cannot resolve "
                   "raw.githubusercontent.com (Name or service not known); connect to the internet, or download "
                   "it and set dataset: to the local file" + copy)
    # requirements-test.txt's packages (the optional trackers, matplotlib) bring more into CI's environment,
    # which a declared package imports when it is there (httpx: brotli, sniffio): tolerated; the optional
    # packages themselves are not (the default job must not import a tracker)
    tests_only = _requirements("requirements-test.txt")
    closure = _closure(_requirements()) | (_closure(tests_only) - {_canonical(r.name) for r in tests_only})
    missing = [d for d in result["distributions"] if _canonical(d) not in closure]
    assert not missing, f"the default job imported {missing}, which requirements.txt does not bring"
    assert not (tmp_path / "out").exists()  # a failed start leaves nothing behind


def test_the_default_model_offline_is_one_line(tmp_path, capsys, monkeypatch, tiny_data_file):
    import socket

    def no_network(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no retries: the hub client gives up at once
    assert T.main(["device=cpu", f"dataset={tiny_data_file}", "num_problems=2", f"output_dir={tmp_path / 'o'}"]) == 2
    _one_line_error(capsys, "could not load model 'Qwen/Qwen3-0.6B-Base'", "no network: cannot resolve huggingface.co")


@pytest.mark.parametrize("suffix", [".json.gz", ".jsonl.gz"])
def test_gzipped_json_and_jsonl_load(tmp_path, suffix):
    records = [{"problem": f"p{i}", "answer": str(i)} for i in range(5)]
    text = json.dumps(records) if suffix == ".json.gz" else "\n".join(map(json.dumps, records))
    path = tmp_path / f"data{suffix}"
    path.write_bytes(gzip.compress(text.encode()))
    problems = T.load_problems(T.Config(dataset=str(path), num_problems=5))
    assert [p["answer"] for p in problems] == ["0", "1", "2", "3", "4"]


def test_the_offline_copy_of_the_default_training_set_loads():
    path = SHARED / "data" / "math_train.jsonl.gz"
    if not path.exists():
        pytest.skip("../shared/data/math_train.jsonl.gz not present (fresh clone): offline training set not checked")
    problems = T.load_problems(T.Config(dataset=str(path), num_problems=50))
    first50 = json.loads((SHARED / "data" / "math_train_first50.json").read_text())
    assert [(p["problem"], p["answer"]) for p in problems] == [(r["problem"], r["answer"]) for r in first50]


# ----------------------------------------------------------------------------------------------
# 2. The README's commands: a plain GPU install, the CPU wheel index, the same test command as CI


def _readme_blocks():
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_commands_gpu_plain_cpu_index_and_ci_runs_the_test_command():
    blocks = _readme_blocks()
    assert blocks[0].strip() == "pip install -r requirements.txt && python train_rlvr.py"
    test_command = blocks[1].strip()
    assert "--index-url https://download.pytorch.org/whl/cpu" in test_command and test_command.endswith(
        "python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci  # CI runs exactly the README's test command
    assert re.search(r"^transformers>=5\.\d+(\.\d+)?,<5\.\d+", (ROOT / "requirements.txt").read_text(), re.M)


def test_decoding_uses_the_cache_argument_of_the_installed_transformers(tiny_model):
    import warnings

    model, _ = tiny_model
    cfg = T.Config(group_size=2, max_new_tokens=3, device="cpu", compile="false")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # 5.24 deprecates past_key_values for 5.40
        T.generate_rollouts(model, torch.tensor([1, 2, 3]), cfg, -1, T.rollout_streams(0, 1, range(2), "cpu"),
                            T.nullcontext())
    import inspect

    takes_cache = "cache" in inspect.signature(type(model).forward).parameters
    assert T.cache_arg(model) == ("cache" if takes_cache else "past_key_values")


# ----------------------------------------------------------------------------------------------
# 3. Runs lost without a word


def test_overwrite_deletes_nothing_before_the_data_and_model_have_loaded(finished_run, tmp_path, capsys,
                                                                         tiny_model_dir, tiny_data_file):
    out = _copy_run(finished_run, tmp_path)
    before = _snapshot(out)
    assert T.main(_args(tiny_model_dir, tmp_path / "typo.json", out, "overwrite=true")) == 2
    _one_line_error(capsys, "typo.json not found")
    assert T.main(_args(tmp_path / "no-model", tiny_data_file, out, "overwrite=true")) == 2
    _one_line_error(capsys, f"model {tmp_path / 'no-model'}: no such folder")
    assert _snapshot(out) == before


def test_final_or_foreign_files_count_as_a_run_and_foreign_files_are_never_deleted(
        finished_run, tmp_path, capsys, tiny_model_dir, tiny_data_file):
    out = tmp_path / "only-final"
    shutil.copytree(finished_run[0] / "final", out / "final")
    assert T.main(_args(tiny_model_dir, tiny_data_file, out)) == 2
    _one_line_error(capsys, "already holds a run (final/)")
    (out / "final" / "my-notes.txt").write_text("mine")
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "overwrite=true")) == 2
    _one_line_error(capsys, "holds files rlvr did not write", "my-notes.txt")
    (out / "final" / "my-notes.txt").unlink()
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "README.txt").write_text("do not delete")
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "num_problems=1")) == 2
    assert "already holds a run (checkpoints/, final/)" in capsys.readouterr().err
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "num_problems=1", "overwrite=true")) == 0
    assert (out / "checkpoints" / "README.txt").read_text() == "do not delete"
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000001"]


def test_resume_path_into_another_run_is_refused_unless_overwrite(finished_run, tmp_path, capsys, tiny_model_dir,
                                                                  tiny_data_file, monkeypatch):
    other = _copy_run(finished_run, tmp_path / "b")
    before = _snapshot(other)
    foreign = finished_run[0] / "checkpoints" / "step-000002"
    assert T.main(_args(tiny_model_dir, tiny_data_file, other, f"resume={foreign}")) == 2
    _one_line_error(capsys, "is not a checkpoint of output_dir", "holds another run")
    assert _snapshot(other) == before
    fresh = tmp_path / "fresh"  # an empty output_dir may continue any checkpoint
    _first_rollout_wins(monkeypatch)
    assert T.main(_args(tiny_model_dir, tiny_data_file, fresh, f"resume={foreign}")) == 0
    assert _rows(capsys.readouterr().out) == finished_run[1]


def test_a_second_run_in_the_same_output_dir_is_refused_with_the_holders_pid(tmp_path, capsys, tiny_model_dir,
                                                                              tiny_data_file):
    out = tmp_path / "busy"
    out.mkdir()
    fd = os.open(out / T.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"4242\n")
    try:
        assert T.main(_args(tiny_model_dir, tiny_data_file, out)) == 2
        _one_line_error(capsys, f"output_dir {out} is in use by another run (pid 4242)")
    finally:
        os.close(fd)
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "num_problems=1")) == 0  # released: free again


def test_a_failed_start_leaves_nothing_that_blocks_the_same_command(tmp_path, capsys, tiny_model_dir,
                                                                     tiny_data_file, monkeypatch):
    out = tmp_path / "run"
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert T.main(_args(tiny_model_dir, bad, out)) == 2                      # bad data
    assert T.main(_args(tmp_path / "missing-model", tiny_data_file, out)) == 2  # missing model
    assert not out.exists()
    real = T.load_model_and_tokenizer
    monkeypatch.setattr(T, "load_model_and_tokenizer", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert T.main(_args(tiny_model_dir, tiny_data_file, out)) == 130          # Ctrl-C while loading
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted while loading; output_dir was not changed"
    monkeypatch.setattr(T, "load_model_and_tokenizer", real)
    existing = tmp_path / "kept"
    (existing / "checkpoints").mkdir(parents=True)
    (existing / "checkpoints" / "mine.txt").write_text("x")
    assert T.main(_args(tmp_path / "missing-model", tiny_data_file, existing, "overwrite=true")) == 2
    assert (existing / "checkpoints" / "mine.txt").exists()
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "num_problems=1")) == 0  # the same command runs


# ----------------------------------------------------------------------------------------------
# 4. Corrupt or inconsistent checkpoints


def test_every_checkpoint_and_final_carry_a_verified_manifest(finished_run):
    out = finished_run[0]
    for ckpt in T.list_checkpoints(out):
        manifest = json.loads((ckpt / T.MANIFEST).read_text())
        assert set(manifest["files"]) == set(T.CHECKPOINT_FILES)
        assert manifest["files"]["model.safetensors"]["sha256"] == T.sha256_file(ckpt / "model.safetensors")
        assert T.verify_checkpoint(ckpt) is None
    assert "model.safetensors" in json.loads((out / "final" / T.MANIFEST).read_text())["files"]


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, named", [
    (lambda c: _truncate(c / "model.safetensors"), "model.safetensors has"),
    (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    (lambda c: (c / "state.json").write_text("#" * (c / "state.json").stat().st_size),  # same size, garbage
     "state.json does not match the sha256"),
    (lambda c: (c / T.MANIFEST).unlink(), "manifest.json is missing"),
])
def test_a_damaged_checkpoint_is_named_and_resume_auto_takes_the_newest_intact_one(
        finished_run, tmp_path, capsys, tiny_model_dir, tiny_data_file, damage, named, monkeypatch):
    out = _copy_run(finished_run, tmp_path)
    newest = T.list_checkpoints(out)[-1]
    damage(newest)
    shutil.rmtree(out / "final")
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, f"resume={newest}")) == 2
    _one_line_error(capsys, f"cannot resume {newest}: {named}")
    _first_rollout_wins(monkeypatch)
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "resume=auto", "save_every=2", "keep_last=3")) == 0
    captured = capsys.readouterr()
    assert f"resume=auto: skipping damaged checkpoints: step-000003 ({named}" in captured.err
    assert "resumed from" in captured.err and "step-000002 after step 2" in captured.err
    assert _rows(captured.out) == finished_run[1]  # step 3 redone: the same row
    a = load_file(out / "final" / "model.safetensors")
    b = load_file(finished_run[0] / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_step_counter_the_manifest_and_the_logs_must_agree(finished_run, tmp_path, capsys, tiny_model_dir,
                                                               tiny_data_file):
    out = _copy_run(finished_run, tmp_path)
    ckpt = T.list_checkpoints(out)[-1]
    lines = (ckpt / "metrics.jsonl").read_text().splitlines()
    (ckpt / "metrics.jsonl").write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # a line lost
    (ckpt / T.MANIFEST).unlink()
    T.write_manifest(ckpt, 3)  # consistent hashes: only the contents disagree
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, f"resume={ckpt}")) == 2
    _one_line_error(capsys, "its step counter (3), manifest (3) and metrics.jsonl (2 steps) disagree")


def test_a_checkpoint_of_another_model_is_one_line(finished_run, tmp_path, capsys, tiny_data_file):
    from tiny_models import build_tiny_qwen3, build_tiny_tokenizer

    other = tmp_path / "wider"
    other.mkdir()
    build_tiny_qwen3(other, vocab_size=len(build_tiny_tokenizer(other)), hidden_size=48, head_dim=12)
    out = _copy_run(finished_run, tmp_path)
    ckpt = T.list_checkpoints(out)[0]
    config = ckpt / "config.yaml"
    config.write_text(config.read_text().replace(str(T.yaml.safe_load(config.read_text())["model"]), str(other)))
    (ckpt / T.MANIFEST).unlink()
    T.write_manifest(ckpt, 2)
    assert T.main(_args(other, tiny_data_file, out, f"resume={ckpt}")) == 2
    _one_line_error(capsys, "model.safetensors does not fit this model and optimizer")


def test_a_second_signal_between_the_renames_of_a_rewrite_loses_no_checkpoint(finished_run, tmp_path, capsys,
                                                                              tiny_model_dir, tiny_data_file,
                                                                              monkeypatch):
    out = _copy_run(finished_run, tmp_path)
    root = out / "checkpoints"
    os.rename(root / "step-000003", root / ".old-step-000003-999")  # the first rename happened, then exit
    shutil.copytree(root / "step-000002", root / ".tmp-step-000003-999")
    shutil.rmtree(out / "final")
    _first_rollout_wins(monkeypatch)
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "resume=auto", "keep_last=3")) == 0
    assert "step-000003 after step 3" in capsys.readouterr().err  # put back, not deleted
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]


# ----------------------------------------------------------------------------------------------
# 5. Non-finite numbers


def _state(opt, params):
    return {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in params}


def test_a_step_that_makes_a_weight_non_finite_is_undone_with_its_adamw_state(tiny_model):
    model, _ = tiny_model
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    _, moved = T.optimizer_step(params, opt, 1.0)
    assert moved > 0
    weights, state = [p.detach().clone() for p in params], _state(opt, params)
    real_step = opt.step

    def overflowing_step():  # the real AdamW step (it updates every state tensor), then a weight overflows
        real_step()
        with torch.no_grad():
            params[3].view(-1)[0] = float("inf")
    opt.step = overflowing_step
    for p in params:
        p.grad = torch.randn_like(p)
    grad_norm, moved = T.optimizer_step(params, opt, 1.0)
    assert moved is None and grad_norm > 0
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    after = _state(opt, params)
    assert after.keys() == state.keys()
    for key in state:
        assert state[key].keys() == after[key].keys()
        assert all(torch.equal(after[key][k], v) if torch.is_tensor(v) else after[key][k] == v
                   for k, v in state[key].items())
    fresh = torch.optim.AdamW(params, lr=1e-3)  # the run's first step undone: no state at all
    fresh_step = fresh.step
    fresh.step = lambda: (fresh_step(), params[0].data.view(-1).__setitem__(0, float("nan")))
    assert T.optimizer_step(params, fresh, 1.0)[1] is None and len(fresh.state) == 0
    assert all(torch.equal(p, w) for p, w in zip(params, weights))


def test_a_huge_learning_rate_ends_the_run_with_a_checkpoint_and_no_traceback(tiny_model_dir, tiny_data_file,
                                                                               tmp_path, capsys, monkeypatch):
    """lr 1e30: the first update is real and finite (weights ~1e30), every later step's gradient is NaN
    and skipped, until max_bad_steps stops the run with a checkpoint. Never inf, never an IndexError."""
    _first_rollout_wins(monkeypatch)
    out = tmp_path / "run"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "learning_rate=1e30", "max_bad_steps=2")) == 1
    captured = capsys.readouterr()
    rows = [line.split() for line in captured.out.splitlines()[1:]]
    assert [r[7] for r in rows[1:]] == ["skipped", "skipped"] and float(rows[0][7]) > 1e30
    assert "inf" not in captured.out and "Traceback" not in captured.err
    assert "2 steps in a row had a non-finite loss, gradient norm or update (the last at step 3)" in captured.err
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000003"]


def test_nan_scores_in_generation_stop_with_a_checkpoint_never_an_out_of_range_token(
        tiny_model_dir, tiny_data_file, tmp_path, capsys, monkeypatch):
    _first_rollout_wins(monkeypatch)
    real, calls = T.next_token_scores, {"n": 0}

    def scores(model, ids, cache, name, **kw):  # from step 2 on, the weights give NaN scores
        calls["n"] += 1
        logits = real(model, ids, cache, name, **kw)
        return logits * float("nan") if calls["n"] > 6 else logits
    monkeypatch.setattr(T, "next_token_scores", scores)
    out = tmp_path / "run"
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "max_new_tokens=6")) == 1
    captured = capsys.readouterr()
    assert "step 2: the model's next-token scores are NaN or infinite at new token 1" in captured.err
    assert "IndexError" not in captured.err and "Traceback" not in captured.err
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000001"]
    assert "checkpoint of step 1" in captured.err and "To continue" in captured.err


# ----------------------------------------------------------------------------------------------
# 6. A full disk while writing a checkpoint


def test_a_full_disk_keeps_the_steps_names_the_space_and_resumes(tiny_model_dir, tiny_data_file, tmp_path, capsys,
                                                                  monkeypatch, finished_run):
    _first_rollout_wins(monkeypatch)
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
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "save_every=1", "keep_last=3")) == 1
    err = capsys.readouterr().err
    assert re.search(r"no space left in \S+checkpoints: a checkpoint needs about [0-9.]+ kB and 4\.1 kB are free", err)
    assert "the last checkpoint is step 1; metrics.jsonl and rollouts.jsonl keep steps 1-2" in err
    assert "To continue: python train_rlvr.py" in err and "resume=auto" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]  # no temporary folder left
    assert T.verify_checkpoint(out / "checkpoints" / "step-000001") is None
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    monkeypatch.undo()
    _first_rollout_wins(monkeypatch)
    assert T.main(_args(tiny_model_dir, tiny_data_file, out, "save_every=1", "keep_last=3", "resume=auto")) == 0
    assert _rows(capsys.readouterr().out) == finished_run[1]


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
# 7. Every user mistake is one line and exit status 2


def test_output_dir_and_config_file_mistakes(tmp_path, capsys, tiny_model_dir, tiny_data_file):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert T.main(_args(tiny_model_dir, tiny_data_file, a_file)) == 2
    _one_line_error(capsys, f"output_dir {a_file} is a file")
    assert T.main(_args(tiny_model_dir, tiny_data_file, a_file / "sub")) == 2
    _one_line_error(capsys, f"output_dir {a_file / 'sub'} cannot be written (Not a directory)")
    assert T.main(["--config", str(tmp_path)]) == 2
    _one_line_error(capsys, f"config file {tmp_path} cannot be read (Is a directory)")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("model: caf\xe9\n".encode("latin-1"))
    assert T.main(["--config", str(latin)]) == 2
    _one_line_error(capsys, "is not UTF-8 text (byte 0xe9 at offset 10)")
    assert T.main(["--config", str(ROOT / "config.yaml"), "learning_rate=1e39"]) == 2
    _one_line_error(capsys, "'learning_rate' must be a number in (0, 1e37]")


def test_a_truncated_model_file_is_one_line(tmp_path, capsys, tiny_model_dir, tiny_data_file):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    _truncate(broken / "model.safetensors")
    assert T.main(_args(broken, tiny_data_file, tmp_path / "o")) == 2
    _one_line_error(capsys, f"could not load model '{broken}'")


@pytest.mark.parametrize("content, fragment", [
    (b"", "is empty"),
    ('[{"problem": "caf\xe9", "answer": "1"}]'.encode("latin-1"), "is not UTF-8 text (byte 0xe9 on line 1)"),
    (b'{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": "2"}\n{"problem": "c" "answer": "3"}\n',
     "line 3 is not a JSON record"),
])
def test_data_file_mistakes_name_the_problem(tmp_path, capsys, tiny_model_dir, content, fragment):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    assert T.main(_args(tiny_model_dir, data, tmp_path / "o")) == 2
    _one_line_error(capsys, f"dataset file {data} {fragment}")


def test_a_group_that_cannot_be_allocated_is_refused_before_step_1(tmp_path, capsys, tiny_model_dir,
                                                                    tiny_data_file, monkeypatch):
    monkeypatch.setattr(T, "available_memory", lambda device: 10**6)
    assert T.main(_args(tiny_model_dir, tiny_data_file, tmp_path / "o", "group_size=512")) == 2
    _one_line_error(capsys, "group_size 512 with max_new_tokens 6 needs at least", "GB are available; lower group_size")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------
# 8. Compiled decoding is checked against eager decoding at the first generation


@pytest.mark.parametrize("fault", ["nan", "offset"])
def test_a_faulty_compiled_decoder_falls_back_to_eager_with_the_difference(tiny_model, monkeypatch, capsys, fault):
    """A compiled step off by 0.5 (a real compile) or giving NaN (no compile needed: NaN is no
    difference within the tolerance, `not worst <= tol`) is thrown away at the check, and the
    rollouts are eager's."""
    if fault == "offset" and shutil.which("g++") is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler (g++)")
    model, _ = tiny_model
    cfg = T.Config(group_size=2, max_new_tokens=6, temperature=1.0, top_p=0.9, device="cpu", compile="false")
    prompt = torch.tensor([5, 17, 33, 100, 7])

    def rollouts():
        responses, _ = T.generate_rollouts(model, prompt, cfg, -1, T.rollout_streams(0, 1, range(2), "cpu"),
                                           T.nullcontext())
        return [r.tolist() for r in responses]
    eager = rollouts()
    cfg.compile = "true"
    monkeypatch.setattr(T, "COMPILE_FAILED", [])
    T._STATIC_DECODERS.clear()
    decoder = T.static_decoder(model, T.nullcontext())
    compiled = decoder.compiled_step
    faulty = {"nan": lambda ids: decoder._forward(ids) * float("nan"), "offset": lambda ids: compiled(ids) + 0.5}
    monkeypatch.setattr(decoder, "compiled_step", faulty[fault])  # the injected fault
    try:
        assert rollouts() == eager
    finally:
        T._STATIC_DECODERS.clear()
    err = capsys.readouterr().err
    difference = "nan" if fault == "nan" else r"0\.5\d* \(tolerance [0-9.e-]+ for logits up to [0-9.]+\)"
    assert re.search(r"compiled decoding failed \(RuntimeError: its logits differ from eager decoding by "
                     + difference + r".*; decoding eagerly", err), err
    assert T.COMPILE_FAILED
    monkeypatch.setattr(T, "COMPILE_FAILED", [])
    healthy = T.static_decoder(model, T.nullcontext())
    assert rollouts() == eager and healthy.checked and not T.COMPILE_FAILED  # an honest compile passes
    T._STATIC_DECODERS.clear()


# ----------------------------------------------------------------------------------------------
# 9. What a start never does: replace the user's config.yaml, leave a lock behind on a full disk,
#    share the lock, score a list answer 0 forever, ask the hub for a path, or stop only at the limit


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
    _one_line_error(capsys, f"output_dir {out} holds a run_config.yaml that rlvr did not write")
    assert (out / "run_config.yaml").read_text() == "my own notes\n" and (out / "config.yaml").read_text() == mine


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
    assert T.main(_args(tiny_model_dir, tiny_data_file, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    weights = (tiny_model_dir / "model.safetensors").stat().st_size  # the need of this run's model, not Qwen3's
    assert err == [f"error: no space left in output_dir {out} (not even for its lock file .rlvr.lock): a run of "
                   f"{tiny_model_dir} needs about {10 * weights / 1e6:.1f} MB (checkpoints of {3 * weights / 1e3:.1f} kB, "
                   "keep_last + 1 = 3 of them while one is written, and final/); free some space or choose another "
                   "output_dir"]
    assert out.exists() == exists and (not exists or list(out.iterdir()) == [])
    assert (tmp_path / "full").exists() == exists  # every folder this start made is taken back, none other


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


def _check(problems, tokenizer, **settings):
    return T.check_problems([dict(p, index=i) for i, p in enumerate(problems)], T.Config(**settings), tokenizer, 2048)


def test_list_and_boolean_answers_are_refused_numbers_still_work(tiny_model, tmp_path, capsys, tiny_model_dir):
    _, tok = tiny_model
    good = _check([{"problem": "1+4?", "answer": 5}, {"problem": "half?", "answer": 0.5},
                   {"problem": "x", "answer": "7"}], tok)
    assert [p["answer"] for p in good] == ["5", "0.5", "7"]
    with pytest.raises(T.UserError) as e:
        _check([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": ["5"]}, {"problem": "c", "answer": True}],
               tok)
    assert str(e.value) == ("dataset record 1: 'answer' is a JSON list (['5']), not a text or a number (write several "
                            "answers as one text, e.g. \"3, 5\") (and 1 more); fix the data, move start_index, or set "
                            "bad_records: skip")
    with pytest.raises(T.UserError, match=r"^eval_dataset record 0: 'answer' is a JSON boolean \(False\), .*; fix the "
                                          r"data, or set bad_records: skip$"):
        T.check_problems([{"index": 0, "problem": "p", "answer": False}], T.Config(), tok, 2048, 64, "eval_dataset")
    kept = _check([{"problem": "a", "answer": ["5"]}, {"problem": "b", "answer": 3},
                   {"problem": "c", "answer": {"x": 1}}], tok, bad_records="skip")
    assert [(p["index"], p["answer"]) for p in kept] == [(1, "3")]
    assert "skipping dataset record 2: 'answer' is a JSON object ({'x': 1})" in capsys.readouterr().err
    data = tmp_path / "lists.json"  # through datasets, as a user's file arrives
    data.write_text(json.dumps([{"problem": f"p{i}", "answer": [str(i)]} for i in range(3)]))
    assert T.main(_args(tiny_model_dir, data, tmp_path / "o")) == 2
    _one_line_error(capsys, "dataset record 0: 'answer' is a JSON list (['0'])", "(and 2 more)")
    assert not (tmp_path / "o").exists()


def test_a_too_large_max_new_tokens_is_named_first(tiny_model):
    _, tok = tiny_model
    with pytest.raises(T.UserError) as e:
        _check([{"problem": "What is 1 + 1?", "answer": "2"}], tok, max_new_tokens=100000)
    assert str(e.value).endswith("with max_new_tokens 100000 it exceeds the model's context of 2048; lower "
                                 "max_new_tokens, move start_index, or set bad_records: skip")
    with pytest.raises(T.UserError) as e:  # the advice is for the first record named
        _check([{"problem": "a", "answer": [2]}, {"problem": "What is 1 + 1?", "answer": "2"}], tok,
               max_new_tokens=100000)
    assert str(e.value).endswith("(and 1 more); fix the data, move start_index, or set bad_records: skip")


def test_an_eos_token_that_is_not_the_models_is_warned_once(tiny_model, tiny_model_dir, tiny_data_file, tmp_path,
                                                           capsys):
    model, tok = tiny_model
    other = tok.convert_ids_to_tokens(5)
    assert T.main(_args(tiny_model_dir, tiny_data_file, tmp_path / "a", "num_problems=1", f"eos_token={other}")) == 0
    warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning: eos_token")]
    assert warnings == [f"warning: eos_token {other!r} (id 5) is not the EOS of {tiny_model_dir}'s generation config "
                        "('<|endoftext|>' (id 0)); rollouts that never produce it run to max_new_tokens"]
    assert T.main(_args(tiny_model_dir, tiny_data_file, tmp_path / "b", "num_problems=1")) == 0
    assert "warning: eos_token" not in capsys.readouterr().err
    model.generation_config.eos_token_id = [0, 5]  # a list of ends (e.g. an instruct model's two)
    T.warn_if_not_model_eos(model, tok, T.Config(eos_token=other), 5)
    assert capsys.readouterr().err == ""
    T.warn_if_not_model_eos(model, tok, T.Config(eos_token="x"), 7)
    assert "('<|endoftext|>' (id 0), " in capsys.readouterr().err


def test_path_like_values_are_local_paths_hub_ids_are_org_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert [T.missing_local_path(v) for v in ("Qwen/Qwen3-0.6B-Base", "gpt2", "runs", "https://x.org/a/b.json")] == \
        [None] * 4
    assert [T.missing_local_path(v) for v in ("runs/dmeo", "./demo", "../demo", "/nope/model", "~/m", "a/b/c",
                                              "org/", "a\\b")] == \
        ["read as a path, since runs/ is a folder here"] + ["read as a path: a hub id is org/name"] * 7


def _no_network(monkeypatch):
    import socket

    def no_network(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)


def test_a_mistyped_model_path_and_the_hub_offline_are_one_line_at_once(tmp_path, capfd, caplog, monkeypatch,
                                                                        tiny_data_file):
    """No network and no HF_HUB_OFFLINE: the hub client alone retries for ~50 s (24 lines) per model."""
    import transformers

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    asked = []
    real = transformers.AutoTokenizer.from_pretrained

    def tokenizer(name, **kwargs):
        asked.append((name, kwargs.get("local_files_only")))
        return real(name, **kwargs)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    _no_network(monkeypatch)
    args = ["--config", str(ROOT / "config.yaml"), "device=cpu", f"dataset={tiny_data_file}", "num_problems=2",
            f"output_dir={tmp_path / 'o'}"]
    assert T.main([*args, "model=runs/dmeo"]) == 2
    assert capfd.readouterr().err.splitlines() == [
        "loading runs/dmeo on cpu (fp32)",
        "error: model runs/dmeo: no such folder (read as a path, since runs/ is a folder here); set model: to a local "
        "model folder or a hub id"]
    assert asked == []  # the hub was not asked for a path
    assert T.main([*args, "model=someone/no-such-model"]) == 2
    assert capfd.readouterr().err.splitlines()[1:] == [
        "error: could not load model 'someone/no-such-model' at revision 'da87bfb608c14b7cf20ba1ce41287e8de496c0cd': "
        "it is not in the local hub cache; no network: cannot resolve huggingface.co (Name or service not known); "
        "connect, or set model: to a local folder of the model (config, tokenizer, weights)"]
    assert asked == [("someone/no-such-model", True)]  # the local cache only: no retries
    assert not [r for r in caplog.records if "Retry" in r.getMessage()]
    assert not (tmp_path / "o").exists()


def test_the_default_evaluation_set_offline_is_one_line_naming_a_local_copy(tmp_path, capfd, caplog, monkeypatch,
                                                                             tiny_model_dir, tiny_data_file):
    import datasets
    import huggingface_hub.constants

    asked, real = [], datasets.load_dataset

    def load_dataset(name, **kwargs):
        asked.append((name, huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE))
        return real(name, **kwargs)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    _no_network(monkeypatch)
    monkeypatch.chdir(ROOT)
    assert T.main(_args(tiny_model_dir, tiny_data_file, tmp_path / "o", "eval_problems=4")) == 2
    hint = ", e.g. eval_dataset=../shared/data/math500_test.json" if (SHARED / "data" / "math500_test.json").is_file() \
        else ""
    assert capfd.readouterr().err.splitlines() == [
        "error: could not load eval_dataset 'HuggingFaceH4/MATH-500': no network: cannot resolve huggingface.co (Name "
        "or service not known); connect to the internet, or download it and set eval_dataset: to the local file" + hint]
    assert asked == [("HuggingFaceH4/MATH-500", True, True)]  # the local cache only, at once
    assert not [r for r in caplog.records if "Retry" in r.getMessage()]
    assert T.main(_args(tiny_model_dir, tiny_data_file, tmp_path / "o", "eval_problems=4", "eval_dataset=./m500")) == 2
    assert capfd.readouterr().err.splitlines()[-1].startswith("error: eval_dataset ./m500: no such file or folder")


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
