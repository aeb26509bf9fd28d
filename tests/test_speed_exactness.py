"""Every speed-up of the training step keeps the numbers: each test pins one optimization to the plain
computation it replaces (transformers' warpers, the one-response-at-a-time backward, the float32
master weights under autocast, the DynamicCache decode)."""

import types

import pytest
import torch

import train_rlvr as T
from conftest import ROOT

VOCAB = 151936


def advantages(rewards, std_eps=1e-4, advantage_std="group"):
    """compute_advantages with the zero-variance flag decided as score_group decides it (equal_rewards)."""
    return T.compute_advantages(rewards, std_eps, advantage_std, zero_variance=T.equal_rewards(rewards))


def _hf_kept(scores, top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    if top_p >= 1.0:
        return torch.isfinite(scores)
    return torch.isfinite(TopPLogitsWarper(top_p)(None, scores.clone()))


def _adversarial_rows():
    g = torch.Generator().manual_seed(7)
    flat = torch.randn(6, VOCAB, generator=g) * 0.45           # the random stand-in: ~116,000 tokens kept
    flatter = torch.randn(2, VOCAB, generator=g) * 0.01
    peaked = torch.randn(4, VOCAB, generator=g) * 6             # a trained model's small nucleus
    dominant = torch.randn(2, VOCAB, generator=g)
    dominant[:, 123] = 60.0
    # the boundary inside a block of equal scores: only the order of token ids can decide
    boundary_ties = torch.cat([torch.full((2, 300), 2.0), torch.full((2, 300), 1.0), torch.zeros(2, 400)], dim=1)
    coarse = torch.randint(0, 3, (4, 2000), generator=g).float()   # few distinct values, many ties
    exact_zero = torch.zeros(2, 5000)                               # everything tied
    halves = torch.tensor([[0.0, 0.0], [1.0, 0.0]]).repeat(1, 50)  # mass exactly 0.5 at a tie boundary
    neg_inf = torch.where(torch.rand(3, 4000, generator=g) < 0.5, float("-inf"), torch.randn(3, 4000, generator=g))
    signed_zero = torch.tensor([[-0.0, 0.0, 1.0, -1.0] * 25])
    return {"flat": flat, "flatter": flatter, "peaked": peaked, "dominant": dominant,
            "boundary_ties": boundary_ties, "coarse": coarse, "exact_zero": exact_zero, "halves": halves,
            "neg_inf": neg_inf, "signed_zero": signed_zero}


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999, 1.0])
def test_kept_set_equals_transformers_on_adversarial_rows(top_p, monkeypatch):
    sent = []
    reference = T.top_p_reference
    monkeypatch.setattr(T, "top_p_reference", lambda s, p: sent.append(s.shape[0]) or reference(s, p))
    for name, logits in _adversarial_rows().items():
        for temperature in (0.8, 1.3):
            scores = logits.float() / temperature
            assert torch.equal(T.top_p_mask(scores, top_p), _hf_kept(scores, top_p)), (name, top_p, temperature)
    if top_p < 1.0:
        assert sum(sent) > 0  # tie-split rows really took transformers' own path


def test_continuous_rows_never_need_the_full_sort(monkeypatch):
    """The values-only sort decides every row without ties; torch.sort with its permutation never runs."""
    monkeypatch.setattr(T, "top_p_reference", lambda *a: pytest.fail("fell back to the full sort"))
    g = torch.Generator().manual_seed(1)
    for scale in (0.45, 3.0, 20.0):
        scores = torch.randn(8, VOCAB, generator=g) * scale / 0.8
        assert T.top_p_mask(scores, 0.9).sum() > 0


def test_probabilities_equal_transformers_on_full_vocabulary_rows():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)) * 0.45
    ref = torch.softmax(TopPLogitsWarper(0.9)(None, TemperatureLogitsWarper(0.8)(None, logits.clone())), dim=-1)
    w = T.nucleus_weights(logits, 0.8, 0.9).double()
    torch.testing.assert_close(w / w.sum(-1, keepdim=True), ref.double(), rtol=1e-5, atol=1e-12)


