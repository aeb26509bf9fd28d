"""The GPU check: what only a GPU can answer, read from train_rlvr's own runs, in one command.

    python benchmarks/gpu_check.py --config-dir bench_out/gpu/qwen3-0.6b-base \\
        --problems bench_out/gpu/math_train_first50.json --eval-problems bench_out/gpu/math500_test.json \\
        --json bench_out/gpu/result.json                       # add --sections eval,train-bf16 to finish one
    python benchmarks/gpu_check.py --device cpu --tiny ...    # the CPU test's run

No network, no `datasets` (train_rlvr reads local .json/.jsonl(.gz) itself), no ../shared: the config
+ tokenizer folder and the problem files are arguments. It saves a random-weight model of the
folder's architecture (bfloat16; --tiny: 2 layers, hidden 64), then runs each section as
train_rlvr.main([key=value, ...]) in its own process with its own timeout (a crash or hang loses
that section only). Nothing of train_rlvr is patched: each section's command lists its settings.

  train-compiled  --steps (3) steps, 8 rollouts x --new-tokens (512), compile=auto (CUDA: the compiled
                  decode, checked against eager at step 1; --cpu-compile: compile=true on the CPU),
                  TORCH_LOGS=recompiles,graph_breaks,cudagraphs
  train-batched   train-compiled with problems_per_step=--problems-per-step (8): 8 problems' 64 rollouts in
                  one decode a step, --steps x 8 problems; seconds_per_problem_after_first against train-compiled's
  train-eager     the same with compile=false
  eval            num_problems=0: --eval-count (32) problems, --eval-tokens (2048) new tokens at most,
                  batches of --eval-batch (16); the time for 500 extrapolated
  nccl            torch.distributed alone at world size 1 (gloo on the CPU): all_reduce,
                  all_gather_object, barrier
  train-bf16      train-compiled with precision=bf16

A random model scores 0 on every rollout: every group has zero variance, and the spec's step skips
its backward. So the training sections set kl_coef (--kl-coef, 0.01): the KL term has a gradient in
a zero-variance group, and every response takes its forward + backward. It costs a reference copy
of the weights and its no-grad forward per response (inside logprob_backward). Policy and
reference are equal at step 1, so the gradient norm is 0 there (under bf16 weight decay rounds
away and it stays 0), but the backward runs. --kl-coef 0: the spec's step exactly, no backward.
Random weights rarely emit EOS, so nearly every response runs to its limit (see cut_at_limit).

Figures: per step seconds, generation / logprob_backward / optimizer seconds, response tokens,
cut_at_limit, norms from the run's metrics.jsonl (tokens/s = response tokens / generation seconds);
evaluation tokens from its eval.jsonl, its time from its `[eval model] ... tokens/s)` line (seconds
= tokens / that tokens/s, more digits than its printed seconds); a compile that failed its check
from the `compiled decoding failed` line (a passing check prints nothing); recompiles, graph breaks,
skipped CUDA graphs from TORCH_LOGS lines; peak memory (torch.cuda.max_memory_allocated, ru_maxrss)
read by the section's process after main() returns. Each run writes its checkpoint (save_every=0:
after the last step) and final/, in the section's wall time but no step's.

The JSON (--json) is rewritten after every section; each section's log, metrics.jsonl and
eval.jsonl lie in <json stem>_logs/. No section starts after --time-limit seconds. Exit status 0
when every section ran, 1 when one failed or was skipped, 2 for a bad argument (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

SECTIONS = ("train-compiled", "train-batched", "train-eager", "eval", "nccl", "train-bf16")
SECTION_CAP = {"train-compiled": 240, "train-batched": 240, "train-eager": 150, "eval": 200, "nccl": 60,
               "train-bf16": 200}
MIN_START_S = 20  # no section starts with less than this left of --time-limit (a process start, a model load)
TINY = dict(num_hidden_layers=2, max_window_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
GROUP = 8  # rollouts per problem: the spec's
# main(), then the peak memory that only the process which ran it can read
RUNNER = """import json, resource, sys, torch, train_rlvr
code = train_rlvr.main(sys.argv[1:])
peak = lambda f: max(map(f, range(torch.cuda.device_count()))) if torch.cuda.is_initialized() else None
print("gpu_check peak " + json.dumps({"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      "cuda_allocated_bytes": peak(torch.cuda.max_memory_allocated),
      "cuda_reserved_bytes": peak(torch.cuda.max_memory_reserved)}), file=sys.stderr, flush=True)
