"""A fresh machine gets as far as the network with the declared requirements alone, and loading
says what went wrong in one line: every direct import is declared, the README's install commands
are CI's, the installed transformers' cache argument is used, the default model, training set and
evaluation set offline, gzipped and offline copies of the data, and model values read as local
paths or hub ids. CPU, tiny local model."""

import ast
import gzip
import json
import re
import subprocess
import sys

import pytest
import torch

import train_rlvr as T
from conftest import ROOT, SHARED
from run_helpers import cut_network, one_line_error, run_args


# ----------------------------------------------------------------------------------------------
# Every direct import is declared; the default job gets as far as the network


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
    for source in ("train_rlvr.py", "verifier.py", "credit.py", "tests/tiny_models.py"):
        tree = ast.parse((ROOT / source).read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("verifier", "credit", "train_rlvr", "tiny_models",
                                                              "__future__"):
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


# ----------------------------------------------------------------------------------------------
# The README's commands: a plain GPU install, the CPU wheel index, the same test command as CI


def _readme_blocks():
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_commands_gpu_plain_cpu_index_and_ci_runs_the_test_command():
    blocks = _readme_blocks()
    assert blocks[0].strip() == "pip install -r requirements.txt && python train_rlvr.py"
    test_command = blocks[1].strip()
    assert "--index-url https://download.pytorch.org/whl/cpu" in test_command and test_command.endswith(
        "python -m pytest -q -n 2")
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
# Offline: the default model and evaluation set, a mistyped model path, one line each at once


def test_the_default_model_offline_is_one_line(tmp_path, capsys, monkeypatch, tiny_data_file):
    import socket

    def no_network(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no retries: the hub client gives up at once
    assert T.main(["device=cpu", f"dataset={tiny_data_file}", "num_problems=2", f"output_dir={tmp_path / 'o'}"]) == 2
    one_line_error(capsys, "could not load model 'Qwen/Qwen3-0.6B-Base'", "no network: cannot resolve huggingface.co")


def test_path_like_values_are_local_paths_hub_ids_are_org_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert [T.missing_local_path(v) for v in ("Qwen/Qwen3-0.6B-Base", "gpt2", "runs", "https://x.org/a/b.json")] == \
        [None] * 4
    assert [T.missing_local_path(v) for v in ("runs/dmeo", "./demo", "../demo", "/nope/model", "~/m", "a/b/c",
                                              "org/", "a\\b")] == \
        ["read as a path, since runs/ is a folder here"] + ["read as a path: a hub id is org/name"] * 7


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
    cut_network(monkeypatch)
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
    cut_network(monkeypatch)
    monkeypatch.chdir(ROOT)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, tmp_path / "o", "eval_problems=4")) == 2
    hint = ", e.g. eval_dataset=../shared/data/math500_test.json" if (SHARED / "data" / "math500_test.json").is_file() \
        else ""
    assert capfd.readouterr().err.splitlines() == [
        "error: could not load eval_dataset 'HuggingFaceH4/MATH-500': no network: cannot resolve huggingface.co (Name "
        "or service not known); connect to the internet, or download it and set eval_dataset: to the local file" + hint]
    assert asked == [("HuggingFaceH4/MATH-500", True, True)]  # the local cache only, at once
    assert not [r for r in caplog.records if "Retry" in r.getMessage()]
    # another set (the GSM8K preset's) gets no hint to MATH-500's copy
    assert T.main(run_args(tiny_model_dir, tiny_data_file, tmp_path / "o", "eval_problems=4",
                           "eval_dataset=openai/gsm8k", "eval_dataset_config=main")) == 2
    assert capfd.readouterr().err.splitlines()[-1].endswith("download it and set eval_dataset: to the local file")
    assert T.main(run_args(tiny_model_dir, tiny_data_file, tmp_path / "o", "eval_problems=4", "eval_dataset=./m500")) == 2
    assert capfd.readouterr().err.splitlines()[-1].startswith("error: eval_dataset ./m500: no such file or folder")


# ----------------------------------------------------------------------------------------------
# Data files: gzipped JSON and JSON lines, the offline copy of the default training set


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
