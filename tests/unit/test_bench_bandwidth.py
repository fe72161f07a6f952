"""nccl-tests' algbw/busbw formulas against values worked out by hand, and the size sweep."""

from __future__ import annotations

from fractions import Fraction

import pytest

from hpkit.netbench.bandwidth import algbw_gbps, bus_factor, busbw_gbps
from hpkit.netbench.results import BenchRow, from_csv, to_csv
from hpkit.sizes import human, parse_size, sweep


@pytest.mark.parametrize(
    ("op", "ranks", "factor"),
    [
        ("all_reduce", 4, Fraction(3, 2)),  # 2(n-1)/n = 6/4
        ("all_reduce", 16, Fraction(15, 8)),
        ("all_reduce", 1, Fraction(0)),
        ("all_gather", 4, Fraction(3, 4)),
        ("reduce_scatter", 8, Fraction(7, 8)),
        ("all_to_all", 2, Fraction(1, 2)),
        ("broadcast", 16, Fraction(1)),
        ("reduce", 3, Fraction(1)),
    ],
)
def test_bus_factor_matches_nccl_tests(op, ranks, factor):
    assert bus_factor(op, ranks) == factor


def test_hand_computed_bandwidths():
    # 1 GiB all_reduce over 16 ranks in 5 ms: algbw = 1073741824 / 0.005 / 1e9 = 214.7483648 GB/s,
    # busbw = 214.7483648 * 30/16 = 402.65318400 GB/s.
    assert algbw_gbps(1073741824, 0.005) == pytest.approx(214.7483648, rel=1e-12)
    assert busbw_gbps("all_reduce", 1073741824, 0.005, 16) == pytest.approx(402.653184, rel=1e-12)
    # all_gather of 4 x 1 MiB chunks (S = 4 MiB) over 4 ranks in 1 ms: 4.194304 GB/s, busbw x 3/4.
    assert busbw_gbps("all_gather", 4 * 2**20, 0.001, 4) == pytest.approx(3.145728, rel=1e-12)
    # broadcast: busbw is algbw.
    assert busbw_gbps("broadcast", 10**9, 2.0, 8) == pytest.approx(0.5)
    # all_to_all of an 8 MB send buffer over 2 ranks in 4 ms: 2 GB/s algbw, 1 GB/s busbw.
    assert busbw_gbps("all_to_all", 8 * 10**6, 0.004, 2) == pytest.approx(1.0)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        bus_factor("allreduce", 4)
    with pytest.raises(ValueError, match="ranks must be at least 1"):
        bus_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="time must be positive"):
        algbw_gbps(8, 0.0)


def test_sizes_follow_nccl_tests_units():
    assert [parse_size(s) for s in ("8", "64K", "1M", "8G", "2kb")] == [8, 65536, 2**20, 8 * 2**30, 2048]
    assert sweep(8, 128, 2) == [8, 16, 32, 64, 128]
    assert sweep(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert human(8 * 2**30) == "8G" and human(1536) == "1536"
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("eight")
    with pytest.raises(ValueError, match="larger than the largest"):
        sweep(64, 8, 2)
    with pytest.raises(ValueError, match="at least 2"):
        sweep(8, 64, 1)


def test_csv_round_trip():
    row = BenchRow("hpkit", "all_gather", 4, 4096, 256, "float", False, 12.5, 0.3, 0.225, None, "gloo")
    assert from_csv(to_csv([row])) == [row]
