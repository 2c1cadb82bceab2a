"""An SGLang frontend-language program shared by the single-server and the cluster tests."""

from __future__ import annotations

import sglang as sgl

CHOICES = ["red", "green", "blue"]


@sgl.function
def describe(s, topic: str):  # noqa: ANN001
    s += f"Topic: {topic}\n"
    s += "Colour: " + sgl.select("colour", choices=CHOICES) + "\n"
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += f"Idea {i}:" + sgl.gen("idea", max_tokens=6, temperature=0)
    s += "Summary:" + sgl.gen("summary", max_tokens=8, temperature=0)
    s["ideas"] = [branch["idea"] for branch in forks]
