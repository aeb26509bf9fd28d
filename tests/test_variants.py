"""The variants of the spec's step (docs/variants.md), each against a hand computation on a tiny
model; the spec's own formula is checked the same way, since it stays the default."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
import yaml

import train_rlvr as T
from conftest import ROOT
from run_helpers import verdict

# ----------------------------------------------------------------------------------------------
# advantage_std


def advantages(rewards, std_eps=1e-4, advantage_std="group"):
    """compute_advantages with the zero-variance flag decided as score_group decides it (equal_rewards)."""
    return T.compute_advantages(rewards, std_eps, advantage_std, zero_variance=T.equal_rewards(rewards))


def test_advantage_std_none_is_reward_minus_mean_and_group_is_the_spec():
    r = torch.tensor([1.5, 0.5, 0.5, 0.0])  # mean 0.625, sample std sqrt(1.1875 / 3)
    assert advantages(r, 1e-4, "none").tolist() == [0.875, -0.125, -0.125, -0.625]
    std = (1.1875 / 3) ** 0.5
    assert advantages(r, 1e-4, "group").tolist() == pytest.approx(
        [0.875 / (std + 1e-4), -0.125 / (std + 1e-4), -0.125 / (std + 1e-4), -0.625 / (std + 1e-4)], rel=1e-6)
    assert torch.equal(advantages(r, 1e-4), advantages(r, 1e-4, "group"))


def test_advantage_std_none_reaches_the_runs_advantages_and_loss(tmp_path):
    """The setting must reach the step, not only compute_advantages: the default run's step 1 scores
    rollout 0 right (rewards 1, 0, 0, 0; mean 0.25), so none gives 0.75, -0.25, -0.25, -0.25 where
    group would give 0.75 / (0.5 + 1e-4) = 1.4997..."""
    import default_run

    default_run.default_run(tmp_path, ["advantage_std=none", "num_problems=1"])
    rollouts = [json.loads(l) for l in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rollouts] == [1.0, 0.0, 0.0, 0.0]
    assert [r["advantage"] for r in rollouts] == pytest.approx([0.75, -0.25, -0.25, -0.25], abs=1e-6)
    # the spec's loss with these advantages: -(1/G) sum_i A_i log p_i
    want = -sum(a * r["sequence_log_prob"] for a, r in zip([0.75, -0.25, -0.25, -0.25], rollouts)) / 4
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert metrics["policy_loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("mode", ["group", "none"])
def test_equal_rewards_that_float32_cannot_average_exactly_give_zero_advantages(mode):
    r = torch.full((8,), 0.1)  # 8 x 0.1 has a float32 mean that is not 0.1 exactly
    assert torch.equal(advantages(r, 1e-4, mode), torch.zeros(8))


# ----------------------------------------------------------------------------------------------
# loss_aggregation

LENGTHS = (3, 7, 1, 5)  # G = 4, sum_j L_j = 16
MAX_NEW = 8


def test_loss_divisors_worked_numbers():
    assert T.loss_divisors("sequence_sum", list(LENGTHS), MAX_NEW) == [4, 4, 4, 4]
    assert T.loss_divisors("sequence_mean", list(LENGTHS), MAX_NEW) == [12, 28, 4, 20]
    assert T.loss_divisors("token_mean", list(LENGTHS), MAX_NEW) == [16, 16, 16, 16]
    assert T.loss_divisors("dr_grpo", list(LENGTHS), MAX_NEW) == [32, 32, 32, 32]


def _group(seed=1):
    torch.manual_seed(seed)
    prompt = torch.randint(1, 300, (6,))
    responses = [torch.randint(1, 300, (n,)) for n in LENGTHS]
    responses[1][-1] = 0  # one ends with EOS
    return prompt, responses


def _by_hand_loss(model, prompt, responses, adv, aggregation):
    """The issue's formulas, written out: full log-softmax, per-token l_it picked one by one."""
    G, total = len(responses), sum(len(r) for r in responses)
    terms = []
    for i, r in enumerate(responses):
        logp = torch.log_softmax(model(torch.cat([prompt, r]).unsqueeze(0)).logits[0].float(), dim=-1)
        l_i = torch.stack([logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(r.tolist())])
        terms.append({"sequence_sum": adv[i] * l_i.sum() / G,
                      "sequence_mean": adv[i] * l_i.sum() / len(r) / G,
                      "token_mean": adv[i] * l_i.sum() / total,
                      "dr_grpo": adv[i] * l_i.sum() / (G * MAX_NEW)}[aggregation])
    return -torch.stack(terms).sum()


@pytest.mark.parametrize("aggregation", T.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("batch", [1, 3])
def test_each_aggregation_gives_the_hand_computed_loss_and_gradient(tiny_model, aggregation, batch):
    model, _ = tiny_model
    params = list(model.parameters())
    prompt, responses = _group()
    adv = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    divisors = T.loss_divisors(aggregation, [len(r) for r in responses], MAX_NEW)
    done = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext(), batch, divisors)
    loss, _ = done.loss, done.seq_log_probs
    got = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    ref = _by_hand_loss(model, prompt, responses, adv, aggregation)
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)  # float32 terms ~1 that nearly cancel
    got, want = _flat(got), _flat([p.grad for p in params])
    assert (got - want).norm() <= 1e-5 * want.norm() and want.norm() > 0


def _flat(tensors):
    return torch.cat([t.flatten() for t in tensors])


def _clipped_step(model_dir, aggregation, max_grad_norm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    prompt, responses = _group()
    adv = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    divisors = T.loss_divisors(aggregation, [len(r) for r in responses], MAX_NEW)
    T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext(), 1, divisors)
    grad_norm, _ = T.optimizer_step(params, opt, max_grad_norm)
    return grad_norm, [p.grad.clone() for p in params], [p.detach().clone() for p in params]


def test_token_mean_and_dr_grpo_take_the_spec_step_when_the_clip_is_active_for_both(tiny_model_dir):
    """Grad norms here: spec 7.86, token_mean 7.86/4, dr_grpo 7.86/8 (factors G/sum L = 4/16 and
    1/max_new_tokens = 1/8). Clip 0.5 is active for all three: the same clipped gradient, the same step."""
    spec_norm, spec_grad, spec_weights = _clipped_step(tiny_model_dir, "sequence_sum", 0.5)
    assert spec_norm == pytest.approx(7.861, abs=1e-3)  # the tiny model's, measured: above every clip below
    for aggregation, factor in (("token_mean", 4 / 16), ("dr_grpo", 4 / 32)):
        norm, grad, weights = _clipped_step(tiny_model_dir, aggregation, 0.5)
        assert norm == pytest.approx(spec_norm * factor, rel=1e-5) and norm > 0.5  # clipped in both
        assert (_flat(grad) - _flat(spec_grad)).norm() <= 1e-5 * 0.5
        assert (_flat(weights) - _flat(spec_weights)).abs().max() <= 1e-6
    # clip 1.5: active for the spec (7.86) and token_mean (1.97), not for dr_grpo (0.98): only
    # token_mean keeps the spec's step; dr_grpo's gradient is the spec's clipped one times 0.98 / 1.5
    _, spec_grad, _ = _clipped_step(tiny_model_dir, "sequence_sum", 1.5)
    tm_norm, grad, _ = _clipped_step(tiny_model_dir, "token_mean", 1.5)
    assert (_flat(grad) - _flat(spec_grad)).norm() <= 1e-5 * 1.5 and tm_norm > 1.5
    dr_norm, grad, _ = _clipped_step(tiny_model_dir, "dr_grpo", 1.5)
    assert (_flat(grad) - _flat(spec_grad) * dr_norm / 1.5).norm() <= 1e-5 * 1.5 and dr_norm < 1.5
    # sequence_mean weighs each response by 1/L_i: another direction, clipped or not
    _, grad, _ = _clipped_step(tiny_model_dir, "sequence_mean", 0.5)
    assert torch.nn.functional.cosine_similarity(_flat(grad), _flat(spec_grad), dim=0) < 0.99


