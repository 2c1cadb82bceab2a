"""A process that takes the store's port (while the store restarts) learns nothing it can use
and serves no one (issue 31, item 6): the token never travels, and a client refuses a server
that cannot prove it holds the token. Before protocol 2, HELLO carried the token in clear."""

from __future__ import annotations

import hashlib
import os
import socket
import threading

import pytest

from banaserve.kvstore.client import KvStoreAuthError, KvStoreClient
from banaserve.kvstore.embedded import proves_token
from banaserve.kvstore.framing import FrameDecoder
from banaserve.kvstore.protocol import NONCE_BYTES, PROTOCOL_VERSION, Op, encode_frame
from banaserve.kvstore.server import ServerConfig
from banaserve.kvstore.storage import TieredStore
from support.kvstore_server import TOKEN, InProcessServer, keys_for, pages


class Impostor:
    """Listens on a port and plays a store's handshake without the token, answering AUTH
    with ``proof``; keeps every byte a client sent."""

    def __init__(self, proof: bytes | None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.proof = proof
        self.received = bytearray()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        decoder = FrameDecoder()
        with conn:
            while chunk := conn.recv(65536):
                self.received += chunk
                for frame in decoder.feed(chunk):
                    if frame.op is Op.HELLO:
                        control = {"version": PROTOCOL_VERSION, "server": "impostor",
                                   "nonce": os.urandom(NONCE_BYTES)}  # fmt: skip
                    else:
                        control = {"version": PROTOCOL_VERSION, "max_payload": 1 << 20,
                                   "shm": False, "tenant": None, "proof": self.proof}  # fmt: skip
                    conn.sendall(encode_frame(frame.op, frame.request_id, control, reply=True))

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=10)


@pytest.mark.parametrize("proof", [None, b"p" * NONCE_BYTES])
def test_a_client_refuses_a_server_that_cannot_prove_the_token(proof: bytes | None) -> None:
    impostor = Impostor(proof)
    try:
        with pytest.raises(KvStoreAuthError, match="did not prove it holds the store's token"):
            KvStoreClient(impostor.url, token=TOKEN)
    finally:
        impostor.close()
    sent = bytes(impostor.received)
    assert sent, "the client never connected"
    for secret in (TOKEN.encode(), hashlib.sha256(TOKEN.encode()).digest()):
        assert secret not in sent


def test_the_real_store_proves_it_and_a_store_without_tokens_is_refused() -> None:
    for token in (TOKEN, None):
        store = TieredStore(8 << 20)
        server = InProcessServer(store, ServerConfig(token=token))
        try:
            if token is None:
                with pytest.raises(KvStoreAuthError, match="did not prove"):
                    KvStoreClient(server.url, token=TOKEN)  # it may be anyone on that port
            with KvStoreClient(server.url, token=token) as client:
                keys = keys_for("proved", 2)
                assert client.put(keys, pages(2)) == [True, True]
        finally:
            server.close()
            store.close()


def test_a_restarted_shard_is_back_only_once_it_proves_the_token() -> None:
    """The supervisor's readiness check of a restarted store: a port that accepts (another
    process took it) is not the store; before, accepting was enough."""
    impostor = Impostor(None)
    try:
        assert not proves_token(impostor.url, TOKEN, timeout_s=5)
    finally:
        impostor.close()
    assert not proves_token(impostor.url, TOKEN, timeout_s=5)  # nothing listens now
    store = TieredStore(8 << 20)
    server = InProcessServer(store, ServerConfig(token=TOKEN))
    try:
        assert proves_token(server.url, TOKEN)
        assert not proves_token(server.url, "another-token-0123")
    finally:
        server.close()
        store.close()
