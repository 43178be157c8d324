"""Comparing the ranks' collectives of a cell (pure: no engines)."""

from __future__ import annotations

from mlx_nbdist.mismatch import first_mismatch, signature

A4 = signature("all_sum", (4,), "float32")
A6 = signature("all_sum", (6,), "float32")
G4 = signature("all_gather", (4,), "float32")


def test_equal_collectives_agree() -> None:
    assert first_mismatch({0: {1: A4, 2: G4}, 1: {1: A4, 2: G4}}) is None


def test_positions_known_on_one_rank_only_are_not_a_difference() -> None:
    # a status file keeps the last records only, and a rank may not have got there yet
    assert first_mismatch({0: {1: A4, 2: G4}, 1: {2: G4, 3: A6}}) is None


def test_the_first_differing_position_is_named_with_each_ranks_collective() -> None:
    found = first_mismatch({0: {1: A4, 2: A4}, 1: {1: A4, 2: A6}, 2: {1: A4, 2: A6}})
    assert found is not None
    assert found.startswith("collective 2 of this cell differs between the ranks")
    assert "rank 0: all_sum shape=(4,) dtype=float32" in found
    assert "ranks 1, 2: all_sum shape=(6,) dtype=float32" in found


def test_op_dtype_and_check_flag_count() -> None:
    assert first_mismatch({0: {1: A4}, 1: {1: G4}}) is not None
    assert first_mismatch({0: {1: A4}, 1: {1: signature("all_sum", (4,), "float16")}})
    assert first_mismatch({0: {1: A4}, 1: {1: signature("all_sum", (4,), "float32", True)}})
