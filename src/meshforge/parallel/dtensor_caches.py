"""Forget the DeviceMeshes that torch's process-wide DTensor caches hold, after a temporary (fake) world ends.

DTensor's sharding propagation caches its results (the Python ``lru_cache`` of ``ShardingPropagator`` and the C++
fast-path cache) keyed by the input specs, and a ``DeviceMesh`` compares equal to another by its rank layout, device
type, dimension names and thread alone: not by the rank it was built on nor by its process groups. A cached output spec
carries the mesh object it was computed with. So after ``meshforge train --dry-run`` (rank 0 of a fake world), a later
mesh of the same shape and names, in this process or in any process forked from it, gets the dry run's rank-0 mesh back
in ops whose result the cache already holds (FSDP2's 1-D parameters, for one): on rank 1 such a DTensor reports
coordinate 0, and a distributed checkpoint of it saves rank 0's chunk twice ("invalid fill"). The redistribute planner
cache is keyed by a weak reference to the mesh, which compares by the referent while it is alive: same hazard.
"""

from __future__ import annotations


def clear_dtensor_caches() -> None:
    """Empty torch's DTensor sharding-propagation caches (Python and C++) and its redistribute-planner cache."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
