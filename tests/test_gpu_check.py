"""benchmarks/gpu_check.py on the CPU with a tiny model: every section runs train_rlvr.main() (or
torch.distributed) end to end, and its JSON holds real numbers consistent with what the runs wrote,
so the check that a GPU session runs cannot rot in between."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SHARED, bf16_attention_problem, build_tiny_tokenizer

SECTIONS = ["train-compiled", "train-batched", "train-eager", "eval", "nccl", "train-bf16"]


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
    """The real problems when ../shared has them, else small files of the same fields (24 training problems: the
    train-batched section's --steps 3 x 8 by default, which the argument check asks for)."""
    train, test = SHARED / "data" / "math_train_first50.json", SHARED / "data" / "math500_test.json"
    if train.exists() and test.exists():
        return train, test
    train, test = tmp_path / "train.json", tmp_path / "test.jsonl"
    train.write_text(json.dumps([{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(24)]))
    test.write_text("\n".join(json.dumps({"problem": f"What is {i} * 3?", "answer": str(3 * i), "level": 1,
                                          "subject": "Algebra"}) for i in range(6)))
    return train, test


def check_cmd(tmp_path, *flags):
    config_dir, vocab = tiny_config_dir(tmp_path / "config")
    train, test = problem_files(tmp_path)
    return [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", "--config-dir", str(config_dir),
            "--problems", str(train), "--eval-problems", str(test), *flags], vocab


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gpu_check_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "out" / "result.json"
    cmd, vocab = check_cmd(tmp_path, "--cpu-compile", "--steps", "2", "--problems-per-step", "2", "--json", str(out),
                           "--work", str(tmp_path / "work"))
    # TORCH_COMPILE_DISABLE: the compiled sections run their code (StaticDecoder, the check) without Inductor
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, TORCH_COMPILE_DISABLE="1"), capture_output=True,
                          text=True, timeout=600)
    # where bfloat16 attention cannot run on this CPU's chosen kernels (conftest), train-bf16 fails and says so
    bf16_fails = bf16_attention_problem() is not None
    assert proc.returncode == int(bf16_fails), proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert list(r["sections"]) == SECTIONS
    assert {name: s["status"] for name, s in r["sections"].items()} == {
        name: "failed (exit 1)" if name == "train-bf16" and bf16_fails else "ok" for name in SECTIONS}
    assert r["env"]["torch"] == torch.__version__ and r["env"]["device"] == "cpu" and r["env"]["gpu"] is None
    assert r["model"]["layers"] == 2 and r["model"]["hidden"] == 64 and r["model"]["vocab"] == vocab
    assert r["table"] in proc.stdout and all(name in r["table"] for name in SECTIONS)
    logs = out.parent / "result_logs"
    assert not (tmp_path / "work" / "runs" / "train-eager").exists()  # each run's folder goes after its section

    for name, compile_, precision in (("train-compiled", "true", "auto"), ("train-batched", "true", "auto"),
                                      ("train-eager", "false", "auto"), ("train-bf16", "true", "bf16")):
        if name == "train-bf16" and bf16_fails:
            continue
        sec = r["sections"][name]
        per_step = 2 if name == "train-batched" else 1  # problems_per_step: 2 problems a step, 4 in all
        assert {f"compile={compile_}", f"precision={precision}", f"num_problems={2 * per_step}", "max_new_tokens=8",
                "group_size=8", "kl_coef=0.01"} <= set(sec["command"])
        assert ("problems_per_step=2" in sec["command"]) == (per_step == 2)
        s, metrics = sec["summary"], read_jsonl(logs / f"{name}.metrics.jsonl")
        assert s["steps"] == 2 and [m["step"] for m in metrics] == [1, 2]
        assert s["compile_fallback"] is None and s["log_counts"]["tracebacks"] == 0
        assert s["peak_memory"]["rss_bytes"] > 0 and s["peak_memory"]["cuda_allocated_bytes"] is None
        assert "loading the reference model for the KL term" in (logs / f"{name}.log").read_text()
        for p, m in zip(s["per_step"], metrics):
            assert p["seconds"] == m["seconds"] and p["generation_seconds"] == m["timings"]["generation"]
            assert p["response_tokens"] == m["response_tokens"] and p["cut_at_limit"] == m["cut_at_limit"]
            assert close(p["tokens_per_s"], p["response_tokens"] / p["generation_seconds"])
            # 8 rollouts a problem of at most 8 tokens (--tiny), each one cut at the limit holds all 8
            assert p["problems"] == per_step == len(m.get("problems", [0]))
            assert 8 * p["cut_at_limit"] <= p["response_tokens"] <= per_step * 8 * 8
            assert p["cut_at_limit"] <= per_step * 8
            assert p["seconds"] >= p["generation_seconds"] + p["logprob_backward_seconds"] + p["optimizer_seconds"]
            assert p["logprob_backward_seconds"] > 0 and p["kl"] is not None and math.isfinite(p["kl"])
        # zero rewards everywhere; kl_coef's term alone makes the gradient: zero at step 1 (reference = policy)
        assert all(m["reward_mean"] == 0 for m in metrics) and s["per_step"][0]["grad_norm"] == 0
        later = s["per_step"][1]
        assert close(s["seconds_per_problem_after_first"], later["seconds"] / per_step)
        assert close(s["tokens_per_s_after_first"], later["tokens_per_s"])
        assert close(s["first_step_extra_generation_seconds"],
                     s["per_step"][0]["generation_seconds"] - later["generation_seconds"])
        assert s["cut_at_limit_last_step"] == later["cut_at_limit"]

    ev = r["sections"]["eval"]["summary"]
    records = read_jsonl(logs / "eval.eval.jsonl")
    assert {"num_problems=0", "eval_problems=4", "eval_max_new_tokens=64", "eval_batch_size=2"} <= set(
        r["sections"]["eval"]["command"])
    assert ev["problems"] == len(records) == 4 and ev["tokens"] == sum(x["tokens"] for x in records) <= 4 * 64
    assert ev["cut_at_limit"] == sum(x["cut_at_limit"] for x in records)
    assert close(ev["seconds"], ev["tokens"] / ev["printed_tokens_per_s"])
    # the run printed its seconds to 0.1 s and its problems/s to 0.01; tokens/s (an integer) gives the digits
    rel = 0.5 / (ev["printed_tokens_per_s"] - 0.5)  # how far tokens / the rounded tokens/s may lie from the truth
    assert abs(ev["seconds"] - ev["printed_seconds"]) <= 0.05 + ev["seconds"] * rel + 1e-9
    assert abs(ev["problems_per_s"] - ev["printed_problems_per_s"]) <= 0.005 + ev["problems_per_s"] * rel + 1e-9
    assert close(ev["problems_per_s"], 4 / ev["seconds"])
    assert close(ev["extrapolated_500_seconds"], 500 * ev["seconds"] / 4)
    assert ev["peak_memory"]["rss_bytes"] > 0

    nccl = r["sections"]["nccl"]["summary"]
    assert nccl["backend"] == "gloo" and nccl["ok"] is True and nccl["init_seconds"] >= 0


