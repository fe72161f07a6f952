"""The Prometheus exporter alone: what a textfile and the HTTP endpoint hold, read back with prometheus-client's
own parser. (Real training runs export through it in tests/integration: test_stragglers, test_prometheus_http.)"""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpkit.errors import SpecError
from hpkit.rendezvous import free_local_ports
from hpkit.runtime.config import PrometheusSpec, RunConfig
from hpkit.runtime.observe.metrics import StepStats
from hpkit.runtime.observe.prometheus import PrometheusExporter
from hpkit.runtime.watchdog.stragglers import Straggler, Window
from hpkit.validation import parse_document


def samples(text: str) -> dict[str, tuple[dict[str, str], float]]:
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


def stats(step: int, peak: float | None) -> StepStats:
    return StepStats(step, 2.5, 0.75, 1e-3, 0.5, 4096, 4, 1e9, peak, 1.5, "max_allocated")


def test_textfile_holds_the_step_with_labels_and_is_removed_at_the_end(tmp_path):
    spec = PrometheusSpec(textfile_dir=str(tmp_path / "prom"))
    exp = PrometheusExporter(spec, "run", "4242", rank=1, local_rank=1, node="node7")
    path = tmp_path / "prom" / "run-4242-rank1.prom"
    assert path.exists()  # written at start: the run is visible before its first step ends
    exp.log(stats(3, peak=10.0))
    got = samples(path.read_text())
    labels = {"job_id": "4242", "rank": "1", "node": "node7"}
    s = stats(3, peak=10.0)
    assert got["hpkit_train_step"] == (labels, 3.0)
    assert got["hpkit_train_loss"] == (labels, 2.5)
    assert got["hpkit_train_grad_norm"] == (labels, 0.75)
    assert got["hpkit_train_learning_rate"] == (labels, 1e-3)
    assert got["hpkit_train_tokens_per_second"] == (labels, s.tokens_per_s)
    assert got["hpkit_train_step_seconds"] == (labels, 0.5)
    assert got["hpkit_train_mfu_ratio"] == (labels, s.mfu)
    assert got["hpkit_train_device_flops_per_second"][1] == pytest.approx(s.tflops_per_device * 1e12)
    assert got["hpkit_train_memory_peak_bytes"] == (labels, 1.5 * 2**30)
    assert got["hpkit_train_stragglers_total"] == (labels, 0.0)
    assert list(path.parent.iterdir()) == [path]  # the temporary file was renamed, not left
    exp.close()
    assert not path.exists()


def test_unknown_mfu_has_no_sample_and_a_straggler_window_counts_once(tmp_path):
    exp = PrometheusExporter(PrometheusSpec(textfile_dir=str(tmp_path)), "r", "1", 2, 0, "n")
    exp.log(stats(1, peak=None))
    assert "hpkit_train_mfu_ratio" not in samples((tmp_path / "r-1-rank2.prom").read_text())
    named = Window(10, 5, [1.0, 1.0, 4.0], [5.0] * 3, [1.0, 1.0, 4.0], [Straggler(2, 4.0, 4.0, 1.0)])
    other = Window(15, 5, [1.0, 1.0, 4.0], [5.0] * 3, [1.0, 1.0, 4.0], [])
    exp.window(named)
    exp.window(other)
    exp.log(stats(16, peak=None))
    got = samples((tmp_path / "r-1-rank2.prom").read_text())
    assert got["hpkit_train_stragglers_total"][1] == 1.0
    assert got["hpkit_train_slowdown_ratio"][1] == 4.0
    assert got["hpkit_train_local_work_seconds"][1] == 4.0
    exp.close()


def test_http_listens_on_port_plus_local_rank_and_a_taken_port_is_one_error_line():
    base = free_local_ports(2)
    exp = PrometheusExporter(PrometheusSpec(port=base), "r", "9", rank=5, local_rank=1, node="n")
    try:
        exp.log(stats(4, peak=None))
        with urllib.request.urlopen(f"http://127.0.0.1:{base + 1}/metrics", timeout=10) as resp:
            got = samples(resp.read().decode())
        assert got["hpkit_train_step"] == ({"job_id": "9", "rank": "5", "node": "n"}, 4.0)
        with pytest.raises(SpecError) as err:
            PrometheusExporter(PrometheusSpec(port=base), "r", "9", rank=6, local_rank=1, node="n")
        assert str(err.value).startswith(
            f"train.prometheus.port: rank 6 (local rank 1) cannot listen on port {base + 1}"
        )
    finally:
        exp.close()


@pytest.mark.parametrize(
    "block",
    [{}, {"port": 9100, "textfile_dir": "/var/lib/node_exporter"}],
)
def test_prometheus_needs_exactly_one_of_textfile_dir_and_port(block):
    with pytest.raises(SpecError) as err:
        parse_document(RunConfig, {"train": {"prometheus": block}}, "job.yaml")
    assert str(err.value) == (
        "job.yaml: train.prometheus: give exactly one of textfile_dir (a directory node_exporter reads) "
        "or port (an HTTP endpoint)"
    )


def test_prometheus_is_off_unless_asked_for():
    assert parse_document(RunConfig, {}).train.prometheus is None
    assert parse_document(RunConfig, {"train": {"prometheus": {"port": 9400}}}).train.prometheus.port == 9400
