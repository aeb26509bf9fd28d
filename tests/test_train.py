"""The trainer's math, sampling, step table and end-to-end runs, on CPU with tiny local models."""

import json
import math
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

import train_rlvr as T
from conftest import ROOT
from run_helpers import verdict

# ----------------------------------------------------------------------------------------------
# Advantages: the spec's worked numbers


def advantages(rewards, std_eps=1e-4, advantage_std="group"):
    """compute_advantages with the zero-variance flag decided as score_group decides it (equal_rewards)."""
    return T.compute_advantages(rewards, std_eps, advantage_std, zero_variance=T.equal_rewards(rewards))


def test_advantages_match_the_spec_step_2():
    rewards = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float32)
    adv = advantages(rewards)
    assert round(adv[0].item(), 4) == 2.4742
    assert all(round(a, 4) == -0.3535 for a in adv[1:].tolist())
    assert abs(adv.sum().item()) < 1e-5
    # order does not matter
    shuffled = advantages(torch.tensor([0, 0, 0, 1, 0, 0, 0, 0.0]))
    assert shuffled[3].item() == adv[0].item() and shuffled[0].item() == adv[1].item()


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_equal_rewards_give_exactly_zero_advantages(value):
    adv = advantages(torch.full((8,), value))
    assert torch.equal(adv, torch.zeros(8)) and not torch.signbit(adv).any()


def test_rewards_closer_than_any_tolerance_still_have_variance_and_a_gradient(tiny_model, monkeypatch):
    """The zero-variance decision is exact equality, never a tolerance: seven 0 and one 1e-6 (std 3.54e-7,
    possible with a small format_reward or a reward a user brings) is a group with variance, whose
    A_8 = (1e-6 - 1.25e-7) / (3.54e-7 + 1e-4) = 0.00872 and whose gradient is not 0."""
    model, _ = tiny_model
    rewards = [0.0] * 7 + [1e-6]
    monkeypatch.setattr(T, "score_rollouts", lambda scorer, texts, gold: [T.Score(r, None, "wrong") for r in rewards])
    t = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, **kw: "x"), scorer=None, cfg=T.Config())
    responses = [torch.tensor([7 + i, 0]) for i in range(8)]
    group = T.score_group(2, responses, [False] * 8, {"answer": "1"}, t)
    assert not group.zero_variance
    assert group.rewards.std().item() == pytest.approx(3.5355e-7, rel=1e-4)
    adv = T.compute_advantages(group.rewards, T.Config().std_eps, zero_variance=group.zero_variance)
    assert round(adv[7].item(), 5) == 0.00872 and round(adv[0].item(), 7) == -0.0012456
    params = [p for p in model.parameters() if p.requires_grad]
    T.accumulate_policy_gradient(model, params, torch.tensor([5, 17, 33]), responses, adv, 8, T.nullcontext(),
                                 silent=group.zero_variance)
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item() > 0


def test_advantages_use_the_configured_eps_and_the_unbiased_std():
    r = torch.tensor([1.0, 1.0, 0.0, 0.0])
    std = math.sqrt(sum((x - 0.5) ** 2 for x in r.tolist()) / 3)
    assert advantages(r, 0.5)[0].item() == pytest.approx(0.5 / (std + 0.5), rel=1e-6)


# ----------------------------------------------------------------------------------------------
# Sequence log-probability


def _by_hand_log_prob(model, prompt, response):
    """Full-vocabulary log-softmax over every position, then pick the response tokens one by one."""
    ids = torch.cat([prompt, response]).unsqueeze(0)
    logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    return sum(logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response.tolist()))


def test_sequence_log_prob_equals_a_by_hand_sum(tiny_model):
    model, _ = tiny_model
    prompt = torch.tensor([5, 17, 33, 100, 7])
    response = torch.tensor([12, 250, 3, 0])  # ends with EOS (id 0)
    with torch.no_grad():
        per_token = T.token_log_probs(model, prompt, response, T.nullcontext())
        seq = T.sequence_log_prob(T.token_log_probs(model, prompt, response, T.nullcontext()))
        expected = _by_hand_log_prob(model, prompt, response)
    assert per_token.dtype == torch.float32 and per_token.shape == (4,)  # one term per response token
    assert seq.item() == pytest.approx(expected, abs=1e-4)
    assert seq.item() == pytest.approx(per_token.sum().item(), abs=1e-6)  # a sum, not a mean
    # the EOS token counts: its term is log p(EOS | prompt, response[:-1])
    with torch.no_grad():
        without_eos = T.sequence_log_prob(T.token_log_probs(model, prompt, response[:-1], T.nullcontext())).item()
        logp_eos = torch.log_softmax(model(torch.cat([prompt, response[:-1]])[None]).logits[0, -1], -1)[0].item()
    assert seq.item() == pytest.approx(without_eos + logp_eos, abs=1e-4)


class _ScriptedModel(torch.nn.Module):
    """Row r emits token 5 until step r, then EOS; rows past max_new_tokens are cut."""

    def __init__(self, config, vocab=16, eos=0):
        super().__init__()
        self.config, self.vocab, self.eos, self.step = config, vocab, eos, 0

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=1):
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e4)
        for r in range(input_ids.shape[0]):
            logits[r, 0, self.eos if r == self.step else 5] = 0.0
        self.step += 1
        return SimpleNamespace(logits=logits)


