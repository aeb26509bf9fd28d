"""Benchmark of one RLVR step: the trainer's own phase functions against a plain loop.

    python benchmarks/bench_step.py [--steps 10] [--json bench.json] [--full] [...]

Builds a random-weight model from a config folder (default: ../shared/qwen3-0.6b-base shrunk to the
CPU stand-in: 4 layers, hidden 512, intermediate 1536, 8 heads, 4 KV heads, head_dim 64, the
real 151,936-token vocabulary and tokenizer; --full keeps the exact Qwen3-0.6B architecture). Every
step uses one problem of the JSON file, forces exactly --new-tokens new tokens per rollout (EOS does
not stop a rollout) and the reward pattern --rewards (default 1,0,0,0,0,0,0,0), so every step trains.

Two variants, each with its own model (same initial weights) and AdamW, run interleaved step by step
in this process (the order alternates every step):

  trainer  train_rlvr's own phase functions: generate_rollouts, score_rollouts (the real verifier; its
           rewards are then replaced by the pattern), compute_advantages, accumulate_policy_gradient,
           optimizer_step, at the trainer's precision (precision=auto unless --precision).
  plain    the plain loop (the baseline): transformers' generate (do_sample, temperature 0.8, top_p 0.9,
           top_k 0), then per response a full-logits forward, log_softmax of every position, the sum
           over the response, backward; clip_grad_norm_ and AdamW.step; float32 on CPU.

Medians over --steps steps after --warmup untimed steps (compilation and allocator warm-up happen
there). Peak memory is measured per variant in a separate process holding only that variant's model
and optimizer (--probe), after one warm-up step and one step: peak RSS (ru_maxrss) on CPU,
torch.cuda.max_memory_allocated on CUDA. --no-memory skips the probes.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import train_rlvr as T  # noqa: E402

STAND_IN = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64)
PHASES = ("generation", "rewards", "logprob_backward", "optimizer", "step")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(SHARED / "qwen3-0.6b-base"), help="config.json + tokenizer folder")
    p.add_argument("--full", action="store_true", help="the exact architecture of --model-dir (no stand-in shrink)")
    p.add_argument("--layers", type=int), p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int), p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int), p.add_argument("--head-dim", type=int)
    p.add_argument("--problems", default=str(SHARED / "data" / "math_train_first50.json"))
    p.add_argument("--problem-index", type=int, default=0)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (medians)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant before timing")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rewards", default="1,0,0,0,0,0,0,0")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--precision", default="auto", choices=T.PRECISIONS, help="the trainer's precision")
    p.add_argument("--baseline-precision", default="auto", choices=T.PRECISIONS,
                   help="the plain loop's (auto: fp32 on CPU, the baseline's own precision there; bf16-autocast on CUDA)")
    p.add_argument("--logprob-batch-size", type=int, default=1)
    p.add_argument("--compile", default="auto", help="the trainer's compile setting: auto, true, false")
    p.add_argument("--variants", default="trainer,plain")
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant peak-memory probes")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--probe", choices=("trainer", "plain"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Setup


def build(args, device):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(args.model_dir)
    overrides = {} if args.full else dict(STAND_IN)
    for key, value in dict(num_hidden_layers=args.layers, hidden_size=args.hidden,
                           intermediate_size=args.intermediate, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, head_dim=args.head_dim).items():
        if value is not None:
            overrides[key] = value
    for key, value in overrides.items():
        setattr(config, key, value)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)

    def make_model():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
        model.generation_config.eos_token_id = None  # forced-length rollouts in generate as well
        return model
    return config, tokenizer, make_model


def trainer_precision(args, device):
    return T.resolve_precision(T.Config(precision=args.precision, device=device.type), device)


def baseline_precision(args, device):
    if args.baseline_precision == "auto":
        return "fp32" if device.type == "cpu" else "bf16-autocast"
    return args.baseline_precision


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# The two variants


class TrainerVariant:
    name = "trainer"

    def __init__(self, args, device, tokenizer, make_model, prompt_ids, problem):
        self.args, self.device, self.tokenizer = args, device, tokenizer
        self.precision = trainer_precision(args, device)
        self.model = make_model()
        if self.precision == "bf16":
            self.model = self.model.to(torch.bfloat16)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, weight_decay=0.01)
        self.cfg = T.Config(group_size=args.group, max_new_tokens=args.new_tokens, temperature=0.8, top_p=0.9,
                            device=str(device), precision=self.precision, compile=args.compile,
                            logprob_batch_size=args.logprob_batch_size)
        self.copies = T.StepCopies(T.update_norm_buffers(self.params, device))  # as run() does
        self.decoders = T.Decoders()  # the compiled decoder kept from step to step, as the Trainer holds it
        self.decoders.plan("rollouts", [{"prompt_ids": prompt_ids.tolist()}], args.new_tokens)
        self.steps_done = 0
        self.prompt_ids, self.problem = prompt_ids.to(device), problem
        self.rewards = torch.tensor([float(x) for x in args.rewards.split(",")])
        self.scorer = T.verifier.TimedVerifier(timeout_s=2.0).__enter__()  # starts its worker now, as run() does

    def step(self):
        amp, d, t = T.autocast(self.device, self.precision), self.device, {}
        t0 = time.perf_counter()
        # eos_id -1: no token stops a rollout, so every one has exactly new_tokens tokens
        self.steps_done += 1
        streams = T.rollout_streams(0, self.steps_done, range(self.cfg.group_size), d)
        responses, _ = T.generate_rollouts(self.model, self.prompt_ids, self.cfg, -1, streams, amp, self.decoders)
        sync(d)
        t["generation"] = time.perf_counter() - t0
        s = time.perf_counter()
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in responses]
        T.score_rollouts(self.scorer, texts, self.problem["answer"])
        rewards = self.rewards  # forced, so that every step trains
        t["rewards"] = time.perf_counter() - s
        advantages = T.compute_advantages(rewards, self.cfg.std_eps, zero_variance=T.equal_rewards(rewards))
        s = time.perf_counter()
        T.accumulate_policy_gradient(self.model, self.params, self.prompt_ids, responses, advantages.to(d),
                                     self.cfg.group_size, amp, self.cfg.logprob_batch_size)
        sync(d)
        t["logprob_backward"] = time.perf_counter() - s
        s = time.perf_counter()
        T.optimizer_step(self.params, self.optimizer, self.cfg.max_grad_norm, 0.0, self.copies)
        sync(d)
        t["optimizer"] = time.perf_counter() - s
        t["step"] = time.perf_counter() - t0
        assert all(len(r) == self.args.new_tokens for r in responses)
        return t


class PlainVariant:
    """The baseline plain loop: generate + full-logits log-softmax + per-response backward."""
    name = "plain"

    def __init__(self, args, device, tokenizer, make_model, prompt_ids, problem):
        from transformers import GenerationConfig

        self.args, self.device, self.tokenizer = args, device, tokenizer
        self.precision = baseline_precision(args, device)
        self.model = make_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, weight_decay=0.01)
        self.gen_config = GenerationConfig(do_sample=True, temperature=0.8, top_p=0.9, top_k=0,
                                           max_new_tokens=args.new_tokens, eos_token_id=None,
                                           pad_token_id=tokenizer.eos_token_id)
        self.prompt_ids, self.problem = prompt_ids.to(device), problem
        self.rewards = torch.tensor([float(x) for x in args.rewards.split(",")])
        self.scorer = T.verifier.TimedVerifier(timeout_s=2.0).__enter__()  # the plain loop scores like the trainer
        torch.manual_seed(1)

    def step(self):
        amp, d, t, G = T.autocast(self.device, self.precision), self.device, {}, self.args.group
        P = len(self.prompt_ids)
        t0 = time.perf_counter()
        with torch.no_grad(), amp:
            batch = self.prompt_ids.unsqueeze(0).repeat(G, 1)
            out = self.model.generate(batch, attention_mask=torch.ones_like(batch), generation_config=self.gen_config)
        responses = [row[P:] for row in out]
        sync(d)
        t["generation"] = time.perf_counter() - t0
        s = time.perf_counter()
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in responses]
        for text in texts:
            self.scorer.score(text, self.problem["answer"])
        rewards = self.rewards
        t["rewards"] = time.perf_counter() - s
        adv = (rewards - rewards.mean()) / (rewards.std(unbiased=True) + 1e-4)
        s = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        for r, a in zip(responses, adv.to(d)):
            ids = torch.cat([self.prompt_ids, r]).unsqueeze(0)
            with amp:
                logits = self.model(ids).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)  # every position, whole vocabulary
            seq = logp[P - 1:-1].gather(-1, r.unsqueeze(-1)).sum()
            (-(a * seq) / G).backward()
        sync(d)
        t["logprob_backward"] = time.perf_counter() - s
        s = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        sync(d)
        t["optimizer"] = time.perf_counter() - s
        t["step"] = time.perf_counter() - t0
        assert all(len(r) == self.args.new_tokens for r in responses)
        return t


VARIANTS = {"trainer": TrainerVariant, "plain": PlainVariant}


# ----------------------------------------------------------------------------------------------
# Memory probes (one process per variant)


def reset_peak(device) -> str:
    """Start a new peak: CUDA's allocator statistics, or on Linux the process's VmHWM (writing 5
    to /proc/self/clear_refs resets it); elsewhere ru_maxrss, which also holds the build's peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "torch.cuda.max_memory_allocated"
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "VmHWM after a reset (peak RSS of the steps)"
    except OSError:
        return "ru_maxrss (peak RSS of the whole process, building included)"


