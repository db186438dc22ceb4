"""The Responses API's store: recent responses by id, each with its owner, bounded by count, bytes and age
(`store: true`, the default), for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`; and the ids
themselves (a cluster's ingress routes a response's later requests by the replica tag inside its id)."""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import re
import time
import uuid
from collections import OrderedDict

from aiohttp import web

from ..generation.images import ImageInput
from ..protocol import ApiError

STORE_MAX = 512  # responses kept for previous_response_id and GET, the oldest evicted first
STORE_MAX_BYTES = 64 * 2**20  # and their JSON together at most this, the oldest evicted first
STORE_TTL_S = 3600.0
ID_PATTERN = "^resp_[0-9a-f]{24}$"  # what response_id makes


class ResponseStore:
    """Recent responses by id, each with its owner (who made it: a key's name, or the socket's user) and what
    its conversation was (for previous_response_id). Bounded by count, by bytes and by age; another owner's
    response is answered exactly as an unknown id is."""

    def __init__(self, max_items: int = STORE_MAX, ttl: float = STORE_TTL_S, max_bytes: int = STORE_MAX_BYTES):
        self.max_items, self.ttl, self.max_bytes = max_items, ttl, max_bytes
        self._items: OrderedDict[str, tuple[float, str, dict, list[dict], int]] = OrderedDict()
        self.bytes = 0  # the stored responses' and conversations' JSON
        self.evicted = 0

    def put(self, response: dict, conversation: list[dict], owner: str) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation, default=_image_text))
        if size > self.max_bytes:
            self.evicted += 1
            return  # more than the whole store holds: answered, not kept
        self._drop(response["id"])
        self._items[response["id"]] = (time.monotonic(), owner, response, conversation, size)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
            self.evicted += 1

    def _drop(self, rid: str) -> None:
        entry = self._items.pop(rid, None)
        if entry is not None:
            self.bytes -= entry[4]

    def get(self, rid: str, owner: str, param: str = "response_id") -> tuple[dict, list[dict]]:
        """The response and its conversation (a copy: a continuation never changes what is stored)."""
        if not re.fullmatch(ID_PATTERN, rid):
            raise ApiError(404, f"{param}: {rid[:80]!r} is not a response id (resp_ and 24 hex digits)", param)
        entry = self._items.get(rid)
        if entry is not None and time.monotonic() - entry[0] > self.ttl:
            self._drop(rid)
            entry = None
        if entry is None or not hmac.compare_digest(entry[1], owner):
            raise ApiError(
                404,
                f"{param}: no stored response {rid!r} (responses are kept {self.ttl / 60:g} minutes, "
                f"{self.max_items} and {self.max_bytes // 2**20} MiB at most, only with store: true, and "
                "only for the key that made them)",
                param,
                "response_not_found",
            )
        return entry[2], copy.deepcopy(entry[3])

    def delete(self, rid: str, owner: str) -> None:
        self.get(rid, owner)
        self._drop(rid)

    def prometheus(self) -> bytes:
        """What the store holds, and what it let go, in Prometheus' text format."""
        lines = [
            "# HELP minibatch_responses_stored Responses kept for GET and previous_response_id",
            "# TYPE minibatch_responses_stored gauge",
            f"minibatch_responses_stored {len(self._items)}",
            "# HELP minibatch_responses_stored_bytes Their JSON, and their conversations', together",
            "# TYPE minibatch_responses_stored_bytes gauge",
            f"minibatch_responses_stored_bytes {self.bytes}",
            "# HELP minibatch_responses_evicted_total Responses let go for room (count or bytes), or too large to keep",
            "# TYPE minibatch_responses_evicted_total counter",
            f"minibatch_responses_evicted_total {self.evicted}",
        ]
        return ("\n".join(lines) + "\n").encode()


STORE = web.AppKey("responses", ResponseStore)


def response_id(tag: str | None) -> str:
    """A response's id: resp_ and 24 hex digits, the first 8 the replica's tag behind a cluster's ingress
    (which routes the response's later requests by it)."""
    return "resp_" + (tag or "") + uuid.uuid4().hex[: 24 - len(tag or "")]


def replica_tag(replica_id: str) -> str:
    """A replica's 8 hex digits in the ids of the responses it stores."""
    return hashlib.sha256(replica_id.encode()).hexdigest()[:8]


def tag_of(response_id: str) -> str | None:
    return response_id[5:13] if re.fullmatch(ID_PATTERN, response_id) else None


def _image_text(value: ImageInput) -> str:
    """An image in a stored conversation counts as the text it was sent as."""
    return value.url or value.b64 or ""