def test_responses_stop_at_the_first_eos_and_exclude_padding(tiny_model):
    model, _ = tiny_model
    cfg = T.Config(group_size=6, max_new_tokens=4, temperature=1.0, top_p=0.9)
    scripted = _ScriptedModel(model.config)
    streams = T.rollout_streams(0, 1, range(6), "cpu")
    responses, cut = T.generate_rollouts(scripted, torch.tensor([1, 2, 3]), cfg, 0, streams, T.nullcontext())
    assert [r.tolist() for r in responses] == [[0], [5, 0], [5, 5, 0], [5, 5, 5, 0], [5, 5, 5, 5], [5, 5, 5, 5]]
    assert cut == [False, False, False, False, True, True]


def test_generation_stops_early_when_every_rollout_has_ended(tiny_model):
    model, _ = tiny_model
    cfg = T.Config(group_size=3, max_new_tokens=50, temperature=1.0, top_p=1.0)
    scripted = _ScriptedModel(model.config)
    responses, cut = T.generate_rollouts(scripted, torch.tensor([1]), cfg, 0, T.rollout_streams(0, 1, range(3), "cpu"),
                                         T.nullcontext())
    # all ended after 3 tokens; on the CPU the loop checks at every token: the prompt pass and 2 decode steps,
    # not 50 (on a GPU it would learn it at its check after token 8, T.CHECK_EVERY: tested in test_speed_exactness)
    assert scripted.step == 3 and [len(r) for r in responses] == [1, 2, 3] and not any(cut)


def test_each_rollout_has_its_own_stream_whatever_shares_its_batch(tiny_model):
    """Rollout i of step s draws from the stream (seed, step, i): decoding rollouts 0-3 together,
    2-3 alone or 3 alone gives the same tokens for each (this is what makes ranks interchangeable)."""
    model, _ = tiny_model
    cfg = T.Config(group_size=4, max_new_tokens=12, temperature=1.0, top_p=0.95, device="cpu")
    prompt = torch.tensor([5, 17, 33, 100, 7])

    def decode(rows, seed=0, step=3):
        responses, _ = T.generate_rollouts(model, prompt, cfg, -1, T.rollout_streams(seed, step, rows, "cpu"),
                                           T.nullcontext())
        return [r.tolist() for r in responses]
    whole = decode(range(4))
    assert decode([2, 3]) == whole[2:] and decode([3]) == whole[3:]
    assert len({tuple(r) for r in whole}) == 4  # four different streams, four different rollouts
    assert decode(range(4), step=4) != whole and decode(range(4), seed=1) != whole
    assert T.stream_seed(0, "rollout", 3, 1) == T.stream_seed(0, "rollout", 3, 1) != T.stream_seed(0, "rollout", 1, 3)


