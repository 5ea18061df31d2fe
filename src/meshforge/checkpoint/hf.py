"""Hugging Face Llama interop: safetensors weights with HF names <-> meshforge weights and DCP checkpoints.

Names: tok_embeddings <-> model.embed_tokens; layers.N.attention.wq/wk/wv/wo <-> model.layers.N.self_attn.q/k/v/o_proj;
feed_forward.w1/w3/w2 <-> mlp.gate_proj/up_proj/down_proj; attention_norm / ffn_norm <-> input_layernorm /
post_attention_layernorm; norm <-> model.norm; output <-> lm_head (or the embedding when the HF model ties them).

RoPE layout: meshforge (like Meta's own checkpoints) rotates interleaved pairs (2i, 2i+1) of each head; HF's Llama
rotates (i, i + head_dim/2) (``rotate_half``). So the output rows of wq and wk are permuted per head on the way (their
biases and Qwen3's q/k norm weights too; names of those: checkpoint/hf_attention.py):

    meshforge -> HF:  w.view(heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(heads * head_dim, dim)
    HF -> meshforge:  w.view(heads, 2, head_dim // 2, dim).transpose(1, 2).reshape(heads * head_dim, dim)

Only safetensors and JSON are read here: nothing is unpickled.

CLI: ``meshforge convert from-hf HF_DIR OUT_FOLDER --flavor F`` writes ``OUT_FOLDER/step-0``, a seed checkpoint any
layout loads (``checkpoint.initial_load_path``); ``meshforge convert to-hf CHECKPOINT OUT_DIR [--flavor F] [--dtype D]``
exports a checkpoint (a ``step-N`` folder, or a folder of them: the latest) as ``model.safetensors`` + ``config.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshforge.checkpoint import store
from meshforge.checkpoint.hf_attention import ATTENTION_NAMES, architecture_fields, rope_heads
from meshforge.checkpoint.hf_moe import LAYER_NAMES, OPTIONAL_SUFFIX, expert_names, moe_hf_config, split_experts
from meshforge.device.dtypes import DTYPES
from meshforge.errors import ConfigError
from meshforge.model.flavors import ModelArgs, get_flavor
from meshforge.model.llama import Transformer, canonical_name, copy_into

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LAYER.update(ATTENTION_NAMES)  # Qwen2's q/k/v biases, Qwen3's q/k norms (checkpoint/hf_attention.py)
_LAYER.update(LAYER_NAMES)  # MoE layers (checkpoint/hf_moe.py)
# Llama 3.1 long-context RoPE scaling, the constants of meshforge.model.llama.rope_frequencies
_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_name(fqn: str) -> str:
    """The HF name of a meshforge parameter (canonical name, without wrapper prefixes)."""
    if fqn in _TOP:
        return _TOP[fqn]
    parts = fqn.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise ValueError(f"parameter {fqn!r} has no Hugging Face Llama name")


def full_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the whole model (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = Transformer(args)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def permute_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved-pair rows (meshforge / Meta) -> half-split rows (HF rotate_half), per head (a 1-D bias or norm
    weight: its entries as rows)."""
    if w.dim() == 1:
        return permute_to_hf(w[:, None], heads)[:, 0]
    rows, dim = w.shape
    return w.view(heads, rows // heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def permute_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `permute_to_hf`."""
    if w.dim() == 1:
        return permute_from_hf(w[:, None], heads)[:, 0]
    rows, dim = w.shape
    return w.view(heads, 2, rows // heads // 2, dim).transpose(1, 2).reshape(rows, dim)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs, dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """meshforge full weights -> HF names, layout and dtype."""
    out = {}
    for fqn, tensor in state_dict.items():
        if fqn == "output.weight" and args.tie_embeddings:  # HF omits lm_head.weight when tied
            continue
        if (experts := expert_names(fqn, args.n_routed_experts)) is not None:  # one HF matrix per expert
            out.update({k: v.to(DTYPES[dtype]).contiguous() for k, v in split_experts(experts, tensor).items()})
            continue
        heads = rope_heads(fqn, args)
        tensor = permute_to_hf(tensor, heads) if heads else tensor
        out[hf_name(fqn)] = tensor.to(DTYPES[dtype]).contiguous()
    return out


def hf_config(args: ModelArgs, dtype: str) -> dict[str, Any]:
    """config.json of the exported model (transformers' LlamaConfig fields; Qwen2's or Qwen3's for their attention,
    Qwen3-MoE's for MoE flavors)."""
    cfg = {
        **architecture_fields(args),
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": _rope_scaling(args) if args.use_scaled_rope else None,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": dtype,
    }
    return {**cfg, **moe_hf_config(args)} if args.is_moe else cfg


def _rope_scaling(args: ModelArgs) -> dict[str, Any]:
    """HF rope_scaling of a scaled-RoPE model (the llama3 type with the model's own factors)."""
    return {
        **_ROPE_SCALING,
        "factor": args.rope_scaling_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_seq_len,
    }


def save_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs, out: Path, dtype: str = "bfloat16") -> Path:
    """Write ``out/model.safetensors`` and ``out/config.json``; returns out."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(to_hf(state_dict, args, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------------------------------


def is_hf_checkpoint(path: Path) -> bool:
    """A .safetensors file, or a folder of them (without DCP metadata)."""
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and not (path / ".metadata").exists() and any(path.glob("*.safetensors"))


def hf_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (one file, an index, or every file of the folder)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if path.is_dir() and index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no .safetensors files (a Hugging Face model folder or file was expected)")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def check_hf_config(path: Path, args: ModelArgs) -> None:
    """The config.json next to the weights (when present) must describe this flavor's shape: a wrong head count
    would permute q/k silently wrong."""
    file = (path if path.is_dir() else path.parent) / "config.json"
    if not file.is_file():
        return
    cfg = json.loads(file.read_text())
    want = hf_config(args, "")
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    bad = [
        f"{k} {cfg[k]} vs {want[k]}"
        for k in (*keys, "intermediate_size", "rope_theta")
        if k in cfg and cfg[k] != want[k]
    ]
    if bad:
        raise ConfigError(f"{file} does not describe this model.flavor: {', '.join(bad)}; choose the matching flavor")


def _source_names(path: Path, args: ModelArgs) -> tuple[dict[str, Path], dict[str, str | list[str]]]:
    """(HF files, meshforge name -> HF name to read), after checking names and shapes against the whole model."""
    from safetensors import safe_open

    check_hf_config(path, args)
    files = hf_files(path)
    shapes = full_shapes(args)
    names: dict[str, str | list[str]] = {
        fqn: expert_names(fqn, args.n_routed_experts) or hf_name(fqn) for fqn in shapes
    }
    if "lm_head.weight" not in files and "output.weight" in names:  # tied in HF, untied here
        names["output.weight"] = "model.embed_tokens.weight"
    wanted = {n for name in names.values() for n in ([name] if isinstance(name, str) else name)}
    missing = sorted(n for n in wanted if n not in files)
    ignored = ("rotary_emb.inv_freq", OPTIONAL_SUFFIX, *(("lm_head.weight",) if args.tie_embeddings else ()))
    extra = sorted(n for n in files if n not in wanted and not n.endswith(ignored))
    wrong = []
    for fqn, name in names.items():
        for one in [name] if isinstance(name, str) else name:  # an expert's matrix: the 3-D weight without dim 0
            want = shapes[fqn] if isinstance(name, str) else shapes[fqn][1:]
            if one in files:
                with safe_open(str(files[one]), framework="pt") as f:
                    shape = tuple(f.get_slice(one).get_shape())
                if shape != want:
                    wrong.append(f"{one} {shape} vs model {want}")
    if missing or extra or wrong:
        detail = "; ".join(
            f"{what} {store.listing(items)}"
            for what, items in (("missing", missing), ("unexpected", extra), ("shape", wrong))
            if items
        )
        raise ConfigError(f"Hugging Face weights {path} do not match model {args.dim}x{args.n_layers}: {detail}")
    return files, names


def load_hf_weights(model_parts: list[nn.Module], path: Path, args: ModelArgs) -> None:
    """Copy HF weights into this rank's (possibly sharded, possibly pipeline-split) model parts, one tensor at a
    time. A DTensor parameter reads only its own shard from the file (``get_slice``): no rank reads the full model."""
    from safetensors import safe_open

    files, names = _source_names(path, args)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(files.values())}

        def read(name: str) -> torch.Tensor:
            return handles[files[name]].get_tensor(name)

        for part in model_parts:
            for name, param in part.named_parameters():
                fqn = canonical_name(name)
                hf = names[fqn]
                heads = rope_heads(fqn, args)
                with torch.no_grad():
                    if isinstance(param, DTensor) and isinstance(hf, str):
                        local = read_local_shard(handles[files[hf]], hf, param, heads)
                        param.to_local().copy_(local.to(device=param.device, dtype=param.dtype))
                        continue
                    tensor = _read(read, hf)  # experts: the per-expert matrices stacked (read whole)
                    copy_into(param, (permute_from_hf(tensor, heads) if heads else tensor).to(device=param.device))


def read_local_shard(handle: Any, name: str, param: DTensor, heads: int | None) -> torch.Tensor:
    """This rank's block of a sharded parameter, read from an open safetensors file by slices. For the RoPE-permuted
    wq / wk rows the whole heads covering the block are read (the permutation stays within a head), then cut."""
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(size == 0 for size in shape):  # an uneven split left this rank nothing
        return torch.empty(shape)
    index = [slice(start, start + size) for start, size in zip(offset, shape, strict=True)]
    if heads is None:
        return handle.get_slice(name)[tuple(index)]
    head_dim = param.shape[0] // heads
    first, last = offset[0] // head_dim, -(-(offset[0] + shape[0]) // head_dim)
    rows = handle.get_slice(name)[(slice(first * head_dim, last * head_dim), *index[1:])]
    block = permute_from_hf(rows, last - first)
    return block[offset[0] - first * head_dim : offset[0] - first * head_dim + shape[0]]


def load_hf(path: Path, args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF weights as a full meshforge state dict (float32)."""
    from safetensors import safe_open

    files, names = _source_names(path, args)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name).float()

    out = {}
    for fqn, name in names.items():
        tensor = _read(read, name)
        heads = rope_heads(fqn, args)
        out[fqn] = permute_from_hf(tensor, heads) if heads else tensor
    if args.is_moe and args.load_balance_coeff > 0:  # the expert biases (buffers): zeros when the file has none
        for i in range(args.n_layers):
            fqn = f"layers.{i}.feed_forward.expert_bias"
            if args.is_moe_layer(i):
                out[fqn] = read(hf_name(fqn)) if hf_name(fqn) in files else torch.zeros(args.n_routed_experts)
    return out