def _old_sample(logits, temperature, top_p, generator):
    """sample_next_token before its speed-ups (torch.where, float64 copy, last kept token always)."""
    scores = logits.float() / temperature
    kept = T.top_p_reference(scores, top_p) if top_p < 1.0 else torch.isfinite(scores)
    weights = torch.where(kept, (scores - scores.max(dim=-1, keepdim=True).values).exp(), 0.0)
    cdf = weights.double().cumsum(dim=-1)
    u = torch.rand(weights.shape[0], 1, generator=generator, dtype=torch.float64)
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    last_kept = weights.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
    return torch.minimum(token, last_kept).squeeze(-1)


@pytest.mark.parametrize("scale, top_p", [(0.45, 0.9), (5.0, 0.9), (1.0, 0.5), (0.45, 1.0)])
def test_a_fixed_seed_draws_the_same_tokens_as_the_full_sort_path(scale, top_p):
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3)) * scale
    for seed in range(3):
        u = torch.rand(8, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        new = T.sample_next_token(logits, 0.8, top_p, u)
        old = _old_sample(logits, 0.8, top_p, torch.Generator().manual_seed(seed))
        assert torch.equal(new, old)


def test_a_uniform_that_rounds_up_to_the_total_takes_the_last_kept_token(monkeypatch):
    logits = torch.tensor([[3.0, 2.0, 1.0, -9.0, -9.0], [0.0, 5.0, 0.0, 0.0, -9.0]])
    almost_one = 1.0 - 2.0 ** -53
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full_like(real_rand(*a, **k), almost_one))
    new = T.sample_next_token(logits, 1.0, 0.9, torch.full((2, 1), almost_one, dtype=torch.float64))
    old = _old_sample(logits, 1.0, 0.9, torch.Generator())
    assert torch.equal(new, old) and T.top_p_mask(logits, 0.9)[torch.arange(2), new].all()


def test_the_cuda_path_keeps_transformers_set_on_the_adversarial_rows(monkeypatch):
    """What CUDA tensors take (sampler_on_host False), run on CPU tensors: every row through
    top_p_reference, the values-only sort never used, the same kept set as transformers'."""
    monkeypatch.setattr(T, "sampler_on_host", lambda device: False)
    monkeypatch.setattr(T, "sorted_values", lambda *a: pytest.fail("the CUDA path sorted the values alone"))
    for name, logits in _adversarial_rows().items():
        for top_p in (0.05, 0.5, 0.9):
            scores = logits.float() / 0.8
            assert torch.equal(T.top_p_mask(scores, top_p), _hf_kept(scores, top_p)), (name, top_p)


@pytest.mark.parametrize("on_host", [True, False])
def test_top_p_removes_a_token_whose_cumulative_sum_equals_one_minus_top_p(on_host, monkeypatch):
    """Distinct scores whose float32 cumulative probability hits 1 - top_p exactly: sorted up,
    softmax(log [0.125, 0.375, 0.5]).cumsum() is [0.125, 0.5, 1.0] and 0.5 <= 1 - 0.5 removes the
    second token too (transformers' `<=`); a `<` would keep it. No tie: the host path decides the
    row itself, without top_p_reference."""
    monkeypatch.setattr(T, "sampler_on_host", lambda device: on_host)
    if on_host:
        monkeypatch.setattr(T, "top_p_reference", lambda *a: pytest.fail("a row without ties took the full sort"))
    scores = torch.tensor([[0.125, 0.375, 0.5], [0.375, 0.5, 0.125]]).log()
    values = torch.sort(scores[0]).values
    assert values.softmax(-1).cumsum(-1).tolist() == [0.125, 0.5, 1.0]  # the float32 numbers, exactly
    kept = T.top_p_mask(scores, 0.5)
    assert kept.tolist() == [[False, False, True], [False, True, False]]
    assert torch.equal(kept, _hf_kept(scores, 0.5))


SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")  # under .item(), bool(tensor), .tolist(); nonzero's size


