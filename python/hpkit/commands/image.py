"""`hpkit image build | tags | import-base | export`: the training images through the Docker Engine API."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpkit.image import (
    BASE_TAG,
    DEFAULT_REPO,
    VARIANTS,
    ImageError,
    build,
    checkout_versions,
    connect,
    export_oci,
    image_tags,
    import_base,
    prepare_build,
)


def _parse_kv(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise ImageError(f"{what} {value!r}: expected KEY=VALUE")
        out[key] = val
    return out


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Build and import training images (Docker Engine API)."
    )
    sub = parser.add_subparsers(dest="action", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cpu", action="store_true", help="the CPU image (docker/Dockerfile.cpu)")
        p.add_argument("--repo", default=DEFAULT_REPO, help="image repository name (default: %(default)s)")
        p.add_argument("--context", type=Path, default=Path.cwd(), help="the hpkit checkout (default: .)")

    b = sub.add_parser("build", help="build the GPU image (or --cpu) and tag it with its versions")
    common(b)
    b.add_argument(
        "--base-image", help="the CPU image's base (e.g. hpkit-base:bookworm from `make image-base`)"
    )
    b.add_argument(
        "--build-arg", action="append", default=[], metavar="KEY=VALUE", help="override a build arg"
    )
    b.add_argument("--network", help="network mode for RUN steps (e.g. host)")
    b.add_argument("--no-cache", action="store_true")
    b.add_argument("--quiet", "-q", action="store_true", help="show only the steps, not their output")

    t = sub.add_parser("tags", help="print the tags a build gives (versioned first)")
    common(t)

    i = sub.add_parser("import-base", help="import a root file system tarball as the CPU image's base")
    i.add_argument("tarball", type=Path)
    i.add_argument("--tag", default=BASE_TAG, help="default: %(default)s")

    e = sub.add_parser(
        "export", help="write an image as an OCI bundle (rootfs + config.json) for container.runtime: oci"
    )
    e.add_argument("--oci", type=Path, required=True, metavar="DIR", help="the bundle directory to write")
    e.add_argument("image", nargs="?", help=f"the image (default: {DEFAULT_REPO}:cpu, from make image-cpu)")
    return parser


def _build(args: argparse.Namespace) -> int:
    extra = _parse_kv(args.build_arg, "--build-arg")
    if args.base_image:
        extra["BASE_IMAGE"] = args.base_image
    request = prepare_build(
        args.context.resolve(),
        VARIANTS["cpu" if args.cpu else "gpu"],
        args.repo,
        extra,
        network_mode=args.network,
        nocache=args.no_cache,
    )
    client = connect()

    def show(line: str) -> None:
        if not args.quiet or line.startswith(("[", "sending")):
            print(line, flush=True)

    result = build(client, request, show)
    print(
        f"built {result.image_id[:19]} in {result.seconds:.0f} s, tagged {' '.join(result.tags)}", flush=True
    )
    return 0


def parse_args(argv: list[str], prog: str = "hpkit image") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name)."""
    return _parser(prog).parse_args(argv[1:])


def main(argv: list[str], prog: str = "hpkit image") -> int:
    args = parse_args(argv, prog)
    if args.action == "build":
        return _build(args)
    if args.action == "tags":
        variant = VARIANTS["cpu" if args.cpu else "gpu"]
        print("\n".join(image_tags(variant, checkout_versions(args.context.resolve()), args.repo)))
        return 0
    if args.action == "import-base":
        image_id = import_base(connect(), args.tarball.resolve(), args.tag)
        print(f"imported {args.tarball} as {args.tag} ({image_id[:19]})")
        return 0
    if args.action == "export":
        ref = args.image or f"{DEFAULT_REPO}:cpu"
        result = export_oci(connect(), ref, args.oci.resolve())
        print(
            f"exported {ref} ({result.image_id[:19]}) as the OCI bundle {result.bundle} in {result.seconds:.0f} s; "
            f"use it with container: {{runtime: oci, image: {result.bundle}}}"
        )
        return 0
    return 2
