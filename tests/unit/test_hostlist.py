"""hpkit.slurm.hostlist reads a host list as Slurm does. Each expected list is what `scontrol show hostnames`
of Slurm 22.05 (Debian 12's) printed for it, except the suffix case, which 22.05 refuses and later releases read."""

from __future__ import annotations

import pytest

from hpkit.slurm.hostlist import HostlistError, compress, expand, first


@pytest.mark.parametrize(
    ("hostlist", "names"),
    [
        ("node[1-3,7],login1", ["node1", "node2", "node3", "node7", "login1"]),
        ("node[3,1-2]", ["node3", "node1", "node2"]),  # the order given, not sorted
        ("n[1-2],n1", ["n1", "n2", "n1"]),  # duplicates kept
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[07-9]", ["n07", "n08", "n09"]),  # the first number's width
        ("n[009-11]", ["n009", "n010", "n011"]),
        ("a[8-010]", ["a8", "a9", "a10"]),
        ("n[0-2]", ["n0", "n1", "n2"]),
        ("x[1-2]y[3-4]", ["x1y3", "x1y4", "x2y3", "x2y4"]),  # two brackets: the first outermost
        # More: the last fastest, then the first, the second, ...
        (
            "a[1-2]b[1-2]c[1-2]",
            ["a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2", "a1b2c1", "a1b2c2", "a2b2c1", "a2b2c2"],
        ),
        (
            "b[009-11]x[1-2]y[03-4]",
            [
                "b009x1y03",
                "b009x1y04",
                "b010x1y03",
                "b010x1y04",
                "b011x1y03",
                "b011x1y04",
                "b009x2y03",
                "b009x2y04",
                "b010x2y03",
                "b010x2y04",
                "b011x2y03",
                "b011x2y04",
            ],
        ),
        (
            "r[1-2]-[2,5]-n[7]",
            ["r1-2-n7", "r2-2-n7", "r1-5-n7", "r2-5-n7"],
        ),
        ("n[1-2]-x[1-2]", ["n1-x1", "n1-x2", "n2-x1", "n2-x2"]),
        ("ip-10-1-[2-3]", ["ip-10-1-2", "ip-10-1-3"]),
        (" n1, n2", ["n1", "n2"]),
        ("n1 n2", ["n1", "n2"]),  # whitespace separates too
        ("n[1-2],", ["n1", "n2"]),
        (",n1", ["n1"]),
        ("", []),
        ("ip-10-1-2-[3,4]-ib", ["ip-10-1-2-3-ib", "ip-10-1-2-4-ib"]),  # a suffix (24.11 reads it)
    ],
)
def test_expand_as_slurm_does(hostlist, names):
    assert expand(hostlist) == names


@pytest.mark.parametrize("hostlist", ["n[3-1]", "n[]", "n[1,,2]", "n[a-b]", "n[1-2", "n]1[", "n[[1]]"])
def test_a_list_slurm_refuses_is_one_line_naming_it(hostlist):
    with pytest.raises(HostlistError, match=r"^invalid host list '") as caught:
        expand(hostlist)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "hostlist", ["n[1-65537]", "a[1-300]b[1-300]", "n[1-40000],m[1-40000]", "n[1-40000,1-40000]"]
)
def test_a_list_of_more_hosts_than_a_cluster_has_is_refused_before_it_is_written_out(hostlist):
    with pytest.raises(HostlistError, match=r"more than 65,536 hosts"):
        expand(hostlist)


def test_first_is_the_first_name_or_none():
    assert first("gpu-[007-010],a1") == "gpu-007"
    assert first("") is None
    assert first("n[3-1]") is None


@pytest.mark.parametrize(
    "names",
    [["n3", "n1", "n2", "n10"], ["m01", "m02", "m1"], ["x", "y1", "y"], ["gpu-007", "gpu-008", "gpu-010"]],
)
def test_compress_gives_back_the_names(names):
    assert sorted(expand(compress(names))) == sorted(set(names))