def test_the_cuda_sampler_path_makes_no_host_sync_per_token(monkeypatch):
    """The sampler as CUDA tensors take it, profiled on the CPU: no op that reads a device value
    on the host, and the uniforms drawn once per stream per 64 tokens. The logits are bf16-rounded,
    so rows tie at the top-p boundary (the old tie branch synced twice on each such token)."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(T, "sampler_on_host", lambda device: False)
    g = torch.Generator().manual_seed(4)
    logits = [(torch.randn(4, 1000, generator=g) * 0.45).bfloat16().float() for _ in range(66)]
    pick = T.sampling_pick(T.rollout_streams(0, 1, range(4), "cpu"), 0.8, 0.9, "cpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tokens = [pick(x) for x in logits]
    names = [e.name for e in prof.events()]
    assert sum(names.count(s) for s in SYNCS) == 0
    assert names.count("aten::uniform_") == 4 * 2  # 66 tokens: two blocks of 64 per stream
    assert all(0 <= int(t.min()) and int(t.max()) < 1000 for t in tokens)
    # the same tokens as the CPU's own path (numpy sort, tie branch, syncs allowed), whose tie
    # branch these logits really reach
    monkeypatch.setattr(T, "sampler_on_host", lambda device: True)
    sent, reference = [], T.top_p_reference
    monkeypatch.setattr(T, "top_p_reference", lambda scores, p: sent.append(len(scores)) or reference(scores, p))
    host = T.sampling_pick(T.rollout_streams(0, 1, range(4), "cpu"), 0.8, 0.9, "cpu")
    assert all(torch.equal(host(x), t) for x, t in zip(logits, tokens))
    assert len(sent) > 30


def test_uniform_blocks_give_each_stream_its_numbers_one_at_a_time():
    """The CPU's guarantee: a stream's t-th uniform is its t-th torch.rand(1) draw, across blocks,
    when rows leave the batch, and after a stream's state is set back (the eager retry)."""
    def singles(i, n):
        g = T.rollout_streams(0, 5, [i], "cpu")[0]
        return [torch.rand(1, 1, generator=g, dtype=torch.float64).item() for _ in range(n)]
    streams = T.rollout_streams(0, 5, range(4), "cpu")
    uniforms = T.Uniforms(streams, "cpu")
    got = {i: [] for i in range(4)}
    for t in range(150):
        rows = None if t < 70 else [1, 3] if t < 100 else [3]
        u = uniforms(rows)
        for i, x in zip(range(4) if rows is None else rows, u[:, 0].tolist()):
            got[i].append(x)
    assert [len(got[i]) for i in range(4)] == [70, 100, 70, 150]
    assert all(got[i] == singles(i, len(got[i])) for i in range(4))
    # set back (generate_rollouts before its eager retry): the numbers again from there
    fresh = T.rollout_streams(0, 5, range(2), "cpu")
    states, uniforms = [g.get_state() for g in fresh], T.Uniforms(fresh, "cpu")
    first = [uniforms()[:, 0].tolist() for _ in range(5)]
    for g, state in zip(fresh, states):
        g.set_state(state)
    assert [uniforms()[:, 0].tolist() for _ in range(5)] == first
    held = [uniforms() for _ in range(64)]  # a refill in between: what was handed out keeps its value
    assert [u[:, 0].tolist() for u in held] == [[a, b] for a, b in zip(singles(0, 69)[5:], singles(1, 69)[5:])]


