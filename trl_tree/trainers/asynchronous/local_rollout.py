"""TRL's async GRPO on one machine: a rollout worker that generates with transformers, no vLLM server.

TRL 1.16's async trainer gets its samples from a worker (``RolloutWorkerProtocol``) and pushes its
weights through a ``WeightTransferProtocol``; its own worker asks a vLLM server for every turn. Here
stock's rollout loop (``async_rollout_worker._AsyncRolloutLoop``) runs unchanged — reward functions,
group advantages, the tool loop, environments, forking of re-tokenised conversations, staleness
tags — in a background thread, and only its one call to the server (``_generate_one_turn``) is
replaced: a copy of the policy samples the turn with ``generate`` and returns the tokens with their
log-probabilities under the generating weights (temperature-scaled, as the trainer scores them, so
an up-to-date sample's importance ratio is exactly 1). The weight transfer copies the trainer's
tensors into that copy in-process, between turns (``pause`` waits for the turn being sampled).
"""

from __future__ import annotations

import asyncio
import copy
import multiprocessing
import queue
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import torch
from peft import PeftModel


class LocalGenerator:
    """A copy of the policy that samples one turn at a time (one thread; a lock the weight transfer
    holds while it copies)."""

    def __init__(self, model: torch.nn.Module, eos_token_ids: list[int], pad_token_id: int, max_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float | None = None,
                 repetition_penalty: float = 1.0, stepped: bool = False) -> None:
        model = copy.deepcopy(model)
        if isinstance(model, PeftModel):  # stock's sync sends the merged base weights
            model = model.merge_and_unload()
        self.model = model.eval().requires_grad_(False)
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.sampling = dict(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             min_p=min_p, repetition_penalty=repetition_penalty)
        self.temperature = temperature
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-tree-generate")
        #: ``stepped``: each turn waits for a permit (``allow``), so a caller decides when samples are made
        self.permits = threading.Semaphore(0) if stepped else None
        #: per sampled turn: ``(prompt ids, tokens, log-probs, weights loaded so far)`` (stepped only)
        self.turns: list[tuple[list[int], list[int], list[float], int]] = []
        self.loads = 0
        self.closed = False

    def close(self) -> None:
        """Let every waiting and later turn through (the loop is stopping: its in-flight turns finish)."""
        self.closed = True
        if self.permits is not None:
            self.permits.release(1 << 20)

    def allow(self, turns: int) -> None:
        """Stepped: let ``turns`` more turns be sampled."""
        for _ in range(turns):
            self.permits.release()

    @torch.no_grad()
    def sample(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        """One turn: the sampled tokens (up to and with the first EOS) and their log-probabilities."""
        if self.permits is not None:
            self.permits.acquire()
        with self.lock:
            device = next(self.model.parameters()).device
            ids = torch.tensor([prompt_ids], device=device)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id,
                                      output_logits=True, return_dict_in_generate=True, **self.sampling)
        new = out.sequences[0, ids.shape[1]:]
        logits = torch.stack(out.logits, dim=1)[0, : new.shape[0]].float() / self.temperature
        logps = torch.log_softmax(logits, dim=-1).gather(1, new[:, None])[:, 0]
        tokens = new.tolist()
        ends = [i for i, t in enumerate(tokens) if t in self.eos_token_ids]
        cut = ends[0] + 1 if ends else len(tokens)
        if self.permits is not None:
            self.turns.append((list(prompt_ids), tokens[:cut], logps[:cut].tolist(), self.loads))
        return tokens[:cut], logps[:cut].tolist()

    def load(self, named_tensors) -> None:
        """Copy ``(name, tensor)`` pairs (stock's names: the base checkpoint's) into the copy."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"the trainer sent weight {name!r}, which the local generator has not")
            params[name].data.copy_(tensor.to(params[name].device, params[name].dtype))
        self.loads += 1


class LocalWeightTransfer:
    """TRL's ``WeightTransferProtocol`` into a :class:`LocalGenerator` in this process."""

    def __init__(self, generator: LocalGenerator) -> None:
        self.generator = generator
        self.syncs = 0

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        self.generator.lock.acquire()  # waits for the turn being sampled

    def send_weights(self, iterator) -> None:
        self.generator.load(iterator)
        self.syncs += 1

    def resume(self) -> None:
        self.generator.lock.release()

    def destroy(self) -> None:
        self.generator.pool.shutdown(wait=False, cancel_futures=True)


