"""The instance catalog: what each instance type has (GPUs, GPU memory, EFA interfaces) and whether SMDDP supports it.

One table that the checker, the SageMaker importer and the runtime all read. Torch-free and import-light.
Every row was checked against AWS's documentation; the source of each family is noted above its rows.
`efa_devices` is the most EFA interfaces the type takes (one per network card that supports EFA); 0
means the type has no EFA.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceSpec:
    gpus: int
    gpu: str  # the GPU model, "" for CPU types
    efa_devices: int
    smddp: bool = False  # SageMaker's data-parallel library supports only these
    gpu_memory_gib: int = 0  # per GPU
    vcpus: int = 0  # vCPUs of the whole instance (AWS's figure)

    @property
    def is_gpu(self) -> bool:
        return self.gpus > 0


def _size_vcpus(name: str) -> int:
    """vCPUs of a G5/G6/G6e size: 4 per "xlarge" (xlarge 4, 2xlarge 8, ..., 48xlarge 192), as AWS lists them."""
    multiple = name.split(".")[1].removesuffix("xlarge")
    return 4 * (int(multiple) if multiple else 1)


def _sizes(gpu: str, memory: int, rows: dict[str, tuple[int, int]]) -> dict[str, InstanceSpec]:
    """One family's sizes: name -> (GPUs, EFA interfaces)."""
    return {
        name: InstanceSpec(gpus, gpu, efa, gpu_memory_gib=memory, vcpus=_size_vcpus(name))
        for name, (gpus, efa) in rows.items()
    }


# EC2 names; HyperPod and SageMaker spell the same types with an "ml." prefix (see normalise()).
INSTANCE_TYPES: dict[str, InstanceSpec] = {
    # P3: https://aws.amazon.com/ec2/instance-types/p3/ (8 × V100 16 GB, NVLink; EFA only on p3dn)
    # SMDDP: https://docs.aws.amazon.com/sagemaker/latest/dg/distributed-data-parallel-support.html and
    # .../model-parallel-core-features-v2-smddp-allgather.html ("The SMDDP library supports P4 and P4de").
    "p3.16xlarge": InstanceSpec(8, "V100", 0, gpu_memory_gib=16, vcpus=64),
    # P4: https://aws.amazon.com/ec2/instance-types/p4/ (A100 40 GB / 80 GB, 400 Gbps EFA = 4 cards)
    "p4d.24xlarge": InstanceSpec(8, "A100", 4, smddp=True, gpu_memory_gib=40, vcpus=96),
    "p4de.24xlarge": InstanceSpec(8, "A100", 4, smddp=True, gpu_memory_gib=80, vcpus=96),
    # P5, P5e, P5en: https://aws.amazon.com/ec2/instance-types/p5/ and
    # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html (P5/P5e: 32 network
    # cards, 3200 Gbps; P5en: 16 × 200 Gbps EFAv3)
    "p5.48xlarge": InstanceSpec(8, "H100", 32, gpu_memory_gib=80, vcpus=192),
    "p5e.48xlarge": InstanceSpec(8, "H200", 32, gpu_memory_gib=141, vcpus=192),
    "p5en.48xlarge": InstanceSpec(8, "H200", 16, gpu_memory_gib=141, vcpus=192),
    # P6-B200: https://aws.amazon.com/ec2/instance-types/p6/ (8 × B200 179 GB, 8 × 400 Gbps EFAv4).
    # Not confirmed through the search tool's stored pages (nor P5en's 16 cards): re-check on AWS's page.
    "p6-b200.48xlarge": InstanceSpec(8, "B200", 8, gpu_memory_gib=179, vcpus=192),
    # G5 (A10G 24 GB), G6 (L4 24 GB), G6e (L40S 48 GB): https://aws.amazon.com/ec2/instance-types/g5/,
    # .../g6/, .../g6e/ and https://docs.aws.amazon.com/batch/latest/userguide/gpu-jobs.html (GPUs per size);
    # EFA from 8xlarge up (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa.html#efa-instance-types);
    # G6e has up to 4 network cards (efa-acc-inst-types.html above).
    **_sizes(
        "A10G",
        24,
        {
            "g5.xlarge": (1, 0),
            "g5.2xlarge": (1, 0),
            "g5.4xlarge": (1, 0),
            "g5.8xlarge": (1, 1),
            "g5.12xlarge": (4, 1),
            "g5.16xlarge": (1, 1),
            "g5.24xlarge": (4, 1),
            "g5.48xlarge": (8, 1),
        },
    ),
    **_sizes(
        "L4",
        24,
        {
            "g6.xlarge": (1, 0),
            "g6.2xlarge": (1, 0),
            "g6.4xlarge": (1, 0),
            "g6.8xlarge": (1, 1),
            "g6.12xlarge": (4, 1),
            "g6.16xlarge": (1, 1),
            "g6.24xlarge": (4, 1),
            "g6.48xlarge": (8, 1),
        },
    ),
    **_sizes(
        "L40S",
        48,
        {
            "g6e.xlarge": (1, 0),
            "g6e.2xlarge": (1, 0),
            "g6e.4xlarge": (1, 0),
            "g6e.8xlarge": (1, 1),
            "g6e.12xlarge": (4, 1),
            "g6e.16xlarge": (1, 1),
            "g6e.24xlarge": (4, 2),
            "g6e.48xlarge": (8, 4),
        },
    ),
    # vCPUs: P3 64, P4d/P4de 96, P5/P5e/P5en/P6-B200 192 (the same pages); C5.2xlarge 8.
    # CPU types the SageMaker examples use: https://aws.amazon.com/ec2/instance-types/c5/
    "c5.2xlarge": InstanceSpec(0, "", 0, vcpus=8),
}

