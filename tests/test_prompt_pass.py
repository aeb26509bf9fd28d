"""prompt_pass: shared, the prompt's forward once per group in the log-probability pass (SharedPrompt). Each
response is still backpropagated on its own; the gradient is the spec's per_response one up to float rounding.

The tolerance is derived, not chosen: the same pass in float64 is the reference, and shared's float32 gradient
may be at most SHARED_ROUNDING times as far from it as the spec's own float32 gradient is (both round; they round
in another order). Per setting that runs the pass: micro-batches, a later PPO epoch's clipped ratio, the KL's
reference forward, a credit's token advantages with the entropy mask, masked responses, another aggregation,
bf16 autocast. Then whole runs on the tiny model: problems_per_step with ppo_epochs and kl_coef, credit=steps
with the entropy mask; torchrun replicate and fsdp and a SIGKILLed run resumed byte for byte are the steps runs
of tests/test_distributed.py and tests/test_steps.py, which use this pass. The default is the
spec's pass, bit for bit (tests/test_variants.py's fixture, tests/default_run.py)."""

import copy
import json

import pytest
import torch

import rlvr_driver
import train_rlvr as T
from conftest import ROOT
from run_helpers import main_args, one_line_error

SHARED_ROUNDING = 4.0  # shared's distance from float64 over the spec's (both float32; the sums in another order)


