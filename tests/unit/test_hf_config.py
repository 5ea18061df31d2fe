"""Any Llama-family model: Hugging Face config.json fixtures and [model] overrides resolve to shapes whose parameter
counts equal the published totals and the built model's; what training cannot build is refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from meshforge.cli import main
from meshforge.config.io import ConfigError, load_config
from meshforge.config.schema import JobConfig
from meshforge.model.flavors import get_flavor, param_counts
from meshforge.model.hf_config import args_from_hf, read_hf_config, resolve_model_args
from meshforge.model.llama import build_model
from meshforge.parallel.layout import check_tied_pipeline

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
# totals as published on the models' Hugging Face pages (safetensors parameter count)
PUBLISHED = {"llama3_8b": 8_030_261_248, "mistral_7b": 7_241_732_096, "qwen3_8b": 8_190_735_360}


def built_numel(args: object) -> int:
    """Distinct parameters of the model meshforge builds (a tied weight counts once)."""
    return sum(p.numel() for p in build_model(args).parameters())  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_fixture_counts_equal_published_totals(name: str) -> None:
    args = args_from_hf(read_hf_config(str(FIXTURES / name / "config.json")))
    assert param_counts(args).total == PUBLISHED[name]


def test_fixture_shapes_are_mapped() -> None:
    llama = args_from_hf(read_hf_config(str(FIXTURES / "llama3_8b")))
    assert llama.use_scaled_rope and llama.rope_scaling_factor == 8.0 and llama.ffn_hidden_dim == 14336
    assert param_counts(llama) == param_counts(get_flavor("8B"))
    qwen = args_from_hf(read_hf_config(str(FIXTURES / "qwen3_8b")))
    assert qwen.qk_norm and not qwen.qkv_bias and qwen.head_dim == 128 and qwen.rope_theta == 1e6
    mistral = args_from_hf(read_hf_config(str(FIXTURES / "mistral_7b")))
    assert not mistral.use_scaled_rope and mistral.vocab_size == 32000 and mistral.kv_heads == 8


def test_llama32_flavors_tie_and_count_once() -> None:
    assert param_counts(get_flavor("1B")).total == 1_235_814_400
    assert param_counts(get_flavor("3B")).total == 3_212_749_824
    tied = replace(get_flavor("tiny"), tie_embeddings=True)
    model = build_model(tied)
    assert model.output is not None and model.tok_embeddings is not None
    assert model.output.weight is model.tok_embeddings.weight
    model.to_empty(device="cpu")  # materialising gives each name a new Parameter: the model re-ties them
    assert model.output.weight is model.tok_embeddings.weight
    assert built_numel(tied) == param_counts(tied).total == param_counts(get_flavor("tiny")).total - 2048 * 64


def test_model_section_overrides_the_flavor() -> None:
    overrides = ["--model.flavor", "tiny", "--model.n_layers", "3", "--model.ffn_dim", "96", "--model.head_dim", "32"]
    cfg = load_config(None, [*overrides, "--model.tie_embeddings", "true", "--model.rope_theta", "10000"])
    args = resolve_model_args(cfg.model, 64)
    assert (args.n_layers, args.ffn_hidden_dim, args.head_dim, args.max_seq_len) == (3, 96, 32, 64)
    assert args.tie_embeddings and args.rope_theta == 10000.0
    assert built_numel(args) == param_counts(args).total
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    assert model(torch.randint(0, 2048, (1, 16))).shape == (1, 16, 2048)


def test_qwen_extras_are_counted() -> None:
    base = args_from_hf(read_hf_config(str(FIXTURES / "qwen3_8b")))
    plain = replace(base, qk_norm=False)
    assert param_counts(base).total - param_counts(plain).total == 36 * 2 * 128
    biased = replace(plain, qkv_bias=True)
    assert param_counts(biased).total - param_counts(plain).total == 36 * (32 + 2 * 8) * 128


@pytest.mark.parametrize(
    ("change", "needle"),
    [({"architectures": ["GPT2LMHeadModel"]}, "architecture"), ({"rope_scaling": {"rope_type": "yarn"}}, "yarn")],
)
def test_unsupported_configs_are_refused(tmp_path: Path, change: dict[str, object], needle: str) -> None:
    data = json.loads((FIXTURES / "llama3_8b" / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=needle):
        args_from_hf(read_hf_config(str(tmp_path)))
    with pytest.raises(ConfigError, match=r"model\.n_layers = -2"):
        resolve_model_args(load_config(None, ["--model.n_layers", "-2"]).model, 64)
    with pytest.raises(ConfigError, match="no such file"):
        read_hf_config(str(tmp_path / "absent.json"))


def test_training_refuses_what_it_cannot_build() -> None:
    from meshforge.parallel.layout import Layout

    def check_layout(cfg: JobConfig, world_size: int) -> None:  # as the bench and the dry run ask it
        Layout.from_config(cfg, world_size).check(resolve_model_args(cfg.model, cfg.training.seq_len))

    check_layout(load_config(None, ["--model.hf_config", str(FIXTURES / "qwen3_8b" / "config.json")]), 1)  # trains
    tied_pp = [
        "--model.flavor",
        "tiny",
        "--model.tie_embeddings",
        "true",
        "--parallelism.pipeline_parallel_degree",
        "2",
    ]
    with pytest.raises(ConfigError, match="tie_embeddings"):
        check_layout(load_config(None, tied_pp), 2)
    check_tied_pipeline(get_flavor("1B"), 1)  # tied without pipeline parallel trains


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_plan_cli_takes_a_hf_config(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(FIXTURES / name / "config.json")
    code = main(["plan", "--model.hf_config", path, "--world-size", "8", "--hardware", "h100-96gb"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"meshforge plan: {name} ({PUBLISHED[name]:,} parameters) on 8 x h100-96gb" in out
    assert "tokens/s per device" in out and "fits" in out


def test_dry_run_measures_the_qwen3_extras(capsys: pytest.CaptureFixture[str]) -> None:
    from meshforge.tools.dry_run import plan

    path = str(FIXTURES / "qwen3_8b" / "config.json")
    small = ["--model.n_layers", "2", "--model.dim", "256", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
    code = main(["train", "--dry-run", "--world-size", "2", "--model.hf_config", path, *small])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "the measured shards below do not" not in out  # the old note: they leave the extras out
    cfg = load_config(None, ["--model.hf_config", path, *small])
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    assert args.qk_norm and args.head_dim == 256 // 4  # head_dim 128 = 4096 / 32 follows the overrides
    assert 2 * plan(cfg, 2).ranks[0].param_elements == param_counts(args).total  # FSDP 2: every tensor halves


def test_hf_export_of_a_tied_model_omits_lm_head(tmp_path: Path) -> None:
    from safetensors import safe_open

    from meshforge.checkpoint.hf import load_hf, save_hf

    args = replace(get_flavor("tiny"), tie_embeddings=True).with_seq_len(64)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(1)
    save_hf(model.state_dict(), args, tmp_path, dtype="float32")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    assert args_from_hf(read_hf_config(str(tmp_path))).tie_embeddings
    back = load_hf(tmp_path, args)
    assert "output.weight" not in back
    assert torch.equal(back["tok_embeddings.weight"], model.tok_embeddings.weight)  # type: ignore[union-attr]


def test_qwen3_moe_config_maps_to_the_flavor_shape() -> None:
    from meshforge.checkpoint.hf import hf_config

    args, flavor = args_from_hf(read_hf_config(str(FIXTURES / "qwen3_30b_a3b"))), get_flavor("qwen3_30B_A3B")
    fields = ("dim", "n_layers", "n_heads", "kv_heads", "head_dim", "qk_norm", "qkv_bias", "vocab_size", "norm_eps")
    fields += ("rope_theta", "n_routed_experts", "top_k", "moe_ffn_dim", "n_shared_experts", "first_k_dense")
    fields += ("route_norm", "score_func", "route_scale")
    assert {f: getattr(args, f) for f in fields} == {f: getattr(flavor, f) for f in fields}
    assert param_counts(args).total == param_counts(flavor).total == 30_532_122_624  # the published total
    assert args.aux_loss_coeff == 0 and args.load_balance_coeff == 0  # output_router_logits false; HF has no bias
    # meshforge's own export of a Qwen3-MoE model (dense first layer, a shared expert, aux loss on) reads back
    moe = replace(
        get_flavor("debugmoe"), qk_norm=True, explicit_head_dim=64, load_balance_coeff=0.0, aux_loss_coeff=0.01
    )
    back = args_from_hf(hf_config(moe, "float32"))
    assert {f: getattr(back, f) for f in (*fields, "aux_loss_coeff")} == {
        f: getattr(moe, f) for f in (*fields, "aux_loss_coeff")
    }
    assert built_numel(back) == param_counts(back).total == param_counts(moe).total
    for change, needle in (({"mlp_only_layers": [1]}, "mlp_only_layers"), ({"decoder_sparse_step": 2}, "sparse_step")):
        data = json.loads((FIXTURES / "qwen3_30b_a3b" / "config.json").read_text()) | change
        with pytest.raises(ConfigError, match=needle):
            args_from_hf(data)
