"""A two-stage instance whose layer boundary moves at run time (``--pp-size 2
--pp-layer-boundary 6 --pp-min-boundary 2`` on an 8-layer tiny model): at every boundary,
and with the boundary moved while eight streams decode, it answers token for token like one
plain instance; a move down sends exactly the moved layers' weights; bad moves are 400s that
change nothing; and the KV the stages share leaves no file behind.

Servers: ``pp_servers`` in ``test/conftest.py`` (shared with ``test_pp_split.py``); each runs
one OpenMP thread per stage, which bit-exactness needs.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from banaserve.migration.boundary_control import split_dir_for
from banaserve.server.kv_pool_sizing import layer_weight_bytes
from support.pipeline import LAYERS, MIN_BOUNDARY, MOVABLE_START, generate, streamed
from support.servers import Server

NEW_TOKENS = 32
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
#: Long enough that eight of them are still decoding while the test moves the boundary
#: five times (each move lands before the next micro-batch: milliseconds).
LONG = {**GREEDY, "max_new_tokens": 256}
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a kingdom by the sea, there lived",
    "apples, rivers and stars",
    " ".join(f"Sentence number {i} talks about apples, rivers and stars." for i in range(6)),
]
APPLY_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def servers(pp_servers: dict[str, Server]) -> tuple[Server, Server]:
    """(plain pp=1 instance, pp=2 instance with a movable boundary)."""
    return pp_servers["plain"], pp_servers["movable"]


def boundary_state(server: Server) -> dict:
    answer = requests.get(f"{server.url}/pp_boundary", timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def ask(server: Server, body: object) -> requests.Response:
    return requests.post(f"{server.url}/pp_boundary", json=body, timeout=30)


def move(server: Server, boundary: int) -> dict:
    """Ask for ``boundary``; the state it answers (not applied before the next micro-batch)."""
    answer = ask(server, {"boundary": boundary})
    assert answer.status_code == 200, answer.text
    assert answer.json()["requested"] == boundary
    return answer.json()


def wait_applied(server: Server, boundary: int) -> dict:
    deadline = time.monotonic() + APPLY_TIMEOUT_S
    while (state := boundary_state(server))["applied"] != boundary:
        assert time.monotonic() < deadline, f"boundary {boundary} not applied: {state}"
        time.sleep(0.005)
    return state


def test_it_starts_at_its_boundary(servers: tuple[Server, Server]) -> None:
    _, movable = servers
    assert boundary_state(movable) == {
        "requested": MOVABLE_START, "applied": MOVABLE_START, "min_boundary": MIN_BOUNDARY,
        "num_layers": LAYERS, "moves": 0, "bytes_moved": 0,
    }  # fmt: skip


@pytest.mark.parametrize("boundary", [MIN_BOUNDARY, LAYERS, 4, MOVABLE_START])
def test_every_boundary_answers_like_a_plain_instance(
    servers: tuple[Server, Server], boundary: int
) -> None:
    """k = MIN_BOUNDARY (the second stage runs the most layers), k = L (the first stage runs
    them all, the second none), and two in between; one request at a time and a batch."""
    plain, movable = servers
    move(movable, boundary)
    expected = [generate(plain.url, GREEDY, prompt)["output_ids"] for prompt in PROMPTS]
    first = generate(movable.url, GREEDY, PROMPTS[0])
    assert wait_applied(movable, boundary)["applied"] == boundary
    assert first["output_ids"] == expected[0]
    batch = generate(movable.url, GREEDY, PROMPTS)
    assert [answer["output_ids"] for answer in batch] == expected
    assert all(len(ids) == NEW_TOKENS for ids in expected)


def test_moving_while_eight_streams_decode_changes_no_token(
    servers: tuple[Server, Server],
) -> None:
    """Eight streams decode while the boundary moves 6 -> 3 -> 7 -> 2 -> 8 -> 5; each move
    is applied while they all still run, and every stream ends with the plain instance's
    tokens and text."""
    plain, movable = servers
    move(movable, MOVABLE_START)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(8)]
    expected = [generate(plain.url, LONG, prompt) for prompt in prompts]
    results: dict[int, tuple[list[int], str, int]] = {}
    started = threading.Barrier(len(prompts) + 1)
    first_chunks = [threading.Event() for _ in prompts]
    finished = [threading.Event() for _ in prompts]

    def stream(i: int) -> None:
        started.wait()
        try:
            results[i] = streamed(movable.url, LONG, prompts[i], lambda n: first_chunks[i].set())
        finally:
            finished[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    started.wait()
    for event in first_chunks:
        assert event.wait(120), "a stream sent no first chunk"
    before = boundary_state(movable)["moves"]
    for boundary in (3, 7, 2, 8, 5):
        move(movable, boundary)
        wait_applied(movable, boundary)
        assert not any(event.is_set() for event in finished), "streams ended before the moves"
    for thread in threads:
        thread.join(300)
    assert boundary_state(movable)["moves"] == before + 5
    for i, want in enumerate(expected):
        ids, text, chunks = results[i]
        assert ids == want["output_ids"], i
        assert text == want["text"], i
        assert chunks > 1


def test_a_move_down_sends_the_moved_layers_weights(servers: tuple[Server, Server]) -> None:
    """8 -> 3 sends layers [3, 8) (the second stage held none at k = L); 3 -> 5 sends
    nothing (the second stage frees layers [3, 5)); 5 -> 4 sends layer 4 again."""
    _, movable = servers
    per_layer = layer_weight_bytes(movable.model_path, "float32")  # the CPU default
    for boundary, sent_layers in ((LAYERS, 0), (3, LAYERS - 3), (5, 0), (4, 1)):
        before = boundary_state(movable)
        move(movable, boundary)
        generate(movable.url, GREEDY, PROMPTS[0])
        after = wait_applied(movable, boundary)
        if boundary != before["applied"]:
            assert after["moves"] == before["moves"] + 1
        assert after["bytes_moved"] - before["bytes_moved"] == sent_layers * per_layer, boundary


@pytest.mark.parametrize(
    "body",
    [{"boundary": MIN_BOUNDARY - 1}, {"boundary": LAYERS + 1}, {"boundary": "4"},
     {"boundary": 4.0}, {"boundary": True}, {"k": 4}, {"boundary": 4, "extra": 1}, [4], None],
)  # fmt: skip
def test_a_bad_move_is_a_400_that_changes_nothing(
    servers: tuple[Server, Server], body: object
) -> None:
    _, movable = servers
    before = boundary_state(movable)
    answer = ask(movable, body)
    assert answer.status_code == 400, answer.text
    assert "boundary" in answer.json()["error"]
    assert boundary_state(movable) == before


def test_a_body_that_is_not_json_is_a_400(servers: tuple[Server, Server]) -> None:
    _, movable = servers
    before = boundary_state(movable)
    answer = requests.post(f"{movable.url}/pp_boundary", data=b"{4", timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == 'the body must be a JSON object {"boundary": k}'
    assert boundary_state(movable) == before


def test_the_shared_kv_leaves_no_file(servers: tuple[Server, Server]) -> None:
    """Both stages map the shared layers' KV files, then their names go: the memory returns
    when the stages exit, however they exit. The record and the stages' marks stay, bytes."""
    _, movable = servers
    folder = split_dir_for(movable.process.pid)
    left = sorted(path.name for path in folder.iterdir())
    assert left == ["boundary", "mapped0", "mapped1"]
