"""What one compiled decode step moves besides the weights: the static KV cache it reads (keys
and values, by dtype) and the bytes its graph allocates per step (repeat_kv copies of the whole
cache show up here), counted in Inductor's output code, on this machine's device.

    python benchmarks/decode_step_bytes.py [--layers 2] [--batch 8] [--prompt 200] [--precision bf16-autocast]
    python benchmarks/decode_step_bytes.py --code DIR   # the same with DIR/train_rlvr.py (e.g. an older version)

The model is Qwen3-0.6B's architecture (../shared/qwen3-0.6b-base: hidden 1024, 16 query heads on 8
key/value heads of 128) with --layers layers and random weights; the numbers scale with the layers.
"""
import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def graph_buffers() -> int:
    """Bytes of the buffers the compiled decode step allocates per call: the empty_strided calls
    of Inductor's output code (what TORCH_LOGS=output_code prints), shapes times dtype sizes."""
    import re

    import torch
    from torch._inductor.codecache import PyCodeCache

    total = 0
    for module in PyCodeCache.modules:
        code = Path(module.__file__).read_text()
        call = code[code.find("def call("):]
        for shape, dtype in re.findall(r"empty_strided_\w+\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)", call):
            numel = 1
            for d in (int(x) for x in shape.split(",") if x.strip()):
                numel *= d
            total += numel * getattr(torch, dtype).itemsize
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--precision", default="bf16-autocast", choices=["fp32", "bf16-autocast", "bf16"])
    ap.add_argument("--code", default=str(ROOT), help="the folder whose train_rlvr.py is measured")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, args.code)
    import torch
    from transformers import AutoModelForCausalLM

    import train_rlvr as T
    from tiny_models import build_like

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        build_like(Path(tmp), SHARED / "qwen3-0.6b-base", layers=args.layers)
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    amp = T.autocast(device, args.precision)
    batch = torch.randint(0, 150000, (1, args.prompt), generator=torch.Generator().manual_seed(0)).repeat(args.batch, 1)
    with torch.no_grad(), T.weight_cast_cache(amp, device.type):
        # a train_rlvr.py of --code from before the Decoders class kept its decoders in static_decoder()
        decoder = T.Decoders().get(model, amp) if hasattr(T, "Decoders") else T.static_decoder(model, amp)
        logits = decoder.prefill(batch.to(device), 16)
        for _ in range(3):  # compile and warm up
            logits = decoder.step(logits.argmax(-1, keepdim=True))
    allocated = graph_buffers()
    layer = decoder.cache.layers[0]
    cache = sum(layer.keys.nbytes + layer.values.nbytes for layer in decoder.cache.layers)
    weights = sum(p.nbytes for p in decoder.model.parameters())
    print(f"{args.code}: {args.layers} layers, batch {args.batch}, cache length {decoder.cache_len}, {args.precision}, "
          f"{device}\n  keys {layer.keys.dtype}, values {layer.values.dtype}: static cache read per step "
          f"{cache / 1e6:.1f} MB; allocated by the step {allocated / 1e6:.1f} MB; weights {weights / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