def test_a_temperature_that_overflows_float32_samples_the_argmax(monkeypatch):
    """logits / 1e-38 overflows to +-inf for logits above 3.4 (NaN weights, a token out of range
    before); 1e-46 is 0 in float32 (NaN for a zero logit). Both take the limit temperature -> 0:
    the argmax, tied maxima sharing. A row whose scores stay finite keeps its numbers."""
    logits = torch.tensor([[1.0, 7.5, -3.0, 7.0, 0.0], [9.0, 9.0, 2.0, -8.0, 0.0],
                           [0.5, 0.25, 0.0, 1.0, -1.0], [-5.0, -4.0, -4.5, -6.0, -7.0]])
    for on_host in (True, False):
        monkeypatch.setattr(T, "sampler_on_host", lambda device: on_host)
        for temperature in (1e-38, 1e-46):
            w = T.nucleus_weights(logits, temperature, 0.9)
            expected = [[0, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 1, 0], [0, 1, 0, 0, 0]]
            if temperature == 1e-38:  # row 2's scores (at most 1e38) stay finite: already one-hot
                assert torch.isfinite(logits[2] / temperature).all()
            assert w.tolist() == expected, (on_host, temperature)
            for u in (0.0, 0.3, 0.7, 1 - 2 ** -53):
                token = T.sample_next_token(logits, temperature, 0.9, torch.full((4, 1), u, dtype=torch.float64))
                assert token.tolist() == [1, 0 if u < 0.5 else 1, 3, 1]
    finite = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))  # untouched: the 0.8 numbers
    scores = finite / 0.8
    by_hand = (scores - scores.max(-1, keepdim=True).values).exp() * T.top_p_reference(scores, 0.9)
    assert torch.equal(T.nucleus_weights(finite, 0.8, 0.9), by_hand)


# ----------------------------------------------------------------------------------------------
# Log-probabilities: micro-batches give the one-at-a-time gradient


@pytest.mark.parametrize("batch_size", [2, 3, 8])
def test_logprob_micro_batches_give_the_same_gradient(tiny_model, batch_size):
    model, _ = tiny_model
    params = list(model.parameters())
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 300, (7,), generator=g)
    responses = [torch.randint(1, 300, (n,), generator=g) for n in (5, 1, 9, 3, 12)]
    responses[2][-1] = 0  # one ends with EOS
    adv = advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0]))
    done = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 5, T.nullcontext())
    loss1, lps1 = done.loss, done.seq_log_probs
    grads1 = [p.grad.clone() for p in params]
    done = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 5, T.nullcontext(),
                                                 logprob_batch_size=batch_size)
    loss_b, lps_b = done.loss, done.seq_log_probs
    assert loss_b == pytest.approx(loss1, rel=1e-5, abs=1e-6)
    assert lps_b == pytest.approx(lps1, rel=1e-5, abs=1e-5)
    for a, b in zip(grads1, (p.grad for p in params)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    # per-token values of a micro-batch equal the one-response function's
    with torch.no_grad():
        batched = T.batch_token_log_probs(model, prompt, responses, T.nullcontext())
        for r, lp in zip(responses, batched):
            torch.testing.assert_close(lp, T.token_log_probs(model, prompt, r, T.nullcontext()), rtol=1e-5, atol=1e-5)


def test_batch_size_one_is_the_spec_path_bit_for_bit(tiny_model):
    model, _ = tiny_model
    params = list(model.parameters())
    prompt, responses = torch.tensor([4, 5, 6, 7]), [torch.tensor([8, 9, 0]), torch.tensor([10, 11])]
    adv = advantages(torch.tensor([1.0, 0.0]))
    out = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 2, T.nullcontext())
    grads = [p.grad.clone() for p in params]
    # by hand: the spec's loop, one response per forward and backward
    for p in params:
        p.grad.zero_()
    total, lps = 0.0, []
    for r, a in zip(responses, adv):
        s = T.sequence_log_prob(T.token_log_probs(model, prompt, r, T.nullcontext()))
        loss = T.policy_loss(a, s, 2)
        loss.backward()
        total += loss.item()
        lps.append(s.item())
    assert (out.loss, out.seq_log_probs) == (total, lps)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, params))


# ----------------------------------------------------------------------------------------------
# Decoding: the bf16 twin, the static cache, torch.compile


