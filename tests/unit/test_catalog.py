"""The instance catalog: the seeds' types and HyperPod's GPU types, with GPUs, memory, EFA and SMDDP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpkit.catalog import INSTANCE_TYPES, SMDDP_TYPES, lookup, normalise
from hpkit.sagemaker.convert import convert
from hpkit.sagemaker.estimator import Estimator
from hpkit.validation import parse_document

SEEDS = Path("/work/shared/seeds")
# The types the seeds' estimators name (grep ml\. in /work/shared/seeds), kept here so that the test
# also runs where the seeds are not.
SEED_TYPES = ["ml.c5.2xlarge", "ml.g5.12xlarge", "ml.p3.16xlarge", "ml.p4d.24xlarge", "ml.p4de.24xlarge"]
HYPERPOD_FAMILIES = {
    "p4d": 1,
    "p4de": 1,
    "p5": 1,
    "p5e": 1,
    "p5en": 1,
    "p6-b200": 1,
    "g5": 8,
    "g6": 8,
    "g6e": 8,
}


def test_every_type_the_seeds_name_is_in_the_catalog():
    named = set(SEED_TYPES)
    if SEEDS.is_dir():
        for seed in SEEDS.iterdir():
            named |= set(re.findall(r"\bml\.[a-z0-9-]+\.[0-9]*x?large\b", seed.read_text(errors="replace")))
    missing = sorted(t for t in named if lookup(t) is None)
    assert not missing, f"not in hpkit/catalog.py: {missing}"


def test_p3_16xlarge_is_eight_v100_16gb_without_efa_or_smddp():
    row = lookup("ml.p3.16xlarge")
    assert row is not None and row.is_gpu
    assert (row.gpus, row.gpu, row.gpu_memory_gib, row.efa_devices, row.smddp) == (8, "V100", 16, 0, False)


@pytest.mark.parametrize("family", sorted(HYPERPOD_FAMILIES))
def test_hyperpod_families_have_their_sizes_in_both_spellings(family):
    sizes = [name for name in INSTANCE_TYPES if name.split(".")[0] == family]
    assert len(sizes) == HYPERPOD_FAMILIES[family], sizes
    for name in sizes:
        assert lookup(f"ml.{name}") is lookup(name) is lookup(f" ML.{name.upper()} ")


@pytest.mark.parametrize(
    ("name", "gpus", "gpu", "memory", "efa"),
    [
        ("p4d.24xlarge", 8, "A100", 40, 4),
        ("p4de.24xlarge", 8, "A100", 80, 4),
        ("p5.48xlarge", 8, "H100", 80, 32),
        ("p5e.48xlarge", 8, "H200", 141, 32),
        ("p5en.48xlarge", 8, "H200", 141, 16),
        ("p6-b200.48xlarge", 8, "B200", 179, 8),
        ("g5.12xlarge", 4, "A10G", 24, 1),
        ("g5.xlarge", 1, "A10G", 24, 0),
        ("g6.48xlarge", 8, "L4", 24, 1),
        ("g6e.24xlarge", 4, "L40S", 48, 2),
        ("g6e.48xlarge", 8, "L40S", 48, 4),
    ],
)
def test_rows_as_documented(name, gpus, gpu, memory, efa):
    row = INSTANCE_TYPES[name]
    assert (row.gpus, row.gpu, row.gpu_memory_gib, row.efa_devices) == (gpus, gpu, memory, efa)


def test_rows_are_consistent():
    for name, row in INSTANCE_TYPES.items():
        assert name == normalise(name), name
        if row.is_gpu:
            assert row.gpu and row.gpu_memory_gib > 0, name
        else:
            assert (row.gpu, row.gpu_memory_gib, row.efa_devices, row.smddp) == ("", 0, 0, False), name
    assert lookup("ml.c5.2xlarge") is not None and not lookup("ml.c5.2xlarge").is_gpu
    assert lookup(None) is None and lookup("ml.x9.huge") is None


def test_smddp_is_supported_on_p4d_and_p4de_only():
    assert SMDDP_TYPES == ("ml.p4d.24xlarge", "ml.p4de.24xlarge")


def test_importer_takes_gpus_from_the_catalog_and_warns_on_unknown_types():
    def imported(instance_type: str):
        est = parse_document(
            Estimator, {"entry_point": "t.py", "instance_count": 2, "instance_type": instance_type}, "est"
        )
        return convert(est)

    assert imported("ml.p3.16xlarge").data["gpus_per_node"] == 8
    assert not [w for w in imported("ml.p3.16xlarge").warnings if w.field == "instance_type"]
    unknown = [w.line() for w in imported("ml.x9.huge").warnings if w.field == "instance_type"]
    assert len(unknown) == 1 and "not a GPU type in hpkit's instance catalog" in unknown[0]
