"""Under sequence parallel every parameter of the real parallelization is on the tp mesh (norms replicated there,
their inputs sequence-sharded): a norm left out of the plan stays a tensor of the data-parallel mesh alone, which no
optimizer implementation is guaranteed to notice (foreach AdamW crashes; the for-loop one drifts 4e-5 in the loss)."""

from __future__ import annotations

from fakeworld import parallelized
from torch.distributed.tensor import DTensor, Replicate


def test_every_parameter_is_placed_on_the_tp_mesh_under_sequence_parallel() -> None:
    with parallelized(["--parallelism.tensor_parallel_degree", "2"], world=4) as parts:
        params = {n: p for stage in parts[0] for n, p in stage.named_parameters()}
        meshes = {n: p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None for n, p in params.items()}
        norms = {n: p.placements for n, p in params.items() if n.endswith("norm.weight")}
    off_tp = {n: names for n, names in meshes.items() if names is None or "tp" not in names}
    assert not off_tp, f"parameters not on the tp mesh under sequence parallel (missing from the TP plan): {off_tp}"
    assert len(norms) == 2 * 8 + 1  # two per block of the tiny flavor, the final norm
    tp_dim = {n: meshes[n].index("tp") for n in norms}  # type: ignore[union-attr]
    assert all(isinstance(norms[n][tp_dim[n]], Replicate) for n in norms), norms
