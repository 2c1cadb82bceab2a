"""An SGLang frontend-language program (gen, select, fork) runs against the server."""

from __future__ import annotations

import sglang as sgl

from support.frontend import CHOICES, describe
from support.servers import Server


def test_gen_select_fork(server: Server) -> None:
    backend = sgl.RuntimeEndpoint(server.url)
    state = describe.run(topic="the sea", backend=backend)
    assert state["colour"] in CHOICES
    assert len(state["ideas"]) == 2 and all(isinstance(idea, str) for idea in state["ideas"])
    assert state["summary"]
    assert "Summary:" + state["summary"] in state.text()

    # Greedy decoding is deterministic: the same program gives the same answers again.
    again = describe.run(topic="the sea", backend=backend)
    assert (again["colour"], again["ideas"], again["summary"]) == (
        state["colour"],
        state["ideas"],
        state["summary"],
    )


def test_run_batch(server: Server) -> None:
    backend = sgl.RuntimeEndpoint(server.url)
    states = describe.run_batch(
        [{"topic": "the sea"}, {"topic": "mountains"}], backend=backend, num_threads=2
    )
    assert all(state["colour"] in CHOICES for state in states)
