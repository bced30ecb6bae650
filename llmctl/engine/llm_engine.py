"""The engine loop: admit requests, schedule a step, run the model, sample, finish requests.

Owns: `LLMEngine` (request validation, stop conditions, engine statistics, forking a request with
n > 1 once its prompt is computed and gathering its n completions, and when asked the logprobs of
sampled and prompt tokens, `logprobs.py`). Knows nothing of files: callers (run-batch, profile,
the Python API) feed it token ids and read `RequestOutput`s back.
Its log lines (the `llmctl.engine` logger) are engine_log.py's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.config import EngineConfig
from llmctl.engine.cuda_graphs import graphs_supported
from llmctl.engine.detokenizer import Detokenize, first_stop
from llmctl.engine.engine_log import EngineLog
from llmctl.engine.grammar import Grammars
from llmctl.engine.logprobs import add_prompt, add_sampled, to_dicts
from llmctl.engine.lora import LoraSlots, start_lora
from llmctl.engine.model_runner import ModelRunner
from llmctl.engine.params import CompletionOutput, RequestOutput, SamplingParams, derived_seed
from llmctl.engine.requests import check_prompt_ids
from llmctl.engine.sampler import Sampler
from llmctl.engine.scheduler import Scheduler
from llmctl.engine.sequence import Sequence
from llmctl.engine.spec_decode import verify
from llmctl.errors import RequestError, UsageError
from llmctl.models.config import ModelConfig


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    computed_tokens: int = 0  # tokens run through the model (prefill chunks, decodes, recomputes)
    output_tokens: int = 0
    finished: int = 0
    peak_used_blocks: int = 0
    model_seconds: float = 0.0  # time inside the model forward and sampling
    spec_proposed: int = 0  # draft tokens sent for verification
    spec_accepted: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None


@dataclass
class _Group:
    """The finished completions of a request with n > 1, until all n are done."""

    n: int
    done: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list | None = None
    first_token_time: float | None = None


class LLMEngine:
    """The engine over a loaded model. It loads nothing: whoever builds it passes the model and its
    config, the EOS ids, a detokenize callable (token ids -> text; stop strings and output text need
    it), for speculative decoding a proposer (spec_decode.NgramProposer/DraftModelProposer) and
    for structured outputs the tokenizer's `Grammars` (engine/grammar.py)."""

    def __init__(
        self,
        model,
        model_config: ModelConfig,
        engine_config: EngineConfig | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        detokenize: Detokenize | None = None,
        proposer=None,
        grammars: Grammars | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
    ):
        cfg = engine_config or EngineConfig()
        if cfg.batch_invariant and not model_config.native:
            raise UsageError(
                f"--batch-invariant needs llmctl's own model code, and {model_config.not_native}"
            )
        if cfg.batch_invariant and (model_config.gemma or model_config.attention_features):
            raise UsageError(
                f"--batch-invariant is not available for {model_config.model_type} (its "
                "sliding-window, soft-capped or GELU layers have no fixed-order kernels)"
            )
        weight = next(model.parameters())
        device = str(device or weight.device)
        self.model_config, self.engine_config = model_config, cfg
        self.lora = start_lora(model, cfg, device, dtype or weight.dtype)  # before the runner
        self.runner = ModelRunner(model, model_config, cfg, device, dtype or weight.dtype)
        self.runner.lora = self.lora
        if self.runner.num_blocks < 1:
            raise UsageError(
                f"--kv-cache-memory is smaller than one KV block ({self.runner.bytes_per_block} "
                f"bytes at block size {cfg.block_size})"
            )
        self.block_manager = BlockManager(
            self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.scheduler.lora_gate = self.lora and self.lora.gate
        self.sampler = Sampler(cfg.seed, cfg.kernels.native)
        model_len = model_config.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or model_len, model_len)
        self.capacity = min(self.max_model_len, self.runner.num_blocks * cfg.block_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize: Detokenize = detokenize or (lambda ids: "")
        self.stats = EngineStats()
        self._log = EngineLog(time.perf_counter())
        self.proposer, self.grammars = proposer, grammars
        self._groups: dict[str, _Group] = {}  # requests with n > 1 by id
        if cfg.cuda_graphs and not self.lora and graphs_supported(model, model_config, device):
            self.runner.enable_decode_graphs(cfg.max_num_seqs, self.capacity)

    def _loras(self) -> LoraSlots:
        if self.lora is None:
            raise UsageError("a LoRA adapter needs an engine started with enable_lora")
        return self.lora

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora=None
    ) -> None:
        """Queue a request (`lora`: an engine.lora.Adapter or a registered adapter's name, None
        for the base model); raises RequestError when it can never be served."""
        check_prompt_ids(prompt_token_ids, self.model_config.vocab_size)
        n = len(prompt_token_ids)
        if n >= self.capacity:
            where = "context length" if self.capacity == self.max_model_len else "KV cache capacity"
            raise RequestError(
                "prompt_too_long",
                f"the prompt has {n} tokens; at most {self.capacity - 1} fit ({where} "
                f"{self.capacity} tokens)",
            )
        seq = Sequence(
            request_id, prompt_token_ids, params, max_len=min(self.capacity, n + params.max_tokens)
        )
        if lora is not None:
            seq.lora = self._loras().resolve(lora)  # resident once admitted: scheduler.lora_gate
        if params.structured_outputs is not None:  # the constraint's errors are this request's
            if self.grammars is None:
                raise RequestError("unsupported_parameter", "structured outputs need a tokenizer")
            self.grammars.start(seq)
        self.stats.prompt_tokens += n
        if params.n > 1:
            self._groups[request_id] = _Group(params.n)
        self.scheduler.add(seq)

    def warm_up(self, prompt_tokens: int = 16) -> None:
        """One short greedy request through prefill, decode and sampling, then forgotten: the KV
        blocks back in their first order, nothing in the prefix cache, the statistics zeroed.
        For callers that time or report from their first request (run-batch's job clock): the
        process's one-time costs (oneDNN generating its kernels on first use) are paid here, as
        vLLM pays them in its start-up dummy run. Needs an idle engine."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up needs an engine with no requests")
        n = max(1, min(prompt_tokens, self.capacity - 3))
        ids = [i % self.model_config.vocab_size for i in range(n)]
        self.add_request(
            "warm-up", ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        )
        while self.has_unfinished_requests():
            self.step()
        self.block_manager.reset()
        self.stats = EngineStats()
        self._log = EngineLog(time.perf_counter())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.has_unfinished():
                raise RuntimeError(
                    "scheduler made no progress with requests pending"
                )  # a bug, not user error
            return []
        t0 = time.perf_counter()
        logits, sampling, prompt_hidden = self.runner.execute(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        for seq, first, hidden in prompt_hidden:
            add_prompt(self.runner.project, seq, first, hidden)
        if any(s.params.n > 1 and not s.index and not s.num_output_tokens for s in sampling):
            logits, sampling = self._fork(logits, sampling)
        lps = any(s.logprobs is not None for s in sampling)
        constrained = any(s.params.structured_outputs is not None for s in sampling)
        masked = self.grammars.mask(logits, sampling, lps) if constrained else logits
        new_tokens = self._sample(masked, sampling)
        if lps:  # of the model's distribution, as vLLM's default (raw) logprobs
            add_sampled(logits, sampling, new_tokens)
        self.stats.model_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.computed_tokens += batch.total_tokens
        self.stats.peak_used_blocks = max(
            self.stats.peak_used_blocks, self.block_manager.num_used_blocks
        )
        now = time.perf_counter()
        finished = []
        for seq, tokens in zip(sampling, new_tokens):
            if (
                seq.spec_token_ids
            ):  # K/V of rejected drafts stays in the cache but counts as not computed
                seq.num_computed_tokens -= len(seq.spec_token_ids) - (len(tokens) - 1)
                seq.spec_token_ids = []
            if seq.first_token_time is None:
                seq.first_token_time = now
            done = self._append(seq, tokens, now)
            if done is not None:
                finished.append(done)
        self.stats.finished += len(finished)
        if self.proposer:
            self._propose()
        self._log.step(self, batch, now - t0)
        return finished

    def _append(self, seq: Sequence, tokens: list[int], now: float) -> RequestOutput | None:
        """Append the new tokens up to a stop; the request's output once it is complete."""
        for token in tokens:
            seq.token_ids.append(token)
            self.stats.output_tokens += 1
            reason = self._stop_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                if self.proposer:
                    self.proposer.release(seq.key)
                return self._finished(seq, now)
        return None

    def _fork(self, logits: torch.Tensor, sampling: list[Sequence]):
        """Children for each request with n > 1 whose prompt this step finished: they share its
        K/V (scheduler.fork) and sample their first token from its logits row, each with its
        own seed. Returns the logits and sampling sequences with the children after each
        parent. Forks may run more than max_num_seqs sequences for a while."""
        rows, seqs = [], []
        for row, seq in enumerate(sampling):
            rows.append(row)
            seqs.append(seq)
            if seq.params.n == 1 or seq.index or seq.num_output_tokens:
                continue
            children = []
            for i in range(1, seq.params.n):
                p = seq.params
                params = dataclasses.replace(
                    p, n=1, seed=derived_seed(p.seed, i), prompt_logprobs=None
                )
                child = Sequence(seq.request_id, seq.token_ids, params, seq.max_len)
                child.index, child.arrival_time, child.lora = i, seq.arrival_time, seq.lora
                children.append(child)
            for src, dst in self.scheduler.fork(seq, children):
                self.runner.copy_block(src, dst)
            rows += [row] * len(children)
            seqs += children
        return logits[rows], seqs

    def _sample(self, logits, sampling: list[Sequence]) -> list[list[int]]:
        """New tokens per sampling sequence: one, or the verified drafts plus one."""
        if not any(s.spec_token_ids for s in sampling):
            return [[t] for t in self.sampler(logits, sampling)] if sampling else []
        out: list[list[int] | None] = []
        plain_rows, plain_seqs = [], []
        row = 0
        for seq in sampling:
            k = len(seq.spec_token_ids)
            if k:
                gen = self._generator(seq)
                tokens = verify(logits[row : row + k + 1], seq.spec_token_ids, seq.params, gen)
                self.stats.spec_proposed += k
                self.stats.spec_accepted += len(tokens) - 1
                out.append(tokens)
            else:
                plain_rows.append(row)
                plain_seqs.append(seq)
                out.append(None)
            row += k + 1
        if plain_seqs:
            it = iter(self.sampler(logits[plain_rows], plain_seqs))
            out = [o if o is not None else [next(it)] for o in out]
        return out  # type: ignore[return-value]

    def _generator(self, seq: Sequence):
        import torch

        if seq.params.seed is None:
            return self.sampler.generator
        if seq.generator is None:
            seq.generator = torch.Generator().manual_seed(seq.params.seed)
        return seq.generator

    def _propose(self) -> None:
        """Draft tokens for the next step, for running sequences that are decoding."""
        cfg = self.engine_config
        running = self.scheduler.running
        if cfg.speculative_max_batch is not None and len(running) > cfg.speculative_max_batch:
            return
        for seq in running:
            p = seq.params
            if (
                seq.num_computed_tokens != seq.num_tokens - 1
                or p.repetition_penalty != 1.0
                or p.presence_penalty
                or p.frequency_penalty
            ):
                continue
            k = min(
                cfg.num_speculative_tokens,
                p.max_tokens - seq.num_output_tokens - 1,
                seq.max_len - seq.num_tokens - 1,
            )
            if k > 0:
                seq.spec_token_ids = self.proposer.propose(seq.key, seq.token_ids, k)[:k]

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if p.structured_outputs is not None and self.grammars.advance(seq, token):
            return "stop"  # the grammar is complete (or refused the token: status says so)
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if p.stop:
            since = seq.text.update(self.detokenize, seq.output_token_ids)
            if first_stop(seq.text.text, p.stop, since) is not None:
                seq.stopped_on_text = True
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= seq.max_len:
            return "length"
        return None

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = self.detokenize(
            seq.output_token_ids
        )  # once per request; stops were found incrementally
        if seq.stopped_on_text:
            end = first_stop(text, seq.params.stop)
            text = text if end is None else text[:end]
        out = CompletionOutput(seq.index, text, seq.output_token_ids, seq.finish_reason or "length")
        if seq.params.structured_outputs is not None:
            out.structured_output, out.structured_output_error = self.grammars.status(seq, text)
        if seq.logprobs is not None:
            entries = seq.logprobs[: seq.num_output_tokens]  # drafts after a stop were scored
            out.logprobs = to_dicts(entries, self.detokenize)
            out.cumulative_logprob = sum(e.logprob for e in entries)
        return out

    def _finished(self, seq: Sequence, now: float) -> RequestOutput | None:
        """The request's output: at once for n = 1, when the last completion ends for n > 1."""
        done = self._completion(seq)
        prompt_lps = seq.prompt_logprobs
        first = seq.first_token_time
        group = self._groups.get(seq.request_id)
        if group is not None:
            group.done[seq.index] = done
            if seq.index == 0:
                group.prompt_logprobs = prompt_lps
            group.first_token_time = min(filter(None, (group.first_token_time, first)))
            if len(group.done) < group.n:
                return None
            del self._groups[seq.request_id]
            prompt_lps, first = group.prompt_logprobs, group.first_token_time
        outputs = [done] if group is None else [group.done[i] for i in range(group.n)]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            output_token_ids=outputs[0].token_ids,
            text=outputs[0].text,
            finish_reason=outputs[0].finish_reason,
            arrival_time=seq.arrival_time,
            first_token_time=first,
            finish_time=now,
            outputs=outputs,
            prompt_logprobs=None
            if prompt_lps is None
            else [None, *to_dicts(prompt_lps, self.detokenize)],
        )
