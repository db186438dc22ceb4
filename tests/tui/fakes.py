"""A fake daemon client for TUI tests: scripted answers, recorded calls, controllable events."""

from __future__ import annotations

import asyncio

from minibatch.tui.client import DaemonUnavailable, Delta


def event(mode="continuous", running=0, waiting=0, used=0, step=1, pending=None):
    return {
        "step": step,
        "timestamp": 0.0,
        "mode": mode,
        "pending_mode": pending,
        "running": running,
        "max_num_seqs": 8,
        "waiting": waiting,
        "prefill_tokens": 0,
        "decode_tokens": running,
        "padding_rows": 0,
        "kv_blocks_used": used,
        "kv_blocks_total": 64,
        "prefix_hit_blocks": 0,
        "preemptions": 0,
        "wasted_row_steps": 0,
        "total_preemptions": 0,
        "step_time": 0.05,
        "kv_usage_percent": 100 * used / 64,
        "prefill_tokens_per_s": 10.0,
        "decode_tokens_per_s": 20.0,
    }


def step_record(step: int, rows: list[list], mode: str = "continuous", waiting: int = 0) -> dict:
    return {"step": step, "t": 0.0, "ms": 20.0, "mode": mode, "waiting": waiting, "rows": rows, "preempted": []}


class FakeClient:
    target = "/run/user/1000/minibatch/minibatchd.sock"

    def __init__(self, answer: str = "Hello **there**, friend.", hold: bool = False) -> None:
        self.answer, self.hold = answer, hold
        self.step_records: list[dict] = []  # what steps() serves
        self.steps_calls = 0
        self.chats: list[list[dict]] = []
        self.params: list[dict] = []
        self.cancelled = 0
        self.modes: list[str] = []
        self.events_queue: asyncio.Queue | None = None
        self.connected = True
        self.next_id = 0
        self.release = asyncio.Event()
        self.listed = [{"id": "fake-model", "loaded": True}, {"id": "qwen2.5:0.5b", "loaded": False}]
        self.viewed: list[str | None] = []  # the model of every events(), blocks() and steps() call

    async def models(self) -> list[dict]:
        return self.listed

    async def close(self) -> None:
        pass

    async def health(self) -> dict:
        return {"status": "ok", "model": "fake-model", "weights": "Q4_1 native", "device": "cpu"}

    async def set_mode(self, mode: str) -> dict:
        self.modes.append(mode)
        return {"mode": "continuous", "requested_mode": mode}

    async def blocks(self, model: str | None = None) -> dict:
        self.viewed.append(model)
        if not self.connected:
            raise DaemonUnavailable("down")
        return {"total": 64, "owners": {f"req-{i}": [1 + 2 * i, 2 + 2 * i] for i in range(self.next_id)}, "shared": [1]}

    async def steps(self, since: int = 0, model: str | None = None) -> dict:
        self.viewed.append(model)
        self.steps_calls += 1
        if not self.connected:
            raise DaemonUnavailable("down")
        return {
            "last_step": self.step_records[-1]["step"] if self.step_records else 0,
            "max_rows": 8,
            "steps": [r for r in self.step_records if r["step"] > since][:200],
        }

    async def events(self, model: str | None = None):
        self.viewed.append(model)
        if self.events_queue is None:
            self.events_queue = asyncio.Queue()
        if not self.connected:
            raise DaemonUnavailable("connection refused")
        while True:
            item = await self.events_queue.get()
            if isinstance(item, Exception):
                raise item
            yield item

    async def chat(self, messages, **params):
        self.chats.append(messages)
        self.params.append(params)
        rid = f"req-{self.next_id}"
        self.next_id += 1
        yield Delta(request_id=rid)
        try:
            for word in self.answer.split(" "):
                yield Delta(text=word + " ")
                await asyncio.sleep(0)
            if self.hold:
                await self.release.wait()
            yield Delta(
                finish_reason="stop",
                timings={"ttft_ms": 12.0, "decode_ms": 100.0, "queue_wait_ms": 1.0, "cached_prompt_tokens": 16},
            )
            yield Delta(usage={"completion_tokens": 5})
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except GeneratorExit:
            self.cancelled += 1
            raise
