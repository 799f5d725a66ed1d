"""Greedy references from the in-process Engine, computed in a separate process (so the test process
never holds a model). Reads {"engine": {...ServerArgs kwargs}, "requests": [{"text"|"messages"|"input_ids",
"sampling_params"}]} on stdin, writes [{"input_ids", "output_ids", "text"}] on stdout."""

import json
import sys

from treespec.engine import Engine
from treespec.tokenizer import chat_input_ids


def main() -> None:
    spec = json.load(sys.stdin)
    engine = Engine(**spec.get("engine", {}))
    # text as /generate encodes it (SGLang: the tokenizer's own special tokens); chats through the template
    ids = [r["input_ids"] if "input_ids" in r
           else chat_input_ids(engine.tokenizer, r["messages"]) if "messages" in r
           else engine.tokenizer.encode(r["text"], add_special_tokens=True) for r in spec["requests"]]
    outs = engine.generate(input_ids=ids, sampling_params=[r["sampling_params"] for r in spec["requests"]])
    json.dump([{"input_ids": i, "output_ids": o["output_ids"], "text": o["text"]} for i, o in zip(ids, outs, strict=True)],
              sys.stdout)


if __name__ == "__main__":
    main()
