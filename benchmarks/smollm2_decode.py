"""Where a SmolLM2 rollout group's generation goes, against two references measured in the same process.

    python benchmarks/smollm2_decode.py [--model runs/smollm2] [--groups 3] [--json out.json]

Needs the real-model demo's folder (python examples/make_smollm2.py runs/smollm2). One group is the
trainer's: 8 rollouts of one problem of train.json with examples/smollm2.yaml's prompt, temperature 0.8,
top-p 0.9, at most 48 new tokens, through the trainer's own generate_rollouts (its Decoders, as in a run).
Beside it, interleaved group by group on the same batch:

- `generate`: transformers' model.generate with the same sampling (do_sample, temperature 0.8, top_p 0.9,
  top_k 0) and EOS, 8 rows of the prompt;
- the eager floor: a plain greedy loop over the model with its DynamicCache (a batched prompt pass, then one
  argmax token per row per step), as many decode steps as the trainer's group took.

Each is timed whole (prompt pass included) and given as decode steps per second of its group, the measure a
run's generation seconds give. The trainer's group is then taken apart: its prompt pass; per decode step the
30 layers' forward, the LM head (final norm and the 49,152-token projection; hooks on the modules), the
cache's concatenations inside the layers (the profiler's aten::cat), the sampler (top-p and the draw), the
rest of the loop (Python and the small ops between); host syncs counted. Last, why the floor is where it is:
the machine's memory bandwidth (a sum over 540 MB) against the bandwidth of the forward's matrix products
at 8 rows (MKL, as torch calls it, and oneDNN's prepacked kernel, which is faster but rounds differently).
Run it alone: a second job on a 2-core machine makes every figure several times slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_rlvr as T  # noqa: E402  the trainer's own generation


def load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (model_dir / "config.json").is_file():
        print(f"error: {model_dir} is not a model folder; run python examples/make_smollm2.py {model_dir}",
              file=sys.stderr)
        sys.exit(2)
    demo = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    cfg = T.Config(**{k: v for k, v in demo.items() if k in ("prompt_template", "eos_token", "max_new_tokens")},
                   device="cpu")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    problems = json.loads((model_dir / "train.json").read_text())
    return cfg, tok, model, problems


class Clock:
    """Seconds spent inside a module's forward (hooks) or a wrapped function, summed; `skip` (the prompt pass's
    clock while it runs) keeps the per-step clocks out of the prompt pass."""

    def __init__(self, skip=None):
        self.total, self.calls, self._t0, self.skip = 0.0, 0, 0.0, skip

    def start(self, *_):
        self._t0 = time.perf_counter()

    def stop(self, *_):
        if self.skip is None or not self.skip.running:
            self.total += time.perf_counter() - self._t0
            self.calls += 1

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self.running = True
            self.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop()
                self.running = False
        return timed


def trainer_group(model, prompt, cfg, eos, step, decoders):
    streams = T.rollout_streams(cfg.seed, step, range(cfg.group_size), "cpu")
    t0 = time.perf_counter()
    responses, _ = T.generate_rollouts(model, prompt, cfg, eos, streams, nullcontext(), decoders)
    return time.perf_counter() - t0, max(len(r) for r in responses), responses


@torch.no_grad()
def hf_generate(model, prompt, cfg, eos):
    from transformers import GenerationConfig
    gen = GenerationConfig(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                           max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, pad_token_id=eos)
    batch = prompt.repeat(cfg.group_size, 1)
    t0 = time.perf_counter()
    out = model.generate(batch, attention_mask=torch.ones_like(batch), generation_config=gen)
    return time.perf_counter() - t0, out.shape[1] - batch.shape[1]


@torch.no_grad()
def greedy_floor(model, prompt, rows, steps):
    from transformers import DynamicCache
    cache, name = DynamicCache(config=model.config), T.cache_arg(model)
    t0 = time.perf_counter()
    logits = T.next_token_scores(model, prompt.repeat(rows, 1), cache, name)
    for _ in range(steps - 1):
        logits = T.next_token_scores(model, logits.argmax(dim=-1, keepdim=True), cache, name)
    return time.perf_counter() - t0


def anatomy(model, prompt, cfg, eos, step):
    """One trainer group taken apart, after a first group (the one-time check of the shared prompt pass)."""
    decoders = T.Decoders()
    trainer_group(model, prompt, cfg, eos, step, decoders)
    prefill = Clock()
    prefill.running = False
    layers, head, sampler = Clock(prefill), Clock(prefill), Clock(prefill)
    hooks = [model.model.layers[0].register_forward_pre_hook(layers.start),
             model.model.layers[-1].register_forward_hook(layers.stop),
             model.model.norm.register_forward_pre_hook(head.start), model.lm_head.register_forward_hook(head.stop)]
    real_pass, real_sample, real_tolist = T.prompt_pass, T.sample_next_token, torch.Tensor.tolist
    syncs = {"n": 0}

    def counted_tolist(self):
        syncs["n"] += 1
        return real_tolist(self)
    T.prompt_pass, T.sample_next_token, torch.Tensor.tolist = prefill.wrap(real_pass), sampler.wrap(real_sample), \
        counted_tolist
    from torch.profiler import ProfilerActivity, profile
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            seconds, steps, _ = trainer_group(model, prompt, cfg, eos, step, decoders)
    finally:
        for h in hooks:
            h.remove()
        T.prompt_pass, T.sample_next_token, torch.Tensor.tolist = real_pass, real_sample, real_tolist
    cat = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "aten::cat") / 1e6
    # host syncs: decode's own checks; responses_of's and the rewards' reading of the tokens come after
    return {"profiled_seconds": seconds, "decode_steps": steps, "prefill": prefill.total, "layers": layers.total,
            "layer_calls": layers.calls, "head": head.total, "sampler": sampler.total, "cache_cat": cat,
            "host_syncs": syncs["n"]}


def bandwidth():
    """GB/s of a sum over 540 MB (the memory's), and of the 8-row products the forward makes, MKL and oneDNN."""
    f = torch.nn.functional
    out = {}
    x = torch.randn(135_000_000)
    out["memory_sum"] = 540e6 / best_of(lambda: x.sum())
    del x
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(1536, 576, generator=g) for _ in range(90)]  # 318 MB, as the MLPs' stream
    a = torch.randn(8, 576, generator=g)
    nbytes = sum(w.numel() * 4 for w in weights)
    out["mkl_linear_8_rows"] = nbytes / best_of(lambda: [f.linear(a, w) for w in weights])
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
        out["onednn_packed_8_rows"] = nbytes / best_of(
            lambda: [torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], "") for p in packed])
        diff = (f.linear(a, weights[0]) - torch.ops.mkldnn._linear_pointwise(a, packed[0], None, "none", [], ""))
        out["onednn_max_abs_difference"] = float(diff.abs().max())
    except Exception as e:  # not every build has oneDNN's packed linear
        out["onednn_packed_8_rows"] = f"unavailable ({type(e).__name__})"
    return {k: (v / 1e9 if isinstance(v, float) and not k.endswith("difference") else v) for k, v in out.items()}