# Host RAM (GiB) of a whole instance, AWS's figure, where known: what in-memory checkpoints (checkpoint.memory)
# stage each rank's state into. Sources: the instance pages above (P3 488 GiB; P4d/P4de 1152; P5/P5e/P5en 2048;
# G5 and G6 4 GiB per vCPU: 16-768; trn1.32xlarge 512, https://aws.amazon.com/ec2/instance-types/trn1/). Types not
# listed: unknown, and the planner shows their host memory without judging it.
HOST_MEMORY_GIB: dict[str, int] = {
    "p3.16xlarge": 488,
    "p4d.24xlarge": 1152,
    "p4de.24xlarge": 1152,
    "p5.48xlarge": 2048,
    "p5e.48xlarge": 2048,
    "p5en.48xlarge": 2048,
    "trn1.32xlarge": 512,
    **{
        f"{family}.{size}": 4 * vcpus
        for family in ("g5", "g6")
        for size, vcpus in (
            ("xlarge", 4),
            ("2xlarge", 8),
            ("4xlarge", 16),
            ("8xlarge", 32),
            ("12xlarge", 48),
            ("16xlarge", 64),
            ("24xlarge", 96),
            ("48xlarge", 192),
        )
    },
    "c5.2xlarge": 16,
}


def host_memory_gib(instance_type: str | None) -> int | None:
    """The instance's RAM in GiB; None where the catalog does not know it."""
    return HOST_MEMORY_GIB.get(normalise(instance_type)) if instance_type else None


# Dense (no sparsity) peak TFLOP/s per GPU model, bf16 and tf32, from the vendors' data sheets. The step line's
# MFU (hpkit.runtime.observe.metrics) and the planner's (hpkit.plan.speed) divide by the same figure. Matched by
# substring of the CUDA device name, longest first (see peak_tflops_for).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.5, "tf32": 494.7},
    "GH200": {"bf16": 989.5, "tf32": 494.7},
    "H100 NVL": {"bf16": 835.0, "tf32": 417.5},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0},
    "H100": {"bf16": 989.5, "tf32": 494.7},  # SXM
    "H800": {"bf16": 989.5, "tf32": 494.7},
    "B200": {"bf16": 2250.0, "tf32": 1100.0},
    "A100": {"bf16": 312.0, "tf32": 156.0},
    "A800": {"bf16": 312.0, "tf32": 156.0},
    "L40S": {"bf16": 362.0, "tf32": 183.0},
    "L4": {"bf16": 121.0, "tf32": 60.0},
    "A10G": {"bf16": 70.0, "tf32": 35.0},
    "A10": {"bf16": 125.0, "tf32": 62.5},
    "V100": {"bf16": 125.0, "tf32": 15.7},  # no bf16 tensor cores: fp16 figure; fp32 for tf32
}


