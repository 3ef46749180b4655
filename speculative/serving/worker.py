"""Generations for `speculate serve`: -np at once on the engine's slots, a bounded queue in front.

Each generation runs in a slot of its own (engine/parallel.py: its own sequences of the shared
models, its steps decoded with the others' in one batch by the one scheduler), in arrival
order, on the thread that makes every llama.cpp call (parallel.ModelThread: it loads the
models too). A job's thread hands it over and waits; the HTTP side (the event loop) only
submits requests and reads what they produce, so it stays responsive while generations run.

A request asks for a place first: -np generate and `waiting` more may wait; beyond that it
is refused at once (503) rather than queued without bound. A generation stops at the next
step once its client has gone or its time is up, and in the middle of its prompt too: at
the next chunk of it, or inside llama.cpp when every request of the batch should stop (the
abort callback asks the scheduler, see interrupt.cancel_when and scheduler.abort_wanted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Union

from speculative.decoding.events import Prefilling
from speculative.decoding.backend import NEEDS
from speculative.decoding.scheduler import Stopped
from speculative.decoding.settings import SpecSettings
from speculative.decoding.stats import Stats
from speculative.drafters import registry
from speculative.engine.engine import Engine
from speculative.engine.parallel import ModelThread, Parallel
from speculative.engine.stream import Final, Piece, Stream
from speculative.engine.text import LineLimits, prompt_tail
from speculative.errors import GrammarError, ModelError, UsageError
from speculative.llamacpp import interrupt
from speculative.serving.generation import ApiError, Busy, Generation, choices

log = logging.getLogger("speculate.serve")


@dataclass(frozen=True)
class Started:
    """The prompt passed its checks and generation begins: the response can start."""
    prompt: tuple[int, ...] = ()  # the prompt's tokens
    prompt_tail: str = ""  # the prompt's last tokens as text (a chat template may open a thinking block)


@dataclass(frozen=True)
class Progress:
    """How far the prompt has gone into the caches (Generation.return_progress), as llama-server's
    prompt_progress: its tokens, those the cache held, those in it now, and the time so far."""
    total: int
    cache: int
    processed: int
    time_ms: float

    def json(self) -> dict:
        """llama-server's prompt_progress (its time in whole milliseconds, an int64 there)."""
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": int(self.time_ms)}

    def stats(self) -> Stats:
        """The statistics so far, as llama-server's timings on a progress report: the tokens
        processed and their time (none before the first batch), nothing generated yet."""
        done = self.processed > self.cache
        return Stats(n_prompt=self.processed, n_cached=self.cache, t_encode=self.time_ms / 1000 if done else 0.0)


@dataclass(frozen=True)
class Failed:
    error: Exception


Output = Union[Started, Progress, Piece, Final, Failed]  # Piece and Final: stream.py's


def chat_prompt(engine: Engine, generation: Generation, render: Callable[[list], object]):
    """A chat request's conversation through the target's chat template: `render(messages)`, the
    engine's chat_text or chat_tokens (ApiError 400 when the model has no template, or its template
    refuses the conversation)."""
    if not engine.target.chat_template():
        raise ApiError(400, f"{engine.target.name} has no chat template: use /v1/completions")
    try:
        return render(generation.messages, generation.tools, generation.template_kwargs)
    except (ModelError, UsageError) as e:  # the template refused this conversation ("roles must alternate", ...)
        raise ApiError(400, str(e), param="messages") from None


def request_tokens(engine: Engine, generation: Generation) -> list[int]:
    """The prompt as tokens (ApiError 400 for a token outside the vocabulary), whatever the context holds."""
    if generation.tokens is not None:  # llama-server's endpoints
        tokens = list(generation.tokens)
        n_vocab = engine.target.n_vocab
        bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"the prompt has the token {bad}, outside this model's vocabulary "
                                f"(0 to {n_vocab - 1})", param="prompt")
        return tokens
    if generation.chat:
        return chat_prompt(engine, generation, engine.chat_tokens)
    return engine.prompt_tokens(generation.prompt)