def _group():
    """A 40-token prompt and 5 responses of 5, 1 (EOS alone), 9, 3 and 12 tokens, rewards with variance."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 300, (40,), generator=g)
    responses = [torch.randint(1, 300, (n,), generator=g) for n in (5, 1, 9, 3, 12)]
    responses[1][0] = responses[2][-1] = 0  # EOS
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])
    return prompt, responses, T.compute_advantages(r, 1e-4, zero_variance=False)


def _gradient(model, prompt, responses, adv, amp, terms=None, **kw):
    params = list(model.parameters())
    out = T.accumulate_policy_gradient(model, params, prompt, responses, adv.to(params[0].dtype), len(responses),
                                       amp, terms=terms and terms(model), **kw)
    return out, torch.cat([p.grad.flatten().double() for p in params])


def _terms(setting, model32, prompt, responses, adv):
    """The LossTerms of a setting, built for the model it is given (float32 or its float64 copy)."""
    n = len(responses)
    if setting == "ppo_epoch":  # a later epoch: the ratio against the first pass's log-probabilities (moved a bit)
        first = T.accumulate_policy_gradient(model32, list(model32.parameters()), prompt, responses, adv, n,
                                             T.nullcontext()).token_log_probs
        old = [lp + 0.3 * torch.sin(torch.arange(len(lp), dtype=torch.float32)) for lp in first]
        return lambda m: T.LossTerms([n] * n, old=[o.to(m.dtype) for o in old], clip_low=0.2, clip_high=0.28)
    if setting == "kl":  # the frozen reference: other weights than the policy's, so k3 has a gradient
        ref = copy.deepcopy(model32)
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(1.05)
        return lambda m: T.LossTerms([n] * n, reference=ref.to(m.dtype), kl_coef=0.5)
    if setting == "credit":  # every token its own A_it (a credit), and the entropy mask dropping some
        g = torch.Generator().manual_seed(1)
        weights = [torch.randn(len(r), generator=g) * (torch.rand(len(r), generator=g) > 0.3) for r in responses]
        return lambda m: T.LossTerms([n] * n, weights=[w.to(m.dtype) for w in weights])
    if setting == "masked":  # mask_truncated_completions: two responses have no term
        return lambda m: T.LossTerms([n] * n, masked=[False, True, False, False, True])
    if setting == "token_mean":
        return lambda m: T.LossTerms(T.loss_divisors("token_mean", [len(r) for r in responses], 16))
    return None


@pytest.mark.parametrize("setting, batch", [("spec", 1), ("spec", 3), ("ppo_epoch", 2), ("kl", 1), ("kl", 2),
                                            ("credit", 1), ("masked", 2), ("token_mean", 1)])
def test_the_shared_prompt_pass_is_the_spec_gradient_to_float_rounding(tiny_model, setting, batch):
    model, _ = tiny_model
    prompt, responses, adv = _group()
    terms = _terms(setting, model, prompt, responses, adv)
    spec, g_spec = _gradient(model, prompt, responses, adv, T.nullcontext(), terms, logprob_batch_size=batch)
    shared, g_shared = _gradient(model, prompt, responses, adv, T.nullcontext(), terms, logprob_batch_size=batch,
                                 shared=True)
    exact, g64 = _gradient(copy.deepcopy(model).double(), prompt, responses, adv, T.nullcontext(), terms,
                           logprob_batch_size=batch)
    spec_error, shared_error = ((g - g64).norm() / g64.norm() for g in (g_spec, g_shared))
    assert 0 < spec_error < 1e-5 and shared_error <= SHARED_ROUNDING * spec_error, (spec_error, shared_error)
    assert shared.loss == pytest.approx(exact.loss, rel=1e-5, abs=1e-6)
    assert shared.seq_log_probs == pytest.approx(exact.seq_log_probs, rel=1e-5)
    assert (shared.kl, shared.clipped) == (pytest.approx(spec.kl, rel=1e-5, abs=1e-9), spec.clipped)
    for a, b in zip(spec.token_log_probs, shared.token_log_probs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_under_bf16_autocast_the_shared_pass_rounds_no_more_than_the_spec(tiny_model, bf16_attention):
    model, _ = tiny_model
    prompt, responses, adv = _group()
    amp = T.autocast(torch.device("cpu"), "bf16-autocast")
    _, g_spec = _gradient(model, prompt, responses, adv, amp)
    _, g_shared = _gradient(model, prompt, responses, adv, amp, shared=True)
    _, g64 = _gradient(copy.deepcopy(model).double(), prompt, responses, adv, T.nullcontext())
    spec_error, shared_error = ((g - g64).norm() / g64.norm() for g in (g_spec, g_shared))
    assert 1e-5 < spec_error < 0.1 and shared_error <= SHARED_ROUNDING * spec_error, (spec_error, shared_error)
    # the prompt's values are bfloat16 under autocast (its keys leave the float32 norm); the responses' shares of
    # their gradients add up in float32 leaves (a sum of G bfloat16 terms would round at each one)
    prompt_state = T.shared_prompt(model, prompt, amp)
    assert {t.dtype for t in prompt_state.outputs[1:-1:2]} == {torch.bfloat16}
    assert {t.dtype for t in prompt_state.leaves} == {torch.float32}


def test_the_prompt_is_read_once_per_group_and_a_silent_group_reads_nothing(tiny_model):
    """shared: one forward over the prompt's 40 tokens, then one per micro-batch over the responses alone; the
    spec's pass reads prompt + response for each. A group with every advantage 0 runs no forward at all."""
    model, _ = tiny_model
    prompt, responses, adv = _group()
    widths = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: widths.append(
        (args[0] if args else kwargs["input_ids"]).shape), with_kwargs=True)
    try:
        _gradient(model, prompt, responses, adv, T.nullcontext(), shared=True, logprob_batch_size=2)
        assert widths == [(1, 40), (2, 4), (2, 8), (1, 11)]
        widths.clear()
        _gradient(model, prompt, responses, adv, T.nullcontext())
        assert widths == [(1, 40 + len(r) - 1) for r in responses]
        widths.clear()
        _gradient(model, prompt, responses, torch.zeros(5), T.nullcontext(), shared=True, silent=True)
        assert widths == []
    finally:
        hook.remove()
    # with kl_coef, the frozen reference reads the prompt once too
    ref, seen = copy.deepcopy(model), []
    ref.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0] if args else kwargs["input_ids"]).shape), with_kwargs=True)
    _gradient(model, prompt, responses, adv, T.nullcontext(), lambda m: T.LossTerms([5] * 5, reference=ref,
                                                                                     kl_coef=0.1),
              shared=True, logprob_batch_size=5)
    assert seen == [(1, 40), (5, 11)]


