"""The jobs of the composability matrix (tests/distributed/test_composability_matrix.py): factors (a layout, a model
and one value per feature), a small greedy t-wise covering array over them, and each job's command-line overrides and
table cells. Pure Python: no torch, so the cover is unit-tested in milliseconds (tests/unit/test_matrix_cover.py).

A layout stands for the table's parallelism rows it turns on (``ROWS``); a table cell is (row, feature column). The
cover holds every allowed t-tuple of factor values, a row standing for its layout (so every (row, feature value)
cell a job can reach is in some job). Pairs that cannot be run are ``forbidden``: EP needs an MoE model, the cells
the table refuses (each gets its own refusal job instead) and chunked loss under TP / PP (refused by
model/loss.py at set-up while the levers work makes it run; those cells stay as the table has them).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable

from meshforge.parallel import composability as table

GLOBAL_BATCH = 4
BASE = [
    "--training.seq_len",
    "32",
    "--training.steps",
    "2",
    "--training.deterministic",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--optimizer.lr",
    "3e-3",
    "--comm.train_timeout_seconds",
    "120",
]

PP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    # name: (world size, overrides); the local batch is GLOBAL_BATCH over the data-parallel degree
    "fsdp": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "hsdp": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    "tp": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp_tp_nolp": (
        4,
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel"],
    ),
    **{f"pp_{name}": (2, [*PP, "--parallelism.pipeline_parallel_schedule", name]) for name in table.SCHEDULES},
    "cp_allgather": (
        2,
        ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_impl", "allgather"],
    ),
    "cp_ring": (2, ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_impl", "ring"]),
    "ep": (2, ["--parallelism.expert_parallel_degree", "2"]),
}
DP = {"fsdp": 2, "hsdp": 4, "fsdp_tp_nolp": 2, "ep": 2}  # data-parallel degree (1 elsewhere)
ROWS: dict[str, list[str]] = {
    # the table rows each layout turns on (what composability.active_parallelisms gives for its config)
    "fsdp": ["fsdp"],
    "hsdp": ["hsdp", "fsdp"],
    "tp": ["tp_sp", "loss_parallel"],
    "fsdp_tp_nolp": ["fsdp", "tp_sp"],
    **{f"pp_{name}": [f"pp_{name}"] for name in table.SCHEDULES},
    "cp_allgather": ["cp_allgather"],
    "cp_ring": ["cp_ring"],
    "ep": ["fsdp", "ep"],
}
MODELS: dict[str, list[str]] = {
    "debugmodel": ["--model.flavor", "debugmodel"],
    "debugmoe": ["--model.flavor", "debugmoe"],
    # Qwen3's q/k norms from the tiny fixture, 4 blocks so that every pipeline split has a block per stage
    "qwen3": ["--model.hf_config", "tests/fixtures/hf_configs/qwen3_tiny", "--model.n_layers", "4"],
}
AC = {
    "none": ["--activation_checkpoint.mode", "none"],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "every_2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
    "full": ["--activation_checkpoint.mode", "full"],
}
SWITCHES: dict[str, tuple[str, list[str]]] = {
    # factor: (table column when on, overrides when on)
    "compile": ("compile", ["--compile.enable"]),
    "document_mask": ("document_mask", ["--training.document_mask"]),
    "validation": (
        "validation",
        ["--validation.enable", "--validation.freq", "1", "--validation.steps", "1"],
    ),
    "tied": ("tied_embeddings", ["--model.tie_embeddings", "true"]),
    "loss_chunks": ("loss_chunks", ["--training.loss_chunks", "2"]),
    "offload": ("activation_offload", ["--activation_checkpoint.offload"]),
}
FLOAT8 = {"off": [], "tensorwise": ["tensorwise"], "rowwise": ["rowwise"]}
FACTORS: dict[str, list[str]] = {
    "layout": list(LAYOUTS),
    "model": list(MODELS),
    "ac": list(AC),
    "float8": list(FLOAT8),
    **{name: ["off", "on"] for name in SWITCHES},
}
CI_LAYOUTS = ("fsdp", "tp", "pp_1F1B", "pp_ZBVZeroBubble", "cp_allgather", "ep")
"""The layouts of CI's pairwise cover (``make test``: minutes on 2 cores), run without compile (a compiled job costs
minutes there); ``make test-matrix`` covers every layout with compile. Together they reach every row but async TP
(CUDA only) and the CSV schedule."""
MODEL_COLUMN = {"debugmoe": "moe", "qwen3": "qwen_qk_norm_bias"}
AC_COLUMN = {"none": "ac_none", "op": "ac_selective_op", "every_2": "ac_every_n", "full": "ac_full"}

Job = dict[str, str]
COST = {("compile", "on"): 2, ("float8", "tensorwise"): 1, ("float8", "rowwise"): 1}
"""Among values that cover as many new tuples, the greedy takes the cheaper (a compiled job costs the most)."""


def columns(factor: str, value: str) -> list[str]:
    """The table columns one factor value turns on."""
    if factor == "model":
        return [MODEL_COLUMN[value]] if value in MODEL_COLUMN else []
    if factor == "ac":
        return [AC_COLUMN[value]]
    if factor == "float8":
        return [] if value == "off" else [f"float8_{value}"]
    if factor in SWITCHES:
        return [SWITCHES[factor][0]] if value == "on" else []
    return []


def cells(job: Job) -> list[tuple[str, str]]:
    """The table cells a job exercises: its layout's rows x its features' columns."""
    cols = [c for f, v in job.items() for c in columns(f, v)]
    return [(row, col) for row in ROWS[job["layout"]] for col in cols]


def forbidden(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Whether two factor values may not share a job (see the module docstring)."""
    pair = dict([a, b])
    if len(pair) < 2:
        return False
    layout, model = pair.get("layout"), pair.get("model")
    if layout == "ep" and model is not None and model != "debugmoe":
        return True
    if layout is None:
        return False
    rows = ROWS[layout]
    if pair.get("loss_chunks") == "on" and any(r.startswith(("tp_", "pp_")) for r in rows):
        return True
    other = next(f for f in pair if f != "layout")
    return any(table.cell(row, col).status == "refused" for row in rows for col in columns(other, pair[other]))