def test_bf16_twin_computes_exactly_what_autocast_computes_from_the_float32_master(tiny_model):
    model, _ = tiny_model
    twin, pairs = T.bf16_linear_copy(model)
    assert pairs and all(low.dtype == torch.bfloat16 for _, low in pairs)
    assert twin.model.embed_tokens.weight is model.model.embed_tokens.weight  # shared, float32
    assert twin.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(0))

    def both():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(ids).logits, twin(ids).logits
    a, b = both()
    assert torch.equal(a, b)
    with torch.no_grad():  # an optimizer step moves the master; the refresh follows it exactly
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
        for master, low in pairs:
            low.copy_(master)
    a, b = both()
    assert torch.equal(a, b)


def _rollouts(model, cfg, amp, seed=0, decoders=None):
    responses, _ = T.generate_rollouts(model, torch.tensor([5, 17, 33, 100, 7]), cfg, -1,
                                       T.rollout_streams(seed, 1, range(cfg.group_size), "cpu"), amp, decoders)
    return [r.tolist() for r in responses]


def test_static_cache_decode_takes_the_same_tokens_as_the_dynamic_cache(tiny_model, monkeypatch):
    model, _ = tiny_model
    cfg = T.Config(group_size=4, max_new_tokens=10, temperature=1.0, top_p=0.9, device="cpu")
    cfg.compile = "false"
    dynamic = _rollouts(model, cfg, T.nullcontext())
    cfg.compile = "true"
    decoders = T.Decoders()
    decoder = decoders.get(model, T.nullcontext())
    monkeypatch.setattr(decoder, "compiled_step", decoder._forward)  # the static cache alone, eager
    assert _rollouts(model, cfg, T.nullcontext(), decoders=decoders) == dynamic
    assert decoder.checked and decoders.failed is None  # the static path ran
    assert _rollouts(model, cfg, T.nullcontext(), seed=1, decoders=decoders) == _rollouts(model, T.Config(
        group_size=4, max_new_tokens=10, temperature=1.0, top_p=0.9, device="cpu"), T.nullcontext(), seed=1)


def test_compiled_decode_runs_and_matches_eager_in_float32(tiny_model, inductor):
    model, _ = tiny_model
    cfg = T.Config(group_size=2, max_new_tokens=6, temperature=1.0, top_p=0.9, device="cpu")
    eager = _rollouts(model, cfg, T.nullcontext())
    cfg.compile = "true"
    decoders = T.Decoders()
    assert _rollouts(model, cfg, T.nullcontext(), decoders=decoders) == eager
    assert decoders.failed is None and decoders.static["rollouts"][-1].checked


def test_packed_gqa_leaves_a_transformers_without_the_packing_alone(monkeypatch):
    # transformers 5.17 (the GPU box's) has no is_torchdynamo_compiling in its sdpa module; on an H100 the
    # patch's AttributeError sent every compiled decode to eager. Its sdpa path is used as it is there.
    import transformers.integrations
    from transformers.integrations import sdpa_attention

    packing = sdpa_attention.is_torchdynamo_compiling
    with T.packed_gqa():
        assert sdpa_attention.is_torchdynamo_compiling is T._traced_as_eager
    assert sdpa_attention.is_torchdynamo_compiling is packing
    older = types.SimpleNamespace(sdpa_attention_forward=sdpa_attention.sdpa_attention_forward)
    monkeypatch.setattr(transformers.integrations, "sdpa_attention", older)
    with T.packed_gqa():
        assert vars(older) == {"sdpa_attention_forward": sdpa_attention.sdpa_attention_forward}
    assert vars(older) == {"sdpa_attention_forward": sdpa_attention.sdpa_attention_forward}


def test_compile_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert T.compile_decode(T.Config(), cuda) and not T.compile_decode(T.Config(), cpu)  # auto
    for value, on in [("true", True), ("false", False), ("True", True), ("auto", False)]:
        cfg = T.load_config(["--config", str(ROOT / "config.yaml"), f"compile={value}"])
        assert cfg.compile in ("true", "false", "auto") and T.compile_decode(cfg, cpu) is on
    with pytest.raises(T.UserError, match="'compile' must be auto, true or false"):
        T.load_config(["--config", str(ROOT / "config.yaml"), "compile=maybe"])