def prompt_tokens(engine: Engine, generation: Generation) -> list[int]:
    """The prompt as tokens, checked against the context (ApiError 400 when it cannot run)."""
    tokens = request_tokens(engine, generation)
    n_ctx = engine.target.n_ctx
    if len(tokens) >= n_ctx:  # llama-server's error, with its n_prompt_tokens and n_ctx
        raise ApiError(400, f"the prompt has {len(tokens)} tokens but the context holds {n_ctx}, "
                            "leaving no room to generate", code="context_length_exceeded",
                       extra={"n_prompt_tokens": len(tokens), "n_ctx": n_ctx})
    # max_tokens beyond the room the prompt leaves: the answer ends at the context's end with
    # finish_reason length, as llama-server's (clients send max_tokens 4096 whatever -c is)
    return tokens


def generate(engine: Engine, generation: Generation, tokens: list[int], spec: SpecSettings,
             should_stop: Callable[[], str | None],
             progress: Callable[[Prefilling], None] | None = None) -> Iterator[Output]:
    """Run one request (its prompt as `tokens`, prompt_tokens' check passed) on a slot's engine:
    Started, one Piece per step that completes text, then Final. `should_stop` is asked after
    the prompt and after every step: a finish reason ends the run there; `progress` hears the
    prompt's way into the caches."""
    spec = request_spec(engine, generation, spec)
    yield Started(tuple(tokens), prompt_tail(engine.target, tokens))
    if not tokens:  # llama-server answers an empty prompt with an empty answer
        yield Final("none", "", "", [], Stats(), [])
        return
    if not generation.cache_prompt:
        engine.forget()
    limits = None
    if generation.n_indent > 0 or generation.t_max_predict_ms > 0:
        limits = LineLimits(generation.n_indent, generation.t_max_predict_ms / 1000)
    seed = generation.sampling.resolved_seed()
    budget = Budget.of(generation, prompt_tail(engine.target, tokens))
    final = yield from _run(Stream(engine, tokens, generation.sampling, spec, seed, generation.stops,
                                   budget.watching(should_stop), limits, progress=progress, alone=False),
                            should_stop, budget.see)
    if budget.spent:  # the thinking cut short: its end written, and the answer goes on from there
        final = yield from _after_thinking(engine, generation, tokens, spec, seed, should_stop, final, budget.end)
    yield dataclasses.replace(final, n_kept=len(engine.caches["target"]))


def _run(stream: Stream, should_stop: Callable[[], str | None],
         see: Callable[[Piece], None] = lambda piece: None) -> Iterator[Output]:
    """A stream's pieces, each shown to `see` first; returns its Final (the tail yielded as a last piece)."""
    reason = None
    try:
        for piece in stream:
            if isinstance(piece, NEEDS):  # the scheduler's to run
                yield piece
                continue
            see(piece)
            if piece.text or any(p is not None for p in piece.probs):  # tokens whose text waits: their probabilities
                yield piece
    except (interrupt.Cancelled, Stopped):  # stopped in its prompt: in llama.cpp, or between chunks
        reason = should_stop() or "cancelled"
    final = stream.end(reason)
    if final.tail:
        yield Piece(((final.tail, False),), stats=final.stats)
    return final


def _after_thinking(engine: Engine, generation: Generation, prompt: list[int], spec: SpecSettings, seed: int,
                    should_stop: Callable[[], str | None], thought: Final, end: str) -> Iterator[Output]:
    """The reasoning budget spent: the end of thinking forced (as llama.cpp's budget sampler writes
    it), then the rest of the answer as a continuation of the same prompt; one Final for both."""
    forced = engine.target.tokenize(end, add_special=False)
    yield Piece(((end, False),), tuple(forced), stats=thought.stats)
    used = len(thought.tokens) + len(forced)
    rest = dataclasses.replace(spec, n_predict=-1 if spec.n_predict < 0 else max(spec.n_predict - used, 0))
    if rest.n_predict == 0:
        return dataclasses.replace(thought, reason="length", text=thought.text + end, tokens=thought.tokens + forced)
    answer = yield from _run(Stream(engine, prompt + thought.tokens + forced, generation.sampling, rest, seed,
                                    generation.stops, should_stop, alone=False), should_stop)
    stats = dataclasses.replace(thought.stats)
    stats.merge(answer.stats)  # one answer: the first run's prompt, every generated token
    stats.n_prompt, stats.n_cached = thought.stats.n_prompt, thought.stats.n_cached
    stats.n_predict = used + len(answer.tokens)
    return dataclasses.replace(answer, text=thought.text + end + answer.text,
                               tokens=thought.tokens + forced + answer.tokens, stats=stats,
                               notes=thought.notes + answer.notes)