# ----------------------------------------------------------------------------------------------
# zero_variance


def _trainer(model, zero_variance):
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    cfg = SimpleNamespace(zero_variance=zero_variance, max_grad_norm=1.0)
    return SimpleNamespace(cfg=cfg, params=params, optimizer=opt, copies=None)


@pytest.mark.parametrize("mode", ["step", "skip"])
def test_zero_variance_skip_leaves_weights_and_adamw_untouched_step_moves_them(tiny_model, mode):
    model, _ = tiny_model
    t = _trainer(model, mode)
    prompt, responses = _group()
    adv = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    T.accumulate_policy_gradient(model, t.params, prompt, responses, adv, 4, T.nullcontext())
    assert T.step_or_skip([SimpleNamespace(silent=False)], 0.0, t)[1] > 0  # a group with a signal steps in both modes
    weights = [p.detach().clone() for p in t.params]
    state = {k: v.clone() for k, v in t.optimizer.state[t.params[0]].items()}
    zero = advantages(torch.ones(4))
    T.accumulate_policy_gradient(model, t.params, prompt, responses, zero, 4, T.nullcontext(), silent=True)
    grad_norm, moved = T.step_or_skip([SimpleNamespace(silent=True)], 0.0, t)
    after = t.optimizer.state[t.params[0]]
    assert grad_norm == 0.0
    if mode == "skip":
        assert moved == 0.0 and all(torch.equal(p, w) for p, w in zip(t.params, weights))
        assert all(torch.equal(after[k], v) for k, v in state.items()) and int(after["step"]) == 1
    else:  # the spec: momentum and weight decay move the weights, AdamW counts a second step
        assert moved > 0 and int(after["step"]) == 2 and not torch.equal(after["exp_avg_sq"], state["exp_avg_sq"])


# ----------------------------------------------------------------------------------------------
# format_reward


def test_format_bonus_needs_a_readable_box_and_eos():
    assert T.format_bonus("correct", False, 0.25) == 0.25
    assert T.format_bonus("wrong", False, 0.25) == 0.25
    assert T.format_bonus("no_answer", False, 0.25) == 0.0
    assert T.format_bonus("wrong", True, 0.25) == 0.0  # cut at max_new_tokens: no EOS
    assert T.format_bonus("timeout", False, 0.25) == 0.0
    assert T.format_bonus("correct", False, 0.0) == 0.0


ONE_EPOCH = dict(epoch=1, policy_loss=0.0, grad_norm=0.0, update_norm=0.0)


def _slot(problem, group, adv):
    """The step's one problem as step_report gets it (its first pass skipped: no sequence log-probs)."""
    return T.Slot(problem, None, [], group, advantages=adv, first=T.Pass(0.0, [None] * len(group.texts)))


def test_format_reward_enters_the_rewards_but_not_the_correct_count(tiny_model):
    _, tokenizer = tiny_model
    scores = {"a": (1.0, "2", "correct"), "b": (0.0, "3", "wrong"), "c": (0.0, None, "no_answer"),
              "d": (0.0, "5", "wrong")}
    scorer = SimpleNamespace(score=lambda text, gold, record=None: scores[text])
    cfg = T.Config(group_size=4, format_reward=0.5)
    t = SimpleNamespace(tokenizer=tokenizer, scorer=scorer, cfg=cfg, credit_method=T.credit.method(cfg))
    responses = [torch.tensor(tokenizer.encode(x)) for x in "abcd"]
    group = T.score_group(1, responses, [False, False, False, True], {"answer": "2"}, t)  # d was cut at the limit
    assert group.rewards.tolist() == [1.5, 0.5, 0.0, 0.0]
    adv = T.compute_advantages(group.rewards, cfg.std_eps, zero_variance=group.zero_variance)
    record = T.step_report(1, [_slot({"index": 0}, group, adv)], t, [ONE_EPOCH], T.Stopwatch(torch.device("cpu")))
    metrics, rollouts = record.metrics, record.rollouts
    assert metrics["correct"] == 1 and metrics["reward_mean"] == 0.5
    assert [r["reward"] for r in rollouts] == [1.5, 0.5, 0.0, 0.0]
    # eight formatted wrong answers at w = 0.1: equal rewards whose float32 std is 8e-9, not 0
    scores = {x: (0.0, "3", "wrong") for x in "abcdefgh"}
    cfg = T.Config(group_size=8, format_reward=0.1)
    t = SimpleNamespace(tokenizer=tokenizer, scorer=scorer, cfg=cfg, credit_method=T.credit.method(cfg))
    group = T.score_group(2, [torch.tensor(tokenizer.encode(x)) for x in "abcdefgh"], [False] * 8, {"answer": "2"}, t)
    adv = T.compute_advantages(group.rewards, cfg.std_eps, zero_variance=group.zero_variance)
    metrics = T.step_report(2, [_slot({"index": 1}, group, adv)], t, [ONE_EPOCH],
                            T.Stopwatch(torch.device("cpu"))).metrics
    assert group.zero_variance and group.rewards.std().item() > 0 and not adv.any() and metrics["reward_std"] == 0.0  # a zero-variance group


# ----------------------------------------------------------------------------------------------
# The settings: validated, recorded, refused on resume, a whole run


