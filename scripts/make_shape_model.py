"""Write a randomly initialised model of a real model's shape, with a BPE tokenizer trained on GSM8K.

For speed and memory work where no weights can be downloaded: the shape (layers, widths, heads,
tied embeddings, RoPE base) is what costs time and memory, not the values of the weights. The
tokenizer is a byte-level BPE of `--vocab` tokens trained on the GSM8K train solutions
(`prmppo.models.tiny.build_bpe_tokenizer`), so prompts and responses have realistic lengths.

    python scripts/make_shape_model.py --out models/qwen2-0.5b-shape --data-dir ../shared/data/gsm8k
    python -m prmppo model=hf model.path=models/qwen2-0.5b-shape task=gsm8k task.data_dir=... topology=gpu

Shapes (`--shape`): `qwen2-0.5b` (Qwen2-0.5B: 24 layers, hidden 896, MLP 4864, 14 query heads,
2 KV heads, tied embeddings; 372.6M parameters with a 16,384-token vocabulary), `qwen2-7b` (Qwen2-7B's
layers: 28 layers, hidden 3584, MLP 18944, 28 query heads, 4 KV heads, untied embeddings; 6.64B parameters
with that vocabulary; build it with `--device cuda`, which initialises the weights on the GPU in the target
dtype instead of in float32 on the host) and `tiny-qwen2` (2 layers, hidden 64: for checking the script and
the code paths on a CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SHAPES = {
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny-qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, rope_theta=10_000.0, rms_norm_eps=1e-6),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="HF-layout directory to write (must not exist)")
    parser.add_argument("--data-dir", required=True, help="GSM8K directory holding train.jsonl")
    parser.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary size, specials included")
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the weights are initialised (cuda: fast for 7B)")
    args = parser.parse_args()

    out = Path(args.out)
    if out.exists():
        print(f"--out {out} exists; refusing to overwrite it", file=sys.stderr)
        return 2
    train = Path(args.data_dir) / "train.jsonl"
    if not train.is_file():
        print(f"--data-dir {args.data_dir} has no train.jsonl", file=sys.stderr)
        return 2

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from prmppo.models.tiny import build_bpe_tokenizer

    rows = [json.loads(line) for line in train.read_text().splitlines() if line.strip()]
    texts = [row["question"] + "\n" + row["answer"] for row in rows]
    tokenizer = build_bpe_tokenizer(texts, args.vocab)
    config = Qwen2Config(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_position_embeddings=args.max_positions,
        use_sliding_window=False, **{"tie_word_embeddings": True, **SHAPES[args.shape]})
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: no float32 copy of a 7B model
    try:
        with torch.device(args.device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to(dtype)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {args.shape}, {params / 1e6:.1f}M parameters, vocabulary {len(tokenizer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