@dataclass
class Budget:
    """The reasoning budget (--reasoning-budget, a request's reasoning_budget_tokens): how many tokens
    an answer may think before its thinking is ended for it, counted from the start where the
    prompt opened the thinking, else from the family's opening tag. `spent`: the run was stopped
    for it."""
    limit: int = -1
    think: tuple[str, str] | None = None
    thinking_from: int | None = None  # the token the thinking began at (None: not yet)
    text: str = ""
    n_tokens: int = 0
    spent: bool = False

    @classmethod
    def of(cls, generation: Generation, prompt_tail: str) -> "Budget":
        plan = generation.plan
        if generation.reasoning_budget < 0 or plan is None or plan.format.think is None:
            return cls()
        opened = plan.after_prompt(prompt_tail).syntax.thinking_open
        return cls(generation.reasoning_budget, plan.format.think, 0 if opened else None)

    @property
    def end(self) -> str:
        return self.think[1] + "\n\n"

    def watching(self, should_stop: Callable[[], str | None]) -> Callable[[], str | None]:
        """`should_stop`, and the budget (asked after each step, once `see` has had its piece)."""
        if self.limit < 0:
            return should_stop
        return lambda: should_stop() or self._spent()

    def see(self, piece: Piece) -> None:
        self.text += piece.text
        self.n_tokens += len(piece.ids)
        if self.thinking_from is None and self.think is not None and self.think[0] in self.text:
            self.thinking_from = self.n_tokens

    def _spent(self) -> str | None:
        if self.thinking_from is None or self.think[1] in self.text:
            return None
        if self.n_tokens - self.thinking_from >= self.limit:
            self.spent = True
            return "reasoning budget"
        return None


def request_spec(engine: Engine, generation: Generation, spec: SpecSettings) -> SpecSettings:
    """The server's speculation with the request's own (its speculative.* fields): ApiError 400
    when they make no sense, or need a model the server has not loaded."""
    spec = dataclasses.replace(spec, n_predict=generation.max_tokens or -1, ignore_eos=generation.ignore_eos,
                               **generation.speculation)
    try:
        registry.check(spec)
    except UsageError as e:
        raise ApiError(400, f"speculative.*: {e}") from None
    for name in spec.drafters:
        kind = registry.TYPES[name]
        if kind.needs in (registry.DRAFT, registry.HEAD) and not engine.factory.has(kind, None):
            raise ApiError(400, f"speculative.type: {name} needs {kind.model}, which this server has not loaded (-md)",
                           param="speculative.type")
    return spec


class Job:
    """One request on its way through the worker. Outputs cross from the worker's
    thread to the event loop through an asyncio queue."""

    def __init__(self, generation: Generation, deadline: float, after: "Job | None" = None):
        """`after`: the first choice of the same prompt (n > 1), whose processed prompt this one
        waits for, to restore it from the RAM cache instead of processing it again."""
        self.generation = generation
        self.deadline = deadline  # time.monotonic() by which it must be done
        self.started = False      # the worker has taken it
        self.after = after
        self.leads = False  # the first of several choices: the others wait for its prompt
        self.prompt_kept = threading.Event()  # its prompt is in the RAM cache, or it will not be
        self.grace: float | None = None  # the server is stopping: the deadline is the end of this grace
        self._grace_told = False
        self._cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[Output] = asyncio.Queue()

    def cancel(self) -> None:
        """The client is gone (or the server is stopping): stop at the next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def should_stop(self) -> str | None:
        if self.cancelled:
            return "cancelled"
        if time.monotonic() > self.deadline:
            if self.grace is not None and not self._grace_told:
                self._grace_told = True
                log.info("shutting down: the %g s grace is over; the running generation ends with what it has",
                         self.grace)
            return "length"  # out of time: what was generated is the answer, as at max_tokens
        return None

    def end_within(self, grace: float) -> None:
        """The server is stopping: end within `grace` seconds (or at the deadline, if sooner)."""
        ends = time.monotonic() + grace
        if ends < self.deadline:
            self.deadline, self.grace = ends, grace

    async def next(self) -> Output:
        return await self._outputs.get()

    def post(self, output: Output) -> None:
        """From the worker's thread."""
        try:
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, output)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass


