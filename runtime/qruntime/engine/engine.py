"""The engine: requests in, tokens out. Engine -> Scheduler -> ModelRunner -> Plan -> ops.

`generate` runs a batch to completion, `stream` yields one request's tokens as they come, and
`add_request` / `step` / `abort` are the loop a server drives. Each step schedules a batch
(continuous batching, chunked prefill, preemption), runs the model once, samples, and applies the
stop rules. At tp > 1 the engine lives on rank 0 and each step also goes to the workers of the
other ranks (engine/workers.py); `close()` stops them.

Async scheduling (on by default): `step()` first schedules and launches the next model step, then
waits for the one launched before and turns its tokens into deltas, so the host's work on a step's
results (detokenizing, stop checks, the server's dispatch) and on the next step's inputs runs while
the device computes. The launched step's decodes read the tokens the step before sampled on the
device (scheduler.py: pending tokens). At tp > 1 every rank must hold those tokens (each worker
keeps its copy): a step sampled from the vocabulary shards leaves them on every rank, and rank 0
sends the workers the tokens of a step whose rows it samples alone (top_p, penalties, logprobs,
structured output) through the same exchange; without a vocabulary-parallel head there is no
exchange, and async scheduling is off. A request that stops on a token its next step has
already been launched for gets no more from that step (its one extra token is dropped); requests
that end by max_tokens or the model length are not scheduled past it. Sampling, greedy or not, is
queued on the device with the step (engine/sampler.py). While a request with structured output is
unfinished, the step before is read between queuing the next step's forward and its sampling: the
grammar masks follow the token in flight, and the device still does not wait (engine/structured.py).

Speculative decoding (`speculative=`, engine/speculative/): a decoding request may carry draft tokens
into its step, which computes them with its token; the target's logits verify them (rejection
sampling: the outputs keep the target's distribution, greedy ones are plain greedy's) and the
request keeps the accepted drafts plus one token. Drafts need the newest token on the host, so a
step that may draft runs synchronously; while every running request's drafting pauses (its drafts
kept failing, or prompt lookup kept finding nothing: speculative/draft_length.py) steps run
asynchronously, without drafts, as a plain engine's; so do all steps at a batch size where drafting
was measured slower than plain decoding (speculative/draft_gate.py, on by default on a GPU). Requests
whose sampling needs per-position state
(penalties, logit_bias, min_tokens not yet reached, logprobs, structured output, a thinking cap)
decode one token a step beside the speculating ones.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from qruntime.engine.block_manager import NoFreeBlocks
from qruntime.engine.launch_pacing import LaunchPacer, StepKey, step_key
from qruntime.engine.logprobs import DeviceLogprobs
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.multimodal import (
    ImagePrompt,
    PreparedPrompt,
    RequestImages,
    VisionModel,
    encode_pending,
    image_prompt_ids,
    request_images,
    step_images,
)
from qruntime.engine.outputs import InvalidRequest, RequestOutput, StreamDelta, Timings, TokenLogprob
from qruntime.engine.prefix_cache import PrefixCacheStats
from qruntime.engine.request import Request
from qruntime.engine.sampled_tokens import SampledTokens
from qruntime.engine.sampler import Forced, History, sample_on_device
from qruntime.engine.sampling_params import SamplingParams, as_list
from qruntime.engine.scheduler import Scheduler, SchedulerOutput
from qruntime.engine.sharded_sampler import ShardedSampling, shardable, share_tokens
from qruntime.engine.speculative.rejection import verify_drafts
from qruntime.engine.speculative.speculator import SpeculativeStats, Speculator
from qruntime.engine.speculative.verify_step import VerifyStep, draft_logit_rows, draft_probs
from qruntime.engine.step_chunk import StepChunk
from qruntime.engine.structured import Grammars, StructuredOutput, StructuredOutputError
from qruntime.engine.thinking import ThinkingState
from qruntime.engine.transfer import device_tensor, to_device
from qruntime.tokenizer import IncrementalDetokenizer, TokenIdsOnly, Tokenizer, TokenizerError
from qruntime.vision.preprocess import DecodedImages, preprocess_decoded
from qruntime.vision.prompt_images import MultimodalPrompt, encode_prompt

if TYPE_CHECKING:
    from qruntime.engine.workers import Workers


logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | ImagePrompt | MultimodalPrompt | PreparedPrompt
Messages = Sequence[Mapping[str, Any]]


@dataclass(eq=False)
class _Tracked:
    """The engine's bookkeeping of one request besides its token state."""

    request: Request
    params: SamplingParams
    detok: IncrementalDetokenizer | None  # None: the caller detokenizes (add_request(detokenize=False))
    generator: torch.Generator | None
    arrival: float
    first_token: float | None = None
    new_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    output: RequestOutput | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of each output token (params.logprobs)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.. (params.prompt_logprobs)
    thinking: ThinkingState | None = None  # params.max_thinking_tokens: where its <think> block stands
    matcher: Any = None  # params.structured: its llguidance matcher, which has seen every token generated
    images: RequestImages | None = None  # Qwen3-VL: its prompt's images (engine/multimodal.py)


@dataclass(eq=False)
class _Launched:
    """A step queued on the device, its sampled tokens not yet read by the host."""

    output: SchedulerOutput
    tracked: list[_Tracked]  # the requests of its sampling rows, in row order
    tokens: SampledTokens
    rows: dict[str, int]  # request id -> its row of tokens (what the next step's pending ids name)
    logprobs: tuple[list[int], DeviceLogprobs] | None = None  # (rows of `tracked`, their sampled tokens' logprobs)
    # (request, its first prompt position scored, how many), in the order of the prompt logprobs' rows
    prompt_logprobs: tuple[list[tuple[_Tracked, int, int]], DeviceLogprobs] | None = None
    verify: VerifyStep | None = None  # the drafts its chunks carried and their verdicts (speculative decoding)
    # whether every rank holds its tokens (tp > 1: sampled from the vocabulary shards, or sent by rank
    # 0), so that the next step may name them by pending ids before rank 0 has read them; at tp = 1, always
    everywhere: bool = True
    key: StepKey = (0, 0, 0)  # its shape, as launch pacing estimates its device time (launch_pacing.step_key)
    queued_at: float = 0.0  # time.perf_counter() once it was queued on the device