def interaction(job: Job) -> table.Interaction | None:
    """The table's three-way refusal a (partial) job hits on a CPU (where the matrix runs), if any."""
    rows = set(ROWS[job["layout"]]) if "layout" in job else set()
    cols = {c for f, v in job.items() for c in columns(f, v)}
    return next((r for r in table.INTERACTIONS if rows & r.rows and r.features <= cols and "cpu" in r.devices), None)


def allowed(job: Job) -> bool:
    items = list(job.items())
    return not any(forbidden(a, b) for a, b in itertools.combinations(items, 2)) and interaction(job) is None


def tuples_of(job: Job, strength: int) -> set[tuple[tuple[str, str], ...]]:
    """The t-tuples of (factor, value) a job covers."""
    return set(itertools.combinations(sorted(job.items()), strength))


def factors(layouts: Iterable[str] | None = None) -> dict[str, list[str]]:
    """FACTORS with the layout factor cut to ``layouts`` (None: every layout); CI's layouts run uncompiled."""
    if layouts is None:
        return FACTORS
    return {**FACTORS, "layout": list(layouts), **({"compile": ["off"]} if tuple(layouts) == CI_LAYOUTS else {})}


def required(
    strength: int, ok: Callable[[Job], bool] = allowed, layouts: Iterable[str] | None = None
) -> set[tuple[tuple[str, str], ...]]:
    """Every t-tuple of factor values that an allowed job can hold."""
    space = factors(layouts)
    out: set[tuple[tuple[str, str], ...]] = set()
    for names in itertools.combinations(sorted(space), strength):
        for values in itertools.product(*(space[n] for n in names)):
            combo = tuple(zip(names, values, strict=True))
            if ok(dict(combo)):
                out.add(combo)
    return out


def cover(strength: int = 2, seed: int = 0, tries: int = 24, layouts: Iterable[str] | None = None) -> list[Job]:
    """A greedy t-wise covering array (AETG-style): seed each job with an uncovered tuple, fill the other factors
    one at a time with the value that covers most new tuples (ties: the cheaper, then at random), keep the best of
    ``tries``."""
    rng = random.Random(seed)
    space = factors(layouts)
    todo = required(strength, layouts=layouts)
    jobs: list[Job] = []
    while todo:
        best: Job = {}
        gain = -1
        for _ in range(tries):
            job = _grow(dict(rng.choice(sorted(todo))), todo, strength, rng, space)
            new = len(tuples_of(job, strength) & todo)
            if job and new > gain:
                best, gain = job, new
        jobs.append(best)
        todo -= tuples_of(best, strength)
    return jobs


