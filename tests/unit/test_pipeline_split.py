"""Pipeline stage splitting, schedule names and microbatch rules, CSV schedules and the bubble theory (no processes)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from meshforge.config.schema import Parallelism
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import Transformer, build_model
from meshforge.parallel.pipeline.bubble import BusyClock, simulate_idle_shares, single_stage_theory
from meshforge.parallel.pipeline.rules import (
    check_csv_split_backward,
    check_split_backward,
    num_microbatches,
    resolve_schedule_name,
)
from meshforge.parallel.pipeline.schedule import check_microbatches, read_csv_schedule, schedule_spec
from meshforge.parallel.pipeline.split import (
    num_stages_for,
    prune_to_stage,
    split_evenly,
    stage_modules,
    stage_to_rank,
    validate_stage_modules,
)

LAYERS = [f"layers.{i}" for i in range(8)]


def test_even_split_counts_embedding_and_output_as_blocks() -> None:
    assert split_evenly(8, 2, 1, 1) == [["tok_embeddings", *LAYERS[:4]], [*LAYERS[4:], "norm", "output"]]
    assert split_evenly(8, 4, 1, 1) == [
        ["tok_embeddings", *LAYERS[:2]],
        LAYERS[2:5],
        LAYERS[5:7],
        [LAYERS[7], "norm", "output"],
    ]
    assert split_evenly(8, 2, 0, 0) == [["tok_embeddings", *LAYERS[:4]], [*LAYERS[4:], "norm", "output"]]
    assert split_evenly(8, 2, 0, 2)[0] == ["tok_embeddings", *LAYERS[:5]]  # heavier output: last stage gets fewer
    assert split_evenly(8, 8, 1, 1)[-1] == ["norm", "output"]  # a stage may hold only norm + output


def test_more_stages_than_layers_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs 11 stages but the model has only 8 layers"):
        split_evenly(8, 11, 1, 1)
    with pytest.raises(ValueError, match="less_layers = 4/1 exceed the 3 blocks per stage"):
        split_evenly(8, 4, 4, 1)
    assert split_evenly(8, 4, 3, 1)[0] == ["tok_embeddings"]  # the embedding alone is a stage


def test_number_of_stages_follows_schedule_and_layers_per_stage() -> None:
    cfg = Parallelism()
    assert num_stages_for(cfg, 8, 2, "single") == 2
    assert num_stages_for(cfg, 8, 2, "v") == 4
    cfg.pipeline_parallel_layers_per_stage = 3  # ceil((8 + 1 + 1) / 3) = 4 stages
    assert num_stages_for(cfg, 8, 2, "loop") == 4
    with pytest.raises(ValueError, match="needs exactly 1 stage"):
        num_stages_for(cfg, 8, 2, "single")
    cfg.pipeline_parallel_layers_per_stage = 2  # 5 stages over 2 ranks
    with pytest.raises(ValueError, match="not a multiple of pipeline_parallel_degree = 2"):
        num_stages_for(cfg, 8, 2, "loop")
    cfg.pipeline_parallel_layers_per_stage = 1  # 10 stages over 2 ranks: 5 per rank, V needs 2
    with pytest.raises(ValueError, match="needs exactly 2"):
        num_stages_for(cfg, 8, 2, "v")


def test_explicit_module_names_are_checked() -> None:
    good = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    validate_stage_modules(good, 2)
    with pytest.raises(ValueError, match=r"names \['layers.9'\], which the model does not have"):
        validate_stage_modules([["tok_embeddings", "layers.9"], ["layers.1", "norm", "output"]], 2)
    with pytest.raises(ValueError, match=r"missing \['layers.1'\]"):
        validate_stage_modules([["tok_embeddings", "layers.0"], ["norm", "output"]], 2)
    with pytest.raises(ValueError, match="forward order"):
        validate_stage_modules([["layers.1", "norm", "output"], ["tok_embeddings", "layers.0"]], 2)
    with pytest.raises(ValueError, match="stage 1 is empty"):
        validate_stage_modules([[*good[0], *good[1]], []], 2)
    cfg = Parallelism(module_fqns_per_model_part=good)
    assert stage_modules(cfg, 2, 2) == good


def test_stage_to_rank_looped_and_v_shaped() -> None:
    assert stage_to_rank(4, 2, "loop") == {0: 0, 1: 1, 2: 0, 3: 1}
    assert stage_to_rank(8, 4, "v") == {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 2, 6: 1, 7: 0}


def test_pruned_stages_get_the_whole_models_weights() -> None:
    args = get_flavor("tiny").with_seq_len(16)
    whole = build_model(args)
    whole.to_empty(device="cpu")
    whole.init_weights(7)
    full = dict(whole.named_parameters())
    parts = [prune_to_stage(build_model(args), names) for names in split_evenly(8, 4, 1, 1)]
    seen = 0
    for part in parts:
        part.to_empty(device="cpu")
        part.init_weights(7)
        for name, param in part.named_parameters():
            assert torch.equal(param, full[name]), name
            seen += 1
    assert seen == len(full)
    # and the stages, chained, compute what the whole model computes
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    h = tokens
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)
    assert isinstance(parts[1], Transformer) and parts[1].tok_embeddings is None and parts[1].output is None


def test_schedule_names() -> None:
    assert resolve_schedule_name("interleave_1f1b") == "Interleaved1F1B"
    assert resolve_schedule_name("ScheduleZBVZeroBubble") == "ZBVZeroBubble"
    assert resolve_schedule_name("gpipe") == "GPipe"
    assert resolve_schedule_name("DUALPIPEV") == "DualPipeV"
    with pytest.raises(ValueError, match="'PipeDream' is unknown; choose one of GPipe, 1F1B, Interleaved1F1B"):
        resolve_schedule_name("PipeDream")


def test_microbatch_rules() -> None:
    assert num_microbatches(8, 2) == 4
    with pytest.raises(ValueError, match=r"local_batch_size = 6 is not divisible by .*microbatch_size = 4"):
        num_microbatches(6, 4)
    with pytest.raises(ValueError, match="1F1B needs at least 4 microbatches"):
        check_microbatches(schedule_spec("1F1B", "", 4), 3, 4, 4)
    with pytest.raises(ValueError, match="DualPipeV needs at least 8 microbatches"):
        check_microbatches(schedule_spec("DualPipeV", "", 4), 4, 4, 8)
    with pytest.raises(ValueError, match=r"multiple of its rounds max\(1, microbatches // pp\) = 2"):
        check_microbatches(schedule_spec("Interleaved1F1B", "", 2), 5, 2, 4)
    for n in (1, 2, 3, 4, 6):  # torch's interleaved rules accept these at pp 2
        check_microbatches(schedule_spec("InterleavedZeroBubble", "", 2), n, 2, 4)
    check_microbatches(schedule_spec("GPipe", "", 4), 1, 4, 4)


def test_zero_bubble_refuses_fsdp_resharding_and_compile() -> None:
    def check(name: str, *, resharding: bool = False, compile_enabled: bool = False) -> None:
        spec = schedule_spec(name, "", 2)
        check_split_backward(spec.name, spec.split_backward, resharding=resharding)
        kw = {"ac_mode": "full", "ac_option": "op"}  # CSV schedules': the table refuses the named ones' compile
        check_csv_split_backward(spec.name, spec.split_backward, compile_enabled=compile_enabled, **kw)

    with pytest.raises(ValueError, match="'always' with the ZBVZeroBubble schedule gives wrong gradients"):
        check("ZBVZeroBubble", resharding=True)
    check("1F1B", resharding=True)  # full backward: resharding is fine
    check("DualPipeV")
    with pytest.raises(ValueError, match=r"compile\.enable = true with the InterleavedZeroBubble schedule"):
        check("InterleavedZeroBubble", compile_enabled=True)


def test_example_csv_schedule() -> None:
    csv = read_csv_schedule("configs/pp_schedule_example.csv", 2)
    assert csv.n_microbatches == 4 and csv.stage_rank == {0: 0, 1: 1} and csv.split_backward
    assert simulate_idle_shares(csv.actions, 2) == pytest.approx([1 / 13, 1 / 13])


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("0F0,0B0\n", "1 lines but pipeline_parallel_degree = 2"),
        ("0F0,0X0\n1F0,1B0\n", r"line 1, column 2: '0X0' is not a compute action"),
        ("0F0,0B0\n0F1,1F0,1B0\n", "line 2, column 1: stage 0 already runs on line 1"),
        ("0F0,0B0\n1B0,1F0\n", r"line 2, column 1 \(1B0\): comes before 1F0"),
        ("0F0,0I0,0W0\n1F0,1W0,1I0\n", r"line 2, column 2 \(1W0\): comes before 1I0"),
        ("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n", "line 2: stage 1 must run F and then B"),
        ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "deadlocks: rank 0's action 2"),
        ("0F0,0B0\n2F0,2B0\n", r"stages \[0, 2\] are not numbered"),
    ],
)
def test_malformed_csv_names_the_line(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        read_csv_schedule(str(path), 2)


def test_csv_microbatches_must_match_the_batch() -> None:
    spec = schedule_spec("1F1B", "configs/pp_schedule_example.csv", 2)
    with pytest.raises(ValueError, match="schedules 4 microbatches but the step has 8"):
        check_microbatches(spec, 8, 2, 2)


def gpipe(pp: int, m: int) -> dict[int, list[tuple[int, str, int] | None]]:
    return {r: [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(pp)}


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 4)])
def test_simulated_gpipe_matches_the_closed_form(pp: int, m: int) -> None:
    shares = simulate_idle_shares(gpipe(pp, m), pp)
    assert shares == pytest.approx([single_stage_theory(pp, m)] * pp)


def test_busy_clock_idle_share() -> None:
    clock = BusyClock(torch.device("cpu"))
    with clock.step():
        with clock.busy(), clock.busy():  # nested sections count once
            time.sleep(0.05)
        time.sleep(0.05)  # waiting for a neighbour
    assert 0.3 < clock.take() < 0.7
    assert clock.take() == 0.0  # reset


class FakeCudaEvent:
    """A CUDA timing event on a fake device clock (milliseconds); counts the host waits."""

    clock_ms = 0.0
    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = -1.0

    def record(self) -> None:
        self.at = FakeCudaEvent.clock_ms

    def synchronize(self) -> None:
        FakeCudaEvent.waits += 1

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        return end.at - self.at


def test_cuda_busy_clock_never_waits_for_the_device_inside_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(1))
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(FakeCudaEvent, "waits", 0)
    clock = BusyClock(torch.device("cuda", 0))
    for _ in range(3):  # each step: 30 ms busy of 100 ms on the device
        with clock.step():
            with clock.busy():
                FakeCudaEvent.clock_ms += 30
            FakeCudaEvent.clock_ms += 70  # waiting for a neighbour
    assert syncs == [] and FakeCudaEvent.waits == 0  # no host synchronisation per step
    assert clock.take() == pytest.approx(0.7)  # a log step: one wait for the last event
    assert syncs == [] and FakeCudaEvent.waits == 1
    assert clock.take() == 0.0
