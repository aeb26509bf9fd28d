"""docs/spec.md, the project's statement of what a run computes, keeps its figures true: the setup
table against Config's defaults, the worked numbers against compute_advantages, the table rows
against format_header/format_row, the totals against format_summary, and, where the original
../shared/SPEC.md sits beside this checkout, the reference figures against that text."""

import inspect
import re

import pytest
import torch

import train_rlvr as T
from conftest import ROOT, SHARED

PAGE = ROOT / "docs" / "spec.md"
SPEC = SHARED / "SPEC.md"
SPEC_COLUMNS = 7  # the spec's table: step ... grad norm; the trainer adds update norm and seconds


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def words() -> str:
    """The page's text with every run of whitespace (line breaks too) as one space: phrases across a wrap."""
    return " ".join(page().split())


def block_after(marker: str) -> str:
    """The first fenced code block after the first occurrence of marker on the page (without its fences)."""
    text = page()
    assert marker in text, f"docs/spec.md: {marker!r} not found"
    m = re.search(r"^```[^\n]*\n(.*?)^```", text.split(marker, 1)[1], re.S | re.M)
    assert m, f"docs/spec.md: no code block after {marker!r}"
    return m[1]


def assignments(block: str) -> dict[str, str]:
    """name = value lines of a code block, comments dropped."""
    return {m[1]: m[2].strip() for m in re.finditer(r"^(\w+)\s*=\s*(.*?)\s*(?:#.*)?$", block, re.M)}


def setup_table() -> dict[str, str]:
    """config key -> value cell of the setup table (the rows that name a key)."""
    rows = {}
    for line in page().split("| setting | value | `config.yaml` key |", 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        assert len(cells) == 3, f"docs/spec.md setup table: row {line!r} should have 3 cells"
        key = re.fullmatch(r"`(\w+)`", cells[2])
        if key:
            rows[key[1]] = cells[1]
    return rows


def first_code(cell: str) -> str:
    m = re.match(r"`([^`]*)`", cell)
    assert m, f"docs/spec.md setup table: value {cell!r} should start with the value in backticks"
    return m[1]


def spec_rows() -> list[str]:
    lines = block_after("## The step table").splitlines()
    assert len(lines) == 3, f"docs/spec.md: the step table block should be a header and two rows, got {lines}"
    return lines


def seven_columns(line: str) -> str:
    """A trainer table line cut to the spec's seven columns."""
    return line[:sum(width for _, width in T.COLUMNS[:SPEC_COLUMNS])].rstrip()


REFERENCE = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])  # step 2 of the reference run


# ----------------------------------------------------------------------------------------------
# The setup


def test_the_setup_table_holds_configs_defaults():
    rows, cfg = setup_table(), T.Config()
    text_keys = ("model", "revision", "eos_token")
    number_keys = ("num_problems", "start_index", "group_size", "temperature", "top_p", "max_new_tokens",
                   "learning_rate", "weight_decay", "max_grad_norm", "std_eps")
    missing = [k for k in text_keys + number_keys + ("dataset", "prompt_template") if k not in rows]
    assert not missing, f"docs/spec.md setup table: no row names the key(s) {missing}"
    for key in text_keys:
        assert first_code(rows[key]) == getattr(cfg, key), f"docs/spec.md: {key}"
    for key in number_keys:
        value = getattr(cfg, key)
        assert float(first_code(rows[key])) == value and type(value)(first_code(rows[key])) == value, \
            f"docs/spec.md: {key} is {first_code(rows[key])}, Config says {value}"
    assert "12,000" in rows["dataset"] and cfg.dataset.endswith("math_full_minus_math500.json")
    assert "151643" in rows["eos_token"] and f"the {cfg.max_new_tokens}-token limit" in rows["eos_token"]


def test_weight_decay_is_adamws_pytorch_default():
    default = inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default
    assert T.Config().weight_decay == default == float(first_code(setup_table()["weight_decay"]))
    assert "AdamW's PyTorch default" in setup_table()["weight_decay"]


def test_the_prompt_block_is_the_prompt_template():
    assert block_after("The prompt, ") == T.Config().prompt_template + "\n"
    assert T.Config().prompt_template == T.SPEC_PROMPT


def test_updates_and_rollouts_follow_from_the_setup():
    cfg = T.Config()
    updates = re.search(r"(\d+) updates from (\d+) rollouts", page())
    assert updates and (int(updates[1]), int(updates[2])) == (cfg.num_problems, cfg.num_problems * cfg.group_size)


# ----------------------------------------------------------------------------------------------
# The worked numbers


def test_the_worked_example_is_what_compute_advantages_gives():
    given = assignments(block_after("## Worked example"))
    assert [float(x) for x in re.findall(r"[-\d.]+", given["rewards"])] == REFERENCE.tolist()
    adv = T.compute_advantages(REFERENCE, T.Config().std_eps, zero_variance=T.equal_rewards(REFERENCE))
    assert adv.dtype == torch.float32
    assert given["reward_mean"] == f"{REFERENCE.mean().item():.3f}" == "0.125"
    assert given["reward_std"] == f"{REFERENCE.std(unbiased=True).item():.6f}" == "0.353553"
    assert given["advantage_right"] == f"{adv[0].item():.4f}" == "2.4742"
    assert {f"{a:.4f}" for a in adv[1:].tolist()} == {given["advantage_wrong"]} == {"-0.3535"}
    assert given["sum_advantages"] == "0" and abs(adv.sum().item()) < 1e-6


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_equal_rewards_give_advantages_of_exactly_zero(value):
    rewards = torch.full((8,), value)
    given = assignments(block_after("If all 8 rewards are equal"))
    assert given["advantages"] == "[0, 0, 0, 0, 0, 0, 0, 0]"
    assert T.equal_rewards(rewards)
    adv = T.compute_advantages(rewards, T.Config().std_eps, zero_variance=T.equal_rewards(rewards))
    assert torch.equal(adv, torch.zeros(8))
    # the formula itself, without the flag: the numerator is 0, the 1e-4 only keeps the division defined
    assert torch.equal(T.compute_advantages(rewards, T.Config().std_eps, zero_variance=False), torch.zeros(8))
    # so every response's term, and with it the gradient, is exactly 0
    seq_lp = torch.tensor(-37.5, requires_grad=True)
    T.policy_loss(adv[0], seq_lp, 8).backward()
    assert seq_lp.grad.item() == 0.0


