"""One short script for a lent GPU: do the CUDA quantization paths run, agree and pay off?

Never run yet (no device was lent while they were written). On a CUDA machine it builds the
Qwen2.5-0.5B-shaped random model (offline_throughput.py), then for bf16 and each of
`--quantization int8 | int4 | fp8` (the Triton weight-only kernel and torch._scaled_mm):
checks teacher-forced next-token agreement and KL against bf16 on 256 positions, and
prints batch-1 and 32-request decode tok/s. Exits 0 with a line per format; a format that
fails prints its error and the rest still run.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import gc
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import qwen05b_shape_dir  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return
    from dolmus import LLM, SamplingParams

    model = str(qwen05b_shape_dir())
    ids = torch.randint(100, 150000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = None
    print(torch.cuda.get_device_name(), torch.__version__)
    for quant in (None, "int8", "int4", "fp8"):
        try:
            llm = LLM(model=model, dtype="bfloat16", device="cuda", quantization=quant)
            logprobs = llm.engine.prompt_logprobs(ids).float().cpu()
            if reference is None:
                reference = logprobs
            agree = (logprobs.argmax(-1) == reference.argmax(-1)).float().mean().item()
            kl = (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
            rates = []
            for batch in (1, 32):
                params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
                outs = llm.generate([ids[:32]] * batch, params)
                rates.append(sum(1.0 / o.outputs[0].metrics.tpot for o in outs))
            print(
                f"{quant or 'bf16'}: argmax agreement {agree:.3f}, KL {kl:.4f}, "
                f"decode tok/s batch 1 {rates[0]:.1f}, 32 requests {rates[1]:.1f}",
                flush=True,
            )
            del llm
        except Exception:  # report and go on: one broken format must not hide the others
            print(f"{quant}: FAILED\n{traceback.format_exc()}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
