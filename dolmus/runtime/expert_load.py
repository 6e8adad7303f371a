"""Expert load: how many tokens each Mixture-of-Experts layer routed to each of its experts.

Each `FusedExperts` layer adds its step's routed-token counts, which it computes anyway to group
tokens by expert, to a cumulative tensor on its device (`tokens_routed`): one small add per
layer per step, no extra host sync. The runner reads them all (one stacked copy to the host)
after every REPORT_EVERY steps that ran the model, and on any empty plan after one that did
(the engine sends one as it goes idle), and hands them to the engine in the StepResult: at most
layers x experts integers every REPORT_EVERY steps, and exact whenever the engine is idle.

Routing is replicated over tensor-parallel ranks, expert parallelism included (every rank routes
every token, and counts every expert, its own or not), so every rank reports the same counts;
rank 0's, the ones the engine reads, are the whole truth. The counts include every pass of the
target model: prompt tokens, generated tokens, verified drafts and prompt-logprob scoring. They
count the tokens each layer ran: the last layer runs its MLP for the rows a step samples from
alone (runtime/models/llama.py), so there a prompt adds its last row, not its length.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dolmus.runtime.layers.fused_moe import FusedExperts

REPORT_EVERY = 16  # steps that ran the model between reports while busy

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertLoad:
    """The cumulative routed-token counts of one model's MoE layers, reported in a bounded way."""

    def __init__(self, model: nn.Module, num_layers: int) -> None:
        self.num_layers = num_layers
        self._layers: dict[int, FusedExperts] = {}
        for name, module in model.named_modules():
            if isinstance(module, FusedExperts):
                found = _LAYER.search(name)
                if found is None:
                    raise ValueError(f"expert layer {name!r} is in no numbered decoder layer")
                self._layers[int(found.group(1))] = module
        self._unreported = 0  # model passes since the last report

    @classmethod
    def of(cls, model: nn.Module, num_layers: int) -> ExpertLoad | None:
        """The model's expert load, or None for a model without MoE layers."""
        load = cls(model, num_layers)
        return load if load._layers else None

    def note_pass(self) -> None:
        """The model ran outside a step (prompt-logprob scoring): its counts wait for the next report."""
        self._unreported += 1

    def after_step(self, ran_model: bool) -> list[list[int]] | None:
        """The counts to report with this step's result, or None. `ran_model`: the step ran the
        model (a non-empty plan); an empty plan reports what is pending."""
        if ran_model:
            self._unreported += 1
            if self._unreported < REPORT_EVERY:
                return None
        elif not self._unreported:
            return None
        self._unreported = 0
        return self.counts()

    def counts(self) -> list[list[int]]:
        """Per decoder layer, the tokens routed to each of its experts since load (an empty row
        for a dense layer)."""
        order = sorted(self._layers)
        stacked = torch.stack([self._layers[i].tokens_routed for i in order]).tolist()
        rows: list[list[int]] = [[] for _ in range(self.num_layers)]
        for i, row in zip(order, stacked):
            rows[i] = row
        return rows
