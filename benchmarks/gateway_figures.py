"""The gateway benchmark's figures: each round's rates, CPU and latency ratios, the medians over
rounds, and the issue's targets judged on them."""

from __future__ import annotations

import statistics
from typing import Any

# The targets: 3x what Megatron-LM's HTTP server reports with fake engines (1,185
# non-streamed and 270 streamed requests/s), and at most 1 ms of added p50.
TARGETS = {
    "gateway_requests_per_s": (">=", 3500.0),
    "gateway_streams_per_s": (">=", 800.0),
    "gateway_added_p50_us": ("<=", 1000.0),
    # issue 22: at most 1.5x the bare app's CPU per request, at most 10 us per SSE event.
    "gateway_vs_hello_cpu_per_request": ("<=", 1.5),
    "gateway_cpu_us_per_sse_event": ("<=", 10.0),
}


def figures(measured: dict[str, dict[str, Any]], tokens: int) -> dict[str, float]:
    """The round's figures; ``tokens``: the SSE events of a stream (one per token)."""
    out: dict[str, float] = {}
    if "pipelined_gateway" in measured and "pipelined_client" in measured:
        gateway, client = measured["pipelined_gateway"], measured["pipelined_client"]
        out["gateway_requests_per_s"] = gateway["per_s"]
        out["client_requests_per_s"] = client["per_s"]
        out["gateway_vs_client_requests"] = gateway["per_s"] / client["per_s"]
        out["gateway_cpu_us_per_request"] = gateway["cpu_us_per"]["gateway"]
    if "streaming_gateway" in measured and "streaming_client" in measured:
        gateway, client = measured["streaming_gateway"], measured["streaming_client"]
        out["gateway_streams_per_s"] = gateway["per_s"]
        out["client_streams_per_s"] = client["per_s"]
        out["gateway_vs_client_streams"] = gateway["per_s"] / client["per_s"]
        out["gateway_cpu_us_per_stream"] = gateway["cpu_us_per"]["gateway"]
    if "pipelined_gateway" in measured and "pipelined_hello" in measured:
        hello = measured["pipelined_hello"]["cpu_us_per"]["hello"]
        out["hello_cpu_us_per_request"] = hello
        out["gateway_vs_hello_cpu_per_request"] = measured["pipelined_gateway"]["cpu_us_per"]["gateway"] / hello
    if "pipelined_relay" in measured and "pipelined_hello" in measured:
        relay = measured["pipelined_relay"]["cpu_us_per"]["relay"]
        out["relay_cpu_us_per_request"] = relay
        out["relay_vs_hello_cpu_per_request"] = relay / measured["pipelined_hello"]["cpu_us_per"]["hello"]
        if "pipelined_gateway" in measured:
            out["gateway_vs_relay_cpu_per_request"] = measured["pipelined_gateway"]["cpu_us_per"]["gateway"] / relay
    if "pipelined_gateway" in measured and "pipelined_hello_paced" in measured:
        paced = measured["pipelined_hello_paced"]["cpu_us_per"]["hello"]
        out["hello_cpu_us_per_request_at_gateway_rate"] = paced
        out["gateway_vs_hello_at_gateway_rate"] = measured["pipelined_gateway"]["cpu_us_per"]["gateway"] / paced
    if "pipelined_gateway" in measured and "streaming_gateway" in measured:
        per_stream = measured["streaming_gateway"]["cpu_us_per"]["gateway"]
        per_request = measured["pipelined_gateway"]["cpu_us_per"]["gateway"]
        out["gateway_cpu_us_per_sse_event"] = (per_stream - per_request) / tokens
    if "sequential_gateway" in measured and "sequential_client" in measured:
        out["gateway_sequential_p50_us"] = measured["sequential_gateway"]["p50_us"]
        out["client_sequential_p50_us"] = measured["sequential_client"]["p50_us"]
        out["gateway_added_p50_us"] = out["gateway_sequential_p50_us"] - out["client_sequential_p50_us"]
    return out


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({name for one in rounds for name in one["figures"]})
    medians = {
        name: statistics.median(one["figures"][name] for one in rounds if name in one["figures"]) for name in names
    }
    steps = sorted({step for one in rounds for step in one["measured"]})
    median_steps = {}
    for step in steps:
        entries = [one["measured"][step] for one in rounds if step in one["measured"]]
        median_steps[step] = {
            key: statistics.median(entry[key] for entry in entries)
            for key in ("p50_us", "p99_us", "per_s")
            if key in entries[0]
        } | {"errors": sum(entry["errors"] for entry in entries)}
        if "cpu_us_per" in entries[0]:
            median_steps[step]["cpu_us_per"] = {
                name: statistics.median(entry["cpu_us_per"][name] for entry in entries)
                for name in entries[0]["cpu_us_per"]
            }
    targets = {}
    for name, (sign, bound) in TARGETS.items():
        if name in medians:
            value = medians[name]
            targets[name] = {
                "value": value,
                "sign": sign,
                "bound": bound,
                "met": value >= bound if sign == ">=" else value <= bound,
                "ratio": value / bound,
            }
    return {"figures": medians, "steps": median_steps, "targets": targets}
