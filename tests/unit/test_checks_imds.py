"""IMDS probe against a real local HTTP server speaking the metadata protocol, in each way it can answer."""

from __future__ import annotations

import json
import time

import pytest
from _imds_server import TOKEN, TTL_HEADER, closed_port, imds_server, silent_server

from hpkit.checks import imds
from hpkit.checks.context import Context
from hpkit.checks.result import Status
from hpkit.commands import check

CONTRACT_S = 2.0  # each mode's verdict must come within this


@pytest.fixture(autouse=True)
def _never_real_imds(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever a test forgets, nothing may reach 169.254.169.254 from here.
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", closed_port())
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    monkeypatch.delenv("AWS_METADATA_SERVICE_TIMEOUT", raising=False)


def _probe(endpoint: str, timeout: float = 0.8, **env: str) -> tuple[imds.ImdsProbe, float]:
    started = time.monotonic()
    found = imds.probe({"AWS_EC2_METADATA_SERVICE_ENDPOINT": endpoint, **env}, timeout)
    return found, time.monotonic() - started


def _check(endpoint: str, profile: str = "compute") -> tuple[Status, str, str]:
    ctx = Context(profile=profile, env={"AWS_EC2_METADATA_SERVICE_ENDPOINT": endpoint})
    result = imds.imds(ctx)
    return result.status, result.detail, result.fix


def test_v2_token_then_get() -> None:
    with imds_server(mode="v2") as (url, server):
        found, took = _probe(url)
        status, detail, _ = _check(url)
    assert (found.mode, found.instance_type) == (imds.V2, "ml.p4d.24xlarge")
    assert took < CONTRACT_S
    assert status is Status.PASS and "ml.p4d.24xlarge" in detail
    put, get = server.requests[0], server.requests[1]
    assert put[:2] == ("PUT", "/latest/api/token") and put[2][TTL_HEADER] == "21600"
    assert get[:2] == ("GET", "/latest/meta-data/instance-type")
    assert get[2]["X-aws-ec2-metadata-token"] == TOKEN


def test_v2_with_v1_still_open_is_v2() -> None:
    with imds_server(mode="v2-optional") as (url, _):
        found, _ = _probe(url)
        status, detail, _ = _check(url)
    assert found.mode == imds.V2
    assert status is Status.PASS and "ml.p4d.24xlarge" in detail


def test_server_requires_tokens_for_get() -> None:
    # The stand-in itself must behave like IMDS with http-tokens=required, or the tests above prove nothing.
    import urllib.request

    with imds_server(mode="v2") as (url, _), pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url + "/latest/meta-data/instance-type", timeout=2)
    assert err.value.code == 401


@pytest.mark.parametrize("refusal", [403, 405])
def test_v1_only_is_a_finding(refusal: int) -> None:
    with imds_server(mode="v1", refuse_status=refusal) as (url, _):
        found, took = _probe(url)
        status, detail, fix = _check(url)
        login_status, _, _ = _check(url, profile="login")
    assert found.mode == imds.V1_ONLY and found.instance_type == "ml.p4d.24xlarge"
    assert took < CONTRACT_S
    assert status is Status.FAIL and "IMDSv1" in detail and "--http-tokens required" in fix
    assert login_status is Status.WARN


def test_silent_server_is_no_imds_within_budget() -> None:
    with silent_server() as url:
        found, took = _probe(url)
        status, detail, fix = _check(url)
    assert found.mode == imds.NONE
    assert 0.6 < took < CONTRACT_S
    assert status is Status.FAIL and "did not answer" in detail and fix


def test_slow_server_past_the_budget() -> None:
    with imds_server(mode="slow", delay=5.0) as (url, server):
        found, took = _probe(url)
        status, detail, fix = _check(url)
        login_status, _, login_fix = _check(url, profile="login")
    assert found.mode == imds.NONE and found.instance_type is None
    assert took < CONTRACT_S
    # It was asked (the token PUT, then a tokenless GET), and its silence is what failed.
    assert [r[:2] for r in server.requests[:2]] == [
        ("PUT", "/latest/api/token"),
        ("GET", "/latest/meta-data/instance-type"),
    ]
    assert status is Status.FAIL and "did not answer within 0.8 s" in detail, detail
    assert "--http-endpoint enabled" in fix and "--http-put-response-hop-limit 2" in fix, fix
    assert "AWS_EC2_METADATA_DISABLED=true" in fix
    assert login_status is Status.WARN and login_fix == fix


def test_slow_server_within_the_budget_passes() -> None:
    with imds_server(mode="slow", delay=0.1) as (url, _):
        found, took = _probe(url)
        status, detail, _ = _check(url)
    assert found.mode == imds.V2 and took < CONTRACT_S
    assert status is Status.PASS and "IMDSv2 answers" in detail and "ml.p4d.24xlarge" in detail, detail