def _read(read: Any, name: str | list[str]) -> torch.Tensor:
    """One HF tensor, or the per-expert matrices stacked into meshforge's (experts, ...) weight."""
    return read(name) if isinstance(name, str) else torch.stack([read(n) for n in name])


# ---------------------------------------------------------------------------------------------------------------------
# DCP checkpoints <-> HF (single process)
# ---------------------------------------------------------------------------------------------------------------------


def read_checkpoint_model(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The full model weights of a DCP checkpoint (a step folder, or a folder of them: the latest), verified
    against its manifest; returns (weights, manifest)."""
    import torch.distributed.checkpoint as dcp

    if not (path / ".metadata").exists() and (steps := store.complete_steps(path)):
        path = store.step_dir(path, steps[-1])
    manifest = store.read_manifest(path)
    if manifest and (problems := store.verify_files(path, manifest, 0, 1)):
        raise ConfigError(f"checkpoint damaged: {problems[0]}")
    saved = store.saved_shapes(store.read_metadata(path))
    model = {k.removeprefix("model."): torch.empty(s) for k, s in saved.items() if k.startswith("model.") and s}
    if not model:
        raise ConfigError(f"checkpoint {path} holds no model weights")
    with store.single_process_quiet():
        dcp.load({"model": model}, storage_reader=store.SafeReader(path))
    return model, manifest


def hf_to_checkpoint(hf_path: Path, folder: Path, args: ModelArgs, flavor: str) -> Path:
    """Import HF weights as ``folder/step-0``: a model-only seed checkpoint; returns its path."""
    weights = load_hf(hf_path, args)
    meta = {"step": 0, "model_only": True, "dtype": "float32", "world_size": 1, "flavor": flavor}
    meta["layout"] = f"imported from {hf_path}"
    return store.write_checkpoint({"model": weights}, folder, 0, meta, None)


def checkpoint_to_hf(path: Path, out: Path, flavor: str | None, dtype: str, max_shard_mib: int = 4096) -> Path:
    """Export a DCP checkpoint's model as HF safetensors + config.json, streamed: tensors are read one at a time and
    written in files of at most ``max_shard_mib`` (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` +
    ``model.safetensors.index.json``), so memory holds one file's worth, never the whole model. The flavor defaults
    to the manifest's."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    path = _latest_step(path)
    manifest = store.read_manifest(path)
    if manifest and (problems := store.verify_files(path, manifest, 0, 1)):
        raise ConfigError(f"checkpoint damaged: {problems[0]}")
    name = flavor or (manifest or {}).get("flavor")
    if not name:
        raise ConfigError(f"{path} has no manifest naming its flavor: pass --flavor")
    args = get_flavor(name)
    saved = store.saved_shapes(store.read_metadata(path))
    shapes = {k.removeprefix("model."): s for k, s in saved.items() if k.startswith("model.") and s}
    if not shapes:
        raise ConfigError(f"checkpoint {path} holds no model weights")
    limit, size = max_shard_mib * 2**20, DTYPES[dtype].itemsize
    groups: list[list[str]] = [[]]
    for fqn, shape in shapes.items():
        if groups[-1] and (sum(math.prod(shapes[k]) for k in groups[-1]) + math.prod(shape)) * size > limit:
            groups.append([])
        groups[-1].append(fqn)
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file, group in zip(files, groups, strict=True):
        shard = {}
        for fqn in group:  # one tensor in memory at a time (float32), converted, then kept until its file is written
            tensor = torch.empty(shapes[fqn])
            with store.single_process_quiet():
                dcp.load({"model": {fqn: tensor}}, storage_reader=store.SafeReader(path))
            shard.update(to_hf({fqn: tensor}, args, dtype))
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(math.prod(s) for s in shapes.values()) * size},
            "weight_map": weight_map,
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")
    return out


def _latest_step(path: Path) -> Path:
    if not (path / ".metadata").exists() and (steps := store.complete_steps(path)):
        return store.step_dir(path, steps[-1])
    return path


def main(argv: list[str]) -> int:
    """`meshforge convert from-hf|to-hf SRC DST [--flavor F] [--dtype D]`."""
    parser = argparse.ArgumentParser(prog="meshforge convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("direction", choices=["from-hf", "to-hf"])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--flavor", default=None, help="model flavor (from-hf: required; to-hf: from the manifest)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="to-hf: dtype of the export")
    parser.add_argument("--max-shard-mib", type=int, default=4096, help="to-hf: largest safetensors file (MiB)")
    args = parser.parse_args(argv)
    try:
        if args.direction == "from-hf":
            if not args.flavor:
                parser.error("from-hf needs --flavor")
            done = hf_to_checkpoint(args.src, args.dst, get_flavor(args.flavor), args.flavor)
        else:
            done = checkpoint_to_hf(args.src, args.dst, args.flavor, args.dtype, args.max_shard_mib)
    except ConfigError as exc:
        print(f"meshforge convert: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"meshforge convert: wrote {done}")
    return 0
