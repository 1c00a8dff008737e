"""An outside load tool against ``dpcoord up``: guidellm, streaming, with its defaults.

guidellm cannot go into CI: it pulls torch and transformers (8 minutes and 1.5 GB here with the
CPU torch wheel installed first; a CUDA torch from the index is several GB more). Install it in a
virtual environment of its own and point this script at it::

    python3 -m venv /tmp/gl && /tmp/gl/bin/pip install torch==2.13.0 && /tmp/gl/bin/pip install guidellm==0.8.1
    .venv/bin/python -m benchmarks.outside_clients --guidellm /tmp/gl/bin/guidellm

It starts ``dpcoord up`` (echo engines unless ``--backend torch``) on a free gateway port, writes
a ``json_file`` dataset (prompts with their ``output_tokens_count``, so guidellm sends
``ignore_eos`` and ``max_tokens``) and a local byte-level tokenizer (built with the
``tokenizers`` package of guidellm's environment; ``HF_HUB_OFFLINE=1``, nothing is fetched), runs
guidellm's ``openai_http`` backend as it comes (streaming, backend validation on, chat
completions, ``stream_options`` with ``continuous_usage_stats``) with a concurrent profile
until ``--requests`` requests, and prints its request totals and time to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from service.bus.server import free_port

PROMPTS = ["Hello", "Tell me about NATS.", "What is data parallelism?", "Write a haiku about queues."]
# A byte-level BPE tokenizer without merges: one token per byte, written for transformers'
# AutoTokenizer, run with guidellm's Python (its environment has `tokenizers`).
TOKENIZER = """
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
alphabet = ByteLevel.alphabet()
vocab = {char: index for index, char in enumerate(sorted(alphabet))}
tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
out = Path(sys.argv[1])
tokenizer.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
"""


def _banner(up: subprocess.Popen[str]) -> list[str]:
    assert up.stdout is not None  # Popen(stdout=PIPE)
    lines = []
    for line in up.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C"):
            return lines
    raise RuntimeError(f"dpcoord up ended before it was ready: {''.join(lines)}")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """Request totals, requests/s and TTFT (ms) of each benchmark in guidellm's JSON report."""
    out = []
    for benchmark in report.get("benchmarks", []):
        metrics = benchmark["metrics"]
        ttft = metrics["time_to_first_token_ms"]["successful"]
        percentiles = ttft.get("percentiles", {})
        out.append(
            {
                "requests": metrics["request_totals"],
                "requests_per_s": metrics["requests_per_second"]["successful"].get("mean"),
                "ttft_ms": {"mean": ttft.get("mean"), "p50": percentiles.get("p50"), "p99": percentiles.get("p99")},
            }
        )
    return {"benchmarks": out}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.outside_clients", description=__doc__.splitlines()[0])
    parser.add_argument("--guidellm", default=shutil.which("guidellm"), help="the guidellm executable")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--backend", choices=("echo", "torch"), default="echo")
    args = parser.parse_args()
    if not args.guidellm:
        parser.error("guidellm not found: give --guidellm PATH (see this module's docstring)")
    guidellm = Path(args.guidellm)
    work = Path(tempfile.mkdtemp(prefix="dpcoord-guidellm-"))
    data = work / "data.json"
    data.write_text(
        json.dumps(
            [
                {"prompt": PROMPTS[i % len(PROMPTS)], "output_tokens_count": args.output_tokens}
                for i in range(args.requests)
            ]
        )
    )
    tokenizer = work / "tokenizer"
    tokenizer.mkdir()
    subprocess.run([str(guidellm.parent / "python"), "-c", TOKENIZER, str(tokenizer)], check=True)
    port = free_port()
    env = dict(os.environ, DPCOORD_BACKEND=args.backend, DPCOORD_LOG_LEVEL="WARNING")
    up = subprocess.Popen(
        [sys.executable, "-m", "service", "up", "--engines", str(args.engines), "--gateway-port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        banner = _banner(up)
        model = next(line for line in banner if line.startswith("OpenAI API:")).split("models: ")[1].split(")")[0]
        report = work / "guidellm.json"
        command = [
            str(guidellm),
            "run",
            "--backend",
            f"kind=openai_http,target=http://127.0.0.1:{port},model={model}",
            "--data",
            f"kind=json_file,path={data}",
            "--tokenizer",
            f"kind=hf_auto,model={tokenizer}",
            "--profile",
            f"kind=concurrent,streams={args.concurrency}",
            "--constraint",
            f"kind=max_requests,count={args.requests}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console-interactive",
        ]
        print("$", " ".join(command), flush=True)
        offline = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        ran = subprocess.run(command, env=offline, cwd=work, check=False)
        if ran.returncode != 0 or not report.exists():
            print(f"guidellm exited with {ran.returncode}; its files are in {work}", file=sys.stderr)
            return 1
        print(json.dumps(summary(json.loads(report.read_text())), indent=2))
        print(f"guidellm's report: {report}")
        return 0
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
