#!/usr/bin/env bash
# Image entry point: run the checker's container profile (is this the image, not the host? is /var/log the
# host's? does IMDSv2 answer?), then exec the command. A container that cannot write the host's logs or reach
# instance metadata fails here, with the fix, instead of an hour into a job. "The image, not the host": hpkit's job
# scripts export the host's root as HPKIT_HOST_ROOT, and the in-image check compares it with the root seen here;
# a task that srun ran on the host never reaches this file (the image has it), and the job's own task step stops
# it with one line instead (hpkit.slurm.script.in_image_step).
#
#   HPKIT_SKIP_STARTUP_CHECK=1        do not run the check at all
#   HPKIT_STARTUP_CHECK_WARN_ONLY=1   run it, but only warn when it fails
#   HPKIT_STARTUP_CHECK_ARGS          extra arguments for `hpkit check` (word-split)
set -euo pipefail

if [ "${HPKIT_SKIP_STARTUP_CHECK:-0}" != 1 ]; then
  # shellcheck disable=SC2086  # the extra arguments are meant to be split into words
  if report=$(hpkit check --profile container --plain ${HPKIT_STARTUP_CHECK_ARGS:-} 2>&1); then
    # One line per container is enough when all is well; the last line is the checker's summary.
    printf 'hpkit-entrypoint: %s\n' "${report##*$'\n'}" >&2
  else
    if [ "${HPKIT_STARTUP_CHECK_WARN_ONLY:-0}" = 1 ]; then
      printf '%s\n' "$report" >&2
      echo "hpkit-entrypoint: warning: the container start-up check failed (see above); going on because" \
        "HPKIT_STARTUP_CHECK_WARN_ONLY=1" >&2
    else
      # The failing checks first, then the rest: `srun --kill-on-bad-exit` ends every task as soon as one
      # exits non-zero, and a task's last lines may not reach the job's log before its exit does (seen on
      # a loaded node: neither node's FAIL line arrived). The pause lets this task's lines arrive first.
      grep -E '^FAIL' <<<"$report" >&2 || true
      grep -vE '^FAIL' <<<"$report" >&2 || true
      echo "hpkit-entrypoint: the container start-up check failed (see above): fix it, or set" \
        "HPKIT_STARTUP_CHECK_WARN_ONLY=1 to go on anyway, or HPKIT_SKIP_STARTUP_CHECK=1 to skip it" >&2
      sleep 1
      exit 1
    fi
  fi
fi

if [ $# -eq 0 ]; then
  set -- bash
fi
exec "$@"
