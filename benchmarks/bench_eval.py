"""Benchmark of the before/after evaluation: batched greedy decoding against one problem at a time.

    python benchmarks/bench_eval.py [--problems 16] [--new-tokens 64] [--batch-sizes 8,1] [--json out.json]
    python benchmarks/bench_eval.py --lengths forced --batch-sizes 8 --compiled   # + compile=true against eager
    python benchmarks/bench_eval.py --full --problems 500 --new-tokens 2048 --batch-sizes 16 --lengths forced
        # on a GPU: all of MATH-500 on the exact Qwen3-0.6B architecture (random weights, no EOS: the worst case)

Runs train_rlvr.evaluate itself (sorting by prompt length, left-padded batches, greedy decode with a
DynamicCache, scoring through the TimedVerifier) on the first --problems problems of
../shared/data/math500_test.json with the spec's prompt, on a random-weight model built like
bench_step.py's (default: the CPU stand-in, 4 layers, hidden 512, the real 151,936-token vocabulary
and tokenizer; --full: the exact architecture of --model-dir).

A random model never emits EOS, so response lengths are imposed:
  forced  every response has exactly --new-tokens tokens (eos id -1: nothing stops a row);
  mixed   problem i's response ends with EOS after L_i tokens, L_i spread evenly over 1..--new-tokens
          (a hash of the prompt), the same whatever the batch: a batch then runs until its longest
          row, as real evaluations do. Synthetic lengths, not a real model's.

The batch sizes are measured side by side in this one process: the problems, in evaluate's batch
order, are cut into chunks of the largest batch size, and the variants take turns chunk by chunk
(the order alternating), so a machine whose load drifts (a shared one) slows them alike. Medians
over --repeats of the total time; the ratio is batched problems/s over the last batch size's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import bench_step  # noqa: E402  (the stand-in model builder)
import train_rlvr as T  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(SHARED / "qwen3-0.6b-base"), help="config.json + tokenizer folder")
    p.add_argument("--full", action="store_true", help="the exact architecture of --model-dir (no stand-in shrink)")
    p.add_argument("--problems-file", default=str(SHARED / "data" / "math500_test.json"))
    p.add_argument("--problems", type=int, default=16, help="the first N problems of the file")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="8,1", help="eval_batch_size values to compare (the last is the baseline)")
    p.add_argument("--lengths", default="forced,mixed", help="forced, mixed or both")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats per variant (medians)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--precision", default="auto", choices=T.PRECISIONS)
    p.add_argument("--order-check", action="store_true",
                   help="also time batches in file order against prompt-length order (decode only, forced lengths)")
    p.add_argument("--compiled", action="store_true",
                   help="also time evaluation with compile=true against eager (forced lengths, the largest batch size)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", help="write the results here")
    for name in ("layers", "hidden", "intermediate", "heads", "kv-heads", "head-dim"):
        p.add_argument(f"--{name}", type=int)
    return p.parse_args(argv)


class ImposedLengths(torch.nn.Module):
    """The model, with each row's response length imposed: row r's logits pick EOS at its
    target-th token and never before. The target is a hash of the row's prompt tokens, so a
    problem ends at the same length alone or in any batch. Rows that end leave the batch at the
    next call (train_rlvr.decode drops them), and their targets with them."""

    def __init__(self, model, eos_id: int, max_new_tokens: int):
        super().__init__()
        self.inner, self.config, self.eos_id, self.n = model, model.config, eos_id, max_new_tokens
        self.targets, self.calls = [], 0

    def target(self, tokens: list[int]) -> int:
        digest = hashlib.blake2b(json.dumps(tokens).encode(), digest_size=8).digest()
        return 1 + int.from_bytes(digest, "little") % self.n

    def forward(self, input_ids, attention_mask=None, **kwargs):
        if input_ids.shape[1] > 1 or not self.targets:  # the prefill of a new batch
            rows = list(input_ids) if attention_mask is None else [
                row[mask.bool()] for row, mask in zip(input_ids, attention_mask)]
            self.targets, self.calls = [self.target(r.tolist()) for r in rows], 0
        elif input_ids.shape[0] < len(self.targets):  # decode dropped the rows that had ended (at its last check)
            self.targets = [t for t in self.targets if t > self.calls]
        out = self.inner(input_ids, attention_mask=attention_mask, **kwargs)
        logits = out.logits
        self.calls += 1
        for r, target in enumerate(self.targets):  # call c picks token c
            if self.calls == target:
                logits[r, -1] = float("-inf")
                logits[r, -1, self.eos_id] = 0.0
            else:
                logits[r, -1, self.eos_id] = float("-inf")
        return out


def time_evaluation(model, tokenizer, problems, cfg, eos_id, scorer, amp, device, decoders=None):
    """evaluate() timed; `decoders` (a T.Decoders, kept across calls) lets compile=true decode
    compiled, None decodes eagerly whatever the setting."""
    bench_step.sync(device)
    t0 = time.perf_counter()
    records = T.evaluate(model, tokenizer, problems, cfg, eos_id, scorer, amp, "bench", None, decoders)
    bench_step.sync(device)
    seconds = time.perf_counter() - t0
    return seconds, sum(r["tokens"] for r in records), [r["response"] for r in records]


def order_check(model, problems, new_tokens, amp, device, batch=8):
    """Decode-only: batches of `batch` problems in file order against prompt-length order."""
    prompts = [torch.tensor(p["prompt_ids"], device=device) for p in problems]
    orders = {"file order": list(range(len(prompts))),
              "length order": sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))}
    result = {}
    for name, order in orders.items():
        batches = [order[s:s + batch] for s in range(0, len(order), batch)]
        padded = sum(len(b) * max(len(prompts[i]) for i in b) for b in batches)
        real = sum(len(p) for p in prompts)
        bench_step.sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in batches:
                T.decode(model, [prompts[i] for i in b], new_tokens, -1, T.greedy_pick, amp)
        bench_step.sync(device)
        result[name] = {"seconds": time.perf_counter() - t0, "prompt_padding": 1 - real / padded}
    return result


def compiled_check(model, tokenizer, problems, cfg0, scorer, amp, device, size, repeats):
    """evaluate with compile=true (static cache, one graph, ended rows kept) against compile=false
    (DynamicCache, ended rows dropped), forced lengths: the compile (and its check against eager)
    happens in a warm-up outside the timings; then the two alternate, medians of `repeats`."""
    plan = T.dataclasses.replace(cfg0, eval_batch_size=size)
    decoders = T.Decoders()  # one compiled "eval" decoder for the warm-up and every timed run, as in a training run
    decoders.plan("eval", problems, cfg0.eval_max_new_tokens)
    t0 = time.perf_counter()
    time_evaluation(model, tokenizer, problems[:size], T.dataclasses.replace(plan, compile="true"), -1, scorer, amp,
                    device, decoders)
    warm = time.perf_counter() - t0
    seconds, texts = {"false": [], "true": []}, {}
    for rep in range(repeats):
        for mode in (("false", "true") if rep % 2 == 0 else ("true", "false")):
            s, tokens, texts[mode] = time_evaluation(model, tokenizer, problems, T.dataclasses.replace(plan, compile=mode),
                                                     -1, scorer, amp, device, decoders)
            seconds[mode].append(s)
    eager, compiled = statistics.median(seconds["false"]), statistics.median(seconds["true"])
    failed = [decoders.failed] if decoders.failed else []
    print(f"compiled evaluation (batch {size}, forced lengths, {tokens} tokens): compile + check {warm:.1f} s; "
          f"eager {eager:.2f} s, compiled {compiled:.2f} s ({eager / compiled:.2f}x); same responses: "
          f"{'yes' if texts['false'] == texts['true'] else 'NO'}{'; FELL BACK: ' + failed[0] if failed else ''}")
    return {"eager_seconds": seconds["false"], "compiled_seconds": seconds["true"], "compile_seconds": warm,
            "same_responses": texts["false"] == texts["true"], "fell_back": failed}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    precision = T.resolve_precision(T.Config(precision=args.precision, device=device.type), device)
    amp = T.autocast(device, precision)
    config, tokenizer, make_model = bench_step.build(args, device)
    model = make_model()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cfg0 = T.Config(device=str(device), eval_problems=args.problems, eval_dataset=args.problems_file,
                    eval_max_new_tokens=args.new_tokens)
    problems = T.check_problems(T.load_eval_problems(cfg0), cfg0, tokenizer, config.max_position_embeddings,
                                args.new_tokens, "eval_dataset")
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    kinds = [k.strip() for k in args.lengths.split(",") if k.strip()]
    lengths = [len(p["prompt_ids"]) for p in problems]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters ({'full' if args.full else 'stand-in'}: {config.num_hidden_layers} "
          f"layers, hidden {config.hidden_size}, vocab {config.vocab_size}); device {device} ({precision}); torch "
          f"threads {torch.get_num_threads()}; {len(problems)} MATH-500 problems (prompts {min(lengths)}-{max(lengths)} "
          f"tokens, mean {statistics.mean(lengths):.0f}); greedy, up to {args.new_tokens} new tokens", flush=True)

    variants = [(kind, size) for kind in kinds for size in sizes]
    timings = {v: [] for v in variants}
    responses = {}
    with T.verifier.TimedVerifier(timeout_s=2.0) as scorer:
        wrapped = ImposedLengths(model, eos_id, args.new_tokens)
        time_evaluation(model, tokenizer, problems[:1], T.dataclasses.replace(cfg0, eval_max_new_tokens=2), -1,
                        scorer, amp, device)  # warm-up outside the timings
        # The problems in evaluate's own batch order (by prompt length), cut into chunks of the
        # largest batch: every chunk is one batch of the batched variant. The variants take turns
        # chunk by chunk (the order alternating), so a change of the machine's load hits them alike.
        ordered = sorted(problems, key=lambda p: (len(p["prompt_ids"]), p["index"]))
        chunk = max(sizes)
        chunks = [ordered[i:i + chunk] for i in range(0, len(ordered), chunk)]
        turn = 0
        for rep in range(args.repeats):
            totals = {v: [0.0, 0] for v in variants}
            for part in chunks:
                for kind, size in (variants if turn % 2 == 0 else variants[::-1]):
                    cfg = T.dataclasses.replace(cfg0, eval_batch_size=size)
                    m, e = (model, -1) if kind == "forced" else (wrapped, eos_id)
                    seconds, tokens, texts = time_evaluation(m, tokenizer, part, cfg, e, scorer, amp, device)
                    totals[(kind, size)][0] += seconds
                    totals[(kind, size)][1] += tokens
                    if rep == 0:
                        responses.setdefault((kind, size), []).extend(texts)
                turn += 1
            for v, (seconds, tokens) in totals.items():
                timings[v].append((seconds, tokens))
                print(f"  repeat {rep + 1}/{args.repeats}: {v[0]} lengths, batch {v[1]}: {seconds:.2f} s, "
                      f"{tokens} tokens", file=sys.stderr, flush=True)
    same = all(responses[(kind, size)] == responses[(kind, sizes[-1])] for kind, size in variants)

    rows, results = [], {}
    header = f"{'lengths':8s}{'batch':>6s}{'seconds':>10s}{'problems/s':>12s}{'tokens/s':>10s}{'vs batch ' + str(sizes[-1]):>14s}"
    for kind, size in variants:
        seconds = statistics.median(t[0] for t in timings[(kind, size)])
        tokens = timings[(kind, size)][0][1]
        results[f"{kind}/{size}"] = {"seconds": seconds, "tokens": tokens, "problems_per_s": len(problems) / seconds,
                                     "tokens_per_s": tokens / seconds, "all_seconds": [t[0] for t in timings[(kind, size)]]}
    for kind, size in variants:
        r, base = results[f"{kind}/{size}"], results[f"{kind}/{sizes[-1]}"]
        ratio = r["problems_per_s"] / base["problems_per_s"]
        r["ratio"] = ratio
        rows.append(f"{kind:8s}{size:>6d}{r['seconds']:>10.2f}{r['problems_per_s']:>12.3f}{r['tokens_per_s']:>10.1f}"
                    f"{ratio:>13.2f}x")
    print(f"median of {args.repeats} (problems/s and tokens/s of generated tokens, EOS included)")
    print("\n".join([header, *rows]))
    print(f"same responses at every batch size: {'yes' if same else 'NO'}")
    if 8 in sizes and 1 in sizes and "forced" in kinds:
        met = results["forced/8"]["problems_per_s"] >= 3 * results["forced/1"]["problems_per_s"]
        print(f"{'met    ' if met else 'NOT met'}  eval_batch_size 8 >= 3x the problems/s of one at a time (forced lengths)")

    order = order_check(model, problems, args.new_tokens, amp, device) if args.order_check else None
    compiled = None
    if args.compiled:
        with T.verifier.TimedVerifier(timeout_s=2.0) as scorer:
            compiled = compiled_check(model, tokenizer, problems, cfg0, scorer, amp, device, max(sizes), args.repeats)
    if order:
        for name, r in order.items():
            print(f"{name:13s} batches of 8, decode only: {r['seconds']:.2f} s, prompt padding {100 * r['prompt_padding']:.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "precision": precision,
            "model": {"parameters": n_params, "full": args.full, "layers": config.num_hidden_layers,
                      "hidden": config.hidden_size, "vocab": config.vocab_size},
            "problems": len(problems), "new_tokens": args.new_tokens, "repeats": args.repeats,
            "results": results, "same_responses": same, "order_check": order,
            "compiled": compiled}, indent=1))


if __name__ == "__main__":
    main()