@pytest.mark.parametrize("arg, fragment", [
    ("advantage_std=std", "config key 'advantage_std' must be one of group, none, got 'std'"),
    ("loss_aggregation=mean", "config key 'loss_aggregation' must be one of sequence_sum, sequence_mean, token_mean"),
    ("zero_variance=drop", "config key 'zero_variance' must be one of step, skip, resample, got 'drop'"),
    ("format_reward=-1", "config key 'format_reward' must be a number in [0, 1e6] (0: off), got -1.0"),
    ("resample_limit=0", "config key 'resample_limit' must be an integer in [1, 1024] (groups drawn per step), got 0"),
    ("kl_coef=-0.1", "config key 'kl_coef' must be a number in [0, 1e6] (0: no KL term, no reference model), got -0.1"),
    ("ppo_epochs=0", "config key 'ppo_epochs' must be an integer in [1, 64] (optimizer steps per group), got 0"),
    ("clip_eps=1", "config key 'clip_eps' must be a number in (0, 1) (the ratio is clipped to [1 - eps, 1 + eps]), "
                   "got 1.0"),
    ("token_report=maybe", "config key 'token_report' must be bool, got 'maybe'"),
])
def test_bad_variant_settings_are_one_line_and_exit_2(tiny_model_dir, tiny_data_file, tmp_path, capsys, arg, fragment):
    code = T.main(["--config", str(ROOT / "config.yaml"), f"model={tiny_model_dir}", f"dataset={tiny_data_file}",
                   "device=cpu", f"output_dir={tmp_path / 'run'}", arg])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_run_with_every_variant_records_them_and_refuses_a_change_on_resume(tiny_model_dir, tiny_data_file,
                                                                               tmp_path, capsys):
    """The tiny model never writes a readable box: every group has equal rewards, so skip leaves
    the weights as they were loaded, and the run's table shows update norm 0."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    variants = ["zero_variance=skip", "loss_aggregation=token_mean", "advantage_std=none", "format_reward=0.5"]
    args = ["--config", str(ROOT / "config.yaml"), f"model={tiny_model_dir}", f"dataset={tiny_data_file}",
            "device=cpu", f"output_dir={out}", "group_size=4", "max_new_tokens=6", "num_problems=2",
            "learning_rate=1e-3", "save_every=1", *variants]
    assert T.main(args) == 0
    capsys.readouterr()
    recorded = yaml.safe_load((out / "run_config.yaml").read_text())
    assert [f"{k}={recorded[k]}" for k in ("zero_variance", "loss_aggregation", "advantage_std", "format_reward")] \
        == variants
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["update_norm"], m["grad_norm"], m["skipped"]) for m in metrics] == [(0.0, 0.0, False)] * 2
    start, final = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(start[k], final[k]) for k in start if k in final)
    for changed in ("zero_variance=step", "loss_aggregation=dr_grpo", "advantage_std=group", "format_reward=0.1"):
        assert T.main([*args, "num_problems=3", "resume=auto", changed]) == 2
        err = capsys.readouterr().err
        assert "cannot resume" in err and changed.split("=")[0] in err


# The spec's run stays the default, bit for bit

FIXTURE = ROOT / "tests" / "fixtures" / "default-run"


def _against_the_fixture(got: dict, folder) -> list[str]:
    import default_run

    want = json.loads((FIXTURE / "expected.json").read_text())
    return default_run.compare(got, want, folder, FIXTURE / "weights.safetensors", vocab_size=320)


def test_the_default_run_is_the_spec_run(tmp_path):
    """Every setting at its default: the responses, rewards, advantages and the table's counts equal the
    fixture's (tests/fixtures/default-run, its README); the losses, norms, log-probs and weights within
    what another CPU's rounding explains (tests/default_run.py says how far)."""
    import default_run

    assert _against_the_fixture(default_run.default_run(tmp_path), tmp_path) == []


# ----------------------------------------------------------------------------------------------
# kl_coef: k3 to a frozen reference


def test_k3_worked_numbers_and_its_zero_at_the_reference():
    q, l = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-2.0, -1.0, -0.5], requires_grad=True)
    k3 = T.kl_k3(q, l)
    # d = q - l = 1, -1, 0: e - 2, 1/e, 0
    assert k3.tolist() == pytest.approx([math.e - 2, 1 / math.e, 0.0], abs=1e-6)
    k3.sum().backward()
    # d k3 / d l = 1 - exp(q - l): 1 - e, 1 - 1/e, exactly 0 where q = l
    assert l.grad.tolist() == pytest.approx([1 - math.e, 1 - 1 / math.e, 0.0], abs=1e-6) and l.grad[2] == 0


def _perturbed_copy(model, seed=3, scale=0.05):
    import copy

    ref = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return ref


def _token_lps(model, prompt, r):
    logp = torch.log_softmax(model(torch.cat([prompt, r]).unsqueeze(0)).logits[0].float(), dim=-1)
    return torch.stack([logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(r.tolist())])


def test_the_kl_pass_makes_its_tensors_on_the_models_device_not_the_default_one(tiny_model):
    """On an H100 the KL path stacked a CPU zero (the clip's empty sum) with the GPU's KL sum and every
    kl_coef run crashed at its first backward. Here the default device is meta while the model is on
    the CPU: a tensor made without the model's device is a meta tensor, and stacking it fails the same way."""
    model, _ = tiny_model
    params, ref = list(model.parameters()), _perturbed_copy(model)
    prompt, responses = _group()
    divisors = T.loss_divisors("sequence_sum", [len(r) for r in responses], MAX_NEW)
    adv = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    with torch.device("meta"):
        done = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext(), 1, divisors,
                                            T.LossTerms(divisors, reference=ref, kl_coef=0.3))
    assert done.kl > 0 and done.clipped == 0.0 and all(p.grad.device.type == "cpu" for p in params)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("aggregation", ["sequence_sum", "token_mean"])
def test_the_kl_term_gives_the_hand_computed_loss_and_gradient(tiny_model, aggregation):
    """loss = sum_i (-A_i sum_t l_it + beta sum_t k3_it) / divisor_i, k3 against a reference that
    differs from the policy; and a zero-variance group still gets the KL's gradient."""
    model, _ = tiny_model
    params, ref, beta = list(model.parameters()), _perturbed_copy(model), 0.3
    prompt, responses = _group()
    divisors = T.loss_divisors(aggregation, [len(r) for r in responses], MAX_NEW)
    for rewards in ([1.0, 0.0, 1.0, 0.0], [1.0] * 4):
        adv = advantages(torch.tensor(rewards))
        terms = T.LossTerms(divisors, reference=ref, kl_coef=beta)
        done = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext(), 1,
                                            divisors, terms, silent=len(set(rewards)) == 1)
        loss = done.loss
        got = _flat([p.grad.clone() for p in params])
        model.zero_grad(set_to_none=True)
        by_hand, kl_sum = [], 0.0
        for a, r, d in zip(adv, responses, divisors):
            l, q = _token_lps(model, prompt, r), _token_lps(ref, prompt, r).detach()
            k3 = torch.exp(q - l) - (q - l) - 1
            kl_sum += k3.sum().item()
            by_hand.append((-a * l.sum() + beta * k3.sum()) / d)
        ref_loss = torch.stack(by_hand).sum()
        ref_loss.backward()
        want = _flat([p.grad for p in params])
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)
        assert (got - want).norm() <= 1e-5 * want.norm() and want.norm() > 0
        assert done.kl == pytest.approx(kl_sum, rel=1e-5) and kl_sum > 0
        model.zero_grad(set_to_none=True)


def _pass_trainer(model, reference=None, **settings):
    """What backpropagate_group reads of a Trainer, for one process on the CPU."""
    cfg = T.Config(group_size=4, max_new_tokens=MAX_NEW, device="cpu", **settings)
    return SimpleNamespace(cfg=cfg, model=model, params=list(model.parameters()), device=torch.device("cpu"),
                           precision="fp32", reference=reference)


def _backpropagate(prompt, responses, group, adv, t, old=None):
    """backpropagate_group on one slot (old: a later epoch's first-pass token log-probs)."""
    first = None if old is None else T.Pass(0.0, [None] * len(responses), old)
    return T.backpropagate_group(1, T.Slot({"index": 0}, prompt, responses, group, advantages=adv, first=first), t)