def _stock_loop_class():
    """Stock's rollout loop with its server call replaced (imported late: TRL's experimental module)."""
    from trl.experimental.async_grpo import async_rollout_worker as stock

    if not hasattr(stock, "aiohttp"):  # its __init__ annotates the (unused here) HTTP session's type
        stock.aiohttp = types.SimpleNamespace(ClientSession=object)

    class LocalLoop(stock._AsyncRolloutLoop):
        def __init__(self, *, generator: LocalGenerator, **kwargs) -> None:
            self._generator = generator
            super().__init__(**kwargs)

        async def _run_loops(self, stop_event: asyncio.Event) -> None:
            await asyncio.gather(self._generate_loop(stop_event=stop_event), self._score_loop(stop_event=stop_event))

        async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._generator.pool, self._generator.sample, list(prompt_ids))

    return LocalLoop


class LocalRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` on this machine: stock's rollout loop in a background thread,
    sampling from a copy of ``model``. ``weight_transfer`` is the matching in-process transfer.

    Takes what stock's trainer hands its own worker: the prompt dataset, ``reward_funcs``, ``tools``,
    ``environment_factory``, the tokenizer and EOS ids, the sampling settings and
    ``num_generations``. ``stepped``: turns are sampled only as :meth:`allow` permits (tests that
    need staleness to happen at known steps)."""

    def __init__(self, model: torch.nn.Module, processing_class, dataset, reward_funcs, *, eos_token_ids: list[int],
                 num_generations: int = 8, max_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float | None = None, repetition_penalty: float = 1.0, tools=None,
                 environment_factory=None, max_inflight_tasks: int = 8, queue_maxsize: int = 0,
                 max_tool_calling_iterations: int | None = None, fork_threshold_tokens: int = 1024,
                 chat_template_kwargs: dict | None = None, log_completions: bool = False, stepped: bool = False) -> None:
        self.generator = LocalGenerator(model, eos_token_ids, processing_class.pad_token_id, max_tokens, temperature,
                                        top_p, top_k, min_p, repetition_penalty, stepped)
        self.weight_transfer = LocalWeightTransfer(self.generator)
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=4096)
        self._version = multiprocessing.Value("i", 0)
        self._heartbeat = multiprocessing.Value("d", time.time())
        self._failed = threading.Event()
        self._failure: queue.Queue = queue.Queue(maxsize=1)
        self._loop = _stock_loop_class()(
            generator=self.generator, model_name="local", dataset=dataset, reward_funcs=list(reward_funcs or []),
            processing_class=processing_class, eos_token_ids=list(eos_token_ids), rollout_buffer=self.rollout_buffer,
            model_version_value=self._version, heartbeat_value=self._heartbeat, failed_event=self._failed,
            exception_info_queue=self._failure, metrics_queue=self.metrics_queue, tools=tools,
            environment_factory=environment_factory, num_generations=num_generations,
            max_inflight_tasks=max_inflight_tasks, queue_maxsize=queue_maxsize, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
            chat_template_kwargs=chat_template_kwargs, max_tool_calling_iterations=max_tool_calling_iterations,
            log_completions=log_completions, fork_threshold_tokens=fork_threshold_tokens)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._heartbeat.value = time.time()
            self._thread = threading.Thread(target=self._loop.run, name="trl-tree-rollout", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._loop._loop.call_soon_threadsafe(self._loop._stop_event.set)
        self.generator.close()
        self._thread.join(timeout=60)
        self._thread = None

    def allow(self, turns: int) -> None:
        """Stepped: let ``turns`` more turns be sampled (with the weights loaded by then)."""
        self.generator.allow(turns)

    def update_model_version(self, model_version: int) -> None:
        self._version.value = int(model_version)

    @property
    def model_version(self) -> int:
        return int(self._version.value)

    def check_health(self, stale_after_s: float) -> None:
        if self._failed.is_set():
            try:
                name, message, trace = self._failure.get_nowait()
                cause = RuntimeError(f"{name}: {message}\n{trace}")
            except queue.Empty:
                cause = None
            raise RuntimeError("the local rollout worker failed; see the chained exception") from cause
        age = time.time() - self._heartbeat.value
        if age > stale_after_s:
            raise RuntimeError(f"the local rollout worker's heartbeat is {age:.0f}s old (> {stale_after_s:.0f}s)")
