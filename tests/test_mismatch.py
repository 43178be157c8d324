"""Comparing the ranks' collectives of a cell (pure: no engines)."""

from __future__ import annotations

from mlx_nbdist.mismatch import first_mismatch, lone_trace, signature

A4 = signature("all_sum", (4,), "float32")
A6 = signature("all_sum", (6,), "float32")
G4 = signature("all_gather", (4,), "float32")


def at(*sigs, trace: str = "", start: int = 1):
    return {(trace, start + i): sig for i, sig in enumerate(sigs)}


def test_equal_collectives_agree() -> None:
    assert first_mismatch({0: at(A4, G4), 1: at(A4, G4)}) is None


def test_positions_known_on_one_rank_only_are_not_a_difference() -> None:
    # a status file keeps the last records only, and a rank may not have got there yet
    assert first_mismatch({0: at(A4, G4), 1: at(G4, A6, start=2)}) is None


def test_a_trace_on_one_rank_only_is_not_compared_with_the_others_runs() -> None:
    # rank 0's compiled call hit the cache; rank 1 traced it again (another batch size)
    assert first_mismatch({0: at(A4), 1: {**at(A6, trace="compile:step#1"), **at(A4)}}) is None


def test_the_same_trace_on_two_ranks_is_compared() -> None:
    found = first_mismatch({0: at(A4, trace="compile:step#1"), 1: at(A6, trace="compile:step#1")})
    assert found is not None and found.startswith("collective 1 of mx.compile's trace of step differs")


def test_the_first_differing_position_is_named_with_each_ranks_collective() -> None:
    found = first_mismatch({0: at(A4, A4), 1: at(A4, A6), 2: at(A4, A6)})
    assert found is not None
    assert found.startswith("collective 2 of this cell differs between the ranks")
    assert "rank 0: all_sum shape=(4,) dtype=float32" in found
    assert "ranks 1, 2: all_sum shape=(6,) dtype=float32" in found


def test_op_dtype_and_check_flag_count() -> None:
    assert first_mismatch({0: at(A4), 1: at(G4)}) is not None
    assert first_mismatch({0: at(A4), 1: at(signature("all_sum", (4,), "float16"))})
    assert first_mismatch({0: at(A4), 1: at(signature("all_sum", (4,), "float32", True))})


def test_a_trace_recorded_on_some_ranks_only_is_named_as_not_comparable() -> None:
    assert lone_trace({0: {"compile:step#1"}, 1: {"compile:step#1"}}) is None
    assert lone_trace({0: set(), 1: set()}) is None
    found = lone_trace({0: set(), 1: {"compile:step#1"}, 2: {"compile:step#1"}})
    assert found is not None and found.startswith(
        "mx.compile's trace of step recorded collectives on ranks 1, 2 but not on rank 0")