def test_the_kl_and_clipped_figures_are_means_over_the_groups_tokens(tiny_model):
    """The kl column is the group's sum of k3 over all its tokens divided by the number of tokens
    (sum_j L_j = 16 here), not by the number of responses (4); the clipped column likewise."""
    model, _ = tiny_model
    prompt, responses = _group()
    lengths = [len(r) for r in responses]
    adv = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    ref = _perturbed_copy(model)
    with torch.no_grad():
        k3 = [torch.exp(q - l) - (q - l) - 1 for q, l in
              ((_token_lps(ref, prompt, r), _token_lps(model, prompt, r)) for r in responses)]
    want = sum(k.sum().item() for k in k3) / 16
    group = T.Group([""] * 4, [T.Score(0.0, None, "wrong")] * 4, lengths, [False] * 4, torch.tensor([1.0, 0.0, 1.0, 0.0]),
                    False)
    t = _pass_trainer(model, ref, kl_coef=0.3)
    measured = T.epoch_figures(1, [_backpropagate(prompt, responses, group, adv, t)], 0.0, 0.0,
                               [SimpleNamespace(group=group)], t.cfg)
    assert measured["kl"] == pytest.approx(want, rel=1e-5) and want > 0
    model.zero_grad(set_to_none=True)
    old_model = _perturbed_copy(model, scale=0.02)  # a first pass a step away: some ratios leave [0.8, 1.2]
    with torch.no_grad():
        old = [_token_lps(old_model, prompt, r) for r in responses]
        rho = [torch.exp(_token_lps(model, prompt, r) - o) for r, o in zip(responses, old)]
    held = sum(int((((p < 0.8) & (a < 0)) | ((p > 1.2) & (a > 0))).sum()) for p, a in zip(rho, adv))
    t = _pass_trainer(model, ppo_epochs=2)
    measured = T.epoch_figures(2, [_backpropagate(prompt, responses, group, adv, t, old)], 0.0, 0.0,
                               [SimpleNamespace(group=group)], t.cfg)
    assert 0 < held < 16 and measured["clipped_fraction"] == held / 16
    model.zero_grad(set_to_none=True)