def peak_tflops_for(device_name: str, mixed_precision: str) -> float | None:
    """Dense peak TFLOP/s of a GPU named `device_name` (a CUDA device name or a catalog `gpu`), for bf16 or
    (anything else) tf32; None for a GPU the table lacks."""
    kind = "bf16" if mixed_precision == "bf16" else "tf32"
    # Longest names first, so "H100 PCIe" wins over "H100".
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_TFLOPS[key][kind]
    return None


@dataclass(frozen=True)
class Links:
    """The bandwidths a training step's collectives and optimizer meet on one instance type.

    nvlink_gbs: GB/s (1e9 bytes) one way, per GPU, to the other GPUs of its node (NVLink through
    NVSwitch; PCIe Gen4 x16 where the type has no NVLink). efa_gbps: Gbit/s of the whole instance to other
    instances (EFA; ENA where the type has none). hbm_gbs: GB/s of one GPU's memory.
    """

    nvlink_gbs: float
    efa_gbps: float
    hbm_gbs: float


# Sources: NVIDIA's data sheets (NVLink: V100 300 GB/s, A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s, all
# both ways together, halved here; HBM: V100 900 GB/s, A100 40 GB 1555, A100 80 GB 2039, H100 SXM 3350,
# H200 4800, B200 8000, A10G 600, L4 300, L40S 864) and AWS's instance pages (network: p3.16xlarge 25 Gbps,
# p4d/p4de 400, p5/p5e/p5en/p6-b200 3200, g5.48xlarge and g6.48xlarge 100, g6e.48xlarge 400). Measured figures
# (`hpkit bench collectives`, `hpkit check --all-nodes`) replace these where a user gives them.
LINKS: dict[str, Links] = {
    "p3.16xlarge": Links(nvlink_gbs=150, efa_gbps=25, hbm_gbs=900),
    "p4d.24xlarge": Links(nvlink_gbs=300, efa_gbps=400, hbm_gbs=1555),
    "p4de.24xlarge": Links(nvlink_gbs=300, efa_gbps=400, hbm_gbs=2039),
    "p5.48xlarge": Links(nvlink_gbs=450, efa_gbps=3200, hbm_gbs=3350),
    "p5e.48xlarge": Links(nvlink_gbs=450, efa_gbps=3200, hbm_gbs=4800),
    "p5en.48xlarge": Links(nvlink_gbs=450, efa_gbps=3200, hbm_gbs=4800),
    "p6-b200.48xlarge": Links(nvlink_gbs=900, efa_gbps=3200, hbm_gbs=8000),
    "g5.48xlarge": Links(nvlink_gbs=32, efa_gbps=100, hbm_gbs=600),
    "g6.48xlarge": Links(nvlink_gbs=32, efa_gbps=100, hbm_gbs=300),
    "g6e.48xlarge": Links(nvlink_gbs=32, efa_gbps=400, hbm_gbs=864),
}


def links(instance_type: str | None) -> Links | None:
    return LINKS.get(normalise(instance_type)) if instance_type else None


SMDDP_TYPES = tuple(f"ml.{name}" for name, spec in INSTANCE_TYPES.items() if spec.smddp)


def normalise(instance_type: str) -> str:
    name = instance_type.strip().lower()
    return name[3:] if name.startswith("ml.") else name


def lookup(instance_type: str | None) -> InstanceSpec | None:
    return INSTANCE_TYPES.get(normalise(instance_type)) if instance_type else None


def smddp_verdict(instance_type: str | None) -> str | None:
    """None when SMDDP may run on this type (supported, or unknown), else why not: the instance catalog."""
    if instance_type is None:
        return None
    row = lookup(instance_type)
    if row is not None and row.smddp:
        return None
    return f"SMDDP supports only {', '.join(SMDDP_TYPES)}, not {instance_type}"