sys.exit(code)
"""
# what the table shows of a section's summary (the JSON holds all of it)
TABLE = ("seconds_per_step", "seconds_per_problem_after_first", "tokens_per_s_after_first", "first_step_extra_generation_seconds",
         "logprob_backward_seconds_last_step", "optimizer_seconds_last_step", "cut_at_limit_last_step",
         "compile_fallback", "problems", "tokens", "cut_at_limit", "seconds", "problems_per_s",
         "extrapolated_500_seconds", "peak_memory", "log_counts", "backend", "init_seconds", "ok")
LOG_PATTERNS = {"recompiles": "Recompiling function", "graph_breaks": "Graph break",
                "cudagraph_skips": "skipping cudagraph", "tracebacks": "Traceback (most recent call last)"}


class BadArgument(Exception):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config-dir", default=str(SHARED / "qwen3-0.6b-base"), help="config.json + tokenizer files")
    p.add_argument("--problems", default=str(SHARED / "data" / "math_train_first50.json"),
                   help="training problems, .json/.jsonl(.gz) with fields problem and answer")
    p.add_argument("--eval-problems", default=str(SHARED / "data" / "math500_test.json"), help="MATH-500 problems")
    p.add_argument("--json", default=str(ROOT / "bench_out" / "gpu" / "result.json"), help="write the results here")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-64 model of the folder's family, small sizes")
    p.add_argument("--steps", type=int, default=3, help="training steps per training section")
    p.add_argument("--new-tokens", type=int, help="max_new_tokens (default 512, --tiny 8)")
    p.add_argument("--eval-count", type=int, help="eval_problems (default 32, --tiny 4)")
    p.add_argument("--eval-tokens", type=int, help="eval_max_new_tokens (default 2048, --tiny 64)")
    p.add_argument("--eval-batch", type=int, help="eval_batch_size (default 16, --tiny 2)")
    p.add_argument("--problems-per-step", type=int, default=8,
                   help="problems_per_step of the train-batched section (train-compiled's settings otherwise)")
    p.add_argument("--kl-coef", type=float, default=0.01, help="kl_coef of the training sections (> 0: a backward)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="which sections, in this order")
    p.add_argument("--time-limit", type=float, default=450.0, help="seconds; no section starts after that")
    p.add_argument("--work", help="folder for the model and the runs (default: a temporary one, removed after)")
    p.add_argument("--cpu-compile", action="store_true", help="on the CPU, compile=true in the compiled sections")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the sections (default 1 with --tiny on the CPU)")
    p.add_argument("--nccl", help=argparse.SUPPRESS)  # the nccl section's own process: its device
    args = p.parse_args(argv)
    for key, full, tiny in (("new_tokens", 512, 8), ("eval_count", 32, 4), ("eval_tokens", 2048, 64),
                            ("eval_batch", 16, 2)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def check_args(args) -> list[str]:
    """The sections to run; a BadArgument (one line, exit 2) for anything that cannot work."""
    import torch

    import train_rlvr as T

    folder = Path(args.config_dir)
    if not (folder / "config.json").is_file():
        raise BadArgument(f"--config-dir {folder}: no config.json there; pass the folder holding the model's "
                          "config.json and tokenizer files")
    if not any(f.name.startswith("tokenizer") for f in folder.iterdir()):
        raise BadArgument(f"--config-dir {folder}: no tokenizer files there; copy them beside config.json")
    for key in ("steps", "new_tokens", "eval_count", "eval_tokens", "eval_batch", "problems_per_step"):
        if getattr(args, key) < 1:
            raise BadArgument(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    batched = "train-batched" in args.sections.split(",")
    for flag, path, need in (("--problems", args.problems, args.steps * (args.problems_per_step if batched else 1)),
                             ("--eval-problems", args.eval_problems, args.eval_count)):
        if T.data_builder(path) != "json" or not Path(path).is_file():
            raise BadArgument(f"{flag} {path}: no such .json/.jsonl(.gz) file (what train_rlvr reads without datasets)")
        try:  # the trainer's own reader, as its main() calls it
            T.load_records(path, "train", {"problem_field": "problem", "answer_field": "answer"}, 0, need)
        except T.UserError as e:
            raise BadArgument(f"{flag} {path}: needs {need} records with fields problem and answer ({e})")
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise BadArgument(f"--sections: unknown section {unknown[0] if unknown else '(none)'}; "
                          f"choose from {','.join(SECTIONS)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise BadArgument(f"--device {args.device}: this machine has no CUDA GPU; pass --device cpu (with --tiny)")
    return names


def shown(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {shown(v)}" for k, v in value.items() if v is not None)
    if isinstance(value, list):
        return ", ".join(map(shown, value))
    return f"{value:.4g}" if isinstance(value, float) else str(value)[:100]


def write_json(path: Path, data: dict) -> None:
    path.with_name(path.name + ".tmp").write_text(json.dumps(data, indent=1))
    os.replace(path.with_name(path.name + ".tmp"), path)


def environment(device) -> dict:
    import torch
    import transformers

    gpu = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "device": str(device), "cpu_count": os.cpu_count(), "gpu": gpu and gpu.name,
            "gpu_memory_bytes": gpu and gpu.total_memory, "capability": gpu and f"{gpu.major}.{gpu.minor}"}


def build_model(config_dir: Path, folder: Path, tiny: bool, device) -> dict:
    """config.json as it is (or made tiny) with random weights, the tokenizer files beside them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    for f in config_dir.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in (
                "generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")):
            shutil.copyfile(f, folder / f.name)  # copyfile: the copy is writable whatever the source's mode
    values = json.loads((config_dir / "config.json").read_text())
    if tiny:
        values.update(TINY)
        values.pop("layer_types", None)  # derived from num_hidden_layers
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    with device if device.type == "cuda" else torch.device("cpu"):  # random init is fast on the GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters()), "layers": config.num_hidden_layers,
            "hidden": config.hidden_size, "vocab": config.vocab_size}