def test_prompt_pass_is_checked_and_a_sliding_window_model_is_refused(tiny_model_dir, tiny_data_file, tmp_path,
                                                                      capsys):
    assert T.main(main_args(tiny_model_dir, tiny_data_file, tmp_path / "o", "prompt_pass=once")) == 2
    one_line_error(capsys, "config key 'prompt_pass' must be one of per_response, shared, got 'once'")
    model = T.Config(prompt_pass="shared", model="m")
    from transformers import Qwen3Config, Qwen3ForCausalLM
    windowed = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32,
                                            use_sliding_window=True, sliding_window=8, max_window_layers=0))
    with pytest.raises(T.UserError, match="prompt_pass shared needs a model whose every layer attends to the whole "
                                          "sequence; m has cache layers DynamicSlidingWindowLayer"):
        T.check_prompt_pass(model, windowed)
    T.check_prompt_pass(T.Config(model="m"), windowed)  # per_response reads the whole sequence each time


# ----------------------------------------------------------------------------------------------
# Whole runs


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _close(a, b, keys):
    for x, y in zip(a, b):
        for key in keys:
            if x.get(key) is not None:
                assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (x["step"], key, x[key], y[key])


@pytest.mark.parametrize("extra", [
    ["problems_per_step=2", "ppo_epochs=2", "kl_coef=0.1", "logprob_batch_size=2"],
    ["credit=steps", f"step_checker={ROOT / 'tests' / 'step_checkers.py'}:by_length", "max_new_tokens=12",
     "top_entropy_quantile=0.5"],
])
def test_a_run_with_the_shared_pass_takes_the_same_rollouts_and_steps(tiny_model_dir, tiny_data_file, tmp_path,
                                                                      monkeypatch, extra):
    monkeypatch.setattr(T, "score_rollouts", rlvr_driver.by_text)
    monkeypatch.setattr(T, "sample_next_token", rlvr_driver.writes_lines())
    runs, passes, real = {}, [], T.SharedPrompt.backward
    monkeypatch.setattr(T.SharedPrompt, "backward", lambda self: (passes.append(1), real(self)))
    for name in ("per_response", "shared"):
        runs[name] = tmp_path / name
        assert T.main(main_args(tiny_model_dir, tiny_data_file, runs[name], "num_problems=4", "learning_rate=1e-3",
                                f"prompt_pass={name}", *extra)) == 0
        assert (len(passes) > 0) is (name == "shared")  # the setting reaches the pass: a prompt backward per group
    a, b = (_jsonl(runs[n] / "rollouts.jsonl") for n in runs)
    keys = ("step", "problem_index", "rollout", "response", "reward", "tokens", "line_verdicts", "entropy_mask")
    assert [tuple(r.get(k) for k in keys) for r in a] == [tuple(r.get(k) for k in keys) for r in b]
    _close(a, b, ("advantage", "sequence_log_prob"))
    ma, mb = (_jsonl(runs[n] / "metrics.jsonl") for n in runs)
    assert any(m["grad_norm"] > 0 for m in ma)
    _close(ma, mb, ("policy_loss", "grad_norm", "update_norm", "kl", "clipped_fraction"))
    _close([e for m in ma for e in m.get("epochs", [])], [e for m in mb for e in m.get("epochs", [])],
           ("policy_loss", "grad_norm", "update_norm", "kl"))


# Two processes with the shared pass: tests/test_distributed.py's steps cases (replicate and fsdp); SIGKILL and
# resume with it: tests/test_steps.py's (both run prompt_pass=shared).
