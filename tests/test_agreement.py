"""Ranks that disagree raise on EVERY rank, naming what differs, and never train or hang
(spawned gloo groups with a 60 s process-group timeout; cases in cases_agreement.py)."""
from __future__ import annotations

import functools
import tempfile

import pytest
import torch

import cases_agreement
from dist_helper import case_values, run_cases, run_distributed

WORLDS = [2, 3]


@functools.lru_cache(maxsize=None)
def _results(world: int):
    tmp = tempfile.mkdtemp(prefix="shardamp-agreement-")
    return run_distributed(run_cases, world, "cases_agreement", cases_agreement.CASES, {"tmp": tmp},
                           timeout=400, pg_timeout=60)


def _errors(world, case):
    return [v["error"] for v in case_values(_results(world), case)]


CONSTRUCTION = {
    "case_same_numel_other_shapes": "param shapes (item 0: rank 0: (6, 4), rank 1: (4, 6)",
    "case_param_count_differs": "number of params",
    "case_bucket_cap_differs": "bucket_cap_mb",
    "case_dtype_differs": "param dtypes",
    "case_lr_differs_at_construction": "param group hyperparameters",
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", sorted(CONSTRUCTION))
def test_construction_disagreement_raises_on_every_rank(world, case):
    for rank, error in enumerate(_errors(world, case)):
        assert error.startswith("ValueError") and "built different optimizers" in error, (rank, error)
        assert CONSTRUCTION[case] in error, (rank, error)
    if case == "case_same_numel_other_shapes":  # nothing was touched: no weights taken from rank 0
        assert all(v["untouched"] for v in case_values(_results(world), case))


@pytest.mark.parametrize("world", WORLDS)
def test_two_optimizers_over_one_group_raise(world):
    """Two optimizers over one group: rounds one after the other are fine (both alive, in any
    order); overlapping rounds raise at each one's step, on every rank, before anything trains."""
    for value in case_values(_results(world), "case_two_optimizers_one_group"):
        assert value["sequential"] == ["NO ERROR"] * 4, value["sequential"]
        assert value["rebuilt"] == "NO ERROR"
        for error in value["at_step"]:
            assert "received gradients while this one held gradients" in error, error
        assert value["untouched"]
        assert value["after"] == "NO ERROR"


PER_STEP = {
    "case_lr_differs_per_step": ("RuntimeError", "hyperparameters (lr, betas"),
    "case_norm_type_differs": ("RuntimeError", "norm_type"),
    "case_eps_differs_under_inf_norm": ("RuntimeError", "hyperparameters (lr, betas"),
    "case_tensor_lr_differs": ("RuntimeError", "the value of the tensor lr of param_groups[0]"),
    "case_max_grad_norm_differs": ("RuntimeError", "options (max_grad_norm"),
    "case_nan_tensor_lr_on_one_rank": ("ValueError", "param_groups[0]: lr=tensor(nan)"),
    "case_bad_betas_on_one_rank": ("ValueError", "param_groups[0]: betas"),
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", sorted(PER_STEP))
def test_per_step_disagreement_raises_on_every_rank_and_trains_nothing(world, case):
    kind, what = PER_STEP[case]
    for rank, value in enumerate(case_values(_results(world), case)):
        # an invalid value is named by the rank that has it; the others say another rank has one
        expected = what if kind == "RuntimeError" or rank == 1 else "invalid on some rank"
        assert value["error"].startswith(kind) and expected in value["error"], (rank, value["error"])
        assert value["untouched"], f"rank {rank} trained on mismatched values"


@pytest.mark.parametrize("world", WORLDS)
def test_agreeing_ranks_train(world):
    for value in case_values(_results(world), "case_agreeing_ranks_still_train"):
        assert value["error"] == "NO ERROR" and not value["untouched"]


ONE_RANK = ["case_load_state_dict_on_one_rank", "case_state_dict_on_one_rank", "case_save_sharded_on_one_rank",
            "case_load_sharded_on_one_rank"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ONE_RANK)
def test_collective_called_on_one_rank_raises_in_bounded_time(world, case):
    values = case_values(_results(world), case)
    name = case[len("case_"):-len("_on_one_rank")]
    assert values[0]["error"].startswith("RuntimeError") and f"{name} is a collective" in values[0]["error"]
    assert values[0]["seconds"] < 30
    if "untouched" in values[0]:
        assert all(v["untouched"] for v in values)
    if "written" in values[0]:
        assert not any(v["written"] for v in values)


@pytest.mark.parametrize("world", WORLDS)
def test_different_collectives_and_inputs_raise_on_every_rank(world):
    for value in case_values(_results(world), "case_different_collectives"):
        assert "called different collectives" in value["error"]
    for value in case_values(_results(world), "case_different_state_dicts"):
        assert "given different arguments" in value["error"] and value["untouched"]


# Collectives that do not line up (rank 1 misbehaves at iteration 2 = step 3): the error on EVERY rank
# names the sequence of shardamp collectives, the step, every rank's position and the likely
# cause, within the bound (SHARDAMP_COLLECTIVE_TIMEOUT = cases_agreement.ORDER_BOUND s, waited
# once, plus at most as long for the other ranks' reports) and well before the group's 60 s.
ORDER = {
    "case_order_skipped_step": "rank 1 skipped a step the others took",
    "case_order_skipped_step_group_timeout": "rank 1 skipped a step the others took",
    "case_order_skipped_step_kept_grads": "rank 1 ran 2 backward passes",
    "case_order_extra_backward": "rank 1 ran 2 backward passes",
    "case_order_second_norm_type_on_one_rank": "a collective was called on some ranks only",
}


def _check_order_error(world: int, rank: int, value: dict, cause: str, waited: str) -> str:
    """The collective-order message on ``rank``: its wait, the step, the cause, every rank's
    position (from the store), raised within twice the bound; returns the message."""
    bound = cases_agreement.ORDER_BOUND
    error = value["error"]
    assert error.startswith("RuntimeError: DistributedFusedAdam: the ranks disagree on the sequence of "
                            "shardamp collectives"), (rank, error)
    assert f"This rank (rank {rank}) waited {waited}" in error and "at step 3" in error, (rank, error)
    assert cause in error, (rank, error)
    for other in range(world):
        assert f"rank {other}: in " in error, (rank, other, error)
    # the rank that skipped step() waits first in the next iteration's backward
    assert value["at"] in (2, 3) and value["seconds"] < 2 * bound + 15, (rank, value)
    return error


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", sorted(ORDER))
def test_collectives_out_of_order_raise_on_every_rank_in_bounded_time(world, case):
    bound = cases_agreement.ORDER_BOUND
    waited = "the process group's timeout" if case.endswith("group_timeout") else f"{bound:g} s"
    for rank, value in enumerate(case_values(_results(world), case)):
        _check_order_error(world, rank, value, ORDER[case], waited)


@pytest.mark.parametrize("world", WORLDS)
def test_clip_on_some_ranks_only_raises_on_every_rank(world):
    # before the stats: caught by the next step's all-reduce (which call starts the stats may
    # differ legitimately between ranks, so it is not compared in the same step)
    for rank, value in enumerate(case_values(_results(world), "case_order_clip_on_one_rank")):
        assert value["error"].startswith("RuntimeError") and "clip_grad_norm calls of the previous step" in value["error"]
        assert value["at"] == 3, (rank, value)
    # after the stats (grad_norm first): caught at the next step's all-reduce
    for rank, value in enumerate(case_values(_results(world), "case_order_clip_after_stats_on_one_rank")):
        assert value["error"].startswith("RuntimeError") and "clip_grad_norm calls of the previous step" in value["error"]
        assert value["at"] == 3, (rank, value)


@pytest.mark.parametrize("world", WORLDS)
def test_grad_norm_read_on_one_rank_is_fine(world):
    for value in case_values(_results(world), "case_order_grad_norm_logged_on_one_rank"):
        assert value["error"] == "NO ERROR", value
    # rank 0 logs the norm first, then every rank clips: the stats start from different calls
    values = case_values(_results(world), "case_order_grad_norm_logged_then_clip_everywhere")
    for value in values:
        assert value["error"] == "NO ERROR", value
    for value in values[1:]:
        assert all(torch.equal(a, b) for a, b in zip(value["params"], values[0]["params"]))


# The same mismatches with the watchdog (SHARDAMP_COLLECTIVE_WATCHDOG=force): the path of CUDA
# params, where no wait is bounded on the host; the monitor thread of collective_watchdog.py
# finds the stuck collective, exchanges positions through the store, aborts the optimizer's
# groups and ends the wait. The same message, on every rank, within the bound, and again at the
# next optimizer call.
WATCHED = {case.replace("case_order_", "case_watched_"): cause for case, cause in ORDER.items()}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", sorted(WATCHED))
def test_watchdog_ends_mismatched_collectives_on_every_rank_in_bounded_time(world, case):
    bound = cases_agreement.ORDER_BOUND
    waited = (f"{bound:g} s (the process group's timeout less min(60 s, half of it)" if case.endswith("group_timeout")
              else f"{bound:g} s (SHARDAMP_COLLECTIVE_TIMEOUT)")
    for rank, value in enumerate(case_values(_results(world), case)):
        error = _check_order_error(world, rank, value, WATCHED[case], waited)
        assert "shardamp's collective watchdog" in error, (rank, error)
        assert value["again"] == error, (rank, value["again"])  # every later call raises it
        assert value["aborted"] == 4, (rank, value)  # the group, its control, calls and gather groups


@pytest.mark.parametrize("world", WORLDS)
def test_watchdog_ends_a_collective_call_on_one_rank(world):
    bound = cases_agreement.ORDER_BOUND
    value = case_values(_results(world), "case_watched_state_dict_on_one_rank")[0]
    error = value["error"]
    assert error.startswith("RuntimeError: state_dict is a collective") and "did not join it" in error, error
    assert "waited 3 s (SHARDAMP_COLLECTIVE_TIMEOUT) in the agreement all-reduce of a collective call" in error, error
    assert "shardamp's collective watchdog" in error and value["aborted"] == 4, value
    assert value["seconds"] < 2 * bound + 15, value


@pytest.mark.parametrize("world", WORLDS)
def test_collective_call_never_pairs_with_the_stats_all_reduce(world):
    bound = cases_agreement.ORDER_BOUND
    for rank, value in enumerate(case_values(_results(world), "case_call_meets_stats_all_reduce")):
        if rank == 0:
            assert value["error"].startswith("RuntimeError: state_dict is a collective"), value["error"]
        else:
            assert "the ranks disagree on the sequence of shardamp collectives" in value["error"], value["error"]
            assert "the step's stats all-reduce" in value["error"], value["error"]
        assert value["at"] == 2 and value["seconds"] < 2 * bound + 15, (rank, value)


@pytest.mark.parametrize("world", WORLDS)
def test_clip_on_some_ranks_in_the_last_step_raises_at_state_dict(world):
    for value in case_values(_results(world), "case_clip_in_last_step_on_one_rank"):
        assert value["agreeing"] == "NO ERROR"
        for call in ("state_dict", "save_sharded"):
            assert value[call].startswith(f"RuntimeError: {call}: the ranks' last step clipped differently"), value
        assert not value["written"]
