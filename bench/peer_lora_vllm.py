"""vLLM's side of bench.lora (`--vllm`): the same requests on the base model alone and spread over the
same LoRA adapters, with `enable_lora`. Runs in the peer venv (`make peer`); imports only the standard
library, torch and vllm.

    .venv-peer/bin/python bench/peer_lora_vllm.py SPEC.json     # prints one JSON object

SPEC: {"model": dir, "adapters": {name: dir}, "work": [[prompt ids, max new tokens], ...], "rank": r,
"kv_tokens": n, "rounds": k}. Rounds alternate base / mixed after one untimed round each; output tok/s
are medians.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_fd = os.dup(1)
    os.dup2(2, 1)  # vLLM logs to stdout
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    names = sorted(spec["adapters"])
    llm = LLM(
        model=spec["model"], dtype="float32", max_model_len=512, enforce_eager=True, block_size=32,
        num_gpu_blocks_override=-(-spec["kv_tokens"] // 32), enable_lora=True, max_loras=len(names),
        max_lora_rank=spec["rank"], max_num_seqs=256,
    )  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in spec["work"]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in spec["work"]]
    loras = [LoRARequest(names[i % len(names)], 1 + i % len(names), spec["adapters"][names[i % len(names)]])
             for i in range(len(prompts))]  # fmt: skip

    def run(mixed: bool) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras if mixed else None, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    run(False)
    run(True)
    tok_s: dict[str, list[float]] = {"base": [], "mixed": []}
    for _ in range(spec["rounds"]):
        tok_s["base"].append(run(False))
        tok_s["mixed"].append(run(True))
    med = {k: round(statistics.median(v), 1) for k, v in tok_s.items()}
    result = {"tok_s": med, "mixed_vs_base": round(med["mixed"] / med["base"], 3)}
    os.write(out_fd, (json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()