def test_decoders_keep_one_static_decoder_per_use_and_model_with_its_planned_length(tiny_model):
    """A StaticDecoder is kept from step to step for its use, with the cache length planned from the
    problems; another model (or another autocast) gets a new one, never the old model's graph."""
    import copy

    model, _ = tiny_model
    decoders = T.Decoders()
    decoders.plan("rollouts", [{"prompt_ids": [1] * 5}, {"prompt_ids": [1] * 9}], 7)
    first = decoders.get(model, T.nullcontext())
    assert decoders.get(model, T.nullcontext()) is first and first.planned == 16 and first.model is model
    assert decoders.get(model, T.nullcontext(), "eval").planned == 0  # nothing planned for eval
    other = copy.deepcopy(model)
    assert decoders.get(other, T.nullcontext()) is not first and decoders.get(other, T.nullcontext()).model is other
    bf16 = decoders.get(other, torch.autocast("cpu", dtype=torch.bfloat16))
    assert bf16.bf16 and decoders.get(other, T.nullcontext()) is not bf16


def test_a_failing_compiled_decoder_falls_back_to_eager_with_the_same_tokens(tiny_model, monkeypatch, capsys):
    model, _ = tiny_model
    cfg = T.Config(group_size=4, max_new_tokens=8, temperature=1.0, top_p=0.9, device="cpu", compile="false")
    eager = _rollouts(model, cfg, T.nullcontext(), seed=3)

    def broken(self, model, amp, use="rollouts"):
        raise RuntimeError("Inductor could not compile this\nlong details")
    monkeypatch.setattr(T.Decoders, "get", broken)
    decoders = T.Decoders()
    cfg.compile = "true"
    assert _rollouts(model, cfg, T.nullcontext(), seed=3, decoders=decoders) == eager
    assert "compiled decoding failed (RuntimeError: Inductor could not compile this); decoding eagerly" in capsys.readouterr().err
    assert decoders.failed == "RuntimeError: Inductor could not compile this"
    # and stays eager, without a new attempt
    assert _rollouts(model, cfg, T.nullcontext(), seed=3, decoders=decoders) == eager
    assert capsys.readouterr().err == ""


def test_bf16_weights_keep_the_compiled_decoder(tiny_model, inductor, monkeypatch, capsys):
    """precision: bf16 (bfloat16 weights, no autocast) computes its logits in bfloat16: the check
    holds it to the bf16 tolerance, not float32's, so the compiled decoder is kept."""
    model, _ = tiny_model
    model = model.to(torch.bfloat16)
    cfg = T.Config(group_size=2, max_new_tokens=6, temperature=1.0, top_p=0.9, device="cpu", compile="true",
                   precision="bf16")
    decoders = T.Decoders()
    responses = _rollouts(model, cfg, T.nullcontext(), decoders=decoders)
    decoder = decoders.get(model, T.nullcontext())
    worst, scale = T.compiled_decode_difference(decoder, model, [torch.tensor([5, 17, 33, 100, 7])] * 2, 6,
                                                T.nullcontext())
    assert "compiled decoding failed" not in capsys.readouterr().err and decoders.failed is None
    assert decoder.checked and decoder.low_precision and len(responses) == 2
    assert T.compiled_tolerance(scale, False) < worst <= T.compiled_tolerance(scale, True)  # float32's would fail


