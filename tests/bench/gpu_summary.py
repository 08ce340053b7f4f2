"""The end of tests/bench/gpu_checks.sh: each part's status and time, and the figures its JSON holds, on one
screen; also written as JSON (gpu_checks.json beside the parts' files).

    python -m tests.bench.gpu_summary --parts STATUS_FILE --dest DIR

STATUS_FILE: one line per part, `name<TAB>status<TAB>seconds<TAB>file<TAB>note` (status: ok, failed (rc N),
timeout, skipped, or for vs_torchtitan "fallback ok": bench_trainer ran in its place). The figures are read
from the file the part wrote in DIR; a missing or unreadable file gives no figures, never an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.bench.report import provenance

def _f(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def kernel_cases(r: dict) -> list[str]:
    failed = r.get("failed", [])
    return [f"{r.get('cases')} cases, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else "")]


def kernels_bench(r: dict) -> list[str]:
    lines = [] if r.get("complete", True) else ["partial: stopped before every op was measured"]
    lines.append(f"copy bandwidth {_f(r.get('copy_bandwidth_gbps'), '.0f')} GB/s")
    for op, row in r.get("ops", {}).items():
        kiln = row.get("kiln", {})
        if "error" in kiln:
            lines.append(f"{op}: kiln failed: {kiln['error'][:100]}")
            continue
        vs = ", ".join(f"{name} {_f(v.get('kiln_speedup'), '.2f')}x" for name, v in row.items()
                       if isinstance(v, dict) and name != "kiln" and "kiln_speedup" in v)
        extra = (f"{_f(kiln.get('fwd_bwd_frac_copy_bw'), '.0%')} of copy bw" if "fwd_bwd_frac_copy_bw" in kiln
                 else f"{_f(kiln.get('tflops'), '.0f')} TFLOP/s, peak {_f(kiln.get('peak_gib'), '.2f')} GiB"
                 f" (eager {_f(row.get('eager', {}).get('peak_gib'), '.2f')})")
        lines.append(f"{op}: kiln {_f(kiln.get('fwd_bwd_ms'), '.3f')} ms fwd+bwd, {extra}; kiln speed-up over: {vs or '-'}")
    return lines


def vs_torchtitan(r: dict) -> list[str]:
    if r.get("bench") == "trainer":  # the fallback: kiln against a plain PyTorch loop
        k, ref = r["kiln"], r["reference"]
        return [f"(fallback bench_trainer, {r['preset']} {r['precision']}) kiln {_f(k['tokens_per_second'], '.0f')} tok/s "
                f"MFU {_f(k.get('mfu'), '.1%')}; plain loop {_f(ref['tokens_per_second'], '.0f')} tok/s "
                f"MFU {_f(ref.get('mfu'), '.1%')}; kiln/plain {_f(r['ratio_kiln_over_reference'], '.3f')}"]
    k, t = r["kiln"], r["torchtitan_llama3"]
    return [f"{r['preset']} {r['precision']} batch {r['batch']}x{r['seq_len']}, TorchTitan {r['torchtitan']}",
            f"kiln {_f(k['tokens_per_second'], '.0f')} tok/s MFU {_f(k.get('mfu'), '.1%')}; TorchTitan "
            f"{_f(t['tokens_per_second'], '.0f')} tok/s MFU {_f(t.get('mfu'), '.1%')}",
            f"kiln/TorchTitan: medians {_f(r['ratio_of_medians'], '.3f')}, pair ratios "
            f"{_f(r['median_of_pair_ratios'], '.3f')}, best steps {_f(r['ratio_of_best_steps'], '.3f')}"]


def moe(r: dict) -> list[str]:
    steps = r.get("steps_compared", {})
    rates = ", ".join(f"{name} {_f(v['tokens_per_s']['median'], '.0f')}" for name, v in steps.items()
                      if isinstance(v, dict))
    ratios = ", ".join(f"{name} {_f(v, '.3f')}" for name, v in steps.items() if not isinstance(v, dict))
    split = r.get("moe_layer_split", {}).get("forward_ms", {})
    return [f"{r.get('precision')}, batch {r.get('batch')}: tok/s {rates}", ratios,
            "MoE layer forward ms: " + ", ".join(f"{n} {_f(v, '.3f')}" for n, v in split.items())]


def packing(r: dict) -> list[str]:
    lines = [r.get("attention", "")]
    for name, m in r.get("models", {}).items():
        if "error" in m:
            lines.append(f"{name}: error {m['error'][:120]}")
        else:
            lines.append(f"{name}: {'ok' if m['ok'] else 'OVER BOUND'} (logits {_f(m['logits_max_abs_diff'])}, "
                         f"loss {_f(m['loss_rel_diff'])}, grads {_f(m['grad_max_rel_diff'])})")
    return lines


FIGURES = {"kernels_cases": kernel_cases, "kernels_bench": kernels_bench, "vs_torchtitan": vs_torchtitan,
           "moe": moe, "packing": packing}


def read_parts(text: str) -> list[dict]:
    parts = []
    for line in text.splitlines():
        if line.strip():
            name, status, seconds, file, note = (line.split("\t") + [""] * 4)[:5]
            parts.append({"part": name, "status": status, "seconds": int(seconds or 0), "file": file, "note": note})
    return parts


def summarize(parts: list[dict], dest: Path) -> dict:
    """Each part with its status, the file it wrote and its figures (lines of text)."""
    for p in parts:
        path = dest / p["file"]
        if p["file"] and path.is_file() and p["part"] in FIGURES:
            try:
                p["figures"] = FIGURES[p["part"]](json.loads(path.read_text()))
            except Exception as e:  # a partial or unexpected file: say so, keep the rest of the summary
                p["figures"] = [f"could not read {p['file']}: {type(e).__name__}: {e}"]
        elif p["file"]:
            p["figures"] = [f"{p['file']} was not written"]
    return {"parts": parts, "all_ok": all(p["status"] in ("ok", "skipped") for p in parts)}


def render(summary: dict) -> str:
    lines = ["== gpu_checks summary"]
    for p in summary["parts"]:
        lines.append(f"{p['part']:14s} {p['status']:16s} {p['seconds']:4d}s  {p['file']}  {p['note']}".rstrip())
        lines += [f"    {line}" for line in p.get("figures", []) if line]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", required=True)
    ap.add_argument("--dest", required=True)
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    summary = summarize(read_parts(Path(args.parts).read_text()), dest)
    (dest / "gpu_checks.json").write_text(json.dumps({**summary, "provenance": provenance()}, indent=2) + "\n")
    print(render(summary))
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