# ----------------------------------------------------------------------------------------------
# The step table and the totals


def test_the_table_rows_are_the_trainers_cut_to_seven_columns():
    header, row1, row2 = spec_rows()
    assert header == seven_columns(T.format_header(T.Config().group_size))
    assert T.format_header(8)[len(header):].split("  ")[1:] == ["update norm", "seconds"]
    common = dict(update_norm=0.0123, seconds=8.0)
    m1 = dict(step=1, correct=0, reward_mean=0.0, reward_std=0.0, response_tokens=1554, policy_loss=-0.0,
              grad_norm=0.0, **common)
    m2 = dict(step=2, correct=int(REFERENCE.sum()), reward_mean=REFERENCE.mean().item(),
              reward_std=REFERENCE.std(unbiased=True).item(), response_tokens=564, policy_loss=-3.0424821,
              grad_norm=256.81549, **common)
    assert row1 == seven_columns(T.format_row(m1))
    assert row2 == seven_columns(T.format_row(m2))
    assert "`update norm`" in words() and "`seconds`" in words()


def test_the_tokens_per_rollout_of_step_1():
    tokens = int(spec_rows()[1].split()[4])
    assert f"step 1: {tokens:,} tokens, {tokens / T.Config().group_size} per rollout" in words()


def reference_totals() -> tuple[int, int, str, int, int, list[int]]:
    m = re.search(r"(\d+) of (\d+) rollouts were correct \(mean reward ([\d.]+)\)\. (\d+) of (\d+) groups had "
                  r"zero reward variance, and only steps ([\d, and]+) had a non-zero gradient", words())
    assert m, "docs/spec.md: the reference run's totals are not where the test reads them"
    steps = [int(s) for s in re.findall(r"\d+", m[6])]
    return int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5]), steps


def test_the_totals_agree_with_each_other_and_with_the_setup():
    correct, rollouts, mean, flat, groups, steps = reference_totals()
    cfg = T.Config()
    assert (groups, rollouts) == (cfg.num_problems, cfg.num_problems * cfg.group_size)
    assert f"{correct / rollouts:.4f}" == mean == "0.0375"
    assert groups - flat == len(steps) == 5 and steps == sorted(steps) and 2 in steps  # step 2: the worked example


def test_the_end_of_run_summary_reports_those_totals():
    correct, rollouts, mean, flat, groups, steps = reference_totals()
    per_step = dict(zip(steps, [1, 3, 4, 3, 4]))  # any split of the correct rollouts over those steps
    assert sum(per_step.values()) == correct and all(0 < c < 8 for c in per_step.values())
    metrics = []
    for step in range(1, groups + 1):
        rewards = torch.tensor([1.0] * per_step.get(step, 0) + [0.0] * (8 - per_step.get(step, 0)))
        varied = not T.equal_rewards(rewards)
        metrics.append(dict(step=step, group_size=8, correct=int(rewards.sum()), reward_std=rewards.std().item(),
                            skipped=False, grad_norm=1.5 if varied else 0.0, update_norm=1e-3, response_tokens=100,
                            timings={"generation": 1.0}, verifier_timeouts=0, verifier_crashes=0, seconds=2.0))
    summary = T.format_summary(metrics, 100.0)
    assert f"correct rollouts        {correct}/{rollouts} (mean reward {mean})" in summary
    assert f"zero-variance groups    {flat}/{groups}" in summary
    assert f"non-zero gradient       {len(steps)} steps: {', '.join(map(str, steps))}" in summary


# ----------------------------------------------------------------------------------------------
# The original text, where it sits beside this checkout


@pytest.mark.skipif(not SPEC.exists(), reason="../shared/SPEC.md is not beside this checkout (a fresh clone): "
                                              "the page's figures are checked against the trainer only")
def test_the_pages_reference_figures_are_the_originals():
    spec = SPEC.read_text(encoding="utf-8")
    for line in spec_rows():
        assert line in spec, f"docs/spec.md's table line {line!r} is not in ../shared/SPEC.md"
    correct, rollouts, mean, flat, groups, steps = reference_totals()
    assert f"{correct} of {rollouts} rollouts were correct (mean reward {mean})" in spec
    assert f"{flat} of {groups} groups had" in spec
    assert f"steps {', '.join(map(str, steps[:-1]))} and {steps[-1]} had a non-zero gradient" in spec
    given = assignments(block_after("## Worked example"))
    for key in ("reward_mean", "reward_std", "advantage_right", "advantage_wrong"):
        assert given[key] in spec, f"docs/spec.md: {key} = {given[key]} is not in ../shared/SPEC.md"
    rows = setup_table()
    for key in ("model", "revision"):
        assert first_code(rows[key]) in spec
    assert "(id 151643)" in spec and "12,000 problems" in spec and "RTX 3090 Ti (24 GB)" in spec
    assert "1,554 tokens, 194.25" in spec and "1,554 tokens, 194.25 per rollout" in words()