# ----------------------------------------------------------------------------------------------
# Loss and backward


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_per_response_backward_equals_one_backward_of_the_group_loss(tiny_model):
    model, _ = tiny_model
    params = list(model.parameters())
    torch.manual_seed(1)
    prompt = torch.randint(1, 300, (6,))
    responses = [torch.randint(1, 300, (n,)) for n in (3, 7, 1, 5)]
    responses[1][-1] = 0  # one ends with EOS
    adv = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    done = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext())
    loss, seq_lps = done.loss, done.seq_log_probs
    accumulated = _grads(model)

    # reference: one padded batch, full log-softmax, one backward of -(1/G) sum_i A_i * s_i
    model.zero_grad(set_to_none=True)
    width = len(prompt) + max(len(r) for r in responses)
    ids = torch.zeros(len(responses), width, dtype=torch.long)
    mask = torch.zeros(len(responses), width, dtype=torch.long)
    for i, r in enumerate(responses):
        seq = torch.cat([prompt, r])
        ids[i, :len(seq)], mask[i, :len(seq)] = seq, 1
    logp = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), dim=-1)
    seqs = torch.stack([
        sum(logp[i, len(prompt) - 1 + t, tok] for t, tok in enumerate(r.tolist())) for i, r in enumerate(responses)])
    ref_loss = -(adv * seqs).sum() / 4
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-5)
    assert seq_lps == pytest.approx(seqs.tolist(), abs=1e-4)
    for a, b in zip(accumulated, _grads(model)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert sum(g.abs().sum().item() for g in accumulated) > 0


def test_zero_variance_group_takes_the_same_step_as_computed_zero_gradients(tiny_model):
    model, _ = tiny_model
    params = list(model.parameters())
    twin = [p.detach().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    opt_twin = torch.optim.AdamW(twin, lr=1e-2)
    prompt, responses = torch.tensor([4, 5, 6]), [torch.tensor([7, 8]), torch.tensor([9, 0])]

    # a first step with a real gradient, so that AdamW has momentum to carry
    adv = advantages(torch.tensor([1.0, 0.0]))
    T.accumulate_policy_gradient(model, params, prompt, responses, adv, 2, T.nullcontext())
    for p, q in zip(params, twin):
        q.grad = p.grad.clone()
    T.optimizer_step(params, opt, 1.0)
    T.optimizer_step(twin, opt_twin, 1.0)

    # zero variance: the product skips the passes; the twin computes the zero gradient
    zero_adv = advantages(torch.tensor([0.0, 0.0]))
    done = T.accumulate_policy_gradient(model, params, prompt, responses, zero_adv, 2, T.nullcontext(),
                                        silent=True)
    loss, seq_lps = done.loss, done.seq_log_probs
    assert loss == 0.0 and seq_lps == [None, None]
    assert all(p.grad is not None and not p.grad.any() for p in params)
    for q in twin:
        q.grad = torch.zeros_like(q)
    before = [p.detach().clone() for p in params]
    grad_norm, update_norm = T.optimizer_step(params, opt, 1.0)
    T.optimizer_step(twin, opt_twin, 1.0)
    assert grad_norm == 0.0
    assert update_norm > 0  # momentum and weight decay still move the weights
    assert update_norm == pytest.approx(
        math.sqrt(sum(((p - b) ** 2).sum().item() for p, b in zip(params, before))), rel=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(params, twin))
    assert all(opt.state[p]["step"].item() == 2 for p in params)
    row = T.format_row(dict(step=1, correct=0, reward_mean=0.0, reward_std=0.0, response_tokens=1554,
                            policy_loss=loss, grad_norm=grad_norm, update_norm=update_norm, seconds=1.0))
    assert row.split()[5:7] == ["0.000000", "0.000"]


def test_grad_norm_is_the_norm_before_clipping(tiny_model):
    model, _ = tiny_model
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    expected = 3.0 * math.sqrt(sum(p.numel() for p in params))
    opt = torch.optim.AdamW(params, lr=1e-3)
    grad_norm, _ = T.optimizer_step(params, opt, 1.0)
    assert grad_norm == pytest.approx(expected, rel=1e-5)
    assert math.sqrt(sum((p.grad ** 2).sum().item() for p in params)) == pytest.approx(1.0, rel=1e-4)


def _prob_even(model, prompt):
    with torch.no_grad():
        p = torch.softmax(model(prompt[None]).logits[0, -1], -1)
    return p[0::2].sum().item()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_sign_is_right_reward_rises_and_falls_with_flipped_advantages(tiny_model_dir, sign):
    """Toy task: reward 1 when the sampled token id is even. With the right sign the probability of
    an even token rises over a few dozen steps; with the advantages flipped it falls."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=2e-2)
    cfg = T.Config(group_size=8, max_new_tokens=1, temperature=1.0, top_p=1.0)
    prompt = torch.tensor([10, 20, 30])
    start = _prob_even(model, prompt)
    for step in range(1, 41):
        responses, _ = T.generate_rollouts(model, prompt, cfg, -1, T.rollout_streams(0, step, range(8), "cpu"),
                                           T.nullcontext())
        rewards = torch.tensor([float(r[0] % 2 == 0) for r in responses])
        adv = sign * advantages(rewards)
        T.accumulate_policy_gradient(model, params, prompt, responses, adv, 8, T.nullcontext())
        T.optimizer_step(params, opt, 1.0)
    end = _prob_even(model, prompt)
    assert 0.3 < start < 0.7
    if sign > 0:
        assert end > 0.9
    else:
        assert end < 0.1


# ----------------------------------------------------------------------------------------------
# Sampling: temperature and top-p, no top-k, equal to transformers' warpers


def _u(logits, seed):
    """One float64 uniform per row of logits, from a seeded generator."""
    return torch.rand(logits.shape[0], 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _hf_probs(logits, temperature, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1.0:  # transformers adds no top-p warper at 1.0
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1), torch.isfinite(scores)


def _adversarial_logits():
    g = torch.Generator().manual_seed(0)
    cases = {
        "random_small": torch.randn(8, 1000, generator=g) * 0.5,
        "random_peaked": torch.randn(8, 5000, generator=g) * 4,
        "very_peaked": torch.randn(4, 3000, generator=g) * 15,
        "ties": torch.randint(0, 4, (8, 600), generator=g).float(),
        "flat": torch.zeros(3, 400),
        "one_dominant": torch.cat([torch.full((2, 1), 50.0), torch.randn(2, 999, generator=g)], dim=1),
        "two_tied_leaders": torch.cat([torch.full((2, 2), 9.0), torch.randn(2, 500, generator=g)], dim=1),
        "with_minus_inf": torch.where(torch.rand(4, 700, generator=g) < 0.3, float("-inf"),
                                      torch.randn(4, 700, generator=g)),
        "full_vocab": torch.randn(2, 151936, generator=g) * 0.45,
    }
    return cases


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999, 1.0])
@pytest.mark.parametrize("temperature", [0.8, 1.0, 2.5])
def test_kept_set_and_probabilities_equal_transformers(top_p, temperature):
    for name, logits in _adversarial_logits().items():
        ref_probs, ref_kept = _hf_probs(logits, temperature, top_p)
        weights = T.nucleus_weights(logits, temperature, top_p)
        kept = T.top_p_mask(logits.float() / temperature, top_p)
        assert torch.equal(kept, ref_kept), name
        probs = weights.double() / weights.double().sum(-1, keepdim=True)
        torch.testing.assert_close(probs, ref_probs.double(), rtol=1e-5, atol=1e-9, msg=name)


def test_fast_top_p_takes_the_same_tokens_as_the_full_sort(monkeypatch):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 4000, generator=g) * 5
    fast = [T.sample_next_token(logits, 0.8, 0.9, _u(logits, s)) for s in range(5)]
    monkeypatch.setattr(T, "top_p_mask", lambda scores, top_p: T.top_p_reference(scores, top_p))
    slow = [T.sample_next_token(logits, 0.8, 0.9, _u(logits, s)) for s in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_no_top_k_a_flat_nucleus_keeps_far_more_than_50_tokens():
    kept = T.top_p_mask(torch.zeros(1, 1000), 0.9)
    assert kept.sum().item() >= 900  # transformers' default top-k would have kept 50
    draws = torch.stack([T.sample_next_token(torch.zeros(1, 1000), 0.8, 0.9, _u(torch.zeros(1, 1000), s))
                         for s in range(400)])
    assert draws.unique().numel() > 250


def test_draws_follow_the_temperature_and_top_p_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(20000, 1)
    temperature, top_p = 0.7, 0.9
    expected, kept = _hf_probs(logits[:1], temperature, top_p)
    tokens = T.sample_next_token(logits, temperature, top_p, _u(logits, 0))
    freq = torch.bincount(tokens, minlength=6).double() / len(tokens)
    sigma = torch.sqrt(expected[0].double() * (1 - expected[0].double()) / len(tokens))
    assert (freq - expected[0]).abs().le(4 * sigma + 1e-12).all(), (freq, expected)
    assert freq[~kept[0]].sum().item() == 0.0  # nothing outside the nucleus
    assert freq[kept[0]].gt(0).all()
    # a different temperature gives a measurably different distribution
    hot = T.sample_next_token(logits, 2.0, 1.0, _u(logits, 0))
    assert torch.bincount(hot, minlength=6)[5].item() > 500


def test_temperature_1e_38_gives_the_greedy_rollouts(tiny_model):
    """temperature=1e-38 passed validation and then stopped the run (IndexError from a token out
    of range): logits / 1e-38 overflow float32. Such a row takes the limit temperature -> 0, so
    every rollout is the greedy decode."""
    model, _ = tiny_model
    with torch.no_grad():
        model.model.norm.weight.mul_(100)  # logits above 3.4: logits / 1e-38 overflows, as a real model's do
    prompt = torch.tensor([5, 17, 33, 100, 7])
    with torch.no_grad():
        assert model(prompt[None]).logits[0, -1].max() > 3.5
    cfg = T.Config(group_size=3, max_new_tokens=8, temperature=1e-38, top_p=0.9, device="cpu", compile="false")
    responses, _ = T.generate_rollouts(model, prompt, cfg, -1, T.rollout_streams(0, 1, range(3), "cpu"),
                                       T.nullcontext())
    greedy, _ = T.decode(model, [prompt], 8, -1, T.greedy_pick, T.nullcontext())
    assert [r.tolist() for r in responses] == [greedy[0].tolist()] * 3


def test_eval_temperature_1e_40_samples_the_greedy_responses(tiny_model):
    """eval_samples=2 eval_temperature=1e-40 stopped the same way; each sample is now the greedy one."""
    import verifier

    model, tok = tiny_model
    problems = [{"index": i, "problem": "", "answer": "7", "prompt_ids": ids, "level": "unknown", "subject": "unknown",
                 "unique_id": None} for i, ids in enumerate([[5, 17, 33], [8, 9], [40, 41, 42, 43]])]

    def responses(**settings):
        cfg = T.Config(device="cpu", eval_problems=3, eval_max_new_tokens=6, eval_batch_size=2, **settings)
        records = T.evaluate(model, tok, problems, cfg, -1, SimpleNamespace(score=verifier.score), T.nullcontext(),
                             "before", 0)
        return [(r["problem_index"], r["sample"], r["response"]) for r in records]
    greedy = responses(eval_samples=1)
    assert responses(eval_samples=2, eval_temperature=1e-40) == [(i, s, text) for i, _, text in greedy for s in (0, 1)]


# ----------------------------------------------------------------------------------------------
# Step table


SPEC_HEADER = "step  correct/8  reward mean  sample std  response tokens  policy loss  grad norm"
SPEC_ROW1 = "1     0          0.000        0.000000    1554             0.000000     0.000"
SPEC_ROW2 = "2     1          0.125        0.353553     564             -3.042482    256.815"


def test_the_table_lines_here_are_the_ones_of_the_spec():
    spec = ROOT.parent / "shared" / "SPEC.md"
    if not spec.exists():
        pytest.skip("../shared/SPEC.md not present (fresh clone): comparison with the spec's table skipped")
    text = spec.read_text()
    assert SPEC_HEADER in text and SPEC_ROW1 in text and SPEC_ROW2 in text


def test_rows_reproduce_the_spec_table_exactly():
    header, row1, row2 = SPEC_HEADER, SPEC_ROW1, SPEC_ROW2
    assert T.format_header(8).startswith(header + "  update norm")
    m1 = dict(step=1, correct=0, reward_mean=0.0, reward_std=0.0, response_tokens=1554, policy_loss=-0.0,
              grad_norm=0.0, update_norm=0.0, seconds=12.0)
    m2 = dict(step=2, correct=1, reward_mean=0.125, reward_std=0.35355339, response_tokens=564,
              policy_loss=-3.0424821, grad_norm=256.81549, update_norm=0.0123, seconds=8.04)
    assert T.format_row(m1).startswith(row1 + " ")
    assert T.format_row(m2).startswith(row2 + "    ")
    assert T.format_row(m2).split()[7:] == ["1.230e-02", "8.0"]
    assert T.format_row(dict(m1, policy_loss=-1e-9)).split()[5] == "0.000000"


# ----------------------------------------------------------------------------------------------
# Config


def test_config_yaml_defaults_are_the_spec_setup():
    values = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg = T.load_config(["--config", str(ROOT / "config.yaml")])
    assert set(values) == {f.name for f in T.dataclasses.fields(T.Config)}
    assert cfg == T.Config()
    assert (cfg.model, cfg.revision) == ("Qwen/Qwen3-0.6B-Base", "da87bfb608c14b7cf20ba1ce41287e8de496c0cd")
    assert (cfg.group_size, cfg.temperature, cfg.top_p, cfg.max_new_tokens) == (8, 0.8, 0.9, 512)
    assert (cfg.learning_rate, cfg.max_grad_norm, cfg.std_eps, cfg.num_problems, cfg.start_index) == (
        1e-5, 1.0, 1e-4, 50, 0)
    assert cfg.prompt_template == (
        "You are a helpful math assistant.\nAnswer the question and write the final result on a new line as:\n"
        "\\boxed{ANSWER}\n\nQuestion:\n{problem}\n\nAnswer:")
    assert cfg.dataset.endswith("math_full_minus_math500.json") and cfg.eos_token == "<|endoftext|>"


def test_command_line_overrides_are_typed():
    cfg = T.load_config(["--config", str(ROOT / "config.yaml"), "learning_rate=1e-5", "group_size=4",
                         "top_p=1", "device=cpu", "overwrite=true", "revision=123"])
    assert cfg.learning_rate == 1e-5 and isinstance(cfg.learning_rate, float)
    assert cfg.group_size == 4 and cfg.top_p == 1.0 and cfg.device == "cpu" and cfg.overwrite is True
    assert cfg.revision == "123"


@pytest.mark.parametrize("override, fragment", [
    ("group_size=1", "'group_size' must be an integer in [2, 65536]"),
    ("group_size=100000000", "'group_size' must be an integer in [2, 65536]"),
    ("seed=18446744073709551616", "'seed' must be an integer in [0, 2**63)"),
    ("seed=-1", "'seed' must be an integer in [0, 2**63)"),
    ("verifier_timeout=1e10", "'verifier_timeout' must be a number of seconds in (0, 86400]"),
    ("std_eps=1e-50", "'std_eps' must be a number > 0 that float32 can hold"),
    ("temperature=0", "'temperature' must be a number > 0"),
    ("top_p=0", "'top_p' must be a number in (0, 1]"),
    ("top_p=1.5", "'top_p' must be a number in (0, 1]"),
    ("max_new_tokens=0", "'max_new_tokens'"),
    ("group_size=eight", "'group_size' must be int"),
    ("learning_rate=fast", "'learning_rate' must be float"),
    ("bogus_key=1", "unknown config key 'bogus_key'"),
    ("precision=fp8", "'precision' must be one of auto, fp32, bf16-autocast, bf16"),
    ("device=tpu", "'device' must be cpu, cuda or cuda:N"),
    ("prompt_template=no placeholder", "'prompt_template'"),
    ("std_eps=0", "'std_eps'"),
    ("learning_rate=nan", "finite"),
    ("group_size", "must look like key=value"),
    # the evaluation settings
    ("eval_samples=0", "'eval_samples' must be an integer >= 1"),
    ("eval_batch_size=0", "'eval_batch_size' must be an integer >= 1"),
    ("eval_max_new_tokens=0", "'eval_max_new_tokens' must be an integer >= 1"),
    ("eval_top_p=0", "'eval_top_p' must be a number in (0, 1]"),
    ("eval_temperature=0", "'eval_temperature' must be a number > 0"),
    ("eval_every=-1", "'eval_every' must be an integer >= 0"),
    ("eval_problems=-1", "'eval_problems' must be an integer >= 0"),
    ("num_problems=0", "'eval_problems' must be an integer >= 1 when num_problems is 0"),
    ("eval_problems=two", "'eval_problems' must be int"),
])
def test_bad_config_is_one_line_and_exit_2(override, fragment, capsys):
    assert T.main(["--config", str(ROOT / "config.yaml"), override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and "\n" not in err


def test_cuda_without_a_gpu_says_how_to_choose_cpu(capsys, tmp_path):
    if T.torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert T.main(["--config", str(ROOT / "config.yaml"), f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "device=cpu" in err


def test_bad_config_file_via_the_cli_exits_2_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("group_size: 1\n")
    proc = subprocess.run([sys.executable, str(ROOT / "train_rlvr.py"), "--config", str(bad)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config key 'group_size' must be an integer in [2, 65536] (advantages need a sample std), got 1"
    assert proc.stdout == ""


# ----------------------------------------------------------------------------------------------
# Data


def _args(tiny_model_dir, data, out, *extra):
    return ["--config", str(ROOT / "config.yaml"), f"model={tiny_model_dir}", f"dataset={data}",
            "device=cpu", f"output_dir={out}", "group_size=4", "max_new_tokens=8", "num_problems=3", *extra]


@pytest.mark.parametrize("records, extra, fragment", [
    ([{"question": "q", "answer": "1"}], [], "dataset has no field 'problem' (set problem_field); its fields are: question, answer"),
    ([{"problem": "q", "solution": "1"}], [], "no field 'answer' (set answer_field)"),
    ([{"problem": "q", "answer": "1"}] * 2, [], "dataset has 2 records but start_index + num_problems = 3"),
    ([{"problem": "q", "answer": ""}] * 3, [], "dataset record 0: 'answer' is empty"),
    ([{"problem": "q", "answer": "1"}] * 3, ["start_index=1"], "start_index + num_problems = 4"),
])
def test_data_errors_are_one_line_and_exit_2(tiny_model_dir, tmp_path, capsys, records, extra, fragment):
    data = tmp_path / "d.json"
    data.write_text(json.dumps(records))
    assert T.main(_args(tiny_model_dir, data, tmp_path / "out", *extra)) == 2
    _assert_one_error_line(capsys.readouterr().err, fragment)


def _assert_one_error_line(err, fragment):
    """Progress lines may come first; the error is one line, the last, and no traceback."""
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and fragment in lines[-1], err
    assert sum(l.startswith("error") for l in lines) == 1 and "Traceback" not in err


def test_missing_dataset_file_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    assert T.main(_args(tiny_model_dir, tmp_path / "nope.json", tmp_path / "out")) == 2
    _assert_one_error_line(capsys.readouterr().err, "not found")


def test_the_shared_first_50_problems_load_in_order(tmp_path):
    data = ROOT.parent / "shared" / "data" / "math_train_first50.json"
    if not data.exists():
        pytest.skip("../shared/data not present (fresh clone): real-data check skipped")
    cfg = T.Config(dataset=str(data), num_problems=50)
    problems = T.load_problems(cfg)
    raw = json.loads(data.read_text())
    assert [p["answer"] for p in problems] == [r["answer"] for r in raw]
    assert problems[9]["answer"] == "\\$42409" and [p["index"] for p in problems] == list(range(50))
    assert T.build_prompt(cfg.prompt_template, problems[0]["problem"]).endswith(raw[0]["problem"] + "\n\nAnswer:")


def test_jsonl_and_parquet_files_load(tmp_path):
    records = [{"problem": f"p{i}", "answer": i} for i in range(4)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    import datasets

    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.jsonl", "d.parquet"):
        problems = T.load_problems(T.Config(dataset=str(tmp_path / name), num_problems=3, start_index=1))
        assert [(p["problem"], p["answer"], p["index"]) for p in problems] == [("p1", 1, 1), ("p2", 2, 2), ("p3", 3, 3)]


# ----------------------------------------------------------------------------------------------
# End to end


def _run(tiny_model_dir, data, out, capsys, *extra):
    code = T.main(_args(tiny_model_dir, data, out, *extra))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def _rewards_from_parity(monkeypatch):
    """The tiny random model never writes a right \\boxed answer; reward odd-length responses so
    that groups have reward variance and the gradient path runs end to end."""
    def fake_score(scorer, texts, gold):
        return [verdict(len(t) % 2 == 1) for t in texts]
    monkeypatch.setattr(T, "score_rollouts", fake_score)


def test_end_to_end_table_summary_outputs_and_reload(tiny_model_dir, tiny_data_file, tmp_path, capsys):
    out_dir = tmp_path / "run"
    stdout = _run(tiny_model_dir, tiny_data_file, out_dir, capsys, "num_problems=3")
    lines = stdout.splitlines()
    assert lines[0] == T.format_header(4)
    rows = [l.split() for l in lines[1:4]]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    metrics = [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(l) for l in (out_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and len(rollouts) == 12
    for m, row in zip(metrics, lines[1:4]):
        assert row == T.format_row(m)
        mine = [r for r in rollouts if r["step"] == m["step"]]
        assert m["response_tokens"] == sum(r["tokens"] for r in mine)
        assert m["correct"] == sum(r["reward"] == 1.0 for r in mine)
        assert m["cut_at_limit"] == sum(r["cut_at_limit"] for r in mine)
        assert all(r["tokens"] <= 8 and r["status"] in ("correct", "wrong", "no_answer") for r in mine)
        assert m["update_norm"] > 0  # weight decay moves the weights even at zero gradient
    assert "correct rollouts" in stdout and "zero-variance groups" in stdout and "tokens/s" in stdout
    saved = yaml.safe_load((out_dir / "run_config.yaml").read_text())
    assert saved["group_size"] == 4 and saved["model"] == str(tiny_model_dir)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir / "final")
    assert (out_dir / "final" / "model.safetensors").exists()
    assert AutoTokenizer.from_pretrained(out_dir / "final").eos_token == "<|endoftext|>"
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    moved = sum((a - b).pow(2).sum().item() for a, b in zip(reloaded.parameters(), original.parameters()))
    assert math.sqrt(moved) > 0


def test_end_to_end_with_reward_variance_moves_the_weights(tiny_model_dir, tiny_data_file, tmp_path, capsys,
                                                            monkeypatch):
    _rewards_from_parity(monkeypatch)
    stdout = _run(tiny_model_dir, tiny_data_file, tmp_path / "run", capsys, "num_problems=4", "learning_rate=1e-3")
    metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    varied = [m for m in metrics if m["reward_std"] > 0]
    flat = [m for m in metrics if m["reward_std"] == 0]
    assert varied, "the parity reward should give at least one group with variance"
    assert all(m["grad_norm"] > 0 and m["policy_loss"] != 0 for m in varied)
    assert all(m["grad_norm"] == 0 and m["policy_loss"] == 0 for m in flat)
    rollouts = [json.loads(l) for l in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    for m in varied:
        mine = [r for r in rollouts if r["step"] == m["step"]]
        loss = -sum(r["advantage"] * r["sequence_log_prob"] for r in mine) / 4
        assert m["policy_loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
        assert sum(r["advantage"] for r in mine) == pytest.approx(0.0, abs=1e-5)
    assert f"non-zero gradient       {len(varied)} steps" in stdout


def test_same_seed_same_table_and_outputs(tiny_model_dir, tiny_data_file, tmp_path, capsys, monkeypatch):
    _rewards_from_parity(monkeypatch)

    def strip(text):  # the seconds column and timings are the only measured-time values
        return [l.rsplit(None, 1)[0] for l in text.splitlines()[1:4]]
    a = _run(tiny_model_dir, tiny_data_file, tmp_path / "a", capsys, "learning_rate=1e-3")
    b = _run(tiny_model_dir, tiny_data_file, tmp_path / "b", capsys, "learning_rate=1e-3")
    c = _run(tiny_model_dir, tiny_data_file, tmp_path / "c", capsys, "learning_rate=1e-3", "seed=1")
    assert strip(a) == strip(b) and strip(a) != strip(c)
    assert (tmp_path / "a" / "rollouts.jsonl").read_text() == (tmp_path / "b" / "rollouts.jsonl").read_text()
    from safetensors.torch import load_file

    wa, wb = load_file(tmp_path / "a" / "final" / "model.safetensors"), load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_existing_run_is_not_overwritten(tiny_model_dir, tiny_data_file, tmp_path, capsys):
    _run(tiny_model_dir, tiny_data_file, tmp_path / "run", capsys, "num_problems=1")
    assert T.main(_args(tiny_model_dir, tiny_data_file, tmp_path / "run", "num_problems=1")) == 2
    assert "already holds a run" in capsys.readouterr().err
    _run(tiny_model_dir, tiny_data_file, tmp_path / "run", capsys, "num_problems=1", "overwrite=true")


def test_cli_stdout_holds_only_the_table_and_summary(tiny_model_dir, tiny_data_file, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "train_rlvr.py"),
                           *_args(tiny_model_dir, tiny_data_file, tmp_path / "run", "num_problems=2")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("step  correct/4  reward mean") and lines[1].startswith("1 ") and lines[2].startswith("2 ")
    assert lines[3] == "" and lines[4].startswith("correct rollouts")
    assert "[step 1] generating" in proc.stderr


def test_hub_names_and_urls_go_through_the_real_loaders(monkeypatch):
    """No network here: check what load_problems and the model loader ask datasets and
    transformers for, with the libraries' loaders replaced by recorders."""
    import datasets
    import transformers

    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([{"problem": "p", "answer": "1"}])
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    T.load_problems(T.Config(num_problems=1))
    T.load_problems(T.Config(dataset="someone/math-set", dataset_split="test", num_problems=1))
    assert calls[0] == (("json",), {"data_files": T.MATH_TRAIN_URL, "split": "train"})
    assert calls[1] == (("someone/math-set",), {"split": "test"})

    seen = {}

    class Recorder:
        @staticmethod
        def from_pretrained(name, **kwargs):
            seen.setdefault("names", []).append((name, kwargs.get("revision")))
            raise OSError("offline")
    monkeypatch.setattr(transformers, "AutoTokenizer", Recorder)
    with pytest.raises(T.UserError, match="could not load model 'Qwen/Qwen3-0.6B-Base' at revision 'da87bfb6"):
        T.load_model_and_tokenizer(T.Config(), torch.device("cpu"), "fp32")
    assert seen["names"] == [("Qwen/Qwen3-0.6B-Base", "da87bfb608c14b7cf20ba1ce41287e8de496c0cd")]


def test_unreachable_dataset_is_one_line(monkeypatch, capsys, tmp_path):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'raw.githubusercontent.com'\nmore detail")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert T.main(["--config", str(ROOT / "config.yaml"), "device=cpu", f"output_dir={tmp_path}"]) == 2
    _assert_one_error_line(capsys.readouterr().err, "could not load dataset 'https://raw.githubusercontent.com/")


def test_update_norm_through_reused_host_buffers_is_the_same(tiny_model_dir):
    """On CUDA the weights before the step go to reused host buffers; the measured norm must not
    depend on where the copy lives."""
    from transformers import AutoModelForCausalLM

    norms = []
    for host_copy in (None, "buffers"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3)
        buffers = [torch.full_like(p, 7.0) for p in params] if host_copy else None
        torch.manual_seed(0)
        for p in params:
            p.grad = torch.randn_like(p)
        before = [p.detach().clone() for p in params]
        norms.append(T.optimizer_step(params, opt, 1.0, 0.0, buffers and T.StepCopies(buffers))[1])
        by_hand = math.sqrt(sum(((p.detach() - b) ** 2).sum().item() for p, b in zip(params, before)))
        assert norms[-1] == pytest.approx(by_hand, rel=1e-6)
    assert norms[0] == norms[1] > 0


@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
def test_the_other_precisions_run_end_to_end_on_cpu(tiny_model_dir, tiny_data_file, tmp_path, capsys, monkeypatch,
                                                   precision, bf16_attention):
    """Each step's loss, sequence log-probs and gradient against a float32 copy of the model on the
    same tokens. Stated tolerances (measured: at most 0.0015 on log-probs of about -45, 0.6 % on
    the gradient): log-probs within 1e-4 relative + 0.005 (a sum rounded to bf16, 0.25 apart at
    45, does not pass), the loss within 0.1 % + 0.005, the gradient within 5 % of its norm."""
    import copy

    _rewards_from_parity(monkeypatch)
    real, compared = T.accumulate_policy_gradient, []

    def against_float32(model, params, prompt, responses, adv, group_size, amp, batch_size=1, divisors=None,
                        terms=None, silent=False, zero=True, shared=False):
        assert terms.kl_coef == 0 and terms.old is None and terms.masked is None  # the spec's step
        twin = copy.deepcopy(model).float()
        done = real(model, params, prompt, responses, adv, group_size, amp, batch_size, divisors, terms, silent, zero=zero)
        ref = real(twin, list(twin.parameters()), prompt, responses, adv.float(), group_size, T.nullcontext(),
                   batch_size, divisors, terms, silent, zero=zero)
        assert done.loss == pytest.approx(ref.loss, rel=1e-3, abs=5e-3)
        assert done.seq_log_probs == pytest.approx(ref.seq_log_probs, rel=1e-4, abs=5e-3)
        grad = torch.cat([p.grad.float().flatten() for p in params])
        ref_grad = torch.cat([p.grad.flatten() for p in twin.parameters()])
        assert (grad - ref_grad).norm() <= 0.05 * ref_grad.norm()
        compared.append(ref_grad.norm().item())
        return done
    monkeypatch.setattr(T, "accumulate_policy_gradient", against_float32)
    out = tmp_path / "run"
    stdout = _run(tiny_model_dir, tiny_data_file, out, capsys, "num_problems=2", f"precision={precision}",
                  "learning_rate=1e-3")
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["update_norm"] > 0 for m in metrics)
    varied = [m for m in metrics if m["reward_std"] > 0]
    assert varied and len(compared) == 2
    for m, ref_norm in zip(metrics, compared):  # the logged grad norm is the bf16 one, near float32's
        assert m["grad_norm"] == pytest.approx(ref_norm, rel=0.05, abs=1e-6)
    from safetensors.torch import load_file

    weights = load_file(out / "final" / "model.safetensors")
    expected = torch.bfloat16 if precision == "bf16" else torch.float32  # bf16-autocast keeps float32 masters
    assert {w.dtype for w in weights.values()} == {expected}
    assert "correct rollouts" in stdout


def test_end_to_end_with_the_real_qwen3_tokenizer(tmp_path, capsys):
    """The real tokenizer (no BOS; its unk token is <|endoftext|>, id 151643) on a small random model."""
    like = ROOT.parent / "shared" / "qwen3-0.6b-base"
    if not like.exists():
        pytest.skip("../shared/qwen3-0.6b-base not present (fresh clone): real-tokenizer check skipped")
    from conftest import build_like
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    build_like(model_dir, like, layers=1, hidden=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert T.resolve_eos_id(tok, T.Config(), 151936) == 151643
    with pytest.raises(T.UserError, match=re.escape("eos_token '<|im_nope|>' is not a token")):
        T.resolve_eos_id(tok, T.Config(eos_token="<|im_nope|>"), 151936)
    prompt = T.build_prompt(T.SPEC_PROMPT, "What is 1 + 1?")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == prompt and 151643 not in ids  # no BOS, no special token added
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"problem": "What is 1 + 1?", "answer": "2"}] * 2))
    out = tmp_path / "run"
    stdout = _run(model_dir, data, out, capsys, "num_problems=2", "max_new_tokens=6")
    rollouts = [json.loads(l) for l in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 8 and all(1 <= r["tokens"] <= 6 for r in rollouts)
    assert stdout.splitlines()[0].startswith("step  correct/4")


def test_unknown_eos_token_of_the_tiny_tokenizer_is_refused(tiny_model):
    _, tok = tiny_model
    assert T.resolve_eos_id(tok, T.Config(), 320) == 0
    with pytest.raises(T.UserError, match="set eos_token to its EOS"):
        T.resolve_eos_id(tok, T.Config(eos_token="</s>"), 320)
