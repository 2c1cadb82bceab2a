"""Fault injection for the reliability tests: an SGLang scheduler that crashes on a marked
request, as a real poison pill would.

With ``BANASERVE_TEST_CRASH_ON_TEXT=MARKER`` in an instance's environment, a request whose
prompt text contains ``MARKER`` makes the scheduler raise. Everything after that is SGLang's
own crash path: the scheduler logs the exception, the server kills its process tree. Nothing
changes unless the variable is set. (The crashes validation already prevents, such as an
out-of-vocabulary token id, cannot be sent through a gateway that validates: this is how the
tests reach the gateway's and the supervisor's handling of a crash none of the checks
foresaw.)
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

from banaserve.env import CRASH_ON_TEXT_ENV


def _patch_scheduler(module: types.ModuleType) -> None:
    marker = os.environ.get(CRASH_ON_TEXT_ENV)
    if not marker:
        return
    original = module.Scheduler.handle_generate_request

    @functools.wraps(original)
    def handle_generate_request(self: Any, recv_req: Any) -> Any:
        text = getattr(recv_req, "input_text", None)
        if isinstance(text, str) and marker in text:
            raise RuntimeError(f"{CRASH_ON_TEXT_ENV}: crashing on request {recv_req.rid}")
        return original(self, recv_req)

    module.Scheduler.handle_generate_request = handle_generate_request


POST_IMPORT_PATCHES = {"sglang.srt.managers.scheduler": _patch_scheduler}