def settings(name: str, args, device, model_dir: Path, out: Path) -> list[str]:
    """The section's settings: what a user would type after `python train_rlvr.py`."""
    common = [f"model={model_dir}", f"device={device}", f"output_dir={out}", "overwrite=true"]
    if name == "eval":
        return common + ["num_problems=0", f"eval_dataset={Path(args.eval_problems).resolve()}",
                         f"eval_problems={args.eval_count}", f"eval_max_new_tokens={args.eval_tokens}",
                         f"eval_batch_size={args.eval_batch}"]
    compile_ = "false" if name == "train-eager" else "true" if device.type == "cpu" and args.cpu_compile else "auto"
    per_step = args.problems_per_step if name == "train-batched" else 1  # P problems' rollouts in one decode
    return common + [f"dataset={Path(args.problems).resolve()}", f"num_problems={args.steps * per_step}",
                     *([f"problems_per_step={per_step}"] if per_step > 1 else []),
                     f"max_new_tokens={args.new_tokens}", f"group_size={GROUP}", f"kl_coef={args.kl_coef}",
                     f"precision={'bf16' if name == 'train-bf16' else 'auto'}", f"compile={compile_}",
                     "save_every=0", "keep_last=1"]


def run_process(cmd: list[str], env: dict, timeout: float, log: Path) -> str:
    """cmd in its own process group, stdout and stderr into `log`; returns its status."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        status = None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = f"timeout after {timeout:.0f} s"
        finally:  # a timeout, or the check itself interrupted: the section's processes go too
            for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGTERM first: the trainer stops at a safe point
                if proc.poll() is None:
                    os.killpg(proc.pid, sig)
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
    return status or ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarize_train(run: Path, text: str) -> dict:
    s = {"per_step": [{
        "seconds": m["seconds"], "generation_seconds": m["timings"]["generation"],
        "logprob_backward_seconds": m["timings"]["logprob_backward"], "optimizer_seconds": m["timings"]["optimizer"],
        "response_tokens": m["response_tokens"], "cut_at_limit": m["cut_at_limit"], "kl": m.get("kl"),
        "tokens_per_s": m["response_tokens"] / m["timings"]["generation"], "grad_norm": m["grad_norm"],
        "update_norm": m["update_norm"], "problems": len(m.get("problems", [m["problem_index"]]))}
        for m in read_jsonl(run / "metrics.jsonl")]}
    steps, later = s["per_step"], s["per_step"][1:] or s["per_step"]
    fallback = [line for line in text.splitlines() if "compiled decoding failed" in line]
    s.update(steps=len(steps), compile_fallback=fallback[0] if fallback else None,
             seconds_per_step=[round(p["seconds"], 3) for p in steps])
    if later:
        s["seconds_per_step_after_first"] = sum(p["seconds"] for p in later) / len(later)
        s["seconds_per_problem_after_first"] = sum(p["seconds"] for p in later) / sum(p["problems"] for p in later)
        s["tokens_per_s_after_first"] = sum(p["response_tokens"] for p in later) / sum(
            p["generation_seconds"] for p in later)
        s["first_step_extra_generation_seconds"] = steps[0]["generation_seconds"] - sum(
            p["generation_seconds"] for p in later) / len(later)
        s.update({f"{k}_last_step": later[-1][k] for k in ("logprob_backward_seconds", "optimizer_seconds",
                                                           "cut_at_limit")})
    return s


def summarize_eval(run: Path, text: str) -> dict:
    records = read_jsonl(run / "eval.jsonl")
    s = {"problems": len(records), "tokens": sum(r["tokens"] for r in records),
         "cut_at_limit": sum(r["cut_at_limit"] for r in records)}
    line = re.search(r"\[eval model\].*; ([\d.]+) s \(([\d.]+) problems/s, (\d+) tokens/s\)", text)
    if not line or int(line[3]) == 0:
        return s
    s.update(printed_seconds=float(line[1]), printed_problems_per_s=float(line[2]), printed_tokens_per_s=int(line[3]))
    s["seconds"] = s["tokens"] / s["printed_tokens_per_s"]
    s.update(problems_per_s=s["problems"] / s["seconds"], extrapolated_500_seconds=500 * s["seconds"] / s["problems"])
    return s


def nccl_child(name: str) -> int:
    """The nccl section's process: torch.distributed at world size 1; one JSON line on stdout."""
    import torch
    import torch.distributed as dist

    device = torch.device(name)
    if device.type == "cuda" and device.index is None:  # set_device needs an index (torch 2.11 refuses "cuda")
        device = torch.device("cuda", torch.cuda.current_device())
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's object collectives use the current device
    t0 = time.perf_counter()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # one process: its own store
    out = {"backend": backend, "init_seconds": time.perf_counter() - t0}
    x = torch.arange(1024, dtype=torch.float32, device=device)
    dist.all_reduce(x)
    gathered = [None]
    dist.all_gather_object(gathered, {"rank": 0, "text": "é"})  # what the trainer's gather_objects does
    dist.barrier()
    out["ok"] = bool(torch.equal(x.cpu(), torch.arange(1024.0))) and gathered == [{"rank": 0, "text": "é"}]
    dist.destroy_process_group()
    print("gpu_check nccl " + json.dumps(out), flush=True)
    return 0


