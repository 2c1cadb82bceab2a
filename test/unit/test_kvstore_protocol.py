"""KV store wire protocol, placement ring and client argument checks: pure, no server."""

from __future__ import annotations

import hashlib
import socket
import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from banaserve.kvstore.client import KvStoreClient, byte_view
from banaserve.kvstore.framing import FrameDecoder, decode_frames
from banaserve.kvstore.protocol import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_CONTROL_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    Limits,
    Op,
    ProtocolError,
    decode_header,
    encode_error,
    encode_frame,
    unpack_control,
)
from banaserve.kvstore.sharding import HashRing
from banaserve.kvstore.transport import KvStoreError, parse_url


def key(i: int) -> bytes:
    return hashlib.sha256(f"page {i}".encode()).digest()


def raw_frame(
    op: int,
    control: object,
    payload: bytes = b"",
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    request_id: int = 7,
    control_len: int | None = None,
    payload_len: int | None = None,
) -> bytes:
    """A frame with every field under the test's control (encode_frame refuses bad ones)."""
    body = control if isinstance(control, bytes) else msgpack.packb(control, use_bin_type=True)
    head = HEADER.pack(
        magic,
        version,
        op,
        request_id,
        len(body) if control_len is None else control_len,
        len(payload) if payload_len is None else payload_len,
    )
    return head + body + payload


NONCE = b"n" * NONCE_BYTES
VALID_REQUESTS = [
    encode_frame(Op.HELLO, 1, {"version": PROTOCOL_VERSION, "nonce": NONCE}),
    encode_frame(Op.AUTH, 1, {"proof": NONCE, "shm": {"size": 64}}),
    encode_frame(Op.EXISTS, 2, {"keys": [key(0), key(1)]}),
    encode_frame(Op.GET, 3, {"keys": [key(0)], "lengths": [16], "range": [4, 16]}),
    encode_frame(Op.GET, 3, {"keys": [key(0), key(1)], "lengths": [8, 8], "range": None}),
    encode_frame(Op.PUT, 4, {"keys": [key(0), key(1)], "sizes": [3, 2]}, b"abcde"),
    encode_frame(Op.PUT, 4, {"keys": [key(0)], "sizes": [3], "shm": True}),
    encode_frame(Op.STATS, 5, {}),
    encode_frame(Op.SHM_ATTACH, 6, {"size": 1 << 20}),
]

VALID_REPLIES = [
    encode_frame(Op.HELLO, 1, {"version": 2, "server": "s", "nonce": NONCE}, reply=True),
    encode_frame(
        Op.AUTH, 1, {"version": 2, "max_payload": 1 << 30, "shm": False, "proof": None}, reply=True
    ),  # fmt: skip
    encode_frame(Op.EXISTS, 2, {"present": [True, False]}, reply=True),
    encode_frame(Op.GET, 3, {"sizes": [3, -1, 2]}, b"abcde", reply=True),
    encode_frame(Op.GET, 3, {"sizes": [3], "shm": True}, reply=True),
    encode_frame(Op.PUT, 4, {"stored": [True]}, reply=True),
    encode_frame(Op.STATS, 5, {"store": {"hits": 1}, "server": {"pid": 1}}, reply=True),
    encode_error(9, ErrorCode.AUTH, "authentication failed"),
]


# -- round trips ------------------------------------------------------------------------------


def test_requests_round_trip() -> None:
    frames = decode_frames(b"".join(VALID_REQUESTS))
    assert [f.op for f in frames] == [
        Op.HELLO, Op.AUTH, Op.EXISTS, Op.GET, Op.GET, Op.PUT, Op.PUT, Op.STATS, Op.SHM_ATTACH,
    ]  # fmt: skip
    put = frames[5]
    assert put.request_id == 4 and put.control["keys"] == [key(0), key(1)]
    assert put.payload == b"abcde" and not put.is_reply


def test_replies_round_trip() -> None:
    frames = decode_frames(b"".join(VALID_REPLIES), replies=True)
    assert all(f.is_reply for f in frames)
    get = frames[3]
    assert get.op is Op.GET and get.control["sizes"] == [3, -1, 2] and get.payload == b"abcde"
    error = frames[-1]
    assert error.op is Op.ERROR and error.request_id == 9
    assert error.control == {"code": "auth", "message": "authentication failed"}