def best_of(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/smollm2", type=Path)
    ap.add_argument("--groups", type=int, default=5, help="groups of each kind, interleaved (and one warm-up first)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cfg, tok, model, problems = load(args.model)
    eos = tok.convert_tokens_to_ids(cfg.eos_token)
    rows = {"trainer": [], "generate": [], "floor": []}
    decoders = T.Decoders()
    for k in range(args.groups + 1):
        problem = problems[k % len(problems)]
        prompt = torch.tensor(tok(T.build_prompt(cfg.prompt_template, problem["problem"]),
                                  add_special_tokens=False)["input_ids"])
        seconds, steps, _ = trainer_group(model, prompt, cfg, eos, k + 1, decoders)
        hf_seconds, hf_steps = hf_generate(model, prompt, cfg, eos)
        floor_seconds = greedy_floor(model, prompt, cfg.group_size, steps)
        if k == 0:
            continue  # warm-up (and the trainer's one-time check of its shared prompt pass)
        rows["trainer"].append((steps, seconds))
        rows["generate"].append((hf_steps, hf_seconds))
        rows["floor"].append((steps, floor_seconds))
    prompt = torch.tensor(tok(T.build_prompt(cfg.prompt_template, problems[0]["problem"]),
                              add_special_tokens=False)["input_ids"])
    parts = anatomy(model, prompt, cfg, eos, 1)
    bw = bandwidth()
    rate = {k: sum(s for s, _ in v) / sum(t for _, t in v) for k, v in rows.items()}
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    report = {"prompt_tokens": len(prompt), "threads": torch.get_num_threads(), "rows": cfg.group_size,
              "groups": {k: [{"decode_steps": s, "seconds": round(t, 3)} for s, t in v] for k, v in rows.items()},
              "decode_steps_per_second": rate, "trainer_over_floor": rate["trainer"] / rate["floor"],
              "trainer_over_generate": rate["trainer"] / rate["generate"], "anatomy": parts, "bandwidth_GBps": bw,
              "weights_GB": weights_gb, "bandwidth_limit_steps_per_second": bw["memory_sum"] / weights_gb}
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def table(r: dict) -> str:
    a = r["anatomy"]
    decode = a["profiled_seconds"] - a["prefill"]
    per = lambda x: f"{1e3 * x / max(1, a['layer_calls']):.1f} ms"  # noqa: E731  per decode step after the prompt
    rest = decode - a["layers"] - a["head"] - a["sampler"]
    lines = [
        f"SmolLM2-135M-Instruct, float32, {r['rows']} rows, {r['prompt_tokens']}-token prompt, "
        f"{r['threads']} threads",
        "",
        "| generation of one group (prompt pass included) | decode steps / s | vs the eager floor |",
        "|---|---|---|",
    ]
    for name, key in (("rlvr (generate_rollouts)", "trainer"), ("transformers generate, same sampling", "generate"),
                      ("eager floor: greedy loop with its cache", "floor")):
        v = r["decode_steps_per_second"][key]
        lines.append(f"| {name} | {v:.2f} | {v / r['decode_steps_per_second']['floor']:.2f}x |")
    lines += [
        f"| bandwidth limit: {r['weights_GB']:.2f} GB of weights a step at {r['bandwidth_GBps']['memory_sum']:.1f} "
        f"GB/s | {r['bandwidth_limit_steps_per_second']:.1f} | |",
        "",
        f"rlvr's group taken apart (profiled: {a['decode_steps']} tokens, {a['layer_calls']} decode steps after "
        f"the prompt pass, {a['profiled_seconds']:.2f} s):",
        "",
        "| part | seconds | per decode step |",
        "|---|---|---|",
        f"| the prompt pass (run once for the group) | {a['prefill']:.3f} | |",
        f"| the 30 layers' forward | {a['layers']:.3f} | {per(a['layers'])} |",
        f"| of which the cache's concatenations (aten::cat) | {a['cache_cat']:.3f} | {per(a['cache_cat'])} |",
        f"| the LM head (final norm + 49,152-token projection) | {a['head']:.3f} | {per(a['head'])} |",
        f"| the sampler (top-p and the draw) | {a['sampler']:.3f} | {per(a['sampler'])} |",
        f"| the rest of the loop (Python, small ops) | {rest:.3f} | {per(rest)} |",
        f"| host syncs (decode's checks) | {a['host_syncs']} in all | |",
        "",
        f"memory sum {r['bandwidth_GBps']['memory_sum']:.1f} GB/s; 8-row matrix products: MKL (torch's) "
        f"{r['bandwidth_GBps']['mkl_linear_8_rows']:.1f} GB/s, oneDNN prepacked "
        f"{fmt(r['bandwidth_GBps']['onednn_packed_8_rows'])} GB/s (max |difference| "
        f"{fmt(r['bandwidth_GBps'].get('onednn_max_abs_difference', float('nan')))})",
    ]
    return "\n".join(lines)


def fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
