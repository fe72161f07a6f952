#!/usr/bin/env bash
# Run the training image on one node for debugging, the way a job would: the host's /var/log mounted (the
# entry point's check wants it), the checkout mounted at /workspace, GPUs and EFA devices passed when present.
#
#   scripts/docker-run.sh [IMAGE] [COMMAND...]     (IMAGE defaults to hpkit:latest; COMMAND to bash)
#
# Honours DOCKER_HOST (Docker or podman's Docker API). Uses the docker CLI, or podman's when docker is absent.
set -euo pipefail

engine=${HPKIT_ENGINE:-}
if [ -z "$engine" ]; then
  if command -v docker >/dev/null; then engine=docker; elif command -v podman >/dev/null; then engine=podman; fi
fi
[ -n "$engine" ] || {
  echo "neither docker nor podman is installed" >&2
  exit 1
}

image=${1:-hpkit:latest}
[ $# -gt 0 ] && shift

args=(--network host --ipc host -v /var/log:/var/log -v "$PWD:/workspace" -w /workspace)
[ -t 0 ] && [ -t 1 ] && args+=(-it)
if [ -e /dev/nvidiactl ]; then args+=(--gpus all); fi
for dev in /dev/infiniband/uverbs*; do
  [ -e "$dev" ] && args+=(--device "$dev")
done
for var in AWS_EC2_METADATA_DISABLED AWS_EC2_METADATA_SERVICE_ENDPOINT HPKIT_SKIP_STARTUP_CHECK \
  HPKIT_STARTUP_CHECK_WARN_ONLY HPKIT_STARTUP_CHECK_ARGS; do
  [ -n "${!var+x}" ] && args+=(-e "$var")
done

# Not --rm: podman 4.3's Docker API answers the CLI's wait for removal with status 0, hiding the command's exit
# status. Remove the container ourselves once its status is known.
name="hpkit-debug-$$"
trap '"$engine" rm -f "$name" >/dev/null 2>&1 || true' EXIT
rc=0
"$engine" run --name "$name" "${args[@]}" "$image" "$@" || rc=$?
exit "$rc"
