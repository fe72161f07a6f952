#!/usr/bin/env bash
# Turn a locally built image into an enroot squashfs for pyxis (`srun --container-image=/path/hpkit.sqsh`).
#
#   scripts/enroot-import.sh IMAGE [OUT.sqsh]
#
# enroot reads the image through `docker save` (dockerd://), so DOCKER_HOST works here as it does for the
# build: Docker, or podman's Docker API service. Put the .sqsh on the shared filesystem so every node sees it,
# and point the job spec's `container.image` at it.
set -euo pipefail

image=${1:?usage: $0 IMAGE [OUT.sqsh]}
out=${2:-$(echo "${image##*/}" | tr ':' '+').sqsh}

command -v enroot >/dev/null || {
  echo "enroot is not installed: see https://github.com/NVIDIA/enroot/blob/master/doc/installation.md" >&2
  exit 1
}
command -v docker >/dev/null || {
  echo "enroot's dockerd:// import needs the docker CLI (it works against podman too: set DOCKER_HOST)" >&2
  exit 1
}
docker image inspect "$image" >/dev/null 2>&1 || {
  echo "no image $image in the engine at ${DOCKER_HOST:-the default socket}: build it with make image" >&2
  exit 1
}
if [ -e "$out" ]; then
  echo "$out exists: remove it first, or name another output" >&2
  exit 1
fi
enroot import --output "$out" "dockerd://$image"
echo "wrote $out: use it as container.image in a job spec, or srun --container-image=$(realpath "$out")"