def test_one_compile_per_run_whatever_the_prompt_lengths_and_the_rank_share(tiny_model, inductor, monkeypatch):
    """The static cache is sized once from the longest prompt (Decoders.plan), and the check
    runs at the batch the process decodes (2 of a group of 4 on each of two ranks): a run with a
    short and then a long prompt compiles the decode step once."""
    model, _ = tiny_model
    cfg = T.Config(group_size=4, max_new_tokens=6, temperature=1.0, top_p=0.9, device="cpu", compile="true")
    prompts = [torch.arange(1, 6), torch.arange(1, 301) % 250 + 1]  # 5 + 6 fits 256 columns, 300 + 6 does not
    decoders = T.Decoders()
    decoders.plan("rollouts", [{"prompt_ids": p.tolist()} for p in prompts], cfg.max_new_tokens)
    torch._dynamo.utils.counters.clear()
    for step, prompt in enumerate(prompts):
        responses, _ = T.generate_rollouts(model, prompt, cfg, -1, T.rollout_streams(0, step, [2, 3], "cpu"),
                                           T.nullcontext(), decoders)  # rank 1 of 2: rollouts 2 and 3
        assert len(responses) == 2 and decoders.failed is None
    assert decoders.get(model, T.nullcontext()).cache_len == 512
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def _host_syncs(fn) -> tuple[int, int]:
    """(calls that make the host wait for the device: item, tolist, bool, nonzero, as seen by a
    TorchFunctionMode; aten::item / _local_scalar_dense / nonzero events in the profiler). On the
    CPU `tolist` dispatches no aten op, so the profiler alone would miss it."""
    from torch.overrides import TorchFunctionMode

    names = {"item", "tolist", "__bool__", "nonzero", "__int__", "__float__"}

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.n += getattr(func, "__name__", "") in names
            return func(*args, **(kwargs or {}))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, Count():
        fn()
    events = sum(e.count for e in prof.key_averages()
                 if e.key in ("aten::item", "aten::_local_scalar_dense", "aten::nonzero"))
    return Count.n, events


def test_the_decode_loop_syncs_with_the_host_once_every_8_tokens_on_a_gpu(tiny_model, monkeypatch):
    """The GPU's loop (run on CPU tensors). Greedy (a pick with no sync of its own), no EOS, 24 tokens
    against 8: the 16 more tokens cost the decode loop 2 syncs (the end tests after tokens 16 and 24),
    not 16 (one per token). Eager evaluation's loop (left-padded, drop_finished) adds one `any` per check,
    where it had a `bool(ended.any())` per token: in the profiler 2 aten events per token are left, those
    of transformers' own padding check (an item per forward), plus 2 per check (36, not 64)."""
    model, _ = tiny_model
    monkeypatch.setattr(T, "sampler_on_host", lambda device: False)  # the GPU's check period

    def more(prompts, **kw):
        (short, short_events), (long, long_events) = (_host_syncs(lambda: T.decode(
            model, prompts, n, -1, T.greedy_pick, T.nullcontext(), **kw)) for n in (8, 24))
        return long - short, long_events - short_events
    assert more([torch.tensor([5, 17, 33])] * 2) == (2, 0)  # the CPU's tolist: no aten event, hence the mode count
    assert more([torch.tensor([5, 17, 33]), torch.tensor([9])], drop_finished=True) == (16 + 4, 32 + 4)


def test_nan_scores_never_reach_the_embedding_and_stop_at_the_next_check(tiny_model, monkeypatch):
    """Scores that turn NaN at new token 3 draw an out-of-range id; the GPU's loop feeds the safe id in
    its place until the check after token 8 raises, naming token 3 (the CPU's checks at token 3)."""
    model, _ = tiny_model
    monkeypatch.setattr(T, "CHECK_EVERY", 8)
    monkeypatch.setattr(T, "HOST_CHECK_EVERY", 8)  # the GPU's period; the sampler stays the CPU's
    seen, real = [], T.next_token_scores

    def poisoned(model, ids, cache, name, **kw):
        seen.append(int(ids.max()))
        logits = real(model, ids, cache, name, **kw)
        return logits * float("nan") if len(seen) >= 3 else logits
    monkeypatch.setattr(T, "next_token_scores", poisoned)
    pick = T.sampling_pick(T.rollout_streams(0, 1, range(2), "cpu"), 1.0, 0.9, "cpu")
    with pytest.raises(T.NonFiniteScores, match="NaN or infinite at new token 3$"):
        T.decode(model, [torch.tensor([5, 17, 33])] * 2, 12, -1, pick, T.nullcontext())
    assert len(seen) == 8 and max(seen) < model.config.vocab_size  # prefill + 7 steps, every id in range


# ----------------------------------------------------------------------------------------------
# The rollouts' prompt pass, run once for the group