def test_with_kl_the_first_step_is_the_spec_step_and_the_kl_column_shows_only_then(tmp_path):
    """Step 1's weights are the reference's: k3 = 0 with a zero gradient, so its row and its update
    are the spec's exactly; later steps differ (the KL pulls back) and the table shows a kl column."""
    import default_run

    spec = default_run.default_run(tmp_path / "spec", ["num_problems=1"])
    kl = default_run.default_run(tmp_path / "kl", ["num_problems=1", "kl_coef=0.5"])
    assert kl["table"][0].startswith(spec["table"][0] + "  ")  # the spec's cells, then kl 0
    assert kl["table"][0].split()[-1] == "0.000e+00"
    assert kl["weights"] == spec["weights"]
    header = T.format_header(4, T.table_extras(T.Config(kl_coef=0.5)))
    assert header.endswith("update norm  kl         seconds") and "kl" not in T.format_header(4)
    longer = default_run.default_run(tmp_path / "kl3", ["num_problems=3", "kl_coef=0.5"])
    want = json.loads((FIXTURE / "expected.json").read_text())["steps"]
    assert longer["table"][0].startswith(spec["table"][0])
    # step 2: the policy left the reference, and the KL moves the loss by far more than rounding could
    assert abs(longer["steps"][1]["policy_loss"] - want[1]["policy_loss"]) > 1e-3 * abs(want[1]["policy_loss"])
    kls = [json.loads(l)["kl"] for l in (tmp_path / "kl3" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert kls[0] == 0.0 and all(k > 0 for k in kls[1:])


# ----------------------------------------------------------------------------------------------
# ppo_epochs, clip_eps: the clipped ratio


def test_clipped_objective_worked_numbers():
    old = torch.zeros(3)
    l = torch.log(torch.tensor([1.5, 0.5, 1.0])).requires_grad_(True)
    obj, held = T.clipped_objective(torch.tensor(2.0), l, old, 0.2)
    # A = 2: min(3.0, 2.4) + min(1.0, 1.6) + 2.0 = 5.4; the clip holds the first token (ratio > 1.2, A > 0)
    assert obj.item() == pytest.approx(5.4, abs=1e-6) and held.item() == 1
    obj.backward()
    # d/dl of rho A = rho A where unclipped (1.0 and 2.0), 0 where the clip holds
    assert l.grad.tolist() == pytest.approx([0.0, 1.0, 2.0], abs=1e-6)
    obj, held = T.clipped_objective(torch.tensor(-1.0), l.detach(), old, 0.2)
    # A = -1: min(-1.5, -1.2) + min(-0.5, -0.8) - 1 = -3.3; the clip holds the second (ratio < 0.8, A < 0)
    assert obj.item() == pytest.approx(-3.3, abs=1e-6) and held.item() == 1


def test_a_later_epoch_gives_the_hand_computed_clipped_loss_and_gradient(tiny_model):
    model, _ = tiny_model
    params = list(model.parameters())
    prompt, responses = _group()
    adv = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    divisors = T.loss_divisors("sequence_sum", [len(r) for r in responses], MAX_NEW)
    old_model = _perturbed_copy(model, scale=0.02)  # the first pass's model, a step away
    old = [_token_lps(old_model, prompt, r).detach() for r in responses]
    terms = T.LossTerms(divisors, old=old, clip_low=0.2, clip_high=0.2)
    done = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext(), 1, divisors,
                                        terms)
    loss = done.loss
    got = _flat([p.grad.clone() for p in params])
    model.zero_grad(set_to_none=True)
    by_hand, held = [], 0
    for a, r, o in zip(adv, responses, old):
        rho = torch.exp(_token_lps(model, prompt, r) - o)
        by_hand.append(-torch.minimum(rho * a, rho.clamp(0.8, 1.2) * a).sum() / 4)
        held += int((((rho < 0.8) & (a < 0)) | ((rho > 1.2) & (a > 0))).sum())
    ref = torch.stack(by_hand).sum()
    ref.backward()
    want = _flat([p.grad for p in params])
    assert loss == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    assert (got - want).norm() <= 1e-5 * want.norm() and want.norm() > 0
    assert done.clipped == held and 0 < held < sum(len(r) for r in responses)  # some tokens clipped


def test_ppo_epochs_takes_that_many_steps_per_group_the_first_being_the_spec_step(tmp_path, monkeypatch):
    """Every later epoch's ratio is against the first pass (its log-probs sum to rollouts.jsonl's
    sequence_log_prob), not against the epoch before."""
    import default_run

    olds, real = [], T.clipped_objective
    monkeypatch.setattr(T, "clipped_objective",
                        lambda a, l, old, low, high: olds.append(old.sum().item()) or real(a, l, old, low, high))
    run = default_run.default_run(tmp_path, ["ppo_epochs=3", "clip_eps=0.1", "num_problems=2", "save_every=1"])
    first_pass = [json.loads(l)["sequence_log_prob"]
                  for l in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert olds == pytest.approx([x for step in (first_pass[:4], first_pass[4:]) for x in step * 2], rel=1e-6)
    want = json.loads((ROOT / "tests" / "fixtures" / "default-run" / "expected.json").read_text())
    rows = [r.split() for r in run["table"]]  # default_run drops each row's last cell (seconds; clipped)
    assert len(rows) == 6 and rows[0][:8] == want["table"][0].split() and rows[0][8] == "1"  # the spec's step
    assert [r[0] for r in rows] == ["1", "1", "1", "2", "2", "2"] and [r[4] for r in rows[1:3]] == ["2", "3"]
    metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [[e["epoch"] for e in m["epochs"]] for m in metrics] == [[1, 2, 3]] * 2
    assert all(e["update_norm"] > 0 for m in metrics for e in m["epochs"])
    assert max(e["clipped_fraction"] for m in metrics for e in m["epochs"]) > 0  # lr 1e-3 moves some past 10 %
    optimizer = torch.load(tmp_path / "run" / "checkpoints" / "step-000002" / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {6.0}  # 3 AdamW steps per group


@pytest.fixture(scope="module")
def ppo_run_with_an_undone_epoch(tmp_path_factory):
    """The default run's first 2 steps with ppo_epochs=3 and token_report, a checkpoint after each;
    step 1's second epoch gets a NaN gradient, so optimizer_step undoes it (a non-finite norm).
    Returns the run's folder and the calls of step_or_skip (one per epoch that ran), numbered."""
    import default_run

    folder, calls, real = tmp_path_factory.mktemp("ppo-undone"), [], T.step_or_skip

    def poisoned(advantages, loss, t):
        calls.append(len(calls) + 1)
        if len(calls) == 2:
            next(p for p in t.params if p.grad is not None).grad.view(-1)[0] = float("nan")
        return real(advantages, loss, t)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(T, "step_or_skip", poisoned)
        default_run.default_run(folder, ["ppo_epochs=3", "num_problems=2", "save_every=1", "token_report=true"])
    return folder, calls


def test_an_undone_epoch_ends_its_groups_epochs(ppo_run_with_an_undone_epoch):
    """Step 1: epoch 1 steps, epoch 2 is undone and no epoch 3 follows; step 2 takes its 3 epochs.
    AdamW counts 1 step after step 1 and 1 + 3 = 4 after step 2 (5 calls of step_or_skip)."""
    folder, calls = ppo_run_with_an_undone_epoch
    out = folder / "run"
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [[e["epoch"] for e in m["epochs"]] for m in metrics] == [[1, 2], [1, 2, 3]]
    assert metrics[0]["epochs"][0]["update_norm"] > 0 and metrics[0]["epochs"][1]["update_norm"] is None
    assert [m["skipped"] for m in metrics] == [True, False] and len(calls) == 5
    for step, count in ((1, 1.0), (2, 4.0)):
        optimizer = torch.load(out / "checkpoints" / f"step-{step:06d}" / "optimizer.pt", weights_only=True)
        assert {float(s["step"]) for s in optimizer["state"].values()} == {count}


def test_token_report_before_is_the_first_pass_after_the_last_epoch(ppo_run_with_an_undone_epoch):
    """With ppo_epochs=3, step 2's "before" is its first pass, under the weights step 1 left (the
    step-1 checkpoint), and "after" is under the weights after its third epoch (step 2's), each
    recomputed here by a forward of the saved weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = ppo_run_with_an_undone_epoch
    out = folder / "run"
    records = [json.loads(l) for l in (out / "tokens.jsonl").read_text().splitlines()]
    step2 = [r for r in records if r["step"] == 2]
    assert [r["rollout"] for r in step2] == [0, 1, 2, 3]
    ids = torch.tensor(AutoTokenizer.from_pretrained(folder / "model").encode(
        T.build_prompt(T.SPEC_PROMPT, "What is 1 + 1?")))  # step 2's problem
    for name, key in (("step-000001", "before"), ("step-000002", "after")):
        model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
        missing, unexpected = model.load_state_dict(load_file(out / "checkpoints" / name / "model.safetensors"),
                                                    strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
        for r in step2:
            with torch.no_grad():
                want = T.token_log_probs(model, ids, torch.tensor(r["token_ids"]), T.nullcontext())
            assert r[key] == pytest.approx(want.tolist(), abs=1e-5), (name, r["rollout"])
    assert max(abs(a - b) for r in step2 for a, b in zip(r["after"], r["before"])) > 1e-3


# ----------------------------------------------------------------------------------------------
# zero_variance: resample (DAPO's dynamic sampling)


def test_run_candidates_leave_a_problem_for_every_step_to_come():
    problems = [{"index": i} for i in range(10)]
    cfg = T.Config(zero_variance="resample", resample_limit=3)
    s = SimpleNamespace(problems=problems, steps=4, trains=4, history=[])
    assert [p["index"] for p in T.run_candidates(s, cfg)[0]] == [0, 1, 2] and T.run_candidates(s, cfg)[1] == 1
    s.history = [{"problems_drawn": 3}, {"problems_drawn": 3}]  # 6 drawn, 2 steps to come: 3 spare, limit 3
    assert [p["index"] for p in T.run_candidates(s, cfg)[0]] == [6, 7, 8] and T.run_candidates(s, cfg)[1] == 7
    s.history.append({"problems_drawn": 3})  # 9 drawn, the last step: one left
    assert [p["index"] for p in T.run_candidates(s, cfg)[0]] == [9]
    s.history = [{"step": 1}]  # without resampling every step draws one: step 2's problem, draw 2
    assert T.run_candidates(s, T.Config())[0] == [problems[1]] and T.run_candidates(s, T.Config())[1] == 2


def _scores_by_problem(flat_golds):
    """Rollout 0 right, except for the problems whose answer is in flat_golds: all wrong."""
    def score(scorer, texts, gold):
        return [verdict(i == 0 and gold not in flat_golds) for i in range(len(texts))]
    return score


def test_resample_sets_zero_variance_groups_aside_and_counts_optimizer_steps(tiny_model_dir, tiny_data_file,
                                                                             tmp_path, capsys, monkeypatch):
    """Problems 1, 2 and 5 (answers 2, 4 and 10) have equal rewards: step 2 sets 1 and 2 aside and
    trains on problem 3, step 4 sets 5 aside and trains on 6: 4 optimizer steps, 7 problems drawn.
    Each draw samples from its own streams, keyed by the draw number (problem p is draw p + 1)."""
    monkeypatch.setattr(T, "score_rollouts", _scores_by_problem({"2", "4", "10"}))
    keys, real_streams = [], T.rollout_streams

    def streams(seed, draw, rollouts, device):
        keys.append(draw)
        return real_streams(seed, draw, rollouts, device)
    monkeypatch.setattr(T, "rollout_streams", streams)
    out = tmp_path / "run"
    args = ["--config", str(ROOT / "config.yaml"), f"model={tiny_model_dir}", f"dataset={tiny_data_file}",
            "device=cpu", f"output_dir={out}", "group_size=4", "max_new_tokens=6", "num_problems=4",
            "learning_rate=1e-3", "save_every=1", "keep_last=5", "zero_variance=resample", "resample_limit=3"]
    assert T.main(args) == 0
    stdout = capsys.readouterr().out
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    # step 1: problem 0; step 2: 1, 2 set aside, 3 trained; step 3: 4; step 4: 5 set aside, 6
    assert [m["problem_index"] for m in metrics] == [0, 3, 4, 6]
    assert [m["problems_drawn"] for m in metrics] == [1, 3, 1, 2]
    assert [[g["problem_index"] for g in m["set_aside"]] for m in metrics] == [[], [1, 2], [], [5]]
    # step 2 draws problems 1, 2, 3 (draws 2, 3, 4), step 3 problem 4 (draw 5), step 4 problems 5, 6
    assert keys == [1, 2, 3, 4, 5, 6, 7]
    assert all(m["reward_std"] > 0 for m in metrics)  # every optimizer step had a learning signal
    rollouts = [json.loads(l) for l in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["problem_index"]) for r in rollouts if r.get("set_aside")] == \
        [(2, 1)] * 4 + [(2, 2)] * 4 + [(4, 5)] * 4
    assert len(rollouts) == 4 * 7
    assert "2     0          0.000        0.000000" in stdout and "set aside (problem 1)" in stdout
    assert "problems drawn          7 for 4 optimizer steps; 3 zero-variance groups set aside" in stdout
    state = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["next_record"] == 4  # the data position counts the problems drawn, not the steps
    # 12 problems for num_problems 12 leave none to set aside: each step trains on the one it drew
    out2 = tmp_path / "run2"
    assert T.main([*args, "num_problems=12", f"output_dir={out2}", "save_every=0"]) == 0
    capsys.readouterr()
    metrics = [json.loads(l) for l in (out2 / "metrics.jsonl").read_text().splitlines()]
    assert [m["problem_index"] for m in metrics] == list(range(12))
    assert [m["problems_drawn"] for m in metrics] == [1] * 12


def test_kl_ppo_resample_and_token_report_survive_resume_bit_for_bit(tiny_model_dir, tiny_data_file, tmp_path,
                                                                      capsys, monkeypatch):
    """kl_coef (the reference reloaded), ppo_epochs, resample and token_report together: 2 steps,
    then resumed to 4, give the uninterrupted 4-step run's weights, rollouts and token records."""
    from safetensors.torch import load_file

    monkeypatch.setattr(T, "score_rollouts", _scores_by_problem({"2", "4"}))
    common = ["--config", str(ROOT / "config.yaml"), f"model={tiny_model_dir}", f"dataset={tiny_data_file}",
              "device=cpu", "group_size=4", "max_new_tokens=6", "learning_rate=1e-3", "save_every=1",
              "kl_coef=0.2", "ppo_epochs=2", "zero_variance=resample", "resample_limit=2", "token_report=true"]
    assert T.main([*common, f"output_dir={tmp_path / 'straight'}", "num_problems=4"]) == 0
    assert T.main([*common, f"output_dir={tmp_path / 'split'}", "num_problems=2"]) == 0
    assert T.main([*common, f"output_dir={tmp_path / 'split'}", "num_problems=4", "resume=auto"]) == 0
    capsys.readouterr()
    a, b = load_file(tmp_path / "straight" / "final" / "model.safetensors"), \
        load_file(tmp_path / "split" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("rollouts.jsonl", "tokens.jsonl"):
        assert (tmp_path / "straight" / name).read_text() == (tmp_path / "split" / name).read_text()
    for changed in ("kl_coef=0.3", "ppo_epochs=3", "clip_eps=0.3", "zero_variance=step", "resample_limit=3",
                    "token_report=false"):
        assert T.main([*common, f"output_dir={tmp_path / 'split'}", "num_problems=5", "resume=auto", changed]) == 2
        err = capsys.readouterr().err
        assert "cannot resume" in err and changed.split("=")[0] in err


# ----------------------------------------------------------------------------------------------
# token_report


def test_token_report_records_each_tokens_change_and_changes_nothing_else(tmp_path):
    """tokens.jsonl: for the steps with reward variance, every response token's log-probability
    before the step (its sum is rollouts.jsonl's sequence_log_prob) and after it (a forward of the
    weights after the step); the table, rollouts and weights are the spec's run's."""
    import default_run
    from transformers import AutoModelForCausalLM

    got = default_run.default_run(tmp_path, ["token_report=true"])
    assert _against_the_fixture(got, tmp_path) == []
    out = tmp_path / "run"
    records = [json.loads(l) for l in (out / "tokens.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records}) == [1, 2, 4, 6]  # not the zero-variance steps 3 and 5
    rollouts = {(r["step"], r["rollout"]): r
                for r in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines())}
    for r in records:
        assert sum(r["before"]) == pytest.approx(rollouts[(r["step"], r["rollout"])]["sequence_log_prob"], rel=1e-6)
        assert len(r["before"]) == len(r["after"]) == len(r["token_ids"]) == \
            rollouts[(r["step"], r["rollout"])]["tokens"]
    final = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    prompt = T.build_prompt(T.SPEC_PROMPT, "What is 5 + 5?")
    from transformers import AutoTokenizer

    ids = torch.tensor(AutoTokenizer.from_pretrained(out / "final").encode(prompt))
    last = [r for r in records if r["step"] == 6]
    with torch.no_grad():
        after = T.token_log_probs(final, ids, torch.tensor(last[0]["token_ids"]), T.nullcontext())
    assert after.tolist() == pytest.approx(last[0]["after"], abs=1e-5)
    assert any(abs(a - b) > 1e-3 for a, b in zip(last[0]["after"], last[0]["before"]))
    assert (out / "tokens.png").stat().st_size > 10_000


def _token_record(step, tokens, changes, reward=1.0, rollout=0):
    return dict(step=step, problem_index=3, rollout=rollout, reward=reward, advantage=0.5,
                token_ids=list(range(len(tokens))), tokens=tokens, before=[-2.0] * len(tokens),
                after=[-2.0 + c for c in changes])


def _token_cells(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # lays it out: the extents are the PNG's, in pixels
    return [t for ax in fig.axes for t in ax.texts if t.get_bbox_patch() is not None]


def _contrast(a, b):
    """WCAG contrast ratio of two colours."""
    from matplotlib.colors import to_rgb

    def lum(c):
        return sum(w * (v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4)
                   for w, v in zip((0.2126, 0.7152, 0.0722), to_rgb(c)))
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_tokens_png_text_is_readable_on_every_cell_and_nothing_overlaps():
    pytest.importorskip("matplotlib", reason="requirements-test.txt installs matplotlib")
    tokens = [" The", " answer", " is", " $48213$", ".", " So", " \\boxed{48213}", "\n"] * 12 + ["<|im_end|>"]
    changes = [(k % 9 - 4) / 4 for k in range(len(tokens))]  # -1 .. 1: both ends of the colour map, and white
    cells = _token_cells(T.token_figure([_token_record(2, tokens, changes)]))
    assert [t.get_text() for t in cells] == [p.replace("\n", "\u23ce") for p in tokens]
    for t in cells:
        assert _contrast(t.get_color(), t.get_bbox_patch().get_facecolor()) >= 4.5, (t.get_text(), t.get_color())
    darkest = max(cells, key=lambda t: _contrast(t.get_bbox_patch().get_facecolor(), "white"))
    assert _contrast(darkest.get_color(), "white") == 1  # light text on the darkest cell
    rows, px = {}, cells[0].get_window_extent().width / len(cells[0].get_text())
    for t in cells:  # each token in its own place: its text as wide as its characters, none over its neighbour
        rows.setdefault(t.get_position()[1], []).append(t)
        assert abs(t.get_window_extent().width - len(t.get_text()) * px) <= 1, t.get_text()  # "$48213$" not math
    assert len(rows) > 3
    for row in rows.values():
        boxes = [t.get_window_extent() for t in row]
        for a, b in zip(boxes, boxes[1:]):
            assert a.x1 <= b.x0 + 1
        fig_box = row[0].figure.bbox
        assert fig_box.x0 <= boxes[0].x0 and boxes[-1].x1 <= fig_box.x1


def test_tokens_png_counts_in_words_and_is_as_big_as_its_text():
    pytest.importorskip("matplotlib", reason="requirements-test.txt installs matplotlib")
    one = T.token_figure([_token_record(1, [" \\boxed{7}"], [0.3])])  # a tick label at each end of the bar
    title = one.axes[0].get_title(loc="left")
    assert "\\boxed{}: +0.3000 (1 token); elsewhere: none" in title and "1 tokens" not in title
    two = T.token_figure([_token_record(1, [" \\boxed{7}", "<|im_end|>", " so"], [0.25, 0.5, -0.5])])
    assert "\\boxed{}: +0.2500 (1 token); elsewhere: +0.0000 (2 tokens)" in two.axes[0].get_title(loc="left")
    w1, h1 = one.get_size_inches()
    assert w1 < 8 and h1 < 2.5  # one short row: no wide empty page
    heights = []
    for rows in (1, 2, 4, 8):
        fig = T.token_figure([_token_record(1, ["x" * 95 + "."] * rows, [0.1] * rows)])  # one token a row
        assert len({t.get_position()[1] for t in _token_cells(fig)}) == rows
        heights.append(fig.get_size_inches()[1])
    grows = [b - a for a, b in zip(heights, heights[1:])]
    assert grows[0] > 0 and grows[1] == pytest.approx(2 * grows[0]) and grows[2] == pytest.approx(4 * grows[0])
    for fig in (one, two):  # the title, the text and the colour bar inside the figure
        _token_cells(fig)
        for ax in fig.axes:
            box = ax.get_tightbbox()
            assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1


def test_the_variants_figures_reach_the_trackers_under_trls_names():
    m = dict(step=3, group_size=4, correct=1, reward_mean=0.25, reward_std=0.5, response_tokens=20, cut_at_limit=0,
             no_answer=0, policy_loss=-0.5, grad_norm=2.0, update_norm=0.1, skipped=False, seconds=1.0,
             timings={"generation": 0.5}, kl=0.003, clipped_fraction=0.0, problems_drawn=2,
             epochs=[dict(epoch=1, clipped_fraction=0.0), dict(epoch=2, clipped_fraction=0.125)])
    scalars = T.step_scalars(m, [m])
    assert (scalars["kl"], scalars["clip_ratio/region_mean"], scalars["problems_drawn"]) == (0.003, 0.125, 2)
    plain = {k: v for k, v in m.items() if k not in ("kl", "clipped_fraction", "problems_drawn", "epochs")}
    assert not {"kl", "clip_ratio/region_mean", "problems_drawn"} & set(T.step_scalars(plain, [plain]))


# ----------------------------------------------------------------------------------------------
# clip_eps_high (DAPO's clip-higher), mask_truncated_completions (TRL's)


def test_clip_higher_worked_numbers():
    old = torch.zeros(3)
    l = torch.log(torch.tensor([1.25, 0.7, 1.1])).requires_grad_(True)
    # A = 1, range [0.8, 1.28]: 1.25 is inside, so min(1.25, 1.25) + min(0.7, 0.8) + min(1.1, 1.1) = 3.05;
    # nothing held (0.7 < 0.8 is on the side A > 0 does not push to)
    obj, held = T.clipped_objective(torch.tensor(1.0), l, old, 0.2, 0.28)
    assert obj.item() == pytest.approx(3.05, abs=1e-6) and held.item() == 0
    obj.backward()
    # d/dl of rho A = rho A for every token: 1.25, 0.7, 1.1
    assert l.grad.tolist() == pytest.approx([1.25, 0.7, 1.1], abs=1e-6)
    l.grad = None
    # the symmetric clip [0.8, 1.2] (clip_eps_high's default 0 means clip_eps): 1.25 clipped to 1.2,
    # 1.2 + 0.7 + 1.1 = 3.0, the first token held (ratio > 1.2, A > 0): gradient 0 there
    obj, held = T.clipped_objective(torch.tensor(1.0), l, old, 0.2)
    assert obj.item() == pytest.approx(3.0, abs=1e-6) and held.item() == 1
    obj.backward()
    assert l.grad.tolist() == pytest.approx([0.0, 0.7, 1.1], abs=1e-6)
    # the low side stays clip_eps whatever eps_high is: A = -1, min(-1.25, -1.25) + min(-0.7, -0.8)
    # + min(-1.1, -1.1) = -3.15, the second token held (ratio 0.7 < 0.8, A < 0)
    obj, held = T.clipped_objective(torch.tensor(-1.0), l.detach(), old, 0.2, 0.28)
    assert obj.item() == pytest.approx(-3.15, abs=1e-6) and held.item() == 1
    # above 1 + eps_high the clip holds again: ratio 1.5, A = 2, eps_high 0.28: min(3.0, 2.56) = 2.56
    obj, held = T.clipped_objective(torch.tensor(2.0), torch.log(torch.tensor([1.5])), torch.zeros(1), 0.2, 0.28)
    assert obj.item() == pytest.approx(2.56, abs=1e-6) and held.item() == 1


def _group_of(tokens, cut):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    return T.Group(["x"] * 4, [T.Score(1.0, "1", "correct")] * 4, tokens, cut, rewards, T.equal_rewards(rewards))


def test_loss_terms_carry_the_settings_clip_range_and_mask(tiny_model):
    model, _ = tiny_model
    group = _group_of([3, 6, 2, 4], [False, True, False, False])
    # the defaults: the symmetric clip, no mask, every response's tokens counted (token_mean: 3 + 6 + 2 + 4)
    terms = T.loss_terms(_pass_trainer(model, ppo_epochs=2), group, None, range(4))
    assert (terms.clip_low, terms.clip_high, terms.masked, terms.divisors) == (0.2, 0.2, None, [4, 4, 4, 4])
    terms = T.loss_terms(_pass_trainer(model, loss_aggregation="token_mean"), group, None, range(4))
    assert (terms.masked, terms.divisors) == (None, [15, 15, 15, 15])
    t = _pass_trainer(model, ppo_epochs=2, clip_eps=0.1, clip_eps_high=0.28, mask_truncated_completions=True,
                      loss_aggregation="token_mean")
    terms = T.loss_terms(t, group, None, range(4))
    # token_mean over the responses left: 3 + 2 + 4 = 9 tokens, not 15
    assert (terms.clip_low, terms.clip_high, terms.masked, terms.divisors) == (
        0.1, 0.28, [False, True, False, False], [9, 9, 9, 9])
    assert T.loss_terms(t, group, None, range(2, 4)).masked == [False, False]  # this rank's share
    # the other aggregations keep their divisors: sequence_sum's G = 4 counts responses, not tokens
    t = _pass_trainer(model, mask_truncated_completions=True)
    assert T.loss_terms(t, group, None, range(4)).divisors == [4, 4, 4, 4]
    # nothing cut: nothing masked
    assert T.loss_terms(t, _group_of([3, 6, 2, 4], [False] * 4), None, range(4)).masked is None


@pytest.mark.parametrize("batch", [1, 3])
def test_mask_truncated_completions_drops_the_cut_responses_terms(tiny_model, batch):
    """Response 1 is cut at the limit: with the mask the loss is -(A_0 s_0 + A_2 s_2 + A_3 s_3) / 4 and
    the gradient that of those three terms alone; its sequence log-prob is still measured. batch 3
    puts the masked response in one forward with two kept ones."""
    model, _ = tiny_model
    params = list(model.parameters())
    prompt, responses = _group()
    adv = advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]))  # A = 0.866, 0.866, -0.866, -0.866
    terms = T.LossTerms([4] * 4, masked=[False, True, False, False])
    done = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext(), batch, terms=terms)
    got = _flat([p.grad.clone() for p in params])
    model.zero_grad(set_to_none=True)
    s = [_token_lps(model, prompt, r).sum() for r in responses]
    want_loss = -sum(adv[i] * s[i] for i in (0, 2, 3)) / 4
    want_loss.backward()
    want = _flat([p.grad for p in params])
    assert done.loss == pytest.approx(want_loss.item(), rel=1e-5, abs=1e-6)
    assert done.seq_log_probs == pytest.approx([x.item() for x in s], rel=1e-5)
    assert (got - want).norm() <= 1e-5 * want.norm() and want.norm() > 0
    model.zero_grad(set_to_none=True)
    unmasked = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext(), batch)
    # response 1's term -A_1 s_1 / 4 is what the mask took out (A_1 > 0, s_1 < 0: far from rounding)
    assert unmasked.loss - done.loss == pytest.approx(-(adv[1] * s[1]).item() / 4, rel=1e-5)
    assert abs(adv[1] * s[1]).item() / 4 > 1
    model.zero_grad(set_to_none=True)


def test_a_masked_response_adds_no_kl_and_the_kl_figure_counts_kept_tokens(tiny_model):
    """kl_coef 0.3, token_mean, response 1 (7 tokens) and response 3 (5) cut: the loss is
    sum over i in {0, 2} of (-A_i sum_t l_it + 0.3 sum_t k3_it) / 4 (3 + 1 tokens kept), the Pass's KL
    the kept responses' k3 alone, and the table's kl that sum over those 4 tokens."""
    model, _ = tiny_model
    params, ref, beta = list(model.parameters()), _perturbed_copy(model), 0.3
    prompt, responses = _group()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = advantages(rewards)
    group = T.Group([""] * 4, [T.Score(0.0, None, "wrong")] * 4, list(LENGTHS), [False, True, False, True], rewards, False)
    t = _pass_trainer(model, ref, kl_coef=beta, loss_aggregation="token_mean", mask_truncated_completions=True)
    done = _backpropagate(prompt, responses, group, adv, t)
    figures = T.epoch_figures(1, [done], 0.0, 0.0, [SimpleNamespace(group=group)], t.cfg)
    got = _flat([p.grad.clone() for p in params])
    model.zero_grad(set_to_none=True)
    by_hand, kl_sum = [], 0.0
    for i in (0, 2):
        l, q = _token_lps(model, prompt, responses[i]), _token_lps(ref, prompt, responses[i]).detach()
        k3 = torch.exp(q - l) - (q - l) - 1
        kl_sum += k3.sum().item()
        by_hand.append((-adv[i] * l.sum() + beta * k3.sum()) / 4)
    want_loss = torch.stack(by_hand).sum()
    want_loss.backward()
    want = _flat([p.grad for p in params])
    assert done.loss == pytest.approx(want_loss.item(), rel=1e-5, abs=1e-6)
    assert (got - want).norm() <= 1e-5 * want.norm() and want.norm() > 0
    assert done.kl == pytest.approx(kl_sum, rel=1e-5) and kl_sum > 0
    assert figures["kl"] == pytest.approx(kl_sum / 4, rel=1e-5)
    model.zero_grad(set_to_none=True)


def test_mask_truncated_completions_reaches_the_runs_loss(tmp_path):
    """The default run's step 1 (tests/fixtures/default-run): rollouts 0, 2, 3 are cut at 6 tokens,
    rollout 1 ends with EOS. With the mask the step's loss is rollout 1's term alone, -A_1 s_1 / 4
    (sequence_sum's G = 4 stays), with s_1 the sequence log-prob rollouts.jsonl records."""
    import default_run

    default_run.default_run(tmp_path, ["mask_truncated_completions=true", "num_problems=1"])
    rollouts = [json.loads(l) for l in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [r["cut_at_limit"] for r in rollouts] == [True, False, True, True]
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    a, s = rollouts[1]["advantage"], rollouts[1]["sequence_log_prob"]
    assert metrics["policy_loss"] == pytest.approx(-a * s / 4, rel=1e-5) and abs(a * s) > 1e-3


def test_a_group_with_variance_whose_every_response_is_masked_is_said_once_a_run(tiny_model_dir, tiny_data_file,
                                                                                  tmp_path, capsys, monkeypatch):
    """max_new_tokens 1: every response is cut; rollout 0 always wins, so every group has reward variance
    and the mask leaves nothing to train: a zero gradient, and one warning line for the run."""
    from run_helpers import first_rollout_wins, run_args

    first_rollout_wins(monkeypatch)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, tmp_path / "run", "mask_truncated_completions=true",
                           "max_new_tokens=1", "save_every=0")) == 0
    metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["cut_at_limit"], m["reward_std"] > 0, m["grad_norm"]) for m in metrics] == [(4, True, 0.0)] * 3
    warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning: step")]
    assert warnings == ["warning: step 1: every response of a group with reward variance was cut at max_new_tokens "
                        "(1) and mask_truncated_completions leaves each out of the loss, so it trains nothing (said "
                        "once a run; raise max_new_tokens or set mask_truncated_completions: false)"]


