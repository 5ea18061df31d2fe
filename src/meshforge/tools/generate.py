"""`meshforge generate --checkpoint DIR [--prompt TEXT] ...`: sample text from a trained model in one process.

DIR is a meshforge checkpoint (a DCP step folder, or a checkpoint folder: its latest complete step; the flavor comes
from its manifest) or a Hugging Face safetensors folder (pass --flavor). Sampling recomputes the whole sequence for
each new token (no KV cache: meant for looking at small models), with temperature and top-k, and draws from a
generator seeded by --seed, so the same seed gives the same text. --temperature 0 is greedy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from meshforge.checkpoint import hf
from meshforge.config.schema import Model
from meshforge.data.tokenizer import build_tokenizer
from meshforge.errors import ConfigError
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import Transformer, build_model


def load_model(path: Path, flavor: str | None, seq_len: int, device: torch.device) -> Transformer:
    """The float32 model of a meshforge checkpoint or a Hugging Face folder, on device, in eval mode."""
    if not path.exists():
        raise ValueError(f"--checkpoint {str(path)!r} does not exist")
    if hf.is_hf_checkpoint(path):
        if not flavor:
            raise ValueError(f"{path} is a Hugging Face folder: pass --flavor (tiny, debugmodel, 100m, 1B, ...)")
        args = get_flavor(flavor).with_seq_len(seq_len)
        hf.check_hf_config(path, args)
        weights = hf.load_hf(path, args)
    else:
        weights, manifest = hf.read_checkpoint_model(path)
        name = flavor or (manifest or {}).get("flavor")
        if not name:
            raise ValueError(f"{path} has no manifest naming its flavor: pass --flavor")
        args = get_flavor(name).with_seq_len(seq_len)
    model = build_model(args)
    model.to_empty(device=device)
    model.init_weights(0)  # fills the non-persistent buffers (RoPE); the weights are replaced next
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.eval()


@torch.no_grad()
def sample(
    model: Transformer,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    eos_id: int | None = None,
) -> list[int]:
    """prompt + up to max_new_tokens sampled ids (stops after eos_id). Same seed, same ids."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.args.max_seq_len :])[0, -1].float()  # (vocab,)
        if temperature <= 0:
            token = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                threshold = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
        if eos_id is not None and int(token) == eos_id:
            break
    return [int(i) for i in ids[0]]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshforge generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="checkpoint folder or HF safetensors folder")
    parser.add_argument("--prompt", default="", help="text to continue (after the begin-of-text token)")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flavor", default=None, help="model flavor (default: the checkpoint manifest's)")
    parser.add_argument("--tokenizer", default=Model.tokenizer_path, help="the tokenizer the model was trained with")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """Print the prompt and its continuation."""
    args = parse(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--max-new-tokens must be >= 1, --temperature and --top-k >= 0")
    try:
        tokenizer = build_tokenizer(args.tokenizer)
        prompt = [tokenizer.bos_id, *tokenizer.encode(args.prompt)]
        model = load_model(args.checkpoint, args.flavor, len(prompt) + args.max_new_tokens, torch.device(args.device))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ConfigError(f"--tokenizer has {tokenizer.vocab_size} tokens, the model {model.args.vocab_size}")
    ids = sample(
        model,
        prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        eos_id=tokenizer.eos_id,
    )
    sys.stdout.write(tokenizer.decode(ids[1:]) + "\n")
    return 0
