"""Context parallel: each of ``cp`` ranks holds a slice of every sequence; attention still sees the whole sequence.

Load balance (head-tail): the sequence is cut into ``2 x cp`` chunks and rank ``r`` holds chunks ``r`` and
``2cp - 1 - r``, so every rank gets the same share of the causal mask's work. Inputs, labels and the tokens' global
positions (for RoPE) are sliced the same way before the forward; the loss is a mean over the local tokens, and FSDP
over ``dp_shard_cp`` averages the gradients over cp (the mean of equal-size means).

Attention never builds a mask or a score matrix: each local query chunk attends to the chunks before it (unmasked) and
to itself (causal) with a fused kernel that returns the log-sum-exp, and the partials are merged exactly
(``blocks.py``; memory linear in the sequence). K/V travel at K/V-head width (grouped-query attention is done by the
kernel, never by repeating K/V). Two implementations (``parallelism.context_parallel_impl``), behind the entry points
of ``api.py`` (``apply_cp``, ``shard_batch``, the implementation checks):

* ``allgather`` (the default): each rank all-gathers K and V over the cp group (autograd reduce-scatters dK/dV) and
  attends its two query chunks to the gathered sequence. Two collectives per layer; K/V memory of the full sequence.
* ``ring``: K/V blocks pass rank to rank over the cp group (``ring.py``, point-to-point sends that overlap the
  current block's attention); the backward passes dK/dV around the ring. K/V memory of two local slices.
"""

from meshforge.parallel.context_parallel.api import (
    IMPLS,
    AllGatherKVAttention,
    apply_cp,
    check_cp_impl,
    load_balanced_positions,
    resolve_cp_impl,
    shard_batch,
)
from meshforge.parallel.context_parallel.ring import RingAttention

__all__ = [
    "IMPLS",
    "AllGatherKVAttention",
    "RingAttention",
    "apply_cp",
    "check_cp_impl",
    "load_balanced_positions",
    "resolve_cp_impl",
    "shard_batch",
]
