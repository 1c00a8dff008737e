"""The gateway benchmark's figures (benchmarks/gateway_figures.py) from one round's measurements."""

from __future__ import annotations

import pytest

from benchmarks.gateway_figures import figures


def _step(per_s: float, **cpu: float) -> dict[str, object]:
    return {"per_s": per_s, "p50_us": 1.0, "p99_us": 2.0, "errors": 0, "cpu_us_per": cpu}


def test_the_gateway_is_compared_with_the_bare_app_unpaced_and_at_its_own_rate() -> None:
    measured = {
        "pipelined_gateway": _step(1000.0, gateway=200.0),
        "pipelined_client": _step(4000.0, gateway=0.0),
        "pipelined_hello": _step(20000.0, hello=40.0),
        "pipelined_hello_paced": _step(1000.0, hello=100.0),
        "streaming_gateway": _step(100.0, gateway=200.0 + 64 * 15.0),
        "streaming_client": _step(300.0, gateway=0.0),
    }
    out = figures(measured, tokens=64)
    assert out["gateway_vs_hello_cpu_per_request"] == pytest.approx(5.0)
    assert out["hello_cpu_us_per_request_at_gateway_rate"] == pytest.approx(100.0)
    assert out["gateway_vs_hello_at_gateway_rate"] == pytest.approx(2.0)
    assert out["gateway_cpu_us_per_sse_event"] == pytest.approx(15.0)


def test_the_relay_app_is_the_floor_under_the_ratio_and_the_gateway_is_compared_with_it() -> None:
    measured = {
        "pipelined_gateway": _step(1000.0, gateway=150.0),
        "pipelined_hello": _step(20000.0, hello=30.0),
        "pipelined_relay": _step(5000.0, relay=100.0),
    }
    out = figures(measured, tokens=64)
    assert out["relay_cpu_us_per_request"] == pytest.approx(100.0)
    assert out["relay_vs_hello_cpu_per_request"] == pytest.approx(100.0 / 30.0)
    assert out["gateway_vs_relay_cpu_per_request"] == pytest.approx(1.5)
