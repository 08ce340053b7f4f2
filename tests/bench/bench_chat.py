"""`kiln data prepare --format chat` against transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`
on the same conversations, in the same run.

Conversations: the English help text that ships with Python (pydoc topics), cut into paragraphs; each
conversation is a system prompt and two user/assistant turns (the user asks with a paragraph's first line, the
assistant answers with the paragraph), --copies times over, numbered so none is a duplicate. Tokenizer and
template: tests/chat_models.py (byte-level BPE of 320 tokens + Llama 3's special tokens, a Llama-3-style
template). Timed: kiln with the template's `{% generation %}` blocks, kiln with the same template without them
(assistant spans from incremental renderings: 2 extra renderings per assistant turn), and transformers'
tokenizer rendering and tokenizing the same conversations in batches of 1,000 with the generation template
(rendering, tokenizing and the mask; no reading, dedup or writing). Reported: conversations per second and the
throughput ratios kiln/transformers; both must give the same tokens and assistant-token count.

    python -m tests.bench.bench_chat [--copies 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.report import write_report


def conversations(copies: int) -> list[list[dict]]:
    from kiln.trainer.data.loader import pydoc_bytes

    paragraphs = [p.strip() for p in pydoc_bytes().decode().split("\n\n") if len(p.strip()) > 40]
    out = []
    for c in range(copies):
        for i in range(0, len(paragraphs) - 1, 2):
            a, b = paragraphs[i], paragraphs[i + 1]
            out.append([{"role": "system", "content": f"You explain Python ({c}.{i})."},
                        {"role": "user", "content": a.splitlines()[0]}, {"role": "assistant", "content": a},
                        {"role": "user", "content": b.splitlines()[0]}, {"role": "assistant", "content": b}])
    return out


def transformers_reference(folder: Path, convs: list[list[dict]], batch: int) -> tuple[int, int]:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    tokens = assistant = 0
    for i in range(0, len(convs), batch):
        out = tok.apply_chat_template(convs[i:i + batch], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        tokens += sum(len(ids) for ids in out["input_ids"])
        assistant += sum(sum(m) for m in out["assistant_masks"])
    return tokens, assistant


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/bench/chat.json")
    args = ap.parse_args(argv)
    from kiln.trainer.data.prepare import prepare
    from tests.chat_models import WITHOUT_GENERATION, save_chat_folder

    batch = 1000
    with tempfile.TemporaryDirectory(prefix="kiln-bench-chat-") as tmp:
        root = Path(tmp)
        folders = {"generation": save_chat_folder(root / "generation"),
                   "incremental": save_chat_folder(root / "incremental", WITHOUT_GENERATION)}
        convs = conversations(args.copies)
        (root / "src").mkdir()
        (root / "src" / "chat.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in convs))
        times: dict[str, list[float]] = {"transformers": [], "kiln_generation": [], "kiln_incremental": []}
        counts: dict[str, tuple[int, int]] = {}
        for r in range(args.repeats):
            t0 = time.perf_counter()
            counts["transformers"] = transformers_reference(folders["generation"], convs, batch)
            times["transformers"].append(time.perf_counter() - t0)
            for name, folder in folders.items():
                out = root / f"out-{name}-{r}"
                t0 = time.perf_counter()
                res = prepare([str(root / "src")], tokenizer_uri=f"file://{folder}", output=f"file://{out}",
                              format="chat", dedup="none", batch_docs=batch, log=lambda m: None)
                times[f"kiln_{name}"].append(time.perf_counter() - t0)
                manifest = json.loads((out / "manifest.json").read_text())
                counts[f"kiln_{name}"] = (res.tokens, manifest["assistant_tokens"])
    assert len(set(counts.values())) == 1, counts  # the same tokens and assistant tokens everywhere
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "chat", "host": platform.node(), "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
        "conversations": len(convs), "tokens": counts["transformers"][0], "assistant_tokens": counts["transformers"][1],
        "seconds_median": med, "seconds_all": times,
        "conversations_per_second": {k: len(convs) / v for k, v in med.items()},
        "throughput_kiln_generation_over_transformers": med["transformers"] / med["kiln_generation"],
        "throughput_kiln_incremental_over_transformers": med["transformers"] / med["kiln_incremental"],
    }
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
