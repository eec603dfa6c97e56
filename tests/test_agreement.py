"""Ranks that disagree raise on EVERY rank, naming what differs, and never train or hang
(spawned gloo groups with a 60 s process-group timeout; cases in cases_agreement.py)."""
from __future__ import annotations

import functools
import tempfile

import pytest
import torch

import cases_agreement
from cases_two_optimizers import INF_STEP
from dist_helper import case_values, run_cases, run_distributed
from parity import ATOL, RTOL

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
    "case_moment_format_differs": "moment formats (exp_avg_dtype, exp_avg_sq_dtype) (rank 0: {'exp_avg': "
                                  "'float32', 'exp_avg_sq': 'float32'}, rank 1: {'exp_avg': 'float32', "
                                  "'exp_avg_sq': 'bfloat16'}",
    "case_low_bit_format_differs": "moment formats (exp_avg_dtype, exp_avg_sq_dtype) (rank 0: {'exp_avg': "
                                   "'bfloat16', 'exp_avg_sq': 'float32'}, rank 1: {'exp_avg': '4bit (block 128)', "
                                   "'exp_avg_sq': 'float32'}",
    "case_quant_block_size_differs": "moment formats (exp_avg_dtype, exp_avg_sq_dtype) (rank 0: {'exp_avg': "
                                     "'8bit (block 256)', 'exp_avg_sq': '8bit (block 256)'}, rank 1: {'exp_avg': "
                                     "'8bit (block 64)', 'exp_avg_sq': '8bit (block 64)'}",
    "case_lr_differs_at_construction": "param group hyperparameters",
    "case_offload_differs": "offload (offload, offload_fraction) (rank 0: {'offload': None, 'offload_fraction': "
                            "None}, rank 1: {'host memory': 'fits', 'offload': 'cpu', 'offload_fraction': 0.5}",
    "case_offload_fraction_differs": "offload (offload, offload_fraction) (rank 0: {'host memory': 'fits', "
                                     "'offload': 'cpu', 'offload_fraction': 1.0}, rank 1: {'host memory': 'fits', "
                                     "'offload': 'cpu', 'offload_fraction': 0.5}",
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
def test_offload_short_of_host_memory_or_pinning_raises_on_every_rank_before_state_moves(world):
    """Too little host memory (on one rank: the agreement names its shortfall; on all: each raises
    its own error naming the bytes), or a failed pin on one rank (its outcome agreed): every rank
    raises, none waits in a collective another left, and rank 0's weights were not broadcast."""
    for rank, value in enumerate(case_values(_results(world), "case_offload_host_short_on_one_rank")):
        error = value["error"]
        assert error.startswith("ValueError") and "built different optimizers" in error, (rank, error)
        assert "offload (offload, offload_fraction) (rank 0: {'host memory': 'fits'" in error, (rank, error)
        assert "rank 1: {'host memory': 'needs " in error and "> 1000 B available (MemAvailable)" in error
        assert value["untouched"], rank
    for rank, value in enumerate(case_values(_results(world), "case_offload_host_short_on_every_rank")):
        assert value["error"].startswith("RuntimeError: DistributedFusedAdam(offload='cpu'): too little host "
                                         "memory"), (rank, value["error"])
        assert "1000 B are available (MemAvailable)" in value["error"] and value["untouched"], rank
    for rank, value in enumerate(case_values(_results(world), "case_offload_pin_fails_on_one_rank")):
        error = value["error"]
        assert "offloaded state allocated on the host" in error, (rank, error)
        assert f"rank {world - 1}: 'allocating " in error and "cudaHostAlloc failed" in error, (rank, error)
        assert value["untouched"], rank


@pytest.mark.parametrize("world", WORLDS)
def test_two_optimizers_over_one_group(world):
    """Two optimizers over one group: rounds one after the other are fine (both alive, in any
    order), and so is one loss through both models (it used to raise at each step: its
    reduce-scatters now wait for the end of the backward, in build order; exactness against
    torch in test_two_optimizers_over_one_group_train_exactly)."""
    values = case_values(_results(world), "case_two_optimizers_one_group")
    for value in values:
        assert value["sequential"] == ["NO ERROR"] * 4, value["sequential"]
        assert value["rebuilt"] == "NO ERROR"
        assert value["at_step"] == ["NO ERROR"] * 2, value["at_step"]
        assert value["trained"] == [True, True]
        assert value["after"] == "NO ERROR"
        assert all(torch.equal(p, q) for p, q in zip(value["model"], values[0]["model"]))