class Engine:
    """A loaded artifact ready to generate. Build it with `qruntime.load(path)`; `close()` it (or use
    it as a context manager) to stop a tensor-parallel engine's workers."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Tokenizer | TokenIdsOnly,
        *,
        vocab_size: int,
        max_model_len: int,
        description: Mapping[str, Any],
        workers: Workers | None = None,
        async_scheduling: bool = True,
        speculator: Speculator | None = None,
        vision: VisionModel | None = None,
    ) -> None:
        self.runner = runner  # rank 0's at tp > 1
        self.workers = workers  # the other ranks' processes (tp > 1), which run every step with rank 0
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.description = dict(description)  # what was loaded and how the engine is sized (for logs / CLI)
        if speculator is not None and workers is not None:
            raise ValueError("speculative decoding runs at tp = 1 only")
        self.speculator = speculator
        self.vision = vision  # Qwen3-VL: the vision encoder and image settings (None: a text model)
        if vision is not None and speculator is not None:
            raise ValueError("a Qwen3-VL engine runs without speculative decoding for now")
        if speculator is not None:
            speculator.attach(runner)
        # launch a step before reading the last one's tokens (while speculating, only the steps no request
        # drafts in: a draft needs the newest token on the host); not at tp > 1 without a
        # vocabulary-parallel head (its exchange is what leaves a step's tokens on every rank, for the
        # next step to read)
        self.async_scheduling = async_scheduling and (workers is None or runner.vocab_shard is not None)
        self._tracked: dict[str, _Tracked] = {}
        self._in_flight: _Launched | None = None  # the step launched last, not read yet (async scheduling)
        self._scheduled = False  # whether the last step() scheduled anything
        self._admitted = True  # whether the last step() admitted a request or ran a prefill (the draft gate's)
        self._pacer = LaunchPacer()  # its steps' device times: how long a server may hold the next launch
        self._scoring: set[str] = set()  # unfinished requests that asked for prompt logprobs (usually none)
        self._capped: set[str] = set()  # unfinished requests with a thinking cap (usually none)
        self._guided: set[str] = set()  # unfinished requests with structured output: masks follow the token in flight
        self._grammars: Grammars | None = None  # built with the first structured request
        # the random stream of sampled requests without a seed (each seeded one has its own)
        self._generator = torch.Generator(device=runner.device).manual_seed(int.from_bytes(os.urandom(8)) >> 1)
        self._ids = itertools.count()
        self._closed = False

    # --- the loop a server drives ------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        detokenize: bool = True,
    ) -> str:
        """Queue one request; returns its id. Raises InvalidRequest (and queues nothing) for bad input.

        detokenize=False: the caller turns the ids into text and applies the stop strings (the server
        does, away from the engine's thread): this request's deltas and output carry no text, and its
        stop strings end nothing here (stop tokens, EOS, max_tokens and the context length still do)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be a SamplingParams (got {type(params).__name__})")
        prepared = prompt if isinstance(prompt, PreparedPrompt) else self._prepare(prompt)
        token_ids = prepared.token_ids
        if unknown := [token for token, _ in params.logit_bias if token >= self.vocab_size]:
            raise InvalidRequest(
                f"logit_bias: {unknown[0]} is not a token id (the model's vocabulary is ids 0..{self.vocab_size - 1})"
            )
        if params.stop and not self.tokenizer.has_text:
            raise InvalidRequest(
                "stop strings need the artifact's tokenizer, which it does not have (compiled with --no-tokenizer): "
                "use stop_token_ids"
            )
        thinking = None
        if params.max_thinking_tokens is not None:
            marks = self._think_ids()
            if marks is None:
                raise InvalidRequest(
                    "max_thinking_tokens needs <think> and </think> tokens, which this model's vocabulary lacks"
                )
            thinking = ThinkingState.of_prompt(params.max_thinking_tokens, *marks, token_ids)
        matcher = None
        if params.structured is not None:
            matcher = self._matcher(params.structured)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        generator = None
        if not params.greedy and params.seed is None:
            generator = self._generator  # shared: the sampler draws for all such rows in one op
        elif not params.greedy:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        request = Request(request_id, token_ids, params.max_tokens, reuse_cached=params.prompt_logprobs is None)
        if prepared.images is not None:
            request.image_keys = prepared.images.keys
        detok = None
        if detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                min_tokens=params.min_tokens,
            )
        self._tracked[request_id] = _Tracked(
            request,
            params,
            detok,
            generator,
            time.perf_counter(),
            thinking=thinking,
            matcher=matcher,
            images=prepared.images,
        )
        if params.prompt_logprobs is not None:
            self._scoring.add(request_id)
        if thinking is not None:
            self._capped.add(request_id)
        if matcher is not None:
            self._guided.add(request_id)
        self.scheduler.add(request)
        return request_id

    def step(self) -> list[StreamDelta]:
        """Run one scheduled batch; a delta for every request that got a token or finished.

        With async scheduling the deltas are those of the step launched by the call before (this
        call launches the next one first), so a call may return none while a step is in flight.

        A failure that belongs to requests fails those requests alone (finish_reason "error", the
        cause logged with their ids): non-finite logits or a detokenizer error fail one request, a
        model step that raises fails the requests of its batch. The engine runs on for the others;
        only a device error (the GPU is gone, every later step would fail too) is raised."""
        started = time.perf_counter()
        gated = self.speculator is not None and self.speculator.gate is not None
        before = self._decoding_ids() if gated else None
        drafting = self._drafts_due()
        deltas = self._step(started, drafting)
        if gated:  # the gate's sample: this call's tokens and time, drafting or not, when no prefill is in it
            running = {r.request_id for r in self.scheduler.running}
            admitted = before is None or not running <= before  # a prefill launched now is read by the next call
            if not admitted and not self._admitted:
                tokens = sum(len(d.token_ids) for d in deltas)
                self.speculator.measured(len(before), drafting, tokens, time.perf_counter() - started)
            self._admitted = admitted
        return deltas

    def _step(self, started: float, drafting: bool) -> list[StreamDelta]:
        previous, self._in_flight = self._in_flight, None
        if not self.async_scheduling or drafting:
            done = self._complete(previous) if previous is not None else []
            launched, deltas = self._launch(None, drafting=drafting)
            return done + deltas + (self._complete(launched) if launched is not None else [])
        done = []
        if previous is not None and not previous.everywhere:  # tp > 1: its tokens are on rank 0 alone
            done, previous = self._complete(previous), None  # read first: the next step sends them as ids
        # a structured row's mask needs the token in flight, which the forward does not: the step's
        # forward is queued first, the token read while it runs, then the masks made and the sampling queued
        read_previous = bool(self._guided) and previous is not None
        launched, deltas = self._launch(previous, read_previous)
        self._in_flight = launched
        if launched is not None:
            self._pacer.launched(started, launched.queued_at)
        if read_previous:
            return done + deltas
        return done + deltas + (self._complete(previous) if previous is not None else [])

    def launch_hold(self) -> float:
        """Seconds a serving loop may wait before its next step() without leaving the device idle: until
        shortly before the step in flight ends, by the device times measured so far (engine/launch_pacing.py),
        so that requests arriving meanwhile join the next step rather than the one after. 0.0 when no step
        is in flight, its time is not known yet, or the engine does not run the plain asynchronous steps
        (tp > 1, speculative decoding)."""
        launched = self._in_flight
        if launched is None or self.workers is not None or self.speculator is not None:
            return 0.0
        return self._pacer.hold(launched.key, launched.queued_at, time.perf_counter())

    def _launch(
        self, previous: _Launched | None, read_previous: bool = False, drafting: bool = False
    ) -> tuple[_Launched | None, list[StreamDelta]]:
        """Schedule a step and queue it on the device, sampling included; `previous`: the step still
        in flight, whose sampled tokens this one's pending ids name. Returns the step (None when
        nothing was scheduled or it failed) and the deltas of requests it failed. read_previous:
        `previous` is also read (`_complete`, its deltas first) once this step's forward is queued
        and before its sampling, so that the structured rows' masks follow its tokens. drafting: a
        speculating engine's synchronous step, whose decoding requests may carry drafts (otherwise
        none do); every scheduled step ticks the speculator's step clock, which the requests'
        drafting pauses count."""
        done: list[StreamDelta] = []

        def read() -> None:  # `previous`'s tokens, once
            nonlocal done, read_previous
            if read_previous and previous is not None:
                read_previous, done = False, self._complete(previous)

        if self.speculator is not None and drafting and self.speculator.batches:
            # every decoding request's drafts in shared steps
            self.speculator.draft_ahead(
                [
                    (request.request_id, request.all_token_ids, limit, t.params, t.generator, grow)
                    for request, limit, grow in self.scheduler.draft_candidates()
                    if self._may_draft(t := self._tracked[request.request_id], request)
                ]
            )
        output = (
            self.scheduler.schedule(self._draft)
            if self.speculator is not None and drafting
            else self.scheduler.schedule()
        )
        self._scheduled = bool(output.chunks)
        if not output.chunks:
            read()
            return None, done
        if self.speculator is not None:  # the step clock the drafting pauses count
            self.speculator.tick()
        rows = [i for i, chunk in enumerate(output.chunks) if chunk.samples]
        tracked = [self._tracked[output.chunks[i].request.request_id] for i in rows]
        try:
            pending_rows = previous.rows if previous is not None else {}
            images = {}
            if self.vision is not None:  # the step's requests with images, their embeddings made first if needed
                images = step_images(output.chunks, lambda i: self._tracked[i].images, self.vision, self.runner.device)
            chunks = [
                StepChunk.of(c, pending_rows.get(c.request.request_id), images.get(c.request.request_id))
                for c in output.chunks
            ]
            sampled = previous.tokens.ids if pending_rows and any(c.token_ids[-1] < 0 for c in chunks) else None
            scored = tuple(map(self._scores_prompt, output.chunks)) if self._scoring else ()
            scoring = any(scored)
            banned = [self._banned(t) for t in tracked]
            forced = self._forced(tracked, pending_rows) if self._capped else None
            in_flight = previous.tokens.ids if previous is not None else None
            sharded, shared = self._samples_shards(tracked, scoring), None
            if sharded:  # tp > 1: the ranks sample their vocabulary shards
                generators = [t.generator for t in tracked]
                sampling = ShardedSampling.of(
                    None if len(rows) == len(chunks) else rows,
                    [t.params for t in tracked],
                    generators,
                    banned if any(banned) else None,
                    forced,  # put in by every rank, as the pick
                )
                ids, peaks = self._execute(chunks, sampled=sampled, sampling=sampling, generators=generators)
                read()
                tokens, logprobs, prompt_logprobs, verify = SampledTokens(ids, peaks), None, None, None
            else:  # whole rows: tp = 1, or a step the ranks cannot sample from their shards
                # sampling rows with drafts (speculative decoding), and the chunks whose every row comes back
                drafted = [r for r, i in enumerate(rows) if output.chunks[i].draft] if self.speculator else []
                wide = (
                    [bool(c.draft) or (scoring and scored[i]) for i, c in enumerate(output.chunks)]
                    if scoring or drafted
                    else []
                )
                # tp > 1, async: rank 0 samples these rows alone and sends the workers the tokens
                shared = len(rows) if rows and self.async_scheduling and self.runner.vocab_shard is not None else None
                logits = self._execute(chunks, all_logits=wide or False, sampled=sampled, shared=shared)
                read()  # while the forward runs
                prompt_logprobs = verify_logits = None
                if scoring or drafted:  # rows of every token of some chunks came back: keep each chunk's last
                    ends = list(
                        itertools.accumulate(c.num_tokens if w else 1 for c, w in zip(chunks, wide, strict=True))
                    )
                    if scoring:  # score the scored chunks' rows
                        prompt_logprobs = self._prompt_logprobs(logits, output.chunks, scored, ends)
                    if drafted:  # [B, K, V]: the rows that verify each request's drafts
                        at = draft_logit_rows(
                            [ends[rows[r]] for r in drafted], [chunks[rows[r]].token_ids[1:] for r in drafted]
                        )
                        verify_logits = logits[device_tensor(at, torch.int64, logits.device)]
                    logits = logits[device_tensor([ends[i] - 1 for i in rows], torch.int64, logits.device)]
                elif len(rows) != len(chunks):
                    logits = logits[device_tensor(rows, torch.int64, logits.device)]
                histories = None
                if any(t.params.penalized for t in tracked):  # an output still in flight is read on the device
                    histories = [
                        History(
                            t.request.prompt_token_ids,
                            t.request.output_token_ids,
                            pending_rows.get(t.request.request_id),
                        )
                        if t.params.penalized
                        else None
                        for t in tracked
                    ]
                tokens = sample_on_device(
                    logits,
                    [t.params for t in tracked],
                    [t.generator for t in tracked],
                    banned if any(banned) else None,
                    histories,
                    in_flight,
                    forced,
                    self._allowed(tracked, logits.device) if self._guided else None,
                )
                if shared:
                    share_tokens(self.runner.vocab_shard, tokens.ids, shared, logits.device)
                logprobs = verify = None
                if wanted := [row for row, t in enumerate(tracked) if t.params.logprobs is not None]:
                    k = max(tracked[row].params.logprobs for row in wanted)
                    chosen = tokens.ids[device_tensor(wanted, torch.int64, logits.device)]
                    logprobs = (wanted, DeviceLogprobs(logits, wanted, chosen, k))
                if drafted:
                    drafts = tuple(output.chunks[rows[r]].draft for r in drafted)
                    ids = [tracked[r].request.request_id for r in drafted]
                    verdicts = verify_drafts(
                        verify_logits,
                        drafts,
                        [tracked[r].params for r in drafted],
                        [tracked[r].generator for r in drafted],
                        draft_probs(drafts, [self.speculator.probs(i) for i in ids], verify_logits),
                    )
                    verify = VerifyStep(tuple(drafted), drafts, verdicts)
        except Exception as exc:
            if self._is_fatal(exc):
                if self.workers is not None and not self._closed:  # stopped: they may wait in its exchange
                    error = self.workers.abandon(exc)
                    if error is not exc:
                        raise error from exc
                raise
            read()
            batch = [t for c in output.chunks if (t := self._tracked.get(c.request.request_id)) is not None]
            return None, done + self._fail(batch, "the model step running this request failed", exc)
        ids = {t.request.request_id: row for row, t in enumerate(tracked)}
        everywhere = self.workers is None or sharded or bool(shared)
        prefills = [c for c in output.chunks if c.num_tokens > 1]
        key = step_key(output.num_tokens, len(prefills), sum(c.start + c.num_tokens for c in prefills))
        launched = _Launched(output, tracked, tokens, ids, logprobs, prompt_logprobs, verify, everywhere, key)
        launched.queued_at = time.perf_counter()
        return launched, done

    def _matcher(self, constraint: StructuredOutput) -> Any:
        """A new request's grammar matcher (InvalidRequest when its constraint does not compile)."""
        backend = getattr(self.tokenizer, "backend", None)
        if backend is None:
            raise InvalidRequest("structured output needs the artifact's tokenizer, which it does not have")
        if self._grammars is None:
            self._grammars = Grammars(backend.to_str(), self.vocab_size, self.tokenizer.eos_token_ids)
        try:
            return self._grammars.matcher(constraint)
        except StructuredOutputError as exc:
            raise InvalidRequest(f"structured output: {exc}") from None

    def _allowed(self, tracked: list[_Tracked], device: torch.device) -> tuple[list[int], torch.Tensor] | None:
        """The structured rows of a step and their masks of allowed tokens, on the device. A row whose
        request finished since the step was scheduled (its grammar complete, say) is left free: its
        token is dropped."""
        rows = [
            row
            for row, t in enumerate(tracked)
            if t.matcher is not None and self._tracked.get(t.request.request_id) is t and not t.matcher.is_stopped()
        ]
        if not rows:
            return None
        masks = self._grammars.masks([tracked[row].matcher for row in rows])
        return rows, to_device(masks, device)

    def _think_ids(self) -> tuple[int, int] | None:
        """The ids of <think> and </think>, None when the vocabulary lacks one."""
        backend = getattr(self.tokenizer, "backend", None)
        if backend is None:
            return None
        ids = backend.token_to_id("<think>"), backend.token_to_id("</think>")
        return None if None in ids else ids

    def _forced(self, tracked: list[_Tracked], pending_rows: Mapping[str, int]) -> Forced | None:
        """The rows whose token this step must force to </think> (thinking.ThinkingState.mode)."""
        rows: dict[str, list] = {"always": [], "unless": [], "when": []}
        marks = None
        for row, t in enumerate(tracked):
            if t.thinking is None:
                continue
            flying = pending_rows.get(t.request.request_id)
            mode = t.thinking.mode(flying is not None)
            if mode is not None:
                rows[mode].append(row if mode == "always" else (row, flying))
                marks = (t.thinking.open_id, t.thinking.close_id)
        if marks is None:
            return None
        open_id, close_id = marks
        return Forced(close_id, tuple(rows["always"]), tuple(rows["unless"]), close_id, tuple(rows["when"]), open_id)

    def _scores_prompt(self, chunk) -> bool:
        """Whether this scheduled chunk computes prompt positions whose prompt logprobs are wanted."""
        if chunk.request.request_id not in self._scoring:
            return False
        t = self._tracked[chunk.request.request_id]
        last = min(chunk.start + chunk.num_tokens, len(t.request.prompt_token_ids) - 1)
        return max(chunk.start, len(t.prompt_logprobs)) < last

    def _prompt_logprobs(self, logits, chunks, scored, ends) -> tuple[list[tuple[_Tracked, int, int]], DeviceLogprobs]:
        """Queue the prompt logprobs of the scored chunks' rows: row p (the logits after position p)
        scores prompt token p + 1, for the positions no earlier step scored (a preempted request
        computes its prompt again)."""
        spans, rows, chosen, k = [], [], [], 0
        for chunk, wanted, end in zip(chunks, scored, ends, strict=True):
            if not wanted:
                continue
            t = self._tracked[chunk.request.request_id]
            prompt = t.request.prompt_token_ids
            first = max(chunk.start, len(t.prompt_logprobs))  # position whose next token is scored first
            last = min(chunk.start + chunk.num_tokens, len(prompt) - 1)  # one past the last such position
            if first >= last:
                continue
            row0 = end - chunk.num_tokens - chunk.start
            rows += range(row0 + first, row0 + last)
            chosen += prompt[first + 1 : last + 1]
            spans.append((t, first, last - first))
            k = max(k, t.params.prompt_logprobs)
        device = logits.device
        return spans, DeviceLogprobs(logits, rows, device_tensor(chosen, torch.int64, device), k)

    def _complete(self, launched: _Launched) -> list[StreamDelta]:
        """Read a launched step's tokens (waiting for them) and apply them: the scheduler's update,
        detokenizing, the stop rules. Requests finished or aborted since it was launched are skipped."""
        read_at = time.perf_counter()
        tokens = self._read(launched)
        self._pacer.completed(launched.key, launched.queued_at, read_at, time.perf_counter())
        tracked = launched.tracked
        if launched.prompt_logprobs is not None:
            spans, device_logprobs = launched.prompt_logprobs
            entries, at = device_logprobs.tolist(), 0
            for t, first, count in spans:
                done = len(t.prompt_logprobs)  # positions scored before (a recomputed prompt scores some again)
                if self._tracked.get(t.request.request_id) is t and first <= done < first + count:
                    k = t.params.prompt_logprobs
                    t.prompt_logprobs += [_top(e, k) for e in entries[at + done - first : at + count]]
                at += count
        token_logprobs = {}
        if launched.logprobs is not None:
            wanted, device_logprobs = launched.logprobs
            token_logprobs = dict(zip(wanted, device_logprobs.tolist(), strict=True))
        kept = self._kept(launched, tokens) if launched.verify is not None else {}
        if kept:
            tokens = [None if kept.get(row, ()) is None else tok for row, tok in enumerate(tokens)]
        self.scheduler.update(
            launched.output,
            {
                t.request.request_id: kept.get(row, tok)
                for row, (t, tok) in enumerate(zip(tracked, tokens, strict=True))
                if tok is not None
            },
        )
        now = time.perf_counter()
        deltas = []
        for row, (t, token) in enumerate(zip(tracked, tokens, strict=True)):
            if self._tracked.get(t.request.request_id) is not t:
                continue  # finished (by the step before, or aborted) after this step was launched
            if token is None:
                deltas += self._fail([t], "the model produced non-finite logits (NaN or inf) for this request")
                continue
            try:
                run = kept.get(row) or (token,)
                for taken, token in enumerate(run, 1):
                    t.first_token = t.first_token if t.first_token is not None else now
                    t.new_ids.append(token)
                    if t.thinking is not None:
                        t.thinking.observe(token)
                    if t.matcher is not None and not t.matcher.consume_token(token):
                        raise RuntimeError(f"the grammar refused token {token}: {t.matcher.get_error()[:200]}")
                    if row in token_logprobs:
                        entry = _top(token_logprobs[row], t.params.logprobs)
                        t.logprobs.append(entry)
                        t.new_logprobs.append(entry)
                    if t.detok is not None:
                        t.new_text += t.detok.add(token)
                    reason = self._stop_reason(t, token, len(run) - taken)
                    if reason is not None:
                        # a stop string ended it before the last token verification kept: those never happened
                        del t.request.output_token_ids[len(t.request.output_token_ids) - (len(run) - taken) :]
                        self._finish(t, *reason, now)
                        break
            except Exception as exc:  # detokenizing or a stop check: this request's alone
                deltas += self._fail([t], "turning this request's tokens into text failed", exc)
                continue
            deltas.append(self._delta(t))
        return deltas

    def _kept(self, launched: _Launched, tokens: list[int | None]) -> dict[int, list[int] | None]:
        """Row -> the tokens a verified request keeps from the step (VerifyStep.kept), cut after the
        first that ends it by a token (EOS or a stop token id; stop strings are the detokenizer's),
        with the verification's counts given to the speculator. None: a faulty row."""
        kept = launched.verify.kept(tokens)
        for row, draft in zip(launched.verify.rows, launched.verify.drafts, strict=True):
            run, t = kept[row], launched.tracked[row]
            if run is None or self._tracked.get(t.request.request_id) is not t:
                continue
            p = t.params
            ends = [
                i
                for i, tok in enumerate(run)
                if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tokenizer.eos_token_ids)
            ]
            kept[row] = run = run[: ends[0] + 1] if ends else run
            self.speculator.record(t.request.request_id, len(draft), len(run) - 1, len(run))
        return kept

    def _draft(self, request: Request, limit: int, grow: Callable[[int], tuple[int, ...] | None]) -> tuple[int, ...]:
        """Draft tokens for a decoding request (the scheduler asks): none for a request whose sampling
        needs per-position state the verification does not apply (see the module docstring)."""
        t = self._tracked[request.request_id]
        if not self._may_draft(t, request):
            return ()
        return self.speculator.draft(request.request_id, request.all_token_ids, limit, t.params, t.generator, grow)

    def _drafts_due(self) -> bool:
        """Whether some running request may draft at this step (a speculating engine then runs it
        synchronously: a draft starts from the newest token, which the host must have read), and the
        speculator's gate lets a step of this batch draft."""
        if self.speculator is None or not self.speculator.allows(self.scheduler.num_running):
            return False
        for request in self.scheduler.running:
            t = self._tracked.get(request.request_id)
            if t is not None and self._may_draft(t, request) and self.speculator.due(request.request_id):
                return True
        return False

    def _decoding_ids(self) -> set[str] | None:
        """The running requests' ids when every one is past its prompt (None: one is prefilling). A
        step() is a sample of the speculator's gate when it and the call before admitted no request
        and none was prefilling (a prefill's time would count against whichever mode ran it)."""
        running = self.scheduler.running
        if any(r.num_computed_tokens < len(r.prompt_token_ids) for r in running):
            return None
        return {r.request_id for r in running}

    @staticmethod
    def _may_draft(t: _Tracked, request: Request) -> bool:
        """Whether the request's sampling lets the verification check drafts (see _draft)."""
        p = t.params
        return not (
            p.penalized
            or p.logit_bias
            or p.logprobs is not None
            or p.prompt_logprobs is not None
            or t.matcher is not None
            or t.thinking is not None
            or len(request.output_token_ids) < p.min_tokens  # EOS and stop ids are banned from some position
        )

    @property
    def speculative_stats(self) -> SpeculativeStats | None:
        """Draft tokens proposed and accepted and tokens per verification since the engine started
        (None when it does not speculate). An immutable value: safe to read from another thread."""
        return self.speculator.stats if self.speculator is not None else None

    def abort(self, request_id: str) -> RequestOutput:
        """Stop an unfinished request now (its KV blocks are freed at once); returns its output so far."""
        t = self._tracked.get(request_id)
        if t is None:
            raise KeyError(f"no unfinished request {request_id!r} in the engine")
        self._finish(t, "abort", None, time.perf_counter())
        return t.output

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def idle_work(self) -> bool:
        """Do one piece of the start-up work the load left for later (load's graph_capture="first-use":
        a graph not captured yet, largest first, then the warm-up steps; then a speculating engine's
        draft's, Proposer.idle_work) when no request is unfinished, so that the work never delays
        one; returns whether any is left. A serving loop calls it while idle; `while
        engine.idle_work(): pass` finishes the start-up at once."""
        if self._closed or not self._has_idle_work():
            return False
        if self.has_unfinished():
            return True
        if not self.runner.has_idle_work():
            self.speculator.idle_work()
        elif self.workers is not None:  # every rank, at the same point of its steps
            self.workers.idle_work(self.runner)
        else:
            self.runner.idle_work()
        return self._has_idle_work()

    def _has_idle_work(self) -> bool:
        return self.runner.has_idle_work() or (self.speculator is not None and self.speculator.has_idle_work())

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Tokens of admitted requests looked up in the prefix cache and found, since the engine started
        (both 0 with the cache off). An immutable value: safe to read from another thread."""
        return self.scheduler.prefix_cache_stats

    def close(self) -> None:
        """Release the engine: drop the decode graphs, and at tp > 1 stop the workers and destroy
        the process group. Idempotent; a closed engine runs no more steps."""
        self._closed = True
        self._in_flight = None
        self.runner.drop_graphs()  # first: at tp > 1 they hold NCCL kernels of the group about to go
        if self.speculator is not None:
            self.speculator.close()
        if self.workers is not None:
            self.workers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- convenience APIs --------------------------------------------------------------------------
    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generate for a prompt (text or token ids) or a list of prompts; outputs in prompt order.

        Every prompt is checked before any is queued: one bad prompt raises InvalidRequest naming
        its index, and nothing runs."""
        batch = self._as_batch(prompts)
        params_list = as_list(params, len(batch))
        prepared = []
        for index, prompt in enumerate(batch):
            try:
                prepared.append(self._prepare(prompt))
            except InvalidRequest as exc:
                raise InvalidRequest(f"prompt {index}: {exc}") from None
        ids = [self.add_request(p, sp) for p, sp in zip(prepared, params_list, strict=True)]
        outputs: dict[str, RequestOutput] = {}
        try:
            while len(outputs) < len(ids):
                outputs.update((d.request_id, d.output) for d in self._step_or_fail() if d.finished)
        except BaseException:
            for i in ids:
                if i in self._tracked:
                    self.abort(i)
            raise
        return [outputs[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield one request's tokens as they are generated (other queued requests progress too).
        Closing the iterator early aborts the request.

        `generate` and `stream` drive the engine themselves: a server that runs many requests at
        once drives it with add_request / step / abort instead of interleaving these."""
        request_id = self.add_request(prompt, params)
        try:
            while request_id in self._tracked:
                for delta in self._step_or_fail():
                    if delta.request_id == request_id:
                        yield delta
        finally:
            if request_id in self._tracked:
                self.abort(request_id)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate replies to chat conversations (a list of {role, content} messages, or a list of them)
        rendered with the artifact's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts: list[Prompt] = []
        for index, conversation in enumerate(conversations):
            try:
                if self.vision is None:
                    prompts.append(self.tokenizer.encode_chat(conversation, **template_kwargs))
                else:  # content parts with images: the checkpoint's template, each image's tokens expanded
                    v = self.vision
                    device = self.runner.device
                    prompts.append(
                        encode_prompt(
                            conversation,
                            self.tokenizer,
                            v.tokens,
                            v.preprocess,
                            v.limits,
                            device=device,
                            video_config=v.video_config,
                            **template_kwargs,
                        )
                    )
            except ValueError as exc:  # ImageInputError included
                raise InvalidRequest(f"conversation {index}: {exc}") from None
        return self.generate(prompts, params)

    def score(self, token_ids: Sequence[int] | ImagePrompt | MultimodalPrompt) -> torch.Tensor:
        """Logits [len(token_ids), V] (fp32, on the engine's device) of the next token after every
        prefix of token_ids: one forward pass over the sequence, for evaluation (perplexity, KL).
        A Qwen3-VL engine also scores a prompt with images (its image tokens expanded: as many rows).
        Uses the engine's cache blocks for its duration; runs beside queued requests."""
        images = isinstance(token_ids, ImagePrompt | MultimodalPrompt)
        prepared = self._prepare(token_ids if images else list(token_ids))
        ids = prepared.token_ids
        scratch = Request(f"score-{next(self._ids)}", ids, 1)
        manager = self.scheduler.block_manager
        try:
            table = manager.grow(scratch.request_id, len(ids))
        except NoFreeBlocks:
            raise InvalidRequest(f"{len(ids)} tokens do not fit in the free KV blocks now") from None
        try:
            chunk = StepChunk(tuple(ids), 0, table)
            if prepared.images is not None:
                encode_pending([prepared.images], self.vision, self.runner.device)
                chunk = StepChunk(tuple(ids), 0, table, *prepared.images.chunk_parts(0, len(ids)))
            return self._execute([chunk], all_logits=True, settle=True).float()
        finally:
            manager.free(scratch.request_id)

    # --- internals ---------------------------------------------------------------------------------
    def _execute(
        self,
        chunks: list[StepChunk],
        all_logits: bool | Sequence[bool] = False,
        sampled: torch.Tensor | None = None,
        sampling: ShardedSampling | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        settle: bool = False,
        shared: int | None = None,
    ) -> Any:
        """The step's logits, whole rows; or at tp > 1 with `sampling`, its (token ids, row maxima).
        At tp > 1 the device is waited for later, when the step's tokens are read (`_read`), unless
        `settle` (then a failure on any rank is raised here)."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        if self.workers is not None:
            return self.workers.step(self.runner, chunks, all_logits, sampling, generators, sampled, settle, shared)
        return self.runner.execute(chunks, all_logits, sampled=sampled)

    def _read(self, launched: _Launched) -> list[int | None]:
        """A launched step's tokens on the host (waiting for them); at tp > 1 a failure of any rank
        in that step is raised here (a WorkerError; the workers are stopped)."""
        if self.workers is None:
            return launched.tokens.tolist()
        return self.workers.settle(launched.tokens.tolist)

    def _samples_shards(self, tracked: list[_Tracked], scoring: bool) -> bool:
        """Whether this step's tokens are sampled from the ranks' vocabulary shards (sharded_sampler)."""
        return (
            self.runner.vocab_shard is not None
            and not scoring
            and all(t.matcher is None and shardable(t.params) for t in tracked)
        )

    def _is_fatal(self, exc: BaseException) -> bool:
        """Whether a failed step means no later step can run: a CUDA error (torch.AcceleratorError;
        the CUDA context is unusable after one), or any failure at tp > 1 (the workers have been
        abandoned then). Anything else, out-of-memory included, fails only the step's requests."""
        accelerator_error = getattr(torch, "AcceleratorError", None)
        return (
            self._closed
            or self.workers is not None
            or (accelerator_error is not None and isinstance(exc, accelerator_error))
        )

    def _step_or_fail(self) -> list[StreamDelta]:
        deltas = self.step()
        if not deltas and not self.scheduler.has_unfinished():
            raise RuntimeError("the engine has no unfinished requests but the caller still waits for some")
        if not deltas and not self._scheduled and self._in_flight is None:  # every later step would be this one
            raise RuntimeError("the scheduler has unfinished requests but scheduled nothing, with no step in flight")
        return deltas

    def _prepare(self, prompt: Prompt) -> PreparedPrompt:
        """A prompt checked and turned into token ids; with images (a Qwen3-VL engine), their tokens
        expanded, preprocessed on the engine's device, and the prompt's M-RoPE positions."""
        if isinstance(prompt, PreparedPrompt):
            return prompt
        vision = videos = None
        if isinstance(prompt, ImagePrompt | MultimodalPrompt):
            if self.vision is None:
                raise InvalidRequest("this model does not take images (it is not a Qwen3-VL artifact)")
            try:
                if isinstance(prompt, ImagePrompt):
                    encode = self.tokenizer.encode
                    ids, vision, videos = image_prompt_ids(prompt, self.vision, encode, self.runner.device)
                else:
                    ids, vision, videos = prompt.token_ids, prompt.vision, prompt.videos
                    if isinstance(vision, DecodedImages):  # decoded on the host: resized here, on the device
                        vision = preprocess_decoded(vision, self.vision.preprocess, device=self.runner.device)
            except (ValueError, TokenizerError) as exc:  # ImageInputError is a ValueError
                raise InvalidRequest(f"images: {exc}") from None
            prompt = ids
        ids = self._prompt_ids(prompt)
        if self.vision is None:
            return PreparedPrompt(ids)
        if vision is None and videos is None:  # text alone: every token at its index on the three axes
            marks = {self.vision.tokens.image_token_id, self.vision.tokens.video_token_id}
            if not marks.isdisjoint(ids):
                raise InvalidRequest("the prompt holds image or video tokens but no images (use ImagePrompt or chat)")
            return PreparedPrompt(ids)
        try:
            keyed = self.scheduler.config.prefix_caching  # blocks named by the images' digests
            return PreparedPrompt(ids, request_images(ids, vision, self.vision.tokens, keyed=keyed, videos=videos))
        except ValueError as exc:  # runs of image tokens that disagree with the grids
            raise InvalidRequest(f"images: {exc}") from None

    @staticmethod
    def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str | ImagePrompt | MultimodalPrompt | PreparedPrompt):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("empty prompt")
            try:
                ids = self.tokenizer.encode(prompt)
            except TokenizerError as exc:
                raise InvalidRequest(f"prompt: {exc}") from None
        elif isinstance(prompt, Sequence):
            ids = list(prompt)
            # the common case in one pass of C-level builtins (a 2,064-id prompt: ~0.03 ms, not ~1 ms of
            # this thread's time, which a served request spends on the engine's own thread); any
            # doubt takes the per-id checks, which name the position at fault
            plain = set(map(type, ids)) == {int}
            bad = [] if plain else [(i, t) for i, t in enumerate(ids) if isinstance(t, bool) or not isinstance(t, int)]
            if bad:
                raise InvalidRequest(f"token ids must be integers (position {bad[0][0]}: {bad[0][1]!r})")
            in_vocab = plain and bool(ids) and min(ids) >= 0 and max(ids) < self.vocab_size
            unknown = [] if in_vocab else [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size]
            if unknown:
                raise InvalidRequest(
                    f"unknown token id {unknown[0][1]} at position {unknown[0][0]}: "
                    f"the model's vocabulary is ids 0..{self.vocab_size - 1}"
                )
        else:
            raise InvalidRequest(f"a prompt is a string or a list of token ids (got {type(prompt).__name__})")
        if not ids:
            raise InvalidRequest("empty prompt (no tokens)")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt is {len(ids)} tokens but the context is {self.max_model_len} tokens "
                f"(max_model_len): at most {self.max_model_len - 1} prompt tokens leave room to generate"
            )
        return ids

    def _banned(self, t: _Tracked) -> tuple[int, ...]:
        """The tokens this request may not sample now: its stop token ids and (unless ignore_eos) the
        EOS ids, while it has fewer than min_tokens outputs (the one being sampled not counted)."""
        p, request = t.params, t.request
        if not p.min_tokens or len(request.output_token_ids) + request.num_pending - 1 >= p.min_tokens:
            return ()
        return (*p.stop_token_ids, *(() if p.ignore_eos else self.tokenizer.eos_token_ids))

    def _stop_reason(self, t: _Tracked, token: int, later: int = 0) -> tuple[str, str | int | None] | None:
        """Why `token` ends the request, or None; `later`: tokens the request already holds after it
        (the rest of what a verification kept)."""
        p, request = t.params, t.request
        if (not p.ignore_eos and token in self.tokenizer.eos_token_ids) or token in p.stop_token_ids:
            return "stop", token
        if t.detok is not None and t.detok.stop_matched is not None:
            return "stop", t.detok.stop_matched
        if t.matcher is not None and t.matcher.is_stopped():  # the constraint is complete
            return "stop", None
        if len(request.output_token_ids) - later >= p.max_tokens or request.num_tokens - later >= self.max_model_len:
            return "length", None
        return None

    def _finish(
        self, t: _Tracked, reason: str, stop_reason: str | int | None, now: float, error: str | None = None
    ) -> None:
        """Record the output, free the request's blocks and forget it (its last delta carries the output)."""
        request = t.request
        self.scheduler.finish(request.request_id)
        del self._tracked[request.request_id]
        self._scoring.discard(request.request_id)
        self._capped.discard(request.request_id)
        self._guided.discard(request.request_id)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        if t.detok is not None and (reason not in ("stop", "error") or not isinstance(stop_reason, str)):
            with contextlib.suppress(Exception):  # a request failing in its detokenizer keeps what it has
                t.new_text += t.detok.flush()
        timings = Timings(t.arrival, t.first_token, now, len(request.output_token_ids))
        t.output = RequestOutput(
            request.request_id,
            tuple(request.prompt_token_ids),
            tuple(request.output_token_ids),
            t.detok.text if t.detok is not None else "",
            reason,
            stop_reason,
            timings,
            request.num_preemptions,
            error,
            request.num_cached_prompt_tokens or 0,
            tuple(t.logprobs) if t.params.logprobs is not None else None,
            (None, *t.prompt_logprobs) if t.params.prompt_logprobs is not None else None,
        )

    def _fail(self, failed: list[_Tracked], what: str, exc: BaseException | None = None) -> list[StreamDelta]:
        """Finish `failed` with finish_reason "error" (`what` is the output's error; the cause goes to
        the log with the request ids, never to the output) and return their last deltas."""
        ids = [t.request.request_id for t in failed]
        logger.error("%s: failing request(s) %s", what, ", ".join(ids), exc_info=exc)
        now = time.perf_counter()
        deltas = []
        for t in failed:
            self._finish(t, "error", None, now, error=what)
            deltas.append(self._delta(t))
        return deltas

    def _delta(self, t: _Tracked) -> StreamDelta:
        delta = StreamDelta(
            t.request.request_id, tuple(t.new_ids), t.new_text, t.output is not None, t.output, tuple(t.new_logprobs)
        )
        t.new_ids, t.new_text, t.new_logprobs = [], "", []
        return delta


def _top(entry: TokenLogprob, k: int) -> TokenLogprob:
    """entry with its k likeliest tokens (a step computes the most any of its requests asked for)."""
    return entry if len(entry.top) <= k else TokenLogprob(entry.token_id, entry.logprob, entry.top[:k], entry.rank)
