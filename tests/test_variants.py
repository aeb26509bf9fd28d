"""The variants of the spec's step (docs/variants.md), each against a hand computation on a tiny
model; the spec's own formula is checked the same way, since it stays the default."""

import json
from types import SimpleNamespace

import pytest
import torch
import yaml

import train_rlvr as T
from conftest import ROOT

# ----------------------------------------------------------------------------------------------
# advantage_std


def test_advantage_std_none_is_reward_minus_mean_and_group_is_the_spec():
    r = torch.tensor([1.5, 0.5, 0.5, 0.0])  # mean 0.625, sample std sqrt(1.1875 / 3)
    assert T.compute_advantages(r, 1e-4, "none").tolist() == [0.875, -0.125, -0.125, -0.625]
    std = (1.1875 / 3) ** 0.5
    assert T.compute_advantages(r, 1e-4, "group").tolist() == pytest.approx(
        [0.875 / (std + 1e-4), -0.125 / (std + 1e-4), -0.125 / (std + 1e-4), -0.625 / (std + 1e-4)], rel=1e-6)
    assert torch.equal(T.compute_advantages(r, 1e-4), T.compute_advantages(r, 1e-4, "group"))


@pytest.mark.parametrize("mode", ["group", "none"])
def test_equal_rewards_that_float32_cannot_average_exactly_give_zero_advantages(mode):
    r = torch.full((8,), 0.1)  # 8 x 0.1 has a float32 mean that is not 0.1 exactly
    assert torch.equal(T.compute_advantages(r, 1e-4, mode), torch.zeros(8))


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
    adv = T.compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 1e-4)
    divisors = T.loss_divisors(aggregation, [len(r) for r in responses], MAX_NEW)
    loss, _ = T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext(), batch, divisors)
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
    adv = T.compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 1e-4)
    divisors = T.loss_divisors(aggregation, [len(r) for r in responses], MAX_NEW)
    T.accumulate_policy_gradient(model, params, prompt, responses, adv, 4, T.nullcontext(), 1, divisors)
    grad_norm, _ = T.optimizer_step(params, opt, max_grad_norm)
    return grad_norm, [p.grad.clone() for p in params], [p.detach().clone() for p in params]


def test_token_mean_and_dr_grpo_take_the_spec_step_when_the_clip_is_active_for_both(tiny_model_dir):
    """Grad norms here: spec 8.14, token_mean 8.14/4, dr_grpo 8.14/8 (factors G/sum L = 4/16 and
    1/max_new_tokens = 1/8). Clip 0.5 is active for all three: the same clipped gradient, the same step."""
    spec_norm, spec_grad, spec_weights = _clipped_step(tiny_model_dir, "sequence_sum", 0.5)
    assert spec_norm == pytest.approx(8.138, abs=1e-3)
    for aggregation, factor in (("token_mean", 4 / 16), ("dr_grpo", 4 / 32)):
        norm, grad, weights = _clipped_step(tiny_model_dir, aggregation, 0.5)
        assert norm == pytest.approx(spec_norm * factor, rel=1e-5) and norm > 0.5  # clipped in both
        assert (_flat(grad) - _flat(spec_grad)).norm() <= 1e-5 * 0.5
        assert (_flat(weights) - _flat(spec_weights)).abs().max() <= 1e-6
    # clip 2.0: active for the spec (8.14) and token_mean (2.03), not for dr_grpo (1.02): only
    # token_mean keeps the spec's step; dr_grpo's gradient is the spec's clipped one times 1.02 / 2
    _, spec_grad, _ = _clipped_step(tiny_model_dir, "sequence_sum", 2.0)
    _, grad, _ = _clipped_step(tiny_model_dir, "token_mean", 2.0)
    assert (_flat(grad) - _flat(spec_grad)).norm() <= 1e-5 * 2.0
    dr_norm, grad, _ = _clipped_step(tiny_model_dir, "dr_grpo", 2.0)
    assert (_flat(grad) - _flat(spec_grad) * dr_norm / 2.0).norm() <= 1e-5 * 2.0 and dr_norm < 2.0
    # sequence_mean weighs each response by 1/L_i: another direction, clipped or not
    _, grad, _ = _clipped_step(tiny_model_dir, "sequence_mean", 0.5)
    assert torch.nn.functional.cosine_similarity(_flat(grad), _flat(spec_grad), dim=0) < 0.99


