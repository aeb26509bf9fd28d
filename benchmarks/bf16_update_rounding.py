"""How many weights does one AdamW step at lr 1e-5 actually change, in bfloat16 vs float32?

4M weights drawn like Qwen3's initialization (normal, std 0.02), a random gradient, one step.
    python benchmarks/bf16_update_rounding.py
"""
import torch

torch.manual_seed(0)
w = torch.randn(4_000_000) * 0.02
for dtype in (torch.bfloat16, torch.float32):
    p = w.to(dtype).requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=1e-5)
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    opt.step()
    changed = (p.detach() != before).float().mean().item()
    print(f"{str(dtype):15s} weights changed by one AdamW step: {changed:.1%}")