def peak_memory(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def current_memory(device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def probe(args, device):
    config, tokenizer, make_model = build(args, device)
    problem, prompt_ids = load_problem(args, tokenizer)
    variant = VARIANTS[args.probe](args, device, tokenizer, make_model, prompt_ids, problem)
    import gc

    gc.collect()
    how = reset_peak(device)
    resident = current_memory(device)  # model, tokenizer, libraries: before the first step
    variant.step()  # warm-up: the first optimizer step allocates AdamW's state
    variant.step()
    print(json.dumps({"peak_bytes": peak_memory(device), "before_steps_bytes": resident, "measured_as": how}))


def run_probe(args, name):
    cmd = [sys.executable, __file__, "--probe", name, *sys.argv[1:]]
    cmd = [c for c in cmd if c != "--json" and not c.endswith(".json")]  # the probe writes nothing
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# Main


def load_problem(args, tokenizer):
    problems = json.loads(Path(args.problems).read_text())
    problem = problems[args.problem_index]
    prompt = T.build_prompt(T.SPEC_PROMPT, problem["problem"])
    prompt_ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return problem, prompt_ids


def fmt_s(x):
    return f"{x:8.3f} s"


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.probe:
        return probe(args, device)

    config, tokenizer, make_model = build(args, device)
    problem, prompt_ids = load_problem(args, tokenizer)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    variants = [VARIANTS[n](args, device, tokenizer, make_model, prompt_ids, problem) for n in names]
    n_params = sum(p.numel() for p in variants[0].model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters ({'full' if args.full else 'stand-in'}: "
          f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}); "
          f"device {device}; torch threads {torch.get_num_threads()}; prompt {len(prompt_ids)} tokens; "
          f"{args.group} x {args.new_tokens} new tokens; " +
          ", ".join(f"{v.name} {v.precision}" for v in variants), flush=True)

    timings = {v.name: [] for v in variants}
    for i in range(args.warmup + args.steps):
        order = variants if i % 2 == 0 else variants[::-1]
        for v in order:
            t = v.step()
            if i >= args.warmup:
                timings[v.name].append(t)
        label = "warm-up" if i < args.warmup else f"step {i - args.warmup + 1}/{args.steps}"
        done = ", ".join(f"{v.name} {timings[v.name][-1]['step']:.2f} s" for v in variants) if i >= args.warmup else ""
        print(f"  {label} {done}", file=sys.stderr, flush=True)

    med = {name: {ph: statistics.median(t[ph] for t in ts) for ph in PHASES} for name, ts in timings.items()}
    tokens = args.group * args.new_tokens
    for name in med:
        med[name]["ms_per_decode_step"] = 1000 * med[name]["generation"] / args.new_tokens
        med[name]["generated_tokens_per_s"] = tokens / med[name]["generation"]

    memory = {}
    if not args.no_memory:
        for name in names:
            print(f"  memory probe: {name} (own process)", file=sys.stderr, flush=True)
            memory[name] = run_probe(args, name)

    rows = [("whole step", "step"), ("generation", "generation"), ("  ms per decode step", "ms_per_decode_step"),
            ("  generated tokens/s", "generated_tokens_per_s"), ("rewards (verifier)", "rewards"),
            ("log-prob + backward (8 responses)", "logprob_backward"), ("clip + AdamW step", "optimizer")]
    header = f"{'median of ' + str(args.steps) + ' steps':36s}" + "".join(f"{n:>14s}" for n in med)
    ratio = "trainer" in med and "plain" in med
    if ratio:
        header += f"{'plain/trainer':>16s}"
    lines = [header]
    for label, key in rows:
        line = f"{label:36s}" + "".join(
            f"{med[n][key]:>12.1f}  " if key in ("ms_per_decode_step", "generated_tokens_per_s")
            else f"{med[n][key]:>12.3f}s " for n in med)
        if ratio:
            r = (med["trainer"][key] / med["plain"][key] if key == "generated_tokens_per_s"
                 else med["plain"][key] / med["trainer"][key])
            line += f"{r:>14.2f}x"
        lines.append(line)
    if memory:
        kind = "peak GPU memory allocated" if device.type == "cuda" else "peak RSS (own process)"
        line = f"{kind:36s}" + "".join(
            f"{memory[n]['peak_bytes'] / 2**30:>11.2f}GB " if "peak_bytes" in memory[n] else f"{'error':>13s} "
            for n in med)
        if ratio and all("peak_bytes" in memory[n] for n in ("trainer", "plain")):
            line += f"{memory['plain']['peak_bytes'] / memory['trainer']['peak_bytes']:>14.2f}x"
        lines.append(line)
    table = "\n".join(lines)
    print(table)
    for v in variants:
        getattr(v.scorer, "close", lambda: None)()

    targets = {}
    if ratio:
        targets = {
            "whole step >= 3x faster than TRL's 28.6 s (<= 9.53 s)": med["trainer"]["step"] <= 28.6 / 3,
            "whole step >= 2x faster than the plain loop": med["plain"]["step"] >= 2 * med["trainer"]["step"],
            "generation >= 2x faster than the plain loop's": med["plain"]["generation"] >= 2 * med["trainer"]["generation"],
        }
        if memory and all("peak_bytes" in memory[n] for n in ("trainer", "plain")):
            targets["peak memory no higher than the plain loop's"] = (
                memory["trainer"]["peak_bytes"] <= memory["plain"]["peak_bytes"])
        for k, v in targets.items():
            print(f"{'met    ' if v else 'NOT met'}  {k}")
    if args.json:
        result = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "model": {"parameters": n_params, "full": args.full, "layers": config.num_hidden_layers,
                      "hidden": config.hidden_size, "vocab": config.vocab_size},
            "prompt_tokens": len(prompt_ids), "group": args.group, "new_tokens": args.new_tokens,
            "precision": {v.name: v.precision for v in variants},
            "logprob_batch_size": args.logprob_batch_size, "compile": args.compile,
            "medians": med, "steps": timings, "memory": memory, "targets": targets, "table": table,
        }
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