# ----------------------------------------------------------------------------------------------
# zero_variance


def _trainer(model, zero_variance):
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    cfg = SimpleNamespace(zero_variance=zero_variance, max_grad_norm=1.0)
    return SimpleNamespace(cfg=cfg, params=params, optimizer=opt, weights_before=None, state_before={})


@pytest.mark.parametrize("mode", ["step", "skip"])
def test_zero_variance_skip_leaves_weights_and_adamw_untouched_step_moves_them(tiny_model, mode):
    model, _ = tiny_model
    t = _trainer(model, mode)
    prompt, responses = _group()
    adv = T.compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 1e-4)
    T.accumulate_policy_gradient(model, t.params, prompt, responses, adv, 4, T.nullcontext())
    assert T.step_or_skip(adv, 0.0, t)[1] > 0  # a group with variance steps in both modes
    weights = [p.detach().clone() for p in t.params]
    state = {k: v.clone() for k, v in t.optimizer.state[t.params[0]].items()}
    zero = T.compute_advantages(torch.ones(4), 1e-4)
    T.accumulate_policy_gradient(model, t.params, prompt, responses, zero, 4, T.nullcontext())
    grad_norm, moved = T.step_or_skip(zero, 0.0, t)
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


def test_format_reward_enters_the_rewards_but_not_the_correct_count(tiny_model):
    _, tokenizer = tiny_model
    scores = {"a": (1.0, "2", "correct"), "b": (0.0, "3", "wrong"), "c": (0.0, None, "no_answer"),
              "d": (0.0, "5", "wrong")}
    scorer = SimpleNamespace(score=lambda text, gold: scores[text])
    cfg = T.Config(group_size=4, format_reward=0.5)
    t = SimpleNamespace(tokenizer=tokenizer, scorer=scorer, cfg=cfg)
    responses = [torch.tensor(tokenizer.encode(x)) for x in "abcd"]
    group = T.score_group(1, responses, [False, False, False, True], "2", t)  # d was cut at the limit
    assert group.rewards.tolist() == [1.5, 0.5, 0.0, 0.0]
    adv = T.compute_advantages(group.rewards, cfg.std_eps)
    metrics, rollouts = T.step_report(1, {"index": 0}, cfg, group, adv, [None] * 4, [ONE_EPOCH],
                                      T.Stopwatch(torch.device("cpu")))
    assert metrics["correct"] == 1 and metrics["reward_mean"] == 0.5
    assert [r["reward"] for r in rollouts] == [1.5, 0.5, 0.0, 0.0]
    # eight formatted wrong answers at w = 0.1: equal rewards whose float32 std is 8e-9, not 0
    scores = {x: (0.0, "3", "wrong") for x in "abcdefgh"}
    cfg = T.Config(group_size=8, format_reward=0.1)
    t = SimpleNamespace(tokenizer=tokenizer, scorer=scorer, cfg=cfg)
    group = T.score_group(2, [torch.tensor(tokenizer.encode(x)) for x in "abcdefgh"], [False] * 8, "2", t)
    adv = T.compute_advantages(group.rewards, cfg.std_eps)
    metrics, _ = T.step_report(2, {"index": 1}, cfg, group, adv, [None] * 8, [ONE_EPOCH],
                               T.Stopwatch(torch.device("cpu")))
    assert group.rewards.std().item() > 0 and not adv.any() and metrics["reward_std"] == 0.0  # a zero-variance group


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

def test_the_default_run_is_the_spec_run_bit_for_bit(tmp_path):
    """Every setting at its default: the table, rollouts.jsonl and the final weights equal what main
    gave before the variants of issue 21's second half (tests/fixtures/default-run, its README)."""
    import default_run

    want = json.loads((ROOT / "tests" / "fixtures" / "default-run" / "expected.json").read_text())
    got = default_run.default_run(tmp_path)
    assert got["table"] == want["table"]
    assert got["rollouts_sha256"] == want["rollouts_sha256"]
    assert got["weights"] == want["weights"]
