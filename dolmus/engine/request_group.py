"""One user request as the engine holds it: its prompt, its n sequences with their
detokenizers, and the RequestOutput they make after each step."""

from __future__ import annotations

from dataclasses import dataclass

from dolmus.engine.detokenizer import IncrementalDetokenizer
from dolmus.engine.request import Request
from dolmus.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    one_at_a_time: bool = False  # its sampling needs the last token on the host (no async steps)

    def output(self) -> RequestOutput:
        """Where its sequences stand: text so far (less any held-back tail), the new text since
        the last output, and each finished one's metrics."""
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