def test_decoder_takes_one_byte_at_a_time() -> None:
    stream = b"".join(VALID_REQUESTS)
    decoder = FrameDecoder()
    frames = []
    for i in range(len(stream)):
        frames += decoder.feed(stream[i : i + 1])
    assert len(frames) == len(VALID_REQUESTS) and decoder.idle


def test_encode_refuses_an_oversized_control_map() -> None:
    with pytest.raises(ProtocolError, match="control map"):
        encode_frame(Op.STATS, 1, {"junk": b"x" * MAX_CONTROL_BYTES})


# -- bad input --------------------------------------------------------------------------------

HELLO = {"version": PROTOCOL_VERSION, "nonce": NONCE}
BAD_REQUESTS = {
    "wrong magic": (raw_frame(Op.HELLO, HELLO, magic=b"HTTP"), "bad magic"),
    "wrong version": (raw_frame(Op.HELLO, HELLO, version=99), "version 99"),
    "unknown op": (raw_frame(0x42, {}), "unknown op"),
    "unknown op high bits": (raw_frame(0x102, {}), "unknown op"),
    "error as a request": (raw_frame(Op.ERROR, {"code": "x", "message": "y"}), "expected a req"),
    "reply as a request": (raw_frame(Op.EXISTS | 0x80, {"present": []}), "expected a request"),
    "control over 1 MiB": (raw_frame(Op.STATS, b"", control_len=MAX_CONTROL_BYTES + 1), "limit"),
    "payload over the limit": (raw_frame(Op.PUT, b"", payload_len=(1 << 30) + 1), "limit"),
    "malformed msgpack": (raw_frame(Op.STATS, b"\xc1\xc1"), "malformed msgpack"),
    "truncated msgpack": (raw_frame(Op.STATS, msgpack.packb({"a": "bcdef"})[:-2]), "malformed"),
    "control not a map": (raw_frame(Op.STATS, [1, 2]), "must be a map"),
    "int map keys": (raw_frame(Op.STATS, {1: 2}), "malformed msgpack"),
    "missing field": (raw_frame(Op.EXISTS, {}), "missing field 'keys'"),
    "keys not a list": (raw_frame(Op.EXISTS, {"keys": key(0)}), "must be list"),
    "key 31 bytes": (raw_frame(Op.EXISTS, {"keys": [key(0), key(1)[:31]]}), "key 1 must be 32"),
    "key as str": (raw_frame(Op.EXISTS, {"keys": ["a" * 32]}), "key 0 must be 32 bytes, got str"),
    "version as str": (raw_frame(Op.HELLO, {"version": "1"}), "'version' must be int"),
    "nonce as str": (raw_frame(Op.HELLO, {"version": 2, "nonce": "n" * 32}), "'nonce' must be"),
    "short nonce": (raw_frame(Op.HELLO, {"version": 2, "nonce": b"n"}), "'nonce' must be 32"),
    "no nonce": (raw_frame(Op.HELLO, {"version": 2, "token": "t"}), "missing field 'nonce'"),
    "long proof": (raw_frame(Op.AUTH, {"proof": b"p" * 33}), "'proof' must be 32 bytes"),
    "bool as int": (raw_frame(Op.HELLO, {"version": True}), "must be int, got bool"),
    "hello with payload": (raw_frame(Op.HELLO, HELLO, b"xx"), "carries no payload"),
    # Issue 31: a client named the segment, so a tenant could have any /dev/shm file mapped.
    "shm segment named by the client": (
        raw_frame(Op.SHM_ATTACH, {"name": "sglang_loads_x", "size": 8}),
        "the server names shared-memory segments",
    ),
    "auth segment named by the client": (
        raw_frame(Op.AUTH, {"proof": None, "shm": {"name": "psm_a", "size": 8}}),
        "the server names shared-memory segments",
    ),
    "shm size zero": (raw_frame(Op.SHM_ATTACH, {"size": 0}), "size 0"),
    "sizes too short": (raw_frame(Op.PUT, {"keys": [key(0)], "sizes": []}, b""), "0 entries"),
    "negative size": (raw_frame(Op.PUT, {"keys": [key(0)], "sizes": [-1]}), "ints >= 0"),
    "payload shorter than sizes": (
        raw_frame(Op.PUT, {"keys": [key(0)], "sizes": [4]}, b"abc"),
        "declares 3 payload bytes, control 4",
    ),
    "shm put with payload": (
        raw_frame(Op.PUT, {"keys": [key(0)], "sizes": [3], "shm": True}, b"abc"),
        "shared memory",
    ),
    "get range negative": (
        raw_frame(Op.GET, {"keys": [key(0)], "lengths": [1], "range": [-1, 4]}),
        "'range' must be",
    ),
    "get range as str": (
        raw_frame(Op.GET, {"keys": [key(0)], "lengths": [1], "range": "0:4"}),
        "'range' must be",
    ),
    "get over the payload limit": (
        raw_frame(Op.GET, {"keys": [key(0), key(1)], "lengths": [1 << 29, (1 << 29) + 1]}),
        "over the payload limit",
    ),
    "too many keys": (raw_frame(Op.EXISTS, {"keys": [key(0)] * 16385}), "malformed|per frame"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_a_protocol_error(case: str) -> None:
    frame, message = BAD_REQUESTS[case]
    with pytest.raises(ProtocolError, match=message):
        decode_frames(frame)


def test_oversized_lengths_are_refused_from_the_header_alone() -> None:
    head = raw_frame(Op.PUT, b"", payload_len=1 << 40)[:HEADER_BYTES]
    with pytest.raises(ProtocolError) as info:
        FrameDecoder().feed(head)
    assert info.value.code is ErrorCode.TOO_LARGE
    small = Limits(max_control=64, max_payload=1024)
    with pytest.raises(ProtocolError, match="control length 65"):
        decode_header(raw_frame(Op.STATS, b"", control_len=65)[:HEADER_BYTES], small)


def test_truncated_frame() -> None:
    whole = VALID_REQUESTS[5]
    for cut in (1, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 3, len(whole) - 1):
        with pytest.raises(ProtocolError, match="truncated"):
            decode_frames(whole[:cut])
    decoder = FrameDecoder()
    assert decoder.feed(whole[:-1]) == [] and not decoder.idle


def test_bad_replies() -> None:
    with pytest.raises(ProtocolError, match="expected a reply"):
        decode_frames(VALID_REQUESTS[0], replies=True)
    bad_sizes = raw_frame(Op.GET | 0x80, {"sizes": [3, -2]}, b"abc")
    with pytest.raises(ProtocolError, match="ints >= -1"):
        decode_frames(bad_sizes, replies=True)
    short = raw_frame(Op.GET | 0x80, {"sizes": [3, 2]}, b"abc")
    with pytest.raises(ProtocolError, match="control 5"):
        decode_frames(short, replies=True)


def test_decoder_refuses_input_after_an_error() -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError):
        decoder.feed(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")
    with pytest.raises(ProtocolError, match="already failed"):
        decoder.feed(VALID_REQUESTS[0])


def test_msgpack_length_bombs_allocate_nothing() -> None:
    """Tiny inputs that declare gigantic containers must fail without allocating them."""
    bombs = [
        b"\xdd\xff\xff\xff\xff",  # array32 of 4 Gi elements
        b"\xdf\xff\xff\xff\xff",  # map32 of 4 Gi entries
        b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
        b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
        b"\x81\xa4keys\xdd\x00\x01\x00\x00",  # keys: 65536 elements, none present
        b"\x91" * 100_000,  # nesting deeper than any stack
    ]
    tracemalloc.start()
    try:
        for bomb in bombs:
            with pytest.raises(ProtocolError):
                unpack_control(bomb)
            with pytest.raises(ProtocolError):
                decode_frames(raw_frame(Op.EXISTS, bomb))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


# -- fuzzing ----------------------------------------------------------------------------------


def _drive(data: bytes, replies: bool, chunk: int) -> None:
    """Feed ``data`` in chunks: only ProtocolError may come out, and nothing over the input
    (plus one header) may be buffered."""
    decoder = FrameDecoder(replies=replies, limits=Limits(max_payload=1 << 20))
    try:
        for start in range(0, len(data), chunk):
            decoder.feed(data[start : start + chunk])
            assert decoder.pending <= len(data)
    except ProtocolError as exc:
        assert str(exc)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=2048), replies=st.booleans(), chunk=st.integers(1, 64))
