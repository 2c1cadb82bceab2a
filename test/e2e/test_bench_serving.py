"""SGLang's own benchmark client runs against a BanaServe server unchanged."""

from __future__ import annotations

import subprocess
import sys

from support.servers import Server


def test_bench_serving_random_ids(server: Server, tmp_path) -> None:  # noqa: ANN001
    result_file = tmp_path / "bench.jsonl"
    argv = [
        sys.executable, "-m", "sglang.bench_serving",
        "--backend", "sglang",
        "--base-url", server.url,
        "--model", str(server.model_path),
        "--tokenizer", str(server.model_path),
        "--dataset-name", "random-ids",
        "--num-prompts", "8",
        "--random-input-len", "64",
        "--random-output-len", "8",
        "--random-range-ratio", "1.0",
        "--max-concurrency", "4",
        "--output-file", str(result_file),
    ]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "Successful requests:" in output
    successful = int(output.split("Successful requests:")[1].split()[0])
    assert successful == 8, output[-3000:]
    assert result_file.exists() and result_file.stat().st_size > 0