@dataclass
class Metrics:
    """What /metrics reports: totals since the start, and a window of speeds that each
    scrape reads and restarts (llama-server's buckets)."""
    requests: int = 0           # generations finished (cancelled and cut-off ones included)
    refused: int = 0            # requests refused because the queue was full (503)
    prompt_tokens: int = 0      # prompt tokens processed (those kept in the cache not counted)
    prompt_cached: int = 0      # prompt tokens kept in the cache
    prompt_seconds: float = 0.0
    predicted: int = 0          # generated tokens
    predicted_seconds: float = 0.0
    drafted: int = 0            # drafted tokens verified
    accepted: int = 0           # drafted tokens accepted
    draft_steps: int = 0        # steps that verified a draft
    steps: int = 0              # target passes after the prompt
    n_tokens_max: int = 0       # longest prompt + generation
    n_decode: int = 0           # the target's llama_decode calls (prompts, steps, verifications) ...
    n_busy_slots: int = 0       # ... and the slots each served, summed
    window: list[float] = dataclasses.field(default_factory=lambda: [0, 0.0, 0, 0.0])  # prompt n, s; predicted n, s

    def add(self, stats: Stats) -> None:
        processed = stats.n_prompt - stats.n_cached
        self.requests += 1
        self.prompt_tokens += processed
        self.prompt_cached += stats.n_cached
        self.prompt_seconds += stats.t_encode
        self.predicted += stats.n_predict
        self.predicted_seconds += stats.t_decode
        self.drafted += stats.n_drafted
        self.accepted += stats.n_accept
        self.draft_steps += stats.n_draft_steps
        self.steps += stats.n_steps
        self.n_tokens_max = max(self.n_tokens_max, stats.n_prompt + stats.n_predict)
        self.window = [self.window[0] + processed, self.window[1] + stats.t_encode,
                       self.window[2] + stats.n_predict, self.window[3] + stats.t_decode]


