"""The memory-lever bench preset: each lever is a row whose train flags, label and recorded flags name it."""

from __future__ import annotations

from meshforge.bench.matrix import load_matrix

LEVERS = {
    "fsdp_chunked_loss": ("--training.loss_chunks 8", "chunked loss 8", "loss_chunks", 8),
    "fsdp_activation_offload": (
        "--activation_checkpoint.offload true",
        "activation offload",
        "activation_offload",
        True,
    ),
    "fsdp_cpu_offload": ("--training.enable_cpu_offload true", "CPU offload", "cpu_offload", True),
}


def test_each_lever_row_passes_its_flag_and_names_it() -> None:
    matrix = load_matrix("configs/bench/memory_levers.toml")
    base = matrix.run("fsdp")
    assert base.describe() == "FSDP 2" and matrix.flags_of(base)["loss_chunks"] == 1
    for name, (flag, label, key, value) in LEVERS.items():
        run = matrix.run(name)
        args = " ".join(matrix.train_args(run, "out"))
        assert flag in args, (name, args)
        assert run.describe() == f"FSDP 2 + {label}", run.describe()
        assert matrix.flags_of(run)[key] == value
        others = [k for n, (_, _, k, _) in LEVERS.items() if n != name]
        assert not any(matrix.flags_of(run)[k] not in (1, False) for k in others), (name, matrix.flags_of(run))