def test_fuzz_random_bytes(data: bytes, replies: bool, chunk: int) -> None:
    _drive(data, replies, chunk)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    index=st.integers(0, len(VALID_REQUESTS) + len(VALID_REPLIES) - 1),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["flip", "insert", "delete", "truncate"]),
            st.integers(0, 1 << 16),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=6,
    ),
    chunk=st.integers(1, 97),
)
def test_fuzz_mutated_frames(index: int, edits: list[tuple[str, int, int]], chunk: int) -> None:
    frames = VALID_REQUESTS + VALID_REPLIES
    replies = index >= len(VALID_REQUESTS)
    data = bytearray(frames[index] * 2)
    for kind, pos, value in edits:
        pos %= len(data) + 1
        if kind == "flip" and pos < len(data):
            data[pos] ^= value or 1
        elif kind == "insert":
            data[pos:pos] = bytes([value])
        elif kind == "delete":
            del data[pos : pos + 1]
        elif kind == "truncate":
            del data[pos:]
    _drive(bytes(data), replies, chunk)


@settings(max_examples=200, deadline=None)
@given(
    op=st.sampled_from(list(Op)),
    reply=st.booleans(),
    control=st.dictionaries(
        st.sampled_from(["keys", "sizes", "lengths", "range", "shm", "version", "nonce", "proof",
                         "name", "size", "present", "stored", "code", "message", "store",
                         "server"]),
        st.recursive(
            st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40)
            | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=4), inner, max_size=3)
            ),
            max_leaves=12,
        ),
        max_size=5,
    ),
    payload=st.binary(max_size=64),
)  # fmt: skip
def test_fuzz_well_framed_random_controls(
    op: Op, reply: bool, control: dict[str, object], payload: bytes
) -> None:
    wire_op = op if op is Op.ERROR or not reply else op | 0x80
    _drive(raw_frame(wire_op, control, payload), reply or op is Op.ERROR, 1 << 16)


