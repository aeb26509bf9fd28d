"""Write a small random-weight Qwen3 and its tokenizer to a folder, for quick CPU runs.

    python tests/make_tiny_model.py runs/tiny-model                 # tiny BPE tokenizer, 29k parameters
    python tests/make_tiny_model.py runs/standin --like ../shared/qwen3-0.6b-base --layers 2 --hidden 256
        # the real tokenizer and architecture family, random weights, made smaller

A random model learns nothing about math: this is for checking that the loop runs end to end.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import build_like, build_tiny_qwen3, build_tiny_tokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--like", help="a folder with config.json and tokenizer files (e.g. ../shared/qwen3-0.6b-base)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None)
    args = ap.parse_args()
    out = Path(args.folder)
    out.mkdir(parents=True, exist_ok=True)
    if args.like is None:
        tok = build_tiny_tokenizer(out)
        build_tiny_qwen3(out, vocab_size=len(tok))
    else:
        build_like(out, Path(args.like), args.layers, args.hidden)
    print(out)


if __name__ == "__main__":
    main()