# case_two_opt_<pattern> (cases_two_optimizers.py): models A and B, two DistributedFusedAdam over one group
# (A built first) against two torch AdamW. Per step, the order the ranks launched the
# optimizers' reduce-scatters in, as runs of one optimizer's buckets: a backward reaching one
# optimizer launches its buckets as they complete (during the backward); one reaching both
# launches at its end, A's buckets then B's (build order), whatever order its hooks fired in;
# in a reentrant backward nested in B's round, A joins it and launches after B.
TWO_OPT = {
    "ab": ("ab", "ab"), "ab_step_ba": ("ab", "ab"), "gan_frozen": ("ba", "ab"), "gan_not_frozen": ("bab", "b"),
    "no_sync": ("ab", "ab"), "shared": ("ab", ""), "chain": ("ab", ""), "chain_reentrant": ("ba", "b"),
    "no_sync_shared": ("ab", ""), "scaler": ("ab", "ab"), "scaler_shared": ("ab", ""),
}


def _runs(log):
    """Per step: the launches as runs of one optimizer's buckets ("ab": all of A's, then all of B's)."""
    steps, runs = [], None
    for entry in log:
        if entry[0] == "step":
            runs = []
            steps.append(runs)
        elif runs and runs[-1][0] == entry[0]:
            runs[-1][1].append(entry[1])
        else:
            runs.append((entry[0], [entry[1]]))
    return steps


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("pattern", sorted(TWO_OPT))
def test_two_optimizers_over_one_group_train_exactly(world, pattern):
    order, during = TWO_OPT[pattern]
    values = case_values(_results(world), f"case_two_opt_{pattern}")
    for rank, value in enumerate(values):
        for step, (ours, ref) in enumerate(zip(value["ours"], value["ref"])):
            for i, (p, q) in enumerate(zip(ours, ref)):
                torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"rank {rank} step {step} param {i}: {m}")
        assert value["scale"] == value["ref_scale"], (rank, value["scale"], value["ref_scale"])
        # every rank launched the same reduce-scatters in the same order (gloo aborts on a pair of
        # different sizes, and sums same-sized ones of different optimizers silently)
        assert value["log"] == values[0]["log"], f"rank {rank} launched in another order than rank 0"
    value = values[0]
    assert any(not torch.equal(p, q) for p, q in zip(value["ours"][0], value["ours"][-1])), "nothing trained"
    for step, runs in enumerate(_runs(value["log"])):
        assert "".join(name for name, _ in runs) == order, (step, runs)
        for name, sizes in runs:
            assert sizes == value["buckets"][name], (step, name, sizes)  # every bucket, in order
    launched_during = {name for name, d in value["during"] if d}
    assert launched_during == set(during), (launched_during, during)
    if pattern.startswith("scaler"):  # the inf on one rank in B skipped that step and backed off
        assert value["scale"][INF_STEP] == value["scale"][INF_STEP - 1] / 2, value["scale"]


@pytest.mark.parametrize("world", WORLDS)
def test_two_optimizers_backward_in_two_threads_at_once_refused(world):
    """The one pattern left unsafe: backward passes of two threads at once over optimizers of one
    group. Each step raises on every rank (within the bound), naming both optimizers, the
    collective and the fix; nothing trains; after zero_grad both train again."""
    values = case_values(_results(world), "case_two_opt_threads_refused")
    for rank, value in enumerate(values):
        assert value["forced"], value
        for error in value["at_step"]:
            assert error.startswith("ValueError: DistributedFusedAdam: optimizers over one process group received "
                                    "gradients in backward passes running at the same time in several threads"), error
            assert "optimizer #1 built over the group (7 params" in error and "optimizer #2" in error, error
            assert "reduce-scatters" in error and "torch.distributed.new_group" in error, error
        assert value["untouched"] and value["seconds"] < 2 * cases_agreement.ORDER_BOUND + 15, value
        assert value["after"] == ["NO ERROR"] * 2 and value["trained"], value
        assert all(torch.equal(p, q) for p, q in zip(value["model"], values[0]["model"]))


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