def test_the_new_settings_at_their_defaults_change_nothing(tmp_path):
    """clip_eps_high equal to clip_eps is the default's symmetric clip; under ppo_epochs=2 (where the
    clip acts) both runs give the same table and weights bit for bit; so does mask_truncated_completions
    written out as false."""
    import default_run

    plain = default_run.default_run(tmp_path / "plain", ["num_problems=1", "ppo_epochs=2"])
    same = default_run.default_run(tmp_path / "same", ["num_problems=1", "ppo_epochs=2", "clip_eps_high=0.2",
                                                       "mask_truncated_completions=false"])
    assert len(plain["table"]) == 2 and same["table"] == plain["table"]
    assert same["weights"] == plain["weights"] and same["rollouts"] == plain["rollouts"]


@pytest.mark.parametrize("arg, fragment", [
    ("clip_eps_high=-1", "config key 'clip_eps_high' must be 0 (equal to clip_eps) or a number in (0, 10] "
                         "(DAPO: 0.28), got -1.0"),
    ("mask_truncated_completions=maybe", "config key 'mask_truncated_completions' must be bool, got 'maybe'"),
])
def test_bad_clip_higher_and_mask_settings_are_one_line_and_exit_2(tiny_model_dir, tiny_data_file, tmp_path, capsys,
                                                                  arg, fragment):
    code = T.main(["--config", str(ROOT / "config.yaml"), f"model={tiny_model_dir}", f"dataset={tiny_data_file}",
                   "device=cpu", f"output_dir={tmp_path / 'run'}", arg])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_kl_and_clipped_figures_count_only_the_tokens_the_loss_keeps():
    """epoch_figures: with mask_truncated_completions the per-token means divide by the kept
    responses' tokens (4 + 5 = 9 here), as the loss does; without it by all 14."""
    group = T.Group([""] * 4, [T.Score(0.0, None, "wrong")] * 4, [4, 2, 5, 3], [False, True, False, True],
                    torch.tensor([1.0, 0.0, 1.0, 0.0]), False)
    done = T.Pass(loss=0.5, seq_log_probs=[0.0] * 4, kl=1.8, clipped=3.0)
    for mask, tokens in ((True, 9), (False, 14)):
        cfg = T.Config(group_size=4, kl_coef=0.1, ppo_epochs=2, mask_truncated_completions=mask)
        figures = T.epoch_figures(2, [done], 1.0, 0.1, [SimpleNamespace(group=group)], cfg)
        assert figures["kl"] == 1.8 / tokens and figures["clipped_fraction"] == 3.0 / tokens
        assert (figures["epoch"], figures["policy_loss"], figures["grad_norm"], figures["update_norm"]) == (2, 0.5, 1.0, 0.1)
