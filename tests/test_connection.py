"""common.connection's Outbox on a real Redis: commands out at once, their replies read later, in order."""

from __future__ import annotations

import uuid

import pytest
import redis
from redis.exceptions import ResponseError

from common.connection import Outbox


def test_commands_go_out_before_their_replies_are_read(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    channel, key = f"outbox:{uuid.uuid4().hex}", f"outbox:{uuid.uuid4().hex}"
    listener = client.pubsub()
    listener.subscribe(channel)
    assert listener.get_message(timeout=1)["type"] == "subscribe"
    outbox = Outbox(client)
    outbox.send([("PUBLISH", channel, "a"), ("PUBLISH", channel + ":nobody", "b"), ("SET", key, "1", "EX", 60)])
    message = listener.get_message(timeout=1)  # delivered while the replies still wait in the socket
    assert message is not None and message["data"] == b"a"
    assert outbox.replies() == [1, 0, b"OK"]
    assert outbox.replies() == []
    listener.close()


def test_a_refused_command_raises_once_every_reply_is_read(redis_url: str) -> None:
    """The replies after a refused one are read too, so the connection stays in step for the next send."""
    client = redis.Redis.from_url(redis_url)
    key = f"outbox:{uuid.uuid4().hex}"
    client.set(key, "not a stream", ex=60)
    outbox = Outbox(client)
    outbox.send([("XACK", key, "group", "0-1"), ("GET", key)])
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        outbox.replies()
    outbox.send([("GET", key), ("DEL", key)])
    assert outbox.replies() == [b"not a stream", 1]


def test_discard_forgets_unread_replies(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    outbox = Outbox(client)
    outbox.send([("PING",)])
    outbox.discard()
    outbox.send([("ECHO", "again")])
    assert outbox.replies() == [b"again"]
