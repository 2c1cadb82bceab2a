"""KV store servers as real processes: round trips over tcp:// and shm://, bad input, auth,
replication through a killed shard, and restart from the SSD tier.

The tests on a server in this process are ``unit/test_kvstore_server_in_process.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

import store_hostile as hostile
from banaserve.kvstore.client import (
    KvStoreAuthError,
    KvStoreClient,
    KvStoreError,
    KvStoreRemoteError,
)
from banaserve.kvstore.keys import KvLayout
from banaserve.kvstore.protocol import HEADER, MAGIC, PROTOCOL_VERSION, Op, encode_frame
from banaserve.kvstore.server import tcp as server_module
from banaserve.kvstore.transport import open_transport, parse_url, shm
from banaserve.kvstore.transport.tcp import TcpTransport
from support.kvstore_server import (
    PAGE,
    TOKEN,
    _spy_streamed,
    exchange,
    hello,
    keys_for,
    pages,
)


class StoreProcess(hostile.StoreProcess):
    """The store server process, with these tests' token by default; :meth:`stop` also gives
    what it printed after its first line."""

    def __init__(self, log_dir: Path, *args: str, token: str | None = TOKEN, port: int = 0) -> None:
        super().__init__(log_dir, *args, token=token, port=port)

    def stop(self) -> tuple[int, str]:  # type: ignore[override]
        code = super().stop()
        return code, self.output


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    process = StoreProcess(tmp_path_factory.mktemp("kvstore"))
    try:
        yield process
    finally:
        code, out = process.stop()
        assert code == 0 and "stopped" in out, out


@pytest.fixture(params=["tcp", "shm"])
def url(request: pytest.FixtureRequest, store: StoreProcess) -> str:
    return store.url if request.param == "tcp" else store.shm_url


# -- round trips ------------------------------------------------------------------------------


def test_port_zero_prints_the_chosen_port(store: StoreProcess) -> None:
    assert store.port > 0 and "auth on" in store.first_line


def test_put_get_exists_round_trip(url: str) -> None:
    keys = keys_for(f"round-trip {url}", 12)
    data = pages(12, seed=1)
    unknown = keys_for(f"never stored {url}", 2)
    with KvStoreClient(url, token=TOKEN) as client:
        assert client.put(keys[:8], data[:8]) == [True] * 8
        # torch sources, including a dtype numpy lacks
        sources = [torch.from_numpy(d.copy()).view(torch.bfloat16) for d in data[8:]]
        assert client.put(keys[8:], sources) == [True] * 4
        assert client.exists(keys + unknown) == [True] * 12 + [False] * 2
        assert client.longest_prefix(keys[:5] + unknown + keys[5:]) == 5

        tensors = [torch.full((PAGE // 4,), -1.0) for _ in range(12)]
        assert client.get(keys, tensors) == [True] * 12
        for tensor, expected in zip(tensors, data, strict=True):
            assert bytes(tensor.numpy().view(np.uint8)) == expected.tobytes()

        arrays = [np.zeros((2, PAGE // 8), np.float32) for _ in range(3)]
        views = [memoryview(bytearray(PAGE)) for _ in range(2)]
        sentinel = np.full(PAGE, 7, np.uint8)
        buffers = [*arrays, *views, sentinel]
        found = client.get([*keys[:5], unknown[0]], buffers)
        assert found == [True] * 5 + [False]
        assert all(bytes(b) == d.tobytes() for b, d in zip(buffers[:5], data, strict=False))
        assert (sentinel == 7).all()  # a miss leaves the buffer untouched

        # a buffer of another size than the page is a miss, not a torn copy
        wrong = bytearray(PAGE // 2)
        assert client.get(keys[:1], [wrong]) == [False] and wrong == bytearray(PAGE // 2)
        assert client.get([], []) == [] and client.exists([]) == []


def test_pages_scattered_over_segments(url: str) -> None:
    """A page given as a list of segments (a layer-first host pool): gathered on put,
    scattered on get, over both transports, also with a byte range across segments."""
    keys = keys_for(f"segments {url}", 3)
    data = pages(3, seed=9)
    with KvStoreClient(url, token=TOKEN) as client:
        gathered = [[d[:1000], d[1000:1001], torch.from_numpy(d[1001:].copy())] for d in data]
        assert client.put(keys, gathered) == [True] * 3
        whole = [bytearray(PAGE) for _ in keys]
        assert client.get(keys, whole) == [True] * 3
        assert [bytes(w) for w in whole] == [d.tobytes() for d in data]
        scattered = [(np.zeros(3000, np.uint8), bytearray(PAGE - 3000)) for _ in keys]
        assert client.get(keys, scattered) == [True] * 3
        for (head, tail), d in zip(scattered, data, strict=True):
            assert head.tobytes() + bytes(tail) == d.tobytes()
        ranged = [[bytearray(10), bytearray(6)] for _ in keys]
        assert client.get(keys, ranged, byte_range=(2995, 16)) == [True] * 3
        assert [b"".join(r) for r in ranged] == [d[2995:3011].tobytes() for d in data]


def test_byte_range_and_layer_range(url: str) -> None:
    layout = KvLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16", page_size=8)
    keys = keys_for(f"layers {url}", 6)
    data = pages(6, layout.page_bytes, seed=2)
    with KvStoreClient(url, token=TOKEN) as client:
        assert all(client.put(keys, data))
        offset, length = layout.layer_range(1, 3)
        buffers = [torch.empty(length // 2, dtype=torch.float16) for _ in keys]
        assert client.get_layers(keys, layout, 1, 3, buffers) == [True] * 6
        for buf, page in zip(buffers, data, strict=True):
            assert bytes(buf.view(torch.uint8).numpy()) == page[offset : offset + length].tobytes()
        small = [bytearray(5) for _ in keys]
        assert client.get(keys, small, byte_range=(100, 5)) == [True] * 6
        assert [bytes(b) for b in small] == [p[100:105].tobytes() for p in data]
        past_end = bytearray(b"x" * 64)
        assert client.get(keys[:1], [past_end], byte_range=(layout.page_bytes - 8, 64)) == [False]
        assert past_end == b"x" * 64
        with pytest.raises(ValueError, match="byte_range"):
            client.get(keys[:1], [bytearray(4)], byte_range=(0, 8))


def test_shm_segment_grows_and_leaves_no_name_behind(store: StoreProcess) -> None:
    big = 1 << 20
    keys = keys_for("big pages", 20)  # 20 MiB: more than the initial 16 MiB segment
    data = pages(20, big, seed=3)
    with KvStoreClient(store.shm_url, token=TOKEN) as client:
        assert client.put(keys, data) == [True] * 20
        out = [np.empty(big, np.uint8) for _ in keys]
        assert client.get(keys, out) == [True] * 20
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        transport = client._shards[0]._idle[0]
        assert transport.segment_bytes >= 20 * big  # type: ignore[attr-defined]
        # Both sides have it mapped, so its name is gone from /dev/shm already.
        assert not os.path.exists(f"/dev/shm/{transport._segment.name}")  # type: ignore[attr-defined]


def test_killed_shm_client_leaves_nothing_in_dev_shm(store: StoreProcess) -> None:
    script = (
        "import sys, numpy as np\n"
        "from banaserve.kvstore.client import KvStoreClient\n"
        f"client = KvStoreClient({store.shm_url!r}, token={TOKEN!r})\n"
        "assert client.put([b'k' * 32], [np.ones(1 << 20, np.uint8)]) == [True]\n"
        "print(client._shards[0]._idle[0]._segment.name, flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        assert name, "the client did not connect"
    finally:
        # The whole group, as when a cluster is killed: Python's resource tracker goes too,
        # so nothing is left to unlink a named segment.
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert not os.path.exists(f"/dev/shm/{name}")
    with KvStoreClient(store.url, token=TOKEN) as client:  # the server is unharmed
        assert client.exists([b"k" * 32]) == [True]


def test_a_client_cannot_name_a_file_for_the_store_to_map(store: StoreProcess) -> None:
    """Issue 31: the HELLO (now AUTH) and SHM_ATTACH of an authenticated client named the
    segment, so it could have the store map any file under /dev/shm (SGLang's, another
    tenant's) and read or overwrite it. The server now creates every segment; a named one is
    refused."""
    victim = Path(f"/dev/shm/banaserve-victim-{os.getpid()}")
    victim.write_bytes(b"secret" * 1024)
    name = {"name": victim.name, "size": 4096}

    class Naming(TcpTransport):
        def _auth_control(self, proof: bytes | None) -> dict:
            return {**super()._auth_control(proof), "shm": name}

    try:
        with pytest.raises(KvStoreRemoteError, match="the server names shared-memory segments"):
            Naming(parse_url(store.url), 10.0).connect(TOKEN)
        transport = open_transport(parse_url(store.shm_url), 10.0)
        try:
            transport.connect(TOKEN)
            with pytest.raises(KvStoreRemoteError, match="the server names"):
                TcpTransport.request(transport, Op.SHM_ATTACH, name)
        finally:
            transport.close()
        assert victim.read_bytes() == b"secret" * 1024
    finally:
        victim.unlink()


@pytest.mark.parametrize("pipeline", [True, False])
def test_shm_get_streams_pages_of_every_size(
    store: StoreProcess, monkeypatch: pytest.MonkeyPatch, pipeline: bool
) -> None:
    if pipeline and not shm.PIPELINE_GET:
        pytest.skip("pipelined shm GETs are for x86 clients")
    monkeypatch.setattr(shm, "PIPELINE_GET", pipeline)
    streamed = _spy_streamed(monkeypatch)
    # Below, at and above the server's chunk size, and not multiples of anything.
    sizes = [1, PAGE, server_module.SHM_CHUNK_BYTES, 700_001, 2 << 20, (3 << 20) + 5]
    keys = keys_for(f"stream {pipeline}", len(sizes))
    data = [pages(1, size, seed=20 + i)[0] for i, size in enumerate(sizes)]
    (missing,) = keys_for(f"stream missing {pipeline}", 1)
    with KvStoreClient(store.shm_url, token=TOKEN) as client:
        assert client.put(keys, data) == [True] * len(sizes)
        for _ in range(3):  # the progress word is reset between requests
            out = [np.zeros(d.nbytes, np.uint8) for d in data]
            gap = np.full(16, 7, np.uint8)
            found = client.get([keys[0], missing, *keys[1:]], [out[0], gap, *out[1:]])
            assert found == [True, False] + [True] * (len(sizes) - 1)
            assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
            assert (gap == 7).all()
        ranged = [np.zeros(1 << 20, np.uint8) for _ in keys[-2:]]
        assert client.get(keys[-2:], ranged, byte_range=(3, 1 << 20)) == [True, True]
        assert all(
            np.array_equal(r, d[3 : 3 + (1 << 20)]) for r, d in zip(ranged, data[-2:], strict=True)
        )
    assert bool(streamed) is pipeline


@pytest.mark.parametrize(
    "progress, message",
    [
        (3, "not an aligned word"),
        (-8, "not an aligned word"),
        (1 << 40, "not an aligned word"),
        (True, "must be an int offset"),
        ("8", "must be an int offset"),
        (0, "over the 0-byte shm segment"),  # the word would overlap the reply
    ],
)
def test_shm_get_bad_progress_is_refused(
    store: StoreProcess, progress: object, message: str
) -> None:
    (key,) = keys_for("progress check", 1)
    with KvStoreClient(store.url, token=TOKEN) as client:
        assert client.put([key], pages(1, seed=9)) == [True]
    transport = open_transport(parse_url(store.shm_url), 10.0)
    try:
        transport.connect(TOKEN)
        control = {"keys": [key], "lengths": [PAGE], "shm": True, "progress": progress}
        with pytest.raises(KvStoreRemoteError, match=message):
            TcpTransport.request(transport, Op.GET, control)
    finally:
        transport.close()


def test_many_threads_and_connections(store: StoreProcess) -> None:
    errors: list[BaseException] = []
    shared = KvStoreClient(store.shm_url, token=TOKEN)

    def worker(n: int) -> None:
        try:
            own = KvStoreClient(store.url, token=TOKEN) if n % 2 else None
            client = own or shared
            keys = keys_for(f"thread {n}", 4)
            data = pages(4, seed=100 + n)
            for _ in range(15):
                assert client.put(keys, data) == [True] * 4
                out = [bytearray(PAGE) for _ in keys]
                assert client.get(keys, out) == [True] * 4
                assert [bytes(o) for o in out] == [d.tobytes() for d in data]
            if own is not None:
                own.close()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    shared.close()
    assert not errors, errors


# -- bad input --------------------------------------------------------------------------------


def header(op: int, control_len: int, payload_len: int, version: int = PROTOCOL_VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, op, 2, control_len, payload_len)


def put_frame(keys: list[bytes], sizes: list[int], payload: bytes) -> bytes:
    body = msgpack.packb({"keys": keys, "sizes": sizes}, use_bin_type=True)
    return header(Op.PUT, len(body), len(payload)) + body + payload


GOOD = keys_for("bad input victim", 1)[0]
#: Bad input of a stranger (sent raw, before any AUTH): frame, what the ERROR reply says.
BAD_INPUT = {
    "random bytes": (os.urandom(3000), "bad magic"),
    "http request": (b"GET / HTTP/1.1\r\nHost: kv\r\n\r\n" * 4, "bad magic"),
    "get before hello": (encode_frame(Op.GET, 1, {"keys": [], "lengths": []}), "must be HELLO"),
    "auth before hello": (encode_frame(Op.AUTH, 1, {"proof": None}), "AUTH must follow HELLO"),
    "put after hello": (hello() + put_frame([GOOD], [4], b"abcd"), "must be HELLO and AUTH"),
    "truncated hello": (hello()[:-3], "truncated frame"),
    "truncated header": (hello()[:10], "truncated frame"),
    "wrong version": (header(Op.HELLO, 0, 0, version=7), "protocol version 7"),
    "oversized control": (header(Op.HELLO, (1 << 20) + 1, 0), "control length"),
    "malformed msgpack": (header(Op.HELLO, 3, 0) + b"\xc1\xc1\xc1", "malformed msgpack"),
    "second hello": (hello() + hello(), "HELLO sent twice"),
    "a token in clear": (
        encode_frame(Op.HELLO, 1, {"version": PROTOCOL_VERSION, "token": TOKEN}),
        "missing field 'nonce'",
    ),
    "short proof": (hello() + encode_frame(Op.AUTH, 2, {"proof": b"p" * 31}), "32 bytes"),
}
#: Bad input of a peer that passed HELLO and AUTH with the token.
BAD_AFTER_AUTH = {
    "oversized payload": (header(Op.PUT, 10, 1 << 40), "payload length"),
    "unknown op": (header(0x33, 0, 0), "unknown op"),
    "wrong types": (encode_frame(Op.EXISTS, 2, {"keys": "abc"}), "must be list"),
    "short key in put": (
        put_frame([GOOD, b"k" * 31], [4, 4], b"abcdefgh"),
        "key 1 must be 32 bytes",
    ),
    "payload shorter than sizes": (put_frame([GOOD], [8], b"abcd"), "declares 4"),
    "put cut short": (put_frame([GOOD], [8], b"abcdefgh")[:-4], "truncated frame"),
    "second auth": (encode_frame(Op.AUTH, 3, {"proof": None}), "AUTH must follow HELLO, once"),
}


def test_bad_input_closes_only_that_connection(store: StoreProcess) -> None:
    keys = keys_for("survivor", 4)
    data = pages(4, seed=4)
    cases = [(case, frame, message, False) for case, (frame, message) in BAD_INPUT.items()]
    cases += [(case, frame, message, TOKEN) for case, (frame, message) in BAD_AFTER_AUTH.items()]
    cases.append(("wrong token", put_frame([GOOD], [4], b"abcd"), "authentication failed", "no"))
    with KvStoreClient(store.url, token=TOKEN) as bystander:
        assert all(bystander.put(keys, data))
        before = bystander.stats()[store.url]
        for case, frame, message, token in cases:
            replies = exchange(store.url, frame, token)
            assert replies, f"{case}: no reply"
            assert replies[-1].op is Op.ERROR, case
            assert message in replies[-1].control["message"], (case, replies[-1].control)
            # the bystander's connection (opened before) is unaffected
            out = [bytearray(PAGE) for _ in keys]
            assert bystander.get(keys, out) == [True] * 4, case
            assert [bytes(o) for o in out] == [d.tobytes() for d in data], case
        after = bystander.stats()[store.url]
        assert after["puts"] == before["puts"] and after["ram_pages"] == before["ram_pages"]
        assert bystander.exists([GOOD]) == [False]  # no PUT took effect, not even in part
        info = bystander.stats()[store.url]["server"]
        assert info["refused"] >= len(cases)


def test_idle_connections_do_not_block_others(store: StoreProcess) -> None:
    host, port = store.url.removeprefix("tcp://").rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(20)]
    try:
        with KvStoreClient(store.url, token=TOKEN) as client:
            assert client.stats()[store.url]["server"]["connections"] >= 21
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("token", ["wrong", None])
def test_wrong_or_missing_token_is_refused(store: StoreProcess, token: str | None) -> None:
    for url in (store.url, store.shm_url):
        with pytest.raises(KvStoreAuthError) as info:
            KvStoreClient(url, token=token)
        assert (
            str(info.value) == f"kv store at {url}: authentication failed: wrong or missing token"
        )


def test_clear_drops_every_page_for_the_shared_token_only(tmp_path: Path) -> None:
    """CLEAR on a real server process: every page and claim goes, whoever stored it, over
    tcp:// or shm://; a tenant token is refused and drops nothing. A second shard counts."""
    tenant_token = "alpha-token-0123456789"
    tenants = tmp_path / "tenants"
    tenants.write_text(f"alpha:{tenant_token}\n")
    tenants.chmod(0o600)
    first = StoreProcess(tmp_path, "--tenant-tokens", str(tenants))
    second = StoreProcess(tmp_path)
    keys, data = keys_for("clear", 8), pages(8)
    try:
        with (
            KvStoreClient([first.url, second.url], token=TOKEN) as shared,
            KvStoreClient(first.shm_url, token=TOKEN) as over_shm,
            KvStoreClient(first.url, token=tenant_token) as tenant,
        ):
            assert shared.put(keys[:6], data[:6]) == [True] * 6  # over both shards
            assert tenant.put(keys[6:], data[6:]) == [True] * 2
            assert over_shm.lookup(keys_for("clear claimed", 2), owner="o") == 0  # 2 claims
            with pytest.raises(KvStoreAuthError, match="CLEAR needs the shared token"):
                tenant.clear()
            assert tenant.exists(keys[6:]) == [True, True]  # refused: nothing dropped
            stats = shared.stats()
            assert sum(s["ram_pages"] for s in stats.values()) == 8
            assert stats[first.url]["server"]["claims_held"] == 2
            assert over_shm.clear() == stats[first.url]["ram_pages"]  # one shard: its pages
            assert shared.clear() == stats[second.url]["ram_pages"]  # both: the rest
            for url, after in shared.stats().items():
                assert (after["ram_pages"], after["ssd_pages"], after["ram_bytes"]) == (0, 0, 0)
                assert after["server"]["claims_held"] == 0, url
            assert shared.stats()[first.url]["server"]["claims_cleared"] == 2
            assert shared.exists(keys[:6]) == [False] * 6
            assert tenant.exists(keys[6:]) == [False] * 2
            assert shared.put(keys[:1], data[:1]) == [True]  # the store serves on
            out = [np.zeros(PAGE, np.uint8)]
            assert shared.get(keys[:1], out) == [True]
            np.testing.assert_array_equal(out[0], data[0])
        with KvStoreClient(first.url, token=TOKEN) as alone:
            assert alone.put(keys[:2], data[:2]) == [True] * 2
        second.stop()
        with KvStoreClient([first.url, second.url], token=TOKEN, timeout=2.0) as half:
            with pytest.raises(KvStoreError, match=f"could not clear .*:{second.port} "):
                half.clear()  # a shard that is down still holds its pages: an error
        with KvStoreClient(first.url, token=TOKEN) as alone:
            assert alone.exists(keys[:2]) == [False] * 2  # the live one was cleared all the same
    finally:
        for process in (first, second):
            if process.proc.poll() is None:
                process.stop()


# -- replication and restarts ---------------------------------------------------------------


def test_replicated_store_survives_a_killed_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(KvStoreClient, "RETRY_AFTER_S", 0.3)
    a = StoreProcess(tmp_path / "a")
    b = StoreProcess(tmp_path / "b")
    try:
        client = KvStoreClient([a.url, b.shm_url], token=TOKEN, replication=2, timeout=5.0)
        keys = keys_for("replicated", 32)
        data = pages(32, seed=5)
        assert client.put(keys, data) == [True] * 32
        stats = client.stats()
        assert all(s["ram_pages"] == 32 for s in stats.values())

        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(10)
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        assert client.get(keys, out) == [True] * 32
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))
        assert client.exists(keys) == [True] * 32
        more_keys, more = keys_for("written while down", 8), pages(8, seed=6)
        assert client.put(more_keys, more) == [True] * 8
        assert client.get(more_keys, [bytearray(PAGE) for _ in more]) == [True] * 8
        assert client.stats()[a.url]["up"] is False
        downs = [r for r in caplog.records if "is down" in r.getMessage()]
        assert len(downs) == 1 and a.url in downs[0].getMessage()

        # Back on the same port, empty: reads fall through its misses to the other replica.
        a = StoreProcess(tmp_path / "a2", port=a.port)
        time.sleep(0.4)
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        assert client.get(keys, out) == [True] * 32
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))
        assert any("back up" in r.getMessage() for r in caplog.records)
        assert client.put(keys[:4], data[:4]) == [True] * 4
        assert client.stats()[a.url]["ram_pages"] == 4
        client.close()
    finally:
        a.kill()
        b.kill()


def test_restart_finds_pages_on_ssd(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    keys = keys_for("durable", 10)
    data = pages(10, seed=7)
    first = StoreProcess(tmp_path / "logs", "--ssd-dir", str(ssd), "--ssd-capacity-gb", "0.05")
    try:
        assert "SSD" in first.first_line
        with KvStoreClient(first.shm_url, token=TOKEN) as client:
            assert client.put(keys, data) == [True] * 10
    finally:
        code, out = first.stop()
    assert code == 0 and "stopped" in out
    second = StoreProcess(tmp_path / "logs", "--ssd-dir", str(ssd), "--ssd-capacity-gb", "0.05")
    try:
        with KvStoreClient(second.url, token=TOKEN) as client:
            out = [bytearray(PAGE) for _ in keys]
            assert client.get(keys, out) == [True] * 10
            assert [bytes(o) for o in out] == [d.tobytes() for d in data]
            assert client.stats()[second.url]["ssd_pages"] == 10
    finally:
        second.stop()
