#!/usr/bin/env bash
# `make demo-container`: the demo job (slurm/jobs/demo.yaml) inside the CPU training image, in Slurm's own OCI
# containers (container.runtime: oci, runc) on the local development cluster. Needs root (podman, runc).
#
#   1. a container engine: DOCKER_HOST if it answers, else podman's Docker API service (scripts/podman-service.sh)
#   2. the CPU image: its mmdebstrap base (`make image-base`) when the engine lacks it, then `make image-cpu`
#   3. `hpkit image export --oci` into OCI_BUNDLE (default: .dev-cluster/images/hpkit-cpu)
#   4. the demo spec with a container block (the checkout mounted at its own path, as the working directory),
#      submitted with `hpkit submit --wait --follow`
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${BIN:-$here/.venv/bin}
cluster_dir=${HPKIT_DEV_CLUSTER_DIR:-$here/.dev-cluster}
bundle=${OCI_BUNDLE:-$cluster_dir/images/hpkit-cpu}
base=${IMAGE_BASE_TAG:-hpkit-base:bookworm}
cd "$here"

engine_answers() {
  "$bin/python" -c 'import hpkit.image as i; i.connect()' >/dev/null 2>&1
}
has_image() {
  "$bin/python" -c 'import sys, hpkit.image as i; i.connect().images.get(sys.argv[1])' "$1" >/dev/null 2>&1
}

if ! engine_answers; then
  eval "$(scripts/podman-service.sh start)"
  export DOCKER_HOST
fi
if ! has_image "$base"; then
  make --no-print-directory image-base IMAGE_BASE_TAG="$base"
fi
make --no-print-directory image-cpu IMAGE_BASE="$base"
"$bin/hpkit" image export --oci "$bundle" hpkit:cpu

spec=$cluster_dir/demo-container.yaml
{
  cat slurm/jobs/demo.yaml
  cat <<YAML
# Added by scripts/demo-container.sh: the same job inside the CPU image (Slurm's OCI containers, runc).
env:
  AWS_EC2_METADATA_DISABLED: "true"  # not on EC2: the image's start-up check leaves the metadata service out
container:
  runtime: oci
  image: $bundle
  mounts: ["$here:$here"]
  workdir: $here
YAML
} >"$spec"
"$bin/hpkit" submit "$spec" --wait --follow