# -- placement --------------------------------------------------------------------------------


def test_ring_replicas_are_distinct_and_stable() -> None:
    nodes = [f"10.0.0.{i}:7000" for i in range(5)]
    ring = HashRing(nodes)
    for i in range(200):
        reps = ring.replicas(key(i), 3)
        assert len(set(reps)) == 3 and reps == HashRing(nodes).replicas(key(i), 3)
        assert ring.replicas(key(i), 1) == reps[:1]
    with pytest.raises(ValueError):
        ring.replicas(key(0), 6)
    with pytest.raises(ValueError):
        HashRing(["a", "a"])


def test_ring_balance_and_minimal_movement() -> None:
    nodes = [f"host{i}:1" for i in range(4)]
    ring = HashRing(nodes)
    owners = [ring.replicas(key(i), 1)[0] for i in range(8000)]
    for node in nodes:
        assert 0.15 < owners.count(node) / len(owners) < 0.35
    grown = HashRing([*nodes, "host4:1"])
    moved = sum(grown.replicas(key(i), 1)[0] != owners[i] for i in range(8000))
    assert moved / 8000 < 0.3  # about 1/5 move; a modulo scheme would move 4/5
    assert all(grown.replicas(key(i), 1)[0] in (owners[i], "host4:1") for i in range(8000))


def test_urls() -> None:
    assert parse_url("tcp://127.0.0.1:5000").endpoint == "127.0.0.1:5000"
    assert parse_url("shm://[::1]:5").url == "shm://[::1]:5"
    for bad in ("http://a:1", "tcp://a", "tcp://:5", "tcp://a:b", "tcp://a:1/x"):
        with pytest.raises(ValueError):
            parse_url(bad)


# -- client argument checks -------------------------------------------------------------------


def test_byte_views_share_memory() -> None:
    array = np.zeros((4, 8), np.float16)
    view = byte_view(array, writable=True)
    assert view.nbytes == 64 and view.format == "B"
    view[0] = 0xFF
    assert array.view(np.uint8)[0, 0] == 0xFF
    tensor = torch.zeros(2, 16, dtype=torch.bfloat16)
    tview = byte_view(tensor, writable=True)
    tview[:2] = b"\x80\x3f"  # bfloat16 1.0
    assert tensor[0, 0].item() == 1.0 and tview.nbytes == 64
    assert byte_view(bytearray(5), writable=True).nbytes == 5
    assert byte_view(b"abc", writable=False).nbytes == 3
    with pytest.raises(ValueError, match="read-only"):
        byte_view(b"abc", writable=True)
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(np.zeros((4, 4))[:, ::2], writable=True)
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(4, 4).t(), writable=True)
    with pytest.raises(TypeError, match="buffer protocol"):
        byte_view([1, 2], writable=False)