class Worker:
    """The engine's only user: generations run on the slots' threads, in order of arrival.
    With `sleep_after` seconds (llama-server's --sleep-idle-seconds), the models are freed once
    no request has come for that long, and `load()` loads them again for the next that needs
    them (awake())."""

    def __init__(self, load: Callable[[], Parallel], spec: SpecSettings, waiting: int, timeout: float,
                 sleep_after: float = -1):
        self._load = load
        self._models = ModelThread()  # every llama.cpp call, loading included
        try:
            self.parallel: Parallel | None = self._models.call(load)  # None while the models sleep
        except BaseException:
            self._models.close()
            raise
        self._models.attach(self.parallel)  # the Worker closes its engine
        self.engine: Engine | None = self.parallel.engine  # its tokenizer and facts; the slots' engines generate
        self.n_slots = self.parallel.n_slots
        self.spec = spec
        self.timeout = timeout
        self._slots = threading.BoundedSemaphore(self.n_slots + waiting)
        self._pool = ThreadPoolExecutor(max_workers=self.n_slots, thread_name_prefix="speculate-slot")
        self._abort = interrupt.cancel_when(self._abort_wanted)  # held while the worker runs
        self._jobs: set[Job] = set()
        self._lock = threading.Lock()
        self._draining = threading.Event()
        self._metrics = Metrics()
        self.started_at = time.time()
        self._decodes_before = self.engine.target.decodes  # before serving (warm-up, auto's measures): not counted
        self._decodes_slept = (0, 0)  # the decodes of the models put to sleep since
        self._slept_slots: list[dict] = []  # /slots while they sleep
        self._waking = threading.Lock()  # one sleeps or wakes the models at a time
        self._active = time.monotonic()  # when a request last needed the models
        self._sleep_after = sleep_after
        if sleep_after > 0:
            threading.Thread(target=self._sleeper, name="speculate-sleep", daemon=True).start()

    @property
    def sleeping(self) -> bool:
        return self.parallel is None

    def awake(self) -> Engine:
        """The engine, its models loaded again if they slept (from a request's thread: a wake takes
        as long as loading did at start)."""
        with self._waking:
            if self.parallel is None:
                log.info("waking up: loading the models")
                parallel = self._models.call(self._load)  # the event loop goes on meanwhile: /metrics, /props, /health
                self._models.attach(parallel)
                with self._lock:
                    self._decodes_before = parallel.engine.target.decodes
                    self.parallel, self.engine = parallel, parallel.engine
            # once loaded: a load longer than sleep_after must not leave the request to models freed under it
            self._active = time.monotonic()
            return self.engine

    def _sleeper(self) -> None:
        """Frees the models once no request has needed them for sleep_after seconds."""
        while not self._draining.wait(min(1.0, self._sleep_after / 4)):
            with self._waking:
                with self._lock:
                    idle = not self._jobs and time.monotonic() - self._active >= self._sleep_after
                if idle and self.parallel is not None:
                    log.info("sleeping: no request for %g s, the models are freed", self._sleep_after)
                    with self._lock:
                        self._slept_slots = [{**slot, "n_cached_tokens": 0} for slot in self.parallel.slots()]
                        self._decodes_slept = self._decodes()
                        parallel, self.parallel, self.engine = self.parallel, None, None
                    self._models.attach(None)
                    parallel.close()
                    self._models.call(parallel.engine.close)

    def _abort_wanted(self) -> bool:
        parallel = self.parallel
        return parallel is not None and parallel.scheduler.abort_wanted()

    def _decodes(self) -> tuple[int, int]:
        """The target's decodes while serving (llama_decode calls, and the slots each served); under
        _lock, which the models' sleep and wake take to swap them."""
        if self.parallel is None:
            return self._decodes_slept
        (decodes, slots), (before_d, before_s) = self.engine.target.decodes, self._decodes_before
        return self._decodes_slept[0] + decodes - before_d, self._decodes_slept[1] + slots - before_s

    def slots(self) -> list[dict]:
        """/slots: each slot (while the models sleep, as they were, emptied)."""
        parallel = self.parallel
        return self._slept_slots if parallel is None else parallel.slots()

    def submit(self, generation: Generation) -> list[Job]:
        """Queue a request's generation (from the event loop), a job for each of its n choices, or
        refuse it with Busy when the queue has no room for all of them. The choices after the first
        start once the first has processed the prompt (Job.after)."""
        if self._draining.is_set():
            raise Busy("the server is shutting down")
        if generation.n > self.n_slots:
            raise ApiError(400, f"n: {generation.n} choices need as many slots; this server has {self.n_slots} "
                                "(-np)", param="n")
        taken = 0
        while taken < generation.n and self._slots.acquire(blocking=False):
            taken += 1
        if taken < generation.n:
            for _ in range(taken):
                self._slots.release()
            with self._lock:
                self._metrics.refused += 1
            raise Busy("the server is busy: every slot and every place in the queue is taken "
                       "(see --parallel and --max-waiting)")
        deadline = time.monotonic() + self.timeout
        first, *others = choices(generation)
        jobs = [Job(first, deadline)]
        jobs += [Job(g, deadline, after=jobs[0]) for g in others]
        jobs[0].leads = bool(others)
        with self._lock:
            self._jobs.update(jobs)
        for job in jobs:  # in order: the first takes a thread before the others wait for it
            self._pool.submit(self._run, job)
        return jobs

    def _run(self, job: Job) -> None:
        job.started = True
        final = None  # posted last, once its slot is free: a client with its answer finds it idle (/slots, /metrics)
        try:
            if job.cancelled or self._draining.is_set():  # its client gave up while it waited, or we stop
                job.post(Failed(Busy("the server is shutting down" if self._draining.is_set() else "cancelled")))
                return
            if job.after is not None:
                job.after.prompt_kept.wait()
            tokens = prompt_tokens(self.awake(), job.generation)
            final = self.parallel.submit(tokens, lambda engine: self._generation(job, engine, tokens),
                                         lambda: job.should_stop() is not None, job.generation.stream).wait()
        except ApiError as e:
            job.post(Failed(e))
        except GrammarError as e:  # a token it names that this vocabulary lacks
            job.post(Failed(ApiError(400, str(e), param="grammar")))
        except UsageError as e:  # what the request's own speculation asks cannot run here (factory.py)
            job.post(Failed(ApiError(400, f"speculative.type: {e}", param="speculative.type")))
        except Exception as e:  # a decode failure or a bug: this request fails, the server stays up
            log.exception("generation failed")
            job.post(Failed(e))
        finally:
            job.prompt_kept.set()  # whatever happened: the other choices go on
            with self._lock:
                self._jobs.discard(job)
                self._active = time.monotonic()
            self._slots.release()
            if final is not None:
                job.post(final)

    def _generation(self, job: Job, engine: Engine, tokens: list[int]) -> Iterator:
        """A job's generation on a slot's engine, as the scheduler runs it: the decodes it needs
        yielded, what it makes posted to the job's client; its Final returned (posted by _run
        once the slot is free)."""
        final = None
        for output in generate(engine, job.generation, tokens, self.spec, job.should_stop,
                               _progress(job) if job.generation.return_progress else None):
            if isinstance(output, NEEDS):
                yield output
                continue
            if isinstance(output, (Piece, Final)) and job.leads and not job.prompt_kept.is_set():
                engine.persist.keep()  # the first choice's prompt, for the others (RAM cache)
                job.prompt_kept.set()
            if isinstance(output, Final):  # in the log and /metrics before its client has it
                _log(job.generation, output, len(tokens))
                with self._lock:
                    self._metrics.add(output.stats)
                final = output
            else:
                job.post(output)
        return final

    def metrics(self) -> tuple[Metrics, int, int]:
        """A copy of the metrics, and the requests generating and waiting now; the speed
        window starts again."""
        with self._lock:
            decodes, slots = self._decodes()
            copy = dataclasses.replace(self._metrics, window=list(self._metrics.window),
                                       n_decode=decodes, n_busy_slots=slots)
            self._metrics.window = [0, 0.0, 0, 0.0]
            running = sum(job.started for job in self._jobs)
            return copy, running, len(self._jobs) - running

    def drain(self, grace: float) -> None:
        """The server is stopping: waiting requests are refused now, and the running
        generation ends within `grace` seconds with what it has."""
        self._draining.set()
        with self._lock:
            running = [job for job in self._jobs if job.started]
            waiting = [job for job in self._jobs if not job.started]
            for job in running:
                job.end_within(grace)
            for job in waiting:
                job.post(Failed(Busy("the server is shutting down")))
                job.cancel()
        log.info("shutting down: %d waiting request%s refused; %s", len(waiting), "" if len(waiting) == 1 else "s",
                 ("the running one has" if len(running) == 1 else f"the {len(running)} running have")
                 + f" {grace:g} s to finish" if running else "none running")

    def close(self) -> None:
        """Stop every generation at its next step and wait for the threads to finish."""
        self._draining.set()
        with self._lock:
            for job in self._jobs:
                job.cancel()
        if self.parallel is not None:
            self.parallel.close()  # what runs stops at its next decode
        self._pool.shutdown(wait=True)
        with self._waking:
            if self.parallel is not None:
                self._models.attach(None)
                self._models.call(self.parallel.engine.close)
                self.parallel = self.engine = None
        self._models.close()

    def __enter__(self) -> "Worker":
        self._abort.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            self._abort.__exit__(None, None, None)


def _progress(job: Job) -> Callable[[Prefilling], None]:
    """What posts the prompt's progress to the job's client (return_progress)."""
    t0 = time.perf_counter()
    return lambda event: job.post(Progress(event.n_prompt, event.n_cached, event.n_done,
                                           1000 * (time.perf_counter() - t0)))


def _log(generation: Generation, final: Final, n_prompt: int) -> None:
    """The request's line in the log; `n_prompt`: its prompt's tokens."""
    s = final.stats
    kind = "chat" if generation.chat else "completion"
    if n_prompt and not s.n_prompt:  # no Prefilled: llama.cpp's abort callback stopped the prompt
        log.info("%s: stopped during its prompt of %d tokens, finish: %s", kind, n_prompt, final.reason)
        return
    log.info("%s: %d prompt tokens (%d cached), %d generated in %.2f s (%.1f t/s), "
             "%d of %d drafted tokens accepted, finish: %s",
             kind, s.n_prompt, s.n_cached, s.n_predict, s.t_decode, s.decode_tps, s.n_accept, s.n_drafted,
             final.reason)