def _spec_prompt_ids(tok, problem="What is 5 + 5?"):
    return torch.tensor(tok(T.build_prompt(T.SPEC_PROMPT, problem), add_special_tokens=False)["input_ids"])


def test_the_shared_prompt_pass_is_the_batched_pass_bit_for_bit(tiny_model):
    """One prompt in every row (the rollouts): its pass runs once and its keys and values are repeated; the
    logits, keys and values are the batched pass's, so the group's tokens are too. (The LM head runs on every
    row at once: on one row this machine's BLAS rounds it apart, and the check fails.)"""
    model, tok = tiny_model
    prompt = _spec_prompt_ids(tok)
    assert len(prompt) >= 37  # measured: from about this length the BLAS's rows do not depend on the row count
    assert T.same_prompt_pass(model, prompt.repeat(4, 1), T.nullcontext())
    cfg = T.Config(group_size=4, max_new_tokens=10, temperature=1.0, top_p=0.9, device="cpu")
    streams = lambda: T.rollout_streams(0, 1, range(4), "cpu")  # noqa: E731
    decoders = T.Decoders()
    shared = T.generate_rollouts(model, prompt, cfg, -1, streams(), T.nullcontext(), decoders)[0]
    batched = T.generate_rollouts(model, prompt, cfg, -1, streams(), T.nullcontext())[0]
    assert decoders.shared_prompt is True and [r.tolist() for r in shared] == [r.tolist() for r in batched]


def test_where_the_shared_pass_rounds_apart_the_run_says_so_and_runs_every_rows_prompt(tiny_model, monkeypatch,
                                                                                       capsys):
    """A 5-token prompt: the tiny model's BLAS rounds a 5-row product apart from a 20-row one (measured), so
    the check finds the difference, says so once, and the group's prompt pass runs batched: its tokens are
    the batched pass's."""
    model, _ = tiny_model
    prompt = torch.tensor([5, 17, 33, 100, 7])
    if T.same_prompt_pass(model, prompt.repeat(4, 1), T.nullcontext()):
        pytest.skip("this machine's BLAS gives a 5-row and a 20-row product the same rows: nothing to fall back from")
    cfg = T.Config(group_size=4, max_new_tokens=10, temperature=1.0, top_p=0.9, device="cpu")
    decoders = T.Decoders()
    calls = []
    monkeypatch.setattr(T, "prompt_pass", lambda *a, **k: calls.append(a[4] if len(a) > 4 else False) or
                        PROMPT_PASS(*a, **k))
    got = [r.tolist() for r in T.generate_rollouts(model, prompt, cfg, -1, T.rollout_streams(0, 1, range(4), "cpu"),
                                                   T.nullcontext(), decoders)[0]]
    assert decoders.shared_prompt is False and calls == [True, False, False]  # the check's two, then batched
    assert got == _rollouts(model, cfg, T.nullcontext())  # no Decoders: every row's prompt, as before
    assert capsys.readouterr().err.count("differs in its last bits") == 1


PROMPT_PASS = T.prompt_pass


def test_on_the_cpu_a_group_stops_at_its_last_eos(tiny_model):
    """The CPU's loop asks at every token whether every row is done (no device to wait for): a group whose
    last EOS is its 3rd token runs the prompt pass and 2 decode steps, not 7 as with a check every 8 tokens,
    and its responses are the same."""
    model, _ = tiny_model
    calls, real = [], model.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def pick(logits, rows=None):  # rows 0 and 1 end at their 2nd token, row 2 at its 3rd
        drawn.append(1)
        return torch.tensor([0 if len(drawn) == 2 else 9, 0 if len(drawn) == 2 else 9, 0 if len(drawn) == 3 else 9])
    prompt = [torch.tensor([5, 17, 33])] * 3
    model.forward = counted
    try:
        drawn = []
        responses, cut = T.decode(model, prompt, 20, 0, pick, T.nullcontext())
    finally:
        model.forward = real
    assert len(calls) == 3 and [r.tolist() for r in responses] == [[9, 0], [9, 0], [9, 9, 0]] and not any(cut)
