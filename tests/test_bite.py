"""Tests that bite: every setting reaches the math it drives, and every claim has a test that fails
when it breaks (issue 9). CPU, tiny local models, in process.

One scripted run of main() (the `scripted` fixture) serves several tests: the decode loop runs for
real, but the sampled token is replaced by a fixed script, so that the real verifier sees known
responses (right, wrong and missing answers) and every figure of the table and summary is known
in advance."""

import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_rlvr as T
from conftest import ROOT, SHARED

# The spec's prompt, written out here rather than taken from the product.
SPEC_TEXT = ("You are a helpful math assistant.\nAnswer the question and write the final result on a new line as:\n"
             "\\boxed{ANSWER}\n\nQuestion:\n")


def _cache_of(kwargs):
    """The KV cache a forward call was given, under either name (transformers 5.24 renamed it)."""
    return next((kwargs[k] for k in ("cache", "past_key_values") if kwargs.get(k) is not None), None)


def spec_prompt(problem):
    return SPEC_TEXT + problem + "\n\nAnswer:"


def _args(model_dir, data, out, *extra):
    return ["--config", str(ROOT / "config.yaml"), f"model={model_dir}", f"dataset={data}", "device=cpu",
            f"output_dir={out}", "group_size=4", "max_new_tokens=6", *extra]


# ----------------------------------------------------------------------------------------------
# The scripted run: 3 problems ("What is i + i?", answer 2i), 4 rollouts each, real verifier

EOS_ID = 0
SCRIPT = {  # step -> the 4 responses' texts; None: no EOS, the response runs to max_new_tokens
    1: ["\\boxed{0}", "\\boxed{1}", "so 0", None],           # rewards 1 0 0 0: the one group with variance
    2: ["\\boxed{3}", "2", "\\boxed{}", "\\boxed{3}"],        # all 0
    3: ["\\boxed{4}"] * 4,                                    # all 1
}
CUT_TEXT = "x = 0 and more"  # the tiny tokenizer makes 9 tokens of it: exactly max_new_tokens
STATUSES = {1: ["correct", "wrong", "no_answer", "no_answer"], 2: ["wrong", "no_answer", "no_answer", "wrong"],
            3: ["correct"] * 4}
SETTINGS = ["num_problems=3", "max_new_tokens=9", "temperature=0.7", "top_p=0.85", "learning_rate=3e-3",
            "max_grad_norm=0.05", "save_every=0"]


def _script_tokens(tok):
    out = {}
    for step, texts in SCRIPT.items():
        out[step] = [tok(CUT_TEXT, add_special_tokens=False)["input_ids"] if t is None
                     else tok(t, add_special_tokens=False)["input_ids"] + [EOS_ID] for t in texts]
    assert len(out[1][3]) == 9
    return out