def _grow(
    job: Job, todo: set[tuple[tuple[str, str], ...]], strength: int, rng: random.Random, space: dict[str, list[str]]
) -> Job:
    names = [n for n in space if n not in job]
    rng.shuffle(names)
    for name in names:
        scored = []
        for value in space[name]:
            trial = {**job, name: value}
            if allowed(trial):
                new = sum(1 for t in itertools.combinations(sorted(trial.items()), strength) if t in todo)
                scored.append((new, -COST.get((name, value), 0), rng.random(), value))
        if not scored:
            return {}
        job[name] = max(scored)[3]
    return job


def refusal_jobs(layouts: Iterable[str] | None = None) -> list[tuple[tuple[str, str], Job]]:
    """One job per refused table cell that a layout and a factor value reach: the cell's row and column, every other
    factor at its plainest allowed value."""
    plain = {"model": "debugmodel", "ac": "none", "float8": "off", **{n: "off" for n in SWITCHES}}
    out = []
    for layout in factors(layouts)["layout"]:
        rows = ROWS[layout]
        for factor, values in FACTORS.items():
            for value in values if factor != "layout" else []:
                for col in columns(factor, value):
                    for row in rows:
                        if table.cell(row, col).status == "refused":
                            job = {**plain, "layout": layout, factor: value}
                            if layout == "ep":
                                job["model"] = "debugmoe"
                            out.append(((row, col), job))
    space = factors(layouts)
    for rule in table.INTERACTIONS:  # one job per three-way refusal, on the first layout that reaches it
        job = {**plain, **{f: v for f, vs in space.items() for v in vs if set(columns(f, v)) & rule.features}}
        for layout in space["layout"]:
            if set(ROWS[layout]) & rule.rows and rule.features <= {c for f, v in job.items() for c in columns(f, v)}:
                out.append(((sorted(rule.rows)[0], "+".join(sorted(rule.features))), {**job, "layout": layout}))
                break
    firsts: dict[tuple[str, str], Job] = {}
    for key, job in out:
        firsts.setdefault(key, job)
    return sorted(firsts.items())


def overrides(job: Job, *, compile_backend: str = "inductor") -> tuple[int, list[str]]:
    """(world size, command-line overrides) of a job."""
    world, layout = LAYOUTS[job["layout"]]
    args = [*BASE, *MODELS[job["model"]], *layout, *AC[job["ac"]]]
    args += ["--training.local_batch_size", str(GLOBAL_BATCH // DP.get(job["layout"], 1))]
    for name, (_, extra) in SWITCHES.items():
        args += extra if job.get(name) == "on" else []
    if job.get("compile") == "on":
        args += ["--compile.backend", compile_backend]
    if job["float8"] != "off":
        args += ["--quantize.dense.float8.enable", "--quantize.dense.float8.recipe_name", job["float8"]]
    return world, args


def reference_key(job: Job) -> tuple[str, ...]:
    """The single-process run a job's losses compare with: same model, data and numerics (Float8 recipe, document
    mask, tied weights); AC, compile, chunked loss, offload and validation must not change the losses."""
    return (job["model"], job["float8"], job.get("document_mask", "off"), job.get("tied", "off"))


def reference_overrides(key: tuple[str, ...]) -> list[str]:
    """One process, the whole global batch, no AC: the run every job of ``key`` compares with."""
    model, float8, document_mask, tied = key
    args = [*BASE, *MODELS[model], *AC["none"], "--training.local_batch_size", str(GLOBAL_BATCH)]
    args += SWITCHES["document_mask"][1] if document_mask == "on" else []
    args += SWITCHES["tied"][1] if tied == "on" else []
    if float8 != "off":
        args += ["--quantize.dense.float8.enable", "--quantize.dense.float8.recipe_name", float8]
    return args


def describe(job: Job) -> str:
    return " ".join(f"{k}={v}" for k, v in job.items() if v != "off")


def summary(jobs: Iterable[Job]) -> dict[str, int]:
    """Jobs per world size."""
    out: dict[str, int] = {}
    for job in jobs:
        world = str(LAYOUTS[job["layout"]][0])
        out[world] = out.get(world, 0) + 1
    return out
