"""Greedy reference outputs from SGLang's in-process ``sgl.Engine``, run as a script.

It runs in its own process because ``Engine.shutdown()`` kills every child of the calling
process, which inside pytest would include the shared test servers.
Input on stdin (JSON): {"model_path", "max_total_tokens", "sampling_params",
"inputs": [{"prompt": str} | {"input_ids": [int]}]}. Output on stdout: a JSON list of texts.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    job = json.load(sys.stdin)
    import sglang as sgl

    engine = sgl.Engine(
        model_path=job["model_path"],
        device="cpu",
        max_total_tokens=job["max_total_tokens"],
        sleep_on_idle=True,
        log_level="warning",
    )
    try:
        texts = []
        for item in job["inputs"]:
            # One request at a time, as the tests send them, so batching cannot differ.
            output = engine.generate(sampling_params=job["sampling_params"], **item)
            texts.append(output["text"])
    finally:
        engine.shutdown()
    print("REFERENCE " + json.dumps(texts))


if __name__ == "__main__":
    main()
