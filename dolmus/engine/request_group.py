"""One user request as the engine holds it: its prompt, its n sequences with their
detokenizers, and what they make after each step: a cumulative RequestOutput (for callers in
the engine's process) or an OutputDelta of only what is new (the engine core's message)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dolmus.engine.detokenizer import IncrementalDetokenizer
from dolmus.engine.output_delta import CompletionDelta, OutputDelta
from dolmus.engine.request import Request
from dolmus.outputs import CompletionOutput, RequestMetrics, RequestOutput

CHILD_SEP = "#"  # sequence ids are f"{request_id}#{i}" when n > 1


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    one_at_a_time: bool = False  # its sampling needs the last token on the host (no async steps)
    # Tokens of each sequence already in a delta; None before the first. A group is read one
    # way, by output() or by delta(): both take the detokenizers' new text.
    _sent: list[int] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        for req in self.children:  # a loop, not all() over a generator: this runs per request per step
            if not req.status.finished:
                return False
        return True

    def output(self) -> RequestOutput:
        """Where its sequences stand: text so far (less any held-back tail), the new text since
        the last output, and each finished one's metrics. Copies every token id so far (an
        output queued for a slow reader must not grow): O(length), for callers in this process."""
        completions = []
        finished = True
        for i, (req, detok) in enumerate(zip(self.children, self.detoks)):
            status = req.status
            done = status.finished
            finished = finished and done
            delta = detok.take_delta(done)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=detok.text[: detok.emitted],  # held-back characters are not out yet
                    token_ids=list(req.output_token_ids),
                    finish_reason=status.value if done else None,
                    stop_reason=req.stop_reason,
                    logprobs=req.logprobs,
                    cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                    text_delta=delta,
                    metrics=request_metrics(req) if done else None,
                )
            )
        first = self.children[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            kv_transfer_params=first.kv_transfer_out,
            embedding=first.embedding,
        )

    def delta(self) -> OutputDelta:
        """Only what is new since this group's previous delta: the new token ids, text and
        logprobs of each sequence, and a finished one's finish reason and metrics (sent again
        in each delta while its siblings run: the server side keeps the latest). O(new tokens)
        however long the output has grown, so the step loop's cost per request stays flat."""
        first = self._sent is None
        sent = self._sent if self._sent is not None else [0] * len(self.children)
        completions = []
        finished = True
        for i, (req, detok) in enumerate(zip(self.children, self.detoks)):
            done = req.status.finished
            finished = finished and done
            start = sent[i]
            ids = req.output_token_ids
            logprobs = req.logprobs
            completions.append(
                CompletionDelta(
                    ids[start:],
                    detok.take_delta(done),
                    logprobs[start:] if logprobs is not None else None,
                    req.status.value if done else None,
                    req.stop_reason,
                    req.cumulative_logprob if logprobs is not None else None,
                    request_metrics(req) if done else None,
                )
            )
            sent[i] = len(ids)
        self._sent = sent
        lead = self.children[0]
        return OutputDelta(
            self.request_id,
            completions,
            finished,
            max(lead.num_cached_tokens, 0),
            first,
            self.prompt if first else None,
            self.prompt_ids if first else None,
            lead.kv_transfer_out,
            lead.embedding,
        )


def request_metrics(req: Request) -> RequestMetrics:
    t = req.timings
    return RequestMetrics(
        arrival_time=t.arrival,
        queue_time=t.queue_time,
        ttft=t.ttft,
        tpot=t.tpot,
        itl=t.inter_token_latencies,
        e2e_latency=t.e2e_latency,
        num_preemptions=req.num_preemptions,
        num_draft_tokens=req.num_draft_tokens,
        num_accepted_tokens=req.num_accepted_tokens,
    )