def test_gpu_check_past_its_time_limit_skips_and_exits_1(tmp_path):
    out = tmp_path / "r.json"
    cmd, _ = check_cmd(tmp_path, "--time-limit", "0", "--sections", "nccl,eval", "--json", str(out))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert list(r["sections"]) == ["nccl", "eval"]
    assert all(s["status"].startswith("skipped") for s in r["sections"].values())


@pytest.mark.parametrize("flags, message", [
    (["--config-dir", "/no/such/folder"], "--config-dir /no/such/folder: no config.json there"),
    (["--eval-count", "100000"], "needs 100000 records with fields problem and answer"),
    (["--sections", "train,eval"], "--sections: unknown section train"),
    (["--problems", "/no/such/file.parquet"], "--problems /no/such/file.parquet: no such .json/.jsonl(.gz) file"),
])
def test_gpu_check_bad_arguments_are_one_line_and_exit_2(tmp_path, flags, message):
    cmd, _ = check_cmd(tmp_path, "--json", str(tmp_path / "r.json"), *flags)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and message in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_the_h100_figures_in_the_docs_are_the_records():
    """docs/speed.md's H100 table and the README's figures, read back from benchmarks/gpu_check_h100.json."""
    record = json.loads((ROOT / "benchmarks" / "gpu_check_h100.json").read_text())
    sections = record["second_call"]["result"]["sections"]
    assert record["second_call"]["result"]["env"]["gpu"] == "NVIDIA H100 80GB HBM3"
    docs = (ROOT / "docs" / "speed.md").read_text()
    for name in ("train-compiled", "train-eager"):
        s = sections[name]["summary"]
        step1, step2 = s["per_step"]
        row = next(line for line in docs.splitlines() if line.startswith(f"| `{name}`"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:] == [f"{step1['seconds']:.2f}", f"{step2['seconds']:.2f}", f"{step2['tokens_per_s']:,.0f}",
                             f"{step2['logprob_backward_seconds']:.2f}", f"{step2['optimizer_seconds']:.3f}",
                             f"{s['peak_memory']['cuda_allocated_bytes'] / 1e9:.1f} GB"], name
    compiled, eager = (sections[n]["summary"]["per_step"][1] for n in ("train-compiled", "train-eager"))
    first_extra = sections["train-compiled"]["summary"]["first_step_extra_generation_seconds"]
    assert f"{compiled['tokens_per_s'] / eager['tokens_per_s']:.1f}x eager's tokens" in docs
    assert f"({eager['seconds'] / compiled['seconds']:.1f}x)" in docs
    assert f"{first_extra:.1f} s more generation" in docs
    evaluation = sections["eval"]["summary"]
    assert f"{evaluation['tokens']:,} tokens in {evaluation['seconds']:.1f} s ({evaluation['printed_tokens_per_s']}" in docs
    readme = (ROOT / "README.md").read_text()
    assert (f"took {compiled['seconds']:.1f} s with the compiled decode ({compiled['tokens_per_s']:,.0f} generated "
            f"tokens/s) against {eager['seconds']:.1f} s eager ({eager['tokens_per_s']:.0f} tokens/s)") in " ".join(
        readme.split())
    assert f"compiling cost the first step {first_extra:.0f} s" in readme