@pytest.fixture(scope="module")
def scripted(tiny_model_dir, tiny_data_file, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    script = _script_tokens(tok)
    rec = {"forwards": [], "sampling": [], "scored": [], "accumulate": [], "optimizer": []}
    at = {"step": None, "t": 0}
    real_load, real_streams, real_sample = T.load_model_and_tokenizer, T.rollout_streams, T.sample_next_token
    real_score, real_accumulate, real_step = T.score_rollouts, T.accumulate_policy_gradient, T.optimizer_step

    def load(*a, **k):
        model, tokenizer, eos_id = real_load(*a, **k)
        rec["initial"] = copy.deepcopy(model)

        def hook(module, args, kwargs):
            ids = args[0] if args else kwargs["input_ids"]
            rec["forwards"].append({"ids": ids.clone(), "cached": _cache_of(kwargs) is not None,
                                    "use_cache": kwargs.get("use_cache")})
        model.register_forward_pre_hook(hook, with_kwargs=True)
        return model, tokenizer, eos_id

    def streams(seed, step, rollouts, device):
        at.update(step=step, t=0)
        return real_streams(seed, step, rollouts, device)

    def sample(logits, temperature, top_p, u):
        rec["sampling"].append((temperature, top_p))
        real_sample(logits, temperature, top_p, u)  # runs, but the script decides
        t, at["t"] = at["t"], at["t"] + 1
        return torch.tensor([r[t] if t < len(r) else EOS_ID for r in script[at["step"]]])

    def score(scorer, texts, gold):
        rec["scored"].append((list(texts), gold))
        return real_score(scorer, texts, gold)

    def accumulate(model, params, prompt_ids, responses, advantages, *a, **k):
        rec["accumulate"].append((prompt_ids.clone(), [r.clone() for r in responses], advantages.clone()))
        return real_accumulate(model, params, prompt_ids, responses, advantages, *a, **k)

    def step(params, optimizer, max_grad_norm, *a):
        call = {"before": [p.detach().clone() for p in params], "raw": [p.grad.clone() for p in params],
                "lr": [g["lr"] for g in optimizer.param_groups], "max_grad_norm": max_grad_norm}
        call["result"] = real_step(params, optimizer, max_grad_norm, *a)
        call["clipped"] = [p.grad.clone() for p in params]
        call["after"] = [p.detach().clone() for p in params]
        rec["optimizer"].append(call)
        return call["result"]

    out = tmp_path_factory.mktemp("scripted") / "run"
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in [("load_model_and_tokenizer", load), ("rollout_streams", streams),
                         ("sample_next_token", sample), ("score_rollouts", score),
                         ("accumulate_policy_gradient", accumulate), ("optimizer_step", step)]:
            mp.setattr(T, name, fn)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = T.main(_args(tiny_model_dir, tiny_data_file, out, *SETTINGS))
    assert code == 0, stderr.getvalue()
    rec.update(tok=tok, script=script, out=out, stdout=stdout.getvalue(),
               metrics=[json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()],
               rollouts=[json.loads(l) for l in (out / "rollouts.jsonl").read_text().splitlines()])
    return rec


def test_the_model_is_fed_exactly_the_spec_prompt_with_no_bos(scripted):
    """Point 2: every prefill and every log-prob forward starts with tokenizer(spec prompt filled
    with the problem, add_special_tokens=False), and nothing comes before it."""
    tok, model = scripted["tok"], scripted["initial"]
    prompts = [tok(spec_prompt(f"What is {i} + {i}?"), add_special_tokens=False)["input_ids"] for i in range(3)]
    assert tok.decode(prompts[1]) == spec_prompt("What is 1 + 1?")
    prefills = [f["ids"] for f in scripted["forwards"] if f["cached"] and f["ids"].shape[1] > 1]
    assert len(prefills) == 3
    for ids, expected in zip(prefills, prompts):
        assert ids.tolist() == [expected] * 4
        assert ids[0, 0].item() not in (EOS_ID, model.config.bos_token_id) and EOS_ID not in expected
    logprob = [f["ids"] for f in scripted["forwards"] if not f["cached"]]
    assert len(logprob) == 4  # step 1's four responses; steps 2 and 3 have zero variance
    assert all(ids[0, :len(prompts[0])].tolist() == prompts[0] for ids in logprob)
    assert all(f["use_cache"] is False for f in scripted["forwards"] if not f["cached"])


def test_the_decode_loop_samples_at_the_configured_temperature_and_top_p(scripted):
    """Point 1, through main(): the settings reach every draw."""
    # steps 2 and 3 are done after 6 tokens, which the loop learns at its check after token 8
    # (T.CHECK_EVERY): 2 draws more each, whose tokens are dropped
    assert len(scripted["sampling"]) == 9 + 8 + 8 and T.CHECK_EVERY == 8
    assert set(scripted["sampling"]) == {(0.7, 0.85)}


def test_the_real_verifier_scores_the_response_text_alone(scripted):
    """Point 5: reward 1 from the real verifier end to end, and the verifier never sees the
    prompt (whose \\boxed{ANSWER} would turn every response without a box into 'wrong')."""
    scored = scripted["scored"]
    assert [gold for _, gold in scored] == ["0", "2", "4"]
    for step, (texts, _) in enumerate(scored, start=1):
        assert texts == [CUT_TEXT if t is None else t for t in SCRIPT[step]]
    by_step = {s: [r for r in scripted["rollouts"] if r["step"] == s] for s in (1, 2, 3)}
    for s, rows in by_step.items():
        assert [r["status"] for r in rows] == STATUSES[s]
        assert [r["reward"] for r in rows] == [1.0 if st == "correct" else 0.0 for st in STATUSES[s]]
        assert [r["response"] for r in rows] == scored[s - 1][0]
    assert [r["answer"] for r in by_step[1]] == ["0", "1", None, None]
    assert [r["cut_at_limit"] for r in by_step[1]] == [False, False, False, True]


def test_the_table_and_the_summary_print_the_right_figures(scripted):
    """Point 6: the figures, not only the labels: sample std is the unbiased one (0.5 for
    1,0,0,0; the biased one is 0.433013) and the summary counts what happened."""
    lines = scripted["stdout"].splitlines()
    rows = [l.split() for l in lines[1:4]]
    tokens = [sum(len(r) for r in scripted["script"][s]) for s in (1, 2, 3)]
    assert [r[:5] for r in rows] == [["1", "1", "0.250", "0.500000", str(tokens[0])],
                                     ["2", "0", "0.000", "0.000000", str(tokens[1])],
                                     ["3", "4", "1.000", "0.000000", str(tokens[2])]]
    m = scripted["metrics"]
    assert rows[0][5:7] == [f"{m[0]['policy_loss']:.6f}", f"{m[0]['grad_norm']:.3f}"] and float(rows[0][6]) > 0
    assert [r[5:7] for r in rows[1:]] == [["0.000000", "0.000"]] * 2
    assert m[0]["reward_std"] == pytest.approx(0.5, abs=1e-7)
    assert lines[4] == ""
    assert lines[5:11] == [
        "correct rollouts        5/12 (mean reward 0.4167)",
        "zero-variance groups    2/3",
        "non-zero gradient       1 steps: 1",
        "weights changed         3 steps: 1, 2, 3",
        "skipped (non-finite)    0 steps",
        "verifier overruns       0 rollouts scored 0 after a timeout or a crash",
    ]
    assert re.fullmatch(rf"total time .* generation {sum(tokens)} tokens at [0-9.]+ tokens/s", lines[11])


def _by_hand_sequence_log_probs(model, prompt, responses):
    """Full-vocabulary float64 log-softmax over prompt + response, every response token summed."""
    out = []
    for r in responses:
        ids = torch.cat([prompt, r]).unsqueeze(0)
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        out.append(sum(logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(r.tolist())))
    return out


def test_the_eos_token_is_a_trained_response_token(scripted):
    """Point 4: the responses that reach the loss end with their EOS, the logged sequence
    log-probabilities include its term, and so does the gradient."""
    prompt, responses, adv = scripted["accumulate"][0]
    assert [r.tolist() for r in responses] == scripted["script"][1]
    assert [r[-1].item() for r in responses[:3]] == [EOS_ID] * 3
    model = copy.deepcopy(scripted["initial"])  # step 1's log-probs come from the initial weights
    seqs = _by_hand_sequence_log_probs(model, prompt, responses)
    logged = [r["sequence_log_prob"] for r in scripted["rollouts"] if r["step"] == 1]
    assert logged == pytest.approx([s.item() for s in seqs], abs=1e-4)
    without_eos = _by_hand_sequence_log_probs(model, prompt, [r[:-1] for r in responses[:3]])
    assert all(abs(a.item() - b.item()) > 1e-2 for a, b in zip(seqs, without_eos))  # the EOS term is visible
    (-(adv.double() * torch.stack(seqs)).sum() / 4).backward()
    for raw, p in zip(scripted["optimizer"][0]["raw"], model.parameters()):
        torch.testing.assert_close(raw, p.grad, rtol=1e-4, atol=1e-7)


def test_learning_rate_and_max_grad_norm_reach_the_optimizer_and_the_clip(scripted):
    """Point 3: the step of step 1 is a by-hand AdamW step at the configured lr (3e-3) on the
    gradient clipped to the configured max norm (0.05); the logged norm is the raw one."""
    call = scripted["optimizer"][0]
    assert call["lr"] == [3e-3] and call["max_grad_norm"] == 0.05
    raw_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in call["raw"]))
    assert raw_norm > 0.5  # so the clip really acts
    assert call["result"][0] == pytest.approx(raw_norm, rel=1e-5) == scripted["metrics"][0]["grad_norm"]
    clipped_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in call["clipped"]))
    assert clipped_norm == pytest.approx(0.05, rel=1e-4)
    lr, wd, eps = 3e-3, 0.01, 1e-8  # AdamW's first step: m_hat = g, v_hat = g^2
    for before, g, after in zip(call["before"], call["clipped"], call["after"]):
        b, g = before.double(), g.double()
        expected = b * (1 - lr * wd) - lr * g / (g.abs() + eps)
        torch.testing.assert_close(after.double(), expected, rtol=0, atol=1e-6)  # float32 rounding
    moved = math.sqrt(sum((a - b).double().pow(2).sum().item() for a, b in zip(call["after"], call["before"])))
    assert call["result"][1] == pytest.approx(moved, rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Point 1: the decode loop follows temperature and top-p, as transformers' warpers would


def _reference_rollouts(model, prompt, rows, steps, temperature, top_p, seed, step):
    """A by-hand decode: a full forward pass per token (no cache), transformers' warpers, and an
    inverse CDF over their probabilities with the rollout streams' uniforms."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    streams = T.rollout_streams(seed, step, rows, "cpu")
    seqs = prompt.repeat(len(rows), 1)
    for _ in range(steps):
        with torch.no_grad():
            scores = model(seqs).logits[:, -1].float()
        scores = TemperatureLogitsWarper(temperature)(seqs, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(seqs, scores)
        cdf = torch.softmax(scores, dim=-1).double().cumsum(dim=-1)
        u = torch.cat([torch.rand(1, 1, generator=g, dtype=torch.float64) for g in streams])
        token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=cdf.shape[-1] - 1)
        seqs = torch.cat([seqs, token], dim=1)
    return seqs[:, len(prompt):].tolist()


def test_generate_rollouts_follows_temperature_and_top_p(tiny_model):
    model, _ = tiny_model
    prompt = torch.tensor([5, 17, 33, 100, 7])

    def decode(temperature, top_p):
        cfg = T.Config(group_size=4, max_new_tokens=8, temperature=temperature, top_p=top_p, device="cpu",
                       compile="false")
        responses, _ = T.generate_rollouts(model, prompt, cfg, -1, T.rollout_streams(0, 2, range(4), "cpu"),
                                           T.nullcontext())
        return [r.tolist() for r in responses]
    tokens = decode(0.7, 0.8)
    assert tokens == _reference_rollouts(model, prompt, range(4), 8, 0.7, 0.8, 0, 2)
    assert tokens != decode(1.0, 1.0)  # the same uniforms at 1.0 / 1.0 draw other tokens


# ----------------------------------------------------------------------------------------------
# Point 2 with the real Qwen3 tokenizer


def test_the_real_qwen3_tokenizer_feeds_the_spec_prompt_with_no_bos(tmp_path, capsys, monkeypatch):
    like = SHARED / "qwen3-0.6b-base"
    if not (like / "tokenizer.json").exists():
        pytest.skip("../shared/qwen3-0.6b-base (the real tokenizer) not present (fresh clone): skipped")
    from conftest import build_like

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    build_like(model_dir, like, layers=1, hidden=64)  # copies the real tokenizer files
    problem = "Let $f(x) = \\frac{1}{2}x^{2}$ and {problem} stay as written. What is $f(\\{4\\})$?"
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"problem": problem, "answer": "8"}]))
    prefills, loaded = [], []
    real_load = T.load_model_and_tokenizer

    def load(*a, **k):
        model, tokenizer, eos_id = real_load(*a, **k)
        loaded.append(tokenizer)
        model.register_forward_pre_hook(
            lambda m, args, kwargs: prefills.append(args[0].clone()) if _cache_of(kwargs) is not None
            and args[0].shape[1] > 1 else None, with_kwargs=True)
        return model, tokenizer, eos_id
    monkeypatch.setattr(T, "load_model_and_tokenizer", load)
    assert T.main(_args(model_dir, data, tmp_path / "run", "num_problems=1", "group_size=2",
                        "max_new_tokens=2")) == 0, capsys.readouterr().err
    tok = loaded[0]  # the real tokenizer, as the run loaded it from the model folder
    expected = tok(spec_prompt(problem), add_special_tokens=False)["input_ids"]
    assert tok.decode(expected) == spec_prompt(problem)
    assert len(prefills) == 1 and prefills[0].tolist() == [expected] * 2
    assert len(tok) == 151669 and tok.bos_token_id is None  # the real Qwen3 tokenizer: no BOS
    assert 151643 not in expected  # nor <|endoftext|> anywhere


# ----------------------------------------------------------------------------------------------
# Point 10: cached decoding equals the model's own full forward pass (float32)


def _capture_decode_logits(monkeypatch):
    seen = []
    real = T.sample_next_token
    monkeypatch.setattr(T, "sample_next_token", lambda logits, *a: seen.append(logits.float().clone()) or real(logits, *a))
    return seen


def _compare_with_full_forward(model, cfg, amp, seen, tolerance):
    """Two generations, prompts of 9 then 4 tokens (the static cache is reused with a shorter
    prompt), with the weights moved in between as an optimizer step would (the bf16 twin must
    follow): the logits of every decode step against a full forward pass over the same tokens,
    within tolerance(full logits). Returns the largest difference seen."""
    worst = 0.0
    for length, step in ((9, 1), (4, 2)):
        seen.clear()
        prompt = torch.randint(1, 300, (length,), generator=torch.Generator().manual_seed(length))
        responses, _ = T.generate_rollouts(model, prompt, cfg, -1, T.rollout_streams(0, step, range(3), "cpu"), amp)
        tokens = torch.stack(responses)
        assert tokens.shape == (3, cfg.max_new_tokens) and len(seen) == cfg.max_new_tokens
        with torch.no_grad():
            full = model(torch.cat([prompt.repeat(3, 1), tokens], dim=1)).logits.float()
        atol = tolerance(full)
        for t, logits in enumerate(seen):
            diff = (logits - full[:, length - 1 + t]).abs().max().item()
            assert diff <= atol, (length, t, diff, atol)
            worst = max(worst, diff)
        with torch.no_grad():
            g = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return worst


def _static_eager(model, amp, monkeypatch):
    T._STATIC_DECODERS.clear()
    decoder = T.static_decoder(model, amp)
    monkeypatch.setattr(decoder, "compiled_step", decoder._forward)  # the static cache alone, eager


@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_cached_decode_logits_equal_a_full_forward_pass(tiny_model, monkeypatch, path):
    model, _ = tiny_model
    cfg = T.Config(group_size=3, max_new_tokens=8, temperature=0.8, top_p=0.9, device="cpu",
                   compile="true" if path == "static" else "false")
    if path == "static":
        _static_eager(model, T.nullcontext(), monkeypatch)
    seen = _capture_decode_logits(monkeypatch)
    try:
        _compare_with_full_forward(model, cfg, T.nullcontext(), seen, lambda full: 1e-5)  # float32 rounding only
    finally:
        T._STATIC_DECODERS.clear()


# ----------------------------------------------------------------------------------------------
# Point 11: the bf16 decode paths, within a stated tolerance


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(x)) - 7)  # bfloat16: 8 significant bits


@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_bf16_autocast_decode_is_within_4_bf16_ulps_of_the_float32_forward(tiny_model, monkeypatch, path):
    """Under bf16 autocast no decode path is exact (the static path decodes with a bfloat16 twin;
    compiled kernels round differently again, measured up to 4 ulps on the CPU stand-in): every
    step's logits are within 4 bf16 ulps of the largest logit of the float32 full forward pass.
    (The compiled bf16 step itself is not run here: compiling takes ~50 s on 2 cores.)"""
    model, _ = tiny_model
    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    cfg = T.Config(group_size=3, max_new_tokens=8, temperature=0.8, top_p=0.9, device="cpu",
                   compile="true" if path == "static" else "false")
    if path == "static":
        _static_eager(model, amp, monkeypatch)
    seen = _capture_decode_logits(monkeypatch)
    try:
        worst = _compare_with_full_forward(model, cfg, amp, seen, lambda full: 4 * _bf16_ulp(full.abs().max().item()))
    finally:
        T._STATIC_DECODERS.clear()
    assert worst > 0  # bf16 really is in play: not bit-exact


# ----------------------------------------------------------------------------------------------
# Point 8: the update norm across devices (host buffers of CUDA weights), run on the CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_norm_across_devices_equals_the_in_place_one_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*shape, generator=g).to(dtype) for shape in ((64, 32), (32,), (7, 3, 5))]
    before = [(w.float() + torch.randn(w.shape, generator=g) * 1e-3) for w in weights]
    by_hand = math.sqrt(sum((w.double() - b.double()).pow(2).sum().item() for w, b in zip(weights, before)))
    across = T.update_norm_across_devices([b.clone() for b in before], weights)
    in_place = T.update_norm([b.clone() for b in before], weights)
    assert across == in_place  # bit for bit
    assert across == pytest.approx(by_hand, rel=1e-6)


def test_update_norm_sends_buffers_on_another_device_across(monkeypatch):
    """The dispatch: buffers on the weights' device are used in place, others go across ('meta'
    stands in for the CUDA device of the weights)."""
    calls = []
    monkeypatch.setattr(T, "update_norm_across_devices", lambda before, weights: calls.append(weights[0].device) or 1.5)
    assert T.update_norm([torch.zeros(3)], [torch.empty(3, device="meta")]) == 1.5
    assert T.update_norm([torch.zeros(3)], [torch.ones(3)]) == pytest.approx(math.sqrt(3))
    assert calls == [torch.device("meta")]


def test_the_undo_copies_stay_on_the_gpu_when_its_free_memory_holds_them(monkeypatch, capsys):
    """Where optimizer_step's copies (weights in float32, AdamW's two moments) live, from the free
    memory figure: on the GPU when it holds them twice over plus UNDO_RESERVE, else on the host."""
    cuda, cpu, reserve = torch.device("cuda"), torch.device("cpu"), T.UNDO_RESERVE
    need = 596_049_920 * 12  # Qwen3-0.6B in float32: 7.15 GB
    assert T.optimizer_buffer_device(cuda, need, 139 * 10**9) == cuda  # an H200
    assert T.optimizer_buffer_device(cuda, need, 2 * need + reserve) == cuda
    assert T.optimizer_buffer_device(cuda, need, 2 * need + reserve - 1) == cpu
    assert T.optimizer_buffer_device(cuda, need, 22 * 10**9) == cpu  # a 24 GB card
    assert T.optimizer_buffer_device(cpu, need, 10**15) == cpu
    weights = [torch.nn.Parameter(torch.zeros(10, 3)), torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))]
    assert T.optimizer_buffer_bytes(weights) == 30 * (4 + 8) + 5 * (4 + 4)
    # the choice on CUDA, said once on stderr ('cuda' with CPU weights: the buffers go beside them)
    monkeypatch.setattr(T, "available_memory", lambda device: 139 * 10**9)
    buffers = T.update_norm_buffers(weights, cuda)
    assert [(b.shape, b.dtype, b.device.type) for b in buffers] == [((10, 3), torch.float32, "cpu"),
                                                                   ((5,), torch.float32, "cpu")]
    assert capsys.readouterr().err == ("optimizer step: the copies that undo a non-finite step (0.0 GB) are kept on "
                                       "cuda; 139.0 GB free on cuda\n")
    monkeypatch.setattr(T, "available_memory", lambda device: 10**9)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())  # no CUDA here to pin for
    T.update_norm_buffers(weights, cuda)
    assert "kept in pinned host memory (copied across PCIe every step); 1.0 GB free" in capsys.readouterr().err
    assert T.update_norm_buffers(weights, cpu)[0].shape == (10, 3) and capsys.readouterr().err == ""


def test_the_optimizer_step_gives_the_same_numbers_with_its_copies_on_either_side(tiny_model, monkeypatch):
    """The copies beside the weights take update_norm's in-place path; host copies of CUDA weights
    take update_norm_across_devices. Two finite steps and an undone one give the same norms,
    weights and AdamW state, bit for bit, either way."""
    model, _ = tiny_model
    runs = []
    for across in (False, True):
        if across:
            monkeypatch.setattr(T, "update_norm", T.update_norm_across_devices)
        params = [p for p in copy.deepcopy(model).parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3)
        before, state_before, norms = T.update_norm_buffers(params, torch.device("cpu")), {}, []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 2:  # this step leaves a weight infinite: it is undone
                real_step = opt.step
                opt.step = lambda: (real_step(), params[1].data.view(-1).__setitem__(0, float("inf")))
            norms.append(T.optimizer_step(params, opt, 1.0, 0.0, before, state_before))
        runs.append((norms, [p.detach().clone() for p in params],
                     [{k: v.clone() for k, v in opt.state[p].items()} for p in params]))
    (norms, weights, state), (norms2, weights2, state2) = runs
    assert norms == norms2 and norms[2][1] is None and all(n[1] > 0 for n in norms[:2])
    assert all(torch.equal(a, b) for a, b in zip(weights, weights2)) and all(w.isfinite().all() for w in weights)
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(state, state2))


# ----------------------------------------------------------------------------------------------
# The log-prob forwards build no KV cache (point 12)


def test_log_prob_forwards_build_no_kv_cache(tiny_model):
    model, _ = tiny_model
    caches = []
    model.register_forward_hook(lambda m, args, kwargs, out: caches.append(out.past_key_values), with_kwargs=True)
    prompt, responses = torch.tensor([4, 5, 6]), [torch.tensor([7, 8, 0]), torch.tensor([9])]
    with torch.no_grad():
        model(prompt[None])
        assert caches[-1] is not None  # the model's default builds one
        T.token_log_probs(model, prompt, responses[0], T.nullcontext())
        T.batch_token_log_probs(model, prompt, responses, T.nullcontext())
    assert caches[1:] == [None, None]


# ----------------------------------------------------------------------------------------------
# Checkpoints: rewriting step-N after resume=PATH (point 7), a rewrite cut between its renames (12)


class _NoWorker:
    """In place of TimedVerifier where score_rollouts is replaced: no worker process to start."""

    def __init__(self, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _first_rollout_wins(monkeypatch):
    monkeypatch.setattr(T.verifier, "TimedVerifier", _NoWorker)
    monkeypatch.setattr(T, "score_rollouts",
                        lambda scorer, texts, gold: [(float(i == 0), None, "wrong") for i in range(len(texts))])


def _table(stdout):
    return [l.rsplit(None, 1)[0] for l in stdout.splitlines() if l[:1].isdigit()]


def _metrics(out):
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    for m in rows:
        del m["seconds"], m["timings"]
    return rows


def test_resume_from_an_older_checkpoint_rewrites_the_later_one(tiny_model_dir, tiny_data_file, tmp_path, capsys,
                                                               monkeypatch):
    """Point 7: resume=PATH from step 2 when step 3 exists gives the uninterrupted run, and the
    step-3 checkpoint it writes again replaces the old one (marked stale here) entirely."""
    _first_rollout_wins(monkeypatch)
    out = tmp_path / "run"
    args = _args(tiny_model_dir, tiny_data_file, out, "num_problems=3", "save_every=2", "learning_rate=1e-3")
    assert T.main(args) == 0
    whole = capsys.readouterr().out
    whole_metrics, whole_rollouts = _metrics(out), (out / "rollouts.jsonl").read_text()
    whole_weights = load_file(out / "final" / "model.safetensors")
    step2, step3 = T.list_checkpoints(out)
    first_write = load_file(step3 / "model.safetensors")
    (step3 / "STALE").write_text("written by the first run")
    (step3 / "metrics.jsonl").write_text("stale\n")
    shutil.rmtree(out / "final")

    assert T.main(args + [f"resume={step2}"]) == 0
    captured = capsys.readouterr()
    assert f"resumed from {step2}" in captured.err
    assert _table(captured.out) == _table(whole) and len(_table(whole)) == 3
    assert _metrics(out) == whole_metrics and (out / "rollouts.jsonl").read_text() == whole_rollouts
    weights = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(weights[k], whole_weights[k]) for k in whole_weights)
    assert [c.name for c in T.list_checkpoints(out)] == ["step-000002", "step-000003"]
    assert not (step3 / "STALE").exists()
    assert (step3 / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()
    rewritten = load_file(step3 / "model.safetensors")  # what the uninterrupted run wrote, written again
    assert rewritten.keys() == first_write.keys() and all(torch.equal(rewritten[k], first_write[k]) for k in rewritten)
    assert json.loads((step3 / "state.json").read_text())["step"] == 3
    assert not list((out / "checkpoints").glob(".*"))


class _Died(Exception):
    """Stands for a process killed at that point (a second SIGINT exits with os._exit)."""


def test_a_rewrite_cut_between_its_two_renames_keeps_a_usable_checkpoint(tiny_model, tiny_model_dir, tiny_data_file,
                                                                        tmp_path, monkeypatch):
    model, _ = tiny_model
    out = tmp_path / "run"
    cfg = T.Config(model=str(tiny_model_dir), dataset=str(tiny_data_file), device="cpu", output_dir=str(out),
                   group_size=4, num_problems=3, resume="auto")
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "rollouts.jsonl").write_text("{}\n")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = T.save_checkpoint(out, 2, model, opt, cfg, next_record=2)
    saved = load_file(first / "model.safetensors")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-step-"):  # the rewrite's second rename: killed just before it
            raise _Died
        return real_rename(src, dst)
    monkeypatch.setattr(T.os, "rename", rename)
    with pytest.raises(_Died):
        T.save_checkpoint(out, 2, model, opt, cfg, next_record=2)
    monkeypatch.setattr(T.os, "rename", real_rename)
    root = out / "checkpoints"
    assert not first.exists() and {p.name.split("-step-")[0] for p in root.iterdir()} == {".old", ".tmp"}

    od = T.prepare_output_dir(cfg)  # the next start: resume=auto finds step 2 again
    try:
        assert od.resume_from == first
        T.begin_output(od, cfg)  # once everything has loaded: the leftovers go
    finally:
        T.release_output_dir(od)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]
    restored = load_file(first / "model.safetensors")
    assert all(torch.equal(restored[k], saved[k]) for k in saved)


def test_recover_checkpoint_rewrite_keeps_a_present_step_and_deletes_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step-000004", ".old-step-000004-11", ".tmp-step-000006-12", ".old-step-000002-13"):
        (root / name).mkdir(parents=True)
        (root / name / "who").write_text(name)
    T.recover_checkpoint_rewrite(root)
    assert sorted(p.name for p in root.iterdir()) == [".old-step-000004-11", ".tmp-step-000006-12", "step-000002",
                                                      "step-000004"]  # leftovers wait for begin_output
    assert (root / "step-000004" / "who").read_text() == "step-000004"      # the present one is kept
    assert (root / "step-000002" / "who").read_text() == ".old-step-000002-13"  # the missing one restored
    T.recover_checkpoint_rewrite(tmp_path / "nowhere")  # no checkpoints folder: nothing to do