def test_token_answer_lost_but_v1_answers_is_hop_limit() -> None:
    with imds_server(mode="hop-limit") as (url, _):
        found, took = _probe(url)
        status, detail, fix = _check(url)
    assert found.mode == imds.V2_BLOCKED and found.instance_type == "ml.p4d.24xlarge"
    assert took < CONTRACT_S
    assert status is Status.FAIL and "IMDSv1 answers" in detail and "hop-limit 2" in fix


@pytest.mark.parametrize("mode", ["garbage", "garbage-token", "garbage-type"])
def test_garbage_answers(mode: str) -> None:
    with imds_server(mode=mode) as (url, _):
        found, took = _probe(url)
        status, _, fix = _check(url)
    assert found.mode == imds.GARBAGE, found
    assert found.instance_type is None
    assert took < CONTRACT_S
    assert status is Status.FAIL and "AWS_EC2_METADATA_SERVICE_ENDPOINT" in fix


def test_closed_port_is_no_imds_at_once() -> None:
    # A budget far past the contract: a probe that waited for it instead of taking the refusal would fail, and a
    # loaded machine still has the contract's room (a 0.5 s bound here was at the edge of one).
    found, took = _probe(closed_port(), timeout=10.0)
    assert found.mode == imds.NONE and "nothing listens" in found.detail
    assert took < CONTRACT_S


def test_closed_port_reads_the_same_when_the_token_request_ran_out_of_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a loaded machine the token's half of the budget can pass before its connect even runs (a fresh-clone CI
    # saw it): the GET that follows is refused, and the finding must still say nothing listens there.
    request = imds._request

    def token_late(endpoint, method, path, headers, deadline):
        if method == "PUT":
            raise imds._Timeout()
        return request(endpoint, method, path, headers, deadline)

    monkeypatch.setattr(imds, "_request", token_late)
    found, _ = _probe(closed_port())
    assert found.mode == imds.NONE and "nothing listens" in found.detail, found


def test_disabled_asks_nobody() -> None:
    with imds_server(mode="v2") as (url, server):
        found, _ = _probe(url, AWS_EC2_METADATA_DISABLED="TRUE")
        ctx = Context(env={"AWS_EC2_METADATA_DISABLED": "true", "AWS_EC2_METADATA_SERVICE_ENDPOINT": url})
        result = imds.imds(ctx)
    assert found.mode == imds.DISABLED and server.requests == []
    assert result.status is Status.SKIP and result.fix


def test_endpoint_with_path_prefix_and_trailing_slash() -> None:
    endpoint = imds.endpoint_from_env({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:8080/imds/"})
    assert (endpoint.host, endpoint.port, endpoint.prefix) == ("127.0.0.1", 8080, "/imds")
    assert imds.endpoint_from_env({}).url == "http://169.254.169.254:80"
    v6 = imds.endpoint_from_env({"AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE": "IPv6"})
    assert v6.host == "fd00:ec2::254"


def test_bad_endpoint_is_a_finding_not_a_crash() -> None:
    status, detail, fix = _check("ftp://example")
    assert status is Status.FAIL and "AWS_EC2_METADATA_SERVICE_ENDPOINT" in detail and fix


def test_sdk_timeout_variable_caps_the_probe() -> None:
    with silent_server() as url:
        env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": url, "AWS_METADATA_SERVICE_TIMEOUT": "0.2"}
        ctx = Context(profile="compute", env=env)
        started = time.monotonic()
        result = imds.imds(ctx)
    assert time.monotonic() - started < 0.6
    assert result.status is Status.FAIL and "did not answer within 0.2 s" in result.detail, result


def test_probe_runs_once_for_all_checks_that_need_it() -> None:
    from hpkit.checks import instance_types

    with imds_server(mode="v2") as (url, server):
        ctx = Context(profile="compute", env={"AWS_EC2_METADATA_SERVICE_ENDPOINT": url})
        assert imds.imds(ctx).status is Status.PASS
        assert instance_types.instance_type(ctx).status is Status.PASS
    assert len(server.requests) == 2  # one PUT, one GET


@pytest.mark.parametrize(
    ("instance_type", "status"),
    [
        ("ml.p4d.24xlarge", Status.PASS),
        ("p4de.24xlarge", Status.PASS),
        ("ml.p5.48xlarge", Status.WARN),
        ("m5.xlarge", Status.WARN),
    ],
)
def test_instance_type_against_the_table(instance_type: str, status: Status) -> None:
    from hpkit.checks import instance_types

    with imds_server(mode="v2", instance_type=instance_type) as (url, _):
        result = instance_types.instance_type(
            Context(profile="compute", env={"AWS_EC2_METADATA_SERVICE_ENDPOINT": url})
        )
    assert result.status is status
    assert result.status is Status.PASS or "p4d" in result.fix


def test_cli_json_through_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with imds_server(mode="v1") as (url, _):
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", url)
        code = check.main(["check", "--profile", "compute", "--only", "imds,instance-type", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert {c["name"]: c["status"] for c in report["checks"]} == {"imds": "FAIL", "instance-type": "PASS"}
