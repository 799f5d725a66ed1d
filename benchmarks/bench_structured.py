"""Structured output: a JSON-schema extraction workload, constrained plain decoding against constrained
decoding with speculation (the default EAGLE-3 schedule, NGRAM) and with jump-forward (plain decoding,
--enable-jump-forward), with unconstrained plain decoding as the reference for what the grammar costs.

    python benchmarks/bench_structured.py                       # all modes, 16 paragraphs, batch 1
    python benchmarks/bench_structured.py --modes plain,eagle3 --num-paragraphs 8 --json out.json

The text is not tuned on: the first prose paragraph (200-700 characters, no code, links or markup) of
the package description of each of a fixed list of packages installed with treespec (their PyPI
READMEs, read through importlib.metadata). Each paragraph becomes one chat request asking for a JSON
object under SCHEMA. Requests run one at a time (--batch-size to change) with greedy decoding.

Per mode: output tokens, seconds, output tokens/s, valid-output rate (json.loads and the schema's
fields, types, enum and bounds; strings and the array are bounded so that a valid output fits in max_new_tokens), accept length (tokens per verify step, speculative modes) and how
many outputs equal constrained plain decoding's token for token, and tokens appended by jump-forward.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import time

PACKAGES = ["click", "jinja2", "pyyaml", "sortedcontainers", "scipy", "hypothesis", "typer", "anyio",
            "matplotlib", "uvicorn", "starlette", "sympy", "rich", "urllib3", "fastapi", "pydantic", "numpy"]
SCHEMA = {
    "type": "object",
    "properties": {
        "subject": {"type": "string", "maxLength": 60},
        "category": {"enum": ["library", "tool", "framework", "service", "other"]},
        "mentions_python": {"type": "boolean"},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["subject", "category", "mentions_python", "keywords"],
}
INSTRUCTION = ("Read the paragraph and describe it as a JSON object with the fields subject (what it is "
               "about), category (library, tool, framework, service or other), mentions_python (true or "
               "false) and keywords (at most three).\n\nParagraph:\n")
MODES = {
    "plain": {"speculative_algorithm": "NONE"},
    "eagle3": {"speculative_algorithm": "EAGLE3"},  # the shipped head with its schedule
    "ngram": {"speculative_algorithm": "NGRAM"},
    "jump_forward": {"speculative_algorithm": "NONE", "enable_jump_forward": True},
    "unconstrained": {"speculative_algorithm": "NONE"},
}


def paragraphs(n: int) -> list[str]:
    out = []
    for name in PACKAGES:
        meta = importlib.metadata.metadata(name)
        text = meta.get_payload() or meta.get("Description") or ""
        for p in re.split(r"\n\s*\n", text):
            p = p.strip()
            if (200 <= len(p) <= 700 and not re.search(r"^(#|```|\||<|!|\[|    |>>>|\.\.|-|\*|=)", p, re.M)
                    and "http" not in p and "`" not in p):
                out.append(" ".join(p.split()))
                break
        if len(out) == n:
            break
    return out


def valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    props = SCHEMA["properties"]
    return (isinstance(obj, dict) and set(obj) == set(props) and isinstance(obj["subject"], str)
            and obj["category"] in props["category"]["enum"] and isinstance(obj["mentions_python"], bool)
            and isinstance(obj["keywords"], list) and len(obj["keywords"]) <= 3
            and len(obj["subject"]) <= 60 and all(isinstance(k, str) and len(k) <= 30 for k in obj["keywords"]))


def run_mode(mode: str, texts: list[str], args) -> dict:
    from treespec.engine import Engine
    from treespec.tokenizer import chat_input_ids

    engine = Engine(dtype=args.dtype, max_total_tokens=8192, **MODES[mode])
    ids = [chat_input_ids(engine.tokenizer, [{"role": "user", "content": INSTRUCTION + t}]) for t in texts]
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    if mode != "unconstrained":
        params["json_schema"] = json.dumps(SCHEMA)
    engine.generate(input_ids=ids[0], sampling_params={**params, "max_new_tokens": 8})  # warm-up (and compile)
    engine.scheduler.stats.update(spec_verify_ct=0, spec_emitted_tokens=0, jump_forward_tokens=0)
    outs = []
    start = time.perf_counter()
    for i in range(0, len(ids), args.batch_size):
        outs += engine.generate(input_ids=ids[i : i + args.batch_size],
                                sampling_params=[params] * len(ids[i : i + args.batch_size]))
    seconds = time.perf_counter() - start
    engine.check_pool_balance()
    stats = engine.get_stats()
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"mode": mode, "algorithm": engine.server_args.speculative_algorithm, "requests": len(outs),
            "jump_forward_tokens": stats["jump_forward_tokens"],
            "output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "valid_rate": sum(valid(o["text"]) for o in outs) / len(outs),
            "accept_length": stats["avg_spec_accept_length"] or None,
            "output_ids": [o["output_ids"] for o in outs], "texts": [o["text"] for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    ap.add_argument("--num-paragraphs", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=200)  # the schema's bounds keep outputs below it
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", help="write the rows (outputs included) here")
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"--modes: unknown {sorted(unknown)}; choose from {list(MODES)}")
    texts = paragraphs(args.num_paragraphs)
    rows = [run_mode(m, texts, args) for m in modes]
    plain = next((r for r in rows if r["mode"] == "plain"), None)
    print(f"{len(texts)} paragraphs from {len(texts)} package descriptions, batch size {args.batch_size}, greedy")
    print(f"{'mode':<14}{'tokens':>8}{'seconds':>9}{'tok/s':>8}{'valid':>8}{'accept':>8}{'= plain':>9}{'speedup':>9}{'jumped':>8}")
    for r in rows:
        same = (sum(a == b for a, b in zip(r["output_ids"], plain["output_ids"], strict=True))
                if plain and r["mode"] != "unconstrained" else None)
        r["equal_to_plain"] = same
        equal = "-" if same is None else f"{same}/{r['requests']}"
        r["speedup_vs_plain"] = r["output_tok_s"] / plain["output_tok_s"] if plain else None
        print(f"{r['mode']:<14}{r['output_tokens']:>8}{r['seconds']:>9.1f}{r['output_tok_s']:>8.1f}"
              f"{r['valid_rate']:>8.0%}{(r['accept_length'] or 0):>8.2f}"
              f"{equal:>9}"
              f"{(r['speedup_vs_plain'] or 0):>8.2f}x{r['jump_forward_tokens']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"paragraphs": texts, "schema": SCHEMA, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
