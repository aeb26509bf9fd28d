"""benchmarks/gpu_check.py on the CPU with a tiny model (issue 17 point 10, issue 18 point 7): every
section runs through the real code paths and its JSON holds real, consistent numbers, so the check
that the first session with a GPU runs cannot rot in between."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SHARED, build_tiny_tokenizer

sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import train_rlvr as T  # noqa: E402

SECTIONS = ["train-compiled", "train-eager", "eval", "nccl", "probe", "train-bf16"]


def tiny_config_dir(folder):
    """A config + tokenizer folder like ../shared/qwen3-0.6b-base, tiny: what --config-dir takes."""
    from transformers import Qwen3Config

    folder.mkdir()
    tok = build_tiny_tokenizer(folder)
    Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=2048, tie_word_embeddings=True,
                eos_token_id=0, bos_token_id=0, pad_token_id=0).save_pretrained(folder)
    return folder, len(tok)


def problem_files(tmp_path):
    """The real problems when ../shared is here, else small files of the same fields."""
    train, test = SHARED / "data" / "math_train_first50.json", SHARED / "data" / "math500_test.json"
    if train.exists() and test.exists():
        return train, test
    train, test = tmp_path / "train.json", tmp_path / "test.jsonl"
    train.write_text(json.dumps([{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(5)]))
    test.write_text("\n".join(json.dumps({"problem": f"What is {i} * 3?", "answer": str(3 * i), "level": 1,
                                          "subject": "Algebra"}) for i in range(6)))
    return train, test


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9)


def test_gpu_check_runs_every_section_on_the_cpu(tmp_path):
    config_dir, vocab = tiny_config_dir(tmp_path / "config")
    train, test = problem_files(tmp_path)
    out = tmp_path / "out" / "result.json"
    # TORCH_COMPILE_DISABLE: the compiled sections run their code (StaticDecoder, the check) without Inductor
    env = dict(os.environ, TORCH_COMPILE_DISABLE="1")
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", "--cpu-compile",
           "--data-reader", "plain", "--steps", "2", "--config-dir", str(config_dir), "--problems", str(train),
           "--eval-problems", str(test), "--json", str(out), "--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert list(r["sections"]) == SECTIONS
    assert {name: s["status"] for name, s in r["sections"].items()} == {name: "ok" for name in SECTIONS}
    assert r["env"]["torch"] == torch.__version__ and r["env"]["device"] == "cpu" and r["env"]["gpu"] is None
    assert r["model"]["layers"] == 2 and r["model"]["hidden"] == 64 and r["model"]["vocab"] == vocab
    assert r["table"] in proc.stdout and all(name in r["table"] for name in SECTIONS)
    assert (out.parent / "result_logs" / "train-compiled.log").exists()

    for name in ("train-compiled", "train-eager", "train-bf16"):
        sec = r["sections"][name]
        s = sec["summary"]
        assert s["steps"] == 2 and s["exit_code"] == 0 and s["forced_tokens"]
        assert len(sec["patches"]) == 5 and not sec["errors"]  # plain reader, EOS, rewards, 2 x no checkpoint
        for p in s["per_step"]:
            assert p["response_tokens"] == 8 * 8  # 8 rollouts x 8 forced tokens (--tiny)
            assert close(p["generated_tokens_per_s"], p["response_tokens"] / p["generation_seconds"])
            assert p["seconds"] > p["generation_seconds"] + p["logprob_backward_seconds"] > 0
            assert p["grad_norm"] > 0 and p["update_norm"] > 0  # rollout 0 rewarded: every step trains
        later = s["per_step"][1]
        assert close(s["generated_tokens_per_s_after_first"], later["response_tokens"] / later["generation_seconds"])
        assert close(s["first_step_extra_generation_seconds"],
                     s["per_step"][0]["generation_seconds"] - later["generation_seconds"])
        assert s["peak_memory"]["bytes"] > 0
        assert s["compile_failed"] == []
        assert 0 <= s["tie_rows_per_token"] <= 8
    # the compiled sections ran the compiled-vs-eager check once, with the trainer's tolerance
    for name, dtype in (("train-compiled", "torch.float32"), ("train-bf16", "torch.bfloat16")):
        (d,), (tol,) = r["sections"][name]["summary"]["differences"], r["sections"][name]["summary"]["tolerances"]
        assert d["weights_dtype"] == dtype and math.isfinite(d["worst"]) and d["scale"] > 0
        assert tol["scale"] == d["scale"] and tol["tolerance"] == T.compiled_tolerance(d["scale"], tol["bf16"])
        assert d["worst"] <= tol["tolerance"]
    assert r["sections"]["train-eager"]["summary"]["differences"] == []

    ev = r["sections"]["eval"]["summary"]
    assert ev["problems"] == 4 and ev["tokens"] == 4 * 8 and ev["forced"]  # --tiny: 4 problems x 8 tokens
    assert ev["batch_rows"] == [2, 2]  # batches of 2
    assert close(ev["problems_per_s"], 4 / ev["seconds"]) and close(ev["tokens_per_s"], 32 / ev["seconds"])
    assert close(ev["extrapolated_500_seconds"], 500 * ev["seconds"] / 4)
    assert sum(ev["batch_seconds"]) <= ev["seconds"]

    nccl = r["sections"]["nccl"]["summary"]
    assert nccl["backend"] == "gloo" and nccl["all_reduce_ok"] and nccl["all_gather_object_ok"] and nccl["barrier_ok"]

    probe = r["sections"]["probe"]["summary"]
    assert probe["precision"] == "fp32" and not r["sections"]["probe"]["errors"]
    assert [d["precision"] for d in probe["compiled_vs_eager"]] == ["fp32", "bf16-autocast", "bf16"]
    for d in probe["compiled_vs_eager"]:
        assert d["passed"] == (d["worst"] <= d["tolerance"]) and d["compile_and_check_seconds"] > 0
    for kind in ("compiled", "eager"):
        assert probe[f"step_alone_ms_{kind}"] > 0
        whole = probe[f"whole_token_{kind}"]
        (n1, t1), (n2, t2) = sorted((int(n), t) for n, t in whole["seconds"].items())
        assert (n1, n2) == (2, 8)  # --probe-tokens 8 and a quarter of it
        assert close(whole["ms_per_token"], 1000 * (t2 - t1) / (n2 - n1))
        assert 0 <= whole["tie_rows_per_token"] <= 8
        assert set(probe[f"profile_per_token_{kind}"]) == {
            "host_syncs", "item_reads", "memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "kernel_launches",
            "graph_launches", "aten_copy"}
    opt = probe["optimizer"]
    assert opt["weights_bytes"] == 4 * r["model"]["parameters"]  # float32 master weights, tied head counted once
    assert opt["step_seconds"] > 0 and opt["buffers_on"] == "cpu"


def test_plain_reader_gives_what_datasets_gives(tmp_path, monkeypatch):
    """Without datasets the check reads the problem files itself: the same records, fields and order
    as train_rlvr.load_records through datasets, for a JSON list and a gzipped JSON Lines file."""
    import gzip

    records = [{"problem": f"p{i} \\frac{{1}}{{2}}", "answer": str(i), "level": i % 3, "subject": "Algebra"}
               for i in range(7)]
    files = [tmp_path / "list.json", tmp_path / "lines.jsonl.gz"]
    files[0].write_text(json.dumps(records))
    files[1].write_bytes(gzip.compress("\n".join(json.dumps(r) for r in records).encode()))
    if (SHARED / "data" / "math500_test.json").exists():
        files.append(SHARED / "data" / "math500_test.json")
    fields = {"problem_field": "problem", "answer_field": "answer"}
    want = [T.load_records(str(path), "train", fields, 2, 4) for path in files]
    for name in ("open_dataset", "resolve_eos_id", "score_rollouts", "save_checkpoint", "save_final"):
        monkeypatch.setattr(T, name, getattr(T, name))  # put back after the test
    notes = gpu_check.Notes(tmp_path / "notes.json")
    gpu_check.patch_trainer(T, gpu_check.parse_args(["--data-reader", "plain"]), notes)
    assert notes.data["patches"][0].startswith("open_dataset: a plain JSON reader") and not notes.data["errors"]
    got = [T.load_records(str(path), "train", fields, 2, 4) for path in files]
    assert got == want and [r["index"] for r in got[0]] == [2, 3, 4, 5]
    assert got[0][0] == dict(records[2], index=2)


@pytest.mark.parametrize("flags, message", [
    (["--config-dir", "/no/such/folder"], "--config-dir /no/such/folder: no config.json there"),
    (["--eval-count", "100000"], "needs 100000 records with fields problem and answer"),
    (["--sections", "train,eval"], "--sections: unknown section train"),
])
def test_gpu_check_bad_arguments_are_one_line_and_exit_2(tmp_path, flags, message):
    config_dir, _ = tiny_config_dir(tmp_path / "config")
    train, test = problem_files(tmp_path)
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", "--config-dir", str(config_dir),
           "--problems", str(train), "--eval-problems", str(test), "--json", str(tmp_path / "r.json"), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and message in proc.stderr