def _refused_url(scheme: str = "tcp") -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"{scheme}://127.0.0.1:{sock.getsockname()[1]}"


def test_client_argument_errors_raise() -> None:
    with pytest.raises(ValueError, match="replication 2"):
        KvStoreClient(_refused_url(), replication=2)
    try:
        import ucxx  # noqa: F401
    except ImportError:
        with pytest.raises(KvStoreError, match=r"banaserve\[ucx\]"):
            KvStoreClient("ucx://127.0.0.1:1")
    else:  # ucx:// works (test_kvstore_ucx.py): nobody listening is a down shard, a miss
        with KvStoreClient(_refused_url("ucx"), timeout=2.0) as client:
            assert client.exists([key(0)]) == [False]
    with KvStoreClient(_refused_url()) as client:
        with pytest.raises(ValueError, match="key 1 must be 32 bytes"):
            client.exists([key(0), b"short"])
        with pytest.raises(ValueError, match="2 buffers for 1 keys"):
            client.put([key(0)], [b"a", b"b"])
        with pytest.raises(ValueError, match="byte_range 4"):
            client.get([key(0)], [bytearray(8)], byte_range=(0, 4))


def test_unreachable_shards_are_misses_not_errors(caplog: pytest.LogCaptureFixture) -> None:
    urls = [_refused_url("tcp"), _refused_url("shm")]
    with KvStoreClient(urls, replication=2, timeout=1.0) as client:
        buf = bytearray(b"untouched")
        assert client.get([key(1)], [buf]) == [False] and buf == b"untouched"
        assert client.put([key(1)], [b"page"]) == [False]
        assert client.exists([key(1), key(2)]) == [False, False]
        assert client.longest_prefix([key(1)]) == 0
        assert all(not s["up"] for s in client.stats().values())
    downs = [r for r in caplog.records if "is down" in r.getMessage()]
    assert len(downs) == 2  # one warning per shard, not per call


def test_struct_sizes() -> None:
    assert HEADER_BYTES == 28 and struct.calcsize("<4sHHQIQ") == HEADER_BYTES


def test_lookup_and_release_round_trip() -> None:
    lookup = {"keys": [key(0)], "owner": "a", "wait_ms": 0, "lease_ms": 1, "claim": False}
    frames = decode_frames(
        encode_frame(Op.LOOKUP, 1, lookup) + encode_frame(Op.RELEASE, 2, {"keys": [], "owner": "a"})
    )
    assert [f.op for f in frames] == [Op.LOOKUP, Op.RELEASE] and frames[0].control == lookup
    replies = decode_frames(
        encode_frame(Op.LOOKUP, 1, {"present": [True], "claimed": [False]}, reply=True)
        + encode_frame(Op.RELEASE, 2, {"released": []}, reply=True),
        replies=True,
    )
    assert [f.op for f in replies] == [Op.LOOKUP, Op.RELEASE]
    uneven = encode_frame(Op.LOOKUP, 1, {"present": [True], "claimed": []}, reply=True)
    with pytest.raises(ProtocolError, match="'claimed'"):
        decode_frames(uneven, replies=True)
    with pytest.raises(ProtocolError, match="carries no payload"):
        decode_frames(encode_frame(Op.LOOKUP, 1, lookup, b"x"))


def test_clear_round_trip_and_bad_frames() -> None:
    (request,) = decode_frames(encode_frame(Op.CLEAR, 3, {}))
    assert request.op is Op.CLEAR and request.control == {}
    (reply,) = decode_frames(encode_frame(Op.CLEAR, 3, {"dropped": 12}, reply=True), replies=True)
    assert reply.op is Op.CLEAR and reply.control == {"dropped": 12}
    with pytest.raises(ProtocolError, match="carries no payload"):
        decode_frames(encode_frame(Op.CLEAR, 3, {}, b"x"))
    for bad, message in [({}, "missing field 'dropped'"), ({"dropped": -1}, r"in \[0, "),
                         ({"dropped": True}, "must be int, got bool")]:  # fmt: skip
        with pytest.raises(ProtocolError, match=message):
            decode_frames(encode_frame(Op.CLEAR, 3, bad, reply=True), replies=True)
