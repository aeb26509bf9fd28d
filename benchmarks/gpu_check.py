"""The GPU check: what only a GPU can answer, in one command (issue 17 point 10, issue 18 point 7).

    python benchmarks/gpu_check.py --config-dir bench_out/gpu/qwen3-0.6b-base \\
        --problems bench_out/gpu/math_train_first50.json --eval-problems bench_out/gpu/math500_test.json \\
        --json bench_out/gpu/result.json
    python benchmarks/gpu_check.py --device cpu --tiny --json /tmp/gpu_check.json   # the CPU test's run

Needs no network, no `datasets` package and no ../shared: the config + tokenizer folder and the two
problem files are arguments (README, "GPU check", says how to prepare them). It writes a model of the
folder's exact architecture (Qwen3-0.6B: 28 layers, 151,936-token vocabulary) with random weights,
then runs these sections, each in its own process with its own timeout, so that a crash, a hang or
a renamed internal loses that section only:

  train-compiled  train_rlvr.main() itself: --steps steps (default 3) with compile auto (on CUDA:
                  the static-cache decode under torch.compile, checked against eager at step 1),
                  TORCH_LOGS=recompiles,graph_breaks,cudagraphs
  train-eager     the same with compile=false
  eval            main() with num_problems=0: --eval-count MATH-500 problems (32) at --eval-tokens
                  (2,048) forced tokens in batches of --eval-batch (16); problems/s, extrapolated to 500
  nccl            the NCCL backend (gloo on the CPU) at world size 1: init, all_reduce, object
                  gather, barrier (one GPU cannot show more)
  probe           in-process, on the trainer's functions: the decode step alone and a whole token by
                  CUDA events (compiled and eager), syncs, copies and launches per token from the
                  profiler, the rows per token that take top-p's tie path, the optimizer step and
                  its host transfers, the compiled-vs-eager difference in bf16 autocast, fp32, bf16
  train-bf16      main() with precision=bf16 (compile auto)

What main() runs is the real code path with four changes, made in the section's process and
printed: rollouts and evaluation never stop at EOS (resolve_eos_id runs its real check, then the
run gets id -1, as in bench_step.py: every response has exactly its token limit); rollout 0 of
every group is rewarded 1 after the real verifier has scored the texts (a random model scores 0,
and a group of equal rewards skips the backward); checkpoints and final/ are not written
(--keep-checkpoints writes them; they cost ~10 GB and ~30 s a run and nothing in them is GPU
code); without `datasets` a plain JSON reader stands in for train_rlvr.open_dataset. Timings come
from what main() writes (metrics.jsonl) and from thin wrappers that time decode and evaluate and
record the compiled-vs-eager difference: a renamed internal turns its figure into n/a.

The whole check stops starting sections after --time-limit seconds (default 450); the JSON (and
each section's log beside it, in <json stem>_logs/) is rewritten after every section and every
probe measurement, so a check cut short still returns what it measured. Exit status: 0 when every
section ran, 1 when one failed or was skipped, 2 for a bad argument.

On the CPU (--device cpu, for the test) compile auto is off; --cpu-compile turns compile on in the
compiled sections (with TORCH_COMPILE_DISABLE=1, as the test does, their code runs without Inductor).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

SECTIONS = ("train-compiled", "train-eager", "eval", "nccl", "probe", "train-bf16")
# A section gets at most this long (seconds), and never more than what is left of --time-limit.
SECTION_CAP = {"train-compiled": 240, "train-eager": 150, "eval": 200, "nccl": 60, "probe": 240, "train-bf16": 200}
MIN_START_S = 20  # a section is not started with less time than this left (a process start and a model load)
TINY = dict(num_hidden_layers=2, max_window_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
TORCH_LOGS = "recompiles,graph_breaks,cudagraphs"
GROUP = 8  # rollouts per problem: the spec's


class BadArgument(Exception):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config-dir", default=str(SHARED / "qwen3-0.6b-base"),
                   help="folder with config.json and the tokenizer files (the model's architecture)")
    p.add_argument("--problems", default=str(SHARED / "data" / "math_train_first50.json"),
                   help="training problems, .json/.jsonl(.gz) with fields problem and answer")
    p.add_argument("--eval-problems", default=str(SHARED / "data" / "math500_test.json"),
                   help="MATH-500 problems, .json/.jsonl(.gz) with fields problem and answer")
    p.add_argument("--json", default=str(ROOT / "bench_out" / "gpu" / "result.json"), help="write the results here")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-64 model of the folder's family, small sizes")
    p.add_argument("--steps", type=int, default=3, help="training steps per training section")
    p.add_argument("--new-tokens", type=int, help="forced tokens per rollout (default 512, --tiny 8)")
    p.add_argument("--eval-count", type=int, help="evaluation problems (default 32, --tiny 4)")
    p.add_argument("--eval-tokens", type=int, help="forced tokens per evaluation answer (default 2048, --tiny 8)")
    p.add_argument("--eval-batch", type=int, help="eval_batch_size (default 16, --tiny 2)")
    p.add_argument("--probe-tokens", type=int, help="tokens per timed decode in the probe (default 64, --tiny 8)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="which sections, in this order")
    p.add_argument("--time-limit", type=float, default=450.0, help="seconds; no section starts after that")
    p.add_argument("--work", help="folder for the random-weight model and the runs (default: a temporary one)")
    p.add_argument("--data-reader", default="auto", choices=("auto", "datasets", "plain"),
                   help="how main() reads the problems: auto (plain when datasets is not installed)")
    p.add_argument("--keep-checkpoints", action="store_true", help="let main() write its checkpoints and final/")
    p.add_argument("--cpu-compile", action="store_true", help="on the CPU, compile=true in the compiled sections")
    p.add_argument("--threads", type=int, help="torch threads in the sections (default: torch's; 1 with --tiny on the "
                   "CPU: a tiny model's ops are too small to share, and 2 threads on a busy machine ran 20x slower)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, full, tiny in (("new_tokens", 512, 8), ("eval_count", 32, 4), ("eval_tokens", 2048, 8),
                            ("eval_batch", 16, 2), ("probe_tokens", 64, 8)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def check_args(args) -> list[str]:
    """The sections to run; a BadArgument (one line, exit 2) for anything that cannot work."""
    folder = Path(args.config_dir)
    if not (folder / "config.json").is_file():
        raise BadArgument(f"--config-dir {folder}: no config.json there; pass the folder holding the model's "
                          "config.json and tokenizer files (README, 'GPU check')")
    try:
        json.loads((folder / "config.json").read_text())
    except (ValueError, OSError) as e:
        raise BadArgument(f"--config-dir {folder}: config.json is not readable JSON ({e}); copy it again")
    if not any(f.name.startswith("tokenizer") for f in folder.iterdir()):
        raise BadArgument(f"--config-dir {folder}: no tokenizer files there; copy tokenizer.json and "
                          "tokenizer_config.json beside config.json")
    for flag, path, need in (("--problems", args.problems, args.steps), ("--eval-problems", args.eval_problems,
                                                                          args.eval_count)):
        if not Path(path).is_file():
            raise BadArgument(f"{flag} {path}: no such file; pass a .json/.jsonl(.gz) file of problems")
        try:
            records = read_problem_file(Path(path))
        except (ValueError, OSError, EOFError) as e:  # JSON, UTF-8 and gzip errors are ValueErrors or OSErrors
            raise BadArgument(f"{flag} {path}: not a JSON or JSON Lines file of records ({e})")
        if len(records) < need or not all("problem" in r and "answer" in r for r in records[:need]):
            raise BadArgument(f"{flag} {path}: needs {need} records with fields problem and answer, "
                              f"has {len(records)}")
    for key in ("steps", "new_tokens", "eval_count", "eval_tokens", "eval_batch", "probe_tokens"):
        if getattr(args, key) < 1:
            raise BadArgument(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.probe_tokens < 8:
        raise BadArgument(f"--probe-tokens must be >= 8 (two decode lengths are compared), got {args.probe_tokens}")
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise BadArgument(f"--sections: unknown section {unknown[0] if unknown else '(none)'}; "
                          f"choose from {','.join(SECTIONS)}")
    return names


# ----------------------------------------------------------------------------------------------
# Small helpers shared by the parent and the sections


def json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(data), indent=1))
    os.replace(tmp, path)


def resolve_device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BadArgument(f"--device {name}: this machine has no CUDA GPU; pass --device cpu (with --tiny)")
    return torch.device(name)


def environment(device) -> dict:
    import importlib.util

    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "datasets": None, "cuda": torch.version.cuda, "device": str(device), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "TORCH_COMPILE_DISABLE": os.environ.get("TORCH_COMPILE_DISABLE")}
    if importlib.util.find_spec("datasets") is not None:
        try:
            import datasets

            env["datasets"] = datasets.__version__
        except Exception as e:  # installed but not importable counts as missing
            env["datasets"] = f"unusable ({type(e).__name__}: {str(e)[:80]})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}")
        try:
            version = torch.cuda.nccl.version()  # a tuple, or an int (2.18.1 -> 21801) in older torch
            env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as e:
            env["nccl"] = f"n/a ({type(e).__name__})"
    else:
        env["gpu"] = None
    return env


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)
        except OSError:
            pass


def peak_memory(device) -> dict:
    import torch

    if device.type == "cuda":
        return {"kind": "torch.cuda.max_memory_allocated", "bytes": torch.cuda.max_memory_allocated(device),
                "reserved_bytes": torch.cuda.max_memory_reserved(device)}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return {"kind": "peak RSS (VmHWM)", "bytes": int(line.split()[1]) * 1024}
    except OSError:
        pass
    return {"kind": "unknown", "bytes": None}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Seconds of the block: CUDA events on the GPU (what the GPU spent from the first to the last
    queued kernel, waited for at the end), time.perf_counter on the CPU."""

    def __init__(self, device):
        self.device, self.seconds = device, None

    def __enter__(self):
        import torch

        if self.device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            self.seconds = self.start.elapsed_time(end) / 1000
        else:
            self.seconds = time.perf_counter() - self.t0
        return False


