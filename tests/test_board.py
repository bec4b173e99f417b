"""The load board's arithmetic: what a policy compares for one rank."""

from __future__ import annotations

from dprouter.fleet.board import Board


def test_alone_a_router_sees_its_own_count_exactly_between_reports() -> None:
    board = Board(slots=4)
    board.add(0, 3, 0)
    board.report(0, 3)  # the engine runs what this router sent
    assert board.load_of(0) == 3
    board.add(0, 1, 0)
    assert board.load_of(0) == 4
    board.add(0, -2, 0)  # two finished before the next report
    assert board.load_of(0) == 2
    board.report(0, 1)  # a report that lags (one still on its way): never below our count
    assert board.load_of(0) == 2


def test_beside_other_replicas_the_engine_report_counts_plus_what_was_sent_since() -> None:
    board = Board(slots=4)
    board.add(1, 1, 0)
    board.report(1, 5)  # 4 of them came from other replicas
    assert board.load_of(1) == 5
    board.add(1, 2, 0)  # sent since the report: not in it yet
    assert board.load_of(1) == 7
    board.add(1, -1, 0)
    assert board.load_of(1) == 6
    board.report(1, 6)  # the engine now counts ours too: nothing twice
    assert board.load_of(1) == 6


def test_a_released_row_takes_its_requests_out_of_the_load() -> None:
    board = Board(rows=2, row=0, slots=4)
    board.add(2, 3, 30)
    board.report(2, 5)
    board.add(2, 1, 10)
    assert board.load_of(2) == 6
    board.release(0)  # the process that sent all four died
    assert board.inflight_of(2) == 0 and board.load_of(2) == 2  # the others, as reported
