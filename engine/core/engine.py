"""LLMEngine: one step is schedule -> execute -> update -> outputs.

The engine itself imports no torch; the runner and the tokenizer come in
through the constructor (see `factory.build_engine` for the real ones).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from minibatch.engine.core.admission import RequestRejected
from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.config import SchedulerConfig
from minibatch.engine.core.cpu_wait import RunQueueWait
from minibatch.engine.core.detokenizer import IncrementalDetokenizer, Tokenizer
from minibatch.engine.core.info import EngineInfo
from minibatch.engine.core.kv_tier import BlockTier, TierCounters
from minibatch.engine.core.outputs import EngineState, RequestOutput, RunnerOutput, StepAbandoned, StepStats
from minibatch.engine.core.request import POOLINGS, ImageSpan, Request, RequestStatus, check_images
from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.core.scheduler import Scheduler
from minibatch.engine.core.scheduler_output import SchedulerOutput
from minibatch.engine.core.timeline import Timeline
from minibatch.engine.lora.names import LoraUses, lora_salt
from minibatch.engine.spec_decode.config import SpecConfig
from minibatch.engine.spec_decode.decoder import Proposer, SpecDecoder

if TYPE_CHECKING:
    from minibatch.engine.lora.adapter import LoraAdapter
    from minibatch.engine.vision.images import ImageEncoder


class Runner(Protocol):
    """What the engine needs of a model runner (runner/model_runner.py is the real one)."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Compute the scheduled rows; for every row that reached its last token, the tokens it takes."""

    def forget(self, request_id: str) -> None:
        """The request is done: drop its per-request state (the token counts its penalties keep)."""

    def device_lost(self) -> bool:
        """After a failed step: whether the device is unusable from now on."""

    def add_lora(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` (checked against the model at its load) under its name."""

    def remove_lora(self, name: str) -> None:
        """Stop serving the adapter served as `name` (no request runs under it)."""

    def lora_bytes(self) -> int:
        """What the served adapters' weights take, as the kernels read them."""


@dataclass(slots=True)
class _Stream:
    """Per-request output state: the detokenizer and how much text went out."""

    detok: IncrementalDetokenizer
    sent_chars: int = 0
    sent_tokens: int = 0
    cut: bool = False  # a stop string ended the text: nothing after it may be flushed


class LLMEngine:
    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        block_manager: BlockManager,
        scheduler_config: SchedulerConfig,
        eos_token_ids: tuple[int, ...] = (),
        mode: str = "continuous",
        clock: Callable[[], float] = time.monotonic,
        timeline_steps: int = 512,
        speculative: SpecConfig | None = None,
        proposer: Proposer | None = None,  # the drafts' source (default: the config's n-gram lookup)
        tier: BlockTier | None = None,  # a second tier of prefix blocks (kv_tier.py): disk, past restarts
    ) -> None:
        self.runner, self.tokenizer, self.clock = runner, tokenizer, clock
        # the LoRA adapters served, by name: their facts (lora/adapter.py; the weights are the runner's)
        self.loras: dict[str, LoraAdapter] = {}
        # reads and checks an adapter against the model, from its path and as its name (lora/adapter.py's
        # load_adapter, set by factory.build_engine for a model that serves adapters); any thread may call it
        self.lora_reader: Callable[[str, str], LoraAdapter] | None = None
        # a vision model's images: its tower behind the request bounds, and how an image sits in a prompt
        # (vision/images.py, set by factory.build_engine); None: the model sees no images
        self.images: ImageEncoder | None = None
        self.aborted: set[str] = set()  # aborts asked for from other threads, not applied yet (abort_soon)
        self.abandoned_steps = 0  # forwards stopped between layers because all their requests were aborted
        # proposes draft tokens for decoding rows (None: one token per row per step)
        on = speculative is not None and speculative.enabled
        self.spec = SpecDecoder(speculative, proposer) if on else None
        self.timeline = Timeline(timeline_steps)  # the last steps' rows, for the chat's timeline and the report
        self.scheduler = Scheduler(scheduler_config, block_manager, mode, clock, tier)
        self.tier = tier
        if tier is not None:  # every block the prefix cache registers is offered to the tier
            block_manager.registered = []
        self.eos_token_ids = frozenset(eos_token_ids)
        self.streams: dict[str, _Stream] = {}
        self.pending_outputs: list[RequestOutput] = []  # finished outside a step (aborts)
        self.num_steps = 0
        self._run_queue = RunQueueWait()
        self._run_queue_at: float | None = None
        self.info: EngineInfo | None = None  # the model's facts, set by whoever built the runner (factory.build_engine)

    # -- requests ---------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        share_prompt_with: str | None = None,
        checked: bool = False,
        pooling: str | None = None,
        cache_salt: int = 0,
        reuse_shifted: bool = False,
        loras: LoraUses = (),
        images: tuple[ImageSpan, ...] = (),
    ) -> Request:
        """Queue a request; raises RequestRejected (or QueueFull) with the reason.

        `share_prompt_with` names an earlier request with the same prompt (n > 1): this one then waits until
        that one has computed the prompt and borrows its KV blocks instead of computing them again.
        `checked`: the caller (AsyncEngine) ran the admission checks already, counting its in-flight requests.
        `pooling` ("last", "mean" or "cls"): an embedding request, which ends with its prompt's pooled hidden
        states (RequestOutput.embedding) once the prompt is computed, in the same batches as the others; "rank":
        a cross-encoder's scores of the pair its prompt holds, in the same place.
        `cache_salt`: the prefix caches' namespace (request.py): blocks are shared only within one salt.
        `reuse_shifted`: it may start from a recent prompt's K/V at shifted positions (core/kv_reuse.py; not what
        computing its prompt gives: fill-in-the-middle requests).
        `loras`: the LoRA adapters the model serves (add_lora) to run it under, with their scales (lora_uses);
        its blocks are cached in a namespace of their own.
        `images`: its prompt's images (request.py's ImageSpan: placeholder positions whose input embeddings are
        the image's), in order, apart, within the prompt; a ValueError otherwise."""
        if pooling not in (None, *POOLINGS):
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.check_images(images, len(prompt_token_ids))
        if loras:
            cache_salt = lora_salt(cache_salt, [(self.lora_digest(name), scale) for name, scale in loras])
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            arrival_time=self.clock(),
            pooling=pooling,
            cache_salt=cache_salt,
            reuse_shifted=reuse_shifted,
            loras=loras,
            images=tuple(images),
        )
        leader = self.scheduler.requests.get(share_prompt_with) if share_prompt_with is not None else None
        if leader is not None and leader.prompt_token_ids == req.prompt_token_ids:
            req.prompt_leader = leader
        self.scheduler.add(req, checked)
        self.streams[request_id] = _Stream(IncrementalDetokenizer(self.tokenizer))
        return req

    def check_images(self, images: tuple[ImageSpan, ...], prompt_len: int) -> None:
        """A ValueError unless the images lie in order, apart, within the prompt; RequestRejected for a whole
        image (computed in one forward) longer than a step computes."""
        check_images(images, prompt_len)
        budget = self.scheduler.config.max_num_batched_tokens
        if any(span.whole and span.end - span.offset > budget for span in images):
            raise RequestRejected(
                f"an image takes more positions than one step computes (max_num_batched_tokens {budget})", "images"
            )

    # -- LoRA adapters ----------------------------------------------------
    def add_lora(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` (lora/adapter.py, checked against the model) to requests that name it."""
        self.runner.add_lora(adapter)
        self.loras[adapter.name] = adapter.without_weights()

    def remove_lora(self, name: str) -> None:
        """Let the adapter served as `name` go (its memory with it); a RuntimeError while a request in the
        engine runs under it. Its blocks stay cached under its digest: loaded again, its prompts are hits."""
        if any(name == n for r in self.scheduler.requests.values() for n, _ in r.loras):
            raise RuntimeError(f"LoRA adapter {name!r} is in use")
        if self.loras.pop(name, None) is not None:
            self.runner.remove_lora(name)

    def lora_digest(self, name: str) -> bytes:
        """The digest of the adapter served as `name`, or RequestRejected (404) naming it."""
        adapter = self.loras.get(name)
        if adapter is None:
            raise RequestRejected(f"no LoRA adapter named {name!r} is loaded", "model", "model_not_found", 404)
        return adapter.digest

    def abort_soon(self, request_id: str) -> None:
        """From any thread, before the abort itself is queued: a forward computing for nobody else stops at its
        next layer instead of running to its end (an editor's keystroke abandons the last one's request)."""
        self.aborted.add(request_id)

    def abort(self, request_id: str) -> bool:
        self.aborted.discard(request_id)
        req = self.scheduler.abort(request_id)
        if req is None or request_id not in self.streams:
            return False
        self.pending_outputs.append(self._final(req))
        return True

    def set_mode(self, mode: str) -> None:
        self.scheduler.set_mode(mode)

    def close(self) -> None:
        """The engine is let go (unload, shutdown): the disk tier finishes its writes and reads; images waiting
        for the tower are dropped."""
        if self.tier is not None:
            self.tier.close()
        if self.images is not None:
            self.images.close()

    @property
    def mode(self) -> str:
        return self.scheduler.mode

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.pending_outputs)

    # -- the step ---------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepStats | None]:
        outputs, self.pending_outputs = self.pending_outputs, []
        started = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        for req in (*self.scheduler.running, *sched.preempted):
            req.draft_token_ids = []  # a proposal lives for one schedule
        if sched.is_empty:
            return outputs, None
        ids = frozenset(r.request_id for r in sched.requests)
        imaged = {  # prompt chunks that take an image's embeddings (the timeline marks them)
            r.request_id
            for r, n, decode in zip(sched.requests, sched.num_new_tokens, sched.is_decode)
            if r.images and not decode and r.takes_image(r.num_computed_tokens, n)
        }
        if ids and not sched.padding:  # (a step whose every row was aborted meanwhile stops between layers)
            sched.abandon = lambda: ids <= self.aborted
        try:
            result = self.runner.execute(sched)
        except StepAbandoned:  # its requests' aborts are next in the inbox; nothing they computed is kept
            self.abandoned_steps += 1
            return outputs, None
        finally:
            self.scheduler.blocks.unpin_all()  # the rows shifted reuse copied out of them are in
        now = self.clock()
        drafted = {r.request_id for r, d in zip(sched.requests, sched.drafts) if d}
        accepted_rows: dict[str, int] = {}  # verify rows: draft tokens accepted
        for req, tokens in self.scheduler.update(sched, result.sampled):
            logprobs = result.logprobs.get(req.request_id)
            error = None
            for j, token in enumerate(tokens):
                req.append_token(token, now)
                if logprobs is not None:
                    req.output_logprobs.append(logprobs[j])
                error = self._take(req)
                if req.status.finished:
                    break
            self.scheduler.settle(req)
            if req.request_id in drafted:
                accepted_rows[req.request_id] = len(tokens) - 1
            out = self._final(req, error) if req.status.finished else self._pending_delta(req)
            if out is not None:
                outputs.append(out)
        for request_id, vector in result.embeddings.items():
            req = self.scheduler.requests.get(request_id)
            if req is None or req.status.finished:
                continue
            req.embedding, req.first_token_time = vector, now
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            out = self._final(req)
            out.embedding = vector
            outputs.append(out)
        if self.tier is not None:  # before the next schedule could hand a registered block out again
            self.tier.save(self.scheduler.blocks.take_registered())
        self.num_steps += 1
        step_time = time.perf_counter() - started
        spec_stats = self._observe_spec(sched, accepted_rows, step_time)
        stats = self._stats(sched, step_time, self._cpu_waited(), spec_stats)
        self._record(sched, accepted_rows, stats, imaged)
        return outputs, stats

    def _observe_spec(
        self, sched: SchedulerOutput, accepted_rows: dict[str, int], step_time: float
    ) -> tuple[int, int, int]:
        """(draft tokens verified, accepted, rows that verified) this step; the decoder learns from them."""
        if self.spec is None:
            return 0, 0, 0
        drafted = accepted = rows = 0
        for req, draft in zip(sched.requests, sched.drafts):
            if draft:
                kept = accepted_rows.get(req.request_id, 0)
                self.spec.observe(req, len(draft), kept)
                drafted, accepted, rows = drafted + len(draft), accepted + kept, rows + 1
        if not sched.num_prefill_tokens:
            self.spec.observe_step(sched.num_decode_tokens + sched.num_draft_tokens + len(sched.padding), step_time)
        return drafted, accepted, rows

    def _record(
        self, sched: SchedulerOutput, accepted_rows: dict[str, int], stats: StepStats, images: set[str]
    ) -> None:
        computed = [
            (r.request_id, n, d, len(draft), accepted_rows.get(r.request_id, 0))
            for r, n, d, draft in zip(sched.requests, sched.num_new_tokens, sched.is_decode, sched.drafts)
        ]
        padding = [r.request_id for r in sched.padding]
        seen = {c[0] for c in computed}
        seen.update(padding)
        held = [r.request_id for r in self.scheduler.running if r.request_id not in seen and not r.status.finished]
        self.timeline.record(
            stats.step,
            stats.timestamp,
            stats.step_time,
            stats.mode,
            stats.waiting,
            computed,
            padding,
            held,
            [r.request_id for r in sched.preempted],
            {r.request_id for r in sched.requests if r.pooling is not None},
            {r.request_id: "+".join(n for n, _ in r.loras) for r in (*sched.requests, *sched.padding) if r.loras},
            images,
        )

    def _take(self, req: Request) -> str | None:
        """Detokenize the request's newest token and apply the stop conditions (finishing it when one
        holds); returns an error when the request ended as a fault. One token at a time, so a step that
        takes several ends a request at exactly the token that stops it."""
        p, token = req.params, req.output_token_ids[-1]
        stream = self.streams[req.request_id]
        status = None
        if p.grammar is not None and not p.grammar.accept(token):  # the mask allowed it: a grammar engine fault
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            return f"the response format's grammar refused token {token}"
        if ((not p.ignore_eos or p.grammar is not None) and token in self.eos_token_ids) or token in p.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED  # a stop token adds no text
        else:
            stream.detok.push([token])
            if p.stop:
                cut = _find_stop(stream.detok.text, p.stop, stream.sent_chars)
                if cut is not None:
                    stream.detok.text = stream.detok.text[:cut]
                    stream.cut = True
                    status = RequestStatus.FINISHED_STOPPED
        if status is None and p.grammar is not None and p.grammar.is_done():
            status = RequestStatus.FINISHED_STOPPED  # the document is complete
        if status is None and len(req.output_token_ids) >= p.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(req, status)
        return None

    def _pending_delta(self, req: Request) -> RequestOutput | None:
        """The new text of a running request, holding back what could be the start of a stop string."""
        stream = self.streams[req.request_id]
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        return self._delta(req, stream, len(stream.detok.text) - hold)

    def _delta(self, req: Request, stream: _Stream, upto: int) -> RequestOutput | None:
        text = stream.detok.text[stream.sent_chars : max(upto, stream.sent_chars)]
        tokens = req.output_token_ids[stream.sent_tokens :]
        if not text and not tokens:
            return None
        start = stream.sent_tokens
        stream.sent_chars += len(text)
        stream.sent_tokens = len(req.output_token_ids)
        out = RequestOutput(req.request_id, text, tokens)
        if req.params.logprobs is not None:
            out.logprobs = req.output_logprobs[start : start + len(tokens)]
        return out

    def _final(self, req: Request, error: str | None = None) -> RequestOutput:
        stream = self.streams.pop(req.request_id)
        if not stream.cut:
            stream.detok.flush()
        out = self._delta(req, stream, len(stream.detok.text)) or RequestOutput(req.request_id, "", [])
        out.finished, out.finish_reason = True, req.status.finish_reason
        out.metrics, out.error = req.metrics(), error
        self.runner.forget(req.request_id)
        if self.spec is not None:
            self.spec.forget(req.request_id)
        return out

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with an error (after a forward failed) and free their blocks."""
        outputs = self.pending_outputs
        self.pending_outputs = []
        loading = [r for r, _ in self.scheduler.loading.values()]
        for req in list(self.scheduler.waiting) + loading + list(self.scheduler.running):
            already = req.status.finished
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            if not already and req.request_id in self.streams:
                outputs.append(self._final(req, error))
        for req in list(self.scheduler.running):  # static members kept for padding
            self.scheduler.release(req)
        return outputs

    def state(self) -> EngineState:
        """The engine now (call on the thread that steps it)."""
        s, bm = self.scheduler, self.scheduler.blocks
        return EngineState(
            step=self.num_steps,
            timestamp=time.time(),
            mode=s.mode,
            pending_mode=s.pending_mode,
            running=len(s.running),
            max_num_seqs=s.config.max_num_seqs,
            waiting=len(s.waiting),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_usable_blocks,
            block_size=bm.block_size,
            kv_window=bm.window,
            kv_blocks_released_out_of_window=bm.released_blocks,
            prefix_cache_hit_blocks=bm.prefix_hits,
            reused_tokens=s.reused_tokens,
            **_tier_fields(self.tier, s.tier_hit_blocks, len(s.loading)),
            preemptions=s.num_preemptions,
            wasted_row_steps=s.wasted_row_steps,
            speculative=self.spec.config.method if self.spec is not None else "off",
            draft_tokens=self.spec.drafted if self.spec is not None else 0,
            accepted_tokens=self.spec.accepted if self.spec is not None else 0,
            verify_rows=self.spec.verify_rows if self.spec is not None else 0,
        )

    def _cpu_waited(self) -> float | None:
        """Run-queue wait since the previous step ended (one read of the threads' counters a step)."""
        now = self._run_queue.seconds()
        before, self._run_queue_at = self._run_queue_at, now
        return None if now is None or before is None else max(0.0, now - before)

    def _stats(
        self,
        sched: SchedulerOutput,
        step_time: float,
        cpu_wait: float | None = None,
        spec: tuple[int, int, int] = (0, 0, 0),
    ) -> StepStats:
        s, bm = self.scheduler, self.scheduler.blocks
        return StepStats(
            step=self.num_steps,
            timestamp=time.time(),
            mode=s.mode,
            pending_mode=s.pending_mode,
            running=len(sched.requests) + len(sched.padding),
            max_num_seqs=s.config.max_num_seqs,
            waiting=len(s.waiting),
            prefill_tokens=sched.num_prefill_tokens,
            decode_tokens=sched.num_decode_tokens,
            padding_rows=len(sched.padding),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_usable_blocks,
            prefix_hit_blocks=sched.prefix_hit_blocks,
            disk_hit_blocks=sched.tier_hit_blocks,
            reused_tokens=len(sched.kv_moves),
            preemptions=len(sched.preempted),
            wasted_row_steps=s.wasted_row_steps,
            total_preemptions=s.num_preemptions,
            step_time=step_time,
            cpu_wait=cpu_wait,
            draft_tokens=spec[0],
            accepted_tokens=spec[1],
            verify_rows=spec[2],
        )


def _tier_fields(tier: BlockTier | None, hits: int, loading: int) -> dict:
    """EngineState's disk-tier fields (all 0 with the tier off)."""
    c = tier.counters() if tier is not None else TierCounters()
    return {
        "disk_cache": tier is not None,
        "disk_hit_blocks": hits,
        "disk_loading_requests": loading,
        "disk_read_bytes": c.read_bytes,
        "disk_written_blocks": c.written_blocks,
        "disk_written_bytes": c.written_bytes,
        "disk_bad_blocks": c.bad_blocks,
        "disk_write_errors": c.write_errors,
        "disk_skipped_blocks": c.skipped_blocks,
    }


def _find_stop(text: str, stops: list[str], sent: int) -> int | None:
    """Index where the earliest stop string starts, searching only text that can hold a new match."""
    longest = max(len(s) for s in stops)
    window_start = max(0, sent - longest)
    best = None
    for s in stops:
        i = text.find(s, window_start)
        if i != -1 and (best is None or i < best):
            best = i
    return best