def read_problem_file(path: Path) -> list[dict]:
    """Records of a .json (a list, or columns) or .jsonl file, gzipped or not: what main() reads
    through datasets' json builder, for machines without datasets."""
    raw = path.read_bytes()
    if path.name.lower().endswith(".gz"):
        raw = gzip.decompress(raw)
    text = raw.decode("utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):  # {"column": [values]}
        data = [dict(zip(data, row)) for row in zip(*data.values())]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError("not a list of records")
    return data


# ----------------------------------------------------------------------------------------------
# The random-weight model (parent)


def build_model(config_dir: Path, folder: Path, tiny: bool, device) -> dict:
    """config.json as it is (or made tiny), random weights saved in bfloat16 like the real
    checkpoint, the tokenizer files copied beside them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
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
    t0 = time.perf_counter()
    where = device if device.type == "cuda" else torch.device("cpu")  # random init is fast on the GPU
    with where:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"parameters": n, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "vocab": config.vocab_size, "tiny": tiny, "build_seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------
# Inside a section's process: the changes to main()'s run and the wrappers that measure it


class Notes:
    """The section's results, rewritten to its file at every change (a killed section keeps them)."""

    def __init__(self, path: Path):
        self.path, self.data = path, {"patches": [], "errors": []}

    def set(self, key, value):
        self.data[key] = value
        self.save()

    def add(self, key, value):
        self.data.setdefault(key, []).append(value)
        self.save()

    def save(self):
        write_json(self.path, self.data)


def guarded(notes: Notes, what: str, fn, *args, **kwargs):
    """Run one measurement; a failure is noted (with its traceback on stderr) and the rest goes on."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        traceback.print_exc()
        notes.add("errors", f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400])
        return None


class PlainRecords:
    """What train_rlvr.load_records reads of a datasets.Dataset: column_names, len and [i]."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.column_names = list(dict.fromkeys(k for r in rows for k in r))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return dict(self.rows[i])


def patch_trainer(T, args, notes: Notes) -> None:
    """The four changes of the docstring; each one that cannot be made is noted, not fatal."""
    def patch(name, make, what):
        try:
            setattr(T, name, make(getattr(T, name)))
            notes.add("patches", what)
        except Exception as e:
            notes.add("errors", f"could not patch {name} ({what}): {type(e).__name__}: {e}"[:400])

    if args.data_reader == "plain":
        def make_reader(real):
            def open_dataset(source, split, what="dataset"):
                path = Path(source)
                if not path.is_file():
                    raise T.UserError(f"{what} {source}: without the datasets package the GPU check reads local "
                                      ".json/.jsonl(.gz) files only")
                if hasattr(T, "check_data_file"):
                    T.check_data_file(path, what)
                return PlainRecords(read_problem_file(path))
            return open_dataset
        patch("open_dataset", make_reader, "open_dataset: a plain JSON reader (datasets is not used)")

    def make_eos(real):
        def resolve_eos_id(*a, **k):
            real(*a, **k)  # the real check of eos_token
            return -1
        return resolve_eos_id
    patch("resolve_eos_id", make_eos, "resolve_eos_id: its check runs, then id -1 (no token stops a response)")

    def make_rewards(real):
        def score_rollouts(scorer, texts, gold):
            scored = real(scorer, texts, gold)  # the real verifier's time is in the step's
            return [(1.0 if i == 0 and T.RANKS.rank == 0 else 0.0, s[1], s[2]) for i, s in enumerate(scored)]
        return score_rollouts
    patch("score_rollouts", make_rewards, "score_rollouts: the real verifier runs, then rewards [1, 0, ...]")

    if not args.keep_checkpoints:
        for name in ("save_checkpoint", "save_final"):
            patch(name, lambda real: (lambda *a, **k: None), f"{name}: not written")


def instrument(T, device, notes: Notes) -> dict:
    """Wrappers that time decode and evaluate and record the compiled-vs-eager check and top-p's
    tie path; what they wrap runs unchanged. Returns the tie-path counters."""
    ties = {"mask_calls": 0, "mask_rows": 0, "reference_calls": 0, "reference_rows": 0}

    def wrap(name, make):
        try:
            setattr(T, name, make(getattr(T, name)))
        except Exception as e:
            notes.add("errors", f"cannot measure {name}: {type(e).__name__}: {e}"[:400])

    def arg(a, k, index, key, default=None):
        return k[key] if key in k else a[index] if len(a) > index else default

    def make_decode(real):
        def decode(*a, **k):
            sync(device)
            t0 = time.perf_counter()
            result = real(*a, **k)
            sync(device)
            seconds = time.perf_counter() - t0
            try:
                tokens = sum(len(r) for r in result[0])
            except Exception:
                tokens = None
            notes.add("decode_calls", {"rows": len(arg(a, k, 1, "prompts", [])),
                                       "max_new_tokens": arg(a, k, 2, "max_new_tokens"),
                                       "compiled": arg(a, k, 6, "compiled"),
                                       "drop_finished": arg(a, k, 7, "drop_finished", False),
                                       "tokens": tokens, "seconds": seconds})
            return result
        return decode

    def make_evaluate(real):
        def evaluate(*a, **k):
            sync(device)
            t0 = time.perf_counter()
            records = real(*a, **k)
            sync(device)
            lengths = [r["tokens"] for r in records if r]
            notes.add("evaluations", {"problems": len(records), "tokens": sum(lengths),
                                      "seconds": time.perf_counter() - t0,
                                      "shortest": min(lengths, default=0), "longest": max(lengths, default=0),
                                      "forced": all(r and r.get("cut_at_limit") for r in records)})
            return records
        return evaluate

    def make_difference(real):
        def compiled_decode_difference(*a, **k):
            t0 = time.perf_counter()
            worst, scale = real(*a, **k)
            decoder = arg(a, k, 0, "decoder")
            notes.add("differences", {"worst": worst, "scale": scale, "seconds": time.perf_counter() - t0,
                                      "bf16": getattr(decoder, "low_precision", None),
                                      "weights_dtype": str(next(arg(a, k, 1, "model").parameters()).dtype)})
            return worst, scale
        return compiled_decode_difference

    def make_tolerance(real):
        def compiled_tolerance(*a, **k):
            tol = real(*a, **k)
            notes.add("tolerances", {"scale": arg(a, k, 0, "scale"), "bf16": arg(a, k, 1, "bf16"), "tolerance": tol})
            return tol
        return compiled_tolerance

    def make_counter(real, calls, rows):
        def counted(scores, *a, **k):
            ties[calls] += 1
            ties[rows] += scores.shape[0] if scores.dim() > 1 else 1
            return real(scores, *a, **k)
        return counted

    wrap("decode", make_decode)
    wrap("evaluate", make_evaluate)
    wrap("compiled_decode_difference", make_difference)
    wrap("compiled_tolerance", make_tolerance)
    wrap("top_p_mask", lambda real: make_counter(real, "mask_calls", "mask_rows"))
    wrap("top_p_reference", lambda real: make_counter(real, "reference_calls", "reference_rows"))
    return ties


def dynamo_stats() -> dict:
    """torch._dynamo's counters (graphs, graph breaks, recompiles, cudagraph skips) and compile time."""
    out = {}
    try:
        from torch._dynamo.utils import counters

        out["counters"] = {k: {str(kk): vv for kk, vv in v.items()} for k, v in counters.items() if v}
    except Exception as e:
        out["counters"] = f"n/a ({type(e).__name__})"
    try:
        from torch._dynamo.utils import calculate_time_spent

        out["time_spent"] = calculate_time_spent()
    except Exception as e:
        out["time_spent"] = f"n/a ({type(e).__name__})"
    return out


# ----------------------------------------------------------------------------------------------
# The sections (each runs in its own process: `--child NAME`)


def compile_setting(args, device, compiled: bool) -> str:
    if not compiled:
        return "false"
    return "true" if device.type == "cpu" and args.cpu_compile else "auto"


def run_main(T, device, notes: Notes, argv: list[str]) -> None:
    """train_rlvr.main(argv), the real CLI path, with its wall time, exit code and peak memory noted."""
    notes.set("argv", argv)
    reset_peak(device)
    t0 = time.perf_counter()
    code = T.main(argv)
    notes.set("main_seconds", time.perf_counter() - t0)
    notes.set("exit_code", code)
    notes.set("peak_memory", peak_memory(device))


def section_train(args, device, notes: Notes, compiled: bool, precision: str) -> None:
    import train_rlvr as T

    patch_trainer(T, args, notes)
    ties = instrument(T, device, notes)
    run_dir = Path(args.work) / "runs" / args.child
    empty = Path(args.work) / "empty.yaml"
    empty.write_text("# the GPU check passes every setting on the command line\n")
    run_main(T, device, notes, [
        "--config", str(empty), f"model={args.model_dir}", f"dataset={Path(args.problems).resolve()}",
        f"num_problems={args.steps}", f"max_new_tokens={args.new_tokens}", f"group_size={GROUP}",
        f"device={device}", f"precision={precision}", f"compile={compile_setting(args, device, compiled)}",
        f"output_dir={run_dir}", "overwrite=true"])
    notes.set("compile_failed", list(getattr(T, "COMPILE_FAILED", [])))
    notes.set("ties", ties)
    notes.set("dynamo", dynamo_stats())


def section_eval(args, device, notes: Notes) -> None:
    import train_rlvr as T

    patch_trainer(T, args, notes)
    instrument(T, device, notes)
    empty = Path(args.work) / "empty.yaml"
    empty.write_text("# the GPU check passes every setting on the command line\n")
    run_main(T, device, notes, [
        "--config", str(empty), f"model={args.model_dir}", "num_problems=0",
        f"eval_dataset={Path(args.eval_problems).resolve()}", f"eval_problems={args.eval_count}",
        f"eval_max_new_tokens={args.eval_tokens}", f"eval_batch_size={args.eval_batch}", f"device={device}",
        f"output_dir={Path(args.work) / 'runs' / 'eval'}", "overwrite=true"])


def section_nccl(args, device, notes: Notes) -> None:
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    with socket.socket() as s:  # a free local port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    notes.set("backend", backend)
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's object collectives use the current device
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    notes.set("init_seconds", time.perf_counter() - t0)
    try:
        x = torch.arange(1024, dtype=torch.float32, device=device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        sync(device)
        notes.set("all_reduce_seconds", time.perf_counter() - t0)
        notes.set("all_reduce_ok", bool(torch.equal(x.cpu(), torch.arange(1024, dtype=torch.float32))))
        gathered = [None]
        dist.all_gather_object(gathered, {"rank": 0, "text": "é"})  # what the trainer's gather_objects does
        notes.set("all_gather_object_ok", gathered == [{"rank": 0, "text": "é"}])
        dist.barrier()
        notes.set("barrier_ok", True)
    finally:
        dist.destroy_process_group()


def section_probe(args, device, notes: Notes) -> None:
    """The trainer's functions one by one (issue 18 point 7), each measurement guarded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import train_rlvr as T

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ties = instrument(T, device, notes)
    reset_peak(device)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(device).eval()
    problem = read_problem_file(Path(args.problems))[0]
    prompt = torch.tensor(tokenizer(T.build_prompt(T.SPEC_PROMPT, problem["problem"]), add_special_tokens=False)
                          ["input_ids"], device=device)
    notes.set("prompt_tokens", len(prompt))
    default = T.resolve_precision(T.Config(device=device.type), device)  # auto: bf16-autocast on CUDA
    notes.set("precision", default)
    compiled = device.type == "cuda" or args.cpu_compile
    n2 = args.probe_tokens
    n1 = max(2, n2 // 4)
    cfg = T.Config(group_size=GROUP, max_new_tokens=n2, device=str(device), compile="true" if compiled else "false")

    def difference(precision):
        """Compile a StaticDecoder for this precision and compare it with eager decoding."""
        nonlocal model
        getattr(T, "_STATIC_DECODERS", {}).clear()  # one decoder at a time (each holds a cache, maybe a twin)
        if precision == "bf16":  # loaded as the trainer loads it (model.to() would also cast the rotary buffers)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).to(device).eval()
        amp = T.autocast(device, precision)
        t0 = time.perf_counter()
        decoder = T.static_decoder(model, amp)
        with torch.no_grad():
            worst, scale = T.compiled_decode_difference(decoder, model, [prompt] * GROUP, n2, amp)
        seconds = time.perf_counter() - t0
        tolerance = T.compiled_tolerance(scale, decoder.low_precision)  # bf16 autocast or bf16 weights
        decoder.checked = True  # generate_rollouts below takes this one as checked
        notes.add("compiled_vs_eager", {"precision": precision, "worst": worst, "scale": scale, "tolerance": tolerance,
                                        "passed": bool(worst <= tolerance), "compile_and_check_seconds": seconds})
        return decoder, amp

    def step_alone(amp, decoder):
        """ms of one decode forward (8 rows), compiled (decoder.step) or eager (DynamicCache)."""
        from transformers import DynamicCache

        batch = prompt.unsqueeze(0).repeat(GROUP, 1)
        k = n2 - 4
        with torch.no_grad(), T.weight_cast_cache(amp, device.type):
            if decoder is not None:
                ids = decoder.prefill(batch, n2).argmax(dim=-1, keepdim=True)
                forward = decoder.step
            else:
                cache, name = DynamicCache(config=model.config), T.cache_arg(model)
                with amp:
                    ids = T.next_token_scores(model, batch, cache, name).argmax(dim=-1, keepdim=True)

                def forward(x):
                    with amp:
                        return T.next_token_scores(model, x, cache, name)
            for _ in range(3):
                forward(ids)
            with Clock(device) as c:
                for _ in range(k):
                    forward(ids)
        return 1000 * c.seconds / k

    def whole_token(amp, compile_value):
        """ms per token of generate_rollouts (8 rows, sampling, the loop's bookkeeping), from two
        lengths, so the prefill drops out; and the rows per token that took top-p's tie path."""
        run_cfg = T.dataclasses.replace(cfg, compile=compile_value)
        times = {}
        for n in (n1, n2):
            streams = T.rollout_streams(0, 1, range(GROUP), device)
            before = dict(ties)
            with Clock(device) as c:
                T.generate_rollouts(model, prompt, T.dataclasses.replace(run_cfg, max_new_tokens=n), -1, streams, amp)
            times[n] = c.seconds
            tie_rows = ties["reference_rows"] - before["reference_rows"]
            tie_calls = ties["mask_calls"] - before["mask_calls"]
        return {"ms_per_token": 1000 * (times[n2] - times[n1]) / (n2 - n1), "seconds": times,
                "tie_rows_per_token": tie_rows / tie_calls if tie_calls else None, "rows": GROUP}

    def per_token_profile(amp, compile_value):
        """Host syncs, item reads, copies and launches per token: profiler counts at two lengths."""
        from torch.profiler import ProfilerActivity, profile

        run_cfg = T.dataclasses.replace(cfg, compile=compile_value)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        counts = {}
        for n in (n1, n2):
            streams = T.rollout_streams(0, 1, range(GROUP), device)
            with profile(activities=activities) as prof:
                T.generate_rollouts(model, prompt, T.dataclasses.replace(run_cfg, max_new_tokens=n), -1, streams, amp)
            counts[n] = profile_groups(prof)
        return {k: (counts[n2][k] - counts[n1][k]) / (n2 - n1) for k in counts[n2]}

    if compiled:
        got = guarded(notes, f"compiled vs eager ({default})", difference, default)
        decoder, amp = got if got else (None, T.autocast(device, default))
    else:
        decoder, amp = None, T.autocast(device, default)
        notes.add("errors", "compiled parts skipped: compile is off on the CPU (--cpu-compile turns it on)")
    if decoder is not None:
        notes.set("step_alone_ms_compiled", guarded(notes, "compiled step alone", step_alone, amp, decoder))
        notes.set("whole_token_compiled", guarded(notes, "compiled whole token", whole_token, amp, "true"))
    notes.set("step_alone_ms_eager", guarded(notes, "eager step alone", step_alone, amp, None))
    notes.set("whole_token_eager", guarded(notes, "eager whole token", whole_token, amp, "false"))
    notes.set("optimizer", guarded(notes, "optimizer step", optimizer_probe, T, model, device))
    notes.set("peak_memory", peak_memory(device))
    # The profiler (CUPTI) after the plain timings: if it upsets the CUDA context, they are already saved
    if decoder is not None:
        notes.set("profile_per_token_compiled", guarded(notes, "compiled profile", per_token_profile, amp, "true"))
    notes.set("profile_per_token_eager", guarded(notes, "eager profile", per_token_profile, amp, "false"))
    if compiled:
        for precision in ("fp32", "bf16-autocast", "bf16"):
            if precision == default:
                continue
            guarded(notes, f"compiled vs eager ({precision})", difference, precision)
    notes.set("peak_memory", peak_memory(device))
    notes.set("ties", ties)
    notes.set("dynamo", dynamo_stats())


def profile_groups(prof) -> dict:
    """Counts of the profiler events that cost a GPU decode its speed, grouped."""
    groups = {"host_syncs": 0, "item_reads": 0, "memcpy_htod": 0, "memcpy_dtoh": 0, "memcpy_dtod": 0,
              "kernel_launches": 0, "graph_launches": 0, "aten_copy": 0}
    for e in prof.key_averages():
        key, n = e.key, e.count
        if key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            groups["host_syncs"] += n
        elif key == "aten::_local_scalar_dense":  # .item(), bool(tensor), .tolist() of one value
            groups["item_reads"] += n
        elif key.startswith("Memcpy HtoD"):
            groups["memcpy_htod"] += n
        elif key.startswith("Memcpy DtoH"):
            groups["memcpy_dtoh"] += n
        elif key.startswith("Memcpy DtoD"):
            groups["memcpy_dtod"] += n
        elif key.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
            groups["kernel_launches"] += n
        elif key == "cudaGraphLaunch":
            groups["graph_launches"] += n
        elif key == "aten::copy_":
            groups["aten_copy"] += n
    return groups


def optimizer_probe(T, model, device) -> dict:
    """optimizer_step on random gradients (the trainer's buffers: update_norm_buffers, state
    snapshot), its time by CUDA events, and what of it is host transfer (profiler, copies alone)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01)
    before, state = T.update_norm_buffers(params, device), {}
    result = {"weights_bytes": sum(p.numel() * p.element_size() for p in params)}
    with Clock(device) as c:
        T.optimizer_step(params, optimizer, 1.0, 0.0, before, state)  # the first allocates AdamW's state
    result["first_step_seconds"] = c.seconds
    with Clock(device) as c:
        T.optimizer_step(params, optimizer, 1.0, 0.0, before, state)
    result["step_seconds"] = c.seconds
    with Clock(device) as c:
        for b, p in zip(before, params):
            b.copy_(p.detach(), non_blocking=True)
    result["weights_to_buffers_seconds"] = c.seconds
    result["buffers_on"] = str(before[0].device) + (" (pinned)" if before[0].is_pinned() else "")
    with Clock(device) as c:
        T.snapshot_optimizer_state(optimizer, state)
    result["state_snapshot_seconds"] = c.seconds
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            T.optimizer_step(params, optimizer, 1.0, 0.0, before, state)
            sync(device)
        copies = [e for e in prof.key_averages() if e.key.startswith("Memcpy")]
        result["profiled_memcpy"] = {e.key: {"count": e.count, "device_seconds": device_us(e) / 1e6} for e in copies}
    for p in params:
        p.grad = None
    del optimizer, before, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def device_us(event) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return float("nan")


def watch_parent() -> None:
    """A section runs in its own process group (so that a timeout stops its workers too); if the
    check itself is killed outright, the section must not go on holding the GPU: it ends its group."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(2)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()


def child_main(args) -> int:
    import torch

    watch_parent()
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    notes = Notes(Path(args.child_out))
    notes.set("env", environment(device))
    t0 = time.perf_counter()
    try:
        name = args.child
        if name == "train-compiled":
            section_train(args, device, notes, compiled=True, precision="auto")
        elif name == "train-eager":
            section_train(args, device, notes, compiled=False, precision="auto")
        elif name == "train-bf16":
            section_train(args, device, notes, compiled=True, precision="bf16")
        elif name == "eval":
            section_eval(args, device, notes)
        elif name == "nccl":
            section_nccl(args, device, notes)
        elif name == "probe":
            section_probe(args, device, notes)
        code = 0
    except Exception as e:
        traceback.print_exc()
        notes.add("errors", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400])
        code = 1
    notes.set("section_seconds", time.perf_counter() - t0)
    return code


# ----------------------------------------------------------------------------------------------
# The parent: runs the sections, summarizes, prints the table


TORCH_LOG_LINE = re.compile(r"^[VIWEDC]\d{4} \d\d:\d\d:\d\d")  # glog-style lines of TORCH_LOGS


def torch_logs() -> str:
    """TORCH_LOGS for the compiled sections, without a name this torch does not know (an unknown
    name stops torch at import)."""
    try:
        from torch._logging._internal import log_registry

        known = set(log_registry.artifact_names) | set(log_registry.log_alias_to_log_qnames)
        return ",".join(n for n in TORCH_LOGS.split(",") if n in known)
    except Exception:
        return TORCH_LOGS


def run_section(name: str, args, timeout: float, logs: Path, model_dir: Path) -> dict:
    out_file, log_file = logs / f"{name}.json", logs / f"{name}.log"
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--child-out", str(out_file),
           "--model-dir", str(model_dir), *passed_args(args)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if name in ("train-compiled", "train-bf16", "probe"):
        env["TORCH_LOGS"] = torch_logs()
    lines: list[str] = []
    t0, cpu0 = time.perf_counter(), cpu_seconds_of_children()
    with log_file.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                                start_new_session=True, errors="replace")

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                lines.append(line.rstrip("\n"))
                if not TORCH_LOG_LINE.match(line) and not line.startswith((" ", "\t")):
                    print(f"  [{name}] {line.rstrip()[:200]}", file=sys.stderr, flush=True)
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        status = None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = f"timeout after {timeout:.0f} s"
        finally:  # a timeout, or the check itself interrupted: the section's processes go too
            if proc.poll() is None:
                stop_group(proc)
        reader.join(timeout=10)
    child = json.loads(out_file.read_text()) if out_file.exists() else {}
    if status is None:
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    return {"status": status, "seconds": time.perf_counter() - t0, "cpu_seconds": cpu_seconds_of_children() - cpu0,
            "child": child, "log": str(log_file),
            "log_counts": log_counts(lines), "log_lines": len(lines)}


def cpu_seconds_of_children() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def stop_group(proc) -> None:
    """SIGTERM to the section's process group (the trainer stops at a safe point), SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def passed_args(args) -> list[str]:
    out = ["--config-dir", args.config_dir, "--problems", args.problems, "--eval-problems", args.eval_problems,
           "--device", args.device, "--steps", str(args.steps), "--new-tokens", str(args.new_tokens),
           "--eval-count", str(args.eval_count), "--eval-tokens", str(args.eval_tokens),
           "--eval-batch", str(args.eval_batch), "--probe-tokens", str(args.probe_tokens), "--work", args.work,
           "--data-reader", args.data_reader] + (["--threads", str(args.threads)] if args.threads else [])
    return out + (["--tiny"] if args.tiny else []) + (["--keep-checkpoints"] if args.keep_checkpoints else []) + (
        ["--cpu-compile"] if args.cpu_compile else [])


def log_counts(lines: list[str]) -> dict:
    """What TORCH_LOGS and the trainer said: recompiles, graph breaks, skipped CUDA graphs, a failed compile."""
    patterns = {"recompiles": "Recompiling function", "graph_breaks": "Graph break",
                "cudagraph_skips": "skipping cudagraph", "compiled_decoding_failed": "compiled decoding failed",
                "tracebacks": "Traceback (most recent call last)"}
    counts = {}
    for key, pattern in patterns.items():
        hits = [line for line in lines if pattern.lower() in line.lower()]
        counts[key] = {"count": len(hits), "first": [h[:300] for h in hits[:3]]}
    return counts


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarize_train(r: dict, run_dir: Path, args) -> tuple[dict, list[tuple[str, str]]]:
    child, steps = r["child"], read_metrics(run_dir)
    s = {"steps": len(steps), "exit_code": child.get("exit_code"), "per_step": []}
    for m in steps:
        t = m["timings"]
        s["per_step"].append({"seconds": m["seconds"], "generation_seconds": t["generation"],
                              "response_tokens": m["response_tokens"],
                              "generated_tokens_per_s": m["response_tokens"] / t["generation"],
                              "logprob_backward_seconds": t["logprob_backward"], "optimizer_seconds": t["optimizer"],
                              "grad_norm": m["grad_norm"], "update_norm": m["update_norm"]})
    later = s["per_step"][1:] or s["per_step"]
    if later:
        s["seconds_per_step_after_first"] = sum(p["seconds"] for p in later) / len(later)
        s["generated_tokens_per_s_after_first"] = (sum(p["response_tokens"] for p in later) /
                                                   sum(p["generation_seconds"] for p in later))
        s["first_step_extra_generation_seconds"] = (s["per_step"][0]["generation_seconds"] -
                                                    sum(p["generation_seconds"] for p in later) / len(later))
    s["forced_tokens"] = all(p["response_tokens"] == GROUP * args.new_tokens for p in s["per_step"])
    s["peak_memory"] = child.get("peak_memory")
    s["differences"], s["tolerances"] = child.get("differences", []), child.get("tolerances", [])
    s["compile_failed"] = child.get("compile_failed")
    ties = child.get("ties") or {}
    s["tie_rows_per_token"] = ties["reference_rows"] / ties["mask_calls"] if ties.get("mask_calls") else None
    s["dynamo"] = child.get("dynamo")
    if r["status"] == "ok" and (s["exit_code"] != 0 or s["steps"] != args.steps):
        r["status"] = f"failed (main exit {s['exit_code']}, {s['steps']} of {args.steps} steps)"
    rows = [("seconds per step", ", ".join(f"{p['seconds']:.2f}" for p in s["per_step"]) or "none")]
    if later:
        rows += [("generated tokens/s (after step 1)", f"{s['generated_tokens_per_s_after_first']:.1f}"),
                 ("step 1 generation minus later ones", f"{s['first_step_extra_generation_seconds']:.2f} s"),
                 ("backward / optimizer (last step)", f"{later[-1]['logprob_backward_seconds']:.2f} s / "
                                                     f"{later[-1]['optimizer_seconds']:.2f} s")]
    rows.append(("peak memory", fmt_bytes(s["peak_memory"])))
    if s["differences"]:
        d, tol = s["differences"][0], (s["tolerances"] or [{}])[0].get("tolerance")
        within = f", tolerance {tol:.3g}" if tol is not None else ""
        rows.append(("compiled vs eager (max |logit diff|)", f"{d['worst']:.3g} of scale {d['scale']:.3g}{within}"))
    if s["compile_failed"]:
        rows.append(("compiled decoding FAILED", s["compile_failed"][0][:90]))
    rows += compile_rows(r, s["dynamo"])
    if s["tie_rows_per_token"] is not None:
        rows.append(("top-p tie-path rows per token", f"{s['tie_rows_per_token']:.2f} of {GROUP}"))
    return s, rows


def compile_rows(r: dict, dynamo: dict | None) -> list[tuple[str, str]]:
    """Compile time (dynamo's own clock) and what TORCH_LOGS reported, from a section's log."""
    counts, rows = r["log_counts"], []
    spent = (dynamo or {}).get("time_spent")
    if isinstance(spent, dict) and spent.get("entire_frame_compile") is not None:
        rows.append(("compile time (dynamo, all graphs)", f"{spent['entire_frame_compile']:.1f} s"))
    rows.append(("recompiles / graph breaks / cudagraph skips",
                 f"{counts['recompiles']['count']} / {counts['graph_breaks']['count']} / "
                 f"{counts['cudagraph_skips']['count']}"))
    return rows


def summarize_eval(r: dict, args) -> tuple[dict, list[tuple[str, str]]]:
    child = r["child"]
    ev = (child.get("evaluations") or [None])[0]
    batches = [c for c in child.get("decode_calls", []) if c.get("drop_finished")]
    s = {"exit_code": child.get("exit_code"), "peak_memory": child.get("peak_memory"),
         "batch_seconds": [c["seconds"] for c in batches], "batch_rows": [c["rows"] for c in batches]}
    rows = []
    if ev:
        s.update(problems=ev["problems"], tokens=ev["tokens"], seconds=ev["seconds"], forced=ev["forced"],
                 problems_per_s=ev["problems"] / ev["seconds"], tokens_per_s=ev["tokens"] / ev["seconds"])
        s["extrapolated_500_seconds"] = 500 / s["problems_per_s"]
        rows += [("problems/s", f"{s['problems_per_s']:.3f} ({ev['problems']} problems x {args.eval_tokens} forced "
                                f"tokens, batches of {args.eval_batch})"),
                 ("generated tokens/s", f"{s['tokens_per_s']:.1f}"),
                 ("500 problems, extrapolated", f"{s['extrapolated_500_seconds']:.0f} s "
                                               f"({s['extrapolated_500_seconds'] / 60:.1f} min) per pass")]
    if batches:
        rows.append(("seconds per batch", ", ".join(f"{b:.2f}" for b in s["batch_seconds"])))
    rows.append(("peak memory", fmt_bytes(s["peak_memory"])))
    if r["status"] == "ok" and (s["exit_code"] != 0 or not ev or ev["problems"] != args.eval_count):
        r["status"] = f"failed (main exit {s['exit_code']})"
    return s, rows


def summarize_nccl(r: dict) -> tuple[dict, list[tuple[str, str]]]:
    c = r["child"]
    s = {k: c.get(k) for k in ("backend", "init_seconds", "all_reduce_seconds", "all_reduce_ok",
                               "all_gather_object_ok", "barrier_ok")}
    ok = bool(s["all_reduce_ok"] and s["all_gather_object_ok"] and s["barrier_ok"])
    if r["status"] == "ok" and not ok:
        r["status"] = "failed"
    rows = [(f"{s['backend']} world size 1", "init {} s, all_reduce + all_gather_object + barrier {}".format(
        f"{s['init_seconds']:.2f}" if s["init_seconds"] is not None else "n/a", "ok" if ok else "FAILED"))]
    return s, rows


def summarize_probe(r: dict) -> tuple[dict, list[tuple[str, str]]]:
    c = r["child"]
    keys = ("precision", "prompt_tokens", "compiled_vs_eager", "step_alone_ms_compiled", "step_alone_ms_eager",
            "whole_token_compiled", "whole_token_eager", "profile_per_token_compiled", "profile_per_token_eager",
            "optimizer", "peak_memory")
    s = {k: c.get(k) for k in keys}
    rows = []
    for d in s["compiled_vs_eager"] or []:
        verdict = "passed" if d["passed"] else "FAILS"
        rows.append((f"compiled vs eager, {d['precision']}", f"{d['worst']:.3g} (tolerance {d['tolerance']:.3g}: "
                     f"{verdict}), compile + check {d['compile_and_check_seconds']:.1f} s"))
    for kind in ("compiled", "eager"):
        alone, whole, prof = s[f"step_alone_ms_{kind}"], s[f"whole_token_{kind}"], s[f"profile_per_token_{kind}"]
        if alone is not None and whole:
            rows.append((f"{kind}: decode step alone / whole token", f"{alone:.2f} ms / {whole['ms_per_token']:.2f} ms "
                                                                    f"({GROUP} rows)"))
        if whole and whole.get("tie_rows_per_token") is not None:
            rows.append((f"{kind}: top-p tie-path rows per token", f"{whole['tie_rows_per_token']:.2f} of {GROUP}"))
        if prof:
            rows.append((f"{kind}: per token, from the profiler", "host syncs {:.1f}, item reads {:.1f}, copy_ {:.1f}, "
                         "H2D {:.1f}, D2H {:.1f}".format(prof["host_syncs"], prof["item_reads"], prof["aten_copy"],
                                                         prof["memcpy_htod"], prof["memcpy_dtoh"])))
            rows.append((f"{kind}: per token kernel / graph launches", f"{prof['kernel_launches']:.1f} / "
                                                                       f"{prof['graph_launches']:.1f}"))
    opt = s["optimizer"]
    if opt:
        rows.append(("optimizer step (clip + AdamW + copies)", f"{opt['step_seconds']:.3f} s; weights -> "
                     f"{opt['buffers_on']} {opt['weights_to_buffers_seconds']:.3f} s, AdamW state copy "
                     f"{opt['state_snapshot_seconds']:.3f} s"))
    rows.append(("peak memory", fmt_bytes(s["peak_memory"])))
    rows += compile_rows(r, c.get("dynamo"))
    if c.get("errors"):
        rows.append(("errors", f"{len(c['errors'])}: {c['errors'][0][:80]}"))
    return s, rows


def fmt_bytes(peak) -> str:
    if not peak or peak.get("bytes") is None:
        return "n/a"
    return f"{peak['bytes'] / 2**30:.2f} GiB ({'GPU allocated' if 'cuda' in peak['kind'] else peak['kind']})"


def format_table(result: dict) -> str:
    env, model = result["env"], result.get("model") or {}
    head = [f"GPU check, {result['started']}: {env.get('gpu') or env['device']}, torch {env['torch']} (CUDA "
            f"{env['cuda']}), transformers {env['transformers']}, datasets {env['datasets'] or 'missing'}",
            f"model: {model.get('parameters', 0) / 1e6:.1f}M parameters, {model.get('layers')} layers, hidden "
            f"{model.get('hidden')}, vocab {model.get('vocab')}, random weights; {GROUP} rollouts x "
            f"{result['settings']['new_tokens']} forced tokens; data reader {result['settings']['data_reader']}"]
    width = max([len(label) for sec in result["sections"].values() for label, _ in sec.get("rows", [])] + [10])
    lines = head + ["", f"{'section':16s}{'measurement':{width + 2}s}value"]
    for name, sec in result["sections"].items():
        lines.append(f"{name:16s}{'status':{width + 2}s}{sec['status']} ({sec.get('seconds', 0):.0f} s)")
        for label, value in sec.get("rows", []):
            lines.append(f"{'':16s}{label:{width + 2}s}{value}")
    if result.get("interrupted"):
        lines.append(f"interrupted {result['interrupted']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    try:
        names = check_args(args)
        device = resolve_device(args.device)
    except BadArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    logs = json_path.with_name(json_path.stem + "_logs")
    logs.mkdir(exist_ok=True)
    temporary = args.work is None
    args.work = str(Path(tempfile.mkdtemp(prefix="gpu_check-") if temporary else args.work).resolve())
    if args.threads is None and args.tiny and device.type == "cpu":
        args.threads = 1
    env = environment(device)
    if args.data_reader == "auto":  # datasets installed and importable, or the plain reader
        args.data_reader = "datasets" if env["datasets"] and not env["datasets"].startswith("unusable") else "plain"
    result = {"command": " ".join(["python", *sys.argv]),
              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "env": env,
              "settings": {k: getattr(args, k) for k in ("config_dir", "problems", "eval_problems", "tiny", "steps",
                                                         "new_tokens", "eval_count", "eval_tokens", "eval_batch",
                                                         "probe_tokens", "time_limit", "data_reader", "cpu_compile",
                                                         "keep_checkpoints", "threads")},
              "group_size": GROUP, "sections": {}, "logs": str(logs)}
    write_json(json_path, result)
    signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(128 + sig))  # the finally clauses run
    name = "building the model"
    try:
        print(f"building the random-weight model of {args.config_dir}{' (tiny)' if args.tiny else ''}",
              file=sys.stderr, flush=True)
        model_dir = Path(args.work) / "model"
        result["model"] = build_model(Path(args.config_dir), model_dir, args.tiny, device)
        write_json(json_path, result)
        for name in names:
            left = args.time_limit - (time.perf_counter() - start)
            if left < MIN_START_S:
                result["sections"][name] = {"status": f"skipped ({left:.0f} s of --time-limit left)", "rows": []}
                write_json(json_path, result)
                continue
            print(f"section {name} (at most {min(left, SECTION_CAP[name]):.0f} s)", file=sys.stderr, flush=True)
            r = run_section(name, args, min(left, SECTION_CAP[name]), logs, model_dir)
            try:
                if name.startswith("train"):
                    summary, rows = summarize_train(r, Path(args.work) / "runs" / name, args)
                elif name == "eval":
                    summary, rows = summarize_eval(r, args)
                elif name == "nccl":
                    summary, rows = summarize_nccl(r)
                else:
                    summary, rows = summarize_probe(r)
            except Exception as e:  # a section that died early has little to summarize
                summary, rows = {}, [("summary", f"n/a ({type(e).__name__}: {e})"[:120])]
            errors = r["child"].get("errors", [])
            if errors and r["status"] != "ok" and not any(label == "errors" for label, _ in rows):
                rows.append(("error", errors[-1][:100]))
            result["sections"][name] = {"status": r["status"], "seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"],
                                        "summary": summary,
                                        "rows": rows, "patches": r["child"].get("patches"), "errors": errors,
                                        "log": r["log"], "log_counts": r["log_counts"], "raw": r["child"]}
            shutil.rmtree(Path(args.work) / "runs" / name, ignore_errors=True)
            for label, value in [("status", r["status"]), *rows]:
                print(f"  {name}: {label}: {value}", file=sys.stderr, flush=True)
            write_json(json_path, result)
        code = 0 if all(s["status"] == "ok" for s in result["sections"].values()) else 1
    except (KeyboardInterrupt, SystemExit):
        result["interrupted"] = f"during {name}; the sections before it are complete"
        print(f"interrupted during {name}; {json_path} holds the sections before it", file=sys.stderr)
        code = 130
    finally:
        if temporary:
            shutil.rmtree(args.work, ignore_errors=True)
    result["seconds"] = time.perf_counter() - start
    result["table"] = format_table(result)
    write_json(json_path, result)
    print(result["table"])
    return code


if __name__ == "__main__":
    sys.exit(main())