def run_section(name: str, args, device, work: Path, logs: Path, timeout: float, env: dict) -> dict:
    run, log, t0 = work / "runs" / name, logs / f"{name}.log", time.perf_counter()
    if name == "nccl":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--nccl", str(device)]
    else:  # --config: no config.yaml of the working folder slips into the run
        cmd = [sys.executable, "-c", RUNNER, "--config", str(work / "empty.yaml"),
               *settings(name, args, device, work / "model", run)]
    command = cmd[3:] if name != "nccl" else cmd[1:]  # a train_rlvr command line, or the check's own
    print(f"section {name}: {' '.join(command)}", file=sys.stderr, flush=True)
    if name in ("train-compiled", "train-bf16"):
        env = dict(env, TORCH_LOGS="recompiles,graph_breaks,cudagraphs")
    status = run_process(cmd, env, timeout, log)
    text = log.read_text("utf-8", "replace")
    found = {line.split(" ")[1]: json.loads(line.split(" ", 2)[2]) for line in text.splitlines()
             if line.startswith("gpu_check ")}
    if name == "nccl":
        s = found.get("nccl", {})
        ok = s.get("ok")
    else:
        s = summarize_eval(run, text) if name == "eval" else summarize_train(run, text)
        ok = s["problems"] == args.eval_count if name == "eval" else s["steps"] == args.steps
        s["peak_memory"] = found.get("peak")
        s["log_counts"] = {k: sum(p.lower() in line.lower() for line in text.splitlines())
                           for k, p in LOG_PATTERNS.items()}
        for f in ("metrics.jsonl", "eval.jsonl"):
            if (run / f).exists():
                shutil.copyfile(run / f, logs / f"{name}.{f}")
        shutil.rmtree(run, ignore_errors=True)  # a checkpoint of the real model is ~10 GB
    if status == "ok" and not ok:
        status = "failed (the run's outputs are incomplete)"
    print(f"  {name}: {status}", file=sys.stderr, flush=True)
    return {"status": status, "seconds": time.perf_counter() - t0, "command": command, "log": str(log), "summary": s}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nccl:
        return nccl_child(args.nccl)
    try:
        names = check_args(args)
    except BadArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    start, json_path, device = time.perf_counter(), Path(args.json), torch.device(args.device)
    logs = json_path.with_name(json_path.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check-")).resolve()
    (work / "runs").mkdir(parents=True, exist_ok=True)
    (work / "empty.yaml").write_text("# the GPU check passes every setting on the command line\n")
    threads = args.threads or (1 if args.tiny and device.type == "cpu" else None)  # ops too small to share
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    result = {"command": " ".join(["python", *sys.argv]), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "env": environment(device), "settings": {k: v for k, v in vars(args).items() if k != "nccl"},
              "group_size": GROUP, "sections": {}, "logs": str(logs)}
    signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(128 + sig))  # the finally clauses run
    name, code = "building the model", 1
    write_json(json_path, result)
    try:
        print(f"building the random-weight model of {args.config_dir}", file=sys.stderr, flush=True)
        result["model"] = build_model(Path(args.config_dir), work / "model", args.tiny, device)
        write_json(json_path, result)
        for name in names:
            left = args.time_limit - (time.perf_counter() - start)
            skipped = {"status": f"skipped ({left:.0f} s of --time-limit left)", "summary": {}}
            result["sections"][name] = skipped if left < MIN_START_S else run_section(
                name, args, device, work, logs, min(left, SECTION_CAP[name]), env)
            write_json(json_path, result)
        code = 0 if all(s["status"] == "ok" for s in result["sections"].values()) else 1
    except (KeyboardInterrupt, SystemExit):
        result["interrupted"] = f"during {name}; the sections before it are complete"
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    lines = [f"GPU check, {result['started']}: {result['env']['gpu'] or device}, torch {torch.__version__}, "
             f"{result.get('model', {}).get('parameters', 0) / 1e6:.1f}M random parameters; {GROUP} rollouts x "
             f"{args.new_tokens} tokens, kl_coef {args.kl_coef}"]
    for sec_name, sec in result["sections"].items():
        lines.append(f"{sec_name:16s}{'status':38s}{sec['status']} ({sec.get('seconds', 0):.0f} s)")
        lines += [f"{'':16s}{key:38s}{shown(sec['summary'][key])}" for key in TABLE if key in sec["summary"]]
    result["seconds"], result["table"] = time.perf_counter() - start, "\n".join(lines)
    write_json(json_path, result)
    print(result["table"])
    return code


if __name__ == "__main__":
    sys.exit(main())
