"""From the responses to the weights: the EOS token's term in the loss and its gradient, log-prob
forwards without a KV cache, the learning rate and max_grad_norm at the optimizer and its clip,
the update norm (in place and across devices), and where the copies that undo a non-finite step
live. CPU, tiny local model."""

import copy
import math

import pytest
import torch

import train_rlvr as T
from scripted_run import EOS_ID, run_scripted


@pytest.fixture(scope="module")
def scripted(tiny_model_dir, tiny_data_file, tmp_path_factory):
    return run_scripted(tiny_model_dir, tiny_data_file, tmp_path_factory)


# ----------------------------------------------------------------------------------------------
# The EOS token is trained; log-prob forwards build no KV cache


def _by_hand_sequence_log_probs(model, prompt, responses):
    """Full-vocabulary float64 log-softmax over prompt + response, every response token summed."""
    out = []
    for r in responses:
        ids = torch.cat([prompt, r]).unsqueeze(0)
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        out.append(sum(logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(r.tolist())))
    return out


def test_the_eos_token_is_a_trained_response_token(scripted):
    """The responses that reach the loss end with their EOS, the logged sequence
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
# The learning rate and max_grad_norm reach the optimizer and the clip


def test_learning_rate_and_max_grad_norm_reach_the_optimizer_and_the_clip(scripted):
    """The update of step 1 is a by-hand AdamW step at the configured lr (3e-3) on the
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
# The update norm across devices (host buffers of CUDA weights), run on the CPU, and the undo copies


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
        copies, norms = T.StepCopies(T.update_norm_buffers(params, torch.device("cpu"))), []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 1:  # weights near 1e37, still finite; at step 2 the weight decay overflows: undone
                opt.param_groups[0]["lr"] = 1e37
            norms.append(T.optimizer_step(params, opt, 1.0, 0.0, copies))
        runs.append((norms, [p.detach().clone() for p in params],
                     [{k: v.clone() for k, v in opt.state[p].items()} for p in params]))
    (norms, weights, state), (norms2, weights2, state2) = runs
    assert norms == norms2 and norms[2][1] is None and all(n[1] > 0 for n in norms[:2])
    assert all(torch.equal(a, b) for a, b in zip(weights, weights2)) and all(w.isfinite().all() for w in weights)
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(state, state2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_weights_range_finds_any_non_finite_weight_without_overflow(bad):
    """optimizer_step's undo test: each tensor's min and max. A NaN anywhere, +inf or -inf is found; the
    largest finite float32 (whose square or sum would overflow) is finite, and the largest |weight|; an empty
    shard (fsdp) is skipped."""
    w = [torch.full((3, 4), -3.0e38), torch.zeros(0), torch.randn(1000).to(torch.bfloat16)]
    if bad is not None:
        w[2][517] = bad
    finite, largest = T.weights_range(w)
    assert finite is (bad is None) and (largest == pytest.approx(3.0e38, rel=1e-6) if bad is None else largest == math.inf)
