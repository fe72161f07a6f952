"""The EC2 instance metadata service, spoken over IMDSv2: a token PUT with a TTL, then a GET with the token.

Written on http.client rather than a library: the kept clients either import too slowly for the login
profile's one-second budget (botocore) or need requests and speak only IMDSv2 (ec2-metadata), and cannot say
*which* protocol answered, which is the finding here. scripts/check-prereqs.sh also needs this to work with
the standard library alone. The conversation is bounded by one deadline: a watchdog shuts the socket when it
passes, so a server that accepts and then trickles or stays silent cannot stretch it.

Environment, as the AWS SDKs read it: AWS_EC2_METADATA_DISABLED=true skips the probe;
AWS_EC2_METADATA_SERVICE_ENDPOINT overrides the endpoint; AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE=IPv6 picks
the IPv6 address; AWS_METADATA_SERVICE_TIMEOUT (seconds) caps the whole probe.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from hpkit.checks.context import Context
from hpkit.checks.registry import check
from hpkit.checks.result import Result, Status

DEFAULT_ENDPOINT = "http://169.254.169.254"
IPV6_ENDPOINT = "http://[fd00:ec2::254]"
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
TOKEN_TTL_S = 21600
INSTANCE_TYPE_PATH = "/latest/meta-data/instance-type"
MAX_BODY = 4096

# Modes of a probe, one per finding.
V2 = "v2"  # token issued and accepted
V1_ONLY = "v1-only"  # token PUT refused; tokenless GET answers
V2_BLOCKED = "v2-blocked"  # token PUT unanswered (hop limit) but tokenless GET answers
NONE = "none"  # nothing answered
GARBAGE = "garbage"  # something answered, not in the IMDS protocol
DISABLED = "disabled"  # AWS_EC2_METADATA_DISABLED=true
BAD_CONFIG = "bad-config"  # the endpoint variable cannot be used

_TOKEN = re.compile(r"^[A-Za-z0-9+/=_.-]{8,1024}$")
_INSTANCE_TYPE = re.compile(r"^(ml\.)?[a-z][a-z0-9-]*\.[a-z0-9-]+$")
# socket.timeout is an alias of TimeoutError only from Python 3.10; the script may run on older ones.
_TIMEOUTS = (TimeoutError, socket.timeout)


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    prefix: str  # path before /latest, usually ""

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"


@dataclass(frozen=True)
class ImdsProbe:
    mode: str
    endpoint: str
    detail: str
    instance_type: str | None = None
    seconds: float = 0.0


class _Timeout(Exception):
    pass


class _Unreachable(Exception):
    pass


class _Garbage(Exception):
    pass


def endpoint_from_env(env: Mapping[str, str]) -> Endpoint:
    get = env.get
    raw = (get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or "").strip()
    if not raw:
        raw = IPV6_ENDPOINT if (get("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE") or "").lower() == "ipv6" else ""
    parts = urlsplit(raw or DEFAULT_ENDPOINT)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"AWS_EC2_METADATA_SERVICE_ENDPOINT={raw!r} is not an http:// or https:// URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ValueError(f"AWS_EC2_METADATA_SERVICE_ENDPOINT={raw!r}: {exc}") from None
    return Endpoint(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))


def _request(
    endpoint: Endpoint, method: str, path: str, headers: dict[str, str], deadline: float
) -> tuple[int, bytes]:
    import http.client

    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _Timeout()
    cls = http.client.HTTPSConnection if endpoint.scheme == "https" else http.client.HTTPConnection
    conn = cls(endpoint.host, endpoint.port, timeout=remaining)
    fired = threading.Event()

    def abort() -> None:
        fired.set()
        sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed: nothing left to interrupt
                sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(remaining, abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request(method, endpoint.prefix + path, headers=headers)
        response = conn.getresponse()
        body = response.read(MAX_BODY + 1)
        if len(body) > MAX_BODY:
            raise _Garbage(f"{method} {path} answered with more than {MAX_BODY} bytes")
        return response.status, body
    except _TIMEOUTS:
        raise _Timeout() from None
    except (http.client.HTTPException, ConnectionResetError, BrokenPipeError) as exc:
        if fired.is_set():
            raise _Timeout() from None
        raise _Garbage(f"{method} {path}: not an HTTP answer ({type(exc).__name__})") from None
    except OSError as exc:
        if fired.is_set():
            raise _Timeout() from None
        raise _Unreachable(exc.strerror or str(exc)) from None
    finally:
        watchdog.cancel()
        conn.close()


def _get_instance_type(endpoint: Endpoint, token: str | None, deadline: float) -> str:
    headers = {TOKEN_HEADER: token} if token else {}
    status, body = _request(endpoint, "GET", INSTANCE_TYPE_PATH, headers, deadline)
    if status == 401:
        raise _Garbage("GET instance-type: 401 Unauthorized" + (" with a fresh token" if token else ""))
    if status != 200:
        raise _Garbage(f"GET instance-type: HTTP {status}")
    text = body.decode("ascii", errors="replace").strip()
    if not _INSTANCE_TYPE.match(text):
        raise _Garbage(f"GET instance-type: {text[:40]!r} is not an instance type")
    return text


def probe(env: Mapping[str, str], timeout: float) -> ImdsProbe:
    """Ask the metadata service which protocol it speaks and the instance type, within timeout seconds."""
    get = env.get
    if (get("AWS_EC2_METADATA_DISABLED") or "").strip().lower() == "true":
        return ImdsProbe(DISABLED, "", "AWS_EC2_METADATA_DISABLED=true")
    try:
        endpoint = endpoint_from_env(env)
    except ValueError as exc:
        return ImdsProbe(BAD_CONFIG, "", str(exc))
    import http.client  # noqa: F401  (here, before the clock starts: a cold import can take a while)

    started = time.monotonic()
    deadline = started + timeout

    def done(mode: str, detail: str, instance_type: str | None = None) -> ImdsProbe:
        return ImdsProbe(mode, endpoint.url, detail, instance_type, time.monotonic() - started)

    # Half the budget for the token: if its answer never comes (a hop limit of 1 seen from a container),
    # the other half still finds out whether a tokenless GET would have worked.
    token_deadline = started + timeout / 2
    try:
        status, body = _request(
            endpoint, "PUT", TOKEN_PATH, {TOKEN_TTL_HEADER: str(TOKEN_TTL_S)}, token_deadline
        )
    except _Unreachable as exc:
        return done(NONE, f"nothing listens at {endpoint.url} ({exc})")
    except _Garbage as exc:
        return done(GARBAGE, f"{endpoint.url} {exc}")
    except _Timeout:
        try:
            instance_type = _get_instance_type(endpoint, None, deadline)
        except _Unreachable as exc:
            return done(NONE, f"nothing listens at {endpoint.url} ({exc})")
        except _Timeout:
            return done(NONE, f"{endpoint.url} accepts connections but did not answer within {timeout:g} s")
        except _Garbage as exc:
            # Alive, yet the token's answer never came: what a container sees behind a hop limit of 1.
            return done(
                V2_BLOCKED, f"the IMDSv2 token request got no answer within {timeout / 2:g} s ({exc})"
            )
        return done(
            V2_BLOCKED,
            f"the IMDSv2 token request got no answer within {timeout / 2:g} s, but IMDSv1 answers "
            f"(instance type {instance_type}): the PUT response hop limit is too low for this container",
            instance_type,
        )
    if status in (403, 404, 405):
        try:
            instance_type = _get_instance_type(endpoint, None, deadline)
        except _Timeout:
            return done(NONE, f"the token PUT was refused (HTTP {status}) and GET got no answer in time")
        except (_Garbage, _Unreachable) as exc:
            return done(GARBAGE, f"the token PUT was refused (HTTP {status}); then {exc}")
        return done(V1_ONLY, f"only IMDSv1 answers: the token PUT was refused (HTTP {status})", instance_type)
    token = body.decode("ascii", errors="replace").strip()
    if status != 200 or not _TOKEN.match(token):
        shown = f"HTTP {status}" if status != 200 else f"{token[:40]!r}, not a token"
        return done(GARBAGE, f"{endpoint.url} answered the token PUT with {shown}")
    try:
        instance_type = _get_instance_type(endpoint, token, deadline)
    except _Timeout:
        return done(NONE, f"a token was issued but the GET with it got no answer within {timeout:g} s")
    except (_Garbage, _Unreachable) as exc:
        return done(GARBAGE, f"a token was issued, then {exc}")
    return done(V2, f"IMDSv2 answers at {endpoint.url}", instance_type)


def _budget(ctx: Context) -> float:
    raw = ctx.env.get("AWS_METADATA_SERVICE_TIMEOUT")
    try:
        return min(ctx.imds_timeout, float(raw)) if raw else ctx.imds_timeout
    except ValueError:
        return ctx.imds_timeout


def probe_for(ctx: Context) -> ImdsProbe:
    """The probe for this context, run once however many checks ask."""
    return ctx.memo("imds", lambda: probe(ctx.env, _budget(ctx)))


_FIX_NONE = (
    "on EC2, turn the endpoint on: `aws ec2 modify-instance-metadata-options --instance-id ID "
    "--http-endpoint enabled --http-tokens required`; in a container also raise "
    "`--http-put-response-hop-limit 2`; off EC2 set AWS_EC2_METADATA_DISABLED=true to skip this"
)
_FIXES = {
    V1_ONLY: "turn IMDSv2 on: `aws ec2 modify-instance-metadata-options --instance-id ID --http-endpoint "
    "enabled --http-tokens required`, and make sure no proxy or iptables rule refuses PUT to the endpoint",
    V2_BLOCKED: "let the token answer reach the container: `aws ec2 modify-instance-metadata-options "
    "--instance-id ID --http-put-response-hop-limit 2` (or run the container with host networking)",
    NONE: _FIX_NONE,
    GARBAGE: "something other than the metadata service answers there: unset or correct "
    "AWS_EC2_METADATA_SERVICE_ENDPOINT, and look for a proxy or iptables rule on 169.254.169.254",
    BAD_CONFIG: "set AWS_EC2_METADATA_SERVICE_ENDPOINT to a URL such as http://169.254.169.254, or unset it",
}


@check("imds", "EC2 metadata service (IMDSv2)", profiles=("login", "compute", "container"))
def imds(ctx: Context) -> Result:
    found = probe_for(ctx)
    if found.mode == DISABLED:
        return Result.skip(
            "AWS_EC2_METADATA_DISABLED=true: not asked",
            "unset AWS_EC2_METADATA_DISABLED on EC2 hosts to check IMDSv2",
        )
    took = f"{found.seconds * 1000:.0f} ms"
    if found.mode == V2:
        return Result.ok(f"{found.detail} in {took}; instance type {found.instance_type}")
    # SMDDP needs IMDSv2 where training runs; on a login node it is worth knowing, not blocking.
    status = Status.WARN if ctx.profile == "login" else Status.FAIL
    detail = found.detail if found.mode == BAD_CONFIG else f"{found.detail} ({took})"
    return Result(status, detail, _FIXES[found.mode])
