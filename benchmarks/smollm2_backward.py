"""The log-probability and backward pass of a SmolLM2 group against its FLOP count, and what sharing the prompt's
forward among the group's responses would save.

    python benchmarks/smollm2_backward.py [--model runs/smollm2] [--repeats 2] [--json out.json]

Needs the real-model demo's folder (python examples/make_smollm2.py runs/smollm2). The group: 8 responses of
the demo's length (18 tokens, EOS included) after examples/smollm2.yaml's prompt for problem 0 of train.json,
rewards [1, 1, 0, 0, 1, 0, 0, 0]. Three ways, each timed on the same group (best of --repeats):

- the trainer's own accumulate_policy_gradient (the spec: one response at a time, each its own forward over
  prompt + response and its own backward);
- a matrix-product floor: the same products as plain torch.mm calls, forward and backward (what the BLAS
  gives for these shapes; no attention, no elementwise ops);
- the prompt shared (a sketch here, not in the trainer): the prompt's forward once, its keys, values and
  last logits held as leaves; each response's forward reads them as a cache and its backward stops at them;
  after the 8th, one backward through the prompt with the leaves' summed gradients. The same gradient up to
  the order of summation: its difference from the spec's is printed next to the tolerance the tests derive.

FLOPs are counted from the shapes: 2 per multiply-add of every linear layer (per position: the 30 layers'
106 M parameters; the LM head only at the response positions, logits_to_keep), attention's QK and PV, and the
backward at twice the forward (gradients of the inputs and of the weights).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_rlvr as T  # noqa: E402

REWARDS = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def group(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (model_dir / "config.json").is_file():
        print(f"error: {model_dir} is not a model folder; run python examples/make_smollm2.py {model_dir}",
              file=sys.stderr)
        sys.exit(2)
    demo = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    problem = json.loads((model_dir / "train.json").read_text())[0]
    prompt = torch.tensor(tok(T.build_prompt(demo["prompt_template"], problem["problem"]),
                              add_special_tokens=False)["input_ids"])
    eos = tok.convert_tokens_to_ids(demo["eos_token"])
    a, b = problem["problem"].split(" + ")
    text = f" {a} + {b} = {int(a) + int(b)}, so the answer is \\boxed{{{int(a) + int(b)}}}."
    body = tok(text, add_special_tokens=False)["input_ids"]
    responses = [torch.tensor(body[:17] + [eos]) for _ in range(8)]  # the demo's 18 tokens, EOS included
    for i, r in enumerate(responses):  # 8 different responses: the last digit before the box varies
        r[min(4, len(r) - 2)] = (r[min(4, len(r) - 2)] + i) % len(tok)
    return model, prompt, responses


def spec_pass(model, prompt, responses, advantages):
    params = [p for p in model.parameters() if p.requires_grad]
    return T.accumulate_policy_gradient(model, params, prompt, responses, advantages, len(responses), nullcontext())


def shared_prompt_pass(model, prompt, responses, advantages):
    """The spec's gradient with the prompt's forward and backward run once (see the module docstring)."""
    from transformers import DynamicCache
    params = [p for p in model.parameters() if p.requires_grad]
    T.zero_gradients(params)
    cache = DynamicCache(config=model.config)
    last = model(prompt[None], cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    held = [(layer.keys, layer.values) for layer in cache.layers]
    leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in held]
    last_leaf = last.detach().requires_grad_()
    total = 0.0
    for a, r in zip(advantages, responses):
        c = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(leaves):
            c.update(k, v, i)
        rest = model(r[:-1][None], cache=c, use_cache=True).logits[0]
        lp = T.gathered_log_probs(torch.cat([last_leaf[None], rest]), r)
        loss = T.policy_loss(a, T.sequence_log_prob(lp), len(responses))
        loss.backward()
        total += loss.item()
    outputs = [t for kv in held for t in kv] + [last]
    grads = [t.grad for kv in leaves for t in kv] + [last_leaf.grad]
    torch.autograd.backward(outputs, grads)
    return total


def flops(model, prompt_len: int, lengths: list[int], shared: bool) -> float:
    c = model.config
    head = c.vocab_size * c.hidden_size
    body = sum(p.numel() for n, p in model.named_parameters() if "layers." in n and p.dim() == 2)
    attn_width = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)

    def forward(new: int, before: int) -> float:  # `new` positions after `before` cached ones
        attention = 2 * 2 * attn_width * c.num_hidden_layers * sum(before + j + 1 for j in range(new))
        return 2 * body * new + attention

    if shared:
        f = forward(prompt_len, 0) + 2 * head + sum(forward(n - 1, prompt_len) + 2 * head * (n - 1) for n in lengths)
    else:
        f = sum(forward(prompt_len + n - 1, 0) + 2 * head * n for n in lengths)
    return 3 * f  # forward + backward (twice the forward)


def mm_floor(model, prompt_len: int, lengths: list[int]) -> float:
    """Seconds of the spec pass's matrix products alone (forward and backward), as plain torch.mm calls."""
    c = model.config
    weights = [p.detach() for n, p in model.named_parameters() if "layers." in n and p.dim() == 2]
    head = model.get_output_embeddings().weight.detach()
    t0 = time.perf_counter()
    for n in lengths:
        x = torch.randn(prompt_len + n - 1, c.hidden_size)
        for w in weights:
            inp = torch.randn(prompt_len + n - 1, w.shape[1])
            out = inp @ w.t()
            g = torch.randn_like(out)
            g @ w, g.t() @ inp  # noqa: B018  the input's and the weight's gradient
        h = x[-n:]
        out = h @ head.t()
        g = torch.randn_like(out)
        g @ head, g.t() @ h  # noqa: B018
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/smollm2", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model, prompt, responses = group(args.model)
    rewards = torch.tensor(REWARDS)
    advantages = T.compute_advantages(rewards, 1e-4, zero_variance=T.equal_rewards(rewards))
    params = [p for p in model.parameters() if p.requires_grad]
    lengths = [len(r) for r in responses]
    times = {"spec": [], "shared": [], "mm_floor": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        spec = spec_pass(model, prompt, responses, advantages)
        times["spec"].append(time.perf_counter() - t0)
        spec_grads = [p.grad.clone() for p in params]
        t0 = time.perf_counter()
        shared_loss = shared_prompt_pass(model, prompt, responses, advantages)
        times["shared"].append(time.perf_counter() - t0)
        times["mm_floor"].append(mm_floor(model, len(prompt), lengths))
    shared_grads = [p.grad.clone() for p in params]
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    a, b = flat(spec_grads), flat(shared_grads)
    diff = float((a - b).norm() / a.norm())
    best = {k: min(v) for k, v in times.items()}
    f_spec, f_shared = flops(model, len(prompt), lengths, False), flops(model, len(prompt), lengths, True)
    report = {"prompt_tokens": len(prompt), "response_tokens": lengths, "seconds": best,
              "gflop": {"spec": f_spec / 1e9, "shared": f_shared / 1e9},
              "gflop_per_second": {"spec": f_spec / best["spec"] / 1e9, "shared": f_shared / best["shared"] / 1e9,
                                   "mm_floor": f_spec / best["mm_floor"] / 1e9},
              "loss": {"spec": spec.loss, "shared": shared_loss},
              "gradient_relative_difference": diff, "threads": torch.get_num_threads()}
    print(f"SmolLM2-135M-Instruct, float32, 8 responses of {lengths[0]} tokens after a {len(prompt)}-token prompt, "
          f"{torch.get_num_threads()} threads (best of {args.repeats})\n")
    print("| log-probabilities + backward of the group | seconds | GFLOP | GFLOP/s |")
    print("|---|---|---|---|")
    print(f"| rlvr, one response at a time (the spec) | {best['spec']:.2f} | {f_spec / 1e9:.0f} | "
          f"{f_spec / best['spec'] / 1e9:.1f} |")
    print(f"| the same matrix products alone (torch.mm) | {best['mm_floor']:.2f} | {f_spec / 1e9:.0f} | "
          f"{f_spec / best['mm_floor'] / 1e9:.1f} |")
    print(f"| the prompt's forward shared (a sketch) | {best['shared']:.2f} | {f_shared / 1e9:.0f} | "
          f"{f_shared / best['shared'] / 1e9:.1f} |")
    print(f"\nshared / spec: {best['shared'] / best['spec']:.2f} of the time, {f_shared / f_spec:.2f} of the FLOPs; "
          f"loss {spec.loss:.6f} vs {shared_loss:.6f}; gradient |shared - spec| / |spec| = {diff:.2e}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
